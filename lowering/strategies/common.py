"""What every strategy shares: its runtime settings and the staged emission (``lowering.ep_stages``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

import moe_compile.lowering.ep_stages  # noqa: F401  (registers the staged ops)


@dataclass(frozen=True)
class Settings:
    """How one layer's runtime runs: the all-to-all dimension (None: d* per step, HierMoE Eq. 6 /
    Alg. 1) and whether a token travels once per destination group (dedup) or once per expert."""

    dimension: int | None
    dedup: bool


def emit_stages(graph: fx.Graph, args: list[Any], layer_id: int, by_expert: bool, name: str, slots: int
                ) -> fx.Node:
    """dispatch -> local experts -> combine for one layer, nodes named after it; returns the
    combine's node. ``args`` are the ``hiermoe::experts`` arguments, ``slots`` the routing slots a
    dispatched row carries (K with dedup, 1 without)."""
    x, topk_idx, topk_weights, *weights, activation = args
    prefix = "".join(c if c.isalnum() else "_" for c in name).strip("_") or "moe"

    def node(target: Any, node_args: tuple[Any, ...], what: str) -> fx.Node:
        return graph.create_node("call_function", target, node_args, {}, name=f"{prefix}_{what}")

    disp = node(torch.ops.hiermoe.ep_dispatch.default, (x, topk_idx, topk_weights, layer_id, slots), "dispatch")
    rows, ids, w, route = (node(operator.getitem, (disp, i), what)
                           for i, what in enumerate(("rows", "row_experts", "row_weights", "route")))
    partial = node(torch.ops.hiermoe.ep_local_experts.default,
                   (rows, ids, w, *weights, activation, by_expert, route), "local_experts")
    num_tokens = node(torch.ops.aten.sym_size.int, (x, 0), "num_tokens")
    return node(torch.ops.hiermoe.ep_combine.default, (partial, route, num_tokens), "combine")
