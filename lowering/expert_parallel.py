"""The expert-parallel expert op ``hiermoe::ep_experts`` and its backward.

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

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from moe_compile.ep import groups, runtime
from moe_compile.lowering import hier_a2a
from moe_compile.lowering.experts_ref import check_activation

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


def _check_device(lay: runtime.EPLayer, x: Tensor) -> None:
    if x.device.type != lay.comm.device.type:
        raise ValueError(f"layer {lay.name}: tokens are on {x.device} but the mesh is on {lay.comm.device.type}; "
                         "build the mesh on the device the model runs on (init_device_mesh(device_type, ...))")


@contextlib.contextmanager
def _collective(lay: runtime.EPLayer, what: str) -> Iterator[None]:
    """Re-raise a failed collective (a peer died, hangs, or diverged) naming the layer and it."""
    try:
        yield
    except RuntimeError as e:
        raise groups.collective_error(f"layer {lay.name}", what, e) from e


def _phases(d: int, lay: runtime.EPLayer) -> str:
    return f"HD-{d}: " + ", ".join(p.name for p in lay.comm.phases(d))


def _local_pairs(ids_RS: Tensor, w_RS: Tensor, lay: runtime.EPLayer, by_expert: bool, w_dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(row r_P, slot column s_P, weight row of its expert wrow_P1, weight w_P1) of every valid
    slot; all must be local."""
    r_P, s_P = (ids_RS >= 0).nonzero(as_tuple=True)
    e_P = ids_RS[r_P, s_P]
    assert bool((lay.local_slot_E[e_P] >= 0).all()), "a row arrived at a rank that does not hold its expert"
    return r_P, s_P, lay.rows(by_expert)[e_P][:, None], w_RS[r_P, s_P][:, None].to(w_dtype)


def _local_forward(rows_RH: Tensor, ids_RS: Tensor, w_RS: Tensor, lay: runtime.EPLayer, by_expert: bool,
                   weights: list[Tensor | None], activation: str, w_dtype: torch.dtype) -> Tensor:
    """[R, H] float32: sum_s w[r, s] * FFN_{ids[r, s]}(rows[r]) over valid slots (each slot one
    ``hiermoe::experts`` token with K = 1)."""
    r_P, _, slot_P1, w_P1 = _local_pairs(ids_RS, w_RS, lay, by_expert, w_dtype)
    out_RH = rows_RH.new_zeros(rows_RH.shape, dtype=torch.float32)
    if r_P.numel():
        y_PH = torch.ops.hiermoe.experts(rows_RH[r_P], slot_P1, w_P1, *weights, activation)
        out_RH.index_add_(0, r_P, y_PH.float())
    return out_RH


