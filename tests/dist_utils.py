"""Spawn real gloo ranks on this machine: one Python process per rank, rendezvous over localhost.

``run_ranks(world, case, **params)`` runs ``tests/ep_worker.py <case>`` (or another worker
script of tests/, ``worker=``) in ``world`` processes
and returns each rank's JSON result (what the worker wrote); a rank that fails raises with its
output. Processes that outlive ``timeout_s`` are killed (no test hangs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("ep_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, case: str, params: dict[str, Any], timeout_s: float, out_dir: str,
           worker: Path = WORKER, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   HIERMOE_TEST_OUT=out_dir, HIERMOE_TEST_PARAMS=json.dumps(params))
        procs.append(subprocess.Popen([sys.executable, str(worker), case], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=rank_env))
    deadline = time.monotonic() + timeout_s
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[killed after {timeout_s} s]"
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return results


def run_ranks(world: int, case: str, timeout_s: float = 240.0, worker: str = "ep_worker.py",
              env: dict[str, str] | None = None, **params: Any) -> list[dict[str, Any]]:
    """``env``: environment variables the ranks get beyond this process's."""
    with tempfile.TemporaryDirectory(prefix="hiermoe_ranks_") as out_dir:
        done = launch(world, case, params, timeout_s, out_dir, WORKER.with_name(worker), env)
        failed = [(r, p) for r, p in enumerate(done) if p.returncode != 0]
        # show the root cause first: ranks that failed because a peer died say so
        failed.sort(key=lambda rp: "closed by peer" in rp[1].stdout or "killed after" in rp[1].stdout)
        if failed:
            rank, p = failed[0]
            raise AssertionError(f"rank {rank} of {world} failed ({p.returncode}) in case {case}:\n{p.stdout[-6000:]}")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
