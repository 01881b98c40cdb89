"""The chunked expert-parallel pipeline: how long a layer takes when its tokens run in n chunks, and
the n to run (MoNTA, papers/monta.txt, Alg. 1-2 "Find Optimal Chunk Size", adapted to the staged
HD-d layer; DESIGN.md "Pipelined chunked streams").

MoNTA splits one AllToAll's data into N chunks along the sequence (its Eq. 4: I_j = I[:, (j-1)s/N :
js/N, :]) so that the stages of different chunks, which use different resources, run at the same
time; Alg. 1-2 search N up to the bound where a chunk falls below I_minimal (below it the fixed
overhead of a collective dominates: more chunks cost more than they hide) and keep the N with the
least predicted time. Here the stages are the layer's: chunk i's dispatch (HD-d's phases), its
local expert compute, its combine; the resources are the communication worker's lanes
(``moe_compile.ep.worker``: a thread per process group, i.e. per HD-d phase, each running its
phases in graph order, so chunk i's intra-node phase runs beside chunk i+1's inter-node phase:
MoNTA's AllToAll and AllGather streams) and the caller's thread that computes. Rather than MoNTA's closed forms for a two-stage
pipeline of equal stages (Alg. 1 lines 13-16), the schedule the expert-parallel pass emits is
simulated exactly, op by op, because it has three stages of unequal length on two resources:

    caller:  start D0, start D1, wait D0, L0, start C0, start D2, wait D1, L1, start C1, start D3, ...,
             wait D(n-1), L(n-1), start C(n-1), wait C0 .. C(n-1)
    lanes:   D0, D1, C0, D2, C1, D3, C2, ...  (each lane in the order the caller started them)

so while the experts compute chunk i, chunk i+1's tokens arrive and chunk i-1's results go back.
Backward runs the adjoint stages (combine's backward is dispatch-shaped, dispatch's backward
combine-shaped) with the local backward's compute; it is modelled by the same schedule with the
directions swapped.

Assumptions (each a term of the model):
  - a chunk's communication is, per phase, its fixed latency plus 1/n of the phase's transfer time
    (uniform routing: each chunk sends 1/n of the rows; ``Phase.chunk_s``); where the topology
    holds the level's measured efficiency curve (``moe-calibrate`` writes ``all_to_all_<level>``),
    1/n of the transfer at the efficiency r measured at 1/n of the buffer instead (MoNTA Eq. 8-9:
    a smaller message reaches less of the bandwidth, which the fitted alpha alone understates);
  - a chunk's compute is 1/n of the layer's plus a fixed per-chunk overhead (``overhead_s``:
    the topology's ``chunk_overhead_s`` where its file gives a measured one (``fit_chunk_overhead``
    fits it to timed runs of a layer in n chunks); else the default ``OP_OVERHEAD_S``, measured
    on CPU ranks);
  - the worker and the caller do not slow each other down (true when the transfer is on a link,
    not on the cores; on CPU ranks that share cores, measured overlap is less);
  - backward compute is ``BACKWARD_COMPUTE`` times forward's (the local backward recomputes the
    activations, then two matmuls per weight);
  - each chunk's backward gives the rank's expert weights a full-size gradient and autograd sums
    them: n - 1 adds over the weights (``LayerTimes.grad_sum_s``: two reads and a write of their
    bytes at the device's memory bandwidth), on the caller, after the chunks (measured on two CPU
    ranks, grouped GEMM layer E=8, H=F=256: the backward's adds grew 13 ms a step from 1 to 4
    chunks, of 64 ms the step grew; the smaller matmuls of smaller chunks took 16 ms more for the
    same FLOPs, which ``op_overhead_s`` stands for).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moe_compile.cost.topology import EfficiencyCurve

# a chunk's fixed cost per direction beyond its collectives' latencies: its stage ops (Python, the
# route, the split sizes' exchange), the smaller matmuls of a smaller chunk, the comm thread's
# copies competing with the caller for the core. Measured by moe-calibrate --chunk-overhead's
# probe (tools/calibrate.py) on CPU ranks on gloo, a core each (bench/results/pipeline.md,
# 2026-11-27): 5.4-5.6 ms at 400 Mbit, 4.4-5.4 ms at 1 Gbit. With the earlier default, 2 ms, the
# chunk count was within 5 % of the fastest in 2 of 6 configurations there; with 5 ms in 6 of 6
# (n = 1 throughout: no chunk count paid on that run). A cluster's own value (the topology's
# chunk_overhead_s) replaces it.
OP_OVERHEAD_S = 5e-3
BACKWARD_COMPUTE = 2.0
MAX_CHUNKS = 8
# chunks run only where the model predicts at least this fraction saved: its error is larger than
# a few per cent (bench/results/pipeline.md: at 1 Gbit it predicted 1-2 % saved by 2 chunks where
# they measured 6 % slower)
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Phase:
    """One all-to-all phase of a stage: its fixed latency and the time its bytes take (whole layer);
    where calibration measured its level's efficiency curve (``efficiency``, MoNTA's r(n), Eq. 8-9:
    the fraction of the fitted bandwidth the all-to-all reaches at send buffer n), also the whole
    layer's send buffer ``buffer_bytes``."""

    alpha_s: float
    transfer_s: float
    buffer_bytes: float = 0.0
    efficiency: EfficiencyCurve | None = None
    level: str = ""  # the mesh level whose curve ``efficiency`` is (for reports)

    def chunk_s(self, n: int) -> float:
        """One chunk's time in n: alpha + transfer / n (the alpha-beta fit), or with a measured
        curve what the all-to-all took at a chunk's buffer, (transfer / n) / r(buffer / n) (MoNTA
        looks r up at the chunk's size: start-up and small-message slowdown are both in r). Below
        the smallest measured size the time stays that size's (r proportional to the size: the
        start-up floor), not r's value there, which would make a tiny chunk cheap."""
        if self.efficiency is None or self.buffer_bytes <= 0 or self.transfer_s <= 0:
            return self.alpha_s + self.transfer_s / n
        size = self.buffer_bytes / n
        smallest = self.efficiency.sizes_bytes[0]
        r = self.efficiency(max(size, smallest)) * min(1.0, size / smallest)
        if r <= 0:
            raise ValueError(f"efficiency curve {self.efficiency} gives r <= 0 at {size:.0f} bytes")
        return self.transfer_s / n / r


