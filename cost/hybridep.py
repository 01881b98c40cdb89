"""HybridEP (Yang et al., "Scaling Expert Parallelism to Cross-Datacenter Scenario via Hybrid
Expert/Data Transmission"): move experts (AllGather of expert weights inside an expert domain) or
tokens (A2A across domains).  Stream model (Section III, Eq. 1-12) with the optimal proportion p
derived by sympy, the Case 1 / 2.1 / 2.2 regions, and the domain partition of a multi-level
topology (Section IV-A, Eq. 13, Alg. 1) with its communication frequencies (Table VII).

Assumptions (paper Section III unless marked ours): every GPU holds the same number n of equally
sized experts and the gate spreads tokens evenly; all GPUs use the same p (Section III-E); expert
compute is fully overlapped with AG and A2A (Eq. 7); AG also overlaps the pre-expert compute
(asynchronous prefetch, Section IV-B) while A2A cannot; A2A runs twice (dispatch and combine), AG
once (Eq. 5).  The flat model (Eq. 3-12) has one bandwidth B and no per-message latency.
Multi-level extension (ours; equal to the flat model on one level with alpha = 0): level l of a
Topology has SF^l = level.size workers and expert-domain size S^l (a divisor of SF^l).  Expert
weights are gathered slowest level first, so level l carries the experts already gathered above it,
P_E * prod_{j<l} S^j per peer, to S^l - 1 peers (Eq. 4 with |G^AG| = S^l); tokens cross level l in
an A2A among the SF^l / S^l same-offset workers, D * (1 - S^l / SF^l) bytes (Eq. 3 with
|G^A2A| = SF^l / S^l); level times add up (no cross-level pipelining); every message costs
alpha_l + bytes * beta_l.  A GPU ends up holding the experts of prod_l S^l GPUs (memory, Section VI).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Literal

import sympy as sp

from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import Workload

# Table I notation, units in the names.
D_bytes = sp.Symbol("D_bytes", positive=True)  # data (dispatched tokens) of one GPU
P_E_bytes = sp.Symbol("P_E_bytes", positive=True)  # expert parameters held by one GPU
B_bytes_per_s = sp.Symbol("B_bytes_per_s", positive=True)
G = sp.Symbol("G", integer=True, positive=True)  # GPUs (DCs in the flat model)
p = sp.Symbol("p", real=True)  # Definition 1: share of leaving chunks sent by A2A
lat_pe_s = sp.Symbol("lat_pe_s", positive=True)  # pre-expert compute, (m+1) Att + m FFN
lat_ep_s = sp.Symbol("lat_ep_s", positive=True)  # one expert's compute
n_experts = sp.Symbol("n", positive=True)  # experts per GPU
L_rows, H_inner, M_cols = sp.symbols("L H M", positive=True)
C_macs_per_s = sp.Symbol("C_macs_per_s", positive=True)

Case = Literal["1", "2.1", "2.2"]


@dataclass(frozen=True)
class StreamModel:
    """The stream model's expressions; ``p_opt`` and ``case21_discriminant`` are derived."""

    lat_gemm_s: sp.Expr
    lat_comp_s: sp.Expr
    v_a2a_bytes: sp.Expr
    v_ag_bytes: sp.Expr
    lat_a2a_s: sp.Expr
    lat_ag_s: sp.Expr
    lat_comm_s: sp.Expr
    lat_ovlp_s: sp.Expr
    lat_final_s: sp.Expr
    case1_s: sp.Expr
    case2_s: sp.Expr
    p_boundary: sp.Expr
    slope_case1: sp.Expr
    slope_case2: sp.Expr
    case21_discriminant: sp.Expr
    p_opt: sp.Expr


def _drop_positive_factors(expr: sp.Expr) -> sp.Expr:
    """The part of ``expr`` whose sign is not known positive, using G > 1 (Definition 1)."""
    g = sp.Symbol("g", positive=True)
    factored = sp.factor(expr.subs(G, g + 1))
    kept = [f for f in sp.Mul.make_args(factored) if not f.is_positive]
    return sp.expand(sp.Mul(*kept).subs(g, G - 1))


