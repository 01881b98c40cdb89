"""Which FX ops are sample-wise, and where their results hold the samples (for
``passes.sample_placement``): a per-sample value holds B samples along one dim (its sample axis:
dim 0 of the residual stream, dim 1 of attention's [3, B, h, S, d] after a permute); an op is
sample-wise when sample b of its result reads only sample b of its per-sample inputs, every other
operand broadcast along the samples or a weight. ``out_axis`` follows the axis through views and
reshapes, permutes and transposes, indexing, reductions and normalisations over other dims,
concatenation and splits, linear / matmul / bmm, attention with its mask, embeddings and padding,
pointwise ops with broadcasting, and the hiermoe expert ops (token-wise); anything else is taken to
mix samples (None). tests/test_sample_axis.py checks the claims against what the ops compute.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from moe_compile.passes.graph_index import example_value

_POINTWISE = frozenset("""
add sub subtract mul multiply div divide true_divide floor_divide remainder fmod neg negative abs pow rsqrt sqrt
exp exp2 expm1 log log1p log2 sigmoid tanh relu gelu silu mish softplus elu leaky_relu erf sin cos tan clamp clip
clamp_min clamp_max maximum minimum where masked_fill lerp reciprocal square sign floor ceil round trunc logical_and
logical_or logical_not logical_xor eq ne lt le gt ge isnan isinf isfinite nan_to_num float half bfloat16 double int
long bool to type type_as contiguous clone detach zeros_like ones_like full_like empty_like dropout add_ mul_ div_
sub_ masked_fill_ relu_ addcmul addcdiv hardtanh hardsigmoid hardswish alias sigmoid_ tanh_ pow_ neg_ clamp_ copy_
fill_ zero_
""".split())
_OPERATORS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                        operator.pow, operator.neg, operator.pos, operator.abs, operator.invert, operator.and_,
                        operator.or_, operator.xor, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
                        operator.ge, operator.iadd, operator.isub, operator.imul, operator.itruediv})
# reductions and normalisations along one dim: sample-wise unless that dim is 0 (dim position, default)
_ALONG_DIM = {"sum": (1, None), "mean": (1, None), "amax": (1, None), "amin": (1, None), "prod": (1, None),
              "std": (1, None), "var": (1, None), "logsumexp": (1, None), "softmax": (1, None),
              "log_softmax": (1, None), "cumsum": (1, None), "cumprod": (1, None), "argmax": (1, None),
              "argmin": (1, None), "any": (1, None), "all": (1, None), "norm": (2, None),
              "topk": (2, -1), "sort": (1, -1), "argsort": (1, -1), "glu": (1, -1), "normalize": (2, 1),
              "chunk": (2, 0), "split": (2, 0), "unbind": (1, 0), "select": (1, None), "narrow": (1, None),
              "cat": (1, 0), "concat": (1, 0), "concatenate": (1, 0), "stack": (1, 0), "flip": (1, None),
              "roll": (2, None), "repeat_interleave": (2, None), "scatter": (1, None), "scatter_": (1, None),
              "scatter_add": (1, None), "scatter_add_": (1, None), "gather": (1, None)}
_INDEXED = frozenset({"scatter", "scatter_", "scatter_add", "scatter_add_", "gather"})
_TRAILING = frozenset({"layer_norm", "rms_norm", "group_norm", "embedding", "linear", "pad", "scaled_dot_product_attention"})
_RESHAPE = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "expand", "expand_as",
                      "unsqueeze", "squeeze", "repeat"})
_DIM_MOVES = frozenset({"transpose", "swapaxes", "permute", "movedim", "mT"})
_NEUTRAL = frozenset({"size", "dim", "numel", "ndimension", "is_contiguous", "get_device"})
# a new tensor of constants (its input gives dtype and device): shaped like the input's samples it
# is per-sample (a buffer filled per sample), else no sample's value (Llama-4's x.new_ones(()))
_FACTORIES = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"})
_MATMUL = frozenset({"matmul", "bmm", "mm"})


def op_name(node: fx.Node) -> str | None:
    """The torch / functional / method name a node calls, or None for anything else."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and t.namespace == "hiermoe":
        return "hiermoe"
    name = getattr(t, "__name__", None)
    if name is None:
        return None
    for ns in (torch, F, torch._C._nn, torch.Tensor, torch.special):
        if getattr(ns, name, None) is t:
            return name
    return None


