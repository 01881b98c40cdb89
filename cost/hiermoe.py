"""HierMoE's time model of the hierarchical deduplicating all-to-all (HD-d), its baselines, the
optimal dimension d* and the expert-swap matrix Q_d, as sympy expressions of named symbols.

Lin et al., "HierMoE: Accelerating MoE Training with Hierarchical Token Deduplication and Expert
Swap" (papers/hiermoe.txt): t_1 Eq. 1-2, t_d Eq. 3-5, d* Eq. 6 / Alg. 1, Q_d Eq. 8-9, the best
swap Eq. 10, smooth-max Eq. 11. Statistics and their indexing: cost/routing.py.

Assumptions:
- alpha-beta links (Eq. 1, fitted in Section V-B): one all-to-all costs alpha + n*beta, n the bytes
  one rank sends: (ranks in the all-to-all) * (tokens to its busiest destination) * M * v
  (Eq. 2, 4, 5), i.e. every destination padded to the busiest, the busiest relay setting the pace.
- Inter-level-i runs over level i's links (``Topology.levels[i-1]``). Intra-level-i, an
  all-to-all inside one level-i group, runs at the slowest link it crosses, level i+1
  (``Topology.levels[i]``); Intra-level-0 is the flat all-to-all (alpha_a2a, beta_a2a, Eq. 8's
  convention). The paper fits each separately; its Fig. 9 (b)-(c) finds Intra-(i) close to
  Inter-(i+1), which is what one alpha/beta per level gives.
- Dispatch only: combine moves the same volumes back, so one layer step costs twice this.
- The routing metadata sent with a row is ignored, as in the paper, unless the workload gives its
  bytes per slot (``Workload.slot_bytes``, what the runtime sends): then a deduplicated row is
  M*v + K*m bytes and a per-(token, expert) copy M*v + m (the planner compares the two families
  with it; at small M it decides between them).
- Levels 1..D are the mesh dims slowest first; U[i] = s_1*...*s_i groups at level i, U[0] = 1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import sympy as sp

from moe_compile.cost.routing import (
    HDStatistics,
    Kind,
    _Routing,
    hd_statistics,
    phase_keys,
    phase_statistics,
    swap_statistics_kinds,
)
from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import Workload

M_hidden = sp.Symbol("M_hidden", positive=True)  # M: elements per token (hidden size)
v_bytes_per_element = sp.Symbol("v_bytes_per_element", positive=True)  # v
G_ranks = sp.Symbol("G_ranks", positive=True, integer=True)  # G: ranks in the cluster
m_slot_bytes = sp.Symbol("m_slot_bytes", nonnegative=True)  # routing metadata per slot (0 in the paper)
K_top = sp.Symbol("K_top", positive=True, integer=True)  # K: routing slots of a token
token_bytes = M_hidden * v_bytes_per_element
dedup_row_bytes = token_bytes + K_top * m_slot_bytes  # a token with all its slots
copy_row_bytes = token_bytes + m_slot_bytes  # one (token, expert) copy with its slot


def U_groups(i: int) -> sp.Expr:
    """U[i], expert groups at level i (HierMoE Table I); U[0] = 1."""
    return sp.Integer(1) if i == 0 else sp.Symbol(f"U_{i}_groups", positive=True, integer=True)


def alpha_inter_s(i: int) -> sp.Symbol:
    return sp.Symbol(f"alpha_inter{i}_s", positive=True)


def beta_inter_s_per_byte(i: int) -> sp.Symbol:
    return sp.Symbol(f"beta_inter{i}_s_per_byte", positive=True)


def alpha_intra_s(i: int) -> sp.Symbol:
    """Intra-level-i startup; i = 0 is the flat all-to-all's alpha_a2a (Eq. 8)."""
    return sp.Symbol(f"alpha_intra{i}_s", positive=True)


def beta_intra_s_per_byte(i: int) -> sp.Symbol:
    return sp.Symbol(f"beta_intra{i}_s_per_byte", positive=True)


