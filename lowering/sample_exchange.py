"""Sample exchanges: NetMoE's dynamic sample placement at run time (ICLR 2025; papers/netmoe-notes-zh.md).

``passes.sample_placement`` cuts the graph after an MoE layer and emits, per cut:

  hiermoe::sample_plan(topk_idx, keys, ...) -> (perm, keys')   the placement of every sample
  hiermoe::sample_move(xs, perm, ...) -> xs'                     every live per-sample value moved

Global slots: rank at mesh position p holds slots p*B .. p*B+B-1 (B samples per rank, the same on
every rank, so shapes stay static). ``keys[slot]`` is the origin slot of the sample now in
``slot`` (the identity before the first cut; the graph's outputs are moved back by
``argsort(keys)``); ``perm[new slot] = old slot``: ``sample_move`` makes ``out[n] = in[perm[n]]``
across ranks, with one all-to-all (``p2p_a2a.all_to_all_rows``) over the world for all the values of a cut (each
sample's rows of every value packed as bytes into one row), and its backward moves the gradients
by the inverse permutation, so backward sends what forward sent, reversed. Both are stages
(``ep_stages.stage_ops``): ``passes.overlap`` splits them into start and wait, so a move runs while
independent work (a fused cut's local expert stage) computes.

The decision (``sample_plan``): the layer's routing gives, per local sample, the tokens that go
to each node and each rank, deduplicated as HierMoE's HD-d sends them
(``cost.netmoe.traffic_from_routing``); every rank's table is gathered (a small all-to-all), and
every rank solves NetMoE's two-stage assignment (``cost.netmoe.place_samples``: samples to nodes,
then to the node's ranks, S/R per rank) on the same integer table with the same deterministic
Hungarian method (scipy's ``linear_sum_assignment``), so all ranks reach the same placement
without a further message. Where the model says the move does not pay (the next exchanges'
saving below the time to move the samples), perm is the identity and no sample moves.

With ``layer`` < 0 (``passes.sample_placement``'s verification, one process, no collective) the
plan is a fixed derangement of the local samples (a roll by one), so the verification checks that
the graph computes the same with its samples permuted.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from moe_compile.cost import netmoe
from moe_compile.cost.topology import Topology
from moe_compile.ep import groups, runtime
from moe_compile.lowering.ep_stages import Job, collective, stage_ops
from moe_compile.lowering.p2p_a2a import all_to_all_rows


@dataclass
class PlacementRecord:
    """What one cut's plan knows (set at compile time) and decided in its last step."""

    topology: Topology
    samples: int  # B: samples per rank
    sample_bytes: int  # bytes of every value that moves with one sample at this cut
    token_bytes: int  # bytes one token sends in a dispatch (hidden row + routing slots)
    fused: bool = False  # the layer's combine delivers to the new ranks (a redirect all-to-all)
    chunks: int = 1  # the chunks the layer's tokens run in: a fused cut redirects each chunk's rows
    # the last step's decision
    last: netmoe.Placement | None = None
    # after a step that moved nothing, or whose move gained less than the decision's exchange cost
    # (``netmoe.Placement.worth_deciding``), the next min(2 ** (declines - 1), MAX_SKIP) steps skip
    # the decision (no exchange, no sample moves): routing that gives nothing to gain costs almost
    # nothing, and a change is seen within MAX_SKIP steps; the same on every rank (same decisions)
    declines: int = 0
    skip_left: int = 0
    skipped: int = 0
    steps: int = 0
    moves: int = 0  # steps whose placement moved samples
    moved_samples: int = 0  # samples moved, summed over steps (every rank's)
    solve_s: list[float] = field(default_factory=list)

    @property
    def exchanges(self) -> float:
        """All-to-alls a move serves: the next layer's dispatch and combine, and a fused cut's
        layer's own combine too."""
        return 3.0 if self.fused else 2.0


_records: dict[int, PlacementRecord] = {}
MAX_SKIP = 8
# the process group of the sample exchanges, per set of ranks: their own, so that no other
# collective of the layers (a stage running on a lane thread, a statistics exchange) can interleave
_groups: dict[tuple[int, ...], Any] = {}


def ensure_group(ranks: Sequence[int]) -> None:
    """Create the exchanges' process group over ``ranks`` (collective over the world: every rank
    calls it at the same point of its compile; once per set of ranks)."""
    key = tuple(sorted(int(r) for r in ranks))
    if key not in _groups:
        _groups[key] = groups.new_group(key)


