"""What the backend did to each compiled graph, for ``explain`` and the dump directory."""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from moe_compile.ep import runtime
from moe_compile.lowering import sample_exchange


@dataclass(frozen=True)
class RegionReport:
    """One MoE layer found and rewritten into ``hiermoe::experts``."""

    name: str
    pattern: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int
    activation: str
    gated: bool
    bias: bool
    router: str
    plan: str  # the chosen candidate and, under expert parallelism, its strategy and settings
    predicted_s: dict[str, float]  # planner's predicted seconds per candidate strategy
    layout: str
    drops: bool
    num_tokens: int
    dtype: str
    verification: str  # "verified", "not verified (verify=False)" or "model already calls the op"
    forward_err: float
    backward_err: float
    graph: int
    ep_layer: int | None = None  # runtime.EPLayer id when the layer runs expert-parallel
    expert_params: tuple[tuple[str, ...], ...] = ()  # module paths of each expert tensor family
    parallel: dict[str, Any] | None = None  # filled by explain after running: see ParallelReport keys
    executable: list[str] = field(default_factory=list)  # the candidates the planner could choose
    pipeline: str = ""  # the chunked pipeline's prediction for the chosen candidate (cost.pipeline)
    plan_notes: list[str] = field(default_factory=list)  # the planner's notes (e.g. the expert loads' imbalance)


def parallel_summary(layer_id: int) -> dict[str, Any]:
    """What an expert-parallel layer did in its last step on this rank: the d it used, the
    predicted seconds of every d (HD-d, or H-d without dedup; empty when d is fixed) and from
    which statistics ("gathered": every rank's routing together, exact; "max-reduced": each
    rank's own, an upper estimate, on meshes too large to gather) and, once measured, those
    times corrected by the measured offsets (``tuned_s``, options['tune_dimension']), the payload
    bytes it sent per level, the experts this rank holds, the placement (mesh position of every
    expert), the expert swaps made so far (``moe_compile.swap.swapper.SwapRecord`` fields) and the
    swapper's decisions by outcome (a swap, or why none: ``moe_compile.swap.policy.OUTCOMES``),
    and the bytes its last forward kept for backward (the staged ops' dispatched rows)."""
    lay = runtime.layer(layer_id)
    return {"dimension": lay.last_dimension, "fixed": lay.dimension is not None, "dedup": lay.dedup,
            "predicted_s": {f"d{d}": t for d, t in enumerate(lay.last_times_s, start=1)},
            # the model's times corrected by what was measured (moe_compile.ep.tuning); only once measured
            "tuned_s": ({f"d{d}": t for d, t in enumerate(lay.last_tuned_s, start=1)}
                        if lay.tuner.offsets_s else {}),
            "statistics": None if lay.dimension is not None else
            "gathered" if lay.last_stats is not None else "max-reduced",
            "bytes_per_level": lay.last_step_bytes(), "local_experts": list(lay.local_experts),
            "bytes_per_phase": {p: lay.last_step_bytes(phase=p) for p in ("dispatch", "combine")},
            "mesh": dict(zip(lay.comm.level_names, lay.comm.sizes, strict=True)), "rank_position": lay.comm.position,
            "placement": lay.placement(), "swaps": [asdict(r) for r in lay.swaps],
            "swap_decisions": dict(lay.swap_decisions), "swappable": lay.swap_blocker is None,
            "saved_bytes": lay.saved_bytes,
            # a layer that gathers its experts (lowering.ep_gather): its domain, what its last step's
            # gather received and sent per level, and how long its forward waited for the gather
            "gather": None if lay.domain is None else {
                "domain_level": lay.domain, "domain_size": len(lay.domain_positions()),
                "gathered_bytes": lay.gathered_bytes, "bytes_per_level": lay.last_step_bytes(gather=True),
                "exposed_s": lay.gather_exposed_s, "regathered": lay.regathered, "compress_ratio": lay.compress_ratio},
            # a layer whose routing places the samples after it (passes.sample_placement): the last
            # step's decision, NetMoE's predicted bytes of one all-to-all per level before and after,
            # and the samples' own bytes counted per level
            "samples": _placement_summary(lay)}


