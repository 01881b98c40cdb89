"""Alias-aware dependency index over a Dynamo FX graph.

Dynamo graphs keep Python's in-place operators: ``out.index_add_(0, idx, y)`` returns ``out`` and
later code reads ``out`` (not the ``index_add_`` node).  Plain ``node.users`` therefore misses the
fact that a later read of ``out`` depends on the mutation.  ``GraphIndex`` adds those edges: a
node that reads a tensor also depends on every in-place mutation of that tensor (or of a view of
it) that happened earlier in program order.  All region analysis uses these edges.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.fx as fx

from moe_compile.passes.op_kinds import op_name

# Calls that return a view of their first argument; a mutation through the view mutates the
# base, so both belong to one alias group.  Over-approximating (reshape may copy) only adds
# dependency edges, which keeps the analysis conservative.
_VIEW_METHODS = frozenset(
    {
        "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "narrow",
        "select", "t", "as_strided", "flatten", "unflatten", "chunk", "split", "unbind",
        "view_as", "expand_as", "detach", "contiguous", "__getitem__",
    }
)
_VIEW_FUNCTIONS = frozenset(
    {
        torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze,
        torch.narrow, torch.select, torch.t, torch.flatten, torch.chunk, torch.split,
        torch.unbind, torch.detach, operator.getitem, torch.Tensor.view, torch.Tensor.reshape,
        torch.Tensor.transpose, torch.Tensor.permute, torch.Tensor.unsqueeze,
    }
)
_INPLACE_FUNCTIONS = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}
)
_INPLACE_METHOD = re.compile(r"^[a-z][a-z0-9_]*[a-z0-9]_$")


def is_inplace(node: fx.Node) -> bool:
    """True when ``node`` mutates its first argument (and, except setitem, returns it)."""
    if node.op == "call_method":
        return bool(_INPLACE_METHOD.match(str(node.target)))
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCTIONS:
            return True
        name = getattr(node.target, "__name__", "")
        return isinstance(node.target, type(torch.Tensor.add_)) and bool(_INPLACE_METHOD.match(name))
    return False


def is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
        # getitem on a tuple (e.g. topk's result) is not a tensor view.
        src = node.args[0] if node.args else None
        return isinstance(src, fx.Node) and isinstance(example_value(src), torch.Tensor)
    return False


_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})


def _cast_name(node: fx.Node) -> bool:
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in _CASTS


def example_value(node: fx.Node) -> object:
    """The fake value Dynamo recorded for ``node`` (tensor, tuple, SymInt, ...), or None."""
    return node.meta.get("example_value", node.meta.get("val"))


def tensor_meta(node: fx.Node) -> torch.Tensor | None:
    v = example_value(node)
    return v if isinstance(v, torch.Tensor) else None


def fake_tensor(node: fx.Node) -> torch.Tensor | None:
    """``tensor_meta``, or for a node a pass added without one (a ``stack`` or ``narrow`` of
    weights), its value computed from its inputs' fake values in their fake mode; None where
    an input has none. Inputs whose fake values another mode made (a pass's fake propagation
    filled the ones Dynamo's left out: ``sample_placement``) are converted into the first one's."""
    t = tensor_meta(node)
    if t is not None or node.op not in ("call_function", "call_method"):
        return t
    inputs: dict[fx.Node, torch.Tensor] = {}
    for n in node.all_input_nodes:
        v = fake_tensor(n)
        if v is None:
            return None
        inputs[n] = v
    mode = next((v.fake_mode for v in inputs.values() if hasattr(v, "fake_mode")), None)
    if mode is None:
        return None
    for n, v in inputs.items():
        if getattr(v, "fake_mode", mode) is not mode:
            inputs[n] = mode.from_tensor(v)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: inputs[n])
    with mode:
        out = getattr(args[0], str(node.target))(*args[1:], **kwargs) if node.op == "call_method" \
            else node.target(*args, **kwargs)  # type: ignore[operator]
    return out if isinstance(out, torch.Tensor) else None


def static_shape(node: fx.Node) -> tuple[int, ...] | None:
    """Shape with symbolic sizes replaced by their hints; None for non-tensors."""
    return value_shape(tensor_meta(node))


def value_shape(t: object) -> tuple[int, ...] | None:
    """``static_shape`` of a value (a tensor of a node's meta, or an element of a tuple's)."""
    if not isinstance(t, torch.Tensor):
        return None
    out = []
    for s in t.shape:
        if isinstance(s, torch.SymInt):
            # the hint, not int(s): int() would install a guard and specialize the graph
            hint = s.node.hint
            if hint is None:  # unbacked (data-dependent) size
                return None
            out.append(int(hint))
        else:
            out.append(int(s))
    return tuple(out)


def source_line(node: fx.Node) -> tuple[str, str, str] | None:
    """(file name, line number, code) of the model line that made ``node``: the last frame of
    Dynamo's stack trace; None where it recorded none."""
    trace = node.meta.get("stack_trace") or ""
    # the last frame: 'File "...", line N, in f', the code, and (Python 3.11+) a line of carets
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().strip("^~")]
    if len(lines) < 2 or not lines[-2].startswith("File "):
        return None
    loc = lines[-2].split(",")
    file = loc[0].removeprefix('File "').rstrip('"').rsplit("/", 1)[-1]
    line = loc[1].strip().removeprefix("line ") if len(loc) > 1 else "?"
    return file, line, lines[-1]


