"""Read an expert activation that is more than one op off the graph, as an expression.

GPT-OSS clamps its gate and up pre-activations, scales the gate inside a sigmoid and adds 1 to
up; NemotronH squares a ReLU; Inkling-2 soft-caps both halves with tanh. None of these is
``act(gate) * up`` for one named ``act``, and each op of them would leave the layer unaccounted
for (``account.py``). This module writes what the experts compute between their projections as
an ``expr:`` activation (``lowering/activation.py``) for one expert layout, so the expert op
computes the same function and ``account`` can name every op of it as part of the activation.

    for each matmul of the layout's down projection:          (one per expert in a loop)
        h <- its operand that carries the expert values
        Step 1: walk back from h through elementwise ops (the grammar of lowering/activation.py:
                clamp, sigmoid, tanh, ..., +-*/ with numbers), casts and views that keep the
                last dim, to the leaves
        Step 2: a leaf is a projection's output (a matmul with the up or gate weights, its bias
                added), or columns of it (chunk, split, narrow, [..., a:b:c]); the layout says
                which columns are g and which u (a fused gate_up: halves, or even/odd columns)
    Step 3: every down matmul must read the same expression; one that is ``act(g) * u`` or
            ``act(u)`` for a named act is left to the named activations (None)

Refuses (returns None) anything else on the way: an op outside the grammar, a view that moves
columns, a leaf that is not the layout's gate or up, or expressions that differ between experts.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from moe_compile.lowering.activation import UNARY, Expr, spec
from moe_compile.lowering.experts_ref import ACTIVATIONS
from moe_compile.passes import op_kinds as ops
from moe_compile.passes.graph_index import GraphIndex, example_value, tensor_meta
from moe_compile.passes.regions import ExpertLayout, WeightRole

_CASTS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone"}
_BINARY = {"mul": "mul", "mul_": "mul", "add": "add", "add_": "add", "sub": "sub", "sub_": "sub", "div": "div",
           "div_": "div", "truediv": "div", "true_divide": "div", "rsub": "rsub"}
_UNARY_NAMES = {"tanh": "tanh", "tanh_": "tanh", "exp": "exp", "neg": "neg", "square": "square"}


@dataclass(frozen=True)
class Found:
    """An expression activation and the graph nodes that compute it (every copy in a loop)."""

    activation: str
    nodes: frozenset[fx.Node]


@dataclass(frozen=True)
class _Cols:
    """Columns start, start + step, ... (count of them) of a projection's output."""

    start: int
    step: int
    count: int

    def pick(self, start: int, step: int, count: int) -> _Cols:
        return _Cols(self.start + self.step * start, self.step * step, count)


def expression_activation(index: GraphIndex, nodes: set[fx.Node], layout: ExpertLayout,
                          token_root: fx.Node) -> Found | None:
    """The expression ``layout``'s experts compute, if it is not a named activation; else None."""
    reader = _Reader(index, nodes, layout, token_root)
    down = set(layout.down.nodes)
    texts: set[str] = set()
    for n in index.ordered(nodes):
        if not ops.is_matmul(n):
            continue
        h = reader.operand(n, down)
        if h is None:
            continue
        tree = reader.expr(h)
        if tree is None:
            return None
        texts.add(spec(tree))
    if len(texts) != 1:
        return None
    text = texts.pop()
    tree = reader.trees[text]
    if _named(tree, layout.gated) or "u" not in _vars(tree) or (layout.gated != ("g" in _vars(tree))):
        return None
    return Found(text, frozenset(reader.visited))


