"""What the benchmark scripts record about the machine (imported as a sibling module: the
scripts run as ``python bench/<script>.py``, which puts bench/ on sys.path)."""

from __future__ import annotations

import multiprocessing
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what ``platform`` knows."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        return cpu


def fork_ranks(world: int, worker: Callable[[Any], None], args: Any, timeout_s: float, name: str,
               loadavg_env: str) -> int:
    """Fork ``world`` ranks after the imports (torch is imported once, not once per rank: on a
    small machine eight concurrent imports take most of a minute); each sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT (a gloo process group over localhost), OMP_NUM_THREADS=1 and
    ``loadavg_env`` (the 1-minute load average before the ranks started), then runs
    ``worker(args)``. Rank 0 prints to the terminal, the others to logs shown if something
    fails. Returns 0, or 1 when a rank failed or ``timeout_s`` passed (every rank killed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = Path(tempfile.mkdtemp(prefix=f"{name}_ranks_"))
    loadavg = os.getloadavg()[0]  # before our ranks add to it

    def entry(rank: int) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1", **{loadavg_env: f"{loadavg:.2f}"})
        if rank != 0:
            fd = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        worker(args)

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=entry, args=(r,)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failed: int | None = None
    while failed is None and any(p.is_alive() for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
        if failed is None and time.monotonic() > deadline:
            failed = -1
        time.sleep(0.2)
    if failed is None:
        failed = next((r for r, p in enumerate(procs) if p.exitcode), None)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    if failed is None:
        shutil.rmtree(logs, ignore_errors=True)
        return 0
    print((f"rank {failed} failed" if failed >= 0 else f"timed out after {timeout_s} s") + f"; rank logs in {logs}",
          file=sys.stderr)
    for r in range(1, world):
        if (r == failed or failed < 0) and (logs / f"rank{r}.log").exists():
            print(f"--- rank {r} ---\n{(logs / f'rank{r}.log').read_text()[-3000:]}", file=sys.stderr)
    return 1


def resolve_ranks(p: Any, args: Any, topology_file: str | None = None) -> None:
    """Set ``args.world``, ``args.mesh_names`` and ``args.mesh_sizes`` for a benchmark that forks
    its own ranks or runs under torchrun / moe-cluster: the world is torchrun's WORLD_SIZE or
    ``args.world`` (default 8), the mesh ``args.mesh``, else moe-cluster's MOE_CLUSTER_MESH, else
    node=2,socket=2,gpu=2 for 8 ranks. A topology file must have the mesh's levels. Errors go
    through the argparse parser ``p``."""
    from moe_compile.cost.topology import Topology
    from moe_compile.tools import calibrate

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and args.world is not None and args.world != int(os.environ["WORLD_SIZE"]):
        p.error(f"--world {args.world} but torchrun started {os.environ['WORLD_SIZE']} ranks (WORLD_SIZE)")
    if args.world is None:
        args.world = int(os.environ["WORLD_SIZE"]) if under_torchrun else 8
    mesh = args.mesh or os.environ.get("MOE_CLUSTER_MESH") or ("node=2,socket=2,gpu=2" if args.world == 8 else None)
    if mesh is None:
        p.error(f"--world {args.world}: give --mesh NAME=SIZE,... (slowest first) with product {args.world}")
    try:
        args.mesh_names, args.mesh_sizes = calibrate.parse_mesh(mesh)
        calibrate.check_world_size(args.mesh_names, args.mesh_sizes, args.world)
        if topology_file is not None:
            topo = Topology.load(topology_file)
            if (tuple(topo.level_names), tuple(topo.sizes)) != (args.mesh_names, args.mesh_sizes):
                raise ValueError(f"--topology {topology_file} has levels {dict(zip(topo.level_names, topo.sizes))}"
                                 f", the mesh {dict(zip(args.mesh_names, args.mesh_sizes))}: calibrate on this mesh")
    except (ValueError, OSError) as e:
        p.error(str(e))
