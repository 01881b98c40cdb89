"""How expert swaps move data between ranks (``moe_compile.swap.swapper`` decides what moves).

- ``Message``: one exchange of every rank with every rank on the swapper's gloo group (routing,
  decision rows, outcomes of swaps), one ``all_to_all_single`` round.
- ``migrate`` / ``commit``: the two ranks of a swap exchange one message each way, a description
  of what they send and the expert's rows (weights, gradients, optimizer state); each writes
  what it received, and puts its own rows back if the outcome exchange says the other side
  failed.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moe_compile.ep import groups, runtime

TABLE_COLS = 9  # a decision row: swap?, a, b, d, objective before/after, predicted before/after, migration


_EXCHANGE = "the swapper's exchange of routing, decisions and outcomes (an all-to-all on its gloo group)"


class Message:
    """One round of the swapper's own exchange: every rank sends every rank one int32 header,
    [per-swap outcome | per-layer routing sizes, the ids it has for its busiest decider | table
    rows as float64 | per-layer ``payload_bytes`` as int64], and to the rank that decides a layer
    (``deciders``) also its routing ids of that layer, padded to ``capacity``: one
    ``all_to_all_single`` (uneven splits), one round of direct sends on gloo, in which no rank
    receives routing it does not read. The
    layout's sizes are the same on every rank (they come from agreed decisions, the model's
    layers, the deciders and earlier rounds), so no size is sent.

    outcome: 1 where this rank's part of a swap succeeded (ranks outside the pair send 1);
    read: the minimum over ranks. table: the decision rows this rank computed, zero elsewhere;
    read: the sum over ranks. payload: what this rank would send to move one expert of each
    layer; read: every rank's. routing: this rank's [T, K] ids of each layer's last forward, sent
    to the global rank ``deciders[i]`` only (None with decider -1: sent nowhere, as every rank
    agreed); ``capacity`` bounds the ids one rank sends one decider (all its layers together)."""

    def __init__(self, group: Any, world: int, rank: int, *, outcome: Sequence[bool] = (),
                 table: np.ndarray | None = None, topks: Sequence[Tensor | None] | None = None,
                 deciders: Sequence[int] = (), capacity: int = 0, payload: Sequence[int] = (),
                 async_op: bool = False) -> None:
        self.world, self.rank = world, rank
        self.num_out = len(outcome)
        self.num_rows = 0 if table is None else table.shape[0]
        self.num_layers = 0 if topks is None else len(topks)
        self.num_payload = len(payload)
        self.capacity = capacity if topks is not None else 0
        self.ks = [] if topks is None else [0 if t is None else t.shape[1] for t in topks]
        self.deciders = list(deciders) if topks is not None else []
        if len(self.deciders) != self.num_layers:
            raise ValueError(f"a routing message needs one decider per layer, got {len(self.deciders)} for "
                             f"{self.num_layers} layers")
        head = self.num_out + self.num_layers + (topks is not None)
        self.table_at = head + head % 2  # float64 rows and int64 sizes start on an 8-byte boundary
        self.payload_at = self.table_at + 2 * TABLE_COLS * self.num_rows
        self.ids_at = self.payload_at + 2 * self.num_payload  # the header's length
        splits, starts, self.width = _layout(world, rank, self.ids_at, self.capacity, tuple(self.deciders))
        # built in numpy: a dozen small torch ops cost more than the exchange's own CPU time
        buf = np.zeros(starts[-1], dtype=np.int32)
        head_row = buf[: self.ids_at]
        head_row[: self.num_out] = outcome
        if table is not None:
            head_row[self.table_at: self.payload_at].view(np.float64)[:] = table.reshape(-1)
        head_row[self.payload_at:].view(np.int64)[:] = payload
        if topks is not None:
            flat = [_NO_IDS if t is None else _ids(t) for t in topks]
            need = 0
            for dst in set(self.deciders) - {-1}:
                mine = [f for f, d in zip(flat, self.deciders, strict=True) if d == dst]
                n = sum(f.size for f in mine)
                need = max(need, n)
                if n <= self.capacity:  # else every rank sees it in the header
                    at = starts[dst] + self.ids_at
                    np.concatenate(mine, out=buf[at: at + n], casting="same_kind")
            head_row[self.num_out: head] = [*(f.size for f in flat), need]
        for dst in range(1, world):
            buf[starts[dst]: starts[dst] + self.ids_at] = head_row
        recv = torch.empty(world * self.width, dtype=torch.int32)
        try:
            self.work = dist.all_to_all_single(recv, torch.from_numpy(buf), [self.width] * world, splits,
                                               group=group, async_op=async_op)
        except RuntimeError as e:
            raise groups.collective_error("expert swap", _EXCHANGE, e) from e
        self._rows: np.ndarray = recv.numpy().reshape(world, self.width)  # [sender's global rank, ...]; once waited

    def wait(self) -> None:
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                raise groups.collective_error("expert swap", _EXCHANGE, e) from e
            self.work = None

    @property
    def rows(self) -> np.ndarray:
        self.wait()
        return self._rows

    def outcome(self) -> list[bool]:
        return [bool(v) for v in self.rows[:, : self.num_out].min(0)] if self.num_out else []

    def table(self) -> np.ndarray:
        """[rows, TABLE_COLS] float64: the rows every rank filled, summed (each row filled by one rank)."""
        return self.rows[:, self.table_at: self.payload_at].view(np.float64).sum(0).reshape(self.num_rows, TABLE_COLS)

    def payload(self) -> np.ndarray:
        """[global rank, i]: the ``payload`` sizes each rank sent (``payload_bytes`` of layer i)."""
        return self.rows[:, self.payload_at: self.ids_at].view(np.int64)

    def routing(self, comm: Any) -> tuple[list[tuple[np.ndarray, np.ndarray] | None] | None, int]:
        """Every rank's routing of each layer this rank decides ([sum of T, K] expert ids, [sum of
        T] source mesh position; None for the other layers), identical to what any other decider
        would read, and the capacity to use next; None (with twice the largest need as the
        capacity) when some rank's ids for some decider did not fit, which every rank sees alike
        in the headers."""
        rows = self.rows
        sizes = rows[:, self.num_out: self.num_out + self.num_layers]  # [sender, layer]
        longest = int(rows[:, self.num_out + self.num_layers].max()) if self.num_layers else 0
        if longest > self.capacity:
            return None, 2 * longest
        out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * self.num_layers
        offsets = np.full(self.world, self.ids_at)
        for i, k in enumerate(self.ks):
            if self.deciders[i] != self.rank:
                continue
            parts, sources = [], []
            for pos in range(self.world):
                rank = comm.ranks[pos]  # rows are by global rank; mesh positions map through comm.ranks
                n = int(sizes[rank, i])
                parts.append(rows[rank, offsets[rank]: offsets[rank] + n].reshape(-1, k))
                sources.append(np.full(n // k if k else 0, pos, dtype=np.int64))
                offsets[rank] += n
            out[i] = (np.concatenate(parts).astype(np.int64), np.concatenate(sources))
        return out, self.capacity


@functools.lru_cache(maxsize=64)
def _layout(world: int, rank: int, head: int, capacity: int, deciders: tuple[int, ...]
            ) -> tuple[list[int], list[int], int]:
    """A message's send splits (a header to every rank, ``capacity`` ids more to each decider),
    where each destination's part starts, and how much this rank receives from each rank (the
    same every call of a training run: made once)."""
    splits = [head + (capacity if dst in deciders else 0) for dst in range(world)]
    return splits, [0, *itertools.accumulate(splits)], splits[rank]


_NO_IDS = np.zeros(0, dtype=np.int32)


def _ids(topk: Tensor) -> np.ndarray:
    """A layer's [T, K] routing ids, flat, as numpy (a view where the tensor is on the CPU)."""
    return (topk if topk.is_cpu else topk.cpu()).detach().numpy().reshape(-1)


