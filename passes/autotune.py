"""autotune: what an expert-parallel layer runs, measured on the ranks themselves at compile time:
its chunk count (options['pipeline'] = "tune") and its strategy (options['tune_strategy']).

MoNTA picks the chunk count from its model of the links and measured efficiency curves r(size)
(papers/monta.txt Alg. 1-2); ``cost.pipeline`` does the same on the staged HD-d layer, and the
planner (``cost.planner``) picks the strategy from the HierMoE, HybridEP and HEXA-MoE models. What
the models cannot know is what the ranks add: one more chunk's stage ops, the split sizes'
exchange and a collective's wait for ranks that share cores (on the emulated 2 x 2 cluster, 4
ranks on 2 cores, 25-50 ms per chunk forward + backward against the model's 4 ms, so with 32-128
tokens per rank "auto" ran 2 chunks where 1 is 1.15-1.5x faster: bench/results/pipeline_2x2_few.md),
or HD's per-step rounds against model0's fixed-size messages (bench/results/gather_model.md).
Inductor's max-autotune answers the same question for kernels by timing the candidates at compile
time; this pass does it for the layer:

    candidates: chunk counts 1 .. min(bound, TUNE_MAX) and the model's n (bound = MoNTA's chunk
    bound, ``cost.pipeline.chunk_bound``), or the strategies the planner predicts within
    TUNE_WITHIN of its best, one per distinct runtime (hd1 and hd2 both run d* per step)
    for each candidate: a throwaway runtime layer with its settings (mesh, d, dedup, domain,
    model-centric, sizes), and the layer's stages emitted for it alone in a graph, compiled by
    AOTAutograd with the overlap pass (start/wait on the communication lanes, as the real graph
    runs them)
    random inputs of the example's shapes (weights as the rank holds them: its E/G experts where
    the graph reads only those), routing drawn in proportion to the expert loads every rank's
    compile batch gave (``cost.planner.routing_from_load``: the layer's skew, so the busiest
    rank's compute and bytes are what is timed), or uniform at random without them
    rounds: every candidate once per round, in turn; each run one forward + backward, after a
    barrier, its time the slowest rank's (all_reduce MAX)
    choice = argmin median; another candidate than the baseline (n = 1; the planner's strategy)
    only where it saves TUNE_MIN_GAIN of the baseline's median

Every rank gets the same times (the MAX), so every rank chooses the same candidate with no further
exchange. The throwaway layers' traffic is not counted, the step clock the d tuner reads does not
advance, and the layers are dropped afterwards (``runtime.probing``). Layers with the same shapes
settings and expert loads share one measurement, also across recompiles. A candidate's compiled
graph depends on the shapes and settings, not on the loads: a later layer of the same shapes times
the graph compiled for an earlier one on its own throwaway layer (the graph's baked layer id
``runtime.remapped`` to it), so a model of identical layers compiles each candidate once.

Contract
    needs     the hiermoe::experts node's arguments with their fake values, the candidates'
              strategies and settings, a mesh every rank compiles with at the same point (as the
              plan's agreement already needs)
    does      returns the measured median fw+bw seconds per candidate and the one to run
    refuses   nothing: with one candidate nothing is measured
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from moe_compile.cost.pipeline import PipelineChoice
from moe_compile.cost.planner import routing_from_load
from moe_compile.ep import runtime
from moe_compile.lowering.strategies.common import Settings
from moe_compile.passes.graph_index import fake_tensor
from moe_compile.passes.overlap import OverlapPass

TUNE_MAX = 4  # the most chunks measured besides the model's n (each candidate costs a compile)
TUNE_WITHIN = 2.0  # strategies the planner predicts slower than twice its best are not measured
TUNE_ROUNDS = 5  # timed runs per candidate, after one untimed run (process groups connect on first use)
TUNE_MIN_GAIN = 0.03  # another candidate than the baseline where its median saves this much (runs differ by a few per cent)
_WEIGHTS = range(3, 9)  # w_up, w_gate, w_down, b_up, b_gate, b_down in hiermoe::experts


@dataclass(frozen=True)
class Candidate:
    """One thing to time: the strategy that emits the layer's stages, its runtime settings, and
    whether the graph's weights hold every expert (by_expert) or only this rank's."""

    strategy: Any  # lowering.strategies.Strategy
    settings: Settings
    by_expert: bool


@dataclass(frozen=True)
class Measured:
    """The candidates' median forward + backward seconds (slowest rank) and the one chosen."""

    choice: str
    times_s: dict[str, float]

    def describe(self, what: str) -> str:
        """"measured <what> 1 12.3, 2 10.1 ms fw+bw (slowest rank, median): runs 2"."""
        each = ", ".join(f"{k} {t * 1e3:.1f}" for k, t in self.times_s.items())
        return f"measured {what} {each} ms fw+bw (slowest rank, median): runs {self.choice}"


