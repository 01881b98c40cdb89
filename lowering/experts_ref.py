"""Torch reference lowering of the expert op ``hiermoe::experts`` (forward and backward math).

This is the pure-torch lowering of the one op every MoE layer is rewritten into: dropless
(every (token, expert) slot is computed, no capacity) and sort-based (slots are sorted by
expert so each expert sees one contiguous block of rows). It follows the data-centric
execution of HEXA-MoE (papers/hexa-moe.txt): the re-index vector is the stable argsort of the
flattened routing, the expert-specific matmul (ESMM) is a grouped matmul over those blocks,
and the top-k combine is an add into the token rows. The Triton ESMM/ESS/ESTMM kernels from
HEXA-MoE are a separate, later lowering of the same op and are checked against this one.

Semantics (nn.Linear layouts, ``act`` from ``ACTIVATIONS``)::

    gated:      h = act(x W_gate^T + b_gate) * (x W_up^T + b_up)
    non-gated:  h = act(x W_up^T + b_up)
    expression: h = E(g, u), g = x W_gate^T + b_gate, u = x W_up^T + b_up  (``activation.py``:
                an ``expr:`` activation, e.g. GPT-OSS's clamped SwiGLU; non-gated: E(u))
    y_e(x) = h W_down^T + b_down
    y[t]   = sum_k topk_weights[t, k] * y_{topk_idx[t, k]}(x[t])

Expert ids must lie in [0, E); rows of ``topk_idx`` may repeat an expert (each slot counts).
Matmuls and the activation run in x.dtype (as the model would); the top-k weighting and
both scatter-adds run in promote(x.dtype, topk_weights.dtype, float32), so bf16/fp16 tokens
are accumulated in fp32. y comes out in promote(x.dtype, topk_weights.dtype) (``out_dtype``):
as a layer's ``y_e * w`` does, bf16 expert outputs weighted by fp32 routing weights (a layer under
torch.autocast) give an fp32 sum, not rounded to bf16.

Biases in 16 bits: a layer adds each bias either inside its matmul (``nn.Linear``, ``linear(x, w,
b)``: the product and the bias summed before one rounding) or to the product already rounded
(``x @ w + b``, ``einsum(...) + b``: rounded twice). A third of the bf16 entries differ by one ulp
between the two, and a pre-activation at a ReLU's or a clamp's kink then takes the other side and
flips its unit's gradient. The op computes what the layer does: an ``activation`` ending in
``BIAS_IN_MATMUL`` (``op_activation``, set by the rewrite from the graph) adds the biases inside
per-expert ``addmm``s on the CPU; otherwise they are added after the product. On CUDA the torch
lowering adds them after the grouped matmul (which takes no bias) and the Triton kernels inside
their fp32 accumulators, whatever the suffix.

Shape legend:
    T tokens, K experts per token, N = T*K slots, E experts, H hidden size, F ffn size.
    x_TH, topk_idx_TK, topk_weights_TK, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF,
    b_down_EH; slot tensors in expert-sorted order end in _N (x_NH, up_NF, expert_N, tok_N);
    offs_E are the int32 end offsets of each expert's block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_compile.lowering.activation import is_expression, parse
from moe_compile.lowering.grouped_mm import (
    grouped_linear,
    grouped_linear_gate_up,
    grouped_mm,
    grouped_mm_rows,
)

ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "identity")

# the suffix of an ``activation`` whose layer adds its expert biases inside the matmuls (module doc)
BIAS_IN_MATMUL = ";bias_in_matmul"


def op_activation(activation: str, bias_in_matmul: bool) -> str:
    """The op's ``activation`` argument for a layer with this activation and bias form."""
    return activation + BIAS_IN_MATMUL if bias_in_matmul else activation


def split_activation(activation: str) -> tuple[str, bool]:
    """(the activation, whether the biases are added inside the matmuls) of an op's argument."""
    if activation.endswith(BIAS_IN_MATMUL):
        return activation[:-len(BIAS_IN_MATMUL)], True
    return activation, False

