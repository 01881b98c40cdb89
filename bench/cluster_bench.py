"""What the benchmarks that run one layer per node-link rate on the emulated cluster share
(bench_pipeline.py, bench_gather.py): the driver's loop over rates, each rank's setup, the
report's heading per rate, and one timed forward + backward."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from bench_hier_a2a import calibrate_local

from moe_compile.cost.topology import Topology

T = TypeVar("T")


def cluster_rank(quick: bool, rate: str, efficiency: bool = False
                 ) -> tuple[int, int, Any, tuple[str, ...], Topology, Any]:
    """One rank of a benchmark run on the emulated cluster (torchrun's environment): one torch
    thread, stdout only on rank 0, the gloo group, the mesh (node=2, gpu=world/2), the links fitted
    at start (``calibrate_local``; ``efficiency``: with the levels' efficiency curves r(n) from
    the same measurements, else alpha-beta only) and the compute rate measured, the lowest over
    the ranks, and the expert op's rates (``agreed_expert_compute``), so that every rank plans on
    the same numbers. Returns (rank, world, mesh, level names, topology, a print that only rank
    0's does)."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe_compile.tools.calibrate import agreed_expert_compute, measure_compute

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    if int(os.environ["RANK"]) != 0:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    names, sizes = (("node", "gpu"), (2, world // 2)) if world > 2 else (("node",), (2,))
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    say = print if rank == 0 else (lambda *a, **k: None)
    for _ in range(3):  # a fit without a positive beta (too noisy on 2 loaded cores): measure again
        fitted, _ = calibrate_local(mesh, names, sizes, quick=quick)
        failed = torch.tensor([int(fitted is None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # every rank measures again, or none does
        if not int(failed):
            break
    else:
        raise RuntimeError("the calibration at start fitted no positive beta (too noisy) 3 times; run again")
    flops, mem_bw = measure_compute(torch.device("cpu"))
    rates = torch.tensor([flops, mem_bw], dtype=torch.float64)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)  # every rank plans on the same numbers
    expert = agreed_expert_compute(torch.device("cpu"), world)
    if isinstance(expert, str):
        raise RuntimeError(f"measuring the expert op at start: {expert}; run again")
    curves = fitted.efficiency if efficiency else {}  # from the same agreed times as the levels
    topology = Topology(levels=fitted.levels, flops_per_s=(float(rates[0]),), mem_bw_bytes_per_s=(float(rates[1]),),
                        efficiency=curves, name="the emulated cluster's links, fitted at start; compute measured",
                        expert_flops_per_s=expert[0], expert_row_bytes_per_s=expert[1])
    say(f"rate {rate}: " + ", ".join(f"{lv.name} alpha {lv.alpha_s * 1e6:.0f} us, {lv.bandwidth_gbps:.3g} Gbit/s"
                                     for lv in topology.levels) + f", {rates[0] / 1e9:.1f} GFLOP/s; expert op "
        f"{expert[0] / 1e9:.1f} GFLOP/s, rows {expert[1] / 1e9:.2f} GB/s", flush=True)
    return rank, world, mesh, names, topology, say


def run_per_rate(script: Path, args: Any, argv: list[str], out_env: str) -> list[dict[str, Any]] | int:
    """Run ``script``'s ranks (with ``argv`` and ``--rate r``) on a fresh emulated cluster per node
    link rate of ``args.rates`` (``args.cluster``'s spec, the rate and ``args.ranks_per_node``
    overridden; ``args.timeout``); rank 0 writes its JSON where ``out_env`` says. Returns each
    rate's JSON with the cluster's description under "cluster", or the ranks' exit code."""
    import tempfile

    from moe_compile.tools import cluster

    spec = cluster.load_spec(args.cluster)
    runs = []
    for rate in args.rates:
        out = Path(tempfile.mkdtemp(prefix=f"{script.stem}_")) / "rank0.json"
        rate_spec = spec.with_overrides(rate=rate, ranks_per_node=args.ranks_per_node)
        code = cluster.run(rate_spec, [sys.executable, str(script), *argv, "--rate", rate], timeout_s=args.timeout,
                           env={out_env: str(out)})
        if code:
            print(f"{script.stem}: the ranks exited with {code} at {rate}", file=sys.stderr)
            return int(code)
        run = json.loads(out.read_text())
        run["cluster"] = rate_spec.describe()
        runs.append(run)
    return runs


def rate_header(run: dict[str, Any]) -> list[str]:
    """The report's heading of one ``run_per_rate`` run: the node rate and the topology fitted."""
    topo = run["topology"]
    flops = topo["compute"]["flops_per_s"] if "compute" in topo else topo["flops_per_s"]
    flops = float(flops[0] if isinstance(flops, list) else flops)
    return [f"## node link {run['rate']}", "", "Topology (fitted at start): " + ", ".join(
        f"{lv['name']}: alpha {lv['alpha_s'] * 1e6:.0f} us, beta {lv['beta_s_per_byte'] * 1e9:.3g} ns/B"
        for lv in topo["levels"]) + f"; compute {flops / 1e9:.1f} GFLOP/s (measured)" + _expert_rates(topo) + ".", ""]


def _expert_rates(topo: dict[str, Any]) -> str:
    compute = topo.get("compute", topo)
    if compute.get("expert_flops_per_s") is None:
        return ""
    return (f"; expert op {compute['expert_flops_per_s'] / 1e9:.1f} GFLOP/s on its matmuls, "
            f"{compute['expert_row_bytes_per_s'] / 1e9:.2f} GB/s on its rows (measured)")


def forward_backward(fn: Any, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward of a layer: (its output, the input's gradient for upstream ``g``)."""
    xi = x.clone().requires_grad_()
    y = fn(xi)
    (gx,) = torch.autograd.grad(y, xi, g)
    return y.detach(), gx


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (the memory figures need Linux)")


def step_peak_bytes(run: Callable[[], T]) -> tuple[T, int]:
    """(what ``run()`` returned, the bytes this process's resident memory rose by at its peak
    during that one call): every thread's allocations (autograd's, the collectives' buffers on
    gloo's threads), which the torch profiler's CPU memory events miss on the communication
    threads. Before the call, freed heap memory goes back to the OS (``malloc_trim``), so memory
    the step reuses counts as it is touched again, and the kernel's peak-RSS mark is reset
    (``/proc/self/clear_refs`` 5); after it, the peak (VmHWM) less the resident memory before.
    Linux, glibc."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    out = run()
    return out, (_status_kib("VmHWM") - base) * 1024


def drive_rates(script: Path, args: Any, argv: list[str], out_env: str, report: Callable[[dict[str, Any]], str],
                **extra: Any) -> int:
    """The driver of a per-rate benchmark: ``run_per_rate``, then the payload (command, arguments, runs,
    wall time, date, load, ``extra``) reported by ``report``, printed and, with ``args.out``, written
    as ``<out>.json`` and ``<out>.md``. Returns the ranks' exit code, or 0."""
    start = time.perf_counter()
    runs = run_per_rate(script, args, argv, out_env)
    if isinstance(runs, int):
        return runs
    payload = {"command": shlex.join(["python", f"bench/{script.name}", *argv]),
               "args": vars(args) | {"cluster": str(args.cluster)}, "runs": runs, "wall_s": time.perf_counter() - start,
               "date": datetime.date.today().isoformat(), "load_avg_end": os.getloadavg()[0], **extra}
    text = report(payload)
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(payload, indent=1, default=str))
        Path(f"{args.out}.md").write_text(text)
    return 0


def bench_main(argv: list[str] | None, parse_args: Callable[[list[str]], Any], worker: Callable[[Any], None],
               drive: Callable[[Any, list[str]], int], report: Callable[[dict[str, Any]], str] | None = None) -> int:
    """A per-rate benchmark's entry: ``--report JSON`` (where ``report`` is given) rewrites the .md
    beside the JSON; under torchrun (RANK set) one rank's ``worker``; else the ``drive``r."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if report is not None and getattr(args, "report", None):
        path = Path(args.report)
        text = report(json.loads(path.read_text()))
        path.with_suffix(".md").write_text(text)
        print(text)
        return 0
    if "RANK" in os.environ:
        worker(args)
        return 0
    return drive(args, argv)
