"""Expert parallelism under real gloo process groups (spawned ranks on CPU; tests/ep_worker.py).

Tolerances: fp32 throughout. Outputs and token/routing-weight gradients of a rank are compared
with the single-process op on the same rank's tokens; the expert computation is the same, only
summation order differs (the relays add partial results in another order), so 1e-5 of the
largest magnitude. Expert-weight gradients are compared summed over ranks (what DDP averages).
If any of these fail, fix the dispatch/combine, not the tolerance.
"""

from __future__ import annotations

import re

import pytest
from dist_utils import check_checkpoint, check_optim, run_ranks

from moe_compile.cost.hiermoe import dimension_rule

TOL = 1e-5
ROUTINGS = ["random", "one_expert", "t1", "k_eq_e", "empty_rank", "local_only"]


def check_matrix(results: list[dict], num_levels: int, routings: list[str] = ROUTINGS, mixed: bool = False) -> None:
    """``mixed``: bf16 tokens and expert weights, float32 routing weights (torch.autocast's op):
    the partial sums travel back in float32 (``w`` = 2 bytes per element more than a token's)."""
    wide = 2 if mixed else 1  # a float32 partial sum (or output gradient) against a bf16 token row
    for rank, res in enumerate(results):
        records = res["records"]
        assert len(records) == len(routings) * (2 * num_levels + 1)  # + the fused op on the deepest route
        for rec in records:
            where = f"rank {rank} routing {rec['kind']} dedup {rec['dedup']} d {rec['d']} {rec['mode']}"
            assert rec["used"] == rec["d"], where
            for name, err in rec["errs"].items():
                assert err < mixed_tol(name, rec["mode"]) if mixed else err < TOL, f"{where}: {name} rel err {err}"
            if mixed:  # the op's dtypes: y and the routing weights' gradient float32, x's gradient bf16
                assert rec["dtypes"] == ["float32", "float32", "bfloat16", "float32"], (where, rec["dtypes"])
            sent = {int(k): v for k, v in rec["sent"].items()}
            for level, want in rec["expected"].items():
                got = sent[int(level)]["dispatch"]["forward"]
                assert got == want, f"{where}: level {level} dispatch bytes {got} != routing-derived {want}"
            # the staged ops' backward sends the output gradient where the rows went and the rows'
            # gradients back: per level exactly the forward's payload; the fused op's backward
            # dispatches [x | grad_y] rows, twice the forward's
            for s in sent.values():
                factor = wide if rec["mode"] == "stages" else 2
                assert s["dispatch"]["backward"] == factor * s["dispatch"]["forward"], where
                assert wide * s["combine"]["backward"] == s["combine"]["forward"], where
            if rec["dedup"] and rec["d"] > 1:  # HierMoE Eq. 4 (Inter-level-1) from the p statistics
                assert sent[0]["dispatch"]["forward"] == rec["eq4_sum"] <= rec["eq4_n"], where
            if rec["dedup"] and rec["d"] == 1:  # Eq. 2: the flat HD1 all-to-all
                total = sum(s["dispatch"]["forward"] for s in sent.values())
                assert total == rec["eq2_sum"] <= rec["eq2_n"], where
            if rec["kind"] == "local_only":
                assert all(s["dispatch"]["forward"] == 0 for s in sent.values()), where
    # combine returns every row over the link it came: per level, what all ranks send in combine
    # equals what all ranks sent in dispatch
    for i in range(len(results[0]["records"])):
        recs = [r["records"][i] for r in results]
        for level in recs[0]["sent"]:
            disp = sum(r["sent"][level]["dispatch"]["forward"] for r in recs)
            comb = sum(r["sent"][level]["combine"]["forward"] for r in recs)
            assert wide * disp == comb, f"{recs[0]['kind']} dedup {recs[0]['dedup']} d {recs[0]['d']} level {level}"


def mixed_tol(name: str, mode: str) -> float:
    """The largest relative error against the single-process op with bf16 tokens and experts and
    float32 routing weights: y and the routing weights' gradient are float32 sums of the same bf16
    expert outputs (summation order only; the fused op's backward sends the output gradient in
    the tokens' dtype, beside them); x's and the experts' gradients are bf16 (2 units in the
    last place: their sums over the ranks are bf16 too)."""
    if name == "y" or (name == "topk_weights" and mode == "stages"):
        return 1e-6
    return 2e-3 if name == "topk_weights" else 2 ** -6


@pytest.mark.ranks
def test_op_matrix_4_ranks_2_levels() -> None:
    results = run_ranks(4, "op_matrix", shape=[2, 2], E=8, K=3, H=6, F=5, T=9, routings=ROUTINGS)
    check_matrix(results, 2)


@pytest.mark.ranks
def test_op_matrix_bf16_tokens_float32_routing_weights() -> None:
    """The op torch.autocast makes: bf16 tokens and experts, float32 routing weights. Every d,
    both dedup modes, stages and the fused op: y is float32 and equals the single-process op to
    float32 summation order (before, the partial sums travelled in bf16: 6.5e-3 off, and y came
    back bf16), the routing weights' gradient too; dispatch sends bf16 rows, combine float32."""
    routings = ["random", "t1", "local_only"]
    results = run_ranks(4, "op_matrix", shape=[2, 2], E=8, K=3, H=16, F=8, T=9, routings=routings, dtype="bfloat16")
    check_matrix(results, 2, routings, mixed=True)


@pytest.mark.ranks
def test_op_matrix_8_ranks_3_levels() -> None:
    results = run_ranks(8, "op_matrix", shape=[2, 2, 2], E=16, K=4, H=6, F=5, T=7, routings=ROUTINGS)
    check_matrix(results, 3)


