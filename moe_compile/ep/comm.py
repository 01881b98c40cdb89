"""Mesh communicators: the process groups of every HD-d phase on one device mesh.

HierMoE's HD-d (papers/hiermoe.txt Section III-A, Fig. 4) runs Inter-level-1 .. Inter-level-(d-1)
all-to-alls among the ranks that differ only in that level's coordinate, then one
Intra-level-(d-1) all-to-all among the ranks that share coordinates 1..d-1. ``MeshComm`` makes
their groups once per mesh (with the default group's timeout, ``groups.new_group``) and, per
phase, which peer a row bound for a mesh position leaves through; ``lowering.hier_a2a`` moves the
rows.

Legend: G ranks (mesh positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moe_compile.ep import groups


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
    group's timeout (``moe_compile.ep.groups``)."""

    sizes: tuple[int, ...]
    level_names: tuple[str, ...]
    ranks: tuple[int, ...]  # global rank of every position
    position: int
    device: torch.device
    inter: list[Phase] = field(default_factory=list)  # [i]: Inter-level-(i+1), i < D-1 used
    intra: list[Phase] = field(default_factory=list)  # [i]: Intra-level-i (i = 0: flat, world)
    # a gloo group over every rank for the per-step routing statistics (CPU tensors, asynchronous:
    # its own group, so it runs beside the dispatch's collectives instead of queueing with them)
    stats_group: Any = None

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
        comm.stats_group = groups.new_group(backend="gloo")
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
