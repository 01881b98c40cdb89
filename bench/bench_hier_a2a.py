"""Hierarchical token-deduplicating all-to-all: bytes per mesh level and wall time of dispatch + combine.

    python bench/bench_hier_a2a.py           # full run, 8 local gloo ranks; writes bench/results/hier_a2a.*
    python bench/bench_hier_a2a.py --quick   # one small configuration, well under a minute; prints only
    moe-cluster run --nodes 2 --ranks-per-node 2 --rate 400mbit -- python -m moe_compile.tools.calibrate \
        --mesh node=2,gpu=2 --out /tmp/c.toml           # then, on the same emulated cluster:
    moe-cluster run --nodes 2 --ranks-per-node 2 --rate 400mbit -- python bench/bench_hier_a2a.py \
        --topology /tmp/c.toml --reps 7 --out bench/results/hier_a2a_cluster

The script starts its own ranks (one process per rank, forked after the imports, with env RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT as tests/dist_utils.py sets them; under torchrun it is the
rank torchrun made, the world its WORLD_SIZE and the mesh, without --mesh, moe-cluster's
MOE_CLUSTER_MESH) over a mesh node x socket x gpu (2 x 2 x 2 for 8 ranks).
Each rank holds T tokens x_TH [T, H] fp32 and a routing topk_idx_TK (uniform, or Zipf-skewed over a
fixed random popularity order of the experts; K distinct experts per token either way; placement
contiguous, expert e on rank e // (E/G)). One step is ``lowering.hier_a2a.dispatch`` followed by
``combine`` of the received rows (no expert compute, so the time is the all-to-alls' alone), for:

    flat A2A  dedup=False, d=1: one (token, expert) copy per pair, one all-to-all (Megatron, HF)
    HD1       dedup, d=1: one copy per (token, destination rank)
    2DH       dedup=False, d=2: Tutel's two-phase hierarchical all-to-all
    HD2, HD3  dedup, d=2 / d=3 (HierMoE Section III-A)
    HD-d*     dedup, d chosen each step by ``EPLayer.choose_dimension`` (HierMoE Eq. 6 / Alg. 1)
              on a layer built by ``setup.build_layer(dimension=None, topology=...)``

Bytes: the runtime's traffic counters (``runtime.counters()``) of one untimed step per strategy,
summed over ranks: forward dispatch payload per mesh level (combine sends the same back; checked).
The dedup lower bound on inter-node bytes, distinct (token, other node) pairs x H x 4, and the
expected inter-node bytes of every strategy are computed from the routing alone and compared with
the counters. The untimed step also checks the result: combining rows scaled by their summed slot
weights must give x * sum_k w_k for every strategy.

Time: after that step, ``--reps`` repetitions; each times one step of every strategy, in an order
rotated by one per repetition (interleaved, so drift hits all alike), each after a barrier; a step's
time is its slowest rank's. Reported: median, min and max, and median / median(flat A2A).

Backward: right after each strategy's forward step (same repetition, same rotated order, its own
barrier), its backward step as ``hiermoe::ep_experts_backward`` runs it, on the d the forward used
(no second decision): dispatch of ``torch.cat([x, grad_y], 1)`` rows (2H wide) along the same HD-d
route with direction "backward", then combine of H-wide rows with float32 [R, S] per-slot
routing-weight gradients as ``meta_RS``; timed are the dispatch and the combine, as the op counts
them, not the stand-in for the local expert backward between them. The untimed step checks it too
(the grad_y half, scaled, and the metadata, which must come back as the routing weights) and counts
its bytes (dispatch 2x the forward's payload per level, combine 1x). Reported beside the forward:
"bwd" median, min / max, wall / flat and speedup over flat A2A's backward.
``--top-k``, ``--experts``, ``--routing`` select part of the grid (K in 2, 4, 8; E in 16, 64).

Predicted time: 2 x HierMoE's dispatch time (cost/hiermoe.py; combine moves the same volumes back)
from the statistics of every rank's routing gathered as the runtime does, under two topologies: ``cluster``, the
topology file given with ``--topology`` (moe_compile.tools.calibrate's output for the cluster the ranks run
on), else the emulated cluster of bench/clusters/two_node_two_socket.toml as stated (node 400 Mbit/s,
socket 2 Gbit/s, gpu 10 Gbit/s standing in for its unshaped loopback; alpha 20 us per level), and
``local``, the ranks' own links fitted at start (all_to_all per mesh level, as moe_compile.tools.calibrate
does, with the same all-to-all as the dispatch: receives first on gloo). HD-d* runs on the local fit,
or on the ``--topology`` file when one is given (``--dstar-topology`` to choose), so its d can be
compared with the fastest measured d.

Under ``moe-cluster run`` (env MOE_CLUSTER_MESH) the report also names the emulated cluster: the
node link's tc rate read from the rank's interface (``tc qdisc show``), the ranks per namespace.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from machine import cpu_name, fork_ranks, resolve_ranks
from rich.console import Console
from rich.table import Table
from torch import Tensor

from moe_compile.cost.calibrate import efficiency_curve, link_fraction, message_sizes
from moe_compile.cost.hiermoe import HDCostModel, dimension_rule
from moe_compile.cost.routing import gathered_statistics, source_table
from moe_compile.cost.topology import Level, Topology
from moe_compile.cost.workload import Workload
from moe_compile.ep import runtime, setup
from moe_compile.lowering import hier_a2a
from moe_compile.tools import calibrate

# Shape legend: T tokens per rank, H hidden, K top-k, E experts, G ranks, N nodes, R rows, S slots.
CLUSTER_GBPS = {"node": 0.4, "socket": 2.0, "gpu": 10.0}  # bench/clusters/two_node_two_socket.toml
CLUSTER_ALPHA_S = 2e-5
ZIPF_EXPONENT = 1.2
FULL_GRID = [(k, e, r) for e in (16, 64) for r in ("uniform", "zipf") for k in (2, 4, 8)]
console = Console(width=None if Console().is_terminal else 200)


@dataclass(frozen=True)
class Strategy:
    name: str
    dedup: bool
    d: int | None  # None: d* per step


def strategies(num_levels: int) -> list[Strategy]:
    out = [Strategy("flat A2A", False, 1), Strategy("HD1", True, 1)]
    if num_levels >= 2:
        out.append(Strategy("2DH", False, 2))
    out += [Strategy(f"HD{d}", True, d) for d in range(2, num_levels + 1)]
    return out + [Strategy("HD-d*", True, None)]


# ---- routing ------------------------------------------------------------------------------------


def make_routing(kind: str, num_tokens: int, top_k: int, num_experts: int, seed: int) -> Tensor:
    """[T, K] distinct experts per token: uniform, or Zipf(ZIPF_EXPONENT) popularity over a random
    (but same on every rank) order of the experts, sampled without replacement."""
    if kind == "uniform":
        probs_E = torch.ones(num_experts)
    elif kind == "zipf":
        order_E = torch.randperm(num_experts, generator=torch.Generator().manual_seed(12345))
        probs_E = torch.empty(num_experts)
        probs_E[order_E] = torch.arange(1, num_experts + 1, dtype=torch.float32) ** -ZIPF_EXPONENT
    else:
        raise ValueError(f"routing must be 'uniform' or 'zipf', got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs_E.expand(num_tokens, num_experts), top_k, replacement=False, generator=gen)


def expected_node_rows(topk_idx_TK: Tensor, num_experts: int, sizes: tuple[int, ...], position: int
                       ) -> dict[str, int]:
    """Rows this rank must send across the node level, from the routing alone: (token, expert)
    copies (no dedup), distinct (token, rank) pairs (HD1), distinct (token, node) pairs (the
    lower bound, reached by HD-d for d >= 2)."""
    world = math.prod(sizes)
    ranks_per_node = world // sizes[0]
    dest_rank_TK = topk_idx_TK // (num_experts // world)
    away_TK = dest_rank_TK // ranks_per_node != position // ranks_per_node
    num_tokens = topk_idx_TK.shape[0]
    has_TG = torch.zeros(num_tokens, world, dtype=torch.bool).scatter_(1, dest_rank_TK, True)
    away_G = torch.arange(world) // ranks_per_node != position // ranks_per_node
    has_TN = torch.zeros(num_tokens, sizes[0], dtype=torch.bool).scatter_(1, dest_rank_TK // ranks_per_node, True)
    has_TN[:, position // ranks_per_node] = False
    return {"copies": int(away_TK.sum()), "rank_pairs": int(has_TG[:, away_G].sum()),
            "node_pairs": int(has_TN.sum())}


# ---- one rank -----------------------------------------------------------------------------------


def calibrate_local(mesh: Any, names: tuple[str, ...], sizes: tuple[int, ...], quick: bool
                    ) -> tuple[Topology | None, list[dict[str, Any]]]:
    """alpha/beta per mesh level from timed subgroup all-to-alls (moe_compile.tools.calibrate's measure
    and fit); None when a fit has no positive beta (too noisy)."""
    steps, reps = (3, 3) if quick else (8, 11)
    plan = [("all_to_all", n, s, message_sizes(1 << 14, 1 << 22, steps, multiple_of=s * 4))
            for n, s in zip(names, sizes)]
    a2a = calibrate.resolve_a2a(None, torch.device("cpu"))  # the all-to-all hier_a2a runs: receives first on gloo
    fits = calibrate.fit_measurements(calibrate.measure(mesh, plan, torch.device("cpu"), reps, 1, lambda _: None,
                                                        a2a))
    info = [{"level": f.measurement.group, "alpha_s": f.alpha_s, "beta_s_per_byte": f.beta_s_per_byte, "r2": f.r2,
             "sizes_bytes": list(f.measurement.sizes_bytes), "times_s": list(f.measurement.times_s)} for f in fits]
    if any(f.beta_s_per_byte <= 0 for f in fits):
        return None, info
    levels = tuple(Level(n, s, max(f.alpha_s, 0.0), f.beta_s_per_byte) for n, s, f in zip(names, sizes, fits))
    name = ("the emulated cluster's links, fitted at start" if os.environ.get("MOE_CLUSTER_MESH")
            else "this machine (loopback, fitted at start)")
    # MoNTA's r(n) per level, as moe-calibrate writes them (all_to_all_<level>)
    efficiency = {f"all_to_all_{n}": efficiency_curve(f.measurement.sizes_bytes, f.measurement.times_s,
                                                      f.beta_s_per_byte, link_fraction(s))
                  for n, s, f in zip(names, sizes, fits)}
    return Topology(levels=levels, efficiency=efficiency, name=name), info


def run_step(s: Strategy, x_TH: Tensor, topk_idx_TK: Tensor, weights_TK: Tensor, comm: Any, expert_pos_E: Tensor,
             chooser: runtime.EPLayer, scale: bool = False) -> tuple[Tensor, int, float]:
    """One forward dispatch + combine: (result, d, seconds spent choosing d). ``scale`` multiplies
    each row by its slots' weights (the correctness check) instead of sending the rows straight back."""
    t0 = time.perf_counter()
    d = chooser.choose_dimension(topk_idx_TK) if s.d is None else s.d
    decide_s = time.perf_counter() - t0
    rows_RH, ids_RS, w_RS, route = hier_a2a.dispatch(x_TH, topk_idx_TK, weights_TK, expert_pos_E, comm.phases(d),
                                                     s.dedup, "forward")
    if scale:
        rows_RH = rows_RH * torch.where(ids_RS >= 0, w_RS, 0.0).sum(1, keepdim=True)
    y_TH, _ = hier_a2a.combine(rows_RH, route, "forward")
    return y_TH, d, decide_s