@pytest.mark.ranks
def test_dedup_sends_less_than_flat() -> None:
    """At K=4 over 2 nodes, HD2's inter-node bytes are the dedup lower bound, below the flat
    non-dedup all-to-all's (one copy per (token, expert))."""
    results = run_ranks(4, "op_matrix", shape=[2, 2], E=8, K=4, H=6, F=5, T=16, routings=["random"])
    for res in results:
        by = {(r["dedup"], r["d"]): r["sent"]["0"]["dispatch"]["forward"] for r in res["records"]}
        assert by[(True, 2)] < by[(False, 1)]
        assert by[(True, 2)] <= by[(True, 1)]


@pytest.mark.ranks
def test_llama4_input_scaled_experts_over_ranks() -> None:
    """transformers' Llama-4 at K = 2, whose routing weights scale the experts' input (the op gets
    K rows per token), over 2 gloo ranks with the token all-to-alls: loss and summed gradients
    equal eager's, both layers rewritten as input-scaled and run expert parallel."""
    for rank, r in enumerate(run_ranks(2, "llama4", worker="hf_worker.py", shape=[2], k=2)):
        assert abs(r["loss"] - r["loss_ref"]) <= TOL * abs(r["loss_ref"]), (rank, r)
        assert r["grad_err"] < 1e-5, (rank, r)
        assert len(r["layouts"]) == 2 and all("weights scale the input" in lay for lay in r["layouts"]), r
        assert r["layers_run"] == 2 and not any(p.startswith(("local", "gather")) for p in r["plans"]), r


@pytest.mark.ranks
def test_activation_checkpointed_mixtral_over_ranks() -> None:
    """transformers' Mixtral with activation checkpointing (each decoder layer a checkpointed
    subgraph), over 2 gloo ranks with the token exchanges the planner picks: both layers are found
    inside the checkpointed regions and run expert parallel, loss and summed gradients equal the
    eager model checkpointed alike, and every step sends the bytes it sends without
    checkpointing: backward recomputes the layer's local work, not its exchanges. It keeps for
    backward 0.39x the activations it keeps without checkpointing (measured 32 against 80 KB; 55 KB
    before the local stage stopped keeping its pre-activations in checkpointed layers). The same
    with the experts sharded (shard_experts) and selective checkpointing (a context_fn), each
    shard's gradient its rows' summed over the ranks: its checkpoints are closed again around the
    rewritten layers' pieces between the exchanges, which stay outside them (the policy is never
    asked about an exchange; the local expert stage, outside too, keeps its pre-activations only if
    the policy saves grouped matmuls, and this one recomputes everything), and it sends the bytes
    the unsharded plain run sends (measured: kept 36 KB, against 32 KB with plain checkpointing
    and 80 KB without; 59 KB while the local stage kept its pre-activations whatever the policy)."""
    for rank, r in enumerate(run_ranks(2, "checkpointed", worker="hf_worker.py", shape=[2], reentrant=False)):
        plain = r["plain"]
        assert plain["inlined"] == 0, (rank, plain)
        for ckpt in (r["checkpointed"], r["sharded"]):
            assert ckpt["inlined"] == 2, (rank, ckpt)
            assert len(ckpt["plans"]) == 2, (rank, ckpt)
            assert not any(p.startswith(("local", "gather", "replicated")) for p in ckpt["plans"]), (rank, ckpt)
            assert abs(ckpt["loss"] - ckpt["loss_ref"]) <= TOL * abs(ckpt["loss_ref"]), (rank, ckpt)
            assert ckpt["grad_err"] < 1e-5, (rank, ckpt)
            assert ckpt["sent"]["dispatch backward"] > 0, (rank, ckpt)
        assert r["checkpointed"]["plans"] == plain["plans"] and r["checkpointed"]["sent"] == plain["sent"], (rank, r)
        sel = r["sharded"]
        assert all(lay.endswith("selectively activation-checkpointed (the checkpoint's policy decides what backward "
                                "recomputes; not for its exchanges, kept; its local expert stage recomputes its "
                                "pre-activations (the policy recomputes the grouped matmuls))")
                   for lay in sel["layouts"]), (rank, sel["layouts"])
        assert sel["kept"] < 0.6 * plain["kept"], (rank, sel["kept"], plain["kept"])
        assert all(lay.endswith("activation-checkpointed (recomputed in backward; what its exchanges received kept)")
                   for lay in r["checkpointed"]["layouts"]), (rank, r["checkpointed"]["layouts"])
        assert sel["sent"] == plain["sent"], (rank, sel["sent"], plain["sent"])
        # the policy decides for the layers' router (its matmul) but is never asked about an exchange
        assert "aten.mm.default" in sel["policy_ops"], (rank, sel["policy_ops"])
        assert not any(op.startswith(("hiermoe.ep_", "hiermoe.sample_")) for op in sel["policy_ops"]), (rank, sel)
        assert r["checkpointed"]["kept"] < 0.5 * plain["kept"], (rank, r["checkpointed"]["kept"], plain["kept"])


