"""The planner: every candidate evaluated, argmin over what is implemented, routing-aware."""

from __future__ import annotations

from importlib.resources import files

import numpy as np
import pytest
import torch

import moe_compile
from moe_compile.cost import Level, Topology, Workload, plan
from moe_compile.cost.planner import uniform_routing
from moe_compile.samples import TinyLMConfig, TinyMoELM

TESTBED = files("moe_compile.cost") / "topologies" / "hiermoe_testbed.toml"


def two_level(inter_gbps: float = 40.0, intra_gbps: float = 2400.0) -> Topology:
    return Topology(levels=(Level("node", 4, 5e-6, 8 / (inter_gbps * 1e9)), Level("gpu", 8, 1e-6, 8 / (intra_gbps * 1e9))),
                    flops_per_s=(3e14,))


WORK = Workload(num_tokens=4096, hidden_size=2048, ffn_size=1024, num_experts=64, top_k=8, dtype_bytes=2)
ALL = ("local", "flat_a2a", "hier_a2a", "hd1", "hd2", "monta_O1", "monta_O2", "monta_O3", "hybridep",
       "hexa_data_centric", "hexa_model_centric")


def test_single_process_plan_is_local() -> None:
    p = plan(None, WORK)
    assert p.strategy == "local" and set(p.predicted) == {"local"}
    assert p.predicted["local"] == pytest.approx(4096 * 8 * 2 * 3 * 2048 * 1024 / 1e12)


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
    assert p.strategy == "local" and set(p.predicted) == {"local"}
    assert "do not split evenly over 32 ranks" in p.notes[0]


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
