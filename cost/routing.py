"""Routing statistics for HierMoE's cost model: duplicate-free token counts per expert group.

HierMoE (papers/hiermoe.txt): the p^(l,g) statistics of Section III-C (Eq. 7, Alg. 1), the
duplication rate of Section II-C (Table II), and the counts after swapping two experts of
Section IV-A (Eq. 9, Fig. 8). Vectorized numpy, O(D*T*K) per statistic.

Index conventions (shared by every function here and by cost/hiermoe.py):

- ``group_sizes`` are the mesh sizes s_1..s_D, slowest level first (``Topology.sizes``);
  G = s_1*...*s_D ranks, flattened row-major, so rank q has coordinates (q_1..q_D), q_1 slowest.
- U[l] = s_1*...*s_l groups at level l (U[0] = 1, U[D] = G). Level-l group j holds the G/U[l]
  consecutive ranks j*G/U[l] .. (j+1)*G/U[l]-1, the ranks that share coordinates 1..l.
- ``placement[e]`` is the rank holding logical expert e; by default contiguous, e // (E/G)
  (the paper's layout, Fig. 6). Expert e is in level-l group placement[e] // (G/U[l]).
- Levels are 1-based in docstrings (as in the paper), lists 0-based: ``dedup_counts(...)[l-1]``
  is level l, ``HDStatistics.p_inter[l-1]`` is Inter-level-l, ``HDStatistics.p_intra[i]`` is
  Intra-level-i (i = 0: the flat all-to-all, HD1).
- ``topk_idx`` is [T, K] expert ids, a torch tensor or a numpy array. ``token_rank`` ([T],
  optional) is the rank each token starts on; without it the T tokens are one rank's tokens and
  stand for every rank's (every source routes alike).

Inputs are read as numpy (a CPU torch tensor without a copy). ``dedup_counts`` answers in the
input's kind (torch in, torch out); everything else answers numpy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Kind = Literal["max", "smooth", "lse"]


def dedup_counts(topk_idx: Any, num_experts: int, group_sizes: Sequence[int], *,
                 placement: Any = None) -> list[Any]:
    """Duplicate-free token counts per destination group, per level.

    Returns D arrays; ``out[l-1][j]`` (j < U[l]) is the number of distinct (token, level-l group j)
    pairs: tokens with at least one of their K experts in group j, each counted once however many
    of its experts the group holds. ``out[D-1]`` is per rank. The lower bound on the traffic into
    group j across level l (DESIGN.md) and, for one rank's tokens, HierMoE's p^(1,U[l]) (Eq. 7)."""
    routing = _Routing(topk_idx, num_experts, group_sizes, placement, None)
    out = [routing.counts(level, 1)[0] for level in range(1, routing.num_levels + 1)]
    if _is_torch(topk_idx):
        import torch

        return [torch.from_numpy(c) for c in out]
    return out


def duplication_rate(topk_idx: Any, num_experts: int, num_groups: int) -> float:
    """HierMoE's token duplication rate (Section II-C, Table II): the fraction of (token, expert)
    copies a plain all-to-all sends that are redundant when the E experts are split contiguously
    into ``num_groups`` groups: 1 - #distinct (token, group) pairs / (T*K)."""
    routing = _Routing(topk_idx, num_experts, (num_groups,), None, None)
    if routing.topk.size == 0:
        return 0.0
    return 1.0 - float(routing.counts(1, 1).sum()) / routing.topk.size


@dataclass(frozen=True)
class HDStatistics:
    """Duplicate-free token counts per destination of every HD-d phase (HierMoE Eq. 7, Alg. 1).

    HD-d dispatch: in Inter-level-l (l < d) a relay rank holds the tokens of the sources that share
    its coordinates l..D and sends each token once to every level-l group (inside its own
    level-(l-1) group) that holds one of the token's experts; in Intra-level-(d-1) it sends each
    token once to every rank of its level-(d-1) group that needs it. Per destination, the count
    from its busiest relay:

    - ``p_inter[l-1][j]``, j < U[l]: tokens into level-l group j in Inter-level-l (l = 1..D-1);
      the paper's p^(l,U[l]).
    - ``p_intra[i][r]``, r < G: tokens into rank r in Intra-level-i, the last phase of HD-(i+1)
      (i = 0..D-1); the paper's p^(i+1,G); ``p_intra[0]`` is the flat HD1 p of Eq. 2.
    - ``c_inter``, ``c_intra``: the same phases without dedup, in (token, expert) copies (the
      baselines: H-d / Tutel 2DH, and for ``c_intra[0]`` the flat Megatron/HF all-to-all);
      None unless asked for.
    """

    group_sizes: tuple[int, ...]
    p_inter: tuple[np.ndarray, ...]
    p_intra: tuple[np.ndarray, ...]
    c_inter: tuple[np.ndarray, ...] | None = None
    c_intra: tuple[np.ndarray, ...] | None = None

    def values(self, kind: Kind = "max", gamma: float = 10.0) -> list[float]:
        """The aggregated statistics in the order of ``hiermoe.stat_symbols``: p_inter then p_intra."""
        return [float(aggregate(p, kind, gamma)) for p in (*self.p_inter, *self.p_intra)]

    def copy_values(self, kind: Kind = "max", gamma: float = 10.0) -> list[float]:
        """The no-dedup counterparts in the order of ``hiermoe.copy_symbols``."""
        if self.c_inter is None or self.c_intra is None:
            raise ValueError("these statistics have no copy counts; call hd_statistics(..., copies=True)")
        return [float(aggregate(c, kind, gamma)) for c in (*self.c_inter, *self.c_intra)]


