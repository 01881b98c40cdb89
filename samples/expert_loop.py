"""Per-expert Python loop over an ``nn.ModuleList``, as in HF transformers v4 ``MixtralSparseMoeBlock``.

Each expert is its own MLP of ``nn.Linear`` layers named w1 (gate), w3 (up) and w2 (down). The loop
runs over ``range(num_experts)`` and picks its tokens with ``torch.where`` on a one-hot mask, so under
``capture_dynamic_output_shape_ops`` Dynamo unrolls it into E data-dependent-size slices of one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import check_top_k, get_activation


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, activation: str, gated: bool, bias: bool) -> None:
        super().__init__()
        self.gated = gated
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=bias)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=bias) if gated else None
        self.act_fn = get_activation(activation)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        else:
            current_hidden_states = self.act_fn(self.w1(hidden_states))
        return self.w2(current_hidden_states)


class MixtralSparseMoeBlock(nn.Module):
    """softmax -> top-k -> renormalize; experts run one after another on their own tokens."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        activation: str = "silu",
        gated: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        self.hidden_dim = hidden_size
        self.ffn_dim = ffn_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [
                MixtralBlockSparseTop2MLP(hidden_size, ffn_size, activation, gated, bias)
                for _ in range(num_experts)
            ]
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        # router_logits: (batch * sequence_length, n_experts)
        router_logits = self.gate(hidden_states)

        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        # we cast back to the input dtype
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )

        # One hot encode the selected experts to create an expert mask
        # this will be used to easily index which expert is going to be sollicitated
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(
            2, 1, 0
        )

        # Loop over all available experts in the model and perform the computation on each expert
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])

            # Index the correct hidden states and compute the expert hidden state for
            # the current expert. We need to make sure to multiply the output hidden
            # states by `routing_weights` on the corresponding tokens (top-1 and top-2)
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]

            # However `index_add_` only support torch tensors for indexing so we'll use
            # the `top_x` tensor here.
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
