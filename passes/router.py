"""The router of a routing anchor: the linear map that makes the scores the experts are chosen
from, and a label for the routing rule.

The router's logits are the last matmul on the way to the scores, with a parameter [R, H] (or
[H, R]) whose R rows are at least the E experts scored: a router may score more than it routes
(Inkling's shared-expert rows, sliced off before the top-k).  Scores made by a matmul of two
activations (attention, a sparse-attention indexer) have no router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from moe_compile.passes import op_kinds as ops
from moe_compile.passes.graph_index import GraphIndex, static_shape
from moe_compile.passes.graph_params import ParamTable
from moe_compile.passes.regions import RoutingWeights
from moe_compile.passes.routing_anchor import Anchor


@dataclass
class Router:
    topk: fx.Node  # the routing anchor's node (routing_anchor.Anchor.node)
    logits: fx.Node
    weight: fx.Node
    tokens: fx.Node
    nodes: set[fx.Node]
    anchor: Anchor


def find_router(index: GraphIndex, params: ParamTable, anchor: Anchor) -> Router | None:
    """The router of ``anchor``: the last matmul before its scores, if its other operand is a
    parameter of E or more rows (or columns) over the tokens' hidden size."""
    scores = anchor.scores
    shape = static_shape(scores)
    if not shape:
        return None
    num_experts = shape[-1]
    logits = next((n for n in reversed(index.ordered(index.ancestors([scores]))) if ops.is_matmul(n)), None)
    if logits is None:
        return None
    for w_arg, x_arg in _operand_pairs(logits):
        w = _state_through_views(params, w_arg)
        if w is None:
            continue
        w_shape = static_shape(w)
        tokens = _strip_casts(x_arg)
        t_shape = static_shape(tokens)
        if w_shape is None or len(w_shape) != 2 or not t_shape:
            continue
        # [R, H] (nn.Linear) or [H, R], R >= E scored experts, H the tokens' last dim
        if any(r >= num_experts and h == t_shape[-1] for r, h in (w_shape, w_shape[::-1])):
            nodes = index.ancestors([scores], stop={logits})
            return Router(topk=anchor.node, logits=logits, weight=w, tokens=tokens, nodes=nodes, anchor=anchor)
    return None


def _operand_pairs(n: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    args = [a for a in n.args if isinstance(a, fx.Node)]
    if len(args) < 2:
        return []
    return [(args[1], args[0]), (args[0], args[1])]


def _state_through_views(params: ParamTable, n: fx.Node) -> fx.Node | None:
    while n not in params:
        if not ops.is_transparent(n) or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]
    return n


def _strip_casts(n: fx.Node) -> fx.Node:
    while ops.op_name(n) in ("to", "float", "half", "bfloat16", "type", "type_as") and isinstance(
        n.args[0], fx.Node
    ):
        n = n.args[0]
    return n


def router_kind(index: GraphIndex, router: Router, weights: list[RoutingWeights]) -> str:
    """A label for the routing rule: score function, selection bias, group-limited top-k, and
    what happens to the top-k scores on their way to the most likely routing weights."""
    rnodes = router.nodes
    if any(ops.is_sigmoid(n) for n in rnodes):
        parts = ["sigmoid"]
    elif any(ops.is_softmax(n) for n in rnodes):
        parts = ["softmax"]
    else:
        parts = ["logits"]
    if any(ops.is_add(n) and any(isinstance(a, fx.Node) and a.op in ("placeholder", "get_attr") for a in n.args)
           for n in rnodes):
        parts.append("bias")  # a selection bias (DeepSeek-V3's e_score_correction_bias)
    if any(ops.is_topk(n) for n in rnodes):
        parts.append("grouped")
    if router.anchor.kind != "topk":
        parts.append(router.anchor.kind)  # top-k written as argmaxes or a sort
    path = (index.ancestors([weights[0].node]) & index.descendants([router.topk, *router.anchor.sources])
            if weights else set())
    if parts[0] == "logits" and any(ops.is_softmax(n) for n in path):
        parts[0] = "topk+softmax"
    if any(ops.is_div(n) for n in path):
        parts.append("renorm")
    return "+".join(parts)


__all__ = ["Router", "find_router", "router_kind"]
