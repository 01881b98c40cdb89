"""HEXA-MoE (Luo et al., MLSys 2025): an MoE layer whose experts are sharded along the FFN hidden
dimension over N devices, run data-centric (gather the weights, keep the tokens) or model-centric
(gather the tokens, keep the weights), Section 4.3, and the heterogeneous split of Section 4.4
(Eq. 1-2).

The paper describes which collective moves what and what overlaps with what, but prints no time
or memory formula; the expressions below write those descriptions down.

Assumptions: every device holds F/N of every expert of a layer (Section 4.3).  Data-centric: an
AllGather of the layer's weights W into the pipeline-shared cache, overlapped with the attention
and router ("pre-MoE") compute (Fig. 6a), then the local T tokens through whole experts; in
training the weights are gathered again for backward (the cache keeps one layer) and the weight
gradients are reduce-scattered to their shard owners.  Model-centric: an AllGather of the N*T
tokens, every device runs them through its F/N slice, and the partial outputs are all-reduced
(sum) as the paper states (a reduce-scatter would halve it); backward swaps the two collectives,
same volumes.  Backward compute is twice forward (pre-MoE and expert).  Collectives are ring /
hierarchical: over a Topology each level, slowest first, exchanges the pieces gathered so far with
its size - 1 peers at alpha_l + bytes * beta_l per message; an all-reduce is a reduce-scatter plus
an all-gather.  Memory counts one MoE layer's peak: weight shards of all layers, the cache
(one gathered layer; Janus-style without cache: every layer gathered), and activations: input and
output tokens plus the (m - 1) * F hidden values per (token, expert) pair (atomic-add top-k,
Fig. 5c), m = 3 matrices for gated experts, 2 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cache, lru_cache
from typing import Literal

import sympy as sp

from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import Workload

N = sp.Symbol("N", integer=True, positive=True)  # devices
T_tokens = sp.Symbol("T_tokens", positive=True)  # tokens per device
H, F, E, K = sp.symbols("H F E K", integer=True, positive=True)
m_mats = sp.Symbol("m_mats", integer=True, positive=True)  # weight matrices per expert (2 or 3)
dtype_bytes = sp.Symbol("dtype_bytes", positive=True)
flops_per_s = sp.Symbol("flops_per_s", positive=True)
alpha_s = sp.Symbol("alpha_s", nonnegative=True)
beta_s_per_byte = sp.Symbol("beta_s_per_byte", positive=True)
pre_moe_s = sp.Symbol("pre_moe_s", nonnegative=True)  # attention + router forward
num_layers = sp.Symbol("num_layers", integer=True, positive=True)
# the collective and compute times the totals are composed of (filled per topology)
t_ag_w_s, t_rs_w_s, t_ag_x_s, t_ar_y_s, t_expert_s = sp.symbols(
    "t_ag_w_s t_rs_w_s t_ag_x_s t_ar_y_s t_expert_s", nonnegative=True)

Mode = Literal["data_centric", "model_centric"]


@dataclass(frozen=True)
class HexaModel:
    weight_bytes: sp.Expr  # W: one layer's experts
    compose: dict[str, sp.Expr]  # totals in the t_*_s symbols
    flat: dict[str, sp.Expr]  # totals on one alpha-beta link, homogeneous devices
    memory_bytes: dict[str, sp.Expr]
    crossover_tokens: sp.Expr  # T where data- and model-centric forward times are equal


def _ring_all_gather(piece_bytes: sp.Expr) -> sp.Expr:
    return (N - 1) * (alpha_s + piece_bytes * beta_s_per_byte)


@lru_cache(maxsize=1)
def hexa_model() -> HexaModel:
    w = E * m_mats * H * F * dtype_bytes
    compose = {
        # Section 4.3 data-centric: AG of weights hides under pre-MoE compute (Fig. 6a)
        "data_centric_forward": sp.Max(pre_moe_s, t_ag_w_s) + t_expert_s,
        "data_centric_train": sp.Max(pre_moe_s, t_ag_w_s) + sp.Max(2 * pre_moe_s, t_ag_w_s)
        + 3 * t_expert_s + t_rs_w_s,
        # Section 4.3 model-centric: AG tokens -> ESMM on the local slice -> all-reduce outputs
        "model_centric_forward": pre_moe_s + t_ag_x_s + t_expert_s + t_ar_y_s,
        "model_centric_train": 3 * pre_moe_s + 2 * (t_ag_x_s + t_ar_y_s) + 3 * t_expert_s,
    }
    flops_pair = 2 * m_mats * H * F  # one (token, expert) pair, forward
    expert_dc = T_tokens * K * flops_pair / flops_per_s  # local tokens, whole experts
    expert_mc = N * T_tokens * K * 2 * m_mats * H * (F / N) / flops_per_s  # all tokens, F/N slice
    assert sp.simplify(expert_dc - expert_mc) == 0  # same work per device either way
    token_bytes = H * dtype_bytes
    subs = {t_ag_w_s: _ring_all_gather(w / N), t_rs_w_s: _ring_all_gather(w / N),
            t_ag_x_s: _ring_all_gather(T_tokens * token_bytes),
            t_ar_y_s: 2 * _ring_all_gather(N * T_tokens * token_bytes / N), t_expert_s: expert_dc}
    flat = {k: v.xreplace(subs) for k, v in compose.items()}
    hidden = T_tokens * K * (m_mats - 1) * F
    memory = {
        "data_centric": (num_layers * w / N + w + (2 * T_tokens * H + hidden) * dtype_bytes),
        "data_centric_no_cache": (num_layers * w + (2 * T_tokens * H + hidden) * dtype_bytes),
        "model_centric": (num_layers * w / N + (2 * N * T_tokens * H + hidden) * dtype_bytes),
    }
    no_overlap = {pre_moe_s: 0}
    (crossover,) = sp.solve(sp.Eq(flat["data_centric_forward"].xreplace(no_overlap),
                                  flat["model_centric_forward"].xreplace(no_overlap)), T_tokens)
    return HexaModel(w, compose, flat, memory, sp.simplify(crossover))


@cache
def _compose_fn(name: str) -> Callable[..., float]:
    args = (pre_moe_s, t_ag_w_s, t_rs_w_s, t_ag_x_s, t_ar_y_s, t_expert_s)
    return sp.lambdify(args, hexa_model().compose[name], modules="math")


def heterogeneous_split(total: int, times_or_speeds: Sequence[float], *, speeds: bool = False,
                        multiple_of: int = 1) -> list[int]:
    """Eq. 1-2: share_i = (1/t_i) / sum_j (1/t_j) * total (or speed_i / sum speeds), in whole units.

    Largest-remainder (Hamilton) rounding, exact in rationals: every device first gets the floor of
    its quota (in units of ``multiple_of``, e.g. a kernel block size for h_i), then the units left
    over go one each to the largest fractional remainders; ties go to the faster device, then the
    lower index.  So the result sums exactly to ``total`` and each share is within one unit of its
    quota.  Used for the batch split B_i (Eq. 1) and the FFN hidden split h_i (Eq. 2)."""
    if not times_or_speeds or any(v <= 0 for v in times_or_speeds):
        raise ValueError(f"need one positive time (or speed) per device, got {list(times_or_speeds)}")
    if total < 0 or multiple_of < 1 or total % multiple_of:
        raise ValueError(f"total {total} must be a non-negative multiple of multiple_of={multiple_of}")
    weights = [Fraction(v) if speeds else 1 / Fraction(v) for v in times_or_speeds]
    units = total // multiple_of
    quotas = [units * wt / sum(weights) for wt in weights]
    shares = [int(q) for q in quotas]  # floor: quotas are non-negative
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - shares[i]), -weights[i], i))
    for i in order[:units - sum(shares)]:
        shares[i] += 1
    return [s * multiple_of for s in shares]


def capacity_proportions(times: Sequence[float]) -> list[float]:
    """Computing-capacity proportion R_i = (1/t_i) / sum_j (1/t_j) (Table 3, the weights of Eq. 1-2)."""
    inv = [1.0 / t for t in times]
    return [v / sum(inv) for v in inv]


def hier_all_gather_s(topology: Topology, piece_bytes: float) -> float:
    """All-gather where each device contributes ``piece_bytes``: slowest level first, each level
    exchanging what was gathered above it (equal to the ring formula on one level)."""
    total, piece = 0.0, piece_bytes
    for lv in topology.levels:
        total += (lv.size - 1) * (lv.alpha_s + piece * lv.beta_s_per_byte)
        piece *= lv.size
    return total


def _expert_flops_per_pair(workload: Workload) -> float:
    return float(workload.expert_flops_per_token())


def data_centric_time_s(topology: Topology, workload: Workload, *, pre_moe_s: float = 0.0, training: bool = False,
                        token_split: Sequence[int] | None = None) -> float:
    """One MoE layer, data-centric.  The N*T tokens are split over the devices by Eq. 1 from the
    topology's per-device FLOP rates (t_i proportional to 1/flops_i) unless ``token_split`` is given."""
    n = topology.world_size
    rates = [topology.device_flops(r) for r in range(n)]
    split = list(token_split) if token_split is not None else heterogeneous_split(
        n * workload.num_tokens, rates, speeds=True)
    expert = max(b * workload.top_k * _expert_flops_per_pair(workload) / f for b, f in zip(split, rates))
    shard = workload.num_experts * workload.expert_bytes / n
    ag_w = hier_all_gather_s(topology, shard)
    name = "data_centric_train" if training else "data_centric_forward"
    return float(_compose_fn(name)(pre_moe_s, ag_w, ag_w, 0.0, 0.0, expert))


