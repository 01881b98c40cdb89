"""Executable expert-parallel strategies: what the plan pass may choose and the expert-parallel
pass emits (DESIGN.md, "Expert-parallel stages and strategies").

A strategy is one module here. It names the planner candidates it runs (the names ``cost.planner``
predicts, from the cost model in ``cost/`` it names), the runtime settings each candidate runs
with (``Settings``: what the layer's ``moe_compile.ep.runtime.EPLayer`` is built with), and how it
emits its stages into the graph. ``REGISTRY`` lists them: adding a strategy is its module, its
cost model, and one line in ``_MODULES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from moe_compile.lowering.strategies import gather, hd, model, nodedup, replicated
from moe_compile.lowering.strategies.common import Settings


@dataclass(frozen=True)
class Strategy:
    """One executable strategy (see the module docstring)."""

    name: str
    summary: str
    cost_model: str  # the cost/ module that predicts its candidates
    # (mesh levels, the user's fixed dimension or None) -> {planner candidate: settings}
    candidates: Callable[[int, int | None], dict[str, Settings]]
    # (graph, hiermoe::experts args, runtime layer id, by_expert, layer name, settings) -> output node
    emit: Callable[[fx.Graph, list[Any], int, bool, str, Settings, int], fx.Node]


_MODULES = (hd, nodedup, gather, model, replicated)
REGISTRY: dict[str, Strategy] = {m.NAME: Strategy(m.NAME, m.SUMMARY, m.COST_MODEL, m.candidates, m.emit)
                                 for m in _MODULES}


def executable(num_levels: int, dimension: int | None, dedup: bool | None,
               gather: str | bool | int = "auto", model_centric: str | bool = "auto", replicated: bool = False
               ) -> dict[str, tuple[Strategy, Settings]]:
    """Every candidate the registered strategies can run on a mesh of ``num_levels`` levels under
    the user's constraints (a fixed dimension; dedup forced on or off; None: free; options'
    ``expert_gather``: "auto" = the gather candidates too, False = none, j = only the gather of
    domain level j; ``model_centric``: options' ``model_centric`` where every rank holds every
    expert whole, "auto" = the model-centric candidate too, False = not it, "always" = only it;
    ``replicated``: whether the layer may run where its experts are, every rank holding every
    expert whole and options' ``replicated_experts`` allowing it; not with a forced gather or
    model-centric), by candidate name."""
    out: dict[str, tuple[Strategy, Settings]] = {}
    level = gather if isinstance(gather, int) and not isinstance(gather, bool) else None  # one forced gather
    for strategy in REGISTRY.values():
        for name, settings in strategy.candidates(num_levels, dimension).items():
            if settings.replicated:
                if replicated and level is None and model_centric != "always":
                    out[name] = (strategy, settings)
                continue
            if settings.model_centric:
                if model_centric is not False and level is None:
                    out[name] = (strategy, settings)
                continue
            gathers = settings.domain is not None
            if gather is False and gathers or level is not None and settings.domain != level:
                continue
            if gathers or dedup is None or settings.dedup == dedup:
                out[name] = (strategy, settings)
    if model_centric == "always":
        return {k: v for k, v in out.items() if v[1].model_centric}
    return out


__all__ = ["REGISTRY", "Settings", "Strategy", "executable"]
