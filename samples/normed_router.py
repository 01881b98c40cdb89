"""An MoE block whose router does more than one linear map, as Gemma-4 and Zaya write theirs.

- ``router="norm"`` (Gemma-4, HF ``Gemma4TextRouter``): the router reads its own RMS-normalized,
  scaled copy of the tokens (``norm(x) * scale / sqrt(H)``), softmax, top-k, renormalize, then each
  weight times a learned per-expert scale (``per_expert_scale[ids]``);
- ``router="latent"`` (Zaya's router MLP): a latent projection to R = H / 2 and a GELU before the
  [E, R] logits, softmax, top-k;
- ``extra_rows`` > 0 (Inkling): the router scores ``extra_rows`` more rows than it routes to (a
  shared expert's), sliced off before the top-k.

The experts read a normalized copy of the tokens of their own (Gemma-4's
``pre_feedforward_layernorm_2``), and the routed sum is normalized again after the combine; both
norms are the layer's surroundings, not part of it. Experts: stacked gate_up [E, 2F, H] (gate
first) and down [E, H, F] in a ``range(E)`` loop.

Shape legend: T tokens, H hidden, F ffn, E experts, K top-k, R latent router width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import activation_fn, check_top_k, init_stacked_


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


class NormedRouterMoE(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, activation: str = "gelu_tanh",
                 router: str = "norm", extra_rows: int = 0) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        if router not in ("norm", "latent"):
            raise ValueError(f"router must be 'norm' or 'latent', got {router!r}")
        self.num_experts, self.top_k, self.router_kind = num_experts, top_k, router
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.router_scale = nn.Parameter(1 + 0.1 * torch.randn(hidden_size))
        self.per_expert_scale = nn.Parameter(1 + 0.1 * torch.randn(num_experts))
        width = hidden_size if router == "norm" else hidden_size // 2
        self.latent = nn.Linear(hidden_size, width, bias=True) if router == "latent" else None
        self.proj = nn.Linear(width, num_experts + extra_rows, bias=False)
        self.pre_norm = nn.Parameter(1 + 0.1 * torch.randn(hidden_size))
        self.post_norm = nn.Parameter(1 + 0.1 * torch.randn(hidden_size))
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        init_stacked_(self.gate_up_proj, hidden_size)
        init_stacked_(self.down_proj, ffn_size)
        self.act = activation_fn(activation)

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latent is None:
            r_TH = rms_norm(x_TH, None) * self.router_scale * self.hidden_size**-0.5
        else:
            r_TH = F.gelu(self.latent(x_TH))
        scores_TE = self.proj(r_TH)[..., : self.num_experts]
        probs_TE = F.softmax(scores_TE, dim=-1, dtype=torch.float32)
        w_TK, idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.latent is None:
            w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
            w_TK = w_TK * self.per_expert_scale[idx_TK]
        return w_TK, idx_TK

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x_TH = hidden_states.reshape(-1, hidden)
        w_TK, idx_TK = self.route(x_TH)
        xe_TH = rms_norm(x_TH, self.pre_norm)
        out_TH = torch.zeros_like(xe_TH)
        for e in range(self.num_experts):
            tok, slot = torch.where(idx_TK == e)
            gate, up = F.linear(xe_TH[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e])
            out_TH.index_add_(0, tok, y * w_TK[tok, slot, None])
        return rms_norm(out_TH, self.post_norm).reshape(batch, seq, hidden)