def hd_statistics(topk_idx: Any, num_experts: int, group_sizes: Sequence[int], *, placement: Any = None,
                  token_rank: Any = None, copies: bool = False) -> HDStatistics:
    """The statistics every HD-d time needs, for one placement (see ``HDStatistics``)."""
    return _statistics(_Routing(topk_idx, num_experts, group_sizes, placement, token_rank), copies)


def source_table(topk_idx: Any, num_experts: int, group_sizes: Sequence[int], *, placement: Any = None
                 ) -> np.ndarray:
    """[G, D+1] int64: one rank's tokens by destination rank q and first level f, cumulative over
    f: [q, l-1] = the tokens that send a copy to rank q's level-l group and name rank q first in
    it (so the level-l group's sum is its duplicate-free count), [q, D] = (token, expert) copies
    into rank q. What each rank contributes to ``gathered_statistics``: O(T*K log K), G*(D+1)
    numbers whatever T is."""
    return _Routing(topk_idx, num_experts, group_sizes, placement, None).cum[0]


def expert_table(topk_idx: Any, num_experts: int, group_sizes: Sequence[int], *, placement: Any = None
                 ) -> np.ndarray:
    """[D+1, E] int64 of one rank's tokens: [0, e] the tokens that select expert e; [l, e]
    (l = 1..D) those that select e and no other expert of e's level-l group, the tokens a relay
    would stop sending to that group if e left it. What each rank contributes, with its
    ``source_table``, to ``HDCostModel.swap_floor_experts``: O(T*K*K*D)."""
    r = _Routing(topk_idx, num_experts, group_sizes, placement, None, tables=False)
    topk = r.topk
    num_tokens, top_k = topk.shape
    out = np.zeros((r.num_levels + 1, num_experts), dtype=np.int64)
    first = np.ones(topk.shape, dtype=bool)  # the first entry of each expert in a token's top-k
    for k in range(1, top_k):
        first[:, k] = (topk[:, :k] != topk[:, k:k + 1]).all(1)
    out[0] = np.bincount(topk[first], minlength=num_experts)
    ranks = np.take(r.placement, topk)
    token = np.arange(num_tokens)[:, None]
    for level in range(1, r.num_levels + 1):
        num_groups = r.groups[level]
        key = token * num_groups + ranks // (r.num_ranks // num_groups)  # (token, group of the entry)
        distinct = np.bincount(key[first], minlength=num_tokens * num_groups)  # experts per (token, group)
        out[level] = np.bincount(topk[first & (distinct[key] == 1)], minlength=num_experts)
    return out


def gathered_statistics(tables: Any, group_sizes: Sequence[int], *, copies: bool = False) -> HDStatistics:
    """``hd_statistics`` of every rank's tokens together, each token at its own source, from every
    rank's ``source_table`` ([source mesh position, G, D+1], one placement): a relay's count is
    the sum of its sources' counts, so this equals ``hd_statistics(all tokens,
    token_rank=their sources)`` exactly, without the tokens."""
    cum = _numpy(tables).astype(np.int64, copy=False)
    sizes = tuple(int(s) for s in group_sizes)
    num_ranks = math.prod(sizes)
    if cum.shape != (num_ranks, num_ranks, len(sizes) + 1):
        raise ValueError(f"tables must be every source's source_table, shape {(num_ranks, num_ranks, len(sizes) + 1)}"
                         f", got {cum.shape}")
    return _statistics(_Routing.from_sources(cum, sizes), copies)


