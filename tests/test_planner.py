"""The planner: every candidate evaluated, argmin over what is implemented, routing-aware."""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
import torch

import moe_compile
from moe_compile.cost import Level, Topology, Workload, plan
from moe_compile.cost.planner import (
    compute_s,
    gather_time_s,
    load_imbalance,
    routing_from_load,
    uniform_routing,
)
from moe_compile.cost.routing import hd_statistics
from moe_compile.cost.workload import SLOT_BYTES
from moe_compile.lowering.strategies import executable
from moe_compile.samples import TinyLMConfig, TinyMoELM
from moe_compile.tools import plan as moe_plan

TESTBED = files("moe_compile.cost") / "topologies" / "hiermoe_testbed.toml"


def two_level(inter_gbps: float = 40.0, intra_gbps: float = 2400.0) -> Topology:
    return Topology(levels=(Level("node", 4, 5e-6, 8 / (inter_gbps * 1e9)), Level("gpu", 8, 1e-6, 8 / (intra_gbps * 1e9))),
                    flops_per_s=(3e14,))


WORK = Workload(num_tokens=4096, hidden_size=2048, ffn_size=1024, num_experts=64, top_k=8, dtype_bytes=2)
ALL = ("local", "flat_a2a", "hier_a2a", "hd1", "hd2", "monta_O1", "monta_O2", "monta_O3", "hybridep",
       "hexa_data_centric", "hexa_model_centric", "gather0", "gather1", "model0", "replicated")


def test_single_process_plan_is_local() -> None:
    p = plan(None, WORK)
    assert p.strategy == "local" and set(p.predicted) == {"local"}
    assert p.predicted["local"] == pytest.approx(4096 * 8 * 2 * 3 * 2048 * 1024 / 1e12)


def test_mesh_of_one_rank_plans_replicated() -> None:
    """A mesh of one rank holds every expert: under a mesh's executable strategies the plan is
    replicated (nothing sent) at the local compute time, where before no strategy applied."""
    one = Topology(levels=(Level("gpu", 1, 1e-6, 8 / 1e12),), flops_per_s=(3e14,))
    p = plan(one, WORK, implemented=tuple(executable(1, None, None, replicated=True)))
    assert p.strategy == "replicated" and p.predicted["replicated"] == pytest.approx(compute_s(one, WORK))


def test_every_candidate_is_predicted_and_argmin_is_over_implemented() -> None:
    topo = two_level()
    p = plan(topo, WORK)
    assert set(p.predicted) == set(ALL)
    assert all(t > 0 for t in p.predicted.values())
    assert p.strategy == "local"  # the only implemented strategy today
    everything = plan(topo, WORK, implemented=ALL)
    assert everything.strategy == min(everything.predicted, key=everything.predicted.__getitem__)
    some = plan(topo, WORK, implemented=("flat_a2a", "hd1", "hd2"))
    assert some.strategy == min(("flat_a2a", "hd1", "hd2"), key=some.predicted.__getitem__)
    assert some.params == ({"dimension": int(some.strategy[2])} if some.strategy.startswith("hd") else {})


def test_replicated_experts_send_nothing_and_read_every_expert() -> None:
    """Candidate ``replicated`` (every rank holds every expert and runs its own tokens): the
    compute of T*K pairs plus one read of the E - E/S experts' weights an expert-parallel rank
    does not hold; no communication term. It wins over every executable candidate where tokens
    are many, and loses to the token all-to-alls where few tokens meet large experts (reading
    every expert costs more than sending the tokens)."""
    topo = two_level()
    p = plan(topo, WORK, implemented=("hd1", "hd2", "flat_a2a", "gather0", "gather1", "model0", "replicated"))
    weights = (64 - 64 / 32) * (3 * 2048 * 1024 * 2) / topo.device_mem_bw(0)
    assert p.predicted["replicated"] == pytest.approx(compute_s(topo, WORK) + weights, rel=1e-12)
    assert p.strategy == "replicated"
    # the note: the experts' gradient all-reduce (twice gather0's all-gather) and what sharding runs
    allreduce = 2 * gather_time_s(topo, WORK, None, 0)
    moving = {k: p.predicted[k] for k in ("hd1", "hd2", "flat_a2a", "gather0", "gather1")}
    alt = min(moving, key=moving.__getitem__)
    assert allreduce > 0 and f"about {allreduce * 1e3:.3g} ms" in p.notes[-1], p.notes
    assert f"keep 2 per rank and avoid it, running {alt} ({moving[alt] * 1e3:.3g} ms" in p.notes[-1], p.notes
    few = Workload(num_tokens=16, hidden_size=8192, ffn_size=8192, num_experts=64, top_k=2, dtype_bytes=2)
    q = plan(topo, few, implemented=("hd1", "hd2", "replicated"))
    assert q.strategy in ("hd1", "hd2") and q.predicted["replicated"] > q.predicted[q.strategy]
    # experts that do not split over the ranks: no expert-parallel candidate, replicated still runs
    odd = plan(topo, Workload(num_tokens=64, hidden_size=64, ffn_size=64, num_experts=6, top_k=2, dtype_bytes=4),
               implemented=("hd1", "replicated"))
    assert odd.strategy == "replicated" and "hd1" not in odd.predicted


