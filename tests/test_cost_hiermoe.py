"""HierMoE cost model (cost/hiermoe.py) and its routing statistics (cost/routing.py).

Paper: papers/hiermoe.txt. Statistics are checked against plain Python loops that simulate the
HD-d relays token by token; the incremental swap matrix against recomputing every placement."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest
import sympy as sp
import torch

from moe_compile.cost import hiermoe as hm
from moe_compile.cost import routing
from moe_compile.cost.routing import (
    aggregate,
    dedup_counts,
    duplication_rate,
    hd_statistics,
    swap_statistics,
)
from moe_compile.cost.topology import Level, Topology
from moe_compile.cost.workload import Workload


def uniform_topk(rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int) -> np.ndarray:
    """K distinct experts per token, uniformly at random (the setting of HierMoE Table II)."""
    return np.argpartition(rng.random((num_tokens, num_experts)), top_k, axis=1)[:, :top_k]


def topology(sizes: tuple[int, ...], gbps: tuple[float, ...],
             alpha_s: tuple[float, ...] | None = None) -> Topology:
    alpha_s = alpha_s or (1e-6,) * len(sizes)
    return Topology(levels=tuple(Level(f"l{i}", s, a, 8.0 / (g * 1e9))
                                 for i, (s, g, a) in enumerate(zip(sizes, gbps, alpha_s))))


# brute force: the HD-d relays simulated token by token --------------------------------------------

def coords(rank: int, sizes: tuple[int, ...]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(rank % s)
        rank //= s
    return out[::-1]


def group_of(rank: int, level: int, sizes: tuple[int, ...]) -> int:
    return rank // (math.prod(sizes) // math.prod(sizes[:level]))


def simulate_hd(topk, placement, sizes, token_rank, d):
    """(inter, intra): dicts (relay rank, destination) -> distinct tokens, for the phases of HD-d."""
    held = [(t, int(q)) for t, q in enumerate(token_rank)]  # copies of tokens and where they sit
    inter: dict[int, dict[tuple[int, int], int]] = {}
    for level in range(1, d):
        counts: dict[tuple[int, int], int] = {}
        moved = []
        for t, q in held:
            ranks = {int(placement[e]) for e in topk[t]}
            mine = {r for r in ranks if group_of(r, level - 1, sizes) == group_of(q, level - 1, sizes)}
            for j in sorted({group_of(r, level, sizes) for r in mine}):
                counts[(q, j)] = counts.get((q, j), 0) + 1
                c = coords(q, sizes)
                c[level - 1] = coords(j * (math.prod(sizes) // math.prod(sizes[:level])), sizes)[level - 1]
                moved.append((t, int(np.ravel_multi_index(c, sizes))))
        inter[level] = counts
        held = moved
    intra: dict[tuple[int, int], int] = {}
    for t, q in held:
        for r in {int(placement[e]) for e in topk[t]}:
            if group_of(r, d - 1, sizes) == group_of(q, d - 1, sizes):
                intra[(q, r)] = intra.get((q, r), 0) + 1
    return inter, intra


def brute_dedup_counts(topk, num_experts, sizes, placement=None):
    num_ranks = math.prod(sizes)
    placement = np.arange(num_experts) // (num_experts // num_ranks) if placement is None else placement
    out = []
    for level in range(1, len(sizes) + 1):
        counts = [0] * math.prod(sizes[:level])
        for row in topk:
            for j in {group_of(int(placement[e]), level, sizes) for e in row}:
                counts[j] += 1
        out.append(counts)
    return out


# routing statistics -------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [(2, 2), (2, 3), (2, 2, 2), (8,)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dedup_counts_match_loops(sizes, seed):
    rng = np.random.default_rng(seed)
    num_experts = 2 * math.prod(sizes)
    topk = uniform_topk(rng, 37, num_experts, 3)
    placement = rng.permutation(np.arange(num_experts) % math.prod(sizes))
    for pl in (None, placement):
        got = dedup_counts(topk, num_experts, sizes, placement=pl)
        assert [c.tolist() for c in got] == brute_dedup_counts(topk, num_experts, sizes, pl)


@pytest.mark.parametrize("topk, num_experts", [
    (np.zeros((50, 1), dtype=np.int64), 8),  # every token to expert 0
    (np.tile([5, 1, 3], (20, 1)), 8),  # every token to the same 3 experts
    (np.tile(np.arange(8), (6, 1)), 8),  # K = E
    (np.array([[7, 0, 4]]), 8),  # T = 1
    (np.zeros((0, 2), dtype=np.int64), 8),  # T = 0
])
def test_dedup_counts_degenerate(topk, num_experts):
    got = dedup_counts(topk, num_experts, (2, 2))
    assert [c.tolist() for c in got] == brute_dedup_counts(topk, num_experts, (2, 2))


def test_dedup_counts_torch_in_torch_out():
    topk = torch.tensor([[0, 1], [2, 7], [6, 7]])
    got = dedup_counts(topk, 8, (2, 4))
    assert all(isinstance(c, torch.Tensor) for c in got)
    assert [c.tolist() for c in got] == [[2, 2], [1, 1, 1, 0, 0, 0, 1, 2]]


@pytest.mark.parametrize("sizes, d", [((2, 2), 1), ((2, 2), 2), ((2, 3), 2), ((2, 2, 2), 2), ((2, 2, 2), 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_hd_statistics_match_simulated_relays(sizes, d, seed):
    """p_inter / p_intra are, per destination, the busiest relay's distinct tokens in HD-d."""
    rng = np.random.default_rng(seed)
    num_ranks = math.prod(sizes)
    num_experts = 2 * num_ranks
    topk = uniform_topk(rng, 60, num_experts, 3)
    token_rank = rng.integers(0, num_ranks, 60)
    placement = rng.permutation(np.arange(num_experts) % num_ranks)
    stats = hd_statistics(topk, num_experts, sizes, placement=placement, token_rank=token_rank)
    inter, intra = simulate_hd(topk, placement, sizes, token_rank, d)
    for level in range(1, d):
        want = np.zeros(math.prod(sizes[:level]), dtype=int)
        for (_, j), n in inter[level].items():
            want[j] = max(want[j], n)
        assert stats.p_inter[level - 1].tolist() == want.tolist()
    want = np.zeros(num_ranks, dtype=int)
    for (_, r), n in intra.items():
        want[r] = max(want[r], n)
    assert stats.p_intra[d - 1].tolist() == want.tolist()