@pytest.mark.ranks
def test_checkpoint_around_the_experts_alone_over_ranks() -> None:
    """A checkpoint around a layer's experts alone (router outside, as Megatron recomputes only the
    MoE part), over 2 gloo ranks with the token exchanges: the expert op becomes stages, and the
    checkpoint goes to its local expert stage (the exchanges are never run again: every variant
    sends what the layer without checkpointing sends). Plain, the stage keeps nothing for backward
    but the rows it received; selective, it keeps its pre-activations only where the policy saves
    the grouped matmuls. Loss and summed gradients equal eager checkpointed alike. Before, plain
    checkpointing recomputed nothing of the layer and a selective one left it as written."""
    for rank, r in enumerate(run_ranks(2, "experts_checkpointed", worker="hf_worker.py", shape=[2])):
        none = r["none"]
        for variant, v in r.items():
            assert len(v["plans"]) == 1 and v["plans"][0].startswith(("hd", "flat", "2dh")), (rank, variant, v)
            assert abs(v["loss"] - v["loss_ref"]) <= TOL * abs(v["loss_ref"]), (rank, variant, v)
            assert v["grad_err"] < 1e-5, (rank, variant, v)
            assert v["sent"] == none["sent"] and none["sent"]["dispatch backward"] > 0, (rank, variant, v["sent"])
        assert r["plain"]["layouts"][0].endswith(
            "activation-checkpointed (recomputed in backward; what its exchanges received kept)"), (rank, r["plain"])
        stage = "its local expert stage {} its pre-activations (the policy {} the grouped matmuls))"
        assert r["recompute"]["layouts"][0].endswith(stage.format("recomputes", "recomputes")), (rank, r["recompute"])
        assert r["save"]["layouts"][0].endswith(stage.format("keeps", "saves")), (rank, r["save"])
        kept = {variant: v["kept"] for variant, v in r.items()}
        assert kept["plain"] < 0.6 * kept["none"] and kept["recompute"] < 0.6 * kept["save"], (rank, kept)


@pytest.mark.ranks
@pytest.mark.parametrize("options", [{"dimension": 2}, {"dimension": 1, "dedup": False},
                                     {"dimension": 2, "ep_backward": "resend"}])
def test_compiled_samples_match_eager(options: dict) -> None:
    """The tiny LM's two MoE layers, compiled over a 2x2 mesh, against eager: loss and every
    gradient; and the token payload its backward sends against its forward's."""
    resend = options.get("ep_backward") == "resend"
    # every model pattern under HD-2; the flat non-dedup route and the fused op do not depend on it
    kinds = ["grouped_gemm"] if resend or options.get("dedup") is False else ["grouped_gemm", "expert_loop",
                                                                               "gshard_einsum"]
    results = run_ranks(4, "compile", shape=[2, 2], kinds=kinds, **options)
    for rank, res in enumerate(results):
        for kind, r in res.items():
            where = (rank, kind, r)
            assert abs(r["loss"] - r["loss_ref"]) <= TOL * abs(r["loss_ref"]), where
            assert r["grad_err"] < 1e-5, where
            assert r["d"] == [options["dimension"]] * 2, where
            assert (r["stage_ops"], r["fused_ops"]) == ((0, 2) if resend else (2, 0)), where
            s = r["sent"]
            fwd = s["dispatch forward payload"] + s["combine forward payload"]
            bwd = s["dispatch backward payload"] + s["combine backward payload"]
            assert fwd > 0, where
            if resend:  # [x | grad_y] dispatched again: 1.5x over dispatch + combine (when they are equal)
                assert s["dispatch backward payload"] == 2 * s["dispatch forward payload"], where
                assert all(b == 0 for b in r["saved_bytes"]), where
            else:  # the staged ops' adjoints: exactly the forward's payload, dispatch- and combine-wise
                assert s["dispatch backward payload"] == s["dispatch forward payload"], where
                assert bwd == fwd, where
                # what they keep for it: the dispatched rows, their slots and the route
                assert all(b > 0 for b in r["saved_bytes"]), where
            assert s["combine backward payload"] == s["combine forward payload"], where


@pytest.mark.ranks
def test_local_stage_on_the_triton_kernels() -> None:
    """options kernels="triton" under a mesh (the Triton interpreter on CPU): each layer's local
    stage is one ESMM call over its dispatched rows and their [R, S] slots (non-local slots -1,
    skipped by the kernels), forward and backward (ESFK), and loss and summed gradients equal
    eager's."""
    results = run_ranks(4, "compile", shape=[2, 2], kinds=["grouped_gemm"], dimension=2, kernels="triton",
                        env={"TRITON_INTERPRET": "1"}, timeout_s=600)
    for rank, res in enumerate(results):
        r = res["grouped_gemm"]
        assert r["triton_stages"] == 2, (rank, r)
        assert abs(r["loss"] - r["loss_ref"]) <= TOL * abs(r["loss_ref"]), (rank, r)
        assert r["grad_err"] < 1e-5, (rank, r)