def run_backward_step(s: Strategy, xg_TC: Tensor, topk_idx_TK: Tensor, weights_TK: Tensor, comm: Any,
                      expert_pos_E: Tensor, d: int, scale: bool = False) -> tuple[Tensor, Tensor, float]:
    """One backward dispatch + combine as ``hiermoe::ep_experts_backward`` runs it on the forward's d
    (no decision): dispatch of the [x | grad_y] rows ``xg_TC`` [T, 2H] along the HD-d route, direction
    "backward", then combine of H-wide rows with float32 [R, S] per-slot metadata (the routing-weight
    gradients; here the received slot weights). Returns (combined [T, H], combined meta [T, K],
    seconds in dispatch + combine: what the op counts as its backward communication, so the
    stand-in for the local expert backward between them, the grad_y half made contiguous, is not
    timed). ``scale`` multiplies each grad_y row by its slots' weights (the correctness check)."""
    hidden = xg_TC.shape[1] // 2
    t0 = time.perf_counter()
    rows_RC, ids_RS, w_RS, route = hier_a2a.dispatch(xg_TC, topk_idx_TK, weights_TK, expert_pos_E, comm.phases(d),
                                                     s.dedup, "backward")
    t1 = time.perf_counter()
    g_RH = rows_RC[:, hidden:].contiguous()
    if scale:
        g_RH = g_RH * torch.where(ids_RS >= 0, w_RS, 0.0).sum(1, keepdim=True)
    meta_RS = w_RS.float().contiguous()
    t2 = time.perf_counter()
    dx_TH, dw_TK = hier_a2a.combine(g_RH, route, "backward", meta_RS=meta_RS)
    seconds = (t1 - t0) + (time.perf_counter() - t2)
    assert dw_TK is not None
    return dx_TH, dw_TK, seconds


