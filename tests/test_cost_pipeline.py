"""cost/pipeline.py: the chunked pipeline's schedule model and MoNTA Alg. 1-2's chunk choice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_compile.cost.hiermoe import phase_times_s, t_d_s, t_hier_nodedup_s
from moe_compile.cost.pipeline import (
    LayerTimes,
    Phase,
    choose_chunks,
    chunk_bound,
    fit_chunk_overhead,
    layer_s,
    schedule_s,
)
from moe_compile.cost.planner import uniform_routing
from moe_compile.cost.routing import hd_statistics
from moe_compile.cost.topology import EfficiencyCurve, Level, Topology
from moe_compile.cost.workload import Workload

times = st.floats(min_value=0.0, max_value=1.0)


@settings(max_examples=200, deadline=None)
@given(first=times, compute=times, last=times, n=st.integers(1, 8))
def test_schedule_between_its_bounds(first: float, compute: float, last: float, n: int) -> None:
    """Any schedule is no faster than its busiest resource (the worker moves n dispatch and n
    combine chunks, the caller computes n chunks) nor than one chunk passing all three stages, and
    no slower than running everything one after the other."""
    t = schedule_s(first, compute, last, n, 0.0)
    lower = max(n * (first + last), n * compute, first + compute + last)
    assert t >= lower * (1 - 1e-12) - 1e-15
    assert t <= n * (first + compute + last) * (1 + 1e-12) + 1e-15


def test_schedule_closed_forms() -> None:
    """Serial at n = 1; compute-bound: the first chunk's dispatch, all compute, the last combine;
    communication-bound: the worker never idles."""
    assert schedule_s(1.0, 2.0, 3.0, 1, 0.5) == 6.0  # no overhead without chunks
    assert schedule_s(0.1, 1.0, 0.1, 4, 0.0) == pytest.approx(0.1 + 4 * 1.0 + 0.1)
    assert schedule_s(1.0, 0.01, 1.0, 4, 0.0) == pytest.approx(4 * 2.0)  # compute hides behind the next chunk


def test_chunk_count_follows_latency_and_balance() -> None:
    """Chunks pay where compute and transfer are alike and latency small; not where latency
    dominates a chunk (MoNTA's I_minimal) or there is nothing to overlap."""
    balanced = LayerTimes((Phase(1e-4, 0.1),), (Phase(1e-4, 0.1),), 0.2)
    choice = choose_chunks(balanced, num_tokens=4096)
    assert choice.chunks > 1 and choice.serial_s / choice.pipelined_s > 1.3, choice
    assert choice.times_s[1] == pytest.approx(sum(layer_s(balanced, 1)))
    latency = LayerTimes((Phase(0.01, 0.005),), (Phase(0.01, 0.005),), 0.02)
    assert chunk_bound(latency, 4096) == 1 and choose_chunks(latency, 4096).chunks == 1
    loopback = LayerTimes((Phase(0.0, 0.2), Phase(1e-3, 1e-4)), (Phase(1e-3, 1e-4), Phase(0.0, 0.2)), 0.2)
    assert chunk_bound(loopback, 4096) > 1 and choose_chunks(loopback, 4096).chunks > 1  # a fast level's latency
    no_compute = LayerTimes((Phase(1e-3, 0.01),), (Phase(1e-3, 0.01),), 0.0)
    assert choose_chunks(no_compute, 4096).chunks == 1  # one worker: chunks only add latency
    assert choose_chunks(balanced, num_tokens=3).chunks <= 3  # a chunk holds a token
    marginal = LayerTimes((Phase(1e-4, 0.01),), (Phase(1e-4, 0.01),), 0.0005)
    choice = choose_chunks(marginal, 4096, overhead_s=2e-3)  # 2 ms: 2 chunks save 1-5 %
    best = min(choice.times_s.values())
    assert best < choice.serial_s and best > 0.95 * choice.serial_s and choice.chunks == 1, choice  # < 5 %: serial


@pytest.mark.parametrize("dedup", [True, False])
def test_phase_times_sum_to_the_hiermoe_model(dedup: bool) -> None:
    """The phases the pipeline divides add up to HierMoE Eq. 3's t_d (and to the no-dedup H-d)."""
    topo = Topology(levels=(Level("node", 2, 3e-5, 1 / 12.5e9), Level("gpu", 4, 5e-6, 1 / 150e9)))
    work = Workload(num_tokens=512, hidden_size=1024, ffn_size=2048, num_experts=16, top_k=4, dtype_bytes=2,
                    gated=True, slot_bytes=8)
    stats = hd_statistics(uniform_routing(work), work.num_experts, topo.sizes, copies=True)
    for d in (1, 2):
        phases = phase_times_s(d, topo, work, stats, dedup=dedup)
        assert len(phases) == d
        total = t_d_s(d, topo, work, stats) if dedup else t_hier_nodedup_s(d, topo, work, stats)
        assert sum(a + b for a, b in phases) == pytest.approx(total)
        assert phases[0][0] == 3e-5  # the first phase crosses the node level (HD1: the flat all-to-all)


def test_lanes_overlap_the_levels() -> None:
    """Two phases on two lanes (an inter-node and an intra-node group): chunk i+1's first phase runs
    beside chunk i's second, so n chunks take about n times the slower phase plus the faster once
    (MoNTA Alg. 1 lines 13-16), where one lane would take n times both."""
    inter, intra = 1.0, 0.5
    two = schedule_s([(0, inter), (1, intra)], 0.0, [], 4, 0.0)  # dispatches alone
    one = schedule_s([(0, inter), (0, intra)], 0.0, [], 4, 0.0)
    assert two == pytest.approx(4 * inter + intra)
    assert one == pytest.approx(4 * (inter + intra))


def test_tuning_candidates() -> None:
    """options pipeline "tune" times 1 .. min(MoNTA's bound, 4) and the model's n, never more
    chunks than tokens (passes.autotune)."""
    from moe_compile.cost.pipeline import PipelineChoice
    from moe_compile.passes.autotune import TUNE_MAX
    from moe_compile.passes.autotune import chunk_candidates as candidates

    wide = PipelineChoice(6, {n: 1.0 for n in range(1, 9)})
    assert candidates(wide, 4096) == [*range(1, TUNE_MAX + 1), 6]
    assert candidates(PipelineChoice(1, {1: 1.0, 2: 1.1}), 4096) == [1, 2]  # the bound
    assert candidates(wide, 3) == [1, 2, 3]  # a chunk holds a token
    assert candidates(PipelineChoice(1, {1: 1.0}), 4096) == [1]  # nothing to measure
    assert candidates(None, 4096) == list(range(1, TUNE_MAX + 1))  # no model: up to TUNE_MAX


def test_chunk_time_from_a_measured_efficiency_curve() -> None:
    """With its level's measured r(n) a chunk takes its share of the transfer at the efficiency
    measured at its buffer (MoNTA Eq. 8-9), the start-up floor below the smallest measured size;
    without one, alpha + transfer / n."""
    curve = EfficiencyCurve((1e6, 8e6), (0.2, 0.9))
    phase = Phase(1e-3, 0.16, 16e6, curve)
    assert phase.chunk_s(1) == pytest.approx(0.16 / 0.9)  # above the largest size: its r
    assert phase.chunk_s(4) == pytest.approx(0.04 / (0.2 + 0.7 * 3 / 7))  # 4 MB: interpolated
    assert phase.chunk_s(16) == pytest.approx(0.01 / 0.2)  # 1 MB: the smallest measured
    assert phase.chunk_s(32) == pytest.approx(phase.chunk_s(16))  # below it: no cheaper than there
    assert Phase(1e-3, 0.16).chunk_s(4) == pytest.approx(1e-3 + 0.04)


def test_small_message_efficiency_limits_the_chunks() -> None:
    """The same layer in chunks: where the level's bandwidth falls off for small messages (as a
    calibration measured it), fewer chunks pay than the alpha-beta fit alone predicts."""
    def layer(curve: EfficiencyCurve | None) -> LayerTimes:
        return LayerTimes((Phase(1e-4, 0.1, 8e6, curve),), (Phase(1e-4, 0.1, 8e6, curve),), 0.2)

    fitted = choose_chunks(layer(None), 4096)
    flat = choose_chunks(layer(EfficiencyCurve((1e5, 8e6), (1.0, 1.0))), 4096)
    falling = choose_chunks(layer(EfficiencyCurve((1e6, 4e6, 8e6), (0.3, 0.9, 1.0))), 4096)
    assert fitted.chunks >= 4 and flat.chunks == fitted.chunks, (fitted, flat)
    assert 1 < falling.chunks < fitted.chunks, falling
    assert falling.times_s[8] > fitted.times_s[8]  # 1 MB chunks reach 30 % of the bandwidth


def test_phase_terms_carry_the_phase_transfer() -> None:
    """Each phase's buffer is on the level whose link carries it, and its bytes times that link's
    beta (HierMoE's, per buffer byte) are the phase's transfer time; the plan pass times the
    chunks with the levels' curves where the topology has them, and says so."""
    from moe_compile.cost.hiermoe import phase_terms
    from moe_compile.passes.plan import _search_chunks

    levels = (Level("node", 2, 3e-5, 1 / 12.5e9), Level("gpu", 4, 5e-6, 1 / 150e9))
    work = Workload(num_tokens=512, hidden_size=1024, ffn_size=2048, num_experts=16, top_k=4, dtype_bytes=2,
                    gated=True, slot_bytes=8)
    topo = Topology(levels=levels)
    stats = hd_statistics(uniform_routing(work), work.num_experts, topo.sizes, copies=True)
    terms = phase_terms(2, topo, work, stats)
    assert [level for level, *_ in terms] == [0, 1]
    assert [(a, t) for _, a, t, _ in terms] == phase_times_s(2, topo, work, stats)
    for level, _, transfer, n in terms:
        size = topo.sizes[level]
        assert n * levels[level].beta_s_per_byte * (size - 1) / size == pytest.approx(transfer)
    assert _search_chunks(topo, work, 2, True).efficiency == ()
    curves = {"all_to_all_node": EfficiencyCurve((1e4, 1e6), (0.1, 0.8)),
              "all_to_all_gpu": EfficiencyCurve((1e4, 1e6), (0.2, 0.9))}
    measured = _search_chunks(Topology(levels=levels, efficiency=curves), work, 2, True)
    assert measured.efficiency == ("node", "gpu")
    assert measured.times_s[1] != _search_chunks(topo, work, 2, True).times_s[1]


def test_weight_gradient_sums_charge_each_extra_chunk() -> None:
    """Each chunk beyond the first gives the expert weights another full-size gradient that
    autograd sums in the backward: n - 1 sums, none at n = 1, and enough of them outweigh what
    the overlap saves."""
    plain = LayerTimes((Phase(1e-4, 0.1),), (Phase(1e-4, 0.1),), 0.2)
    summed = LayerTimes((Phase(1e-4, 0.1),), (Phase(1e-4, 0.1),), 0.2, grad_sum_s=0.01)
    assert layer_s(summed, 1) == layer_s(plain, 1)
    for n in (2, 4):
        assert layer_s(summed, n)[0] == layer_s(plain, n)[0]
        assert layer_s(summed, n)[1] == pytest.approx(layer_s(plain, n)[1] + (n - 1) * 0.01)
    costly = LayerTimes((Phase(1e-4, 0.1),), (Phase(1e-4, 0.1),), 0.2, grad_sum_s=0.2)
    assert choose_chunks(plain, 4096).chunks > 1 and choose_chunks(costly, 4096).chunks == 1


@pytest.mark.parametrize("true_s", [0.0, 0.0023, 0.0061, 0.02])
def test_chunk_overhead_fit_recovers_the_overhead_that_made_the_times(true_s: float) -> None:
    """Times made by the model with a known overhead: on a compute-bound layer the fit gives that
    overhead back, to its 0.1 ms grid; on a communication-bound one, where a small overhead hides
    behind the transfers (the caller waits for them anyway), it gives one that reproduces the
    times, which is all the times can tell."""
    compute_bound = LayerTimes((Phase(1e-4, 0.01),), (Phase(1e-4, 0.01),), 0.12)
    measured = {n: sum(layer_s(compute_bound, n, true_s)) for n in (1, 2, 4)}
    assert fit_chunk_overhead(compute_bound, measured) == pytest.approx(true_s, abs=5e-5)
    times = LayerTimes((Phase(1e-3, 0.08),), (Phase(1e-3, 0.08),), 0.03, grad_sum_s=0.002)
    measured = {n: sum(layer_s(times, n, true_s)) for n in (1, 2, 4)}
    fitted = fit_chunk_overhead(times, measured)
    for n, t in measured.items():
        assert sum(layer_s(times, n, fitted)) == pytest.approx(t, abs=1e-3 * n)
    with pytest.raises(ValueError, match="n = 1 and some n > 1"):
        fit_chunk_overhead(times, {2: 0.1, 4: 0.2})


def test_a_calibrated_chunk_overhead_decides_the_chunk_count_and_explain_says_so() -> None:
    """The planner's chunk search uses the topology's measured chunk_overhead_s in place of the
    default: a layer that pays in chunks at the default runs whole with an overhead as large as
    this VM measured, and the plan says the overhead was calibrated."""
    import dataclasses

    from moe_compile.passes.plan import _search_chunks

    topo = Topology((Level("node", 2, 0.0, 4e-8), Level("gpu", 2, 1e-5, 1e-10)), flops_per_s=(2e10,))
    work = Workload(512, 256, 256, 8, 4, 4, True, 8)
    default = _search_chunks(topo, work, 2, True)
    assert default.chunks > 1 and not default.calibrated
    measured = _search_chunks(dataclasses.replace(topo, chunk_overhead_s=0.03), work, 2, True)
    assert measured.chunks == 1 and measured.calibrated and measured.overhead_s == 0.03