def test_a_measured_expert_op_charges_model_centric_its_rows() -> None:
    """With the expert op measured (Topology.expert_flops_per_s / expert_row_bytes_per_s), every
    candidate's expert compute is its FLOPs at the op's matmul rate plus its rows' bytes at the
    op's row rate: T*K rows of H for the token all-to-alls and replicated, S*T*K rows (on F/S
    columns, the same FLOPs) for model0. On FLOPs alone model0 ties HD-2 at the placement
    bench's K = 8 layer (4 ranks, 100 Mbit); with the rows it loses, as measured there (1377
    against about 600 ms a step, bench/results/placement_cluster.md's note)."""
    topo = Topology(levels=(Level("node", 2, 0.0, 178e-9), Level("gpu", 2, 1480e-6, 2.32e-9)),
                    flops_per_s=(58e9,), mem_bw_bytes_per_s=(40e9,))
    measured = dataclasses.replace(topo, expert_flops_per_s=1.2e11, expert_row_bytes_per_s=1.6e9)
    work = Workload(num_tokens=256, hidden_size=256, ffn_size=64, num_experts=16, top_k=8, dtype_bytes=4,
                    slot_bytes=SLOT_BYTES)
    both = ("hd2", "model0", "replicated")
    flops_only, rows = plan(topo, work, implemented=both), plan(measured, work, implemented=both)
    pairs = 256 * 8
    flops = pairs * 3 * 2 * 256 * 64
    assert flops_only.predicted["model0"] == pytest.approx(flops_only.predicted["hd2"], rel=0.01)
    for name, row_share in (("hd2", 1), ("model0", 4), ("replicated", 1)):
        extra = rows.predicted[name] - flops_only.predicted[name]
        assert extra == pytest.approx(flops / 1.2e11 + row_share * pairs * 256 * 4 / 1.6e9 - flops / 58e9,
                                      rel=1e-9), name
    assert rows.predicted["model0"] > rows.predicted["hd2"]
    picked = plan(measured, work, implemented=("hd2", "model0"))
    assert picked.strategy == "hd2"


def test_replicated_runs_only_where_the_options_let_every_expert_stay() -> None:
    """``strategies.executable``: the replicated candidate is runnable where the plan pass says
    every rank holds every expert (``replicated``), not with a fixed dimension (a token
    all-to-all), a forced gather level or model-centric "always"; it never chunks."""
    assert executable(2, None, None, replicated=False).keys().isdisjoint({"replicated"})
    runnable = executable(2, None, None, replicated=True)
    assert "replicated" in runnable and {"hd1", "hd2", "gather0", "gather1", "model0"} <= runnable.keys()
    strategy, settings = runnable["replicated"]
    assert strategy.name == "replicated" and settings.replicated and not settings.chunkable
    assert "replicated" in executable(2, None, True, replicated=True)  # dedup forced: like the gathers, free
    assert "replicated" not in executable(2, 2, None, replicated=True)
    assert "replicated" not in executable(2, None, None, gather=0, replicated=True)
    assert set(executable(2, None, None, model_centric="always", replicated=True)) == {"model0"}