def _local_backward(grad_RH: Tensor, rows_RH: Tensor, ids_RS: Tensor, w_RS: Tensor, lay: runtime.EPLayer,
                    by_expert: bool, weights: list[Tensor | None], activation: str, w_dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Grads of ``_local_forward``: rows [R, H], slot weights [R, S] float32, and the six weight
    tensors (zero-size for absent ones), through ``hiermoe::experts_backward``."""
    r_P, s_P, slot_P1, w_P1 = _local_pairs(ids_RS, w_RS, lay, by_expert, w_dtype)
    d_rows_RH = torch.zeros_like(rows_RH, dtype=torch.float32)
    d_w_RS = torch.zeros_like(w_RS, dtype=torch.float32)
    if not r_P.numel():
        return d_rows_RH, d_w_RS, [rows_RH.new_empty(0) if w is None else torch.zeros_like(w) for w in weights]
    d_x_PH, d_w_P1, *d_weights = torch.ops.hiermoe.experts_backward(
        grad_RH[r_P].to(rows_RH.dtype), rows_RH[r_P], slot_P1, w_P1, *weights, activation)
    d_rows_RH.index_add_(0, r_P, d_x_PH.float())
    d_w_RS[r_P, s_P] = d_w_P1[:, 0].float()
    return d_rows_RH, d_w_RS, d_weights


@torch.library.custom_op("hiermoe::ep_experts", mutates_args=(), schema=_SCHEMA)
def ep_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
               w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
               activation: str, layer: int, by_expert: bool) -> tuple[Tensor, Tensor]:
    lay = runtime.resolve(layer)
    _check_device(lay, x)
    lay.settle()  # an expert swap still in flight is put in force before the placement is read
    lay.last_topk = topk_idx.detach()
    with _collective(lay, "the exchange of routing statistics that chooses d*"):
        d = lay.choose_dimension(topk_idx)
    lay.begin_step(d)
    phases = lay.comm.phases(d)
    t0 = time.perf_counter()
    with _collective(lay, f"the forward dispatch all-to-alls ({_phases(d, lay)})"):
        rows_RH, ids_RS, w_RS, route = hier_a2a.dispatch(x, topk_idx, topk_weights, lay.expert_pos_E, phases,
                                                         lay.dedup, "forward", layer)
    t1 = time.perf_counter()
    out_RH = _local_forward(rows_RH, ids_RS, w_RS, lay, by_expert, [w_up, w_gate, w_down, b_up, b_gate, b_down],
                            activation, topk_weights.dtype)
    t2 = time.perf_counter()
    with _collective(lay, f"the forward combine all-to-alls ({_phases(d, lay)})"):
        y_TH, _ = hier_a2a.combine(out_RH.to(x.dtype), route, "forward")
    lay.add_comm_time("forward", (t1 - t0) + (time.perf_counter() - t2))
    return y_TH, torch.tensor([d, lay.version, lay.layer_id], dtype=torch.long)


@ep_experts.register_fake
def _ep_experts_fake(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
                     w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
                     activation: str, layer: int, by_expert: bool) -> tuple[Tensor, Tensor]:
    check_activation(activation)
    return x.new_empty(x.shape), x.new_empty((3,), dtype=torch.long, device="cpu")


@torch.library.custom_op("hiermoe::ep_experts_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def ep_experts_backward(grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor,
                        w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None,
                        b_down: Tensor | None, activation: str, layer: int, by_expert: bool, dim: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    d, version, actual = (int(v) for v in dim.tolist())
    lay = runtime.layer(actual)  # the layer the forward ran on (the graph's, or another model's weights')
    hidden = x.shape[1]
    if version != lay.version:
        raise RuntimeError(f"layer {lay.name}: its experts were swapped between this forward and its backward; "
                           "swap experts only after backward and the optimizer step (swapper.step() at the end "
                           "of the training step)")
    phases = lay.comm.phases(d)
    xg_TC = torch.cat([x, grad_out.to(x.dtype)], dim=1)
    t0 = time.perf_counter()
    with _collective(lay, f"the backward dispatch all-to-alls ({_phases(d, lay)})"):
        rows_RC, ids_RS, w_RS, route = hier_a2a.dispatch(xg_TC, topk_idx, topk_weights, lay.expert_pos_E, phases,
                                                         lay.dedup, "backward", layer)
    t1 = time.perf_counter()
    weights = [w_up, w_gate, w_down, b_up, b_gate, b_down]
    d_rows_RH, d_w_RS, d_weights = _local_backward(rows_RC[:, hidden:], rows_RC[:, :hidden], ids_RS, w_RS,
                                                   lay, by_expert, weights, activation, topk_weights.dtype)
    t2 = time.perf_counter()
    with _collective(lay, f"the backward combine all-to-alls ({_phases(d, lay)})"):
        d_x_TH, d_tw_TK = hier_a2a.combine(d_rows_RH.to(x.dtype), route, "backward", meta_RS=d_w_RS.float())
    lay.add_comm_time("backward", (t1 - t0) + (time.perf_counter() - t2))
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