@dataclass(frozen=True)
class LayerTimes:
    """An unchunked layer's stage times: dispatch's and combine's phases, the experts' compute;
    ``grad_sum_s``: what each chunk beyond the first adds to the backward by its own full-size
    expert weight gradients, which autograd sums (one add over the rank's expert weights)."""

    dispatch: tuple[Phase, ...]
    combine: tuple[Phase, ...]
    compute_s: float
    grad_sum_s: float = 0.0


Stage = float | Sequence[tuple[int, float]]  # one phase on lane 0, or (lane, seconds) per phase


def schedule_s(first: Stage, compute: float, last: Stage, n: int, overhead_s: float) -> float:
    """Simulated time of the emitted n-chunk schedule (module docstring) for per-chunk stage times
    ``first`` (the stage before the experts), ``compute`` and ``last`` (the one after): each a
    time on one lane, or its phases as (lane, seconds); the lanes are the communication worker's
    threads, one per process group (``moe_compile.ep.worker``), each running its phases in the
    order the stages were started, a stage's phases one after the other; the caller computes.
    n = 1 is the serial layer."""
    def phases(stage: Stage) -> Sequence[tuple[int, float]]:
        return [(0, stage)] if isinstance(stage, int | float) else stage

    lanes: dict[int, float] = {}
    caller = 0.0
    done: dict[tuple[str, int], float] = {}

    def start(kind: str, i: int) -> None:
        if 0 <= i < n:
            t = caller
            for lane, seconds in phases(first if kind == "D" else last):
                t = max(t, lanes.get(lane, 0.0)) + seconds
                lanes[lane] = t
            done[(kind, i)] = t

    start("D", 0)
    start("D", 1)
    for i in range(n):
        caller = max(caller, done[("D", i)]) + compute + (overhead_s if n > 1 else 0.0)
        start("C", i)
        start("D", i + 2)
    return max(caller, max(done[("C", i)] for i in range(n)))


def _lanes(phases: Sequence[Phase], n: int, reverse: bool) -> list[tuple[int, float]]:
    """A stage's chunk phases on their lanes: dispatch's phase j on lane j (its own group), the
    combine's phases the same groups in reverse."""
    k = len(phases)
    return [(k - 1 - j if reverse else j, p.chunk_s(n)) for j, p in enumerate(phases)]


def layer_s(times: LayerTimes, n: int, overhead_s: float = OP_OVERHEAD_S) -> tuple[float, float]:
    """(forward, backward) seconds of the layer in n chunks."""
    d, c = _lanes(times.dispatch, n, False), _lanes(times.combine, n, True)
    fw = schedule_s(d, times.compute_s / n, c, n, overhead_s)
    bw = schedule_s(c, BACKWARD_COMPUTE * times.compute_s / n, d, n, overhead_s)  # the adjoints
    return fw, bw + (n - 1) * times.grad_sum_s


