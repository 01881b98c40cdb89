"""Run by every rank of an emulated cluster (tests/test_cluster.py, or by hand under ``moe-cluster
run``).  Checks ``all_to_all_single`` (even and uneven splits) against the values each rank computes
locally -- what a run without the emulation gives -- and, with ``--bench-mib``, times exchanges at
each size: gloo's all-to-all, an all-to-all of point-to-point ops with every receive posted before
any send, a duplex exchange inside a namespace (ranks 0 and 1) and across nodes (rank 0 and the first rank
of node 1), and a one-way send across nodes; each with the bytes that left rank 0's
link interface meanwhile.  Rank r writes ``OUT/rank<r>.json``.  ``--calibrate ARGS...`` then runs
``tests/cluster_calibrate_recv_first.py ARGS...`` in the same processes.

    moe-cluster run --nodes 2 --ranks-per-node 2 --rate 400mbit -- \\
        python tests/cluster_a2a_script.py --out /tmp/a2a --bench-mib 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def chunk(src: int, dst: int, n: int) -> torch.Tensor:
    """What rank ``src`` sends to rank ``dst``: values that name both ends and the position."""
    return torch.arange(n, dtype=torch.int64) + 1_000_000 * src + 1_000 * dst


def check_all_to_all(rank: int, world: int) -> dict[str, bool]:
    results = {}
    for name, count in (("even", lambda s, d: 64), ("uneven", lambda s, d: (3 * s + d) % 5)):
        send = torch.cat([chunk(rank, d, count(rank, d)) for d in range(world)])
        expected = torch.cat([chunk(s, rank, count(s, rank)) for s in range(world)])
        recv = torch.empty_like(expected)
        dist.all_to_all_single(recv, send, [count(s, rank) for s in range(world)],
                               [count(rank, d) for d in range(world)])
        results[name] = bool(torch.equal(recv, expected))
    return results


def tx_bytes() -> int:
    """Bytes this namespace's link interface has sent so far (``ip netns exec`` mounts this
    namespace's /sys)."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "veth0")
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def exchange(rank: int, peers: list[int], send: torch.Tensor, recv: torch.Tensor) -> None:
    """Send ``send``'s i-th chunk to peers[i] and receive into ``recv``'s, receives posted first: gloo
    then has every receive-ready notice on the wire before bulk data can queue in front of it."""
    send_c, recv_c = send.chunk(len(peers)), recv.chunk(len(peers))
    reqs = [dist.irecv(recv_c[i], p) for i, p in enumerate(peers) if p != rank]
    reqs += [dist.isend(send_c[i], p) for i, p in enumerate(peers) if p != rank]
    for i, p in enumerate(peers):
        if p == rank:
            recv_c[i].copy_(send_c[i])
    for r in reqs:
        assert r is not None  # None only for ranks outside the group
        r.wait()


def timed(fn: Callable[[], object], active: bool, reps: int) -> dict[str, float]:
    times, sent = [], []
    for i in range(reps + 1):
        dist.barrier()
        b0, t0 = tx_bytes(), time.perf_counter()
        if active:
            fn()
        dist.barrier()
        if i:  # the first run sets the connections up
            times.append(time.perf_counter() - t0)
            sent.append(tx_bytes() - b0)
    return {"s": statistics.median(times), "veth_tx_bytes": statistics.median(sent)}


def cases(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor
          ) -> dict[str, tuple[Callable[[], object], bool]]:
    """name -> (what one rank runs, whether this rank takes part)."""
    nodes = int(os.environ["MOE_CLUSTER_MESH"].split(",")[0].split("=")[1])
    inter = world // nodes  # the first rank of the second node
    out: dict[str, tuple[Callable[[], object], bool]] = {
        "a2a_gloo": (lambda: dist.all_to_all_single(recv, send), True),
        "a2a_recv_first": (lambda: exchange(rank, list(range(world)), send, recv), True),
        "pair_inter_node": (lambda: exchange(rank, [inter if rank == 0 else 0], send, recv), rank in (0, inter)),
        "oneway_inter_node": (lambda: dist.send(send, inter) if rank == 0 else dist.recv(recv, 0), rank in (0, inter)),
    }
    if int(os.environ["LOCAL_WORLD_SIZE"]) > 1:  # ranks 0 and 1 share a namespace
        out["pair_intra_node"] = (lambda: exchange(rank, [1 - rank], send, recv), rank in (0, 1))
    return out