def _placement_summary(lay: runtime.EPLayer) -> dict[str, Any] | None:
    rec = sample_exchange.record(lay.layer_id)
    if rec is None:
        return None
    last = rec.last
    return {"steps": rec.steps, "moves": rec.moves, "moved_samples": rec.moved_samples, "skipped": rec.skipped,
            "sample_bytes": rec.sample_bytes, "bytes_per_level": lay.last_step_bytes(samples=True),
            "solve_ms": 1e3 * max(rec.solve_s, default=0.0),
            "last": None if last is None else {
                "pays": last.pays, "moved": last.moved, "move_s": last.move_s, "exchanges": last.exchanges,
                "gain_s": last.gain_s, "decision_s": last.decision_s, "worth_deciding": last.worth_deciding,
                "time_before_s": last.time_before_s, "time_after_s": last.time_after_s,
                "inter_before": last.before.inter_max, "inter_after": last.after.inter_max,
                "intra_before": last.before.intra_max, "intra_after": last.after.intra_max}}


def _bytes(n: int) -> str:
    """Bytes in the nearest binary unit: 512 B, 12.3 KiB, 4.5 MiB."""
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


@dataclass(frozen=True)
class SkipReport:
    """A layer or graph left alone, and why."""

    name: str
    reason: str
    graph: int


@dataclass
class GraphReport:
    index: int
    before: str
    after: str
    regions: list[RegionReport] = field(default_factory=list)
    skipped: list[SkipReport] = field(default_factory=list)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    # where the plans' topology came from: "" (none), "given: <name>" or "probed: <what>"
    topology: str = ""
    # per graph the inner compiler got from AOTAutograd (forward, then backward) with
    # expert-parallel stages: (stages split into start/wait, nodes moved between them, its code);
    # filled when that graph compiles (the backward's at the first backward)
    scheduled: list[tuple[int, int, str]] = field(default_factory=list)
    # where each expert gather of those graphs starts (passes.overlap's prefetch), "<start> after <node>"
    gather_starts: list[str] = field(default_factory=list)
    # the sample placement pass (options['sample_placement']): each cut, or why the graph has none
    placement: list[str] = field(default_factory=list)


PROBED_ADVICE = ("the mesh's links were probed briefly (3 all-to-all sizes per level) at the first compile; for accurate "
                 "choices calibrate them (torchrun ... -m moe_compile.tools.calibrate --mesh ... --out "
                 "cluster.toml, or moe-calibrate) and pass options['topology']")