def _group_of(comm: Any) -> tuple[Any, list[int]]:
    """The exchanges' group of ``comm``'s ranks and the mesh position of each of its group ranks."""
    key = tuple(sorted(comm.ranks))
    if key not in _groups:
        raise RuntimeError("sample exchange: no process group for this mesh (passes.sample_placement creates it "
                           "when it compiles a graph with sample exchanges)")
    return _groups[key], [list(comm.ranks).index(r) for r in key]


def register(layer_id: int, record: PlacementRecord) -> None:
    """Attach a cut's record to the EP layer whose routing decides it."""
    _records[layer_id] = record


def record(layer_id: int) -> PlacementRecord | None:
    return _records.get(layer_id)


def reset_counts() -> None:
    """Zero every record's step, move and solve counts (what a benchmark counts per step)."""
    for r in _records.values():
        r.steps = r.moves = r.moved_samples = r.skipped = 0
        r.solve_s.clear()


def _derangement(n: int, device: torch.device) -> Tensor:
    return torch.roll(torch.arange(n, dtype=torch.int64, device=device), 1)


def _record_of(lay: runtime.EPLayer, layer: int) -> PlacementRecord:
    """The cut's record: the layer's, or the graph's own layer's when the graph runs another model's
    weights (``runtime.remapped``)."""
    return _records.get(lay.layer_id) or _records[layer]


def _node_sizes(comm: Any) -> tuple[int, int]:
    """(nodes, ranks per node) of a mesh: its slowest level, and every rank below it."""
    return comm.sizes[0], int(np.prod(comm.sizes[1:]))


def _traffic(lay: runtime.EPLayer, topk_idx: Tensor, samples: int, sizes: tuple[int, int]) -> np.ndarray:
    """[B, N + R]: units this rank's samples send to each node and each rank, deduplicated."""
    idx = topk_idx.detach().to("cpu", torch.int64).numpy()
    rank_E = lay.expert_pos_E.detach().cpu().numpy()
    num_nodes, per_node = sizes
    sample_T = np.arange(idx.shape[0]) // max(idx.shape[0] // samples, 1)
    t = netmoe.traffic_from_routing(idx, sample_T, samples, rank_E, num_nodes * per_node, per_node, dedup=lay.dedup)
    return np.concatenate([t.to_node_SN, t.to_rank_SR], axis=1)


_pending: dict[int, tuple[Any, Tensor, int]] = {}  # ticket -> (work, received, width) of a started exchange
_tickets = [0]


def start_impl(topk_idx: Tensor, world: int, samples: int, layer: int) -> Tensor:
    """Start gathering every rank's per-sample traffic table for the plan (asynchronous, on the
    exchanges' own group): right after the layer's router, so that it travels during the layer's
    own all-to-alls and experts; ``sample_plan`` waits for it at the cut."""
    _tickets[0] += 1
    ticket = _tickets[0]
    if layer >= 0:
        lay = runtime.resolve(layer)
        rec = _record_of(lay, layer)
        if rec.skip_left > 0:
            rec.skip_left -= 1
            rec.skipped += 1
        elif lay.domain is None:
            comm = lay.comm
            sizes = _node_sizes(comm)
            own = torch.from_numpy(_traffic(lay, topk_idx, samples, sizes).astype(np.int64)).reshape(-1)
            group, _ = _group_of(comm)
            every, work = runtime.exchange_with_all(own.to(comm.device), world, group, async_op=True)
            _pending[ticket] = (work, every, own.numel())
    return torch.tensor([ticket], dtype=torch.int64)


