"""Tables, the results file and the plot of bench_e2e.py (imported as a sibling module), and the
count of how often HierMoE's d* is the measured-fastest d, over this run and the all-to-all
benchmark's results (bench/results/hier_a2a.json, hier_a2a_cluster.json)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"
A2A_SOURCES = (("hier_a2a.json", "bench_hier_a2a, 8 local ranks (loopback)"),
               ("hier_a2a_cluster.json", "bench_hier_a2a on the emulated cluster"))
NEAR = 0.05  # a d whose median is within 5 % of the fastest's is as fast as this machine can tell
console = Console(width=None if Console().is_terminal else 220)


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def _by_name(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["variant"]: r for r in config["results"]}


def shown_name(config: dict[str, Any], variant: str) -> str:
    """The variant's name, flat A2A's marked as the stand-in for a transformers variant that did not run."""
    failed = [n for n in config["failed"] if n.startswith("HF")]
    return f"{variant} (stand-in for {' and '.join(failed)}, which did not run)" if variant == "flat A2A" and failed \
        else variant


def dstar_choice(config: dict[str, Any]) -> tuple[int | None, str]:
    """(the d d* used most, "d (n/N layer-steps)") over its timed steps and layers."""
    counts = Counter(d for step in config["dstar_d_per_step"] for d in step)
    if not counts:
        return None, "-"
    total = sum(counts.values())
    text = ", ".join(f"d={d} ({n}/{total})" for d, n in sorted(counts.items()))
    return counts.most_common(1)[0][0], text


def fastest_fixed_d(config: dict[str, Any]) -> int | None:
    fixed = [r for r in config["results"] if r["kind"] == "hiermoe" and r["options"].get("dimension")
             and r["options"].get("dedup", True)]
    return int(min(fixed, key=lambda r: r["median_s"])["options"]["dimension"]) if fixed else None


def predicted_ms(config: dict[str, Any]) -> str:
    """The cost model's t_d (ms) per d, median over d*'s layer-steps."""
    steps = [t for step in config["dstar_predicted_s_per_step"] for t in step if t]
    if not steps:
        return "-"
    return ", ".join(f"t{d + 1} {statistics.median(s[d] for s in steps) * 1e3:.2f}" for d in range(len(steps[0])))


def variant_rows(config: dict[str, Any], levels: list[str]) -> list[list[str]]:
    by = _by_name(config)
    flat, eager = by.get("flat A2A"), by.get("eager DDP")
    _, dstar_text = dstar_choice(config)
    rows = []
    for r in config["results"]:
        t = r["times_s"]
        name = r["variant"]
        d = (dstar_text if name == "hiermoe d*" else str(r["options"].get("dimension", "-")))
        plans = r.get("plans") or []
        if any(p.startswith(("gather", "replicated")) for p in plans):  # what the layers ran: no d
            d = ", ".join(f"{p} x{plans.count(p)}" for p in sorted(set(plans)))
        per_level = r["payload_bytes_per_level"] or {}
        rows.append([shown_name(config, name), _ms(r["median_s"]), f"{_ms(min(t))} / {_ms(max(t))}",
                     f"{flat['median_s'] / r['median_s']:.2f}x" if flat else "-",
                     f"{eager['median_s'] / r['median_s']:.2f}x" if eager else "-", d,
                     *(_mib(per_level.get(n)) if r["payload_bytes_per_level"] else "-" for n in levels),
                     _mib(r["meta_bytes"]), _mib(r["grad_allreduce_bytes"]), _mib(r.get("kept_bytes")),
                     _mib(r.get("held_bytes")), _mib(r.get("step_peak_bytes")),
                     f"{r['first_loss_max_rel_err']:.1e}",
                     f"{r['warmup_first_step_s']:.1f}"])
    return rows


def e2e_dstar_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for c in payload["configs"]:
        used, text = dstar_choice(c)
        fastest = fastest_fixed_d(c)
        by = _by_name(c)
        slow = None
        if used is not None and fastest is not None and f"hiermoe HD{used}" in by:
            slow = by[f"hiermoe HD{used}"]["median_s"] / by[f"hiermoe HD{fastest}"]["median_s"]
        out.append({"config": f"{c['model']} K={c['top_k']}", "used": used, "used_text": text, "fastest": fastest,
                    "match": used == fastest, "chosen_over_fastest": slow, "predicted": predicted_ms(c),
                    "dstar_vs_fastest": (by["hiermoe d*"]["median_s"] / by[f"hiermoe HD{fastest}"]["median_s"]
                                         if fastest is not None and "hiermoe d*" in by else None)})
    return out


def a2a_dstar_counts(path: Path, label: str) -> list[dict[str, Any]]:
    """Per run in a bench_hier_a2a JSON: configurations, how many had HD-d* use the measured-fastest
    dedup d, and the worst median(HD-d_used) / median(HD-d_fastest) among the others."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    runs = data["runs"].items() if "runs" in data else [("", data)]
    out = []
    for run_name, run in runs:
        matches, near, worst, n = 0, 0, 1.0, 0
        for c in run["configs"]:
            by_d = {r["d"]: r["median_s"] for r in c["strategies"] if r["dedup"] and r["strategy"] != "HD-d*"}
            used = next(r["d"] for r in c["strategies"] if r["strategy"] == "HD-d*")
            fastest = min(by_d, key=by_d.__getitem__)
            n += 1
            matches += used == fastest
            near += by_d[used] / by_d[fastest] <= 1 + NEAR
            worst = max(worst, by_d[used] / by_d[fastest])
        out.append({"source": f"{path.name}" + (f" [{run_name}]" if run_name else ""), "label": label,
                    "dstar_topology": run.get("dstar_topology"), "configs": n, "matches": matches, "near": near,
                    "worst_chosen_over_fastest": worst})
    return out


