"""Routers written in the less common ways, compiled with hiermoe against eager (outputs and
every gradient, compile_utils' fp32 tolerance: summation order only).

Each layer must be rewritten into one expert op, with the routing left as written: a latent
projection before the logits while the experts read the tokens themselves, a top-k written as
masked argmaxes, a fixed token -> experts table (hash routing), group-limited greedy routing, a
skip class the router masks; and a routed sum scaled and mixed with a gated shared expert and a
norm after it (the routed part rewritten, the rest kept). Routing weights that scale the experts'
input (Llama-4) instead of their output are rewritten as such, and a layer that scales both is
left alone.
If one fails, fix the finder, not the assertion.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compile_utils import compare_compiled, op_count
from test_finder import ArgmaxRouted
from torch import nn


class LatentRouted(nn.Module):
    """logits = W_r gelu(W_lat x + b) (a latent projection to H/2, as Zaya's router MLP); the
    experts read x itself, in a range(E) loop."""

    def __init__(self, h: int = 32, f: int = 48, e: int = 8, k: int = 2) -> None:
        super().__init__()
        self.latent = nn.Linear(h, h // 2)
        self.router = nn.Linear(h // 2, e, bias=False)
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)
        self.e, self.k = e, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(self.router(F.gelu(self.latent(x))).softmax(-1), self.k)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(idx == e)
            y = F.linear(F.relu(F.linear(x[tok], self.w_up[e])), self.w_down[e])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


def test_latent_projection_before_the_logits() -> None:
    torch.manual_seed(0)
    cmp = compare_compiled(LatentRouted(), [torch.randn(10, 32)])
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1, cmp.report.skipped
    r = cmp.report.regions[0]
    assert (r.hidden_size, r.num_experts, r.top_k) == (32, 8, 2)  # the experts' H, not the router's H/2


def test_argmax_router_compiles_and_matches_eager() -> None:
    torch.manual_seed(0)
    cmp = compare_compiled(ArgmaxRouted(), [torch.randn(9, 16)])
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1
    assert cmp.report.regions[0].router == "softmax+argmax"


class HashRouted(nn.Module):
    """DeepSeek-V4's hash layer: the experts of each token are a fixed table's row for its token
    id (``tid2eid[input_ids]``), weighted by the router's scores gathered there, renormalized."""

    def __init__(self, vocab: int = 50, h: int = 16, f: int = 24, e: int = 8, k: int = 2) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.register_buffer("tid2eid", torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(vocab)]))
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * f, h) / h**0.5)
        self.down = nn.Parameter(torch.randn(e, h, f) / f**0.5)
        self.e = e

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        scores = F.softplus(self.router(x)).sqrt()
        idx = self.tid2eid[input_ids.reshape(-1)].long()
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(gate) * up, self.down[e]) * w[tok, slot, None])
        return out


def test_hash_table_routing() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(1))
    cmp = compare_compiled(HashRouted(), [torch.randn(12, 16), ids])
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1, cmp.report.skipped
    assert "table" in cmp.report.regions[0].router


class GroupLimitedGreedy(nn.Module):
    """DeepSeek-V2's group-limited greedy routing: each group scored by its best expert (a max,
    not V3's top-2 sum), the best ``topk_group`` groups kept by masking the others to 0, then the
    top-k of what is left; softmax scores as weights, times a route scale."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 8, k: int = 2, groups: int = 4, topk_group: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)
        self.e, self.k, self.groups, self.topk_group = e, k, groups, topk_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        group_scores = scores.view(x.shape[0], self.groups, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, self.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = group_mask.unsqueeze(-1).expand(-1, -1, self.e // self.groups).reshape(x.shape[0], -1)
        w, idx = torch.topk(scores.masked_fill(~mask.bool(), 0.0), self.k, dim=-1)
        w = w * 16.0
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, F.linear(F.gelu(F.linear(x[tok], self.w_up[e])), self.w_down[e]) * w[tok, slot, None])
        return out


def test_group_limited_greedy_routing() -> None:
    torch.manual_seed(0)
    cmp = compare_compiled(GroupLimitedGreedy(), [torch.randn(10, 16)])
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1, cmp.report.skipped
    assert "grouped" in cmp.report.regions[0].router


class SkipRouted(nn.Module):
    """Zaya's skip expert: the router scores E + 1 classes; a token whose slot picks the last one
    gets expert 0 with weight 0 there (the ids and the weights are masked before the experts)."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(h, e + 1, bias=True)
        with torch.no_grad():
            self.router.bias[-1] = 1.0  # the skip class is picked often
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)
        self.e, self.k = e, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(self.router(x).softmax(-1), self.k)
        skip = idx == self.e
        w, idx = w.masked_fill(skip, 0), idx.masked_fill(skip, 0)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, F.linear(F.silu(F.linear(x[tok], self.w_up[e])), self.w_down[e]) * w[tok, slot, None])
        return out


