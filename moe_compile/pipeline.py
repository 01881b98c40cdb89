"""The hiermoe pass pipeline: one ordered list, each pass switchable off by name.

Ordering constraints:
  inline_checkpoint first: opens activation checkpointing's subgraphs (their ops tagged for
                    recompute, as AOTAutograd would tag them) so that the MoE layers inside are
                    in the graph the other passes read.
  find_moe_regions  after inline_checkpoint: every later pass consumes its MoERegion records, and
                    it must see the graph as Dynamo produced it, its checkpointed calls opened
                    (verification re-runs that graph), and its indexed-assignment accumulators
                    as chains of values (passes/functional_setitem.py, run by the same step).
  canonicalize      after find_moe_regions, before plan: plans are made for rewritten layers only.
                    With a mesh and neither a topology nor a dimension it first probes the mesh's
                    links (tools/calibrate.probe, once per mesh; every rank reaches the agreement
                    together), and the ranks' agreement settles each layer's planned strategy.
  plan              after canonicalize: passes/plan.py decides each rewritten layer's strategy with
                    cost/planner.py over what lowering/strategies can run
                    (the argmin over what the lowering implements: "local" on one process, the
                    all-to-all dimensions with a mesh), recording every candidate's predicted time
                    when a topology is given.
  sample_placement  after plan, before expert_parallel, only with options['sample_placement']: its
                    verification runs the graph on one process (the hiermoe::experts nodes still
                    local); expert_parallel binds its exchanges to the runtime layers.
  expert_parallel   after plan, only with options['mesh']: turns each hiermoe::experts node into
                    the stages its planned strategy emits (hiermoe::ep_dispatch / ep_local_experts
                    / ep_combine) over the mesh; before lower_kernels, which only sees the
                    single-process op.
  lower_kernels     last: retargets the hiermoe::experts nodes left by all earlier passes (options['kernels']).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.fx as fx

from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import SLOT_BYTES
from moe_compile.ep import agreement, shard
from moe_compile.lowering import sample_exchange
from moe_compile.options import PASS_NAMES, Options
from moe_compile.passes.canonicalize import Agree, CanonicalizeResult, Decision, canonicalize_moe_regions_pass
from moe_compile.passes.expert_parallel import expert_parallel_pass
from moe_compile.passes.find_moe_regions import FindResult, find_moe_regions
from moe_compile.passes.functional_setitem import functionalize_setitems
from moe_compile.passes.inline_checkpoint import (
    Selective,
    checkpoint_local_stages,
    inline_checkpoints,
    outline_selective,
    straddles,
    tag_expert_ops,
    tag_rewrites,
)
from moe_compile.passes.lower_kernels import lower_kernels_pass
from moe_compile.passes.plan import LayerPlan, plan_layer, plan_pass
from moe_compile.passes.regions import Skip
from moe_compile.passes.sample_binding import bind, fuse_combines, register_records
from moe_compile.passes.sample_placement import Layer as PlacementLayer
from moe_compile.passes.sample_placement import PlacementResult, sample_placement_pass
from moe_compile.passes.verify import ambient_autocast
from moe_compile.tools import calibrate


@dataclass
class PassContext:
    gm: fx.GraphModule
    example_inputs: Sequence[object]
    options: Options
    found: FindResult | None = None
    canonical: CanonicalizeResult | None = None
    plans: dict[str, LayerPlan] = field(default_factory=dict)
    agreed_plans: dict[str, str | None] = field(default_factory=dict)  # layer name -> candidate the ranks agreed on
    # layer name -> the plan this rank made for the agreement (reused by the plan pass where agreed)
    own_plans: dict[str, LayerPlan] = field(default_factory=dict)
    skipped: list[Skip] = field(default_factory=list)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    ep_layers: dict[str, int] = field(default_factory=dict)  # layer name -> runtime.EPLayer id
    input_swaps: dict[int, torch.Tensor] = field(default_factory=dict)  # input position -> shard parameter
    layer_inputs: dict[int, tuple[int, ...]] = field(default_factory=dict)  # EP layer id -> its weights' inputs
    # the topology plans are made on: options['topology'], or with a mesh and neither a topology nor
    # a dimension, the one moe_compile.tools.calibrate.probe measured (topology_probed)
    topology: Topology | None = None
    topology_probed: bool = False
    placement: PlacementResult | None = None  # what the sample_placement pass did (options['sample_placement'])
    # the graph's nodes once inline_checkpoint opened its checkpointed calls (None: it opened none);
    # what the later passes emit among them gets their recompute tags (inline_checkpoint.tag_rewrites)
    checkpointed: set[fx.Node] | None = None
    # the selective checkpoints inline_checkpoint opened, which inline_checkpoint.outline_selective
    # closes again around the rewritten layers (the exchanges between ranks left outside)
    selective: dict[int, Selective] = field(default_factory=dict)
    # per expert-parallel layer under a selective checkpoint: what its local expert stage keeps
    # (inline_checkpoint.checkpoint_local_stages, shown by explain)
    stage_notes: dict[str, str] = field(default_factory=dict)


def _inline_checkpoint(ctx: PassContext) -> dict[str, int]:
    res = inline_checkpoints(ctx.gm, selective=True)
    ctx.skipped.extend(Skip(name, why) for name, why in res.kept)
    ctx.selective = res.selective
    if res.inlined:
        ctx.checkpointed = set(ctx.gm.graph.nodes)
    return res.counters()


def _ddp_split() -> str | None:
    """Why this graph may be a piece of a bigger one: Dynamo's DDP optimizer cutting the graph of
    a model DistributedDataParallel wraps at its gradient buckets (importing moe_compile turns it
    off; None when it is off or no DDP forward is running)."""
    from torch.nn.parallel import DistributedDataParallel

    mode = torch._dynamo.config.optimize_ddp
    if mode not in (True, "ddp_optimizer") or DistributedDataParallel._get_active_ddp_module() is None:
        return None
    return (f"Dynamo's DDP optimizer (torch._dynamo.config.optimize_ddp = {mode!r}) cut this model's graph at "
            "DistributedDataParallel's gradient buckets, and a layer cut in two is not found whole: set "
            "torch._dynamo.config.optimize_ddp = False (importing moe_compile does; something set it back)")


def _find(ctx: PassContext) -> dict[str, int]:
    # buffers summed into by indexed assignment (mistral-inference's ``results[idx] += ...``) as
    # chains of values first, so the routed sum is a value the finder can read
    setitems = functionalize_setitems(ctx.gm)
    ctx.found = find_moe_regions(ctx.gm, list(ctx.example_inputs))
    if ctx.selective:  # a layer cut by a selective checkpoint's boundary is left as written
        for region in list(ctx.found.regions):
            why = straddles(region.topk, set().union(*(c.nodes for c in region.outputs)))
            if why is not None:
                ctx.found.regions.remove(region)
                ctx.found.skipped.append(Skip(region.name, why, router_weight=region.router_weight))
    ctx.skipped.extend(ctx.found.skipped)
    split = _ddp_split()
    if split is not None and (ctx.found.skipped or not ctx.found.num_topk):
        ctx.skipped.append(Skip("graph cut for DDP", split))
    return {"topk": ctx.found.num_topk, "regions": len(ctx.found.regions), "skipped": len(ctx.found.skipped),
            "functional_setitems": setitems}


def _canonicalize(ctx: PassContext) -> dict[str, int]:
    if ctx.found is None:
        return {}
    # under expert parallelism a graph whose routers were found but none of their layers still
    # takes part in the agreement: other ranks may have found the layers in their graphs
    routers_left = any(s.router_weight is not None for s in ctx.found.skipped)
    if not ctx.found.regions and not (ctx.options.mesh is not None and routers_left):
        return {"rewritten": 0}
    before = len(ctx.gm.graph.nodes)
    sharded = [ex for ex in ctx.example_inputs if shard.lookup(ex) is not None]
    if sharded and ctx.options.mesh is None:
        raise ValueError("this model's experts are sharded (moe_compile.shard_experts); compile it with "
                         "options['mesh'] set to the mesh it was sharded over")
    # sharded expert weights are zero placeholders: verify on random weights of their shape instead
    inputs = [shard.verification_value(ex, seed=i) for i, ex in enumerate(ctx.example_inputs)]
    opts = ctx.options
    if opts.mesh is not None and ctx.topology is None and opts.dimension is None:
        # every rank reaches this point together (the agreement below is collective too); the probe
        # runs once per mesh in the process, before the first agreement, which plans on it
        ctx.topology, ctx.topology_probed = calibrate.probe(opts.mesh), True
    agree = _agreement(ctx) if opts.mesh is not None else None
    ctx.canonical = canonicalize_moe_regions_pass(ctx.gm, inputs, ctx.found, verify=ctx.options.verify, agree=agree)
    ctx.skipped.extend(ctx.canonical.skipped)
    if ctx.checkpointed is not None:  # a checkpoint around the experts alone
        tag_expert_ops((r.op_node, r.region.topk, r.output.nodes) for r in ctx.canonical.rewritten)
    return {"rewritten": len(ctx.canonical.rewritten), "left_alone": len(ctx.canonical.skipped),
            "verifications": ctx.canonical.num_verifications, "nodes_before": before,
            "nodes_after": len(ctx.gm.graph.nodes)}


def _autocast_condition(graph: fx.Graph) -> str:
    """The torch.autocast states a graph is compiled under, as text ("" for none): around the
    compiled call, and each one the graph enters itself."""
    states = [f"around {d} {dtype}" for d, dtype in ambient_autocast()]
    states += [f"inside {n.args[0]} {n.args[1]} {n.args[2]}" for n in graph.nodes
               if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast]
    return f" (autocast: {'; '.join(states)})" if states else ""


def _agreement(ctx: PassContext) -> Agree:
    """canonicalize's ``agree`` under expert parallelism: every rank's decisions made the same by
    ``moe_compile.ep.agreement`` (the first compile of a layer exchanges them; later ones reuse it)."""
    assert ctx.found is not None
    opts, params, index = ctx.options, ctx.found.params, ctx.found.index
    mesh = opts.mesh
    settings = (f"mesh {tuple(mesh.mesh.shape)} {tuple(mesh.mesh_dim_names or ())} ranks {mesh.mesh.flatten().tolist()}; "
                f"dimension {opts.dimension}; dedup {opts.dedup}; topology {opts.topology!r}; "
                f"expert_swap {opts.expert_swap!r}; verify {opts.verify}; expert_gather {opts.expert_gather!r}; "
                f"gather_compress {opts.gather_compress!r}; model_centric {opts.model_centric!r}; "
                f"replicated_experts {opts.replicated_experts!r}; sharded {_not_whole(ctx) is not None}")

    def key(d: Decision, i: int) -> tuple[str, str]:
        """(what the experts compute, where the output and the routing weights are read)."""
        interp = d.passing[i] if i >= 0 else d.chosen
        assert interp is not None
        reg = d.region
        return (f"E={reg.num_experts} K={reg.top_k} H={reg.hidden_size} {reg.dtype}: {interp.layout.signature()}",
                f"output {index.anchor(interp.output.node)}, weights {index.anchor(interp.weights.node)} "
                f"scaling the {interp.weights.scales}")

    def planned(d: Decision, agreed: agreement.Agreed) -> str:
        """The candidate every rank runs the layer with: each plans it alike, from the token count
        and the summed expert loads the ranks agreed on (its plan is kept for the plan pass)."""
        assert d.chosen is not None
        region = replace(d.region, num_tokens=agreed.tokens)
        lp = plan_layer(region, d.chosen.layout, None, ctx.topology, mesh_levels=_mesh_levels(opts),
                        dimension=opts.dimension, dedup=opts.dedup, chunks=_chunks(opts), gather=_gather(opts),
                        gather_compress=opts.gather_compress, model_centric=_model_centric(ctx),
                        replicated=_replicated(ctx), tune_strategy=opts.tune_strategy, expert_load=agreed.load)
        ctx.own_plans[d.region.name] = lp
        return lp.choice

    def load(d: Decision, routing: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """(token, expert) pairs per expert of this rank's compile batch; () without routing."""
        ids = routing.get(d.region.name)
        if ids is None:
            return ()
        ids = ids.reshape(-1).to(torch.int64)
        ids = ids[(ids >= 0) & (ids < d.region.num_experts)]  # a dropped slot's id is out of range
        return tuple(int(c) for c in torch.bincount(ids.cpu(), minlength=d.region.num_experts).tolist())

    # A layer compiled under torch.autocast is another rewrite (its op computes in the autocast
    # dtype): training under autocast and evaluating outside it compiles each once, agreed apart.
    precision = _autocast_condition(ctx.gm.graph)

    def agree(decisions: list[Decision], routers_left: list[Skip], routing: dict[str, torch.Tensor]) -> list[Decision]:
        proposals = []
        for d in decisions:
            mine = key(d, -1) if d.chosen is not None and not d.vacuous else (None, "")
            proposals.append(agreement.Proposal(
                anchor=params.path[d.region.router_weight] + precision, name=d.region.name, key=mine[0], where=mine[1],
                reason=d.reason, vacuous=d.vacuous, candidates=tuple(key(d, i) for i in range(len(d.passing))),
                tokens=d.region.num_tokens, load=load(d, routing)))
        proposals += [agreement.Proposal(anchor=params.path[s.router_weight] + precision, name=s.name, key=None,
                                         reason=s.reason)
                      for s in routers_left if s.router_weight is not None]
        # a layer is known by its router's weight tensor on every compile of this rank, whether the
        # finder saw the rest of the layer or not
        identities = [(params.value.get(d.region.router_weight),) for d in decisions]
        identities += [(params.value.get(s.router_weight),) for s in routers_left if s.router_weight is not None]
        agreed = agreement.agree(settings, proposals, identities)
        out = []
        for d, p, a in zip(decisions, proposals[:len(decisions)], agreed[:len(decisions)], strict=True):
            if a.key is None:
                ctx.agreed_plans[d.region.name] = None
                out.append(Decision(d.region, None, a.reason))
                continue
            if a.key != p.key:  # this rank had 0 tokens: it takes what the others verified, where they found it
                i = p.candidates.index((a.key, a.where))
                d = Decision(d.region, d.passing[i], vacuous=True)
            ctx.agreed_plans[d.region.name] = planned(d, a)
            out.append(d)
        return out

    return agree


