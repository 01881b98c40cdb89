"""The shapes of one MoE layer on one rank, as the cost models see them (no fx, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

# bytes of one routing slot as lowering/hier_a2a.py sends it with a row: int32 expert id + float32 weight
SLOT_BYTES = 8


@dataclass(frozen=True)
class Workload:
    """One MoE layer's work on one rank per step.

    num_tokens: T, tokens on this rank; hidden_size: H; ffn_size: F (per expert, per projection);
    num_experts: E; top_k: K; dtype_bytes: bytes per activation/weight element; gated: SwiGLU-style
    experts (3 matrices) or not (2); slot_bytes: routing metadata a dispatched row carries per
    routing slot (0: ignored, as HierMoE's model does; ``SLOT_BYTES`` for what the expert-parallel
    runtime sends: an int32 expert id and a float32 weight per slot, K slots on a deduplicated
    row, 1 on a per-(token, expert) copy)."""

    num_tokens: int
    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int
    dtype_bytes: int = 2
    gated: bool = True
    slot_bytes: int = 0

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's hidden vector (the unit every dispatch moves)."""
        return self.hidden_size * self.dtype_bytes

    @property
    def expert_params(self) -> int:
        return (3 if self.gated else 2) * self.hidden_size * self.ffn_size

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * self.dtype_bytes

    def expert_flops_per_token(self) -> int:
        """Forward FLOPs of one (token, expert) pair: 2 per multiply-add over each matrix."""
        return 2 * self.expert_params
