"""Which expert swap to make (``moe_compile.swap.swapper`` exchanges the data and moves the experts).

- ``decide_layer``: one layer's decision row from every rank's routing (HierMoE Section IV:
  Q* and Eq. 10, the threshold, the plain-max check and the payback rule), or the SmartMoE-style
  baseline (``smart_matrix``).
- ``migration_matrix`` / ``migration_s``: the predicted time to move experts between two ranks.
- ``repayable`` / ``no_swap_repays``: the payback rule's bound, from the routing ids (on the rank
  deciding a layer) or from the statistics every rank gathered in the forward (before any
  routing is sent).
"""

from __future__ import annotations

import numpy as np

from moe_compile.cost.hiermoe import best_swap
from moe_compile.cost.routing import _exclusion_table, _first_difference, hd_statistics
from moe_compile.ep import runtime
from moe_compile.swap.options import SwapOptions
from moe_compile.swap.transfer import TABLE_COLS

A2A_PER_STEP = 4  # HD all-to-alls of one layer per training step: dispatch and combine, forward and backward

# What a layer's decision came to (EPLayer.swap_decisions): a swap, or why none. A decision row's
# first entry is 1 for a swap, minus the index of the reason for none, 0 where the rank did not decide.
SWAPPED, NO_GAIN, SMOOTH_ONLY, NO_PAYBACK, RECENT = OUTCOMES = (
    "swap", "no swap lowers the prediction (by more than the threshold)",
    "a swap lowers the smooth max only, not the time", "no swap repays its migration within payback steps",
    "the best swap would swap back a pair swapped within hysteresis steps")
# a swap decided in overlap mode and dropped before it started (a swap of that call failed on some
# rank, or the layer's placement changed in between)
DROPPED = "a decided swap dropped: the placement changed or a swap failed before it started"


def no_swap(reason: str) -> list[float]:
    """A decision row that makes no swap, for ``reason`` (one of OUTCOMES)."""
    return [-float(OUTCOMES.index(reason))] + [0.0] * (TABLE_COLS - 1)


def outcome(code: float) -> str | None:
    """The outcome a decision row's first entry stands for (None: not decided)."""
    return None if code == 0 else SWAPPED if code > 0 else OUTCOMES[int(round(-code))]


def count(lay: runtime.EPLayer, what: str) -> None:
    """One more decision of ``lay`` with outcome ``what``."""
    lay.swap_decisions[what] = lay.swap_decisions.get(what, 0) + 1


def decide_layer(lay: runtime.EPLayer, opts: SwapOptions, placement: np.ndarray, topk: np.ndarray,
                 token_rank: np.ndarray, sizes: np.ndarray | None, call: int = 0) -> list[float]:
    """The decision row of one layer from every rank's routing of it ([T, K] ids and each
    token's source), on ``placement``, with every rank's announced ``sizes``, at the swapper's
    ``call``: 1 and the swap, or ``no_swap`` of the reason.  A pair swapped fewer than
    ``opts.hysteresis`` calls before is not a candidate (swapping it back chases one step's
    routing and pays two migrations)."""
    d = lay.last_dimension or lay.dimension or 1
    now = None  # t_d of the placement as is, where the payback check below computed it
    if payback_bounded(lay, opts):
        # skip Q* when not even the best conceivable swap would pass the payback rule below
        now, floors = lay.cost.swap_floor_s(topk, d, placement=placement, token_rank=token_rank)
        if not repayable(now, floors, opts.payback, migration_matrix(lay, sizes)):
            return no_swap(NO_PAYBACK)
    q_max = None  # plain-max Q: [r, c] / diagonal = t_d after / before a swap
    if opts.policy == "hierd":
        assert lay.cost is not None
        kinds = (opts.kind,) if opts.kind == "max" else (opts.kind, "max")
        qs, d = lay.cost.swap_matrices(topk, d=d, kinds=kinds, gamma=opts.gamma,  # type: ignore[arg-type]
                                       placement=placement, token_rank=token_rank)
        q, q_max = qs[0], qs[-1]
    else:
        q = smart_matrix(topk, lay.num_experts, placement, lay.comm.world)
    before = float(q[0, 0])
    recent = recently_swapped(lay, call, opts.hysteresis)
    if recent:
        best_any = best_swap(q)
        q = q.copy()
        for x, y in recent:
            q[x, y] = q[y, x] = np.inf
    a, b, after = best_swap(q)
    if not after < (1.0 - opts.threshold) * before or placement[a] == placement[b]:
        if recent and best_any[2] < (1.0 - opts.threshold) * before and (best_any[0], best_any[1]) in recent:
            return no_swap(RECENT)
        return no_swap(NO_GAIN)
    if q_max is not None:
        pred = [float(q_max[a, a]), float(q_max[a, b])]
    else:
        swapped = placement.copy()
        swapped[[a, b]] = swapped[[b, a]]
        pred = [now if now is not None else predicted(lay, topk, token_rank, placement, d),
                predicted(lay, topk, token_rank, swapped, d)]
    if opts.policy == "hierd" and opts.kind != "max" and pred[1] > pred[0]:
        return no_swap(SMOOTH_ONLY)  # the smooth objective improved but the time it stands for would not
    migration = migration_s(lay, int(placement[a]), int(placement[b]), sizes)
    if opts.payback and not A2A_PER_STEP * (pred[0] - pred[1]) * opts.payback > migration:
        return no_swap(NO_PAYBACK)  # moving the two experts costs more than it would save in `payback` steps
    return [1.0, a, b, d, before, after, *pred, migration]