def test_skip_class_masked_before_the_experts() -> None:
    """The op must read the masked ids: the raw ones name an expert that does not exist.  (Had
    it read them, verification's routings, drawn over all E + 1 classes, would refuse it.)"""
    torch.manual_seed(0)
    model = SkipRouted()
    x = torch.randn(12, 16)
    assert (torch.topk(model.router(x), 2).indices == 4).any()  # the compile batch picks the skip class
    cmp = compare_compiled(model, [x])
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1, cmp.report.skipped
    assert cmp.report.regions[0].num_experts == 4


class MixedAfterTheSum(nn.Module):
    """The routed sum scaled by a learned vector, a sigmoid-gated shared expert added (Qwen2-MoE),
    then a norm with its own weight: the routed part is rewritten, the rest stays as written."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.w_up = nn.Parameter(torch.randn(e, f, h) / h**0.5)
        self.w_down = nn.Parameter(torch.randn(e, h, f) / f**0.5)
        self.routed_scale = nn.Parameter(1 + 0.1 * torch.randn(h))
        self.shared_gate = nn.Linear(h, 1, bias=False)
        self.shared = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))
        self.norm = nn.LayerNorm(h)
        self.e, self.k = e, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(self.router(x).softmax(-1), self.k)
        routed = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(idx == e)
            routed.index_add_(0, tok, F.linear(F.silu(F.linear(x[tok], self.w_up[e])), self.w_down[e]) * w[tok, slot, None])
        out = routed * self.routed_scale + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return self.norm(out)


def test_what_follows_the_routed_sum_stays_as_written() -> None:
    torch.manual_seed(0)
    cmp = compare_compiled(MixedAfterTheSum(), [torch.randn(10, 16)])
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1, cmp.report.skipped
    after = cmp.report.after
    assert "routed_scale" in after and "shared_gate" in after and "layer_norm" in after


class InputScaled(nn.Module):
    """Llama-4's routing, written as a sparse loop: each expert computes FFN_e(w x) on its tokens,
    so the routing weights scale the experts' input, not their output. ``both``: the output is
    weighted again (w FFN(w x)), which no interpretation computes."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4, k: int = 2, bias: bool = False, both: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.gate = nn.ModuleList(nn.Linear(h, f, bias=bias) for _ in range(e))
        self.up = nn.ModuleList(nn.Linear(h, f, bias=bias) for _ in range(e))
        self.down = nn.ModuleList(nn.Linear(f, h, bias=bias) for _ in range(e))
        self.e, self.k, self.both = e, k, both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(self.router(x), self.k)
        w = torch.sigmoid(w)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(idx == e)
            xs = x[tok] * w[tok, slot, None]
            y = self.down[e](F.silu(self.gate[e](xs)) * self.up[e](xs))
            out.index_add_(0, tok, y * w[tok, slot, None] if self.both else y)
        return out


@pytest.mark.parametrize("k,bias", [(1, False), (2, False), (2, True)])
def test_routing_weights_that_scale_the_experts_input(k: int, bias: bool) -> None:
    """sum_k FFN_k(w_k x) is rewritten (the op gets K rows per token, w_k x each, routed to one
    expert) and equals eager, forward and backward, with and without biases; the report says
    the weights scale the input."""
    torch.manual_seed(0)
    cmp = compare_compiled(InputScaled(k=k, bias=bias), [torch.randn(12, 16)])
    cmp.assert_close()
    assert len(cmp.report.regions) == 1 and op_count(cmp.report) == 1, cmp.report.skipped
    region = cmp.report.regions[0]
    # the op's rows: one per token and expert, each to one expert
    assert (region.top_k, region.num_tokens) == (1, 12 * k) and "weights scale the input" in region.layout, region


def test_routing_weights_on_input_and_output_leave_the_layer_alone() -> None:
    """w FFN(w x): neither reading of the weights computes it, so verification refuses both and
    the layer stays as written (and equal to eager)."""
    torch.manual_seed(0)
    cmp = compare_compiled(InputScaled(both=True), [torch.randn(12, 16)])
    cmp.assert_close()
    assert op_count(cmp.report) == 0 and len(cmp.report.skipped) == 1
    reason = cmp.report.skipped[0].reason
    assert "fail verification" in reason and "scaling the experts' input: router: outputs differ" in reason, reason
