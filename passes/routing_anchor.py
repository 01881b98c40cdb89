"""Where a layer's routing decision is in the graph: the anchor the finder starts from.

Most routers call ``torch.topk``; others choose the same K experts per token without it:

    topk     torch.topk(scores, K) / scores.topk(K)            (values, indices) tuple
    argmax   cat([argmax_1, ..., argmax_K], -1): the best expert, then the best of the scores
             with it masked out, and so on (PhiMoE's sparsemixer; K = 1: one argmax)
    sort     sort(scores, descending=True).indices[..., :K], argsort(...)[..., :K]
    table    table[token_ids]: a fixed token -> experts table (DeepSeek-V4's hash routing,
             ``tid2eid[input_ids]``), weighted by router scores gathered at the ids

Each anchor is an [.., K] tensor of expert ids (a topk's indices) chosen from [.., E] router
scores.  ``routing_anchors`` lists them in program order.  An id tensor that only feeds a larger
selection (the argmaxes inside a cat) is part of that one, not an anchor of its own.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_compile.passes import op_kinds as ops
from moe_compile.passes.graph_index import GraphIndex, static_shape, tensor_meta


@dataclass(frozen=True)
class Anchor:
    node: fx.Node  # the topk call (its getitem 1 holds the ids) or the [.., K] id tensor itself
    kind: str  # "topk", "argmax", "sort", "table"
    k: int | None  # None: a top-k whose k is data-dependent
    scores: fx.Node  # the (first) [.., E] float tensor the experts are chosen from
    # nodes whose results carry the selection: the weights a router reads off them (the top-k
    # values, a gather of the scores at each argmax) depend on these, not on the anchor itself
    sources: tuple[fx.Node, ...]

    def ids(self) -> fx.Node | None:
        """The node holding the [.., K] expert ids."""
        return ops.topk_output(self.node, 1) if self.kind == "topk" else self.node


def routing_anchors(index: GraphIndex) -> list[Anchor]:
    anchors: list[Anchor] = []
    for n in index.nodes:
        if ops.is_topk(n):
            scores = n.args[0] if n.args else n.kwargs.get("input")
            if isinstance(scores, fx.Node):
                anchors.append(Anchor(n, "topk", ops.topk_k(n), scores, (n,)))
            continue
        found = _argmax_selection(n) or _sort_selection(n) or _table_selection(n)
        if found is not None:
            anchors.append(found)
    # an argmax inside a cat of argmaxes is part of that selection
    inner = {p for a in anchors if a.kind == "argmax" and ops.op_name(a.node) != "argmax"
             for p in (a.node.args[0] if isinstance(a.node.args[0], list | tuple) else ())}
    return [a for a in anchors if a.node not in inner]


def _is_ids(n: fx.Node) -> bool:
    t = tensor_meta(n)
    return t is not None and t.dtype in (torch.int64, torch.int32) and t.dim() >= 1


def _is_scores(n: object) -> bool:
    t = tensor_meta(n) if isinstance(n, fx.Node) else None
    return t is not None and t.dtype.is_floating_point and t.dim() >= 1


def _last_dim(n: fx.Node) -> int | None:
    shape = static_shape(n)
    return shape[-1] if shape else None


def _argmax_of(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(scores, the max/argmax call) when ``n`` is the [.., 1] index of the largest score along
    the last dim: argmax(s, -1, keepdim=True), max(s, -1, keepdim=True)[1], or either without
    keepdim followed by unsqueeze(-1)."""
    if ops.op_name(n) == "unsqueeze" and n.args[1:2] == (-1,) and isinstance(n.args[0], fx.Node):
        return _argmax_call(n.args[0], keepdim=False)
    return _argmax_call(n, keepdim=True)


def _argmax_call(n: fx.Node, keepdim: bool) -> tuple[fx.Node, fx.Node] | None:
    call = n
    if n.op == "call_function" and n.target is operator.getitem and n.args[1] == 1 and isinstance(n.args[0], fx.Node):
        call = n.args[0]
        if ops.op_name(call) != "max":
            return None
    elif ops.op_name(n) != "argmax":
        return None
    src = call.args[0] if call.args else None
    dim = call.kwargs.get("dim", call.args[1] if len(call.args) > 1 else None)
    kd = call.kwargs.get("keepdim", call.args[2] if len(call.args) > 2 else False)
    if not isinstance(src, fx.Node) or not _is_scores(src) or not _is_last(dim, src) or bool(kd) != keepdim:
        return None
    return src, call


