"""moe_compile.ep.worker: one lane (thread) per process group, each running its phases in the order
their stages were started, whatever the phases' durations; errors reach the stage's wait."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest
import torch

from moe_compile.ep import worker

CPU = torch.device("cpu")


class Group:
    """Stands for a process group: a lane key that records the order phases ran on it."""

    def __init__(self, name: str) -> None:
        self.name, self.ran = name, []
        self.busy = threading.Lock()


def stage(name: str, groups: list[Group], rng: random.Random, fail_at: int = -1) -> Generator[Any, None, str]:
    for i, g in enumerate(groups):
        yield g
        assert g.busy.acquire(blocking=False), f"two phases at once on {g.name}"  # one thread per lane
        time.sleep(rng.random() * 2e-3)
        g.ran.append(name)
        g.busy.release()
        if i == fail_at:
            raise RuntimeError(f"{name} failed in phase {i}")
    return name


def test_each_lane_runs_in_start_order() -> None:
    """Stages over two groups in either order (dispatch: inter then intra; combine: intra then
    inter), with random phase durations: on each group the phases run in the order the stages
    started, and every stage returns its result."""
    rng = random.Random(0)
    inter, intra = Group("inter"), Group("intra")
    started = []
    for i in range(40):
        groups = [inter, intra] if i % 3 else [intra, inter]
        name = f"s{i}"
        started.append((name, worker.start_steps(CPU, stage(name, groups, rng), groups)))
    assert [worker.wait(t) for _, t in started] == [n for n, _ in started]
    assert inter.ran == intra.ran == [n for n, _ in started]
    assert worker.in_flight() == 0


def test_phases_of_different_groups_overlap() -> None:
    """Phase 2 of one stage and phase 1 of the next, on different groups, run at the same time."""
    inter, intra = Group("inter"), Group("intra")
    during: list[bool] = []
    second_started = threading.Event()

    def first() -> Generator[Any, None, None]:
        yield inter
        yield intra
        during.append(second_started.wait(timeout=5.0))  # the next stage's inter phase runs meanwhile

    def second() -> Generator[Any, None, None]:
        yield inter
        second_started.set()
        yield intra

    a = worker.start_steps(CPU, first(), [inter, intra])
    b = worker.start_steps(CPU, second(), [inter, intra])
    worker.wait(a)
    worker.wait(b)
    assert during == [True]


def test_error_reaches_wait_and_later_stages_run() -> None:
    """A phase's error is raised by its stage's wait; its later phases are skipped and the stages
    after it still run in order."""
    rng = random.Random(1)
    inter, intra = Group("inter"), Group("intra")
    bad = worker.start_steps(CPU, stage("bad", [inter, intra], rng, fail_at=0), [inter, intra])
    good = worker.start_steps(CPU, stage("good", [inter, intra], rng), [inter, intra])
    with pytest.raises(RuntimeError, match="bad failed in phase 0"):
        worker.wait(bad)
    assert worker.wait(good) == "good"
    assert inter.ran == ["bad", "good"] and intra.ran == ["good"]


def test_announced_phases_are_checked() -> None:
    """A stage that yields another group first, or fewer phases than announced, fails at its wait."""
    a, b = Group("a"), Group("b")
    rng = random.Random(2)
    wrong = worker.start_steps(CPU, stage("x", [b], rng), [a])
    with pytest.raises(RuntimeError, match="not on the group it announced"):
        worker.wait(wrong)
    short = worker.start_steps(CPU, stage("y", [a], rng), [a, b])
    with pytest.raises(RuntimeError, match="ended after 1 of the 2 phases"):
        worker.wait(short)
    later = worker.start_steps(CPU, stage("z", [a, b], rng), [a, b])  # b's place of "y" was released
    assert worker.wait(later) == "z"


def test_run_waits_for_the_stages_in_flight() -> None:
    """A stage that is not split runs after every started stage has finished."""
    rng = random.Random(3)
    g = Group("g")
    tickets = [worker.start_steps(CPU, stage(f"s{i}", [g], rng), [g]) for i in range(5)]
    assert worker.run(CPU, lambda: list(g.ran)) == [f"s{i}" for i in range(5)]
    assert [worker.wait(t) for t in tickets] == [f"s{i}" for i in range(5)]
