"""The emulated cluster (moe_compile/cluster.py): cluster descriptions and the network plan (no root
needed), then, where network namespaces can be made (root, iproute2), real runs: an all_to_all
across 2 nodes x 2 ranks checked against locally computed values, intra-node traffic on loopback,
the shaped rate recovered, teardown after success, failure, timeout and SIGTERM, cleanup of
leftovers, and a quick calibration.  The namespaces here use the prefix ``hmt`` (test) so a test
never touches the clusters of a ``moe-cluster`` run beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_compile.cost import Topology
from moe_compile.tools import cluster
from moe_compile.tools.cluster import (
    ClusterSpec,
    EmulatedCluster,
    load_spec,
    parse_delay,
    parse_rate,
    run,
    tcp_goodput_fraction,
    torchrun_tail,
)
from moe_compile.tools.cluster_net import SUBNET, namespaces_unavailable, run_namespaces

REPO = Path(__file__).resolve().parents[1]
PREFIX = "hmt"
SCRIPT = str(REPO / "tests" / "cluster_a2a_script.py")
_unavailable = namespaces_unavailable(PREFIX) if sys.platform == "linux" else "network namespaces are Linux only"
needs_netns = pytest.mark.skipif(_unavailable is not None,
                                 reason=f"emulated cluster unavailable here: {_unavailable}")


def test_parse_rate_and_delay() -> None:
    assert parse_rate("400mbit") == 400e6 and parse_rate("1gbit") == 1e9 and parse_rate("2.5Gbit") == 2.5e9
    assert parse_rate("1000") == 1000 and parse_rate("none") == float("inf")
    assert parse_delay("0") == 0 and parse_delay("2ms") == pytest.approx(2e-3) and parse_delay("250us") == 250e-6
    for bad in ("400mbps", "fast", "-1mbit", "0bit"):
        with pytest.raises(ValueError, match="bits per second"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="unit"):
        parse_delay("3")


def test_example_descriptions() -> None:
    two = load_spec(REPO / "bench" / "clusters" / "two_node.toml")
    assert two.mesh == "node=2,gpu=2" and two.world_size == 4 and two.links[0].rate_bit_s == 400e6
    three = load_spec(REPO / "bench" / "clusters" / "two_node_two_socket.toml")
    assert three.mesh == "node=2,socket=2,gpu=2" and three.world_size == 8 and three.ranks_per_node == 4
    # command-line overrides keep the level names and split ranks over sockets
    assert three.with_overrides(nodes=3, ranks_per_node=2).mesh == "node=3,socket=2,gpu=1"
    assert ClusterSpec.create(nodes=2, ranks_per_node=4, sockets_per_node=2).mesh == "node=2,socket=2,gpu=2"
    with pytest.raises(ValueError, match="multiple of --sockets-per-node"):
        two.with_overrides(sockets_per_node=3)


@pytest.mark.parametrize("body, message", [
    ('[[levels]]\nname = "node"\nsize = 2\nrate = "1gbit"\n[[levels]]\nname = "gpu"\nsize = 2\nrate = "1gbit"\n',
     "takes no rate"),
    ('[[levels]]\nname = "node"\nsize = 2\n[[levels]]\nname = "gpu"\nsize = 2\n', "needs a rate"),
    ('[[levels]]\nname = "gpu"\nsize = 2\n', "2 or 3"),
    ('[[levels]]\nname = "node"\nsize = 2\nrate = "1gbit"\nspeed = 1\n[[levels]]\nname = "gpu"\nsize = 2\n',
     "unknown keys"),
])
def test_bad_descriptions(tmp_path: Path, body: str, message: str) -> None:
    (tmp_path / "c.toml").write_text(body)
    with pytest.raises(ValueError, match=message):
        load_spec(tmp_path / "c.toml")


def test_plan_stays_inside_its_namespaces() -> None:
    """Every device is made inside one of the run's namespaces; every address is in the private subnet."""
    c = EmulatedCluster(ClusterSpec.create(nodes=2, ranks_per_node=4, sockets_per_node=2, rate="400mbit",
                                           socket_rate="2gbit"), prefix=PREFIX)
    assert [leaf.address for leaf in c.leaves] == [f"{SUBNET}.1.1", f"{SUBNET}.1.2", f"{SUBNET}.2.1", f"{SUBNET}.2.2"]
    for cmd in c.plan.commands:
        if cmd[:3] == ("ip", "netns", "add"):
            assert cmd[3] in c.plan.namespaces
        elif cmd[:3] == ("ip", "netns", "exec"):
            assert cmd[3] in c.plan.namespaces and cmd[4] == "sysctl"
        else:  # ip -n NS ... / tc -n NS ...
            assert cmd[1] == "-n" and cmd[2] in c.plan.namespaces, cmd
        assert all(a.startswith(SUBNET) for a in cmd if a[0].isdigit() and a.count(".") == 3), cmd
    # both ends of the node link and of every socket link are shaped
    rates = [cmd[cmd.index("rate") + 1] for cmd in c.plan.commands if "tbf" in cmd]
    assert rates.count("400000000bit") == 4 and rates.count("2000000000bit") == 8
    argv = c.torchrun_argv(c.leaves[3], ["python", "-m", "moe_compile.tools.calibrate", "--mesh", c.spec.mesh])
    assert argv[:4] == ["ip", "netns", "exec", c.leaves[3].namespace]
    assert argv[argv.index("--node-rank") + 1] == "3" and argv[argv.index("--nnodes") + 1] == "4"
    assert argv[argv.index("--master-addr") + 1] == c.leaves[0].address


