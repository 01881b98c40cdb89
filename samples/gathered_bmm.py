"""Gathered-weights bmm, as in HF transformers v5 ``batched_mm_experts_forward``.

Every token is repeated K times, each copy gathers its expert's full weight matrix
(``gate_up_proj[expert_ids]`` -> [S, 2F, H]) and one ``torch.bmm`` runs all copies at once. No sort,
no offsets: memory grows with S * F * H, which is why transformers uses it for small batches.
The combine is a deterministic ``view(T, K, H).sum(1)``.

The router here is "top-k on the logits, then softmax over the K chosen" (Mixtral's reference code,
MegaBlocks), which equals softmax -> top-k -> renormalize; or softmax -> top-k; or softmax and the
first K of a descending sort (a top-k written without ``torch.topk``).

Shape legend: T tokens, H hidden, F ffn, E experts, K top-k, S = T*K routed rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import check_top_k, get_activation, init_stacked_


def _batched_linear(x_SI: torch.Tensor, w_SOI: torch.Tensor, b_SO: torch.Tensor | None) -> torch.Tensor:
    # (S, O, I) @ (S, I, 1) -> (S, O)
    out_SO = torch.bmm(w_SOI, x_SI.unsqueeze(-1)).squeeze(-1)
    if b_SO is not None:
        out_SO.add_(b_SO)
    return out_SO


class GatheredBmmMoE(nn.Module):
    """Top-k MoE that gathers per-row expert weights and multiplies them with ``torch.bmm``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        activation: str = "gelu",
        gated: bool = True,
        bias: bool = True,
        router: str = "topk+softmax",
    ) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        if router not in ("topk+softmax", "softmax", "softmax+sort"):
            raise ValueError(f"router must be 'topk+softmax', 'softmax' or 'softmax+sort', got {router!r}")
        self.hidden_dim, self.intermediate_dim = hidden_size, ffn_size
        self.num_experts, self.num_experts_per_tok = num_experts, top_k
        self.has_gate, self.has_bias, self.router_kind = gated, bias, router
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        # transformers' names: "gate_up_proj" (gate rows first) with a gate, else "up_proj".
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_size, hidden_size))
            init_stacked_(self.gate_up_proj, hidden_size)
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
            init_stacked_(self.up_proj, hidden_size)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        init_stacked_(self.down_proj, ffn_size)
        if bias:
            if gated:
                self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * ffn_size))
                init_stacked_(self.gate_up_proj_bias, hidden_size)
            else:
                self.up_proj_bias = nn.Parameter(torch.empty(num_experts, ffn_size))
                init_stacked_(self.up_proj_bias, hidden_size)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
            init_stacked_(self.down_proj_bias, ffn_size)
        self.act_fn = get_activation(activation)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        if self.router_kind == "topk+softmax":
            top_k_logits, top_k_index = torch.topk(router_logits, self.num_experts_per_tok, dim=-1)
            top_k_weights = F.softmax(top_k_logits, dim=-1, dtype=torch.float).to(hidden_states.dtype)
        elif self.router_kind == "softmax+sort":  # top-k as the head of a descending sort
            probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            top_k_weights = sorted_probs[:, : self.num_experts_per_tok].to(hidden_states.dtype)
            top_k_index = order[:, : self.num_experts_per_tok]
        else:
            probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
            top_k_weights, top_k_index = torch.topk(probs, self.num_experts_per_tok, dim=-1)
            top_k_weights = top_k_weights.to(hidden_states.dtype)

        num_top_k = top_k_index.size(-1)
        num_tokens = hidden_states.size(0)
        selected_hidden_states = hidden_states.repeat_interleave(num_top_k, dim=0)  # (S, H)
        sample_weights = top_k_weights.reshape(-1)  # (S,)
        expert_ids = top_k_index.reshape(-1)  # (S,)

        if self.has_gate:
            selected_weights = self.gate_up_proj[expert_ids]  # (S, 2F, H)
            selected_biases = self.gate_up_proj_bias[expert_ids] if self.has_bias else None
        else:
            selected_weights = self.up_proj[expert_ids]  # (S, F, H)
            selected_biases = self.up_proj_bias[expert_ids] if self.has_bias else None
        proj_out = _batched_linear(selected_hidden_states, selected_weights, selected_biases)

        if self.has_gate:
            gate, up = proj_out.chunk(2, dim=-1)
            proj_out = self.act_fn(gate) * up  # (S, F)
        else:
            proj_out = self.act_fn(proj_out)

        selected_weights = self.down_proj[expert_ids]  # (S, H, F)
        selected_biases = self.down_proj_bias[expert_ids] if self.has_bias else None
        proj_out = _batched_linear(proj_out, selected_weights, selected_biases)  # (S, H)

        weighted_out = proj_out * sample_weights.unsqueeze(-1)
        final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        return final_hidden_states.view(batch_size, seq_len, hidden_dim)
