"""DeepSeek-V3 MoE layer, as in HF transformers v5 ``DeepseekV3MoE``.

Router: sigmoid scores; ``e_score_correction_bias`` is added for SELECTION only; experts are split
into ``n_group`` groups, each group is scored by the sum of its top-2 biased scores, the best
``topk_group`` groups stay and the rest are masked to 0.0, then top-k over experts. The weights are
the UNBIASED sigmoid scores of the chosen experts, normalized (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``.

Routed experts are stacked parameters (``gate_up_proj`` [E, 2F, H], gate rows first; ``down_proj``
[E, H, F]) run in a ``range(E)`` loop with ``F.linear`` on ``w[expert_idx]``. A dense shared-expert
SwiGLU MLP sees every token and is added to the routed output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import check_top_k, get_activation, init_stacked_


class DeepseekV3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV3TopkRouter(nn.Module):
    e_score_correction_bias: torch.Tensor

    def __init__(self, hidden_size: int, n_routed_experts: int) -> None:
        super().__init__()
        self.n_routed_experts = n_routed_experts
        self.weight = nn.Parameter(torch.empty(n_routed_experts, hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        # Updated outside autograd by the load-balancing rule in real training.
        self.register_buffer("e_score_correction_bias", torch.zeros(n_routed_experts))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(-1, hidden_states.size(-1))
        return F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))


class DeepseekV3NaiveMoe(nn.Module):
    """Routed experts as 3D parameters, one expert at a time."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, activation: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        init_stacked_(self.gate_up_proj, hidden_size)
        init_stacked_(self.down_proj, intermediate_size)
        self.act_fn = get_activation(activation)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states


class DeepseekV3MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        n_group: int = 4,
        topk_group: int = 2,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 2.5,
        n_shared_experts: int = 1,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        if num_experts % n_group != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by n_group={n_group}")
        if not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
            raise ValueError(
                f"need 1 <= topk_group <= n_group and top_k <= topk_group * experts per group; got "
                f"topk_group={topk_group}, n_group={n_group}, top_k={top_k}, num_experts={num_experts}"
            )
        if num_experts // n_group < 2:
            raise ValueError("each group needs at least 2 experts (groups are scored by their top-2 sum)")
        self.n_routed_experts = num_experts
        self.top_k = top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.experts = DeepseekV3NaiveMoe(hidden_size, ffn_size, num_experts, activation)
        self.gate = DeepseekV3TopkRouter(hidden_size, num_experts)
        self.shared_experts = DeepseekV3MLP(hidden_size, ffn_size * n_shared_experts, activation)

    def route_tokens_to_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = router_logits.sigmoid()
        router_logits_for_choice = router_logits + self.gate.e_score_correction_bias
        group_scores = (
            router_logits_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.n_group, self.n_routed_experts // self.n_group)
            .reshape(-1, self.n_routed_experts)
        )
        scores_for_choice = router_logits_for_choice.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = router_logits.gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        router_logits = self.gate(hidden_states)
        topk_indices, topk_weights = self.route_tokens_to_experts(router_logits)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states