def _arg(node: fx.Node, pos: int, key: str, default: Any) -> Any:
    if key in node.kwargs:
        return node.kwargs[key]
    # call_method: args[0] is self; call_function: args[0] is the input too
    return node.args[pos] if len(node.args) > pos else default


def _ndim(v: object) -> int:
    return v.ndim if isinstance(v, torch.Tensor) else 0


def _dims(dim: Any, ndim: int) -> list[int] | None:
    """``dim`` (an int or a sequence of ints) normalized to 0..ndim-1; None when it is not one."""
    dims = list(dim) if isinstance(dim, list | tuple) else [dim]
    if not ndim or not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    return [d % ndim for d in dims]


NOT_TENSOR = -1  # the axis of a sample-wise op's result that is not a tensor (a size)
Axes = dict[fx.Node, int]  # per-sample value -> the dim that holds its samples


def _getitem_axis(idx: Any, ndim: int, axis: int) -> int | None:
    """The sample axis of ``x[idx]`` (x's at ``axis``), or None where the index touches it."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, fx.Node | torch.Tensor | list) for i in items):
        return None  # advanced indexing
    consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    i = o = 0
    for item in items:
        if item is Ellipsis:
            span = ndim - consuming
            if i <= axis < i + span:
                return o + axis - i
            i, o = i + span, o + span
        elif item is None:
            o += 1
        elif isinstance(item, int):
            if i == axis:
                return None
            i += 1
        elif isinstance(item, slice):
            if i == axis:
                return o if item == slice(None) else None
            i, o = i + 1, o + 1
        else:
            return None
    return o + axis - i if axis >= i else None


def out_axis(node: fx.Node, axes: Axes, samples: int) -> int | None:
    """The sample axis of ``node``'s result when its sample b reads only sample b of its per-sample
    inputs (``axes``: where each holds its samples; every other operand broadcast along it or a
    weight), NOT_TENSOR for a size; None when the op may mix samples."""
    name = op_name(node)
    if name is None and node.op == "call_function" and node.target in _OPERATORS:
        name = "add"  # operator.add & co: pointwise
    if name is None:
        return None
    out = example_value(node)
    x = node.args[0] if node.args else None
    xa = axes.get(x) if isinstance(x, fx.Node) else None
    x_val = example_value(x) if isinstance(x, fx.Node) else None
    nd = _ndim(x_val)
    if name in _NEUTRAL:
        return NOT_TENSOR
    if name in _FACTORIES:
        like = isinstance(out, torch.Tensor) and isinstance(x_val, torch.Tensor) and xa is not None \
            and out.ndim > xa and tuple(out.shape[:xa + 1]) == tuple(x_val.shape[:xa + 1])
        return xa if like else NOT_TENSOR
    if name == "hiermoe":
        return 0 if xa == 0 else None  # the expert ops are token-wise
    if name == "getitem" and not isinstance(x_val, torch.Tensor):
        return xa  # an element of a tuple (topk's values, a split's piece)
    axis = _result_axis(node, name, x, xa, x_val, nd, axes, samples)
    if axis is None or axis == NOT_TENSOR:
        return axis
    vals = out if isinstance(out, tuple | list) else [out]
    for v in vals:  # every result holds a multiple of B along its axis
        if not isinstance(v, torch.Tensor) or not 0 <= axis < v.ndim or v.shape[axis] == 0 or v.shape[axis] % samples:
            return None
    return axis


def _result_axis(node: fx.Node, name: str, x: Any, xa: int | None, x_val: Any, nd: int, axes: Axes,
                 samples: int) -> int | None:
    out = example_value(node)
    if name == "getitem":
        return None if xa is None else _getitem_axis(node.args[1], nd, xa)
    if name in _POINTWISE:
        return _broadcast_axis(node, axes)
    if name in _ALONG_DIM:
        pos, default = _ALONG_DIM[name]
        if name in ("cat", "concat", "concatenate", "stack"):
            seq = node.args[0]
            if not isinstance(seq, list | tuple) or not seq or not all(isinstance(i, fx.Node) and i in axes for i in seq):
                return None
            a = {axes[i] for i in seq}  # type: ignore[index]
            first = example_value(seq[0])  # type: ignore[arg-type]
            if len(a) != 1:
                return None
            (a0,) = a
            d = _dims(_arg(node, 1, "dim", 0), _ndim(out))
            if d is None or (name != "stack" and d[0] == a0):
                return None
            return a0 + (1 if name == "stack" and d[0] <= a0 else 0) if isinstance(first, torch.Tensor) else None
        if xa is None:
            return None
        if name in _INDEXED and not all(axes.get(a) == xa for a in node.all_input_nodes
                                        if isinstance(example_value(a), torch.Tensor)):
            return None  # an index or source that is not per-sample alike
        key = "dims" if name in ("flip", "roll") else "dim"
        d = _dims(_arg(node, pos, key, default), nd)
        if d is None or xa in d:
            return None  # over every element, or along the samples
        if name in ("unbind", "select"):
            return xa - (1 if d[0] < xa else 0)
        out_nd = _ndim(out[0] if isinstance(out, tuple | list) else out)
        return xa if out_nd == nd else xa - sum(1 for i in d if i < xa)
    if name in _TRAILING:
        if name in ("embedding", "linear"):
            others = [a for a in [*node.args[1:], *node.kwargs.values()] if isinstance(a, fx.Node)]
            if xa is None or any(a in axes for a in others) or (name == "linear" and xa >= nd - 1):
                return None
            return xa
        if name == "scaled_dot_product_attention":
            qkv = [a for a in node.args[:3] if isinstance(a, fx.Node)]
            if len(qkv) != 3 or not all(a in axes for a in qkv) or len({axes[a] for a in qkv}) != 1 or xa is None \
                    or xa >= nd - 2:
                return None
            mask = _arg(node, 3, "attn_mask", None)
            if isinstance(mask, fx.Node):
                m = example_value(mask)
                if not isinstance(m, torch.Tensor):
                    return None
                j = xa - (nd - m.ndim)
                if mask in axes:
                    return xa if axes[mask] == j else None
                return xa if j < 0 or m.shape[j] == 1 else None
            return xa
        if xa is None:
            return None
        if name == "pad":
            pad = _arg(node, 1, "pad", ())
            return xa if isinstance(pad, list | tuple) and xa < nd - len(pad) // 2 else None
        if name == "group_norm":
            return xa if xa == 0 else None
        shape = _arg(node, 1, "normalized_shape", None)
        trailing = len(shape) if isinstance(shape, list | tuple) else 1
        return xa if xa < nd - trailing else None
    if name in _RESHAPE:
        if xa is None or not isinstance(out, torch.Tensor):
            return None
        if name == "unsqueeze":
            d = _dims(_arg(node, 1, "dim", None), out.ndim)
            return None if d is None else xa + (1 if d[0] <= xa else 0)
        if name == "squeeze":
            d = _dims(_arg(node, 1, "dim", None), nd)
            if d is None:
                return None if x_val.shape[xa] == 1 else xa - sum(1 for i in range(xa) if x_val.shape[i] == 1)
            return None if xa in d else xa - sum(1 for i in d if i < xa)
        if name in ("expand", "expand_as", "repeat"):
            lead = out.ndim - nd
            if name == "repeat":
                reps = node.args[1:] if len(node.args) > 2 or not isinstance(_arg(node, 1, "repeats", None), list | tuple) \
                    else _arg(node, 1, "repeats", ())
                return xa + lead if len(reps) == out.ndim and reps[xa + lead] == 1 else None
            return xa + lead if out.shape[xa + lead] == x_val.shape[xa] else None
        # view / reshape / flatten / unflatten: the dims before the samples unchanged, row-major order
        # keeps each (prefix, sample) block whole
        if tuple(out.shape[:xa]) == tuple(x_val.shape[:xa]) and out.ndim > xa and out.shape[xa] % samples == 0:
            return xa
        return None
    if name in ("view_as_complex", "view_as_real"):  # the trailing pair of reals <-> one complex (rotary embeddings)
        return None if xa is None or (name == "view_as_complex" and xa >= nd - 1) else xa
    if name in _DIM_MOVES:
        if xa is None:
            return None
        if name == "permute":
            dims = node.args[1:] if len(node.args) > 2 or not isinstance(_arg(node, 1, "dims", None), list | tuple) \
                else _arg(node, 1, "dims", ())
            order = _dims(list(dims), nd)
            return None if order is None else order.index(xa)
        if name == "mT":
            d0, d1 = nd - 2, nd - 1
        elif name == "movedim":
            src, dst = _dims(_arg(node, 1, "source", None), nd), _dims(_arg(node, 2, "destination", None), nd)
            if src is None or dst is None or len(src) != 1 or len(dst) != 1:
                return None
            order = [i for i in range(nd) if i != src[0]]
            order.insert(dst[0], src[0])
            return order.index(xa)
        else:
            pair = _dims([_arg(node, 1, "dim0", 0), _arg(node, 2, "dim1", 1)], nd)
            if pair is None:
                return None
            d0, d1 = pair
        return d1 if xa == d0 else d0 if xa == d1 else xa
    if name in _MATMUL or node.target is operator.matmul:
        b = node.args[1]
        b_val = example_value(b) if isinstance(b, fx.Node) else None
        if not isinstance(out, torch.Tensor) or not isinstance(b_val, torch.Tensor):
            return None
        ba = axes.get(b) if isinstance(b, fx.Node) else None
        if xa is not None and ba is not None:  # batched: the samples in a batch dim of both
            if xa >= nd - 2 or ba >= b_val.ndim - 2 or xa - nd != ba - b_val.ndim:
                return None
            return out.ndim - (nd - xa)
        if xa is not None and ba is None:
            if xa > nd - 2 or (b_val.ndim > 2 and b_val.ndim - (nd - xa) >= 0):
                return None  # the rows of a, or a batch dim the weight does not have
            return out.ndim - (nd - xa)
        return None
    return None


def _broadcast_axis(node: fx.Node, axes: Axes) -> int | None:
    """A pointwise op: the per-sample operands' samples on one axis of the result, every other
    operand of size 1 (or absent) there."""
    out = example_value(node)
    if not isinstance(out, torch.Tensor):
        return None
    found: set[int] = set()
    others = []
    for a in [*node.args, *node.kwargs.values()]:
        for n in (a if isinstance(a, list | tuple) else [a]):
            if not isinstance(n, fx.Node):
                continue
            v = example_value(n)
            if not isinstance(v, torch.Tensor):
                continue
            if n in axes:
                found.add(axes[n] + out.ndim - v.ndim)
            else:
                others.append(v)
    if len(found) != 1:
        return None
    (axis,) = found
    for v in others:
        j = axis - (out.ndim - v.ndim)
        if j >= 0 and v.shape[j] != 1:
            return None
    return axis


def sample_wise(node: fx.Node, axes: Axes, samples: int, rank_local: set[fx.Node]) -> bool:
    """Whether ``node``'s sample b reads only sample b of its per-sample inputs (``out_axis``). A
    tensor computed from the inputs that is not per-sample (a mean over the batch, a [1, S] input)
    differs between ranks: a sample that moved would meet another rank's, so an op reading one is
    not sample-wise."""
    if any(a in rank_local for a in node.all_input_nodes):
        return False
    return out_axis(node, axes, samples) is not None


RESHAPES = _RESHAPE

__all__ = ["NOT_TENSOR", "RESHAPES", "Axes", "op_name", "out_axis", "sample_wise"]