_ACT_FWD: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "identity": lambda z: z,
}

# d act(z)/dz applied to an incoming grad; the aten backward ops are the ones autograd uses for
# the eager model, so rewritten and original layers get bit-identical activation gradients. Even
# where aten's is inexact (GELU-tanh's 0.5 (1 + tanh u) cancels to exactly 0 in the negative
# tail): a more exact derivative there is a tiny nonzero gradient against eager's 0, which
# verification rightly calls a relative error of 1 (tests/test_fuzz.py's non-gated clamp example).
_ACT_BWD: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "silu": lambda g, z: torch.ops.aten.silu_backward(g, z),
    "gelu": lambda g, z: torch.ops.aten.gelu_backward(g, z, approximate="none"),
    "gelu_tanh": lambda g, z: torch.ops.aten.gelu_backward(g, z, approximate="tanh"),
    "relu": lambda g, z: torch.ops.aten.threshold_backward(g, z, 0),
    "sigmoid": lambda g, z: torch.ops.aten.sigmoid_backward(g, torch.sigmoid(z)),
    "identity": lambda g, z: g,
}

# (device type -> dtypes) for which F.grouped_mm has an eager kernel we have run. CPU: fp32,
# bf16, fp16 (checked on torch 2.13). CUDA: bf16 is the documented dtype (SM80+); others untested.
_GROUPED_MM_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}


def check_activation(activation: str, gated: bool | None = None) -> None:
    """ValueError unless ``activation`` is one of ``ACTIVATIONS`` or an ``expr:`` expression (that
    reads the gate only when ``gated`` is not False), either with the ``BIAS_IN_MATMUL`` suffix."""
    activation = split_activation(activation)[0]
    if is_expression(activation):
        if "g" in parse(activation).variables and gated is False:
            raise ValueError(f"expert activation {activation!r} reads the gate g, but the experts have no gate "
                             "projection")
        return
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; use one of {ACTIVATIONS} or an "
                         "'expr:' expression (moe_compile.lowering.activation)")


def activation_error(activation: str) -> str | None:
    """Why the Triton kernels cannot compute ``activation`` (None: they can). They evaluate
    ``act(gate) * up`` / ``act(up)`` for the names in ``ACTIVATIONS`` inside their tiles; an
    ``expr:`` activation runs on this torch lowering. They add biases inside their fp32
    accumulators, so either bias form (``BIAS_IN_MATMUL``) is theirs."""
    activation = split_activation(activation)[0]
    if activation in ACTIVATIONS:
        return None
    return (f"the Triton expert kernels compute act(gate) * up or act(up) for act in {ACTIVATIONS}, not the "
            f"expression activation {activation!r}; the torch lowering computes it "
            "(options={'kernels': 'torch'}, or 'auto', which chooses it for such layers)")


class _Routing(NamedTuple):
    order_N: Tensor  # slot ids (t*K + k) sorted stably by expert: the re-index vector
    tok_N: Tensor  # token row of each sorted slot
    expert_N: Tensor  # expert of each sorted slot (non-decreasing)
    offs_E: Tensor  # int32 end offset of each expert's block
    bounds: list[int] | None  # [0, end_0, ..., end_{E-1}] for the per-expert loop; None = grouped_mm


def _gmm_layout_ok(m: Tensor) -> bool:
    """Whether grouped_mm's kernel accepts m's strides (mirrors its meta check: row- or
    column-major, leading stride a multiple of 16 bytes). Symmetric under m.mT."""
    align = 16 // m.element_size()
    s_r, s_c = m.stride(-2), m.stride(-1)
    if s_r == 1 and s_c >= max(1, m.shape[-2]):
        lead = s_c
    elif s_c == 1 and s_r >= max(1, m.shape[-1]):
        lead = s_r
    else:
        return False
    return lead % align == 0 and m.data_ptr() % 16 == 0


