"""Expert gather (``lowering.strategies.gather``): layers that all-gather their experts inside a
mesh block, on 4 real gloo ranks (2 x 2 mesh), against the eager model; the planner's prediction."""

from __future__ import annotations

import operator
from dataclasses import replace

import pytest
import torch
import torch.fx as fx
from dist_utils import run_ranks

from moe_compile.cost import planner
from moe_compile.cost.topology import Level, Topology
from moe_compile.cost.workload import Workload
from moe_compile.passes.overlap import split_stages


@pytest.mark.ranks
def test_gathered_layers_equal_eager_forward_and_backward() -> None:
    """gather0 (data-centric: no token moves) and gather1 (each node gathers, tokens cross nodes;
    compiled by Inductor) of stacked experts, gather0 of E expert modules (aot_eager, on a mesh
    whose positions hold the ranks [[0, 2], [1, 3]]): the loss equals eager's, gradients summed over the ranks equal eager's; the expert bytes travel on the levels the domain spans, tokens only
    above it."""
    results = run_ranks(4, "gather", worker="gather_worker.py", shape=[2, 2],
                        cases=[["grouped_gemm", 0], ["grouped_gemm", 1], ["expert_loop", 0]],
                        permuted_kind="expert_loop", inductor_case=["grouped_gemm", 1])
    for rank, res in enumerate(results):
        for key, r in res.items():
            where = (rank, key)
            level = int(key.split()[-1])
            assert abs(r["loss"] - r["loss_ref"]) <= 1e-6 * abs(r["loss_ref"]), where
            assert r["grad_err"] < 1e-5, where
            assert all(p.startswith(f"gather{level} ") for p in r["plans"]), (where, r["plans"])
            assert r["gathers"] == 2, where  # one gather per layer (every weight in one collective)
            sent = r["sent"]
            # 8 experts of 3 [32, 48] fp32 matrices: 36864 B per rank and layer
            piece = 3 * 32 * 48 * 4 * 2
            if level == 0:
                assert r["dispatches"] == 0, where
                assert all(sent[lv]["dispatch"] == sent[lv]["combine"] == 0 for lv in sent), where
                # forward gathers 1 piece across sockets then 2 inside; backward reduce-scatters
                # the mirror image: 2 layers each
                assert sent["socket"]["gather"] == 2 * 2 * piece, where
                assert sent["gpu"]["gather"] == 2 * 2 * 2 * piece, where
                assert r["gathered_bytes"] == [4 * piece] * 2, where
            else:
                assert r["dispatches"] == 2, where
                assert sent["gpu"]["dispatch"] == sent["gpu"]["combine"] == 0, where  # no token moves inside
                assert sent["socket"]["gather"] == 0, where
                assert sent["gpu"]["gather"] == 2 * 2 * piece, where
                assert r["gathered_bytes"] == [2 * piece] * 2, where


