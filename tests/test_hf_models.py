"""Hugging Face transformers MoE models from small random configs, compiled with hiermoe: Mixtral's
fields in detail, the eager experts implementation's graph break, GPT-OSS's expression activation
and the hiermoe experts implementation.  Every MoE family under both stock implementations is
tests/test_zoo.py."""

from __future__ import annotations

import pytest
import torch
from compile_utils import compare_compiled, kept_for_backward, op_count
from hf_models import build, input_ids

import moe_compile

pytest.importorskip("transformers")


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_mixtral_grouped_and_batched_mm(impl: str) -> None:
    model = build("mixtral", impl)
    cmp = compare_compiled(model, [input_ids()], input_grads=False)
    cmp.assert_close()
    assert len(cmp.report.regions) == 2 and op_count(cmp.report) == 2
    assert {r.pattern for r in cmp.report.regions} == {"grouped_mm" if impl == "grouped_mm" else "gathered_bmm"}
    r = cmp.report.regions[0]
    assert (r.num_experts, r.top_k, r.hidden_size, r.ffn_size, r.activation, r.gated) == (8, 2, 32, 48, "silu", True)
    assert r.router == "softmax+renorm"
    assert [r.name for r in cmp.report.regions] == ["model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_expert_parallel_sentinel_masks_are_routing_selections(impl: str) -> None:
    """transformers' expert-parallel form of the experts (``_is_expert_parallel``; always on in
    5.17's grouped_mm): slots whose id is >= E are masked (``masked_fill(ids >= E, 0)``) and the
    ids clamped. A mask read off the expert ids is a routing selection, like ``where``: the layer
    is rewritten and equals eager (every id a router picks is < E, so the masks select nothing)."""
    model = build("mixtral", impl)
    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
    assert experts
    for m in experts:
        m._is_expert_parallel = True
    cmp = compare_compiled(model, [input_ids()], input_grads=False)
    cmp.assert_close()
    assert len(cmp.report.regions) == 2 and op_count(cmp.report) == 2, cmp.report


def test_eager_experts_implementation_reports_the_graph_break() -> None:
    """HF's eager experts loop over `expert_hit` (a data-dependent tensor) splits the graph: nothing
    can be rewritten, the model still runs, and the report says why and what to change."""
    model = build("mixtral", "eager")
    ids = input_ids()
    # the reasons come from the passes, before the inner compiler: "eager" spares compiling each
    # of the pieces the breaks leave with AOTAutograd
    report = moe_compile.explain(model, ids, options={"inner_compiler": "eager"})
    assert report.regions == []
    reasons = " ".join(s.reason for s in report.skipped)
    assert "graph break" in reasons
    # Mixtral has an experts interface, so the report names the switch that fixes it
    assert "mixtral models can switch their experts code: `model.set_experts_implementation" in reasons, reasons
    assert report.graph_breaks


def test_gpt_oss_clamped_swiglu_is_rewritten_as_an_expression() -> None:
    """GPT-OSS clamps gate and up, scales the gate inside the sigmoid and adds 1 to up, over
    interleaved gate/up columns with biases: the op computes that as an ``expr:`` activation."""
    model = build("gpt_oss")
    cmp = compare_compiled(model, [input_ids()], input_grads=False)
    cmp.assert_close()
    assert len(cmp.report.regions) == 2 and op_count(cmp.report) == 2, cmp.report
    r = cmp.report.regions[0]
    assert r.activation == ("expr:mul(add(clamp(u,-7.0,7.0),1.0),mul(clamp(g,None,7.0),"
                            "sigmoid(mul(clamp(g,None,7.0),1.702))))")
    assert "interleaved" in r.layout and r.bias


def test_hiermoe_experts_implementation() -> None:
    """set_experts_implementation("hiermoe") routes HF experts straight to the op, in eager and
    compiled, with the same results as grouped_mm; the report lists the layers."""
    model = build("mixtral", "grouped_mm")
    ids = input_ids()
    ref = model(ids).logits
    model.set_experts_implementation("hiermoe")
    got = model(ids).logits
    assert (got - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
    cmp = compare_compiled(model, [ids], input_grads=False)
    cmp.assert_close()
    assert [r.pattern for r in cmp.report.regions] == ["experts_interface"] * 2
    assert op_count(cmp.report) == 2


def test_hiermoe_experts_implementation_rejects_custom_gate() -> None:
    model = build("gpt_oss", "grouped_mm")
    model.set_experts_implementation("hiermoe")
    with pytest.raises(ValueError, match="gating function"):
        model(input_ids())


def test_hiermoe_experts_implementation_gradients_match() -> None:
    ids = input_ids()
    grads = {}
    for impl in ("grouped_mm", "hiermoe"):
        model = build("qwen3_moe", impl)
        model(ids).logits.square().mean().backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["grouped_mm"].keys() == grads["hiermoe"].keys()
    for n, g in grads["grouped_mm"].items():
        assert torch.allclose(grads["hiermoe"][n], g, rtol=1e-4, atol=1e-6), n


def _checkpointed_step(backend: str | None, checkpointing: str | None) -> dict[str, object]:
    """One forward + backward of a 2-layer Mixtral (``checkpointing``: None, "reentrant", "plain",
    "selective" or "selective saving grouped matmuls", the last two with a context_fn), eager or compiled (a warm-up call first, so that the
    measured call does not count what compiling saves): its loss, gradients, the layers hiermoe
    rewrote and the reasons for the others, and the bytes of activations autograd kept for
    backward (the saved tensors that are not parameters)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from moe_compile.backend import collect_reports

    torch._dynamo.reset()
    model = build("mixtral")
    model.train()
    if checkpointing is not None:
        kwargs: dict[str, object] = {"use_reentrant": checkpointing == "reentrant"}
        if checkpointing == "selective":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                     lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
        elif checkpointing == "selective saving grouped matmuls":  # a policy written for the model's own ops:
            # torch's grouped matmul, and the op transformers runs its grouped_mm experts on where
            # torch._grouped_mm has no kernel (CPU)
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, [
                torch.ops.aten._grouped_mm.default, torch.ops.transformers.grouped_mm_fallback.default])
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    fn = model if backend is None else torch.compile(
        model, backend=backend, **({"options": {"inner_compiler": "aot_eager"}} if backend == "hiermoe" else {}))
    ids = input_ids(seq=16)
    with collect_reports() as graphs:
        fn(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad()
        with kept_for_backward(model) as kept:
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
    return {"loss": loss.detach(), "grads": [p.grad for p in model.parameters()], "kept": sum(kept),
            "rewritten": sum(len(g.regions) for g in graphs), "reasons": [s.reason for g in graphs for s in g.skipped],
            "layouts": [r.layout for g in graphs for r in g.regions]}


def test_activation_checkpointed_layers_are_rewritten_and_recomputed() -> None:
    """transformers' activation checkpointing (reentrant here; the Trainer test runs the default)
    wraps each decoder layer in torch.utils.checkpoint, which Dynamo hands the backend as a
    subgraph. Before, no MoE layer of such a model was found ("no top-k router in this graph");
    now both are rewritten, loss and gradients equal eager with checkpointing, and backward still
    recomputes the layers: it keeps about the activations torch.compile without hiermoe keeps
    with checkpointing (measured 38 against 34 KB, eager 42 KB; the difference is the op's token
    positions), a fifth of the 176 KB the rewritten model keeps without checkpointing."""
    eager = _checkpointed_step(None, "reentrant")
    ours = _checkpointed_step("hiermoe", "reentrant")
    assert ours["rewritten"] == 2, ours["reasons"]
    assert all(lay.endswith("activation-checkpointed (recomputed in backward)") for lay in ours["layouts"])
    assert torch.allclose(ours["loss"], eager["loss"], rtol=1e-6)
    for g, ref in zip(ours["grads"], eager["grads"], strict=True):
        assert torch.allclose(g, ref, rtol=1e-5, atol=1e-7)
    # what torch.compile without hiermoe keeps with checkpointing (measured: the rewrite's nodes
    # without their region's recompute tag keep 119 KB, the model without checkpointing 176 KB)
    aot = _checkpointed_step("aot_eager", "reentrant")
    assert ours["kept"] <= 1.25 * aot["kept"], (ours["kept"], aot["kept"])


def test_selective_activation_checkpointing_is_rewritten_under_its_policy() -> None:
    """A checkpoint with a context_fn decides per op at run time what to keep. hiermoe opens it to
    find the layer, then closes it again around the rewritten layer with the same context_fn, so
    the policy decides for the expert op's matmuls too: both layers rewritten, loss and gradients
    equal eager's, and with a recompute-everything policy it keeps about what torch.compile
    without hiermoe keeps (measured 38 against 34 KB)."""
    eager = _checkpointed_step(None, "selective")
    ours = _checkpointed_step("hiermoe", "selective")
    assert ours["rewritten"] == 2, ours["reasons"]
    assert all("selectively activation-checkpointed" in lay for lay in ours["layouts"]), ours["layouts"]
    assert torch.allclose(ours["loss"], eager["loss"], rtol=1e-6)
    for g, ref in zip(ours["grads"], eager["grads"], strict=True):
        assert torch.allclose(g, ref, rtol=1e-5, atol=1e-7)
    aot = _checkpointed_step("aot_eager", "selective")
    assert ours["kept"] <= 1.25 * aot["kept"], (ours["kept"], aot["kept"])


def test_a_policy_naming_the_models_matmuls_decides_for_the_expert_op() -> None:
    """A selective checkpoint's policy is written for the ops the model runs: here it saves the
    Mixtral experts' grouped matmuls (``aten._grouped_mm``, on CPU transformers'
    ``grouped_mm_fallback``), whose outputs plain torch.compile keeps.
    The rewritten layer's matmuls are the expert op's (``hiermoe.grouped_mm``), which the policy
    does not name; it is asked about them as about the matmuls they replaced, so they are kept as
    well: hiermoe keeps more than under a recompute-everything policy and about what torch.compile
    keeps under this one. Before, it kept what the recompute-everything policy keeps (the expert
    matmuls recomputed in backward, against the policy)."""
    eager = _checkpointed_step(None, "selective saving grouped matmuls")
    ours = _checkpointed_step("hiermoe", "selective saving grouped matmuls")
    recompute = _checkpointed_step("hiermoe", "selective")
    aot = _checkpointed_step("aot_eager", "selective saving grouped matmuls")
    assert ours["rewritten"] == 2, ours["reasons"]
    assert torch.allclose(ours["loss"], eager["loss"], rtol=1e-6)
    for g, ref in zip(ours["grads"], eager["grads"], strict=True):
        assert torch.allclose(g, ref, rtol=1e-5, atol=1e-7)
    assert ours["kept"] > recompute["kept"], (ours["kept"], recompute["kept"])
    assert 0.75 * aot["kept"] <= ours["kept"] <= 1.25 * aot["kept"], (ours["kept"], aot["kept"])
