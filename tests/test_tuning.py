"""The measured correction of HierMoE's d* (moe_compile.ep.tuning): what it explores, how it
decides once measured, and that it follows the model's routing-driven times afterwards. The
multi-rank behaviour (every rank deciding alike from the exchanged measurements) is
tests/test_expert_parallel.py::test_tuned_dimension_agrees."""

from __future__ import annotations

import pytest

from moe_compile.cost.hiermoe import dimension_rule
from moe_compile.ep import tuning
from moe_compile.ep.tuning import DimensionTuner, StepClock


def run(tuner: DimensionTuner, times: list[float], measured: dict[int, float], steps: range) -> list[int]:
    """Decide ``steps`` with the model's ``times``; each step measured at once as ``measured[d]``."""
    chosen = []
    for step in steps:
        d = tuner.choose(times, step, measure=step > 0)
        chosen.append(d)
        if step > 0:
            tuner.observe(step, measured[d])
    return chosen


def test_no_rounds_is_the_models_rule() -> None:
    tuner = DimensionTuner(0)
    for times in ([1.0, 2.0], [2.0, 1.0], [3.0, 1.0, 2.0]):
        assert tuner.choose(times, 5) == dimension_rule(times)
    assert not tuner.pending and not tuner.offsets_s


def test_explores_then_corrects_a_wrong_model() -> None:
    # the model says d=2 (0.9 < 1.0 s) but d=2 measures 1.5 s and d=1 1.0 s
    tuner = DimensionTuner(2)
    chosen = run(tuner, [1.0, 0.9], {1: 1.0, 2: 1.5}, range(8))
    assert chosen[0] == 2  # the first step is not measured: the model's choice
    assert sorted(chosen[1:5]) == [1, 1, 2, 2]  # each close candidate twice
    assert chosen[5:] == [1, 1, 1]
    assert tuner.corrected_s([1.0, 0.9]) == pytest.approx([1.0, 1.5])


def test_keeps_a_right_model_and_follows_the_routing() -> None:
    tuner = DimensionTuner(1)
    chosen = run(tuner, [1.0, 0.5], {1: 1.1, 2: 0.6}, range(5))  # the model is right, offsets 0.1 each
    assert chosen[3:] == [2, 2]
    # new routing: the model now finds d=1 much faster; the equal offsets keep its choice
    assert tuner.choose([0.2, 0.5], 5) == 1


def test_far_candidates_are_never_explored() -> None:
    tuner = DimensionTuner(3)
    chosen = run(tuner, [5.0, 1.0, 1.5], {1: 5.0, 2: 1.0, 3: 1.5}, range(12))
    assert 1 not in chosen  # predicted 5x the best
    assert chosen.count(3) == 3 and chosen[-1] == 2


def test_observations_align_by_step() -> None:
    tuner = DimensionTuner(1)
    assert tuner.choose([1.0, 1.0], 0, measure=False) == 2 and not tuner.pending  # Eq. 6: a tie goes to d > 1
    d1 = tuner.choose([1.0, 1.0], 1)
    d2 = tuner.choose([1.0, 1.0], 2)
    assert {d1, d2} == {1, 2}
    tuner.observe(0, 9.0)  # a step never queued: ignored
    assert not tuner.offsets_s
    tuner.observe(2, 3.0)  # step 1's measurement never came: dropped, step 2's kept
    assert tuner.offsets_s == {d2: [2.0]} and not tuner.pending


def test_only_exploring_steps_are_measured() -> None:
    """Once every close d has its rounds, a step is decided by the corrected rule and queues no
    measurement: the offsets stay those of the exploring steps (where every layer ran one d)."""
    tuner = DimensionTuner(2)
    chosen = run(tuner, [1.0, 0.9], {1: 1.0, 2: 1.5}, range(1, 12))
    assert sorted(chosen[:4]) == [1, 1, 2, 2] and chosen[4:] == [1] * 7
    assert tuner.tried == {1: 2, 2: 2} and not tuner.pending
    assert {d: len(o) for d, o in tuner.offsets_s.items()} == {1: 2, 2: 2}


class _Clock:
    """A settable perf_counter for StepClock (no sleeping: the spans are exact numbers)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_clock_spans_the_layers_of_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's span runs from its first layer's forward to its last backward dispatch's end, per
    layer and transfer, the same for every layer of it; chunks count as dispatches; what runs
    between steps, an evaluation forward, or another model's step is not in any span."""
    now = _Clock()
    monkeypatch.setattr(tuning.time, "perf_counter", now)
    clock = StepClock()

    def train_step(layers: list[int], chunks: int, start: float, end: float) -> list[int]:
        now.now = start
        steps = []
        for lay in layers:  # forward: each layer's chunks dispatch
            steps.append(clock.forward(lay))
            for _ in range(chunks):
                clock.dispatched()
        now.now = end
        for _ in range(len(layers) * chunks):  # backward: the last one ends at ``end``
            clock.backward_done()
        return steps

    a = train_step([0, 1], 3, 10.0, 18.0)
    assert a == [0, 0] and clock.span_s(0) == pytest.approx(8.0 / (4 * 2))
    b = train_step([0, 1], 3, 30.0, 34.0)  # 12 s between the steps (optimizer, data): not in the span
    assert b == [1, 1] and clock.span_s(1) == pytest.approx(4.0 / 8)
    now.now = 40.0  # an evaluation: forwards, no backward
    e = []
    for lay in (0, 1):
        e.append(clock.forward(lay))
        clock.dispatched()
    assert e == [2, 2] and clock.span_s(2) is None
    c = train_step([0, 1], 1, 50.0, 51.0)  # layer 0 again opens a new step; the evaluation never closes
    assert c == [3, 3] and clock.span_s(2) is None and clock.span_s(3) == pytest.approx(1.0 / 8)
    other = train_step([7], 2, 60.0, 62.0)  # another model's step, between two of this one's
    assert other == [4] and clock.span_s(4) == pytest.approx(2.0 / 4)
    d = train_step([0, 1], 1, 70.0, 72.0)
    assert d == [5, 5] and clock.span_s(5) == pytest.approx(2.0 / 8)
