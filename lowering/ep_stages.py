"""Expert parallelism as three graph-visible stages: ``hiermoe::ep_dispatch``,
``hiermoe::ep_local_experts`` and ``hiermoe::ep_combine``, each with its adjoint as backward.

The expert-parallel pass replaces a layer's ``hiermoe::experts`` by (HierMoE Section III-A, HD-d):

    rows, ids, w, route = ep_dispatch(x, topk_idx, topk_weights)   # tokens reach their experts' ranks
    partial             = ep_local_experts(rows, ids, w, weights, route)   # sum_s w * FFN_e(row)
    y                   = ep_combine(partial, route, T)             # summed at every relay on the way back

``route`` is an int64 CPU tensor (``hier_a2a.Route.pack``): the dimension d, the placement
version, the runtime layer the forward ran on, and per hop the split sizes and which row every
sent row came from. It is an ordinary value of the graph, so nothing is kept outside autograd's
saved tensors: a forward without backward leaves nothing behind.

Backward (each op's autograd is the adjoint of its forward; papers/hiermoe.txt: "combine is the
reverse of dispatch"):

    ep_combine'       d_partial = redispatch(d_y, route)       # dispatch-shaped, payload only
    ep_local_experts' d_rows, d_w, d_weights from the dispatched rows saved by autograd
    ep_dispatch'      d_x, d_topk_weights = combine(d_rows, route, meta = d_w)

so backward moves exactly the forward's token payload (one dispatch, one combine), where the
fused ``hiermoe::ep_experts`` re-dispatches ``[x | grad_y]`` (1.5x). The price is the
dispatched rows ([R, H] per layer) kept from forward to backward; ``explain`` reports them per
layer (``EPLayer.saved_bytes``).

Under sample placement a fused cut's layer ends in ``hiermoe::ep_combine_to(partial, route, perm,
B, T, offset, T)`` instead (``passes.sample_binding.fuse_combines``): the combine delivers each token's
result to the rank its sample moves to (``hier_a2a.combine_to_steps``; a step that moves no sample
combines plainly), and its backward brings the gradients back from there.

Dtypes: the rows travel in the tokens' dtype, the slot weights as float32 metadata (back in the
routing weights' dtype on arrival), and the partial sums and ``y`` in promote(tokens, routing
weights), the dtype ``hiermoe::experts`` returns: under torch.autocast the tokens go out in bf16
and the partial sums come back in float32, as the layer weights bf16 expert outputs by float32
routing weights and sums them in float32 (sent in bf16 they were rounded where eager's are not).

Legend: T tokens, K top-k, H hidden, R rows at this rank after dispatch, S slots per row (K
with dedup, 1 without), P (row, slot) pairs bound for local experts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.fx.node import has_side_effect

from moe_compile.ep import groups, runtime, worker
from moe_compile.lowering import hier_a2a
from moe_compile.lowering.experts_ref import (
    Kept,
    check_activation,
    experts_reference_backward,
    experts_reference_keep,
    out_dtype,
)

# route header: d, placement version, runtime layer id
_HEADER = 3
_WEIGHTS = "Tensor w_up, Tensor? w_gate, Tensor w_down, Tensor? b_up, Tensor? b_gate, Tensor? b_down"


def check_device(lay: runtime.EPLayer, x: Tensor) -> None:
    if x.device.type != lay.comm.device.type:
        raise ValueError(f"layer {lay.name}: tokens are on {x.device} but the mesh is on {lay.comm.device.type}; "
                         "build the mesh on the device the model runs on (init_device_mesh(device_type, ...))")


@contextlib.contextmanager
def collective(lay: runtime.EPLayer, what: str) -> Iterator[None]:
    """Re-raise a failed collective (a peer died, hangs, or diverged) naming the layer and it."""
    try:
        yield
    except RuntimeError as e:
        raise groups.collective_error(f"layer {lay.name}", what, e) from e


def phase_names(d: int, lay: runtime.EPLayer) -> str:
    return f"HD-{d}: " + ", ".join(p.name for p in lay.phases(d))


def begin_forward(lay: runtime.EPLayer, x: Tensor, topk_idx: Tensor) -> int:
    """What every forward does before its dispatch: check the device, put in force a swap still
    in flight (before the placement is read), choose d (the per-step statistics exchange) and
    start the layer's step record. Returns d."""
    check_device(lay, x)
    lay.settle()
    lay.last_topk = topk_idx.detach()
    with collective(lay, "the exchange of routing statistics that chooses d*"):
        d = lay.choose_dimension(topk_idx)
    lay.begin_step(d)
    return d