def p_inter_max_tokens(i: int) -> sp.Symbol:
    """max(p^(i,U[i])): distinct tokens into the busiest level-i group in Inter-level-i (Eq. 4)."""
    return sp.Symbol(f"p_inter{i}_max_tokens", nonnegative=True)


def p_intra_max_tokens(i: int) -> sp.Symbol:
    """max(p^(i+1,G)): distinct tokens into the busiest rank in Intra-level-i (Eq. 5; i = 0: Eq. 2)."""
    return sp.Symbol(f"p_intra{i}_max_tokens", nonnegative=True)


def c_inter_max_copies(i: int) -> sp.Symbol:
    """Like p_inter_max_tokens without dedup: (token, expert) copies."""
    return sp.Symbol(f"c_inter{i}_max_copies", nonnegative=True)


def c_intra_max_copies(i: int) -> sp.Symbol:
    return sp.Symbol(f"c_intra{i}_max_copies", nonnegative=True)


def stat_symbols(num_levels: int) -> list[sp.Symbol]:
    """The order of ``HDStatistics.values()``: p_inter 1..D-1, then p_intra 0..D-1."""
    return ([p_inter_max_tokens(i) for i in range(1, num_levels)]
            + [p_intra_max_tokens(i) for i in range(num_levels)])


def copy_symbols(num_levels: int) -> list[sp.Symbol]:
    return ([c_inter_max_copies(i) for i in range(1, num_levels)]
            + [c_intra_max_copies(i) for i in range(num_levels)])


# the equations ------------------------------------------------------------------------------------

def n_inter_bytes(i: int, tokens: sp.Expr | None = None, row: sp.Expr = dedup_row_bytes) -> sp.Expr:
    """HierMoE Eq. 4: n^Inter(i) = U[i]/U[i-1] * max(p^Inter(i)) * M * v (+ the slots' metadata)."""
    return U_groups(i) / U_groups(i - 1) * (p_inter_max_tokens(i) if tokens is None else tokens) * row


def n_intra_bytes(i: int, tokens: sp.Expr | None = None, row: sp.Expr = dedup_row_bytes) -> sp.Expr:
    """HierMoE Eq. 5: n^Intra(i) = G/U[i] * max(p^Intra(i)) * M * v (+ metadata); i = 0 is Eq. 2."""
    return G_ranks / U_groups(i) * (p_intra_max_tokens(i) if tokens is None else tokens) * row


def t_flat_expr() -> sp.Expr:
    """HierMoE Eq. 1-2: t_1 = alpha_a2a + G * max(p) * M * v * beta_a2a (HD1, dedup per rank)."""
    return alpha_intra_s(0) + n_intra_bytes(0) * beta_intra_s_per_byte(0)


def t_d_expr(d: int) -> sp.Expr:
    """HierMoE Eq. 3: t_d = sum_{i<d} (n^Inter(i) beta^Inter(i) + alpha^Inter(i))
    + n^Intra(d-1) beta^Intra(d-1) + alpha^Intra(d-1); d = 1 gives t_1 (Eq. 8's convention)."""
    return _t_expr(d, p_inter_max_tokens, p_intra_max_tokens, dedup_row_bytes)


def t_hier_nodedup_expr(d: int) -> sp.Expr:
    """Baseline: the same d phases sending one copy per (token, expert) (HierMoE's H-d, Fig. 13;
    d = 2 is Tutel's 2DH all-to-all, d = 1 the flat all-to-all of Megatron and HF)."""
    return _t_expr(d, c_inter_max_copies, c_intra_max_copies, copy_row_bytes)


def t_flat_nodedup_expr() -> sp.Expr:
    """Baseline: flat all-to-all, one copy per (token, expert) (Eq. 1-2 with copies for p)."""
    return t_hier_nodedup_expr(1)


