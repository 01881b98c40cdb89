"""find_moe_regions on small Dynamo graphs: how many regions, and the fields of each.

If one of these fails, fix the finder, not the assertion."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fuzz_moe import BIAS_FORMS, FuzzConfig, make, running_sum
from torch import nn

from moe_compile.passes import op_kinds as ops
from moe_compile.passes.find_moe_regions import FindResult, find_moe_regions
from moe_compile.samples import SAMPLES, example_input


def find(fn: object, *inputs: torch.Tensor) -> FindResult:
    """Run the finder inside a backend, where Dynamo's graph metadata (parameter sources) is live."""
    found = []

    def backend(gm: torch.fx.GraphModule, ex: list) -> object:
        found.append(find_moe_regions(gm, ex))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    assert len(found) == 1
    return found[0]


class StackedMoE(nn.Module):
    """Minimal gathered-weights MoE; `method_form` writes top-k as a tensor method."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4, k: int = 2, method_form: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)
        self.k, self.method_form = k, method_form

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        probs_TE = self.router(x_TH).softmax(-1)
        if self.method_form:
            w_TK, idx_TK = probs_TE.topk(self.k, dim=-1)
        else:
            w_TK, idx_TK = torch.topk(probs_TE, self.k, dim=-1)
        h = torch.einsum("tkfh,th->tkf", self.w_up[idx_TK], x_TH)
        y = torch.einsum("tkhf,tkf->tkh", self.w_down[idx_TK], F.relu(h))
        return (y * w_TK.unsqueeze(-1)).sum(1)


def test_call_function_and_call_method_topk_are_both_found() -> None:
    x = torch.randn(10, 16)
    for method_form in (False, True):
        found = find(StackedMoE(method_form=method_form), x)
        assert len(found.regions) == 1 and found.num_topk == 1
        r = found.regions[0]
        assert (r.num_experts, r.top_k, r.hidden_size, r.num_tokens) == (4, 2, 16, 10)
        assert r.layouts[0].ffn_size == 24 and r.layouts[0].activation == "relu" and not r.layouts[0].gated
        assert r.router == "softmax"


def test_two_layers_in_one_graph_are_two_regions() -> None:
    a, b = StackedMoE(), StackedMoE(k=1)
    found = find(lambda x: b(a(x) + x), torch.randn(6, 16))
    assert [r.top_k for r in found.regions] == [2, 1]
    # each layer's routed output lies inside its own layer
    assert found.regions[0].outputs[0].node is not found.regions[1].outputs[0].node


def test_group_limited_topk_is_part_of_the_router() -> None:
    spec = SAMPLES["deepseek_v3"]
    found = find(spec.make(), example_input(spec))
    assert found.num_topk == 3  # top-2 score per group, group selection, expert selection
    assert len(found.regions) == 1 and not found.skipped
    r = found.regions[0]
    assert "grouped" in r.router and r.router.startswith("sigmoid+bias")
    assert (r.num_experts, r.top_k) == (spec.num_experts, spec.top_k)


def test_topk_that_is_not_a_router_is_skipped_with_reason() -> None:
    def not_moe(x: torch.Tensor) -> torch.Tensor:
        vals, _ = torch.topk(x.abs(), 3, dim=-1)  # top-k of activations, no router projection
        return vals.sum(-1)

    found = find(not_moe, torch.randn(5, 16))
    assert found.regions == [] and found.num_topk == 1
    assert "not fed by a router projection" in found.skipped[0].reason


def test_no_topk_no_regions() -> None:
    found = find(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(3, 8))
    assert found.regions == [] and found.skipped == [] and found.num_topk == 0


def test_transformers_grouped_mm_fallback_op_is_recognized() -> None:
    """HF's `transformers::grouped_mm_fallback` (what grouped_mm uses for fp32 under compile)."""
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    class HFStyle(nn.Module):
        def __init__(self, h: int = 16, f: int = 12, e: int = 4, k: int = 2) -> None:
            super().__init__()
            self.gate = nn.Linear(h, e, bias=False)
            self.up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
            self.down = nn.Parameter(torch.randn(e, h, f) / f**0.5)
            self.e, self.k = e, k

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w, idx = torch.topk(self.gate(x).softmax(-1), self.k)
            ids, perm = torch.sort(idx.reshape(-1))
            xs = x[perm // self.k]
            offs = torch.cumsum(torch.histc(ids.float(), bins=self.e, min=0, max=self.e - 1), 0, dtype=torch.int32)
            h = torch.ops.transformers.grouped_mm_fallback(xs, self.up.transpose(-2, -1), offs)
            y = torch.ops.transformers.grouped_mm_fallback(F.gelu(h), self.down.transpose(-2, -1), offs)
            y = y * w.reshape(-1)[perm].unsqueeze(-1)
            out = torch.zeros_like(x)
            return out.index_add(0, perm // self.k, y)

    found = find(HFStyle(), torch.randn(9, 16))
    assert len(found.regions) == 1
    r = found.regions[0]
    assert r.pattern == "grouped_mm" and r.layouts[0].activation == "gelu" and r.layouts[0].ffn_size == 12


def test_every_sample_is_found_with_its_fields() -> None:
    for name, spec in SAMPLES.items():
        torch.manual_seed(0)
        found = find(spec.make(), example_input(spec))
        assert len(found.regions) == 1, (name, found.skipped)
        r = found.regions[0]
        assert (r.num_experts, r.top_k, r.hidden_size) == (spec.num_experts, spec.top_k, spec.hidden_size), name
        assert any(lay.ffn_size == spec.ffn_size and lay.activation == spec.activation for lay in r.layouts), name
        assert r.name.endswith("(compiled module)"), r.name


class ArgmaxRouted(nn.Module):
    """Top-2 without torch.topk: argmax, mask the winner, argmax again (PhiMoE's sparsemixer),
    and a third argmax of the scores that only feeds a confidence mask on the weights."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        first = probs.argmax(-1, keepdim=True)
        second = probs.scatter(-1, first, float("-inf")).max(dim=-1, keepdim=True)[1]
        idx = torch.cat([first, second], dim=-1)
        w = probs.gather(-1, idx) * (probs.argmax(-1, keepdim=True) >= 0)  # an argmax that picks no expert
        h = torch.einsum("tkfh,th->tkf", self.w_up[idx], x)
        y = torch.einsum("tkhf,tkf->tkh", self.w_down[idx], F.relu(h))
        return (y * w.unsqueeze(-1)).sum(1)


def test_topk_written_as_argmaxes_is_one_layer() -> None:
    found = find(ArgmaxRouted(), torch.randn(7, 16))
    assert len(found.regions) == 1 and not found.skipped, found.skipped
    r = found.regions[0]
    assert (r.num_experts, r.top_k) == (4, 2) and r.router == "softmax+argmax"
    assert ops.op_name(r.topk) == "cat"


def test_argmax_without_a_router_is_not_a_layer() -> None:
    def pick(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, x.argmax(-1, keepdim=True))  # an argmax of activations: no router, no report

    found = find(pick, torch.randn(5, 16))
    assert found.regions == [] and found.skipped == []


def test_topk_written_as_a_sort_is_found() -> None:
    spec = SAMPLES["gathered_bmm"]
    found = find(spec.make(router="softmax+sort"), example_input(spec))
    assert len(found.regions) == 1, found.skipped
    assert found.regions[0].top_k == 2 and found.regions[0].router.endswith("+sort")


def test_where_a_layer_adds_its_biases_is_read_off_the_graph() -> None:
    """``ExpertLayout.bias_in_matmul``: the op rounds a 16-bit bias as the layer does (once inside
    ``linear``, twice after a product; tests/test_experts_op.py), so the finder tells the two apart,
    for E nn.Linear modules as well as for stacked weights."""
    x = torch.randn(10, 16)
    for once in (True, False):
        r = find(running_sum("linear" if once else "add"), x).regions[0]
        assert r.layouts[0].b_up is not None and r.layouts[0].b_down is not None
        assert {lay.bias_in_matmul for lay in r.layouts} == {once}, once
        assert ("bias (in the matmul)" in r.layouts[0].describe()) == once  # what explain shows
    for storage, once in (("modules", True), ("stacked", False)):
        cfg = FuzzConfig(idiom="loop", storage=storage, router="softmax_renorm", router_bias=False, route_scale=1.0,
                         activation="relu", gated=True, bias=True, extra="none", num_experts=4, top_k=2, hidden=16,
                         ffn=12)
        r = find(make(cfg), torch.randn(1, 3, 16)).regions[0]
        assert r.layouts[0].b_gate is not None and {lay.bias_in_matmul for lay in r.layouts} == {once}, storage


def test_an_out_of_place_sum_over_stacked_experts_is_read_whole() -> None:
    """``y = y.index_add(0, tok, v)`` or ``y = y + v`` per expert over stacked weights: every
    partial sum (and, in the dense form, every expert's [T, H] contribution) reaches the [E, ...]
    tensors and has the tokens' shape, so the first three such values were the output candidates
    and the layer's own sum, the last, was never one: every interpretation failed and the layer
    was left alone. The parts are no candidates now; the last sum is the first."""
    x = torch.randn(10, 16)
    for form in BIAS_FORMS:
        found = find(running_sum(form), x)
        r = found.regions[0]
        index_adds = [n for n in found.index.nodes if ops.op_name(n) == "index_add"]
        assert len(index_adds) == 4 and r.outputs[0].node is index_adds[-1], (r.outputs, index_adds)
    cfg = FuzzConfig(idiom="dense", storage="stacked", router="softmax_renorm", router_bias=False, route_scale=1.0,
                     activation="silu", gated=True, bias=False, extra="clamp_gate", num_experts=4, top_k=2, hidden=16,
                     ffn=12, accumulate="out_of_place")
    r = find(make(cfg), torch.randn(2, 3, 16)).regions[0]
    # the sum of all 4 experts: its expression activation is read off every expert's clamp
    assert r.layouts[0].activation.startswith("expr:") and len(r.layouts[0].activation_nodes) >= 4


def test_experts_whose_projections_are_numbered_are_one_family_each() -> None:
    """Each expert an ``nn.ModuleList`` (or ``nn.Sequential``) of its projections:
    ``experts.3.0.weight``. The expert index is not the last number of the path; reading the last
    one (the projection's: 0, 1, 2, no E experts) found no family, took every expert's output for an
    input of the layer, and the layer was not found at all."""
    for gated in (False, True):
        cfg = FuzzConfig(idiom="loop", storage="sequential", router="softmax_renorm", router_bias=False,
                         route_scale=1.0, activation="silu", gated=gated, bias=True, extra="none", num_experts=4,
                         top_k=2, hidden=16, ffn=12)
        found = find(make(cfg), torch.randn(2, 3, 16))
        assert len(found.regions) == 1, found.skipped
        lay = found.regions[0].layouts[0]
        assert lay.up.names == tuple(f"experts.{e}.0.weight" for e in range(4)), lay.up.names
        assert lay.down.names == tuple(f"experts.{e}.{2 if gated else 1}.weight" for e in range(4))
        assert (lay.gate is not None) == gated and lay.b_down is not None


def test_per_expert_masked_weights_leave_the_routing_weights_to_the_op() -> None:
    """A dense loop that takes each expert's weight out of the top-k values, ``(w * (idx ==
    e)).sum(-1)``: its E masked [T, K] products came after ``w`` and filled the [T, K] weight
    candidates, so every interpretation read one expert's share as the weights and was refused.
    They are no candidates now; ``w`` is."""
    for accumulate in ("in_place", "out_of_place"):
        cfg = FuzzConfig(idiom="dense", storage="stacked", router="softmax_renorm", router_bias=False,
                         route_scale=1.0, activation="silu", gated=True, bias=False, extra="none", num_experts=4,
                         top_k=2, hidden=16, ffn=12, accumulate=accumulate, dense_weights="masked_sum")
        found = find(make(cfg), torch.randn(2, 3, 16))
        assert len(found.regions) == 1, found.skipped
        topk = [w.node for w in found.regions[0].weights if w.kind == "topk"]
        masks = [n for n in found.index.nodes if ops.op_name(n) == "eq"]
        assert topk and len(masks) == 4 and not found.index.ancestors(topk) & set(masks), (topk, masks)


class _RawTop2Of2(nn.Module):
    """Two experts, top-2, the top-k values used as they come: ``w`` and ``idx`` are the two
    outputs of one top-k, alike but for their index (and dtype), and E = 2 of them."""

    def __init__(self, h: int = 16, f: int = 24) -> None:
        super().__init__()
        self.router = nn.Linear(h, 2, bias=False)
        self.w_up = nn.Parameter(torch.randn(2, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(2, h, f) / f**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(F.softmax(self.router(x), dim=-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(2):
            tok, k = torch.where(idx == e)
            out.index_add_(0, tok, F.gelu(x[tok] @ self.w_up[e].t()) @ self.w_down[e].t() * w[tok, k, None])
        return out


def test_the_top_k_values_are_no_per_expert_copy_at_two_experts() -> None:
    """The per-expert copies (``_per_expert_copies``) are E nodes alike but for constants; a
    top-k's values and indices are two such nodes (``getitem(topk, 0)``, ``getitem(topk, 1)``), so
    at E = 2 the values are told apart by their dtype, and stay the routing weights."""
    found = find(_RawTop2Of2(), torch.randn(10, 16))
    assert len(found.regions) == 1, found.skipped
    topk = next(n for n in found.index.nodes if ops.op_name(n) == "topk")
    values = next(u for u in topk.users if u.args[1] == 0)
    assert any(w.node is values for w in found.regions[0].weights), found.regions[0].weights
