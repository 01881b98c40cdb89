"""HierMoE's hierarchical token-deduplicating all-to-all, HD-d (papers/hiermoe.txt Section III-A).

A token travels once to each destination group, carrying the routing slots bound there; d is
chosen per layer and step from every rank's routing statistics (Eq. 6 / Alg. 1: the runtime's
``EPLayer.choose_dimension``), or fixed by the user. Candidates ``hd1`` .. ``hdD`` (Eq. 1-5,
``cost/hiermoe.py``): whichever the planner predicts best, the layer runs d* per step, since the
best d follows the routing.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from moe_compile.lowering.strategies.common import Settings, emit_stages

NAME = "hd"
SUMMARY = "HierMoE HD-d token-deduplicating all-to-all, d* per layer and step"
COST_MODEL = "moe_compile.cost.hiermoe"


def candidates(num_levels: int, dimension: int | None) -> dict[str, Settings]:
    if dimension is not None:
        return {f"hd{dimension}": Settings(dimension, True)}
    return {f"hd{d}": Settings(None, True) for d in range(1, num_levels + 1)}


def emit(graph: fx.Graph, args: list[Any], layer_id: int, by_expert: bool, name: str, settings: Settings,
         top_k: int) -> fx.Node:
    return emit_stages(graph, args, layer_id, by_expert, name, slots=top_k, chunks=settings.chunks)