def test_expert_loads_charge_the_busiest_block() -> None:
    """With the expert loads of every rank's batch, each candidate pays the compute of the block
    that computes the most (token, expert) pairs: single ranks under the token all-to-alls, the
    level-j blocks under gather{j}, nothing extra under gather0 and model0 (balanced whatever the
    routing; HEXA-MoE Section 4.3). Same routing indices, so only the compute term moves."""
    topo = two_level()
    ranks = topo.world_size  # 32: 2 experts per rank, 16 per node
    load = np.zeros(64)
    load[:2] = 100.0  # every pair on rank 0's experts
    assert load_imbalance(load, topo.sizes, 2) == pytest.approx(ranks)
    assert load_imbalance(load, topo.sizes, 1) == pytest.approx(4.0)  # node 0 of 4
    assert load_imbalance(load, topo.sizes, 0) == 1.0
    assert load_imbalance(np.ones(64), topo.sizes, 2) == pytest.approx(1.0)
    assert load_imbalance(np.zeros(64), topo.sizes, 2) == 1.0
    half = np.r_[np.full(32, 3.0), np.full(32, 1.0)]  # the first two nodes 3x as busy as the others
    assert load_imbalance(half, topo.sizes, 1) == pytest.approx(1.5)
    idx = uniform_routing(WORK)
    even, skewed = plan(topo, WORK, idx), plan(topo, WORK, idx, expert_load=load)
    c = compute_s(topo, WORK)
    for name in ("hd1", "hd2", "flat_a2a", "hier_a2a", "monta_O1"):
        assert skewed.predicted[name] - even.predicted[name] == pytest.approx((ranks - 1) * c, rel=1e-9), name
    assert skewed.predicted["gather1"] - even.predicted["gather1"] == pytest.approx(3 * c, rel=1e-9)
    for name in ("gather0", "model0", "replicated"):
        assert skewed.predicted[name] == pytest.approx(even.predicted[name], rel=1e-12), name
    assert not even.notes and "32.00x under the token all-to-alls, 4.00x under gather1" in skewed.notes[0]
    with pytest.raises(ValueError, match="do not split"):
        load_imbalance(np.ones(6), topo.sizes, 2)