def _use_grouped_mm(
    x_TH: Tensor, w_up_EFH: Tensor, w_gate_EFH: Tensor | None, w_down_EHF: Tensor
) -> bool:
    """grouped_mm for every matmul of this call, or the per-expert loop for all of them."""
    dtype, device = x_TH.dtype, x_TH.device
    if dtype not in _GROUPED_MM_DTYPES.get(device.type, ()):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    # The slot tensors we build (x_NH, up_NF, h_NF, dy_NH, ...) are fresh and contiguous, so
    # their leading strides are H and F.
    num_h, num_f = w_down_EHF.shape[-2], w_down_EHF.shape[-1]
    if (num_h * x_TH.element_size()) % 16 or (num_f * x_TH.element_size()) % 16:
        return False
    weights = [w for w in (w_up_EFH, w_gate_EFH, w_down_EHF) if w is not None]
    return all(w.dtype == dtype and _gmm_layout_ok(w) for w in weights)


def _route(topk_idx_TK: Tensor, num_experts: int, grouped: bool) -> _Routing:
    num_k = topk_idx_TK.shape[1]
    flat_N = topk_idx_TK.reshape(-1).long()
    # Stable so slots of one expert keep token order: the result is deterministic and the
    # per-expert row order matches a per-token loop.
    order_N = torch.argsort(flat_N, stable=True)
    expert_N = flat_N[order_N]
    # Same counts as bincount, but searchsorted needs no device sync to size its output.
    ends_E = torch.searchsorted(expert_N, torch.arange(num_experts, device=expert_N.device), right=True)
    bounds = None if grouped else [0, *ends_E.tolist()]  # the one host sync
    return _Routing(order_N, order_N // num_k, expert_N, ends_E.to(torch.int32), bounds)


def _seg_mm(a_NI: Tensor, b_EIO: Tensor, r: _Routing) -> Tensor:
    """Rows of expert e's block times b[e]: [N, I] x [E, I, O] -> [N, O]."""
    if r.bounds is None:
        return grouped_mm(a_NI, b_EIO, r.offs_E)
    out_NO = a_NI.new_zeros(a_NI.shape[0], b_EIO.shape[-1])
    for e in range(b_EIO.shape[0]):
        start, end = r.bounds[e], r.bounds[e + 1]
        if start < end:  # empty experts cost nothing
            out_NO[start:end] = a_NI[start:end] @ b_EIO[e]
    return out_NO


def _seg_wgrad(a_NO: Tensor, b_NI: Tensor, r: _Routing, num_experts: int) -> Tensor:
    """Per-expert a^T b over its block: [N, O] x [N, I] -> [E, O, I] (zero for empty experts)."""
    if r.bounds is None:
        return F.grouped_mm(a_NO.t(), b_NI, offs=r.offs_E)
    out_EOI = a_NO.new_zeros(num_experts, a_NO.shape[1], b_NI.shape[1])
    for e in range(num_experts):
        start, end = r.bounds[e], r.bounds[e + 1]
        if start < end:
            out_EOI[e] = a_NO[start:end].t() @ b_NI[start:end]
    return out_EOI


def _seg_sum(v_NX: Tensor, r: _Routing, num_experts: int, acc_dtype: torch.dtype) -> Tensor:
    return v_NX.new_zeros(num_experts, v_NX.shape[1], dtype=acc_dtype).index_add_(0, r.expert_N, v_NX.to(acc_dtype))


def out_dtype(x_TH: Tensor, topk_weights_TK: Tensor) -> torch.dtype:
    """The dtype of the expert op's result: the top-k weighting's, promote(x, topk_weights)."""
    return torch.promote_types(x_TH.dtype, topk_weights_TK.dtype)


def _acc_dtype(x_TH: Tensor, topk_weights_TK: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x_TH.dtype, topk_weights_TK.dtype), torch.float32)


