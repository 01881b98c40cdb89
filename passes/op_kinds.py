"""Recognizers for the operations MoE code is written with, in both call forms.

Dynamo records ``torch.topk(x, k)`` as a call_function and ``x.topk(k)`` as a call_method; both
(and the aten overloads, for graphs that were already lowered) must be recognized alike.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F


def _name(node: fx.Node) -> str:
    """A normalized op name: method name, or function __name__ without namespace/overload."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return t._schema.name.split("::")[-1]
        if isinstance(t, torch._ops.OpOverloadPacket):
            return t._qualified_op_name.split("::")[-1]
        return getattr(t, "__name__", str(t))
    return ""


def op_name(node: fx.Node) -> str:
    return _name(node)


def qualified_op(node: fx.Node) -> str:
    """``namespace::name`` for torch.ops calls (e.g. ``transformers::grouped_mm_fallback``), else ''."""
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return t._schema.name if isinstance(t, torch._ops.OpOverload) else t._qualified_op_name
    return ""


def is_topk(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and _name(node) == "topk"


def topk_k(node: fx.Node) -> int | None:
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
    return k if isinstance(k, int) else None


def topk_output(topk: fx.Node, which: int) -> fx.Node | None:
    """The getitem node selecting values (0) or indices (1) of a topk call."""
    attr = ("values", "indices")[which]
    for u in topk.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[1] == which:
            return u
        if u.op == "call_function" and u.target is getattr and u.args[1] == attr:
            return u
    return None


_MATMULS = {"linear", "matmul", "mm", "bmm", "einsum", "addmm", "baddbmm", "__matmul__", "_grouped_mm",
            "grouped_mm", "grouped_mm_fallback"}


def is_matmul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.matmul) or (
        node.op in ("call_function", "call_method") and _name(node) in _MATMULS
    )


def matmul_bias(node: fx.Node) -> object:
    """The bias operand a matmul adds inside itself (``linear(x, w, b)``, ``addmm(b, x, w)``,
    ``baddbmm(b, x, w)``), None for any other node or a linear without one."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = _name(node)
    if name == "linear":
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if name in ("addmm", "baddbmm"):
        return node.args[0] if node.args else node.kwargs.get("input")
    return None


def is_grouped_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and _name(node) in ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")


# views that only reshape: the same elements in the same order (an expand of size-1 dims repeats them)
SHAPE_VIEWS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "view_as",
                         "reshape_as"})

# dtype casts and views that do not change which parameter a value is
_TRANSPARENT = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "t", "transpose",
                "permute", "view", "reshape", "contiguous", "detach", "T", "mT"}


def is_transparent(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("T", "mT")
    return node.op in ("call_function", "call_method") and _name(node) in _TRANSPARENT


def activation_of(node: fx.Node) -> str | None:
    """The canonical activation name computed by ``node``, if it is one."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    name = _name(node)
    if node.op == "call_function" and node.target is F.gelu:
        name = "gelu"
    if name in ("silu", "silu_"):
        return "silu"
    if name in ("relu", "relu_"):
        return "relu"
    if name == "gelu":
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "gelu_tanh" if approx == "tanh" else "gelu"
    if name == "sigmoid":
        return "sigmoid"
    return None


def is_softmax(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and _name(node) in ("softmax", "_softmax")


def is_sigmoid(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and _name(node) == "sigmoid"


def is_sum(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and _name(node) == "sum"


def is_div(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.truediv, operator.itruediv)) or (
        node.op in ("call_function", "call_method") and _name(node) in ("div", "div_", "true_divide")
    )


def is_mul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.mul, operator.imul)) or (
        node.op in ("call_function", "call_method") and _name(node) in ("mul", "mul_")
    )


def is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.add, operator.iadd)) or (
        node.op in ("call_function", "call_method") and _name(node) in ("add", "add_")
    )


def is_einsum(node: fx.Node) -> bool:
    return node.op == "call_function" and _name(node) == "einsum"


def is_index_add(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and _name(node) in (
        "index_add_", "index_add", "scatter_add_", "scatter_add", "index_put_", "index_put", "scatter_reduce_")