@lru_cache(maxsize=1)
def stream_model() -> StreamModel:
    lat_gemm = L_rows * M_cols * H_inner / C_macs_per_s  # Eq. 1
    lat_comp = lat_pe_s + n_experts * lat_ep_s  # Eq. 2, Pre-Expert folded into lat_pe_s
    # Eq. 3 at p = 1, then Section III-B "Relationships": each of the (1-p)(G-1) chunks that turns
    # into an AG removes D/G from the A2A and adds P_E to the AG (Eq. 4 with |G^AG|-1 = (1-p)(G-1)).
    v_a2a = D_bytes / G * (G - 1) - (1 - p) * (G - 1) * D_bytes / G
    v_ag = P_E_bytes * (1 - p) * (G - 1)
    lat_a2a, lat_ag = v_a2a / B_bytes_per_s, v_ag / B_bytes_per_s  # Eq. 3, Eq. 4
    lat_comm = lat_ag + 2 * lat_a2a  # Eq. 5
    hidden_ag = sp.Min(lat_pe_s, lat_ag)
    lat_ovlp = hidden_ag + n_experts * lat_ep_s  # Eq. 7
    lat_final = lat_comp + lat_comm - lat_ovlp  # Eq. 8
    case1 = sp.expand(lat_final.xreplace({hidden_ag: lat_ag}))  # Eq. 11: lat_pe >= lat_ag
    case2 = sp.expand(lat_final.xreplace({hidden_ag: lat_pe_s}))  # Eq. 12: lat_pe < lat_ag
    (p_boundary,) = sp.solve(sp.Eq(lat_pe_s, lat_ag), p)  # edge between the two regions
    slope1, slope2 = sp.diff(case1, p), sp.diff(case2, p)
    # Both pieces are linear in p and lat_ag falls with p, so Case 2 lies left of the boundary,
    # Case 1 right of it.  Convex (slope2 < slope1) with slope1 > 0: the minimum over [0, 1] is the
    # boundary when slope2 < 0 (Case 2.1), else p = 0 (Case 2.2); a boundary below 0 means AG hides
    # under the pre-expert compute at every p, so p = 0 again.
    assert _drop_positive_factors(slope1) == 1
    assert _drop_positive_factors(slope1 - slope2) == 1
    disc = _drop_positive_factors(slope2)  # slope2 < 0 <=> disc < 0
    p_opt = sp.Piecewise((0, disc >= 0), (sp.Max(0, p_boundary), True))
    return StreamModel(lat_gemm, lat_comp, v_a2a, v_ag, lat_a2a, lat_ag, lat_comm, lat_ovlp, lat_final,
                       case1, case2, p_boundary, slope1, slope2, disc, p_opt)


_FLAT_ARGS = (D_bytes, P_E_bytes, B_bytes_per_s, G, lat_pe_s)


@cache
def _flat_fn(name: str) -> Callable[..., float]:
    m = stream_model()
    expr = {"p_opt": m.p_opt, "p_boundary": m.p_boundary, "disc": m.case21_discriminant,
            "lat_ag": m.lat_ag_s,
            "lat_final": sp.Max(lat_pe_s, m.lat_ag_s) + 2 * m.lat_a2a_s}[name]  # Eq. 10
    return sp.lambdify((p, *_FLAT_ARGS), expr, modules="math")


def optimal_p(data_bytes: float, expert_bytes: float, bandwidth_bytes_per_s: float, num_gpus: int,
              pre_expert_s: float) -> float:
    """Continuous optimal p (Eq. 11-12 minimised, Fig. 6); the feasible p are (G - S)/(G - 1)."""
    return float(_flat_fn("p_opt")(0.0, data_bytes, expert_bytes, bandwidth_bytes_per_s, num_gpus, pre_expert_s))


def stream_time_s(proportion: float, data_bytes: float, expert_bytes: float, bandwidth_bytes_per_s: float,
                  num_gpus: int, pre_expert_s: float) -> float:
    """Lat_all at a given p (Eq. 8 = Eq. 10: max(Lat_PE, Lat_AG) + 2 Lat_A2A)."""
    return float(_flat_fn("lat_final")(proportion, data_bytes, expert_bytes, bandwidth_bytes_per_s, num_gpus,
                                       pre_expert_s))


def regime(data_bytes: float, expert_bytes: float, num_gpus: int) -> Literal["2.1", "2.2"]:
    """Which Case 2 sits left of Case 1 (Section III-E): 2.1 iff 2D - G P_E < 0 (derived)."""
    return "2.1" if _flat_fn("disc")(0.0, data_bytes, expert_bytes, 1.0, num_gpus, 1.0) < 0 else "2.2"


def case_at(proportion: float, data_bytes: float, expert_bytes: float, bandwidth_bytes_per_s: float,
            num_gpus: int, pre_expert_s: float) -> Case:
    """Region of ``proportion``: Case 1 where Lat_PE >= Lat_AG (Eq. 11), else Case 2.1 / 2.2 (Eq. 12)."""
    lat_ag = _flat_fn("lat_ag")(proportion, data_bytes, expert_bytes, bandwidth_bytes_per_s, num_gpus, pre_expert_s)
    return "1" if pre_expert_s >= lat_ag else regime(data_bytes, expert_bytes, num_gpus)


