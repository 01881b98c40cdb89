"""``hiermoe::grouped_mm``: a grouped matmul over expert-sorted rows, with a fake that traces.

torch's ``_grouped_mm`` runs fp32 and fp16 on CPU, but its meta function (what a trace with
fake tensors runs) accepts bf16 only, so a graph that calls it on fp32 tokens cannot be traced.
This op wraps it with shapes-only fake kernels and an autograd formula in the same two grouped
matmuls, so ``experts_composite`` traces on every dtype ``experts_ref`` runs grouped.

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
    d_b = grouped_mm_wgrad(a_NI, g_NO, offs_E) if ctx.needs_input_grad[1] else None
    return d_a, d_b, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
