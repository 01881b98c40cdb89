"""MoNTA's network-traffic-aware AllToAll model (Guo et al., "MoNTA: Accelerating Mixture-of-Experts
Training with Network-Traffic-Aware Parallel Optimization"; /work/shared/papers/monta.txt).

Under tensor parallelism of degree t the t ranks of a node hold the same tokens, so the dispatch
AllToAll is rewritten as Drop + inter-node AllToAll of 1/t of the data + intra-node AllGather (O1),
chunked so the AllGather of chunk j overlaps the AllToAll of chunk j+1 (O2, with a device-to-device
copy per chunk restoring the layout), and with the copy of chunk j overlapping the AllGather of chunk
j+1 as well (O3).  Each option's time is a sympy expression below; Alg. 1-2 search the chunk count N,
Alg. 3 takes the fastest option.

Topology reading (the paper has two levels): the slowest level is "inter-node": e = its size (the
expert-parallel group, one rank per node), B1 = its bandwidth.  Every faster level together is "the
node": t = the product of their sizes (the tensor-parallel group), B2 = the bandwidth of the slowest
of them (a ring AllGather spanning several levels runs at its slowest link).  A one-level topology
has t = 1: no Drop/AllGather, O1 is the plain AllToAll.  B3 = the smallest device memory bandwidth.

Efficiency curves r(size), read from ``Topology.efficiency`` by name, each falling back to the
paper's measurements (``PAPER_EFFICIENCY``) when the topology has none of that name:
``all_to_all`` (r1, and r_base of the baseline), ``all_gather`` (r2), ``d2d_copy`` (r3), and for
O3 ``all_gather_o3`` / ``d2d_copy_o3`` (Sec. "Performance model": under O3 the AllGather and the copy
compete for load/store units, so their efficiencies may differ; default: the O2 curves).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import sympy as sp

from moe_compile.cost.topology import EfficiencyCurve, Topology
from moe_compile.cost.workload import Workload

# --- symbols (units in the names; r* are dimensionless fractions of the link bandwidth) ------------
I_bytes = sp.Symbol("I_bytes", positive=True)  # MoNTA Eq. 3: one AllToAll's volume per rank
I_min_bytes = sp.Symbol("I_min_bytes", positive=True)  # Alg. 1-2 input I_minimal
t = sp.Symbol("t", positive=True, integer=True)  # tensor-parallel degree = ranks per node
e = sp.Symbol("e", positive=True, integer=True)  # expert-parallel degree = nodes
N = sp.Symbol("N", positive=True, integer=True)  # chunk count, Eq. 4
B1_bytes_per_s = sp.Symbol("B1_bytes_per_s", positive=True)  # inter-node (AllToAll) bandwidth
B2_bytes_per_s = sp.Symbol("B2_bytes_per_s", positive=True)  # intra-node (AllGather) bandwidth
B3_bytes_per_s = sp.Symbol("B3_bytes_per_s", positive=True)  # memory bandwidth (D2D copy)
r1, r2, r3 = sp.symbols("r1 r2 r3", positive=True)  # r_all_to_all(I/(N t)), r_all_gather(I/N), r_d2d(I/N)
r_base = sp.Symbol("r_base", positive=True)  # r_all_to_all(I) of the unoptimized AllToAll

OPTIONS = ("O1", "O2", "O3")  # Table 6; "baseline" is the original AllToAll


def aa_chunk_s() -> sp.Expr:
    """One chunk's inter-node AllToAll: I/(N t) bytes, (e-1)/e of them leave the node.

    Assumptions: after the Drop each of the t ranks sends its own 1/t slice; only the inter-node
    link costs time (intra-node pieces of the AllToAll are free); no fixed latency term, which the
    efficiency r1 looked up at size I/(N t) absorbs (the paper's Fig. 13 curves)."""
    return I_bytes / (N * t) * (e - 1) / e / (B1_bytes_per_s * r1)  # MoNTA Eq. 8


def ag_chunk_s() -> sp.Expr:
    """One chunk's intra-node AllGather of I/N bytes over the t ranks of a node.

    Assumptions: ring AllGather, each rank receives (t-1)/t of the chunk at B2 r2, r2 looked up at
    I/N."""
    return I_bytes / N * (t - 1) / t / (B2_bytes_per_s * r2)  # MoNTA Eq. 9


def d2d_chunk_s() -> sp.Expr:
    """One chunk's device-to-device copy to its interleaved place (Fig. 8 step 3).

    Assumptions: I/N bytes copied at B3 r3 (r3 looked up at I/N)."""
    return I_bytes / N / (B3_bytes_per_s * r3)  # MoNTA Eq. 10


def t_baseline_s() -> sp.Expr:
    """The original AllToAll (Table 6 "Baseline"; the denominator of Eq. 13-16).

    Assumptions: every TP rank sends its full, redundant I; (e-1)/e of it crosses the inter-node
    link (the paper's equivalent-bandwidth formula S(N-8)/(N t) for 2 nodes); efficiency r_base is
    the AllToAll curve at size I.  It is Eq. 8 with N = t = 1.  The paper's Eq. 13-16 put
    r_base = r1 (Eq. 13: "r1 ≈ r2"; Eq. 15-16 only reproduce with r_base = r1 = 0.427)."""
    return I_bytes * (e - 1) / e / (B1_bytes_per_s * r_base)  # MoNTA Eq. 8 at N = t = 1


def t_o1_s() -> sp.Expr:
    """O1: Drop + inter-node AllToAll + intra-node AllGather, one after the other.

    Assumptions: no chunking (N = 1), no overlap, no D2D copy (the layout is already the original,
    Fig. 8 step 1); r1 at size I/t, r2 at size I."""
    return I_bytes / t * (e - 1) / e / (B1_bytes_per_s * r1) + I_bytes * (t - 1) / t / (B2_bytes_per_s * r2)  # Eq. 11


def t_o2_s() -> sp.Expr:
    """O2: N chunks, AllToAll of chunk j+1 overlapping AllGather + D2D copy of chunk j.

    Assumptions: a two-stage pipeline (stage 1 AllToAll on the inter-node link, stage 2 AllGather
    then copy); equal chunks (no jitter, Eq. 5-7); the slower stage runs N times and the faster
    once.  At N = 1 there is no overlap: AllToAll + AllGather + copy (the paper keeps the copy at
    N = 1, though Fig. 8 needs none for a single chunk; that is why O1 is a separate option)."""
    aa, ag, d2d = aa_chunk_s(), ag_chunk_s(), d2d_chunk_s()
    return sp.Piecewise((aa + N * (ag + d2d), aa < ag + d2d),  # MoNTA Alg. 1 lines 13-14
                        (N * aa + ag + d2d, True))  # MoNTA Alg. 1 line 16


def t_o3_s() -> sp.Expr:
    """O3: O2 with the D2D copy of chunk j overlapping the AllGather of chunk j+1.

    Assumptions: a three-stage pipeline in which the copy is never the slowest stage (the paper's
    Alg. 2 only compares AllToAll with AllGather; a copy-bound pipeline would be N D2D_j + AA_j +
    AG_j); r2, r3 may differ from O2's (curves ``all_gather_o3``, ``d2d_copy_o3``)."""
    aa, ag, d2d = aa_chunk_s(), ag_chunk_s(), d2d_chunk_s()
    return sp.Piecewise((aa + N * ag + d2d, aa < ag),  # MoNTA Alg. 2 lines 13-14
                        (N * aa + ag + d2d, True))  # MoNTA Alg. 2 line 16


def aa_ag_ratio() -> sp.Expr:
    """AA_j / AG_j, derived from Eq. 8-9 (the paper's Eq. 12); independent of N and I."""
    return sp.simplify(aa_chunk_s() / ag_chunk_s())  # MoNTA Eq. 12


@cache
def chunk_bound() -> sp.Expr:
    """Largest N with both chunk sizes >= I_minimal (Alg. 1-2 lines 5-8), solved by sympy;
    take its floor.  With t >= 1 the AllToAll chunk I/(N t) binds."""
    sizes = (I_bytes / (N * t), I_bytes / N)  # Alg. 1 line 5: I_AA, I_AG
    n = sp.Symbol("n", positive=True)
    return sp.Min(*(sp.solve(sp.Eq(size.subs(N, n), I_min_bytes), n)[0] for size in sizes))


@cache
def _bound_fn() -> Callable[..., Any]:
    return sp.lambdify((I_bytes, t, I_min_bytes), chunk_bound(), "numpy")


@cache
def o3_limit_ratio() -> sp.Expr:
    """lim_{N→∞} T_O3 / T_base on the AllGather-bound branch (AA_j < AG_j): the "theoretical upper
    limit of the speedup" of Eq. 13, derived by sympy."""
    ag_bound = t_o3_s().args[0].expr
    return sp.simplify(sp.limit(ag_bound / t_baseline_s(), N, sp.oo))


def speedup_ratio(option: str) -> sp.Expr:
    """T_option / T_base (the left-hand sides of Eq. 13-16)."""
    return _models()[option] / t_baseline_s()


@cache
def _models() -> dict[str, sp.Expr]:
    return {"baseline": t_baseline_s(), "O1": t_o1_s(), "O2": t_o2_s(), "O3": t_o3_s()}


_ARGS = (I_bytes, t, e, N, B1_bytes_per_s, B2_bytes_per_s, B3_bytes_per_s, r1, r2, r3, r_base)


@cache
def _lambdified() -> dict[str, Callable[..., Any]]:
    return {name: sp.lambdify(_ARGS, expr, "numpy") for name, expr in _models().items()}


# --- the paper's own numbers (Sec. Evaluation, Table 5, Table 8, Eq. 13-16) ------------------------
# Sizes: the paper's "M" read as 1e6 bytes, as Table 8's latencies need (256e6 B / (25e9 B/s · 0.741)
# · 1/2 = 6.909 ms).  AllToAll: 8M 0.427, 32M 0.632 (Eq. 14 and the 1.012 ms of Table 8; the table's
# column says 63.3 %), 256M 0.741.  AllGather: 64M 0.726, 256M 0.776, and 0.803 (Eq. 13) at the 2048M
# chunk of the 256K run.  D2D copy: 80 % at 64M.  Below / above the points r is held constant.
PAPER_EFFICIENCY: dict[str, EfficiencyCurve] = {
    "all_to_all": EfficiencyCurve((8e6, 32e6, 256e6), (0.427, 0.632, 0.741)),
    "all_gather": EfficiencyCurve((64e6, 256e6, 2048e6), (0.726, 0.776, 0.803)),
    "d2d_copy": EfficiencyCurve((64e6,), (0.80,)),
}
# 2 nodes x 8 A800: IB 200 Gb/s = 25 GB/s, NVLink 200 GB/s unidirectional (Table 5, "B2/B1 = 200/25");
# B3 is not given: 1.6e12 B/s is what Table 8's 0.05 ms for a 64M copy at 80 % implies.
PAPER_CLUSTER: dict[str, float] = {"t": 8, "e": 2, "B1_bytes_per_s": 25e9, "B2_bytes_per_s": 200e9,
                                   "B3_bytes_per_s": 1.6e12}
_FALLBACK = {"all_gather_o3": "all_gather", "d2d_copy_o3": "d2d_copy"}


@dataclass(frozen=True)
class MontaParams:
    """Numbers for the model: I (Eq. 3), t, e, B1-B3, I_minimal and the efficiency curves by name."""

    volume_bytes: float
    tp_size: int
    ep_size: int
    inter_bytes_per_s: float
    intra_bytes_per_s: float
    mem_bytes_per_s: float
    min_chunk_bytes: float
    efficiency: Mapping[str, EfficiencyCurve]

    def r(self, name: str, size_bytes: Any) -> Any:
        """Efficiency ``name`` at ``size_bytes`` (array or scalar), as EfficiencyCurve interpolates."""
        curve = self.efficiency.get(name) or self.efficiency.get(_FALLBACK.get(name, "")) \
            or PAPER_EFFICIENCY[_FALLBACK.get(name, name)]
        return np.interp(size_bytes, curve.sizes_bytes, curve.values)


def monta_params(topology: Topology, workload: Workload, *, min_chunk_bytes: float | None = None) -> MontaParams:
    """The two-level reading of ``topology`` (module docstring) and I = T·K·H·bytes of ``workload``.

    Eq. 3's I = b·s·h·BPE counts each token once; a top-K router sends K copies, so I counts them
    (K = 1 is the paper's form).  Default I_minimal: the larger of the first measured size of the
    ``all_to_all`` curve (below it r is extrapolated) and max_i alpha_i / beta_i (the size below
    which a level's fixed latency outweighs its transfer time: the paper's definition)."""
    inter, intra = topology.levels[0], topology.levels[1:]
    curves = {**PAPER_EFFICIENCY, **topology.efficiency}
    if min_chunk_bytes is None:
        min_chunk_bytes = max([curves["all_to_all"].sizes_bytes[0]]
                              + [lv.alpha_s / lv.beta_s_per_byte for lv in topology.levels])
    return MontaParams(
        volume_bytes=float(workload.num_tokens * workload.top_k * workload.token_bytes),
        tp_size=math.prod(lv.size for lv in intra), ep_size=inter.size,
        inter_bytes_per_s=1.0 / inter.beta_s_per_byte,
        intra_bytes_per_s=min((1.0 / lv.beta_s_per_byte for lv in intra), default=1.0 / inter.beta_s_per_byte),
        mem_bytes_per_s=min(topology.mem_bw_bytes_per_s), min_chunk_bytes=float(min_chunk_bytes),
        efficiency=dict(topology.efficiency))


def option_time_s(params: MontaParams, option: str, num_chunks: Any = 1) -> Any:
    """Predicted time of ``option`` ("baseline", "O1", "O2", "O3") with ``num_chunks`` chunks
    (an int or an integer array; ignored by baseline and O1), efficiencies looked up per chunk size."""
    n = np.asarray(num_chunks, dtype=float) if option in ("O2", "O3") else np.asarray(1.0)
    i_bytes, tp = params.volume_bytes, params.tp_size
    sfx = "_o3" if option == "O3" else ""
    values = (i_bytes, tp, params.ep_size, n, params.inter_bytes_per_s, params.intra_bytes_per_s,
              params.mem_bytes_per_s, params.r("all_to_all", i_bytes / (n * tp)),
              params.r("all_gather" + sfx, i_bytes / n), params.r("d2d_copy" + sfx, i_bytes / n),
              params.r("all_to_all", i_bytes))
    out = np.broadcast_to(_lambdified()[option](*values), np.shape(num_chunks))
    return float(out) if out.ndim == 0 else out


def optimal_chunks(params: MontaParams, option: str, *, max_chunks: int = 1 << 16) -> tuple[int, float]:
    """MoNTA Alg. 1 (O2) / Alg. 2 (O3): the N in 1..floor(chunk_bound()) with the least time, and that
    time.  A search, since r varies with the chunk size; ties go to the smaller N (the paper's strict <;
    its lines 18-19 "if T < T_min then T = T_min" are read as T_min = T, remembering N).
    With constant efficiencies both branches fall with N, so the bound itself wins.  Where even one
    chunk is below I_minimal (the paper's loop would return T = ∞) a single chunk is kept."""
    bound = _bound_fn()(params.volume_bytes, params.tp_size, params.min_chunk_bytes)
    n_max = max(1, min(max_chunks, math.floor(bound)))
    times = option_time_s(params, option, np.arange(1, n_max + 1))
    best = int(np.argmin(times))
    return best + 1, float(times[best])


@dataclass(frozen=True)
class MontaChoice:
    """Alg. 3's answer: the chosen option, every option's time and chunk count, the baseline's time."""

    strategy: str
    times_s: dict[str, float]
    chunks: dict[str, int]
    baseline_s: float


def select_strategy(params: MontaParams) -> MontaChoice:
    """MoNTA Alg. 3: T_O1 (Eq. 11), T_O2 and T_O3 at their optimal N (Alg. 1-2), the least wins
    (ties to the simpler option, in Table 6's order)."""
    chunks = {"O1": 1}
    times = {"O1": option_time_s(params, "O1")}
    for option in ("O2", "O3"):
        chunks[option], times[option] = optimal_chunks(params, option)
    strategy = min(OPTIONS, key=lambda o: times[o])  # MoNTA Alg. 3 line 2
    return MontaChoice(strategy, times, chunks, option_time_s(params, "baseline"))


def plan(topology: Topology, workload: Workload, *, min_chunk_bytes: float | None = None) -> MontaChoice:
    """``select_strategy`` on ``monta_params(topology, workload)``."""
    return select_strategy(monta_params(topology, workload, min_chunk_bytes=min_chunk_bytes))
