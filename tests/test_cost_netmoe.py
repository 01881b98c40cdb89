"""NetMoE's sample-placement cost model (cost/netmoe.py): the traffic of a placement against a direct
count, the two-stage balanced assignment against brute force, and the decision on sample-affine vs
uniform routing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moe_compile.cost.netmoe import (
    Placement,
    level_bytes,
    place_samples,
    traffic_from_counts,
    traffic_from_routing,
)
from moe_compile.cost.topology import Level, Topology


def topo(nodes: int = 2, per_node: int = 2, inter_gbps: float = 0.4, intra_gbps: float = 8.0) -> Topology:
    return Topology(levels=(Level("node", nodes, 2e-5, 8 / (inter_gbps * 1e9)),
                            Level("local", per_node, 5e-6, 8 / (intra_gbps * 1e9))), name="test")


def direct_bytes(rank_S: np.ndarray, counts_SE: np.ndarray, expert_rank_E: np.ndarray, per_node: int
                 ) -> tuple[float, float]:
    """Total inter- and intra-node tokens, counted token copy by token copy."""
    inter = intra = 0.0
    for s, r in enumerate(rank_S):
        for e, c in enumerate(counts_SE[s]):
            dst = expert_rank_E[e]
            if dst // per_node != r // per_node:
                inter += c
            elif dst != r:
                intra += c
    return inter, intra


def test_traffic_matches_a_direct_count() -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=(8, 8))
    expert_rank = np.repeat(np.arange(4), 2)  # 8 experts, 2 per rank, 2 nodes x 2 ranks
    traffic = traffic_from_counts(counts, expert_rank, 4, 2)
    inter_SN, intra_SR = traffic.inter_SN(), traffic.intra_SR(2)
    for rank_S in (np.repeat(np.arange(4), 2), rng.permutation(np.repeat(np.arange(4), 2))):
        b = level_bytes(rank_S, inter_SN, intra_SR, 2, token_bytes=1.0)
        assert (b.inter_total, b.intra_total) == direct_bytes(rank_S, counts, expert_rank, 2)


def test_stage_one_is_the_best_balanced_node_assignment() -> None:
    """With moving free and intra-node traffic ignored, stage 1's inter-node total equals the
    minimum over every balanced assignment of samples to nodes (brute force)."""
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 6, size=(6, 6))
    expert_rank = np.array([0, 1, 2, 3, 4, 5])  # 3 nodes x 2 ranks, one expert each
    t = topo(nodes=3, per_node=2, intra_gbps=1e9)  # intra links (nearly) free
    rank_S = np.array([0, 1, 2, 3, 4, 5])
    traffic = traffic_from_counts(counts, expert_rank, 6, 2)
    p = place_samples(traffic, rank_S, t, token_bytes=1.0, sample_bytes=0.0)
    inter_SN = traffic.inter_SN()
    best = min(sum(inter_SN[s, n] for s, n in enumerate(assign))
               for assign in itertools.product(range(3), repeat=6) if np.bincount(assign, minlength=3).max() == 2)
    assert p.after.inter_total == pytest.approx(best)
    assert np.bincount(p.rank_of_sample, minlength=6).tolist() == [1] * 6  # S / R samples on every rank


def test_sample_affine_routing_moves_samples_to_their_experts() -> None:
    """Each sample sends all its tokens to the experts of one node, and half the samples live on
    the other node: placement brings every sample home, inter-node bytes drop to zero, it pays."""
    per_sample_tokens = 64  # 32 tokens a sample, top-2
    expert_rank = np.repeat(np.arange(4), 2)  # 8 experts on 2 nodes x 2 ranks
    counts = np.zeros((8, 8))
    home = np.array([0, 1, 2, 3, 0, 1, 2, 3])  # each sample's experts sit on this rank
    for s, r in enumerate(home):
        counts[s, 2 * r] = counts[s, 2 * r + 1] = per_sample_tokens // 2
    rank_S = np.array([2, 3, 0, 1, 0, 1, 2, 3])  # samples 0-3 live on the wrong node
    traffic = traffic_from_counts(counts, expert_rank, 4, 2)
    p = place_samples(traffic, rank_S, topo(), token_bytes=4096.0, sample_bytes=32 * 4096.0)
    assert p.before.inter_total == 4 * per_sample_tokens * 4096.0
    assert p.after.inter_total == 0.0 and p.after.intra_total == 0.0
    assert list(p.rank_of_sample) == list(home)
    assert p.moved == 4 and p.time_after_s < p.time_before_s and p.pays


def test_a_move_pays_the_start_ups_of_the_all_to_alls_it_adds() -> None:
    """A move costs its bytes and the start-ups of the all-to-alls it adds: its own, one message to
    every other rank ((R - per_node) inter-node and per_node - 1 intra-node alphas), and, where the
    layer's combine delivers to the new ranks, the redirect's world all-to-all in place of the
    combine's inter-node hop. A placement that saves less than those start-ups declines."""
    expert_rank = np.repeat(np.arange(4), 2)
    counts = np.zeros((8, 8))
    home = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    for s, r in enumerate(home):
        counts[s, 2 * r] = counts[s, 2 * r + 1] = 1  # one token a sample: little to save
    rank_S = np.array([2, 3, 0, 1, 0, 1, 2, 3])
    traffic = traffic_from_counts(counts, expert_rank, 4, 2)
    free = Topology(levels=(Level("node", 2, 0.0, 8 / 0.4e9), Level("local", 2, 0.0, 8 / 8e9)))
    plain = place_samples(traffic, rank_S, free, token_bytes=4096.0, sample_bytes=4096.0)
    assert plain.moved == 4 and plain.pays  # without start-ups the bytes alone pay
    t = Topology(levels=(Level("node", 2, 1e-3, 8 / 0.4e9), Level("local", 2, 1e-4, 8 / 8e9)))
    unfused = place_samples(traffic, rank_S, t, token_bytes=4096.0, sample_bytes=4096.0)
    fused = place_samples(traffic, rank_S, t, token_bytes=4096.0, sample_bytes=4096.0, fused=True)
    world = 2 * 1e-3 + 1 * 1e-4
    assert unfused.rank_of_sample == plain.rank_of_sample
    assert unfused.move_s == pytest.approx(plain.move_s + world, rel=1e-12)
    assert fused.move_s == pytest.approx(plain.move_s + world + (world - 1e-3), rel=1e-12)
    # a layer run in 3 chunks redirects each chunk's rows: 3 world all-to-alls for its one inter-node hop each
    chunked = place_samples(traffic, rank_S, t, token_bytes=4096.0, sample_bytes=4096.0, fused=True, chunks=3)
    assert chunked.move_s == pytest.approx(plain.move_s + world + 3 * (world - 1e-3), rel=1e-12)
    saved = 2 * (unfused.time_before_s - unfused.time_after_s)
    assert plain.move_s < saved < unfused.move_s and not unfused.pays and not fused.pays


