"""Spawn real gloo ranks on this machine: one Python process per rank, rendezvous over localhost.

``run_ranks(world, case, **params)`` runs ``tests/ep_worker.py <case>`` (or another worker
script of tests/, ``worker=``) in ``world`` processes
and returns each rank's JSON result (what the worker wrote); a rank that fails raises with its
output. Processes that outlive ``timeout_s`` are killed (no test hangs).

The ranks are forked from a forkserver that has imported torch, moe_compile and transformers once
(``_PRELOAD``): each fresh interpreter paid about 7 s of CPU for those imports (11 s with a
transformers model), 4 to 8 times a launch on 2 cores, which was most of the time the tests spent
on ranks. The forkserver also compiles the tiny LM once (``_rank_warmup``), so each rank's first
compile does not pay again for what every process's first compile pays. Every rank is still its own new process running the worker script from the top
(``runpy``, as ``python worker.py case`` would), so no state passes between tests. A launch with
``env`` starts plain interpreters instead: variables such as ``TRITON_INTERPRET`` are read when
the modules are imported, which in the forkserver happened before.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("ep_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone (world size 1), destroyed on the way out. Tests
    that need several ranks spawn processes; none may leave a group behind in this one."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a test leaked an initialized process group"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# what each rank's worker imports anyway, imported once in the forkserver the ranks are forked from
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "moe_compile",
            "moe_compile.backend", "moe_compile.ep.runtime", "moe_compile.ep.setup", "moe_compile.samples",
            "moe_compile.samples.tiny_lm", "transformers", "transformers.models.mixtral.modeling_mixtral",
            "transformers.models.qwen3_moe.modeling_qwen3_moe", "_rank_warmup"]
_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _run_worker(worker: str, case: str, env: dict[str, str], log: str) -> None:
    """A forked rank: its output to ``log``, its environment, then the worker script as
    ``python worker case`` runs it. torch read OMP_NUM_THREADS when the forkserver imported it,
    so the rank's thread count is set here."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [worker, case]
    sys.path.insert(0, os.path.dirname(worker))
    runpy.run_path(worker, run_name="__main__")


def _launch_forked(envs: list[dict[str, str]], worker: Path, case: str, timeout_s: float,
                   out_dir: str) -> list[subprocess.CompletedProcess[str]]:
    ctx = _forkserver()
    logs = [os.path.join(out_dir, f"rank{rank}.log") for rank in range(len(envs))]
    procs = [ctx.Process(target=_run_worker, args=(str(worker), case, env, log)) for env, log in zip(envs, logs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    killed = False
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            killed = True
            for q in procs:
                q.kill()
            for q in procs:
                q.join()
            break
    results = []
    for p, log in zip(procs, logs):
        out = Path(log).read_text() if os.path.exists(log) else ""
        if killed:
            out += f"\n[killed after {timeout_s} s]"
        results.append(subprocess.CompletedProcess([str(worker), case], p.exitcode, out, ""))
    return results


def launch(world: int, case: str, params: dict[str, Any], timeout_s: float, out_dir: str,
           worker: Path = WORKER, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    envs = [dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 HIERMOE_TEST_OUT=out_dir, HIERMOE_TEST_PARAMS=json.dumps(params)) for rank in range(world)]
    if env is None:
        return _launch_forked(envs, worker, case, timeout_s, out_dir)
    procs = []
    for rank_env in envs:
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


def check_checkpoint(c: dict[str, Any], rank: int, where: Any) -> None:
    """shard_worker.checkpoint_checks: the gathered state dict is the unsharded model's, loads into
    an unsharded model (same loss) and back into a sharded one (this rank's rows)."""
    assert not c["keys_missing"] and not c["keys_extra"], (where, c)
    assert c["state_err"] < 1e-4, (where, c)  # as weight_err: AdamW on near-zero gradients
    assert c["loaded_loss"] == pytest.approx(c["model_loss"], rel=1e-6), (where, c)
    assert c["fresh_rows_err"] == 0.0 and c["reload_err"] == 0.0, (where, c)  # rows copied as they are
    # a per-rank state dict names its rows' experts: reordered ones load back, another rank's are refused
    assert c["flipped_err"] == 0.0 and c["foreign_unchanged"] == 0.0, (where, c)
    if c["ids"]:  # stacked weights (expert modules keep their names)
        assert "another rank's shard" in c["foreign_error"], (where, c)
    if rank == 0:
        assert c["rank0_keys"] > 0 and c["rank0_err"] == 0.0, (where, c)
    else:
        assert c["rank0_keys"] == 0, (where, c)


def check_optim(c: dict[str, Any], rank: int, where: Any) -> None:
    """shard_worker.optim_checks: the gathered optimizer state is the unsharded optimizer's, loads
    back into the sharded optimizer unchanged and into an unsharded one."""
    assert not c["keys_missing"] and not c["keys_extra"] and c["groups_equal"], (where, c)
    assert c["state_err"] < 1e-4, (where, c)
    assert c["reload_err"] == 0.0 and c["unsharded_err"] == 0.0, (where, c)
    # a rank's own optimizer.state_dict() says whose rows it holds; the first rank's loaded on every
    # rank is refused on every rank at the next step (before, its experts' moments trained the others'),
    # and reordered rows are put back in the rank's order
    assert all(n > 0 for n in c["tagged"]), (where, c)
    others = list(range(1, c["world"]))
    assert "is not those ranks' own" in c["foreign_error"] and f"mesh position(s) {others}" in c["foreign_error"], \
        (where, c)
    assert c["foreign_weights_err"] == 0.0 and c["own_weights_err"] == 0.0, (where, c)
    assert c["flipped_state_err"] == 0.0 and c["own_state_err"] == 0.0, (where, c)
    if rank == 0:
        assert c["rank0_keys"] > 0 and c["rank0_err"] == 0.0, (where, c)
    else:
        assert c["rank0_keys"] == 0, (where, c)
