"""canonicalize: replace each verified MoE region by one ``hiermoe::experts`` call.

Contract
    Needs: the ``FindResult`` of find_moe_regions on this same, unmodified graph, and the example
    inputs Dynamo passed (verification runs the graph on them, with the tokens and the expert
    weights replaced by samples, see ``verify``).
    Guarantees: a region is rewritten only after one of its interpretations (output candidate x
    expert layout x routing-weight source) accounts for every op it removes
    (``account.unexplained_op``) and computed the same outputs and gradients as the original
    subgraph on every sample case; the decision depends on the graph, the shapes and the seeds,
    not on the batch or the weights' values, and ``agree`` (expert parallelism) makes it the
    same on every rank before anything is rewritten; the region's now-dead nodes are erased;
    the graph lints.  Capacity-limited layers keep their drops because their routing weights
    are read from the [T, E, C] combine tensor.
    Refuses: regions none of whose interpretations account for every op and verify (the reason
    names the op, or the case that differed), regions ``agree`` leaves alone (the reason names
    the rank), outputs read back through a view created before the accumulation.

    values <- run graph on sample tokens and weights, keep every region boundary value
    Step 1: per region, the first interpretation that accounts for every op and verifies, or
            a reason; with 0 tokens (nothing to verify on), every one that accounts for its ops
    Step 2: agree(decisions): with a mesh, every rank's decisions made the same
    for region in reversed(regions):            # later regions first: earlier nodes stay valid
        Step 3: emit hiermoe::experts after the output node and redirect the readers of it
        Step 4: erase the region nodes that became dead (in-place updates of private tensors too)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from moe_compile.passes.account import Unexplained, unexplained_op
from moe_compile.passes.emit import emit_expert_op
from moe_compile.passes.find_moe_regions import FindResult
from moe_compile.passes.graph_index import GraphIndex, is_inplace, is_view, tensor_meta
from moe_compile.passes.regions import ExpertLayout, MoERegion, OutputCandidate, RoutingWeights, Skip
from moe_compile.passes.verify import (
    Verdict,
    ambient_autocast,
    autocast_at,
    boundary_of,
    capture_boundary_values,
    kept_nodes,
    sample_overrides,
    verify_interpretation,
)


@dataclass(frozen=True)
class Interpretation:
    output: OutputCandidate
    layout: ExpertLayout
    weights: RoutingWeights
    verdict: Verdict | None  # None: not checked numerically (verify=False)


@dataclass(frozen=True)
class Decision:
    """What Step 1 decided for one region: an interpretation, or why none."""

    region: MoERegion
    chosen: Interpretation | None
    reason: str = ""
    # the region has 0 tokens, so verification compared empty tensors and told no interpretation
    # apart; ``passing`` then holds every interpretation that accounts for its ops
    vacuous: bool = False
    passing: tuple[Interpretation, ...] = ()


# Makes every rank's decisions the same (moe_compile.pipeline builds it from the EP runtime): the
# decisions, and the layers whose router find_moe_regions found but not the rest of the layer.
# The third argument: each region's [T, K] expert ids on the compile's batch, by region name (the
# planner's expert loads).
Agree = Callable[[list[Decision], list[Skip], dict[str, torch.Tensor]], list[Decision]]


@dataclass(frozen=True)
class Rewritten:
    region: MoERegion
    output: OutputCandidate
    layout: ExpertLayout
    weights: RoutingWeights
    verdict: Verdict | None
    op_node: fx.Node
    # [T, K] expert ids the example inputs produced (routing statistics for the planner)
    routing: torch.Tensor | None = None
    vacuous: bool = False  # 0 tokens: verification compared empty tensors


@dataclass
class CanonicalizeResult:
    rewritten: list[Rewritten]
    skipped: list[Skip]
    num_verifications: int


def canonicalize_moe_regions_pass(gm: fx.GraphModule, example_inputs: Sequence[object], found: FindResult,
                                  verify: bool = True, agree: Agree | None = None) -> CanonicalizeResult:
    index, params = found.index, found.params
    result = CanonicalizeResult(rewritten=[], skipped=[], num_verifications=0)
    values: dict[fx.Node, object] = {}
    regions = [r for r in found.regions if r.existing_op is None]
    if verify and regions:
        wanted = {b for r in regions for c in r.outputs for b in boundary_of(index, params, r, c)}
        try:
            values = capture_boundary_values(gm, example_inputs, index, wanted,
                                             sample_overrides(index, params, regions))
        except ValueError as e:
            result.skipped.extend(Skip(r.name, str(e)) for r in regions)
            return result
    routing = _routing(gm, example_inputs, index, regions)
    # Step 1
    decisions = [_as_op(_decide(index, params, region, values, verify, result)) for region in regions]
    op_routing = {d.region.name: _op_routing(d, routing[r.topk]) for d, r in zip(decisions, regions) if r.topk in routing}
    # Step 2
    routers_left = [s for s in found.skipped if s.router_weight is not None]
    if agree is not None and (decisions or routers_left):
        decisions = agree(decisions, routers_left, op_routing)
    chosen = {d.region.name: d for d in decisions}
    for region in reversed(found.regions):
        if region.existing_op is not None:  # already the expert op: nothing to verify or rewrite
            op = region.existing_op
            layout = replace(region.layouts[0], activation=str(op.args[9]))
            result.rewritten.append(Rewritten(region, region.outputs[0], layout, region.weights[0], None, op))
            continue
        decision = chosen[region.name]
        if decision.chosen is None:
            result.skipped.append(Skip(region.name, decision.reason))
            continue
        cand, layout, weights, verdict = (decision.chosen.output, decision.chosen.layout, decision.chosen.weights,
                                          decision.chosen.verdict)
        # Step 3: emit the op and redirect readers
        readers = _readers_after(index, cand.node)
        assert readers is not None  # _decide took only outputs it can redirect
        if verdict is None:
            warnings.warn(f"hiermoe: layer {region.name} is rewritten without numerical verification "
                          "(options['verify'] is False); its results are not checked against the layer's",
                          stacklevel=2)
        with gm.graph.inserting_before(cand.node.next):
            op_node, y = emit_expert_op(gm.graph, region, layout, weights, cand.node, lambda n: n)
        for reader, old in readers:
            reader.replace_input_with(old, y)
        # Step 4: erase dead region nodes
        _erase_dead(index, cand)
        # capacity-limited: a [T, E, C] tensor exists and the weights that verified carry its drops
        capacity = any(w.kind == "combine" for w in region.weights)
        region = replace(decision.region, drops=capacity and weights.kind != "topk", ffn_size=layout.ffn_size)
        result.rewritten.append(Rewritten(region, cand, layout, weights, verdict, op_node, op_routing.get(region.name),
                                          decision.vacuous))
    result.rewritten.reverse()
    gm.graph.lint()
    gm.recompile()
    return result


def _routing(gm: fx.GraphModule, example_inputs: Sequence[object], index: GraphIndex,
             regions: Sequence[MoERegion]) -> dict[fx.Node, torch.Tensor]:
    """The [T, K] expert ids of each region on the compile's own batch: routing statistics for
    the planner's predictions, which the sample tokens of verification would not give."""
    try:
        values = capture_boundary_values(gm, example_inputs, index, {r.topk for r in regions})
    except ValueError:  # fake example inputs: no statistics, the planner assumes uniform routing
        return {}
    # a topk's (values, indices), or another anchor's ids (routing_anchor.py)
    return {n: v[1] if isinstance(v, tuple) else v for n, v in values.items() if isinstance(v, tuple | torch.Tensor)}