def _plan(ctx: PassContext) -> dict[str, int]:
    """Decide each rewritten layer's strategy (passes/plan.py; cost/ never sees fx)."""
    if ctx.canonical is None:
        return {}
    opts = ctx.options
    ctx.plans = plan_pass(ctx.canonical.rewritten, ctx.topology, mesh_levels=_mesh_levels(opts),
                          dimension=opts.dimension, dedup=opts.dedup, agreed=ctx.agreed_plans, known=ctx.own_plans,
                          chunks=_chunks(opts), gather=_gather(opts), gather_compress=opts.gather_compress,
                          model_centric=_model_centric(ctx), replicated=_replicated(ctx),
                          tune_strategy=opts.tune_strategy)
    counts: dict[str, int] = {}
    for p in ctx.plans.values():
        counts[p.plan.strategy] = counts.get(p.plan.strategy, 0) + 1
    return counts


def _chunks(opts: Options) -> str | int:
    """options['pipeline'] where the layer can run chunks: the staged ops with their stages split
    into start and wait (else chunks would only add latency); "auto" is 1 on CUDA, where a stage
    still runs where it is started (``ep.worker``: no side stream yet), an explicit n or "tune"
    (which measures) stays."""
    if not opts.overlap or opts.ep_backward != "stages":
        return 1
    if opts.pipeline == "auto" and getattr(opts.mesh, "device_type", "cpu") == "cuda":
        return 1
    return opts.pipeline


