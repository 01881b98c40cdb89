"""Ops the passes emit. Importing this package registers them with torch.library."""

from moe_compile.lowering.experts import (
    ACTIVATIONS,
    experts,
    experts_backward,
    experts_flops,
    experts_reference,
)

__all__ = ["ACTIVATIONS", "experts", "experts_backward", "experts_flops", "experts_reference"]