def _t_expr(d: int, inter: Callable[[int], sp.Symbol], intra: Callable[[int], sp.Symbol], row: sp.Expr) -> sp.Expr:
    return sum((a + n * b for _, a, n, b in _phase_exprs(d, inter, intra, row)), sp.Integer(0))


def _phase_exprs(d: int, inter: Callable[[int], sp.Symbol], intra: Callable[[int], sp.Symbol], row: sp.Expr
                 ) -> list[tuple[int, sp.Expr, sp.Expr, sp.Expr]]:
    """Eq. 3's summands, one per phase in order: (the mesh level whose link carries it, fixed
    latency alpha, send buffer n, beta): the phase takes alpha + n * beta."""
    assert d >= 1
    return ([(i - 1, alpha_inter_s(i), n_inter_bytes(i, inter(i), row), beta_inter_s_per_byte(i)) for i in range(1, d)]
            + [(d - 1, alpha_intra_s(d - 1), n_intra_bytes(d - 1, intra(d - 1), row), beta_intra_s_per_byte(d - 1))])


def _phases(d: int, dedup: bool) -> list[tuple[int, sp.Expr, sp.Expr, sp.Expr]]:
    return (_phase_exprs(d, p_inter_max_tokens, p_intra_max_tokens, dedup_row_bytes) if dedup
            else _phase_exprs(d, c_inter_max_copies, c_intra_max_copies, copy_row_bytes))


def phase_times_s(d: int, topology: Topology, workload: Workload, stats: HDStatistics, dedup: bool = True
                  ) -> list[tuple[float, float]]:
    """(alpha, transfer seconds) of each phase of one HD-d dispatch (dedup; Eq. 3's summands) or
    of the no-dedup H-d baseline's (``stats`` then from ``hd_statistics(..., copies=True)``)."""
    return [(alpha, transfer) for _, alpha, transfer, _ in phase_terms(d, topology, workload, stats, dedup)]


def phase_terms(d: int, topology: Topology, workload: Workload, stats: HDStatistics, dedup: bool = True
                ) -> list[tuple[int, float, float, float]]:
    """``phase_times_s``'s phases with where they run: (the mesh level whose link carries it,
    alpha, transfer seconds, the busiest rank's send buffer bytes n): what the chunked pipeline's
    model (``cost.pipeline``) divides among chunks, looking up the level's measured efficiency
    r(n / chunks) (MoNTA Eq. 8-9) where calibration wrote one."""
    def value(expr: sp.Expr) -> float:
        return _evaluate(expr, topology, workload, stats, "max", 10.0)

    return [(level, value(a), value(n * b), value(n)) for level, a, n, b in _phases(d, dedup)]


# substitution -------------------------------------------------------------------------------------

def symbol_values(topology: Topology, workload: Workload) -> dict[sp.Symbol, float]:
    """Every non-statistic symbol's value (see Assumptions for the link mapping)."""
    levels, sizes = topology.levels, topology.sizes
    out: dict[sp.Symbol, float] = {M_hidden: workload.hidden_size, v_bytes_per_element: workload.dtype_bytes,
                                   G_ranks: topology.world_size, m_slot_bytes: workload.slot_bytes,
                                   K_top: workload.top_k}
    # Topology's beta is seconds per byte leaving a rank over a level's link; HierMoE's beta (Fig. 9)
    # is per byte of the whole A2A send buffer n.  In an A2A whose slowest link is level l, the part
    # of n addressed outside the sender's level-l group, (s_l - 1)/s_l, crosses that link:
    # beta_paper = beta_link * (s_l - 1) / s_l (e.g. a flat A2A over 4 nodes sends 3/4 inter-node).
    for i in range(1, len(levels)):
        s_l = sizes[i - 1]
        out[U_groups(i)] = math.prod(sizes[:i])
        out[alpha_inter_s(i)] = levels[i - 1].alpha_s
        out[beta_inter_s_per_byte(i)] = levels[i - 1].beta_s_per_byte * (s_l - 1) / s_l
    for i in range(len(levels)):
        s_l = sizes[i]
        out[alpha_intra_s(i)] = levels[i].alpha_s
        out[beta_intra_s_per_byte(i)] = levels[i].beta_s_per_byte * (s_l - 1) / s_l
    return out