def _statistics(r: _Routing, copies: bool) -> HDStatistics:
    num_levels = r.num_levels

    def phases(dedup: bool) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        inter = tuple(r.counts(level, level, dedup).max(0) for level in range(1, num_levels))
        intra = tuple(r.counts(num_levels, i + 1, dedup).max(0) for i in range(num_levels))
        return inter, intra

    p_inter, p_intra = phases(True)
    c_inter, c_intra = phases(False) if copies else (None, None)
    return HDStatistics(r.sizes, p_inter, p_intra, c_inter, c_intra)


def phase_statistics(topk_idx: Any, num_experts: int, group_sizes: Sequence[int], phases: Sequence[int], *,
                 placement: Any = None, token_rank: Any = None) -> list[np.ndarray]:
    """``hd_statistics``' duplicate-free arrays of the given ``phases`` only (indices in
    ``HDStatistics.values()`` order: Inter-level-1..D-1, then Intra-level-0..D-1), each from one
    scatter of the [T, K] ids into a 0/1 [T, groups] hit table summed per relay (one product
    with the relays' one-hot; float32, exact below 2**24 tokens), O(T*(K+U)): for the few phases
    one t_d reads, without ``hd_statistics``' sort of every token's ranks."""
    r = _Routing(topk_idx, num_experts, group_sizes, placement, token_rank, tables=False)
    keys = phase_keys(r.num_levels)
    num_tokens = r.topk.shape[0]
    dtype = np.float32 if num_tokens < 2**24 else np.float64
    out = []
    for i in phases:
        level, split = keys[i]
        num_groups = r.groups[level]
        grp = r.placement // (r.num_ranks // num_groups)  # [E] expert -> group at this level
        hit = np.zeros((num_tokens, num_groups), dtype=dtype)  # 1: the token sends one copy to group j
        hit.ravel()[(np.arange(num_tokens) * num_groups)[:, None] + grp[r.topk]] = 1.0
        pos, num_pos, mult = r.relays(split)
        if pos is None:
            per_relay = hit.sum(0, keepdims=True)
        else:
            relay = np.zeros((num_tokens, num_pos), dtype=dtype)
            relay.ravel()[np.arange(num_tokens) * num_pos + pos] = 1.0
            per_relay = relay.T @ hit
        out.append(per_relay.max(0).astype(np.int64) * mult)
    return out


@functools.lru_cache(maxsize=8)
def phase_keys(num_levels: int) -> tuple[tuple[int, int], ...]:
    """Every HD phase as (destination level, relay split), in ``HDStatistics.values()`` order:
    Inter-level-1..D-1 = (l, l), then Intra-level-0..D-1 = (D, i + 1) (``_Routing.counts``)."""
    return (*((lv, lv) for lv in range(1, num_levels)), *((num_levels, i + 1) for i in range(num_levels)))