def dstar_summary(payload: dict[str, Any], results_dir: Path) -> list[dict[str, Any]]:
    e2e = e2e_dstar_rows(payload)
    rows = [{"source": "e2e (this run)", "label": "training step, hiermoe d* vs fixed HD-d", "dstar_topology":
             "calibrated" if not payload.get("topology_file") else payload["topology_file"], "configs": len(e2e),
             "matches": sum(r["match"] for r in e2e),
             "near": sum((r["chosen_over_fastest"] or 1.0) <= 1 + NEAR for r in e2e),
             "worst_chosen_over_fastest": max([r["chosen_over_fastest"] or 1.0 for r in e2e], default=1.0)}]
    for name, label in A2A_SOURCES:
        rows += a2a_dstar_counts(results_dir / name, label)
    return rows


# ---- output -------------------------------------------------------------------------------------


def hf_status(payload: dict[str, Any]) -> list[str]:
    lines = []
    for c in payload["configs"]:
        if c["model"] != "hf_mixtral":
            continue
        by = _by_name(c)
        for name in ("HF EP", "HF EP+DDP"):
            if name not in by and name not in c["failed"]:
                continue  # not asked for (--variants)
            if name in by:
                lines.append(f"- {c['model']} K={c['top_k']}, {name}: ran (first-step loss max rel err "
                             f"{by[name]['first_loss_max_rel_err']:.1e} against eager DDP).")
            else:
                lines.append(f"- {c['model']} K={c['top_k']}, {name}: did NOT run: {c['failed'].get(name, '?')}. "
                             "flat A2A (same copies per (token, expert)) stands in for it in the comparison.")
    return lines


def print_tables(payload: dict[str, Any]) -> None:
    levels = list(payload["mesh"])
    headers = ["variant", "median ms", "min / max ms", "vs flat", "vs eager", "d", *(f"{n} MiB" for n in levels),
               "meta MiB", "grad AR MiB", "kept MiB", "loss err", "1st step s"]
    for c in payload["configs"]:
        table = Table(title=f"e2e {c['model']} K={c['top_k']}")
        for h in headers:
            table.add_column(h, justify="left" if h in ("variant", "d") else "right", overflow="fold")
        for row in variant_rows(c, levels):
            table.add_row(*row)
        console.print(table)
        for name, err in c["failed"].items():
            console.print(f"{name} did not run: {err}", highlight=False, markup=False)


