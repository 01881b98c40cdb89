"""Sample placement (NetMoE, passes/sample_placement.py) at run time on the emulated 2-node cluster:
a training step (forward + backward) of a transformers Mixtral with and without
options["sample_placement"], the inter-node bytes each sends, and their step times.

    python bench/bench_placement_cluster.py          # as root: the command behind
                                                     # bench/results/placement_cluster.{md,json}
    python bench/bench_placement_cluster.py --quick  # affine and uniform routing at K=2, 3 reps: prints only
    python bench/bench_placement_cluster.py --report bench/results/placement_cluster.json

Per node link rate (a fresh emulated cluster each: bench/clusters/two_node.toml with its rate
overridden; mesh node=2,gpu=2), routing and K: the model of moe_compile.samples.sample_affine
(Mixtral, fp32, token embeddings along one of G directions, one per block of E / G experts (default
G = min(ranks, E / K): one per rank while a rank's block holds K experts, else fewer, larger blocks
(K=8 of E=16: one per node), so that a sample's K experts can share a block; --groups fixes G); routers scoring each expert by its block's direction) and each rank's batch drawn with that routing
(every rank's batch from one generator, this rank's taken: samples.sample_affine.rank_token_ids):
"affine" (each sample's tokens from one group), "balanced" (the same, a rank's samples taking the
groups in turn: every rank holds samples of every group), "zipf" (each sample draws its tokens' groups with
Zipf(1.2) weights over its own ranking of the groups), "uniform" (every token's group at random: no
sample prefers anything); and "trained": moe_compile.samples' tiny LM (grouped GEMM experts, the same
sizes) trained eagerly for --train-steps AdamW steps on its counting task, each sample counting with
its own stride, on counting batches (its routing, whatever it learned). Two variants, each a copy of the same model compiled by hiermoe (the links
fitted at start as bench_e2e does, compute measured; inner compiler aot_eager; expert_gather,
model_centric and replicated_experts False: the token all-to-all, HD-d with d* per step):

  HD d*             the planner's all-to-all
  placement + HD d* the same with options["sample_placement"] = True: after each MoE layer but the
                    last the samples may move to the ranks whose node holds their experts, decided
                    per step (NetMoE's two-stage assignment, where the model says it pays)

The first step is the check (both variants' loss equal, rel 1e-5); one more untimed step counts the
bytes (moe_compile's counters, summed over the ranks: token payload of dispatch + combine across the
node link, forward + backward, and the samples' own bytes across it), then repetitions that time one
step of each variant (alternating order, barrier first, the slowest rank's time).
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
DEFAULT_CLUSTER = HERE / "clusters" / "two_node.toml"
VARIANTS = {"HD d*": False, "placement + HD d*": True}


def worker(args: argparse.Namespace) -> None:
    from cluster_bench import cluster_rank

    from moe_compile.backend import collect_reports, hiermoe_backend
    from moe_compile.ep import runtime
    from moe_compile.lowering import sample_exchange
    from moe_compile.samples.sample_affine import affine_mixtral, rank_token_ids
    from moe_compile.samples.train_tiny_lm import counting_batch

    rank, world, mesh, names, topology, say = cluster_rank(args.quick, args.rate)
    results = []
    for routing in args.routings:
        for k in args.ks:
            torch._dynamo.reset()
            groups = args.groups or min(world, args.experts // k)
            if routing == "trained":
                base = trained_tiny_lm(args, k)  # the same on every rank: one seed, one data stream
                gen = torch.Generator().manual_seed(1000)  # every rank's batch from one stream, this rank's taken
                ids, labels = [counting_batch(args.batch, args.seq, args.vocab, gen) for _ in range(world)][rank]
            else:
                base = affine_mixtral(layers=args.layers, experts=args.experts, top_k=k, groups=groups,
                                      hidden=args.hidden, ffn=args.ffn, vocab=args.vocab)
                ids = rank_token_ids(routing, rank, world, args.batch, args.seq, groups, args.vocab)
                labels = ids
            models = {}
            for name, place in VARIANTS.items():
                # token all-to-alls in both variants (no gathers, no model-centric, no replicated
                # layers: those the placement compares with are HD d*'s)
                options = {"mesh": mesh, "topology": topology, "inner_compiler": "aot_eager", "expert_gather": False,
                           "sample_placement": place, "replicated_experts": False, "model_centric": False}
                models[name] = torch.compile(copy.deepcopy(base), backend=functools.partial(hiermoe_backend,
                                                                                              options=options))

            def step(model: Any, ids: torch.Tensor = ids, labels: torch.Tensor = labels,
                     tiny: bool = routing == "trained") -> float:
                loss = model(ids, labels) if tiny else model(input_ids=ids, labels=labels).loss
                loss.backward()
                return float(loss.detach())

            losses, layout = {}, {}
            for name, m in models.items():  # compiles; the check
                with collect_reports() as reports:
                    losses[name] = step(m)
                # each layer's chunks (the plan's "n chunks"), and the combines fused with the placement
                layout[name] = {"chunks": [int(p.split(" chunks")[0].rsplit(" ", 1)[-1]) if " chunks" in p else 1
                                           for g in reports for p in (r.plan for r in g.regions)],
                                "fused": sum(g.counters.get("expert_parallel", {}).get("fused_combines", 0)
                                             for g in reports)}
            ref = losses["HD d*"]
            if abs(losses["placement + HD d*"] - ref) > 1e-5 * abs(ref):
                raise RuntimeError(f"{routing} K={k}: the losses differ: {losses}")
            sent: dict[str, dict[str, int]] = {}
            for name, m in models.items():
                runtime.reset_counters()
                sample_exchange.reset_counts()
                step(m)
                c = runtime.counters()[names[0]]
                row = torch.tensor([sum(c[ph][dr]["payload_bytes"] for ph in ("dispatch", "combine")
                                        for dr in ("forward", "backward")),
                                    sum(c["samples"][dr]["payload_bytes"] for dr in ("forward", "backward"))],
                                   dtype=torch.float64)
                dist.all_reduce(row)
                records = [r for lay in runtime.layers()
                           if (r := sample_exchange.record(lay.layer_id)) is not None and r.steps]  # this model's
                sent[name] = {"tokens": int(row[0]), "samples": int(row[1]),
                              "moves": sum(r.moves for r in records) if VARIANTS[name] else 0,
                              "cuts": len(records) if VARIANTS[name] else 0,
                              "moved_samples": sum(r.moved_samples for r in records) if VARIANTS[name] else 0,
                              "solve_ms": max((1e3 * max(r.solve_s) for r in records if r.solve_s), default=0.0)
                              if VARIANTS[name] else 0.0}
            times: dict[str, list[float]] = {n: [] for n in models}
            order = list(models)
            for rep in range(args.reps):
                for name in (order if rep % 2 == 0 else order[::-1]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    step(models[name])
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    times[name].append(float(dt))
            med = {n: statistics.median(v) for n, v in times.items()}
            say(f"  {routing} K={k}: " + "  ".join(
                f"{n} {med[n] * 1e3:.0f} ms, {sent[n]['tokens'] / 1024:.0f} KiB tokens + "
                f"{sent[n]['samples'] / 1024:.0f} KiB samples across nodes" for n in models), flush=True)
            results.append({"routing": routing, "top_k": k, "groups": groups, "loss": losses, "sent": sent, "times_s": times,
                            "median_s": med, "layout": layout})
            del models
    if rank == 0:
        Path(os.environ["PLACEMENT_OUT"]).write_text(json.dumps({"rate": args.rate, "topology": topology.to_dict(),
                                                                 "configs": results}))
    dist.destroy_process_group()


def trained_tiny_lm(args: argparse.Namespace, top_k: int) -> torch.nn.Module:
    """moe_compile.samples' tiny LM (grouped GEMM experts, the benchmark's sizes) trained eagerly for
    ``--train-steps`` AdamW steps on its counting task (each sample counts with its own stride: a
    per-sample pattern the router may learn to follow)."""
    from moe_compile.samples.tiny_lm import TinyLMConfig, TinyMoELM
    from moe_compile.samples.train_tiny_lm import train

    torch.manual_seed(0)
    model = TinyMoELM(TinyLMConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                                   num_heads=4, num_experts=args.experts, top_k=top_k, ffn_size=args.ffn,
                                   moe_kind="grouped_gemm", max_seq_len=args.seq))
    train(model, args.train_steps, batch=args.batch * 2, seq=args.seq, seed=0)
    return model


def drive(args: argparse.Namespace, argv: list[str]) -> int:
    from cluster_bench import drive_rates

    return drive_rates(Path(__file__).resolve(), args, argv, "PLACEMENT_OUT", report, machine=_machine())


def _machine() -> str:
    from machine import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cores"


def report(payload: dict[str, Any]) -> str:
    from cluster_bench import rate_header

    a = payload["args"]
    lines = ["# Sample placement (NetMoE) at run time: a Mixtral training step on the emulated cluster", "",
             f"Command: `{payload['command']}` (as root, from the repository root; cluster `{a['cluster']}` with its "
             "node rate set per run)", "",
             f"Machine: {payload['machine']}; {2 * a['ranks_per_node']} gloo ranks (mesh node=2,gpu="
             f"{a['ranks_per_node']}), 1 torch thread each; {payload['date']}; wall time {payload['wall_s'] / 60:.1f} "
             f"min; 1-min load average at the end {payload['load_avg_end']:.1f}.", "",
             f"Model: moe_compile.samples.sample_affine Mixtral, fp32, {a['layers']} layers, H={a['hidden']}, "
             "G routing groups (each a block of E / G experts; G per row), "
             f"F={a['ffn']}, E={a['experts']}, vocab {a['vocab']}; each rank {a['batch']} samples of {a['seq']} "
             "tokens drawn with the routing named (module docstring); one step = forward + loss + backward. "
             f"{a['reps']} repetitions per variant, medians in ms (slowest rank). Bytes: one step, summed over the "
             "ranks, across the node link: the token payload of every layer's dispatch + combine (forward + "
             "backward) and the samples' own moves (placement's exchanges, forward + backward). "
             "Cuts moved: the exchanges (one per MoE layer but the last) that moved samples in that step.", ""]
    for run in payload["runs"]:
        lines += rate_header(run)
        lines.append("| routing | K | G | HD d* ms | placement ms | speedup | inter-node tokens KiB: HD d* -> placement "
                     "(ratio) | + samples KiB | all inter-node bytes ratio | cuts moved | samples moved | solve ms | "
                     "layers' chunks (fused combines) |")
        lines.append("|" + "---|" * 13)
        for c in run["configs"]:
            med, sent = c["median_s"], c["sent"]
            base, place = sent["HD d*"], sent["placement + HD d*"]
            tok_ratio = place["tokens"] / max(base["tokens"], 1)
            all_ratio = (place["tokens"] + place["samples"]) / max(base["tokens"], 1)
            lines.append(
                f"| {c['routing']} | {c['top_k']} | {c.get('groups', a.get('groups') or 2 * a['ranks_per_node'])} | "
                f"{med['HD d*'] * 1e3:.0f} | {med['placement + HD d*'] * 1e3:.0f} | "
                f"{med['HD d*'] / med['placement + HD d*']:.2f}x | {base['tokens'] / 1024:.0f} -> "
                f"{place['tokens'] / 1024:.0f} ({tok_ratio:.2f}x) | {place['samples'] / 1024:.0f} | {all_ratio:.2f}x | "
                f"{place['moves']} of {place['cuts']} | {place['moved_samples']} | {place['solve_ms']:.2f} | "
                f"{_layout(c.get('layout', {}).get('placement + HD d*'))} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _layout(lay: dict[str, Any] | None) -> str:
    """'1,2,2,2 (2)': the placement variant's chunks per layer and how many combines were fused
    with the sample moves ('-' in results from before it was recorded)."""
    return "-" if lay is None else f"{','.join(map(str, lay['chunks']))} ({lay['fused']})"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="affine and uniform at K=2, 3 reps, prints only")
    p.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER)
    p.add_argument("--rates", default=None, help="node link rates, tc syntax, comma-separated (default 100mbit,400mbit; quick 400mbit)")
    p.add_argument("--rate", default=None, help=argparse.SUPPRESS)  # the rank's run
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2: mesh node=2,gpu=2)")
    p.add_argument("--routings", default="affine,balanced,zipf,uniform,trained",
                   help="of affine, balanced, zipf, uniform, trained (default all)")
    p.add_argument("--ks", default="2,4,8", help="top-K values (default 2,4,8)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--groups", type=int, default=None,
                   help="routing groups: directions the experts are scored by, each a block of E / groups experts "
                        "(default: min(ranks, E / K), so that a block holds a token's K experts; 2: one per node)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=150, help="the trained tiny LM's steps (routing 'trained')")
    p.add_argument("--batch", type=int, default=4, help="samples per rank (default 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 7; 3 quick)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=None, help="results path without suffix (default "
                                               "bench/results/placement_cluster; --quick: none)")
    p.add_argument("--report", default=None, metavar="JSON", help="only rewrite the .md from a results JSON")
    args = p.parse_args(argv)
    args.rates = (args.rates or ("400mbit" if args.quick else "100mbit,400mbit")).split(",")
    args.routings = ["affine", "uniform"] if args.quick else args.routings.split(",")
    args.ks = [2] if args.quick else [int(k) for k in args.ks.split(",")]
    args.reps = args.reps or (3 if args.quick else 7)
    if args.out is None and not args.quick:
        args.out = "bench/results/placement_cluster"
    return args


def main(argv: list[str] | None = None) -> int:
    from cluster_bench import bench_main

    return bench_main(argv, parse_args, worker, drive, report)


if __name__ == "__main__":
    sys.exit(main())
