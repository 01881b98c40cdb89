"""GShard / Switch Transformer einsum dispatch with a capacity factor (fairseq, DeepSpeed, Mesh TF).

Each expert has C = ceil(capacity_factor * T * K / E) slots. A token's slot in its expert comes from a
``cumsum`` over the one-hot choice masks; all first choices are placed before any second choice
(GShard's priority), and choices that land beyond C are DROPPED: they get no expert output, and the
residual connection outside the layer carries the token through. The combine tensor [T, E, C] holds
gate * one_hot(slot); the dispatch mask is its ``.bool()``. Tokens move with
``einsum("tec,th->ech")`` and come back with ``einsum("tec,ech->th")``.

Gates: top-1 (Switch) uses the raw softmax probability; top-k >= 2 (GShard) renormalizes the kept
choices' probabilities to sum to 1 (after drops, as DeepSpeed's ``top2gating`` does).

Experts are stacked parameters applied with einsum: ``wi`` [E, H, F], ``wo`` [E, F, H] (Mesh TF
names), default ReLU with biases as in the Switch FFN.

Shape legend: T tokens, H hidden, F ffn, E experts, K top-k, C capacity slots per expert.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .common import activation_fn, check_top_k, init_stacked_


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int) -> int:
    return max(math.ceil(capacity_factor * num_tokens * top_k / num_experts), min_capacity)


def topk_gating(logits_TE: torch.Tensor, top_k: int, capacity_C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (combine_weights_TEC, dispatch_mask_TEC)."""
    num_experts = logits_TE.size(1)
    gates_TE = F.softmax(logits_TE, dim=1)
    _, topk_idx_TK = torch.topk(gates_TE, k=top_k, dim=1)

    masks_TE = []
    locations_TE = []
    filled_1E = torch.zeros(1, num_experts, dtype=torch.int64, device=logits_TE.device)
    for i in range(top_k):
        mask_TE = F.one_hot(topk_idx_TK[:, i], num_classes=num_experts)
        # Slot = rank of this token among the i-th choices of its expert, after all earlier choices.
        loc_TE = torch.cumsum(mask_TE, dim=0) - 1 + filled_1E
        filled_1E = filled_1E + torch.sum(mask_TE, dim=0, keepdim=True)
        mask_TE = mask_TE * torch.lt(loc_TE, capacity_C)
        masks_TE.append(mask_TE)
        locations_TE.append(loc_TE)

    gates_s_T = [torch.einsum("te,te->t", gates_TE, m.to(gates_TE.dtype)) for m in masks_TE]
    if top_k > 1:
        denom_T = torch.clamp(torch.stack(gates_s_T).sum(0), min=torch.finfo(gates_TE.dtype).eps)
        gates_s_T = [g / denom_T for g in gates_s_T]

    combine_TEC = torch.zeros(
        logits_TE.size(0), num_experts, capacity_C, dtype=gates_TE.dtype, device=logits_TE.device
    )
    for gate_T, mask_TE, loc_TE in zip(gates_s_T, masks_TE, locations_TE, strict=True):
        loc_s_T = torch.sum(loc_TE * mask_TE, dim=1)
        gate_TE = torch.einsum("t,te->te", gate_T, mask_TE.to(gate_T.dtype))
        loc_TC = F.one_hot(loc_s_T, num_classes=capacity_C).to(gate_T.dtype)
        combine_TEC = combine_TEC + torch.einsum("te,tc->tec", gate_TE, loc_TC)
    dispatch_mask_TEC = combine_TEC.bool()
    return combine_TEC, dispatch_mask_TEC


class SwitchEinsumMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int = 1,
        activation: str = "relu",
        gated: bool = False,
        bias: bool = True,
        capacity_factor: float = 1.0,
        min_capacity: int = 1,
    ) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.gated, self.has_bias = gated, bias
        self.act = activation_fn(activation)
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)  # router ("gate" in GShard)
        self.wi = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.wo = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        init_stacked_(self.wi, hidden_size)
        init_stacked_(self.wo, ffn_size)
        if gated:
            self.wi_gate = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
            init_stacked_(self.wi_gate, hidden_size)
        if bias:
            self.bi = nn.Parameter(torch.empty(num_experts, ffn_size))
            self.bo = nn.Parameter(torch.empty(num_experts, hidden_size))
            init_stacked_(self.bi, hidden_size)
            init_stacked_(self.bo, ffn_size)
            if gated:
                self.bi_gate = nn.Parameter(torch.empty(num_experts, ffn_size))
                init_stacked_(self.bi_gate, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        x_TH = x.reshape(-1, hidden)
        capacity_C = capacity(
            x_TH.size(0), self.num_experts, self.top_k, self.capacity_factor, self.min_capacity
        )
        combine_TEC, dispatch_TEC = topk_gating(self.wg(x_TH), self.top_k, capacity_C)

        expert_in_ECH = torch.einsum("tec,th->ech", dispatch_TEC.to(x_TH.dtype), x_TH)
        h_ECF = torch.einsum("ech,ehf->ecf", expert_in_ECH, self.wi)
        if self.has_bias:
            h_ECF = h_ECF + self.bi.unsqueeze(1)
        if self.gated:
            g_ECF = torch.einsum("ech,ehf->ecf", expert_in_ECH, self.wi_gate)
            if self.has_bias:
                g_ECF = g_ECF + self.bi_gate.unsqueeze(1)
            h_ECF = self.act(g_ECF) * h_ECF
        else:
            h_ECF = self.act(h_ECF)
        expert_out_ECH = torch.einsum("ecf,efh->ech", h_ECF, self.wo)
        if self.has_bias:
            # Empty slots get the bias too, but their combine weight is 0.
            expert_out_ECH = expert_out_ECH + self.bo.unsqueeze(1)
        out_TH = torch.einsum("tec,ech->th", combine_TEC, expert_out_ECH)
        return out_TH.reshape(batch, seq, hidden)