def plan_impl(ticket: Tensor, keys: Tensor | None, world: int, samples: int, layer: int) -> tuple[Tensor, Tensor]:
    device = keys.device if keys is not None else torch.device("cpu")
    if keys is None:
        keys = torch.arange(world * samples, dtype=torch.int64, device=device)
    if layer < 0:
        perm = _derangement(world * samples, device)
        return perm, keys[perm]
    lay = runtime.resolve(layer)
    rec = _record_of(lay, layer)
    comm = lay.comm
    pending = _pending.pop(int(ticket.reshape(-1)[0]), None)
    if pending is None:  # a step that skips the decision, or an expert-gathering layer (tokens cross above it only)
        perm = torch.arange(world * samples, dtype=torch.int64, device=device)
        return perm, keys[perm]
    work, every, width = pending
    work.wait()
    _, position_of = _group_of(comm)
    sizes = _node_sizes(comm)
    table = np.empty((world, width), dtype=np.float64)
    table[position_of] = every.cpu().numpy()
    table = table.reshape(world * samples, -1)
    traffic = netmoe.SampleTraffic(table[:, : sizes[0]], table[:, sizes[0]:])
    slot_rank = np.arange(world * samples) // samples
    start = time.perf_counter()
    placed = netmoe.place_samples(traffic, slot_rank, rec.topology, float(rec.token_bytes), float(rec.sample_bytes),
                                  rec.exchanges, rec.fused, rec.chunks)
    rec.solve_s.append(time.perf_counter() - start)
    rec.last, rec.steps = placed, rec.steps + 1
    # a step that moves nothing, or whose move gains less than deciding costs (it still moves: the
    # exchange is spent), backs the next decisions off
    if placed.worth_deciding:
        rec.declines = 0
    else:
        rec.declines += 1
        rec.skip_left = min(2 ** (rec.declines - 1), MAX_SKIP)
    if not placed.pays or placed.moved == 0:
        perm = torch.arange(world * samples, dtype=torch.int64)
    else:
        rec.moves += 1
        rec.moved_samples += placed.moved
        dest = np.asarray(placed.rank_of_sample)
        # new slots of rank r: the samples bound for r, in the order of their origin (keys)
        key_np = keys.cpu().numpy()
        order = np.lexsort((key_np, dest))
        perm = torch.from_numpy(order.astype(np.int64))
    perm = perm.to(device)
    return perm, keys[perm]


@torch.library.custom_op("hiermoe::sample_plan_start", mutates_args=(),
                         schema="(Tensor topk_idx, int world, int samples, int layer) -> Tensor")
def sample_plan_start(topk_idx: Tensor, world: int, samples: int, layer: int) -> Tensor:
    """A ticket for the plan's exchange, started (see ``start_impl``)."""
    return start_impl(topk_idx, world, samples, layer)


@sample_plan_start.register_fake
def _start_fake(topk_idx: Tensor, world: int, samples: int, layer: int) -> Tensor:
    return topk_idx.new_empty((1,), dtype=torch.int64, device="cpu")


@torch.library.custom_op("hiermoe::sample_plan", mutates_args=(),
                         schema="(Tensor ticket, Tensor? keys, int world, int samples, int layer) -> (Tensor, Tensor)")
def sample_plan(ticket: Tensor, keys: Tensor | None, world: int, samples: int, layer: int) -> tuple[Tensor, Tensor]:
    """(perm, keys after the move): see the module docstring."""
    perm, new_keys = plan_impl(ticket, keys, world, samples, layer)
    return perm, new_keys.clone()


@sample_plan.register_fake
def _plan_fake(ticket: Tensor, keys: Tensor | None, world: int, samples: int, layer: int) -> tuple[Tensor, Tensor]:
    n = world * samples
    like = keys if keys is not None else ticket
    return (like.new_empty((n,), dtype=torch.int64), like.new_empty((n,), dtype=torch.int64))


