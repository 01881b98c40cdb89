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
    Alg. 1), whether a token travels once per destination group (dedup) or once per expert, and
    the chunks its tokens run in (the pipeline, ``cost.pipeline``; 1 = not chunked), the mesh
    level whose blocks gather their experts (``strategies.gather``; None: experts stay),
    whether every rank runs every token on its columns of the experts (``strategies.model``), and
    whether every rank runs its own tokens through its own copy of every expert, nothing sent
    (``strategies.replicated``: no runtime layer)."""

    dimension: int | None
    dedup: bool
    chunks: int = 1
    domain: int | None = None
    model_centric: bool = False
    replicated: bool = False

    @property
    def chunkable(self) -> bool:
        """Whether the layer's tokens may run in chunks: the token all-to-alls' stages; the gathers,
        model-centric and replicated layers are not chunked."""
        return self.domain is None and not self.model_centric and not self.replicated


def emit_stages(graph: fx.Graph, args: list[Any], layer_id: int, by_expert: bool, name: str, slots: int,
                chunks: int = 1) -> fx.Node:
    """dispatch -> local experts -> combine for one layer, nodes named after it; returns the
    layer's output node. ``args`` are the ``hiermoe::experts`` arguments, ``slots`` the routing
    slots a dispatched row carries (K with dedup, 1 without).

    ``chunks`` = n > 1: the tokens split in n chunks along dim 0 (MoNTA Eq. 4's I_j; the last ones
    may be empty), ``ep_begin`` choosing the step's d from all of them, and the stages in the
    order ``cost.pipeline`` models: dispatch 0, dispatch 1, then per chunk i its local experts,
    its combine, dispatch i+2; the outputs concatenated. With start/wait split (passes.overlap),
    chunk i computes while chunk i+1's tokens travel and chunk i-1's results go back."""
    x, topk_idx, topk_weights, *weights, activation = args
    prefix = "".join(c if c.isalnum() else "_" for c in name).strip("_") or "moe"

    def node(target: Any, node_args: tuple[Any, ...], what: str) -> fx.Node:
        return graph.create_node("call_function", target, node_args, {}, name=f"{prefix}_{what}")

    def dispatch(xs: Any, idx: Any, tw: Any, step: Any, chunk: int) -> list[fx.Node]:
        extra = () if step is None else (step, chunk)
        sfx = "" if step is None else f"_{chunk}"
        disp = node(torch.ops.hiermoe.ep_dispatch.default, (xs, idx, tw, layer_id, slots, *extra), f"dispatch{sfx}")
        return [node(operator.getitem, (disp, i), what + sfx)
                for i, what in enumerate(("rows", "row_experts", "row_weights", "route"))]

    def local_and_combine(xs: Any, dispatched: list[fx.Node], sfx: str) -> fx.Node:
        rows, ids, w, route = dispatched
        local = node(torch.ops.hiermoe.ep_local_experts.default,
                     (rows, ids, w, *weights, activation, by_expert, route), f"local_experts{sfx}")
        partial = node(operator.getitem, (local, 0), f"partial{sfx}")  # [1], [2]: kept for backward
        num_tokens = node(torch.ops.aten.sym_size.int, (xs, 0), f"num_tokens{sfx}")
        return node(torch.ops.hiermoe.ep_combine.default, (partial, route, num_tokens), f"combine{sfx}")

    if chunks <= 1:
        return local_and_combine(x, dispatch(x, topk_idx, topk_weights, None, 0), "")
    step = node(torch.ops.hiermoe.ep_begin.default, (x, topk_idx, layer_id), "step")
    split = [node(torch.tensor_split, (t, chunks), f"{what}_chunks")
             for t, what in ((x, "x"), (topk_idx, "topk_idx"), (topk_weights, "topk_weights"))]
    parts = [[node(operator.getitem, (s, i), f"{s.name}_{i}") for s in split] for i in range(chunks)]
    dispatched = {i: dispatch(parts[i][0], parts[i][1], parts[i][2], step, i) for i in range(min(2, chunks))}
    outs = []
    for i in range(chunks):
        outs.append(local_and_combine(parts[i][0], dispatched.pop(i), f"_{i}"))
        if i + 2 < chunks:
            x2, idx2, tw2 = parts[i + 2]
            dispatched[i + 2] = dispatch(x2, idx2, tw2, step, i + 2)
    return node(torch.cat, (outs,), "combined")
