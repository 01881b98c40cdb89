"""The ``hiermoe`` torch.compile backend.

``torch.compile(model, backend="hiermoe", options={...})`` calls ``hiermoe_backend`` once per
Dynamo graph: the pass pipeline finds and rewrites the MoE layers, a ``GraphReport`` records
what happened (read by ``explain`` and written to the dump directory), and the inner compiler
(Inductor by default) compiles the rewritten graph.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence

import torch.fx as fx

from moe_compile.dump import dump_graph_report, dump_scheduled
from moe_compile.ep import runtime, shard
from moe_compile.options import Options, parse_options
from moe_compile.passes.canonicalize import Rewritten
from moe_compile.passes.inline_checkpoint import checkpoint_note
from moe_compile.passes.overlap import OverlapPass, Split
from moe_compile.passes.regions import ExpertLayout
from moe_compile.pipeline import PassContext, run_pipeline
from moe_compile.report import GraphReport, RegionReport, SkipReport

_graph_counter = itertools.count()
_collectors = threading.local()


def hiermoe_backend(gm: fx.GraphModule, example_inputs: Sequence[object], *,
                    options: dict[str, object] | None = None, mode: str | None = None) -> Callable[..., object]:
    opts = parse_options(options)
    index = next(_graph_counter)
    before = gm.code
    ctx = run_pipeline(PassContext(gm=gm, example_inputs=example_inputs, options=opts))
    report = _graph_report(ctx, index, before)
    for collector in getattr(_collectors, "stack", []):
        collector.append(report)
    if opts.dump_dir:
        dump_graph_report(opts.dump_dir, report, gm)
    _check_shards_read(ctx)
    inputs = list(example_inputs)
    for pos, t in ctx.input_swaps.items():
        inputs[pos] = t
    compiled = _inner_compile(gm, inputs, opts, mode, _overlap(opts, report) if ctx.ep_layers else None)
    return _with_expert_inputs(compiled, tuple(ctx.input_swaps), ctx.layer_inputs) if ctx.layer_inputs else compiled


def _check_shards_read(ctx: PassContext) -> None:
    """A graph that reads a ``shard_experts`` placeholder other than through the expert-parallel
    stages would compute with its zeros: a sharded layer left as written (verification failed,
    a pass disabled, a layer the finder did not see whole). Raise, naming why the layers were
    left alone, instead of running it."""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    read = [n.name for pos, (n, ex) in enumerate(zip(placeholders, ctx.example_inputs, strict=False))
            if n.users and pos not in ctx.input_swaps and shard.lookup(ex) is not None]
    if not read:
        return
    why = "; ".join(f"{s.name}: {s.reason}" for s in ctx.skipped) or "no MoE layer of this graph was rewritten"
    raise ValueError(f"this graph reads expert weights that moe_compile.shard_experts split over the ranks "
                     f"({', '.join(read)}) outside an expert-parallel layer, where they are placeholders of "
                     f"zeros: a sharded layer must be rewritten, and here it was left as written ({why})")


def _with_expert_inputs(fn: Callable[..., object], shard_positions: Sequence[int],
                        layer_inputs: Mapping[int, tuple[int, ...]]) -> Callable[..., object]:
    """Run an expert-parallel graph on the weights it is called with.

    Dynamo reuses a compiled graph for another model of the same class (weights are graph
    inputs, not guarded by identity), so at each call: the expert shard parameters of the
    placeholders actually passed are fed where Dynamo passes those full-shape placeholders
    (after its guards checked them), and a layer whose weights are not the ones it was compiled
    for runs on the runtime layer of those weights (placement, shards; made on first use).
    Dynamo calls compiled functions with positional arguments, so this does too."""
    def call(*args: object) -> object:
        given = list(args)
        for pos in shard_positions:
            sh = shard.lookup(args[pos])
            if sh is None or sh.local is None:
                raise ValueError("an expert-parallel graph compiled for sharded experts was called with weights that "
                                 "are not this rank's shards (moe_compile.shard_experts); shard every model compiled "
                                 "with the same options alike. A copy of a sharded model (copy.deepcopy) has "
                                 "placeholders no shard knows: copy the model before shard_experts and shard the copy")
            given[pos] = sh.local
        remap = {}
        for lid, positions in layer_inputs.items():
            lay = runtime.layer(lid)
            if positions and any(args[p] is not t for p, t in zip(positions, lay.tensors, strict=True)):
                remap[lid] = runtime.layer_for(lay, tuple(args[p] for p in positions)).layer_id
        if not remap:
            return fn(*given)
        with runtime.remapped(remap):
            return fn(*given)

    return call


def _graph_report(ctx: PassContext, index: int, before: str) -> GraphReport:
    regions = []
    for r in ctx.canonical.rewritten if ctx.canonical else []:
        reg, lay = r.region, r.layout
        checkpointing = (ctx.ep_layers.get(reg.name) is not None, ctx.stage_notes.get(reg.name, ""))
        regions.append(RegionReport(
            name=reg.name, pattern=reg.pattern, num_experts=reg.num_experts, top_k=reg.top_k,
            hidden_size=reg.hidden_size, ffn_size=lay.ffn_size, activation=lay.activation, gated=lay.gated,
            bias=lay.b_up is not None or lay.b_down is not None, router=reg.router,
            plan=ctx.plans[reg.name].describe() if reg.name in ctx.plans else "not planned",
            predicted_s=dict(ctx.plans[reg.name].plan.predicted) if reg.name in ctx.plans else {},
            executable=list(ctx.plans[reg.name].plan.implemented) if reg.name in ctx.plans else [],
            pipeline="; ".join(d for d in (ctx.plans[reg.name].describe_pipeline(),
                                           ctx.plans[reg.name].describe_measured()) if d)
            if reg.name in ctx.plans else "",
            plan_notes=list(ctx.plans[reg.name].plan.notes) if reg.name in ctx.plans else [],
            layout=lay.describe() + (", weights scale the input (a row per token and expert)" if r.weights.scales == "input" else "")
            + (checkpoint_note(reg.topk, *checkpointing) or checkpoint_note(r.op_node, *checkpointing)),
            drops=reg.drops,
            num_tokens=reg.num_tokens, dtype=reg.dtype, verification=_verification(r, ctx.options.mesh is not None),
            forward_err=r.verdict.forward_err if r.verdict else float("nan"),
            backward_err=r.verdict.backward_err if r.verdict else float("nan"), graph=index,
            ep_layer=ctx.ep_layers.get(reg.name), expert_params=_expert_params(lay)))
    skipped = [SkipReport(s.name, s.reason, index) for s in ctx.skipped]
    if ctx.found is not None and ctx.found.num_topk == 0:
        skipped.append(SkipReport(f"graph {index}", "no MoE layer found (no top-k router in this graph)", index))
    topology = "" if ctx.topology is None else (
        f"{'probed' if ctx.topology_probed else 'given'}: {ctx.topology.name or 'unnamed'}; " + ", ".join(
            f"{lv.name} x{lv.size} alpha {lv.alpha_s * 1e6:.3g} us, {lv.bandwidth_gbps:.3g} Gb/s"
            for lv in ctx.topology.levels))
    placement = []
    if ctx.placement is not None:
        res = ctx.placement
        placement = [res.reason] if res.reason is not None else [
            (f"after {c.after} ({c.layer}) the samples go home" if c.home else
             f"after {c.after} the samples may move, decided by {c.layer}'s routing")
            + f": {', '.join(c.moved) or 'nothing'} ({c.sample_bytes} B per sample, {res.samples} samples per rank"
            + ("; its output goes to the new ranks in its combine)" if c.fused and c.layer in res.fused else ")")
            for c in res.cuts]
    return GraphReport(index=index, before=before, after=ctx.gm.code, regions=regions, skipped=skipped,
                       counters=ctx.counters, topology=topology, placement=placement)


def _expert_params(lay: ExpertLayout) -> tuple[tuple[str, ...], ...]:
    roles = (lay.up, lay.gate, lay.down, lay.b_up, lay.b_gate, lay.b_down)
    return tuple(role.names for role in roles if role is not None)


def _verification(r: Rewritten, parallel: bool) -> str:
    if r.region.existing_op is not None:
        return "model already calls the op"
    if r.verdict is None:
        return "not verified (verify=False)"
    if r.vacuous:
        return "0 tokens here: verified by the ranks with tokens" if parallel else "0 tokens: nothing to compare"
    return "verified"


def _overlap(opts: Options, report: GraphReport) -> OverlapPass | None:
    """The pass that splits the graph's expert-parallel stages into start and wait (options
    ``overlap``), recording what it did in ``report`` (and the dump)."""
    if not opts.overlap:
        return None

    def done(split: Split, code: str) -> None:
        report.scheduled.append((split.stages, split.moved, code))
        report.gather_starts.extend(split.gather_starts)
        if opts.dump_dir:
            dump_scheduled(opts.dump_dir, report, code)

    return OverlapPass(done, None if opts.gather_prefetch == "auto" else opts.gather_prefetch)


def _inner_compile(gm: fx.GraphModule, example_inputs: list[object], opts: Options,
                   mode: str | None, overlap: OverlapPass | None) -> Callable[..., object]:
    """Compile the rewritten graph; ``overlap`` runs on the graphs AOTAutograd makes of it
    (Inductor's post-grad custom pass, or aot_eager's compilers); the eager compiler has none."""
    if opts.inner_compiler == "eager":
        return gm.forward
    if opts.inner_compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def nop(g: fx.GraphModule, ex: list[object]) -> Callable[..., object]:
            if overlap is not None:
                overlap(g.graph)
                g.recompile()
            return boxed_nop(g, ex)  # type: ignore[arg-type]

        return aot_eager(gm, example_inputs, fw_compiler=nop, bw_compiler=nop)  # type: ignore[arg-type]
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = dict(list_mode_options(mode)) if mode else {}
    if overlap is not None:  # after any pass the user set
        from torch._inductor.custom_graph_pass import get_custom_graph_passes

        theirs = get_custom_graph_passes(inductor_config.post_grad_custom_post_pass)
        patches["post_grad_custom_post_pass"] = [*theirs, overlap] if theirs else overlap
        patches["reorder_for_peak_memory"] = False
    return compile_fx(gm, example_inputs, config_patches=patches or None)  # type: ignore[arg-type,return-value]


class collect_reports:
    """Context manager gathering the GraphReports of every compile on this thread (for explain)."""

    def __init__(self) -> None:
        self.graphs: list[GraphReport] = []

    def __enter__(self) -> list[GraphReport]:
        if not hasattr(_collectors, "stack"):
            _collectors.stack = []
        _collectors.stack.append(self.graphs)
        return self.graphs

    def __exit__(self, *exc: object) -> None:
        # by identity: an inner collector's list can equal an outer one's (both empty, or the
        # same reports), and list.remove compares by value
        stack = _collectors.stack
        del stack[next(i for i, g in enumerate(stack) if g is self.graphs)]


__all__ = ["collect_reports", "hiermoe_backend"]
