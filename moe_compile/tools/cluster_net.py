"""The emulated cluster (``moe_compile.tools.cluster``): its description, and the network it becomes --
Linux network namespaces, veth links through a bridge, ``tc`` shaping -- built and torn down
through iproute2's ``ip`` and ``tc``.

Description (TOML, ``load_spec``), levels slowest first as in a topology file; every level but the
last is a shaped link, the last one is the ranks inside one namespace (loopback, no rate):

    name = "2 nodes x 2 ranks"
    [[levels]]
    name = "node"
    size = 2
    rate = "400mbit"   # tc rate per direction of each node's link: bits/s on the wire, headers included
    delay = "0ms"      # optional one-way delay between nodes (needs the kernel's netem qdisc)
    [[levels]]         # optional socket level: name, size (sockets per node), rate, delay
    name = "gpu"
    size = 2

Layout, for a run id ``hm<pid>`` (prefix + process id, so parallel runs never share a name):

    one shaped level (node):                   two shaped levels (node, socket):

    hm<pid>b: bridge br0                       hm<pid>b: bridge br0
      p0 ==node link== veth0 hm<pid>n0           p0 ==node link== veth0 hm<pid>n0 (router)
      p1 ==node link== veth0 hm<pid>n1                              br0: s0 ==socket link== veth0 hm<pid>n0s0
                                                                         s1 ==socket link== veth0 hm<pid>n0s1
                                                 p1 ==node link== veth0 hm<pid>n1 (router) ...

The ranks run in the *leaf* namespaces (``n<i>``, or ``n<i>s<j>`` with sockets); the ranks of one
leaf talk over that namespace's loopback: a packet to the leaf's own veth address is routed by the
``local`` table to ``lo`` and never enters the veth or its qdisc.  Every link is a veth pair shaped
on both ends (``tbf`` on the egress of each end), so each direction runs at the link's rate, like a
full-duplex NIC port on a switch; a delay (``netem``, when the kernel has it) sits on the bridge or
router end only, so one crossing of a link adds it once.  A node's ranks share its node link.
Addresses: node i's node-link end is 10.231.0.<i+1>/24; with sockets, node i's router holds
10.231.<i+1>.254/24 on its bridge and socket j is 10.231.<i+1>.<j+1>/24, routed through it.
Nothing is created in, or routed to, the namespace this process runs in: every device is created
inside one of the run's namespaces, and deleting the namespaces removes every device.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

IFACE = "veth0"  # the leaf's (and the router's uplink) interface in every namespace: GLOO_SOCKET_IFNAME
SUBNET = "10.231"
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_GSO_MAX_BYTES = 64 * 1024  # a veth hands tbf segmentation-offloaded packets of up to 64 KiB
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "kibit": 2.0**10, "mibit": 2.0**20,
               "gibit": 2.0**30, "tibit": 2.0**40}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up (missing tools or privileges, a failing ip/tc command)."""


def parse_rate(text: str) -> float:
    """A tc rate in bits per second: ``"400mbit"``, ``"1gbit"``, ``"2.5gbit"``, ``"100000000"``; ``"none"``
    (inf) leaves the link unshaped (veth speed, for comparisons)."""
    if str(text).strip().lower() in ("none", "inf", "unlimited"):
        return math.inf
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in ("", *_RATE_UNITS) or float(m.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: write a positive rate in bits per second as tc does, e.g. 400mbit, 1gbit "
                         "(tc's 'mbps' means megabytes per second and is not accepted here, to keep it apart from "
                         "topology files' bandwidth_gbps, which is gigabits)")
    return float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1.0)