def _evaluate(expr: sp.Expr, topology: Topology, workload: Workload, stats: HDStatistics, kind: Kind,
              gamma: float) -> float:
    num_levels = len(topology.levels)
    subs: dict[sp.Symbol, float] = symbol_values(topology, workload)
    subs.update(zip(stat_symbols(num_levels), stats.values(kind, gamma)))
    if stats.c_inter is not None:
        subs.update(zip(copy_symbols(num_levels), stats.copy_values(kind, gamma)))
    return float(expr.subs(subs))


def t_d_s(d: int, topology: Topology, workload: Workload, stats: HDStatistics, kind: Kind = "max",
          gamma: float = 10.0) -> float:
    """Seconds of one HD-d dispatch (Eq. 3; d = 1: Eq. 1)."""
    return _evaluate(t_d_expr(d), topology, workload, stats, kind, gamma)


def t_flat_s(topology: Topology, workload: Workload, stats: HDStatistics) -> float:
    return t_d_s(1, topology, workload, stats)


def t_hier_nodedup_s(d: int, topology: Topology, workload: Workload, stats: HDStatistics) -> float:
    """Seconds of the no-dedup H-d baseline; ``stats`` from ``hd_statistics(..., copies=True)``."""
    return _evaluate(t_hier_nodedup_expr(d), topology, workload, stats, "max", 10.0)


def t_flat_nodedup_s(topology: Topology, workload: Workload, stats: HDStatistics) -> float:
    return t_hier_nodedup_s(1, topology, workload, stats)


def dimension_rule(times_s: Sequence[float]) -> int:
    """HierMoE Eq. 6 on t_1..t_D: d* = 1 if t_1 < min_{d>1} t_d, else argmin_{d>1} t_d."""
    if len(times_s) == 1 or times_s[0] < min(times_s[1:]):
        return 1
    return 2 + int(np.argmin(times_s[1:]))


def optimal_dimension(topology: Topology, workload: Workload, stats: HDStatistics) -> int:
    """d* (Eq. 6) by substituting into the sympy expressions; ``HDCostModel`` is the fast path."""
    return dimension_rule([t_d_s(d, topology, workload, stats) for d in range(1, len(topology.levels) + 1)])


# the runtime path ---------------------------------------------------------------------------------