def test_representative_rank_equals_every_rank_routing_alike():
    """Without token_rank the tokens stand for every rank's: same as G copies, one per rank."""
    rng = np.random.default_rng(3)
    sizes, num_experts = (2, 2, 2), 16
    topk = uniform_topk(rng, 25, num_experts, 4)
    alone = hd_statistics(topk, num_experts, sizes, copies=True)
    every = hd_statistics(np.tile(topk, (8, 1)), num_experts, sizes, token_rank=np.repeat(np.arange(8), 25),
                          copies=True)
    assert alone.values() == every.values() and alone.copy_values() == every.copy_values()


# HierMoE Table II: duplication rate [%] by number of groups R (rows) and top-K (columns)
TABLE_II = {32: (2, 4, 7, 9), 16: (3, 9, 14, 18), 8: (6, 17, 27, 34), 4: (12, 32, 46, 55)}


def test_duplication_rate_reproduces_table_ii():
    """E is not stated in the paper; E = 256 (DeepSeek-V3, the paper's model) reproduces it."""
    rng = np.random.default_rng(0)
    rows = []
    for k_col, top_k in enumerate((2, 4, 6, 8)):
        topk = uniform_topk(rng, 20000, 256, top_k)
        for groups, row in TABLE_II.items():
            ours = 100 * duplication_rate(topk, 256, groups)
            rows.append((groups, top_k, row[k_col], ours))
            assert abs(ours - row[k_col]) < 1.5, (groups, top_k, ours)
    print("\nTable II  R  K  paper%  ours%")
    for groups, top_k, paper, ours in sorted(rows, key=lambda r: (-r[0], r[1])):
        print(f"        {groups:3d} {top_k:2d} {paper:6d} {ours:6.1f}")


def test_duplication_rate_definition():
    topk = np.array([[0, 1], [0, 4]])  # token 0: both experts on group 0; token 1: two groups
    assert duplication_rate(topk, 8, 2) == pytest.approx(1 - 3 / 4)
    assert duplication_rate(topk, 8, 8) == 0.0


# the sympy model ----------------------------------------------------------------------------------

def test_t_d_reduces_to_t_1():
    assert sp.simplify(hm.t_d_expr(1) - hm.t_flat_expr()) == 0
    assert sp.simplify(hm.t_hier_nodedup_expr(1) - hm.t_flat_nodedup_expr()) == 0