@dataclass
class Report:
    """Everything hiermoe found and did while compiling a model (one entry per Dynamo graph)."""

    graphs: list[GraphReport] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)

    @property
    def regions(self) -> list[RegionReport]:
        return [r for g in self.graphs for r in g.regions]

    @property
    def skipped(self) -> list[SkipReport]:
        out = [s for g in self.graphs for s in g.skipped]
        if not self.graphs:
            out.append(SkipReport("<model>", "nothing was compiled (the model ran no graph through hiermoe)", -1))
        return out

    @property
    def before(self) -> str:
        return "\n".join(f"# ---- graph {g.index} ----\n{g.before}" for g in self.graphs)

    @property
    def after(self) -> str:
        return "\n".join(f"# ---- graph {g.index} ----\n{g.after}" for g in self.graphs)

    def to_json(self) -> str:
        return json.dumps(
            {"regions": [asdict(r) for r in self.regions], "skipped": [asdict(s) for s in self.skipped],
             "graph_breaks": self.graph_breaks, "topology": sorted({g.topology for g in self.graphs} - {""}),
             "counters": {g.index: g.counters for g in self.graphs}},
            indent=2,
        )

    def __str__(self) -> str:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        buf = io.StringIO()
        console = Console(file=buf, width=160, force_terminal=False, color_system=None)
        regions = Table(title=f"hiermoe: {len(self.regions)} MoE layer(s) rewritten in {len(self.graphs)} graph(s)")
        for col in ("graph", "layer", "pattern", "E", "K", "hidden", "ffn", "activation", "router", "layout",
                    "plan", "verified rel. err fwd/bwd"):
            regions.add_column(col)
        for r in self.regions:
            act = f"{r.activation}{' gated' if r.gated else ''}{' +bias' if r.bias else ''}"
            err = f"{r.forward_err:.1e}/{r.backward_err:.1e}" if r.verification == "verified" else r.verification
            layout = r.layout + (" (drops kept)" if r.drops else "")
            cells = (str(r.graph), r.name, r.pattern, str(r.num_experts), str(r.top_k), str(r.hidden_size),
                     str(r.ffn_size), act, r.router, layout, r.plan, err)
            regions.add_row(*(escape(c) for c in cells))
        console.print(regions)
        planned = [r for r in self.regions if len(r.predicted_s) > 1]
        if planned:
            table = Table(title="planner: predicted time per layer forward (fastest candidates first; "
                                "* = executable here, the others predicted only)")
            table.add_column("layer")
            table.add_column("chosen")
            table.add_column("predicted (ms)", overflow="fold")
            table.add_column("pipeline (chunks)", overflow="fold")
            for r in planned:
                ranked = sorted(r.predicted_s.items(), key=lambda kv: kv[1])
                table.add_row(escape(r.name), escape(r.plan), escape(", ".join(
                    f"{k}{'*' if k in r.executable else ''} {v * 1e3:.3g}" for k, v in ranked)),
                    escape(r.pipeline or "-"))
            console.print(table)
            for r in planned:
                for note in r.plan_notes:
                    console.print(f"  {escape(r.name)}: {escape(note)}")
        parallel = [r for r in self.regions if r.parallel is not None]
        if parallel:
            table = Table(title="expert parallel: last step on this rank (payload bytes sent per level)")
            for col in ("layer", "d used", "predicted per d (ms)", "bytes per level", "kept for backward",
                        "local experts"):
                table.add_column(col, overflow="fold")
            for r in parallel:
                p = r.parallel
                assert p is not None
                used = (f"{p['dimension']}" + (" (fixed)" if p["fixed"] else f" (d*, {p['statistics']} statistics)")
                        + ("" if p["dedup"] else " no dedup"))
                g = p["gather"]
                if g is not None:
                    used = (f"experts gathered over {g['domain_size']} ranks (mesh levels {g['domain_level']}..), "
                            + (f"tokens over {g['domain_level']} level(s)" if g["domain_level"] else "no token moves"))
                pred = ", ".join(f"{k} {v * 1e3:.3g}" for k, v in p["predicted_s"].items()) or "-"
                if p["tuned_s"]:
                    pred += "; measured-corrected " + ", ".join(f"{k} {v * 1e3:.3g}" for k, v in p["tuned_s"].items())
                sent = ", ".join(f"{k} {v}" for k, v in p["bytes_per_level"].items())
                if g is not None:
                    sent += ("; expert weights " + ", ".join(f"{k} {v}" for k, v in g["bytes_per_level"].items())
                             + f" ({_bytes(g['gathered_bytes'])} gathered, "
                             + ("gathered again in backward" if g["regathered"] else "kept for backward")
                             + (f", SR-compressed 1/{g['compress_ratio']:g} (lossy)" if g["compress_ratio"] else "")
                             + f", forward waited {g['exposed_s'] * 1e3:.3g} ms)")
                local = p["local_experts"]
                contiguous = local == list(range(local[0], local[0] + len(local)))
                table.add_row(escape(r.name), used, pred, sent, _bytes(p["saved_bytes"]),
                              f"{local[0]}..{local[-1]} ({len(local)})" if contiguous else ", ".join(map(str, local)))
            console.print(table)
            decided = [r for r in parallel if r.parallel and r.parallel["swap_decisions"]]
            if decided:
                table = Table(title="expert swap decisions (moe_compile.expert_swapper): a swap, or why none")
                for col in ("layer", "decisions", "outcomes"):
                    table.add_column(col, overflow="fold")
                for r in decided:
                    p = r.parallel
                    assert p is not None
                    counts = sorted(p["swap_decisions"].items(), key=lambda kv: -kv[1])
                    table.add_row(escape(r.name), str(sum(p["swap_decisions"].values())),
                                  "; ".join(f"{n} x {escape(what)}" for what, n in counts))
                console.print(table)
            swapped = [r for r in parallel if r.parallel and r.parallel["swaps"]]
            if swapped:
                table = Table(title="expert swaps (HierD-ES): placement = mesh position of each expert")
                for col in ("layer", "swaps", "last swaps: experts (positions) predicted ms before -> after "
                            "[migration]", "placement"):
                    table.add_column(col, overflow="fold")
                for r in swapped:
                    p = r.parallel
                    assert p is not None
                    last = "; ".join(f"step {w['step']}: {w['experts'][0]}<->{w['experts'][1]} "
                                     f"({w['ranks'][0]}<->{w['ranks'][1]}) "
                                     f"{w['predicted_before_s'] * 1e3:.3g} -> {w['predicted_after_s'] * 1e3:.3g}"
                                     + (f" [{w['predicted_migration_s'] * 1e3:.3g}]"
                                        if not math.isnan(w["predicted_migration_s"]) else "")
                                     for w in p["swaps"][-3:])
                    table.add_row(escape(r.name), str(len(p["swaps"])), last, " ".join(map(str, p["placement"])))
                console.print(table)
        skipped = self.skipped
        if skipped:
            table = Table(title=f"left alone: {len(skipped)}")
            table.add_column("graph")
            table.add_column("layer / graph")
            table.add_column("reason", overflow="fold")
            for s in skipped:
                table.add_row(str(s.graph), escape(s.name), escape(s.reason))
            console.print(table)
        for g in self.graphs:
            if g.scheduled:
                console.print(f"graph {g.index}: collectives split into start/wait (passes.overlap): " + "; ".join(
                    f"{'forward' if i == 0 else 'backward' if i == 1 else f'graph {i}'} {n} stages, {m} nodes "
                    "run between a start and its wait" for i, (n, m, _) in enumerate(g.scheduled)))
            if g.gather_starts:
                console.print(f"graph {g.index}: expert gathers start " + "; ".join(map(escape, g.gather_starts)))
            for line in g.placement:
                console.print(f"graph {g.index}: sample placement: {escape(line)}")
        placing = [r for r in parallel if r.parallel and r.parallel.get("samples")]
        if placing:
            table = Table(title="sample placement (NetMoE): last step on this rank; one all-to-all's bytes predicted "
                                "for the slowest rank, before -> after")
            for col in ("layer", "steps moved", "last step", "predicted inter-node", "predicted intra-node",
                        "samples' bytes its exchanges sent per level (fw+bw)",
                        "decision: exchange (predicted) + solve (measured)"):
                table.add_column(col, overflow="fold")
            for r in placing:
                sp = r.parallel["samples"]  # type: ignore[index]
                last = sp["last"]
                if last is None:
                    table.add_row(escape(r.name), "0", "not run yet", "-", "-", "-", "-")
                    continue
                outcome = (f"moved {last['moved']} samples"
                           + ("" if last["worth_deciding"] else
                              f" (gaining {1e3 * last['gain_s']:.3g} ms, "
                              f"under the decision's {1e3 * last['decision_s']:.3g} ms: the next decisions back off)")
                           if last["pays"] and last["moved"] else
                           f"stayed (saving {1e3 * (last['time_before_s'] - last['time_after_s']):.3g} ms "
                           f"x{last['exchanges']:g} <= move {1e3 * last['move_s']:.3g} ms, its all-to-alls' "
                           "start-ups included)")
                table.add_row(escape(r.name), f"{sp['moves']} of {sp['steps']}"
                              + (f" ({sp['skipped']} skipped after declines)" if sp["skipped"] else ""), outcome,
                              f"{_bytes(int(last['inter_before']))} -> {_bytes(int(last['inter_after']))}",
                              f"{_bytes(int(last['intra_before']))} -> {_bytes(int(last['intra_after']))}",
                              ", ".join(f"{k} {v}" for k, v in sp["bytes_per_level"].items()),
                              f"{1e3 * last['decision_s']:.3g} + {sp['solve_ms']:.3g} ms")
            console.print(table)
        for topology in sorted({g.topology for g in self.graphs} - {""}):
            console.print(f"topology {escape(topology)}")
            if topology.startswith("probed"):
                console.print(f"  ({PROBED_ADVICE})")
        if self.graph_breaks:
            console.print(f"graph breaks ({len(self.graph_breaks)}):")
            for b in self.graph_breaks:
                console.print(f"  - {escape(b)}")
        return buf.getvalue()
