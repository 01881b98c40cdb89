"""The one thread that issues every expert-parallel collective of this process, in program order.

The staged ops (``lowering.ep_stages``) split each all-to-all stage into a start and a wait (the
functional-collectives way, ``torch.distributed._functional_collectives``): ``start`` hands the
stage to this worker and returns a ticket at once, ``wait`` blocks until the stage is done and
returns its tensors. Graph work between the two (a shared expert, anything that does not need the
stage's result; ``passes.overlap`` moves it there) runs on the caller's thread while the worker
moves tokens. Gloo and the cores both release the GIL, so on CPU the two really overlap.

Why one thread for all of them: collectives on a process group must be issued in the same order on
every rank. Every rank runs the same graph, and every stage goes through this FIFO, so the order a
rank issues them in is the graph's order, whatever runs beside them. Stages that are not split
(an op called directly, the fused re-send op) go through the same queue and wait at once, so they
never run beside a split one on the same group.

CUDA: the stages run inline on the caller's thread (start does the work, wait returns it): the
worker would need its own CUDA stream and events against the caller's stream, which comes with
the chunked pipeline (issue 21). So on CUDA a split stage costs nothing and overlaps nothing.

A stage's error (a dead peer, a timeout: ``ep.groups``) is raised by its ``wait``, on the
caller's thread, with the message the stage wrote.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

_pool: ThreadPoolExecutor | None = None
_pending: dict[int, Future[Any]] = {}
_next = 0
_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hiermoe-comm")
    return _pool


def start(device: torch.device, job: Callable[[], Any]) -> Tensor:
    """Queue ``job`` (a stage: its collectives and the copies around them) and return its ticket,
    an int64 CPU tensor of one element. On CUDA ``job`` runs here, before returning."""
    global _next
    fut: Future[Any] = Future()
    if device.type == "cuda":
        try:
            fut.set_result(job())
        except BaseException as e:  # raised by wait, like the worker's
            fut.set_exception(e)
    else:
        fut = _executor().submit(_in_mode, job, torch.is_inference_mode_enabled())
    with _lock:
        ticket = _next
        _next += 1
        _pending[ticket] = fut
    return torch.tensor([ticket], dtype=torch.long)


def _in_mode(job: Callable[[], Any], inference: bool) -> Any:
    """``job`` on the worker thread, under the grad mode a custom op's body has on the caller's
    (grad modes are per thread; the stage records nothing for autograd)."""
    with torch.inference_mode() if inference else torch.no_grad():
        return job()


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
    """A stage that is not split: queued behind every stage in flight, waited at once."""
    return wait(start(device, job))


def in_flight() -> int:
    """Stages started and not yet waited for (0 between steps)."""
    with _lock:
        return len(_pending)


__all__ = ["in_flight", "run", "start", "wait"]