def test_t_2_is_the_papers_expression():
    """Eq. 3-5 written out for d = 2: Inter-level-1 over U[1] groups, then Intra-level-1."""
    mv = hm.M_hidden * hm.v_bytes_per_element
    u1 = sp.Symbol("U_1_groups", positive=True, integer=True)
    g = hm.G_ranks
    by_hand = (hm.alpha_inter_s(1) + u1 * hm.p_inter_max_tokens(1) * mv * hm.beta_inter_s_per_byte(1)
               + hm.alpha_intra_s(1) + g / u1 * hm.p_intra_max_tokens(1) * mv * hm.beta_intra_s_per_byte(1))
    assert sp.simplify(hm.t_d_expr(2).subs(hm.m_slot_bytes, 0) - by_hand) == 0  # the paper ignores metadata
    # with the routing slots counted, every deduplicated row is K * m bytes longer
    rows = u1 * hm.p_inter_max_tokens(1) * hm.beta_inter_s_per_byte(1) + g / u1 * hm.p_intra_max_tokens(1) * \
        hm.beta_intra_s_per_byte(1)
    assert sp.simplify(hm.t_d_expr(2) - by_hand - rows * hm.K_top * hm.m_slot_bytes) == 0


def test_slot_metadata_makes_one_copy_per_expert_win_at_tiny_rows():
    """A deduplicated row carries all K routing slots, a per-expert copy one: with rows of a few
    bytes the flat all-to-all sends less, with real hidden sizes dedup does."""
    topo = topology((2, 2), (100.0, 100.0), (2e-5, 2e-5))
    # experts 2r, 2r+1 on rank r: half the tokens have both their experts on one rank, so every
    # destination receives 24 deduplicated rows against 32 copies
    idx = np.array([[0, 1], [2, 3], [4, 5], [6, 7]] * 8 + [[0, 2], [4, 6], [1, 5], [3, 7]] * 8)
    for hidden, dedup_wins in ((4, False), (64, True)):
        work = Workload(num_tokens=64, hidden_size=hidden, ffn_size=8, num_experts=8, top_k=2, dtype_bytes=2,
                        slot_bytes=8)  # 24 (2 H + 16) against 32 (2 H + 8) bytes: dedup wins above H = 8
        model = hm.HDCostModel(topo, work)
        stats = hd_statistics(idx, 8, topo.sizes, copies=True)
        hd1, flat = model.times_s(stats)[0], model.nodedup_times_s(stats)[0]
        assert (hd1 < flat) == dedup_wins, (hidden, hd1, flat)
        paper = hm.HDCostModel(topo, replace(work, slot_bytes=0))  # without metadata dedup always wins here
        assert paper.times_s(stats)[0] < paper.nodedup_times_s(stats)[0]


def test_t_d_structure_and_monotonicity():
    for d in (1, 2, 3, 4):
        t = hm.t_d_expr(d)
        # HD-(d+1) splits HD-d's last phase (Intra-level-(d-1)) into Inter-level-d and Intra-level-d
        split = (hm.alpha_inter_s(d) + hm.n_inter_bytes(d) * hm.beta_inter_s_per_byte(d)
                 + hm.alpha_intra_s(d) + hm.n_intra_bytes(d) * hm.beta_intra_s_per_byte(d)
                 - hm.alpha_intra_s(d - 1) - hm.n_intra_bytes(d - 1) * hm.beta_intra_s_per_byte(d - 1))
        assert sp.simplify(hm.t_d_expr(d + 1) - t - split) == 0
        # more tokens to the busiest destination, or a slower link, never makes it faster
        for sym in [*hm.stat_symbols(d)[: d - 1], hm.p_intra_max_tokens(d - 1), hm.alpha_intra_s(d - 1)]:
            assert sp.diff(t, sym).is_positive, (d, sym)
        for sym in [hm.M_hidden, hm.v_bytes_per_element, hm.beta_intra_s_per_byte(d - 1),
                    *[hm.beta_inter_s_per_byte(i) for i in range(1, d)]]:
            assert sp.diff(t, sym).is_nonnegative, (d, sym)
        # copies in place of distinct tokens give the no-dedup baseline, term by term (rows whose
        # routing slots are not counted; counted, a copy carries 1 slot where a token carries K)
        to_p = dict(zip(hm.copy_symbols(d), hm.stat_symbols(d)))
        no_meta = {hm.m_slot_bytes: 0}
        assert sp.simplify(hm.t_hier_nodedup_expr(d).subs(to_p).subs(no_meta) - t.subs(no_meta)) == 0
        assert sp.simplify(hm.t_hier_nodedup_expr(d).subs(to_p) - t.subs(hm.K_top, 1)) == 0