def model_centric_time_s(topology: Topology, workload: Workload, *, pre_moe_s: float = 0.0, training: bool = False,
                         hidden_split: Sequence[int] | None = None) -> float:
    """One MoE layer, model-centric: every device runs all N*T tokens through its h_i columns of F
    (Eq. 2 from the per-device FLOP rates unless ``hidden_split`` is given)."""
    n = topology.world_size
    rates = [topology.device_flops(r) for r in range(n)]
    split = list(hidden_split) if hidden_split is not None else heterogeneous_split(
        workload.ffn_size, rates, speeds=True)
    per_column = _expert_flops_per_pair(workload) / workload.ffn_size
    expert = max(n * workload.num_tokens * workload.top_k * per_column * h / f for h, f in zip(split, rates))
    ag_x = hier_all_gather_s(topology, workload.num_tokens * workload.token_bytes)
    ar_y = 2 * hier_all_gather_s(topology, workload.num_tokens * workload.token_bytes)
    name = "model_centric_train" if training else "model_centric_forward"
    return float(_compose_fn(name)(pre_moe_s, 0.0, 0.0, ag_x, ar_y, expert))


@cache
def _memory_fn(name: str) -> Callable[..., float]:
    args = (N, T_tokens, H, F, E, K, m_mats, dtype_bytes, num_layers)
    return sp.lambdify(args, hexa_model().memory_bytes[name], modules="math")