def p_of_domain_size(num_gpus: int, domain_size: int) -> float:
    """Definition 1: a domain of S GPUs gathers from S - 1 peers, so p = (G - S) / (G - 1)."""
    if num_gpus % domain_size:
        raise ValueError(f"expert-domain size {domain_size} must divide the {num_gpus} GPUs of the level")
    return 0.0 if num_gpus == 1 else (num_gpus - domain_size) / (num_gpus - 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def best_domain_size(data_bytes: float, expert_bytes: float, bandwidth_bytes_per_s: float, num_gpus: int,
                     pre_expert_s: float) -> int:
    """The feasible domain size (a divisor of G) with the least Eq. 10 time; ties -> smaller domain."""
    def t(s: int) -> float:
        return stream_time_s(p_of_domain_size(num_gpus, s), data_bytes, expert_bytes, bandwidth_bytes_per_s,
                             num_gpus, pre_expert_s)
    return min(_divisors(num_gpus), key=lambda s: (t(s), s))


# Domain partition of a multi-level topology (Section IV-A) -----------------------------------

CommKind = Literal["AG", "A2A"]


@dataclass(frozen=True)
class DomainPartition:
    """Expert domains per level: ``scaling_factors`` are SF^l (the Topology's level sizes, slowest
    first, as in the paper where level 0 is the DC), ``domain_sizes`` are S_ED^l."""

    level_names: tuple[str, ...]
    scaling_factors: tuple[int, ...]
    domain_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, sf, s in zip(self.level_names, self.scaling_factors, self.domain_sizes):
            if s < 1 or sf % s:
                raise ValueError(f"expert-domain size {s} at level {name!r} must divide its size {sf}")

    @classmethod
    def of(cls, topology: Topology, domain_sizes: tuple[int, ...]) -> DomainPartition:
        if len(domain_sizes) != len(topology.levels):
            raise ValueError(f"give one domain size per level {list(topology.level_names)}, got {domain_sizes}")
        return cls(topology.level_names, topology.sizes, tuple(domain_sizes))

    @property
    def world_size(self) -> int:
        return math.prod(self.scaling_factors)

    @property
    def proportions(self) -> tuple[float, ...]:
        """Per-level p (Definition 1)."""
        return tuple(p_of_domain_size(sf, s) for sf, s in zip(self.scaling_factors, self.domain_sizes))

    def location(self, rank: int) -> tuple[int, ...]:
        """Eq. 13: x_i = floor(m / prod_{j>i} SF^j) mod SF^i (row-major, like a DeviceMesh)."""
        out = []
        for i, sf in enumerate(self.scaling_factors):
            out.append(rank // math.prod(self.scaling_factors[i + 1:]) % sf)
        return tuple(out)

    def comm_type(self, m: int, n: int) -> tuple[CommKind, str] | None:
        """Alg. 1 over all levels: (kind, level name) of the link GPUs m and n use, or None."""
        loc_m, loc_n = self.location(m), self.location(n)
        for lv, (name, s) in enumerate(zip(self.level_names, self.domain_sizes)):
            # Alg. 1 line 8 compares only the faster coordinates; we also require the slower ones to
            # agree, so that a fast-level link never joins GPUs of two different slow-level workers.
            if loc_m[:lv] + loc_m[lv + 1:] != loc_n[:lv] + loc_n[lv + 1:]:
                continue
            (ed_m, off_m), (ed_n, off_n) = divmod(loc_m[lv], s), divmod(loc_n[lv], s)
            if ed_m == ed_n and off_m != off_n:
                return "AG", name
            if ed_m != ed_n and off_m == off_n:
                return "A2A", name
        return None

    def pairs(self) -> list[tuple[int, int, CommKind, str]]:
        """Every ordered GPU pair that communicates, O(world^2): for inspection and tests."""
        out = []
        for m, n in itertools.permutations(range(self.world_size), 2):
            c = self.comm_type(m, n)
            if c is not None:
                out.append((m, n, c[0], c[1]))
        return out

    def frequencies(self) -> dict[CommKind, int]:
        """Table VII: ordered GPU-to-GPU communications; per level a GPU has S^l - 1 AG peers and
        SF^l / S^l - 1 A2A peers (Alg. 1)."""
        w = self.world_size
        return {"A2A": w * sum(sf // s - 1 for sf, s in zip(self.scaling_factors, self.domain_sizes)),
                "AG": w * sum(s - 1 for s in self.domain_sizes)}

    def expert_domain(self, rank: int) -> list[int]:
        """Ranks whose experts ``rank`` holds after the gathers (same domain at every level)."""
        key = [x // s for x, s in zip(self.location(rank), self.domain_sizes)]
        return [r for r in range(self.world_size)
                if [x // s for x, s in zip(self.location(r), self.domain_sizes)] == key]

    def describe(self) -> str:
        rows = [f"{'level':<10}{'SF':>5}{'S_ED':>6}{'p':>7}{'AG peers':>10}{'A2A peers':>11}"]
        for name, sf, s, pr in zip(self.level_names, self.scaling_factors, self.domain_sizes, self.proportions):
            rows.append(f"{name:<10}{sf:>5}{s:>6}{pr:>7.3f}{s - 1:>10}{sf // s - 1:>11}")
        return "\n".join(rows)


# Multi-level time (our extension of Eq. 3, 4, 10) --------------------------------------------

@cache
def multilevel_model(num_levels: int) -> tuple[sp.Expr, sp.Expr, tuple[sp.Symbol, ...]]:
    """(Lat_AG, Lat_A2A one direction) over ``num_levels`` levels and the per-level symbols
    (SF_l, S_l, alpha_l_s, beta_l_s_per_byte for each l, slowest first)."""
    per_level = []
    ag: sp.Expr = sp.Integer(0)
    a2a: sp.Expr = sp.Integer(0)
    gathered = P_E_bytes
    for lv in range(num_levels):
        sf, s = sp.symbols(f"SF_{lv} S_{lv}", integer=True, positive=True)
        alpha, beta = sp.symbols(f"alpha_{lv}_s beta_{lv}_s_per_byte", positive=True)
        per_level += [sf, s, alpha, beta]
        ag += (s - 1) * (alpha + gathered * beta)  # Eq. 4 with |G^AG| = S_l
        a2a += (sf / s - 1) * alpha + D_bytes * (1 - s / sf) * beta  # Eq. 3 with |G^A2A| = SF_l / S_l
        gathered *= s
    return ag, a2a, tuple(per_level)


@cache
def _multilevel_fn(num_levels: int) -> Callable[..., tuple[float, float, float]]:
    ag, a2a, syms = multilevel_model(num_levels)
    total = sp.Max(lat_pe_s, ag) + 2 * a2a  # Eq. 10
    return sp.lambdify((D_bytes, P_E_bytes, lat_pe_s, *syms), (ag, a2a, total), modules="math")


@dataclass(frozen=True)
class StreamSizes:
    """D and P_E of Table I in bytes."""

    data_bytes: float
    expert_bytes: float

    @classmethod
    def from_workload(cls, workload: Workload, world_size: int, compression_ratio: float = 1.0) -> StreamSizes:
        """D = T * K * token bytes (each token goes to K experts); P_E = (E / G) experts' bytes,
        divided by the SR compression ratio (Section IV-B) when one is used."""
        data = workload.num_tokens * workload.top_k * workload.token_bytes
        experts = workload.num_experts / world_size * workload.expert_bytes / compression_ratio
        return cls(float(data), float(experts))


@dataclass(frozen=True)
class HybridEPTime:
    ag_s: float
    a2a_s: float  # one direction; the layer runs it twice
    total_s: float


def partition_time_s(topology: Topology, partition: DomainPartition, sizes: StreamSizes, *,
                     pre_expert_s: float = 0.0) -> HybridEPTime:
    """Predicted time of one MoE layer (forward) under ``partition`` on ``topology``."""
    args: list[float] = []
    for lv, s in zip(topology.levels, partition.domain_sizes):
        args += [lv.size, s, lv.alpha_s, lv.beta_s_per_byte]
    ag, a2a, total = _multilevel_fn(len(topology.levels))(sizes.data_bytes, sizes.expert_bytes, pre_expert_s, *args)
    return HybridEPTime(float(ag), float(a2a), float(total))


@dataclass(frozen=True)
class HybridEPPlan:
    partition: DomainPartition
    time: HybridEPTime
    candidates_s: dict[tuple[int, ...], float] = field(repr=False)


def choose_partition(topology: Topology, sizes: StreamSizes, *, pre_expert_s: float = 0.0) -> HybridEPPlan:
    """Argmin over every per-level choice of domain size; ties go to the smaller domains (fewer
    gathered experts in memory).  All-ones domain sizes are plain EP."""
    candidates = {}
    for choice in itertools.product(*(_divisors(lv.size) for lv in topology.levels)):
        part = DomainPartition.of(topology, choice)
        candidates[choice] = partition_time_s(topology, part, sizes, pre_expert_s=pre_expert_s).total_s
    best = min(candidates, key=lambda c: (candidates[c], math.prod(c), c))
    part = DomainPartition.of(topology, best)
    return HybridEPPlan(part, partition_time_s(topology, part, sizes, pre_expert_s=pre_expert_s), candidates)
