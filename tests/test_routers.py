"""Routers written in the less common ways, compiled with hiermoe against eager (outputs and
every gradient, compile_utils' fp32 tolerance: summation order only).

Each layer must be rewritten into one expert op, with the routing left as written: a latent
projection before the logits while the experts read the tokens themselves, a top-k written as
masked argmaxes, a router that scores more rows than it routes to, a learned per-expert scale on
the weights.  If one fails, fix the finder, not the assertion.
"""

from __future__ import annotations

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