@pytest.mark.ranks
def test_mesh_alone_probes_the_links() -> None:
    """options={"mesh": mesh} alone: the links are probed once at the first compile, every rank
    gets the same topology and plans on it alike. The tiny LM's experts are on every rank (not
    sharded), so its layers run replicated: the expert op stays, no stage op, nothing sent, the
    loss and summed gradients equal eager's; so do they with 6 experts, which no expert-parallel
    plan can split over 4 ranks. With replicated_experts False, d* is predicted from
    the probed topology for a layer that runs a token all-to-all (on loopback the probe may also
    make an expert gather win: then its domain is reported), the loss and summed gradients equal
    eager's, and explain says the topology was probed and how to calibrate it. The probe measures
    the expert op's rates too, the same on every rank."""
    results = run_ranks(4, "probe", worker="plan_worker.py", shape=[2, 2])
    for rank, r in enumerate(results):
        rep = r["replicated"]
        assert len(rep["plans"]) == 2 and all(p.startswith("replicated (every rank holds every expert") for p in rep["plans"]), rep
        assert rep["ep_layers"] == [None, None] and rep["stage_ops"] == 0 and rep["experts_ops"] == 2, (rank, rep)
        assert rep["sent"] == 0, (rank, rep)
        assert "probed" in rep["text"] and "replicated" in rep["text"], rep["text"]
        assert abs(rep["loss"] - r["loss_ref"]) <= TOL * abs(r["loss_ref"]), (rank, rep)
        assert rep["grad_err"] < 1e-5, (rank, rep)
        odd = rep["odd"]  # 6 experts over 4 ranks: no expert-parallel plan exists, replicated runs
        assert len(odd["plans"]) == 2 and all(p.startswith("replicated") for p in odd["plans"]), odd
        assert abs(odd["loss"] - odd["loss_ref"]) <= TOL * abs(odd["loss_ref"]) and odd["grad_err"] < 1e-5, odd
    first = results[0]["topology"]
    assert len(first) == 1 and first[0].startswith("probed: "), first
    assert "socket x2" in first[0] and "gpu x2" in first[0], first  # the mesh levels (make_mesh)
    rates = results[0]["expert_rates"]  # the expert op measured by the probe, agreed
    assert len(rates) == 1 and all(v is not None and v > 0 for v in rates[0]), rates
    for rank, r in enumerate(results):
        assert r["topology"] == first, (rank, r["topology"], first)  # the same numbers on every rank
        assert r["expert_rates"] == rates, (rank, r["expert_rates"], rates)
        assert "moe_compile.tools.calibrate" in r["text"] and "probed" in r["text"], r["text"]
        assert r["plans"] == results[0]["plans"], (rank, r["plans"])  # planned alike on every rank
        assert len(r["predicted"]) == 2, r["predicted"]
        for plan, predicted, gather in zip(r["plans"], r["predicted"], r["gathers"], strict=True):
            if plan.startswith("gather"):
                assert gather is not None and gather["domain_size"] in (2, 4), (rank, plan, gather)
            else:
                assert gather is None and set(predicted) == {"d1", "d2"}, (rank, plan, predicted)
                assert all(t > 0 for t in predicted.values()), predicted
        assert abs(r["loss"] - r["loss_ref"]) <= TOL * abs(r["loss_ref"]), (rank, r)
        assert r["grad_err"] < 1e-5, (rank, r)


@pytest.mark.ranks
def test_planner_choice_decides_what_runs() -> None:
    """The plan pass chooses among what the registered strategies run, and the choice is what
    runs: at H = 4 (fp32, equal links) a deduplicated row's two routing slots cost more than
    dedup saves, so the flat one-copy-per-expert all-to-all runs; at H = 64 HD-d with d* per
    step, predicted HD2 on a slow inter-node link and HD1 on equal links (the token all-to-alls
    only: expert_gather False). With the expert gathers allowed, on the slow link, the 12 KiB of
    experts per rank cost less to gather than the tokens to send: a gather runs. Outputs and
    gradients equal eager's. Each compile plans the layer once: the plan the ranks agreed on is
    reused.

    Every rank plans from the same exchanged data (the lowest rank's token count, every rank's
    expert loads summed), so every rank predicts the same times. On a slow device with routing
    as drawn a token all-to-all runs; with every token's experts on rank 0 the all-to-alls are
    charged rank 0's compute (4x the mean) and the model-centric mode, whose compute is balanced
    whatever the routing, runs."""
    results = run_ranks(4, "plan", worker="plan_worker.py", shape=[2, 2])
    for case in results[0]:
        assert all(res[case]["predicted"] == results[0][case]["predicted"] for res in results), case
    for rank, res in enumerate(results):
        for case, r in res.items():
            where = (rank, case, r["plan"], r["predicted"])
            assert r["err"] < TOL, where
            assert r["plans_made"] == 1, where  # the agreement's plan is the one that runs
            assert any("busiest block" in n for n in r["notes"]) and "busiest block" in r["text"], where
            gathers = {"gather0", "gather1"} if case.endswith("gather") else set()
            assert set(r["executable"]) == {"hd1", "hd2", "flat_a2a", "hier_a2a", "model0"} | gathers, where
            chosen = r["plan"].split()[0]
            runnable = {k: v for k, v in r["predicted"].items() if k in r["executable"]}
            assert chosen == min(runnable, key=runnable.__getitem__), where  # the argmin, on every rank
            assert "flat_a2a*" in r["text"] and "monta_O1 " in r["text"], where  # executable ones marked
        assert res["4 equal"]["plan"] == "flat_a2a (nodedup, d=1)", res["4 equal"]["plan"]
        assert (res["4 equal"]["dedup"], res["4 equal"]["dimension"]) == (False, 1)
        assert res["64 slow_node"]["plan"] == "hd2 (hd, d* per step)", res["64 slow_node"]["plan"]
        assert res["64 equal"]["plan"] == "hd1 (hd, d* per step)", res["64 equal"]["plan"]
        for case in ("64 slow_node", "64 equal"):
            assert (res[case]["dedup"], res[case]["dimension"]) == (True, None), case
        assert res["64 slow_node gather"]["plan"].startswith("gather"), res["64 slow_node gather"]["plan"]
        assert res["64 slow_device"]["plan"].startswith(("hd", "flat", "hier")), res["64 slow_device"]["plan"]
        skewed = res["64 slow_device skewed"]
        assert skewed["plan"].startswith("model0"), skewed["plan"]
        assert any("4.00x under the token all-to-alls" in n for n in skewed["notes"]), skewed["notes"]


@pytest.mark.ranks
def test_dimension_decided_off_the_critical_path() -> None:
    """d* per step decides from the previous forward's statistics of every rank (exchanged
    asynchronously on the mesh's statistics group), the first forward from its own; the last
    forward's statistics are still there to read (the expert swapper reads them). With
    ``lag_statistics = False`` every forward decides from its own."""
    results = run_ranks(4, "lag", shape=[2, 2])
    for rank, res in enumerate(results):
        lagged, fresh = res["True"], res["False"]
        assert lagged["times"][0] == lagged["expected"][0], rank  # first forward: its own statistics
        assert lagged["times"][1] == lagged["expected"][0], rank  # second: the first's
        assert fresh["times"] == fresh["expected"], rank
        assert lagged["expected"][0] != lagged["expected"][1], rank  # the two routings differ
        assert lagged["last_is_second"] and fresh["last_is_second"], rank
        assert res["True"]["d"] == results[0]["True"]["d"], rank  # every rank decides alike


