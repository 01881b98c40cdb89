"""All-to-alls that send one copy per (token, expert): the flat all-to-all of Megatron and HF
(``flat_a2a``, d = 1), Tutel's 2DH (``hier_a2a``, d = 2) and HierMoE's H-d beyond two levels
(``hier{d}_a2a``; papers/hiermoe.txt Fig. 13). Predicted by ``cost/hiermoe.py``'s no-dedup
baselines; where a deduplicated row's K routing slots outweigh what dedup saves (small hidden
sizes), these win.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from moe_compile.cost.planner import dispatch_strategy
from moe_compile.lowering.strategies.common import Settings, emit_stages

NAME = "nodedup"
SUMMARY = "one copy per (token, expert): flat all-to-all (Megatron, HF), Tutel 2DH, H-d"
COST_MODEL = "moe_compile.cost.hiermoe"


def candidates(num_levels: int, dimension: int | None) -> dict[str, Settings]:
    dims = [dimension] if dimension is not None else range(1, num_levels + 1)
    return {dispatch_strategy(d, False): Settings(d, False) for d in dims}


def emit(graph: fx.Graph, args: list[Any], layer_id: int, by_expert: bool, name: str, settings: Settings,
         top_k: int) -> fx.Node:
    return emit_stages(graph, args, layer_id, by_expert, name, slots=1, chunks=settings.chunks)