def bench_config(cfg: tuple[int, int, str], args: argparse.Namespace, mesh: Any, comm: Any,
                 topologies: dict[str, Topology], dstar_topology: str, seed: int) -> dict[str, Any]:
    top_k, num_experts, kind = cfg
    rank, names, sizes = dist.get_rank(), comm.level_names, comm.sizes
    strats = strategies(len(sizes))
    topk_idx_TK = make_routing(kind, args.tokens, top_k, num_experts, seed * 1000 + rank)
    gen = torch.Generator().manual_seed(seed * 1000 + 500 + rank)
    x_TH = torch.randn(args.tokens, args.hidden, generator=gen)
    weights_TK = torch.rand(args.tokens, top_k, generator=gen)
    grad_TH = torch.randn(args.tokens, args.hidden, generator=gen)  # drawn after the forward's tensors: same x, w
    xg_TC = torch.cat([x_TH, grad_TH], dim=1)  # the op's backward concatenates before it starts timing
    chooser = setup.build_layer(name=f"K{top_k}E{num_experts}{kind}", mesh=mesh,
                                   topology=topologies[dstar_topology], dimension=None, dedup=True,
                                   num_experts=num_experts, top_k=top_k, hidden_size=args.hidden,
                                   ffn_size=args.hidden, gated=True, dtype=torch.float32, device=torch.device("cpu"))
    expert_pos_E = chooser.expert_pos_E

    # Step 1: one untimed step per strategy, forward then backward on the forward's d: bytes,
    # messages, the result checks (and warm-up).
    fields = 8  # forward: dispatch payload, combine payload, dispatch meta, dispatch payload messages, d used;
    #             backward: dispatch payload, combine payload, combine meta
    traffic = torch.zeros(len(strats), len(sizes), fields, dtype=torch.int64)
    errs = torch.zeros(len(strats), 3, dtype=torch.float64)  # forward y, backward grad rows, backward meta
    want_TH = x_TH * weights_TK.sum(1, keepdim=True)
    want_grad_TH = grad_TH * weights_TK.sum(1, keepdim=True)
    for i, s in enumerate(strats):
        runtime.reset_counters()
        y_TH, d, _ = run_step(s, x_TH, topk_idx_TK, weights_TK, comm, expert_pos_E, chooser, scale=True)
        dx_TH, dw_TK, _ = run_backward_step(s, xg_TC, topk_idx_TK, weights_TK, comm, expert_pos_E, d, scale=True)
        errs[i, 0] = float((y_TH - want_TH).abs().max() / want_TH.abs().max())
        errs[i, 1] = float((dx_TH - want_grad_TH).abs().max() / want_grad_TH.abs().max())
        errs[i, 2] = float((dw_TK - weights_TK).abs().max() / weights_TK.abs().max())
        c = runtime.counters()
        for lv, name in enumerate(names):
            dis, com = c[name]["dispatch"]["forward"], c[name]["combine"]["forward"]
            bdis, bcom = c[name]["dispatch"]["backward"], c[name]["combine"]["backward"]
            traffic[i, lv, :4] = torch.tensor([dis["payload_bytes"], com["payload_bytes"], dis["meta_bytes"],
                                               dis["payload_messages"]])
            traffic[i, lv, 5:] = torch.tensor([bdis["payload_bytes"], bcom["payload_bytes"], bcom["meta_bytes"]])
        traffic[i, :, 4] = d
    used_d = traffic[:, 0, 4].clone()
    dist.all_reduce(traffic)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    expected = expected_node_rows(topk_idx_TK, num_experts, sizes, comm.position)
    expected_t = torch.tensor([expected["copies"], expected["rank_pairs"], expected["node_pairs"]])
    dist.all_reduce(expected_t)

    # Step 2: interleaved timed repetitions; each step's time is its slowest rank's. Every strategy's
    # forward step is followed (after its own barrier) by its backward step on the d that forward used.
    times = torch.zeros(args.reps, len(strats), dtype=torch.float64)
    bwd_times = torch.zeros(args.reps, len(strats), dtype=torch.float64)
    decide = torch.zeros(args.reps, dtype=torch.float64)  # HD-d*'s choose_dimension, inside its time
    order = list(range(len(strats)))
    for rep in range(args.reps):
        for i in order[rep % len(order):] + order[: rep % len(order)]:
            dist.barrier()
            t0 = time.perf_counter()
            _, d, decide_s = run_step(strats[i], x_TH, topk_idx_TK, weights_TK, comm, expert_pos_E, chooser)
            times[rep, i] = time.perf_counter() - t0
            decide[rep] += decide_s
            dist.barrier()
            _, _, bwd_times[rep, i] = run_backward_step(strats[i], xg_TC, topk_idx_TK, weights_TK, comm,
                                                        expert_pos_E, d)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(bwd_times, op=dist.ReduceOp.MAX)
    dist.all_reduce(decide, op=dist.ReduceOp.MAX)

    # Step 3: the cost model's statistics of every rank's routing, gathered as EPLayer.choose_dimension does.
    own = source_table(topk_idx_TK, num_experts, sizes, placement=expert_pos_E.numpy())
    tables = runtime.gather_by_position(torch.from_numpy(own.reshape(-1)), comm).reshape(comm.world, *own.shape)
    stats = gathered_statistics(tables, sizes, copies=True)
    num_stats = len(stats.values())
    values = torch.tensor(stats.values() + stats.copy_values(), dtype=torch.float64)
    if rank != 0:
        return {}

    row_bytes = args.hidden * 4
    vals = values.tolist()
    predicted: dict[str, list[float]] = {}
    dstar: dict[str, int] = {}
    for tname, topo in topologies.items():
        work = Workload(num_tokens=args.tokens, hidden_size=args.hidden, ffn_size=args.hidden,
                        num_experts=num_experts, top_k=top_k, dtype_bytes=4)
        model = HDCostModel(topo, work)
        hd = model.times_from_values(vals[:num_stats], dedup=True)
        nodedup = model.times_from_values(vals[num_stats:], dedup=False)
        dstar[tname] = dimension_rule(hd)
        predicted[tname] = [2 * float((hd if s.dedup else nodedup)[(s.d or int(used_d[i])) - 1])
                            for i, s in enumerate(strats)]
    lower_bound = int(expected_t[2]) * row_bytes
    results = []
    for i, s in enumerate(strats):
        d = int(used_d[i])
        per_level = {n: int(traffic[i, lv, 0]) for lv, n in enumerate(names)}
        exp_rows = int(expected_t[0] if not s.dedup else expected_t[1] if d == 1 else expected_t[2])
        t = times[:, i].tolist()
        tb = bwd_times[:, i].tolist()
        results.append({
            "strategy": s.name, "dedup": s.dedup, "d": d, "bytes_per_level": per_level,
            "combine_bytes_per_level": {n: int(traffic[i, lv, 1]) for lv, n in enumerate(names)},
            "meta_bytes": int(traffic[i, :, 2].sum()), "messages": int(traffic[i, :, 3].sum()),
            "total_bytes": sum(per_level.values()), "expected_node_bytes": exp_rows * row_bytes,
            "result_rel_err": float(errs[i, 0]), "times_s": t, "median_s": statistics.median(t),
            "predicted_s": {tn: p[i] for tn, p in predicted.items()},
            "bwd_bytes_per_level": {n: int(traffic[i, lv, 5]) for lv, n in enumerate(names)},
            "bwd_combine_bytes_per_level": {n: int(traffic[i, lv, 6]) for lv, n in enumerate(names)},
            "bwd_combine_meta_bytes": int(traffic[i, :, 7].sum()),
            "bwd_result_rel_err": float(errs[i, 1]), "bwd_meta_rel_err": float(errs[i, 2]),
            "bwd_times_s": tb, "bwd_median_s": statistics.median(tb),
        })
    return {"top_k": top_k, "num_experts": num_experts, "routing": kind, "node_lower_bound_bytes": lower_bound,
            "dstar_decision_s": decide.tolist(), "dstar": dstar, "dstar_topology": dstar_topology, "strategies": results}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = args.mesh_names, args.mesh_sizes
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    comm = setup.mesh_comm(mesh)
    if "HIER_A2A_LOADAVG" not in os.environ:  # under torchrun: this rank's view, before the bench's load
        os.environ["HIER_A2A_LOADAVG"] = f"{os.getloadavg()[0]:.2f}"
    if args.topology_file is not None:
        cluster_topo = Topology.load(args.topology_file)
    else:
        links = {n: {"alpha_s": CLUSTER_ALPHA_S, "bandwidth_gbps": CLUSTER_GBPS.get(n, 10.0)} for n in names}
        cluster_topo = Topology.from_mesh(mesh, links, name="emulated cluster (stated)")
    topologies = {"cluster": cluster_topo}
    t0 = time.perf_counter()
    local, fit_info = calibrate_local(mesh, names, sizes, args.quick)
    if dist.get_rank() == 0:
        links_fitted = "the cluster's links" if os.environ.get("MOE_CLUSTER_MESH") else "this machine's loopback"
        console.print(f"fitted {links_fitted} per level in {time.perf_counter() - t0:.1f} s: "
                      + "; ".join(f"{f['level']} alpha {f['alpha_s'] * 1e6:.0f} us, "
                                  f"{8 / f['beta_s_per_byte'] / 1e9 if f['beta_s_per_byte'] > 0 else 0:.2g} Gbit/s "
                                  f"(r2 {f['r2']:.3f})" for f in fit_info), highlight=False)
    if local is not None:
        topologies["local"] = local
    dstar_topology = args.dstar_topology or ("cluster" if args.topology_file else "local")
    dstar_topology = dstar_topology if dstar_topology in topologies else "cluster"
    rank = dist.get_rank()
    grid = [(4, 16, "uniform")] if args.quick else [c for c in FULL_GRID if c[0] in args.top_ks
                                                     and c[1] in args.num_experts and c[2] in args.routings]
    configs = []
    start = time.perf_counter()
    for n, cfg in enumerate(grid):
        res = bench_config(cfg, args, mesh, comm, topologies, dstar_topology, seed=n + 1)
        if rank == 0:
            configs.append(res)
            med = {r["strategy"]: (r["median_s"], r["bwd_median_s"]) for r in res["strategies"]}
            console.print(f"[{time.perf_counter() - start:6.1f} s] K={cfg[0]} E={cfg[1]} {cfg[2]:7s} fwd / bwd "
                          + "  ".join(f"{k} {v * 1e3:.1f} / {b * 1e3:.1f} ms" for k, (v, b) in med.items()),
                          highlight=False)
    if rank == 0:
        report(args, configs, topologies, fit_info, dstar_topology)
    dist.barrier()
    dist.destroy_process_group()