def parse_delay(text: str) -> float:
    """A one-way delay in seconds: ``"0ms"``, ``"250us"``, ``"0"``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or (m.group(2) not in _TIME_UNITS and not (m.group(2) == "" and float(m.group(1)) == 0)):
        raise ValueError(f"delay {text!r}: write a time with a unit, e.g. 0ms, 500us, 2ms")
    return float(m.group(1)) * _TIME_UNITS.get(m.group(2), 0.0)


def tcp_goodput_fraction(mtu: int = 1500) -> float:
    """Share of a tc rate left for TCP payload: a full segment carries mtu - 52 payload bytes (IP 20,
    TCP 20 + 12 of timestamps) and tc counts mtu + 14 (Ethernet header): 1448 / 1514 = 0.956."""
    return (mtu - 52) / (mtu + 14)


@dataclass(frozen=True)
class LinkLevel:
    """A shaped level: ``size`` members inside one member of the level above, each on its own link."""

    name: str
    size: int
    rate_bit_s: float  # tc rate: bits per second on the wire (Ethernet + IP + TCP headers); inf: unshaped
    delay_s: float = 0.0  # one-way, added once per crossing of the link

    def tc_commands(self, namespace: str, dev: str, *, with_delay: bool) -> list[list[str]]:
        """Egress shaping of one end of a link: ``tbf`` at the rate, under ``netem`` for the delay."""
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", dev]
        delay = ["netem", "delay", f"{int(round(self.delay_s * 1e6))}us"] if with_delay and self.delay_s > 0 else []
        if math.isinf(self.rate_bit_s):  # unshaped: at most the delay
            return [[*tc, "root", "handle", "1:", *delay]] if delay else []
        rate_bytes_s = self.rate_bit_s / 8
        # The bucket holds one offloaded 64 KiB packet (smaller would make tbf split every one) or 1 ms
        # of traffic at high rates.  The queue holds 100 ms of traffic (4 MiB at least), so TCP almost
        # never loses a packet, as on a lossless fabric (at 20 ms, 2 ranks per node saw drops).
        burst = max(_GSO_MAX_BYTES + 32 * 1024, int(rate_bytes_s * 1e-3))
        tbf = ["tbf", "rate", f"{int(self.rate_bit_s)}bit", "burst", str(burst),
               "limit", str(max(4 << 20, int(rate_bytes_s * 0.1)))]
        if not delay:
            return [[*tc, "root", "handle", "1:", *tbf]]
        # netem's own queue must hold a delay's worth of packets at the rate (plus offload headroom)
        netem_limit = max(10_000, int(rate_bytes_s * self.delay_s / 1000) * 4)
        return [[*tc, "root", "handle", "1:", *delay, "limit", str(netem_limit)],
                [*tc, "parent", "1:1", "handle", "10:", *tbf]]


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster to emulate: shaped levels (node, optionally socket), then ranks per namespace."""

    links: tuple[LinkLevel, ...]  # shaped levels, slowest first: (node,) or (node, socket)
    ranks_per_namespace: int
    rank_level: str = "gpu"  # the mesh name of the ranks inside one namespace
    name: str = ""

    def __post_init__(self) -> None:
        names = [lv.name for lv in self.links] + [self.rank_level]
        if not 1 <= len(self.links) <= 2:
            raise ValueError(f"cluster: 1 shaped level (node) or 2 (node, socket) before the ranks' level, got "
                             f"{len(self.links)}")
        if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            raise ValueError(f"cluster: level names must be distinct identifiers, got {names}")
        for lv in self.links:
            if lv.size < 1 or lv.rate_bit_s <= 0 or lv.delay_s < 0:
                raise ValueError(f"cluster level {lv.name!r}: size >= 1, rate > 0 and delay >= 0, got {lv}")
        if self.ranks_per_namespace < 1:
            raise ValueError(f"cluster: at least one rank per namespace, got {self.ranks_per_namespace}")

    @classmethod
    def create(cls, nodes: int = 2, ranks_per_node: int = 2, rate: str = "1gbit", delay: str = "0ms",
               sockets_per_node: int = 1, socket_rate: str = "10gbit", socket_delay: str = "0ms",
               name: str = "") -> ClusterSpec:
        base = cls((LinkLevel("node", nodes, parse_rate(rate), parse_delay(delay)),), ranks_per_node, name=name)
        return base.with_overrides(sockets_per_node=sockets_per_node, socket_rate=socket_rate,
                                   socket_delay=socket_delay)

    @property
    def num_nodes(self) -> int:
        return self.links[0].size

    @property
    def sockets_per_node(self) -> int:
        return self.links[1].size if len(self.links) > 1 else 1

    @property
    def ranks_per_node(self) -> int:
        return self.sockets_per_node * self.ranks_per_namespace

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def mesh(self) -> str:
        """The ``--mesh`` of ``moe_compile.tools.calibrate`` (and the mesh shape) for this cluster."""
        return ",".join(f"{lv.name}={lv.size}" for lv in self.links) + f",{self.rank_level}={self.ranks_per_namespace}"

    def with_overrides(self, nodes: int | None = None, ranks_per_node: int | None = None, rate: str | None = None,
                       delay: str | None = None, sockets_per_node: int | None = None, socket_rate: str | None = None,
                       socket_delay: str | None = None) -> ClusterSpec:
        """This spec with the command line's ``--nodes`` etc. applied (None keeps a value)."""
        def level(old: LinkLevel, size: int | None, rate: str | None, delay: str | None) -> LinkLevel:
            return LinkLevel(old.name, old.size if size is None else size,
                             old.rate_bit_s if rate is None else parse_rate(rate),
                             old.delay_s if delay is None else parse_delay(delay))

        node = level(self.links[0], nodes, rate, delay)
        sock = level(self.links[1] if len(self.links) > 1 else LinkLevel("socket", 1, parse_rate("10gbit")),
                     sockets_per_node, socket_rate, socket_delay)
        per_node = self.ranks_per_node if ranks_per_node is None else ranks_per_node
        if sock.size < 1:
            raise ValueError(f"--sockets-per-node must be >= 1, got {sock.size}")
        if per_node % sock.size:
            raise ValueError(f"{per_node} ranks per node do not split evenly over {sock.size} sockets per node; "
                             "make --ranks-per-node a multiple of --sockets-per-node")
        links = (node, sock) if sock.size > 1 else (node,)
        return ClusterSpec(links, per_node // sock.size, self.rank_level, self.name)

    def describe(self) -> str:
        parts = [f"{lv.size} {lv.name}s ({_human_rate(lv.rate_bit_s)} each way"
                 + (f", {lv.delay_s * 1e3:g} ms one-way" if lv.delay_s else "") + ")" for lv in self.links]
        return (" x ".join(parts) + f" x {self.ranks_per_namespace} {self.rank_level} ranks on loopback"
                f" = {self.world_size} ranks, mesh {self.mesh}")


def _human_rate(bit_s: float) -> str:
    if math.isinf(bit_s):
        return "unshaped"
    return f"{bit_s / 1e9:g} Gbit/s" if bit_s >= 1e9 else f"{bit_s / 1e6:g} Mbit/s"


def load_spec(path: str | Path) -> ClusterSpec:
    """Read a cluster description (the module docstring has the format)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    levels = data.get("levels")
    if not isinstance(levels, list) or not 2 <= len(levels) <= 3:
        raise ValueError(f"{path}: 'levels' must list 2 or 3 [[levels]] tables, slowest first: node, optionally "
                         "socket, then the ranks inside one namespace")
    links = []
    for i, lv in enumerate(levels):
        where = f"{path}: levels[{i}]"
        if not isinstance(lv.get("name"), str) or not isinstance(lv.get("size"), int):
            raise ValueError(f"{where} needs a name (string) and a size (integer)")
        last = i == len(levels) - 1
        if last and ("rate" in lv or "delay" in lv):
            raise ValueError(f"{where} ({lv['name']!r}) is the ranks inside one namespace, joined by loopback: it "
                             "takes no rate or delay")
        if not last:
            if "rate" not in lv:
                raise ValueError(f"{where} ({lv['name']!r}) needs a rate, e.g. rate = \"400mbit\"")
            links.append(LinkLevel(lv["name"], lv["size"], parse_rate(lv["rate"]), parse_delay(lv.get("delay", "0ms"))))
        unknown = set(lv) - {"name", "size", "rate", "delay"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (name, size, rate, delay)")
    return ClusterSpec(tuple(links), levels[-1]["size"], levels[-1]["name"], str(data.get("name", "")))


@dataclass(frozen=True)
class Leaf:
    """A namespace where ranks run (one torchrun): its place in the cluster and its address."""

    namespace: str
    tag: str  # the namespace name without the run id: "n0", "n0s1"
    address: str
    node: int
    socket: int  # 0 without a socket level


@dataclass(frozen=True)
class NetworkPlan:
    """What to create, in order; pure data, so ``moe-cluster plan`` can print it without root."""

    run_id: str
    namespaces: tuple[str, ...]  # creation order; deleted in reverse
    leaves: tuple[Leaf, ...]  # in rank order: rank = leaf index * ranks per leaf + local rank
    commands: tuple[tuple[str, ...], ...]


def plan_network(run_id: str, spec: ClusterSpec) -> NetworkPlan:
    num_nodes, sockets_per_node = spec.num_nodes, spec.sockets_per_node
    if num_nodes > 253 or sockets_per_node > 253:
        raise ValueError(f"at most 253 nodes and 253 sockets per node (one /24 each), got {num_nodes} and "
                         f"{sockets_per_node}")
    node_link, socket_link = spec.links[0], spec.links[-1]
    bridge = f"{run_id}b"
    nodes = [f"{run_id}n{i}" for i in range(num_nodes)]
    cmds: list[list[str]] = [["ip", "netns", "add", ns] for ns in [bridge, *nodes]]
    cmds += [["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"], ["ip", "-n", bridge, "link", "set", "br0", "up"]]
    namespaces, leaves = [bridge, *nodes], []
    for i, ns in enumerate(nodes):
        node_addr = f"{SUBNET}.0.{i + 1}"
        cmds += _link(ns, IFACE, bridge, f"p{i}", node_link)
        cmds += [["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "-n", ns, "addr", "add", f"{node_addr}/24", "dev", IFACE],
                 ["ip", "-n", bridge, "link", "set", f"p{i}", "master", "br0"]]
        if sockets_per_node == 1:
            leaves.append(Leaf(ns, f"n{i}", node_addr, i, 0))
            continue
        # Step: node i becomes a router between its sockets' bridge and the node link.
        gateway = f"{SUBNET}.{i + 1}.254"
        cmds += [["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                 ["ip", "-n", ns, "link", "add", "br0", "type", "bridge"], ["ip", "-n", ns, "link", "set", "br0", "up"],
                 ["ip", "-n", ns, "addr", "add", f"{gateway}/24", "dev", "br0"]]
        cmds += [["ip", "-n", ns, "route", "add", f"{SUBNET}.{k + 1}.0/24", "via", f"{SUBNET}.0.{k + 1}"]
                 for k in range(num_nodes) if k != i]
        for j in range(sockets_per_node):
            leaf, addr = f"{ns}s{j}", f"{SUBNET}.{i + 1}.{j + 1}"
            namespaces.append(leaf)
            cmds += [["ip", "netns", "add", leaf], *_link(leaf, IFACE, ns, f"s{j}", socket_link),
                     ["ip", "-n", leaf, "link", "set", "lo", "up"],
                     ["ip", "-n", leaf, "addr", "add", f"{addr}/24", "dev", IFACE],
                     ["ip", "-n", leaf, "route", "add", f"{SUBNET}.0.0/16", "via", gateway],
                     ["ip", "-n", ns, "link", "set", f"s{j}", "master", "br0"]]
            leaves.append(Leaf(leaf, f"n{i}s{j}", addr, i, j))
    return NetworkPlan(run_id, tuple(namespaces), tuple(leaves), tuple(tuple(c) for c in cmds))


def _link(inner_ns: str, inner_dev: str, outer_ns: str, outer_dev: str, shaping: LinkLevel) -> list[list[str]]:
    """A veth pair created inside ``inner_ns`` with its peer moved straight into ``outer_ns``,
    both ends up and shaped; the delay goes on the outer (bridge or router) end only."""
    return [["ip", "-n", inner_ns, "link", "add", inner_dev, "type", "veth", "peer", "name", outer_dev, "netns", outer_ns],
            *shaping.tc_commands(inner_ns, inner_dev, with_delay=False),
            *shaping.tc_commands(outer_ns, outer_dev, with_delay=True),
            ["ip", "-n", inner_ns, "link", "set", inner_dev, "up"],
            ["ip", "-n", outer_ns, "link", "set", outer_dev, "up"]]


def run_command(argv: Sequence[str]) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        msg = proc.stderr.strip() or proc.stdout.strip()
        hint = ""
        if "qdisc kind is unknown" in msg:
            kind = "netem" if "netem" in argv else "tbf"
            hint = (f"\nthis kernel has no {kind} qdisc (sch_{kind})" +
                    ("; delays cannot be emulated here: use a delay of 0" if kind == "netem" else ""))
        raise ClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): {msg}{hint}")
    return proc.stdout


def apply(plan: NetworkPlan) -> None:
    """Run the plan's commands; on any failure (or interrupt) delete what was made, then re-raise."""
    try:
        for cmd in plan.commands:
            run_command(cmd)
    except BaseException:
        teardown(plan.namespaces)
        raise


def require_tools() -> None:
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs iproute2's {' and '.join(missing)} on PATH "
                           "(Debian/Ubuntu: apt-get install iproute2)")


