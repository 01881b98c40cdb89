"""Model-centric execution (HEXA-MoE, papers/hexa-moe.txt Section 4.3, Fig. 6b): the tokens of the
whole mesh all-gathered, each rank computing them on its columns of every expert's FFN dimension,
the partial outputs reduce-scattered back (``lowering.ep_model``). No expert weight and no routed
token copy moves; what travels is every token once per rank and every output once per rank, so it
wins where tokens are few and experts large (HEXA's crossover, ``cost.hexa``).

Candidate ``model0`` (the domain is the whole mesh), predicted by ``cost/planner.py``
(``model_time_s``: the hierarchical token all-gather and output reduce-scatter, plus the same
expert FLOPs per rank as the other strategies). It needs every expert whole on every rank: the
plan pass leaves it out for a model whose experts ``shard_experts`` sharded, and
options['model_centric'] = False leaves it out everywhere.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

import moe_compile.lowering.ep_model  # noqa: F401  (registers the model-centric ops)
from moe_compile.ep import runtime
from moe_compile.lowering.ep_model import ffn_columns
from moe_compile.lowering.strategies.common import Settings

NAME = "model"
SUMMARY = "every rank runs every token on its columns of each expert's FFN (HEXA-MoE's model-centric mode)"
COST_MODEL = "moe_compile.cost.planner"


def candidates(num_levels: int, dimension: int | None) -> dict[str, Settings]:
    if dimension is not None:  # the user fixed the all-to-all dimension: token-moving candidates only
        return {}
    return {"model0": Settings(1, True, model_centric=True)}


def emit(graph: fx.Graph, args: list[Any], layer_id: int, by_expert: bool, name: str, settings: Settings,
         top_k: int) -> fx.Node:
    x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation = args
    if not by_expert:
        raise ValueError(f"layer {name}: model-centric execution reads every expert's columns, but this rank "
                         "holds only its own experts (moe_compile.shard_experts); compile with "
                         "options={'model_centric': False}")
    lay = runtime.layer(layer_id)
    comm = lay.comm
    prefix = "".join(c if c.isalnum() else "_" for c in name).strip("_") or "moe"

    def node(target: Any, node_args: tuple[Any, ...], what: str) -> fx.Node:
        return graph.create_node("call_function", target, node_args, {}, name=f"{prefix}_{what}")

    tokens = node(torch.ops.hiermoe.ep_model_tokens.default, (x, topk_idx, topk_weights, layer_id), "tokens")
    x_all, idx_all, w_all = (node(operator.getitem, (tokens, i), what)
                             for i, what in enumerate(("x_all", "topk_idx_all", "topk_weights_all")))
    start, length = ffn_columns(lay.ffn_size, comm.position, comm.world)

    def cols(t: Any, dim: int, what: str) -> Any:
        return None if t is None else node(torch.narrow, (t, dim, start, length), f"{what}_columns")

    sliced = (cols(w_up, 1, "w_up"), cols(w_gate, 1, "w_gate"), cols(w_down, 2, "w_down"),
              cols(b_up, 1, "b_up"), cols(b_gate, 1, "b_gate"), b_down if comm.position == 0 else None)
    y_all = node(torch.ops.hiermoe.experts.default, (x_all, idx_all, w_all, *sliced, activation), "partial_experts")
    return node(torch.ops.hiermoe.ep_model_outputs.default, (y_all, layer_id), "outputs")