def aggregate(values: Any, kind: Kind = "max", gamma: float = 10.0) -> Any:
    """Reduce the last axis: ``max``; ``smooth`` = HierMoE Eq. 11,
    max(x) * (sum_i (x_i / max(x))^gamma)^(1/gamma), 0 for all-zero x; ``lse`` = ln sum_i exp(x_i)
    (HierMoE Section V-E). For non-negative counts."""
    x = np.asarray(values, dtype=np.float64)
    top = x.max(-1, keepdims=True)
    if kind == "max":
        return top[..., 0]
    if kind == "smooth":
        safe = np.where(top > 0, top, 1.0)
        return (top * ((x / safe) ** gamma).sum(-1, keepdims=True) ** (1.0 / gamma))[..., 0]
    if kind == "lse":
        return (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[..., 0]
    raise ValueError(f"kind must be 'max', 'smooth' or 'lse', got {kind!r}")


@dataclass(frozen=True)
class SwapStatistics:
    """Aggregated statistics after swapping experts a and b, for every pair: the [E, E] matrices
    max(Z[a, b, :]) (or its smooth / lse variant) of HierMoE Eq. 9, laid out as ``HDStatistics``
    (``p_inter[l-1]``, ``p_intra[i]``). Symmetric; the diagonal holds the unswapped value."""

    p_inter: tuple[np.ndarray, ...]
    p_intra: tuple[np.ndarray, ...]

    def values(self) -> list[np.ndarray]:
        return [*self.p_inter, *self.p_intra]


def swap_statistics(topk_idx: Any, num_experts: int, group_sizes: Sequence[int], *, kind: Kind = "max",
                    gamma: float = 10.0, placement: Any = None, token_rank: Any = None,
                    method: Literal["incremental", "brute_force"] = "incremental",
                    phases: Sequence[int] | None = None) -> SwapStatistics:
    """Every phase's aggregated statistic after each possible swap of two experts' places.
    ``phases`` (indices in ``values()`` order) limits the incremental method to the phases an
    HD-d time reads; the others are returned as zeros.

    ``brute_force`` recomputes ``hd_statistics`` for each of the E(E-1)/2 placements
    (O(E^2*D*T*K)); ``incremental`` adjusts the unswapped counts with Fig. 8's four cases
    (O(D*(T*min(K^2, E*(E+U)) + X*E^2)), X = relays per destination: Fig. 8's counts are products
    of [T, E]-wide 0/1 matrices while E*(E+U) <= DENSE_COUNTS_RATIO*K^2, else bincounts over the
    [T, K] entries)."""
    return swap_statistics_kinds(topk_idx, num_experts, group_sizes, kinds=(kind,), gamma=gamma,
                                 placement=placement, token_rank=token_rank, method=method, phases=phases)[0]


def swap_statistics_kinds(topk_idx: Any, num_experts: int, group_sizes: Sequence[int], *, kinds: Sequence[Kind],
                          gamma: float = 10.0, placement: Any = None, token_rank: Any = None,
                          method: Literal["incremental", "brute_force"] = "incremental",
                          phases: Sequence[int] | None = None) -> list[SwapStatistics]:
    """``swap_statistics`` for several aggregations at once (e.g. the smooth max Q* minimizes
    and the plain max the predicted times use): the incremental method's token passes, the
    costly part, run once for all of them."""
    r = _Routing(topk_idx, num_experts, group_sizes, placement, token_rank, tables=method != "incremental")
    num_levels = r.num_levels
    keys = phase_keys(num_levels)
    if method == "incremental":
        wanted = range(len(keys)) if phases is None else set(phases)
        num_k = r.topk.shape[1]
        dense = num_experts * (num_experts + r.num_ranks) <= DENSE_COUNTS_RATIO * num_k * num_k
        sel_TE = _selection(r) if dense else None
        per_phase = [_swap_phase(r, level, split, kinds, gamma, sel_TE) if i in wanted
                     else [np.zeros((num_experts, num_experts)) for _ in kinds]
                     for i, (level, split) in enumerate(keys)]
        per_kind = [[m[j] for m in per_phase] for j in range(len(kinds))]
    elif method == "brute_force":
        per_kind = [[np.empty((num_experts, num_experts)) for _ in keys] for _ in kinds]
        base = hd_statistics(topk_idx, num_experts, r.sizes, placement=r.placement, token_rank=token_rank)
        for mats, kind in zip(per_kind, kinds, strict=True):
            for m, v in zip(mats, base.values(kind, gamma)):
                np.fill_diagonal(m, v)
        for a in range(num_experts):
            for b in range(a + 1, num_experts):
                swapped = r.placement.copy()
                swapped[[a, b]] = swapped[[b, a]]
                stats = hd_statistics(topk_idx, num_experts, r.sizes, placement=swapped,
                                      token_rank=token_rank)
                for mats, kind in zip(per_kind, kinds, strict=True):
                    for m, v in zip(mats, stats.values(kind, gamma)):
                        m[a, b] = m[b, a] = v
    else:
        raise ValueError(f"method must be 'incremental' or 'brute_force', got {method!r}")
    return [SwapStatistics(tuple(mats[:num_levels - 1]), tuple(mats[num_levels - 1:])) for mats in per_kind]


# internals ----------------------------------------------------------------------------------------

def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _numpy(x: Any) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


class _Routing:
    """One routing prepared once, O(T*K log K): every phase's relay counts are cheap slices of one
    [source, rank, first level] table (not built with ``tables=False``: the inputs checked only)."""

    def __init__(self, topk_idx: Any, num_experts: int, group_sizes: Sequence[int], placement: Any,
                 token_rank: Any, tables: bool = True) -> None:
        self._mesh(group_sizes)
        sizes = self.sizes
        self.num_experts = num_experts
        topk = _numpy(topk_idx)
        if topk.ndim != 2:
            raise ValueError(f"topk_idx must be [tokens, top_k] expert ids, got shape {topk.shape}")
        if topk.dtype.kind not in "iu":
            raise ValueError(f"topk_idx must hold integer expert ids, got dtype {topk.dtype}")
        # one pass: negative ids read as unsigned are huge
        if topk.size and topk.view(f"u{topk.dtype.itemsize}").max() >= num_experts:
            raise ValueError(f"topk_idx holds expert ids outside [0, {num_experts})")
        if placement is None:
            if num_experts % self.num_ranks:
                raise ValueError(f"{num_experts} experts do not split evenly over {self.num_ranks} ranks; "
                                 "pass a placement (expert -> rank) or change the expert count")
            per_rank = num_experts // self.num_ranks
            self.placement = np.arange(num_experts) // per_rank
        else:
            self.placement = _numpy(placement).astype(np.int64, copy=False)  # read only
            if self.placement.shape != (num_experts,) or self.placement.min() < 0 \
                    or self.placement.max() >= self.num_ranks:
                raise ValueError(f"placement must map each of the {num_experts} experts to a rank in "
                                 f"[0, {self.num_ranks})")
        self.token_rank = None if token_rank is None else _numpy(token_rank).astype(np.int64, copy=False)
        self.per_source = token_rank is not None  # cum has a row per source (else one standing in for all)
        if self.token_rank is not None and self.token_rank.shape != topk.shape[:1]:
            raise ValueError(f"token_rank must hold one rank per token ({topk.shape[0]}), "
                             f"got shape {self.token_rank.shape}")
        if self.token_rank is not None and self.token_rank.size and \
                (self.token_rank.min() < 0 or self.token_rank.max() >= self.num_ranks):
            raise ValueError(f"token_rank must hold ranks in [0, {self.num_ranks})")
        self.topk = topk
        if not tables:
            return
        # each entry's rank, int32 from here on: half the memory traffic of int64 in every pass below
        if placement is None:
            # a shift is ~10x faster than int64 floor division, and per_rank is usually a power of 2
            shift = per_rank.bit_length() - 1
            ranks = np.empty(topk.shape, dtype=np.int32)
            if per_rank == 1 << shift:
                np.right_shift(topk, shift, out=ranks, casting="unsafe")
            else:
                np.floor_divide(topk, per_rank, out=ranks, casting="unsafe")
        else:
            ranks = np.take(self.placement.astype(np.int32), topk)
        # Step 1: sort each token's ranks; a sorted row is sorted at every coarser level too.
        ranks.sort(axis=1)
        # Step 2: each (token, k) entry's first_level (0-based): the first level at which its rank's
        # coordinates differ from the previous entry's, num_levels for a repeat of the same rank.
        # Entry k is the token's first in its level-l group iff first_level < l.
        first_level = np.zeros(ranks.shape, dtype=np.int32)
        first_level[:, 1:] = np.take(_first_difference(sizes), ranks[:, 1:] * self.num_ranks + ranks[:, :-1])
        # Step 3: one bincount: table[source, rank, f] = entries with that first_level; its cumsum
        # over f gives the distinct-token count at every level at once (f = num_levels: copies).
        num_f = self.num_levels + 1
        key = ranks * num_f + first_level
        num_src = 1 if self.token_rank is None else self.num_ranks
        if self.token_rank is not None:
            key += (self.token_rank * (self.num_ranks * num_f))[:, None]
        table = np.bincount(key.ravel(), minlength=num_src * self.num_ranks * num_f)
        self.cum = table.reshape(num_src, self.num_ranks, num_f).cumsum(-1)

    def _mesh(self, group_sizes: Sequence[int]) -> None:
        sizes = tuple(int(s) for s in group_sizes)
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"group_sizes must be positive mesh sizes, slowest level first; "
                             f"got {group_sizes}")
        self.sizes, self.num_levels = sizes, len(sizes)
        self.num_ranks = math.prod(sizes)
        self.groups = [math.prod(sizes[:i]) for i in range(len(sizes) + 1)]  # U[0..D]

    @classmethod
    def from_sources(cls, cum: np.ndarray, sizes: tuple[int, ...]) -> _Routing:
        """The counts of ``cum`` ([source, rank, first level], cumulative), with no tokens."""
        r = cls.__new__(cls)
        r._mesh(sizes)
        r.cum, r.per_source, r.token_rank = cum, True, None
        return r

    def relays(self, split: int) -> tuple[np.ndarray | None, int, int]:
        """Each token's relay position (its source's coordinates split..D), the number of
        positions, and the multiplier that stands the T tokens in for every source."""
        num_pos, mult = self.relay_positions(split)
        return (None if self.token_rank is None else self.token_rank % num_pos), num_pos, mult

    def relay_positions(self, split: int) -> tuple[int, int]:
        """``relays`` without the per-token positions: (number of positions, multiplier)."""
        if not self.per_source:
            return 1, self.groups[split - 1]
        return self.num_ranks // self.groups[split - 1], 1

    def counts(self, level: int, split: int, dedup: bool = True) -> np.ndarray:
        """[relay position x, level-``level`` group j]: tokens (distinct, or copies) that the relay
        at position x sends to group j; the relays of a destination are the ranks of its
        ancestor group at level split-1, x their coordinates split..D."""
        num_pos, mult = self.relay_positions(split)
        per_src = self.cum[:, :, level - 1 if dedup else self.num_levels]  # [source, rank]
        per_src = per_src.reshape(per_src.shape[0], self.groups[level], -1).sum(-1)  # [source, group]
        return per_src.reshape(-1, num_pos, self.groups[level]).sum(0) * mult


