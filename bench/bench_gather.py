"""One MoE layer's forward + backward under the hiermoe backend's expert-parallel strategies: token
all-to-all against expert gathers, and what the planner picks, on the emulated 2-node cluster
(issue 22; lowering/strategies/gather.py, cost/planner.py gather_time_s).

    python bench/bench_gather.py                   # as root: the command behind bench/results/gather.*
    python bench/bench_gather.py --quick           # 400mbit, the first shape, 3 reps: prints only
    python bench/bench_gather.py --report bench/results/gather.json   # rewrite gather.md from the JSON

Per node link rate (a fresh emulated cluster each, bench/clusters/two_node.toml with its node rate
overridden; mesh node=2,gpu=2) and shape (moe_compile.samples grouped GEMM, fp32, H, F, E experts,
top-K, T tokens per rank as [batch, T / batch, H], each rank its own, a seeded upstream gradient):
the layer compiled with hiermoe (the links fitted at start as bench_e2e does, the compute rate
measured; inner compiler aot_eager) once per variant, each a copy of the same layer:

  a2a (HD d*)  options {"expert_gather": False, "model_centric": False, "replicated_experts": False}:
               the planner's choice among
               the token all-to-alls
  gather1      {"expert_gather": "gpu"} (level 1): each node's ranks
               all-gather their experts, tokens cross nodes
  gather0      {"expert_gather": "node"} (level 0): the whole mesh gathers the experts, no token
               moves (data-centric)
  model0       {"model_centric": "always"}: HEXA-MoE's model-centric mode (lowering/strategies/model.py):
               every rank's tokens all-gathered, each rank computing its F/S columns of every
               expert, the partial outputs reduce-scattered (--no-model leaves it out)
  planner      {"replicated_experts": False} (expert_gather and model_centric "auto"): the planner
               chooses among all of them (the layer is on every rank, so without that option it
               would run replicated, nothing sent: this bench weighs moving tokens against experts)
  tuned        the planner's options and tune_strategy: the candidates it predicts within 2x of its
               best timed at compile time on the ranks, the fastest runs (passes/autotune.py;
               --no-tune leaves it out)

Untimed warmup steps (the first compiles and is the check: every variant's output and input
gradient against the a2a variant's, rel. err < 1e-5), more untimed steps while a variant's layer
still explores its all-to-all dimension (options' tune_dimension: the steps that measure each close
d), then repetitions that each time one forward + backward of every variant in an order rotated per
repetition, after a barrier; a step's time is its slowest rank's.

Reported: the median per variant, the planner's pick (its plan's candidate) and whether the planner
variant is the measured fastest or within 10 % of it; the planner's predicted times (forward: the
candidates' communication + expert compute, ``RegionReport.predicted_s``) for the best token
all-to-all, gather1 and gather0; the seconds each gather variant's forward waited for its gather
(``EPLayer.gather_exposed_s``, slowest rank, median); per shape the measured and the predicted
crossover rate (the lowest rate at which the all-to-all beats the best gather); per variant the
step's peak memory per rank (one more step after the timed ones: how far the rank's resident
memory rose above where the step started, ``cluster_bench.step_peak_bytes``, the highest rank).
"""

from __future__ import annotations

import argparse
import copy
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
# name=H:F:E:K:T (T tokens per rank)
DEFAULT_SHAPES = "small experts=256:128:8:4:1024,large experts=256:1024:8:2:128"
LABELS = {"a2a": "a2a (HD d*)", "gather1": "gather1", "gather0": "gather0", "model0": "model0", "planner": "planner",
          "tuned": "tuned"}
MOVING = ("gather1", "gather0", "model0")  # the variants that force one candidate
WITHIN = 1.10  # the planner's pick counts as good within 10 % of the measured fastest