class HDCostModel:
    """t_1..t_D and the baselines lambdified once per (topology, workload), so that choosing d*
    from each step's routing costs the statistics plus a few microseconds."""

    def __init__(self, topology: Topology, workload: Workload) -> None:
        self.topology, self.workload = topology, workload
        self.num_levels = len(topology.levels)
        subs = symbol_values(topology, workload)
        dims = range(1, self.num_levels + 1)
        # one function per d: swap_matrices evaluates its t_d alone on [E, E] arguments
        self._t_d = [sp.lambdify(stat_symbols(self.num_levels), t_d_expr(d).subs(subs), "numpy") for d in dims]
        self._nodedup = sp.lambdify(copy_symbols(self.num_levels),
                                    [t_hier_nodedup_expr(d).subs(subs) for d in dims], "numpy")

    def _hd(self, *values: Any) -> list[Any]:
        """t_1..t_D of the statistics ``values`` (``HDStatistics.values()`` order)."""
        return [t(*values) for t in self._t_d]

    def _phases(self, d: int) -> list[int]:
        """The phases t_d reads, as indices in ``HDStatistics.values()`` order (inter, then intra):
        Inter-level-1..d-1 and Intra-level-(d-1)."""
        if not 1 <= d <= self.num_levels:
            raise ValueError(f"d must be in 1..{self.num_levels} (the topology's levels), got {d}")
        return [*range(d - 1), self.num_levels - 1 + d - 1]

    def times_s(self, stats: HDStatistics, kind: Kind = "max", gamma: float = 10.0) -> np.ndarray:
        """[d-1] = t_d, seconds of HD-d for d = 1..D."""
        return np.asarray(self._hd(*stats.values(kind, gamma)), dtype=np.float64)

    def nodedup_times_s(self, stats: HDStatistics) -> np.ndarray:
        """[d-1] = seconds of the no-dedup H-d baseline: [0] flat all-to-all, [1] Tutel 2DH."""
        return np.asarray(self._nodedup(*stats.copy_values()), dtype=np.float64)

    def optimal_dimension(self, stats: HDStatistics) -> int:
        return dimension_rule(self._hd(*stats.values()))

    def times_from_values(self, values: Sequence[float], dedup: bool = True) -> np.ndarray:
        """t_1..t_D from already aggregated statistics, in the order of ``HDStatistics.values()``
        (``copy_values()`` when not ``dedup``): the runtime path, where every rank has the same
        values (gathered statistics, or each rank's max-reduced) so all ranks agree."""
        fn = self._hd if dedup else self._nodedup
        return np.asarray(fn(*values), dtype=np.float64)

    def swap_floor_s(self, topk_idx: Any, d: int, *, placement: Any = None, token_rank: Any = None
                     ) -> tuple[float, np.ndarray]:
        """(t_d now, [G, G] lower bounds: [A, B] bounds t_d after any one swap of an expert on rank A
        with an expert on rank B) for one routing and placement. Such a swap changes, in every
        phase, the counts of two destinations only: the groups of A and B at that phase's level
        (Fig. 8's Group1..4 are those two); every other destination keeps its count, so the
        phase's max is at least the largest count outside those two groups; and where A and B
        share their group at that level no count of the phase changes. t_d (Eq. 3) grows with
        each phase's max, so it is at least t_d of those. A swap decision that needs a minimum
        saving per rank pair (``payback`` against the time to move experts between them) can skip
        Q* when no pair's t_d now minus its bound reaches it. Reads only the phases t_d reads:
        with one or two, ``routing.phase_statistics`` (about 60 us a phase on 2048 tokens, E=16,
        top-4, 8 ranks), else ``hd_statistics`` (about 170 us for all)."""
        used = self._phases(d)
        num_experts, sizes = self.workload.num_experts, self.topology.sizes
        if len(used) <= 2:
            counts = phase_statistics(topk_idx, num_experts, sizes, used, placement=placement, token_rank=token_rank)
            return self._floors(d, counts)
        return self.swap_floor_from_statistics(
            hd_statistics(topk_idx, num_experts, sizes, placement=placement, token_rank=token_rank), d)

    def swap_floor_from_statistics(self, stats: HDStatistics, d: int) -> tuple[float, np.ndarray]:
        """``swap_floor_s`` from statistics already made for the placement (e.g. the runtime's
        ``gathered_statistics`` of the last forward): no pass over the tokens."""
        arrays = (*stats.p_inter, *stats.p_intra)
        return self._floors(d, [arrays[i] for i in self._phases(d)])

    def swap_floor_experts(self, tables: Any, experts: Any, d: int, placement: Any) -> tuple[float, np.ndarray]:
        """(t_d now, [E, E] lower bounds: [a, b] bounds t_d after swapping experts a and b) from
        every rank's ``routing.source_table`` ([source, G, D+1]) and ``routing.expert_table``
        ([source, D+1, E]) for ``placement``: no tokens. Tighter than ``swap_floor_s``'s per rank
        pair because the swapped experts' tokens move with them: in a phase whose destinations
        are level-l groups, relay x sends group g_a = group of a, after the swap, at least its
        tokens for g_a less those that select a and no other expert of g_a (they leave with a),
        and at least its tokens that select b (they follow b into g_a); the same for g_b; every
        other group keeps its count, and where a and b share their group the phase is unchanged.
        Each bound is a sum over the sources of the relay, so exact from the tables."""
        sizes = tuple(self.topology.sizes)
        num_ranks, num_experts = math.prod(sizes), self.workload.num_experts
        experts = np.asarray(experts)
        r = _Routing.from_sources(np.asarray(tables).astype(np.int64, copy=False), sizes)
        placement = np.asarray(placement, dtype=np.int64)
        now: list[Any] = [0.0] * (2 * self.num_levels - 1)  # t_d reads no other
        floor: list[Any] = list(now)
        for i in self._phases(d):
            level, split = phase_keys(self.num_levels)[i]
            c = r.counts(level, split).astype(np.float64)  # [relay position, level-l group]
            num_pos = c.shape[0]
            # a relay's counts are its sources' (source q at position q mod num_pos) summed
            n = experts[:, 0, :].reshape(-1, num_pos, num_experts).sum(0)  # [x, e] tokens that chose e
            u = experts[:, level, :].reshape(-1, num_pos, num_experts).sum(0)  # ... e alone in e's group
            grp = placement // (num_ranks // r.groups[level])  # [E] each expert's group
            kept = c[:, grp] - u  # [x, a]: what g_a keeps from relay x when a leaves it
            low_a = np.maximum(kept[:, :, None], n[:, None, :])  # [x, a, b]: into g_a after the swap
            low_b = np.maximum(kept[:, None, :], n[:, :, None])  # into g_b
            now[i] = float(c.max())
            bound = np.maximum(_outside(c, grp), np.maximum(low_a, low_b)).max(0)  # [a, b]
            floor[i] = np.where(grp[:, None] == grp[None, :], now[i], bound)
        return self._bounds(d, now, floor, num_experts)

    def _floors(self, d: int, counts: Sequence[np.ndarray]) -> tuple[float, np.ndarray]:
        """(t_d, [G, G] its bounds after a swap between ranks A and B) from the per-destination
        counts of t_d's phases: ``_outside`` for one row of counts, in Python (a few dozen numbers;
        2-3x faster than numpy here, and this runs every swapper call)."""
        num_ranks = math.prod(self.topology.sizes)
        now: list[Any] = [0.0] * (2 * self.num_levels - 1)  # t_d reads no other
        floor: list[Any] = list(now)
        for i, c in zip(self._phases(d), counts, strict=True):
            values = np.asarray(c).reshape(-1).tolist()  # one per destination
            top = sorted(range(len(values)), key=values.__getitem__, reverse=True)[:3]  # the busiest three
            vals = [float(values[j]) for j in top] + [0.0] * (3 - len(top))
            touched, apart = _touched(num_ranks, len(values))
            bound: Any = vals[1]
            if len(top) >= 2:
                bound = np.where(touched[top[1]], vals[2], vals[1])
            # A and B in one group: the phase's counts stay; else its max is at least the largest
            # count outside their two groups
            floor[i] = np.where(apart & touched[top[0]], bound, vals[0])
            now[i] = vals[0]
        return self._bounds(d, now, floor, num_ranks)

    def _bounds(self, d: int, now: list[Any], floor: list[Any], n: int) -> tuple[float, np.ndarray]:
        """(t_d of the phase maxima ``now``, [n, n] t_d of the phase bounds ``floor``)."""
        t_d = self._t_d[d - 1]
        return float(t_d(*now)), np.broadcast_to(t_d(*floor), (n, n)).astype(np.float64)

    def choose(self, topk_idx: Any, *, placement: Any = None, token_rank: Any = None) -> int:
        """d* (Eq. 6, Alg. 1) from fresh routing: statistics, then the lambdified times."""
        stats = hd_statistics(topk_idx, self.workload.num_experts, self.topology.sizes, placement=placement,
                              token_rank=token_rank)
        return self.optimal_dimension(stats)

    def swap_matrix(self, topk_idx: Any, *, d: int | None = None, kind: Kind = "max", gamma: float = 10.0,
                    placement: Any = None, token_rank: Any = None,
                    method: Literal["incremental", "brute_force"] = "incremental") -> tuple[np.ndarray, int]:
        """(Q_d, d): HierMoE Eq. 8-9, Q_d[r, c] the predicted HD-d seconds after experts r and c swap
        places (the max over destinations replaced by Eq. 11's smooth-max or log-sum-exp when asked).
        d defaults to d* of the unswapped placement, giving Q* (Section IV-A)."""
        qs, d = self.swap_matrices(topk_idx, d=d, kinds=(kind,), gamma=gamma, placement=placement,
                                   token_rank=token_rank, method=method)
        return qs[0], d

    def swap_matrices(self, topk_idx: Any, *, kinds: Sequence[Kind], d: int | None = None, gamma: float = 10.0,
                      placement: Any = None, token_rank: Any = None,
                      method: Literal["incremental", "brute_force"] = "incremental") -> tuple[list[np.ndarray], int]:
        """``swap_matrix`` for several aggregations from one pass over the tokens: e.g. Q* with the
        smooth max to minimize and with the plain max, whose [r, c] / diagonal are the predicted
        t_d (Eq. 3) after / before a swap."""
        num_experts, sizes = self.workload.num_experts, self.topology.sizes
        if d is None:
            d = self.optimal_dimension(hd_statistics(topk_idx, num_experts, sizes, placement=placement,
                                                     token_rank=token_rank))
        swaps = swap_statistics_kinds(topk_idx, num_experts, sizes, kinds=kinds, gamma=gamma, placement=placement,
                                      token_rank=token_rank, method=method, phases=self._phases(d))
        out = [np.broadcast_to(self._t_d[d - 1](*swap.values()), (num_experts, num_experts)).copy()
               for swap in swaps]
        return out, d


