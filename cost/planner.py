"""The planner: predicted time of every strategy for one MoE layer on a topology, and the argmin
over the strategies the lowering implements (STYLE.md: find, then decide, then rewrite; this is
"decide", from the region's shapes and routing statistics, never from fx nodes).

Candidates and where their times come from (seconds of one layer's forward on one rank):

    local              the experts computed on this rank only: compute time, no communication
                       (with several ranks: every rank's tokens on one device)
    replicated         every rank holds every expert whole and runs its own tokens through them
                       (the lowering's ``strategies.replicated``, data parallel): the compute of
                       its T*K pairs, balanced whatever the routing, plus reading the weights of
                       the E - E/S experts an expert-parallel rank does not hold; no communication
                       (the gradient all-reduce a replicated expert needs is the same under every
                       candidate, so none is charged it)
    flat_a2a           flat all-to-all, one copy per (token, expert) - what Megatron and HF do
    hier_a2a           hierarchical all-to-all without dedup (Tutel 2DH), topologies with >= 2 levels
    hier{d}_a2a        the same over d >= 3 levels (HierMoE's H-d)
    hd{d}              HierMoE HD-d dedup all-to-all, d = 1..D (hiermoe.py, Eq. 1-5)
    monta_{O1,O2,O3}   MoNTA's drop + inter-node A2A + intra-node AllGather options (monta.py, Alg. 3)
    hybridep           HybridEP's expert-domain AllGather + cross-domain A2A (hybridep.py, Alg. 1)
    gather{j}          the expert gather the lowering runs (``lowering.strategies.gather``): the
                       mesh blocks at level j all-gather their experts (HybridEP's AG term with
                       domain sizes 1 above level j, the level sizes from j on), tokens cross
                       levels 0..j-1 by HD-(j+1)'s deduplicating inter-level phases (hiermoe.py);
                       gather0 is HEXA-MoE's data-centric mode
    model0             the model-centric mode the lowering runs (``lowering.strategies.model``):
                       every rank's tokens all-gathered and the partial outputs reduce-scattered,
                       hierarchically (hexa.py's AllGather per level), plus the compute
    hexa_{data,model}_centric   HEXA-MoE's execution modes (hexa.py, Section 4.3)

Assumptions: the dispatch models give one direction; the combine is its mirror, so dispatch
strategies count twice their time (the HierMoE ones: the dispatch with the routing slots' bytes
when ``Workload.slot_bytes`` counts them, the combine without), plus the expert compute (an
expert-parallel layer computes T*K (token, expert) pairs per rank on average): its FLOPs at the
device's FLOP rate, or, where the topology holds the expert op measured on the device
(``Topology.expert_compute_s``), its FLOPs at the op's matmul rate plus its rows' bytes (T*K rows of
H) at the op's row rate; ``model0`` computes S times the rows on F/S columns, the same FLOPs and S
times the row bytes (``compute_s``'s ``row_share``).  HybridEP's and
HEXA-MoE's own models already cover the whole layer.  Without routing indices the statistics are
those of uniform random routing of T tokens.

Compute imbalance (``expert_load``: the (token, expert) pairs each expert received, summed over
the ranks): a layer ends when its busiest rank does, so a candidate whose tokens compute where
their experts live is charged its busiest block's share of the pairs, not the mean
(``load_imbalance``: max over the blocks / mean). The blocks are where the pairs are computed:
single ranks for the token all-to-alls (hd*, flat, hier*, MoNTA), the level-j blocks for
``gather{j}`` (each block computes the tokens of the experts it gathered, split over its ranks
by where they came from), one block for ``gather0`` and ``model0`` (every rank computes its own
tokens, or every token on its F/S columns: balanced whatever the routing). This is the case for
HEXA-MoE's model-centric and data-centric modes under skewed routing (papers/hexa-moe.txt
Section 4.3). The communication models keep uniform routing statistics without routing indices:
what skewed routing does to each level's bytes is left to the per-step d* tuner and to
``tune_strategy``'s measurement, which draws its tokens' routing from the same loads
(``routing_from_load``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moe_compile.cost import hexa, hybridep, monta
from moe_compile.cost.hiermoe import HDCostModel, phase_terms, phase_times_s
from moe_compile.cost.pipeline import LayerTimes, Phase
from moe_compile.cost.routing import hd_statistics
from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import Workload

# What the lowering runs on one process; with a mesh, the expert-parallel lowering runs the
# all-to-all candidates of the strategies ``moe_compile.lowering.strategies`` registers.
IMPLEMENTED: tuple[str, ...] = ("local",)


def dispatch_strategy(dimension: int, dedup: bool) -> str:
    """The candidate name of an HD-d (dedup) or H-d (no dedup) all-to-all."""
    if dedup:
        return f"hd{dimension}"
    return {1: "flat_a2a", 2: "hier_a2a"}.get(dimension, f"hier{dimension}_a2a")


@dataclass(frozen=True)
class Plan:
    """The strategy chosen for one layer, its parameters, and every candidate's predicted time."""

    strategy: str
    params: Mapping[str, Any] = field(default_factory=dict)
    predicted: Mapping[str, float] = field(default_factory=dict)
    implemented: tuple[str, ...] = IMPLEMENTED
    notes: tuple[str, ...] = ()  # candidates that could not be evaluated, and why

    def describe(self, top: int = 4) -> str:
        best = sorted(self.predicted.items(), key=lambda kv: kv[1])[:top]
        return ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in best)


