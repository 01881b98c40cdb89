"""Process groups the project creates, and failures inside them that say where they happened.

``dist.new_group()`` without a timeout gets torch's default (30 minutes on gloo), not the one the
user gave ``init_process_group``: a rank that hangs or dies would then block the others for half
an hour in an expert-parallel subgroup.  Every group made here takes the default group's timeout,
so a missing rank makes every other rank raise within the user's bound.

``collective_error`` turns the backend's error (gloo: "Connection closed by peer", "Timed out
waiting ... for recv") into one that names the layer (or the swapper) and the collective that
failed.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def default_timeout() -> datetime.timedelta:
    """The timeout of the default process group (the one ``init_process_group`` was given)."""
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            backend = world._get_backend(torch.device(device))  # type: ignore[union-attr]
        except (RuntimeError, ValueError):
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return dist.distributed_c10d._get_default_timeout(dist.get_backend())  # type: ignore[arg-type]


def new_group(ranks: Sequence[int] | None = None, backend: str | None = None) -> Any:
    """``dist.new_group`` with the default group's timeout (collective over the world: every rank
    calls it, in the same order)."""
    return dist.new_group(list(ranks) if ranks is not None else None, timeout=default_timeout(), backend=backend)


def collective_error(where: str, what: str, error: BaseException) -> RuntimeError:
    """The error to raise when collective ``what`` of ``where`` (``layer <name>``, the expert
    swapper) failed with ``error``."""
    seconds = default_timeout().total_seconds()
    return RuntimeError(
        f"{where}: {what} failed on rank {dist.get_rank()} ({type(error).__name__}: {error}). Another rank "
        f"died, hangs, or runs other collectives (every rank must run every expert-parallel layer in the "
        f"same order); each rank gives up after the process group timeout ({seconds:g} s)")


__all__ = ["collective_error", "default_timeout", "new_group"]
