"""An emulated hierarchical cluster on one Linux machine: ``moe-cluster`` (``python -m moe_compile.tools.cluster``).

    moe-cluster run --nodes 2 --ranks-per-node 2 --rate 400mbit -- \\
        python -m moe_compile.tools.calibrate --mesh node=2,gpu=2 --out /tmp/cluster.toml
    moe-cluster run --config bench/clusters/two_node.toml --log-dir /tmp/logs -- python train.py
    moe-cluster plan --nodes 2 --sockets-per-node 2 --ranks-per-node 4   # print what would be made
    moe-cluster up --config ...                                           # keep it up until Ctrl-C
    moe-cluster cleanup                                                   # leftovers of killed runs

In Python: ``moe_compile.tools.cluster.run(ClusterSpec.create(nodes=2, ranks_per_node=2, rate="400mbit"),
["python", "script.py"], timeout_s=120, log_dir=...) -> exit status``, or ``with
EmulatedCluster(spec) as c: c.run(argv)`` for several commands on one cluster.

Every node is a network namespace joined to the others through a bridge by a veth link shaped
with ``tc``; with a socket level every socket is its own namespace behind its node's router
namespace, on a faster shaped link (``moe_compile.tools.cluster_net`` has the description format and the
layout).  The command runs under one ``torchrun`` per leaf namespace (``--nnodes`` = leaves,
``--node-rank`` = leaf index), so rank = leaf index * ranks per leaf + local rank: the mesh
``node=N[,socket=S],gpu=R`` (``ClusterSpec.mesh``, also in the ranks' ``MOE_CLUSTER_MESH``), slowest
first, matches ``init_device_mesh``'s row-major rank order.  Ranks get ``GLOO_SOCKET_IFNAME`` = the
leaf's veth, so gloo listens on (and advertises) the leaf's address: peers on other leaves reach it
over the shaped links, peers on the same leaf through the kernel's ``local`` route over loopback,
unshaped.

Everything made is removed when the run ends, fails, is interrupted (Ctrl-C, SIGTERM, SIGHUP) or
times out.  Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from moe_compile.tools.cluster_net import (
    IFACE,
    ClusterError,
    ClusterSpec,
    Leaf,
    LinkLevel,
    NetworkPlan,
    apply,
    kill_processes,
    load_spec,
    namespaces_unavailable,
    parse_delay,
    parse_rate,
    plan_network,
    privilege_problem,
    require_tools,
    run_namespaces,
    tcp_goodput_fraction,
    teardown,
)

__all__ = ["ClusterError", "ClusterSpec", "EmulatedCluster", "LinkLevel", "cleanup", "load_spec", "main",
           "namespaces_unavailable", "parse_delay", "parse_rate", "run", "tcp_goodput_fraction", "torchrun_tail"]

_run_counter = itertools.count()


def torchrun_tail(argv: Sequence[str]) -> list[str]:
    """What follows torchrun's own options: ``-m mod ...`` or ``script.py ...`` for Python (a leading
    ``python`` is dropped: torchrun starts its own interpreter), else ``--no-python cmd ...``."""
    argv = list(argv)
    if not argv:
        raise ValueError("no command to run: give it after --, e.g. -- python -m moe_compile.tools.calibrate --mesh ...")
    if re.fullmatch(r"python[0-9.]*", Path(argv[0]).name) or argv[0] == sys.executable:
        if len(argv) > 1 and (argv[1] == "-m" or not argv[1].startswith("-")):
            argv = argv[1:]
        else:
            return ["--no-python", *argv]
    if argv[0] == "-m" or argv[0].endswith(".py"):
        return argv
    return ["--no-python", *argv]


class EmulatedCluster:
    """Context manager: ``with EmulatedCluster(spec) as c: c.run([...])``; torn down on exit."""

    def __init__(self, spec: ClusterSpec, prefix: str = "hm") -> None:
        if not re.fullmatch(r"[a-z]{1,8}", prefix):
            raise ValueError(f"prefix {prefix!r}: 1 to 8 lowercase letters")
        k = next(_run_counter)
        self.spec = spec
        self.prefix = prefix
        self.run_id = f"{prefix}{os.getpid()}" + (f"_{k}" if k else "")
        self.plan: NetworkPlan = plan_network(self.run_id, spec)
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def leaves(self) -> tuple[Leaf, ...]:
        return self.plan.leaves

    def __enter__(self) -> EmulatedCluster:
        require_tools()
        if (problem := privilege_problem()) is not None:
            raise ClusterError(problem)
        with _signals_raise():
            apply(self.plan)  # removes what it made if it fails
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        # no signal may cut the teardown short
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            self._stop()
            teardown(self.plan.namespaces)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def torchrun_argv(self, leaf: Leaf, argv: Sequence[str], master_port: int = 29500) -> list[str]:
        return ["ip", "netns", "exec", leaf.namespace, sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(len(self.leaves)), "--node-rank", str(self.leaves.index(leaf)),
                "--nproc-per-node", str(self.spec.ranks_per_namespace), "--master-addr", self.leaves[0].address,
                "--master-port", str(master_port), "--monitor-interval", "0.2", *torchrun_tail(argv)]

    def rank_env(self, leaf: Leaf, env: Mapping[str, str] | None = None) -> dict[str, str]:
        out = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        # gloo (and tensorpipe) bind to and advertise this interface's address: the shaped link for
        # peers on other leaves, the local route (loopback) for peers on this one
        out.update(GLOO_SOCKET_IFNAME=IFACE, TP_SOCKET_IFNAME=IFACE, NCCL_SOCKET_IFNAME=IFACE,
                   MOE_CLUSTER_MESH=self.spec.mesh, MOE_CLUSTER_NAMESPACE=leaf.namespace)
        return {**out, **(env or {})}

    def run(self, argv: Sequence[str], *, timeout_s: float | None = None, log_dir: str | Path | None = None,
            master_port: int = 29500, env: Mapping[str, str] | None = None, failure_grace_s: float = 10.0) -> int:
        """Run ``argv`` on every rank (one torchrun per leaf namespace) and wait.  Output goes to
        ``log_dir/<leaf tag>.log`` (e.g. ``n0.log``) when given, else to this process's.  Returns 0,
        the first failing torchrun's status (the others are stopped ``failure_grace_s`` later), or 124
        on timeout."""
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        with _signals_raise(), contextlib.ExitStack() as stack:
            stack.callback(self._stop)
            for leaf in self.leaves:
                out: IO[bytes] | None = None
                if log_dir is not None:
                    out = stack.enter_context(open(Path(log_dir) / f"{leaf.tag}.log", "wb"))
                self._procs.append(subprocess.Popen(self.torchrun_argv(leaf, argv, master_port),
                                                    env=self.rank_env(leaf, env), stdout=out,
                                                    stderr=subprocess.STDOUT if out else None, start_new_session=True))
            return self._wait(timeout_s, failure_grace_s)

    def _wait(self, timeout_s: float | None, failure_grace_s: float) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed_at = None
        while True:
            codes = [p.poll() for p in self._procs]
            if all(c is not None for c in codes):
                return next((c for c in codes if c), 0)
            now = time.monotonic()
            if failed_at is None and any(codes):
                failed_at = now
            if failed_at is not None and now - failed_at > failure_grace_s:
                return next(c for c in codes if c)
            if deadline is not None and now > deadline:
                return 124
            time.sleep(0.05)

    def _stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM each torchrun's process group (torchrun passes it to its workers), SIGKILL after
        ``grace_s``, then kill anything still running inside the namespaces."""
        live = [p for p in self._procs if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in live:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
            deadline = time.monotonic() + grace_s
            while (live := [p for p in live if p.poll() is None]) and time.monotonic() < deadline:
                time.sleep(0.02)
        if self._procs:  # workers run in sessions of their own; whatever the run left goes too
            kill_processes(self.plan.namespaces)
        self._procs = []


class _Interrupted(KeyboardInterrupt):
    pass


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise (like Ctrl-C) so ``finally`` blocks tear the cluster down."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupted(f"signal {signal.Signals(signum).name}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(spec: ClusterSpec, argv: Sequence[str], *, timeout_s: float | None = None, log_dir: str | Path | None = None,
        master_port: int = 29500, env: Mapping[str, str] | None = None, failure_grace_s: float = 10.0,
        prefix: str = "hm") -> int:
    """Bring the cluster up, run ``argv`` on it (:meth:`EmulatedCluster.run`), tear it down.  Raises
    :class:`ClusterError` when the cluster cannot be built (no root, no iproute2, a failing command)."""
    with _signals_raise(), EmulatedCluster(spec, prefix) as cluster:
        return cluster.run(argv, timeout_s=timeout_s, log_dir=log_dir, master_port=master_port, env=env,
                           failure_grace_s=failure_grace_s)


def cleanup(prefix: str = "hm", everything: bool = False) -> list[str]:
    """Delete the namespaces (and processes in them) of runs with this prefix whose process is gone
    (all of them with ``everything``).  Returns the namespaces deleted."""
    deleted = []
    for run_id, (pid, names) in sorted(run_namespaces(prefix).items()):
        if not everything and os.path.exists(f"/proc/{pid}"):
            print(f"moe-cluster cleanup: {run_id} belongs to live process {pid}; left alone (--all removes it)",
                  file=sys.stderr)
            continue
        deleted += teardown(names)
    return deleted


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-cluster", description="Emulated hierarchical cluster: network namespaces "
                                "joined by tc-shaped veth links, one torchrun per node.",
                                epilog="The command to run comes after --, e.g. moe-cluster run --nodes 2 "
                                "--ranks-per-node 2 --rate 400mbit -- python -m moe_compile.tools.calibrate --mesh "
                                "node=2,gpu=2 --out /tmp/c.toml")
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_ in (("run", "bring the cluster up, run the command after -- on every rank, tear down"),
                        ("up", "bring the cluster up and keep it until Ctrl-C or SIGTERM"),
                        ("plan", "print the namespaces, addresses, ip/tc and torchrun commands (needs no root)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--config", type=Path, help="cluster description TOML (format: moe_compile/tools/cluster_net.py, "
                       "example: bench/clusters/two_node.toml)")
        s.add_argument("--nodes", type=int, help="number of nodes (default 2)")
        s.add_argument("--ranks-per-node", type=int, help="ranks per node, over all its sockets (default 2)")
        s.add_argument("--rate", help="node link rate per direction, tc syntax: 400mbit, 1gbit (default 1gbit)")
        s.add_argument("--delay", help="one-way delay between nodes, e.g. 1ms (needs netem; default 0ms)")
        s.add_argument("--sockets-per-node", type=int, help="add a socket level: sockets per node (default 1: none)")
        s.add_argument("--socket-rate", help="socket link rate per direction (default 10gbit)")
        s.add_argument("--socket-delay", help="one-way delay between sockets of a node (default 0ms)")
        s.add_argument("--prefix", default="hm", help="namespace name prefix (default hm: hm<pid>n0, ...)")
        if name == "run":
            s.add_argument("--log-dir", type=Path, help="write each torchrun's output to DIR/<leaf>.log")
            s.add_argument("--timeout", type=float, help="stop the command after this many seconds (status 124)")
            s.add_argument("--master-port", type=int, default=29500, help="torchrun's rendezvous port on node 0")
    c = sub.add_parser("cleanup", help="remove namespaces and processes left by runs that were killed")
    c.add_argument("--prefix", default="hm", help="namespace name prefix (default hm)")
    c.add_argument("--all", action="store_true", help="also remove those of runs that are still alive")
    return p


def _spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    base = load_spec(args.config) if args.config else ClusterSpec.create()
    return base.with_overrides(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate=args.rate, delay=args.delay,
                               sockets_per_node=args.sockets_per_node, socket_rate=args.socket_rate,
                               socket_delay=args.socket_delay)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        if args.action == "cleanup":
            require_tools()
            if (problem := privilege_problem()) is not None:
                raise ClusterError(problem)
            deleted = cleanup(args.prefix, args.all)
            print(f"moe-cluster cleanup: removed {len(deleted)} namespaces" + (f": {' '.join(deleted)}" if deleted else ""))
            return 0
        spec = _spec_from_args(args)
        if args.action == "run":
            torchrun_tail(command)  # a missing command is a usage error before anything is built
        cluster = EmulatedCluster(spec, args.prefix)
    except (ValueError, OSError, tomllib.TOMLDecodeError, ClusterError) as e:
        print(f"moe-cluster: error: {e}", file=sys.stderr)
        return 2
    if args.action == "plan":
        print(f"# {spec.describe()}")
        for leaf in cluster.leaves:
            print(f"# rank namespace {leaf.namespace}: {leaf.address} on {IFACE}")
        print("\n".join(" ".join(c) for c in cluster.plan.commands))
        for leaf in cluster.leaves:
            print(" ".join(cluster.torchrun_argv(leaf, command or ["python", "train.py"])))
        return 0
    try:
        with _signals_raise(), cluster:
            print(f"moe-cluster: {spec.describe()}; namespaces "
                  + ", ".join(f"{leaf.namespace} {leaf.address}" for leaf in cluster.leaves), file=sys.stderr)
            if args.action == "up":
                print(f"moe-cluster: up; e.g. ip netns exec {cluster.leaves[0].namespace} bash. Ctrl-C tears it "
                      "down.", file=sys.stderr)
                while True:
                    time.sleep(3600)
            code = cluster.run(command, timeout_s=args.timeout, log_dir=args.log_dir, master_port=args.master_port)
            if code == 124:
                print(f"moe-cluster: timed out after {args.timeout} s", file=sys.stderr)
            return code
    except ClusterError as e:
        print(f"moe-cluster: error: {e}", file=sys.stderr)
        return 2 if privilege_problem() or "iproute2" in str(e) else 1
    except KeyboardInterrupt as e:
        print(f"moe-cluster: interrupted ({str(e) or 'Ctrl-C'}); torn down", file=sys.stderr)
        return 130


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()