def _as_op(d: Decision) -> Decision:
    """The decision with its region as the op computes it: where the routing weights scale the
    experts' input, the op gets K rows per token (w_k x, to expert k with weight 1), so every
    later pass (planning, expert parallelism, sample placement) sees T*K tokens routed to 1."""
    if d.chosen is None or d.chosen.weights.scales != "input":
        return d
    return replace(d, region=replace(d.region, num_tokens=d.region.num_tokens * d.region.top_k, top_k=1))


def _op_routing(d: Decision, ids_TK: torch.Tensor) -> torch.Tensor:
    """A region's [T, K] expert ids as the op reads them ([T*K, 1] where the weights scale the input)."""
    return ids_TK.reshape(-1, 1) if d.chosen is not None and d.chosen.weights.scales == "input" else ids_TK


def _decide(index: GraphIndex, params, region: MoERegion, values: dict[fx.Node, object], verify: bool,  # type: ignore[no-untyped-def]
            result: CanonicalizeResult) -> Decision:
    vacuous = region.num_tokens == 0
    unexplained: list[Unexplained] = []
    failed: list[str] = []
    passing: list[Interpretation] = []
    for cand in region.outputs:
        if _readers_after(index, cand.node) is None:
            unexplained.append(Unexplained("the routed output is read through a view taken before it was "
                                           "accumulated", cand.node))
            continue
        reads = index.ancestors([cand.node])
        for layout in region.layouts:
            for weights in region.weights:
                if weights.node not in reads:
                    continue  # the op multiplies by these weights: an output without them is not the layer's
                keep = kept_nodes(index, params, region, cand, weights)
                why = unexplained_op(index, params, region, cand, layout, keep)
                if why is not None and why.scales_input:  # Llama-4: the weights scale the experts' input
                    weights = replace(weights, scales="input")
                    why = unexplained_op(index, params, region, cand, layout, keep, input_scaled=True)
                if why is not None:
                    unexplained.append(why)
                    continue
                if not verify:
                    return Decision(region, Interpretation(cand, layout, weights, None))
                if vacuous:  # 0 tokens: nothing to compare; every interpretation that accounts for its ops
                    passing.append(Interpretation(cand, layout, weights, Verdict(True, 0.0, 0.0)))
                    continue
                result.num_verifications += 1
                verdict = verify_interpretation(index, params, region, cand, layout, weights, values)
                if verdict.ok:
                    return Decision(region, Interpretation(cand, layout, weights, verdict))
                failed.append(f"{layout.describe()}, activation {layout.activation}, weights from "
                              f"{weights.kind} node {weights.node.name} scaling the experts' {weights.scales}: "
                              f"{verdict.reason}")
    if passing:
        return Decision(region, passing[0], vacuous=True, passing=tuple(passing))
    n = len(region.outputs) * len(region.layouts) * len(region.weights)
    if failed and not unexplained:
        return Decision(region, None, f"verification failed for all {n} interpretations of the layer, so it is "
                                      f"left unchanged (first: {failed[0]}){_autocast_note(region, index.gm.graph)}")
    if not unexplained:
        return Decision(region, None, "left unchanged: no output candidate reads any of the routing-weight "
                                      "candidates, so none is the routed sum")
    # the interpretation that accounts for the most of the layer (its first unexplained op comes
    # latest) says best what the op lacks: an earlier failure is often a wrong interpretation's
    first = max(unexplained, key=lambda u: index.pos[u.node])
    reason = f"left unchanged: {first.reason}; rewriting the layer into the expert op would change its results"
    if failed:
        reason += (f" (the {len(failed)} interpretations that account for every op fail verification, "
                f"first: {failed[0]}){_autocast_note(region, index.gm.graph)}")
    return Decision(region, None, reason)


