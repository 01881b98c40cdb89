"""Runtime cost of the planner's per-step decision (HierMoE Alg. 1: d* from fresh routing).

Measures, for E=256, K=8, T=8192 routings on the shipped topologies, the time to compute the
duplicate-free statistics and evaluate the lambdified t_1..t_D (``HDCostModel.choose``), and the
time of a full ``plan()`` over every candidate model (done once per compile, not per step).
The target (issue 3): well under 1 ms per step on this machine.

    python bench/bench_planner.py [--reps 50] [--out bench/results/planner.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from moe_compile.cost import Topology, Workload, plan
from moe_compile.cost.hiermoe import HDCostModel
from moe_compile.cost.planner import uniform_routing


def _time(fn, reps: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples), statistics.median(samples), max(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench/results/planner.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Workload(num_tokens=8192, hidden_size=7168, ffn_size=2048, num_experts=256, top_k=8, dtype_bytes=2)
    routing = uniform_routing(work)
    rows = []
    for name in ("hiermoe_testbed", "dgx_h100_2node", "hybridep_cross_dc"):
        topo = Topology.load(str(files("moe_compile.cost") / "topologies" / f"{name}.toml"))
        t0 = time.perf_counter()
        model = HDCostModel(topo, work)
        build_s = time.perf_counter() - t0
        step = _time(lambda m=model: m.choose(routing), args.reps)
        full = _time(lambda t=topo: plan(t, work, routing), max(3, args.reps // 10))
        rows.append((name, "x".join(map(str, topo.sizes)), build_s, step, full, model.choose(routing)))
    table = Table(title=f"planner cost, E={work.num_experts} K={work.top_k} T={work.num_tokens} "
                        f"({args.reps} reps, {args.threads} thread)")
    for col in ("topology", "mesh", "lambdify once (s)", "d* per step: median ms (min/max)",
                "full plan(): median ms", "d*"):
        table.add_column(col)
    lines = [
        "# Planner runtime path", "",
        f"Command: `python bench/bench_planner.py --reps {args.reps} --threads {args.threads}`", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"numpy {np.__version__}", "",
        f"Workload: E={work.num_experts}, K={work.top_k}, T={work.num_tokens} uniform routing. 'd* per step' is "
        "`HDCostModel.choose`: duplicate-free statistics (HierMoE Eq. 7 / Alg. 1) plus the lambdified "
        "t_1..t_D and Eq. 6. 'full plan()' evaluates every candidate model (HierMoE, MoNTA, HybridEP, "
        "HEXA-MoE) and runs once per compile.", "",
        "| topology | mesh | lambdify once (s) | d* per step: median ms (min / max) | full plan(): median ms | d* |",
        "|---|---|---|---|---|---|",
    ]
    for name, mesh, build_s, step, full, d in rows:
        cells = (name, mesh, f"{build_s:.2f}", f"{step[1] * 1e3:.3f} ({step[0] * 1e3:.3f} / {step[2] * 1e3:.3f})",
                 f"{full[1] * 1e3:.1f}", str(d))
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