def hand_case():
    """E = 8 experts on 2 nodes x 4 GPUs; token 0 -> experts 0, 1, 4; token 1 -> 5, 6, 7."""
    topo = topology((2, 4), (8.0, 80.0), (10e-6, 1e-6))  # beta 1e-9 and 1e-10 s/byte
    work = Workload(num_tokens=2, hidden_size=1024, ffn_size=64, num_experts=8, top_k=3, dtype_bytes=2)
    stats = hd_statistics(np.array([[0, 1, 4], [5, 6, 7]]), 8, topo.sizes, copies=True)
    return topo, work, stats


def test_numbers_by_hand():
    topo, work, stats = hand_case()
    # per node: token 0 reaches both nodes, token 1 node 1 -> [1, 2]; per rank: [1,1,0,0,1,1,1,1];
    # Intra-level-1 relays carry both nodes' tokens (every rank routes alike): x U[1] = 2
    assert stats.values() == [2, 1, 2]
    # copies: node 0 gets 2 (token 0 -> experts 0, 1), node 1 gets 1 + 3 = 4
    assert stats.copy_values() == [4, 1, 2]
    mv = 1024 * 2
    # Topology betas are per byte leaving a rank; HierMoE's are per byte of the A2A buffer:
    # beta_link * (s - 1) / s with s the size of the phase's slowest level (2 nodes, 4 GPUs)
    t1 = 10e-6 + 8 * 1 * mv * 1e-9 / 2
    t2 = 10e-6 + 2 * 2 * mv * 1e-9 / 2 + 1e-6 + (8 / 2) * 2 * mv * 1e-10 * 3 / 4
    h2 = 10e-6 + 2 * 4 * mv * 1e-9 / 2 + 1e-6 + (8 / 2) * 2 * mv * 1e-10 * 3 / 4
    assert hm.t_flat_s(topo, work, stats) == pytest.approx(t1, rel=1e-12)
    assert hm.t_d_s(2, topo, work, stats) == pytest.approx(t2, rel=1e-12)
    assert hm.t_flat_nodedup_s(topo, work, stats) == pytest.approx(t1, rel=1e-12)
    assert hm.t_hier_nodedup_s(2, topo, work, stats) == pytest.approx(h2, rel=1e-12)
    model = hm.HDCostModel(topo, work)
    np.testing.assert_allclose(model.times_s(stats), [t1, t2], rtol=1e-12)
    np.testing.assert_allclose(model.nodedup_times_s(stats), [t1, h2], rtol=1e-12)
    assert hm.optimal_dimension(topo, work, stats) == model.optimal_dimension(stats) == 2


def test_dimension_rule_is_eq_6():
    assert hm.dimension_rule([1.0, 2.0, 3.0]) == 1
    assert hm.dimension_rule([3.0, 2.0, 1.0]) == 3
    assert hm.dimension_rule([2.0, 2.0, 3.0]) == 2  # t_1 must be strictly smaller to win
    assert hm.dimension_rule([5.0]) == 1


def test_slow_inter_node_link_favours_dedup_when_duplication_is_high():
    """4 nodes x 8 GPUs, 5 GB/s between nodes, 300 GB/s inside: with K = 8 uniform routing (55%
    duplication at node level, Table II) HD2 wins; with K = 1 perfectly balanced routing nothing
    dedups and the extra phase only costs."""
    topo = topology((4, 8), (40.0, 2400.0))
    high = uniform_topk(np.random.default_rng(0), 4096, 256, 8)
    assert hm.HDCostModel(topo, Workload(4096, 2048, 512, 256, 8)).choose(high) == 2
    none = (np.arange(4096) % 256)[:, None]
    assert hm.HDCostModel(topo, Workload(4096, 2048, 512, 256, 1)).choose(none) == 1


def test_uniform_links_never_pay_for_hierarchy():
    topo = topology((4, 8), (400.0, 400.0))
    work = Workload(4096, 2048, 512, 256, 8)
    assert hm.HDCostModel(topo, work).choose(uniform_topk(np.random.default_rng(0), 4096, 256, 8)) == 1


def test_three_levels_pick_the_deepest_when_two_links_are_slow():
    topo = topology((2, 2, 8), (20.0, 40.0, 2400.0))
    work = Workload(4096, 2048, 512, 256, 8)
    model = hm.HDCostModel(topo, work)
    topk = uniform_topk(np.random.default_rng(1), 4096, 256, 8)
    stats = hd_statistics(topk, 256, topo.sizes)
    times = model.times_s(stats)
    assert model.choose(topk) == 3 == int(np.argmin(times)) + 1
    assert hm.optimal_dimension(topo, work, stats) == 3


