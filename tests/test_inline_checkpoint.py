"""passes/inline_checkpoint.py on models written with torch.utils.checkpoint: checkpointed
calls one after another and one inside another are opened, the MoE layers inside them rewritten,
and the model computes what eager computes (HF models with transformers' checkpointing:
test_hf_models.py, test_trainer.py; over ranks: test_expert_parallel.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from moe_compile.backend import collect_reports
from moe_compile.passes.inline_checkpoint import inline_checkpoints
from moe_compile.samples import SAMPLES


class TwoLayers(torch.nn.Module):
    """Two grouped-GEMM MoE layers with residuals; ``nested``: the second layer's checkpoint
    inside the first's, else one checkpoint per layer."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        spec = SAMPLES["grouped_gemm"]
        torch.manual_seed(0)
        self.a, self.b = spec.factory(**spec.kwargs), spec.factory(**spec.kwargs)
        self.nested = nested

    def second(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(x)

    def both(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.second, x + self.a(x), use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested:
            x = checkpoint(self.both, x, use_reentrant=False)
        else:
            x = checkpoint(lambda t: t + self.a(t), x, use_reentrant=False)
            x = checkpoint(self.second, x, use_reentrant=False)
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
