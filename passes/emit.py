"""Emit the canonical ``hiermoe::experts`` call for one interpretation of a region.

The same emitter builds the replacement in the real graph and in the small graphs that
verification runs, so what is verified is exactly what is inserted.  Layout adaptation is done
with views (transpose, narrow, strided slices), so stacked parameters are never copied; experts
stored as E modules are stacked once per call (torch.stack), which autograd differentiates.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import moe_compile.lowering  # noqa: F401  (registers torch.ops.hiermoe)
from moe_compile.lowering.experts_ref import op_activation
from moe_compile.passes import op_kinds as ops
from moe_compile.passes.graph_index import static_shape, tensor_meta
from moe_compile.passes.regions import ExpertLayout, MoERegion, RoutingWeights, WeightRole

_STACK_AC_GRAPH = 1 << 20  # an activation-checkpoint region id no user region takes

NodeMap = Callable[[fx.Node], fx.Node]


def emit_expert_op(graph: fx.Graph, region: MoERegion, layout: ExpertLayout, weights: RoutingWeights,
                   output: fx.Node, m: NodeMap) -> tuple[fx.Node, fx.Node]:
    """Insert nodes (at the graph's current insertion point) computing ``output``'s value.

    Returns (the hiermoe::experts node, the node holding ``output``'s value)."""
    fn = graph.call_function
    hidden, k = region.hidden_size, region.top_k

    compute = getattr(torch, region.dtype)

    def cast(node: fx.Node, source: fx.Node) -> fx.Node:
        # the op computes in the layer's matmul dtype (torch.autocast's where the layer ran under it)
        meta = tensor_meta(source)
        return node if meta is None or meta.dtype == compute else graph.call_method("to", (node, compute))

    x_TH = cast(m(region.tokens), region.tokens)
    if len(static_shape(region.tokens) or ()) != 2:
        x_TH = graph.call_method("reshape", (x_TH, -1, hidden))
    if region.ids is not None:  # the router masked the anchor's ids before the experts read them
        topk_idx_TK, ids_shape = m(region.ids), static_shape(region.ids)
    elif ops.is_topk(region.topk):
        topk_idx_TK = fn(operator.getitem, (m(region.topk), 1))
        ids_shape = static_shape(region.topk.args[0])  # type: ignore[arg-type]
    else:  # the anchor is the [.., K] id tensor itself (routing_anchor.py)
        topk_idx_TK, ids_shape = m(region.topk), static_shape(region.topk)
    if len(ids_shape or ()) != 2:
        topk_idx_TK = graph.call_method("reshape", (topk_idx_TK, -1, k))

    w = m(weights.node)
    if weights.kind == "combine":  # [T, E, C] -> [T, E]: a dropped (token, expert) is all zeros
        w = fn(torch.sum, (w, -1))
    if weights.kind in ("dense", "combine"):
        w = fn(torch.gather, (w, 1, topk_idx_TK))
    topk_w_TK = w

    def stacked(role: WeightRole | None) -> fx.Node | None:
        if role is None:
            return None
        if role.stacked:
            return cast(m(role.first), role.first)
        node = fn(torch.stack, ([m(n) for n in role.nodes],))
        # a copy of E modules' weights that the matmuls' backward would keep alive from forward
        # to backward; tagged for AOTAutograd's partitioner (the tag travels into the joint
        # graph, as activation checkpointing's does) to stack them again in the backward instead
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = _STACK_AC_GRAPH
        return cast(node, role.first)

    w_in = stacked(layout.up)
    assert w_in is not None
    if layout.up_transposed:
        w_in = fn(torch.transpose, (w_in, 1, 2))
    b_in = stacked(layout.b_up)
    w_gate = stacked(layout.gate)
    if w_gate is not None and layout.up_transposed:
        w_gate = fn(torch.transpose, (w_gate, 1, 2))
    b_gate = stacked(layout.b_gate)
    w_up, b_up = w_in, b_in
    if layout.fused_gate is not None:
        w_gate, w_up = _split(graph, w_in, layout.fused_gate, layout.ffn_size)
        if b_in is not None:
            b_gate, b_up = _split(graph, b_in, layout.fused_gate, layout.ffn_size)
    w_down = stacked(layout.down)
    assert w_down is not None
    if layout.down_transposed:
        w_down = fn(torch.transpose, (w_down, 1, 2))
    b_down = stacked(layout.b_down)

    if weights.scales == "input":
        # y = sum_k FFN_k(w_k x) (Llama-4): K rows per token, row (t, k) = w_tk x_t going to
        # expert idx_tk with weight 1, then the K rows of a token summed
        x_TKH = fn(operator.mul, (graph.call_method("unsqueeze", (x_TH, 1)),
                                  graph.call_method("unsqueeze", (graph.call_method("to", (topk_w_TK, x_TH)), -1))))
        x_TH = graph.call_method("reshape", (x_TKH, -1, hidden))
        topk_idx_TK = graph.call_method("reshape", (topk_idx_TK, -1, 1))
        topk_w_TK = fn(torch.ones_like, (graph.call_method("reshape", (topk_w_TK, -1, 1)),))
    op = fn(
        torch.ops.hiermoe.experts.default,
        (x_TH, topk_idx_TK, topk_w_TK, w_up, w_gate, w_down, b_up, b_gate, b_down,
         op_activation(layout.activation, layout.bias_in_matmul)),
    )
    y_TH = op
    if weights.scales == "input":
        y_TH = fn(torch.sum, (graph.call_method("reshape", (y_TH, -1, k, hidden)), 1))
    out_shape = static_shape(output)
    if out_shape is not None and out_shape != (region.num_tokens, hidden):
        template = shape_source(region, output)
        assert template is not None, "the finder only accepts outputs shaped like the tokens"
        # reshape_as a node of that shape keeps symbolic sizes symbolic under dynamic shapes
        y_TH = graph.call_method("reshape_as", (y_TH, m(template)))
    # the op's result is in promote(compute, weights' dtype) (lowering.experts_ref.out_dtype), an
    # expert-parallel strategy's in compute: cast wherever either is not the layer's output dtype
    out_meta, w_meta = tensor_meta(output), tensor_meta(weights.node)
    result = torch.promote_types(compute, w_meta.dtype) if w_meta is not None else compute
    if out_meta is not None and (out_meta.dtype != compute or out_meta.dtype != result):
        y_TH = graph.call_method("to", (y_TH, out_meta.dtype))
    return op, y_TH


def shape_source(region: MoERegion, output: fx.Node) -> fx.Node | None:
    """A node on the tokens' way to the router with ``output``'s shape ([B, S, H] before the
    flattening view), to reshape the op's [T, H] result like."""
    want = static_shape(output)
    n: object = region.tokens
    while isinstance(n, fx.Node):
        if static_shape(n) == want:
            return n
        n = n.args[0] if n.args and n.op in ("call_method", "call_function") else None
    return None


def _split(graph: fx.Graph, w: fx.Node, order: str, ffn: int) -> tuple[fx.Node, fx.Node]:
    """(gate, up) views of a fused [E, 2F, ...] tensor."""
    fn = graph.call_function
    if order == "interleaved":
        even = (slice(None), slice(0, None, 2))
        odd = (slice(None), slice(1, None, 2))
        return fn(operator.getitem, (w, even)), fn(operator.getitem, (w, odd))
    first = fn(torch.narrow, (w, 1, 0, ffn))
    second = fn(torch.narrow, (w, 1, ffn, ffn))
    return (first, second) if order == "gate_first" else (second, first)
