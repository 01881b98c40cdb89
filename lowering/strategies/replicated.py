"""Replicated experts, run where they are: a layer whose experts every rank holds whole (not
sharded by ``moe_compile.shard_experts``, no expert swap) runs each rank's own tokens through the
rank's own copy of every expert, as eager data parallelism (DDP) does. Nothing is sent in the
layer; the expert gradients are each rank's own tokens', and the all-reduce every replicated
parameter needs (DDP's, or the training loop's) sums them, as it sums the expert-parallel
candidates' (whose non-owner ranks hold zeros). So for such a layer the token all-to-alls and the
gathers only add communication (HEXA-MoE's data-centric mode, papers/hexa-moe.txt Section 4.3,
with the AllGather already done by the replication).

Candidate ``replicated``, predicted by ``cost/planner.py`` (the expert compute of the rank's own
T*K pairs, balanced whatever the routing, plus reading every expert's weights where expert
parallelism reads E/S of them). The expert-parallel pass keeps the layer's ``hiermoe::experts``
op as it is (the kernels lowering applies) and builds no runtime layer for it.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from moe_compile.lowering.strategies.common import Settings

NAME = "replicated"
SUMMARY = "every rank runs its own tokens through its own copy of every expert, nothing sent (data parallel)"
COST_MODEL = "moe_compile.cost.planner"


def candidates(num_levels: int, dimension: int | None) -> dict[str, Settings]:
    if dimension is not None:  # the user fixed the all-to-all dimension: token-moving candidates only
        return {}
    return {"replicated": Settings(None, False, replicated=True)}


def emit(graph: fx.Graph, args: list[Any], layer_id: int, by_expert: bool, name: str, settings: Settings,
         top_k: int) -> fx.Node:
    """Never called: the expert-parallel pass leaves a replicated layer's op (its shapes and
    metadata) as canonicalize made it."""
    raise AssertionError(f"layer {name}: a replicated layer keeps its hiermoe::experts op; nothing is emitted")
