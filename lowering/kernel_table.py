"""The measured table behind ``kernels="auto"`` on CUDA: per device, dtype and expert shape, whether
the Triton kernels (``hiermoe::experts_triton`` / ``_keep``) or the torch lowering (what
``kernels="torch"`` runs: ``hiermoe::experts_composite``, grouped GEMMs) was faster, forward alone
(inference) and forward + backward (training).

The table (``kernel_table.json`` beside this module) is written from a ``bench/bench_kernels.py``
run on the device by ``python bench/bench_kernels.py --write-table RESULTS.json``; each entry is one
(model shape, T, mode) row pair of that run with both medians. One run per device: writing a run
replaces its device's entries and keeps the other devices' (``sources`` names each device's run).
A layer takes the decision of the nearest measured shape (log-distance over tokens per expert, H,
F and E; the same dtype and mode) on the same device name, else on a device of the same compute
capability; where nothing was measured for the device the torch lowering runs, so "auto" never
picks an unmeasured kernel.

Pure Python and json: the passes call it without importing Triton (DESIGN.md, Layout).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("kernel_table.json")


@dataclass(frozen=True)
class Entry:
    device: str  # torch.cuda.get_device_name
    capability: tuple[int, int]
    dtype: str  # "bfloat16", ...
    mode: str  # "fwd" or "fwd+bwd"
    tokens: int
    top_k: int
    experts: int
    hidden: int
    ffn: int
    triton_ms: float
    torch_ms: float

    @property
    def winner(self) -> str:
        return "triton" if self.triton_ms < self.torch_ms else "torch"


@functools.cache
def load(path: Path = TABLE_PATH) -> tuple[Entry, ...]:
    """The entries of the table at ``path`` (none when the file does not exist)."""
    if not path.exists():
        return ()
    data = json.loads(path.read_text())
    return tuple(Entry(**{**e, "capability": tuple(e["capability"])}) for e in data["entries"])


@dataclass(frozen=True)
class Choice:
    kernels: str  # "triton" or "torch"
    why: str


def device_key(device: torch.device) -> tuple[str, tuple[int, int]] | None:
    """(name, compute capability) of a CUDA ``device`` in this process, None where CUDA is absent."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


def _distance(e: Entry, tokens: int, top_k: int, experts: int, hidden: int, ffn: int) -> float:
    def d(a: float, b: float) -> float:
        return abs(math.log(max(a, 1e-9) / max(b, 1e-9)))

    return (d(e.tokens * e.top_k / e.experts, tokens * top_k / experts) + d(e.hidden, hidden) + d(e.ffn, ffn)
            + d(e.experts, experts))


def choose(key: tuple[str, tuple[int, int]] | None, dtype: torch.dtype, tokens: int, top_k: int, experts: int,
           hidden: int, ffn: int, training: bool, entries: tuple[Entry, ...] | None = None) -> Choice:
    """The kernels for one expert layer of this shape on the device ``key`` (``device_key``)."""
    entries = load() if entries is None else entries
    mode = "fwd+bwd" if training else "fwd"
    name = str(dtype).removeprefix("torch.")
    if key is None:
        return Choice("torch", "no CUDA device in this process to look up")
    same = [e for e in entries if e.dtype == name and e.mode == mode and e.device == key[0]]
    if not same:
        same = [e for e in entries if e.dtype == name and e.mode == mode and e.capability == key[1]]
    if not same:
        return Choice("torch", f"no {mode} measurement of the Triton kernels for {name} on {key[0]} "
                               f"(sm_{key[1][0]}{key[1][1]}) in {TABLE_PATH.name}")
    e = min(same, key=lambda e: _distance(e, tokens, top_k, experts, hidden, ffn))
    return Choice(e.winner, f"nearest measured {mode} shape on {e.device}: T={e.tokens} K={e.top_k} E={e.experts} "
                            f"H={e.hidden} F={e.ffn}, Triton {e.triton_ms:.3f} ms vs torch {e.torch_ms:.3f} ms")


def entries_from_bench(results: dict, models: dict[str, tuple[int, int, int, int]],
                       triton_impl: str = "triton_keep", torch_impl: str = "composite") -> list[dict]:
    """Table entries from a bench_kernels.py results JSON: one per (model, T, mode) where both
    implementations ran; ``models`` maps the bench's model names to (H, F, E, K)."""
    machine = results["machine"]
    rows = {(r["model"], r["tokens"], r["mode"], r["impl"]): r for r in results["rows"] if not r.get("error")}
    out = []
    for (model, tokens, mode, impl), r in sorted(rows.items()):
        if impl != torch_impl:
            continue
        tri = rows.get((model, tokens, mode, triton_impl if mode == "fwd+bwd" else "triton"))
        if tri is None:
            continue
        hidden, ffn, experts, top_k = models[model]
        out.append(dict(device=machine["gpu"], capability=list(machine["capability"]), dtype="bfloat16", mode=mode,
                        tokens=tokens, top_k=top_k, experts=experts, hidden=hidden, ffn=ffn,
                        triton_ms=round(tri["median_ms"], 4), torch_ms=round(r["median_ms"], 4)))
    return out


def merged(table: dict, results: dict, models: dict[str, tuple[int, int, int, int]]) -> dict:
    """The table (the JSON ``kernel_table.json`` holds) with a bench_kernels.py run's entries for its
    device in place of the ones it had for that device; other devices' entries and sources stay.
    A table of the older one-source form (``source``/``command`` at the top) is read as the source
    of every device it has entries for."""
    device = results["machine"]["gpu"]
    listed = table.get("sources") or [{"device": d, "source": table["source"], "command": table["command"]}
                                      for d in sorted({e["device"] for e in table.get("entries", [])})]
    sources = {s["device"]: s for s in listed if s["device"] != device}
    sources[device] = {"device": device, "source": results.get("source", ""), "command": results["command"]}
    kept = [e for e in table.get("entries", []) if e["device"] != device]
    return {"sources": sorted(sources.values(), key=lambda s: s["device"]),
            "entries": kept + entries_from_bench(results, models)}