def recently_swapped(lay: runtime.EPLayer, call: int, hysteresis: int) -> set[tuple[int, int]]:
    """Expert pairs (a < b) of ``lay`` swapped within the last ``hysteresis`` swapper calls."""
    out = set()
    for rec in reversed(lay.swaps):
        if call - rec.step >= hysteresis:
            break
        out.add((min(rec.experts), max(rec.experts)))
    return out


def predicted(lay: runtime.EPLayer, topk: np.ndarray, token_rank: np.ndarray, placement: np.ndarray,
              d: int) -> float:
    """t_d of the routing on ``placement`` (nan without a topology)."""
    if lay.cost is None:
        return float("nan")
    stats = hd_statistics(topk, lay.num_experts, lay.comm.sizes, placement=placement, token_rank=token_rank)
    return float(lay.cost.times_s(stats)[d - 1])


def smart_matrix(topk: np.ndarray, num_experts: int, placement: np.ndarray, world: int) -> np.ndarray:
    """[E, E]: the largest raw token count (one per (token, expert) pair, no dedup) any rank
    receives after swapping experts r and c: SmartMoE-style load balancing. The diagonal is
    the placement as is."""
    load_E = np.bincount(topk.ravel(), minlength=num_experts).astype(np.float64)
    load_G = np.bincount(placement, weights=load_E, minlength=world)
    pa, pb = placement[:, None], placement[None, :]
    others = _exclusion_table(load_G, np.maximum)[pa, pb]  # -inf where no third rank is left
    delta = load_E[None, :] - load_E[:, None]  # [r, c]: what r's rank gains when r and c swap
    q = np.maximum(others, np.maximum(load_G[pa] + delta, load_G[pb] - delta))
    q[pa == pb] = load_G.max()
    return q


def payback_bounded(lay: runtime.EPLayer, opts: SwapOptions) -> bool:
    """Whether the payback rule applies: it is set, rows move with an expert, and the topology
    gives the times."""
    return bool(opts.payback and lay.slot_params and lay.cost is not None)


def no_swap_repays(lay: runtime.EPLayer, opts: SwapOptions, migration: np.ndarray) -> bool:
    """The payback bound on the statistics the layer's last forward gathered from every rank
    (``EPLayer.last_stats``, for ``last_stats_placement``): True where no swap could save, over
    ``payback`` steps, more than moving its experts costs (``migration``: ``migration_matrix``
    of the sizes every rank announced). First per rank pair
    (``HDCostModel.swap_floor_from_statistics``, ~10 us); where some pair passes, per expert
    pair (``HDCostModel.swap_floor_experts``: the experts' tokens move with them), from the
    per-expert counts the forward gathers when ``EPLayer.gather_experts`` is set."""
    assert lay.cost is not None and lay.last_stats is not None
    d = lay.last_dimension or 1
    now, floors = lay.cost.swap_floor_from_statistics(lay.last_stats, d)
    if repayable(now, floors, opts.payback, migration) and lay.last_experts is not None:
        placement = lay.last_stats_placement
        now, floors = lay.cost.swap_floor_experts(lay.last_tables, lay.last_experts, d, placement)
        migration = migration[np.ix_(placement, placement)]
    return not repayable(now, floors, opts.payback, migration)


def migration_s(lay: runtime.EPLayer, pa: int, pb: int, sizes: np.ndarray | None) -> float:
    """Predicted seconds to move experts between mesh positions pa and pb (``migration_matrix``);
    0 where no rows move."""
    if not lay.slot_params or pa == pb:
        return 0.0
    return float(migration_matrix(lay, sizes)[pa, pb])


def migration_matrix(lay: runtime.EPLayer, sizes: np.ndarray | None) -> np.ndarray:
    """[A, B]: predicted seconds to move experts between mesh positions A and B: both ranks send
    their announced ``payload_bytes`` (``sizes``, by global rank) at once over the slowest level
    between them (alpha + bytes * beta of that level); inf where A == B (no swap to pay for), nan
    where a size or the topology is unknown."""
    world = lay.comm.world
    if sizes is None or lay.cost is None:
        return np.full((world, world), np.nan)
    levels = lay.cost.topology.levels
    first = _first_difference(tuple(lay.comm.sizes)).reshape(world, world)  # len(levels) where A == B
    alpha = np.array([lv.alpha_s for lv in levels] + [np.inf])
    beta = np.array([lv.beta_s_per_byte for lv in levels] + [0.0])
    by_pos = np.asarray(sizes, dtype=np.float64)[list(lay.comm.ranks)]
    return alpha[first] + np.maximum(by_pos[:, None], by_pos[None, :]) * beta[first]


def repayable(now: float, floors: np.ndarray, payback: float, migration: np.ndarray) -> bool:
    """Whether some pair could save, over ``payback`` steps, more than moving its experts costs:
    ``floors`` bounds t_d after the pair's swap from below, ``migration`` is its time (nan:
    unknown, taken as not repayable, as the payback check on a chosen swap takes it)."""
    return bool((A2A_PER_STEP * (now - floors) * payback > migration).any())