class Kept(NamedTuple):
    """What a forward may keep for its backward instead of the backward recomputing it: the
    slots' pre-activations in expert-sorted order (the order ``_route`` gives again)."""

    up_NF: Tensor  # x W_up^T + b_up
    gate_NF: Tensor  # x W_gate^T + b_gate; zero-size when non-gated


class _Ffn(NamedTuple):
    x_NH: Tensor | None  # None where the gate/up op gathered the rows itself (list weights)
    up_NF: Tensor  # x W_up^T + b_up (pre-activation when non-gated)
    gate_NF: Tensor | None  # x W_gate^T + b_gate (pre-activation when gated)
    h_NF: Tensor
    y_NH: Tensor | None  # None when not asked for (backward needs h, not y)


Weights = Tensor | list[Tensor]  # [E, O, I], or E separate [O, I] (``experts_composite_list``)


def _linear(a_NI: Tensor, w_EOI: Weights, b_EO: Tensor | None, r: _Routing, once: bool) -> Tensor:
    """Each sorted slot's row through its expert's nn.Linear-layout weight (and bias); ``once``:
    the layer adds the bias inside the matmul (``_bias_in_matmul``)."""
    if _bias_in_matmul(a_NI, b_EO, once):
        # per-block addmm: the bias rounded once with the product, as nn.Linear rounds it
        return grouped_linear(a_NI, w_EOI if isinstance(w_EOI, list) else list(w_EOI.unbind(0)), r.offs_E, True,
                              b_EO)
    if isinstance(w_EOI, list):
        out_NO = grouped_linear(a_NI, w_EOI, r.offs_E, True, None)
    else:
        out_NO = _seg_mm(a_NI, w_EOI.mT, r)
    return _plus_bias(out_NO, b_EO, r)


def _bias_in_matmul(a_NI: Tensor, b_EO: Tensor | None, once: bool) -> bool:
    """Whether a projection adds its bias inside per-block ``addmm``s (``grouped_linear``): where
    the layer does (``once``, ``BIAS_IN_MATMUL``), in 16 bits, on the CPU. In fp32 the two forms
    differ by an fp32 rounding, and the grouped matmul is kept; on CUDA per-block ``addmm``s would
    read the block bounds to the host (a sync), so the bias is added after (module doc)."""
    return once and b_EO is not None and a_NI.dtype.itemsize < 4 and a_NI.device.type == "cpu"


def _linear_rows(x_TI: Tensor, w_EOI: Tensor, b_EO: Tensor | None, r: _Routing, once: bool) -> Tensor:
    """``_linear`` of the slots' token rows ``x[tok]`` (stacked weights, grouped routing), the rows
    gathered inside the matmul op (``grouped_mm_rows``): no [N, I] copy kept for the backward
    (but where the bias goes inside the matmul, ``_bias_in_matmul``)."""
    assert r.bounds is None, "grouped routing only"
    if _bias_in_matmul(x_TI, b_EO, once):
        return _linear(x_TI.index_select(0, r.tok_N), w_EOI, b_EO, r, once)
    return _plus_bias(grouped_mm_rows(x_TI, r.tok_N, w_EOI.mT, r.offs_E), b_EO, r)


def _plus_bias(v_NO: Tensor, b_EO: Tensor | None, r: _Routing) -> Tensor:
    """Each sorted slot's row plus its expert's bias (none: v itself)."""
    return v_NO if b_EO is None else v_NO + b_EO.index_select(0, r.expert_N)


class GateUp(NamedTuple):
    """Gate and up projections stored as one [E, 2F, H] tensor (transformers' ``gate_up_proj``):
    ``order`` "gate_first" / "up_first" (its two halves) or "interleaved" (gate at even rows);
    ``b_E2F``: their biases stored the same way as one [E, 2F] tensor (GPT-OSS's
    ``gate_up_proj_bias``), added to the [N, 2F] product before it is split, so its gradient is
    one reduction of the [N, 2F] gradient the backward writes anyway (two [N, F] halves' biases
    make the backward write each half apart as well)."""

    w_E2FH: Tensor
    order: str
    b_E2F: Tensor | None = None


