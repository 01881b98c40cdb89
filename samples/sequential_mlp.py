"""Megatron-core's ``SequentialMLP``: tokens permuted by expert, then a Python loop over the
experts that cuts each expert's rows out by counts read back into Python ints.

The token dispatcher sorts the (token, slot) pairs by expert and counts them per expert
(``routing_map.sum(0)``); the experts then take their rows by those counts:

    style="split"   torch.split(tokens, counts.tolist())        (Megatron's SequentialMLP)
    style="tolist"  tokens[start:start + n] for n in counts.tolist()
    style="int"     n = int(counts[e]) per expert

The counts are data: without Dynamo's ``capture_scalar_outputs`` (which ``import moe_compile``
turns on) each read breaks the graph; with it they are unbacked sizes of one graph.  The
router is Megatron's default (top-k on the logits, softmax over the K chosen); the experts are
``linear_fc1`` (gate and up rows stacked, SwiGLU) and ``linear_fc2`` modules; the combine puts
each row back with ``index_add``.

Shape legend: T tokens, H hidden, F ffn, E experts, K top-k, S = T*K permuted rows.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .common import activation_fn, check_top_k

STYLES = ("split", "tolist", "int")


class _Expert(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, gated: bool) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, 2 * ffn_size if gated else ffn_size, bias=False)
        self.linear_fc2 = nn.Linear(ffn_size, hidden_size, bias=False)


class SequentialMLPMoE(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, activation: str = "silu",
                 gated: bool = True, style: str = "split") -> None:
        super().__init__()
        check_top_k(num_experts, top_k)
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        self.num_experts, self.top_k, self.gated, self.style = num_experts, top_k, gated, style
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.local_experts = nn.ModuleList(_Expert(hidden_size, ffn_size, gated) for _ in range(num_experts))
        self.act = activation_fn(activation)

    def _mlp(self, expert: _Expert, rows_SH: torch.Tensor) -> torch.Tensor:
        h = expert.linear_fc1(rows_SH)
        if self.gated:
            gate, up = torch.chunk(h, 2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return expert.linear_fc2(h)

    def _per_expert(self, permuted_SH: torch.Tensor, counts_E: torch.Tensor) -> list[torch.Tensor]:
        experts = [cast(_Expert, ex) for ex in self.local_experts]
        if self.style == "split":
            return [self._mlp(ex, rows) for ex, rows in zip(experts, torch.split(permuted_SH, counts_E.tolist()))]
        outs, start = [], 0
        counts = counts_E.tolist() if self.style == "tolist" else None
        for e, ex in enumerate(experts):
            n = counts[e] if counts is not None else int(counts_E[e])
            outs.append(self._mlp(ex, permuted_SH[start:start + n]))
            start += n
        return outs

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x_TH = hidden_states.reshape(-1, hidden)
        top_logits_TK, top_idx_TK = torch.topk(self.router(x_TH), self.top_k, dim=-1)
        probs_TK = torch.softmax(top_logits_TK, dim=-1)
        flat_S = top_idx_TK.reshape(-1)
        order_S = torch.argsort(flat_S, stable=True)
        token_S = order_S // self.top_k
        counts_E = F.one_hot(flat_S, self.num_experts).sum(0)  # routing_map.sum(0)
        out_SH = torch.cat(self._per_expert(x_TH[token_S], counts_E))
        out_SH = out_SH * probs_TK.reshape(-1)[order_S, None]
        return torch.zeros_like(x_TH).index_add(0, token_S, out_SH).reshape(batch, seq, hidden)
