"""tune_chunks: a layer's chunk count measured on the ranks themselves (options['pipeline'] = "tune").

MoNTA picks the chunk count from its model of the links and measured efficiency curves r(size)
(papers/monta.txt Alg. 1-2); ``cost.pipeline`` does the same on the staged HD-d layer. What that
model cannot know is what one more chunk costs on the ranks: its stage ops, the split sizes'
exchange and a collective's wait for ranks that share cores. On the emulated 2 x 2 cluster (4
ranks on 2 cores) that is 12-20 ms per chunk and direction against the model's 2 ms, so with 32-128
tokens per rank "auto" ran 2 chunks where 1 is 1.2-1.5x faster (bench/README.md). Inductor's
max-autotune answers the same question for kernels by timing the candidates at compile time; this
pass does it for the pipeline:

    for each candidate n (1 .. min(bound, TUNE_MAX), and the model's n; bound = MoNTA's chunk
    bound, ``cost.pipeline.chunk_bound``):
        a throwaway runtime layer with the real layer's settings (mesh, d, dedup, sizes), and
        the layer's stages emitted for n chunks alone in a graph, compiled by AOTAutograd with
        the overlap pass (start/wait on the communication lanes, as the real graph runs them)
    random inputs of the example's shapes, routing uniform at random (the model's assumption)
    rounds: every candidate once per round, in turn; each run one forward + backward, after a
    barrier, its time the slowest rank's (all_reduce MAX)
    n = argmin median; n > 1 only where it saves TUNE_MIN_GAIN of n = 1's median

Every rank gets the same times (the MAX), so every rank chooses the same n with no further
exchange. The throwaway layer's traffic is not counted, the step clock the d tuner reads does not
advance, and the layer is dropped afterwards (``runtime.probing``). Layers with the same shapes and
settings share one measurement (a model's layers usually do).

Contract
    needs     the planned layer (its strategy, settings and the model's ``PipelineChoice``), the
              hiermoe::experts node's arguments with their fake values, a mesh every rank
              compiles with at the same point (as the plan's agreement already needs)
    does      returns the measured median fw+bw seconds per candidate n and the n to run
    refuses   nothing: a layer with no tokens or no chunk bound above 1 measures n = 1 alone
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from moe_compile.cost.pipeline import PipelineChoice
from moe_compile.ep import runtime
from moe_compile.lowering.strategies.common import Settings
from moe_compile.passes.graph_index import fake_tensor
from moe_compile.passes.overlap import OverlapPass

TUNE_MAX = 4  # the most chunks measured besides the model's n (each candidate costs a compile)
TUNE_ROUNDS = 5  # timed runs per candidate, after one untimed run (process groups connect on first use)
TUNE_MIN_GAIN = 0.03  # n > 1 runs where its median saves this much of n = 1's (runs differ by a few per cent)


@dataclass(frozen=True)
class Measured:
    """The candidates' median forward + backward seconds (slowest rank) and the n chosen."""

    chunks: int
    times_s: dict[int, float]


_MEASURED: dict[tuple[Any, ...], Measured] = {}


def candidates(pipe: PipelineChoice | None, num_tokens: int) -> list[int]:
    """1 .. min(MoNTA's bound, ``TUNE_MAX``) and the model's n (the bound is the largest n the
    model searched; without a model, ``TUNE_MAX``), at most one chunk per token."""
    bound = max(pipe.times_s) if pipe is not None else TUNE_MAX
    ns = {n for n in range(1, min(bound, TUNE_MAX) + 1)} | ({pipe.chunks} if pipe is not None else set())
    return sorted(n for n in ns if n == 1 or n <= num_tokens)