def bench(rank: int, world: int, sizes_mib: list[float], reps: int) -> list[dict[str, object]]:
    rows = []
    for mib in sizes_mib:
        send = torch.ones(int(mib * (1 << 18)))  # mib MiB of float32
        recv = torch.empty_like(send)
        for name, (fn, active) in cases(rank, world, send, recv).items():
            rows.append({"case": name, "bytes": send.numel() * 4, **timed(fn, active, reps)})
    return rows


def link_bytes(case: str, num_bytes: int, world: int) -> int:
    """Payload bytes one case moves over one direction of the node link: a whole buffer for the
    cross-node pair and one-way cases; for the all-to-alls every rank of a node sends the share of
    its buffer meant for the other nodes' ranks (a node's ranks share its link)."""
    nodes = int(os.environ["MOE_CLUSTER_MESH"].split(",")[0].split("=")[1])
    if case.startswith("a2a"):
        return num_bytes * (world - world // nodes) // world * (world // nodes)
    return 0 if case == "pair_intra_node" else num_bytes


def fit_rates(rows: list[dict[str, object]], world: int) -> dict[str, dict[str, float]]:
    """Per case, least squares t = alpha + link_bytes / B over the sizes: B in Mbit/s of payload, r^2."""
    out = {}
    for case in dict.fromkeys(str(r["case"]) for r in rows):
        xs = torch.tensor([float(link_bytes(case, int(r["bytes"]), world)) for r in rows  # type: ignore[call-overload]
                           if r["case"] == case], dtype=torch.float64)
        ts = torch.tensor([float(r["s"]) for r in rows if r["case"] == case], dtype=torch.float64)  # type: ignore[arg-type]
        if case == "pair_intra_node" or xs.unique().numel() < 2:
            continue
        a = torch.stack([torch.ones_like(xs), xs], dim=1)
        alpha, beta = torch.linalg.lstsq(a, ts[:, None]).solution[:, 0].tolist()
        res = ts - a @ torch.tensor([alpha, beta], dtype=torch.float64)
        r2 = 1 - float(res @ res) / float(((ts - ts.mean()) ** 2).sum())
        out[case] = {"alpha_s": alpha, "payload_mbit_s": 8 / beta / 1e6, "r2": r2}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--bench-mib", type=float, nargs="*", default=[], help="also time exchanges of these sizes")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--calibrate", nargs=argparse.REMAINDER, default=None,
                   help="then run tests/cluster_calibrate_recv_first.py with the arguments that follow (saves "
                        "starting torch a second time)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, object] = {"rank": rank, "world": world, "namespace": os.environ.get("MOE_CLUSTER_NAMESPACE"),
                                 "checks": check_all_to_all(rank, world)}
    if args.bench_mib:
        rows = bench(rank, world, args.bench_mib, args.reps)
        result["bench"] = rows
        result["fits"] = fit_rates(rows, world) if len(args.bench_mib) > 1 else {}
    dist.barrier()
    dist.destroy_process_group()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    print(f"rank {rank} ({result['namespace']}): all_to_all checks {result['checks']}", flush=True)
    if rank == 0 and args.bench_mib:
        for row in result["bench"]:  # type: ignore[attr-defined]
            print(f"  {row['case']:<18} {row['bytes']:>10} B  {row['s'] * 1e3:9.2f} ms  "
                  f"{row['veth_tx_bytes']:>10.0f} B out of rank 0's veth", flush=True)
        for case, f in result["fits"].items():  # type: ignore[attr-defined]
            print(f"  fit {case:<18} {f['payload_mbit_s']:8.1f} Mbit/s payload over the node link, "
                  f"alpha {f['alpha_s'] * 1e3:.2f} ms, r^2 {f['r2']:.5f}", flush=True)
    if args.calibrate is not None:
        from cluster_calibrate_recv_first import main as calibrate_recv_first  # beside this script

        # A second process group on torchrun's store would find the first one's keys (gloo would
        # connect to addresses no longer listened on): rank 0 hosts a fresh store on the next port.
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        code = calibrate_recv_first(args.calibrate)
        if code:
            raise SystemExit(code)


if __name__ == "__main__":
    main()
