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
keeps what the reverse needs (which row each sent row came from, the split sizes).

Every send is counted (``moe_compile.runtime.record_traffic``) at the level of the link it
crosses: the slowest mesh level on which sender and receiver coordinates differ. Payload (token
rows) and metadata (split sizes, expert ids and weights) are counted separately.

Legend: T tokens, K top-k, H hidden size, R rows held at a phase, S slots per row (K with dedup,
1 without), P peers in a phase's group, N rows sent in a phase, G ranks, E experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moe_compile import groups
from moe_compile.lowering.p2p_a2a import all_to_all_single_recv_first, use_recv_first
from moe_compile.runtime import record_traffic


@dataclass
class Phase:
    """One all-to-all of an HD-d schedule, from this rank's point of view."""

    group: dist.ProcessGroup
    peer_pos: tuple[int, ...]  # mesh position of each group rank (group rank order)
    me: int  # this rank's index among peer_pos
    dest_peer_G: Tensor  # [G] peer index through which a row bound for a position leaves; -1 unreachable
    peer_level: tuple[int, ...]  # 0-based level of the link to each peer; -1 for self
    name: str  # "inter1", "intra0", ...


@dataclass
class MeshComm:
    """Process groups of every phase of every HD-d on one device mesh (created once per mesh).

    Positions are row-major indices into ``mesh.mesh``; ``sizes`` are the level sizes s_1..s_D
    slowest first, ``level_names`` the mesh dim names. All ranks create the same groups in the
    same order (``dist.new_group`` is collective over the world); every group has the default
    group's timeout (``moe_compile.groups``)."""

    sizes: tuple[int, ...]
    level_names: tuple[str, ...]
    ranks: tuple[int, ...]  # global rank of every position
    position: int
    device: torch.device
    inter: list[Phase] = field(default_factory=list)  # [i]: Inter-level-(i+1), i < D-1 used
    intra: list[Phase] = field(default_factory=list)  # [i]: Intra-level-i (i = 0: flat, world)

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def num_levels(self) -> int:
        return len(self.sizes)

    def coords(self, pos: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(pos, self.sizes))

    def phases(self, d: int) -> list[Phase]:
        """HD-d: Inter-level-1..(d-1), then Intra-level-(d-1)."""
        if not 1 <= d <= self.num_levels:
            raise ValueError(f"dimension must be in 1..{self.num_levels} (the mesh levels), got {d}")
        return [*self.inter[: d - 1], self.intra[d - 1]]

    @classmethod
    def build(cls, mesh: object) -> MeshComm:
        mesh_t = mesh.mesh  # type: ignore[attr-defined]
        names = tuple(mesh.mesh_dim_names or ())  # type: ignore[attr-defined]
        sizes = tuple(int(s) for s in mesh_t.shape)
        ranks = tuple(int(r) for r in mesh_t.flatten().tolist())
        device = torch.device(mesh.device_type)  # type: ignore[attr-defined]
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        me = dist.get_rank()
        comm = cls(sizes, names, ranks, ranks.index(me), device)
        my = comm.coords(comm.position)
        num_levels = len(sizes)
        # Inter-level-(i+1): positions that differ from mine only in coordinate i.
        for i in range(num_levels):
            mine = None
            for others in np.ndindex(*(s for j, s in enumerate(sizes) if j != i)):
                members = []
                for c in range(sizes[i]):
                    co = list(others)
                    co.insert(i, c)
                    members.append(int(np.ravel_multi_index(co, sizes)))
                group = groups.new_group([ranks[p] for p in members])
                if comm.position in members:
                    mine = (group, members)
            assert mine is not None
            comm.inter.append(comm._phase(mine[0], mine[1], my, inter_level=i, name=f"inter{i + 1}"))
        # Intra-level-i: the G/U[i] consecutive positions sharing coordinates 1..i.
        for i in range(num_levels):
            block = math.prod(sizes[i:])
            if i == num_levels - 1:  # the last level's block is its Inter-level group: reuse it
                members = list(comm.inter[i].peer_pos)
                comm.intra.append(comm._phase(comm.inter[i].group, members, my, None, f"intra{i}"))
                continue
            mine = None
            for start in range(0, comm.world, block):
                members = list(range(start, start + block))
                group = groups.new_group([ranks[p] for p in members]) if i > 0 else dist.group.WORLD
                if comm.position in members:
                    mine = (group, members)
            assert mine is not None
            comm.intra.append(comm._phase(mine[0], mine[1], my, None, f"intra{i}"))  # type: ignore[arg-type]
        return comm

    def _phase(self, group: dist.ProcessGroup, members: list[int], my: tuple[int, ...], inter_level: int | None,
               name: str) -> Phase:
        order = sorted(members, key=lambda p: dist.get_group_rank(group, self.ranks[p]))
        dest = torch.full((self.world,), -1, dtype=torch.long)
        for q in range(self.world):
            cq = self.coords(q)
            if inter_level is None:  # the destination itself must be in the group
                if q in order:
                    dest[q] = order.index(q)
            elif all(cq[j] == my[j] for j in range(inter_level)):  # reachable: same higher coords
                want = list(my)
                want[inter_level] = cq[inter_level]
                dest[q] = order.index(int(np.ravel_multi_index(want, self.sizes)))
        levels = []
        for p in order:
            cp = self.coords(p)
            diff = [j for j in range(len(self.sizes)) if cp[j] != my[j]]
            levels.append(diff[0] if diff else -1)
        return Phase(group, tuple(order), order.index(self.position), dest.to(self.device), tuple(levels), name)


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