def write_report(payload: dict[str, Any], out: Path | None) -> None:
    print_tables(payload)
    summary = dstar_summary(payload, RESULTS)
    for s in summary:
        console.print(f"d* = measured-fastest d: {s['matches']} of {s['configs']}, within 5 %: {s['near']} "
                      f"({s['source']})", highlight=False)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(payload, summary) + "\n")
    console.print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    plot(payload, out.with_suffix(".png"))


def markdown(payload: dict[str, Any], summary: list[dict[str, Any]]) -> str:
    m, shape = payload["machine"], payload["shape"]
    levels = list(payload["mesh"])
    emu = m.get("emulated_cluster")
    topo = payload["topology"]
    topo_text = ", ".join(f"{lv['name']}: alpha {lv['alpha_s'] * 1e6:.0f} us, "
                          f"{8 / lv['beta_s_per_byte'] / 1e9:.3g} Gbit/s per rank"
                          for lv in topo["levels"])
    topo_src = (f"the file `{payload['topology_file']}`" if payload.get("topology_file") else
                "fitted at the start of the run on the cluster's links (timed all-to-alls in each level's "
                "subgroups, 16 KiB to 4 MiB, bench_hier_a2a's calibrate_local; fit r2 "
                + ", ".join(f"{f['level']} {f['r2']:.3f}" for f in payload["calibration"]) + ")"
                + (f", written to `{payload['topology_saved']}`" if payload.get("topology_saved") else ""))
    headers = ["variant", "median ms", "min / max ms", "speedup vs flat A2A", "speedup vs eager DDP", "d",
               *(f"{n} MiB/step" for n in levels), "meta MiB", "grad all-reduce MiB/rank",
               "kept for backward MiB/rank", "held MiB/rank", "step peak MiB/rank", "1st-step loss rel err",
               "1st step s"]
    lines = [
        "# End-to-end training step on the emulated cluster", "",
        f"Command: `{payload['command']}`" + (f" (as root, from the repository root; cluster "
                                             f"`{payload['cluster_file']}`)" if payload.get("cluster_file") else ""),
        "",
        f"Machine: {m['cpu']}; {m['cpu_count']} CPUs ({m['affinity']} usable); {payload['world']} gloo ranks, "
        f"{m['torch_threads_per_rank']} torch thread each, all on these CPUs; 1-min load average "
        f"{m['loadavg_1m_at_start']:.2f} at start; torch {m['torch']}, transformers {m['transformers']}, Python "
        f"{m['python']}; {m['date']}; wall time of the run {payload['wall_s'] / 60:.1f} min.", "",
        "Cluster: " + (f"moe-cluster, mesh {emu['mesh']}: one network namespace per node, its veth link shaped "
                       f"with tc to {emu['link_tc_rate']} per direction (shared by the node's ranks), the ranks "
                       "of a node on the namespace's loopback (unshaped)." if emu else
                       "none (plain torchrun: every link is loopback)."), "",
        f"Topology for hiermoe (d* and the planner): {topo_text}; {topo_src}.", "",
        f"Models: fp32, {shape['layers']} decoder layers each with an MoE layer, H={shape['hidden']}, "
        f"F={shape['ffn']}, E={shape['experts']}, vocab {shape['vocab']}, {shape['batch']} x {shape['seq']} = "
        f"{payload['tokens_per_rank']} tokens per rank (each rank its own batches). tiny_lm: "
        "moe_compile.samples.tiny_lm with grouped_gemm layers; hf_mixtral: transformers MixtralForCausalLM "
        "from a random config, experts `grouped_mm`.", "",
        "Step: zero_grad, forward + loss, backward, gradient averaging, AdamW. hiermoe variants: "
        f"torch.compile(backend=\"hiermoe\", options={{mesh, topology, inner_compiler: "
        f"{payload['inner_compiler']!r}, ...}})" + (", experts sharded with moe_compile.shard_experts"
                                                   if payload["shard"] else ", every expert kept on every rank")
        + ". Gradient averaging (all but HF EP): one all-reduce of the flattened gradients of the parameters "
        "every rank holds, divided by the world size; expert shards a rank holds alone are only divided "
        "(\"grad all-reduce MiB/rank\" is that buffer). HF EP: transformers' DistributedConfig(fsdp_size=G, "
        "ep_size=G, ep_implementation=\"all_to_all\") through `maybe_distribute_model` (AllToAllEP + FSDP2, "
        "which reduces its own gradients); HF EP+DDP: transformers' `apply_expert_parallelism` with the "
        "model's ep plan (AllToAllEP), dense gradients averaged as above. eager DDP: all experts on every "
        "rank.", "",
        f"Time: {payload['warmup']} untimed steps per variant (the first compiles), one untimed step for the "
        f"bytes, then {payload['reps']} repetitions each timing one step of every variant in an order rotated "
        "per repetition, each after a barrier; a step's time is its slowest rank's. Speedups are "
        "median(reference) / median(variant), above 1 = faster. Bytes: moe_compile.counters() of one step, "
        "payload per mesh level (tokens: dispatch + combine; expert weights: gathers and their reduce-scatters; forward + backward), summed over ranks; metadata "
        "apart; transformers' all-to-alls are not counted (\"-\"). Memory, in the same untimed step, the "
        "highest rank's: \"held\" the parameters (sharded experts at their shard) and AdamW state a rank "
        "holds between steps, \"step peak\" how far its resident memory rose above where the step started "
        "(gradients, activations, buffers, gathered experts, every thread's; cluster_bench.step_peak_bytes). \"1st-step loss rel err\": every variant's "
        "first step ran on the same batch as eager DDP's, max over ranks of |loss - loss_eager| / loss_eager "
        f"(the run stops above {payload['loss_rtol']:g}). \"1st step s\": that step, compilation included.", "",
        "## Hugging Face transformers' expert parallelism", "",
        *(hf_status(payload) or ["- no transformers model in this run."]), "",
    ]
    for c in payload["configs"]:
        lines += [f"## {c['model']}, K={c['top_k']}", "",
                  f"1-min load average when its repetitions ended: {c['loadavg_1m_at_end']:.1f} (the 4 ranks "
                  "count about 4).", "",
                  "| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|",
                  *("| " + " | ".join(row) + " |" for row in variant_rows(c, levels)), ""]
        waits = [(r["variant"], r["gather_wait_s"]) for r in c["results"]
                 if r.get("gather_wait_s") and any(r["gather_wait_s"])]
        if waits:
            lines += ["Expert gathers: the time each step's forward waited for them (the gather not hidden by "
                      "the prefetch; slowest rank, median over the repetitions): "
                      + ", ".join(f"{v} {statistics.median(w) * 1e3:.3g} ms" for v, w in waits) + ".", ""]
            lines += gather_wait_lines(c)
    e2e = e2e_dstar_rows(payload)
    lines += ["## d*: the planner's choice against the measured-fastest d", "",
              "This run: `hiermoe d*` chooses d per layer and step (HierMoE Eq. 6 / Alg. 1 on statistics all "
              "ranks agree on); the measured-fastest d is the fixed `hiermoe HDd` with the lowest median.", "",
              "| config | d* used | predicted t_d ms (median) | fastest d (measured) | match | median HD(d* used) / "
              "HD(fastest) | median d* / HD(fastest) |", "|---|---|---|---|---|---|---|",
              *(f"| {r['config']} | {r['used_text']} | {r['predicted']} | {r['fastest']} | "
                f"{'yes' if r['match'] else 'no'} | "
                + (f"{r['chosen_over_fastest']:.2f}" if r["chosen_over_fastest"] is not None else "-") + " | "
                + (f"{r['dstar_vs_fastest']:.2f}" if r["dstar_vs_fastest"] is not None else "-") + " |"
                for r in e2e), "",
              "Over this run and the all-to-all benchmark's results (there dispatch + combine only, HD-d* "
              "against the fixed dedup HD-d with the lowest median). \"within 5 %\": configurations where the d "
              "d* used had a median at most 5 % above the fastest d's (on this shared 2-core machine, closer "
              "medians do not tell the two apart); \"worst\": the largest median(HD-d used) / "
              "median(HD-d fastest), 1.00 when every choice was the fastest.", "",
              "| source | what | d* topology | configurations | d* = fastest | within 5 % | worst |",
              "|---|---|---|---|---|---|---|",
              *(f"| {s['source']} | {s['label']} | {s['dstar_topology']} | {s['configs']} | {s['matches']} | "
                f"{s['near']} | {s['worst_chosen_over_fastest']:.2f} |" for s in summary),
              "", f"In all: d* was the measured-fastest d in {sum(s['matches'] for s in summary)} of "
              f"{sum(s['configs'] for s in summary)} configurations, within 5 % of it in "
              f"{sum(s['near'] for s in summary)}."]
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> bool:
    """Median step time per variant with min-max whiskers, one panel per configuration; False (with
    a note) without matplotlib (pip install -e '.[bench]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("note: matplotlib is not installed; no plot written (pip install -e '.[bench]')")
        return False
    configs = payload["configs"]
    fig, axes = plt.subplots(1, len(configs), figsize=(max(4.2 * len(configs), 7.0), 4.4), squeeze=False)
    colors = {"hiermoe": "tab:blue", "hf_ep": "tab:orange", "hf_ep_ddp": "tab:orange", "eager": "tab:gray"}
    for ax, c in zip(axes[0], configs):
        res = c["results"]
        med = [r["median_s"] * 1e3 for r in res]
        lo = [m - min(r["times_s"]) * 1e3 for m, r in zip(med, res)]
        hi = [max(r["times_s"]) * 1e3 - m for m, r in zip(med, res)]
        col = [("tab:red" if r["variant"] == "flat A2A" else colors[r["kind"]]) for r in res]
        ax.bar(range(len(res)), med, yerr=[lo, hi], color=col, capsize=3)
        ax.set_xticks(range(len(res)), [shown_name(c, r["variant"]).replace("hiermoe ", "").replace(", which did not run",
                                                                                            "")
                                        for r in res], rotation=40,
                      ha="right", fontsize=8)
        ax.set_title(f"{c['model']}, K={c['top_k']}", fontsize=10)
        ax.set_ylabel("training step, ms (median, min-max)")
    emu = payload["machine"].get("emulated_cluster")
    link = f", node link {emu['link_tc_rate']}" if emu else ""
    fig.suptitle(f"end-to-end training step, {payload['world']} ranks, mesh "
                 + " x ".join(f"{n}={s}" for n, s in payload["mesh"].items()) + link
                 + f"\n{payload['tokens_per_rank']} tokens/rank, H={payload['shape']['hidden']}, "
                 f"E={payload['shape']['experts']}, fp32 (red: flat A2A, orange: transformers EP)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"wrote {path}")
    return True


def gather_wait_lines(config: dict[str, Any]) -> list[str]:
    """Per variant with expert gathers: each MoE layer's median wait (graph order), and, where the
    run has the same variant with ``no prefetch``, the share of the wait the prefetch hid:
    1 - wait with / wait without, of the medians over the repetitions of the slowest rank's step
    sum (the line above), and of the sum over layers of each layer's slowest rank (an upper bound
    of the wait: ranks wait at different layers), the latter also after the first layer (which
    has only the embedding and its attention to hide behind: its gather starts with the step)."""
    by_name = {r["variant"]: r for r in config["results"] if r.get("gather_wait_layer_s")}

    def share(with_s: float, without_s: float) -> str:
        return f"{1 - with_s / without_s:.0%}" if without_s > 0 else "-"

    def layer_sums(rows: list[list[float]]) -> float:  # rows: [layer][rep]
        return statistics.median(map(sum, zip(*rows))) if rows else 0.0

    out = []
    for name, r in by_name.items():
        rows = r["gather_wait_layer_s"]
        per_layer = [statistics.median(w) for w in rows]
        if not any(per_layer):
            continue
        text = f"- {name}: per layer " + ", ".join(f"{w * 1e3:.3g}" for w in per_layer) + " ms"
        base = by_name.get(f"{name} no prefetch")
        if base is not None:
            base_rows = base["gather_wait_layer_s"]
            text += (f"; the prefetch hid {share(statistics.median(r['gather_wait_s']), statistics.median(base['gather_wait_s']))}"
                     f" of the wait without it ({share(layer_sums(rows), layer_sums(base_rows))} summing each "
                     f"layer's slowest rank; {share(layer_sums(rows[1:]), layer_sums(base_rows[1:]))} after the "
                     "first layer)")
        out.append(text)
    return ["Per layer (median over the repetitions, slowest rank):", "", *out, ""] if out else []
