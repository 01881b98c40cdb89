"""GPT-OSS's MoE block (OpenAI gpt-oss; HF transformers ``GptOssMLP``), looping over ``range(E)``.

What sets it apart from a Mixtral block:

- the router is a linear map with a bias; top-k on the logits, then softmax over the K chosen;
- the experts' gate and up projections are one stored ``gate_up_proj [E, H, 2F]`` in [in, out]
  layout, gate and up in interleaved columns (gate at even, up at odd), with per-expert biases;
- the activation is a clamped SwiGLU with a scale alpha inside the sigmoid and an ``(up + 1)``
  term: g = min(gate, L), u = clamp(up, -L, L), h = (u + 1) * g * sigmoid(alpha * g).

HF's own loop visits only the experts that received tokens (``for e in expert_hit``, a graph
break); this one visits every expert with ``torch.where``, the form Dynamo traces as one graph.

Shape legend: T tokens, H hidden, F ffn, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from .common import check_top_k, init_stacked_


class GptOssMoE(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, alpha: float = 1.702,
                 limit: float = 7.0) -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        self.num_experts, self.top_k, self.alpha, self.limit = num_experts, top_k, alpha, limit
        self.router = nn.Linear(hidden_size, num_experts, bias=True)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * ffn_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * ffn_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        for p, fan_in in ((self.gate_up_proj, hidden_size), (self.gate_up_proj_bias, hidden_size),
                          (self.down_proj, ffn_size), (self.down_proj_bias, ffn_size)):
            init_stacked_(p, fan_in)

    def _apply_gate(self, gate_up_SF2: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_SF2[..., ::2], gate_up_SF2[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x_TH = hidden_states.reshape(-1, hidden)
        logits_TE = self.router(x_TH)
        top_value_TK, top_idx_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        scores_TK = torch.softmax(top_value_TK, dim=1)
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            token_idx, slot = torch.where(top_idx_TK == e)
            rows = x_TH[token_idx]
            gate_up = rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            y = self._apply_gate(gate_up) @ self.down_proj[e] + self.down_proj_bias[e]
            out_TH.index_add_(0, token_idx, y * scores_TK[token_idx, slot, None])
        return out_TH.reshape(batch, seq, hidden)