@functools.lru_cache(maxsize=16)
def _first_difference(sizes: tuple[int, ...]) -> np.ndarray:
    """[a*G + b]: the first level (0-based) at which ranks a and b have different coordinates,
    len(sizes) when a == b."""
    num_ranks = math.prod(sizes)
    rank = np.arange(num_ranks)
    out = np.full((num_ranks, num_ranks), len(sizes), dtype=np.int32)
    for level in range(len(sizes), 0, -1):
        group = rank // (num_ranks // math.prod(sizes[:level]))
        out[group[:, None] != group[None, :]] = level - 1
    return out.ravel()


def _selection(r: _Routing) -> np.ndarray:
    """[T, E + 1]: 1 where the token selects the expert (once however often its top-k names it),
    then a column of ones. float32 below 2**24 tokens (every count made of it is a sum of 0/1
    products over the tokens, so exact) for half the memory traffic of float64."""
    num_tokens, num_experts = r.topk.shape[0], r.num_experts
    sel_TE = np.zeros((num_tokens, num_experts + 1), dtype=np.float32 if num_tokens < 2**24 else np.float64)
    sel_TE.ravel()[(np.arange(num_tokens) * (num_experts + 1))[:, None] + r.topk] = 1.0
    sel_TE[:, num_experts] = 1.0
    return sel_TE