def test_routing_drawn_from_expert_loads() -> None:
    """Routing drawn in proportion to the loads (what tune_strategy measures on): K distinct
    experts per token, the same for the same seed."""
    load = np.array([8.0, 4.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    idx = routing_from_load(20000, 1, load)
    freq = np.bincount(idx.reshape(-1), minlength=8) / idx.size
    assert np.allclose(freq, load / load.sum(), atol=0.01)
    two = routing_from_load(1000, 2, load)
    assert two.shape == (1000, 2) and (two[:, 0] != two[:, 1]).all()  # distinct, even beyond the loaded experts
    assert (routing_from_load(20000, 1, load) == idx).all()
    assert not (routing_from_load(20000, 1, load, seed=1) == idx).all()
    with pytest.raises(ValueError, match="top_k=9 needs 1..8"):
        routing_from_load(10, 9, load)


def test_node_local_routing_makes_hierarchical_dedup_win() -> None:
    """Each token's 8 experts on one node: HD2 sends it across the slow link once, the flat A2A
    eight times (HierMoE Section III), so HD2 must be predicted faster and d* = 2."""
    rng = np.random.default_rng(0)
    node = rng.integers(0, 4, size=4096)
    local = np.stack([rng.choice(16, size=8, replace=False) for _ in range(4096)]) + 16 * node[:, None]
    p = plan(two_level(), WORK, local, implemented=("flat_a2a", "hd1", "hd2"))
    assert p.strategy == "hd2"
    assert p.predicted["hd2"] < 0.5 * p.predicted["flat_a2a"]


def test_uniform_links_do_not_pay_for_hierarchy() -> None:
    p = plan(two_level(2400.0, 2400.0), WORK, uniform_routing(WORK), implemented=("hd1", "hd2"))
    assert p.strategy == "hd1"


def test_experts_not_divisible_by_ranks_are_noted() -> None:
    work = Workload(num_tokens=128, hidden_size=64, ffn_size=64, num_experts=8, top_k=2)
    p = plan(Topology.load(str(TESTBED)), work)
    assert p.strategy == "local" and set(p.predicted) == {"local", "replicated"}
    assert "do not split evenly over 32 ranks" in p.notes[0]
    with pytest.raises(ValueError, match="none of the implemented .* do not split evenly over 32 ranks"):
        plan(Topology.load(str(TESTBED)), work, implemented=("hd1", "hd2"))


def test_explain_shows_predictions_for_a_topology_file() -> None:
    torch.manual_seed(0)
    model = TinyMoELM(TinyLMConfig(num_layers=1, moe_kind="grouped_gemm", num_experts=32))
    report = moe_compile.explain(model, torch.randint(0, 32, (2, 8)),
                                 options={"inner_compiler": "aot_eager", "topology": str(TESTBED)})
    (r,) = report.regions
    assert r.plan == "local" and {"hd1", "hd4", "flat_a2a", "hybridep"} <= set(r.predicted_s)
    assert "planner: predicted time" in str(report)


def test_bad_topology_option() -> None:
    with pytest.raises(ValueError, match="option 'topology': no such file"):
        moe_compile.parse_options({"topology": "/nonexistent/cluster.toml"})
    with pytest.raises(ValueError, match="option 'topology' must be"):
        moe_compile.parse_options({"topology": 3})


DGX = files("moe_compile.cost") / "topologies" / "dgx_h100_2node.toml"


def test_moe_plan_prints_the_choice_and_bytes_per_level(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """moe-plan on a config.json, the DGX topology scaled to 4 nodes: the planner's choice over
    what the strategies run (the same as plan_table's), every candidate's prediction, and HD2's
    node-link bytes at most the flat all-to-all's (dedup never sends more across nodes)."""
    config = {"model_type": "my_moe", "hidden_size": 1024, "moe_intermediate_size": 512, "num_experts": 64,
              "num_experts_per_tok": 4, "num_hidden_layers": 6, "first_k_dense_replace": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert moe_plan.main(["--model", str(path), "--topology", str(DGX), "--nodes", "4", "--tokens", "2048"]) == 0
    out = capsys.readouterr().out
    shape = moe_plan.load_shape(str(path))
    assert (shape.num_experts, shape.top_k, shape.hidden_size, shape.ffn_size, shape.num_layers) == (64, 4, 1024, 512, 4)
    topo = moe_plan.scale_nodes(Topology.load(str(DGX)), 4)
    assert topo.sizes == (4, 8)
    decided, _ = moe_plan.plan_table(shape, topo, 2048, 2)
    assert decided.strategy in ("hd1", "hd2", "flat_a2a", "hier_a2a", "gather0", "gather1", "model0")
    assert f"{decided.strategy} <- chosen" in out and f"4 MoE layers, each: {decided.strategy}" in out
    for name in decided.predicted:
        assert name in out
    work = Workload(num_tokens=2048, hidden_size=1024, ffn_size=512, num_experts=64, top_k=4, dtype_bytes=2,
                    slot_bytes=8)
    stats = hd_statistics(uniform_routing(work), 64, topo.sizes, copies=True)
    hd2 = moe_plan.phase_bytes(topo, work, "hd2", stats)
    flat = moe_plan.phase_bytes(topo, work, "flat_a2a", stats)
    assert 0 < hd2["node"] <= flat["node"]
    assert hd2["gpu"] > 0 and flat["gpu"] == 0  # the flat all-to-all is charged at the slowest link it crosses


def test_moe_plan_errors_say_what_to_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128}))
    assert moe_plan.main(["--model", str(dense), "--topology", str(DGX)]) == 2
    assert "no expert count" in capsys.readouterr().err
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_local_experts": 8,
                               "num_experts_per_tok": 2}))
    assert moe_plan.main(["--model", str(moe), "--topology", str(DGX), "--nodes", "3"]) == 2
    assert "8 experts do not split evenly over 24 ranks" in capsys.readouterr().err
    assert moe_plan.main(["--model", "mixtral", "--topology", str(DGX), "--nodes", "1"]) == 0  # a model type
    assert "mixtral: E=8 K=2" in capsys.readouterr().out
