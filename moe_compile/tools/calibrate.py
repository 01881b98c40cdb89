"""Measure a cluster's collectives under torchrun and write its topology file.

    torchrun --nproc-per-node 4 -m moe_compile.tools.calibrate --mesh node=2,gpu=2 --out cluster.toml

Builds ``init_device_mesh(device, shape, mesh_dim_names=names)`` from ``--mesh`` (slowest level
first; gloo on CPU, NCCL on CUDA), then for every level times ``all_to_all_single`` and
``all_gather_into_tensor`` (``all_gather_single`` where torch has it) inside the level's subgroups
(``mesh.get_group(level)``; all subgroups of a level run at once, as HierMoE's Inter-level-i
all-to-alls do), and the flat all-to-all over the whole world, each at ``--steps`` sizes from
``--min-bytes`` to ``--max-bytes``.

All-to-all (``--a2a``): on gloo, by default, ``lowering.p2p_a2a.all_to_all_single_recv_first``
(point-to-point ops, every receive posted before any send), the all-to-all the expert-parallel
dispatch and combine run on gloo; gloo's own ``all_to_all_single`` (``--a2a gloo``) runs the two
directions of a pair one after the other on a full-duplex link and measures 65-94 % of its rate,
differently from run to run (bench/results/cluster_calibration.md).  On NCCL the library's
``all_to_all_single`` (``--a2a library``, the default there).

Timing: ``--warmup`` untimed runs per size, then ``--reps`` timed runs, each after a world barrier;
each run's time is the slowest rank's (all_reduce MAX) and a size's time is the median over runs.
A level whose all-to-all time does not grow with the message size (fitted beta <= 0: on a busy
machine, scheduling noise can outweigh the bytes at every size) is timed again, up to
``--retries`` times, and the note says so; if it still does not grow, the tool stops with an error
that says which level and what to raise.  Every rank sees the same agreed times, so every rank
decides the same re-timing.

Model (HierMoE Eq. 1, Section V-B; details in ``moe_compile.cost.calibrate``): one collective
among g ranks takes ``alpha_s + n * (g-1)/g * beta_s_per_byte``, n the buffer bytes on one rank
(the all-to-all send buffer with its own share; the all-gather output), n * (g-1)/g the bytes that
leave the rank.  So beta is the time per byte over the level's link and 1/beta the bandwidth one
rank gets while all the level's groups run at once (``Topology``'s ``bandwidth_gbps``); HierMoE's
Fig. 9 betas are per byte of n, i.e. beta * (g-1)/g.  A level's ``alpha_s``/``beta_s_per_byte`` in
the topology are the fit of its subgroup all-to-all.  The file also gets MoNTA's efficiency curves
r(n) = n * (g-1)/g * beta_level / t(n) over the buffer size n, named ``<collective>_<level>`` (and
``all_to_all_world``, against the slowest level's link), plus ``all_to_all`` (slowest level,
MoNTA's inter-node r1) and ``all_gather`` (fastest level, MoNTA's intra-node r2).  Rank 0 prints a
table of every fit and writes the file.

The expert op itself (``measure_expert_compute``): ``hiermoe::experts`` forward timed at shapes
that vary its (token, expert) rows and its FFN columns independently, fitted to a matmul FLOP rate
and a row rate (``cost.calibrate.fit_expert_compute``), the ranks' median written as
``compute.expert_flops_per_s`` / ``compute.expert_row_bytes_per_s``: the planner's expert compute
(``Topology.expert_compute_s``; without them it charges FLOPs at ``flops_per_s`` alone, which
prices a rank computing S times the rows on F / S columns, model-centric, like one computing its
own rows on all F).

``--chunk-overhead`` also measures what one more chunk of the expert-parallel pipeline costs
beyond the pipeline model's transfer and compute terms (``measure_chunk_overhead``): a probe MoE
layer compiled with hiermoe on the mesh just fitted, its forward + backward timed in 1, 2 and 4
chunks, and ``cost.pipeline.fit_chunk_overhead`` fitted to the growth over 1 chunk; the file gets
it as ``compute.chunk_overhead_s``, which the planner's chunk count then uses in place of its
default (``cost.pipeline.OP_OVERHEAD_S``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moe_compile.cost.calibrate import (
    efficiency_curve,
    fit_collective,
    fit_expert_compute,
    link_fraction,
    message_sizes,
)
from moe_compile.cost.pipeline import fit_chunk_overhead
from moe_compile.cost.planner import layer_times
from moe_compile.cost.topology import EfficiencyCurve, Level, Topology
from moe_compile.cost.workload import SLOT_BYTES, Workload
from moe_compile.ep.runtime import counters, reset_counters
from moe_compile.lowering.experts import experts as experts_op
from moe_compile.lowering.p2p_a2a import all_to_all_single_recv_first, use_recv_first

_ELEMENT = torch.float32  # the payload's dtype; only its byte count matters
_ELEMENT_BYTES = 4
WORLD = "world"
# torch 2.13 renamed all_gather_into_tensor (deprecated, warns on every call) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
A2A_CHOICES = ("recv-first", "library", "gloo")  # "gloo": the library's, as named for gloo


def parse_mesh(spec: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"node=2,gpu=4"`` -> ``(("node", "gpu"), (2, 4))``, slowest level first."""
    names: list[str] = []
    sizes: list[int] = []
    for part in spec.split(","):
        name, sep, size = part.strip().partition("=")
        name, size = name.strip(), size.strip()
        if not sep or not name.isidentifier() or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {spec!r}: each entry must be NAME=SIZE with a positive integer size, "
                             f"slowest level first, e.g. --mesh node=2,gpu=4 (bad entry {part!r})")
        if name == WORLD or name in names:
            raise ValueError(f"--mesh {spec!r}: level names must be unique and not {WORLD!r} (got {name!r} twice "
                             "or reserved)")
        names.append(name)
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


