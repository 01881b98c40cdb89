"""The fused expert-parallel op ``hiermoe::ep_experts`` and its backward: the "resend" backward.

The expert-parallel pass emits the staged ops of ``ep_stages`` by default, whose backward moves
the forward's payload and keeps the dispatched rows ([R, H] per layer) from forward to backward.
This op keeps only its inputs and re-sends the tokens in backward instead (1.5x the forward's
payload): option ``"ep_backward": "resend"`` chooses it, for when activation memory is what
runs out.

Each rank calls it with its own tokens and weights holding its local experts; ``layer`` names
the ``moe_compile.ep.runtime.EPLayer`` holding the mesh, the placement table and the dispatch
settings. ``by_expert`` says how the weights are indexed: by expert id (stacked weights that
hold every expert, of which this rank reads only its own) or by local slot (this rank's shard,
or a stack of its expert modules). Both go through the layer's tables at run time, so an expert
swap (``moe_compile.swap``) changes where tokens go without a recompile.
Forward (HierMoE Section III-A, ``hier_a2a``):

    d       = the layer's fixed dimension, or d* (Eq. 6 / Alg. 1) from every rank's routing statistics
    rows    = dispatch(x, routing) over HD-d                  # tokens reach their experts' ranks
    partial = sum over each row's local slots of w * FFN_e(row)   # hiermoe::experts, one slot each
    y       = combine(partial)                                # summed at every relay on the way back

Backward dispatches ``[x | grad_y]`` rows along the same route (activations are recomputed, as
in ``hiermoe::experts``, so a relay keeps no [T*K, F] tensor between forward and backward),
differentiates the local experts (``hiermoe::experts_backward``), and combines ``grad_x`` (and the routing-weight
gradients, as float32 per-slot metadata) back. Local weight gradients stay on the rank that
owns the experts: summed over ranks they equal the eager gradients summed over ranks.

The op returns (y_TH, d_3): the dimension used, the placement version and the runtime layer
(the graph's, or the one of another model's weights the backend mapped it to for this call),
saved so backward uses the same route shape without another statistics all-reduce, and refuses
to run on a placement that changed after the forward (the tokens' experts may have moved).

Legend: T tokens, K top-k, H hidden, R rows at this rank after dispatch, S slots per row,
P (row, slot) pairs bound for local experts, E_l local experts.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from moe_compile.ep import runtime, worker
from moe_compile.lowering import hier_a2a
from moe_compile.lowering.ep_stages import (
    begin_forward,
    check_version,
    collective,
    collective_op,
    local_backward,
    local_forward,
)
from moe_compile.lowering.ep_stages import phase_names as _phases
from moe_compile.lowering.experts_ref import check_activation, out_dtype

_SCHEMA = (
    "(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_up, Tensor? w_gate, Tensor w_down, "
    "Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation, int layer, bool by_expert) -> (Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_up, Tensor? w_gate, "
    "Tensor w_down, Tensor? b_up, Tensor? b_gate, Tensor? b_down, str activation, int layer, bool by_expert, "
    "Tensor dim) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("hiermoe::ep_experts", mutates_args=(), schema=_SCHEMA)
def ep_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
               w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
               activation: str, layer: int, by_expert: bool) -> tuple[Tensor, Tensor]:
    lay = runtime.resolve(layer)
    d = begin_forward(lay, x, topk_idx)
    lay.saved_bytes = 0  # autograd keeps only the op's inputs
    phases = lay.phases(d)
    runtime.STEP_CLOCK.dispatched()
    t0 = time.perf_counter()
    with collective(lay, f"the forward dispatch all-to-alls ({_phases(d, lay)})"):
        rows_RH, ids_RS, w_RS, route = worker.run(x.device, lambda: hier_a2a.dispatch(
            x, topk_idx, topk_weights, lay.expert_pos_E, phases, lay.dedup, "forward", layer))
    t1 = time.perf_counter()
    out_RH, _ = local_forward(rows_RH, ids_RS, w_RS, lay, by_expert, [w_up, w_gate, w_down, b_up, b_gate, b_down],
                              activation, topk_weights.dtype)  # what it could keep is not: resend recomputes
    t2 = time.perf_counter()
    with collective(lay, f"the forward combine all-to-alls ({_phases(d, lay)})"):
        y_TH, _ = worker.run(x.device, lambda: hier_a2a.combine(out_RH.to(out_dtype(x, topk_weights)), route,
                                                               "forward"))
    lay.add_comm_time("forward", (t1 - t0) + (time.perf_counter() - t2))
    return y_TH, torch.tensor([d, lay.version, lay.layer_id], dtype=torch.long)


@ep_experts.register_fake
def _ep_experts_fake(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
                     w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
                     activation: str, layer: int, by_expert: bool) -> tuple[Tensor, Tensor]:
    check_activation(activation)
    return x.new_empty(x.shape, dtype=out_dtype(x, topk_weights)), x.new_empty((3,), dtype=torch.long, device="cpu")


@torch.library.custom_op("hiermoe::ep_experts_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def ep_experts_backward(grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor,
                        w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None,
                        b_down: Tensor | None, activation: str, layer: int, by_expert: bool, dim: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    d, version, actual = (int(v) for v in dim.tolist())
    lay = runtime.layer(actual)  # the layer the forward ran on (the graph's, or another model's weights')
    hidden = x.shape[1]
    check_version(lay, version)
    phases = lay.phases(d)
    xg_TC = torch.cat([x, grad_out.to(x.dtype)], dim=1)
    t0 = time.perf_counter()
    with collective(lay, f"the backward dispatch all-to-alls ({_phases(d, lay)})"):
        rows_RC, ids_RS, w_RS, route = worker.run(x.device, lambda: hier_a2a.dispatch(
            xg_TC, topk_idx, topk_weights, lay.expert_pos_E, phases, lay.dedup, "backward", layer))
    t1 = time.perf_counter()
    weights = [w_up, w_gate, w_down, b_up, b_gate, b_down]
    d_rows_RH, d_w_RS, d_weights = local_backward(rows_RC[:, hidden:], rows_RC[:, :hidden], ids_RS, w_RS,
                                                   lay, by_expert, weights, activation, topk_weights.dtype)
    t2 = time.perf_counter()
    with collective(lay, f"the backward combine all-to-alls ({_phases(d, lay)})"):
        d_x_TH, d_tw_TK = worker.run(x.device, lambda: hier_a2a.combine(d_rows_RH.to(x.dtype), route, "backward",
                                                                       meta_RS=d_w_RS.float()))
    lay.add_comm_time("backward", (t1 - t0) + (time.perf_counter() - t2))
    runtime.STEP_CLOCK.backward_done()
    assert d_tw_TK is not None
    return (d_x_TH, d_tw_TK.to(topk_weights.dtype), *d_weights)  # type: ignore[return-value]


@ep_experts_backward.register_fake
def _ep_experts_backward_fake(grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor,
                              w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None,
                              b_down: Tensor | None, activation: str, layer: int, by_expert: bool, dim: Tensor
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    def like(t: Tensor | None) -> Tensor:
        return x.new_empty(0) if t is None else t.new_empty(t.shape)

    return like(x), like(topk_weights), like(w_up), like(w_gate), like(w_down), like(b_up), like(b_gate), like(b_down)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    *tensors, activation, layer, by_expert = inputs
    ctx.save_for_backward(*tensors, output[1])
    ctx.activation, ctx.layer, ctx.by_expert = activation, layer, by_expert


def _backward(ctx: Any, grad_out: Tensor, _grad_dim: Tensor | None) -> tuple[Tensor | None, ...]:
    x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, dim = ctx.saved_tensors
    d_x, d_tw, *d_w = torch.ops.hiermoe.ep_experts_backward(
        grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, ctx.activation,
        ctx.layer, ctx.by_expert, dim)
    inputs = (w_up, w_gate, w_down, b_up, b_gate, b_down)
    return (d_x, None, d_tw, *(None if t is None else g for g, t in zip(d_w, inputs, strict=True)), None, None, None)


ep_experts.register_autograd(_backward, setup_context=_setup_context)
collective_op(torch.ops.hiermoe.ep_experts.default)
collective_op(torch.ops.hiermoe.ep_experts_backward.default)