def _is_last(dim: object, n: fx.Node) -> bool:
    t = tensor_meta(n)
    return t is not None and dim in (-1, t.dim() - 1)


def _argmax_selection(n: fx.Node) -> Anchor | None:
    """cat/concat/stack of argmaxes along the last dim (or a single argmax): K experts chosen one
    at a time from scores of the same E."""
    if ops.op_name(n) in ("cat", "concat", "concatenate") and n.args and isinstance(n.args[0], list | tuple):
        dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
        parts = [_argmax_of(p) if isinstance(p, fx.Node) else None for p in n.args[0]]
        t = tensor_meta(n)
        if not parts or any(p is None for p in parts) or t is None or dim not in (-1, t.dim() - 1):
            return None
    elif _is_ids(n) and _argmax_of(n) is not None and _last_dim(n) == 1:
        parts = [_argmax_of(n)]
    else:
        return None
    found = [p for p in parts if p is not None]
    widths = {_last_dim(s) for s, _ in found}
    if len(widths) != 1 or None in widths:
        return None
    return Anchor(n, "argmax", len(found), found[0][0], tuple(call for _, call in found))


def _sort_selection(n: fx.Node) -> Anchor | None:
    """The first K of the ids sorted by descending score: sort(s, -1, descending=True)[1][..., :K]
    or argsort(s, -1, descending=True)[..., :K]."""
    if not (n.op == "call_function" and n.target is operator.getitem and _is_ids(n)):
        return None
    src, idx = n.args[0], n.args[1]
    if not isinstance(src, fx.Node) or not isinstance(idx, tuple) or not idx or not isinstance(idx[-1], slice):
        return None
    lead, last = idx[:-1], idx[-1]
    if not all(i is Ellipsis or i == slice(None) for i in lead) or last.start not in (None, 0) or \
            last.step not in (None, 1) or not isinstance(last.stop, int):
        return None
    call = src
    if src.op == "call_function" and src.target is operator.getitem and src.args[1] == 1 \
            and isinstance(src.args[0], fx.Node):
        call = src.args[0]
        if ops.op_name(call) != "sort":
            return None
    elif ops.op_name(src) != "argsort":
        return None
    scores = call.args[0] if call.args else None
    dim = call.kwargs.get("dim", call.args[1] if len(call.args) > 1 else -1)
    descending = call.kwargs.get("descending", call.args[2] if len(call.args) > 2 else False)
    if not isinstance(scores, fx.Node) or not _is_scores(scores) or not descending or not _is_last(dim, scores):
        return None
    return Anchor(n, "sort", _last_dim(n), scores, (call,))


_INT_CASTS = ("long", "int", "to")


def _table_selection(n: fx.Node) -> Anchor | None:
    """Expert ids looked up in a fixed integer table by token ids (``table[ids].long()``) whose
    weights are router scores gathered at them; the scores are the anchor's, for its router."""
    src = n
    if ops.op_name(n) in _INT_CASTS and n.args and isinstance(n.args[0], fx.Node):
        src = n.args[0]
    elif any(ops.op_name(u) in _INT_CASTS and _is_ids(u) for u in n.users):
        return None  # the cast is the anchor: the experts read the ids in its dtype
    table = src.args[0] if src.op == "call_function" and src.target is operator.getitem else None
    key = src.args[1] if table is not None else None
    if not (_is_ids(n) and isinstance(table, fx.Node) and table.op in ("placeholder", "get_attr") and _is_ids(table)
            and isinstance(key, fx.Node) and _is_ids(key)):
        return None
    for u in n.users:  # weights = scores.gather(-1, ids)
        if ops.op_name(u) == "gather" and len(u.args) >= 3 and u.args[2] is n and _is_scores(u.args[0]):
            scores = u.args[0]
            assert isinstance(scores, fx.Node)
            return Anchor(n, "table", _last_dim(n), scores, (n,))
    return None


__all__ = ["Anchor", "routing_anchors"]
