"""Which graph nodes are model state (parameters/buffers), and their module paths."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.fx as fx

_KEY = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]|\.([A-Za-z_][A-Za-z0-9_]*)")
# Container attributes Dynamo spells out in sources; they are not part of the module path.
_CONTAINER_KEYS = {"_modules", "_parameters", "_buffers", "L", "G", "self"}


def source_path(source_name: str) -> str:
    """``L['self']._modules['experts']._modules['3']._parameters['weight']`` -> ``experts.3.weight``."""
    keys: list[str] = []
    # the first key is the local/global variable the module was reached from (self, model, ...)
    skip_first = source_name.startswith(("L[", "G["))
    for m in _KEY.finditer(source_name):
        if skip_first:
            skip_first = False
            continue
        key = m.group(1) or m.group(2)
        if key and key not in _CONTAINER_KEYS:
            keys.append(key)
    return ".".join(keys)


class ParamTable:
    """Model-state nodes of a graph: placeholders that are parameters/buffers, and get_attrs."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[object] | None) -> None:
        self.path: dict[fx.Node, str] = {}
        self.value: dict[fx.Node, torch.Tensor] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        inputs = list(example_inputs) if example_inputs is not None else [None] * len(placeholders)
        for node, ex in zip(placeholders, inputs):
            grapharg = node.meta.get("grapharg")
            name = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
            is_state = isinstance(ex, torch.nn.Parameter) or "_parameters" in name or "_buffers" in name
            if is_state:
                self.path[node] = source_path(name) if name else node.name
                if isinstance(ex, torch.Tensor):
                    self.value[node] = ex
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                attr = _get_attr(gm, str(node.target))
                if isinstance(attr, torch.Tensor):
                    self.path[node] = str(node.target)
                    self.value[node] = attr

    def __contains__(self, node: object) -> bool:
        return node in self.path

    def is_parameter(self, node: fx.Node) -> bool:
        v = self.value.get(node)
        return isinstance(v, torch.nn.Parameter) or (node in self.path and v is None)


def _get_attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def common_prefix(paths: Sequence[str]) -> str:
    """Longest common dotted prefix of module paths (``""`` when there is none)."""
    if not paths:
        return ""
    split = [p.split(".") for p in paths]
    out = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return ".".join(out)