class _Reader:
    def __init__(self, index: GraphIndex, nodes: set[fx.Node], layout: ExpertLayout, token_root: fx.Node) -> None:
        self.index, self.nodes, self.layout, self.token_root = index, nodes, layout, token_root
        self.visited: set[fx.Node] = set()
        self.trees: dict[str, Expr] = {}
        self.memo: dict[fx.Node, Expr | None] = {}
        self.roles: dict[fx.Node, WeightRole] = {}
        for r in (layout.up, layout.gate):
            if r is not None:
                self.roles.update({n: r for n in r.nodes})
        self.biases = {n for r in (layout.b_up, layout.b_gate) if r is not None for n in r.nodes}

    def _from_tokens(self, n: fx.Node) -> bool:
        return any(self.index.value_root(a) is self.token_root for a in self.index.ancestors([n]))

    def operand(self, mm: fx.Node, weights: set[fx.Node]) -> fx.Node | None:
        """The expert-value operand of a matmul with one of ``weights`` as its other operand."""
        # the two matrices: not linear's bias, grouped_mm's offsets or einsum's equation
        given = mm.args[1:3] if ops.is_einsum(mm) else mm.args[:2]
        args = [a for a in given if isinstance(a, fx.Node)]
        if len(args) != 2:
            return None
        for w, x in ((args[0], args[1]), (args[1], args[0])):
            if self.index.ancestors([w]) & weights and self._from_tokens(x):
                return x
        return None

    def expr(self, h: fx.Node) -> Expr | None:
        tree = self._expr(h)
        if tree is not None:
            self.trees.setdefault(spec(tree), tree)
        return tree

    def _expr(self, n: fx.Node) -> Expr | None:
        if n in self.memo:
            return self.memo[n]
        self.memo[n] = None  # a cycle cannot happen in a DAG; this only stops a repeated failure early
        out = self._build(n)
        self.memo[n] = out
        return out

    def _build(self, n: fx.Node) -> Expr | None:
        if n not in self.nodes:
            return None
        leaf = self._leaf(n)
        if leaf is not None:
            return leaf
        name = _name(n)
        if name in _CASTS or (name in ops.SHAPE_VIEWS and _same_last_dim(n)):
            return self._expr(n.args[0]) if isinstance(n.args[0], fx.Node) else None
        act = ops.activation_of(n)
        unary = act if act in UNARY else _UNARY_NAMES.get(name)
        if unary is not None:
            if len(n.args) < 1 or not isinstance(n.args[0], fx.Node) or (act is None and len(n.args) > 1):
                return None
            x = self._expr(n.args[0])
            return self._op(n, (unary, x)) if x is not None else None
        if name in ("clamp", "clip", "clamp_min", "clamp_max"):
            return self._clamp(n, name)
        if name in ("pow", "__pow__"):
            c = _num(n.args[1] if len(n.args) > 1 else n.kwargs.get("exponent"))
            x = self._expr(n.args[0]) if isinstance(n.args[0], fx.Node) else None
            if x is None or c is None:
                return None
            return self._op(n, ("square", x) if c == 2.0 else ("pow", x, c))
        if name in _BINARY and len(n.args) == 2 and not n.kwargs:
            a, b = (self._operand_expr(v) for v in n.args)
            if a is None or b is None or (isinstance(a, float) and isinstance(b, float)):
                return None
            op = _BINARY[name]
            if op == "rsub":  # torch.rsub(x, c) = c - x
                op, a, b = "sub", b, a
            return self._op(n, (op, a, b))
        return None

    def _operand_expr(self, v: object) -> Expr | None:
        if isinstance(v, fx.Node):
            return self._expr(v)
        return _num(v)

    def _clamp(self, n: fx.Node, name: str) -> Expr | None:
        x = self._expr(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
        rest = list(n.args[1:])
        if name == "clamp_min":
            lo, hi = (rest[0] if rest else n.kwargs.get("min")), None
        elif name == "clamp_max":
            lo, hi = None, (rest[0] if rest else n.kwargs.get("max"))
        else:
            lo = rest[0] if rest else n.kwargs.get("min")
            hi = rest[1] if len(rest) > 1 else n.kwargs.get("max")
        bounds = [None if v is None else _num(v) for v in (lo, hi)]
        if x is None or (lo is not None and bounds[0] is None) or (hi is not None and bounds[1] is None) \
                or bounds == [None, None]:
            return None
        return self._op(n, ("clamp", x, *bounds))

    def _op(self, n: fx.Node, tree: tuple) -> Expr:
        self.visited.add(n)
        return tree

    def _leaf(self, n: fx.Node) -> str | None:
        """``g`` or ``u`` when ``n`` holds (columns of) the gate or up projection's output."""
        cols: list[tuple[int, int, int]] = []
        m: object = n
        while isinstance(m, fx.Node) and m in self.nodes:
            if ops.is_matmul(m):
                return self._variable(m, cols)
            name = _name(m)
            picked = _columns(m)
            if picked is not None:
                cols.append(picked)
                m = _source(m)
            elif name in _CASTS or (name in ops.SHAPE_VIEWS and _same_last_dim(m)):
                m = m.args[0]
            elif ops.is_add(m) and len(m.args) == 2 and all(isinstance(a, fx.Node) for a in m.args):
                # a projection's bias: continue on the operand that carries the expert values
                # (the bias is gathered by expert ids, which derive from the tokens too: tell the
                # two apart by the bias parameter, not by the tokens)
                bias = [a for a in m.args if self.index.ancestors([a]) & self.biases]  # type: ignore[list-item]
                if len(bias) != 1:
                    return None
                m = m.args[1] if m.args[0] is bias[0] else m.args[0]
            else:
                return None
        return None

    def _variable(self, mm: fx.Node, cols: list[tuple[int, int, int]]) -> str | None:
        roles = {self.roles[w] for w in self.index.ancestors(mm.all_input_nodes) if w in self.roles}
        if len(roles) != 1:
            return None
        role = roles.pop()
        lay, ffn = self.layout, self.layout.ffn_size
        # the projection's output columns (not its last dim: bmm(W, x[..., None]) ends in a 1)
        sel = _Cols(0, 1, 2 * ffn if lay.fused_gate else ffn)
        for start, step, count in reversed(cols):
            sel = sel.pick(start, step, count)
        if lay.fused_gate is None:
            if sel != _Cols(0, 1, ffn):
                return None
            return "g" if role is lay.gate else "u" if role is lay.up else None
        halves = {"gate_first": (_Cols(0, 1, ffn), _Cols(ffn, 1, ffn)),
                  "up_first": (_Cols(ffn, 1, ffn), _Cols(0, 1, ffn)),
                  "interleaved": (_Cols(0, 2, ffn), _Cols(1, 2, ffn))}[lay.fused_gate]
        if role is not lay.up:
            return None
        return "g" if sel == halves[0] else "u" if sel == halves[1] else None


def _name(n: fx.Node) -> str:
    if n.op == "call_function" and n.target is operator.getitem:
        return "getitem"
    return ops.op_name(n)


def _num(v: object) -> float | None:
    """A Python number argument as a float; None for anything else (a tensor, a bool)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _source(n: fx.Node) -> fx.Node | None:
    """The tensor a column selection reads (through chunk's / split's tuple)."""
    src = n.args[0] if n.args else None
    if isinstance(src, fx.Node) and _name(n) == "getitem" and _name(src) in ("chunk", "split"):
        src = src.args[0]
    return src if isinstance(src, fx.Node) else None


def _same_last_dim(n: fx.Node) -> bool:
    """A view that keeps the columns where they are: a (un)squeeze (``bmm``'s trailing 1), or a
    reshape that keeps the last dim."""
    if _name(n) in ("squeeze", "unsqueeze"):
        return True
    src = n.args[0] if n.args else None
    a, b = _last_dim(n), _last_dim(src) if isinstance(src, fx.Node) else None
    return a is not None and a == b


def _last_dim(n: fx.Node) -> int | None:
    """The last dim's size (a per-expert loop's rows are data-dependent, its columns are not)."""
    t = tensor_meta(n)
    if t is None or not t.dim() or not isinstance(t.shape[-1], int):
        return None
    return int(t.shape[-1])


def _columns(n: fx.Node) -> tuple[int, int, int] | None:
    """(start, step, count) of the last-dim columns ``n`` selects from its source, or None when it
    is not a selection of last-dim columns only."""
    name = _name(n)
    src = n.args[0] if n.args else None
    if not isinstance(src, fx.Node):
        return None
    if name == "getitem" and _name(src) in ("chunk", "split") and isinstance(n.args[1], int):
        whole = tensor_meta(src.args[0]) if isinstance(src.args[0], fx.Node) else None
        parts = example_value(src)
        dim = src.kwargs.get("dim", src.args[2] if len(src.args) > 2 else 0)
        if whole is None or not isinstance(parts, tuple | list) or dim not in (-1, whole.dim() - 1):
            return None
        sizes = [int(p.shape[-1]) for p in parts]
        i = n.args[1]
        return sum(sizes[:i]), 1, sizes[i]
    t, cols, out = tensor_meta(src), _last_dim(src), _last_dim(n)
    if t is None or cols is None or out is None:
        return None
    if name == "narrow" and len(n.args) == 4:
        _, dim, start, length = n.args
        if dim in (-1, t.dim() - 1) and isinstance(start, int) and isinstance(length, int):
            return start, 1, length
        return None
    if name == "getitem" and isinstance(n.args[1], tuple):
        idx = n.args[1]
        if not idx or not isinstance(idx[-1], slice):
            return None
        lead = idx[:-1]
        full = all(i is Ellipsis or i == slice(None) for i in lead)
        if not full or (Ellipsis not in lead and len(idx) != t.dim()):
            return None
        start, _, step = idx[-1].indices(cols)
        if step <= 0:
            return None
        return start, step, out
    return None


def _vars(e: Expr | None) -> set[str]:
    if isinstance(e, str):
        return {e}
    if isinstance(e, tuple):
        return set().union(*(_vars(a) for a in e[1:]))
    return set()


def _named(tree: Expr, gated: bool) -> bool:
    """``act(g) * u`` (either order, or with g and u swapped) or ``act(u)`` for act in ACTIVATIONS:
    the named activations already compute these, and their hypotheses already exist."""
    def act_of(e: Expr, var: str) -> bool:
        return e == var or (isinstance(e, tuple) and len(e) == 2 and e[0] in ACTIVATIONS and e[1] == var)

    if not gated:
        return act_of(tree, "u")
    if isinstance(tree, tuple) and tree[0] == "mul":
        a, b = tree[1], tree[2]
        # act(u) * g too: the named activation on the layout with gate and up swapped
        return any((act_of(a, x) and b == y) or (act_of(b, x) and a == y) for x, y in (("g", "u"), ("u", "g")))
    return False


__all__ = ["Found", "expression_activation"]
