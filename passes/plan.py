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
    predicted. With a mesh every rank runs the same candidate: every rank plans the layer from
    what ``ep.agreement`` exchanged at its first compile (kept for its recompiles): the lowest
    planning rank's token count and the expert loads of every rank's compile batch summed
    (``cost.planner``: each candidate's compute at its busiest block), so every rank computes
    the same plan (``moe_compile.pipeline``).

    for each rewritten layer:
        workload <- shapes (+ the routing slots' bytes the runtime sends, with a mesh)
        candidates <- strategies.executable(levels, dimension, dedup)  (with a mesh) | {"local"}
        plan <- cost.planner.plan(topology, workload, routing | summed expert loads, implemented=candidates)
        with a mesh: plan.strategy <- the agreed candidate
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from moe_compile.cost.pipeline import PipelineChoice, choose_chunks
from moe_compile.cost.planner import Plan, dispatch_strategy, layer_times, load_imbalance, plan
from moe_compile.cost.topology import Topology
from moe_compile.cost.workload import SLOT_BYTES, Workload
from moe_compile.lowering.strategies import REGISTRY, Settings, Strategy, executable
from moe_compile.passes.autotune import TUNE_WITHIN
from moe_compile.passes.canonicalize import Rewritten
from moe_compile.passes.regions import ExpertLayout, MoERegion

if TYPE_CHECKING:
    from moe_compile.passes.autotune import Measured


@dataclass(frozen=True)
class LayerPlan:
    """The plan of one layer and, under expert parallelism, what runs it."""

    plan: Plan
    strategy: Strategy | None = None  # None: one process ("local")
    settings: Settings | None = None
    pipeline: PipelineChoice | None = None  # the chunk counts searched (None: not predicted)
    tune: bool = False  # options pipeline "tune": a chunkable layer's chunk count is measured (passes.autotune)
    # options tune_strategy: the candidates to measure (the planner's within TUNE_WITHIN of its best,
    # one per distinct runtime, this plan's first), each with its settings and chunk prediction
    alternatives: tuple[tuple[str, Strategy, Settings, PipelineChoice | None], ...] = ()
    measured_strategy: Measured | None = None  # what the measurements found (set by the expert-parallel pass)
    measured_chunks: Measured | None = None
    expert_load: tuple[int, ...] | None = None  # pairs per expert, every rank's summed (what the plan charged)

    @property
    def choice(self) -> str:
        """What the ranks must agree on: the candidate, and "@n" when it runs in n > 1 chunks."""
        n = self.settings.chunks if self.settings is not None else 1
        return self.plan.strategy if n == 1 else f"{self.plan.strategy}@{n}"

    def describe(self) -> str:
        """The chosen candidate and how it runs: "hd2 (hd, d* per step)", "flat_a2a (nodedup, d=1)",
        "hd2 (hd, d* per step, 4 chunks)"."""
        if self.strategy is None or self.settings is None:
            return self.plan.strategy
        if self.settings.replicated:
            return (f"{self.plan.strategy} (every rank holds every expert and runs its own tokens through them, "
                    "nothing sent; the expert gradients are summed by the all-reduce of replicated parameters)")
        if self.settings.model_centric:
            return (f"{self.plan.strategy} ({self.strategy.name}, every rank computes every token on its columns "
                    "of the experts)")
        if self.settings.domain is not None:
            j = self.settings.domain
            return (f"{self.plan.strategy} ({self.strategy.name}, experts all-gathered "
                    + ("over the whole mesh, no token moves" if j == 0 else
                       f"inside each block of mesh levels {j}.., tokens across levels 0..{j - 1}") + ")")
        how = "d* per step" if self.settings.dimension is None else f"d={self.settings.dimension}"
        if self.settings.chunks > 1:
            how += f", {self.settings.chunks} chunks"
        return f"{self.plan.strategy} ({self.strategy.name}, {how})"

    def describe_pipeline(self) -> str:
        """The pipeline's prediction: n, serial and pipelined forward+backward time ("" if none)."""
        p = self.pipeline
        if p is None:
            return ""
        top = max(p.times_s)
        curves = f"; chunk transfers at the measured efficiency of {', '.join(p.efficiency)}" if p.efficiency else ""
        if p.calibrated:
            curves += f"; a chunk's fixed cost {p.overhead_s * 1e3:.3g} ms per direction, calibrated"
        if p.chunks == 1:
            others = {n: t for n, t in p.times_s.items() if n > 1}
            if not others:
                return f"n=1: predicted fw+bw {p.serial_s * 1e3:.3g} ms; chunks below MoNTA's bound (none searched)"
            n = min(others, key=others.__getitem__)
            return (f"n=1: predicted fw+bw {p.serial_s * 1e3:.3g} ms serial, at best {others[n] * 1e3:.3g} ms in {n} "
                    f"chunks (searched n=2..{top}; chunks need 5 % saved{curves})")
        return (f"n={p.chunks}: predicted fw+bw {p.serial_s * 1e3:.3g} ms serial, "
                f"{p.pipelined_s * 1e3:.3g} ms in {p.chunks} chunks (searched n=1..{top}{curves})")

    def describe_measured(self) -> str:
        """What the autotuning measured ("" if nothing): "measured strategy hd2 30.1, model0 25.2 ms
        fw+bw (slowest rank, median): runs model0; measured chunks ..."."""
        return "; ".join(m.describe(what) for what, m in (("strategy", self.measured_strategy),
                                                          ("chunks", self.measured_chunks))
                         if m is not None and m.times_s)


def plan_layer(region: MoERegion, layout: ExpertLayout, routing: Any, topology: Topology | None, *,
               mesh_levels: int | None, dimension: int | None, dedup: bool | None,
               agreed: str | None = None, chunks: str | int = 1, gather: str | bool | int = "auto",
               gather_compress: float | None = None, model_centric: str | bool = "auto",
               replicated: bool = False, tune_strategy: bool = False, expert_load: Any = None) -> LayerPlan:
    """One layer's plan. ``routing``: [T, K] expert ids of the compile's tokens, or None: with a
    mesh, ``expert_load`` ([E] (token, expert) pairs per expert, every rank's summed: the same
    on every rank, so ranks with the same shapes choose alike; ``cost.planner``), or uniform
    random routing without it. ``agreed``: the choice the ranks agreed on (``ep.agreement``,
    ``LayerPlan.choice``), which overrides this rank's; the predictions stay this rank's.
    ``chunks``: options['pipeline'] as the layer may use it: "auto" (the cost model's n), "tune"
    (the model's n until the expert-parallel pass measures the candidates) or n.
    ``gather``: options['expert_gather'] ("auto", False, or a domain level); ``gather_compress``
    options['gather_compress'] (the gathers' predicted bytes); ``model_centric``: options'
    ``model_centric`` as this model may use it (``strategies.executable``); ``replicated``:
    whether it may run replicated (every rank holds every expert whole, options'
    ``replicated_experts`` allows it)."""
    agreed, _, agreed_chunks = (agreed or "").partition("@")
    agreed = agreed or None
    work = Workload(num_tokens=region.num_tokens, hidden_size=region.hidden_size, ffn_size=layout.ffn_size,
                    num_experts=region.num_experts, top_k=region.top_k,
                    dtype_bytes=getattr(torch, region.dtype).itemsize, gated=layout.gated,
                    slot_bytes=SLOT_BYTES if mesh_levels is not None else 0)
    if mesh_levels is None:
        return LayerPlan(plan(topology, work, routing))
    runnable = executable(mesh_levels, dimension, dedup, gather, model_centric, replicated)
    if topology is None:
        assert dimension is not None, "a mesh without topology and dimension is probed before planning"
        name = dispatch_strategy(dimension, True if dedup is None else dedup)
        decided = Plan(strategy=name, implemented=tuple(runnable), notes=("no topology given: nothing predicted",))
    else:
        decided = plan(topology, work, routing, implemented=tuple(runnable), gather_compress=gather_compress,
                       expert_load=expert_load)
    if agreed is not None and agreed != decided.strategy:
        if agreed not in runnable:
            raise RuntimeError(f"layer {region.name}: the ranks agreed to run it as {agreed}, which this rank's "
                               f"options cannot run (it can run {sorted(runnable)})")
        decided = replace(decided, strategy=agreed, params={},
                          notes=(*decided.notes, f"{agreed}: agreed with the other ranks (this rank's own "
                                                 "token count predicts another candidate)"))
    # the token all-to-alls' compute stage is the busiest rank's (chunks pipeline it)
    # (experts that do not split over the ranks run no token all-to-all: replicated or an error)
    busiest = 1.0 if expert_load is None or topology is None or region.num_experts % topology.world_size else \
        load_imbalance(expert_load, topology.sizes, len(topology.sizes))
    strategy, settings, pipe = _chunked(decided.strategy, runnable, topology, work, chunks,
                                        int(agreed_chunks or 1) if agreed is not None else None, busiest)
    alternatives = [(decided.strategy, strategy, settings, pipe)]  # this plan's first: the measurement's baseline
    if tune_strategy and topology is not None and not settings.replicated:  # replicated: nothing sent to time
        predicted = decided.predicted
        best = predicted.get(decided.strategy, float("inf"))
        seen = {replace(settings, chunks=1)}
        for name in sorted(runnable, key=lambda c: predicted.get(c, float("inf"))):
            runtime_of = replace(runnable[name][1], chunks=1)
            if runtime_of.replicated:  # it builds no runtime layer to time (it sends nothing)
                continue
            if predicted.get(name, float("inf")) <= TUNE_WITHIN * best and runtime_of not in seen:
                seen.add(runtime_of)
                alternatives.append((name, *_chunked(name, runnable, topology, work, chunks, None, busiest)))
    return LayerPlan(decided, strategy, settings, pipe, tune=chunks == "tune",
                     alternatives=tuple(alternatives) if len(alternatives) > 1 else (),
                     expert_load=None if expert_load is None else tuple(int(v) for v in expert_load))


def _chunked(name: str, runnable: Mapping[str, tuple[Strategy, Settings]], topology: Topology | None,
             work: Workload, chunks: str | int, agreed_chunks: int | None, busiest: float = 1.0
             ) -> tuple[Strategy, Settings, PipelineChoice | None]:
    """Candidate ``name``'s strategy, its settings with the chunk count it runs (the user's n, the
    agreed one, else the model's; the gathers and model-centric are not chunked), and the
    pipeline model's choice (None where not chunked or nothing is predicted); ``busiest``: the
    busiest rank's compute over the mean (``cost.planner.load_imbalance``)."""
    strategy, settings = runnable[name]
    if not settings.chunkable:
        return strategy, settings, None
    pipe = None if topology is None else _pipeline(topology, work, Plan(strategy=name), settings, busiest)
    if isinstance(chunks, int):  # the user's n: the same option on every rank
        n = chunks
    elif agreed_chunks is not None:
        n = agreed_chunks
    else:
        n = pipe.chunks if pipe is not None else 1
    return strategy, replace(settings, chunks=n), pipe


_PIPELINES: dict[tuple[str, Workload, int, bool, float], PipelineChoice] = {}


def _pipeline(topology: Topology, work: Workload, decided: Plan, settings: Settings,
              busiest: float = 1.0) -> PipelineChoice:
    """The chunk counts for the chosen candidate (``cost.pipeline``): its d (the candidate's, for
    d* per step), each phase's latency and transfer from the HierMoE model on uniform routing,
    dispatch with the routing slots' bytes and combine without, the busiest rank's compute.
    Once per (topology, shapes, d, dedup, imbalance): a model's layers share them."""
    d = settings.dimension or int(decided.strategy.removeprefix("hd"))  # d* per step: the hd<d> candidate's
    key = (repr(topology), work, d, settings.dedup, round(busiest, 3))
    if key not in _PIPELINES:
        _PIPELINES[key] = _search_chunks(topology, work, d, settings.dedup, round(busiest, 3))
    return _PIPELINES[key]


def _search_chunks(topology: Topology, work: Workload, d: int, dedup: bool, busiest: float = 1.0) -> PipelineChoice:
    """``choose_chunks`` on ``layer_times``, with the topology's measured chunk overhead where
    its file gives one (measured: ``cost.pipeline.fit_chunk_overhead``), else ``OP_OVERHEAD_S``."""
    times = layer_times(topology, work, d, dedup, busiest)
    if topology.chunk_overhead_s is None:
        return choose_chunks(times, work.num_tokens)
    return choose_chunks(times, work.num_tokens, overhead_s=topology.chunk_overhead_s, calibrated=True)


def plan_pass(rewritten: Sequence[Rewritten], topology: Topology | None, *, mesh_levels: int | None,
              dimension: int | None, dedup: bool | None, agreed: Mapping[str, str | None] | None = None,
              known: Mapping[str, LayerPlan] | None = None, chunks: str | int = 1,
              gather: str | bool | int = "auto", gather_compress: float | None = None,
              model_centric: str | bool = "auto", replicated: bool = False,
              tune_strategy: bool = False) -> dict[str, LayerPlan]:
    """``mesh_levels``: the mesh's number of levels (None: no mesh). ``dimension``/``dedup``: the
    user's constraints (None: the planner's choice). ``agreed``: the candidate per layer name
    the ranks agreed on. ``known``: plans this compile already made of a layer with the same
    arguments (the agreement's, from the exchanged token count and expert loads), reused where
    the ranks agreed on their choice. Returns each layer's plan by name."""
    out: dict[str, LayerPlan] = {}
    for r in rewritten:
        mine = (known or {}).get(r.region.name)
        if mine is not None and mesh_levels is not None and (agreed or {}).get(r.region.name) == mine.choice:
            out[r.region.name] = mine
            continue
        routing = r.routing.cpu().numpy() if r.routing is not None and mesh_levels is None else None
        out[r.region.name] = plan_layer(r.region, r.layout, routing, topology, mesh_levels=mesh_levels,
                                        dimension=dimension, dedup=dedup, agreed=(agreed or {}).get(r.region.name),
                                        chunks=chunks, gather=gather, gather_compress=gather_compress,
                                        model_centric=model_centric, replicated=replicated,
                                        tune_strategy=tune_strategy)
    return out


__all__ = ["REGISTRY", "LayerPlan", "plan_layer", "plan_pass"]