# ---- output (rank 0) ----------------------------------------------------------------------------


def emulated_cluster_info() -> dict[str, Any] | None:
    """Under ``moe-cluster run``: the mesh, this rank's namespace and the tc rate of its link
    (the node link with one shaped level, the socket link with two); None elsewhere."""
    mesh = os.environ.get("MOE_CLUSTER_MESH")
    if not mesh:
        return None
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "veth0")
    rate = None
    try:
        out = subprocess.run(["tc", "qdisc", "show", "dev", iface], capture_output=True, text=True, timeout=10).stdout
        rate = next((w[i + 1] for w in [out.split()] for i in range(len(w) - 1) if w[i] == "rate"), None)
    except (OSError, subprocess.SubprocessError):
        pass
    return {"mesh": mesh, "namespace": os.environ.get("MOE_CLUSTER_NAMESPACE"), "link_iface": iface,
            "link_tc_rate": rate}


def machine_info() -> dict[str, Any]:
    cpu = cpu_name()
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "torch_threads_per_rank": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_1m_at_start": float(os.environ.get("HIER_A2A_LOADAVG", "nan")),
            "emulated_cluster": emulated_cluster_info()}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def detail_rows(configs: list[dict[str, Any]], names: tuple[str, ...]) -> list[list[str]]:
    rows = []
    for c in configs:
        flat = c["strategies"][0]
        for r in c["strategies"]:
            node = r["bytes_per_level"][names[0]]
            t = r["times_s"]
            rows.append([str(c["top_k"]), str(c["num_experts"]), c["routing"], r["strategy"], str(r["d"]),
                         *(_mib(r["bytes_per_level"][n]) for n in names), _mib(r["total_bytes"]),
                         _mib(r["meta_bytes"]),
                         f"{node / flat['bytes_per_level'][names[0]]:.3f}",
                         f"{node / c['node_lower_bound_bytes']:.3f}", str(r["messages"]),
                         f"{r['median_s'] * 1e3:.1f}", f"{min(t) * 1e3:.1f} / {max(t) * 1e3:.1f}",
                         f"{r['median_s'] / flat['median_s']:.2f}",
                         *(f"{r['predicted_s'][tn] * 1e3:.2f}" for tn in sorted(r["predicted_s"])),
                         f"{r['bwd_median_s'] * 1e3:.1f}",
                         f"{min(r['bwd_times_s']) * 1e3:.1f} / {max(r['bwd_times_s']) * 1e3:.1f}",
                         f"{r['bwd_median_s'] / flat['bwd_median_s']:.2f}",
                         f"{flat['bwd_median_s'] / r['bwd_median_s']:.2f}"])
    return rows


