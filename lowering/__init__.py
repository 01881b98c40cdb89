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


def _outside_autocast() -> torch.library.Library:
    """Every ``hiermoe`` op computes in the dtypes its inputs come in: where the model ran under
    ``torch.autocast``, the passes cast the op's tokens and weights to the dtype the layer's own
    matmuls computed in (``passes.expert_layout.compute_dtype``).  A custom op's kernel runs with
    its caller's autocast state, so the aten matmuls inside it (a per-expert loop, a backward)
    would otherwise be cast again, to bf16 where the layer computed in fp32 (``torch._grouped_mm``
    has no autocast rule).  Each op gets an autocast kernel that only leaves autocast."""
    lib = torch.library.Library("hiermoe", "IMPL")
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("hiermoe::"))
    for device in ("cpu", "cuda"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
        for qualname in names:
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key):
                continue
            name, _, overload = qualname.removeprefix("hiermoe::").partition(".")
            op = getattr(getattr(torch.ops.hiermoe, name), overload or "default")

            def kernel(_keys: object, *args: object, _op: object = op, _skip: object = keyset, **kwargs: object) -> object:
                with torch._C._ExcludeDispatchKeyGuard(_skip):  # type: ignore[arg-type]
                    return _op(*args, **kwargs)  # type: ignore[operator]

            lib.impl(qualname.removeprefix("hiermoe::"), kernel, key, with_keyset=True)
    return lib


_AUTOCAST_LIB = _outside_autocast()

__all__ = ["ACTIVATIONS", "HAS_TRITON", "ep_combine", "ep_dispatch", "ep_experts", "ep_expert_rows", "ep_gather", "ep_local_experts", "ep_experts_backward",
           "ep_model_outputs", "ep_model_tokens", "experts", "experts_backward",
           "experts_flops", "experts_reference", "grouped_mm_ok", "sample_move", "sample_plan", "triton_keep_blk", "triton_kernels_error"]