@pytest.mark.ranks
def test_tuned_dimension_agrees() -> None:
    """options['tune_dimension'] (moe_compile.ep.tuning): every rank explores the same d in the
    same steps, receives the same measurements (the least of the ranks', in the statistics
    exchange) and decides alike; once each close d ran twice, a step's d is Eq. 6's rule on the
    corrected times it shows; a forward without backward is not measured."""
    results = run_ranks(4, "tune", shape=[2, 2])
    first = results[0]
    for rank, res in enumerate(results):
        assert res == first, rank  # the same choices, times and offsets everywhere
    steps = first["steps"]
    assert steps[0]["tuned"] == steps[0]["times"]  # nothing measured yet
    # steps 1-3 and the evaluation forward after step 1 explore: only close d, each twice
    exploring = [s["d"] for s in steps[1:4]] + [first["eval_d"]]
    close = [{d for d, t in enumerate(s["times"], 1) if t <= 2.0 * min(s["times"])} for s in steps[1:4]]
    assert all(s["d"] in c for s, c in zip(steps[1:4], close, strict=True)), steps
    assert {1, 2} <= set.union(*close), steps  # the topology makes both close here
    assert sorted(exploring) == [1, 1, 2, 2], (exploring, steps)
    assert first["tried"] == {"1": 2, "2": 2}
    # what is measured is each exploring step's span (it arrives two forwards later): steps 1-3;
    # the evaluation forward has none (the step period, forward to forward, would have made it a
    # fourth), and the steps that follow, decided by the corrected rule, are not measured
    assert sorted(first["offsets"]) == ["1", "2"]
    assert sum(len(o) for o in first["offsets"].values()) == 3, first["offsets"]
    for s in steps[4:]:
        assert s["d"] == dimension_rule(s["tuned"]), s


@pytest.mark.ranks
def test_setup_errors() -> None:
    results = run_ranks(4, "errors", shape=[2, 2])
    for res in results:
        m = res["messages"]
        assert "ValueError" in m["indivisible"] and "6 experts do not split evenly over 4 ranks" in m["indivisible"]
        assert "ValueError" in m["level_names"] and "do not match the topology" in m["level_names"]
        assert "ValueError" in m["world_size"] and "world size is 4" in m["world_size"]
        assert "ValueError" in m["dimension"] and "1..2" in m["dimension"]
        assert "ValueError" in m["device"] and "mesh is on cpu" in m["device"]
        assert res["world_ok"]


@pytest.mark.ranks
def test_explain_reports_dimension_predictions_and_bytes() -> None:
    results = run_ranks(4, "explain", shape=[2, 2])
    for rank, res in enumerate(results):
        # the same model and batches: each rank's own statistics max-reduced (the runtime's way on
        # meshes too large to gather) give the same HD1 time and an upper estimate of HD2's
        exact, upper = res["slow_node"]["layers"], res["slow_node_max_reduced"]["layers"]
        for a, b in zip(exact, upper, strict=True):
            assert b["statistics"] == "max-reduced" and b["times"][0] == pytest.approx(a["times"][0], rel=1e-12)
            assert b["times"][1] >= a["times"][1] * (1 - 1e-12), (rank, a, b)
        assert any(b["times"][1] > a["times"][1] for a, b in zip(exact, upper, strict=True)), (rank, exact, upper)
        for label, want_d in (("slow_node", 2), ("flat", 1)):
            r = res[label]
            assert len(r["layers"]) == 2, r
            for lay in r["layers"]:
                assert lay["d"] == lay["rule"] == want_d, (rank, label, lay)  # Eq. 6 on the shown times
                assert len(lay["times"]) == 2 and all(t > 0 for t in lay["times"])
                assert lay["statistics"] == "gathered", (rank, label, lay)  # 4 ranks: every rank's routing
                assert lay["local"] == [2 * rank, 2 * rank + 1]
            # the report's per-layer bytes add up to this rank's counters for the step
            for level, total in r["counters"].items():
                assert sum(lay["bytes"][level] for lay in r["layers"]) == total, (rank, label)
            assert "expert parallel" in r["text"] and "d*" in r["text"]
            assert r["tune_rounds"] == [3, 3]  # options['tune_dimension'] reached the layers


@pytest.mark.ranks
def test_training_matches_eager_ddp_on_8_ranks() -> None:
    """Three AdamW steps of the tiny LM on a 2x2x2 mesh, d* per step from a topology, against the
    eager model under DistributedDataParallel: same losses on every rank."""
    results = run_ranks(8, "train", shape=[2, 2, 2], kind="grouped_gemm", steps=3, topology_gbps=[1.0, 10.0, 100.0])
    for rank, res in enumerate(results):
        for step, (a, b) in enumerate(zip(res["compiled"], res["eager"], strict=True)):
            # fp32; after AdamW steps small summation-order differences grow a little: 1e-5 relative
            assert abs(a - b) <= 1e-5 * abs(b), (rank, step, res)