@functools.lru_cache(maxsize=32)
def _touched(num_ranks: int, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``num_groups`` groups of consecutive ranks: [j, A, B] rank A or rank B is in group j;
    [A, B] A and B are in different groups."""
    group = np.arange(num_ranks) // (num_ranks // num_groups)
    j = np.arange(num_groups)[:, None, None]
    return (group[None, :, None] == j) | (group[None, None, :] == j), group[:, None] != group[None, :]


def _outside(c: np.ndarray, grp: np.ndarray) -> np.ndarray:
    """[x, a, b]: relay x's largest count c[x, g] over the groups g other than grp[a] and grp[b]
    (0 where none is left), what a swap between a and b leaves as it is (it changes those two
    groups only): the busiest of each relay's three busiest groups that the pair leaves alone."""
    order = np.argsort(-c, axis=1, kind="stable")[:, :3]  # each relay's three busiest groups
    top = np.zeros((c.shape[0], 3))  # their counts, 0 where there are fewer groups
    top[:, : order.shape[1]] = c[np.arange(c.shape[0])[:, None], order]
    mine = order[:, :, None] == grp[None, None, :]  # [x, k, a]: a is in the k-th busiest group
    hit = [mine[:, k, :, None] | mine[:, k, None, :] for k in range(min(2, order.shape[1]))]
    hit += [np.ones_like(hit[0])] * (2 - len(hit))  # fewer than 3 groups: the rest count 0
    return np.where(hit[0], np.where(hit[1], top[:, 2, None, None], top[:, 1, None, None]), top[:, 0, None, None])


def best_swap(q: np.ndarray) -> tuple[int, int, float]:
    """HierMoE Eq. 10: (r*, c*) = argmin Q*[r, c] over pairs r < c, with its value. Compare the value
    with Q*[0, 0] (no swap) before swapping."""
    r, c = _pairs(q.shape[0])
    best = int(np.argmin(q[r, c]))
    return int(r[best]), int(c[best]), float(q[r[best], c[best]])


@functools.lru_cache(maxsize=8)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs r < c of an [n, n] matrix, row by row (made once per n: every decision reads them)."""
    return np.triu_indices(n, k=1)