@pytest.mark.ranks
def test_gathered_shards_train_as_eager_ddp() -> None:
    """shard_experts + gather: 3 AdamW steps equal eager DDP of the unsharded model, and each rank's
    shard ends equal to the eager model's rows of its experts (the gradients were reduce-scattered
    to their owners); each rank still holds a quarter of the expert bytes."""
    results = run_ranks(4, "gather_shard", worker="gather_worker.py", shape=[2, 2], kind="grouped_gemm",
                        levels=[0, 1], steps=3)
    for rank, res in enumerate(results):
        for level, r in res.items():
            where = (rank, level)
            for a, b in zip(r["losses"]["compiled"], r["losses"]["eager"], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (where, r["losses"])
            assert r["weight_err"] < 1e-5, where
            assert r["local_bytes"] * 4 == r["full_bytes"], where


def _topology(inter_gbps: float) -> Topology:
    return Topology((Level("node", 2, 1e-4, 8 / (inter_gbps * 1e9)), Level("gpu", 4, 2e-5, 8 / 100e9)),
                    flops_per_s=(1e12,))


@pytest.mark.parametrize("inter_gbps", [0.1, 1.0, 10.0])
def test_gather_prediction_is_hybridep_all_gather_plus_inter_level_tokens(inter_gbps: float) -> None:
    """gather0's communication is HybridEP's all-gather term with every level a domain (HEXA's
    data-centric mode: the same number); gather1's is the all-gather inside the node plus the
    inter-node phase of HD-2 both ways, which is HD-2's time less its intra-node phase. With SR
    compression the all-gather's bytes shrink by the ratio, less the indices that travel along.
    Each adds the rank's copies, (2 + domain size) times its experts' bytes (packed, its own chunk
    placed, the domain's unpacked): a read and a write at the memory rate, or at the expert op's
    measured row rate where the topology has it (HEXA's data-centric time does not count them)."""
    from moe_compile.cost import hexa, hybridep
    from moe_compile.cost.hiermoe import phase_times_s
    from moe_compile.cost.routing import hd_statistics

    topo = _topology(inter_gbps)
    work = Workload(num_tokens=512, hidden_size=256, ffn_size=512, num_experts=16, top_k=2, dtype_bytes=2,
                    gated=True, slot_bytes=8)
    stats = hd_statistics(planner.uniform_routing(work), work.num_experts, topo.sizes, copies=True)
    piece = work.num_experts // topo.world_size * work.expert_bytes
    expected_ag = (2 - 1) * (1e-4 + piece * 8 / (inter_gbps * 1e9)) + (4 - 1) * (2e-5 + 2 * piece * 8 / 100e9)
    copies = (2 + 8) * piece * 2 / 1e11
    assert planner.gather_time_s(topo, work, stats, 0) == pytest.approx(expected_ag + copies, rel=1e-9)
    assert hexa.data_centric_time_s(topo, work) == pytest.approx(
        expected_ag + planner.compute_s(topo, work), rel=1e-6)
    measured = replace(topo, expert_flops_per_s=1e11, expert_row_bytes_per_s=2e9)
    assert planner.gather_time_s(measured, work, stats, 0) == pytest.approx(expected_ag + (2 + 8) * piece / 2e9,
                                                                            rel=1e-9)
    # SR compression r = 8 on bf16: an entry kept with probability 1/8 travels with its int32 index
    sr = piece / (8 * 2 / (2 + 4))
    expected_sr = (2 - 1) * (1e-4 + sr * 8 / (inter_gbps * 1e9)) + (4 - 1) * (2e-5 + 2 * sr * 8 / 100e9)
    assert planner.gather_time_s(topo, work, stats, 0, 8.0) == pytest.approx(expected_sr + (2 + 8) * sr * 2 / 1e11,
                                                                             rel=1e-9)
    ag1 = (4 - 1) * (2e-5 + piece * 8 / 100e9)
    inter = sum(sum(phase_times_s(2, topo, w, stats)[0]) for w in (work, Workload(**{**work.__dict__, "slot_bytes": 0})))
    assert planner.gather_time_s(topo, work, stats, 1) == pytest.approx(ag1 + (2 + 4) * piece * 2 / 1e11 + inter,
                                                                        rel=1e-9)
    assert hybridep.partition_time_s(topo, hybridep.DomainPartition.of(topo, (1, 4)),
                                     hybridep.StreamSizes.from_workload(work, 8)).ag_s == pytest.approx(ag1)
    predicted = planner.plan(topo, work, implemented=("hd1",)).predicted
    for j in (0, 1):  # the layer's prediction adds the expert compute
        assert predicted[f"gather{j}"] == pytest.approx(planner.gather_time_s(topo, work, stats, j)
                                                        + planner.compute_s(topo, work), rel=1e-9)


def test_planner_moves_experts_on_a_slow_link_with_small_experts() -> None:
    """Where the tokens outweigh the experts and the inter-node link is slow, a gather wins;
    where the experts are large and the link fast, the all-to-all does."""
    runnable = ("hd1", "hd2", "flat_a2a", "hier_a2a", "gather0", "gather1")
    small = Workload(num_tokens=8192, hidden_size=256, ffn_size=128, num_experts=16, top_k=4, dtype_bytes=2,
                     gated=True, slot_bytes=8)
    large = Workload(num_tokens=256, hidden_size=1024, ffn_size=4096, num_experts=16, top_k=2, dtype_bytes=2,
                     gated=True, slot_bytes=8)
    assert planner.plan(_topology(0.1), small, implemented=runnable).strategy.startswith("gather")
    assert planner.plan(_topology(10.0), large, implemented=runnable).strategy.startswith("hd")


@pytest.mark.ranks
def test_gather_prefetch_starts_layers_ahead() -> None:
    """gather_prefetch = n: layer l+n's gather starts before layer l's experts run (right after
    layer l+n-1's gather was waited for, not earlier); 0: each gather where its layer is; "auto"
    (the default): every layer that keeps its gathered weights for backward at the graph's start,
    in layer order. With gather_keep_bytes one layer's worth, the last layer keeps its gathered
    weights and the two before gather theirs again in backward (tagged for the partitioner's
    recompute); under "auto" those two start one layer ahead and the kept one right after the
    gather before it. The results are those of eager whatever the schedule. HF Mixtral too, whose
    layers read constants (its key/value cache) that the gathers start above."""
    results = run_ranks(4, "prefetch", worker="gather_worker.py", shape=[2, 2], prefetch=[0, 2, "auto"])
    g, w, x = "ep_gather_start", "ep_gather_wait", "experts"
    expected = {"0": [g, w, x, g, w, x, g, w, x],
                "1": [g, w, g, x, w, g, x, w, x],
                "2": [g, g, w, g, x, w, x, w, x],
                "auto": [g, g, g, w, x, w, x, w, x],
                "auto keep 147456": [g, w, g, g, x, w, x, w, x]}
    expected["1 keep 147456"] = expected["1"]
    for rank, res in enumerate(results):
        hf = res.pop("hf_mixtral")
        # HF Mixtral (key/value cache on: constant reads inside each layer): layer l+1's gather
        # starts right after layer l's gather was waited for
        assert hf["constants"] > 0, hf  # the case this checks is there
        assert hf["starts"][1:3] == ["ep_gather_1_start after ep_gather_wait",
                                     "ep_gather_2_start after ep_gather_1_wait"], hf["starts"]
        assert abs(hf["loss"] - hf["loss_ref"]) <= 1e-5 * abs(hf["loss_ref"]) and hf["grad_err"] < 1e-4, (rank, hf)
        for ahead, r in res.items():
            assert r["events"] == expected[ahead], (rank, ahead, r["events"])
            assert abs(r["loss"] - r["loss_ref"]) <= 1e-6 * abs(r["loss_ref"]), (rank, ahead)
            assert r["grad_err"] < 1e-5, (rank, ahead)
            assert r["backward_scatters"] == 3, (rank, ahead)  # every layer's reduce-scatter
            regather = ahead.endswith("keep 147456")
            assert r["regathered"] == ([True, True, False] if regather else [False] * 3), (rank, ahead, r)
            assert r["backward_gathers"] == (2 if regather else 0), (rank, ahead, r)
            assert len(r["starts"]) == 3 + r["backward_gathers"], r["starts"]


def test_gather_prefetch_passes_constant_reads() -> None:
    """AOTAutograd lifts tensors a model builds from literals (transformers' empty key/value cache)
    to ``get_attr`` reads in the middle of a layer: the next layer's gather, and the slices of its
    weights that it reads, still start right after the previous gather's wait (before layer 0's
    experts), not below the constant read."""
    g = fx.Graph()
    x, w0, w1 = (g.placeholder(n) for n in ("x", "w0", "w1"))
    gathered0 = g.call_function(torch.ops.hiermoe.ep_gather.default, ([w0], 0, True))
    h = g.call_function(torch.ops.aten.mm.default, (x, g.call_function(operator.getitem, (gathered0, 0))))
    const = g.get_attr("_tensor_constant0")
    h = g.call_function(torch.ops.aten.add.Tensor, (h, g.call_function(torch.ops.aten.lift_fresh_copy.default, (const,))))
    gate = g.call_function(torch.ops.aten.slice.Tensor, (w1, 1, 0, 4))
    gathered1 = g.call_function(torch.ops.hiermoe.ep_gather.default, ([gate], 1, True))
    g.output(g.call_function(torch.ops.aten.mm.default, (h, g.call_function(operator.getitem, (gathered1, 0)))))
    split = split_stages(g, prefetch=1)
    order = [n.name for n in g.nodes]
    assert split.gather_starts == ["ep_gather_default_start after w1",
                                  "ep_gather_default_1_start after ep_gather_default_wait"], split
    assert order.index("slice_tensor") < order.index("ep_gather_default_1_start") < order.index("mm_default"), order


@pytest.mark.ranks
def test_sr_compression_is_lossy_and_sends_less() -> None:
    """HybridEP's SR compression (gather_compress r), 4 AdamW steps of the tiny LM over the whole
    mesh: at r = 1 (every residual entry kept) the losses are the exact gather's; at r = 8 the
    experts cross the node link as the top n/r residual entries (values and int32 indices:
    2/r of the fp32 bytes) and the losses move (it is lossy) but stay within 3 % of exact's (the
    gap this test reports when it fails)."""
    results = run_ranks(4, "compress", worker="gather_worker.py", shape=[2, 2], ratios=[None, 1, 8], steps=4)
    for rank, res in enumerate(results):
        exact = res["None"]
        for key in ("1", "8"):
            r, ratio = res[key], int(key)
            where = (rank, key)
            assert r["node_bytes"] == [b * 2 // ratio for b in exact["node_bytes"]], (where, r["node_bytes"])
            gaps = [abs(a - b) / b for a, b in zip(r["losses"], exact["losses"], strict=True)]
            if ratio == 1:
                assert max(gaps) < 1e-5, (where, gaps)
            else:
                assert gaps[0] > 1e-4, (where, gaps)  # the compressed experts are what ran
                assert max(gaps) < 0.03, (where, gaps, r["losses"], exact["losses"])


@pytest.mark.ranks
def test_model_centric_layers_equal_eager_forward_and_backward() -> None:
    """model0 (HEXA-MoE's model-centric mode: every rank's tokens all-gathered, each rank computing
    them on its 12 of the experts' 48 FFN columns, the partial outputs reduce-scattered) on a 2 x 2
    mesh: stacked experts compiled by Inductor, E expert modules by aot_eager on a mesh whose
    positions hold the ranks [[0, 2], [1, 3]]. The loss equals eager's and the gradients summed
    over the ranks equal eager's; no expert weight and no dispatch moves, each level carries the
    tokens' hierarchical all-gather and the outputs' reduce-scatter (forward and backward); a rank
    with fewer tokens than the others makes every rank fail with a message that says so."""
    results = run_ranks(4, "model", worker="gather_worker.py", shape=[2, 2], kinds=["grouped_gemm", "expert_loop"],
                        permuted_kind="expert_loop", inductor_kind="grouped_gemm")
    # 16 tokens per rank: 32 fp32 hidden + 2 int64 ids + 2 fp32 weights = 152 B each with its routing
    tokens, rows = 16 * (32 * 4 + 2 * 8 + 2 * 4), 16 * 32 * 4
    for rank, res in enumerate(results):
        uneven = res.pop("uneven")
        assert uneven is not None and "same number of tokens on every rank" in uneven, (rank, uneven)
        sharded = res.pop("sharded")
        assert sharded is not None and "'model_centric' = 'always' cannot run this model" in sharded, (rank, sharded)
        for kind, r in res.items():
            where = (rank, kind)
            assert abs(r["loss"] - r["loss_ref"]) <= 1e-6 * abs(r["loss_ref"]), where
            assert r["grad_err"] < 1e-5, where
            assert all(p.startswith("model0 ") for p in r["plans"]), (where, r["plans"])
            assert r["token_gathers"] == 2 and r["dispatches"] == 0 and r["weight_gathers"] == 0, where
            sent = r["sent"]
            # per layer, forward: the tokens' all-gather sends 1 piece across sockets then 2 inside,
            # the outputs' reduce-scatter 2 rows' worth inside then 1 across; backward the mirror
            # (output gradients all-gathered, token gradients reduce-scattered: hidden + weights)
            grads = 16 * (32 * 4 + 2 * 4)
            assert sent["socket"]["dispatch"] == 2 * (tokens + rows), where
            assert sent["gpu"]["dispatch"] == 2 * 2 * (tokens + rows), where
            assert sent["socket"]["combine"] == 2 * (rows + grads), where
            assert sent["gpu"]["combine"] == 2 * 2 * (rows + grads), where
            assert all(sent[lv]["gather"] == 0 for lv in sent), where
