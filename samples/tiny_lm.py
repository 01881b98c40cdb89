"""A tiny decoder-only MoE language model whose feed-forward layers are registry samples.

embedding + learned positions -> N x [RMSNorm, causal self-attention (SDPA), residual, RMSNorm,
MoE layer, residual] -> RMSNorm -> lm head. Small enough to train on CPU in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .registry import SAMPLES


@dataclass
class TinyLMConfig:
    vocab_size: int = 32
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    ffn_size: int = 48
    moe_kind: str = "expert_loop"  # a key of SAMPLES
    max_seq_len: int = 64
    rms_norm_eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class DecoderBlock(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CausalSelfAttention(config.hidden_size, config.num_heads)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SAMPLES[config.moe_kind].make(
            hidden_size=config.hidden_size,
            ffn_size=config.ffn_size,
            num_experts=config.num_experts,
            top_k=config.top_k,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyMoELM(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        if config.moe_kind not in SAMPLES:
            raise ValueError(f"unknown moe_kind {config.moe_kind!r}; use one of {sorted(SAMPLES)}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab], or the mean next-token cross-entropy when ``labels`` are given.

        ``labels`` are already aligned with ``input_ids`` (labels[:, i] is the token after input_ids[:, i]).
        """
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
