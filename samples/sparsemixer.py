"""PhiMoE's SparseMixer routing (HF transformers ``PhimoeSparseMoeBlock``, inference form), whose
top-k is written without ``torch.topk``: the best expert by ``max``, then the best of the scores
with the chosen ones masked to -inf, K times; each choice's weight is a softmax over the scores
within a relative ``jitter_eps`` of that choice (the rest masked out), read at the choice.

Paper: Liu et al., "GRIN: GRadient-INformed MoE" (sparsemixer-v2), arXiv 2409.12136. Training
samples the choices (Gumbel noise) and replaces their gradient by Heun's third-order estimate;
this is the deterministic path transformers takes in eval mode, for any K.

Experts: stacked w1 (gate), w3 (up), w2 (down) [E, F, H] / [E, H, F], in a ``range(E)`` loop.

Shape legend: T tokens, H hidden, F ffn, E experts, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import activation_fn, check_top_k, init_stacked_


def sparsemixer(scores_TE: torch.Tensor, top_k: int, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K], expert ids [T, K]) chosen one at a time by max with masking."""
    weights, ids = [], []
    masked_TE = scores_TE
    for _ in range(top_k):
        with torch.no_grad():
            threshold_T1, max_ind_T1 = masked_TE.max(dim=-1, keepdim=True)
            factor_TE = scores_TE.abs().clamp(min=threshold_T1)
            far_TE = ((threshold_T1 - scores_TE) / factor_TE) > (2 * jitter_eps)
        gates_TE = torch.softmax(masked_TE.masked_fill(far_TE, float("-inf")), dim=-1)
        weights.append(gates_TE.gather(dim=-1, index=max_ind_T1))
        ids.append(max_ind_T1)
        masked_TE = torch.scatter(masked_TE, -1, max_ind_T1, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class SparseMixerMoE(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, activation: str = "silu",
                 jitter_eps: float = 0.01) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        self.num_experts, self.top_k, self.jitter_eps = num_experts, top_k, jitter_eps
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        for w, fan_in in ((self.w1, hidden_size), (self.w3, hidden_size), (self.w2, ffn_size)):
            init_stacked_(w, fan_in)
        self.act = activation_fn(activation)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x_TH = hidden_states.reshape(-1, hidden)
        weights_TK, ids_TK = sparsemixer(self.router(x_TH), self.top_k, self.jitter_eps)
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            tok, slot = torch.where(ids_TK == e)
            rows = x_TH[tok]
            h = self.act(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e])
            out_TH.index_add_(0, tok, F.linear(h, self.w2[e]) * weights_TK[tok, slot, None])
        return out_TH.reshape(batch, seq, hidden)