def fastest_d(config: dict[str, Any]) -> int:
    """The d of the HD-d (dedup, fixed d) with the lowest median time."""
    fixed = [r for r in config["strategies"] if r["dedup"] and r["strategy"] != "HD-d*"]
    return int(min(fixed, key=lambda r: r["median_s"])["d"])


def above_lower_bound(config: dict[str, Any], node: str) -> list[str]:
    """Dedup strategies with d >= 2 whose inter-node bytes differ from the lower bound."""
    return [r["strategy"] for r in config["strategies"] if r["dedup"] and r["d"] >= 2
            and r["bytes_per_level"][node] != config["node_lower_bound_bytes"]]


def summary_rows(configs: list[dict[str, Any]], names: tuple[str, ...]) -> list[list[str]]:
    rows = []
    for c in configs:
        by = {r["strategy"]: r for r in c["strategies"]}
        flat, lb = by["flat A2A"], c["node_lower_bound_bytes"]
        at_lb = above_lower_bound(c, names[0])
        expected_ok = all(r["bytes_per_level"][names[0]] == r["expected_node_bytes"] for r in c["strategies"])
        combine_ok = all(r["bytes_per_level"] == r["combine_bytes_per_level"] for r in c["strategies"])
        bwd_ok = all(r["bwd_bytes_per_level"] == {n: 2 * b for n, b in r["bytes_per_level"].items()}
                     and r["bwd_combine_bytes_per_level"] == r["bytes_per_level"] for r in c["strategies"])
        rows.append([str(c["top_k"]), str(c["num_experts"]), c["routing"], _mib(lb),
                     "yes" if not at_lb else "NO: " + ", ".join(at_lb),
                     "yes" if expected_ok else "NO", "yes" if combine_ok else "NO", "yes" if bwd_ok else "NO",
                     f"{max(r['result_rel_err'] for r in c['strategies']):.1e}",
                     f"{max(max(r['bwd_result_rel_err'], r['bwd_meta_rel_err']) for r in c['strategies']):.1e}",
                     f"{by['HD2']['bytes_per_level'][names[0]] / flat['bytes_per_level'][names[0]]:.3f}",
                     str(fastest_d(c)), str(by["HD-d*"]["d"]),
                     *(str(c["dstar"][tn]) for tn in sorted(c["dstar"])),
                     f"{by['HD2']['median_s'] / flat['median_s']:.2f}",
                     f"{by['HD-d*']['median_s'] / flat['median_s']:.2f}",
                     f"{statistics.median(c['dstar_decision_s']) * 1e3:.1f}",
                     f"{by['HD2']['bwd_median_s'] / flat['bwd_median_s']:.2f}",
                     f"{by['HD-d*']['bwd_median_s'] / flat['bwd_median_s']:.2f}",
                     *(f"{flat['median_s'] / by[n]['median_s']:.2f} / {flat['bwd_median_s'] / by[n]['bwd_median_s']:.2f}"
                       for n in ("HD2", "HD-d*"))])
    return rows


