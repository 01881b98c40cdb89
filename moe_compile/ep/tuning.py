"""The step's all-to-all dimension d from the HierMoE model corrected by measurement.

HierMoE's d* (papers/hiermoe.txt Eq. 6 / Alg. 1) compares the model's t_1..t_D (Eq. 1-5). The
model knows the links (alpha, beta per level) and the routing (the p statistics), not what a
phase costs on the ranks themselves: the split-size exchange before each dispatch phase, the
packing and index work on cores the model's compute shares, a link the ranks of a node share
(the model's beta is per rank, so uneven routing inside a node looks slower than it runs). Where two d are close,
that difference decides, and the model alone can pick the slower one (bench/results/e2e.md).

So the runtime measures. ``DimensionTuner`` keeps, per d, the offsets of the steps that explored it

    o_d = measured_d - t_d,

measured_d being the training step's span as the layers see it (``StepClock``: from the first
layer's forward to the end of the last backward dispatch, per layer and per transfer: a transfer
is one dispatch or combine of a layer's tokens), the least of the ranks'. The span holds
everything a d costs, on the cores and links the rest of the step shares: the layers' stages and
the compute between them, the same for every d, which goes into the offset. It does not hold
what runs between two steps (the optimizer, data loading, an evaluation, another model's step),
so steps need not run back to back: bench/bench_e2e.py interleaves its variants' steps, and a
forward without a backward (evaluation) is not measured. One span for all the layers of a step,
not one per layer: a later layer's own span (its forward to its backward) is short and holds
little besides its own stages, and on the emulated cluster it ranked d=1 level with d=2 at K=8
where d=2's steps are clearly faster. Not the stages' own seconds either: with the stages split into
start and wait, run on lanes and in chunks, a stage's wall time holds waits for other lanes and
for the caller, and it ranked d=1 ahead of d=2 at K=8 (bench/results/e2e.md). Every layer explores
the same d in the same steps (the same schedule), so what an exploring step measures is the model
run at that d throughout; and t_d the model's prediction the step was decided on. It decides

    d = argmin_d  t_d + median(o_d)

(Eq. 6's rule on the corrected times): the model follows the routing from step to step, the
offset carries what the model misses, additive because what it misses is mostly a fixed
per-phase cost. Before every candidate has ``rounds`` measurements the step explores: it runs
the candidate measured least so far (a candidate: a d the model predicts within
``EXPLORE_WITHIN`` of the best; the others are never worth a step). A d never measured is
corrected by the largest offset measured (pessimistic, so it is not chosen for lack of data).
Only exploring steps are measured: there every layer runs the same d, so a step's span is that
d's; once layers decide apart (their t_d differ), a span holds several layers' d at once and says
nothing of one layer's (measured so, two layers of one model settled on different d and drifted
between them step by step).

Every rank decides alike: the inputs are the agreed statistics' predictions, the measurements
every rank received in the same exchange, and the tuner's own history, the same everywhere.
The first step of a layer is not measured (process groups connect on first use).

On by default (``tune_dimension`` = ``TUNE_ROUNDS`` measurements of each close d): on the
emulated cluster the model alone ran d=2 at K=2 where d=1's steps are faster (the relay phase's
work on cores the experts share, which no link model holds; bench/results/e2e_k2_long.md);
0 = the model alone.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moe_compile.cost.hiermoe import dimension_rule

TUNE_ROUNDS = 3  # options['tune_dimension']'s default (the module docstring's last paragraph)
EXPLORE_WITHIN = 2.0  # a d predicted slower than twice the best is not explored


@dataclass
class DimensionTuner:
    """Per-layer measured correction of t_d (module docstring). ``rounds``: measurements of every
    candidate before the corrected rule decides alone (0: the model alone, Eq. 6)."""

    rounds: int
    offsets_s: dict[int, list[float]] = field(default_factory=dict)
    tried: dict[int, int] = field(default_factory=dict)  # exploring steps run with each d
    # steps decided and not yet measured, oldest first: (step index, d, the model's t_d for it)
    pending: deque[tuple[int, int, float]] = field(default_factory=deque)

    def choose(self, times_s: Sequence[float], step: int, *, measure: bool = True) -> int:
        """d (1-based) for step number ``step`` from the model's t_1..t_D. ``measure``: this step
        may be measured (False for a layer's first step). Only exploring steps are measured."""
        times = [float(t) for t in times_s]
        if self.rounds <= 0:
            return dimension_rule(times)
        best = min(times)
        candidates = [d for d, t in enumerate(times, 1) if t <= EXPLORE_WITHIN * best]
        short = [d for d in candidates if self.tried.get(d, 0) < self.rounds]
        if not (short and measure):
            return dimension_rule(self.corrected_s(times))
        d = min(short, key=lambda c: (self.tried.get(c, 0), times[c - 1]))
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
        self.offsets_s.setdefault(d, []).append(measured_s - predicted_s)


@dataclass
class StepClock:
    """The training step as the expert-parallel layers of this process see it: what the tuner
    measures. A step opens at a layer's forward when no layer of the last one awaits its
    backward (every forward dispatch of it has had its backward), or when a layer already in it
    runs forward again (the last one held a forward without backward: an evaluation, never
    measured). Its span runs from that forward to the end of the last backward dispatch of its
    layers, so it holds every layer's stages and the compute between them, not what runs between
    steps. Every layer of a step reads the same span, per layer and transfer: divided by the
    layers in it and by 4 (a dispatch and a combine, forward and backward)."""

    step: int = -1
    start_s: float = 0.0
    layers: set[int] = field(default_factory=set)
    awaiting: int = 0  # forward dispatches of the step whose backward has not ended
    spans_s: dict[int, float] = field(default_factory=dict)  # complete steps, the last few
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def forward(self, layer_id: int) -> int:
        """A layer's forward begins: the step it belongs to."""
        with self._lock:
            if not self.layers or layer_id in self.layers or self.awaiting == 0:
                self.step, self.start_s, self.layers, self.awaiting = self.step + 1, time.perf_counter(), set(), 0
            self.layers.add(layer_id)
            return self.step

    def dispatched(self) -> None:
        """A forward dispatch (one per chunk) ran; its backward is awaited."""
        with self._lock:
            self.awaiting += 1

    def backward_done(self) -> None:
        """A forward dispatch's backward (the last of its layer's backward stages) ended."""
        with self._lock:
            if self.awaiting == 0:  # a backward of a step the clock no longer follows
                return
            self.awaiting -= 1
            if self.awaiting == 0:
                self.spans_s[self.step] = (time.perf_counter() - self.start_s) / (4 * len(self.layers))
                for old in [s for s in self.spans_s if s < self.step - 4]:
                    del self.spans_s[old]

    def span_s(self, step: int) -> float | None:
        """Step ``step``'s span per layer and transfer; None while it is open or if it never closed."""
        with self._lock:
            return self.spans_s.get(step)