def plan(topology: Topology | None, workload: Workload, topk_idx: Any = None, *,
         implemented: Iterable[str] = IMPLEMENTED, gather_compress: float | None = None,
         expert_load: Any = None) -> Plan:
    """Evaluate every candidate strategy and pick the fastest implemented one.

    ``topk_idx`` ([T, K] expert ids of this rank's tokens) gives the routing statistics the
    HierMoE models need; without it, uniform random routing is assumed. ``expert_load``: [E]
    (token, expert) pairs per expert, summed over the ranks (module docstring).
    ``gather_compress``: the SR compression ratio the gathers run with (options['gather_compress'];
    None: off)."""
    allowed = tuple(implemented)
    compute = compute_s(topology, workload)
    predicted: dict[str, float] = {"local": compute if topology is None or topology.world_size == 1
                                   else compute * topology.world_size}
    params: dict[str, dict[str, Any]] = {"local": {}}
    notes: list[str] = []
    if topology is not None and topology.world_size == 1:
        # a mesh of one rank (torchrun --nproc-per-node 1): it holds every expert, nothing to send
        predicted["replicated"], params["replicated"] = compute, {}
    if topology is not None and topology.world_size > 1:
        predicted["replicated"] = replicated_time_s(topology, workload, compute)
        params["replicated"] = {}
        if workload.num_experts % topology.world_size:
            notes.append(f"{workload.num_experts} experts do not split evenly over {topology.world_size} ranks: "
                         "expert-parallel candidates not evaluated")
        else:
            levels = len(topology.sizes)
            # per mesh level j (levels: single ranks), the busiest block's compute over the mean's
            busiest = [1.0 if expert_load is None else load_imbalance(expert_load, topology.sizes, j)
                       for j in range(levels + 1)]
            dist_predicted, dist_params = _distributed(topology, workload, topk_idx, compute, gather_compress,
                                                       busiest)
            predicted.update(dist_predicted)
            params.update(dist_params)
            if expert_load is not None:
                under = [f"{busiest[levels]:.2f}x under the token all-to-alls"]
                under += [f"{busiest[j]:.2f}x under gather{j}" for j in range(1, levels)]
                notes.append("expert compute charged at the busiest block's load (the expert loads of the compile's "
                             f"batches): {', '.join(under)}, 1x under gather0 and model0")
    choices = [s for s in predicted if s in allowed]
    if not choices:
        raise ValueError(f"none of the implemented strategies {list(allowed)} applies"
                         + "".join(f" ({n})" for n in notes) + f"; candidates were {sorted(predicted)}")
    best = min(choices, key=predicted.__getitem__)
    if best == "replicated" and topology is not None:
        notes.append(replicated_note(topology, workload, {k: predicted[k] for k in choices}))
    return Plan(strategy=best, params=params.get(best, {}), predicted=predicted, implemented=allowed,
                notes=tuple(notes))


def replicated_time_s(topology: Topology, workload: Workload, compute_s: float) -> float:
    """Candidate ``replicated``'s forward: the rank's own T*K pairs (``compute_s``) and one read of
    the experts' weights it holds beyond an expert-parallel rank's E/S, at the device's memory
    bandwidth (the term that makes expert parallelism pay for few tokens and large experts)."""
    world = topology.world_size
    extra = workload.num_experts - workload.num_experts / world
    return compute_s + extra * workload.expert_bytes / topology.device_mem_bw(0)