def memory_bytes(workload: Workload, num_devices: int, mode: Mode, *, layers: int = 1,
                 shared_cache: bool = True) -> float:
    """Peak bytes on one device while it runs one MoE layer (Section 4.3; Fig. 8 compares them)."""
    name = mode if mode == "model_centric" or shared_cache else "data_centric_no_cache"
    return float(_memory_fn(name)(num_devices, workload.num_tokens, workload.hidden_size, workload.ffn_size,
                                  workload.num_experts, workload.top_k, 3 if workload.gated else 2,
                                  workload.dtype_bytes, layers))


@dataclass(frozen=True)
class HexaPlan:
    mode: Mode
    data_centric_s: float
    model_centric_s: float
    token_split: list[int]
    hidden_split: list[int]


def choose_execution(topology: Topology, workload: Workload, *, pre_moe_s: float = 0.0,
                     training: bool = False) -> HexaPlan:
    """Data- or model-centric, whichever the model predicts faster (ties -> data-centric), with the
    Eq. 1 / Eq. 2 splits from the topology's per-device FLOP rates."""
    rates = [topology.device_flops(r) for r in range(topology.world_size)]
    tokens = heterogeneous_split(topology.world_size * workload.num_tokens, rates, speeds=True)
    hidden = heterogeneous_split(workload.ffn_size, rates, speeds=True)
    dc = data_centric_time_s(topology, workload, pre_moe_s=pre_moe_s, training=training, token_split=tokens)
    mc = model_centric_time_s(topology, workload, pre_moe_s=pre_moe_s, training=training, hidden_split=hidden)
    return HexaPlan("data_centric" if dc <= mc else "model_centric", dc, mc, tokens, hidden)
