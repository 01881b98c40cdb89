"""Make every rewritten MoE layer expert-parallel over a device mesh.

Contract:
    needs     the ``hiermoe::experts`` nodes that canonicalize emitted (one per layer), a mesh
              that ``moe_compile.ep.setup.check_mesh`` accepted, and either a topology (d* per
              step) or a fixed dimension.
    does      leaves a layer planned ``replicated`` as it is (every rank holds every expert and
              runs its own tokens through them; no runtime layer), and replaces each other by
              what its planned strategy (``passes.plan``, ``lowering.strategies``) emits: the
              staged ops of ``lowering.ep_stages`` (``ep_dispatch`` ->
              ``ep_local_experts`` -> ``ep_combine``, nodes named after the layer), with the
              runtime settings the plan chose (fixed d or d* per step, dedup or not); or with
              ``backward="resend"`` the fused ``hiermoe::ep_experts``. The local stage reads
              only this rank's experts through the layer's placement table at run time (so an
              expert swap needs no recompile). Its weights are either indexed by expert id (``by_expert``): stacked
              [E, ...] weights as they are (no copy), or, with options['expert_swap'], a stack of
              every expert module; or indexed by local slot: for weights sharded by
              ``moe_compile.shard_experts``, this rank's ``_shard`` parameter in place of the
              full-shape placeholder input (returned in "input_swaps": the backend feeds the
              shard at that input position on every call, after Dynamo's guards have checked the
              placeholder, so autograd reaches the parameter), and for experts kept as E modules
              without expert swap, a stack of only the local modules. Registers the layer's
              runtime state (placement, process groups, cost model), or finds the one an earlier
              compile of the same weights built, and passes its id to the op.
    refuses   (ValueError, at compile time, before any collective of the step) E not divisible
              by the number of ranks, a mesh on another device than the tokens, a dimension
              outside 1..D.

Pseudo-code:
    for each rewritten layer:
        Step 1: build (or find) its runtime state (moe_compile.ep.setup.build_layer), keyed by
                the weight tensors the graph reads
        Step 2: sharded weight -> feed the shard (rows = local slots); E modules -> stack every
                module with expert swap (rows = ids), else only the local ones (rows = slots);
                stacked tensor -> as it is (rows = ids)
        Step 3: the strategy emits dispatch -> local experts -> combine (or ep_experts), erase the old op
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import moe_compile.lowering  # noqa: F401  (registers torch.ops.hiermoe)
from moe_compile.cost.topology import Topology
from moe_compile.ep import runtime, shard
from moe_compile.ep.setup import build_layer
from moe_compile.ep.tuning import DimensionTuner
from moe_compile.lowering.strategies import Settings
from moe_compile.passes import autotune
from moe_compile.passes.canonicalize import Rewritten
from moe_compile.passes.graph_index import fake_tensor, tensor_meta
from moe_compile.passes.inline_checkpoint import mark_local_stage
from moe_compile.passes.plan import LayerPlan

_WEIGHT_ARGS = range(3, 9)  # w_up, w_gate, w_down, b_up, b_gate, b_down in hiermoe::experts
# ops emit.py puts between a weight's storage and the op; all keep dim 0 (experts) in place
_VIEWS = {torch.transpose, torch.narrow, operator.getitem}


def expert_parallel_pass(gm: fx.GraphModule, rewritten: Sequence[Rewritten], plans: Mapping[str, LayerPlan], *,
                         mesh: Any, topology: Topology | None, example_inputs: Sequence[object] = (),
                         expert_swap: Any = None, backward: str = "stages", tune_rounds: int = 0,
                         gather_keep_bytes: int | None = None, gather_compress: float | None = None
                         ) -> dict[str, Any]:
    """``plans``: each layer's ``passes.plan.LayerPlan`` (its strategy and runtime settings).
    ``backward``: "stages" or "resend" (options['ep_backward']). Returns counters, under
    "layers" the runtime layer id of every layer by name, under
    "input_swaps" {input position: shard parameter} for the backend to feed, and under
    "layer_inputs" {layer id: input positions of its weights}. ``expert_swap`` is
    the ``moe_compile.options.SwapOptions`` of options["expert_swap"] (None: off);
    ``tune_rounds`` options["tune_dimension"] (``moe_compile.ep.tuning``); ``gather_keep_bytes``
    options["gather_keep_bytes"] (``plan_regathers``); ``gather_compress`` options["gather_compress"]
    (``lowering.ep_gather``'s SR compression, on the layers that gather)."""
    ids: dict[str, int] = {}
    tuned: dict[str, LayerPlan] = {}  # the plans autotuning changed (options tune_strategy, pipeline "tune")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    value = dict(zip(placeholders, example_inputs))
    shards = {n: s for n, ex in value.items() if (s := shard.lookup(ex)) is not None}
    swaps: dict[int, torch.Tensor] = {}  # graph input position -> the shard parameter fed there
    inputs: dict[int, tuple[int, ...]] = {}  # layer id -> input positions of the weights it reads
    for r in rewritten:
        op, reg, name = r.op_node, r.region, r.region.name
        x_meta = tensor_meta(reg.tokens)
        assert x_meta is not None
        num_experts = reg.num_experts
        args = list(op.args)
        weight_nodes: list[fx.Node] = [a for i in _WEIGHT_ARGS if isinstance(a := args[i], fx.Node)]
        weight_inputs = _weight_inputs(weight_nodes, value, num_experts)
        for n in weight_inputs:
            if n not in shards and shard.looks_like_placeholder(value[n]):
                raise ValueError(f"layer {name}: an expert weight ({n.name}) is a shard_experts placeholder (one "
                                 "value expanded to the weight's shape) that no shard record of this process "
                                 "knows: the model was copied, or its modules replaced, after shard_experts; run "
                                 "shard_experts on the model you compile")
        # Step 1
        planned = plans[name]
        assert planned.strategy is not None and planned.settings is not None, f"layer {name} has no EP plan"
        if planned.settings.replicated:  # every rank runs its own tokens on its own experts: the op stays
            continue
        if planned.alternatives and backward == "stages":  # "resend" runs ep_experts whatever the strategy
            planned = tuned[name] = _tuned_strategy(
                planned, _measuring(args, name, reg, r.layout, mesh, topology, x_meta.device, planned.expert_load),
                _probe_by_expert(weight_nodes, shards, num_experts, expert_swap))
        settings = planned.settings
        assert settings is not None
        lay = build_layer(name=name, mesh=mesh, topology=topology, dimension=settings.dimension, dedup=settings.dedup,
                          num_experts=num_experts, top_k=reg.top_k, hidden_size=reg.hidden_size,
                          ffn_size=r.layout.ffn_size, gated=r.layout.gated, dtype=getattr(torch, reg.dtype),
                          device=x_meta.device, tensors=tuple(value[n] for n in weight_inputs),
                          domain=settings.domain, model_centric=settings.model_centric)
        inputs[lay.layer_id] = tuple(placeholders.index(n) for n in weight_inputs)
        if expert_swap is not None:
            lay.swap_options = expert_swap
        lay.compress_ratio = None if settings.domain is None else gather_compress
        if lay.tuner.rounds != tune_rounds:  # a recompile with the same option keeps what was measured
            lay.tuner = DimensionTuner(tune_rounds)
        per = len(lay.local_experts)
        first = lay.comm.position * per  # the rows shard_experts kept: the contiguous placement's
        # Step 2
        by_expert: bool | None = None
        restacked: set[fx.Node] = set()
        for root, stack in [(_root(a), _stack_root(a, num_experts)) for a in weight_nodes]:
            if root in shards:  # sharded by shard_experts: this input will carry the rank's shard
                sh = shards[root]
                if sh.local is None or (sh.first, sh.num_local) != (first, per):
                    raise ValueError(f"layer {name}: {sh.name} was sharded for experts {sh.first}.."
                                     f"{sh.first + sh.num_local - 1} but this rank runs experts {first}.."
                                     f"{first + per - 1}; shard with the same mesh you compile with")
                swaps[placeholders.index(root)] = sh.local
                if not any(sh.local is q for q in lay.slot_params):
                    lay.slot_params = (*lay.slot_params, sh.local)
                mode = False
            elif stack is not None:
                items = list(stack.args[0])  # type: ignore[arg-type]
                sharded_modules = any(isinstance(i, fx.Node) and _root(i) in shards for i in items)
                # every module's weights stay stacked where they may move (expert swap) or where
                # every rank reads every expert (model-centric)
                mode = (expert_swap is not None or settings.model_centric) and not sharded_modules
                if not mode and stack not in restacked:  # only this rank's modules, in slot order
                    stack.args = ([items[e] for e in lay.local_experts], *stack.args[1:])
                    restacked.add(stack)
                    lay.swap_blocker = lay.swap_blocker or (
                        "its expert modules are sharded (moe_compile.shard_experts keeps E modules in place); "
                        "stack the experts into [E, ...] parameters to swap them" if sharded_modules else
                        "its experts are E modules and the graph stacks only this rank's; compile with "
                        "options['expert_swap'] to stack them all and make them swappable")
            else:
                mode = True
            if by_expert is not None and mode != by_expert:
                raise ValueError(f"layer {name}: some expert weights are sharded (moe_compile.shard_experts) and "
                                 "others are not; shard the whole model or none of it")
            by_expert = mode
        if planned.tune and settings.chunkable:
            planned = tuned[name] = _tuned_chunks(
                planned, _measuring(args, name, reg, r.layout, mesh, topology, x_meta.device, planned.expert_load),
                bool(by_expert),
                reg.num_tokens)
            settings = planned.settings
            assert settings is not None
        # Step 3
        before_op = op.prev  # what Step 3 emits lands between it and op
        with gm.graph.inserting_before(op):
            if backward == "resend" and settings.domain is None:
                ep = gm.graph.call_function(torch.ops.hiermoe.ep_experts.default,
                                            (*args, lay.layer_id, bool(by_expert)))
                y = gm.graph.call_function(operator.getitem, (ep, 0))
            else:
                assert planned.strategy is not None
                y = planned.strategy.emit(gm.graph, args, lay.layer_id, bool(by_expert), name, settings, reg.top_k)
        emitted = before_op.next
        while emitted is not op:  # a checkpoint around the experts alone holds the local stage
            if emitted.target is torch.ops.hiermoe.ep_local_experts.default:
                mark_local_stage(emitted, op, name)
            emitted = emitted.next
        op.replace_all_uses_with(y)
        gm.graph.erase_node(op)
        ids[name] = lay.layer_id
    for node in shards:
        if node.users and placeholders.index(node) not in swaps:
            raise ValueError(f"{shards[node].name} is sharded (moe_compile.shard_experts) but a part of the graph "
                             "that was not rewritten into the expert op reads it; see moe_compile.explain for the "
                             "layers left alone and why")
    regathered = plan_regathers(gm.graph, gather_keep_bytes)
    for lay_id in {v for v in ids.values()}:
        runtime.layer(lay_id).regathered = lay_id in regathered
    gm.graph.lint()
    gm.recompile()
    return {"expert_parallel": len(ids), "regathered": len(regathered), "sharded_weights": len(swaps), "layers": ids,
            "input_swaps": swaps, "layer_inputs": inputs, "tuned_plans": tuned}


def _measure_key(args: Sequence[Any], mesh: Any, topology: Topology | None, reg: Any,
                 device: torch.device) -> tuple[Any, ...]:
    """What compiling a layer's autotuning candidates depends on besides the candidates: per
    argument of the op, its shape and dtype (a node; the routing's may have none) or its value
    (the activation, an absent bias), and the mesh, topology and device (the measurement depends
    on the expert loads too)."""
    per_arg = tuple(((tuple(f.shape), f.dtype) if (f := fake_tensor(a)) is not None else "node")
                    if isinstance(a, fx.Node) else repr(a) for a in args)
    return per_arg, id(mesh), repr(topology), reg.top_k, reg.num_experts, str(device)


def _measuring(args: Sequence[Any], name: str, reg: Any, layout: Any, mesh: Any, topology: Topology | None,
               device: torch.device, expert_load: tuple[int, ...] | None) -> dict[str, Any]:
    """``autotune.measure``'s arguments for one layer besides its candidates: the measurement's
    key, the op's arguments, how to build a throwaway layer with a candidate's settings, and the
    expert loads the ranks agreed on (the measured tokens' routing is drawn from them)."""
    dtype = getattr(torch, reg.dtype)

    def probe_layer(settings: Settings) -> runtime.EPLayer:
        return build_layer(name=f"{name} (autotune)", mesh=mesh, topology=topology, dimension=settings.dimension,
                           dedup=settings.dedup, num_experts=reg.num_experts, top_k=reg.top_k,
                           hidden_size=reg.hidden_size, ffn_size=layout.ffn_size, gated=layout.gated, dtype=dtype,
                           device=device, domain=settings.domain, model_centric=settings.model_centric)

    return {"key": _measure_key(args, mesh, topology, reg, device), "op_args": args, "name": name,
            "top_k": reg.top_k, "num_experts": reg.num_experts, "probe_layer": probe_layer, "expert_load": expert_load}


def _tuned_strategy(planned: LayerPlan, measuring: dict[str, Any], by_expert: Callable[[Settings], bool]
                    ) -> LayerPlan:
    """The plan with the fastest of ``planned.alternatives`` measured on the ranks (``passes.autotune``)."""
    options = {n: (strat, sett, pipe) for n, strat, sett, pipe in planned.alternatives}
    cands = {n: autotune.Candidate(strat, sett, by_expert(sett)) for n, (strat, sett, _) in options.items()}
    measured = autotune.measure(candidates=cands, baseline=planned.plan.strategy, **measuring)
    strat, sett, pipe = options[measured.choice]
    plan = planned.plan if measured.choice == planned.plan.strategy else replace(
        planned.plan, strategy=measured.choice, params={},
        notes=(*planned.plan.notes, f"{measured.choice}: measured fastest (tune_strategy)"))
    return replace(planned, plan=plan, strategy=strat, settings=sett, pipeline=pipe, measured_strategy=measured)


def _tuned_chunks(planned: LayerPlan, measuring: dict[str, Any], by_expert: bool, num_tokens: int) -> LayerPlan:
    """The plan with its chunk count measured on the ranks (``passes.autotune``)."""
    settings, strat = planned.settings, planned.strategy
    assert settings is not None and strat is not None
    cands = {str(n): autotune.Candidate(strat, replace(settings, chunks=n), by_expert)
             for n in autotune.chunk_candidates(planned.pipeline, num_tokens)}
    measured = autotune.measure(candidates=cands, baseline="1", **measuring)
    return replace(planned, settings=replace(settings, chunks=int(measured.choice)), measured_chunks=measured)


def _probe_by_expert(weight_nodes: Sequence[fx.Node], shards: Mapping[fx.Node, Any], num_experts: int,
                     expert_swap: Any) -> Callable[[Settings], bool]:
    """Whether a candidate's graph would read every expert's weights (Step 2's rule, before the
    runtime layer exists): not where they are sharded, nor where a stack of modules is cut to the
    rank's own (unless the experts may move, or every rank computes every expert)."""
    roots = [(_root(a), _stack_root(a, num_experts)) for a in weight_nodes]
    sharded = any(root in shards for root, _ in roots)
    stacked = any(stack is not None for _, stack in roots)
    return lambda s: not sharded and (not stacked or expert_swap is not None or s.model_centric)

def _weight_inputs(nodes: Sequence[fx.Node], value: dict[fx.Node, object], num_experts: int) -> tuple[fx.Node, ...]:
    """The graph inputs a layer's weights come from, in argument order: their tensors identify
    the layer across recompiles and tell the backend, at each call, whose weights the graph runs
    on. Empty if one is not a graph input (then nothing is reused)."""
    out: list[fx.Node] = []
    for a in nodes:
        stack = _stack_root(a, num_experts)
        items = list(stack.args[0]) if stack is not None else [a]  # type: ignore[arg-type]
        for i in items:
            n = _root(i) if isinstance(i, fx.Node) else None
            if n is None or n not in value:
                return ()
            out.append(n)
    return tuple(out)


def _root(n: fx.Node) -> fx.Node:
    """The storage under a chain of views and casts (``passes.emit`` casts weights to the layer's
    compute dtype where it ran under torch.autocast)."""
    while ((n.op == "call_function" and n.target in _VIEWS) or (n.op == "call_method" and n.target == "to")) \
            and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _stack_root(n: fx.Node, num_experts: int) -> fx.Node | None:
    """The ``torch.stack`` of per-expert module weights under a chain of views, if any."""
    n = _root(n)
    if n.op == "call_function" and n.target is torch.stack:
        items = n.args[0]
        if isinstance(items, list | tuple) and len(items) == num_experts:
            return n
    return None


# an activation-checkpoint region id no user region takes (passes.emit's is 1 << 20)
_REGATHER_AC_GRAPH = (1 << 20) + 1


def plan_regathers(graph: fx.Graph, budget_bytes: int | None) -> dict[int, int]:
    """Which expert gathers (``strategies.gather``) keep their weights from forward to backward
    and which gather them again in backward, within ``budget_bytes`` kept per rank
    (options['gather_keep_bytes']; None: keep all). The last layers keep first: their backward
    comes first, with no earlier backward work to hide a re-gather behind. A re-gathered gather
    is tagged for AOTAutograd's partitioner to recompute it in backward (as activation
    checkpointing does), so its weights are freed after the layer's forward; in backward
    ``passes.overlap`` starts it ahead like the forward's. Returns {runtime layer id: gathered
    bytes} of the re-gathered ones."""
    gathers = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.hiermoe.ep_gather.default]
    kept, regathered = 0, {}
    for node in reversed(gathers):
        weights, layer_id, _ = node.args
        lay = runtime.layer(int(layer_id))  # type: ignore[arg-type]
        rows = len(lay.domain_positions()) * len(lay.local_experts)
        size = 0
        for w in weights:  # type: ignore[union-attr]
            val = fake_tensor(w)
            assert val is not None, f"layer {lay.name}: no shape for the gathered weight {w}"
            size += rows * math.prod(int(d) for d in val.shape[1:]) * val.dtype.itemsize
        if budget_bytes is None or kept + size <= budget_bytes:
            kept += size
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = _REGATHER_AC_GRAPH
        regathered[lay.layer_id] = size
    return regathered
