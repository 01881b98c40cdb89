"""One MoE layer's forward + backward in n chunks (the expert-parallel pipeline) against serial, on
the emulated 2-node cluster (issue 21; cost/pipeline.py, MoNTA Alg. 1-2).

    python bench/bench_pipeline.py                 # as root: the command behind bench/results/pipeline.*
    python bench/bench_pipeline.py --quick         # K=2 at 400mbit, n in 1,2,4, 3 reps: prints only

Per link rate (a fresh emulated cluster each, bench/clusters/two_node.toml with its node rate
overridden) and top-k: the layer (moe_compile.samples grouped GEMM, fp32, E experts, H, F,
T tokens per rank, each rank its own) compiled with hiermoe (mesh node=2,gpu=2, the links fitted
at start as bench_e2e does, the compute rate measured; inner compiler aot_eager) once per chunk
count n = 1..max, once with pipeline "auto" (the cost model's n on the alpha-beta fit), once as
"auto+r" (pipeline "auto" on a topology that also holds each level's efficiency curve r(n) from
the same calibration: chunk transfers at the efficiency measured at a chunk's size), once as
"auto+o" (pipeline "auto" on the alpha-beta fit plus the fixed cost of a chunk measured at start,
moe_compile.tools.calibrate.measure_chunk_overhead: what `moe-calibrate --chunk-overhead`
writes) and once with "tune" (n measured at compile time, passes/autotune.py); untimed warmup steps, then
repetitions that each time one forward + backward of every variant in an order rotated per
repetition, after a barrier; a step's time is its slowest rank's. Every variant's first output
and input gradient are checked against n = 1's (rel. err < 1e-5).

Reported: median per n, the speedup of the measured-fastest n and of "auto" over n = 1, whether
"auto", "auto+r" and "tune" ran within 5 % of the fastest n, the
model's predicted time per n (cost.pipeline.layer_s), and the bound a perfect overlap gives,
measured: the serial step split on each rank into its dispatch + combine wall time (comm) and
the rest (compute), the bound max(comm, compute) + min(comm, compute) / n (one chunk's fill) at
the fastest n, medians over the ranks and repetitions.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cluster_bench import rate_header  # noqa: E402

DEFAULT_CLUSTER = HERE / "clusters" / "two_node.toml"


def worker(args: argparse.Namespace) -> None:
    from cluster_bench import cluster_rank, forward_backward

    from moe_compile.backend import collect_reports
    from moe_compile.cost.pipeline import OP_OVERHEAD_S
    from moe_compile.ep import runtime
    from moe_compile.samples import SAMPLES

    rank, world, mesh, names, measured, say = cluster_rank(args.quick, args.rate, efficiency=True)
    # every variant but "auto+r" plans on the alpha-beta fit alone; "auto+r" also on the levels'
    # efficiency curves r(n) measured in the same calibration (cost.pipeline.Phase.chunk_s)
    topology = dataclasses.replace(measured, efficiency={})
    if args.no_chunk_overhead:
        with_overhead, chunk_overhead, overhead_times = None, None, {}
    else:
        from moe_compile.tools.calibrate import measure_chunk_overhead

        chunk_overhead, overhead_times = measure_chunk_overhead(mesh, topology, torch.device("cpu"), reps=5, warmup=1)
        with_overhead = dataclasses.replace(topology, chunk_overhead_s=chunk_overhead)
        say(f"  chunk overhead fitted: {chunk_overhead * 1e3:.1f} ms per chunk and direction (probe layer "
            + ", ".join(f"n={n} {t * 1e3:.0f} ms" for n, t in overhead_times.items()) + ")", flush=True)
    results = []
    for top_k in args.top_k:
        torch._dynamo.reset()
        torch.manual_seed(0)
        layer = SAMPLES["grouped_gemm"].make(hidden_size=args.hidden, ffn_size=args.ffn, num_experts=args.experts,
                                             top_k=top_k)
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(args.batch, args.tokens // args.batch, args.hidden, generator=gen)
        g = torch.randn(x.shape, generator=gen)
        variants: dict[str, Any] = {}
        plans: dict[str, str] = {}
        predicted: dict[str, str] = {}
        for n in [*args.chunks, "auto", "auto+r", *(["auto+o"] if with_overhead else []), "tune"]:
            topo_n = measured if n == "auto+r" else with_overhead if n == "auto+o" else topology
            options = {"mesh": mesh, "topology": topo_n, "inner_compiler": "aot_eager",
                       "pipeline": "auto" if n in ("auto+r", "auto+o") else n,
                       "expert_gather": False, "model_centric": False,  # the chunked token all-to-alls
                       "replicated_experts": False}  # (the layer is on every rank: else replicated, nothing sent)
            # (with model_centric left "auto" the planner ran model0 at K=8, which has no chunks)
            # a copy per variant: the ranks' agreement on a layer is kept per weights, for its recompiles
            variants[str(n)] = torch.compile(copy.deepcopy(layer), backend="hiermoe", options=options)

        step = functools.partial(forward_backward, x=x, g=g)

        ref_y, ref_g = None, None
        layer_of: dict[str, Any] = {}
        for name, fn in variants.items():
            with collect_reports() as graphs:
                y, gx = step(fn)
            layer_of[name] = runtime.layers()[-1]  # what its first step compiled
            (region,) = [r for gr in graphs for r in gr.regions]
            plans[name], predicted[name] = region.plan, region.pipeline
            if ref_y is None:
                ref_y, ref_g = y, gx
            err = max(float((y - ref_y).norm() / ref_y.norm()), float((gx - ref_g).norm() / ref_g.norm()))
            if err > 1e-5:
                raise RuntimeError(f"K={top_k} pipeline {name}: output differs from n=1's (rel err {err:.1e})")
            for _ in range(args.warmup):
                step(fn)
        names = list(variants)
        times: dict[str, list[float]] = {n: [] for n in names}
        # the serial (n=1) step split on each rank into its dispatch + combine wall time and the rest
        # (expert and router compute, the graph's own work): a perfect overlap of n chunks takes
        # max(comm, compute) + min(comm, compute) / n (one chunk's fill), the slowest rank's
        serial_split: list[tuple[float, float]] = []
        # CPU seconds of the step summed over the ranks (every thread of each: the caller, the
        # worker's lanes, gloo's): over the cores the ranks share, the least wall time the step
        # can take however well it overlaps
        cpu_s: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step(variants[name])
                dt = torch.tensor([time.perf_counter() - t0])
                cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
                dist.all_reduce(cpu)
                cpu_s[name].append(float(cpu))
                if name == "1":
                    comm = sum(layer_of[name].step_comm_s.values())
                    both = torch.tensor([comm, float(dt) - comm], dtype=torch.float64)
                    every = [torch.zeros_like(both) for _ in range(world)]
                    dist.all_gather(every, both)
                    serial_split.extend([(float(t[0]), float(t[1])) for t in every])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(float(dt))
        med = {n: statistics.median(v) for n, v in times.items()}
        comm_s = statistics.median(c for c, _ in serial_split)
        compute_s = statistics.median(r for _, r in serial_split)
        def ran(plan: str) -> int:
            return int(plan.split(" chunks")[0].rsplit(" ", 1)[-1]) if " chunks" in plan else 1

        chosen, chosen_r = ran(plans["auto"]), ran(plans["auto+r"])
        chosen_o = ran(plans["auto+o"]) if "auto+o" in plans else None
        tuned = int(predicted["tune"].rsplit("runs ", 1)[1]) if "measured chunks" in predicted["tune"] else 1
        # the model's prediction per n, from the layer's stage times in the "auto" plan's search
        say(f"  K={top_k}: " + "  ".join(f"n={n} {med[n] * 1e3:.0f} ms" for n in names)
            + f"  (auto ran n={chosen}; {predicted['auto']}; auto+r ran n={chosen_r}; tune ran n={tuned})", flush=True)
        results.append({"top_k": top_k, "times_s": times, "median_s": med, "auto_chunks": chosen,
                        "auto_r_chunks": chosen_r, "auto_o_chunks": chosen_o, "tune_chunks": tuned,
                        "plans": plans, "predicted": predicted, "serial_comm_s": comm_s,
                        "serial_compute_s": compute_s,
                        "cpu_floor_s": {n: statistics.median(v) / min(world, _cores()) for n, v in cpu_s.items()}})
        del variants
    if rank == 0:
        Path(os.environ["PIPE_OUT"]).write_text(json.dumps({"rate": args.rate, "topology": measured.to_dict(),
                                                            "chunk_overhead_s": chunk_overhead,
                                                            "default_chunk_overhead_s": OP_OVERHEAD_S,
                                                            "chunk_overhead_probe_s": overhead_times,
                                                            "configs": results}))
    dist.destroy_process_group()


def drive(args: argparse.Namespace, argv: list[str]) -> int:
    from cluster_bench import drive_rates

    return drive_rates(Path(__file__).resolve(), args, argv, "PIPE_OUT", report)


def report(payload: dict[str, Any]) -> str:
    from machine import cpu_name

    args = payload["args"]
    lines = ["# MoE layer forward + backward: chunked pipeline against serial, on the emulated cluster", "",
             f"Command: `{payload['command']}` (as root, from the repository root; cluster `{args['cluster']}` "
             "with its node rate set per run)", "",
             f"Machine: {cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}; {2 * args['ranks_per_node']} gloo ranks, 1 torch thread each; {payload['date']}; wall time "
             f"{payload['wall_s'] / 60:.1f} min; 1-min load average at the end {payload['load_avg_end']:.1f}.", "",
             f"Layer: moe_compile.samples grouped_gemm, fp32, E={args['experts']}, H={args['hidden']}, "
             f"F={args['ffn']}, {args['tokens']} tokens per rank; hiermoe over mesh node=2"
             + (f",gpu={args['ranks_per_node']}" if args["ranks_per_node"] > 1 else "") + ", inner compiler "
             f"aot_eager, options pipeline = n, \"auto\" or \"tune\". {args['reps']} repetitions each timing one forward + "
             "backward of every variant (rotated order, barrier first, slowest rank's time).", ""]
    for run in payload["runs"]:
        lines += rate_header(run)
        if run.get("chunk_overhead_s") is not None:
            probe = ", ".join(f"n={n} {t * 1e3:.0f} ms" for n, t in run["chunk_overhead_probe_s"].items())
            lines += [f"Chunk overhead (auto+o): {run['chunk_overhead_s'] * 1e3:.1f} ms per chunk and direction, fitted to "
                      f"the probe layer's forward + backward ({probe}; moe_compile.tools.calibrate."
                      "measure_chunk_overhead), against the model's default "
                      f"{run.get('default_chunk_overhead_s', 2e-3) * 1e3:g} ms (auto).", ""]
        lines.append("| K | " + " | ".join(f"n={n} ms" for n in args["chunks"]) + " | auto ms (n) | fastest n |"
                     " speedup fastest / n=1 | speedup auto / n=1 | auto within 5 % of fastest |"
                     " auto+r ms (n) | auto+r within 5 % of fastest |"
                     " auto+o ms (n) | auto+o within 5 % of fastest |"
                     " tune ms (n) | tune within 5 % of fastest |"
                     " n=1 comm / compute ms | perfect-overlap bound at the fastest n ms | fastest / bound |"
                     " CPU floor n=1 / fastest n ms | predicted by the model |")
        lines.append("|" + "---|" * (len(args["chunks"]) + 17))
        for c in run["configs"]:
            med = c["median_s"]
            chunks = [str(n) for n in args["chunks"]]
            fastest = min(chunks, key=lambda n: med[n])
            serial = med["1"]
            within = med["auto"] <= 1.05 * med[fastest]
            split = ("-", "-", "-")
            if "serial_comm_s" in c:  # runs before the bound was measured have no split
                comm, compute = c["serial_comm_s"], c["serial_compute_s"]
                bound = max(comm, compute) + min(comm, compute) / int(fastest)
                split = (f"{comm * 1e3:.0f} / {compute * 1e3:.0f}", f"{bound * 1e3:.0f}",
                         f"{med[fastest] / bound:.2f}")
            floor = c.get("cpu_floor_s")  # runs before it was measured have none
            floor_txt = f"{floor['1'] * 1e3:.0f} / {floor[fastest] * 1e3:.0f}" if floor else "-"
            tune_txt = (f"{med['tune'] * 1e3:.0f} ({c['tune_chunks']}) | "
                        f"{'yes' if med['tune'] <= 1.05 * med[fastest] else 'no'}") if "tune" in med else "- | -"
            auto_r_txt = (f"{med['auto+r'] * 1e3:.0f} ({c['auto_r_chunks']}) | "
                          f"{'yes' if med['auto+r'] <= 1.05 * med[fastest] else 'no'}") if "auto+r" in med else "- | -"
            auto_o_txt = (f"{med['auto+o'] * 1e3:.0f} ({c['auto_o_chunks']}) | "
                          f"{'yes' if med['auto+o'] <= 1.05 * med[fastest] else 'no'}") if "auto+o" in med else "- | -"
            lines.append(f"| {c['top_k']} | " + " | ".join(f"{med[n] * 1e3:.0f}" for n in chunks)
                         + f" | {med['auto'] * 1e3:.0f} ({c['auto_chunks']}) | {fastest} | {serial / med[fastest]:.2f}x"
                         f" | {serial / med['auto']:.2f}x | {'yes' if within else 'no'} | {auto_r_txt} | {auto_o_txt}"
                         f" | {tune_txt} |"
                         f" {' | '.join(split)} |"
                         f" {floor_txt} | {c['predicted']['auto']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _cores() -> int:
    """The cores this rank may run on (the ranks of one machine share them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="K=2 at 400mbit, n in 1,2,4, 3 reps, prints only")
    p.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER)
    p.add_argument("--rates", default=None, help="node link rates, tc syntax, comma-separated (default 400mbit,1gbit)")
    p.add_argument("--rate", default=None, help=argparse.SUPPRESS)  # the rank's run
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="ranks per node (default 2: mesh node=2,gpu=2; 1: mesh node=2, a core per rank here)")
    p.add_argument("--top-k", default=None, help="comma-separated (default 2,4,8)")
    p.add_argument("--chunks", default=None, help="comma-separated chunk counts (default 1..8)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank (default 512)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7; 3 quick)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-chunk-overhead", action="store_true",
                   help="skip measuring the fixed cost of a chunk at start (and the auto+o variant)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="results path without suffix (default bench/results/pipeline; "
                                               "--quick: none)")
    args = p.parse_args(argv)
    args.rates = (args.rates or ("400mbit" if args.quick else "400mbit,1gbit")).split(",")
    args.top_k = [int(k) for k in (args.top_k or ("2" if args.quick else "2,4,8")).split(",")]
    args.chunks = [int(n) for n in (args.chunks or ("1,2,4" if args.quick else "1,2,3,4,5,6,7,8")).split(",")]
    if args.chunks[0] != 1:
        raise SystemExit("--chunks must start with 1 (the serial layer every speedup is against)")
    args.reps = args.reps or (3 if args.quick else 7)
    if args.out is None and not args.quick:
        args.out = "bench/results/pipeline"
    return args


def main(argv: list[str] | None = None) -> int:
    from cluster_bench import bench_main

    return bench_main(argv, parse_args, worker, drive)


if __name__ == "__main__":
    sys.exit(main())