def _phase_counts(sel_TE: np.ndarray, grp_E: np.ndarray, num_groups: int, ends: np.ndarray
                  ) -> tuple[np.ndarray, ...]:
    """Fig. 8's token counts for one phase, per relay position x (tokens ends[x]:ends[x+1] of
    ``_selection``'s ``sel_TE``): sums over tokens of 0/1 products, so exact and additive over
    token sets. With S = selection, G[t, g] = the token selects something in group g, A[t, e] = e
    is the token's only selected expert in e's group, returns (float64)

      base [X, U] = sum_t G (distinct tokens into each group: the unswapped count)
      sel [X, E] = sum_t S,  alone [X, E] = sum_t A
      ax [X, E, E] = A^T S with a zero diagonal (tokens with a alone that also select b != a)
      nonempty [X, E, U] = S^T G (tokens that select e and something in g)

    read off two products per relay: A^T [S | 1] and [S | 1]^T [G | 1] (A implies S, so A^T S's
    diagonal is sum_t A)."""
    num_tokens, e, dtype = sel_TE.shape[0], sel_TE.shape[1] - 1, sel_TE.dtype
    onehot_EU = np.zeros((e + 1, num_groups), dtype=dtype)  # the ones column maps to no group
    onehot_EU[np.arange(e), grp_E] = 1.0
    per_group_TU = sel_TE @ onehot_EU  # distinct selected experts in each group
    hit_TU = np.empty((num_tokens, num_groups + 1), dtype=dtype)
    np.greater(per_group_TU, 0.0, out=hit_TU[:, :num_groups])
    hit_TU[:, num_groups] = 1.0
    alone_TE = ((per_group_TU == 1.0).astype(dtype) @ onehot_EU[:e].T) * sel_TE[:, :e]
    num_pos = len(ends) - 1
    lengths = np.diff(ends)
    if num_pos == 1 or (lengths == lengths[0]).all():  # every relay as many tokens: batched products
        split = (num_pos, int(lengths[0]))
        sel3, alone3 = sel_TE.reshape(*split, e + 1), alone_TE.reshape(*split, e)
        ax_s = alone3.transpose(0, 2, 1) @ sel3
        s_hit = sel3.transpose(0, 2, 1) @ hit_TU.reshape(*split, num_groups + 1)
    else:
        ax_s = np.empty((num_pos, e, e + 1), dtype=dtype)
        s_hit = np.empty((num_pos, e + 1, num_groups + 1), dtype=dtype)
        for x in range(num_pos):
            seg = slice(ends[x], ends[x + 1])
            np.matmul(alone_TE[seg].T, sel_TE[seg], out=ax_s[x])
            np.matmul(sel_TE[seg].T, hit_TU[seg], out=s_hit[x])
    diag = np.arange(e)
    ax = ax_s[:, :, :e].astype(np.float64)
    alone = ax[:, diag, diag].copy()
    ax[:, diag, diag] = 0.0
    s_hit = s_hit.astype(np.float64)
    return s_hit[:, e, :num_groups], s_hit[:, :e, num_groups], alone, ax, s_hit[:, :e, :num_groups]


