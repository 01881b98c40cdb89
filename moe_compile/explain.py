"""``moe_compile.explain``: compile a model with hiermoe, run it once, and return the report."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from moe_compile.backend import collect_reports, hiermoe_backend
from moe_compile.options import parse_options
from moe_compile.report import Report, parallel_summary


def explain(model: torch.nn.Module, *example_inputs: object, options: Mapping[str, object] | None = None,
            **example_kwargs: object) -> Report:
    """Compile ``model`` with the hiermoe backend, run it once on the inputs, return a Report.

    ``report.regions`` lists every MoE layer rewritten, ``report.skipped`` every layer or graph
    left alone with the reason, ``report.before``/``report.after`` the graph code, and
    ``report.graph_breaks`` the reasons Dynamo split the model into several graphs.  Dynamo's
    caches are reset first so the report describes a fresh compile; the model object itself is
    not modified.  Under torchrun with options['mesh'], every rank must call it (the step runs
    collectives); each expert-parallel layer's ``parallel`` entry then holds the d it used, the
    predicted time of every d, and the bytes this rank sent per level in that step.
    """
    return explain_run(model, lambda compiled: compiled(*example_inputs, **example_kwargs), options)


def explain_run(model: torch.nn.Module, run: Callable[[Callable[..., Any]], object],
                options: Mapping[str, object] | None = None) -> Report:
    """``explain`` with the step given as ``run(compiled_model)``: e.g. a forward and a backward,
    whose graphs (the backward's too) are compiled inside it."""
    parse_options(options)  # fail before compiling on a bad option
    torch._dynamo.reset()
    counters["unimplemented"].clear()
    backend = functools.partial(hiermoe_backend, options=dict(options or {}))
    with collect_reports() as graphs:
        run(torch.compile(model, backend=backend))
    breaks = [_summarize_break(reason, n) for reason, n in counters["unimplemented"].items()]
    for g in graphs:  # expert-parallel layers: what the step just run chose and sent
        g.regions = [r if r.ep_layer is None else replace(r, parallel=parallel_summary(r.ep_layer))
                     for r in g.regions]
    return Report(graphs=list(graphs), graph_breaks=breaks)


def _summarize_break(reason: str, count: int) -> str:
    """First line of Dynamo's graph-break message plus where it happened."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    where = next((ln for ln in lines if ln.startswith("Developer debug context:")), "")
    where = where.removeprefix("Developer debug context:").strip()
    text = lines[0] if lines else reason
    if where:
        text += f" [{where}]"
    return text + (f" (x{count})" if count > 1 else "")