@pytest.mark.parametrize("sizes", [(4, 8), (4, 2, 4)])
def test_runtime_path_timing(sizes):
    """Choosing d* from fresh routing (statistics included), E = 256, K = 8, T = 8192. The bound
    is generous so CI never flakes; the figure printed is the one to read (bench/ measures it)."""
    topo = topology(sizes, (200.0,) + (2400.0,) * (len(sizes) - 1))
    work = Workload(8192, 7168, 2048, 256, 8)
    model = hm.HDCostModel(topo, work)
    topk = torch.from_numpy(uniform_topk(np.random.default_rng(0), 8192, 256, 8))
    model.choose(topk)
    best = math.inf
    for _ in range(30):
        start = time.perf_counter()
        model.choose(topk)
        best = min(best, time.perf_counter() - start)
    print(f"\nd* from fresh routing, mesh {sizes}, E=256 K=8 T=8192: {best * 1e3:.3f} ms (best of 30)")
    assert best < 0.050


# expert swap --------------------------------------------------------------------------------------

def test_aggregates():
    x = np.array([3.0, 1.0, 2.0])
    assert aggregate(x) == 3.0
    assert aggregate(x, "smooth", 10.0) == pytest.approx(3.0 * sum((v / 3.0) ** 10 for v in x) ** 0.1)
    assert 3.0 < aggregate(x, "smooth", 10.0) < aggregate(x, "smooth", 2.0)
    assert aggregate(x, "smooth", 200.0) == pytest.approx(3.0, rel=1e-3)
    assert aggregate(x, "lse") == pytest.approx(math.log(sum(math.exp(v) for v in x)))
    assert aggregate(np.zeros(4), "smooth") == 0.0
    assert aggregate(np.array([800.0, 0.0]), "lse") == pytest.approx(800.0)  # no overflow