def chunk_bound(times: LayerTimes, num_tokens: int, max_chunks: int = MAX_CHUNKS) -> int:
    """MoNTA Alg. 1-2 lines 5-8: the largest n whose chunks still carry at least I_minimal, read as
    the size at which a chunk's transfer equals its fixed latency, over the whole stage (the
    phases' transfers against their latencies summed: a fast phase with a large latency, like a
    loopback level, does not forbid chunking the slow one; its latencies are in the simulation);
    at most ``max_chunks`` and the token count (a chunk holds at least one token)."""
    phases = (*times.dispatch, *times.combine)
    alpha, transfer = sum(p.alpha_s for p in phases), sum(p.transfer_s for p in phases)
    bound = max_chunks if alpha <= 0 else min(max_chunks, max(1, math.floor(transfer / alpha)))
    return max(1, min(bound, num_tokens))


@dataclass(frozen=True)
class PipelineChoice:
    """The chunk count to run and the predicted forward+backward time of every n searched."""

    chunks: int
    times_s: dict[int, float]
    efficiency: tuple[str, ...] = ()  # the levels whose measured efficiency curves timed the chunks
    overhead_s: float = OP_OVERHEAD_S  # a chunk's fixed cost per direction the search assumed
    calibrated: bool = False  # ``overhead_s`` was measured (the topology's chunk_overhead_s)

    @property
    def serial_s(self) -> float:
        return self.times_s[1]

    @property
    def pipelined_s(self) -> float:
        return self.times_s[self.chunks]


def choose_chunks(times: LayerTimes, num_tokens: int, *, max_chunks: int = MAX_CHUNKS,
                  overhead_s: float = OP_OVERHEAD_S, min_gain: float = MIN_GAIN,
                  calibrated: bool = False) -> PipelineChoice:
    """MoNTA Alg. 1-2 on the simulated schedule: every n in 1..``chunk_bound``, the least
    forward+backward time wins, ties to the smaller n (the paper's strict <); n = 1 where chunking
    does not pay, or saves less than ``min_gain`` of the serial time."""
    bound = chunk_bound(times, num_tokens, max_chunks)
    predicted = {n: sum(layer_s(times, n, overhead_s)) for n in range(1, bound + 1)}
    best = min(predicted, key=lambda n: (predicted[n], n))
    if predicted[best] > (1.0 - min_gain) * predicted[1]:
        best = 1
    curves = tuple(dict.fromkeys(p.level or "?" for p in (*times.dispatch, *times.combine) if p.efficiency is not None))
    return PipelineChoice(best, predicted, curves, overhead_s, calibrated)


# the overheads fit_chunk_overhead tries: 0 to 100 ms per chunk and direction, in 0.1 ms steps
_OVERHEAD_GRID_S = tuple(i * 1e-4 for i in range(1001))


def fit_chunk_overhead(times: LayerTimes, measured_s: Mapping[int, float]) -> float:
    """The fixed cost per chunk and direction (``overhead_s``) with which the model best explains
    measured forward+backward times of one layer in n chunks (``measured_s``: n -> seconds, n = 1
    and at least one n > 1): least squares of the model's growth over n = 1, ``layer_s(n) -
    layer_s(1)``, against the measured growth, over n > 1. The growth is what the constant stands
    for (smaller matmuls, the stage ops, the fills: what the phase and compute terms leave out);
    the model's serial time itself is not fitted. The schedule is simulated, so the time is
    piecewise linear in the overhead (a caller waiting on a transfer absorbs it); the search is
    over a 0.1 ms grid up to 100 ms."""
    if 1 not in measured_s or not any(n > 1 for n in measured_s):
        raise ValueError(f"fit_chunk_overhead needs measured times at n = 1 and some n > 1, got n = {sorted(measured_s)}")
    growth = {n: t - measured_s[1] for n, t in measured_s.items() if n > 1}

    def error(o: float) -> float:
        base = sum(layer_s(times, 1, o))
        return sum((sum(layer_s(times, n, o)) - base - g) ** 2 for n, g in growth.items())

    return min(_OVERHEAD_GRID_S, key=error)


__all__ = ["BACKWARD_COMPUTE", "MAX_CHUNKS", "MIN_GAIN", "OP_OVERHEAD_S", "LayerTimes", "Phase", "PipelineChoice",
           "chunk_bound", "choose_chunks", "fit_chunk_overhead", "layer_s", "schedule_s"]