def pieces(lay: runtime.EPLayer, slot: int, optimizer: torch.optim.Optimizer | None
            ) -> tuple[list[Tensor], list[float], str | None]:
    """The row views that move with the expert in ``slot`` (weights, gradients, optimizer state
    shaped like the weight), the scalar optimizer state that must agree, and an error if this
    rank cannot move them."""
    rows: list[Tensor] = []
    scalars: list[float] = []
    for p in lay.slot_params:
        rows.append(p.data[slot])
        if p.grad is not None:
            rows.append(p.grad[slot])
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            v = state[key]
            if isinstance(v, Tensor) and v.shape == p.shape:
                rows.append(v[slot])
            elif isinstance(v, Tensor) and v.numel() == 1:
                scalars.append(float(v))
            elif isinstance(v, int | float):
                scalars.append(float(v))
            elif v is not None:
                return [], [], (f"optimizer state {key!r} of an expert shard has shape "
                                f"{tuple(getattr(v, 'shape', ()))}, neither the parameter's {tuple(p.shape)} nor a "
                                "scalar; expert swap cannot move it with the expert")
    return rows, scalars, None


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.int16, torch.bool]


_SIGNATURE_LEN = 256  # float64 values: one fixed-size message, so no message announces its size


def signature(rows: Sequence[Tensor], scalars: Sequence[float], error: str | None) -> tuple[Tensor, str | None]:
    """What a side will send, to check that both sides agree: [ok, #rows, #scalars,
    (dtype, numel) per row..., scalars..., zeros], float64, and the error (also one when there
    are too many pieces to describe)."""
    vals = [float(len(rows)), float(len(scalars))]
    for r in rows:
        vals += [float(_DTYPES.index(r.dtype)), float(r.numel())]
    vals += list(scalars)
    if len(vals) >= _SIGNATURE_LEN:
        error = error or f"an expert has {len(rows)} tensors to move, more than a swap describes ({_SIGNATURE_LEN})"
    out = torch.zeros(_SIGNATURE_LEN, dtype=torch.float64)
    if not error:
        out[0] = 1.0
        out[1: 1 + len(vals)] = torch.tensor(vals, dtype=torch.float64)
    return out, error