def test_torchrun_tail() -> None:
    assert torchrun_tail(["python", "-m", "m", "--x"]) == ["-m", "m", "--x"]
    assert torchrun_tail([sys.executable, "train.py", "1"]) == ["train.py", "1"]
    assert torchrun_tail(["train.py"]) == ["train.py"]
    assert torchrun_tail(["moe-calibrate", "--mesh", "node=2"]) == ["--no-python", "moe-calibrate", "--mesh", "node=2"]
    assert torchrun_tail(["python3", "-c", "pass"]) == ["--no-python", "python3", "-c", "pass"]
    with pytest.raises(ValueError, match="no command"):
        torchrun_tail([])


def test_cli_without_root(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cluster, "privilege_problem", lambda: "the emulated cluster needs root (CAP_NET_ADMIN ...)")
    assert cluster.main(["run", "--nodes", "2", "--", "python", "x.py"]) == 2
    assert "needs root" in capsys.readouterr().err
    assert cluster.main(["cleanup"]) == 2
    # plan needs no privileges
    assert cluster.main(["plan", "--nodes", "3", "--rate", "1gbit", "--", "python", "-m", "m"]) == 0
    out = capsys.readouterr().out
    assert "mesh node=3,gpu=2" in out and "tc -n" in out and "--node-rank 2" in out
    assert cluster.main(["run", "--nodes", "2"]) == 2  # no command after --
    assert "no command" in capsys.readouterr().err


def _leftovers(marker: str) -> tuple[list[str], list[int]]:
    """Namespaces of this process's runs, and processes whose command line mentions ``marker``."""
    names = [ns for pid, nss in run_namespaces(PREFIX).values() if pid == os.getpid() for ns in nss]
    procs = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    procs.append(int(d.name))
            except OSError:
                pass
    return names, procs


