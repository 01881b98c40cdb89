"""Dense masked MoE: every expert runs on every token, and a dense [T, E] gate matrix masks the result.

Common in small research code and in "soft" MoE prototypes: the top-k weights are scattered into a
zero [T, E] matrix, so experts a token did not choose are multiplied by exactly 0. It costs E full FFNs
per token but has no data-dependent shapes at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import check_top_k, get_activation


class DenseExpert(nn.Module):
    """fc1 -> act -> fc2 (ViT / NLLB-MoE names); gated adds a parallel ``fc_gate``."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: str, gated: bool, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.fc_gate = nn.Linear(hidden_size, ffn_size, bias=bias) if gated else None
        self.act = get_activation(activation)
        self.fc2 = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc_gate is not None:
            return self.fc2(self.act(self.fc_gate(x)) * self.fc1(x))
        return self.fc2(self.act(self.fc1(x)))


class DenseMaskedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        activation: str = "gelu",
        gated: bool = False,
        bias: bool = True,
        norm_topk_prob: bool = False,
    ) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            DenseExpert(hidden_size, ffn_size, activation, gated, bias) for _ in range(num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x = x.reshape(b * s, h)
        probs = F.softmax(self.router(x), dim=-1)
        topk_w, topk_idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        # [T, E] with the top-k weights in place and zeros elsewhere
        gates = torch.zeros_like(probs).scatter(1, topk_idx, topk_w)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + gates[:, e : e + 1] * expert(x)
        return out.reshape(b, s, h)
