"""Moving experts instead of tokens (DESIGN.md, "Expert gather"): each expert domain, the block of
the mesh at level j (the ranks sharing coordinates 0..j-1), all-gathers its ranks' expert weights
(``lowering.ep_gather``) and computes there the tokens routed to them; tokens cross only levels
0..j-1, by the deduplicating all-to-all of ``ep_stages`` (Inter-level-1..j of HD-d). HybridEP's
expert domains (papers/hybridep.txt Section IV-A, Alg. 1: AG inside a domain, A2A among the
same-offset ranks of other domains); j = 0 is HEXA-MoE's data-centric mode (papers/hexa-moe.txt
Section 4.3): the whole mesh is one domain, no token moves, every rank runs its own tokens through
the gathered experts.

Candidates ``gather0`` .. ``gather{D-1}`` (the domain level j), predicted by ``cost/planner.py``
from HybridEP's multi-level AG term and HierMoE's inter-level phases (``gather_time_s``).
Backward reduce-scatters the weight gradients to their owners, so a rank still owns only its
experts (its ``shard_experts`` shard) between steps.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

import moe_compile.lowering.ep_gather  # noqa: F401  (registers the gather ops)
from moe_compile.lowering.strategies.common import Settings, emit_stages

NAME = "gather"
SUMMARY = "expert weights all-gathered inside each domain (a mesh block), tokens across domains (HybridEP, HEXA)"
COST_MODEL = "moe_compile.cost.planner"


def candidates(num_levels: int, dimension: int | None) -> dict[str, Settings]:
    if dimension is not None:  # the user fixed the all-to-all dimension: token-moving candidates only
        return {}
    return {f"gather{j}": Settings(j, True, domain=j) for j in range(num_levels)}


def emit(graph: fx.Graph, args: list[Any], layer_id: int, by_expert: bool, name: str, settings: Settings,
         top_k: int) -> fx.Node:
    x, topk_idx, topk_weights, *weights, activation = args
    prefix = "".join(c if c.isalnum() else "_" for c in name).strip("_") or "moe"
    present = [w for w in weights if w is not None]
    gather = graph.create_node("call_function", torch.ops.hiermoe.ep_gather.default, (present, layer_id, by_expert),
                               {}, name=f"{prefix}_gather")
    items = iter(range(len(present)))
    full: list[Any] = [None if w is None else graph.create_node("call_function", operator.getitem,
                                                                 (gather, next(items)), {}, name=f"{prefix}_gathered")
                       for w in weights]
    if settings.domain == 0:  # data-centric: every token stays, the experts came
        rows = graph.create_node("call_function", torch.ops.hiermoe.ep_expert_rows.default, (topk_idx, layer_id), {},
                                 name=f"{prefix}_expert_rows")
        return graph.create_node("call_function", torch.ops.hiermoe.experts.default,
                                 (x, rows, topk_weights, *full, activation), {}, name=f"{prefix}_experts")
    return emit_stages(graph, [x, topk_idx, topk_weights, *full, activation], layer_id, False, name, slots=top_k,
                       chunks=settings.chunks)