def check_world_size(names: Sequence[str], sizes: Sequence[int], world_size: int) -> None:
    if math.prod(sizes) != world_size:
        shape = " x ".join(f"{n}={s}" for n, s in zip(names, sizes))
        raise ValueError(f"--mesh {shape} has {math.prod(sizes)} ranks but the world size is {world_size}; "
                         f"start {math.prod(sizes)} processes (torchrun --nproc-per-node/--nnodes) or change --mesh")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m moe_compile.tools.calibrate",
                                description="Measure each mesh level's collectives, fit alpha-beta per level, "
                                            "write a topology TOML.")
    p.add_argument("--mesh", required=True, help="levels slowest first, NAME=SIZE,... (product = world size)")
    p.add_argument("--out", default="cluster.toml", help="topology file to write (rank 0)")
    p.add_argument("--min-bytes", type=int, default=1 << 12, help="smallest buffer per rank (default 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=1 << 26, help="largest buffer per rank (default 64 MiB)")
    p.add_argument("--steps", type=int, default=8, help="sizes, spaced geometrically (default 8)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per size; the median is kept (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per size (default 2)")
    p.add_argument("--retries", type=int, default=2,
                   help="times a level's all-to-all is timed again when its time does not grow with the message "
                        "size (noise on a busy machine) before the tool gives up (default 2)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda (NCCL) when available under auto, else cpu (gloo)")
    p.add_argument("--a2a", choices=A2A_CHOICES, default=None,
                   help="all-to-all to time: recv-first (point-to-point ops, receives posted first: what the "
                        "expert-parallel dispatch runs on gloo), or library / gloo (torch.distributed."
                        "all_to_all_single: gloo's own on CPU, NCCL's on CUDA). Default: recv-first on gloo, "
                        "library otherwise")
    p.add_argument("--name", default="", help="topology name written to the file")
    p.add_argument("--flops-per-s", type=float, default=None,
                   help="device compute rate to write instead of a quick matmul measurement")
    p.add_argument("--mem-bw-bytes-per-s", type=float, default=None,
                   help="device memory bandwidth to write instead of a quick copy measurement")
    p.add_argument("--chunk-overhead", action="store_true",
                   help="also measure the fixed cost of one more expert-parallel pipeline chunk (compiles a probe "
                        "MoE layer with hiermoe three times: about half a minute on CPU) and write it as "
                        "compute.chunk_overhead_s")
    return p


@dataclass(frozen=True)
class Measurement:
    collective: str  # "all_to_all" or "all_gather"
    group: str  # a level name or WORLD
    group_size: int
    sizes_bytes: tuple[int, ...]  # buffer bytes per rank (n)
    times_s: tuple[float, ...]


@dataclass(frozen=True)
class Fit:
    measurement: Measurement
    alpha_s: float
    beta_s_per_byte: float
    r2: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agreed_median(times_s: list[float], device: torch.device) -> float:
    """Each run's time is the slowest rank's; the size's time is the median over runs."""
    t = torch.tensor(times_s, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _time_runs(run: Callable[[], object], device: torch.device, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        run()
    _sync(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def resolve_a2a(choice: str | None, device: torch.device) -> str:
    """``--a2a`` as run: "recv-first" or "library" (None: recv-first where the world group is gloo)."""
    if choice is None:
        return "recv-first" if use_recv_first(None, device) else "library"
    return "library" if choice == "gloo" else choice


def _collective_runner(collective: str, num_bytes: int, group: Any, group_size: int,
                       device: torch.device, a2a: str = "library") -> Callable[[], object]:
    numel = num_bytes // _ELEMENT_BYTES
    if collective == "all_to_all":
        send = torch.ones(numel, dtype=_ELEMENT, device=device)
        recv = torch.empty_like(send)
        if a2a == "recv-first":
            return lambda: all_to_all_single_recv_first(recv, send, group=group)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    out = torch.empty(numel, dtype=_ELEMENT, device=device)
    shard = torch.ones(numel // group_size, dtype=_ELEMENT, device=device)
    return lambda: _all_gather(out, shard, group=group)


def plan_measurements(names: Sequence[str], sizes: Sequence[int], world_size: int, args: argparse.Namespace
                      ) -> list[tuple[str, str, int, list[int]]]:
    """(collective, group, group size, message sizes) in the order every rank runs them."""
    plan = []
    for name, size in zip(names, sizes):
        msgs = message_sizes(args.min_bytes, args.max_bytes, args.steps, multiple_of=size * _ELEMENT_BYTES)
        plan += [("all_to_all", name, size, msgs), ("all_gather", name, size, msgs)]
    msgs = message_sizes(args.min_bytes, args.max_bytes, args.steps, multiple_of=world_size * _ELEMENT_BYTES)
    plan.append(("all_to_all", WORLD, world_size, msgs))
    return plan


def measure(mesh: Any, plan: Sequence[tuple[str, str, int, list[int]]], device: torch.device, reps: int,
            warmup: int, advance: Callable[[str], None], a2a: str = "library") -> list[Measurement]:
    """Time the plan; ``a2a`` ("library" or "recv-first", see ``resolve_a2a``) picks the all-to-all."""
    out = []
    for collective, group_name, group_size, msgs in plan:
        group = None if group_name == WORLD else mesh.get_group(group_name)
        times = []
        for num_bytes in msgs:
            run = _collective_runner(collective, num_bytes, group, group_size, device, a2a)
            times.append(_agreed_median(_time_runs(run, device, reps, warmup), device))
            advance(f"{collective} {group_name}")
        out.append(Measurement(collective, group_name, group_size, tuple(msgs), tuple(times)))
    return out


def _flat_levels(fits: Sequence[Fit], names: Sequence[str]) -> list[int]:
    """Indices of the level all-to-all fits whose time does not grow with the message size."""
    return [i for i, f in enumerate(fits)
            if f.measurement.collective == "all_to_all" and f.measurement.group in names and f.beta_s_per_byte <= 0]


def retime_flat_levels(mesh: Any, plan: Sequence[tuple[str, str, int, list[int]]], measurements: list[Measurement],
                       names: Sequence[str], device: torch.device, args: argparse.Namespace, a2a: str,
                       note: Callable[[str], None]) -> list[Fit]:
    """The fits of ``measurements`` (one per ``plan`` entry), after timing again, up to
    ``args.retries`` times, each level all-to-all whose fitted beta is <= 0. The times are agreed
    over the ranks (``_agreed_median``), so every rank re-times the same entries in the same order."""
    fits = fit_measurements(measurements)
    for attempt in range(1, args.retries + 1):
        flat = _flat_levels(fits, names)
        if not flat:
            break
        levels = ", ".join(fits[i].measurement.group for i in flat)
        note(f"note: level {levels}: the all-to-all time does not grow with the message size (busy machine?); "
             f"timing it again ({attempt}/{args.retries})")
        again = measure(mesh, [plan[i] for i in flat], device, args.reps, args.warmup, lambda what: None, a2a)
        for i, m in zip(flat, again, strict=True):
            measurements[i] = m
        fits = fit_measurements(measurements)
    return fits


def measure_compute(device: torch.device) -> tuple[float, float]:
    """Quick per-rank matmul FLOP rate and copy bandwidth (read + write bytes), best of a few runs."""
    n, dtype, copy_bytes = (4096, torch.bfloat16, 1 << 28) if device.type == "cuda" else (256, torch.float32, 1 << 23)
    a = torch.randn(n, n, dtype=dtype, device=device)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def best(fn: Callable[[], object]) -> float:
        fn()
        _sync(device)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        return min(ts)

    flops = 2 * n**3 / best(lambda: a @ a)
    mem_bw = 2 * copy_bytes / best(lambda: dst.copy_(src))
    return flops, mem_bw


# measure_expert_compute's runs of hiermoe::experts: (hidden, experts, tokens) and the (top_k,
# ffn) pairs that vary its (token, expert) rows and its FFN columns independently
EXPERT_PROBE = {"cpu": (256, 8, 1024, ((1, 16), (4, 16), (1, 128), (4, 128))),
                "cuda": (2048, 8, 16384, ((1, 128), (4, 128), (1, 1024), (4, 1024)))}


def measure_expert_compute(device: torch.device, reps: int = 7) -> tuple[float, float, float]:
    """The expert op's own rates on ``device``: ``hiermoe::experts`` forward (SwiGLU; fp32 on CPU,
    bf16 on CUDA, as ``measure_compute``) timed at the ``EXPERT_PROBE`` shapes, whose (token,
    expert) rows T*K and FFN columns F vary independently, each shape's best of ``reps`` runs taken
    in turn with the others' (so that a busy moment of a shared device falls on every shape alike),
    and fitted to ``t = flops / F_rate + row_bytes / R_rate`` (``cost.calibrate.fit_expert_compute``):
    returns ``(F_rate FLOP/s, R_rate row bytes/s, r2)``, what ``Topology.expert_compute_s`` charges.
    The row term is why a rank computing F / S columns of S times the rows (model-centric) is
    slower than the FLOPs say: bench/results/gather.md's model0 rows. Raises ValueError where the
    fit finds no cost for one term (noise)."""
    hidden, num_experts, tokens, runs = EXPERT_PROBE["cuda" if device.type == "cuda" else "cpu"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    calls, flops, row_bytes = [], [], []
    for top_k, ffn in runs:
        idx = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k].to(device)
        weights = torch.rand(tokens, top_k, generator=gen).to(device, dtype)
        w_up, w_gate = (torch.randn(num_experts, ffn, hidden, generator=gen).to(device, dtype) * 0.05 for _ in range(2))
        w_down = torch.randn(num_experts, hidden, ffn, generator=gen).to(device, dtype) * 0.05
        calls.append((x, idx, weights, w_up, w_gate, w_down, None, None, None, "silu"))
        flops.append(2 * 3 * tokens * top_k * hidden * ffn)
        row_bytes.append(tokens * top_k * hidden * x.element_size())
    best = [math.inf] * len(calls)
    with torch.no_grad():
        for rep in range(reps + 1):  # the first round warms up
            for i, args in enumerate(calls):
                _sync(device)
                t0 = time.perf_counter()
                experts_op(*args)
                _sync(device)
                if rep:
                    best[i] = min(best[i], time.perf_counter() - t0)
    return fit_expert_compute(flops, row_bytes, best)


# the probe layer measure_chunk_overhead times, per rank: fp32, SwiGLU experts
CHUNK_PROBE = {"hidden_size": 256, "ffn_size": 256, "experts_per_rank": 2, "top_k": 2, "tokens": 512}
CHUNK_COUNTS = (1, 2, 4)


class ChunkProbe(torch.nn.Module):
    """The MoE layer ``measure_chunk_overhead`` compiles: softmax top-k router renormalised over
    the K chosen, SwiGLU experts stacked in transformers v5's layout (``gate_up_proj`` [E, 2F, H],
    ``down_proj`` [E, H, F]) looped over as transformers' eager experts do. Only its detection
    matters: hiermoe replaces it by the expert-parallel stages, whose cost is what is timed."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(num_experts, 2 * ffn, hidden) * hidden**-0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(num_experts, hidden, ffn) * ffn**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        out = torch.zeros_like(tokens)
        mask = F.one_hot(chosen, num_classes=self.gate_up_proj.shape[0]).permute(2, 1, 0)
        for e in range(self.gate_up_proj.shape[0]):
            slot, token = torch.where(mask[e])
            gate, up = F.linear(tokens[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view_as(x)


def measure_chunk_overhead(mesh: Any, topology: Topology, device: torch.device, reps: int, warmup: int
                           ) -> tuple[float, dict[int, float]]:
    """(the fitted fixed cost of a pipeline chunk per direction, the measured forward + backward
    seconds per chunk count) on ``mesh``, whose links ``topology`` describes.

    The ``CHUNK_PROBE`` layer (``ChunkProbe``, E = 2 per rank, random routing: about uniform) is
    compiled with hiermoe (HD-1: the flat deduplicating all-to-all; inner compiler aot_eager) once
    per chunk count in ``CHUNK_COUNTS``; ``warmup`` untimed steps each (at least one: it
    compiles), then ``reps`` rounds timing one step of every count in a rotated order, each after a
    barrier, a step's time the slowest rank's, the median per count. MoNTA's schedule of that layer
    (``cost.planner.layer_times`` at d = 1, as the planner builds it) is then fitted by
    ``cost.pipeline.fit_chunk_overhead``: the constant that makes its predicted growth over one
    chunk the measured one. Every rank gets the same value. Collective: every rank calls it at the
    same point. Raises RuntimeError when the probe did not run expert-parallel in n chunks (the
    traffic counters of ``ep.runtime`` show how many messages each step sent)."""
    world = dist.get_world_size()
    h, f, k, tokens = (CHUNK_PROBE[key] for key in ("hidden_size", "ffn_size", "top_k", "tokens"))
    num_experts = CHUNK_PROBE["experts_per_rank"] * world
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)  # the same weights on every rank, as a replicated model has
        layer = ChunkProbe(h, f, num_experts, k).to(device)
    gen = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randn(4, tokens // 4, h, generator=gen, device=device, requires_grad=True)
    grad = torch.randn(x.shape, generator=gen, device=device)
    steps = {}
    for n in CHUNK_COUNTS:
        options = {"mesh": mesh, "topology": topology, "inner_compiler": "aot_eager", "dimension": 1, "pipeline": n,
                   "expert_gather": False, "model_centric": False}
        steps[n] = torch.compile(copy.deepcopy(layer), backend="hiermoe", options=options)

    def run(n: int) -> None:
        x.grad = None
        (steps[n](x) * grad).sum().backward()

    for n in CHUNK_COUNTS:
        reset_counters()
        for _ in range(max(1, warmup)):  # the first step compiles
            run(n)
        sent = sum(c["dispatch"]["forward"]["payload_messages"] for c in counters().values())
        if sent == 0 or sent % n:
            raise RuntimeError(f"--chunk-overhead: the probe layer compiled with pipeline={n} sent {sent} dispatch "
                               f"messages in {max(1, warmup)} step(s), not a multiple of {n}: it was not run "
                               "expert-parallel in chunks, so nothing measured here is a chunk's cost")
    times: dict[int, list[float]] = {n: [] for n in CHUNK_COUNTS}
    for rep in range(reps):
        order = CHUNK_COUNTS[rep % len(CHUNK_COUNTS):] + CHUNK_COUNTS[:rep % len(CHUNK_COUNTS)]
        for n in order:
            times[n] += _time_runs(functools.partial(run, n), device, reps=1, warmup=0)
    measured = {n: _agreed_median(ts, device) for n, ts in times.items()}
    work = Workload(tokens, h, f, num_experts, k, dtype_bytes=_ELEMENT_BYTES, gated=True, slot_bytes=SLOT_BYTES)
    return fit_chunk_overhead(layer_times(topology, work, 1, True), measured), measured


def _compute_values(local: float, device: torch.device, world_size: int) -> list[float]:
    """One value per rank when the devices differ by more than 20 % (heterogeneous), else the median."""
    t = torch.tensor([local], dtype=torch.float64, device=device)
    gathered = torch.empty(world_size, dtype=torch.float64, device=device)
    _all_gather(gathered, t)
    values = gathered.tolist()
    mid = statistics.median(values)
    return values if max(values) > 1.2 * min(values) else [mid]


def agreed_expert_compute(device: torch.device, world_size: int, attempts: int = 3) -> tuple[float, float] | str:
    """``measure_expert_compute`` on every rank, agreed: the ranks' median rates
    ``(expert_flops_per_s, expert_row_bytes_per_s)``; where some rank's fit failed (its runs
    showed no cost for one term: noise on a busy device) every rank measures again, up to
    ``attempts`` times, then a sentence saying which ranks (the same on every rank)."""
    for _ in range(attempts):  # every rank measures again where any rank's fit failed
        try:
            flops, row_bw, _ = measure_expert_compute(device)
        except ValueError:
            flops, row_bw = math.nan, math.nan
        t = torch.tensor([flops, row_bw], dtype=torch.float64, device=device)
        gathered = torch.empty(2 * world_size, dtype=torch.float64, device=device)
        _all_gather(gathered, t)
        pairs = gathered.view(world_size, 2)
        failed = pairs.isnan().any(dim=1).nonzero().flatten().tolist()
        if not failed:
            return float(pairs[:, 0].median()), float(pairs[:, 1].median())
    return (f"the fit of hiermoe::experts' times found no cost for its matmuls or its rows on rank(s) {failed}, "
            f"{attempts} times (noise: give a topology file from moe-calibrate)")


def fit_measurements(measurements: Sequence[Measurement]) -> list[Fit]:
    fits = []
    for m in measurements:
        alpha, beta, r2 = fit_collective(m.sizes_bytes, m.times_s, m.group_size)
        fits.append(Fit(m, alpha, beta, r2))
    return fits


def build_topology(fits: Sequence[Fit], names: Sequence[str], sizes: Sequence[int], *, flops_per_s: Sequence[float],
                   mem_bw_bytes_per_s: Sequence[float], name: str) -> Topology:
    by_key = {(f.measurement.collective, f.measurement.group): f for f in fits}
    levels = []
    for level_name, size in zip(names, sizes):
        f = by_key[("all_to_all", level_name)]
        if f.beta_s_per_byte <= 0:
            raise ValueError(f"level {level_name!r}: the all-to-all time does not grow with the message size over "
                             f"{f.measurement.sizes_bytes[0]}..{f.measurement.sizes_bytes[-1]} bytes (fitted beta "
                             f"{f.beta_s_per_byte:.3g} s/B); raise --max-bytes or --reps")
        levels.append(Level(level_name, size, f.alpha_s, f.beta_s_per_byte))
    efficiency: dict[str, EfficiencyCurve] = {}
    for f in fits:
        m = f.measurement
        # the world all-to-all is held against the slowest link; (g0-1)/g0 of its buffer crosses it
        ref, frac = ((levels[0], link_fraction(levels[0].size)) if m.group == WORLD
                     else (levels[list(names).index(m.group)], link_fraction(m.group_size)))
        efficiency[f"{m.collective}_{m.group}"] = efficiency_curve(m.sizes_bytes, m.times_s, ref.beta_s_per_byte,
                                                                   frac)
    efficiency["all_to_all"] = efficiency[f"all_to_all_{names[0]}"]
    efficiency["all_gather"] = efficiency[f"all_gather_{names[-1]}"]
    return Topology(levels=tuple(levels), flops_per_s=tuple(flops_per_s), mem_bw_bytes_per_s=tuple(mem_bw_bytes_per_s),
                    efficiency=efficiency, name=name)


# the probe (``probe``): per level, all-to-all buffers of 64 KiB .. 1 MiB per rank, 3 sizes, one
# untimed and 3 timed runs each: about 0.5 s on 4 gloo ranks of a 2-core machine
PROBE_BYTES = (1 << 16, 1 << 20)
PROBE_STEPS = 3
PROBE_REPS = 3
_probed: dict[tuple[Any, ...], Topology] = {}


def probe(mesh: Any) -> Topology:
    """The topology of ``mesh`` measured now, quickly: what ``{"mesh": mesh}`` alone runs on.

    Every rank calls it at the same point (it is collective). Per mesh level, the subgroup
    all-to-all (the one the expert-parallel dispatch uses: ``resolve_a2a``) is timed at
    ``PROBE_STEPS`` buffer sizes in ``PROBE_BYTES``, each run's time the slowest rank's, and fitted
    to HierMoE Eq. 1 (``fit_collective``, non-negative least squares); matmul rate and copy
    bandwidth as ``measure_compute``. Every rank gets the same numbers (max-reduced and gathered
    times, the same fit), so every rank plans alike; the expert op's rates as
    ``agreed_expert_compute`` (where a rank's fit fails, none are kept and the topology's name
    says why). A level whose fit finds no growth with size
    (beta = 0: start-up dominates at these sizes) gets alpha = 0 and beta = its largest run's time
    per byte sent, an upper estimate. No efficiency curves: calibrate (``moe-calibrate``, this
    module's command line) for those and for accurate alpha/beta.

    Cached in this process per (level names, sizes, ranks, every rank's host name): the next
    compile on the same mesh and hosts reuses it."""
    names = tuple(mesh.mesh_dim_names or ())
    sizes = tuple(int(s) for s in mesh.mesh.shape)
    world = dist.get_world_size()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    key = (names, sizes, tuple(int(r) for r in mesh.mesh.flatten().tolist()), tuple(hosts))
    if key in _probed:
        return _probed[key]
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    a2a = resolve_a2a(None, device)
    plan = [("all_to_all", name, size, message_sizes(*PROBE_BYTES, PROBE_STEPS, multiple_of=size * _ELEMENT_BYTES))
            for name, size in zip(names, sizes, strict=True)]
    t0 = time.perf_counter()
    fits = fit_measurements(measure(mesh, plan, device, PROBE_REPS, 1, lambda _: None, a2a))
    levels = []
    for f, name, size in zip(fits, names, sizes, strict=True):
        m = f.measurement
        alpha, beta = f.alpha_s, f.beta_s_per_byte
        if beta <= 0:
            alpha, beta = 0.0, m.times_s[-1] / (m.sizes_bytes[-1] * link_fraction(size))
        levels.append(Level(name, size, alpha, beta))
    flops, mem_bw = measure_compute(device)
    flops_values, mem_values = _compute_values(flops, device, world), _compute_values(mem_bw, device, world)
    expert = agreed_expert_compute(device, world)
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's, so the name is the same everywhere
    rates = expert if isinstance(expert, tuple) else (None, None)
    unmeasured = "" if isinstance(expert, tuple) else f"; expert op not measured, FLOPs alone charged: {expert}"
    topo = Topology(levels=tuple(levels), flops_per_s=tuple(flops_values), mem_bw_bytes_per_s=tuple(mem_values),
                    name=f"measured at the first compile in {float(took):.2f} s ({a2a} all-to-all){unmeasured}",
                    expert_flops_per_s=rates[0], expert_row_bytes_per_s=rates[1])
    _probed[key] = topo
    return topo


def fit_table(fits: Sequence[Fit]) -> Table:
    table = Table(title="alpha-beta fits: t = alpha + n (g-1)/g * beta, n = buffer bytes per rank, g = ranks")
    for col in ("collective", "group", "ranks", "alpha (us)", "beta (s/B)", "link (Gb/s)", "r^2", "n (bytes)"):
        table.add_column(col, justify="left" if col in ("collective", "group") else "right")
    for f in fits:
        m = f.measurement
        bw = f"{8.0 / f.beta_s_per_byte / 1e9:.3g}" if f.beta_s_per_byte > 0 else "-"
        table.add_row(m.collective, m.group, str(m.group_size), f"{f.alpha_s * 1e6:.3g}", f"{f.beta_s_per_byte:.3e}",
                      bw, f"{f.r2:.6f}", f"{m.sizes_bytes[0]}..{m.sizes_bytes[-1]}")
    return table


_A2A_WHAT = {"recv-first": "lowering.p2p_a2a.all_to_all_single_recv_first, receives posted before sends",
             "library": "torch.distributed.all_to_all_single"}


def _stdout_console() -> Console:
    # Off a terminal (logs, pipes) rich assumes 80 columns and would elide the numbers.
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    err = Console(stderr=True)
    try:
        names, sizes = parse_mesh(args.mesh)
        if "WORLD_SIZE" not in os.environ:
            raise ValueError("no WORLD_SIZE in the environment: run under torchrun, e.g. "
                             f"torchrun --nproc-per-node {math.prod(sizes)} -m moe_compile.tools.calibrate --mesh {args.mesh}")
        world_size = int(os.environ["WORLD_SIZE"])
        check_world_size(names, sizes, world_size)
        if args.reps < 1 or args.warmup < 0 or args.retries < 0:
            raise ValueError(f"--reps must be >= 1, --warmup and --retries >= 0, got {args.reps}, {args.warmup} "
                             f"and {args.retries}")
        plan = plan_measurements(names, sizes, world_size, args)
    except ValueError as e:
        if rank == 0:
            err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
        a2a = resolve_a2a(args.a2a, device)
        total = sum(len(msgs) for *_, msgs in plan)
        with Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, disable=rank != 0, transient=False) as progress:
            task = progress.add_task("calibrating", total=total)
            measurements = measure(mesh, plan, device, args.reps, args.warmup,
                                   lambda what: progress.update(task, advance=1, description=what), a2a)
        flops_values, mem_values = [args.flops_per_s], [args.mem_bw_bytes_per_s]
        if args.flops_per_s is None or args.mem_bw_bytes_per_s is None:
            flops, mem_bw = measure_compute(device)
            if args.flops_per_s is None:
                flops_values = _compute_values(flops, device, world_size)
            if args.mem_bw_bytes_per_s is None:
                mem_values = _compute_values(mem_bw, device, world_size)
        fits = retime_flat_levels(mesh, plan, measurements, names, device, args, a2a,
                                  note=(lambda msg: err.print(msg, markup=False, highlight=False)) if rank == 0
                                  else (lambda msg: None))
        name = args.name or f"calibrated {args.mesh} ({device.type}, {a2a} all-to-all)"
        try:
            topo = build_topology(fits, names, sizes, flops_per_s=flops_values, mem_bw_bytes_per_s=mem_values,
                                  name=name)
        except ValueError as e:
            if rank == 0:
                _stdout_console().print(fit_table(fits))
                err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
            return 1
        expert = agreed_expert_compute(device, world_size)
        if isinstance(expert, str):
            if rank == 0:
                err.print(f"error: measuring the expert op: {expert}", markup=False, highlight=False, soft_wrap=True)
            return 1
        topo = dataclasses.replace(topo, expert_flops_per_s=expert[0], expert_row_bytes_per_s=expert[1])
        chunk_note = ""
        if args.chunk_overhead:
            overhead, per_n = measure_chunk_overhead(mesh, topo, device, args.reps, args.warmup)
            topo = dataclasses.replace(topo, chunk_overhead_s=overhead)
            chunk_note = ("pipeline chunks: probe layer forward + backward "
                          + ", ".join(f"n={n} {t * 1e3:.1f} ms" for n, t in per_n.items())
                          + f"; a chunk's fixed cost fitted: {overhead * 1e3:.2f} ms per direction")
        if rank == 0:
            console = _stdout_console()
            console.print(fit_table(fits))
            console.print(f"all-to-all timed: {a2a} ({_A2A_WHAT[a2a]})", markup=False, highlight=False)
            console.print(f"expert op (hiermoe::experts forward, measure_expert_compute): matmuls "
                          f"{expert[0] / 1e9:.3g} GFLOP/s, (token, expert) rows {expert[1] / 1e9:.3g} GB/s",
                          markup=False, highlight=False)
            if chunk_note:
                console.print(chunk_note, markup=False, highlight=False)
            for f in fits:
                if f.measurement.group in names and f.measurement.collective == "all_to_all" and f.alpha_s < 0:
                    console.print(f"note: level {f.measurement.group}: fitted alpha {f.alpha_s * 1e6:.3g} us < 0 is "
                                  "noise around a start-up time near zero; wrote alpha_s = 0", markup=False,
                                  highlight=False)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            topo.save(args.out)
            console.print(f"wrote {args.out}: levels {', '.join(f'{lv.name}={lv.size}' for lv in topo.levels)}",
                          markup=False, highlight=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