def _phase_counts_sparse(r: _Routing, grp: np.ndarray, num_groups: int, pos: np.ndarray | None,
                         num_pos: int) -> tuple[np.ndarray, ...]:
    """``_phase_counts`` from [T, K] passes and bincounts, O(T*K^2) (for many experts, where the
    [T, E]-wide products cost more)."""
    num_experts, num_k = r.num_experts, r.topk.shape[1]
    # each token's entries sorted by (group, expert): a group's entries form one run, with the
    # repeats of an expert next to each other; keys int32 where they fit
    key = np.sort(grp[r.topk] * num_experts + r.topk, axis=1)
    small = np.dtype(np.int32 if num_pos * num_experts * max(num_experts, num_groups) < 2**31 else np.int64)
    e: np.ndarray = (key % num_experts).astype(small)
    g: np.ndarray = (key // num_experts).astype(small)
    valid = np.ones(key.shape, dtype=bool)  # each expert once per token
    valid[:, 1:] = key[:, 1:] != key[:, :-1]
    group_first = np.ones(key.shape, dtype=bool)  # the first entry of its group's run
    group_first[:, 1:] = g[:, 1:] != g[:, :-1]
    run_last = key.copy()  # the last key of each entry's run
    for k in range(num_k - 2, -1, -1):
        np.copyto(run_last[:, k], run_last[:, k + 1], where=~group_first[:, k + 1])
    alone = group_first & (run_last == key)  # the run holds one expert: the only one of its group
    off_diag = ~np.eye(num_k, dtype=bool)

    p: np.ndarray = np.zeros((key.shape[0], 1), dtype=small) if pos is None else pos.astype(small)[:, None]
    pe, pg = p * num_experts + e, p * num_groups + g  # [T, K]
    base = np.bincount(pg[group_first], minlength=num_pos * num_groups).reshape(num_pos, num_groups)
    alone_cnt = np.bincount(pe[alone], minlength=num_pos * num_experts).reshape(num_pos, num_experts)
    sel_cnt = np.bincount(pe[valid], minlength=num_pos * num_experts).reshape(num_pos, num_experts)
    ax_w = alone[:, :, None] & valid[:, None, :] & off_diag
    ax = np.bincount((pe[:, :, None] * num_experts + e[:, None, :])[ax_w], minlength=num_pos * num_experts ** 2)
    ne_w = valid[:, :, None] & group_first[:, None, :]
    nonempty = np.bincount((pe[:, :, None] * num_groups + g[:, None, :])[ne_w],
                           minlength=num_pos * num_experts * num_groups)
    return (base.astype(np.float64), sel_cnt.astype(np.float64), alone_cnt.astype(np.float64),
            ax.reshape(num_pos, num_experts, num_experts).astype(np.float64),
            nonempty.reshape(num_pos, num_experts, num_groups).astype(np.float64))


# _phase_counts' products cost about 2*E*(E+U) flops per token, the bincounts about K^2 passes of
# [T, K]. Measured on 4096 tokens, one core: products 2.3x faster at E=16 top-4 (E*(E+U)/K^2 = 24),
# 2.0x at E=32 top-4 (80), 2.5x at E=64 top-8 (72), even at E=128 top-8 over 16 ranks (288)
DENSE_COUNTS_RATIO = 256


def _swap_phase(r: _Routing, level: int, split: int, kinds: Sequence[Kind], gamma: float,
                sel_TE: np.ndarray | None) -> list[np.ndarray]:
    """Incremental Z for one phase (HierMoE Section IV-A, Fig. 8): for a token that selects expert a
    but not b (a in group ga, b in group gb != ga), swapping a and b
      - lowers ga's count by one iff a is the token's only selected expert in ga (cases 2, 4),
      - raises gb's count by one iff the token selects nothing in gb (cases 1, 2);
    a token selecting both or neither changes nothing. Summed over tokens:
      new[ga](a, b) = old[ga] - alone[a] + AX[a, b] + B[b, ga],   new[gb](a, b) = new[ga](b, a),
    alone[a]: tokens with a alone in its group; AX[a, b]: those of them that also select b;
    B[b, g]: tokens that select b and nothing in g. Per relay position, then max over relays;
    then each of ``kinds``' aggregations over groups. The counts come from ``_phase_counts``
    (two products of [T, E]-wide 0/1 matrices per relay) given ``sel_TE``, else from
    ``_phase_counts_sparse``."""
    num_groups = r.groups[level]
    grp = r.placement // (r.num_ranks // num_groups)  # [E] expert -> group at this level
    pos, num_pos, mult = r.relays(split)
    if sel_TE is None:
        counts = _phase_counts_sparse(r, grp, num_groups, pos, num_pos)
    elif pos is None:
        counts = _phase_counts(sel_TE, grp, num_groups, np.array([0, sel_TE.shape[0]]))
    else:  # each relay's tokens as one run
        if (pos[1:] < pos[:-1]).any():
            order = np.argsort(pos, kind="stable")
            pos, sel_TE = pos[order], sel_TE[order]
        counts = _phase_counts(sel_TE, grp, num_groups, np.searchsorted(pos, np.arange(num_pos + 1)))
    return _swap_from_counts(counts, grp, mult, kinds, gamma)


def _swap_from_counts(counts: tuple[np.ndarray, ...], grp: np.ndarray, mult: int, kinds: Sequence[Kind],
                      gamma: float) -> list[np.ndarray]:
    """``_swap_phase``'s aggregation of ``_phase_counts`` (every relay's tokens counted ``mult``
    times: the stand-in for sources not given)."""
    base, sel, alone_cnt, ax, nonempty = counts
    base = base * mult
    b_cnt = sel[:, :, None] - nonempty  # [X, E, U]
    delta = ax - alone_cnt[:, :, None] + b_cnt[:, :, grp].transpose(0, 2, 1)  # [X, a, b]
    new_ga = (base[:, grp][:, :, None] + mult * delta).max(0)
    z = base.max(0)

    same = grp[:, None] == grp[None, :]
    outs = []
    for kind in kinds:
        to_dom, op, from_dom = _domain(kind, gamma)
        excl = _exclusion_table(to_dom(z), op)[grp[:, None], grp[None, :]]
        out = from_dom(op(op(excl, to_dom(new_ga)), to_dom(new_ga.T)))
        out[same] = aggregate(z, kind, gamma)  # same group: nothing moves
        outs.append(out)
    return outs


def _domain(kind: Kind, gamma: float) -> tuple[Any, Any, Any]:
    """(map, associative op, inverse map) under which ``aggregate`` is a plain reduction:
    max; lse = logaddexp; smooth = (sum x^gamma)^(1/gamma) = exp(logaddexp(gamma*ln x) / gamma)."""
    if kind == "max":
        return (lambda v: v), np.maximum, (lambda v: v)
    if kind == "lse":
        return (lambda v: v), np.logaddexp, (lambda v: v)
    if kind == "smooth":
        def to_log(v: np.ndarray) -> np.ndarray:
            with np.errstate(divide="ignore"):
                return gamma * np.log(v)
        return to_log, np.logaddexp, (lambda v: np.exp(v / gamma))
    raise ValueError(f"kind must be 'max', 'smooth' or 'lse', got {kind!r}")


def _exclusion_table(y: np.ndarray, op: Any) -> np.ndarray:
    """[i, j] = op-reduction of y without entries i and j (i != j; -inf on the diagonal), exactly
    (no subtraction, so no cancellation). Up to 64 entries one masked [n, n, n] reduction; beyond,
    prefix before i, the run between i and j, suffix after j: O(n^2)."""
    n = y.shape[0]
    if n <= 64:
        eye = np.eye(n, dtype=bool)
        out = op.reduce(np.where(eye[:, None, :] | eye[None, :, :], -np.inf, y), axis=-1)
        out[eye] = -np.inf
        return out
    empty = np.array([-np.inf])
    prefix = np.concatenate([empty, op.accumulate(y)])  # prefix[i] = reduce y[:i]
    suffix = np.concatenate([op.accumulate(y[::-1])[::-1], empty])  # suffix[i] = reduce y[i:]
    out = np.full((n, n), -np.inf)
    for i in range(n - 1):
        between = np.concatenate([empty, op.accumulate(y[i + 1:])])  # [k] = reduce y[i+1 : i+1+k]
        j = np.arange(i + 1, n)
        out[i, j] = out[j, i] = op(op(prefix[i], between[j - i - 1]), suffix[j + 1])
    return out