_MEASURED: dict[tuple[Any, ...], Measured] = {}
# a candidate's compiled throwaway graph and the layer id baked into it, by what compiling it
# depends on: the measurement's key without the expert loads, and the candidate
_COMPILED: dict[tuple[Any, ...], tuple[Any, int]] = {}


def chunk_candidates(pipe: PipelineChoice | None, num_tokens: int) -> list[int]:
    """1 .. min(MoNTA's bound, ``TUNE_MAX``) and the model's n (the bound is the largest n the
    model searched; without a model, ``TUNE_MAX``), at most one chunk per token."""
    bound = max(pipe.times_s) if pipe is not None else TUNE_MAX
    ns = {n for n in range(1, min(bound, TUNE_MAX) + 1)} | ({pipe.chunks} if pipe is not None else set())
    return sorted(n for n in ns if n == 1 or n <= num_tokens)


def _inputs(args: Sequence[Any], num_experts: int, top_k: int, gen: torch.Generator,
            expert_load: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
    """Real tensors for the op's node arguments, by position: random, the routing uniform (K
    distinct experts per token; its nodes, made by canonicalize, may carry no example value: the
    routing is [T, K] of the tokens' T) or drawn in proportion to ``expert_load`` (every rank's
    compile batch's pairs per expert: the layer's skew, so the busiest rank's compute is timed),
    floating ones requiring grad as the model's do; weights with every expert (``_local`` cuts a
    rank's)."""
    x = fake_tensor(args[0])
    if x is None:
        raise ValueError(f"autotune: the expert op's tokens ({args[0]}) have no example value")
    num_tokens = int(x.shape[0])
    values: dict[int, torch.Tensor] = {}
    for i, a in enumerate(args):
        if not isinstance(a, fx.Node):
            continue
        if i == 1 and expert_load is not None:  # no pairs at all: routing_from_load draws uniformly
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            t = torch.from_numpy(routing_from_load(num_tokens, top_k, expert_load, seed)).to(torch.int64)
        elif i == 1:
            t = torch.rand((num_tokens, num_experts), generator=gen).topk(top_k, dim=1).indices
        elif i == 2:
            t = torch.rand((num_tokens, top_k), generator=gen).to(x.dtype)
        else:
            fake = fake_tensor(a)
            if fake is None:
                raise ValueError(f"autotune: argument {i} ({a.name}) of the expert op has no example value")
            shape = [int(s) for s in fake.shape]
            if i in _WEIGHTS:  # the graph may hold the rank's experts only (a shard); every expert here
                shape[0] = num_experts
            t = 0.02 * torch.randn(tuple(shape), generator=gen).to(fake.dtype)
        values[i] = t.to(x.device).requires_grad_(t.dtype.is_floating_point)
    return values


def _local(values: Mapping[int, torch.Tensor], by_expert: bool, per_rank: int) -> dict[int, torch.Tensor]:
    """The inputs as a candidate's graph reads them: every expert's weights (by_expert), or the
    first ``per_rank`` rows (the rank's own experts, as shard_experts or the restacked modules give)."""
    if by_expert:
        return dict(values)
    return {i: (v.detach()[:per_rank].clone().requires_grad_(v.requires_grad) if i in _WEIGHTS else v)
            for i, v in values.items()}


def _compiled(cand: Candidate, args: Sequence[Any], values: Mapping[int, torch.Tensor], layer_id: int, name: str,
              top_k: int) -> Any:
    """The layer's stages for ``cand`` alone in a graph, compiled as the real graph is on
    aot_eager (forward and backward split into start and wait by the overlap pass)."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    # example inputs in a fake mode with a shape environment, as Dynamo gives the real graph's:
    # the dispatch's row count is data-dependent
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = {i: mode.from_tensor(v) for i, v in values.items()}
    graph = fx.Graph()
    placeholders = {}
    for i, v in fakes.items():
        placeholders[i] = graph.placeholder(f"in{i}")
        placeholders[i].meta["val"] = v
    y = cand.strategy.emit(graph, [placeholders.get(i, a) for i, a in enumerate(args)], layer_id, cand.by_expert,
                           name, cand.settings, top_k)
    graph.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    overlap = OverlapPass()

    def nop(g: fx.GraphModule, ex: list[object]) -> Any:
        overlap(g.graph)
        g.recompile()
        return boxed_nop(g, ex)  # type: ignore[arg-type]

    # the backward compiled now, not at its first call: that call comes during the user's compile
    # (measure runs inside it), and a lazy backward compile there records its metrics into the
    # user's compile's (Dynamo: "Metric(s) {'is_forward'} have already been set"). AOTAutograd
    # compiles it lazily where the graph saves no symbolic size for backward (a gather, a flat
    # all-to-all of fixed shapes)
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        return aot_eager(gm, list(fakes.values()), fw_compiler=nop, bw_compiler=nop)  # type: ignore[arg-type]


def measure(*, key: tuple[Any, ...], op_args: Sequence[Any], candidates: Mapping[str, Candidate], baseline: str,
            name: str, top_k: int, num_experts: int, probe_layer: Callable[[Settings], Any],
            expert_load: Sequence[int] | None = None) -> Measured:
    """Time every candidate (module docstring) on throwaway layers made by ``probe_layer``;
    ``key`` names what compiling a candidate depends on (the op's arguments' shapes and constants,
    mesh, topology); the measurement depends on ``expert_load`` too."""
    def cand_key(c: Candidate) -> tuple[Any, ...]:
        return c.strategy.name, c.settings, c.by_expert

    measured_key = (key, expert_load, tuple((k, *cand_key(c)) for k, c in candidates.items()))
    if measured_key in _MEASURED:
        return _MEASURED[measured_key]
    if len(candidates) < 2:
        return Measured(baseline, {})
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(4099 + 7919 * dist.get_rank())
    full = _inputs(op_args, num_experts, top_k, gen, expert_load)
    times: dict[str, list[float]] = {k: [] for k in candidates}
    # outside the user's compile: AOTAutograd records into the current tracing context, which is
    # the graph being compiled
    with runtime.probing(), torch._guards.tracing(None):
        runs = {}
        for k, cand in candidates.items():
            lay = probe_layer(cand.settings)
            inputs = _local(full, cand.by_expert, num_experts // world)
            compiled_key = (key, *cand_key(cand))
            if compiled_key not in _COMPILED:
                _COMPILED[compiled_key] = (_compiled(cand, op_args, inputs, lay.layer_id, f"{name}_tune_{k}", top_k),
                                           lay.layer_id)
            fn, baked = _COMPILED[compiled_key]
            runs[k] = (fn, list(inputs.values()), lay.comm.device, {baked: lay.layer_id})
        for rnd in range(TUNE_ROUNDS + 1):
            for k, (fn, inputs_k, device, ids) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                with runtime.remapped(ids):
                    (y,) = fn(*inputs_k)
                    y.backward(torch.ones_like(y))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if rnd:  # the first round connects the groups and warms up
                    times[k].append(float(dt))
                for v in inputs_k:
                    v.grad = None
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med, key=med.__getitem__)  # dicts keep the candidates' order: ties to the earlier
    if best != baseline and med[best] > (1.0 - TUNE_MIN_GAIN) * med[baseline]:
        best = baseline
    _MEASURED[measured_key] = Measured(best, med)
    return _MEASURED[measured_key]


__all__ = ["TUNE_MAX", "TUNE_MIN_GAIN", "TUNE_ROUNDS", "TUNE_WITHIN", "Candidate", "Measured", "chunk_candidates",
           "measure"]