GATE_UP_ORDERS = ("gate_first", "up_first", "interleaved")


def _split_gate_up(gu_N2F: Tensor, order: str) -> tuple[Tensor, Tensor]:
    """(gate, up) column views of the fused projection's [N, 2F] output. Split and unbind (not
    two slices): their backward writes the [N, 2F] gradient once (a cat or stack), where two
    slices' backward pads each half with zeros and sums the two."""
    if order == "interleaved":
        even, odd = gu_N2F.unflatten(1, (-1, 2)).unbind(-1)
        return even, odd
    first, second = gu_N2F.chunk(2, dim=1)
    return (first, second) if order == "gate_first" else (second, first)


def _ffn(
    x_TH: Tensor, r: _Routing, w_up_EFH: Weights | None, w_gate_EFH: Weights | None, w_down_EHF: Weights,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None, activation: str,
    output: bool = True, kept: Kept | None = None, gate_up: GateUp | None = None, keep_rows: bool = True,
) -> _Ffn:
    """The slots' FFN in expert-sorted order; ``kept``: the pre-activations a forward kept
    (``experts_reference_keep``), used instead of recomputing them; ``output``: also y;
    ``gate_up``: gate and up as one weight (``w_up_EFH`` and ``w_gate_EFH`` None), one matmul
    with 2F columns for both; E modules' gate and up weights (lists) are computed by one op
    (``grouped_linear_gate_up``); ``keep_rows`` False (grouped routing, stacked weights, no
    ``kept``): the matmuls gather the token rows themselves and no [N, H] copy is made to keep
    (``x_NH`` None), for callers whose backward is autograd's. ``activation`` may carry the
    ``BIAS_IN_MATMUL`` suffix (how the biases round)."""
    activation, once = split_activation(activation)
    x_NH: Tensor | None = None
    gate_NF: Tensor | None = None
    if gate_up is not None:
        if keep_rows:
            x_NH = x_TH.index_select(0, r.tok_N).contiguous()
            gu_N2F = _linear(x_NH, gate_up.w_E2FH, gate_up.b_E2F, r, once)
        else:
            gu_N2F = _linear_rows(x_TH, gate_up.w_E2FH, gate_up.b_E2F, r, once)
        gate_NF, up_NF = _split_gate_up(gu_N2F, gate_up.order)
        gate_NF, up_NF = _plus_bias(gate_NF, b_gate_EF, r), _plus_bias(up_NF, b_up_EF, r)
    elif isinstance(w_gate_EFH, list) and isinstance(w_up_EFH, list) and kept is None:
        # E modules' gate and up weights: one op gathers each block's rows and computes both,
        # so the [N, H] gathered rows are not kept for the backward (x is)
        if _bias_in_matmul(x_TH, b_up_EF, once) or _bias_in_matmul(x_TH, b_gate_EF, once):
            gate_NF, up_NF = grouped_linear_gate_up(x_TH, r.tok_N, w_gate_EFH, w_up_EFH, r.offs_E, b_gate_EF, b_up_EF)
        else:
            gate_NF, up_NF = grouped_linear_gate_up(x_TH, r.tok_N, w_gate_EFH, w_up_EFH, r.offs_E, None, None)
            gate_NF, up_NF = _plus_bias(gate_NF, b_gate_EF, r), _plus_bias(up_NF, b_up_EF, r)
    elif not keep_rows and kept is None and isinstance(w_up_EFH, Tensor) and not isinstance(w_gate_EFH, list):
        up_NF = _linear_rows(x_TH, w_up_EFH, b_up_EF, r, once)
        if w_gate_EFH is not None:
            gate_NF = _linear_rows(x_TH, w_gate_EFH, b_gate_EF, r, once)
    else:
        assert w_up_EFH is not None
        x_NH = x_TH.index_select(0, r.tok_N).contiguous()
        up_NF = kept.up_NF if kept is not None else _linear(x_NH, w_up_EFH, b_up_EF, r, once)
        if w_gate_EFH is not None:
            gate_NF = kept.gate_NF if kept is not None else _linear(x_NH, w_gate_EFH, b_gate_EF, r, once)
    if is_expression(activation):
        h_NF = parse(activation).forward(gate_NF, up_NF)
    elif gate_NF is not None:
        h_NF = _ACT_FWD[activation](gate_NF) * up_NF
    else:
        h_NF = _ACT_FWD[activation](up_NF)
    if not output:
        return _Ffn(x_NH, up_NF, gate_NF, h_NF, None)
    y_NH = _linear(h_NF, w_down_EHF, b_down_EH, r, once)
    return _Ffn(x_NH, up_NF, gate_NF, h_NF, y_NH)


