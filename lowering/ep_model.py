"""Model-centric expert execution (HEXA-MoE, papers/hexa-moe.txt Section 4.3, Fig. 6b): every rank
of the mesh runs every rank's tokens through its own slice of every expert's FFN dimension.

A layer that ``strategies.model`` rewrites runs, on each rank at mesh position r of S:

  x_all, idx_all, w_all = hiermoe::ep_model_tokens(x, topk_idx, topk_weights, layer)
        every rank's tokens, routing and routing weights ([S*T, ...], rows in position order):
        HEXA's AllGather of the tokens, hierarchical (slowest level first, ``all_gather_levels``)
  y_all = hiermoe::experts(x_all, idx_all, w_all, W_up[:, F_r], W_gate[:, F_r], W_down[:, :, F_r],
                           b_up[:, F_r], b_gate[:, F_r], b_down if r == 0 else None)
        the ESMM on the local columns F_r of F (``hexa.heterogeneous_split``): a partial sum of
        every token's output, since y = sum_f act(.)_f W_down[:, f] splits over f
  y = hiermoe::ep_model_outputs(y_all, layer)
        the partial outputs summed over the ranks onto each token's own rank: a reduce-scatter
        (``reduce_scatter_levels``; HEXA all-reduces, which sends twice as much)

Backward is the adjoint of each: the output gradient all-gathered, the local slice's backward
(autograd of ``hiermoe::experts``), the token and routing-weight gradients reduce-scattered back.
No expert weight moves: each rank reads its columns of the experts it holds whole, so the layer
needs every expert on every rank (not ``shard_experts``' shards), and each rank's weight gradients
are its columns' (zero elsewhere); summed over the ranks (DDP's all-reduce) they are the whole
gradient, as under token-moving expert parallelism.

Every rank must bring the same number of tokens (the all-gather's rows are equal); a mismatch is
an error that names the layer, found by one small exchange of the counts before the gather.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor

from moe_compile.cost.hexa import heterogeneous_split
from moe_compile.ep import runtime
from moe_compile.lowering.ep_gather import all_gather_levels, reduce_scatter_levels
from moe_compile.lowering.ep_stages import Job, check_device, collective, stage_ops


def _check_counts(lay: runtime.EPLayer, num_tokens: int) -> None:
    every = runtime.gather_by_position(torch.tensor([num_tokens], dtype=torch.long), lay.comm)[:, 0]
    if (every != num_tokens).any():
        raise ValueError(f"layer {lay.name} runs model-centric (every rank computes every rank's tokens on its "
                         f"columns of the experts), which needs the same number of tokens on every rank; the ranks "
                         f"have {every.tolist()} (mesh position order). Give every rank batches of the same shape, "
                         "or compile with options={'model_centric': False}")


# -- tokens: all-gather forward, reduce-scatter backward ------------------------------------------

def _gather_rows_job(parts: list[Tensor], layer: int, direction: str, what: str) -> Job:
    """Every rank's ``parts`` (each [T, ...], packed into one message) all-gathered over the mesh:
    each [S*T, ...], rows in position order."""
    lay = runtime.resolve(layer)
    num_t = parts[0].shape[0]
    likes = [(t.dtype, tuple(t.shape[1:])) for t in parts]
    mine = runtime.as_bytes([t.detach() for t in parts], num_t).reshape(1, -1)

    def job() -> Generator[Any, None, list[Tensor]]:
        t0 = time.perf_counter()
        with collective(lay, what):
            have = yield from all_gather_levels(lay, mine, 0, "dispatch", direction)
        lay.add_comm_time(direction, time.perf_counter() - t0)
        return runtime.from_bytes(have.reshape(have.shape[0] * num_t, -1), likes)

    return parts[0].device, job(), [p.group for p in lay.comm.inter]


def _tokens_job(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, layer: int) -> Job:
    lay = runtime.resolve(layer)
    check_device(lay, x)
    lay.settle()
    _check_counts(lay, x.shape[0])
    lay.last_topk = topk_idx.detach()
    lay.begin_step(0)
    return _gather_rows_job([x, topk_idx, topk_weights], layer, "forward",
                            "the all-gather of its tokens (model-centric)")


def _tokens_fake(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, layer: int) -> list[Tensor]:
    s = runtime.resolve(layer).comm.world
    return [t.new_empty((s * t.shape[0], *t.shape[1:])) for t in (x, topk_idx, topk_weights)]


ep_model_tokens = stage_ops("ep_model_tokens", "Tensor x, Tensor topk_idx, Tensor topk_weights, int layer",
                            "Tensor[]", _tokens_job, _tokens_fake)


def _sum_rows_job(grads: list[Tensor], layer: int, direction: str, what: str) -> Job:
    """Each of ``grads`` ([S*T, ...], rows in position order) summed over the ranks onto this
    rank's T rows."""
    lay = runtime.resolve(layer)
    s = lay.comm.world
    num_t = grads[0].shape[0] // s
    flat = [(g.dtype, (num_t * g[0].numel(),)) for g in grads]
    rows = runtime.as_bytes([g.detach().contiguous().reshape(s, -1) for g in grads], s)

    def job() -> Generator[Any, None, list[Tensor]]:
        t0 = time.perf_counter()
        with collective(lay, what):
            have = yield from reduce_scatter_levels(lay, rows, flat, 0, "combine", direction)
        lay.add_comm_time(direction, time.perf_counter() - t0)
        return [t.reshape(num_t, *g.shape[1:]) for t, g in zip(runtime.from_bytes(have, flat), grads, strict=True)]

    return grads[0].device, job(), [p.group for p in lay.comm.inter]