def report(args: argparse.Namespace, configs: list[dict[str, Any]], topologies: dict[str, Topology],
           fit_info: list[dict[str, Any]], dstar_topology: str) -> None:
    names = args.mesh_names
    tnames = sorted(topologies)
    lb_label = "HD2" if len(names) == 2 else f"HD2..HD{len(names)}"  # the strategies that must reach LB
    info = machine_info()
    command = " ".join(["python bench/bench_hier_a2a.py", *sys.argv[1:]])
    detail_headers = ["K", "E", "routing", "strategy", "d", *(f"{n} MiB" for n in names), "total MiB", "meta MiB",
                      f"{names[0]} / flat", f"{names[0]} / LB", "msgs", "median ms", "min / max ms", "wall / flat",
                      *(f"pred ms ({tn})" for tn in tnames), "bwd median ms", "bwd min / max ms", "bwd wall / flat",
                      "bwd speedup"]
    summary_headers = ["K", "E", "routing", f"{names[0]} LB MiB", f"{lb_label} = LB", "all = expected",
                       "combine = dispatch", "bwd bytes = 2x / 1x", "result err", "bwd result err", f"HD2 {names[0]} / flat", "fastest d (measured)",
                       "HD-d* used", *(f"d* ({tn})" for tn in tnames), "HD2 wall / flat", "HD-d* wall / flat",
                       "d* decision ms", "HD2 bwd wall / flat", "HD-d* bwd wall / flat",
                       "HD2 speedup fwd / bwd", "HD-d* speedup fwd / bwd"]
    detail, summary = detail_rows(configs, names), summary_rows(configs, names)
    for title, headers, rows in (("per strategy", detail_headers, detail), ("per configuration", summary_headers,
                                                                             summary)):
        table = Table(title=f"hier_a2a {title}")
        for h in headers:
            table.add_column(h, justify="left" if h in ("routing", "strategy") else "right", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    matches = sum(fastest_d(c) == c["strategies"][-1]["d"] for c in configs)
    lb_all = not any(above_lower_bound(c, names[0]) for c in configs)
    console.print(f"HD-d* ({dstar_topology} topology) used the measured-fastest dedup d in {matches} of "
                  f"{len(summary)} configurations; {lb_label} inter-node bytes at the lower bound everywhere: "
                  f"{'yes' if lb_all else 'NO'}", highlight=False)
    if args.out is None:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "machine": info, "world": args.world, "topology_file": args.topology_file,
               "mesh": dict(zip(names, args.mesh_sizes)), "tokens_per_rank": args.tokens, "hidden": args.hidden,
               "reps": args.reps, "zipf_exponent": ZIPF_EXPONENT, "dstar_topology": dstar_topology,
               "topologies": {tn: t.to_dict() for tn, t in topologies.items()}, "local_fits": fit_info,
               "configs": configs}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    topo_lines = [f"- `{tn}`: " + ", ".join(f"{lv.name} alpha {lv.alpha_s * 1e6:.1f} us, "
                                            f"{lv.bandwidth_gbps:.3g} Gbit/s" for lv in topologies[tn].levels)
                  + f" ({topologies[tn].name})" for tn in tnames]
    if args.topology_file:
        topo_lines[tnames.index("cluster")] += f", from `{args.topology_file}`"
    if "local" in topologies:
        topo_lines.append("  (fit r2 per level: " + ", ".join(f"{f['level']} {f['r2']:.3f}" for f in fit_info)
                          + "; on a shared machine the fit moves from run to run)")
    emu = info["emulated_cluster"]
    if emu is None:
        where = ("All ranks run on one machine: every link is loopback at the same speed, so the wall times mostly "
                 "reflect the number of messages and collectives (an HD-d step runs 3d all-to-alls in dispatch and "
                 "d in combine) and copy overhead, not the bytes saved on slow links. Wall-clock comparisons on slow "
                 "inter-node links belong to the emulated-cluster benchmark (moe-cluster, bench/clusters/).")
        ranks_on = f"{args.world} gloo ranks (one process each, {info['torch_threads_per_rank']} torch thread each) on them"
    else:
        where = (f"The ranks run on an emulated cluster (moe-cluster, mesh {emu['mesh']}): one network namespace per "
                 f"leaf, its link shaped with tc to {emu['link_tc_rate']} per direction, the ranks of a namespace on "
                 "its loopback (unshaped), all processes on the machine's CPUs.")
        ranks_on = (f"{args.world} gloo ranks under moe-cluster run (one process each, "
                    f"{info['torch_threads_per_rank']} torch thread each; leaf link {emu['link_tc_rate']})")
    lines = [
        "# Hierarchical all-to-all: bytes per level and dispatch + combine time", "",
        f"Command: `{command}`" + (" (on every rank, under `moe-cluster run`)" if emu else ""), "",
        f"Machine: {info['cpu']}; {info['cpu_count']} CPUs ({info['affinity']} usable); {ranks_on}; 1-min load "
        f"average {info['loadavg_1m_at_start']} at start; torch {info['torch']}; Python {info['python']}.", "",
        f"Setup: mesh {' x '.join(f'{n}={s}' for n, s in zip(names, args.mesh_sizes))}, {args.tokens} tokens "
        f"per rank, H={args.hidden}, fp32, contiguous expert placement; routing uniform or Zipf (exponent "
        f"{ZIPF_EXPONENT}, fixed random popularity order), K distinct experts per token; {args.reps} timed "
        "repetitions per strategy, strategies interleaved (order rotated each repetition).", "",
        "Bytes: forward dispatch payload (token rows) per mesh level, summed over all ranks, from the runtime's "
        "counters; combine sends the same back (column \"combine = dispatch\"). Metadata (split sizes, "
        "expert ids and weights, all levels) is apart, in \"meta MiB\". LB: the dedup lower bound on inter-node "
        "bytes, distinct (token, other node) pairs x H x 4, computed from the routing. \"all = expected\": "
        "every strategy's inter-node bytes equal the count derived from the routing alone (copies for flat / "
        "2DH, distinct (token, rank) pairs for HD1, LB for d >= 2). \"result err\": max relative error of "
        "combine(dispatch(x) scaled by slot weights) against x * sum_k w_k. \"bwd bytes = 2x / 1x\": the "
        "backward dispatch moved exactly twice the forward's payload per level ([x | grad_y] rows) and the "
        "backward combine exactly the forward's; \"bwd result err\": the same check on the grad_y half and "
        "on the combined per-slot metadata (must give back the routing weights).", "",
        "Time: one forward dispatch + combine (no expert compute), the slowest rank's time per repetition; "
        "median, min / max; wall / flat = median / median of flat A2A. HD-d* includes its per-step decision "
        "(statistics, one all-reduce, Eq. 6), whose median (slowest rank) is \"d* decision ms\". "
        "Backward (\"bwd\" columns): right after each strategy's forward step in the same rotated order, after "
        "its own barrier, the backward dispatch + combine as hiermoe::ep_experts_backward runs it on the d that "
        "forward used (no decision): dispatch of [x | grad_y] rows (2H wide) along the same route, then combine "
        "of H-wide rows with float32 [R, S] per-slot routing-weight gradients as metadata; timed are the "
        "dispatch and the combine (what the op counts as its backward communication), not the stand-in for the "
        "local expert backward between them. bwd wall / flat = median / median of flat A2A's backward; "
        "speedup = the inverse. Predicted (forward only): 2 x HierMoE's dispatch time (combine moves the same "
        "volumes) from the statistics of every rank's routing (gathered), under:", "",
        *topo_lines, "",
        f"HD-d* chooses with the `{dstar_topology}` topology; \"fastest d (measured)\" is the HD-d (dedup) with "
        "the lowest median here.", "",
        where, "",
        f"HD-d* used the measured-fastest d in {matches} of {len(summary)} configurations; {lb_label} inter-node "
        f"bytes equal the lower bound in every configuration: {'yes' if lb_all else 'NO'}.", "",
        "## Per configuration", "",
        "| " + " | ".join(summary_headers) + " |", "|" + "|".join("---" for _ in summary_headers) + "|",
        *("| " + " | ".join(row) + " |" for row in summary), "",
        "## Per strategy", "",
        "| " + " | ".join(detail_headers) + " |", "|" + "|".join("---" for _ in detail_headers) + "|",
        *("| " + " | ".join(row) + " |" for row in detail),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    console.print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    plot(payload, out.with_suffix(".png"))


def plot(payload: dict[str, Any], path: Path) -> bool:
    """Inter-node MiB per strategy, bars grouped by K, one panel per (E, routing); False (with a
    printed note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("note: matplotlib is not installed; no plot written (pip install matplotlib to get one)")
        return False
    node = next(iter(payload["mesh"]))
    panels = sorted({(c["num_experts"], c["routing"]) for c in payload["configs"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, (num_experts, kind) in zip(axes[0], panels):
        cs = sorted((c for c in payload["configs"] if (c["num_experts"], c["routing"]) == (num_experts, kind)),
                    key=lambda c: c["top_k"])
        strat_names = [r["strategy"] for r in cs[0]["strategies"]]
        width = 0.8 / len(strat_names)
        for j, sn in enumerate(strat_names):
            vals = [next(r for r in c["strategies"] if r["strategy"] == sn)["bytes_per_level"][node] / 2**20
                    for c in cs]
            ax.bar([i + j * width for i in range(len(cs))], vals, width, label=sn)
        for i, c in enumerate(cs):
            ax.hlines(c["node_lower_bound_bytes"] / 2**20, i - width / 2, i + 0.8 - width / 2, colors="black",
                      linestyles="dashed", label="dedup lower bound" if i == 0 else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cs))], [f"K={c['top_k']}" for c in cs])
        ax.set_title(f"E={num_experts}, {kind}")
        ax.set_ylabel(f"inter-{node} MiB (all ranks)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"inter-{node} bytes of dispatch: {payload['world']} ranks, {payload['tokens_per_rank']} "
                 f"tokens/rank, H={payload['hidden']} fp32")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    console.print(f"wrote {path}")
    return True


# ---- launcher -----------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> int:
    """Fork ``args.world`` local ranks running ``worker`` (bench/machine.py's fork_ranks)."""
    return fork_ranks(args.world, worker, args, args.timeout, "a2abench", "HIER_A2A_LOADAVG")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small configuration (K=4, E=16, uniform), 3 reps")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to start (default 8; under torchrun its WORLD_SIZE, which it must equal)")
    p.add_argument("--mesh", default=None, help="levels slowest first, NAME=SIZE,... (default node=2,socket=2,gpu=2; "
                                                "under moe-cluster its MOE_CLUSTER_MESH)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 512; 128 quick)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 256; 64 quick)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per strategy (default 21; 3 quick)")
    p.add_argument("--topology", dest="topology_file", default=None, metavar="TOML",
                   help="topology file (moe_compile.tools.calibrate's, for the cluster the ranks run on) to use as the "
                        "'cluster' topology instead of the stated two_node_two_socket figures")
    p.add_argument("--dstar-topology", choices=("local", "cluster"), default=None,
                   help="topology HD-d* chooses d with (default: cluster with --topology, else local: the "
                        "ranks' links fitted at start)")
    p.add_argument("--out", default=None, help="results path without suffix (default bench/results/hier_a2a; "
                                               "with --quick nothing is written unless given)")
    p.add_argument("--top-k", default="2,4,8", help="K values of the grid, comma-separated (default 2,4,8)")
    p.add_argument("--experts", default="16,64", help="E values of the grid, comma-separated (default 16,64)")
    p.add_argument("--routing", default="uniform,zipf", help="routings of the grid (default uniform,zipf)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only draw the plot (JSON path with .png) from a results JSON of an earlier run")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (128 if args.quick else 512)
    args.hidden = args.hidden or (64 if args.quick else 256)
    args.reps = args.reps or (3 if args.quick else 21)
    try:
        args.top_ks = {int(v) for v in args.top_k.split(",")}
        args.num_experts = {int(v) for v in args.experts.split(",")}
    except ValueError as e:
        p.error(f"--top-k / --experts: {e}")
    args.routings = set(args.routing.split(","))
    grid = [c for c in FULL_GRID if c[0] in args.top_ks and c[1] in args.num_experts and c[2] in args.routings]
    if not grid:
        p.error(f"--top-k {args.top_k} --experts {args.experts} --routing {args.routing}: no configuration of the "
                f"grid (K in 2,4,8; E in 16,64; uniform, zipf)")
    if args.out is None and not args.quick:
        args.out = str(Path(__file__).parent / "results" / "hier_a2a")
    resolve_ranks(p, args, args.topology_file)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replot:
        return 0 if plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png")) else 1
    if "RANK" in os.environ:  # started by torchrun or the like: be that rank
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