def experts_reference(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
    w_up_EFH: Tensor, w_gate_EFH: Tensor | None, w_down_EHF: Tensor,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str,
) -> Tensor:
    """Forward of ``hiermoe::experts`` in plain torch: returns y_TH in ``out_dtype``."""
    return experts_reference_keep(x_TH, topk_idx_TK, topk_weights_TK, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF,
                                  b_gate_EF, b_down_EH, activation)[0]


def experts_reference_keep(
    x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
    w_up_EFH: Tensor, w_gate_EFH: Tensor | None, w_down_EHF: Tensor,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str,
) -> tuple[Tensor, Kept]:
    """``experts_reference``'s y_TH and the pre-activations its backward can take instead of
    recomputing them (``experts_reference_backward(..., kept=)``): [T*K, F] each, 2 of 3 forward
    matmuls the backward saves."""
    check_activation(activation)
    num_experts = w_up_EFH.shape[0]
    grouped = _use_grouped_mm(x_TH, w_up_EFH, w_gate_EFH, w_down_EHF)
    r = _route(topk_idx_TK, num_experts, grouped)
    ffn = _ffn(x_TH, r, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH, activation)
    acc = _acc_dtype(x_TH, topk_weights_TK)
    weight_N = topk_weights_TK.reshape(-1).index_select(0, r.order_N).to(acc)
    assert ffn.y_NH is not None
    contrib_NH = ffn.y_NH.to(acc) * weight_N[:, None]
    y_TH = x_TH.new_zeros(x_TH.shape, dtype=acc).index_add_(0, r.tok_N, contrib_NH)
    gate_NF = ffn.gate_NF if ffn.gate_NF is not None else ffn.up_NF.new_empty((0, ffn.up_NF.shape[1]))
    return y_TH.to(out_dtype(x_TH, topk_weights_TK)), Kept(ffn.up_NF, gate_NF)