def replicated_note(topology: Topology, workload: Workload, predicted: Mapping[str, float]) -> str:
    """What running a layer replicated costs outside the layer, and what sharding would run:
    every step all-reduces its E experts' gradients (a hierarchical reduce-scatter and
    all-gather of their bytes: twice gather0's all-gather, HEXA-MoE's AllReduce), which
    ``shard_experts`` avoids (each rank then owns E/S experts, whose gradients the
    expert-parallel backward sums on the owner); ``predicted``: the executable candidates'
    forward times, of which the ones a sharded model runs are named."""
    allreduce = 2 * gather_time_s(topology, workload, None, 0)
    text = (f"replicated: each step all-reduces these {workload.num_experts} experts' gradients, about "
            f"{allreduce * 1e3:.3g} ms on this topology (reduce-scatter + all-gather of "
            f"{workload.num_experts * workload.expert_bytes / 2**20:.3g} MiB)")
    sharded = {k: t for k, t in predicted.items() if k not in ("replicated", "local", "model0")}
    if not sharded:
        return text
    alt = min(sharded, key=sharded.__getitem__)
    return (f"{text}; moe_compile.shard_experts would keep {workload.num_experts // topology.world_size} "
            f"per rank and avoid it, running {alt} ({sharded[alt] * 1e3:.3g} ms forward predicted, "
            f"against {predicted['replicated'] * 1e3:.3g} ms here)")


def compute_s(topology: Topology | None, workload: Workload, row_share: int = 1) -> float:
    """Seconds of the layer's expert FFNs on one device: the T*K (token, expert) pairs' FLOPs
    (``Topology.expert_compute_s``: at the device's FLOP rate, or at the measured expert op's
    rates with the rows' bytes too). ``row_share``: the pairs' FLOPs computed as ``row_share``
    times the rows on 1/``row_share`` of the FFN columns each (``model0``: S)."""
    pairs = workload.num_tokens * workload.top_k
    flops = pairs * workload.expert_flops_per_token()
    if topology is None:
        return flops / 1e12
    return topology.expert_compute_s(flops, row_share * pairs * workload.token_bytes)