def _inputs(args: Sequence[Any], num_experts: int, top_k: int, gen: torch.Generator) -> dict[int, torch.Tensor]:
    """Real tensors for the op's node arguments, by position: random, the routing uniform (K
    distinct experts per token; its nodes, made by canonicalize, may carry no example value: the
    routing is [T, K] of the tokens' T), floating ones requiring grad as the model's do."""
    x = fake_tensor(args[0])
    if x is None:
        raise ValueError(f"pipeline 'tune': the expert op's tokens ({args[0]}) have no example value")
    num_tokens = int(x.shape[0])
    values: dict[int, torch.Tensor] = {}
    for i, a in enumerate(args):
        if not isinstance(a, fx.Node):
            continue
        if i == 1:
            t = torch.rand((num_tokens, num_experts), generator=gen).topk(top_k, dim=1).indices
        elif i == 2:
            t = torch.rand((num_tokens, top_k), generator=gen).to(x.dtype)
        else:
            fake = fake_tensor(a)
            if fake is None:
                raise ValueError(f"pipeline 'tune': argument {i} ({a.name}) of the expert op has no example value")
            t = 0.02 * torch.randn(tuple(int(s) for s in fake.shape), generator=gen).to(fake.dtype)
        values[i] = t.to(x.device).requires_grad_(t.dtype.is_floating_point)
    return values


def _compiled(strategy: Any, args: Sequence[Any], values: dict[int, torch.Tensor], layer_id: int, by_expert: bool,
              name: str, settings: Settings, top_k: int) -> Any:
    """The layer's stages for ``settings.chunks`` chunks alone in a graph, compiled as the real
    graph is on aot_eager (forward and backward split into start and wait by the overlap pass)."""
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
    y = strategy.emit(graph, [placeholders.get(i, a) for i, a in enumerate(args)], layer_id, by_expert, name,
                      settings, top_k)
    graph.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    overlap = OverlapPass()

    def nop(g: fx.GraphModule, ex: list[object]) -> Any:
        overlap(g.graph)
        g.recompile()
        return boxed_nop(g, ex)  # type: ignore[arg-type]

    return aot_eager(gm, list(fakes.values()), fw_compiler=nop, bw_compiler=nop)  # type: ignore[arg-type]


def measure(*, key: tuple[Any, ...], op_args: Sequence[Any], strategy: Any, settings: Settings,
            pipe: PipelineChoice | None, by_expert: bool, name: str, top_k: int, num_experts: int,
            num_tokens: int, probe_layer: Any) -> Measured:
    """Time every candidate n (module docstring) on a throwaway layer made by ``probe_layer()``;
    ``key`` names what the measurement depends on (shapes, settings, mesh, topology)."""
    if key in _MEASURED:
        return _MEASURED[key]
    ns = candidates(pipe, num_tokens)
    if ns == [1]:
        return Measured(1, {})
    lay = probe_layer()
    device = lay.comm.device
    gen = torch.Generator().manual_seed(4099 + 7919 * dist.get_rank())
    values = _inputs(op_args, num_experts, top_k, gen)
    inputs = list(values.values())
    times: dict[int, list[float]] = {n: [] for n in ns}
    # outside the user's compile: AOTAutograd records into the current tracing context, which is
    # the graph being compiled
    with runtime.probing(lay), torch._guards.tracing(None):
        runs = {n: _compiled(strategy, op_args, values, lay.layer_id, by_expert, f"{name}_tune{n}",
                             Settings(settings.dimension, settings.dedup, chunks=n), top_k) for n in ns}
        for rnd in range(TUNE_ROUNDS + 1):
            for n in ns:
                dist.barrier()
                t0 = time.perf_counter()
                y = runs[n](*inputs)
                y = y[0] if isinstance(y, list | tuple) else y
                y.backward(torch.ones_like(y))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if rnd:  # the first round connects the groups and warms up
                    times[n].append(float(dt))
                for v in inputs:
                    v.grad = None
    med = {n: statistics.median(v) for n, v in times.items()}
    best = min(med, key=lambda n: (med[n], n))
    if best != 1 and med[best] > (1.0 - TUNE_MIN_GAIN) * med[1]:
        best = 1
    _MEASURED[key] = Measured(best, med)
    return _MEASURED[key]


__all__ = ["TUNE_MAX", "TUNE_MIN_GAIN", "TUNE_ROUNDS", "Measured", "candidates", "measure"]