def _move_job(xs: Sequence[Tensor], perm: Tensor, samples: int, layer: int, direction: str = "forward") -> Job:
    """``out[n] = in[perm[n]]`` for every value of ``xs`` (each [B * rows, ...]): one all-to-all of
    each sample's rows of every value packed side by side, on the exchanges' own group; a stage
    (``ep_stages.stage_ops``), so that ``passes.overlap`` runs the layer's local work while it is
    in flight. With ``layer`` < 0 (the rewrite's verification) or one rank, a local permutation."""
    device = xs[0].device if xs else perm.device
    world = perm.numel() // samples
    perm_cpu = perm.cpu()
    if not xs or layer < 0 or world == 1 or torch.equal(perm_cpu, torch.arange(world * samples)):
        local = perm_cpu.to(device)
        result = ([x.clone() for x in xs] if layer >= 0 and world > 1
                  else [x.reshape(samples, -1)[local].reshape(x.shape) for x in xs])
        return device, _done(result), []
    lay = runtime.resolve(layer)
    comm = lay.comm
    me = comm.position
    mine = slice(me * samples, (me + 1) * samples)
    packed = runtime.as_bytes(xs, samples)  # [B, bytes]: sample b's rows of every value side by side
    group, position_of = _group_of(comm)
    group_index = _inverse(torch.tensor(position_of, dtype=torch.int64))  # [position] -> group rank
    flat = comm.intra[0]  # the flat world phase: the link level to each position
    level_of = {pos: lv for pos, lv in zip(flat.peer_pos, flat.peer_level, strict=True)}
    new_of_old = torch.argsort(perm_cpu)
    # send: my rows grouped by the group rank of their new position, in new-slot order (so each
    # receiver gets its rows from one source in its own slot order)
    dest_new = new_of_old[mine]
    dest_group = group_index[dest_new // samples]
    send_order = torch.from_numpy(np.lexsort((dest_new.numpy(), dest_group.numpy())))
    send_split = torch.bincount(dest_group, minlength=world).tolist()
    # receive: my new slots grouped by the group rank of their old position, in new-slot order
    src_group = group_index[perm_cpu[mine] // samples]
    recv_order = torch.argsort(src_group, stable=True)
    recv_split = torch.bincount(src_group, minlength=world).tolist()
    send = packed[send_order.to(packed.device)]
    likes = [(x.dtype, (x.numel() // samples,)) for x in xs]
    shapes = [x.shape for x in xs]

    def job() -> Generator[Any, None, list[Tensor]]:
        yield group
        with collective(lay, "the exchange that moves its samples (sample placement)"):
            recv = all_to_all_rows(send, recv_split, send_split, group)
        out = torch.empty_like(recv)
        out[recv_order.to(recv.device)] = recv
        row_bytes = recv.shape[1]
        for i, n in enumerate(send_split):
            level = level_of[position_of[i]]
            if level >= 0 and n:
                runtime.record_traffic(lay.layer_id, level, "samples", direction, payload_bytes=n * row_bytes,
                                       payload_messages=1, meta_bytes=0, meta_messages=0)
        return [y.reshape(shape) for y, shape in zip(runtime.from_bytes(out, likes), shapes, strict=True)]

    return device, job(), [group]


def _done(result: list[Tensor]) -> Generator[Any, None, list[Tensor]]:
    """A stage's steps with no collective: its result at once."""
    return result
    yield  # a generator


def _inverse(order: Tensor) -> Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(order))
    return inv


def _move_fake(xs: list[Tensor], perm: Tensor, samples: int, layer: int) -> list[Tensor]:
    return [torch.empty_like(x) for x in xs]


sample_move = stage_ops("sample_move", "Tensor[] xs, Tensor perm, int samples, int layer", "Tensor[]", _move_job,
                        _move_fake)
sample_move.__doc__ = "``out[n] = in[perm[n]]`` over the global sample slots (module docstring)."


def _move_backward_job(grads: list[Tensor], perm: Tensor, samples: int, layer: int) -> Job:
    """The gradients of ``sample_move``'s outputs moved back: ``sample_move`` by the inverse
    permutation (counted as backward traffic)."""
    return _move_job(grads, perm, samples, layer, "backward")


stage_ops("sample_move_backward", "Tensor[] grads, Tensor perm, int samples, int layer", "Tensor[]",
          _move_backward_job, _move_fake)


def _move_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    xs, perm, samples, layer = inputs
    ctx.save_for_backward(perm)
    ctx.samples, ctx.layer = samples, layer
    ctx.floating = [x.is_floating_point() or x.is_complex() for x in xs]
    ctx.likes = [(x.shape, x.dtype, x.device) for x in xs]


def _move_backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Any, ...]:
    (perm,) = ctx.saved_tensors
    inverse = torch.argsort(perm)
    pick = [i for i, f in enumerate(ctx.floating) if f]
    moved = torch.ops.hiermoe.sample_move_backward(
        [g if (g := grads[i]) is not None else torch.zeros(ctx.likes[i][0], dtype=ctx.likes[i][1], device=ctx.likes[i][2]) for i in pick], inverse, ctx.samples, ctx.layer)
    out: list[Tensor | None] = [None] * len(ctx.floating)
    for i, g in zip(pick, moved, strict=True):
        out[i] = g
    return out, None, None, None


sample_move.register_autograd(_move_backward, setup_context=_move_setup)

__all__ = ["PlacementRecord", "ensure_group", "record", "register", "reset_counts", "sample_move", "sample_plan"]
