"""Tables and plots of bench/bench_swap.py (imported as a sibling module): the markdown report
with its ratios against no swap and the swap overhead, the rounded JSON, and the per-step plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

ZIPF_EXPONENT = 1.2
VARIANTS = (("HD-d* no swap", None), ("HierD-ES", "hierd"), ("Smart", "smart"))
BASE = VARIANTS[0][0]
DISTRIBUTIONS = ("uniform", "zipf")
PART_NAMES = ("exchange_s", "q_s", "predicted_s", "decide_layer_s", "migrate_s", "commit_s")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(steps: list[dict[str, Any]], window: int, node: str) -> dict[str, Any]:
    rows = steps[-window:]
    s: dict[str, Any] = {
        "steps": len(rows), "pred_s": med([r["pred_s"] for r in rows]),
        "exact_pred_s": med([r["exact_pred_s"] for r in rows]),
        "rank_load": med([r["rank_load_max_over_mean"] for r in rows]),
        "node_bytes_max": med([r["bytes_max"][node] for r in rows]),
        "node_bytes_sum": med([r["bytes_sum"][node] for r in rows]),
        "total_bytes_sum": med([sum(r["bytes_sum"].values()) for r in rows]),
        "comm_s": med([r["comm_s"] for r in rows]), "step_s": med([r["step_s"] for r in rows]),
        "d": sorted({d for r in rows for d in r["d"]}),
    }
    if "overhead" in rows[0]:
        s.update(swaps=sum(len(r["swaps"]) for r in rows),
                 overhead_median=med([r["overhead"] for r in rows]), overhead_max=max(r["overhead"] for r in rows),
                 # amortized: all the swapper's seconds over all the steps' (a rare migration counts in full)
                 overhead_total=sum(r["swap_s"] for r in rows) / sum(r["step_s"] for r in rows),
                 decision_s=med([r["decision_s"] for r in rows]), migration_s=med([r["migration_s"] for r in rows]),
                 settle_s=med([r.get("settle_s", 0.0) for r in rows]), swap_s=med([r["swap_s"] for r in rows]),
                 parts={k: med([r["parts_max"].get(k, float("nan")) for r in rows]) for k in PART_NAMES},
                 rest_s=med([r.get("rest_max", float("nan")) for r in rows]),
                 cpu_overhead_median=med([r.get("cpu_overhead", float("nan")) for r in rows]),
                 cpu_s=med([r.get("cpu_s", float("nan")) for r in rows]),
                 cpu_share_median=med([r.get("cpu_share", float("nan")) for r in rows]))
    return s


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def write_report(payload: dict[str, Any], out: Path | None) -> None:
    names = tuple(payload["mesh"])
    node = names[0]
    window = payload["window"]
    lines_tab: list[str] = []
    headers = ["distribution", "steps", "variant", "pred a2a ms", "vs no swap", "pred exact ms", "vs no swap",
               f"{node} MiB max rank", "vs no swap",
               f"{node} MiB all ranks", "vs no swap", "rank load max/mean", "d+c ms measured", "vs no swap",
               "step ms", "vs no swap",
               "swaps", "d used"]
    lines_tab += ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    over_headers = ["distribution", "steps", "variant", "overhead median %", "overhead total %", "overhead max %",
                    "CPU %", "CPU ms",
                    "CPU % of step CPU", "decision ms",
                    "migration ms", "settle ms", "exchanges ms", "Q ms", "predicted ms", "p2p ms", "commit ms",
                    "rest ms", "swaps"]
    over = ["| " + " | ".join(over_headers) + " |", "|" + "|".join("---" for _ in over_headers) + "|"]
    console_lines = []
    for dres in payload["distributions"]:
        kind = dres["distribution"]
        for label, w in ((f"last {window}", window), (f"all {payload['steps']}", payload["steps"])):
            summ = {name: summarize(dres["steps"][name], w, node) for name, _ in VARIANTS}
            dres.setdefault("summary", {})[label] = summ
            b = summ[BASE]
            for name, _ in VARIANTS:
                s = summ[name]
                lines_tab.append("| " + " | ".join([
                    kind, label, name, f"{s['pred_s'] * 1e3:.2f}", _ratio(s["pred_s"], b["pred_s"]),
                    f"{s['exact_pred_s'] * 1e3:.2f}", _ratio(s["exact_pred_s"], b["exact_pred_s"]),
                    f"{s['node_bytes_max'] / 2**20:.3f}", _ratio(s["node_bytes_max"], b["node_bytes_max"]),
                    f"{s['node_bytes_sum'] / 2**20:.3f}", _ratio(s["node_bytes_sum"], b["node_bytes_sum"]),
                    f"{s['rank_load']:.2f}",
                    f"{s['comm_s'] * 1e3:.1f}", _ratio(s["comm_s"], b["comm_s"]),
                    f"{s['step_s'] * 1e3:.0f}", _ratio(s["step_s"], b["step_s"]),
                    str(s.get("swaps", "-")), ",".join(map(str, s["d"]))]) + " |")
                if "overhead_median" in s:
                    p = s["parts"]
                    over.append("| " + " | ".join([
                        kind, label, name, f"{s['overhead_median'] * 100:.2f}", f"{s['overhead_total'] * 100:.2f}",
                        f"{s['overhead_max'] * 100:.2f}",
                        f"{s['cpu_overhead_median'] * 100:.2f}", f"{s['cpu_s'] * 1e3:.2f}",
                        f"{s['cpu_share_median'] * 100:.2f}",
                        f"{s['decision_s'] * 1e3:.2f}", f"{s['migration_s'] * 1e3:.2f}", f"{s['settle_s'] * 1e3:.2f}",
                        f"{p['exchange_s'] * 1e3:.2f}", f"{p['q_s'] * 1e3:.2f}", f"{p['predicted_s'] * 1e3:.2f}",
                        f"{p['migrate_s'] * 1e3:.2f}", f"{p['commit_s'] * 1e3:.3f}", f"{s['rest_s'] * 1e3:.2f}",
                        str(s["swaps"])]) + " |")
                console_lines.append(
                    f"{kind:8s} {label:8s} {name:14s} pred {s['pred_s'] * 1e3:7.2f} ms "
                    f"({_ratio(s['pred_s'], b['pred_s'])}) exact {s['exact_pred_s'] * 1e3:7.2f} ms "
                    f"({_ratio(s['exact_pred_s'], b['exact_pred_s'])})  {node} max {s['node_bytes_max'] / 2**20:6.3f} MiB "
                    f"({_ratio(s['node_bytes_max'], b['node_bytes_max'])})  all {s['node_bytes_sum'] / 2**20:6.3f} "
                    f"MiB ({_ratio(s['node_bytes_sum'], b['node_bytes_sum'])})  d+c {s['comm_s'] * 1e3:6.1f} ms "
                    f"({_ratio(s['comm_s'], b['comm_s'])})  step {s['step_s'] * 1e3:5.0f} ms"
                    + (f"  swap overhead median {s['overhead_median'] * 100:.2f} % total {s['overhead_total'] * 100:.2f} % "
                       f"max {s['overhead_max'] * 100:.2f} %"
                       f" ({s['swaps']} swaps)" if "overhead_median" in s else ""))
    print("\n".join(console_lines), flush=True)
    if out is None:
        return
    info = payload["machine"]
    topo = payload["topology"]
    emu = info["emulated_cluster"]
    cfg = payload["model"]
    checks = "; ".join(f"{d['distribution']}: max relative loss difference {d['max_loss_rel_diff']:.1e}, "
                       f"(step, layer) routings that differ from no-swap's on the worst rank "
                       f"{d['routing_diffs_max_rank']} of {payload['steps'] * cfg['layers'] * 2}; "
                       "swaps' predicted_before_s against \"pred exact\" of the same step and layer: largest "
                       "relative difference " + ", ".join(
                           f"{n} {d['exact'][n]['swap_predicted_before_rel_diff']:.1e}" for n, p in VARIANTS if p)
                       for d in payload["distributions"])
    skews = "; ".join(
        f"{d['distribution']}: {med([x['all'] for row in d['exact']['routing_skew'] for x in row]):.2f} over all "
        f"tokens, {med([v for row in d['exact']['routing_skew'] for x in row for v in x['per_node']]):.2f} within a "
        "node's tokens" for d in payload["distributions"])
    where = (f"an emulated cluster (moe-cluster, mesh {emu['mesh']}, leaf link tc rate {emu['link_tc_rate']})"
             if emu else "one machine (every link is loopback)")
    lines = [
        "# Expert swap during training: HierD-ES vs Smart vs no swap", "",
        f"Command: `{payload['command']}`" + (" (on every rank, under `moe-cluster run`)" if emu else ""), "",
        f"Machine: {info['cpu']}; {info['cpu_count']} CPUs ({info['affinity']} usable); {payload['world']} gloo ranks "
        f"on {where}, one process and {info['torch_threads_per_rank']} torch thread each; 1-min load average "
        f"{info['loadavg_1m_at_start']:.2f} at start (before the ranks), {info['loadavg_1m_at_end']:.2f} at the end ("
        + ", ".join(f"{d['distribution']} {d['loadavg_1m'][0]:.1f} -> {d['loadavg_1m'][1]:.1f}"
                    for d in payload["distributions"]) + " with the ranks running); "
        f"torch {info['torch']}; Python {info['python']}; wall {payload['wall_s']:.0f} s.", "",
        f"Mesh: {' x '.join(f'{n}={s}' for n, s in payload['mesh'].items())}. Topology ({topo['source']}): "
        + ", ".join(f"{lv['name']} alpha {lv['alpha_s'] * 1e6:.0f} us, {8 / lv['beta_s_per_byte'] / 1e9:.3g} Gbit/s"
                    for lv in topo["levels"]) + ".", "",
        f"Model: tiny LM (moe_compile.samples.tiny_lm), {cfg['layers']} layers, `grouped_gemm` MoE, hidden "
        f"{cfg['hidden']}, ffn {cfg['ffn']}, {cfg['heads']} heads, E={cfg['experts']}, top-{cfg['top_k']}, vocabulary "
        f"{cfg['vocab']}, fp32; experts sharded (`moe_compile.shard_experts`, {cfg['experts'] // payload['world']} "
        f"per rank), compiled by hiermoe with aot_eager, d* per layer and step; Adam lr {payload['lr']}, DDP-style "
        f"gradient averaging. {cfg['batch']} x {cfg['seq']} = {cfg['batch'] * cfg['seq']} tokens per rank per step "
        f"(each rank its own batches, the same for every variant), {payload['steps']} steps after one warm-up step "
        "(compiles; gradients dropped).", "",
        "Data: `uniform`: token ids uniform over the vocabulary. `zipf`: token ids Zipf-distributed (exponent "
        f"{ZIPF_EXPONENT}) over a permutation of the vocabulary that differs per node (the same on the ranks of one "
        "node), so each node's frequent tokens, and with them its hot experts, differ. Routing skew, the busiest "
        f"expert's (token, expert) count over the mean per step and layer (median): {skews}.", "",
        "Variants, trained side by side from the same weights on the same batches, alternating every step (order "
        "rotated by one per step): `HD-d* no swap` (contiguous placement), `HierD-ES` (`swapper.step()` after every "
        "optimizer step, policy `hierd`: HierMoE Section IV, Q* with the smooth max, gamma 10"
        + (f", threshold {payload['threshold']}" if payload.get("threshold") else "")
        + (f"; both swapping variants with payback {payload['payback']:g} steps: a swap only where the predicted all-to-all time it saves over "
           f"{payload['payback']:g} training steps exceeds the predicted time to move its two experts"
           if payload.get("payback") else "; both swapping variants with payback 0: a swap on any predicted gain"
           if "payback" in payload else "") + ") and `Smart` (policy "
        "`smart`: minimize the busiest rank's raw (token, expert) count, the paper's HD2-MoE-Smart baseline). A swap "
        f"never changes what the model computes; checked: {checks}.", "",
        "Columns (medians over the steps named): \"pred a2a ms\": the cost model's HD-d time of one dispatch "
        "all-to-all, summed over the layers (`EPLayer.last_times_s[d-1]`, from the forward's statistics under that "
        "step's placement, gathered from every rank). \"pred exact ms\": the same t_d (same d, same placement) "
        "recomputed after the run from every rank's routing together (`hd_statistics` with each token's source "
        "rank): the statistic HierD-ES's Q and `SwapRecord.predicted_*_s` use, and a check of the first (they "
        "must be equal). "
        f"\"{node} MiB\": payload bytes the layers sent across the {node} level in the step (`EPLayer.last_step_bytes()`: dispatch and combine, forward and backward; metadata "
        "apart), of the busiest rank and over all ranks. \"rank load max/mean\": (token, expert) pairs the busiest "
        "rank's experts compute over the mean (the worse layer), what Smart balances. \"d+c ms measured\": wall seconds in dispatch + combine, "
        "both directions, all layers (`EPLayer.step_comm_s`), the slowest rank's. \"step ms\": the training step "
        "(forward, backward, gradient all-reduce, Adam, zero_grad), after a barrier, the slowest rank's; the swap is "
        "not in it. \"vs no swap\": median / median of `HD-d* no swap`.", "",
        "## Traffic and time", "", *lines_tab, "",
        "## Overhead of swapping every step", "",
        "overhead = (decision_s + migration_s + settle_s) / step time, per step (`ExpertSwapper.history`; slowest "
        "rank's swap over the slowest rank's step; `swapper.step()` starts after a barrier, so it does not include "
        "waiting for ranks still in their training step); overhead total = the sum of those swap seconds over the "
        "sum of the step times, so a rare migration counts in full. settle = overlap mode's wait for the outcome of the swaps "
        "a call started, at the variant's next forward (inside that step's time as well). CPU % = `StepTiming.cpu_s` "
        "(the CPU time of the thread calling `step()`, inside it: the swapper's own work, without waiting for other "
        "ranks or for a core) over the step time, slowest rank's; with 8 ranks on 2 cores the wall time of any "
        "step() part includes the time other ranks' processes hold the cores. CPU % of step CPU = each rank's "
        "`cpu_s` over the CPU time of its own training step (the same thread), the largest over ranks: what the "
        "overhead would be with a core per rank and a CPU-bound step (an upper estimate: such a step also waits "
        "for messages). Parts, slowest rank's, "
        "timed by wrapping moe_compile.swap's functions at run time: exchanges = the swapper's exchanges of all "
        "ranks inside `step()` (`swap_transfer.Message`: one `all_to_all_single` each, a small header to every rank "
        "and a layer's routing ids to the rank deciding it alone, posting and waiting: routing, decisions, "
        "outcome), including the wait for ranks still computing Q or moving rows; Q = the swap matrix "
        "(`HDCostModel.swap_matrices` for HierD-ES: Q* with the smooth max and with the plain max, whose entries "
        "are the predicted times, from one pass over the tokens; `smart_matrix` for Smart) on the ranks that decide "
        "a layer (layer i on rank i mod world); with payback, a layer's Q is not computed where no swap could "
        "repay its migration (`HDCostModel.swap_floor_s`: t_d with every phase at its third busiest destination; "
        "that check is in rest), and every rank makes that check first on the statistics the forward gathered "
        "from all ranks' routing (`EPLayer.last_stats`), per rank pair against the migration between them, then "
        "where a pair passes per expert pair (`HDCostModel.swap_floor_experts`: the swapped experts' tokens move "
        "with them): where it fails the layer's routing is not sent, and a "
        "call with no routing, decision or outcome to send exchanges nothing (but every 16th call, which "
        "announces the payload sizes again); predicted = Smart's predicted time after a chosen swap "
        "(`swap_policy.predicted`; its time before comes from the payback check where there is one, else a second call); p2p = "
        "`swap_transfer.migrate` (one message each way between the two ranks of a swap: a description of what "
        "each side sends and its rows); commit = "
        "writing the received rows; rest = decision + migration - exchanges - the per-layer decisions (Q, "
        "predicted) - p2p - commit, per rank. Each part is its own max over ranks, so they do not add up.", "",
        *([] if not payload.get("overlap") else [
            "Overlap mode (`expert_swap: {'overlap': True}`): `swapper.step()` posts one message (this step's "
            "routing, the decisions computed on the previous one, the outcome of the swaps it started) on the "
            "swapper's own gloo group and does not wait for it; the next call reads it, so a swap starts two calls "
            "after the step whose routing decided it, and the ranks outside its pair put it in force at their next "
            "forward (settle). Here exchanges = posting this call's message and reading the previous one (normally "
            "already arrived). The exchanges run in the background during the following training steps of all "
            "three variants (they alternate), on the same cores: whatever they cost beyond that lands in every "
            "variant's step time, not in the overhead column.", ""]),
        *over,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(_rounded(payload), separators=(",", ":")) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", flush=True)
    plot(payload, out.with_suffix(".png"))


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits (microseconds of a second are noise here): a smaller JSON."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_rounded(v) for v in x]
    return x


def plot(payload: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written (pip install matplotlib)")
        return False
    node = next(iter(payload["mesh"]))
    dists = payload["distributions"]
    fig, axes = plt.subplots(2, len(dists), figsize=(6 * len(dists), 7), squeeze=False, sharex=True)
    for j, dres in enumerate(dists):
        for k, (name, _) in enumerate(VARIANTS):
            steps = dres["steps"][name]
            x = [r["step"] for r in steps]
            color = f"C{k}"
            axes[0][j].plot(x, [r["pred_s"] * 1e3 for r in steps], color=color, label=f"{name} (runtime)")
            axes[0][j].plot(x, [r["exact_pred_s"] * 1e3 for r in steps], color=color, linestyle=":",
                            label=f"{name} (exact)")
            axes[1][j].plot(x, [r["bytes_sum"][node] / 2**20 for r in steps], color=color, label=name)
        axes[0][j].set_title(f"{dres['distribution']}")
        axes[0][j].set_ylabel("predicted HD-d a2a ms (sum of layers)")
        axes[1][j].set_ylabel(f"inter-{node} MiB per step (all ranks)")
        axes[1][j].set_xlabel("training step")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(f"expert swap: {payload['world']} ranks, tiny LM E={payload['model']['experts']} "
                 f"top-{payload['model']['top_k']}, {payload['model']['batch'] * payload['model']['seq']} tokens/rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True