@pytest.mark.ranks
@needs_netns
def test_all_to_all_and_calibration_across_two_nodes(tmp_path: Path) -> None:
    """2 nodes x 2 ranks at 400 Mbit/s, one run (starting torch in 4 processes is most of the time):

    - all_to_all_single, even and uneven splits, equals the locally computed result on every rank;
    - a 1 and 4 MiB exchange inside a node leaves nothing on the shaped interface (it goes over
      loopback), one across nodes goes over it;
    - calibration (``moe_compile.tools.calibrate --a2a recv-first``, calibrate's default on gloo, run in the
      same processes through tests/cluster_calibrate_recv_first.py: gloo's own all-to-all runs a
      pair's two directions one after the other, see bench/results/cluster_calibration.md) finds
      the node link's rate: its node-level bandwidth
      times the 2 ranks that share the link is the configured rate less TCP/IP/Ethernet headers
      (tcp_goodput_fraction), within the bounds below;
    - nothing is left behind: no namespace, no process, no link in this namespace."""
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count("\n")
    spec = ClusterSpec.create(nodes=2, ranks_per_node=2, rate="400mbit")
    topo_path = tmp_path / "cluster.toml"
    code = run(spec, ["python", SCRIPT, "--out", str(tmp_path / "out"), "--bench-mib", "1", "4", "--reps", "2",
                      "--calibrate", "--mesh", spec.mesh, "--out", str(topo_path), "--min-bytes", str(1 << 19),
                      "--max-bytes", str(8 << 20), "--steps", "3", "--reps", "5", "--warmup", "1",
                      "--flops-per-s", "1e12", "--mem-bw-bytes-per-s", "1e11"],
               timeout_s=120, log_dir=tmp_path / "logs", prefix=PREFIX)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert code == 0, logs
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["checks"] == {"even": True, "uneven": True} for r in results), results
    assert [r["namespace"][-2:] for r in results] == ["n0", "n0", "n1", "n1"]  # rank order = mesh order
    rows = {(row["case"], row["bytes"]): row for row in results[0]["bench"]}
    for size in (1 << 20, 4 << 20):
        # intra-node: a few barrier messages at most cross the veth, not the 1-4 MiB exchanged
        assert rows["pair_intra_node", size]["veth_tx_bytes"] < 64 << 10, rows
        assert rows["oneway_inter_node", size]["veth_tx_bytes"] >= size
    topo = Topology.load(topo_path)
    node, gpu = topo.level("node"), topo.level("gpu")
    # The full calibration (bench/results/cluster_calibration.md) lands within 2 % of the payload
    # rate; this quick one (3 sizes up to 8 MiB, median of 5, on 2 shared cores) within 4-13 %
    # over repeated runs, as a busy machine stretches the largest transfers most.  The bounds
    # still fail for an unshaped link (far above) and for gloo's own all-to-all (about 0.65).
    payload_gbps = 0.4 * tcp_goodput_fraction()
    assert 0.8 * payload_gbps < node.bandwidth_gbps * spec.ranks_per_node < 1.1 * payload_gbps, logs
    assert gpu.bandwidth_gbps > 2 * node.bandwidth_gbps  # loopback inside a node is not shaped
    # If these fail, the emulation left something behind: fix the teardown, not the test.
    assert _leftovers(str(tmp_path)) == ([], [])
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count("\n") == host_links


@pytest.mark.ranks
@needs_netns
def test_failure_and_timeout_tear_down(tmp_path: Path) -> None:
    """A rank that fails stops the run (its peers are stopped, not left waiting); a run past its
    timeout returns 124; nothing is left either way."""
    marker = f"sleep {600 + os.getpid() % 100}"  # a command line only this test's ranks have
    fail_rank0 = ["sh", "-c", f'test "$RANK" != 0 || exit 3; exec {marker}']
    with EmulatedCluster(ClusterSpec.create(nodes=2, ranks_per_node=1, rate="1gbit"), prefix=PREFIX) as c:
        assert c.run(fail_rank0, timeout_s=60, failure_grace_s=0.5, log_dir=tmp_path) != 0
        assert _leftovers(marker)[1] == []
        assert c.run(marker.split(), timeout_s=1.0, log_dir=tmp_path) == 124
    assert _leftovers(marker) == ([], [])


@pytest.mark.ranks
@needs_netns
def test_sigterm_tears_down() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "moe_compile.tools.cluster", "up", "--prefix", PREFIX, "--nodes", "2",
                             "--ranks-per-node", "1"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(pid == proc.pid for pid, _ in run_namespaces(PREFIX).values()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "torn down" in err
    assert not any(pid == proc.pid for pid, _ in run_namespaces(PREFIX).values())


@pytest.mark.ranks
@needs_netns
def test_cleanup_removes_dead_runs_only() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names a run whose process is gone
    stale, live = f"{PREFIX}{dead.pid}n0", f"{PREFIX}{os.getpid()}_99b"
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        assert cluster.cleanup(PREFIX) == [stale]
        assert sleeper.wait(timeout=10) != 0  # killed with its namespace
        assert cluster.cleanup(PREFIX, everything=True) == [live]
    finally:
        sleeper.kill()
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