def _gather(opts: Options) -> str | bool | int:
    """options['expert_gather'] as the plan may use it: with expert_swap, whose swaps move the
    experts the all-to-alls send tokens to, "auto" weighs no gather (a gathering layer has no
    placement to improve)."""
    return False if opts.expert_swap is not None and opts.expert_gather == "auto" else opts.expert_gather


def _not_whole(ctx: PassContext) -> str | None:
    """Why a rank may not read every expert whole (``shard_experts``' shards), or may not leave
    the experts where they are (expert_swap moves them), or None; worded for the model-centric
    error, and what keeps a layer from running replicated too."""
    sharded = any(shard.lookup(ex) is not None for ex in ctx.example_inputs)
    return ("its experts are sharded (moe_compile.shard_experts) and a model-centric layer reads every expert's "
            "columns on every rank" if sharded else
            "option 'expert_swap' moves experts between ranks, which a model-centric layer does not use"
            if ctx.options.expert_swap is not None else None)


def _model_centric(ctx: PassContext) -> str | bool:
    """options['model_centric'] as the plan may use it (``lowering.strategies.model``): False with
    expert_swap (a model-centric layer has no placement to improve) and where a rank does not hold
    every expert whole (``shard_experts``' shards: it reads every expert's columns)."""
    opts = ctx.options
    why = _not_whole(ctx)
    if why is not None and opts.model_centric == "always":
        raise ValueError(f"option 'model_centric' = 'always' cannot run this model: {why}; use 'auto' or False")
    return False if why is not None else opts.model_centric


