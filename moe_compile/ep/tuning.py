"""The step's all-to-all dimension d from the HierMoE model corrected by measurement.

HierMoE's d* (papers/hiermoe.txt Eq. 6 / Alg. 1) compares the model's t_1..t_D (Eq. 1-5). The
model knows the links (alpha, beta per level) and the routing (the p statistics), not what a
phase costs on the ranks themselves: the split-size exchange before each dispatch phase, the
packing and index work on cores the model's compute shares, the padding assumption of Eq. 2
(every destination sent as much as the busiest) where routing is uneven. Where two d are close,
that difference decides, and the model alone can pick the slower one (bench/results/e2e.md).

So the runtime measures. ``DimensionTuner`` keeps, per d, the last ``WINDOW`` offsets

    o_d = measured_d - t_d,

measured_d being the training step's wall time as the layer sees it (from one forward of the
layer to the next, over the 4 transfers of a forward and backward: a transfer is one dispatch or
combine of the layer's tokens), the least of the ranks'. Not the stages' own seconds: with the
stages split into start and wait, run on lanes and in chunks, a stage's wall time holds waits for
other lanes and for the caller, and on the emulated cluster it ranked d=1 ahead of d=2 at K=8
where d=2's steps are 15 % faster (bench/results/e2e.md). The step holds everything a d costs;
what it holds besides (the other layers, the optimizer) is the same for every d and goes into
the offset. Every layer explores the same d in the same steps (the same schedule), so what an
exploring step measures is the model run at that d throughout;
and t_d the model's prediction the step was decided on. It decides

    d = argmin_d  t_d + median(o_d)

(Eq. 6's rule on the corrected times): the model follows the routing from step to step, the
offset carries what the model misses, additive because what it misses is mostly a fixed
per-phase cost. Before every candidate has ``rounds`` measurements the step explores: it runs
the candidate measured least so far (a candidate: a d the model predicts within
``EXPLORE_WITHIN`` of the best; the others are never worth a step). A d never measured is
corrected by the largest offset measured (pessimistic, so it is not chosen for lack of data).

Every rank decides alike: the inputs are the agreed statistics' predictions, the measurements
every rank received in the same exchange, and the tuner's own history, the same everywhere.
The first step of a layer is not measured (process groups connect on first use).

Off by default (``tune_dimension`` = 0): the step period holds whatever runs between two steps,
so it measures the d only where steps run back to back. bench/bench_e2e.py interleaves its
variants' steps (each period then holds every other variant's step: offsets of 0.7-3.8 s, a
d=1 sample twice the other), and an evaluation or a checkpoint between two exploring steps
would decide a layer's d for good on one outlier. Where steps do run back to back, 2 rounds
settle d for the layers whose predictions are within 2x; the stages' own seconds (summed, or
spanned per direction) ranked d=1 ahead of d=2 at K=8 where d=2's steps are 15 % faster.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moe_compile.cost.hiermoe import dimension_rule

TUNE_ROUNDS = 0  # options['tune_dimension']'s default: off (see the module docstring's last paragraph)
WINDOW = 8  # offsets kept per d: the median of the last 8 steps follows a slow drift
EXPLORE_WITHIN = 2.0  # a d predicted slower than twice the best is not explored


@dataclass
class DimensionTuner:
    """Per-layer measured correction of t_d (module docstring). ``rounds``: measurements of every
    candidate before the corrected rule decides alone (0: the model alone, Eq. 6)."""

    rounds: int
    offsets_s: dict[int, list[float]] = field(default_factory=dict)
    tried: dict[int, int] = field(default_factory=dict)  # steps run with each d (measured or in flight)
    # steps decided and not yet measured, oldest first: (step index, d, the model's t_d for it)
    pending: deque[tuple[int, int, float]] = field(default_factory=deque)

    def choose(self, times_s: Sequence[float], step: int, *, measure: bool = True) -> int:
        """d (1-based) for step number ``step`` from the model's t_1..t_D. ``measure``: this step
        will be measured (False for a layer's first step)."""
        times = [float(t) for t in times_s]
        if self.rounds <= 0:
            return dimension_rule(times)
        best = min(times)
        candidates = [d for d, t in enumerate(times, 1) if t <= EXPLORE_WITHIN * best]
        short = [d for d in candidates if self.tried.get(d, 0) < self.rounds]
        if short and measure:
            d = min(short, key=lambda c: (self.tried.get(c, 0), times[c - 1]))
        else:
            d = dimension_rule(self.corrected_s(times))
        if measure:
            self.tried[d] = self.tried.get(d, 0) + 1
            self.pending.append((step, d, times[d - 1]))
        return d

    def corrected_s(self, times_s: Sequence[float]) -> list[float]:
        """t_d + median(o_d) for every d (a d without measurements: the largest offset's median)."""
        medians = {d: float(np.median(o)) for d, o in self.offsets_s.items() if o}
        worst = max(medians.values(), default=0.0)
        return [float(t) + medians.get(d, worst) for d, t in enumerate(times_s, 1)]

    def observe(self, step: int, measured_s: float) -> None:
        """Step ``step``'s measured seconds per transfer (agreed by every rank); steps decided
        before it and never measured are dropped."""
        while self.pending and self.pending[0][0] < step:
            self.pending.popleft()
        if not self.pending or self.pending[0][0] != step:
            return
        _, d, predicted_s = self.pending.popleft()
        window = self.offsets_s.setdefault(d, [])
        window.append(measured_s - predicted_s)
        del window[:-WINDOW]