def privilege_problem() -> str | None:
    """Why this process cannot create network namespaces, or None when it can (as far as its
    capabilities tell: root in a container may lack them)."""
    caps = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
    if caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1:
        return None
    return ("the emulated cluster needs root (CAP_NET_ADMIN to create links and shape them, CAP_SYS_ADMIN "
            "for `ip netns`); run it as root, e.g. sudo env PATH=\"$PATH\" moe-cluster ...")


def namespaces_unavailable(prefix: str = "hm") -> str | None:
    """None when namespaces, veth pairs and tbf work here; else the reason (for skipping tests)."""
    try:
        require_tools()
    except ClusterError as e:
        return str(e)
    if (problem := privilege_problem()) is not None:
        return problem
    ns = f"{prefix}{os.getpid()}p"
    try:
        apply(NetworkPlan(ns, (ns,), (), (("ip", "netns", "add", ns),
                                           *map(tuple, _link(ns, "a0", ns, "a1", LinkLevel("probe", 1, 1e9))))))
    except ClusterError as e:
        return f"cannot build a shaped veth link in a network namespace: {e}"
    teardown([ns])
    return None


def existing_namespaces() -> list[str]:
    out = run_command(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def kill_processes(namespaces: Iterable[str], wait_s: float = 5.0) -> None:
    """SIGKILL every process inside the namespaces (all started by the run that made them) and wait
    until they are gone."""
    present = set(existing_namespaces())
    pids = {pid for ns in namespaces if ns in present for pid in namespace_pids(ns)}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _alive(pid)}
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent (maybe this process) to collect it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def teardown(namespaces: Iterable[str], wait_s: float = 5.0) -> list[str]:
    """Kill the processes inside the namespaces, then delete the namespaces (which removes their
    devices).  Returns those deleted."""
    present = set(existing_namespaces())
    names = [ns for ns in namespaces if ns in present]
    kill_processes(names, wait_s)
    deleted, errors = [], []
    for ns in reversed(names):
        proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        if proc.returncode == 0:
            deleted.append(ns)
        else:
            errors.append(f"{ns}: {proc.stderr.strip()}")
    if errors:
        raise ClusterError("could not delete namespaces: " + "; ".join(errors))
    return deleted


def run_namespaces(prefix: str) -> dict[str, tuple[int, list[str]]]:
    """The namespaces of runs with this prefix: run id -> (pid that made them, namespaces)."""
    pattern = re.compile(rf"^({re.escape(prefix)}(\d+)(?:_\d+)?)(?:b|p|n\d+(?:s\d+)?)$")
    runs: dict[str, tuple[int, list[str]]] = {}
    for ns in existing_namespaces():
        if m := pattern.match(ns):
            runs.setdefault(m.group(1), (int(m.group(2)), []))[1].append(ns)
    return runs