@pytest.mark.ranks
def test_sharded_experts_train_under_ddp_after_prepare_ddp() -> None:
    """What a trainer does (model.compile, then DistributedDataParallel around it) with sharded
    experts: prepare_ddp keeps DDP from averaging the rank-local shards (and from broadcasting their
    marker buffers) and divides their gradients as DDP divides the rest; 3 AdamW steps equal eager
    DDP of the unsharded model on every rank, with both layers expert-parallel."""
    results = run_ranks(4, "ddp_shard", worker="shard_worker.py", shape=[2, 2], kind="grouped_gemm", steps=3)
    for rank, res in enumerate(results):
        assert res["rewritten"] == 2, (rank, res)
        assert {n.split(".")[-1] for n in res["ignored"]} == {"gate_up_proj", "down_proj", "gate_up_proj_shard",
                                                              "down_proj_shard"}, res["ignored"]
        for a, b in zip(res["losses"]["compiled"], res["losses"]["eager"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, res["losses"])


@pytest.mark.ranks
def test_trainer_under_torchrun_with_sharded_experts() -> None:
    """transformers' Trainer under torchrun (4 gloo ranks), the README's recipe: shard_experts,
    prepare_ddp, model.compile(backend="hiermoe", mesh), then the Trainer, which moves the model to
    its device (new buffer tensors, the shard placeholders too, which the shard records still know:
    before, the recompile took them for full weights and ran on zeros) and wraps it in DDP itself.
    Its logged losses and gradient norms (2 micro-batches accumulated per step, clipped by
    ShardedExperts) equal those of a Trainer of the unsharded eager model; its checkpoint
    (ShardedExperts) is the unsharded model's, and a run resumed from it trains on alike; resumed
    without ShardedExperts, every rank stops at the first step (another rank's optimizer state)."""
    results = run_ranks(4, "trainer_shard", worker="shard_worker.py", shape=[2, 2], steps=4, save=2, max_grad_norm=0.05,
                        accumulate=2)
    for rank, res in enumerate(results):
        assert res["wrapper"] == "DistributedDataParallel" and res["rewritten"] == 2, (rank, res)
        assert {n.split(".")[-1] for n in res["ignored"]} == {"gate_up_proj", "down_proj", "gate_up_proj_shard",
                                                              "down_proj_shard"}, res["ignored"]
        assert len(res["losses"]["compiled"]) == 4, res["losses"]
        for a, b in zip(res["losses"]["compiled"], res["losses"]["eager"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, res["losses"])
        # clipping at 0.05 (active at every step) by ShardedExperts: the whole model's norm, eager's
        norms = res["grad_norms"]
        assert len(norms["compiled"]) == 4 and min(norms["eager"]) > 0.05, norms
        for a, b in zip(norms["compiled"], norms["eager"], strict=True):
            assert abs(a - b) <= 1e-4 * b, (rank, norms)
        assert norms["args after"] == [0.05], norms  # the Trainer's arguments given back
        # the checkpoint (moe_compile.trainer.ShardedExperts) is the unsharded model's: it loads
        # with from_pretrained, every key in place, and equals eager's checkpoint of the same step
        assert "hiermoe_optimizer.pt" in res["saved"] and "model.safetensors" in res["saved"], res["saved"]
        assert res["loading_info"] == {"missing_keys": [], "unexpected_keys": []}, res["loading_info"]
        assert res["checkpoint_err"][0] < 1e-5, res["checkpoint_err"]
        # a model with other weights resumed from it trains on as the run that saved it did
        resumed = res["losses_resumed"]
        assert len(resumed) == 2, resumed
        for a, b in zip(resumed, res["losses"]["compiled"][2:], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, resumed, res["losses"]["compiled"])
        # resumed without ShardedExperts, the Trainer gives every rank its first rank's optimizer
        # state: before, the other ranks trained their experts on it; now every rank stops, saying so
        assert "mesh position(s) [1, 2, 3]" in res["no_callback_error"], res["no_callback_error"]
        assert "ShardedExperts" in res["no_callback_error"], res["no_callback_error"]


@pytest.mark.ranks
def test_a_sharded_layer_left_alone_fails_to_compile_instead_of_reading_zeros() -> None:
    """Before, a sharded layer left as written ran on its placeholders (zeros) and trained on: under
    torch.autocast the tiny LM's loss was the one without experts.  (Its grouped-GEMM layer calls an
    opaque custom op whose own matmuls autocast turns to bf16 where the graph shows fp32, so
    verification under autocast still leaves it alone.)"""
    results = run_ranks(2, "left_alone", worker="shard_worker.py", shape=[2])
    for rank, res in enumerate(results):
        for label, r in res.items():
            assert r["loss"] is None and "placeholders of zeros" in r["error"], (rank, label, r)
        assert "the canonicalize pass is disabled" in res["disabled"]["error"], res["disabled"]
        assert "runs under torch.autocast('cpu', torch.bfloat16) around the compiled call" in res["autocast"]["error"], \
            res["autocast"]


@pytest.mark.ranks
def test_sharded_training_under_autocast_equals_eager_ddp_under_it() -> None:
    """Before, every layer under torch.autocast was left alone, so a sharded model under autocast
    could not compile at all.  Now each layer's expert op computes in bf16 as the layer's own
    matmuls do (tokens travel in bf16, half the bytes): 3 AdamW steps on 4 gloo ranks equal eager
    DDP under autocast to bf16 rounding (the layer-level check, exact where it can be, is in
    test_reliability)."""
    results = run_ranks(4, "autocast", worker="shard_worker.py", shape=[2, 2], kinds=["gathered_bmm", "expert_loop"],
                        steps=3)
    for rank, res in enumerate(results):
        for kind, r in res.items():
            assert r["dtypes"] and set(r["dtypes"]) == {"bfloat16"} and not r["skipped"], (rank, kind, r)
            eager, compiled = r["losses"]["eager"], r["losses"]["compiled"]
            for a, b in zip(compiled, eager, strict=True):
                assert abs(a - b) <= 2e-3 * abs(b), (rank, kind, r)
        # the tokens travel in bf16: each level's dispatch payload (the token rows) halves; the
        # partial sums come back in float32, as the layer sums bf16 expert outputs weighted by
        # float32 routing weights (before, they were rounded to bf16 on the way).  The model
        # compiled under autocast, then explained outside it and under it: each state is its own
        # agreed rewrite (before, the fp32 recompile raised that the ranks would diverge)
        sent = res["gathered_bmm"]["sent"]
        for fp32, half in zip(sent["fp32"], sent["autocast"], strict=True):
            for level, n in fp32["dispatch"].items():
                assert n > 0 and 2 * half["dispatch"][level] == n, (rank, sent)
            assert half["combine"] == fp32["combine"] and sum(fp32["combine"].values()) > 0, (rank, sent)


@pytest.mark.ranks
def test_generate_with_sharded_experts_equals_eager() -> None:
    """transformers' greedy generate on a sharded, expert-parallel HF Mixtral (4 gloo ranks, prompt
    lengths 5..8): every rank's tokens equal the eager unsharded model's, rank 0 stopping at an
    end-of-sequence token after 2 new tokens while the others make 6 (synced_gpus=True)."""
    results = run_ranks(4, "generate", worker="shard_worker.py", shape=[2, 2], new_tokens=6)
    for rank, res in enumerate(results):
        assert res["sharded"] == 4 and res["rewritten"] == 2, (rank, res)
        assert res["got"] == res["want"], (rank, res)
        assert len(res["want"][0]) == (5 + 2 if rank == 0 else 5 + rank + 6), (rank, res)


@pytest.mark.ranks
def test_shard_experts_memory_equality_and_training() -> None:
    results = run_ranks(4, "shard", worker="shard_worker.py", shape=[2, 2], kinds=["grouped_gemm", "expert_loop"], steps=2,
                        checkpoint=True, clip=0.05)
    for rank, res in enumerate(results):
        for kind, r in res.items():
            where = (rank, kind)
            assert r["local_bytes"] * 4 == r["full_bytes"], where  # 8 experts over 4 ranks: a quarter each
            # the model's parameters shrank by the experts other ranks own
            assert r["param_numel_before"] - r["param_numel_after"] == r["expert_numel"] * 3 // 4, where
            # no expert weights are copied in the step: the op reads the shard parameters (stacked
            # family) or stacks only the two local modules (E modules)
            code = r["after_code"]
            assert all(f"ep_{s}" in code for s in ("dispatch", "local_experts", "combine")), where
            assert "torch.stack" not in code or kind == "expert_loop", where
            if kind == "grouped_gemm":  # the shard is fed whole: no narrow over the expert dim
                assert re.search(r"torch\.narrow\([^,]+, 0,", code) is None, where
            else:  # two local modules stacked, not eight
                assert all(line.count("torch.stack([") == 0 or line.count(",") <= 4
                           for line in code.splitlines() if "torch.stack" in line), where
            for a, b in zip(r["losses"]["compiled"], r["losses"]["eager"], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (where, r["losses"])
            # AdamW divides by sqrt(v): on entries whose gradient is ~0, 1e-7 gradient differences
            # (summation order) become update differences of order lr; relative to the largest
            # weight that stays below 1e-4 after two steps
            assert r["weight_err"] < 1e-4, where
            if kind == "grouped_gemm":  # a deep copy's placeholders are no shard's: a clear error
                assert "copy of a sharded model" in r["copy_error"], (where, r["copy_error"])
            else:  # E modules: the copy's local modules are real and its own (zeroing them moves its loss only)
                assert not r["copy_error"] and r["copy_loss"] == pytest.approx(r["loss_now"], rel=1e-6), (where, r)
                assert abs(r["zeroed_loss"] - r["loss_now"]) > 1e-4, (where, r)
            check_checkpoint(r["checkpoint"], rank, where)
            check_optim(r["optim"], rank, where)
            # the stacked shards' optimizer rows were reordered and put back (E modules have no rows)
            assert (r["optim"]["reversed_rows"] > 0) == (kind == "grouped_gemm"), (where, r["optim"])
            # gradient clipping (0.05, active at every step): moe_compile.clip_grad_norm_'s norm is eager
            # DDP's (the losses and weights above equal eager's with it); torch's over the sharded
            # model's parameters sees this rank's experts only and is another
            norms = r["norms"]
            assert min(norms["eager"]) > 0.05, norms
            for a, b in zip(norms["compiled"], norms["eager"], strict=True):
                assert abs(a - b) <= 1e-5 * b, (where, norms)
            assert any(abs(a - b) > 1e-3 * b for a, b in zip(norms["local"], norms["eager"], strict=True)), norms


@pytest.mark.ranks
def test_sharded_experts_train_with_the_strategy_measured() -> None:
    """tune_strategy on sharded experts (each rank holds its E/G experts, so the candidates are
    timed on weights shaped as the rank holds them): every layer times the planner's best and the
    candidates within 2x of it, runs the fastest unless it is not 3 % faster than the planner's
    pick, every rank measures and chooses alike, and AdamW steps with the measured choice equal
    eager DDP of the unsharded model."""
    results = run_ranks(4, "shard", worker="shard_worker.py", shape=[2, 2], kinds=["grouped_gemm"], steps=2,
                        tune_strategy=True)
    for rank, res in enumerate(results):
        r = res["grouped_gemm"]
        assert r["pipelines"] and all("measured strategy " in p for p in r["pipelines"]), (rank, r["pipelines"])
        for plan, p in zip(r["plans"], r["pipelines"], strict=True):  # the planner's best and those within 2x
            part = p.partition("measured strategy ")[2]
            times = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", part.partition(" ms fw+bw")[0])}
            chosen = re.search(r"runs (\w+)", part).group(1)
            baseline = next(iter(times))  # the planner's pick comes first
            assert len(times) >= 2 and plan.startswith(chosen), (plan, p)
            fastest = min(times.values())
            best = {k for k, v in times.items() if v == fastest}  # ties at the printed 0.1 ms: any of them
            assert chosen in (best if fastest <= 0.97 * times[baseline] else {baseline}), p
        for a, b in zip(r["losses"]["compiled"], r["losses"]["eager"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, r["losses"])
        assert r["weight_err"] < 1e-4, rank
    assert len({tuple(res["grouped_gemm"]["pipelines"]) for res in results}) == 1


@pytest.mark.ranks
def test_stages_split_into_start_and_wait_with_independent_work_between() -> None:
    """Inductor, 2x2 mesh, DeepSeek-V3 layers (a shared expert beside the routed experts): every
    all-to-all stage with work beside it is split into start and wait, the shared expert's
    matmuls run between the dispatch's start and wait (forward) and between the combine
    backward's (backward) in the code Inductor generates, nothing is left in flight, and loss
    and summed gradients equal eager's, as they do with overlap off."""
    results = run_ranks(4, "overlap", shape=[2, 2], inner_compiler="inductor", timeout_s=600)
    for rank, res in enumerate(results):
        on, off = res["True"], res["False"]
        for r in (on, off):
            assert abs(r["loss"] - r["loss_ref"]) <= TOL * abs(r["loss_ref"]), (rank, r)
            assert r["grad_err"] < 1e-5, (rank, r)
            assert r["in_flight"] == 0, (rank, r)
        # forward: the dispatches of 2 layers (the shared expert between start and wait; their
        # combines, with nothing to run beside them, stay whole); backward: all 4 adjoints
        assert [n for n, _ in on["stages"]] == [2, 4], (rank, on)
        assert off["stages"] == [] and off.get("inductor_fw_between", -1) == -1, (rank, off)
        # the shared expert: up, gate, down in forward; their input and weight gradients in backward
        assert on["fw_between"] == on["inductor_fw_between"] == 3, (rank, on)
        assert on["bw_between"] == on["inductor_bw_between"] == 6, (rank, on)


@pytest.mark.ranks
def test_chunked_pipeline_equals_eager() -> None:
    """options pipeline = n: each layer's tokens in n chunks (one ep_begin choosing d for the
    step, n dispatch stages, all split into start and wait), loss and summed gradients equal
    eager's, with chunks of one token and empty ones (3 tokens in 5 chunks); with "auto" on a topology where
    compute and transfer are alike the cost model runs more than one chunk, and explain says how
    many, with the serial and pipelined predictions; with "tune" every rank times the same
    candidates, runs the fastest, explain shows the times, the throwaway layers are gone, and the
    second layer (the first's shapes, its own expert loads) times the graphs compiled for the
    first, compiling only candidates the first did not have (tune_strategy's rule:
    test_sharded_experts_train_with_the_strategy_measured)."""
    results = run_ranks(4, "pipeline", shape=[2, 2], dimension=None, timeout_s=600)
    for rank, res in enumerate(results):
        for label, r in res.items():
            where = (rank, label, r)
            assert abs(r["loss"] - r["loss_ref"]) <= TOL * abs(r["loss_ref"]), where
            assert r["grad_err"] < 1e-5, where
            assert r["in_flight"] == 0, where
        for label, n in (("n5 empty chunks", 5),):
            r = res[label]
            assert r["dispatches"] == 2 * n and r["begins"] == 2, (rank, label, r)  # 2 layers
            assert all(f"{n} chunks" in p for p in r["plans"]), (rank, label, r["plans"])
            # forward: all but each layer's last combine (nothing left to run beside it), backward: all
            assert [k for k, _ in r["scheduled"]] == [4 * n - 2, 4 * n], (rank, label, r)
        auto = res["auto"]  # each layer its own n (its expert loads give its busiest rank's compute)
        chosen = [int(re.match(r"n=(\d+): ", p).group(1)) for p in auto["pipelines"]]
        assert all(n > 1 for n in chosen) and sum(chosen) == auto["dispatches"], auto
        assert all("serial" in p for p in auto["pipelines"]), auto["pipelines"]
        for label in ("n5 empty chunks", "auto", "tune"):  # the tuning's throwaway layers are gone
            assert res[label]["new_layers"] == 2, (rank, label, res[label]["new_layers"])
        tune = res["tune"]
        runs, timed = [], set()
        for p in tune["pipelines"]:  # each layer's candidates: 1..4 and the model's n for it
            times = {int(k): float(v) for k, v in re.findall(r"(\d+) ([\d.]+)", p.partition("measured chunks ")[2])}
            chosen = int(re.search(r"runs (\d+)", p.partition("measured chunks ")[2]).group(1))
            assert set(times) == {1, 2, 3, 4} | {int(re.match(r"n=(\d+): ", p).group(1))}, p
            best = min(times, key=lambda k: (times[k], k))
            assert chosen == (best if times[best] <= 0.97 * times[1] else 1), p
            runs.append(chosen)
            timed |= set(times)
        assert tune["dispatches"] == sum(runs), (tune["pipelines"], tune["dispatches"])
        assert len(tune["pipelines"]) == 2 and tune["tune_compiles"] == len(timed), (tune["pipelines"], tune["tune_compiles"])
    # every rank measured the same times and chose alike
    assert len({tuple(res["tune"]["pipelines"]) for res in results}) == 1, [r["tune"]["pipelines"] for r in results]
