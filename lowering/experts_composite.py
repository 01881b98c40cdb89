"""``hiermoe::experts_composite``: the expert op as aten ops the compiler sees through.

The same function as ``hiermoe::experts`` (same arguments, the same forward math as
``experts_ref``: the stable argsort of the routing as HEXA-MoE's re-index vector, grouped
matmuls over the expert-sorted slots, the top-k combine as an index_add in float32 or wider),
registered as a CompositeImplicitAutograd kernel: AOTAutograd traces through it, so autograd
derives the backward (grouped_mm's own derivative, no recompute of the forward's matmuls),
the partitioner decides what to keep for it, and Inductor fuses the elementwise work (the
activation, the gating product, the weighting) and plans the buffers around the grouped
matmuls. ``hiermoe::experts`` stays opaque: the reference that verification runs, the op the
transformers integration calls in eager mode, and the one the Triton kernels replace.

Only for calls whose every matmul can be one grouped_mm (``grouped_mm_ok``): the per-expert
loop of the opaque op reads the block sizes into Python, which a trace cannot.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_compile.lowering.experts_ref import _GROUPED_MM_DTYPES, _acc_dtype, _ffn, _route, check_activation

_lib = torch.library.Library("hiermoe", "FRAGMENT")
_lib.define(
    "experts_composite(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_up, Tensor? w_gate, "
    "Tensor w_down, Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation) -> Tensor"
)


def experts_composite(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
    w_up_EFH: Tensor, w_gate_EFH: Tensor | None, w_down_EHF: Tensor,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str,
) -> Tensor:
    """``experts_ref.experts_reference``'s forward with every matmul grouped (traceable)."""
    check_activation(activation)
    r = _route(topk_idx_TK, w_up_EFH.shape[0], grouped=True)
    ffn = _ffn(x_TH, r, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH, activation)
    assert ffn.y_NH is not None
    acc = _acc_dtype(x_TH, topk_weights_TK)
    weight_N = topk_weights_TK.reshape(-1).index_select(0, r.order_N).to(acc)
    y_TH = x_TH.new_zeros(x_TH.shape, dtype=acc).index_add(0, r.tok_N, ffn.y_NH.to(acc) * weight_N[:, None])
    return y_TH.to(x_TH.dtype)


_lib.impl("experts_composite", experts_composite, "CompositeImplicitAutograd")


def grouped_mm_ok(x: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor) -> bool:
    """Whether ``experts_composite`` can run these (fake or real) tensors: what
    ``experts_ref._use_grouped_mm`` checks, from dtype, device, shapes and strides only (a
    weight's storage offset comes from its view, its base is allocated aligned)."""
    dtype, device = x.dtype, x.device
    if dtype not in _GROUPED_MM_DTYPES.get(device.type, ()):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    num_h, num_f = w_down.shape[-2], w_down.shape[-1]
    size = x.element_size()
    if (num_h * size) % 16 or (num_f * size) % 16:
        return False
    align = 16 // size
    for w in (m for m in (w_up, w_gate, w_down) if m is not None):
        s_r, s_c = w.stride(-2), w.stride(-1)
        if w.dtype != dtype or w.storage_offset() % align:
            return False
        if s_r == 1 and s_c >= max(1, w.shape[-2]):
            lead = s_c
        elif s_c == 1 and s_r >= max(1, w.shape[-1]):
            lead = s_r
        else:
            return False
        if lead % align:
            return False
    return True