def check_version(lay: runtime.EPLayer, version: int) -> None:
    if version != lay.version:
        raise RuntimeError(f"layer {lay.name}: its experts were swapped between this forward and its backward; "
                           "swap experts only after backward and the optimizer step (swapper.step() at the end "
                           "of the training step)")


def _local_pairs(ids_RS: Tensor, w_RS: Tensor, lay: runtime.EPLayer, by_expert: bool, w_dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(row r_P, slot column s_P, weight row of its expert wrow_P1, weight w_P1) of every valid
    slot; all must be local."""
    r_P, s_P = (ids_RS >= 0).nonzero(as_tuple=True)
    row_P = lay.weight_rows(by_expert)[ids_RS[r_P, s_P]]
    assert bool((row_P >= 0).all()), "a row arrived at a rank that does not hold its expert"
    return r_P, s_P, row_P[:, None], w_RS[r_P, s_P][:, None].to(w_dtype)


def _weight_rows(ids_RS: Tensor, lay: runtime.EPLayer, by_expert: bool) -> Tensor:
    """[R, S] the weight row of every slot's expert, -1 for no slot: the routing the Triton kernels
    take as it is (they skip ids outside [0, E)), so no row is copied per slot."""
    valid = ids_RS >= 0
    row_RS = lay.weight_rows(by_expert)[ids_RS.clamp(min=0)]
    assert bool((row_RS >= 0)[valid].all()), "a row arrived at a rank that does not hold its expert"
    return torch.where(valid, row_RS, -1)


def local_forward(rows_RH: Tensor, ids_RS: Tensor, w_RS: Tensor, lay: runtime.EPLayer, by_expert: bool,
                  weights: list[Tensor | None], activation: str, w_dtype: torch.dtype, triton: bool = False
                  ) -> tuple[Tensor, Kept]:
    """([R, H] float32: sum_s w[r, s] * FFN_{ids[r, s]}(rows[r]) over valid slots, what backward
    may take instead of recomputing: the valid slots' pre-activations, zero-size with ``triton``).
    ``triton``: one ``hiermoe::experts_triton`` call over the dispatched rows and their [R, S]
    slots (the ESMM kernels gather each slot's row themselves); else each valid slot one token
    of ``experts_reference`` with K = 1."""
    w_up, w_gate, w_down, b_up, b_gate, b_down = weights
    assert w_up is not None and w_down is not None

    def nothing() -> Kept:  # two tensors: a custom op's outputs may not alias each other
        return Kept(rows_RH.new_empty((0, w_down.shape[-1])), rows_RH.new_empty((0, w_down.shape[-1])))

    if triton:
        return torch.ops.hiermoe.experts_triton(rows_RH, _weight_rows(ids_RS, lay, by_expert), w_RS.to(w_dtype),
                                                *weights, activation).float(), nothing()
    r_P, _, slot_P1, w_P1 = _local_pairs(ids_RS, w_RS, lay, by_expert, w_dtype)
    out_RH = rows_RH.new_zeros(rows_RH.shape, dtype=torch.float32)
    if not r_P.numel():
        return out_RH, nothing()
    y_PH, kept = experts_reference_keep(rows_RH[r_P], slot_P1, w_P1, w_up, w_gate, w_down, b_up, b_gate, b_down,
                                        activation)
    out_RH.index_add_(0, r_P, y_PH.float())
    return out_RH, kept


def local_backward(grad_RH: Tensor, rows_RH: Tensor, ids_RS: Tensor, w_RS: Tensor, lay: runtime.EPLayer,
                   by_expert: bool, weights: list[Tensor | None], activation: str, w_dtype: torch.dtype,
                   triton: bool = False, kept: Kept | None = None) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Grads of ``local_forward``: rows [R, H] float32, slot weights [R, S] float32 (0 where no
    slot), and the six weight tensors (zero-size for absent ones), through
    ``experts_reference_backward`` (or ``hiermoe::experts_triton_backward``), from the
    pre-activations ``local_forward`` kept where given, else (None) recomputed."""
    if triton:
        d_rows_RH, d_w_RS, *d_weights = torch.ops.hiermoe.experts_triton_backward(
            grad_RH.to(rows_RH.dtype), rows_RH, _weight_rows(ids_RS, lay, by_expert), w_RS.to(w_dtype), *weights,
            activation)
        return d_rows_RH.float(), d_w_RS.float(), d_weights
    r_P, s_P, slot_P1, w_P1 = _local_pairs(ids_RS, w_RS, lay, by_expert, w_dtype)
    d_rows_RH = torch.zeros_like(rows_RH, dtype=torch.float32)
    d_w_RS = torch.zeros_like(w_RS, dtype=torch.float32)
    if not r_P.numel():
        return d_rows_RH, d_w_RS, [rows_RH.new_empty(0) if w is None else torch.zeros_like(w) for w in weights]
    w_up, w_gate, w_down, b_up, b_gate, b_down = weights
    assert w_up is not None and w_down is not None
    d_x_PH, d_w_P1, *d_weights = experts_reference_backward(
        grad_RH[r_P].to(out_dtype(rows_RH, w_P1)), rows_RH[r_P], slot_P1, w_P1, w_up, w_gate, w_down, b_up, b_gate,
        b_down, activation, kept=kept)
    d_rows_RH.index_add_(0, r_P, d_x_PH.float())
    d_w_RS[r_P, s_P] = d_w_P1[:, 0].float()
    return d_rows_RH, d_w_RS, d_weights


def _route(packed: Tensor, device: torch.device) -> tuple[runtime.EPLayer, int, hier_a2a.Route]:
    """(the layer the forward ran on, d, the route) from a packed route."""
    d, version, actual = (int(v) for v in packed[:_HEADER].tolist())
    lay = runtime.layer(actual)
    check_version(lay, version)
    return lay, d, hier_a2a.Route.unpack(packed, _HEADER, lay.phases(d), actual, device)


def _timed(lay: runtime.EPLayer, direction: str, t0: float) -> None:
    lay.add_comm_time(direction, time.perf_counter() - t0)


# (device, the stage's phases as a generator: hier_a2a.*_steps wrapped, their process groups)
Job = tuple[torch.device, Generator[Any, None, Any], list[Any]]
# the stages whose collectives are split into start and wait (``passes.overlap``)
SPLIT_STAGES = ("ep_dispatch", "ep_dispatch_backward", "ep_combine", "ep_combine_backward",
                "ep_combine_to", "ep_combine_to_backward",  # sample placement's combine
                "ep_gather", "ep_gather_backward",  # the gathers: lowering.ep_gather
                "sample_move", "sample_move_backward")  # sample placement's moves: lowering.sample_exchange
GATHER_STAGES = ("ep_gather",)  # stages that passes.overlap may start layers ahead (prefetch)


def stage_ops(name: str, args: str, returns: str, make_job: Callable[..., Job], fake: Callable[..., Any],
              on_wait: Callable[..., None] | None = None) -> Any:
    """Register one communicating stage as three ops: ``hiermoe::<name>`` (start and wait at
    once, what the passes emit and autograd differentiates), ``<name>_start`` (same arguments,
    returns the worker's ticket, ``moe_compile.ep.worker``) and ``<name>_wait`` (the ticket, then
    the same arguments again, so that everything the stage reads stays alive until it is done;
    returns what ``<name>`` returns). ``make_job`` does the caller-side part of the stage and
    returns a ``Job`` (the device, the stage's phases as a generator, their process groups);
    ``fake`` is ``<name>``'s fake; ``on_wait(seconds, *arguments)``, if given, hears how long each
    call waited for its collectives (all of them when not split). Returns the op."""

    def run(*a: Any) -> Any:
        device, steps, _ = make_job(*a)
        t0 = time.perf_counter()
        out = worker.run(device, lambda: hier_a2a.run_steps(steps))
        if on_wait is not None:
            on_wait(time.perf_counter() - t0, *a)
        return out

    def start(*a: Any) -> Tensor:
        return worker.start_steps(*make_job(*a))

    def wait(ticket: Tensor, *a: Any) -> Any:
        t0 = time.perf_counter()
        out = worker.wait(ticket)
        if on_wait is not None:
            on_wait(time.perf_counter() - t0, *a)
        return out

    def start_fake(*a: Any) -> Tensor:
        return torch.empty((1,), dtype=torch.long, device="cpu")

    def wait_fake(ticket: Tensor, *a: Any) -> Any:
        return fake(*a)

    op = torch.library.custom_op(f"hiermoe::{name}", run, mutates_args=(), schema=f"({args}) -> {returns}")
    op.register_fake(fake)
    torch.library.custom_op(f"hiermoe::{name}_start", start, mutates_args=(),
                            schema=f"({args}) -> Tensor").register_fake(start_fake)
    torch.library.custom_op(f"hiermoe::{name}_wait", wait, mutates_args=(),
                            schema=f"(Tensor ticket, {args}) -> {returns}").register_fake(wait_fake)
    for suffix in ("", "_start", "_wait"):
        collective_op(getattr(torch.ops.hiermoe, name + suffix).default)
    return op


# every op that communicates (``collective_op``): passes.overlap keeps them in graph order
COLLECTIVE_OPS: set[Any] = set()


def collective_op(op: Any) -> None:
    """Mark ``op`` as communicating: never dead-code-eliminated (FX, AOTAutograd, Inductor) nor
    recomputed, even when its outputs go unused (an empty chunk's combine, whose rows a
    concatenation drops): every rank must issue the same collectives, whatever its shapes."""
    has_side_effect(op)
    COLLECTIVE_OPS.add(op)


# -- dispatch --------------------------------------------------------------------------------------

@torch.library.custom_op("hiermoe::ep_begin", mutates_args=(), schema="(Tensor x, Tensor topk_idx, int layer) -> Tensor")
def ep_begin(x: Tensor, topk_idx: Tensor, layer: int) -> Tensor:
    """The step of a chunked layer (``lowering.strategies.common.emit_stages``): chooses d from all of the step's tokens
    (``begin_forward``) once, before its chunks' dispatches, which read it from the returned
    int64 CPU tensor [d, placement version, runtime layer id]. An unchunked dispatch does this
    itself."""
    lay = runtime.resolve(layer)
    d = begin_forward(lay, x, topk_idx)
    return torch.tensor([d, lay.version, lay.layer_id], dtype=torch.long)


@ep_begin.register_fake
def _ep_begin_fake(x: Tensor, topk_idx: Tensor, layer: int) -> Tensor:
    return torch.empty((_HEADER,), dtype=torch.long, device="cpu")


collective_op(torch.ops.hiermoe.ep_begin.default)  # the step's statistics exchange


# ``chunk``: the chunk's index, only so that two empty chunks' dispatches (the same arguments
# otherwise) stay two calls: AOTAutograd's common-subexpression elimination would merge them
_DISPATCH = "Tensor x, Tensor topk_idx, Tensor topk_weights, int layer, int slots, Tensor? step=None, int chunk=0"
_DISPATCH_OUT = "(Tensor, Tensor, Tensor, Tensor)"


def _dispatch_job(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, layer: int, slots: int,
                  step: Tensor | None = None, chunk: int = 0) -> Job:
    """(rows [R, H], their expert ids [R, S] (-1: no slot), weights [R, S] in the routing weights'
    dtype (they travel as float32 metadata), packed route) at this rank after HD-d's dispatch, d
    chosen for this step. ``slots`` is S (K with dedup, 1 without), for the fake. Choosing d runs
    here, on the caller's thread, or, for one chunk of a chunked layer, ``step`` (``ep_begin``'s)
    holds it; the all-to-alls are the job."""
    lay = runtime.resolve(layer)
    if step is None:
        d = begin_forward(lay, x, topk_idx)
    else:
        d, version, actual = (int(v) for v in step.tolist())
        assert actual == lay.layer_id, (actual, lay.layer_id)
        check_version(lay, version)

    phases = lay.phases(d)
    runtime.STEP_CLOCK.dispatched()

    def job() -> Generator[Any, None, tuple[Tensor, Tensor, Tensor, Tensor]]:
        t0 = time.perf_counter()
        with collective(lay, f"the forward dispatch all-to-alls ({phase_names(d, lay)})"):
            rows_RH, ids_RS, w_RS, route = yield from hier_a2a.dispatch_steps(
                x, topk_idx, topk_weights, lay.expert_pos_E, phases, lay.dedup, "forward", lay.layer_id,
                carry_origin=lay.carry_origin)
        _timed(lay, "forward", t0)
        assert ids_RS.shape[1] == slots, (ids_RS.shape, slots)
        packed = route.pack([d, lay.version, lay.layer_id])
        # contiguous, as the fake says (the compiler checks the strides of a wait's outputs)
        out = (rows_RH.contiguous(), ids_RS.contiguous(), w_RS.to(topk_weights.dtype).contiguous(), packed)
        lay.add_saved_bytes(sum(t.numel() * t.element_size() for t in out))
        return out

    return x.device, job(), [p.group for p in phases]


def _dispatch_fake(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, layer: int, slots: int,
                   step: Tensor | None = None, chunk: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ctx = torch.library.get_ctx()
    num_rows, route_len = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (x.new_empty((num_rows, x.shape[1])), topk_idx.new_empty((num_rows, slots), dtype=torch.long),
            x.new_empty((num_rows, slots), dtype=topk_weights.dtype),
            torch.empty((route_len,), dtype=torch.long, device="cpu"))


ep_dispatch = stage_ops("ep_dispatch", _DISPATCH, _DISPATCH_OUT, _dispatch_job, _dispatch_fake)


_DISPATCH_BW = ("Tensor grad_rows, Tensor grad_w, Tensor route, SymInt[] x_shape, ScalarType x_dtype, "
                "SymInt[] w_shape, ScalarType w_dtype")


def _dispatch_backward_job(grad_rows: Tensor, grad_w: Tensor, route: Tensor, x_shape: list[int],
                           x_dtype: torch.dtype, w_shape: list[int], w_dtype: torch.dtype) -> Job:
    """(d_x, d_topk_weights): the rows' and slot weights' gradients summed back into their tokens
    along the route (combine-shaped), the routing-weight gradients as float32 per-slot metadata."""
    lay, d, rt = _route(route, grad_rows.device)

    def job() -> Generator[Any, None, tuple[Tensor, Tensor]]:
        t0 = time.perf_counter()
        with collective(lay, f"the backward combine all-to-alls ({phase_names(d, lay)})"):
            d_x, d_tw = yield from hier_a2a.combine_steps(grad_rows.to(x_dtype), rt, "backward",
                                                          meta_RS=grad_w.float())
        _timed(lay, "backward", t0)
        runtime.STEP_CLOCK.backward_done()
        assert d_tw is not None and list(d_x.shape) == list(x_shape) and list(d_tw.shape) == list(w_shape)
        return d_x.contiguous(), d_tw.to(w_dtype).contiguous()

    return grad_rows.device, job(), [hop.phase.group for hop in reversed(rt.hops)]


def _dispatch_backward_fake(grad_rows: Tensor, grad_w: Tensor, route: Tensor, x_shape: list[int],
                            x_dtype: torch.dtype, w_shape: list[int], w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return grad_rows.new_empty(x_shape, dtype=x_dtype), grad_rows.new_empty(w_shape, dtype=w_dtype)


stage_ops("ep_dispatch_backward", _DISPATCH_BW, "(Tensor, Tensor)", _dispatch_backward_job, _dispatch_backward_fake)


def _dispatch_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, _, topk_weights, *_ = inputs
    rows, ids, w, route = output
    ctx.mark_non_differentiable(ids, route)
    ctx.save_for_backward(route)
    ctx.x_shape, ctx.x_dtype = list(x.shape), x.dtype
    ctx.w_shape, ctx.w_dtype = list(topk_weights.shape), topk_weights.dtype
    ctx.w_rows_shape = list(w.shape)


def _dispatch_backward(ctx: Any, grad_rows: Tensor | None, _g_ids: Any, grad_w: Tensor | None, _g_route: Any
                       ) -> tuple[Tensor | None, ...]:
    (route,) = ctx.saved_tensors
    if grad_rows is None:
        raise RuntimeError("hiermoe::ep_dispatch: its rows got no gradient (the staged layer was cut apart)")
    if grad_w is None:  # the routing weights need no gradient
        grad_w = grad_rows.new_zeros(ctx.w_rows_shape, dtype=torch.float32)
    d_x, d_tw = torch.ops.hiermoe.ep_dispatch_backward(grad_rows, grad_w, route, ctx.x_shape, ctx.x_dtype,
                                                       ctx.w_shape, ctx.w_dtype)
    return d_x, None, d_tw, None, None, None, None


ep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# -- local experts ---------------------------------------------------------------------------------

@torch.library.custom_op("hiermoe::ep_local_experts", mutates_args=(),
                         schema=f"(Tensor rows, Tensor ids, Tensor w, {_WEIGHTS}, str activation, bool by_expert, "
                                "Tensor route, bool triton=False, bool keep=True) -> (Tensor, Tensor, Tensor)")
def ep_local_experts(rows: Tensor, ids: Tensor, w: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
                     b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str,
                     by_expert: bool, route: Tensor, triton: bool = False, keep: bool = True
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """([R, H] in promote(rows, w), as ``hiermoe::experts`` sums: each dispatched row's weighted sum
    over its slots of its local experts' FFN outputs (bf16 rows under autocast, whose routing
    weights stay float32, send float32 partial sums back, as the layer sums in float32); then the
    valid slots' up and gate pre-activations, [P, F] each, that autograd keeps so that backward
    does not recompute 2 of the 3 forward matmuls: zero-size
    with ``triton``, whose backward recomputes, and the gate's when non-gated). ``by_expert``:
    the weights are indexed by expert id (they hold every expert) rather than by local slot
    (this rank's shard or stack). ``triton``: by the ESMM/ESFK kernels (``passes.lower_kernels``
    sets it, options['kernels']). ``keep`` False: the pre-activations are not kept either (zero-size;
    backward recomputes them), for a layer under activation checkpointing
    (``passes.inline_checkpoint.tag_rewrites`` sets it)."""
    lay = runtime.layer(int(route[2]))
    out, kept = local_forward(rows, ids, w, lay, by_expert, [w_up, w_gate, w_down, b_up, b_gate, b_down],
                              activation, w.dtype, triton)
    if not keep:
        kept = Kept(kept.up_NF[:0].clone(), kept.gate_NF[:0].clone())
    lay.add_saved_bytes(sum(t.numel() * t.element_size() for t in kept))
    return out.to(out_dtype(rows, w)), kept.up_NF, kept.gate_NF


@ep_local_experts.register_fake
def _ep_local_experts_fake(rows: Tensor, ids: Tensor, w: Tensor, w_up: Tensor, w_gate: Tensor | None,
                           w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
                           activation: str, by_expert: bool, route: Tensor, triton: bool = False, keep: bool = True
                           ) -> tuple[Tensor, Tensor, Tensor]:
    check_activation(activation)
    num_f = w_down.shape[-1]
    num_kept = 0 if triton or not keep else torch.library.get_ctx().new_dynamic_size()
    return (rows.new_empty(rows.shape, dtype=out_dtype(rows, w)), rows.new_empty((num_kept, num_f)),
            rows.new_empty((0 if w_gate is None else num_kept, num_f)))


@torch.library.custom_op("hiermoe::ep_local_experts_backward", mutates_args=(),
                         schema=f"(Tensor grad_out, Tensor rows, Tensor ids, Tensor w, {_WEIGHTS}, str activation, "
                                "bool by_expert, Tensor route, Tensor kept_up, Tensor kept_gate, bool triton=False) "
                                "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def ep_local_experts_backward(grad_out: Tensor, rows: Tensor, ids: Tensor, w: Tensor, w_up: Tensor,
                              w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None,
                              b_down: Tensor | None, activation: str, by_expert: bool, route: Tensor,
                              kept_up: Tensor, kept_gate: Tensor, triton: bool = False
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_rows, d_w in w's dtype, d_w_up, d_w_gate, d_w_down, d_b_up, d_b_gate, d_b_down; zero-size for
    absent weights) from the dispatched rows and the pre-activations autograd saved (zero-size
    on the Triton path, whose backward recomputes them, and where the forward kept none: then the
    torch path recomputes them too; a forward that ran slots keeps [P, F] rows, P > 0)."""
    lay = runtime.layer(int(route[2]))
    check_version(lay, int(route[1]))
    d_rows, d_w, d_weights = local_backward(grad_out, rows, ids, w, lay, by_expert,
                                            [w_up, w_gate, w_down, b_up, b_gate, b_down], activation, w.dtype,
                                            triton, Kept(kept_up, kept_gate) if kept_up.shape[0] else None)
    return (d_rows.to(rows.dtype), d_w.to(w.dtype), *d_weights)  # type: ignore[return-value]


@ep_local_experts_backward.register_fake
def _ep_local_experts_backward_fake(grad_out: Tensor, rows: Tensor, ids: Tensor, w: Tensor, w_up: Tensor,
                                    w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None,
                                    b_gate: Tensor | None, b_down: Tensor | None, activation: str, by_expert: bool,
                                    route: Tensor, kept_up: Tensor, kept_gate: Tensor, triton: bool = False
                                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    def like(t: Tensor | None) -> Tensor:
        return rows.new_empty(0) if t is None else t.new_empty(t.shape)

    return (like(rows), like(w), like(w_up), like(w_gate), like(w_down), like(b_up),
            like(b_gate), like(b_down))


def _local_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    *tensors, activation, by_expert, route, triton, _keep = inputs
    _, kept_up, kept_gate = output
    ctx.mark_non_differentiable(kept_up, kept_gate)
    ctx.save_for_backward(*tensors, route, kept_up, kept_gate)
    ctx.activation, ctx.by_expert, ctx.triton = activation, by_expert, triton


def _local_experts_backward(ctx: Any, grad_out: Tensor, _g_up: Any, _g_gate: Any) -> tuple[Tensor | None, ...]:
    rows, ids, w, w_up, w_gate, w_down, b_up, b_gate, b_down, route, kept_up, kept_gate = ctx.saved_tensors
    d_rows, d_w, *d_weights = torch.ops.hiermoe.ep_local_experts_backward(
        grad_out, rows, ids, w, w_up, w_gate, w_down, b_up, b_gate, b_down, ctx.activation, ctx.by_expert, route,
        kept_up, kept_gate, ctx.triton)
    inputs = (w_up, w_gate, w_down, b_up, b_gate, b_down)
    return (d_rows, None, d_w, *(None if t is None else g for g, t in zip(d_weights, inputs, strict=True)),
            None, None, None, None, None)


ep_local_experts.register_autograd(_local_experts_backward, setup_context=_local_setup)


# -- combine ---------------------------------------------------------------------------------------

def _combine_job(partial: Tensor, route: Tensor, num_tokens: int) -> Job:
    """[T, H]: every row's partial result summed back into its token along the route (float32
    sums at every relay, sent in the rows' dtype)."""
    lay, d, rt = _route(route, partial.device)

    def job() -> Generator[Any, None, Tensor]:
        t0 = time.perf_counter()
        with collective(lay, f"the forward combine all-to-alls ({phase_names(d, lay)})"):
            y, _ = yield from hier_a2a.combine_steps(partial, rt, "forward")
        _timed(lay, "forward", t0)
        return y.contiguous()

    return partial.device, job(), [hop.phase.group for hop in reversed(rt.hops)]


def _combine_fake(partial: Tensor, route: Tensor, num_tokens: int) -> Tensor:
    return partial.new_empty((num_tokens, partial.shape[1]))


ep_combine = stage_ops("ep_combine", "Tensor partial, Tensor route, SymInt num_tokens", "Tensor", _combine_job,
                        _combine_fake)


def _combine_backward_job(grad_y: Tensor, route: Tensor, num_rows: int) -> Job:
    """[R, H]: the output gradient of every token sent to each row that contributed to it, along
    the route (dispatch-shaped; payload only, the split sizes are the route's)."""
    lay, d, rt = _route(route, grad_y.device)

    def job() -> Generator[Any, None, Tensor]:
        t0 = time.perf_counter()
        with collective(lay, f"the backward dispatch all-to-alls ({phase_names(d, lay)})"):
            rows = yield from hier_a2a.redispatch_steps(grad_y.contiguous(), rt, "backward")
        _timed(lay, "backward", t0)
        assert rows.shape[0] == num_rows, (rows.shape, num_rows)
        return rows.contiguous()

    return grad_y.device, job(), [hop.phase.group for hop in rt.hops]


def _combine_backward_fake(grad_y: Tensor, route: Tensor, num_rows: int) -> Tensor:
    return grad_y.new_empty((num_rows, grad_y.shape[1]))


stage_ops("ep_combine_backward", "Tensor grad_y, Tensor route, SymInt num_rows", "Tensor", _combine_backward_job,
           _combine_backward_fake)


def _combine_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    partial, route, _ = inputs
    ctx.save_for_backward(route)
    ctx.num_rows = partial.shape[0]


def _combine_backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
    (route,) = ctx.saved_tensors
    return torch.ops.hiermoe.ep_combine_backward(grad_y, route, ctx.num_rows), None, None


ep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# -- combine to the samples' new ranks ------------------------------------------------------------

def _combine_to_job(partial: Tensor, route: Tensor, perm: Tensor, samples: int, num_tokens: int, offset: int,
                    out_tokens: int) -> Job:
    """([T, H], the redirect packed): ``ep_combine`` whose results reach each token's sample at the
    rank the sample placement moves it to (``perm``: ``hiermoe::sample_plan``'s, out slot n holds
    the sample of slot perm[n]; ``hier_a2a.combine_to_steps``), the samples' own move for the
    layer's output fused into its combine: a sample placed where its experts are gets its result
    from inside the node instead of over the slow link twice (to its old rank, then moved).

    A layer run in chunks combines each chunk so: the chunk's ``num_tokens`` tokens are rows
    ``offset`` .. ``offset + num_tokens`` of the rank's ``out_tokens``, and the result is a whole
    [out_tokens, H] holding the rows this chunk delivered (zero elsewhere), summed with the other
    chunks' by the graph (``passes.sample_binding.fuse_combines``). Unchunked: offset 0,
    out_tokens = num_tokens."""
    perm_cpu = perm.cpu()
    if torch.equal(perm_cpu, torch.arange(perm_cpu.numel())):  # no sample moves this step: ep_combine's
        device, steps, groups = _combine_job(partial, route, num_tokens)
        return device, _no_redirect(steps, offset, out_tokens), groups
    lay, d, rt = _route(route, partial.device)
    flat = lay.comm.intra[0]
    new_slot_of = torch.argsort(perm_cpu)

    def job() -> Generator[Any, None, tuple[Tensor, Tensor]]:
        t0 = time.perf_counter()
        with collective(lay, f"the forward combine all-to-alls to the samples' new ranks ({phase_names(d, lay)})"):
            y, redirect = yield from hier_a2a.combine_to_steps(partial, rt, new_slot_of, samples, flat, "forward",
                                                               offset, out_tokens)
        _timed(lay, "forward", t0)
        assert y.shape[0] == out_tokens, (y.shape, out_tokens)
        return y.contiguous(), redirect.pack()

    return partial.device, job(), [*(hop.phase.group for hop in reversed(rt.hops[1:])), flat.group]


def _no_redirect(steps: Generator[Any, None, Tensor], offset: int, out_tokens: int
                 ) -> Generator[Any, None, tuple[Tensor, Tensor]]:
    """``ep_combine``'s steps as ``ep_combine_to``'s of a step that moves no sample: its output (at
    rows ``offset`` .. of ``out_tokens`` for a chunk) and an empty redirect, which tells the
    backward to run ``ep_combine``'s."""
    y = yield from steps
    if offset != 0 or y.shape[0] != out_tokens:
        whole = y.new_zeros((out_tokens, y.shape[1]))
        whole[offset: offset + y.shape[0]] = y
        y = whole
    return y, torch.empty((0,), dtype=torch.long)


def _combine_to_fake(partial: Tensor, route: Tensor, perm: Tensor, samples: int, num_tokens: int, offset: int,
                     out_tokens: int) -> tuple[Tensor, Tensor]:
    return (partial.new_empty((out_tokens, partial.shape[1])),
            torch.empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.long, device="cpu"))


ep_combine_to = stage_ops("ep_combine_to", "Tensor partial, Tensor route, Tensor perm, int samples, SymInt num_tokens, "
                          "SymInt offset, SymInt out_tokens", "(Tensor, Tensor)", _combine_to_job, _combine_to_fake)


def _combine_to_backward_job(grad_y: Tensor, route: Tensor, redirect: Tensor, num_rows: int, offset: int,
                             num_tokens: int) -> Job:
    """[R, H]: ``ep_combine_backward`` from the tokens' new ranks (``hier_a2a.redispatch_from_steps``);
    ``grad_y`` is the whole [T, H] (a chunk's tokens: rows ``offset`` .. ``offset + num_tokens``)."""
    if redirect.numel() == 0:  # the forward combined plainly (no sample moved)
        return _combine_backward_job(grad_y.narrow(0, offset, num_tokens), route, num_rows)
    lay, d, rt = _route(route, grad_y.device)
    flat = lay.comm.intra[0]
    back = hier_a2a.Redirect.unpack(redirect, grad_y.device)

    def job() -> Generator[Any, None, Tensor]:
        t0 = time.perf_counter()
        with collective(lay, f"the backward dispatch all-to-alls from the samples' new ranks ({phase_names(d, lay)})"):
            rows = yield from hier_a2a.redispatch_from_steps(grad_y.contiguous(), rt, back, flat, "backward")
        _timed(lay, "backward", t0)
        assert rows.shape[0] == num_rows, (rows.shape, num_rows)
        return rows.contiguous()

    return grad_y.device, job(), [flat.group, *(hop.phase.group for hop in rt.hops[1:])]


def _combine_to_backward_fake(grad_y: Tensor, route: Tensor, redirect: Tensor, num_rows: int, offset: int,
                              num_tokens: int) -> Tensor:
    return grad_y.new_empty((num_rows, grad_y.shape[1]))


stage_ops("ep_combine_to_backward", "Tensor grad_y, Tensor route, Tensor redirect, SymInt num_rows, SymInt offset, "
          "SymInt num_tokens", "Tensor", _combine_to_backward_job, _combine_to_backward_fake)


def _combine_to_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    partial, route, _perm, _samples, num_tokens, offset, _out = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(route, output[1])
    ctx.num_rows = partial.shape[0]
    ctx.offset, ctx.num_tokens = offset, num_tokens


def _combine_to_backward(ctx: Any, grad_y: Tensor, _g_redirect: Any) -> tuple[Tensor | None, ...]:
    route, redirect = ctx.saved_tensors
    grad = torch.ops.hiermoe.ep_combine_to_backward(grad_y, route, redirect, ctx.num_rows, ctx.offset, ctx.num_tokens)
    return grad, None, None, None, None, None, None


ep_combine_to.register_autograd(_combine_to_backward, setup_context=_combine_to_setup)


def staged_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, weights: list[Tensor | None], activation: str,
                   layer: int, by_expert: bool, slots: int) -> Tensor:
    """The three stages as the expert-parallel pass emits them, called eagerly (for tests and
    benchmarks that drive one layer without compiling a model). ``weights``: w_up, w_gate,
    w_down, b_up, b_gate, b_down."""
    rows, ids, w, route = torch.ops.hiermoe.ep_dispatch(x, topk_idx, topk_weights, layer, slots)
    partial, _, _ = torch.ops.hiermoe.ep_local_experts(rows, ids, w, *weights, activation, by_expert, route)
    return torch.ops.hiermoe.ep_combine(partial, route, x.shape[0])
