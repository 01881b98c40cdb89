"""The threads that issue every expert-parallel collective of this process, one per process group,
each in program order.

The staged ops (``lowering.ep_stages``) split each all-to-all stage into a start and a wait (the
functional-collectives way, ``torch.distributed._functional_collectives``): ``start`` hands the
stage to the worker and returns a ticket at once, ``wait`` blocks until the stage is done and
returns its tensors. Graph work between the two (a shared expert, another chunk's experts;
``passes.overlap`` moves it there) runs on the caller's thread while the worker moves tokens. Gloo
and the cores both release the GIL, so on CPU the two really overlap.

A stage is a sequence of phases (HD-d's all-to-alls, ``hier_a2a.dispatch_steps``), each on one
mesh level's process group. Each group has its own thread, a lane (MoNTA's streams: the
inter-node AllToAll and the intra-node AllGather/copy run at the same time, Fig. 6-7), so phase 2
of one chunk's dispatch runs while phase 1 of the next chunk's crosses the slow link.

Why the order is the same on every rank: collectives on a process group must be issued in the same
order on every rank. ``start`` reserves, on the caller's thread and in graph order, a place on
every lane the stage will use, and a lane runs its places strictly in that order (waiting for a
phase whose previous phase, on another lane, has not finished yet, while the lane's later places
wait too). Every rank runs the same graph, so every lane issues its collectives in the same order
on every rank. No deadlock: the earliest stage not finished has the next place on each lane it
still needs. A stage that is not split (``run``: an op called directly, the fused re-send op, whose
collectives span several groups in one job) first waits for every stage in flight, then runs on
the caller's thread, so it never runs beside a split one.

CUDA: the stages run inline on the caller's thread (start does the work, wait returns it): the
worker would need its own CUDA stream and events against the caller's stream. So on CUDA a split
stage costs nothing and overlaps nothing.

A stage's error (a dead peer, a timeout: ``ep.groups``) is raised by its ``wait``, on the
caller's thread, with the message the stage wrote; the stage's later phases are skipped, and
their places on the lanes released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

_pending: dict[int, Future[Any]] = {}
_next = 0
_lock = threading.Lock()
_lanes: dict[int, _Lane] = {}


class _Lane:
    """One thread running the steps given to it in the order of the places reserved for them."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._reserved = 0  # places handed out
        self._ready: dict[int, Callable[[], None]] = {}
        self._thread = threading.Thread(target=self._loop, name=f"hiermoe-comm-{name}", daemon=True)
        self._thread.start()

    def reserve(self) -> int:
        with self._cv:
            self._reserved += 1
            return self._reserved - 1

    def give(self, place: int, step: Callable[[], None]) -> None:
        with self._cv:
            self._ready[place] = step
            self._cv.notify()

    def _loop(self) -> None:
        place = 0
        while True:
            with self._cv:
                while place not in self._ready:
                    self._cv.wait()
                step = self._ready.pop(place)
            step()  # never raises: ``_Stage.step`` keeps errors for the stage's wait
            place += 1


def _lane(key: Any) -> _Lane:
    """The lane of a process group (by identity: one per group object)."""
    lane = _lanes.get(id(key))
    if lane is None:
        lane = _lanes[id(key)] = _Lane(str(len(_lanes)))
    return lane


class _Stage:
    """A started stage: a generator that yields its next phase's group, its places, its result."""

    def __init__(self, steps: Generator[Any, None, Any], keys: list[Any], fut: Future[Any], inference: bool) -> None:
        self.steps, self.fut, self.inference = steps, fut, inference
        self.lanes = [_lane(k) for k in keys]
        self.places = [lane.reserve() for lane in self.lanes]

    def begin(self) -> None:
        self.lanes[0].give(self.places[0], lambda: self.step(0))

    def step(self, i: int) -> None:
        """Phase i on its lane, then hand phase i+1 to its lane (or the result to the future)."""
        last = i + 1 == len(self.lanes)
        if not self.fut.done():
            try:
                with torch.inference_mode() if self.inference else torch.no_grad():
                    next(self.steps)  # phase i; stops before phase i+1, or returns the result
                if last:
                    raise RuntimeError(f"an expert-parallel stage has more phases than the {len(self.lanes)} it "
                                       "announced")
            except StopIteration as stop:
                if last:
                    self.fut.set_result(stop.value)
                else:
                    self.fut.set_exception(RuntimeError(f"an expert-parallel stage ended after {i + 1} of the "
                                                        f"{len(self.lanes)} phases it announced"))
            except BaseException as e:  # raised by wait, on the caller's thread
                self.fut.set_exception(e)
        if not last:
            self.lanes[i + 1].give(self.places[i + 1], lambda: self.step(i + 1))


def start_steps(device: torch.device, steps: Generator[Any, None, Any], keys: list[Any]) -> Tensor:
    """Start a stage of ``len(keys)`` phases: ``steps`` yields phase i's process group
    ``keys[i]`` before the phase and returns the stage's result after the last (e.g.
    ``hier_a2a.dispatch_steps``); what comes before its first phase runs here. Returns its
    ticket, an int64 CPU tensor of one element. On CUDA the whole stage runs here."""
    fut: Future[Any] = Future()
    try:
        if device.type == "cuda":
            while True:
                next(steps)
        if next(steps) is not keys[0]:
            raise RuntimeError("an expert-parallel stage's first phase is not on the group it announced")
    except StopIteration as stop:
        fut.set_result(stop.value)
    except BaseException as e:  # raised by wait, like the lanes'
        fut.set_exception(e)
    if fut.done():
        return _ticket(fut)
    with _lock:  # places on every lane in one go: another thread's start cannot interleave
        stage = _Stage(steps, keys, fut, torch.is_inference_mode_enabled())
    ticket = _ticket(fut)
    stage.begin()
    return ticket


def _ticket(fut: Future[Any]) -> Tensor:
    global _next
    with _lock:
        ticket = _next
        _next += 1
        _pending[ticket] = fut
    return torch.tensor([ticket], dtype=torch.long)


def wait(ticket: Tensor) -> Any:
    """The result of the stage ``ticket`` names (raising its error); each ticket is waited once."""
    key = int(ticket[0])
    with _lock:
        fut = _pending.pop(key, None)
    if fut is None:
        raise RuntimeError(f"expert-parallel stage ticket {key} is unknown or was already waited for "
                           "(a start/wait pair was cut apart: report this with the dumped graph, HIERMOE_DUMP_DIR)")
    return fut.result()


def run(device: torch.device, job: Callable[[], Any]) -> Any:
    """A stage that is not split: after every stage in flight (they finish: their places come
    first on their lanes), here, at once."""
    with _lock:
        flying = list(_pending.values())
    for fut in flying:
        fut.exception()  # waits; an error stays for that stage's own wait
    return job()


def in_flight() -> int:
    """Stages started and not yet waited for (0 between steps)."""
    with _lock:
        return len(_pending)


__all__ = ["in_flight", "run", "start_steps", "wait"]