def _readers_after(index: GraphIndex, y: fx.Node) -> list[tuple[fx.Node, fx.Node]] | None:
    """(reader, node it reads) for every read of ``y``'s value after ``y``; None if a read goes
    through a view created before ``y`` (the view would need rebuilding)."""
    root = index.root(y)
    group = [n for n in index.nodes if index.root(n) is root]
    muts = set(index.mutators.get(root, []))
    out = []
    for g in group:
        if index.pos[g] > index.pos[y]:
            continue  # a view taken after y is itself a reader of y's value, rewired below
        for u in g.users:
            if index.pos.get(u, -1) <= index.pos[y] or u in muts:
                continue
            if g is not y and g is not root and g not in muts and index.pos[g] < index.pos[y]:
                return None
            out.append((u, g))
    return out


def _erase_dead(index: GraphIndex, cand: OutputCandidate) -> None:
    """Erase region nodes nothing reads any more, plus the shape checks Dynamo attached to them.

    An in-place update is erased only when every alias of the tensor it updates is itself a
    region node, i.e. the tensor is private to the region (an accumulator), never when the
    tensor is read elsewhere (e.g. router weights normalized in place and also returned)."""
    y_pos = index.pos[cand.node]
    lo = min(index.pos[n] for n in cand.nodes if n.op not in ("placeholder", "get_attr"))
    checks = {n for n in index.descendants(cand.nodes) if lo < index.pos[n] < y_pos} - set(cand.nodes)
    erasable = set(cand.nodes) | checks
    for n in reversed(index.ordered(erasable)):
        if n.op in ("placeholder", "get_attr", "output") or n.users:
            continue
        if is_inplace(n) and not _alias_group(n) <= erasable:
            continue
        n.graph.erase_node(n)


def _alias_group(n: fx.Node) -> set[fx.Node]:
    """Nodes aliasing ``n``'s tensor in the current graph (its base, views and in-place updates)."""
    root = n
    while (is_view(root) or is_inplace(root)) and root.args and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    group, todo = set(), [root]
    while todo:
        m = todo.pop()
        if m in group:
            continue
        group.add(m)
        todo.extend(u for u in m.users if (is_view(u) or is_inplace(u)) and u.args and u.args[0] is m)
    return group


def _autocast_note(region: MoERegion, graph: fx.Graph) -> str:
    """What verification did where the layer runs under torch.autocast (inside the compiled code
    or around the compiled call), and what makes a layer fail there."""
    meta = tensor_meta(region.tokens)
    device = meta.device.type if meta is not None else "cpu"
    inside = [state for state in autocast_at(graph, region.topk) if state[0] == device and state[2]]
    around = dict(ambient_autocast())
    if inside:
        where, dtype = "inside the compiled code", inside[-1][1] or torch.get_autocast_dtype(device)
    elif device in around:
        where, dtype = "around the compiled call", around[device]
    else:
        return ""
    return (f"; the layer runs under torch.autocast({device!r}, {dtype}) {where}: verification compares the "
            f"expert op with it without autocast (in the tokens' dtype) and under it (the op in {region.dtype}, the "
            "dtype the layer's own matmuls show in the graph; under it alone, gradients too, where the layer cannot "
            "run without it); a layer that autocast changes where the graph does "
            "not show it (a custom op's own matmuls, a dtype the layer reads off an autocast result) fails there: "
            "call the compiled model outside autocast to have it rewritten")