def worker(args: argparse.Namespace) -> None:
    from cluster_bench import cluster_rank, forward_backward, step_peak_bytes

    from moe_compile.backend import collect_reports, hiermoe_backend
    from moe_compile.ep import runtime
    from moe_compile.samples import SAMPLES

    rank, world, mesh, names, topology, say = cluster_rank(args.quick, args.rate)
    # gather j needs mesh level j: a one-level mesh (--ranks-per-node 1) has no gather1
    # every rank holds the whole layer (no shard_experts), where the planner would run it replicated
    # (nothing sent): left out, this bench weighs moving tokens against moving experts
    gathers: dict[str, dict[str, Any]] = {"a2a": {"expert_gather": False, "model_centric": False,
                                                  "replicated_experts": False}}
    gathers.update({f"gather{j}": {"expert_gather": names[j]} for j in (1, 0) if j < len(names)})
    if args.model:
        gathers["model0"] = {"expert_gather": False, "model_centric": "always"}
    gathers["planner"] = {"replicated_experts": False} if args.model else {"model_centric": False,
                                                                           "replicated_experts": False}
    if args.tune:
        gathers["tuned"] = {**gathers["planner"], "tune_strategy": True}
    results = []
    for shape in args.shapes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        layer = SAMPLES["grouped_gemm"].make(hidden_size=shape["hidden"], ffn_size=shape["ffn"],
                                             num_experts=shape["experts"], top_k=shape["top_k"])
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(args.batch, shape["tokens"] // args.batch, shape["hidden"], generator=gen)
        if args.skew:  # every token leans to the experts of mesh position 0 (their router logits + skew)
            with torch.no_grad():
                hot = torch.arange(shape["experts"]) < shape["experts"] // world
                layer.router.weight[:, 0] = hot.float() * 2 - 1
            x[..., 0] = args.skew
        g = torch.randn(x.shape, generator=gen)
        variants: dict[str, Any] = {}
        for name, extra in gathers.items():
            options = {"mesh": mesh, "topology": topology, "inner_compiler": "aot_eager", **extra}
            if args.pipeline != "auto":
                options["pipeline"] = False if args.pipeline == "off" else int(args.pipeline)
            # a copy per variant: the ranks' agreement on a layer is kept per weights, for its recompiles.
            # The backend as a callable of its own per variant, not backend="hiermoe" with options:
            # Dynamo reuses a compile whose backend compares equal (torch._TorchCompileWrapper.__eq__
            # compares the options dicts with ==, so e.g. 0 and False would collide; the copies'
            # weights are graph inputs, so one variant would run another's graph)
            backend = functools.partial(hiermoe_backend, options=options)
            variants[name] = torch.compile(copy.deepcopy(layer), backend=backend)

        step = functools.partial(forward_backward, x=x, g=g)

        ref_y, ref_g = None, None
        layer_of: dict[str, Any] = {}
        plans: dict[str, str] = {}
        predicted: dict[str, dict[str, float]] = {}
        notes: dict[str, list[str]] = {}
        executable: dict[str, list[str]] = {}
        pipelines: dict[str, str] = {}
        errors: dict[str, float] = {}
        warmups: dict[str, int] = {}
        for name, fn in variants.items():
            # collect_reports, not moe_compile.explain: explain resets Dynamo, which would drop the
            # variants compiled before it; the regions are the same RegionReports explain returns
            with collect_reports() as graphs:
                y, gx = step(fn)
            regions = [r for gr in graphs for r in gr.regions]
            if len(regions) != 1:
                raise RuntimeError(f"{shape['name']} at {args.rate}: {name} compiled {len(regions)} MoE layers, "
                                   f"not 1 ({len(graphs)} graphs; left alone: "
                                   f"{[(s.name, s.reason) for gr in graphs for s in gr.skipped]})")
            (region,) = regions
            ran = region.plan.split()[0]
            if name not in ("planner", "tuned") and (ran != name if name in MOVING else ran.startswith(("gather", "model"))):
                raise RuntimeError(f"{shape['name']} at {args.rate}: the {name} variant runs {region.plan}")
            layer_of[name] = runtime.layer(region.ep_layer) if region.ep_layer is not None else runtime.layers()[-1]
            plans[name], predicted[name] = region.plan, dict(region.predicted_s)
            notes[name] = list(region.plan_notes)
            executable[name], pipelines[name] = list(region.executable), region.pipeline
            if ref_y is None:
                ref_y, ref_g = y, gx
            err = max(float((y - ref_y).norm() / ref_y.norm()), float((gx - ref_g).norm() / ref_g.norm()))
            errors[name] = err
            if err > 1e-5:
                raise RuntimeError(f"{shape['name']} at {args.rate}: {name} ({region.plan}) differs from the a2a "
                                   f"variant's output or input gradient (rel err {err:.1e})")
            n = 1
            for _ in range(args.warmup - 1):
                step(fn)
                n += 1
            while n < args.warmup + args.tune_cap and _exploring(layer_of[name]):
                step(fn)
                n += 1
            warmups[name] = n
        order_names = list(variants)
        times: dict[str, list[float]] = {n: [] for n in order_names}
        exposed: dict[str, list[float]] = {n: [] for n in order_names}
        dims: dict[str, list[int | None]] = {n: [] for n in order_names}
        for rep in range(args.reps):
            order = order_names[rep % len(order_names):] + order_names[:rep % len(order_names)]
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                step(variants[name])
                dt = time.perf_counter() - t0
                lay = layer_of[name]
                both = torch.tensor([dt, lay.gather_exposed_s if lay.domain is not None else 0.0],
                                    dtype=torch.float64)
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                times[name].append(float(both[0]))
                if lay.domain is not None:
                    exposed[name].append(float(both[1]))
                dims[name].append(lay.last_dimension if lay.domain is None else None)
        # memory: one more step of each variant, its resident memory's peak above where it started
        # (every thread's allocations: cluster_bench.step_peak_bytes), the highest rank's
        peaks: dict[str, int] = {}
        for name in order_names:
            dist.barrier()
            peak = torch.tensor([step_peak_bytes(functools.partial(step, variants[name]))[1]], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[name] = int(peak)
        med = {n: statistics.median(v) for n, v in times.items()}
        pick = plans["planner"].split()[0]
        tuned_pick = plans["tuned"].split()[0] if "tuned" in plans else None
        # this rank's payload bytes per level in its last step (forward + backward): tokens, and the
        # expert weights and their gradients of a gather
        sent = {n: {"tokens": lay.last_step_bytes(),
                    "experts": lay.last_step_bytes(gather=True) if lay.domain is not None else {},
                    "gathered_bytes": lay.gathered_bytes} for n, lay in layer_of.items()}
        say(f"  {shape['name']}: " + "  ".join(f"{n} {med[n] * 1e3:.0f} ms" for n in order_names)
            + f"  (planner ran {plans['planner']}" + (f"; tuned ran {plans['tuned']}" if tuned_pick else "") + ")",
            flush=True)
        results.append({"shape": shape, "times_s": times, "median_s": med, "plans": plans, "pick": pick,
                        "tuned_pick": tuned_pick,
                        "predicted_s": predicted, "plan_notes": notes, "executable": executable, "pipeline": pipelines,
                        "first_step_rel_err": errors, "warmup_steps": warmups,
                        "gather_exposed_s": {n: statistics.median(v) for n, v in exposed.items() if v},
                        "dimensions": dims, "rank0_sent_bytes": sent, "step_peak_bytes": peaks,
                        "weight_bytes_per_rank": sum(p.numel() * p.element_size() for p in layer.parameters())})
        del variants
    if rank == 0:
        Path(os.environ["GATHER_OUT"]).write_text(json.dumps({"rate": args.rate, "topology": topology.to_dict(),
                                                              "configs": results}))
    dist.destroy_process_group()


def _exploring(lay: Any) -> bool:
    """Whether the layer's next step still explores an all-to-all dimension (``ep.tuning``): those
    steps run a d the model finds close to the best, to measure it; the same on every rank (the
    tuner decides on what every rank received), max-reduced to be sure."""
    from moe_compile.ep.tuning import EXPLORE_WITHIN

    tuner, times = lay.tuner, list(lay.last_times_s)
    more = False
    if lay.domain is None and lay.dimension is None and tuner.rounds > 0 and times:
        best = min(times)
        more = any(tuner.tried.get(d, 0) < tuner.rounds for d, t in enumerate(times, 1) if t <= EXPLORE_WITHIN * best)
    flag = torch.tensor([int(more)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def drive(args: argparse.Namespace, argv: list[str]) -> int:
    from cluster_bench import drive_rates

    return drive_rates(Path(__file__).resolve(), args, argv, "GATHER_OUT", report, machine=_machine())


def _machine() -> str:
    from machine import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}"


def _class(candidate: str) -> str:
    """The variant that runs a planner candidate: gather0/gather1/model0 themselves, any token all-to-all a2a."""
    return candidate if candidate in MOVING else "a2a"


def _a2a_predicted(c: dict[str, Any]) -> tuple[str, float] | None:
    """The planner's best token all-to-all and its predicted seconds: the fastest of the candidates
    the a2a variant may run, from the planner variant's predictions (the same topology)."""
    pred = c["predicted_s"]["planner"]
    allowed = [k for k in c["executable"]["a2a"] if k in pred] or [k for k in pred if k.startswith("hd")]
    if not allowed:
        return None
    best = min(allowed, key=pred.__getitem__)
    return best, pred[best]


def _fastest(med: dict[str, float]) -> str:
    return min((n for n in med if n not in ("planner", "tuned")), key=med.__getitem__)


def _verdict(c: dict[str, Any], variant: str = "planner") -> tuple[bool, str]:
    """Whether the planner's pick (``variant`` "tuned": tune_strategy's) is the measured fastest
    strategy or the variant ran within 10 % of it, and the words for the table."""
    med = c["median_s"]
    fastest = _fastest(med)
    over = med[variant] / med[fastest] - 1
    if _class(c["pick" if variant == "planner" else "tuned_pick"]) == fastest:
        return True, f"yes (the fastest; {over * 100:+.0f} %)"
    return over <= WITHIN - 1, f"{'yes' if over <= WITHIN - 1 else 'no'} ({over * 100:+.0f} %)"


def _crossover(points: list[tuple[float, str, float, float]]) -> str:
    """The lowest rate at which the all-to-all takes less than the best gather, from (bit/s, rate,
    a2a seconds, best gather seconds) per rate; "none" if at no rate."""
    for _, rate, a2a, gather in sorted(points):
        if a2a < gather:
            return rate
    return "none"


def report(payload: dict[str, Any]) -> str:
    from moe_compile.tools.cluster_net import parse_rate

    args = payload["args"]
    machine = payload.get("machine") or _machine()
    shapes = args["shapes"]
    lines = ["# MoE layer forward + backward: token all-to-all against expert gathers, on the emulated cluster", "",
             f"Command: `{payload['command']}` (as root, from the repository root; cluster `{args['cluster']}` "
             "with its node rate set per run)", "",
             f"Machine: {machine}; {2 * args['ranks_per_node']} gloo ranks, 1 torch thread each; {payload['date']}; "
             f"wall time {payload['wall_s'] / 60:.1f} min; 1-min load average at the end "
             f"{payload['load_avg_end']:.1f}.", "",
             "Cluster: " + "; ".join(f"{r['rate']}: {r.get('cluster', '-')}" for r in payload["runs"]) + ".", "",
             "Layer: moe_compile.samples grouped_gemm, fp32, shapes "
             + "; ".join(f"{s['name']}: H={s['hidden']} F={s['ffn']} E={s['experts']} K={s['top_k']} "
                         f"{s['tokens']} tokens per rank" for s in shapes)
             + f" (as [{args['batch']}, T / {args['batch']}, H])"
             + (f"; skewed routing: every token's first feature {args['skew']:g} and the router's first column +1 "
                "for the experts of mesh position 0, -1 for the others, so tokens lean to that rank's experts"
                if args.get("skew") else "")
             + ". hiermoe over mesh node=2"
             + (f",gpu={args['ranks_per_node']}" if args["ranks_per_node"] > 1 else "")
             + ", inner compiler aot_eager; variants: a2a = expert_gather False (the planner's token all-to-all, "
             "HD-d with d* per step), gather1 = expert_gather level 1 (experts all-gathered inside each node, tokens "
             "across nodes), gather0 = expert_gather level 0 (the whole mesh gathers, no token moves)"
             + (", model0 = model_centric \"always\" (every rank's tokens all-gathered, each rank computing its F/S "
                "columns of every expert, the partial outputs reduce-scattered)" if args.get("model", False) else "")
             + ", planner = expert_gather and model_centric \"auto\", replicated_experts False" + (", tuned = the same with tune_strategy" if args.get("tune") else "")
             + f". {args['warmup']} untimed step(s) per variant, more while its dimension tuner "
             f"explores (up to {args['tune_cap']}), then {args['reps']} repetitions each timing one forward + "
             "backward of every variant (rotated order, barrier first, slowest rank's time); medians in ms.", "",
             "Predicted: the planner's forward times (communication + expert compute, cost/planner.py; the "
             "gathers' without prefetch) from the topology fitted at start; the measured step is forward + "
             "backward, so compare ratios. Gather wait: the seconds the forward waited for its gather "
             "(EPLayer.gather_exposed_s; a single layer has nothing to prefetch behind), slowest rank, median.", "",
             "Step peak: after the timed repetitions, one more forward + backward of each variant; how far the "
             "rank's resident memory rose above where the step started (freed heap memory returned to the OS "
             "first, the kernel's peak mark reset: bench/cluster_bench.py step_peak_bytes; every thread's "
             "allocations, gloo's included), the highest rank's, in MiB. Between steps every rank holds the "
             "whole layer (no shard_experts): "
             + "; ".join(f"{c['shape']['name']} {c['weight_bytes_per_rank'] / 2**20:.1f} MiB"
                         for c in payload["runs"][0]["configs"] if "weight_bytes_per_rank" in c) + ".", ""]
    good = total = tuned_good = tuned_total = 0
    crossings: dict[str, dict[str, list[tuple[float, str, float, float]]]] = {}
    for run in payload["runs"]:
        lines += rate_header(run)
        lines.append("| shape | a2a ms | gather1 ms | gather0 ms | model0 ms | planner ms (its pick) | measured fastest |"
                     " planner pick within 10 % of fastest? | predicted fw ms: a2a (best) / gather1 / gather0 / model0 |"
                     " gather wait fw ms: gather1 / gather0 | a2a plan | tuned ms (its pick) | tuned within 10 %? |"
                     " step peak MiB: a2a / gather1 / gather0 / model0 / planner |")
        lines.append("|" + "---|" * 14)
        for c in run["configs"]:
            med = c["median_s"]
            pred = c["predicted_s"]["planner"]
            fastest = _fastest(med)
            ok, words = _verdict(c)
            good, total = good + ok, total + 1
            tuned_txt = "- | -"
            if c.get("tuned_pick"):
                t_ok, t_words = _verdict(c, "tuned")
                tuned_good, tuned_total = tuned_good + t_ok, tuned_total + 1
                tuned_txt = f"{med['tuned'] * 1e3:.0f} ({c['tuned_pick']}) | {t_words}"
            a2a_pred = _a2a_predicted(c)
            gathers = [n for n in ("gather1", "gather0") if n in med]
            pred_txt = (f"{a2a_pred[1] * 1e3:.3g} ({a2a_pred[0]})" if a2a_pred else "-") + " / " + " / ".join(
                f"{pred[n] * 1e3:.3g}" if n in pred else "-" for n in ("gather1", "gather0", "model0"))
            wait = c.get("gather_exposed_s", {})
            wait_txt = " / ".join(f"{wait[n] * 1e3:.1f}" if n in wait else "-" for n in ("gather1", "gather0"))
            peaks = c.get("step_peak_bytes", {})
            peak_txt = " / ".join(f"{peaks[n] / 2**20:.1f}" if n in peaks else "-"
                                  for n in ("a2a", "gather1", "gather0", "model0", "planner"))
            lines.append(f"| {c['shape']['name']} | " + " | ".join(
                f"{med[n] * 1e3:.0f}" if n in med else "-" for n in ("a2a", "gather1", "gather0", "model0"))
                + f" | {med['planner'] * 1e3:.0f} ({c['pick']}) | {LABELS[fastest]} | {words} | {pred_txt} |"
                f" {wait_txt} | {c['plans']['a2a']} | {tuned_txt} | {peak_txt} |")
            if gathers:
                per = crossings.setdefault(c["shape"]["name"], {"measured": [], "predicted": []})
                bits = parse_rate(run["rate"])
                per["measured"].append((bits, run["rate"], med["a2a"], min(med[n] for n in gathers)))
                pred_g = [pred[n] for n in gathers if n in pred]
                if a2a_pred and pred_g:
                    per["predicted"].append((bits, run["rate"], a2a_pred[1], min(pred_g)))
        lines.append("")
        for c in run["configs"]:
            for note in c.get("plan_notes", {}).get("planner", []):
                lines.append(f"- {c['shape']['name']}, planner: {note}")
        if any(c.get("plan_notes", {}).get("planner") for c in run["configs"]):
            lines.append("")
    lines.append("## Summary")
    lines.append("")
    lines.append(f"The planner's pick is the measured fastest strategy or within 10 % of it at {good} of {total} "
                 "(rate, shape) points." + (f" With tune_strategy (every candidate within 2x of the planner's best "
                                            f"timed at compile time): {tuned_good} of {tuned_total}."
                                            if tuned_total else ""))
    lines.append("")
    if crossings:
        lines.append("Crossover (the lowest node rate at which the token all-to-all is faster than the best gather; "
                     f"rates run: {', '.join(r['rate'] for r in payload['runs'])}):")
        lines.append("")
        lines.append("| shape | measured crossover | predicted crossover |")
        lines.append("|---|---|---|")
        for name, per in crossings.items():
            lines.append(f"| {name} | {_crossover(per['measured'])} | "
                         f"{_crossover(per['predicted']) if per['predicted'] else '-'} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def parse_shapes(text: str) -> list[dict[str, Any]]:
    """``[name=]H:F:E:K:T`` comma-separated (T tokens per rank)."""
    out = []
    for item in text.split(","):
        name, _, dims = item.strip().rpartition("=")
        try:
            hidden, ffn, experts, top_k, tokens = (int(v) for v in dims.split(":"))
        except ValueError:
            raise SystemExit(f"--shapes: {item!r} is not [name=]H:F:E:K:T") from None
        out.append({"name": name or f"H={hidden} F={ffn} E={experts} K={top_k} T={tokens}", "hidden": hidden,
                    "ffn": ffn, "experts": experts, "top_k": top_k, "tokens": tokens})
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="400mbit, the first shape, 3 reps, prints only")
    p.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER)
    p.add_argument("--rates", default=None,
                   help="node link rates, tc syntax, comma-separated (default 100mbit,400mbit,2gbit)")
    p.add_argument("--rate", default=None, help=argparse.SUPPRESS)  # the rank's run
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="ranks per node (default 2: mesh node=2,gpu=2; 1: mesh node=2, no gather1)")
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated [name=]H:F:E:K:T, T tokens per rank (default {DEFAULT_SHAPES!r})")
    p.add_argument("--batch", type=int, default=4, help="the input is [batch, T / batch, H] (default 4)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7; 3 quick)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant, the first the check (default 1)")
    p.add_argument("--tune-cap", type=int, default=12,
                   help="at most this many more untimed steps while a variant's dimension tuner explores "
                        "(default 12; 0: none)")
    p.add_argument("--no-model", dest="model", action="store_false",
                   help="leave out the model-centric variant (and the planner's model0 candidate)")
    p.add_argument("--no-tune", dest="tune", action="store_false",
                   help="leave out the tuned variant (options tune_strategy: the candidates timed at compile time)")
    p.add_argument("--pipeline", default="auto",
                   help="options['pipeline'] of every variant: auto (default, the cost model's chunk count), "
                        "off, or a chunk count")
    p.add_argument("--skew", type=float, default=0.0,
                   help="route every token toward the experts of mesh position 0: their router logits raised by "
                        "SKEW, the others lowered by it (default 0: the router as initialised)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="results path without suffix (default bench/results/gather; "
                                               "--quick: none)")
    p.add_argument("--report", default=None, metavar="JSON", help="only rewrite the .md from a results JSON")
    args = p.parse_args(argv)
    args.rates = (args.rates or ("400mbit" if args.quick else "100mbit,400mbit,2gbit")).split(",")
    args.shapes = parse_shapes(args.shapes or DEFAULT_SHAPES)
    if args.quick:
        args.shapes = args.shapes[:1]
    args.reps = args.reps or (3 if args.quick else 7)
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step compiles and is the check)")
    world = 2 * args.ranks_per_node
    for s in args.shapes:
        if s["experts"] % world or s["tokens"] % args.batch:
            p.error(f"shape {s['name']}: E must split over the {world} ranks and T over --batch {args.batch}")
    if args.out is None and not args.quick:
        args.out = "bench/results/gather"
    return args


def main(argv: list[str] | None = None) -> int:
    from cluster_bench import bench_main

    return bench_main(argv, parse_args, worker, drive, report)


if __name__ == "__main__":
    sys.exit(main())
