"""The expert op ``hiermoe::experts``: one dropless, sort-based MoE expert layer.

Every MoE layer the passes find is rewritten into one call of this op (dispatch, expert FFN
and top-k combine together). This module registers the op with torch.library: the eager
kernel is the torch reference lowering in ``experts_ref`` (grouped matmuls over the
expert-sorted slots, after HEXA-MoE's data-centric ESMM; the Triton ESMM kernels come later
as another lowering of the same op), a fake kernel for tracing (symbolic T works), and an
autograd formula whose backward is itself the custom op ``hiermoe::experts_backward``.

What backward keeps: only the op's inputs (x, topk_idx, topk_weights and the weight/bias
tensors, which the model holds anyway); the slot activations are recomputed in backward,
so no [T*K, F] tensor outlives the forward.

Double backward is not supported: ``hiermoe::experts_backward`` has no autograd formula and
differentiating through it raises.

Shape legend: T tokens, K experts per token, E experts, H hidden size, F ffn size;
x_TH, topk_idx_TK, topk_weights_TK, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF,
b_down_EH, grad_TH.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe_compile.lowering.experts_ref import (
    ACTIVATIONS,
    check_activation,
    experts_reference,
    experts_reference_backward,
    out_dtype,
)

__all__ = ["ACTIVATIONS", "experts", "experts_backward", "experts_flops", "experts_reference"]

_EXPERTS_SCHEMA = (
    "(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_up, Tensor? w_gate, Tensor w_down, "
    "Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation) -> Tensor"
)
# Outputs: grads of x, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down. The schema has
# no optional outputs, so an absent optional input gets a zero-size tensor here and None in
# the autograd formula.
_EXPERTS_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_up, Tensor? w_gate, "
    "Tensor w_down, Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("hiermoe::experts", mutates_args=(), schema=_EXPERTS_SCHEMA)
def experts(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
    w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
    activation: str,
) -> Tensor:
    """y_TH[t] = sum_k topk_weights[t, k] * FFN_{topk_idx[t, k]}(x[t]); see ``experts_ref``."""
    return experts_reference(x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation)


@experts.register_fake
def _experts_fake(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
    w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
    activation: str,
) -> Tensor:
    check_activation(activation, gated=w_gate is not None)  # fail at compile time, not at the first step
    return x.new_empty(x.shape, dtype=out_dtype(x, topk_weights))


@torch.library.custom_op("hiermoe::experts_backward", mutates_args=(), schema=_EXPERTS_BACKWARD_SCHEMA)
def experts_backward(
    grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
    w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Grads of ``hiermoe::experts`` from its inputs (activations recomputed)."""
    return experts_reference_backward(
        grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation
    )


@experts_backward.register_fake
def _experts_backward_fake(
    grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
    w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_activation(activation, gated=w_gate is not None)

    def like(t: Tensor | None) -> Tensor:
        # The eager kernel returns contiguous grads, so new_empty (contiguous) matches its strides.
        return x.new_empty(0) if t is None else t.new_empty(t.shape)

    return like(x), like(topk_weights), like(w_up), like(w_gate), like(w_down), like(b_up), like(b_gate), like(b_down)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    *tensors, activation = inputs
    ctx.save_for_backward(*tensors)  # inputs only; backward recomputes the rest
    ctx.activation = activation


def _backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down = ctx.saved_tensors
    d_x, d_tw, d_w_up, d_w_gate, d_w_down, d_b_up, d_b_gate, d_b_down = torch.ops.hiermoe.experts_backward(
        grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, ctx.activation
    )

    def given(grad: Tensor, inp: Tensor | None) -> Tensor | None:
        return None if inp is None else grad

    return (
        d_x, None, d_tw, d_w_up, given(d_w_gate, w_gate), d_w_down,
        given(d_b_up, b_up), given(d_b_gate, b_gate), given(d_b_down, b_down), None,
    )


experts.register_autograd(_backward, setup_context=_setup_context)


def experts_flops(T: int, K: int, H: int, F: int, gated: bool) -> int:  # noqa: N803 (paper symbols)
    """Forward matmul FLOPs of the op: T*K slots, each 2 (non-gated) or 3 (gated) [H x F]
    matmuls at 2 FLOPs per multiply-add. Activation, bias and combine are ignored (O(T*K*(F+H)))."""
    return 2 * T * K * H * F * (3 if gated else 2)
