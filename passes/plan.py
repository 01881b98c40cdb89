"""plan: decide each rewritten layer's strategy (STYLE.md: find, then decide, then rewrite; this is
"decide", from the layer's shapes and compile-time routing, never from fx nodes).

Contract
    Needs: canonicalize's rewritten layers; the topology the plans are made on (options'
    ``topology``, or the probed one) or None; with a mesh its number of levels.
    Guarantees: every rewritten layer gets a ``LayerPlan``: the planner's ``Plan`` (every
    candidate's predicted time, the argmin over what can run) and, with a mesh, the registered
    strategy (``lowering.strategies``) and the runtime settings the chosen candidate runs with:
    what the expert_parallel pass emits. Without a mesh the only executable candidate is "local".
    With a mesh and no topology (a fixed dimension), the fixed dimension's candidate, nothing
    predicted. With a mesh every rank runs the same candidate: plans are made on uniform
    routing of the compile's token count, and ``ep.agreement`` settles the lowest rank's choice
    (``agreed``) at the first compile of a layer, kept for its recompiles.

    for each rewritten layer:
        workload <- shapes (+ the routing slots' bytes the runtime sends, with a mesh)
        candidates <- strategies.executable(levels, dimension, dedup)  (with a mesh) | {"local"}
        plan <- cost.planner.plan(topology, workload, routing, implemented=candidates)
        with a mesh: plan.strategy <- the agreed candidate
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from moe_compile.cost.planner import Plan, dispatch_strategy, plan
from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import SLOT_BYTES, Workload
from moe_compile.lowering.strategies import REGISTRY, Settings, Strategy, executable
from moe_compile.passes.canonicalize import Rewritten
from moe_compile.passes.regions import ExpertLayout, MoERegion


@dataclass(frozen=True)
class LayerPlan:
    """The plan of one layer and, under expert parallelism, what runs it."""

    plan: Plan
    strategy: Strategy | None = None  # None: one process ("local")
    settings: Settings | None = None

    def describe(self) -> str:
        """The chosen candidate and how it runs: "hd2 (hd, d* per step)", "flat_a2a (nodedup, d=1)"."""
        if self.strategy is None or self.settings is None:
            return self.plan.strategy
        how = "d* per step" if self.settings.dimension is None else f"d={self.settings.dimension}"
        return f"{self.plan.strategy} ({self.strategy.name}, {how})"


def plan_layer(region: MoERegion, layout: ExpertLayout, routing: Any, topology: Topology | None, *,
               mesh_levels: int | None, dimension: int | None, dedup: bool | None,
               agreed: str | None = None) -> LayerPlan:
    """One layer's plan. ``routing``: [T, K] expert ids of the compile's tokens, or None (uniform
    random routing: what every rank plans expert parallelism on, so that ranks with the same
    shapes choose alike). ``agreed``: the candidate the ranks agreed on (``ep.agreement``), which
    overrides this rank's choice; the predictions stay this rank's."""
    work = Workload(num_tokens=region.num_tokens, hidden_size=region.hidden_size, ffn_size=layout.ffn_size,
                    num_experts=region.num_experts, top_k=region.top_k,
                    dtype_bytes=getattr(torch, region.dtype).itemsize, gated=layout.gated,
                    slot_bytes=SLOT_BYTES if mesh_levels is not None else 0)
    if mesh_levels is None:
        return LayerPlan(plan(topology, work, routing))
    runnable = executable(mesh_levels, dimension, dedup)
    if topology is None:
        assert dimension is not None, "a mesh without topology and dimension is probed before planning"
        name = dispatch_strategy(dimension, True if dedup is None else dedup)
        decided = Plan(strategy=name, implemented=tuple(runnable), notes=("no topology given: nothing predicted",))
    else:
        decided = plan(topology, work, routing, implemented=tuple(runnable))
    if agreed is not None and agreed != decided.strategy:
        if agreed not in runnable:
            raise RuntimeError(f"layer {region.name}: the ranks agreed to run it as {agreed}, which this rank's "
                               f"options cannot run (it can run {sorted(runnable)})")
        decided = replace(decided, strategy=agreed, params={},
                          notes=(*decided.notes, f"{agreed}: agreed with the other ranks (this rank's own "
                                                 "token count predicts another candidate)"))
    strategy, settings = runnable[decided.strategy]
    return LayerPlan(decided, strategy, settings)


def plan_pass(rewritten: Sequence[Rewritten], topology: Topology | None, *, mesh_levels: int | None,
              dimension: int | None, dedup: bool | None, agreed: Mapping[str, str | None] | None = None,
              known: Mapping[str, LayerPlan] | None = None) -> dict[str, LayerPlan]:
    """``mesh_levels``: the mesh's number of levels (None: no mesh). ``dimension``/``dedup``: the
    user's constraints (None: the planner's choice). ``agreed``: the candidate per layer name
    the ranks agreed on. ``known``: plans this compile already made of a layer with the same
    arguments (the agreement's, on uniform routing), reused where the ranks agreed on their
    choice. Returns each layer's plan by name."""
    out: dict[str, LayerPlan] = {}
    for r in rewritten:
        mine = (known or {}).get(r.region.name)
        if mine is not None and mesh_levels is not None and (agreed or {}).get(r.region.name) == mine.plan.strategy:
            out[r.region.name] = mine
            continue
        routing = r.routing.cpu().numpy() if r.routing is not None and mesh_levels is None else None
        out[r.region.name] = plan_layer(r.region, r.layout, routing, topology, mesh_levels=mesh_levels,
                                        dimension=dimension, dedup=dedup, agreed=(agreed or {}).get(r.region.name))
    return out


__all__ = ["REGISTRY", "LayerPlan", "plan_layer", "plan_pass"]
