"""NetMoE's sample placement as a cost model (ICLR 2025; papers/netmoe-notes-zh.md, Sec. 4).

The tokens of one sample tend to go to the same few experts. If the combine returns a sample's
tokens to a rank in the node that holds those experts (and the sample's per-sample values move with
it), the next all-to-all stays inside the node. This module predicts the per-level traffic of a
placement under the alpha-beta topology, and chooses the placement by NetMoE's two stages, each a
balanced linear assignment (scipy's ``linear_sum_assignment``, the Hungarian method):

  Stage 1 (inter-node): samples to nodes, S / N per node; the cost of sample s on node n is the
      inter-node bytes its tokens send from there, plus moving the sample there if it lives
      elsewhere.
  Stage 2 (intra-node): inside each node, its samples to its ranks, S / R per rank; the cost of s
      on rank r is the intra-node bytes its tokens send from r (to experts on the node's other
      ranks), plus moving it to r inside the node.

Each rank keeps the same number of samples (shapes stay static). The notes' model (Sec. 4,
"transmission time"): an all-to-all is synchronous, so its time is the slowest rank's: per level,
alpha per peer message plus the most bytes any rank sends over that level times beta. The
assignment minimises the sum over samples of the bytes (what the Hungarian method can); the
prediction reports the slowest-rank time before and after, and ``pays`` compares the time saved in
the exchanges the placement serves with the time to move the samples: their bytes, and the start-ups
of the all-to-alls a move adds (the same model: alpha per peer message): the move's own, one
message to every other rank of the world, and where the layer's combine delivers to the new ranks
(``fused``) its redirect, a world all-to-all in place of the combine's inter-node hop (the
runtime's ``hier_a2a.combine_to_steps``), one per chunk where the layer runs in chunks. A step that moves nothing runs none of them.

The decision itself costs every step it runs, whether samples move or not (``decision_s``): every
rank's table of per-sample traffic ([S/R, N + R] int64, ``lowering.sample_exchange``) gathered by
every rank, one message to every other rank (the same start-ups as a move's) with R - 1 tables'
bytes, the slowest rank's at each level's beta; then the assignment on every rank (``solve_s``,
measured). At decision time it is spent, so ``pays`` leaves it out; ``worth_deciding`` weighs a
move's gain against the exchange (the runtime decides less often where a move gains less).

Shapes: S samples, E experts, R ranks, N nodes (R = N * ranks_per_node); counts_SE[s, e] = tokens of
sample s routed to expert e (a token with K experts counts K times, once per copy sent); or
token-level routing, deduplicated per destination as HierMoE's HD-d sends it
(``traffic_from_routing``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moe_compile.cost.topology import Topology


@dataclass(frozen=True)
class LevelBytes:
    """Bytes one all-to-all sends under a placement: the slowest rank's and the total, per level."""

    inter_max: float
    inter_total: float
    intra_max: float
    intra_total: float


@dataclass(frozen=True)
class Placement:
    """A sample placement and what the model predicts for it."""

    rank_of_sample: tuple[int, ...]  # the rank each sample lives on after the layer
    before: LevelBytes  # the all-to-all's bytes with the samples where they are
    after: LevelBytes  # with the samples at rank_of_sample
    time_before_s: float  # predicted time of one all-to-all (slowest rank, both levels)
    time_after_s: float
    exchanges: float  # all-to-alls the placement serves per move
    move_s: float  # predicted time to move the samples that change rank (slowest rank)
    moved: int  # samples that change rank
    solve_s: float  # wall time of the two assignments
    decision_s: float = 0.0  # predicted time of the decision's exchange of traffic tables (module docstring)

    @property
    def gain_s(self) -> float:
        """The all-to-all time saved over ``exchanges`` all-to-alls less the time to move the samples."""
        return self.exchanges * (self.time_before_s - self.time_after_s) - self.move_s

    @property
    def pays(self) -> bool:
        """Whether the all-to-all time saved over ``exchanges`` all-to-alls repays moving the samples."""
        return self.gain_s > 0

    @property
    def worth_deciding(self) -> bool:
        """Whether moving gains more than the decision's exchange costs: a step that gains less
        would have been better off not deciding. The assignment's wall time (``solve_s``) is left
        out: it differs between ranks, and every rank must reach the same answer (the runtime
        skips decisions by it, and a skipped decision is a collective not run)."""
        return self.pays and self.moved > 0 and self.gain_s > self.decision_s


def _two_levels(topo: Topology) -> tuple[int, int, float, float, float, float]:
    if len(topo.levels) != 2:
        raise ValueError(f"sample placement models a 2-level topology (nodes, ranks in a node); "
                         f"{topo.name!r} has levels {list(topo.level_names)}")
    inter, intra = topo.levels
    return (inter.size, intra.size, inter.alpha_s, inter.beta_s_per_byte, intra.alpha_s, intra.beta_s_per_byte)