def test_swap_counts_match_the_papers_fig_7():
    """Fig. 7: 4 experts in 2 groups; Z[1,3] = Z[2,4] = [4, 4], Z[2,3] = [3, 2], Z[1,4] = [2, 3]
    (1-based). The figure's routing is not in the text; this one is consistent with those values."""
    topk = np.array([[0, 2], [0, 2], [1, 3], [0, 1]])
    for (a, b), z in {(0, 2): [4, 4], (1, 3): [4, 4], (1, 2): [3, 2], (0, 3): [2, 3]}.items():
        placement = np.array([0, 0, 1, 1])
        placement[[a, b]] = placement[[b, a]]
        assert dedup_counts(topk, 4, (2,), placement=placement)[0].tolist() == z
    q = swap_statistics(topk, 4, (2,)).p_intra[0]  # max over the two groups after each swap
    assert (q[0, 2], q[1, 3], q[1, 2], q[0, 3], q[0, 0]) == (4, 4, 3, 3, 4)


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3), (2, 2, 2), (4,)])
@pytest.mark.parametrize("kind", ["max", "smooth", "lse"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("repeats", [False, True])
@pytest.mark.parametrize("dense", [True, False])
def test_incremental_swap_matrix_equals_brute_force(sizes, kind, seed, repeats, dense, monkeypatch):
    """Also with routings that name an expert twice for a token (it receives the token once), and
    with every rank as many tokens (the counts' batched path) or not (one product per relay), and
    Fig. 8's counts from products of the selection matrices (dense) or from bincounts."""
    monkeypatch.setattr(routing, "DENSE_COUNTS_RATIO", 10**9 if dense else 0)
    rng = np.random.default_rng(seed)
    num_ranks = math.prod(sizes)
    num_experts = 2 * num_ranks if num_ranks < 8 else num_ranks
    num_tokens = 24  # divisible by every num_ranks here
    topk = uniform_topk(rng, num_tokens, num_experts, 3)
    if repeats:
        topk[::3, 2] = topk[::3, 0]
    topo = topology(sizes, tuple(10.0 * 4 ** i for i in range(len(sizes))))
    model = hm.HDCostModel(topo, Workload(num_tokens, 64, 32, num_experts, 3))
    for token_rank, placement in ((None, None),
                                  (rng.integers(0, num_ranks, num_tokens),
                                   rng.permutation(np.arange(num_experts) % num_ranks)),
                                  (np.arange(num_tokens) % num_ranks,
                                   rng.permutation(np.arange(num_experts) % num_ranks))):
        for d in range(1, len(sizes) + 1):
            fast, _ = model.swap_matrix(topk, d=d, kind=kind, placement=placement, token_rank=token_rank)
            slow, _ = model.swap_matrix(topk, d=d, kind=kind, placement=placement, token_rank=token_rank,
                                        method="brute_force")
            np.testing.assert_allclose(fast, slow, rtol=1e-10, atol=0)
            # several aggregations from one pass: each the brute force of its own kind
            both, _ = model.swap_matrices(topk, d=d, kinds=(kind, "max"), placement=placement,
                                          token_rank=token_rank)
            slow_max, _ = model.swap_matrix(topk, d=d, kind="max", placement=placement, token_rank=token_rank,
                                            method="brute_force")
            np.testing.assert_allclose(both[0], slow, rtol=1e-10, atol=0)
            np.testing.assert_allclose(both[1], slow_max, rtol=1e-10, atol=0)


def times_after_swaps(model, topk, placement, token_rank, d):
    """(a, b, t_d after swapping experts a < b), recomputed from scratch for every pair."""
    num_experts, sizes = model.workload.num_experts, model.topology.sizes
    for a in range(num_experts):
        for b in range(a + 1, num_experts):
            swapped = placement.copy()
            swapped[[a, b]] = swapped[[b, a]]
            yield a, b, model.times_s(hd_statistics(topk, num_experts, sizes, placement=swapped,
                                                    token_rank=token_rank))[d - 1]


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3), (2, 2, 2), (4,)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_floor_bounds_every_swap_from_below(sizes, seed):
    """swap_floor_s: its first value is t_d of the placement as is, its second, [A, B], no more than
    t_d after any one swap of experts on ranks A and B (recomputed on every swapped placement), on
    uniform and skewed routings (a few hot experts); with two busy ranks, a swap between them is
    bounded by the time with nothing sent (the others' count), and one of a busy rank with an idle
    one by t_d now (the other busy rank keeps its count); a swap inside a node leaves the
    inter-node phase's counts as they are."""
    rng = np.random.default_rng(seed)
    num_ranks = math.prod(sizes)
    num_experts = 2 * num_ranks
    num_tokens = 12 * num_ranks
    topo = topology(sizes, tuple(10.0 * 4 ** i for i in range(len(sizes))))
    model = hm.HDCostModel(topo, Workload(num_tokens, 64, 32, num_experts, 3))
    uniform = uniform_topk(rng, num_tokens, num_experts, 3)
    hot = np.where(rng.random((num_tokens, 3)) < 0.7, rng.integers(0, 3, (num_tokens, 3)), uniform)
    for topk in (uniform, hot):
        token_rank = rng.integers(0, num_ranks, num_tokens)
        placement = rng.permutation(np.arange(num_experts) % num_ranks)
        for d in range(1, len(sizes) + 1):
            stats = hd_statistics(topk, num_experts, sizes, placement=placement, token_rank=token_rank)
            now, floors = model.swap_floor_s(topk, d, placement=placement, token_rank=token_rank)
            assert now == model.times_s(stats)[d - 1]
            again = model.swap_floor_from_statistics(stats, d)
            assert again[0] == now and np.array_equal(again[1], floors)
            # the phases one t_d reads, read alone: hd_statistics' arrays (also with the T tokens
            # standing in for every source)
            for sources in (token_rank, None):
                want = hd_statistics(topk, num_experts, sizes, placement=placement, token_rank=sources)
                got = routing.phase_statistics(topk, num_experts, sizes, range(2 * len(sizes) - 1),
                                           placement=placement, token_rank=sources)
                for i, c in enumerate(got):
                    np.testing.assert_array_equal(c, (*want.p_inter, *want.p_intra)[i])
            for a, b, after in times_after_swaps(model, topk, placement, token_rank, d):
                pa, pb = placement[a], placement[b]
                assert floors[pa, pb] == floors[pb, pa] <= after * (1 + 1e-12), (d, a, b, floors[pa, pb], after)
    # two busy ranks of four (every token to experts 0 and 2, on ranks 0 and 1): a swap between
    # them could at best leave the others' count (nothing); one with rank 2 leaves rank 0 or 1 busy
    topk = np.tile([[0, 2]], (8, 1))
    model = hm.HDCostModel(topology((4,), (10.0,)), Workload(8, 64, 32, 8, 2))
    now, floors = model.swap_floor_s(topk, 1)
    assert floors[0, 1] == model.times_s(hd_statistics(np.zeros((0, 2), dtype=np.int64), 8, (4,)))[0] < now
    assert floors[0, 2] == floors[1, 3] == now
    # every token to experts 0 and 1, both on rank 0 of a 2 x 2 mesh: at d = 2 a swap inside node 0
    # (ranks 0 and 1) leaves the inter-node phase as it is, one across the nodes could empty it
    model = hm.HDCostModel(topology((2, 2), (1.0, 10.0)), Workload(8, 64, 32, 8, 2))
    topk = np.tile([[0, 1]], (8, 1))
    now, floors = model.swap_floor_s(topk, 2)
    inter = float(hd_statistics(topk, 8, (2, 2)).p_inter[0].max())
    assert floors[0, 1] == model.times_from_values([inter, 0.0, 0.0])[1] > floors[0, 2]
    assert floors[0, 2] == model.times_from_values([0.0, 0.0, 0.0])[1]

@pytest.mark.parametrize("sizes", [(2, 2), (2, 3), (2, 2, 2), (3, 2, 2), (4,)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gathered_statistics_equal_the_statistics_of_all_tokens(sizes, seed):
    """gathered_statistics of every rank's source_table (what the runtime gathers in each forward)
    equals hd_statistics of all ranks' tokens with each token's source, copies included, for
    uneven token counts per rank (one rank with none), repeated experts in a token's top-k and
    a shuffled placement; a table of the wrong shape is refused."""
    rng = np.random.default_rng(seed)
    num_ranks = math.prod(sizes)
    num_experts = 2 * num_ranks
    per_rank = rng.integers(0, 30, num_ranks)
    per_rank[1] = 0
    token_rank = np.repeat(np.arange(num_ranks), per_rank)
    topk = uniform_topk(rng, token_rank.size, num_experts, 3)
    topk[::4, 1] = topk[::4, 0]
    placement = rng.permutation(np.arange(num_experts) % num_ranks)
    want = hd_statistics(topk, num_experts, sizes, placement=placement, token_rank=token_rank, copies=True)
    tables = np.stack([routing.source_table(topk[token_rank == q], num_experts, sizes, placement=placement)
                       for q in range(num_ranks)])
    got = routing.gathered_statistics(tables, sizes, copies=True)
    for name in ("p_inter", "p_intra", "c_inter", "c_intra"):
        assert len(getattr(got, name)) == len(getattr(want, name))
        for a, b in zip(getattr(got, name), getattr(want, name), strict=True):
            np.testing.assert_array_equal(a, b)
    # one rank's tokens standing in for every source (the old per-rank statistics) is another thing
    if len(sizes) > 1:
        mine = hd_statistics(topk[token_rank == 0], num_experts, sizes, placement=placement)
        assert any(not np.array_equal(a, b) for a, b in zip((*mine.p_inter, *mine.p_intra),
                                                              (*got.p_inter, *got.p_intra), strict=True))
    with pytest.raises(ValueError, match="source_table"):
        routing.gathered_statistics(tables[1:], sizes)


def test_expert_table_counts_tokens_per_expert_and_alone_in_its_group():
    """routing.expert_table against its definition token by token: [0, e] tokens naming e, [l, e]
    those naming e and no other expert of e's level-l group (a repeated id is one expert)."""
    rng = np.random.default_rng(0)
    sizes, num_experts = (2, 3), 12
    topk = uniform_topk(rng, 40, num_experts, 3)
    topk[::5, 2] = topk[::5, 0]
    placement = rng.permutation(np.arange(num_experts) % 6)
    want = np.zeros((3, num_experts), dtype=np.int64)
    for row in topk:
        for e in set(row.tolist()):
            want[0, e] += 1
            for level, per_group in ((1, 3), (2, 1)):  # ranks per level-l group
                group = {o for o in set(row.tolist()) if placement[o] // per_group == placement[e] // per_group}
                want[level, e] += group == {e}
    np.testing.assert_array_equal(routing.expert_table(topk, num_experts, sizes, placement=placement), want)


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3), (2, 2, 2), (4,)])
def test_swap_floor_experts_bounds_every_swap_and_tightens_the_rank_pair_bound(sizes):
    """swap_floor_experts from every rank's source_table and expert_table: [a, b] no more than t_d
    after swapping experts a and b (recomputed), never below swap_floor_s's bound for their ranks,
    and above it for some pairs (the swapped experts' tokens move with them)."""
    rng = np.random.default_rng(1)
    num_ranks = math.prod(sizes)
    num_experts = 2 * num_ranks
    topo = topology(sizes, tuple(10.0 * 4 ** i for i in range(len(sizes))))
    model = hm.HDCostModel(topo, Workload(64, 64, 32, num_experts, 3))
    tighter = 0
    for _ in range(2):
        token_rank = np.repeat(np.arange(num_ranks), rng.integers(0, 16, num_ranks))
        uniform = uniform_topk(rng, token_rank.size, num_experts, 3)
        hot = np.where(rng.random(uniform.shape) < 0.6, rng.integers(0, 3, uniform.shape), uniform)
        for topk in (uniform, hot):
            placement = rng.permutation(np.arange(num_experts) % num_ranks)
            tables = np.stack([routing.source_table(topk[token_rank == q], num_experts, sizes, placement=placement)
                               for q in range(num_ranks)])
            experts = np.stack([routing.expert_table(topk[token_rank == q], num_experts, sizes, placement=placement)
                                for q in range(num_ranks)])
            for d in range(1, len(sizes) + 1):
                now, floors = model.swap_floor_experts(tables, experts, d, placement)
                ref_now, by_rank = model.swap_floor_s(topk, d, placement=placement, token_rank=token_rank)
                assert now == pytest.approx(ref_now, rel=1e-12)
                for a, b, after in times_after_swaps(model, topk, placement, token_rank, d):
                    assert floors[a, b] == floors[b, a] <= after * (1 + 1e-12), (d, a, b, floors[a, b], after)
                    pa, pb = placement[a], placement[b]
                    if pa != pb:
                        assert floors[a, b] >= by_rank[pa, pb] * (1 - 1e-12)
                        tighter += floors[a, b] > by_rank[pa, pb] * (1 + 1e-12)
    assert tighter, "the expert bound was never tighter than the rank-pair one"


def test_best_swap_is_the_argmin_and_helps_a_skewed_placement():
    """Experts 0 and 1 share rank 0 and each is picked by half the tokens (never both), so rank 0
    receives every token; the best swap moves one of them away, and its predicted time equals the
    model evaluated on the swapped placement."""
    rng = np.random.default_rng(0)
    sizes, num_experts, num_tokens = (2, 2), 8, 200
    topk = np.stack([np.arange(num_tokens) % 2, rng.integers(2, num_experts, num_tokens)], axis=1)
    topo = topology(sizes, (10.0, 100.0))
    work = Workload(num_tokens, 256, 64, num_experts, 2)
    model = hm.HDCostModel(topo, work)
    q, d = model.swap_matrix(topk)
    r, c, value = hm.best_swap(q)
    assert value == q[np.triu_indices(num_experts, 1)].min() and value < q[0, 0]
    assert {r, c} & {0, 1} and not {r, c} <= {0, 1}
    placement = np.arange(num_experts) // 2
    placement[[r, c]] = placement[[c, r]]
    swapped = hd_statistics(topk, num_experts, sizes, placement=placement)
    assert hm.t_d_s(d, topo, work, swapped) == pytest.approx(value, rel=1e-12)


def test_user_errors_say_what_to_change():
    with pytest.raises(ValueError, match="split evenly"):
        dedup_counts(np.zeros((2, 1), dtype=np.int64), 6, (2, 2))
    with pytest.raises(ValueError, match="outside"):
        dedup_counts(np.array([[-1]]), 8, (2, 2))
    with pytest.raises(ValueError, match="outside"):
        dedup_counts(np.array([[8]]), 8, (2, 2))
    with pytest.raises(ValueError, match="placement"):
        dedup_counts(np.array([[1]]), 8, (2, 2), placement=np.arange(8))
    with pytest.raises(ValueError, match="kind"):
        aggregate(np.ones(3), "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="copies=True"):
        hd_statistics(np.array([[1]]), 8, (2, 2)).copy_values()


def test_every_phase_symbol_is_named():
    names = {str(s) for s in hm.t_d_expr(3).free_symbols}
    assert names == {"K_top", "m_slot_bytes", "alpha_inter1_s", "alpha_inter2_s", "beta_inter1_s_per_byte", "beta_inter2_s_per_byte",
                     "alpha_intra2_s", "beta_intra2_s_per_byte", "U_1_groups", "U_2_groups", "G_ranks",
                     "M_hidden", "v_bytes_per_element", "p_inter1_max_tokens", "p_inter2_max_tokens",
                     "p_intra2_max_tokens"}
    assert hm.stat_symbols(2) == [hm.p_inter_max_tokens(1), hm.p_intra_max_tokens(0), hm.p_intra_max_tokens(1)]
