"""Helpers shared by the compile tests: run a model eager and compiled with hiermoe, compare.

Tolerance (fp32): the rewrite replaces the layer's matmuls and sums by the expert op's, which
sums the same products in another order, so results differ by rounding only (~1e-7 relative);
1e-5 of each tensor's scale (its largest magnitude, at least 1) leaves headroom for that and
still fails on any real semantic difference.  If a comparison fails, fix the finder or the op,
not the tolerance.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import moe_compile
from moe_compile.backend import collect_reports
from moe_compile.report import Report
from moe_compile.samples.grouped_gemm import GroupedGemmMoE

RTOL = 1e-5


@dataclass
class Comparison:
    report: Report
    out_err: float
    grad_errs: dict[str, float]

    def assert_close(self, rtol: float = RTOL) -> None:
        assert self.out_err <= rtol, f"output differs from eager: {self.out_err:.2e} (relative to scale)"
        bad = {k: v for k, v in self.grad_errs.items() if v > rtol}
        assert not bad, f"gradients differ from eager (relative to scale): {bad}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max(1, max |b|)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


def _first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"cannot find the output tensor in {type(out).__name__}")


def compare_compiled(model: torch.nn.Module, inputs: Sequence[torch.Tensor], options: dict | None = None,
                     input_grads: bool = True) -> Comparison:
    """Compile ``model`` with hiermoe, run it and eager on the same inputs with the same random
    cotangent, and compare the outputs and the gradients of every parameter (and float input)."""
    options = {"inner_compiler": "aot_eager", **(options or {})}
    torch._dynamo.reset()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def run(fn: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
        xs = [x.detach().clone().requires_grad_(input_grads and x.is_floating_point()) for x in inputs]
        out = _first_tensor(fn(*xs))  # type: ignore[operator]
        leaves = [p for _, p in params] + [x for x in xs if x.requires_grad]
        gen = torch.Generator().manual_seed(123)
        cot = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        grads = torch.autograd.grad(out, leaves, cot, allow_unused=True, materialize_grads=True)
        return out.detach(), list(grads)

    with collect_reports() as graphs:
        compiled = torch.compile(model, backend="hiermoe", options=options)
        out_c, grads_c = run(compiled)
    out_e, grads_e = run(model)
    names = [n for n, _ in params] + [f"input{i}" for i, x in enumerate(inputs) if input_grads and x.is_floating_point()]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, grads_c, grads_e)}
    return Comparison(report=Report(graphs=list(graphs)), out_err=rel_err(out_c, out_e), grad_errs=errs)


def op_count(report: Report) -> int:
    # the expert op, opaque or as the composite the inner compiler sees through (lower_kernels)
    return sum(report.after.count(f"torch.ops.hiermoe.{op}(")
               for op in ("experts.default", "experts", "experts_composite.default", "experts_composite_list.default",
                         "experts_composite_gate_up.default"))


__all__ = ["Comparison", "compare_compiled", "moe_compile", "op_count", "rel_err"]


@contextmanager
def kept_for_backward(model: torch.nn.Module) -> Iterator[list[int]]:
    """Inside the block, the bytes of every tensor autograd keeps for backward that is not one of
    ``model``'s parameters (the activations), appended to the yielded list."""
    params = {p.data_ptr() for p in model.parameters()}
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept


def selective_policy(seen: list[str], save: tuple[str, ...]) -> Any:
    """A selective-checkpoint context_fn whose policy records every op it is asked about and saves
    the outputs of the ops named in ``save`` (recomputes the others)."""
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen.append(str(op))
        return CheckpointPolicy.MUST_SAVE if str(op) in save else CheckpointPolicy.PREFER_RECOMPUTE
    return functools.partial(create_selective_checkpoint_contexts, policy)


# the grouped matmuls of the rewritten expert op, as a policy names them
SAVE_GROUPED = ("hiermoe.grouped_mm.default", "hiermoe.grouped_mm_rows.default")


class ExpertsCheckpointed(GroupedGemmMoE):
    """A grouped-GEMM MoE layer whose experts alone run in a checkpoint (its router and the token
    sort outside), as Megatron recomputes only the MoE part; ``context_fn``: a selective one."""

    def __init__(self, context_fn: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint_kwargs = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn else {})

    def experts(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().experts, *args, **self.checkpoint_kwargs)