def _replicated(ctx: PassContext) -> bool:
    """Whether a layer may run replicated (``lowering.strategies.replicated``): options
    ``replicated_experts`` "auto", every rank holding every expert whole (no shard_experts, no
    expert_swap), and no sample placement (which places samples for the all-to-alls)."""
    opts = ctx.options
    return opts.replicated_experts == "auto" and not opts.sample_placement and _not_whole(ctx) is None


def _mesh_levels(opts: Options) -> int | None:
    return None if opts.mesh is None else int(opts.mesh.mesh.ndim)


def _expert_parallel(ctx: PassContext) -> dict[str, int]:
    opts = ctx.options
    if opts.mesh is None or ctx.canonical is None or not ctx.canonical.rewritten:
        return {}
    out = expert_parallel_pass(ctx.gm, ctx.canonical.rewritten, ctx.plans, mesh=opts.mesh, topology=ctx.topology,
                               example_inputs=ctx.example_inputs, expert_swap=opts.expert_swap,
                               tune_rounds=opts.tune_dimension,
                               backward=opts.ep_backward, gather_keep_bytes=opts.gather_keep_bytes,
                               gather_compress=opts.gather_compress)
    ctx.ep_layers.update(out.pop("layers"))
    ctx.plans.update(out.pop("tuned_plans"))
    ctx.input_swaps.update(out.pop("input_swaps"))
    ctx.layer_inputs.update(out.pop("layer_inputs"))
    if ctx.placement is not None and ctx.placement.cuts:
        out["sample_exchanges"] = bind(ctx.gm, ctx.ep_layers, int(opts.mesh.mesh.numel()))
        fused = fuse_combines(ctx.gm)
        ctx.placement.fused = {name for name, lid in ctx.ep_layers.items() if lid in fused}
        out["fused_combines"] = len(fused)
        register_records(ctx.placement, ctx.ep_layers, ctx.topology, {
            r.region.name: r.region.hidden_size * getattr(torch, r.region.dtype).itemsize + r.region.top_k * SLOT_BYTES
            for r in ctx.canonical.rewritten}, {
            name: lp.settings.chunks for name, lp in ctx.plans.items() if lp.settings is not None})
    return out


