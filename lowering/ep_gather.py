"""Moving experts instead of tokens: the expert weights of a domain all-gathered for one layer
(HybridEP's expert domains, papers/hybridep.txt Section IV-A; HEXA-MoE's data-centric mode,
papers/hexa-moe.txt Section 4.3, when the domain is the whole mesh).

``hiermoe::ep_gather(weights, layer, by_expert)`` returns the layer's expert weights of every rank
of this rank's domain (the block of the mesh at the layer's domain level j: the ranks sharing
coordinates 0..j-1, ``EPLayer.domain``), rows in the order of the domain's mesh positions, each
position's local slots (``EPLayer.weight_rows`` maps expert ids to these rows), then a stamp
(int64 CPU [placement version, runtime layer id]) for backward. Its autograd is the adjoint:
``hiermoe::ep_gather_backward`` reduce-scatters the gathered weights' gradients to their owners,
so that a rank's expert gradients sum every domain rank's tokens, as under all-to-all expert
parallelism (a shard's owner holds its full gradient; DDP-style averaging divides it).

Both run hierarchically, slowest level first for the gather and fastest first for the reduce-
scatter, each level one all-to-all on that level's group (``MeshComm.inter[l]``: ranks differing
only in coordinate l): a rank sends its P expert bytes over the slowest link to the s_j - 1 peers
of that level, not to every rank of the other nodes (HEXA-MoE's hierarchical AllGather, the
``cost.hexa`` model; HybridEP Eq. 4 per level). Each level is a phase of one stage
(``ep_stages.stage_ops``), so the gather splits into start and wait (``passes.overlap``) and runs
on the lanes of ``moe_compile.ep.worker`` while earlier layers compute: the prefetch.

``hiermoe::ep_expert_rows(topk_idx, layer)`` maps a data-centric layer's expert ids to rows of
its gathered weights, and starts the layer's step (settling swaps, the step record explain reads).

Legend: S ranks in the domain, per experts per rank, B bytes of one rank's expert weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moe_compile.ep import runtime
from moe_compile.lowering.ep_stages import Job, check_device, check_version, collective, stage_ops
from moe_compile.lowering.p2p_a2a import all_gather_recv_first, all_to_all_rows, use_recv_first


def _domain(lay: runtime.EPLayer) -> tuple[int, list[int]]:
    """(the domain level j, the mesh positions of this rank's domain, ascending)."""
    block = list(lay.domain_positions())
    assert lay.domain is not None
    return lay.domain, block


def _local_rows(w: Tensor, lay: runtime.EPLayer, by_expert: bool) -> Tensor:
    """[per, ...] this rank's experts' rows of ``w`` (all E when ``by_expert``, else its slots)."""
    if not by_expert:
        return w
    return w.index_select(0, torch.tensor(lay.local_experts, dtype=torch.long, device=w.device))


def _exchange(send: Tensor, group: Any) -> Tensor:
    """[peers * n] every peer's ``send`` [n] in group-rank order (on gloo one round of direct sends,
    every receive posted first, the one buffer sent to every peer: ``all_gather_recv_first``,
    where gloo's all-gather runs rounds between neighbours; else all_gather_into_tensor)."""
    if use_recv_first(group, send.device):
        return all_gather_recv_first(send, group)
    recv = send.new_empty(dist.get_world_size(group) * send.numel())
    dist.all_gather_into_tensor(recv, send, group=group)
    return recv


def _count(lay: runtime.EPLayer, phase: Any, piece_bytes: int, direction: str, what: str = "gather") -> None:
    for level in phase.peer_level:
        if level >= 0:
            runtime.record_traffic(lay.layer_id, level, what, direction, payload_bytes=piece_bytes,
                                   payload_messages=1, meta_bytes=0, meta_messages=0)


def all_gather_levels(lay: runtime.EPLayer, have: Tensor, j: int, what: str = "gather", direction: str = "forward"
                      ) -> Generator[Any, None, Tensor]:
    """Every rank of this rank's block at mesh level ``j`` (``EPLayer.domain_positions`` for the
    gathers; the whole mesh for j = 0) contributes its row of ``have`` ([1, B] bytes, the same B
    everywhere); returns [block positions, B] in ascending position order. Hierarchical, slowest
    level first, each level one exchange on that level's group (a generator for the worker's
    lanes: it yields each phase's group before using it). Traffic is counted under ``what`` and
    ``direction``."""
    comm = lay.comm
    held = [comm.position]
    for level, phase in enumerate(comm.inter[j:], start=j):
        yield phase.group
        recv = _exchange(have.reshape(-1), phase.group).view(len(phase.peer_pos), *have.shape)
        _count(lay, phase, have.numel(), direction, what)
        # each peer holds what I hold with its coordinate at this level: sort by position
        positions = []
        for peer in phase.peer_pos:
            c = comm.coords(peer)[level]
            positions += [_with_coord(comm, p, level, c) for p in held]
        order = np.argsort(positions, kind="stable")
        have = recv.reshape(-1, have.shape[1])
        if (order != np.arange(len(order))).any():  # not in position order already: one copy to sort
            have = have[torch.from_numpy(order).to(recv.device)]
        held = [positions[i] for i in order]
    first = comm.position - comm.position % math.prod(comm.sizes[j:])
    assert held == list(range(first, first + len(held))), (held, first)
    return have


def reduce_scatter_levels(lay: runtime.EPLayer, have: Tensor, flat: Sequence[tuple[torch.dtype, tuple[int, ...]]],
                          j: int, what: str = "gather", direction: str = "backward") -> Generator[Any, None, Tensor]:
    """The adjoint of ``all_gather_levels``: ``have`` [block positions, B] bytes (rows in ascending
    position order, each row the tensors ``flat`` describes, packed by ``runtime.as_bytes``) summed
    over the block's ranks onto this rank's row; returns [1, B]. Fastest level first; the sums run
    in float32 or wider (``from_bytes`` unpacks, each level adds its peers' rows)."""
    comm = lay.comm
    first = comm.position - comm.position % math.prod(comm.sizes[j:])
    held = list(range(first, first + have.shape[0]))
    phases = list(reversed(comm.inter[j:]))
    for i, phase in enumerate(phases):
        level = len(comm.sizes) - 1 - i
        yield phase.group
        peers = [comm.coords(p)[level] for p in phase.peer_pos]
        coord = [comm.coords(p)[level] for p in held]
        # the rows of the positions each peer keeps, in group-rank order: equal splits
        send = torch.cat([have[[k for k, c in enumerate(coord) if c == pc]] for pc in peers])
        recv = all_to_all_rows(send, None, None, phase.group)
        _count(lay, phase, send.numel() // len(peers), direction, what)
        mine = comm.coords(comm.position)[level]
        held = [p for p, c in zip(held, coord, strict=True) if c == mine]
        summed = [t.reshape(len(peers), len(held), -1).to(torch.promote_types(t.dtype, torch.float32)).sum(0)
                  .to(t.dtype) for t in runtime.from_bytes(recv.view(len(peers) * len(held), -1), flat)]
        have = runtime.as_bytes(summed, len(held))
    assert held == [comm.position], (held, comm.position)
    return have


# -- gather ----------------------------------------------------------------------------------------

def _gather_job(weights: list[Tensor], layer: int, by_expert: bool) -> Job:
    """The domain's expert weights (module docstring); reads this rank's rows at once (here, on
    the caller's thread), moves them level by level on the lanes."""
    lay = runtime.resolve(layer)
    check_device(lay, weights[0])
    lay.settle()
    j, block = _domain(lay)
    comm = lay.comm
    local = [_local_rows(w, lay, by_expert) for w in weights]
    per = local[0].shape[0]
    likes = [(w.dtype, tuple(w.shape[1:])) for w in local]
    ratio = lay.compress_ratio
    sr = ratio is not None
    if ratio is not None:  # HybridEP's SR compression: the residuals' top-k travel, not the weights
        shared = _shared_experts(lay, local)
        sent, sent_likes = _sr_encode(local, shared, ratio), _sr_likes(likes, ratio)
    else:
        sent, sent_likes = local, likes
    mine = runtime.as_bytes(sent, per).reshape(1, -1)  # [1, B]: my rows
    lay.gather_step_bytes, lay.gather_exposed_s = {}, 0.0  # a new forward's
    phases = comm.inter[j:]
    stamp = torch.tensor([lay.version, lay.layer_id], dtype=torch.long)

    def job() -> Generator[Any, None, list[Tensor]]:
        t0 = time.perf_counter()
        with collective(lay, "the all-gather of its expert weights"):
            have = yield from all_gather_levels(lay, mine, j)
        assert have.shape[0] == len(block), (have.shape, block)
        lay.add_comm_time("forward", time.perf_counter() - t0)
        gathered = runtime.from_bytes(have.reshape(len(block) * per, -1), sent_likes)
        if sr:
            gathered = _sr_decode(gathered, shared, likes)
            me = (comm.position - block[0]) * per  # this rank's own experts: exact
            for t, w in zip(gathered, local, strict=True):
                t[me:me + per] = w.detach()
        lay.gathered_bytes = sum(t.numel() * t.element_size() for t in gathered)
        return [*gathered, stamp]

    return weights[0].device, job(), [p.group for p in phases]


# -- SR compression (HybridEP Section IV-B) -------------------------------------------------------

def _shared_experts(lay: runtime.EPLayer, local: list[Tensor]) -> list[Tensor]:
    """The layer's shared expert per weight tensor: the mean of every expert of the mesh, first
    made here (one all-reduce of each rank's local sums, on the caller's thread at the same point
    on every rank), then as the last backward left it (``_update_shared``: HybridEP's
    synchronisation in backward, asynchronous, collected here)."""
    pending, lay.shared_pending = lay.shared_pending, None
    if pending is not None:
        work, summed = pending
        work.wait()
        lay.shared = _unpack_shared(summed, local, lay.num_experts)
    if lay.shared is None:
        summed = _local_sums(local)
        dist.all_reduce(summed, group=lay.comm.stats_group)
        lay.shared = _unpack_shared(summed, local, lay.num_experts)
    return lay.shared


def _local_sums(weights: list[Tensor]) -> Tensor:
    """float64 CPU: each weight's sum over this rank's experts, flattened and concatenated."""
    return torch.cat([w.detach().double().sum(0).reshape(-1).cpu() for w in weights])


def _unpack_shared(summed: Tensor, like: list[Tensor], num_experts: int) -> list[Tensor]:
    out, offset = [], 0
    for w in like:
        n = math.prod(w.shape[1:])
        out.append((summed[offset:offset + n] / num_experts).to(w.dtype).reshape(w.shape[1:]).to(w.device))
        offset += n
    return out


def _update_shared(lay: runtime.EPLayer, weights: list[Tensor], by_expert: bool) -> None:
    """Start the all-reduce of the shared experts from these weights (the backward's: HybridEP
    synchronises the shared expert in backward, asynchronously); the next forward collects it."""
    if lay.compress_ratio is None:
        return
    summed = _local_sums([_local_rows(w, lay, by_expert) for w in weights])
    lay.shared_pending = (dist.all_reduce(summed, group=lay.comm.stats_group, async_op=True), summed)


def _top_k(num: int, ratio: float) -> int:
    return max(1, math.ceil(num / ratio))


def _sr_encode(local: list[Tensor], shared: list[Tensor], ratio: float) -> list[Tensor]:
    """Per weight: the residual against the shared expert, its top-k entries by magnitude per
    expert (k = n / ratio) as values [per, k] and int32 indices [per, k] (HybridEP's SREncode)."""
    out = []
    for w, sh in zip(local, shared, strict=True):
        res = (w.detach() - sh).reshape(w.shape[0], -1)
        idx = res.abs().topk(_top_k(res.shape[1], ratio), dim=1).indices
        out += [res.gather(1, idx), idx.int()]
    return out


def _sr_likes(likes: list[tuple[torch.dtype, tuple[int, ...]]], ratio: float
              ) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    out: list[tuple[torch.dtype, tuple[int, ...]]] = []
    for dtype, shape in likes:
        k = _top_k(math.prod(shape), ratio)
        out += [(dtype, (k,)), (torch.int32, (k,))]
    return out


def _sr_decode(parts: list[Tensor], shared: list[Tensor], likes: list[tuple[torch.dtype, tuple[int, ...]]]
               ) -> list[Tensor]:
    """The experts back from (values, indices) pairs: shared + the sparse residual (SRDecode)."""
    out = []
    for (vals, idx), sh, (_, shape) in zip(zip(parts[::2], parts[1::2], strict=True), shared, likes, strict=True):
        res = torch.zeros(vals.shape[0], math.prod(shape), dtype=vals.dtype, device=vals.device)
        res.scatter_(1, idx.long(), vals)
        out.append((res + sh.reshape(1, -1)).reshape(vals.shape[0], *shape))
    return out


def _with_coord(comm: Any, pos: int, level: int, value: int) -> int:
    co = list(comm.coords(pos))
    co[level] = value
    return int(np.ravel_multi_index(co, comm.sizes))


def _gather_fake(weights: list[Tensor], layer: int, by_expert: bool) -> list[Tensor]:
    lay = runtime.resolve(layer)
    _, block = _domain(lay)
    per = len(lay.local_experts)
    return [*(w.new_empty((len(block) * per, *w.shape[1:])) for w in weights),
            torch.empty((2,), dtype=torch.long, device="cpu")]


def _gather_waited(seconds: float, weights: list[Tensor], layer: int, by_expert: bool) -> None:
    runtime.resolve(layer).gather_exposed_s += seconds


ep_gather = stage_ops("ep_gather", "Tensor[] weights, int layer, bool by_expert", "Tensor[]", _gather_job,
                      _gather_fake, on_wait=_gather_waited)


# -- reduce-scatter (the gather's backward) --------------------------------------------------------

def _gather_backward_job(grads: list[Tensor], weights: list[Tensor], stamp: Tensor, by_expert: bool) -> Job:
    """Each weight's gradient: the gathered gradients summed over the domain's ranks onto this
    rank's rows (fastest level first), placed at its experts' rows when ``by_expert`` (zeros
    elsewhere: the owners hold them)."""
    version, actual = (int(v) for v in stamp.tolist())
    lay = runtime.layer(actual)
    check_version(lay, version)
    _update_shared(lay, weights, by_expert)
    j, block = _domain(lay)
    comm = lay.comm
    per = len(lay.local_experts)
    flat = [(g.dtype, (per * int(np.prod(g.shape[1:])),)) for g in grads]  # one position's rows, flat
    rows = runtime.as_bytes([g.reshape(len(block), -1) for g in grads], len(block))  # [positions held, B]
    phases = list(reversed(comm.inter[j:]))

    def job() -> Generator[Any, None, list[Tensor]]:
        t0 = time.perf_counter()
        with collective(lay, "the reduce-scatter of its gathered expert weights' gradients"):
            have = yield from reduce_scatter_levels(lay, rows, flat, j)
        lay.add_comm_time("backward", time.perf_counter() - t0)
        local = [t.reshape(per, *g.shape[1:]) for t, g in zip(runtime.from_bytes(have, flat), grads, strict=True)]
        if not by_expert:
            return local
        idx = torch.tensor(lay.local_experts, dtype=torch.long, device=local[0].device)
        out = []
        for t, w in zip(local, weights, strict=True):
            full = torch.zeros_like(w)
            full[idx] = t
            out.append(full)
        return out

    return grads[0].device, job(), [p.group for p in phases]


def _gather_backward_fake(grads: list[Tensor], weights: list[Tensor], stamp: Tensor, by_expert: bool
                          ) -> list[Tensor]:
    return [w.new_empty(w.shape) for w in weights]


stage_ops("ep_gather_backward", "Tensor[] grads, Tensor[] weights, Tensor stamp, bool by_expert", "Tensor[]",
          _gather_backward_job, _gather_backward_fake)


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
    weights, _, by_expert = inputs
    ctx.mark_non_differentiable(output[-1])
    ctx.save_for_backward(*weights, output[-1])
    ctx.by_expert = by_expert
    ctx.shapes = [tuple(o.shape) for o in output[:-1]]


def _gather_backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Any, ...]:
    *weights, stamp = ctx.saved_tensors
    full = [w.new_zeros(shape) if g is None else g.contiguous()
            for g, w, shape in zip(grads[:-1], weights, ctx.shapes, strict=True)]
    d_weights = torch.ops.hiermoe.ep_gather_backward(full, weights, stamp, ctx.by_expert)
    return list(d_weights), None, None


ep_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


# -- the data-centric layer's routing --------------------------------------------------------------

@torch.library.custom_op("hiermoe::ep_expert_rows", mutates_args=(), schema="(Tensor topk_idx, int layer) -> Tensor")
def ep_expert_rows(topk_idx: Tensor, layer: int) -> Tensor:
    """[T, K] the row of each slot's expert in the layer's gathered weights (``EPLayer.weight_rows``);
    starts the layer's step: a data-centric layer moves no token, so nothing else does."""
    lay = runtime.resolve(layer)
    check_device(lay, topk_idx)
    lay.settle()
    lay.last_topk = topk_idx.detach()
    lay.begin_step(0)
    rows_E = lay.weight_rows(False).to(topk_idx.device)
    return rows_E[topk_idx.long()].to(topk_idx.dtype)


@ep_expert_rows.register_fake
def _ep_expert_rows_fake(topk_idx: Tensor, layer: int) -> Tensor:
    return torch.empty_like(topk_idx)


def gathered_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, weights: list[Tensor | None],
                     activation: str, layer: int, by_expert: bool) -> Tensor:
    """A data-centric layer as the gather strategy emits it, called eagerly (tests, benchmarks).
    ``weights``: w_up, w_gate, w_down, b_up, b_gate, b_down."""
    present = [w for w in weights if w is not None]
    *gathered, _ = torch.ops.hiermoe.ep_gather(present, layer, by_expert)
    it = iter(gathered)
    full = [None if w is None else next(it) for w in weights]
    rows = torch.ops.hiermoe.ep_expert_rows(topk_idx, layer)
    return torch.ops.hiermoe.experts(x, rows, topk_weights, *full, activation)
