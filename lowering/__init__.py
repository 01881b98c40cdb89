"""Ops the passes emit. Importing this package registers them with torch.library."""

from moe_compile.lowering.experts import (
    ACTIVATIONS,
    experts,
    experts_backward,
    experts_flops,
    experts_reference,
)
from moe_compile.lowering.expert_parallel import ep_experts, ep_experts_backward

__all__ = ["ACTIVATIONS", "ep_experts", "ep_experts_backward", "experts", "experts_backward", "experts_flops", "experts_reference"]