def _sample_placement(ctx: PassContext) -> dict[str, int]:
    """options['sample_placement']: NetMoE's sample exchanges between the MoE layers
    (passes/sample_placement.py), the same on every rank (``ep.agreement.every_rank``)."""
    opts = ctx.options
    if not opts.sample_placement or opts.mesh is None or ctx.canonical is None or not ctx.canonical.rewritten:
        return {}
    assert ctx.found is not None
    pos = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
    rewritten = sorted(ctx.canonical.rewritten, key=lambda r: pos[r.op_node])
    layers = [PlacementLayer(r.region.name, r.op_node, r.op_node.args[1], r.region.top_k,  # type: ignore[arg-type]
                             r.region.hidden_size * getattr(torch, r.region.dtype).itemsize,
                             input_scaled=r.weights.scales == "input") for r in rewritten]
    identity = tuple(ctx.found.params.value.get(r.region.router_weight) for r in rewritten)
    levels = int(opts.mesh.mesh.ndim)

    def agree(reason: str | None, samples: int, cuts: int, fused: tuple[str, ...]) -> str | None:
        if levels != 2:
            reason = (f"the mesh has {levels} levels: NetMoE's placement model has two (nodes, ranks in a node); "
                      "give a 2-level mesh")
        elif ctx.topology is None:
            reason = "no topology to weigh a move against its saving: give options['topology'] or leave 'dimension' out"
        every = agreement.every_rank("sample placement", identity, (reason, samples, cuts, fused))
        if every[dist.get_rank()] != (reason, samples, cuts, fused):
            raise RuntimeError(f"this rank's recompile decides sample placement differently ({reason or 'place'}, "
                               f"{samples} samples) from what every rank agreed when the graph was first compiled "
                               f"{every[dist.get_rank()]}; keep the batch shape the same on every rank")
        for r, (why, *_) in enumerate(every):
            if why is not None:
                return why if r == dist.get_rank() else f"left alone on every rank because rank {r} does: {why}"
        if len({(b, c) for _, b, c, _ in every}) > 1:
            return ("the ranks hold different numbers of samples ("
                    + ", ".join(f"rank {r}: {b}" for r, (_, b, _, _) in enumerate(every))
                    + "): sample placement keeps B samples on every rank; give every rank the same batch size")
        if len({f for *_, f in every}) > 1:
            return ("the ranks would fuse different layers' combines with the sample moves ("
                    + ", ".join(f"rank {r}: {list(f)}" for r, (*_, f) in enumerate(every))
                    + "): their graphs differ; compile the same model on every rank")
        return None

    # a cut after a layer whose tokens travel by the all-to-all stages (in any number of chunks) may be
    # fused with its combine (passes.sample_binding.fuse_combines); tune_strategy's candidates
    # could still make it a gather, which has no combine to fuse
    fusable = frozenset(
        name for name, lp in ctx.plans.items()
        if lp.settings is not None and lp.settings.chunkable and not lp.alternatives and opts.ep_backward == "stages")

    inputs = [shard.verification_value(ex, seed=i) for i, ex in enumerate(ctx.example_inputs)]
    ctx.placement = sample_placement_pass(ctx.gm, layers, inputs, ctx.found.params, int(opts.mesh.mesh.numel()),
                                          verify=opts.verify, agree=agree, fusable=fusable)
    if ctx.placement.reason is not None:
        return {"cuts": 0, "left_alone": 1}
    sample_exchange.ensure_group(opts.mesh.mesh.flatten().tolist())  # every rank: the ranks agreed to place
    return ctx.placement.counters()



