"""What the benchmark scripts record about the machine (imported as a sibling module: the
scripts run as ``python bench/<script>.py``, which puts bench/ on sys.path)."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what ``platform`` knows."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        return cpu