def _tokens_backward_job(d_x: Tensor, d_weights: Tensor, layer: int) -> Job:
    return _sum_rows_job([d_x, d_weights], layer, "backward",
                         "the reduce-scatter of its token gradients (model-centric)")


def _tokens_backward_fake(d_x: Tensor, d_weights: Tensor, layer: int) -> list[Tensor]:
    s = runtime.resolve(layer).comm.world
    return [t.new_empty((t.shape[0] // s, *t.shape[1:])) for t in (d_x, d_weights)]


stage_ops("ep_model_tokens_backward", "Tensor d_x, Tensor d_weights, int layer", "Tensor[]",
          _tokens_backward_job, _tokens_backward_fake)


def _tokens_setup(ctx: Any, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
    ctx.layer = inputs[3]
    ctx.mark_non_differentiable(output[1])


def _tokens_backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Any, ...]:
    d_x_all, _, d_w_all = grads
    assert d_x_all is not None and d_w_all is not None, "the expert op differentiates both"
    d_x, d_w = torch.ops.hiermoe.ep_model_tokens_backward(d_x_all, d_w_all, ctx.layer)
    return d_x, None, d_w, None


ep_model_tokens.register_autograd(_tokens_backward, setup_context=_tokens_setup)


# -- outputs: reduce-scatter forward, all-gather backward -----------------------------------------

def _one(parts: Job) -> Job:
    """A job of one-tensor lists as a job of that tensor (the ops with one output)."""
    device, steps, groups = parts

    def job() -> Generator[Any, None, Tensor]:
        (t,) = yield from steps
        return t

    return device, job(), groups


def _outputs_job(y_all: Tensor, layer: int) -> Job:
    return _one(_sum_rows_job([y_all], layer, "forward", "the reduce-scatter of its partial outputs (model-centric)"))


def _outputs_fake(y_all: Tensor, layer: int) -> Tensor:
    s = runtime.resolve(layer).comm.world
    return y_all.new_empty((y_all.shape[0] // s, *y_all.shape[1:]))


ep_model_outputs = stage_ops("ep_model_outputs", "Tensor y_all, int layer", "Tensor", _outputs_job, _outputs_fake)


def _outputs_backward_job(d_y: Tensor, layer: int) -> Job:
    return _one(_gather_rows_job([d_y], layer, "backward", "the all-gather of its output gradients (model-centric)"))


def _outputs_backward_fake(d_y: Tensor, layer: int) -> Tensor:
    s = runtime.resolve(layer).comm.world
    return d_y.new_empty((s * d_y.shape[0], *d_y.shape[1:]))


stage_ops("ep_model_outputs_backward", "Tensor d_y, int layer", "Tensor", _outputs_backward_job,
          _outputs_backward_fake)


def _outputs_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.layer = inputs[1]


def _outputs_backward(ctx: Any, d_y: Tensor) -> tuple[Any, ...]:
    return torch.ops.hiermoe.ep_model_outputs_backward(d_y, ctx.layer), None


ep_model_outputs.register_autograd(_outputs_backward, setup_context=_outputs_setup)


def ffn_columns(ffn_size: int, position: int, world: int) -> tuple[int, int]:
    """(start, length) of mesh position ``position``'s columns of F: an even split (the remainder
    to the first positions; HEXA's Eq. 2 with equal device speeds, ``hexa.heterogeneous_split``)."""
    sizes = heterogeneous_split(ffn_size, [1.0] * world, speeds=True)
    return sum(sizes[:position]), sizes[position]