def _lower_kernels(ctx: PassContext) -> dict[str, int]:
    return lower_kernels_pass(ctx.gm, ctx.options.kernels)


PASSES: list[tuple[str, Callable[[PassContext], dict[str, int]]]] = [
    ("inline_checkpoint", _inline_checkpoint),
    ("find_moe_regions", _find),
    ("canonicalize", _canonicalize),
    ("plan", _plan),
    ("sample_placement", _sample_placement),
    ("expert_parallel", _expert_parallel),
    ("lower_kernels", _lower_kernels),
]
assert tuple(name for name, _ in PASSES) == PASS_NAMES, "options.PASS_NAMES lists the passes users may disable"


def run_pipeline(ctx: PassContext) -> PassContext:
    ctx.topology = ctx.options.topology
    for name, fn in PASSES:
        if name in ctx.options.disable_passes:
            ctx.counters[name] = {"disabled": 1}
            continue
        ctx.counters[name] = fn(ctx)
    if ctx.checkpointed is not None:
        ctx.stage_notes = checkpoint_local_stages(ctx.gm, ctx.checkpointed, ctx.selective)
        ctx.counters["inline_checkpoint"]["rewrite_nodes_tagged"] = tag_rewrites(ctx.gm, ctx.checkpointed)
    if ctx.selective:
        assert ctx.checkpointed is not None
        ctx.counters["inline_checkpoint"]["selective_closed"] = outline_selective(ctx.gm, ctx.checkpointed,
                                                                                   ctx.selective)
    if ctx.found is not None and ctx.found.regions and ctx.canonical is None:
        ctx.skipped.extend(Skip(r.name, "the canonicalize pass is disabled (options['disable_passes'])")
                           for r in ctx.found.regions)
    return ctx