def _distributed(topology: Topology, workload: Workload, topk_idx: Any, compute_s: float,
                 gather_compress: float | None = None, busiest: Sequence[float] | None = None
                 ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """``busiest[j]``: the busiest level-j block's compute over the mean's (``load_imbalance``;
    None: 1 everywhere); candidates are charged it where their pairs are computed (module docstring)."""
    predicted: dict[str, float] = {}
    params: dict[str, dict[str, Any]] = {}
    levels = len(topology.sizes)
    compute_at = [compute_s * (1.0 if busiest is None else busiest[j]) for j in range(levels + 1)]
    ep_compute = compute_at[levels]
    # HierMoE: HD-d for every d, and the no-dedup baselines (dispatch, with the routing slots'
    # metadata when the workload counts it, + combine, rows only, + compute)
    model, back = _hd_model(topology, workload), _hd_model(topology, replace(workload, slot_bytes=0))
    idx = topk_idx if topk_idx is not None else uniform_routing(workload)
    stats = hd_statistics(idx, workload.num_experts, topology.sizes, copies=True)
    hd = model.times_s(stats) + back.times_s(stats)
    for d, t in enumerate(hd, start=1):
        predicted[f"hd{d}"] = float(t) + ep_compute
        params[f"hd{d}"] = {"dimension": d}
    nodedup = model.nodedup_times_s(stats) + back.nodedup_times_s(stats)
    predicted["flat_a2a"] = float(nodedup[0]) + ep_compute
    if len(nodedup) > 1 and len(topology.levels) >= 2:
        predicted["hier_a2a"] = float(nodedup[1]) + ep_compute
    for d in range(3, len(nodedup) + 1):  # HierMoE's H-d (Fig. 13) beyond Tutel's two levels
        predicted[f"hier{d}_a2a"] = float(nodedup[d - 1]) + ep_compute
    # MoNTA: inter-node A2A + intra-node AllGather, chunked
    choice = monta.plan(topology, workload)
    for option, t in choice.times_s.items():
        predicted[f"monta_{option}"] = 2 * float(t) + ep_compute
        params[f"monta_{option}"] = {"chunks": choice.chunks.get(option, 1)}
    # HybridEP: expert domains (its model covers the layer's communication)
    sizes = hybridep.StreamSizes.from_workload(workload, topology.world_size)
    hep = hybridep.choose_partition(topology, sizes)
    predicted["hybridep"] = float(hep.time.total_s) + compute_s
    params["hybridep"] = {"domain_sizes": tuple(hep.partition.domain_sizes)}
    # the executable expert gathers, one per domain level
    for j in range(len(topology.levels)):
        predicted[f"gather{j}"] = gather_time_s(topology, workload, stats, j, gather_compress) + compute_at[j]
        params[f"gather{j}"] = {"domain_level": j, "domain_size": math.prod(topology.sizes[j:])}
    # the executable model-centric mode over the whole mesh
    predicted["model0"] = model_time_s(topology, workload) + _model_compute_s(topology, workload)
    params["model0"] = {"ffn_columns": workload.ffn_size // topology.world_size}
    # HEXA-MoE: data- vs model-centric (its model includes the compute)
    hx = hexa.choose_execution(topology, workload)
    predicted["hexa_data_centric"] = float(hx.data_centric_s)
    predicted["hexa_model_centric"] = float(hx.model_centric_s)
    return predicted, params


def _model_compute_s(topology: Topology, workload: Workload) -> float:
    """``model0``'s expert compute: the FLOPs of T*K pairs as S*T*K rows on F/S columns
    (``compute_s``'s ``row_share``; the same as the other candidates' where the topology has
    no measured expert op, FLOPs alone)."""
    return compute_s(topology, workload, row_share=topology.world_size)


def gather_time_s(topology: Topology, workload: Workload, stats: Any, level: int,
                  compress: float | None = None) -> float:
    """Communication seconds of one layer's forward under ``gather{level}``: the hierarchical
    all-gather of the domain's expert weights (HybridEP's multi-level AG, ``hybridep.partition_time_s``
    with domain sizes 1 above ``level`` and the level sizes from it on; not overlapped with
    earlier work: the prefetch is not credited) plus the tokens' dispatch (with the routing
    slots' bytes) and combine over Inter-level-1..``level`` (HierMoE Eq. 3's first ``level``
    summands of HD-(level+1), ``phase_times_s``). ``compress``: the SR compression ratio r, each
    expert entry kept with probability 1/r travelling with its int32 index (``lowering.ep_gather``).

    Plus the gather's copies on the rank (``Topology.copy_s``): its experts' bytes packed into one
    message and its own chunk copied into the received block, and the domain's S chunks unpacked
    into the gathered weights, (2 + S) times a rank's expert bytes. Measured on the emulated
    cluster (medium experts, 1-2 Gbit) the copies were most of gather1's exposed forward wait:
    20-32 ms, 16-24 once the all-gather stopped copying its buffer once per peer, against 3-5 ms
    on the wire; the planner that left them out picked gather1 where it ran 4-34 % behind the
    token all-to-all (bench/results/gather.md)."""
    sizes = tuple(1 if i < level else s for i, s in enumerate(topology.sizes))
    part = hybridep.DomainPartition.of(topology, sizes)
    ratio = 1.0 if compress is None else compress * workload.dtype_bytes / (workload.dtype_bytes + 4)
    streams = hybridep.StreamSizes.from_workload(workload, topology.world_size, compression_ratio=ratio)
    ag = hybridep.partition_time_s(topology, part, streams).ag_s
    ag += topology.copy_s((2 + math.prod(topology.sizes[level:])) * streams.expert_bytes)
    if level == 0:
        return float(ag)
    tokens = 0.0
    for w in (workload, replace(workload, slot_bytes=0)):  # dispatch, combine
        tokens += sum(a + b for a, b in phase_times_s(level + 1, topology, w, stats)[:level])
    return float(ag) + tokens


def model_time_s(topology: Topology, workload: Workload) -> float:
    """Communication seconds of one layer's forward under ``model0`` (``lowering.ep_model``): the
    hierarchical all-gather of every rank's tokens with their routing slots (HEXA-MoE's AG of the
    tokens, Section 4.3; ``hexa.hier_all_gather_s``) and the reduce-scatter of the partial outputs,
    the all-gather's adjoint with the same bytes per level (HEXA all-reduces, twice that). The
    expert compute is the other candidates': each rank runs S*T tokens on F/S columns."""
    tokens = workload.num_tokens * (workload.token_bytes + workload.top_k * workload.slot_bytes)
    outputs = workload.num_tokens * workload.token_bytes
    return hexa.hier_all_gather_s(topology, tokens) + hexa.hier_all_gather_s(topology, outputs)


_HD_MODELS: dict[tuple[str, Workload], HDCostModel] = {}


def _hd_model(topology: Topology, workload: Workload) -> HDCostModel:
    """Lambdify once per (topology, workload): every layer of a model shares its shapes."""
    key = (repr(topology), workload)
    if key not in _HD_MODELS:
        _HD_MODELS[key] = HDCostModel(topology, workload)
    return _HD_MODELS[key]


def load_imbalance(expert_load: Any, sizes: Sequence[int], level: int) -> float:
    """The busiest level-``level`` mesh block's share of the (token, expert) pairs over the mean
    block's (>= 1; 1 for no pairs): ``expert_load`` [E] pairs per expert, the experts in
    contiguous blocks by mesh position (``runtime.EPLayer.expert_pos_E``), a block holding the
    experts of the ranks that share mesh coordinates 0..level-1 (``level`` = len(sizes): single
    ranks; 0: the whole mesh)."""
    load = np.asarray(expert_load, dtype=np.float64).reshape(-1)
    blocks = math.prod(sizes[:level])
    if load.size % blocks:
        raise ValueError(f"{load.size} experts do not split into {blocks} mesh blocks")
    total = float(load.sum())
    if total <= 0:
        return 1.0
    return float(load.reshape(blocks, -1).sum(axis=1).max() * blocks / total)


def routing_from_load(num_tokens: int, top_k: int, expert_load: Any, seed: int = 0) -> np.ndarray:
    """[T, K] distinct expert ids per token drawn with probabilities proportional to ``expert_load``
    ([E] pairs per expert; Gumbel top-k: K draws without replacement, Plackett-Luce), the same for
    the same seed; an expert with no load keeps a small share (1e-3 of the mean) so K distinct ids
    exist."""
    load = np.asarray(expert_load, dtype=np.float64).reshape(-1)
    if not 0 < top_k <= load.size:
        raise ValueError(f"top_k={top_k} needs 1..{load.size} experts with a load")
    mean = float(load.mean()) if load.sum() > 0 else 1.0
    logits = np.log(np.maximum(load, 1e-3 * mean))
    rng = np.random.default_rng(seed)
    keys = logits[None, :] + rng.gumbel(size=(num_tokens, load.size))
    return np.ascontiguousarray(np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k])


def uniform_routing(workload: Workload, seed: int = 0) -> np.ndarray:
    """[T, K] distinct expert ids per token, uniformly at random (the planner's default statistics)."""
    rng = np.random.default_rng(seed)
    keys = rng.random((workload.num_tokens, workload.num_experts))
    return np.ascontiguousarray(np.argpartition(keys, workload.top_k - 1, axis=1)[:, : workload.top_k])


def layer_times(topology: Topology, work: Workload, d: int, dedup: bool, busiest: float = 1.0) -> LayerTimes:
    """The unchunked HD-``d`` layer's stage times the pipeline model schedules: each phase's
    latency and transfer from the HierMoE model on uniform routing (dispatch with the routing
    slots' bytes, combine without), the busiest rank's compute, the chunks' gradient sums."""
    stats = hd_statistics(uniform_routing(work), work.num_experts, topology.sizes, copies=True)

    def phases(w: Workload) -> tuple[Phase, ...]:
        # each phase with its level's measured efficiency curve where calibration wrote one
        names = [lv.name for lv in topology.levels]
        return tuple(Phase(a, b, n, topology.efficiency.get(f"all_to_all_{names[level]}"), names[level])
                     for level, a, b, n in phase_terms(d, topology, w, stats, dedup=dedup))

    # the rank's share of the expert weights, as the chunks' gradients autograd sums (2 reads, 1 write)
    local_weight_bytes = work.num_experts * work.expert_bytes / topology.world_size
    grad_sum_s = 3 * local_weight_bytes / topology.device_mem_bw(0)
    return LayerTimes(phases(work), phases(replace(work, slot_bytes=0)), busiest * compute_s(topology, work),
                      grad_sum_s)
