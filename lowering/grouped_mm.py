"""``hiermoe::grouped_mm``: a grouped matmul over expert-sorted rows, with a fake that traces;
``hiermoe::grouped_linear``: the same over E separate weights (experts stored as E modules).

torch's ``_grouped_mm`` runs fp32 and fp16 on CPU, but its meta function (what a trace with
fake tensors runs) accepts bf16 only, so a graph that calls it on fp32 tokens cannot be traced.
This op wraps it with shapes-only fake kernels and an autograd formula in the same two grouped
matmuls, so ``experts_composite`` traces on every dtype ``experts_ref`` runs grouped.

``grouped_linear`` takes the E weights as a list, so experts kept as E ``nn.Linear`` modules are
never stacked into one [E, O, I] copy (forward or backward), and each weight's gradient is its
own row-major [O, I] tensor, as eager's ``nn.Linear`` backward gives it: AccumulateGrad takes it
as the parameter's ``.grad`` without a copy. It runs one ``mm`` per expert block, which on CPU is
what ``_grouped_mm`` does too; the block bounds are read to the host (a sync on CUDA, where
``lower_kernels`` does not choose it).

``grouped_mm_rows`` is ``grouped_mm`` of gathered token rows that gathers them itself (forward
and backward), so the [N, I] gathered rows are not kept for the backward.

``grouped_linear_gate_up`` is the gate and up projections of such experts in one op that
gathers each expert block's token rows itself (and again in its backward): the [N, H] gathered
rows are never kept from forward to backward, only the tokens, which the router keeps anyway.

Shape legend: N rows sorted by expert, E experts, I input and O output features; ``offs_E`` the
int32 end offset of each expert's block of rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("hiermoe::grouped_mm", mutates_args=())
def grouped_mm(a_NI: Tensor, b_EIO: Tensor, offs_E: Tensor) -> Tensor:
    """Rows of expert e's block times b[e]: [N, I] x [E, I, O] -> [N, O]."""
    return F.grouped_mm(a_NI.contiguous(), b_EIO, offs=offs_E).contiguous()


@grouped_mm.register_fake
def _grouped_mm_fake(a_NI: Tensor, b_EIO: Tensor, offs_E: Tensor) -> Tensor:
    return a_NI.new_empty((a_NI.shape[0], b_EIO.shape[-1]))