def exchange(send: Tensor, peer: int, recv_bytes: int) -> Tensor:
    """Send ``send`` (uint8) to ``peer`` while receiving up to ``recv_bytes`` bytes from it (gloo
    accepts a message shorter than the buffer, and aborts the process on a longer one: a caller
    never sends more than the peer's bound). The receive is posted before the send: on gloo a send
    posted first can write its whole message before the peer's receive-ready notice comes back
    behind it, and the pair's two directions then run one after the other (lowering/p2p_a2a.py)."""
    recv = torch.empty(recv_bytes, dtype=torch.uint8)
    reqs = [dist.irecv(recv, peer)]
    reqs.append(dist.isend(send, peer))
    for req in reqs:
        assert req is not None  # None only for a rank outside the group; the world holds every rank
        req.wait()
    return recv


HEADER_BYTES = _SIGNATURE_LEN * 8


def payload_bytes(lay: runtime.EPLayer, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes this rank would send to move one expert of ``lay`` (the signature and the rows; the
    same for every slot), announced to every rank so that a swap's two ranks can post their
    receive at once (``migrate``'s bound); 0 for a layer whose weights every rank holds."""
    if not lay.slot_params:
        return 0
    rows, _, err = pieces(lay, 0, optimizer)
    return HEADER_BYTES + (0 if err else sum(r.numel() * r.element_size() for r in rows))


def _sent_bytes(sig: Tensor) -> int:
    """What the side whose signature is ``sig`` sends: the header, and its rows if it packed them."""
    if sig[0] != 1:
        return HEADER_BYTES
    num_rows = int(sig[1])
    desc = sig[3: 3 + 2 * num_rows].view(-1, 2).tolist()
    return HEADER_BYTES + sum(int(n) * torch.empty(0, dtype=_DTYPES[int(d)]).element_size() for d, n in desc)


@dataclass
class Moved:
    """One side's half of a swap that has crossed: ``writes`` (this rank's row, its new content),
    ``undo`` (the same rows' old content, to put back if the other side failed) and the bytes
    this rank sent."""

    writes: list[tuple[Tensor, Tensor]]
    undo: list[tuple[Tensor, Tensor]]
    sent_bytes: int


def _views(rows: Sequence[Tensor], data: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(row, its content in ``data``): ``data`` holds the rows' bytes one after another."""
    out, offset = [], 0
    for r in rows:
        nbytes = r.numel() * r.element_size()
        chunk = data[offset: offset + nbytes]
        if offset % r.element_size():  # a view of another dtype must start on its alignment
            chunk = chunk.clone()
        out.append((r, chunk.view(r.dtype).view(r.shape)))
        offset += nbytes
    return out


def migrate(lay: runtime.EPLayer, a: int, b: int, pa: int, pb: int, optimizer: torch.optim.Optimizer | None,
            bound: int = 0) -> Moved:
    """On a rank holding one of them, move experts a (on position pa) and b (on pb) of a sharded
    layer into new buffers; writes nothing (``commit`` does). The two ranks exchange one message
    each way, [signature | rows], into a receive of ``bound`` bytes (the larger of the two sides'
    announced ``payload_bytes``): one round trip. A side whose message outgrew the bound (its
    layout changed since it announced it, or no bound: ``swap()``) sends the header alone and the
    rows in a second round, which both sides see coming from the header. Both sides compare the
    two signatures and raise alike when they differ; a failure of one side's transfer alone is
    told to the other by the outcome exchange that follows (``swap``), which undoes a side that
    already wrote."""
    comm = lay.comm
    me = comm.position
    local = list(lay.local_experts)
    if pa == pb:  # both here: the two rows trade places
        rows_a, _, err = pieces(lay, local.index(a), optimizer)
        rows_b, _, _ = pieces(lay, local.index(b), optimizer)
        if err:
            raise ValueError(f"layer {lay.name}: {err}")
        old_a, old_b = [r.clone() for r in rows_a], [r.clone() for r in rows_b]
        return Moved([*zip(rows_a, old_b, strict=True), *zip(rows_b, old_a, strict=True)],
                     [*zip(rows_a, old_a, strict=True), *zip(rows_b, old_b, strict=True)], 0)
    mine, theirs = (a, b) if me == pa else (b, a)
    peer = comm.ranks[pb if me == pa else pa]
    rows, scalars, err = pieces(lay, local.index(mine), optimizer)
    sig, err = signature(rows, scalars, err)
    parts = [sig.view(torch.uint8)] + ([] if err else [r.detach().contiguous().view(-1).view(torch.uint8)
                                                        for r in rows])
    payload = torch.cat(parts)
    bound = max(bound, HEADER_BYTES)
    first = payload if payload.numel() <= bound else payload[:HEADER_BYTES]
    got = exchange(first, peer, bound)
    peer_sig = got[:HEADER_BYTES].clone().view(torch.float64)
    peer_bytes = _sent_bytes(peer_sig)
    if payload.numel() > bound or peer_bytes > bound:  # the rows that did not fit, alike on both sides
        rest = exchange(payload[HEADER_BYTES:] if payload.numel() > bound else payload[:0], peer,
                        peer_bytes - HEADER_BYTES if peer_bytes > bound else 0)
        if peer_bytes > bound:
            got = torch.cat([got[:HEADER_BYTES], rest])
    if err or peer_sig[0] != 1:
        raise ValueError(f"layer {lay.name}: cannot swap experts {a} and {b}: "
                         + (err or f"rank {peer} could not pack expert {theirs} (see its error)"))
    if not torch.equal(sig, peer_sig):
        raise ValueError(f"layer {lay.name}: cannot swap experts {a} and {b}: rank {comm.ranks[me]} and rank {peer} "
                         "hold different things for them (gradients on one side only, different optimizer "
                         "state, or scalar optimizer state such as Adam's step that differs); step both alike")
    return Moved(_views(rows, got[HEADER_BYTES: peer_bytes]), _views(rows, payload[HEADER_BYTES:]),
                 int(payload.numel()))


def commit(writes: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Write the rows (``Moved.writes`` once both sides hold what they need, ``Moved.undo`` to
    put a side's own rows back)."""
    with torch.no_grad():
        for dst, src in writes:
            dst.copy_(src)
