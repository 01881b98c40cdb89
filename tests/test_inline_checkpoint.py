"""passes/inline_checkpoint.py on models written with torch.utils.checkpoint: checkpointed
calls one after another and one inside another are opened, the MoE layers inside them rewritten,
and the model computes what eager computes; selective checkpoints (a context_fn) are closed again
around the rewritten layers, their policy asked about the expert op's matmuls, and a layer cut by
one's boundary is left alone (HF models with transformers' checkpointing: test_hf_models.py,
test_trainer.py; over ranks: test_expert_parallel.py)."""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import pytest
import torch
from compile_utils import SAVE_GROUPED, ExpertsCheckpointed, selective_policy
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from moe_compile.backend import collect_reports
from moe_compile.passes.checkpoint_policy import asking_as_written, policy_saves, written_matmuls
from moe_compile.passes.inline_checkpoint import inline_checkpoints
from moe_compile.samples import SAMPLES
from moe_compile.samples.grouped_gemm import GroupedGemmMoE


class TwoLayers(torch.nn.Module):
    """Two grouped-GEMM MoE layers with residuals; ``nested``: the second layer's checkpoint
    inside the first's, else one checkpoint per layer."""

    def __init__(self, nested: bool, **checkpoint_kwargs: Any) -> None:
        super().__init__()
        spec = SAMPLES["grouped_gemm"]
        torch.manual_seed(0)
        self.a, self.b = spec.factory(**spec.kwargs), spec.factory(**spec.kwargs)
        self.nested = nested
        self.kwargs = {"use_reentrant": False, **checkpoint_kwargs}  # context_fn: selective checkpointing

    def second(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(x)

    def both(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.second, x + self.a(x), **self.kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested:
            x = checkpoint(self.both, x, **self.kwargs)
        else:
            x = checkpoint(lambda t: t + self.a(t), x, **self.kwargs)
            x = checkpoint(self.second, x, **self.kwargs)
        return x.square().mean()


@pytest.mark.parametrize("nested", [False, True])
def test_checkpointed_calls_are_opened_and_their_layers_rewritten(nested: bool) -> None:
    torch._dynamo.reset()
    model = TwoLayers(nested)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    want.backward()
    with collect_reports() as graphs:
        got = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})(x)
        got.backward()
    assert [len(g.regions) for g in graphs] == [2], [s.reason for g in graphs for s in g.skipped]
    assert all("activation-checkpointed" in r.layout for r in graphs[0].regions)
    assert graphs[0].counters["inline_checkpoint"]["inlined"] == 2
    assert torch.allclose(got, want, rtol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_opened_nodes_carry_one_recompute_tag_per_call() -> None:
    """What AOTAutograd's own tracing of the calls would give the partitioner: every op of a call
    PREFER_RECOMPUTE with that call's ac_graph_id (the nested call's ops with their own), and no
    checkpoint call or body left."""
    captured = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        res = inline_checkpoints(gm)
        captured.append((res, gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(TwoLayers(nested=True), backend=backend)(torch.randn(2, 8, 32))
    (res, gm), = captured
    assert res.inlined == 2 and res.kept == []
    assert not any(n.target is torch.ops.higher_order.tag_activation_checkpoint for n in gm.graph.nodes)
    assert not any(name.startswith("wrap_body") for name, _ in gm.named_children())
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    tags = {n.meta.get("ac_graph_id") for n in calls if n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE}
    assert len(tags) == 2  # the outer call's ops and the inner call's
    # the routers of both layers are in the opened graph: one in each call
    topks = [n for n in calls if n.target in (torch.topk, "topk")]
    assert len({n.meta["ac_graph_id"] for n in topks}) == 2
    # the final loss is outside any checkpoint
    loss = [n for n in gm.graph.nodes if n.target == "mean"]
    assert len(loss) == 1 and "recompute" not in loss[0].meta


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_selective_checkpoints_are_closed_again_around_the_rewritten_layers(inner: str) -> None:
    """A checkpoint with a context_fn (selective: its policy decides per op what backward
    recomputes) is opened so its layer is found, then closed again around the rewritten layer with
    the same context_fn: the policy is asked about the expert op's own matmuls, and the model
    computes what eager computes. With aot_eager also a policy that saves the grouped matmuls'
    outputs, which must keep more (Inductor compiles one policy: its compile is the slow part)."""
    from compile_utils import kept_for_backward

    kept: dict[str, int] = {}
    for save in ((), SAVE_GROUPED) if inner == "aot_eager" else ((),):
        torch._dynamo.reset()
        seen: list[str] = []
        model = TwoLayers(nested=False, context_fn=selective_policy(seen, save))
        ref = copy.deepcopy(model)
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
        want = ref(x)
        want.backward()
        compiled = torch.compile(model, backend="hiermoe", options={"inner_compiler": inner})
        with collect_reports() as graphs:
            compiled(x).backward()
        model.zero_grad()
        with kept_for_backward(model) as saved:
            got = compiled(x)
        got.backward()
        kept[str(save)] = sum(saved)
        assert [len(g.regions) for g in graphs] == [2], [s.reason for g in graphs for s in g.skipped]
        assert all("selectively activation-checkpointed" in r.layout for r in graphs[0].regions)
        counters = graphs[0].counters["inline_checkpoint"]
        assert counters["selective"] == 2 and counters["selective_closed"] == 2, counters
        assert "hiermoe.grouped_mm.default" in seen or "hiermoe.grouped_mm_rows.default" in seen, set(seen)
        assert torch.allclose(got, want, rtol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    if inner == "aot_eager":  # saving the grouped matmuls' outputs keeps more than recomputing them
        assert kept[str(SAVE_GROUPED)] > kept["()"], kept


class RouterCheckpointed(GroupedGemmMoE):
    """A grouped-GEMM MoE layer whose router alone runs in a selective checkpoint."""

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return checkpoint(super().route, x_TH, use_reentrant=False, context_fn=selective_policy([], ()))


def test_layer_cut_by_a_selective_checkpoint_is_left_alone() -> None:
    """A layer whose router is in a selective checkpoint and whose experts are not: the policy
    could not be applied to one expert op as to the ops it would replace, so the layer stays as
    written, the report says why, and the checkpoint is closed again as it was."""
    torch._dynamo.reset()
    spec = SAMPLES["grouped_gemm"]
    torch.manual_seed(0)
    model = RouterCheckpointed(**spec.kwargs)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    want = ref(x).square().mean()
    want.backward()
    with collect_reports() as graphs:
        got = torch.compile(model, backend="hiermoe", options={"inner_compiler": "aot_eager"})(x).square().mean()
        got.backward()
    assert [len(g.regions) for g in graphs] == [0]
    reasons = [s.reason for g in graphs for s in g.skipped]
    assert any("partly inside a selective activation checkpoint" in r for r in reasons), reasons
    assert graphs[0].counters["inline_checkpoint"]["selective_closed"] == 1
    assert torch.allclose(got, want, rtol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_mesh_of_one_rank_runs_the_layers_in_its_selective_checkpoints_replicated() -> None:
    """A mesh of one rank (torchrun with one process) holds every expert: its layers, here inside
    selective checkpoints, are planned replicated (nothing to send) and rewritten, and the model
    computes what eager computes. Before, the planner found no strategy for one rank and the
    compile failed. (Over 2 ranks, with the exchanges: test_expert_parallel.py.)"""
    from dist_utils import one_rank_group
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = TwoLayers(nested=False, context_fn=selective_policy([], ()))
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    want.backward()
    with one_rank_group(), collect_reports() as graphs:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("gpu",))
        got = torch.compile(model, backend="hiermoe", options={"mesh": mesh, "inner_compiler": "aot_eager"})(x)
        got.backward()
    assert [len(g.regions) for g in graphs] == [2], [s.reason for g in graphs for s in g.skipped]
    assert all(r.plan.startswith("replicated") for r in graphs[0].regions), [r.plan for r in graphs[0].regions]
    assert torch.allclose(got, want, rtol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_a_selective_checkpoints_policy_is_asked_about_the_grouped_matmuls() -> None:
    """What an expert-parallel local expert stage keeps under a selective checkpoint (it stays
    outside the checkpoint, test_expert_parallel.py) is the policy's answer about the gate and up
    projections' grouped matmuls, torch's or the expert op's, or the matmuls the layer was written
    with; a policy that cannot be asked so (it
    reads the op's arguments, or the context_fn is not torch's) is named, and the stage keeps them."""
    def reads_args(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if args[0].ndim == 2 else CheckpointPolicy.PREFER_RECOMPUTE

    assert policy_saves(selective_policy([], ())) is False
    assert policy_saves(selective_policy([], SAVE_GROUPED)) is True
    torch_ops = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten._grouped_mm.default])
    assert policy_saves(torch_ops) is True
    # a policy naming the matmuls the layer was written with (Linear experts: mm / addmm)
    saving_mm = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    assert policy_saves(saving_mm) is False
    assert policy_saves(saving_mm, (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)) is True
    assert "its policy raised IndexError" in str(policy_saves(
        functools.partial(create_selective_checkpoint_contexts, reads_args)))
    assert "does not come from" in str(policy_saves(
        lambda: (contextlib.nullcontext(), contextlib.nullcontext())))
    assert policy_saves(None) == "the checkpoint has no context_fn"


def test_the_policy_answers_for_the_expert_ops_matmuls_as_for_the_written_ones() -> None:
    """The matmuls a layer was written with (Dynamo's targets) are named as AOTAutograd names them
    to a policy; asked about the expert op's matmul, the wrapped policy saves it where it saves
    that op or one of those, other ops as before; for a policy that reads the arguments its answer
    for the op stands; a context_fn that is not torch's stays as it is."""
    aten, ctx = torch.ops.aten, SelectiveCheckpointContext(is_recompute=False)
    g = torch.fx.Graph()
    x, w, idx = (g.placeholder(n) for n in ("x", "w", "idx"))
    nodes = [g.call_function(torch.nn.functional.linear, (x, w)), g.call_function(torch._grouped_mm, (x, w)),
             g.call_function(torch.sort, (idx,)), g.call_method("bmm", (x, w))]
    assert written_matmuls(nodes[2:3]) == ()
    assert written_matmuls(nodes[:1]) == (aten.addmm.default, aten.mm.default)
    assert written_matmuls(nodes) == (aten._grouped_mm.default, aten.addmm.default, aten.bmm.default, aten.mm.default)
    expert_mm = torch.ops.hiermoe.grouped_mm.default
    saving_grouped = functools.partial(create_selective_checkpoint_contexts, [aten._grouped_mm.default])
    forward, _ = asking_as_written(saving_grouped, (aten._grouped_mm.default,))()
    assert forward.policy_fn(ctx, expert_mm) == CheckpointPolicy.MUST_SAVE
    assert forward.policy_fn(ctx, aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    forward, _ = asking_as_written(saving_grouped, (aten.addmm.default, aten.mm.default))()  # Linear experts
    assert forward.policy_fn(ctx, expert_mm) == CheckpointPolicy.PREFER_RECOMPUTE
    saving_mm = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])
    forward, _ = asking_as_written(saving_mm, (aten.addmm.default, aten.mm.default))()
    assert forward.policy_fn(ctx, expert_mm) == CheckpointPolicy.MUST_SAVE
    saving_expert_op = functools.partial(create_selective_checkpoint_contexts, [expert_mm])  # named as such
    forward, _ = asking_as_written(saving_expert_op, (aten._grouped_mm.default,))()
    assert forward.policy_fn(ctx, expert_mm) == CheckpointPolicy.MUST_SAVE

    def reads_args(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if args[0].ndim == 2 else CheckpointPolicy.PREFER_RECOMPUTE

    forward, _ = asking_as_written(functools.partial(create_selective_checkpoint_contexts, reads_args),
                                   (aten._grouped_mm.default,))()
    assert forward.policy_fn(ctx, expert_mm, torch.ones(2, 2)) == CheckpointPolicy.MUST_SAVE
    assert forward.policy_fn(ctx, expert_mm, torch.ones(2, 2, 2)) == CheckpointPolicy.PREFER_RECOMPUTE
    modes = (contextlib.nullcontext(), contextlib.nullcontext())
    assert asking_as_written(lambda: modes, (aten.mm.default,))() is modes


@pytest.mark.parametrize("selective", [False, True])
def test_checkpoint_around_the_experts_alone_takes_the_expert_op(selective: bool) -> None:
    """The router is outside the checkpoint and the experts inside: the expert op that replaces
    them goes into that checkpoint (recomputed in backward, or under the policy), and the model
    computes what eager computes. Before, the op was recomputed by neither: plain, it kept
    2.5x what torch.compile without hiermoe keeps (389 against 156 KB)."""
    from compile_utils import kept_for_backward

    kept = {}
    for backend in ("aot_eager", "hiermoe"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ExpertsCheckpointed(selective_policy([], ()) if selective else None, **SAMPLES["grouped_gemm"].kwargs)
        ref = copy.deepcopy(model)
        x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))
        opts = {"options": {"inner_compiler": "aot_eager"}} if backend == "hiermoe" else {}
        compiled = torch.compile(model, backend=backend, **opts)
        with collect_reports() as graphs:
            compiled(x).square().mean().backward()
        model.zero_grad()
        with kept_for_backward(model) as saved:
            got = compiled(x).square().mean()
        got.backward()
        kept[backend] = sum(saved)
        want = ref(x).square().mean()
        want.backward()
        assert torch.allclose(got, want, rtol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    (layer,) = [r for g in graphs for r in g.regions]
    assert layer.layout.endswith("selectively activation-checkpointed (the checkpoint's policy decides what backward "
                                 "recomputes)" if selective else "activation-checkpointed (recomputed in backward)")
    assert kept["hiermoe"] <= kept["aot_eager"], kept