class GraphIndex:
    """Program order, alias groups and mutation-aware dependency edges of one graph."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.nodes: list[fx.Node] = list(gm.graph.nodes)
        self.pos: dict[fx.Node, int] = {n: i for i, n in enumerate(self.nodes)}
        # alias group root for every node that is a view of / in-place result on another node
        self._root: dict[fx.Node, fx.Node] = {}
        for n in self.nodes:
            if (is_view(n) or is_inplace(n)) and n.args and isinstance(n.args[0], fx.Node):
                self._root[n] = self.root(n.args[0])
        # in-place mutators per alias group, in program order
        self.mutators: dict[fx.Node, list[fx.Node]] = {}
        for n in self.nodes:
            if is_inplace(n) and isinstance(n.args[0], fx.Node):
                self.mutators.setdefault(self.root(n.args[0]), []).append(n)
        self.deps: dict[fx.Node, set[fx.Node]] = {n: self._compute_deps(n) for n in self.nodes}
        self._anchors: dict[fx.Node, str] | None = None
        self.rdeps: dict[fx.Node, set[fx.Node]] = {n: set() for n in self.nodes}
        for n, ds in self.deps.items():
            for d in ds:
                self.rdeps[d].add(n)

    def root(self, n: fx.Node) -> fx.Node:
        while n in self._root:
            n = self._root[n]
        return n

    def anchor(self, n: fx.Node) -> str:
        """A name for ``n`` that the same model code gives the same node in graphs Dynamo
        specialized to other shapes (whose node names and shape nodes differ): the model line
        and op that made it, and how many nodes of that line and op come before it."""
        if self._anchors is None:
            seen: dict[tuple[object, ...], int] = {}
            self._anchors = {}
            for m in self.nodes:
                where = source_line(m)
                # the op's name, not str(target): a function's repr holds its address in this process
                key = (":".join(where[:2]) if where else m.op, op_name(m) or m.op)
                self._anchors[m] = f"{key[0]} {key[1]} #{seen.get(key, 0)}"
                seen[key] = seen.get(key, 0) + 1
        return self._anchors[n]

    def value_root(self, n: fx.Node) -> fx.Node:
        """The tensor whose values ``n`` holds: through views, in-place results and dtype casts
        (a router's ``hidden_states.reshape(-1, H).float()`` is the tokens' values)."""
        while True:
            r = self.root(n)
            if r.op in ("call_function", "call_method") and _cast_name(r) and r.args and isinstance(r.args[0], fx.Node):
                n = r.args[0]
                continue
            return r

    def _compute_deps(self, n: fx.Node) -> set[fx.Node]:
        deps = set(n.all_input_nodes)
        p = self.pos[n]
        for d in list(deps):
            for m in self.mutators.get(self.root(d), ()):
                if self.pos[m] < p and m is not n:
                    deps.add(m)
        return deps

    def final_version(self, n: fx.Node) -> fx.Node:
        """The last in-place mutator of ``n``'s alias group (``n`` itself when never mutated)."""
        muts = self.mutators.get(self.root(n), [])
        return muts[-1] if muts else n

    def ancestors(self, starts: Iterable[fx.Node], stop: set[fx.Node] | None = None) -> set[fx.Node]:
        """Transitive dependencies of ``starts`` (inclusive); does not walk through ``stop``."""
        stop = stop or set()
        seen: set[fx.Node] = set()
        todo = list(starts)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in stop:
                continue
            todo.extend(self.deps[n] - seen)
        return seen

    def descendants(self, starts: Iterable[fx.Node]) -> set[fx.Node]:
        """Transitive dependents of ``starts`` (inclusive)."""
        seen: set[fx.Node] = set()
        todo = list(starts)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(self.rdeps[n] - seen)
        return seen

    def ordered(self, nodes: Iterable[fx.Node]) -> list[fx.Node]:
        return sorted(nodes, key=self.pos.__getitem__)