def experts_reference_backward(
    grad_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
    w_up_EFH: Tensor, w_gate_EFH: Tensor | None, w_down_EHF: Tensor,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str, kept: Kept | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``experts_reference`` w.r.t. (x, topk_weights, w_up, w_gate, w_down, b_up,
    b_gate, b_down), recomputing the slot activations (up, gate, h; not the down projection) from
    the inputs (nothing large is saved), or from the pre-activations the forward ``kept``.

    An absent optional input gets a zero-size tensor (the op schema has no optional outputs).
    Every result is a fresh contiguous tensor in its input's dtype.
    """
    check_activation(activation)
    num_experts = w_up_EFH.shape[0]
    grouped = _use_grouped_mm(x_TH, w_up_EFH, w_gate_EFH, w_down_EHF)
    r = _route(topk_idx_TK, num_experts, grouped)
    ffn = _ffn(x_TH, r, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH, activation, output=False,
               kept=kept)
    activation = split_activation(activation)[0]
    acc = _acc_dtype(x_TH, topk_weights_TK)
    cd = x_TH.dtype

    def none() -> Tensor:  # outputs may not alias each other, so one fresh tensor per absent input
        return x_TH.new_empty(0)

    # Step 1: combine and down projection. y[t] += w * y_e with y_e = h W_down^T + b_down, so
    # dy_e = w * g[t], and dw = <g[t], y_e> = <g[t] W_down, h> + <g[t], b_down>: the forward's
    # y_e is not recomputed (one matmul fewer), g W_down is the input gradient's matmul anyway.
    g_NH = grad_TH.index_select(0, r.tok_N).to(acc)
    weight_N = topk_weights_TK.reshape(-1).index_select(0, r.order_N).to(acc)
    gw_NF = _seg_mm(g_NH.to(cd), w_down_EHF, r).to(acc)  # g W_down, per slot's expert
    d_weight_N = (gw_NF * ffn.h_NF.to(acc)).sum(-1)
    if b_down_EH is not None:
        d_weight_N = d_weight_N + (g_NH * b_down_EH.index_select(0, r.expert_N).to(acc)).sum(-1)
    d_weights = torch.empty_like(d_weight_N).index_copy_(0, r.order_N, d_weight_N)
    d_weights_TK = d_weights.view(topk_weights_TK.shape).to(topk_weights_TK.dtype).contiguous()
    dy_acc_NH = g_NH * weight_N[:, None]
    dy_NH = dy_acc_NH.to(cd)
    d_b_down = _seg_sum(dy_acc_NH, r, num_experts, acc).to(b_down_EH.dtype) if b_down_EH is not None else none()
    d_w_down_EHF = _seg_wgrad(dy_NH, ffn.h_NF, r, num_experts)
    dh_NF = (gw_NF * weight_N[:, None]).to(cd)

    # Step 2: activation (and gate).
    d_gate_NF: Tensor | None
    if is_expression(activation):
        d_gate_NF, d_up_NF = parse(activation).backward(dh_NF, ffn.gate_NF, ffn.up_NF)
        if ffn.gate_NF is not None and d_gate_NF is None:  # a gate the expression does not read
            d_gate_NF = torch.zeros_like(ffn.gate_NF)
    elif ffn.gate_NF is not None:
        act_bwd = _ACT_BWD[activation]
        d_up_NF = dh_NF * _ACT_FWD[activation](ffn.gate_NF)
        d_gate_NF = act_bwd(dh_NF * ffn.up_NF, ffn.gate_NF)
    else:
        d_up_NF = _ACT_BWD[activation](dh_NF, ffn.up_NF)
        d_gate_NF = None

    # Step 3: up (and gate) projection, then scatter slot grads back to token rows.
    d_b_up = _seg_sum(d_up_NF, r, num_experts, acc).to(b_up_EF.dtype) if b_up_EF is not None else none()
    assert ffn.x_NH is not None  # stacked weights: the rows were gathered
    d_w_up_EFH = _seg_wgrad(d_up_NF, ffn.x_NH, r, num_experts)
    dx_NH = _seg_mm(d_up_NF, w_up_EFH, r).to(acc)
    d_w_gate, d_b_gate = none(), none()
    if w_gate_EFH is not None:
        assert d_gate_NF is not None
        d_w_gate = _seg_wgrad(d_gate_NF, ffn.x_NH, r, num_experts).to(w_gate_EFH.dtype).contiguous()
        dx_NH = dx_NH + _seg_mm(d_gate_NF, w_gate_EFH, r).to(acc)
        if b_gate_EF is not None:
            d_b_gate = _seg_sum(d_gate_NF, r, num_experts, acc).to(b_gate_EF.dtype)
    dx_TH = x_TH.new_zeros(x_TH.shape, dtype=acc).index_add_(0, r.tok_N, dx_NH).to(cd)
    return (
        dx_TH.contiguous(),
        d_weights_TK,
        d_w_up_EFH.to(w_up_EFH.dtype).contiguous(),
        d_w_gate,
        d_w_down_EHF.to(w_down_EHF.dtype).contiguous(),
        d_b_up.contiguous(),
        d_b_gate.contiguous(),
        d_b_down.contiguous(),
    )
