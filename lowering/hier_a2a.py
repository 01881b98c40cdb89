"""Hierarchical token-deduplicating all-to-all (HierMoE's HD-d, papers/hiermoe.txt Section III-A).

Dispatch moves each rank's tokens to the ranks holding their experts in d phases: Inter-level-1
.. Inter-level-(d-1) all-to-alls, each among the ranks that differ only in that level's
coordinate, then one Intra-level-(d-1) all-to-all among the ranks that share coordinates
1..d-1 (HierMoE Fig. 4; d = 1 is one flat all-to-all over the world). In every phase a row (a
token, or a partial copy of one) goes once to each peer whose side holds one of its remaining
experts, carrying only the routing slots (expert id, weight) bound there: with ``dedup`` a row is
a token with K slots, so it crosses each link once per destination group however many of its
experts the group holds; without dedup every (token, expert) pair is its own row with one slot
(flat: what Megatron and HF do; d = 2: Tutel's 2DH).

Combine is the exact reverse: every phase sends each received row's partial output back to the
peer it came from, which adds it into the row it sent, so a relay sums the outputs of all the
experts below it before anything goes upward and a token's result crosses each link once.
Backward of dispatch is combine-shaped and backward of combine is dispatch-shaped; ``Route``
keeps what the reverse needs (which row each sent row came from, the split sizes). The process
groups of every phase are ``moe_compile.ep.comm.MeshComm``'s.

Every send is counted (``moe_compile.ep.runtime.record_traffic``) at the level of the link it
crosses: the slowest mesh level on which sender and receiver coordinates differ. Payload (token
rows) and metadata (split sizes, expert ids and weights) are counted separately.

Legend: T tokens, K top-k, H hidden size, R rows held at a phase, S slots per row (K with dedup,
1 without), P peers in a phase's group, N rows sent in a phase, G ranks, E experts.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_compile.ep.comm import Phase
from moe_compile.ep.runtime import record_traffic
from moe_compile.lowering.p2p_a2a import all_to_all_rows


@dataclass
class Hop:
    """What one dispatch phase did, for the reverse (combine) direction."""

    phase: Phase
    src_row_N: Tensor  # row (at the sender) each sent row was copied from, grouped by peer
    send_counts: list[int]
    recv_counts: list[int]
    num_rows: int  # rows held before the phase


@dataclass
class Route:
    hops: list[Hop]
    num_tokens: int
    top_k: int
    dedup: bool
    layer_id: int
    # with ``carry_origin``: the row (at its sender) of every row the first hop delivered here, in
    # arrival order: what ``combine_to_steps`` needs to send each result to its token's new rank
    origin_row: Tensor | None = None

    def pack(self, header: list[int]) -> Tensor:
        """The route as one int64 CPU tensor (what the staged ops pass each other in the graph):
        ``header`` (the caller's fixed-size fields), then per hop (rows held before it, its send
        and receive split sizes), then every hop's source rows, then the origin rows if carried.
        ``unpack`` reverses it, given the header's length and the hops' phases."""
        small = [v for hop in self.hops for v in (hop.num_rows, *hop.send_counts, *hop.recv_counts)]
        origin = [] if self.origin_row is None else [self.origin_row.cpu().long()]
        head = torch.tensor([*header, self.num_tokens, self.top_k, int(self.dedup), len(origin), *small],
                            dtype=torch.long)
        return torch.cat([head, *(hop.src_row_N.cpu().long() for hop in self.hops), *origin])

    @classmethod
    def unpack(cls, packed: Tensor, header_len: int, phases: list[Phase], layer_id: int, device: torch.device
               ) -> Route:
        """The route ``pack`` wrote, its hops along ``phases`` (the same d's)."""
        widths = [1 + 2 * len(ph.peer_pos) for ph in phases]
        head = packed[: header_len + 4 + sum(widths)].tolist()
        num_tokens, top_k, dedup, has_origin = head[header_len: header_len + 4]
        at, src_at = header_len + 4, header_len + 4 + sum(widths)
        hops = []
        for ph in phases:
            num_peers = len(ph.peer_pos)
            num_rows, send, recv = head[at], head[at + 1: at + 1 + num_peers], head[at + 1 + num_peers: at + 1 + 2 * num_peers]
            at += 1 + 2 * num_peers
            sent = sum(send)
            hops.append(Hop(ph, packed[src_at: src_at + sent].to(device), send, recv, num_rows))
            src_at += sent
        origin = packed[src_at: src_at + sum(hops[0].recv_counts)].to(device) if has_origin else None
        return cls(hops, num_tokens, top_k, bool(dedup), layer_id, origin)


def _pack(rows: Tensor, meta: Tensor) -> Tensor:
    """[N, C] rows and [N, m] 4-byte metadata as one [N, C * itemsize + 4 m] byte tensor: one
    all-to-all message per peer instead of two (each costs a start-up alpha on every link)."""
    return torch.cat([rows.contiguous().view(torch.uint8), meta.contiguous().view(torch.uint8)], dim=1)


def _unpack(packed: Tensor, cols: int, dtype: torch.dtype, meta_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The rows ([N, cols] ``dtype``) and the metadata (``meta_dtype``) ``_pack`` joined, each in
    its own storage (a custom op's outputs must not alias each other, even with 0 rows)."""
    split = cols * dtype.itemsize
    contiguous = torch.contiguous_format
    return (packed[:, :split].clone(memory_format=contiguous).view(dtype),
            packed[:, split:].clone(memory_format=contiguous).view(meta_dtype))


def _count(layer_id: int, phase: Phase, counts: list[int], row_bytes: int, meta_row_bytes: int, what: str,
           direction: str, count_msg_bytes: int) -> None:
    for p, n in enumerate(counts):
        level = phase.peer_level[p]
        if level < 0:
            continue
        record_traffic(layer_id, level, what, direction, payload_bytes=n * row_bytes, payload_messages=int(n > 0),
                       meta_bytes=n * meta_row_bytes + count_msg_bytes,
                       meta_messages=int(count_msg_bytes > 0))  # slots travel in the rows' message


Steps = Generator[dist.ProcessGroup, None, Any]


def run_steps(steps: Steps) -> Any:
    """Run a stage's phases one after the other on this thread (see ``dispatch_steps``)."""
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


def dispatch(x_TH: Tensor, topk_idx_TK: Tensor, weights_TK: Tensor, expert_pos_E: Tensor, phases: list[Phase],
             dedup: bool, direction: str, layer_id: int = -1, carry_origin: bool = False
             ) -> tuple[Tensor, Tensor, Tensor, Route]:
    """Send rows of ``x_TH`` (any number of columns) to the ranks holding their experts.

    Returns (rows [R, C] received at the last phase, their expert ids [R, S] (-1 = no slot),
    their weights [R, S] float32, the route). Collectives: per phase, one all-to-all of the
    split sizes, one of the rows with their slots (ids and weights, as bytes after each row).
    ``carry_origin``: the first phase's rows carry their row index at the sender too (4 bytes of
    metadata each), kept in the route for ``combine_to_steps``."""
    return run_steps(dispatch_steps(x_TH, topk_idx_TK, weights_TK, expert_pos_E, phases, dedup, direction, layer_id,
                                    carry_origin))


def dispatch_steps(x_TH: Tensor, topk_idx_TK: Tensor, weights_TK: Tensor, expert_pos_E: Tensor, phases: list[Phase],
                   dedup: bool, direction: str, layer_id: int = -1, carry_origin: bool = False) -> Steps:
    """``dispatch`` as a generator that yields each phase's process group before the phase's
    collectives and returns the result: a driver can run each phase on a thread of its own group
    (``moe_compile.ep.worker.start_steps``), so that phase 2 of one chunk and phase 1 of the next
    are in flight together (MoNTA's AllToAll / AllGather streams, Fig. 6-7)."""
    num_tokens, top_k = topk_idx_TK.shape
    ids_RS = topk_idx_TK.long()
    w_RS = weights_TK.float()
    rows = x_TH
    if not dedup:  # one row per (token, expert) pair
        rows = x_TH.repeat_interleave(top_k, dim=0)
        ids_RS, w_RS = ids_RS.reshape(-1, 1), w_RS.reshape(-1, 1)
    hops: list[Hop] = []
    origin_row: Tensor | None = None
    row_bytes = rows.shape[1] * rows.element_size()
    for phase in phases:
        yield phase.group
        num_peers = len(phase.peer_pos)
        valid = ids_RS >= 0
        peer_RS = phase.dest_peer_G[expert_pos_E[ids_RS.clamp(min=0)]]
        assert bool((peer_RS[valid] >= 0).all()), "a slot is bound for a rank this phase cannot reach"
        peer_RS = torch.where(valid, peer_RS, num_peers)
        has_RP = torch.zeros(rows.shape[0], num_peers + 1, dtype=torch.bool, device=rows.device)
        has_RP.scatter_(1, peer_RS, True)
        peer_N, src_N = has_RP[:, :num_peers].t().nonzero(as_tuple=True)  # grouped by peer, then row
        send_counts_P = torch.bincount(peer_N, minlength=num_peers)
        keep_NS = peer_RS[src_N] == peer_N[:, None]
        send_ids = torch.where(keep_NS, ids_RS[src_N], -1).int()
        send_w = torch.where(keep_NS, w_RS[src_N], 0.0)
        meta_NS2 = torch.cat([send_ids, send_w.view(torch.int32)], dim=1)
        first = carry_origin and not hops
        if first:  # each row's index at its sender, for combine_to_steps
            meta_NS2 = torch.cat([meta_NS2, src_N.to(torch.int32)[:, None]], dim=1)
        recv_counts_P = torch.empty_like(send_counts_P)
        dist.all_to_all_single(recv_counts_P, send_counts_P, group=phase.group)
        send_counts, recv_counts = send_counts_P.tolist(), recv_counts_P.tolist()
        packed = all_to_all_rows(_pack(rows[src_N], meta_NS2), recv_counts, send_counts, phase.group)
        new_rows, meta = _unpack(packed, rows.shape[1], rows.dtype, torch.int32)
        _count(layer_id, phase, send_counts, row_bytes, meta_NS2.shape[1] * 4, "dispatch", direction, count_msg_bytes=8)
        hops.append(Hop(phase, src_N, send_counts, recv_counts, rows.shape[0]))
        num_slots = ids_RS.shape[1]
        if first:
            origin_row = meta[:, 2 * num_slots].long()
        rows, ids_RS = new_rows, meta[:, :num_slots].long()
        w_RS = meta[:, num_slots:2 * num_slots].contiguous().view(torch.float32)
    return rows, ids_RS, w_RS, Route(hops, num_tokens, top_k, dedup, layer_id, origin_row)


def redispatch(x_TC: Tensor, route: Route, direction: str) -> Tensor:
    """Send rows of ``x_TC`` along a route ``dispatch`` found: each hop copies the same source rows
    to the same peers, with the split sizes known, so only the payload moves (no split sizes, no
    slots). The backward of ``combine``: a token's output gradient reaches every row its
    experts' partial results came from. Returns [R, C] aligned with the rows ``dispatch``
    delivered."""
    return run_steps(redispatch_steps(x_TC, route, direction))


def redispatch_steps(x_TC: Tensor, route: Route, direction: str, first_hop: int = 0) -> Steps:
    """``redispatch`` yielding each hop's process group first (``dispatch_steps``). ``first_hop``
    > 0: ``x_TC`` are already the rows hop ``first_hop`` - 1 delivered here; only the later hops run
    (``redispatch_from_steps``)."""
    rows = x_TC if route.dedup or first_hop else x_TC.repeat_interleave(route.top_k, dim=0)
    row_bytes = rows.shape[1] * rows.element_size()
    for hop in route.hops[first_hop:]:
        yield hop.phase.group
        rows = all_to_all_rows(rows[hop.src_row_N], hop.recv_counts, hop.send_counts, hop.phase.group)
        _count(route.layer_id, hop.phase, hop.send_counts, row_bytes, 0, "dispatch", direction, count_msg_bytes=0)
    return rows


def combine(rows_RC: Tensor, route: Route, direction: str, meta_RS: Tensor | None = None
            ) -> tuple[Tensor, Tensor | None]:
    """Reverse of ``dispatch``: sum every row's partial results back into its token.

    ``rows_RC`` are results for the rows ``dispatch`` delivered; ``meta_RS`` optional float32
    per-slot values (routing-weight gradients) that travel back the same way. Sums run in float32
    and are sent in ``rows_RC.dtype``. Returns ([T, C], [T, K] or None)."""
    return run_steps(combine_steps(rows_RC, route, direction, meta_RS))


def combine_steps(rows_RC: Tensor, route: Route, direction: str, meta_RS: Tensor | None = None,
                  first_hop: int = 0) -> Steps:
    """``combine`` yielding each hop's process group first, last hop first (``dispatch_steps``).
    ``first_hop`` > 0: only hops ``first_hop``.. are reversed, returning the rows hop ``first_hop``
    - 1 had delivered here, summed ([R, C], in the rows' dtype; ``combine_to_steps``)."""
    out_dtype = rows_RC.dtype
    acc = rows_RC.float()
    meta = meta_RS
    row_bytes = rows_RC.shape[1] * rows_RC.element_size()
    for hop in reversed(route.hops[first_hop:]):
        yield hop.phase.group
        meta_bytes = 0
        if meta is None:
            back = all_to_all_rows(acc.to(out_dtype), hop.send_counts, hop.recv_counts, hop.phase.group)
        else:  # the per-slot values travel in the rows' message
            packed = all_to_all_rows(_pack(acc.to(out_dtype), meta), hop.send_counts, hop.recv_counts, hop.phase.group)
            back, meta_back = _unpack(packed, acc.shape[1], out_dtype, torch.float32)
            meta = meta.new_zeros((hop.num_rows, meta.shape[1])).index_add_(0, hop.src_row_N, meta_back)
            meta_bytes = meta.shape[1] * 4
        summed = acc.new_zeros((hop.num_rows, acc.shape[1])).index_add_(0, hop.src_row_N, back.float())
        _count(route.layer_id, hop.phase, hop.recv_counts, row_bytes, meta_bytes, "combine", direction, count_msg_bytes=0)
        acc = summed
    if not route.dedup and not first_hop:
        acc = acc.view(route.num_tokens, route.top_k, acc.shape[1]).sum(1)
        if meta is not None:
            meta = meta.view(route.num_tokens, route.top_k)
    return acc.to(out_dtype), meta


# -- combine to the samples' new ranks (sample placement, NetMoE) --------------------------------

@dataclass
class Redirect:
    """Where ``combine_to_steps`` sent the rows the first hop had delivered here, and what it
    received: what its backward (``redispatch_from_steps``) needs to bring the gradients back."""

    send_order: Tensor  # [R0] the rows (in arrival order) as sent, grouped by destination
    send_counts: list[int]
    recv_counts: list[int]
    recv_row: Tensor  # [N] the output row (token at its new rank) of every row received

    def pack(self) -> Tensor:
        """One int64 CPU tensor: peers, split sizes, the two index lists (``unpack`` reverses it)."""
        head = torch.tensor([len(self.send_counts), *self.send_counts, *self.recv_counts], dtype=torch.long)
        return torch.cat([head, self.send_order.cpu().long(), self.recv_row.cpu().long()])

    @classmethod
    def unpack(cls, packed: Tensor, device: torch.device) -> Redirect:
        peers = int(packed[0])
        counts = packed[1: 1 + 2 * peers].tolist()
        send, recv = counts[:peers], counts[peers:]
        at = 1 + 2 * peers
        order = packed[at: at + sum(send)].to(device)
        return cls(order, send, recv, packed[at + sum(send): at + sum(send) + sum(recv)].to(device))


def combine_to_steps(rows_RC: Tensor, route: Route, new_slot_of: Tensor, samples: int, flat: Phase,
                     direction: str, offset: int = 0, out_tokens: int | None = None) -> Steps:
    """``combine`` whose results reach each token's sample at its new rank instead of its origin
    (NetMoE's placement applied in the combine all-to-all, papers/netmoe-notes-zh.md Sec. 4: "the
    second AlltoAll" places the samples). Every hop but the first is reversed as in ``combine``
    (sums at the relays); the rows the first hop had delivered here (``route.origin_row``: their
    row at the sender, carried by ``dispatch(carry_origin=True)``) then go, in one all-to-all over
    the world (``flat``), to the rank of their sample's new slot, which sums them into its tokens.

    Slots: rank at mesh position p holds samples p*B .. p*B+B-1 (B = ``samples``), each T / B
    consecutive tokens (rows for the expert op's K rows per token where its routing weights scale
    its input); ``new_slot_of[slot]`` is the slot the sample moves to. A layer run in chunks
    (``strategies.common.emit_stages``) combines each chunk so: its tokens are rows ``offset`` ..
    ``offset`` + route.num_tokens of the rank's ``out_tokens`` (T), and each chunk's result is a
    whole [T, C] holding the rows it delivered (the chunks' results summed make the layer's).
    Returns ([T, C] in the rows' dtype, summed in float32, the ``Redirect``)."""
    assert route.origin_row is not None, "combine_to needs a dispatch that carried its rows' origin"
    out_dtype = rows_RC.dtype
    row_bytes = rows_RC.shape[1] * rows_RC.element_size()
    acc, _ = yield from combine_steps(rows_RC, route, direction, first_hop=1)
    first = route.hops[0]
    device = acc.device
    num_tokens = route.num_tokens if out_tokens is None else out_tokens
    per_sample = num_tokens // samples
    src_pos = torch.tensor(first.phase.peer_pos, dtype=torch.long, device=device).repeat_interleave(
        torch.tensor(first.recv_counts, dtype=torch.long, device=device))
    token = offset + (route.origin_row if route.dedup else route.origin_row // route.top_k)
    new_slot = new_slot_of.to(device)[src_pos * samples + token // per_sample]
    new_row = (new_slot % samples) * per_sample + token % per_sample
    dest = flat.dest_peer_G.to(device)[new_slot // samples]  # the world phase: every position's group rank
    send_order = torch.argsort(dest, stable=True)
    send_counts_P = torch.bincount(dest, minlength=len(flat.peer_pos))
    yield flat.group
    recv_counts_P = torch.empty_like(send_counts_P)
    dist.all_to_all_single(recv_counts_P, send_counts_P, group=flat.group)
    send_counts, recv_counts = send_counts_P.tolist(), recv_counts_P.tolist()
    packed = all_to_all_rows(_pack(acc[send_order], new_row[send_order].to(torch.int32)[:, None]),
                             recv_counts, send_counts, flat.group)
    got, recv_row = _unpack(packed, acc.shape[1], out_dtype, torch.int32)
    _count(route.layer_id, flat, send_counts, row_bytes, 4, "combine", direction, count_msg_bytes=8)
    recv_row = recv_row[:, 0].long()
    out = torch.zeros((num_tokens, acc.shape[1]), dtype=torch.float32, device=device).index_add_(0, recv_row, got.float())
    return out.to(out_dtype), Redirect(send_order, send_counts, recv_counts, recv_row)


def redispatch_from_steps(grad_TC: Tensor, route: Route, redirect: Redirect, flat: Phase, direction: str) -> Steps:
    """The backward of ``combine_to_steps`` (dispatch-shaped, payload only): each token's output
    gradient at its new rank goes back to every first-hop row it summed, then along the route's
    other hops as in ``redispatch``. Returns [R, C] aligned with the rows ``dispatch`` delivered."""
    row_bytes = grad_TC.shape[1] * grad_TC.element_size()
    yield flat.group
    back = all_to_all_rows(grad_TC[redirect.recv_row], redirect.send_counts, redirect.recv_counts, flat.group)
    _count(route.layer_id, flat, redirect.recv_counts, row_bytes, 0, "dispatch", direction, count_msg_bytes=0)
    rows = torch.empty_like(back)
    rows[redirect.send_order] = back
    return (yield from redispatch_steps(rows, route, direction, first_hop=1))
