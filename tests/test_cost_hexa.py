"""HEXA-MoE cost model: the Eq. 1-2 split, Table 3 proportions, the data- vs model-centric flip."""

import random
from fractions import Fraction

import pytest
import sympy as sp

from moe_compile.cost import hexa as x
from moe_compile.cost.topology import Level, Topology
from moe_compile.cost.workload import Workload


def test_split_sums_exactly_and_is_proportional_within_one_unit():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 9)
        times = [rng.uniform(0.1, 10.0) for _ in range(n)]
        unit = rng.choice([1, 1, 16, 64])
        total = unit * rng.randint(0, 500)
        split = x.heterogeneous_split(total, times, multiple_of=unit)
        assert sum(split) == total and all(s % unit == 0 for s in split)
        inv = [1 / Fraction(t) for t in times]
        for s, w in zip(split, inv):
            assert abs(Fraction(s) - total * w / sum(inv)) < unit
        # faster devices never get less
        for i in range(n):
            for j in range(n):
                if times[i] < times[j]:
                    assert split[i] >= split[j]


def test_split_speeds_equal_times_and_uniform_for_equal_devices():
    assert x.heterogeneous_split(100, [2.0, 1.0, 4.0]) == x.heterogeneous_split(100, [0.5, 1.0, 0.25], speeds=True)
    assert x.heterogeneous_split(40, [3.0, 3.0, 3.0, 3.0]) == [10, 10, 10, 10]
    assert x.heterogeneous_split(10, [1.0, 1.0, 1.0]) == [4, 3, 3]  # tie -> lower index
    with pytest.raises(ValueError, match="positive"):
        x.heterogeneous_split(10, [1.0, 0.0])
    with pytest.raises(ValueError, match="multiple"):
        x.heterogeneous_split(10, [1.0], multiple_of=4)


def test_table3_capacity_proportions():
    for times, r in [((4.58, 3.06), (0.40, 0.60)), ((3.20, 3.18), (0.50, 0.50)), ((3.28, 9.42), (0.74, 0.26))]:
        assert [round(v, 2) for v in x.capacity_proportions(times)] == list(r)
    assert x.heterogeneous_split(40, [3.28, 9.42]) == [30, 10]  # B_i of Eq. 1 for Case 3


def test_symbolic_forms():
    m = x.hexa_model()
    assert sp.simplify(m.crossover_tokens.subs(x.alpha_s, 0) - x.E * x.F * x.m_mats / (3 * x.N)) == 0
    # at the crossover (no overlap) the gathered batch N*T*H*b is a third of the layer weights W
    batch_bytes = x.N * m.crossover_tokens.subs(x.alpha_s, 0) * x.H * x.dtype_bytes
    assert sp.simplify(3 * batch_bytes - m.weight_bytes) == 0
    dc_minus_mc = sp.simplify(m.memory_bytes["data_centric"] - m.memory_bytes["model_centric"])
    assert sp.simplify(dc_minus_mc - (m.weight_bytes - 2 * (x.N - 1) * x.T_tokens * x.H * x.dtype_bytes)) == 0


def _homogeneous(n, gbps=256.0, alpha_s=1e-5, flops=1.65e14):
    return Topology((Level("gpu", n, alpha_s, 8 / (gbps * 1e9)),), flops_per_s=(flops,))


def _swin_base(tokens, experts=4):
    # Swin-MoE-Base stage 3: C = 512, mlp ratio 4, GELU MLP experts, AMP (fp16), top-2
    return Workload(num_tokens=tokens, hidden_size=512, ffn_size=2048, num_experts=experts, top_k=2,
                    dtype_bytes=2, gated=False)


def test_topology_evaluators_match_flat_expressions():
    m = x.hexa_model()
    topo, w = _homogeneous(4), _swin_base(3000)
    vals = {x.N: 4, x.T_tokens: 3000, x.H: 512, x.F: 2048, x.E: 4, x.K: 2, x.m_mats: 2, x.dtype_bytes: 2,
            x.flops_per_s: 1.65e14, x.alpha_s: 1e-5, x.beta_s_per_byte: 8 / 256e9, x.pre_moe_s: 2e-4}
    for training in (False, True):
        suffix = "train" if training else "forward"
        dc = x.data_centric_time_s(topo, w, pre_moe_s=2e-4, training=training)
        mc = x.model_centric_time_s(topo, w, pre_moe_s=2e-4, training=training)
        assert dc == pytest.approx(float(m.flat[f"data_centric_{suffix}"].subs(vals)), rel=1e-12)
        assert mc == pytest.approx(float(m.flat[f"model_centric_{suffix}"].subs(vals)), rel=1e-12)


def test_choice_flips_at_the_derived_crossover():
    """Section 4.3 / Fig. 10: model-centric for small workloads, data-centric for large ones."""
    topo = _homogeneous(4)
    t_star = float(x.hexa_model().crossover_tokens.subs(
        {x.E: 4, x.F: 2048, x.m_mats: 2, x.N: 4, x.H: 512, x.dtype_bytes: 2, x.alpha_s: 1e-5,
         x.beta_s_per_byte: 8 / 256e9}))
    assert 196 < t_star < 40 * 196  # between one image and a batch of 40 (14 x 14 tokens each)
    assert x.choose_execution(topo, _swin_base(int(t_star * 0.9))).mode == "model_centric"
    assert x.choose_execution(topo, _swin_base(int(t_star * 1.1) + 1)).mode == "data_centric"
    assert x.choose_execution(topo, _swin_base(196)).mode == "model_centric"
    assert x.choose_execution(topo, _swin_base(40 * 196)).mode == "data_centric"
    # overlapping the weight gather with attention moves the flip to smaller batches
    plan = x.choose_execution(topo, _swin_base(int(t_star * 0.9)), pre_moe_s=1e-3)
    assert plan.mode == "data_centric"


def test_heterogeneous_split_lowers_data_and_model_centric_time():
    # Table 3 Case 3: t = 3.28 s and 9.42 s on the proxy task -> FLOP rates proportional to 1/t
    topo = Topology((Level("gpu", 2, 1e-5, 8 / 64e9),), flops_per_s=(1e14 / 3.28, 1e14 / 9.42))
    w = _swin_base(40 * 196)
    plan = x.choose_execution(topo, w)
    assert plan.token_split == x.heterogeneous_split(2 * 40 * 196, [3.28, 9.42])
    assert plan.hidden_split == x.heterogeneous_split(2048, [3.28, 9.42])
    uniform_dc = x.data_centric_time_s(topo, w, token_split=[40 * 196, 40 * 196])
    uniform_mc = x.model_centric_time_s(topo, w, hidden_split=[1024, 1024])
    assert plan.data_centric_s < uniform_dc and plan.model_centric_s < uniform_mc


def test_memory_model_centric_slightly_below_data_centric_fig8():
    # Fig. 8: 2 GPUs, 8 experts, batch 40 -> model-centric a little below data-centric
    w = _swin_base(40 * 196, experts=8)
    dc, mc = x.memory_bytes(w, 2, "data_centric"), x.memory_bytes(w, 2, "model_centric")
    assert mc < dc < 1.5 * mc
    # without the pipeline-shared cache every gathered layer stays (Janus), much more memory
    # 12 layers on 2 devices: 12 gathered layers instead of 6 layers of shards + 1 cached layer
    janus = x.memory_bytes(w, 2, "data_centric", layers=12, shared_cache=False)
    cached = x.memory_bytes(w, 2, "data_centric", layers=12)
    assert janus - cached == pytest.approx(5 * 8 * w.expert_bytes)