def test_the_decision_costs_its_exchange_and_a_small_gain_is_not_worth_deciding() -> None:
    """Every decision gathers every rank's [S/R, N + R] int64 traffic table on every rank: one
    message to each other rank, (R - per_node) over the inter-node link and per_node - 1 inside the
    node, each with the table's bytes. A move whose gain (the exchanges' saving less the move) is
    below that still pays (``pays``: the decision is spent) but is not worth deciding for."""
    expert_rank = np.repeat(np.arange(4), 2)
    home = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    rank_S = np.array([2, 3, 0, 1, 0, 1, 2, 3])
    a_inter, a_intra, b_inter, b_intra = 2e-4, 1e-5, 8 / 0.4e9, 8 / 8e9
    t = Topology(levels=(Level("node", 2, a_inter, b_inter), Level("local", 2, a_intra, b_intra)))
    table = 2 * (2 + 4) * 8  # 2 samples a rank, a column per node and per rank, int64
    expected = 2 * (a_inter + table * b_inter) + 1 * (a_intra + table * b_intra)

    def placed(tokens: float) -> Placement:
        counts = np.zeros((8, 8))
        for s, r in enumerate(home):
            counts[s, 2 * r] = counts[s, 2 * r + 1] = tokens
        return place_samples(traffic_from_counts(counts, expert_rank, 4, 2), rank_S, t, token_bytes=4096.0,
                             sample_bytes=64.0)

    # the saving is linear in the tokens (the start-ups are the same before and after): pick the
    # tokens that gain half the decision's cost, then many more
    one = placed(1.0)
    per_token = 2 * (one.time_before_s - one.time_after_s)
    small = (one.move_s + expected / 2) / per_token
    for tokens, worth in ((small, False), (64 * small, True)):
        p = placed(tokens)
        assert p.decision_s == pytest.approx(expected, rel=1e-12)
        assert p.moved == 4 and p.pays
        assert p.gain_s == pytest.approx(2 * (p.time_before_s - p.time_after_s) - p.move_s, rel=1e-12)
        assert p.worth_deciding is worth, (tokens, p.gain_s, p.decision_s)
    assert placed(small).gain_s == pytest.approx(expected / 2, rel=1e-9)
    # more samples a rank: a bigger table, a costlier decision
    counts = np.ones((16, 8))
    more = place_samples(traffic_from_counts(counts, expert_rank, 4, 2), np.repeat(np.arange(4), 4), t,
                         token_bytes=4096.0, sample_bytes=64.0)
    assert more.decision_s == pytest.approx(expected + table * (2 * b_inter + b_intra), rel=1e-12)  # 4 a rank, not 2