@torch.library.custom_op("hiermoe::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(a_NI: Tensor, g_NO: Tensor, offs_E: Tensor) -> Tensor:
    """Per expert a^T g over its block: [N, I] x [N, O] -> [E, I, O] (zero for an empty block)."""
    return F.grouped_mm(a_NI.contiguous().t(), g_NO.contiguous(), offs=offs_E).contiguous()


@grouped_mm_wgrad.register_fake
def _grouped_mm_wgrad_fake(a_NI: Tensor, g_NO: Tensor, offs_E: Tensor) -> Tensor:
    return a_NI.new_empty((offs_E.shape[0], a_NI.shape[1], g_NO.shape[1]))


def _setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, g_NO: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    a_NI, b_EIO, offs_E = ctx.saved_tensors
    g_NO = g_NO.contiguous()  # an expanded gradient (strides 0) is no layout grouped_mm takes
    d_a = grouped_mm(g_NO, b_EIO.mT, offs_E) if ctx.needs_input_grad[0] else None
    d_b = _weight_grad(a_NI, g_NO, b_EIO, offs_E) if ctx.needs_input_grad[1] else None
    return d_a, d_b, None


def _weight_grad(a_NI: Tensor, g_NO: Tensor, b_EIO: Tensor, offs_E: Tensor) -> Tensor:
    """b's gradient per expert block, a^T g. Where b is the transpose of an [E, O, I] weight
    (nn.Linear's layout) it is computed in that layout (g^T a), so it comes out with the weight's
    strides and AccumulateGrad keeps it as .grad instead of copying a column-major a^T g into
    row-major."""
    if b_EIO.stride(-2) == 1 and b_EIO.stride(-1) != 1:
        return grouped_mm_wgrad(g_NO, a_NI, offs_E).mT
    return grouped_mm_wgrad(a_NI, g_NO, offs_E)


grouped_mm.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("hiermoe::grouped_mm_rows", mutates_args=())
def grouped_mm_rows(x_TI: Tensor, rows_N: Tensor, b_EIO: Tensor, offs_E: Tensor) -> Tensor:
    """``grouped_mm(x[rows], b, offs)``: slot n's row is token row ``x[rows[n]]``. The rows are
    gathered here and again in the backward (for b's gradient), so the [N, I] gathered copy is not
    kept from forward to backward, only x and the row indices, which the router keeps anyway."""
    return grouped_mm(x_TI.index_select(0, rows_N), b_EIO, offs_E)


@grouped_mm_rows.register_fake
def _grouped_mm_rows_fake(x_TI: Tensor, rows_N: Tensor, b_EIO: Tensor, offs_E: Tensor) -> Tensor:
    return x_TI.new_empty((rows_N.shape[0], b_EIO.shape[-1]))


def _setup_rows(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward_rows(ctx: Any, g_NO: Tensor) -> tuple[Tensor | None, None, Tensor | None, None]:
    x_TI, rows_N, b_EIO, offs_E = ctx.saved_tensors
    g_NO = g_NO.contiguous()
    d_x = None
    if ctx.needs_input_grad[0]:
        # each slot's input gradient added into its token row (a token has K slots)
        d_x = torch.zeros_like(x_TI).index_add_(0, rows_N, grouped_mm(g_NO, b_EIO.mT, offs_E))
    # the rows gathered again for b's gradient (not kept from the forward)
    d_b = _weight_grad(x_TI.index_select(0, rows_N), g_NO, b_EIO, offs_E) if ctx.needs_input_grad[2] else None
    return d_x, None, d_b, None


grouped_mm_rows.register_autograd(_backward_rows, setup_context=_setup_rows)


def _blocks(offs_E: Tensor) -> list[tuple[int, int]]:
    ends = [int(e) for e in offs_E.tolist()]
    return list(zip([0, *ends[:-1]], ends, strict=True))


@torch.library.custom_op("hiermoe::grouped_linear", mutates_args=())
def grouped_linear(a_NI: Tensor, w_E: list[Tensor], offs_E: Tensor, transpose: bool,
                   bias_EO: Tensor | None) -> Tensor:
    """Rows of expert e's block times w[e]^T (``transpose``: nn.Linear's [O, I] weights) or times
    w[e] ([I, O]), plus bias[e] where given: [N, I] x E weights -> [N, O]. Rows past the last
    offset are not written. The bias is added inside the matmul (``addmm``), rounded once with
    the product as ``nn.Linear`` rounds it: in bf16, a product rounded before its bias is added
    is one ulp off in a third of the entries, and a pre-activation at a ReLU's kink then takes
    the other side (a gradient of 0 where the layer's is not)."""
    num_o = w_E[0].shape[0] if transpose else w_E[0].shape[1]
    out_NO = a_NI.new_empty((a_NI.shape[0], num_o))
    for e, (w, (start, end)) in enumerate(zip(w_E, _blocks(offs_E), strict=True)):
        if start < end:  # an empty expert costs nothing
            _block_linear(a_NI[start:end], w.t() if transpose else w, None if bias_EO is None else bias_EO[e],
                          out_NO[start:end])
    return out_NO


def _block_linear(a: Tensor, w: Tensor, b: Tensor | None, out: Tensor) -> None:
    if b is None:
        torch.mm(a, w, out=out)
    else:
        torch.addmm(b, a, w, out=out)


def _bias_grad(g_NO: Tensor, offs_E: Tensor, dtype: torch.dtype) -> Tensor:
    """Per expert block, the sum of its rows' gradients (accumulated in fp32): the [E, O]
    gradient of the experts' biases, zero for an empty block. Each row's block from the offsets
    on the device (no host read, so the backward traces): rows past the last offset land in a
    bucket E that is dropped."""
    num_e = offs_E.shape[0]
    rows = torch.arange(g_NO.shape[0], device=g_NO.device, dtype=offs_E.dtype)
    block_N = torch.bucketize(rows, offs_E, right=True)
    d_b = g_NO.new_zeros((num_e + 1, g_NO.shape[1]), dtype=torch.float32).index_add_(0, block_N, g_NO.float())
    return d_b[:num_e].to(dtype)


@grouped_linear.register_fake
def _grouped_linear_fake(a_NI: Tensor, w_E: list[Tensor], offs_E: Tensor, transpose: bool,
                         bias_EO: Tensor | None) -> Tensor:
    return a_NI.new_empty((a_NI.shape[0], w_E[0].shape[0] if transpose else w_E[0].shape[1]))


@torch.library.custom_op("hiermoe::grouped_linear_wgrad", mutates_args=())
def grouped_linear_wgrad(g_NO: Tensor, a_NI: Tensor, offs_E: Tensor) -> list[Tensor]:
    """Per expert g^T a over its block: E separate row-major [O, I] tensors (zero for an empty
    block)."""
    out = []
    for start, end in _blocks(offs_E):
        if start < end:
            out.append(torch.mm(g_NO[start:end].t(), a_NI[start:end]))
        else:
            out.append(g_NO.new_zeros((g_NO.shape[1], a_NI.shape[1])))
    return out


@grouped_linear_wgrad.register_fake
def _grouped_linear_wgrad_fake(g_NO: Tensor, a_NI: Tensor, offs_E: Tensor) -> list[Tensor]:
    return [g_NO.new_empty((g_NO.shape[1], a_NI.shape[1])) for _ in range(offs_E.shape[0])]


def _setup_linear(ctx: Any, inputs: tuple[Tensor, list[Tensor], Tensor, bool, Tensor | None], output: Tensor) -> None:
    a_NI, w_E, offs_E, transpose, bias_EO = inputs
    ctx.save_for_backward(a_NI, offs_E, *w_E)
    ctx.transpose = transpose
    ctx.bias_dtype = bias_EO.dtype if bias_EO is not None else None


def _backward_linear(ctx: Any, g_NO: Tensor) -> tuple[Tensor | None, list[Tensor] | None, None, None, Tensor | None]:
    a_NI, offs_E, *w_E = ctx.saved_tensors
    g_NO = g_NO.contiguous()
    d_b = _bias_grad(g_NO, offs_E, ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[4] else None
    d_a = grouped_linear(g_NO, w_E, offs_E, not ctx.transpose, None) if ctx.needs_input_grad[0] else None
    d_w = None
    if ctx.needs_input_grad[1]:
        # y = a w^T: dw = g^T a ([O, I]); y = a w: dw = a^T g ([I, O]); each its weight's layout
        d_w = grouped_linear_wgrad(g_NO, a_NI, offs_E) if ctx.transpose else grouped_linear_wgrad(a_NI, g_NO, offs_E)
    return d_a, d_w, None, None, d_b


grouped_linear.register_autograd(_backward_linear, setup_context=_setup_linear)


@torch.library.custom_op("hiermoe::grouped_linear_gate_up", mutates_args=())
def grouped_linear_gate_up(x_TH: Tensor, rows_N: Tensor, w_gate_E: list[Tensor], w_up_E: list[Tensor],
                           offs_E: Tensor, b_gate_EF: Tensor | None, b_up_EF: Tensor | None,
                           ) -> tuple[Tensor, Tensor]:
    """Gate and up projections of E experts stored as E modules each: slot n (sorted by expert)
    is token row ``x[rows[n]]`` times its expert's gate weight^T and up weight^T, plus their
    biases where given (inside the matmul, as ``grouped_linear``), [N, F] each. The rows are
    gathered per expert block here and again in the backward, so no [N, H] gathered copy is
    kept for the backward (x is)."""
    num_n, num_f = rows_N.shape[0], w_gate_E[0].shape[0]
    gate_NF, up_NF = x_TH.new_empty((num_n, num_f)), x_TH.new_empty((num_n, num_f))
    for e, (w_g, w_u, (start, end)) in enumerate(zip(w_gate_E, w_up_E, _blocks(offs_E), strict=True)):
        if start < end:
            a = x_TH.index_select(0, rows_N[start:end])
            _block_linear(a, w_g.t(), None if b_gate_EF is None else b_gate_EF[e], gate_NF[start:end])
            _block_linear(a, w_u.t(), None if b_up_EF is None else b_up_EF[e], up_NF[start:end])
    return gate_NF, up_NF


@grouped_linear_gate_up.register_fake
def _grouped_linear_gate_up_fake(x_TH: Tensor, rows_N: Tensor, w_gate_E: list[Tensor], w_up_E: list[Tensor],
                                 offs_E: Tensor, b_gate_EF: Tensor | None, b_up_EF: Tensor | None,
                                 ) -> tuple[Tensor, Tensor]:
    shape = (rows_N.shape[0], w_gate_E[0].shape[0])
    return x_TH.new_empty(shape), x_TH.new_empty(shape)


@torch.library.custom_op("hiermoe::grouped_linear_gate_up_backward", mutates_args=())
def grouped_linear_gate_up_backward(
    g_gate_NF: Tensor, g_up_NF: Tensor, x_TH: Tensor, rows_N: Tensor, w_gate_E: list[Tensor], w_up_E: list[Tensor],
    offs_E: Tensor,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """(dL/dx [T, H], E gate weight gradients, E up weight gradients) of ``grouped_linear_gate_up``:
    per expert block, the rows' input gradient g_gate W_gate + g_up W_up (one mm, one addmm) added
    into their token rows, and g^T a for each weight in its [F, H] layout (zero for an empty block)."""
    d_x = torch.zeros_like(x_TH)
    d_gate, d_up = [], []
    for w_g, w_u, (start, end) in zip(w_gate_E, w_up_E, _blocks(offs_E), strict=True):
        if start == end:
            d_gate.append(torch.zeros_like(w_g))
            d_up.append(torch.zeros_like(w_u))
            continue
        rows = rows_N[start:end]
        a = x_TH.index_select(0, rows)
        g_g, g_u = g_gate_NF[start:end], g_up_NF[start:end]
        d_x.index_add_(0, rows, torch.mm(g_g, w_g).addmm_(g_u, w_u))
        d_gate.append(torch.mm(g_g.t(), a))
        d_up.append(torch.mm(g_u.t(), a))
    return d_x, d_gate, d_up


@grouped_linear_gate_up_backward.register_fake
def _grouped_linear_gate_up_backward_fake(
    g_gate_NF: Tensor, g_up_NF: Tensor, x_TH: Tensor, rows_N: Tensor, w_gate_E: list[Tensor], w_up_E: list[Tensor],
    offs_E: Tensor,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    return torch.empty_like(x_TH), [torch.empty_like(w) for w in w_gate_E], [torch.empty_like(w) for w in w_up_E]


def _setup_gate_up(ctx: Any, inputs: tuple[Tensor, Tensor, list[Tensor], list[Tensor], Tensor, Tensor | None,
                                           Tensor | None], output: tuple[Tensor, Tensor]) -> None:
    x_TH, rows_N, w_gate_E, w_up_E, offs_E, b_gate_EF, b_up_EF = inputs
    ctx.save_for_backward(x_TH, rows_N, offs_E, *w_gate_E, *w_up_E)
    ctx.num_experts = len(w_gate_E)
    ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (b_gate_EF, b_up_EF))


def _backward_gate_up(ctx: Any, g_gate_NF: Tensor | None, g_up_NF: Tensor | None,
                      ) -> tuple[Tensor | None, None, list[Tensor], list[Tensor], None, Tensor | None, Tensor | None]:
    x_TH, rows_N, offs_E, *ws = ctx.saved_tensors
    num_e = ctx.num_experts
    shape = (rows_N.shape[0], ws[0].shape[0])
    g_g = g_gate_NF.contiguous() if g_gate_NF is not None else x_TH.new_zeros(shape)
    g_u = g_up_NF.contiguous() if g_up_NF is not None else x_TH.new_zeros(shape)
    d_x, d_gate, d_up = grouped_linear_gate_up_backward(g_g, g_u, x_TH, rows_N, ws[:num_e], ws[num_e:], offs_E)
    d_b_gate, d_b_up = (_bias_grad(g, offs_E, dt) if dt is not None and ctx.needs_input_grad[i] else None
                        for g, dt, i in ((g_g, ctx.bias_dtypes[0], 5), (g_u, ctx.bias_dtypes[1], 6)))
    return d_x if ctx.needs_input_grad[0] else None, None, d_gate, d_up, None, d_b_gate, d_b_up


grouped_linear_gate_up.register_autograd(_backward_gate_up, setup_context=_setup_gate_up)
