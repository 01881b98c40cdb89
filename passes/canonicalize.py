"""canonicalize: replace each verified MoE region by one ``hiermoe::experts`` call.

Contract
    Needs: the ``FindResult`` of find_moe_regions on this same, unmodified graph, and the real
    example inputs (verification runs the graph on them).
    Guarantees: a region is rewritten only after one of its interpretations (output candidate x
    expert layout x routing-weight source) computed the same outputs and gradients as the
    original subgraph on the example inputs and on two synthetic routings; the region's now-dead
    nodes are erased; the graph lints.  Capacity-limited layers keep their drops because their
    routing weights are read from the [T, E, C] combine tensor.
    Refuses: regions none of whose interpretations verify (reported with the mismatch), outputs
    read back through a view created before the accumulation.

    values <- run graph on example inputs, keep every region boundary value
    for region in reversed(regions):            # later regions first: earlier nodes stay valid
        Step 1: first (output, layout, weights) whose verification passes, or skip with reason
        Step 2: emit hiermoe::experts after the output node and redirect the readers of it
        Step 3: erase the region nodes that became dead (in-place updates of private tensors too)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from moe_compile.passes.emit import emit_expert_op
from moe_compile.passes.find_moe_regions import FindResult
from moe_compile.passes.graph_index import GraphIndex, is_inplace, is_view
from moe_compile.passes.regions import ExpertLayout, MoERegion, OutputCandidate, RoutingWeights, Skip
from moe_compile.passes.verify import Verdict, boundary_of, capture_boundary_values, verify_interpretation


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


@dataclass
class CanonicalizeResult:
    rewritten: list[Rewritten]
    skipped: list[Skip]
    num_verifications: int


def canonicalize_moe_regions_pass(gm: fx.GraphModule, example_inputs: Sequence[object], found: FindResult,
                                  verify: bool = True) -> CanonicalizeResult:
    index, params = found.index, found.params
    result = CanonicalizeResult(rewritten=[], skipped=[], num_verifications=0)
    values: dict[fx.Node, object] = {}
    if verify and found.regions:
        wanted = {b for r in found.regions for c in r.outputs for b in boundary_of(index, params, r, c)}
        try:
            values = capture_boundary_values(gm, example_inputs, index, wanted)
        except ValueError as e:
            result.skipped.extend(Skip(r.name, str(e)) for r in found.regions)
            return result
    for region in reversed(found.regions):
        if region.existing_op is not None:  # already the expert op: nothing to verify or rewrite
            op = region.existing_op
            layout = replace(region.layouts[0], activation=str(op.args[9]))
            result.rewritten.append(Rewritten(region, region.outputs[0], layout, region.weights[0], None, op))
            continue
        # Step 1: pick the first interpretation that verifies
        choice, why = _choose(index, params, region, values, verify, result)
        if choice is None:
            result.skipped.append(Skip(region.name, why))
            continue
        cand, layout, weights, verdict = choice
        # Step 2: emit the op and redirect readers
        readers = _readers_after(index, cand.node)
        if readers is None:
            result.skipped.append(Skip(region.name, (
                "the routed output is read through a view taken before it was accumulated; "
                "left alone")))
            continue
        with gm.graph.inserting_before(cand.node.next):
            op_node, y = emit_expert_op(gm.graph, region, layout, weights, cand.node, lambda n: n)
        for reader, old in readers:
            reader.replace_input_with(old, y)
        # Step 3: erase dead region nodes
        _erase_dead(index, cand)
        # capacity-limited: a [T, E, C] tensor exists and the weights that verified carry its drops
        capacity = any(w.kind == "combine" for w in region.weights)
        region = replace(region, drops=capacity and weights.kind != "topk", ffn_size=layout.ffn_size)
        topk_value = values.get(region.topk)
        routing = topk_value[1] if isinstance(topk_value, tuple) else None
        result.rewritten.append(Rewritten(region, cand, layout, weights, verdict, op_node, routing))
    result.rewritten.reverse()
    gm.graph.lint()
    gm.recompile()
    return result


def _choose(index: GraphIndex, params, region: MoERegion, values: dict[fx.Node, object], verify: bool,  # type: ignore[no-untyped-def]
            result: CanonicalizeResult):
    first_failure = ""
    for cand in region.outputs:
        for layout in region.layouts:
            for weights in region.weights:
                if not verify:
                    return (cand, layout, weights, None), ""
                result.num_verifications += 1
                verdict = verify_interpretation(index, params, region, cand, layout, weights, values)
                if verdict.ok:
                    return (cand, layout, weights, verdict), ""
                if not first_failure:
                    first_failure = (f"{layout.describe()}, activation {layout.activation}, weights from "
                                     f"{weights.kind} node {weights.node.name}: {verdict.reason}")
    n = len(region.outputs) * len(region.layouts) * len(region.weights)
    return None, (f"verification failed for all {n} interpretations of the layer, so it is left "
                  f"unchanged (first: {first_failure})")


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