@dataclass(frozen=True)
class SampleTraffic:
    """What each sample's tokens send per all-to-all: ``to_node_SN[s, n]`` units arriving on node n
    and ``to_rank_SR[s, r]`` on rank r. A unit is a token copy per (token, expert) without
    deduplication, or per (token, node) / (token, rank) with it (HierMoE's HD-d sends a token once
    to each node, then once to each rank, that holds any of its experts), so to_node is not always
    the sum of to_rank over the node's ranks."""

    to_node_SN: np.ndarray
    to_rank_SR: np.ndarray

    def inter_SN(self) -> np.ndarray:
        """Units sample s sends over inter-node links if it lives on node n."""
        return self.to_node_SN.sum(1, keepdims=True) - self.to_node_SN

    def intra_SR(self, ranks_per_node: int) -> np.ndarray:
        """Units sample s sends over intra-node links if it lives on rank r (to the node's other ranks;
        with deduplication the node-level copy that arrived from elsewhere is relayed the same way)."""
        num_s, num_ranks = self.to_rank_SR.shape
        per_node_SN = self.to_rank_SR.reshape(num_s, num_ranks // ranks_per_node, ranks_per_node).sum(-1)
        node_of_rank = np.arange(num_ranks) // ranks_per_node
        return per_node_SN[:, node_of_rank] - self.to_rank_SR


def traffic_from_counts(counts_SE: np.ndarray, expert_rank_E: np.ndarray, num_ranks: int,
                        ranks_per_node: int) -> SampleTraffic:
    """Non-deduplicated traffic (one unit per token copy) from per-sample expert counts."""
    counts = np.asarray(counts_SE, dtype=np.float64)
    to_rank_SR = counts @ np.eye(num_ranks)[np.asarray(expert_rank_E)]
    to_node_SN = to_rank_SR.reshape(len(counts), num_ranks // ranks_per_node, ranks_per_node).sum(-1)
    return SampleTraffic(to_node_SN, to_rank_SR)


def traffic_from_routing(topk_idx_TK: np.ndarray, sample_T: np.ndarray, num_samples: int,
                         expert_rank_E: np.ndarray, num_ranks: int, ranks_per_node: int,
                         dedup: bool) -> SampleTraffic:
    """Traffic of token-level routing (token t of sample sample_T[t] picks experts topk_idx_TK[t]),
    deduplicated per (token, node) and (token, rank) as HD-d sends it, or one unit per copy."""
    idx = np.asarray(topk_idx_TK)
    rank_TK = np.asarray(expert_rank_E)[idx]
    num_t = idx.shape[0]
    hit_TR = np.zeros((num_t, num_ranks))
    np.add.at(hit_TR, (np.repeat(np.arange(num_t), idx.shape[1]), rank_TK.reshape(-1)), 1.0)
    hit_TN = hit_TR.reshape(num_t, num_ranks // ranks_per_node, ranks_per_node).sum(-1)
    if dedup:
        hit_TR, hit_TN = (hit_TR > 0).astype(np.float64), (hit_TN > 0).astype(np.float64)
    onehot_TS = np.eye(num_samples)[np.asarray(sample_T)]
    return SampleTraffic(onehot_TS.T @ hit_TN, onehot_TS.T @ hit_TR)


def level_bytes(rank_S: np.ndarray, inter_SN: np.ndarray, intra_SR: np.ndarray, ranks_per_node: int,
                token_bytes: float) -> LevelBytes:
    """Bytes per level of one all-to-all with sample s on rank rank_S[s]."""
    rank_S = np.asarray(rank_S)
    idx = np.arange(len(rank_S))
    inter_S = inter_SN[idx, rank_S // ranks_per_node] * token_bytes
    intra_S = intra_SR[idx, rank_S] * token_bytes
    num_ranks = intra_SR.shape[1]
    inter_R = np.bincount(rank_S, inter_S, minlength=num_ranks)
    intra_R = np.bincount(rank_S, intra_S, minlength=num_ranks)
    return LevelBytes(float(inter_R.max()), float(inter_R.sum()), float(intra_R.max()), float(intra_R.sum()))


def _balanced_assignment(cost_SC: np.ndarray, per_column: int) -> np.ndarray:
    """Column of each row, every column taking ``per_column`` rows, minimising the summed cost."""
    # imported here, not with the module: scipy.optimize takes ~0.2 s to import, and every process
    # that imports moe_compile (each rank of a launch) would pay it whether it places samples or not
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(np.repeat(cost_SC, per_column, axis=1))
    out = np.empty(cost_SC.shape[0], dtype=np.int64)
    out[rows] = cols // per_column
    return out


def place_samples(traffic: SampleTraffic, rank_S: np.ndarray, topo: Topology, token_bytes: float,
                  sample_bytes: float, exchanges: float = 2.0, fused: bool = False, chunks: int = 1) -> Placement:
    """NetMoE's two-stage placement of S samples (now on ranks ``rank_S``, S / R on each) for the
    routing's ``traffic`` on ``topo`` (two levels: nodes, ranks per node); ``token_bytes`` one unit
    of traffic (a token's hidden vector and its routing slots), ``sample_bytes`` everything that moves with a sample (its residual stream, masks,
    labels); ``exchanges``: how many all-to-alls with this routing the placement serves (2: this
    layer's combine and the next layer's dispatch, whose tokens leave from where the sample lives),
    against one move; ``fused``: the layer's combine redirects its rows to the new ranks (one more
    world all-to-all's start-ups in the move's cost, module docstring; ``chunks`` of them where
    the layer runs in chunks, each chunk's combine redirecting its own rows). Raises ValueError where the
    samples cannot be spread evenly."""
    num_nodes, per_node, a_inter, b_inter, a_intra, b_intra = _two_levels(topo)
    num_ranks = num_nodes * per_node
    rank_S = np.asarray(rank_S, dtype=np.int64)
    num_s = len(rank_S)
    if num_s % num_ranks or np.bincount(rank_S, minlength=num_ranks).max() != num_s // num_ranks:
        raise ValueError(f"sample placement keeps S / R samples on every rank: {num_s} samples on {num_ranks} "
                         "ranks must be a multiple, spread evenly now")
    start = time.perf_counter()
    if traffic.to_rank_SR.shape != (num_s, num_ranks):
        raise ValueError(f"traffic is for {traffic.to_rank_SR.shape} (samples, ranks), the placement for "
                         f"{(num_s, num_ranks)}")
    inter_SN, intra_SR = traffic.inter_SN(), traffic.intra_SR(per_node)
    node_S = rank_S // per_node
    # Stage 1: samples to nodes
    move_inter_SN = np.where(np.arange(num_nodes)[None, :] == node_S[:, None], 0.0, sample_bytes * b_inter)
    new_node_S = _balanced_assignment(exchanges * inter_SN * token_bytes * b_inter + move_inter_SN,
                                      num_s // num_nodes)
    # Stage 2: inside each node, its samples to its ranks
    new_rank_S = np.empty(num_s, dtype=np.int64)
    for n in range(num_nodes):
        members = np.flatnonzero(new_node_S == n)
        ranks = n * per_node + np.arange(per_node)
        stays = rank_S[members, None] == ranks[None, :]
        move = np.where(stays, 0.0, np.where(node_S[members, None] == n, sample_bytes * b_intra, 0.0))
        cost = exchanges * intra_SR[np.ix_(members, ranks)] * token_bytes * b_intra + move
        new_rank_S[members] = ranks[_balanced_assignment(cost, len(members) // per_node)]
    solve_s = time.perf_counter() - start

    def a2a_time(b: LevelBytes) -> float:
        return ((num_nodes - 1) * a_inter + b.inter_max * b_inter) + ((per_node - 1) * a_intra + b.intra_max * b_intra)

    before = level_bytes(rank_S, inter_SN, intra_SR, per_node, token_bytes)
    after = level_bytes(new_rank_S, inter_SN, intra_SR, per_node, token_bytes)
    moved = new_rank_S != rank_S
    cross = moved & (new_rank_S // per_node != node_S)
    # moving: the most bytes any rank sends away, per level
    out_inter = np.bincount(rank_S[cross], minlength=num_ranks).max(initial=0) * sample_bytes
    out_intra = np.bincount(rank_S[moved & ~cross], minlength=num_ranks).max(initial=0) * sample_bytes
    world_start = (num_ranks - per_node) * a_inter + (per_node - 1) * a_intra  # one message to every other rank
    starts = world_start + (chunks * (world_start - (num_nodes - 1) * a_inter) if fused else 0.0)
    move_s = out_inter * b_inter + out_intra * b_intra + starts
    return Placement(tuple(int(r) for r in new_rank_S), before, after, a2a_time(before), a2a_time(after),
                     exchanges, float(move_s), int(moved.sum()), solve_s,
                     decision_s(num_nodes, per_node, a_inter, b_inter, a_intra, b_intra, num_s // num_ranks))


def decision_s(num_nodes: int, per_node: int, a_inter: float, b_inter: float, a_intra: float, b_intra: float,
               samples_per_rank: int) -> float:
    """Predicted seconds of the decision's exchange (module docstring): every rank sends its
    [samples_per_rank, N + R] int64 traffic table to every other rank, (R - per_node) messages over
    the inter-node level and per_node - 1 inside the node, each at its level's alpha and beta."""
    num_ranks = num_nodes * per_node
    table = samples_per_rank * (num_nodes + num_ranks) * 8
    return float((num_ranks - per_node) * (a_inter + table * b_inter) + (per_node - 1) * (a_intra + table * b_intra))


__all__ = ["LevelBytes", "Placement", "SampleTraffic", "decision_s", "level_bytes", "place_samples",
           "traffic_from_counts", "traffic_from_routing"]
