"""Expert activations written as expressions: what ``hiermoe::experts`` computes between the
up/gate projections and the down projection when it is not ``act(gate) * up``.

Models clamp, scale, offset and soft-cap their expert activations in ways a fixed list of names
cannot follow: GPT-OSS computes ``h = (clamp(u, -L, L) + 1) * g' * sigmoid(a * g')`` with
``g' = min(g, L)`` over interleaved gate/up columns, NemotronH ``h = relu(u)^2``, Inkling-2
``h = c_g tanh(g / c_g) * sigmoid(g) * c_u tanh(u / c_u)``. The op's ``activation`` argument then
is ``"expr:" + expression``, the expression giving h from the slot's gate pre-activation ``g``
and up pre-activation ``u`` (non-gated experts: ``u`` only), in call form::

    expr:mul(add(clamp(u,-7.0,7.0),1.0),mul(clamp(g,None,7.0),sigmoid(mul(clamp(g,None,7.0),1.702))))

The finder (``passes/activation_expr.py``) writes the expression from the graph's own ops, and
this module evaluates it with the same torch ops, so the forward is computed exactly as the model
computes it; the backward applies each op's derivative in reverse (aten's backward formulas
where autograd uses them), a small reverse-mode pass over the expression tree. A shared
subexpression is written once per use, and its gradient contributions are summed.

Ops: unary ``sigmoid tanh silu relu gelu gelu_tanh exp neg square``, binary ``add sub mul div``
(either operand may be a number), ``pow(x, c)``, ``clamp(x, lo, hi)`` (lo or hi None).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

PREFIX = "expr:"
UNARY = ("sigmoid", "tanh", "silu", "relu", "gelu", "gelu_tanh", "exp", "neg", "square")
BINARY = ("add", "sub", "mul", "div")
VARIABLES = ("g", "u")

# an expression tree: a variable name, a float constant, or (op, args...) with clamp's bounds and
# pow's exponent as floats (None for an absent bound)
Expr = str | float | tuple


@dataclass(frozen=True)
class Activation:
    """A parsed ``expr:`` activation."""

    tree: Expr
    spec: str

    @property
    def variables(self) -> frozenset[str]:
        return _variables(self.tree)

    def forward(self, g: Tensor | None, u: Tensor) -> Tensor:
        return _eval(self.tree, {"g": g, "u": u}, {})

    def backward(self, grad: Tensor, g: Tensor | None, u: Tensor) -> tuple[Tensor | None, Tensor]:
        """(d h / d g, d h / d u) times ``grad``; None for g when the expression does not read it."""
        values: dict[int, Tensor | float] = {}
        env = {"g": g, "u": u}
        _eval(self.tree, env, values)
        grads: dict[str, Tensor] = {}
        _backprop(self.tree, grad, env, values, grads)
        d_u = grads.get("u")
        return grads.get("g"), d_u if d_u is not None else torch.zeros_like(u)


def is_expression(activation: str) -> bool:
    return activation.startswith(PREFIX)


@functools.lru_cache(maxsize=256)
def parse(activation: str) -> Activation:
    """The ``Activation`` of an ``expr:`` spec; ValueError saying what is wrong otherwise."""
    if not is_expression(activation):
        raise ValueError(f"not an expression activation: {activation!r}")
    text = activation[len(PREFIX):]
    tokens = re.findall(r"[A-Za-z_]+|-?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan)|[(),]", text)
    if "".join(tokens) != text.replace(" ", ""):
        raise ValueError(f"expression activation {activation!r}: unexpected characters")
    pos = 0

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"expression activation {activation!r}: ends early")
        pos += 1
        return tokens[pos - 1]

    def expr() -> Expr:
        tok = take()
        if tok in VARIABLES:
            return tok
        if tok == "None":
            raise ValueError(f"expression activation {activation!r}: None outside clamp")
        if re.fullmatch(r"-?(?:\d.*|inf|nan)", tok):
            return float(tok)
        if tok not in UNARY + BINARY + ("clamp", "pow"):
            raise ValueError(f"expression activation {activation!r}: unknown op {tok!r}")
        if take() != "(":
            raise ValueError(f"expression activation {activation!r}: '(' expected after {tok}")
        args: list[Expr | None] = []
        while True:
            if tok == "clamp" and args and tokens[pos] == "None":
                take()
                args.append(None)
            else:
                args.append(expr())
            sep = take()
            if sep == ")":
                break
            if sep != ",":
                raise ValueError(f"expression activation {activation!r}: ',' or ')' expected in {tok}")
        want = 1 if tok in UNARY else 3 if tok == "clamp" else 2
        if len(args) != want:
            raise ValueError(f"expression activation {activation!r}: {tok} takes {want} arguments")
        return (tok, *args)

    tree = expr()
    if pos != len(tokens):
        raise ValueError(f"expression activation {activation!r}: text after the expression")
    if "u" not in _variables(tree):
        raise ValueError(f"expression activation {activation!r} does not read the up projection u")
    return Activation(tree, activation)


def spec(tree: Expr) -> str:
    """The ``expr:`` text of a tree (floats in repr form, which reads back exactly)."""
    return PREFIX + _text(tree)


def _text(e: Expr | None) -> str:
    if e is None:
        return "None"
    if isinstance(e, str):
        return e
    if isinstance(e, float):
        return repr(e)
    return f"{e[0]}({','.join(_text(a) for a in e[1:])})"


def _variables(e: Expr | None) -> frozenset[str]:
    if isinstance(e, str):
        return frozenset({e})
    if isinstance(e, tuple):
        return frozenset().union(*(_variables(a) for a in e[1:]))
    return frozenset()


_UNARY_FWD: dict[str, Callable[[Tensor], Tensor]] = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "relu": torch.relu, "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "exp": torch.exp, "neg": torch.neg, "square": torch.square,
}
_BINARY_FWD: dict[str, Callable[..., Tensor]] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def _eval(e: Expr, env: dict[str, Tensor | None], values: dict[int, Tensor | float]) -> Tensor:
    out = _value(e, env, values)
    assert isinstance(out, Tensor), "an expression of constants only"
    return out


def _value(e: Expr | None, env: dict[str, Tensor | None], values: dict[int, Tensor | float]) -> Tensor | float:
    if isinstance(e, str):
        v = env[e]
        if v is None:
            raise ValueError(f"the activation reads {e}, which these experts do not have (non-gated)")
        return v
    if isinstance(e, float):
        return e
    assert isinstance(e, tuple)
    op, *args = e
    vals = [_value(a, env, values) if a is not None else None for a in args]
    x = vals[0]
    out: Tensor | float
    if op in _UNARY_FWD:
        assert isinstance(x, Tensor)
        out = _UNARY_FWD[op](x)
    elif op in _BINARY_FWD:
        a, b = vals
        # a number first (``1 - x``): as a 0-dim tensor, which takes the other operand's dtype
        out = _BINARY_FWD[op](a if isinstance(a, Tensor) else torch.as_tensor(a), b)
    elif op == "pow":
        assert isinstance(x, Tensor) and isinstance(args[1], float)
        out = torch.pow(x, args[1])
    else:  # clamp: bounds are numbers or None
        lo, hi = args[1], args[2]
        assert isinstance(x, Tensor) and isinstance(lo, float | None) and isinstance(hi, float | None)
        out = torch.clamp(x, min=lo, max=hi)
    values[id(e)] = out
    return out


def _backprop(e: Expr | None, grad: Tensor | float, env: dict[str, Tensor | None], values: dict[int, Tensor | float],
              grads: dict[str, Tensor]) -> None:
    """Add ``grad`` (the gradient at e's value) into the variables' gradients."""
    if not isinstance(e, str | tuple):
        return  # a constant
    assert isinstance(grad, Tensor)
    if isinstance(e, str):
        grads[e] = grad if e not in grads else grads[e] + grad
        return
    op, *args = e
    x = _val(args[0], env, values)
    out = values[id(e)]
    assert isinstance(out, Tensor)
    if op in BINARY:
        a, b = x, _val(args[1], env, values)
        if op == "add":
            da, db = grad, grad
        elif op == "sub":
            da, db = grad, -grad
        elif op == "mul":
            da, db = grad * b, grad * a
        else:
            da, db = grad / b, -grad * a / (b * b)
        _backprop(args[0], da, env, values, grads)  # a constant operand takes nothing
        _backprop(args[1], db, env, values, grads)
        return
    assert isinstance(x, Tensor)
    if op == "clamp":
        lo, hi = args[1], args[2]
        keep = torch.ones_like(x, dtype=torch.bool)
        if lo is not None:
            keep &= x >= lo
        if hi is not None:
            keep &= x <= hi
        dx = torch.where(keep, grad, torch.zeros_like(grad))
    elif op == "pow":
        c = args[1]
        assert isinstance(c, float)
        dx = grad * c * torch.pow(x, c - 1)
    else:
        dx = _UNARY_BWD[op](grad, x, out)
    _backprop(args[0], dx, env, values, grads)


def _val(e: Expr | None, env: dict[str, Tensor | None], values: dict[int, Tensor | float]) -> Tensor | float:
    if isinstance(e, str):
        v = env[e]
        assert v is not None
        return v
    if isinstance(e, float):
        return e
    return values[id(e)]


_UNARY_BWD: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "sigmoid": lambda g, x, y: torch.ops.aten.sigmoid_backward(g, y),
    "tanh": lambda g, x, y: torch.ops.aten.tanh_backward(g, y),
    "silu": lambda g, x, y: torch.ops.aten.silu_backward(g, x),
    "relu": lambda g, x, y: torch.ops.aten.threshold_backward(g, x, 0),
    "gelu": lambda g, x, y: torch.ops.aten.gelu_backward(g, x, approximate="none"),
    "gelu_tanh": lambda g, x, y: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "exp": lambda g, x, y: g * y,
    "neg": lambda g, x, y: -g,
    "square": lambda g, x, y: g * 2 * x,
}


__all__ = ["Activation", "BINARY", "PREFIX", "UNARY", "is_expression", "parse", "spec"]