def _a2a(t: Tensor, recv_counts: list[int], send_counts: list[int], group: dist.ProcessGroup) -> Tensor:
    """The rows' all-to-all: on gloo with every receive posted before any send (gloo's own runs a
    pair's two directions one after the other, lowering/p2p_a2a.py), else the library's."""
    out = t.new_empty((sum(recv_counts), *t.shape[1:]))
    if use_recv_first(group, t.device):
        all_to_all_single_recv_first(out, t.contiguous(), recv_counts, send_counts, group=group)
    else:
        dist.all_to_all_single(out, t.contiguous(), recv_counts, send_counts, group=group)
    return out


def _count(layer_id: int, phase: Phase, counts: list[int], row_bytes: int, meta_row_bytes: int, what: str,
           direction: str, count_msg_bytes: int) -> None:
    for p, n in enumerate(counts):
        level = phase.peer_level[p]
        if level < 0:
            continue
        record_traffic(layer_id, level, what, direction, payload_bytes=n * row_bytes, payload_messages=int(n > 0),
                       meta_bytes=n * meta_row_bytes + count_msg_bytes,
                       meta_messages=int(n > 0 and meta_row_bytes > 0) + int(count_msg_bytes > 0))


def dispatch(x_TH: Tensor, topk_idx_TK: Tensor, weights_TK: Tensor, expert_pos_E: Tensor, phases: list[Phase],
             dedup: bool, direction: str, layer_id: int = -1) -> tuple[Tensor, Tensor, Tensor, Route]:
    """Send rows of ``x_TH`` (any number of columns) to the ranks holding their experts.

    Returns (rows [R, C] received at the last phase, their expert ids [R, S] (-1 = no slot),
    their weights [R, S] float32, the route). Collectives: per phase, one all-to-all of the
    split sizes, one of the rows, one of the slots (ids and weights packed as int32)."""
    num_tokens, top_k = topk_idx_TK.shape
    ids_RS = topk_idx_TK.long()
    w_RS = weights_TK.float()
    rows = x_TH
    if not dedup:  # one row per (token, expert) pair
        rows = x_TH.repeat_interleave(top_k, dim=0)
        ids_RS, w_RS = ids_RS.reshape(-1, 1), w_RS.reshape(-1, 1)
    hops = []
    row_bytes = rows.shape[1] * rows.element_size()
    for phase in phases:
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
        recv_counts_P = torch.empty_like(send_counts_P)
        dist.all_to_all_single(recv_counts_P, send_counts_P, group=phase.group)
        send_counts, recv_counts = send_counts_P.tolist(), recv_counts_P.tolist()
        new_rows = _a2a(rows[src_N], recv_counts, send_counts, phase.group)
        meta = _a2a(meta_NS2, recv_counts, send_counts, phase.group)
        _count(layer_id, phase, send_counts, row_bytes, meta_NS2.shape[1] * 4, "dispatch", direction, count_msg_bytes=8)
        hops.append(Hop(phase, src_N, send_counts, recv_counts, rows.shape[0]))
        num_slots = ids_RS.shape[1]
        rows, ids_RS, w_RS = new_rows, meta[:, :num_slots].long(), meta[:, num_slots:].view(torch.float32)
    return rows, ids_RS, w_RS, Route(hops, num_tokens, top_k, dedup, layer_id)


def combine(rows_RC: Tensor, route: Route, direction: str, meta_RS: Tensor | None = None
            ) -> tuple[Tensor, Tensor | None]:
    """Reverse of ``dispatch``: sum every row's partial results back into its token.

    ``rows_RC`` are results for the rows ``dispatch`` delivered; ``meta_RS`` optional float32
    per-slot values (routing-weight gradients) that travel back the same way. Sums run in float32
    and are sent in ``rows_RC.dtype``. Returns ([T, C], [T, K] or None)."""
    out_dtype = rows_RC.dtype
    acc = rows_RC.float()
    meta = meta_RS
    row_bytes = rows_RC.shape[1] * rows_RC.element_size()
    for hop in reversed(route.hops):
        back = _a2a(acc.to(out_dtype), hop.send_counts, hop.recv_counts, hop.phase.group)
        meta_bytes = 0
        summed = acc.new_zeros((hop.num_rows, acc.shape[1])).index_add_(0, hop.src_row_N, back.float())
        if meta is not None:
            meta_back = _a2a(meta, hop.send_counts, hop.recv_counts, hop.phase.group)
            meta = meta.new_zeros((hop.num_rows, meta.shape[1])).index_add_(0, hop.src_row_N, meta_back)
            meta_bytes = meta.shape[1] * 4
        _count(route.layer_id, hop.phase, hop.recv_counts, row_bytes, meta_bytes, "combine", direction, count_msg_bytes=0)
        acc = summed
    if not route.dedup:
        acc = acc.view(route.num_tokens, route.top_k, acc.shape[1]).sum(1)
        if meta is not None:
            meta = meta.view(route.num_tokens, route.top_k)
    return acc.to(out_dtype), meta
