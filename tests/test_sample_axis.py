"""The sample-axis rules of passes/sample_axis.py (``out_axis``) against what the ops compute:
chains of shape ops, reductions and pointwise ops drawn by hypothesis run on a tensor whose every
element holds its sample's index; wherever the rules say the samples sit in dim a of the result,
slice b of dim a must hold sample b alone."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from moe_compile.passes.sample_axis import out_axis

B = 3  # samples
SHAPE = (B, 4, 5, 2)


def _op(draw: Any, ndim: int) -> tuple[str, Any, int]:
    """One op on a value of ``ndim`` dims: (kind, argument, the result's ndim)."""
    kind = draw(st.sampled_from(["permute", "transpose", "unsqueeze", "getitem", "sum", "flip", "mul_row", "add_bcast",
                                 "softmax", "flatten_tail", "cumsum"] if ndim > 1 else ["unsqueeze", "mul_row"]))
    if kind == "permute":
        return kind, draw(st.permutations(list(range(ndim)))), ndim
    if kind == "transpose":
        return kind, (draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1))), ndim
    if kind == "unsqueeze":
        return kind, draw(st.integers(-ndim - 1, ndim)), ndim + 1
    if kind == "getitem":
        items: list[Any] = []
        out = ndim
        for _ in range(draw(st.integers(1, ndim))):
            item = draw(st.sampled_from(["all", "int", "slice", "none"]))
            items.append({"all": slice(None), "int": 0, "slice": slice(0, 1), "none": None}[item])
            out += {"all": 0, "int": -1, "slice": 0, "none": 1}[item]
        if draw(st.booleans()):
            items.insert(0, Ellipsis)
        return kind, tuple(items), out
    if kind in ("sum", "softmax", "cumsum", "flip"):
        d = draw(st.integers(-ndim, ndim - 1))
        return kind, d, ndim - 1 if kind == "sum" else ndim
    if kind == "flatten_tail":
        return kind, None, ndim - 1
    return kind, None, ndim


@st.composite
def chains(draw: Any) -> list[tuple[str, Any, int]]:
    ndim, out = len(SHAPE), []
    for _ in range(draw(st.integers(1, 4))):
        kind, arg, ndim = _op(draw, ndim)
        out.append((kind, arg, ndim))
        if ndim < 1:
            break
    return out


def _build(chain: list[tuple[str, Any, int]]) -> tuple[fx.GraphModule, list[fx.Node]]:
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")  # a weight: its first entry broadcast along every dim
    nodes, cur = [], x
    for kind, arg, _ in chain:
        if kind == "permute":
            cur = g.call_method("permute", (cur, *arg))
        elif kind == "transpose":
            cur = g.call_method("transpose", (cur, *arg))
        elif kind == "unsqueeze":
            cur = g.call_method("unsqueeze", (cur, arg))
        elif kind == "getitem":
            cur = g.call_function(operator.getitem, (cur, arg))
        elif kind == "sum":
            cur = g.call_method("sum", (cur, arg))
        elif kind == "softmax":
            cur = g.call_method("softmax", (cur, arg))
        elif kind == "cumsum":
            cur = g.call_method("cumsum", (cur, arg))
        elif kind == "flip":
            cur = g.call_method("flip", (cur, [arg]))
        elif kind == "flatten_tail":
            cur = g.call_method("flatten", (cur, -2))
        elif kind == "mul_row":
            cur = g.call_function(operator.mul, (cur, cur))
        else:  # add_bcast: a [1] weight
            last = g.call_function(operator.getitem, (w, (slice(0, 1),)))
            cur = g.call_function(operator.add, (cur, last))
        nodes.append(cur)
    g.output(cur)
    return fx.GraphModule(torch.nn.Module(), g), nodes


@settings(max_examples=150, deadline=None)
@given(chains())
def test_where_the_rules_see_the_samples_they_are(chain: list[tuple[str, Any, int]]) -> None:
    """Sample-wise means: changing sample b of the input changes only block b (along the claimed
    axis) of the result."""
    gm, nodes = _build(chain)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=gen)
    w = torch.randn(SHAPE[-1], dtype=torch.float64, generator=gen)
    try:
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x, w)
    except Exception:
        return  # an invalid chain (a dim out of range after a shape change)
    for n in gm.graph.nodes:
        if "val" in n.meta:
            n.meta["example_value"] = n.meta["val"]
    axes = {next(iter(gm.graph.nodes)): 0}
    for node in nodes:
        axis = out_axis(node, axes, B)
        if axis is None:
            return  # the rules lose the samples here: nothing is claimed from here on
        axes[node] = axis
        prefix = _prefix(gm, node)
        out = prefix(x, w)
        assert out.shape[axis] % B == 0, (chain, node, axis, out.shape)
        per = out.shape[axis] // B
        for b in range(B):
            moved = x.clone()
            moved[b] += 1.0 + torch.rand(SHAPE[1:], dtype=torch.float64, generator=gen)
            diff = (prefix(moved, w) != out)
            outside = torch.cat([diff.narrow(axis, 0, b * per), diff.narrow(axis, (b + 1) * per, (B - b - 1) * per)],
                                dim=axis)
            assert not bool(outside.any()), (chain, node, axis, b)


def _prefix(gm: fx.GraphModule, last: fx.Node) -> fx.GraphModule:
    """``gm`` up to ``last``, returning it."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            break
        env[n] = g.node_copy(n, lambda a: env[a])
        if n is last:
            break
    g.output(env[last])
    return fx.GraphModule(gm, g)
