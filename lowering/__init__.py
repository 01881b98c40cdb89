"""Ops the passes emit. Importing this package registers them with torch.library.

``hiermoe::experts`` (torch lowering) always; ``hiermoe::experts_triton`` (the HEXA-MoE Triton
kernels, same arguments and semantics) when the ``triton`` package is importable (HAS_TRITON).
"""

import torch

from moe_compile.lowering.ep_gather import ep_expert_rows, ep_gather
from moe_compile.lowering.ep_model import ep_model_outputs, ep_model_tokens
from moe_compile.lowering.ep_stages import ep_combine, ep_dispatch, ep_local_experts
from moe_compile.lowering.expert_parallel import ep_experts, ep_experts_backward
from moe_compile.lowering.experts import (
    ACTIVATIONS,
    experts,
    experts_backward,
    experts_flops,
    experts_reference,
)
from moe_compile.lowering.experts_composite import grouped_mm_ok
from moe_compile.lowering.sample_exchange import sample_move, sample_plan

try:
    import triton  # noqa: F401
except ImportError:  # no Triton wheel for this platform: the op stays unregistered
    HAS_TRITON = False
else:
    HAS_TRITON = True
    from moe_compile.lowering import triton_experts  # registers hiermoe::experts_triton


def triton_keep_blk(x: torch.Tensor, num_k: int, num_e: int) -> int:
    """The re-index block of ``hiermoe::experts_triton_keep`` for tokens like ``x`` (a fake value
    will do); for passes, which must not import Triton themselves."""
    return triton_experts.keep_blk(x, num_k, num_e)


def triton_kernels_error(device: torch.device) -> str | None:
    """Why ``hiermoe::experts_triton`` cannot run on ``device`` in this process (None: it can).
    For passes, which must not import Triton themselves."""
    if not HAS_TRITON:
        return "the triton package is not installed (pip install 'triton>=3.3'; Linux wheels only)"
    return triton_experts.interpreter_error(device)


__all__ = ["ACTIVATIONS", "HAS_TRITON", "ep_combine", "ep_dispatch", "ep_experts", "ep_expert_rows", "ep_gather", "ep_local_experts", "ep_experts_backward",
           "ep_model_outputs", "ep_model_tokens", "experts", "experts_backward",
           "experts_flops", "experts_reference", "grouped_mm_ok", "sample_move", "sample_plan", "triton_keep_blk", "triton_kernels_error"]
