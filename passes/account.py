"""account: every op a rewrite would remove must be one the expert op computes.

Numerical verification compares the layer with the expert op on sample inputs, and an op that
changes nothing on those inputs escapes it: a clamp whose limit the samples never reach, a
``relu`` on values that happen to be positive, a threshold on routing weights that no sample
crosses.  The layer would be reported verified and later batches would get other results.  So
before any numerical check, every node an interpretation replaces is accounted for by the role
it plays in ``hiermoe::experts`` (DESIGN.md, "A rewrite never changes what the model computes").

Contract
    Needs: a region from find_moe_regions, one of its interpretations (output candidate,
    expert layout, routing-weight source) and the nodes verification keeps (the ancestors of
    the routing weights, which the replacement recomputes as they are).
    Guarantees: ``unexplained_op`` returns None only when each replaced node is one of: data
    movement (views, indexing, copies, casts, allocation, writes); a matmul of expert values
    with expert weights or with a routing tensor (einsum dispatch/combine masks); the layout's
    activation (a named one, or every op of an ``expr:`` activation read off the graph by
    ``activation_expr``: GPT-OSS's clamps, scale and offset); a bias add; the gating product (gated layouts); a multiply by a routing tensor;
    a combine (sum, accumulating add, index_add / scatter_add); routing bookkeeping on expert
    ids (sorting, counting, one-hot, masks); zeroing expert values where a routing mask says
    (``where(mask, x, 0)``, ``masked_fill(x, mask, 0)``); arithmetic or comparisons with 0 on
    routing weights; and, only for an interpretation whose routing weights scale the experts'
    input (Llama-4, ``input_scaled``), the multiply of the input by them before the projections.
    Refuses: anything else on the expert values (a clamp, a constant scale or offset, another
    nonlinearity outside the layout's activation, a comparison of expert values) or on the routing weights (clamp, thresholds
    other than 0), and anything but data movement on expert weights before their matmul; the
    reason names the op and the source line that wrote it.

    for each replaced node, in program order:
        Step 1: its class, the first of its inputs' classes in this order:
            X: depends on the tokens          (the expert values)
            P: depends on expert weights       (views of the weights)
            B: depends on expert biases
            Q: depends on other float model state
            W: depends on routing-weight values (floats from the router)
            R: the rest (expert ids, shapes, allocation)
        Step 2: P, B, Q: data movement only; W: arithmetic too; R: anything (integers);
                X: the role table in ``_check``, by op and by the classes of the operands
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.fx as fx

from moe_compile.passes import op_kinds as ops
from moe_compile.passes.graph_index import GraphIndex, example_value, source_line
from moe_compile.passes.graph_params import ParamTable
from moe_compile.passes.regions import ExpertLayout, MoERegion, OutputCandidate, WeightRole

# Ops that only move, select, cast, allocate or write values: the result holds (copies of) input
# values or constants, whatever the values are.
_MOVES = frozenset({
    "view", "reshape", "permute", "transpose", "t", "T", "mT", "unsqueeze", "squeeze", "expand", "expand_as",
    "view_as", "reshape_as", "contiguous", "clone", "flatten", "unflatten", "narrow", "select", "getitem",
    "__getitem__", "index_select", "gather", "take_along_dim", "repeat", "repeat_interleave", "cat", "concat",
    "stack", "split", "chunk", "unbind", "movedim", "swapaxes", "to", "float", "half", "bfloat16", "double",
    "type", "type_as", "detach", "zeros", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty",
    "setitem", "index_put", "index_put_", "scatter", "scatter_", "index_copy", "index_copy_", "size", "dim",
    "numel", "sym_size", "getattr",
})
# Combines: sums over slots or experts into token rows.
_COMBINES = frozenset({"sum", "index_add", "index_add_", "scatter_add", "scatter_add_"})
_ARITH = frozenset({"mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_", "true_divide", "neg", "sum",
                    "reciprocal"})
_COMPARISONS = frozenset({"ne", "gt", "ge", "eq", "lt", "le", "__ne__", "__gt__", "__ge__", "__eq__", "__lt__",
                          "__le__"})
_OPERATOR_NAMES = {operator.mul: "mul", operator.imul: "mul_", operator.add: "add", operator.iadd: "add_",
                   operator.sub: "sub", operator.isub: "sub_", operator.truediv: "div", operator.itruediv: "div_",
                   operator.neg: "neg", operator.getitem: "getitem", operator.setitem: "setitem",
                   operator.ne: "ne", operator.gt: "gt", operator.ge: "ge", operator.eq: "eq", operator.lt: "lt",
                   operator.le: "le", operator.floordiv: "floordiv", operator.mod: "mod",
                   operator.matmul: "matmul", getattr: "getattr"}


def _name(n: fx.Node) -> str:
    if n.op == "call_function" and n.target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[n.target]  # type: ignore[index]
    name = ops.op_name(n)
    return name[:-1] if name.endswith("_") and name[:-1] in ("index_add", "scatter_add") else name


def _is_float(n: fx.Node) -> bool:
    v = example_value(n)
    items = v if isinstance(v, tuple | list) else (v,)
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in items)


def _role_nodes(roles: Iterable[WeightRole | None]) -> set[fx.Node]:
    return {n for r in roles if r is not None for n in r.nodes}


def describe(n: fx.Node) -> str:
    """``op`` and where the model wrote it."""
    where = source_line(n)
    at = f" at {where[0]}:{where[1]}: `{where[2]}`" if where else ""
    return f"`{_name(n) or n.target}`{at}"


class Unexplained(NamedTuple):
    reason: str
    node: fx.Node  # the op no role of the expert op accounts for
    # the op multiplies the experts' input by routing weights: an interpretation whose weights
    # scale the input (RoutingWeights.scales "input") may account for it
    scales_input: bool = False


def unexplained_op(index: GraphIndex, params: ParamTable, region: MoERegion, cand: OutputCandidate,
                   layout: ExpertLayout, keep: set[fx.Node], input_scaled: bool = False) -> Unexplained | None:
    """Why the interpretation does not account for some op the rewrite removes, or None.
    ``input_scaled``: the interpretation's routing weights scale the experts' input (Llama-4), so
    a multiply of the input by routing weights before the up/gate projections is its role."""
    replaced = [n for n in index.ordered(cand.nodes)
                if n not in params and n not in keep and n.op in ("call_function", "call_method", "call_module")]
    weights = _role_nodes((layout.up, layout.gate, layout.down))
    biases = _role_nodes((layout.b_up, layout.b_gate, layout.b_down))
    tokens = region.tokens
    cls: dict[fx.Node, str] = {}
    # what flows into the up/gate projections: the expert input, which no routing weight may scale
    inward = _role_nodes((layout.up, layout.gate))
    projections = [m for m in replaced if ops.is_matmul(m) and index.ancestors(m.all_input_nodes) & inward]
    before_projection = index.ancestors(projections)
    routed = region.routed(index)

    token_root = index.value_root(tokens)

    def of(a: object) -> str:
        """The class of an operand: X/P/B/W/R for nodes, 'c' for Python constants."""
        if not isinstance(a, fx.Node):
            return "c"
        if a in cls:
            return cls[a]
        if a in weights:
            return "P"
        if a in biases:
            return "B"
        if a in params:
            return "Q" if _is_float(a) else "R"  # Q: model state that is not an expert tensor of this layout
        if index.value_root(a) is token_root:
            return "X"
        # computed outside the replaced nodes: the router's floats (top-k values, scores, the
        # kept routing weights) are W, the rest (ids, sizes) R
        return "W" if _is_float(a) else "R"

    for n in replaced:
        # Step 1
        kinds = {of(d) for d in index.deps[n] if d is not n}
        c = next((k for k in ("X", "P", "B", "Q", "W") if k in kinds), "R")
        if c == "W" and not _is_float(n) and not _decides_on_weights(n):
            c = "R"  # e.g. topk's indices: a getitem of the (values, indices) tuple
        cls[n] = c
        # Step 2
        scaled_input = n in before_projection and any(a in routed and of(a) == "W" for a in n.all_input_nodes)
        if scaled_input and c == "X" and _name(n) in ("mul", "mul_") \
                and not any(isinstance(a, int | float) for a in _operands(n)):
            if input_scaled:
                continue  # the interpretation's own input scaling
            return Unexplained(f"{describe(n)} multiplies the experts' input by the routing weights; the expert "
                               "op weights their outputs, and FFN(w x) is not w FFN(x)", n, scales_input=True)
        why = _check(n, c, layout, of)
        if why:
            return Unexplained(why, n)
    return None


def _zeroed_by_routing_mask(n: fx.Node, of: Callable[[object], str]) -> bool:
    """``masked_fill(v, mask, 0)`` with a mask computed from routing (ids or weights)."""
    return (_name(n) in ("masked_fill", "masked_fill_") and len(n.args) == 3 and of(n.args[1]) in ("R", "W")
            and isinstance(n.args[2], int | float) and n.args[2] == 0)


def _decides_on_weights(n: fx.Node) -> bool:
    """A non-float result read from routing-weight values (not just carried along with them)."""
    return _name(n) not in ("getitem", "size", "sym_size", "getattr", "dim", "numel")


def _operands(n: fx.Node) -> list[object]:
    flat: list[object] = []
    for a in (*n.args, *n.kwargs.values()):
        flat.extend(a if isinstance(a, list | tuple) else (a,))
    return flat


def _check(n: fx.Node, c: str, layout: ExpertLayout, of: Callable[[object], str]) -> str | None:
    name = _name(n)
    what = describe(n)
    if c == "R":
        return None  # expert ids, sizes and allocation: the synthetic routings cover them
    if c in ("P", "B", "Q"):
        if name in _MOVES:
            return None
        what_state = {"P": "the expert weights", "B": "the expert biases", "Q": "model state"}[c]
        return f"{what} changes {what_state} before they are used"
    if c == "W":
        if name in _MOVES or name in _ARITH or ops.is_matmul(n):
            return None
        if name in _COMPARISONS and any(a == 0 for a in n.args[1:]):
            return None  # a routing weight of exactly 0 is an unrouted slot (capacity drops)
        if name in ("bool", "long", "int", "one_hot", "cumsum"):
            return None
        if _zeroed_by_routing_mask(n, of):
            return None  # unrouted (sentinel) slots get weight 0
        return f"{what} reads the routing weights in a way the expert op does not (it only multiplies by them)"
    # X: the expert values
    if n in layout.activation_nodes:
        return None  # an op of the layout's expr: activation, which the expert op computes as written
    classes = [of(a) for a in _operands(n) if isinstance(a, fx.Node)]
    consts = [a for a in _operands(n) if isinstance(a, int | float) and not isinstance(a, bool)]
    if "Q" in classes:
        return f"{what} mixes model state that is not an expert tensor into the expert values"
    if not _is_float(n):
        if name in _MOVES:
            return None
        return f"{what} makes a decision on the expert values"
    if name in _MOVES:
        return None
    if name == "where" and len(n.args) == 3 and of(n.args[0]) in ("R", "W") and all(a == 0 for a in consts):
        return None  # masked selection by routing
    if _zeroed_by_routing_mask(n, of):
        return None  # the same selection written as a fill (transformers' expert-parallel sentinel slots)
    if ops.is_matmul(n):
        if all(k == "X" for k in classes):
            return f"{what} multiplies expert values with each other"
        return None  # with expert weights, or with a dispatch/combine mask
    act = ops.activation_of(n)
    if act is not None:
        if act != layout.activation:
            return (f"{what} applies {act}, and the experts also apply {layout.activation}: the expert op "
                    "applies one activation")
        return None
    if name in ("mul", "mul_"):
        if consts:
            return f"{what} scales the expert values by {consts[0]}"
        if classes.count("X") >= 2:
            return None if layout.gated else f"{what} multiplies expert values with each other"
        return None  # by a routing weight or mask
    if name in ("add", "add_", "sub", "sub_"):
        if consts:
            return f"{what} adds a constant to the expert values"
        if set(classes) <= {"X", "B"}:
            return None  # a bias, or the sum of expert outputs
        return f"{what} adds a value that is neither an expert output nor an expert bias"
    if name in _COMBINES:
        return None
    return f"{what} is not part of the expert computation (router, dispatch, expert FFN, combine)"


__all__ = ["Unexplained", "describe", "unexplained_op"]
