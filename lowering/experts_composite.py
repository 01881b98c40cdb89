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

The gate and up matmuls gather the slots' token rows themselves (``grouped_mm_rows``), forward
and again backward, so the [T*K, H] copy of the tokens in expert order is never kept for the
backward: the tokens and the routing are, which the router keeps anyway (measured on the
single-process bench, GPT-OSS sample: peak 56.2 -> 48.2 MiB with the biases below, 44.2 MiB
with the rows; plain Inductor 44.2 MiB).

Only for calls whose every matmul can be one grouped_mm (``grouped_mm_ok``): the per-expert
loop of the opaque op reads the block sizes into Python, which a trace cannot.

``hiermoe::experts_composite_list`` is the same with the weights as lists of E tensors (experts
stored as E modules): its matmuls are ``hiermoe::grouped_linear`` calls, so the E weights are
never stacked into a copy, in forward or backward, and each weight's gradient is its own tensor
in its own layout (``lowering/grouped_mm.py``).

``hiermoe::experts_composite_gate_up`` takes gate and up as the one [E, 2F, H] tensor they are
stored in (transformers' ``gate_up_proj``, halves or interleaved rows): one grouped matmul with
2F columns where two views take two (forward, input gradient, weight gradient), and the weight's
gradient comes out whole. There (fp32, no down bias) the top-k weights multiply h before the
down projection, so the backward keeps h, not the [N, H] expert outputs as well.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_compile.lowering.experts_ref import (
    _GROUPED_MM_DTYPES,
    GATE_UP_ORDERS,
    GateUp,
    Weights,
    _acc_dtype,
    _ffn,
    _linear,
    _route,
    check_activation,
    out_dtype,
)

_lib = torch.library.Library("hiermoe", "FRAGMENT")
_lib.define(
    "experts_composite(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_up, Tensor? w_gate, "
    "Tensor w_down, Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation) -> Tensor"
)
_lib.define(
    "experts_composite_list(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor[] w_up, Tensor[]? w_gate, "
    "Tensor[] w_down, Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation) -> Tensor"
)
_lib.define(
    "experts_composite_gate_up(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_gate_up, str order, "
    "Tensor w_down, Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation, Tensor? b_gate_up=None) -> Tensor"
)


def experts_composite(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
    w_up_EFH: Weights, w_gate_EFH: Weights | None, w_down_EHF: Weights,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str,
) -> Tensor:
    """``experts_ref.experts_reference``'s forward with every matmul grouped (traceable); the
    weights stacked [E, ...] or (``experts_composite_list``) lists of E tensors."""
    num_experts = len(w_up_EFH) if isinstance(w_up_EFH, list) else w_up_EFH.shape[0]
    return _composite(x_TH, topk_idx_TK, topk_weights_TK, num_experts, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF,
                      b_gate_EF, b_down_EH, activation, None)


def experts_composite_gate_up(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor, w_gate_up_E2FH: Tensor, order: str,
    w_down_EHF: Tensor, b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str, b_gate_up_E2F: Tensor | None = None,
) -> Tensor:
    """``experts_composite`` with gate and up stored as one [E, 2F, H] tensor (transformers'
    ``gate_up_proj``; ``order`` as ``experts_ref.GateUp``): one grouped matmul with 2F output
    columns computes both (and in the backward one for the input gradient, one for the weight
    gradient, which comes out as the [E, 2F, H] parameter's gradient), where the two views would
    take two of each and a sum. ``b_gate_up_E2F``: gate and up biases stored the same way as one
    [E, 2F] tensor (then ``b_up`` and ``b_gate`` are None)."""
    if order not in GATE_UP_ORDERS:
        raise ValueError(f"order must be one of {list(GATE_UP_ORDERS)}, got {order!r}")
    if b_gate_up_E2F is not None and (b_up_EF is not None or b_gate_EF is not None):
        raise ValueError("pass gate and up biases either as b_gate_up or as b_gate and b_up, not both")
    return _composite(x_TH, topk_idx_TK, topk_weights_TK, w_gate_up_E2FH.shape[0], None, None, w_down_EHF, b_up_EF,
                      b_gate_EF, b_down_EH, activation, GateUp(w_gate_up_E2FH, order, b_gate_up_E2F))


def _composite(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor, num_experts: int,
    w_up_EFH: Weights | None, w_gate_EFH: Weights | None, w_down_EHF: Weights,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str, gate_up: GateUp | None,
) -> Tensor:
    check_activation(activation)
    r = _route(topk_idx_TK, num_experts, grouped=True)
    acc = _acc_dtype(x_TH, topk_weights_TK)
    num_n = r.order_N.shape[0]
    inv_N = torch.empty_like(r.order_N).scatter(0, r.order_N, torch.arange(num_n, device=r.order_N.device))
    if gate_up is not None and acc == x_TH.dtype and b_down_EH is None:
        # Weight the slots before the down projection: w (h W_down^T) = (w h) W_down^T, the same
        # value (the matmul is linear; the weighting runs in x's dtype either way, as acc is it).
        # Autograd then keeps h and w for the backward (the partitioner recomputes the product)
        # instead of h and the [N, H] expert outputs: w's gradient is <dL/d(w h), h>, from the
        # down projection's input gradient, which the backward computes anyway. Measured on the
        # single-process bench (HF Mixtral, 2 layers): peak 132.5 -> 124.6 MiB, time unchanged.
        # Only in the gate_up form, where the activation's backward writes one [N, 2F] buffer
        # either way: with gate and up apart (E modules' weights), Inductor writes their
        # gradients into the saved gate and up buffers, and keeping dL/d(w h) alive for w's
        # gradient cost more than the expert outputs saved (expert_loop peak 34.1 -> 42.2 MiB).
        ffn = _ffn(x_TH, r, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH, activation,
                   output=False, gate_up=gate_up, keep_rows=False)
        weight_N = topk_weights_TK.reshape(-1).index_select(0, r.order_N).to(acc)
        y_NH = _linear(ffn.h_NF * weight_N[:, None], w_down_EHF, None, r, False)  # no down bias here
        return y_NH.index_select(0, inv_N).view(*topk_idx_TK.shape, y_NH.shape[-1]).sum(1)
    ffn = _ffn(x_TH, r, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH, activation,
               gate_up=gate_up, keep_rows=False)
    assert ffn.y_NH is not None
    # The combine as a gather: slot t*K+k sits at sorted position inv[t*K+k], so
    # y[t] = sum_k w[t, k] * y_N[inv[t*K+k]]. Inductor fuses it into one reduction over K (an
    # index_add into zeros is a scatter), and the forward makes no [T, H] zeros that AOTAutograd
    # would merge with the backward's and keep alive from forward to backward.
    y_TKH = ffn.y_NH.index_select(0, inv_N).view(*topk_idx_TK.shape, ffn.y_NH.shape[-1]).to(acc)
    y_TH = (y_TKH * topk_weights_TK.to(acc)[..., None]).sum(1)
    return y_TH.to(out_dtype(x_TH, topk_weights_TK))


_lib.impl("experts_composite", experts_composite, "CompositeImplicitAutograd")
_lib.impl("experts_composite_list", experts_composite, "CompositeImplicitAutograd")
_lib.impl("experts_composite_gate_up", experts_composite_gate_up, "CompositeImplicitAutograd")


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