def test_uniform_routing_declines() -> None:
    """Every sample spreads its tokens evenly over all experts: no placement sends fewer bytes, and
    moving the samples would only cost, so nothing moves (or the model says it does not pay)."""
    counts = np.full((8, 8), 4.0)
    expert_rank = np.repeat(np.arange(4), 2)
    rank_S = np.repeat(np.arange(4), 2)
    traffic = traffic_from_counts(counts, expert_rank, 4, 2)
    p = place_samples(traffic, rank_S, topo(), token_bytes=4096.0, sample_bytes=32 * 4096.0)
    assert p.after.inter_total == p.before.inter_total
    assert p.moved == 0 and not p.pays


def test_refuses_uneven_samples_and_other_topologies() -> None:
    counts = np.ones((3, 4))
    with pytest.raises(ValueError, match="multiple"):
        place_samples(traffic_from_counts(counts, np.arange(4), 4, 2), np.array([0, 1, 2]), topo(), 1.0, 1.0)
    one_level = Topology(levels=(Level("local", 4, 5e-6, 1e-9),))
    with pytest.raises(ValueError, match="2-level"):
        place_samples(traffic_from_counts(np.ones((4, 4)), np.arange(4), 4, 4), np.arange(4), one_level, 1.0, 1.0)


def test_deduplicated_traffic_counts_a_token_once_per_destination() -> None:
    """HD-d sends a token once to each node and once to each rank holding any of its experts:
    token-level routing against a direct count of distinct destinations; without dedup it equals
    the per-copy counts."""
    rng = np.random.default_rng(2)
    num_t, k, e = 40, 4, 8
    idx = np.stack([rng.permutation(e)[:k] for _ in range(num_t)])
    sample = np.repeat(np.arange(4), 10)
    expert_rank = np.repeat(np.arange(4), 2)
    dd = traffic_from_routing(idx, sample, 4, expert_rank, 4, 2, dedup=True)
    for s in range(4):
        toks = idx[sample == s]
        for n in range(2):
            assert dd.to_node_SN[s, n] == sum(bool(set(expert_rank[row] // 2) & {n}) for row in toks)
        for r in range(4):
            assert dd.to_rank_SR[s, r] == sum(r in set(expert_rank[row]) for row in toks)
    counts = np.stack([np.bincount(idx[sample == s].reshape(-1), minlength=e) for s in range(4)])
    plain = traffic_from_routing(idx, sample, 4, expert_rank, 4, 2, dedup=False)
    ref = traffic_from_counts(counts, expert_rank, 4, 2)
    assert np.array_equal(plain.to_rank_SR, ref.to_rank_SR) and np.array_equal(plain.to_node_SN, ref.to_node_SN)
    assert (dd.inter_SN() <= plain.inter_SN()).all()
