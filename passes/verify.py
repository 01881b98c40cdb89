"""Numerical verification of a region interpretation before it is rewritten (DESIGN.md: "A rewrite
never changes what the model computes").

The region is cut out of the graph at its boundary (token input, router top-k, router scores,
expert parameters, ...) into a standalone graph; a second graph computes the same value with the
emitted expert op.  Both run on the boundary values the compile's example inputs produce, and on
two synthetic routings that exercise every expert (balanced) and overflow a few (all tokens on
the first K experts, which makes capacity-limited layers drop).  Outputs and the gradients with
respect to every floating boundary value (tokens, routing weights, expert weights) must agree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_compile.passes.emit import emit_expert_op, shape_source
from moe_compile.passes.graph_index import GraphIndex
from moe_compile.passes.graph_params import ParamTable
from moe_compile.passes.regions import ExpertLayout, MoERegion, OutputCandidate, RoutingWeights

log = logging.getLogger(__name__)

# Relative tolerance (to the larger magnitude of the two tensors) per dtype.  Interpretations that
# are wrong (swapped gate/up, wrong orientation, dropless instead of capacity-limited) are off by
# O(1); differences in summation order are ~1e-6 in fp32, so these bounds separate the two.
_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    forward_err: float
    backward_err: float
    reason: str = ""


class _Done(Exception):
    pass


def capture_boundary_values(gm: fx.GraphModule, example_inputs: Sequence[object], index: GraphIndex,
                            wanted: set[fx.Node]) -> dict[fx.Node, object]:
    """Run the graph on the example inputs and keep a copy of each wanted node's value as it was
    produced (later in-place updates must not leak into the copy)."""
    store: dict[fx.Node, object] = {}
    if not wanted:
        return store
    mutated_inputs = {index.root(m) for muts in index.mutators.values() for m in muts}

    class Capture(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            if n in wanted:
                store[n] = _copy(out, share=n.op in ("placeholder", "get_attr"))
                if len(store) == len(wanted):
                    raise _Done
            return out

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = [_materialize(ex, n, clone=n in mutated_inputs) for n, ex in zip(placeholders, example_inputs)]
    grad_mode = torch.is_grad_enabled()
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            Capture(gm).run(*args)
    except _Done:
        pass
    finally:
        torch.set_grad_enabled(grad_mode)
    return store


def _materialize(ex: object, node: fx.Node, clone: bool) -> object:
    if isinstance(ex, torch._subclasses.FakeTensor):
        raise ValueError(
            f"example input {node.name} is a fake tensor, so the region cannot be verified "
            "numerically; compile with real inputs or pass options={'verify': False}")
    if clone and isinstance(ex, torch.Tensor):
        return ex.detach().clone()
    if isinstance(ex, torch.SymInt | torch.SymFloat | torch.SymBool):
        # dynamic shapes: run on the size hint without int(), which would add a guard and
        # specialize the graph
        return ex.node.hint
    return ex


def _copy(v: object, share: bool) -> object:
    if isinstance(v, torch.Tensor):
        return v.detach() if share else v.detach().clone()
    if isinstance(v, tuple | list):
        return type(v)(_copy(x, share) for x in v)
    return v


def boundary_of(index: GraphIndex, params: ParamTable, region: MoERegion, cand: OutputCandidate) -> list[fx.Node]:
    """Values the region reads from outside, plus the token input and top-k the op reads."""
    inner = {n for n in cand.nodes if n not in params}
    bnd = {d for n in inner for d in index.deps[n]} - inner
    bnd |= {region.tokens, region.topk}
    template = shape_source(region, cand.node)
    if template is not None:
        bnd.add(template)
    bnd |= {w.node for w in region.weights if w.node not in inner}
    return index.ordered(bnd)


def verify_interpretation(index: GraphIndex, params: ParamTable, region: MoERegion, cand: OutputCandidate,
                          layout: ExpertLayout, weights: RoutingWeights,
                          values: dict[fx.Node, object]) -> Verdict:
    boundary = boundary_of(index, params, region, cand)
    inner = [n for n in index.ordered(cand.nodes) if n not in params]
    original = _subgraph(boundary, inner, lambda g, m: m(cand.node))
    keep_roots = [weights.node] if weights.node in cand.nodes else []
    keep = set(index.ancestors(keep_roots, stop=set(boundary))) & set(inner)
    replacement = _subgraph(boundary, index.ordered(keep),
                            lambda g, m: emit_expert_op(g, region, layout, weights, cand.node, m)[1])
    base = [values[b] for b in boundary]
    cases = [("example inputs", base)] + _synthetic_cases(boundary, base, region)
    compute = getattr(torch, region.dtype)
    fwd_err = bwd_err = 0.0
    for label, vals in cases:
        try:
            err, ok = _compare_forward(original, replacement, vals, compute)
        except Exception as e:  # a wrong interpretation may not even run (shape mismatch)
            return Verdict(False, float("inf"), float("inf"), f"{label}: {type(e).__name__}: {e}")
        fwd_err = max(fwd_err, err)
        if not ok:
            return Verdict(False, fwd_err, bwd_err, f"{label}: outputs differ (relative error {err:.2e})")
        if label != "skewed routing":
            err, ok = _compare_backward(original, replacement, vals, [b in params for b in boundary], compute)
            bwd_err = max(bwd_err, err)
            if not ok:
                return Verdict(False, fwd_err, bwd_err, f"{label}: gradients differ (relative error {err:.2e})")
    return Verdict(True, fwd_err, bwd_err)


def _subgraph(boundary: list[fx.Node], inner: list[fx.Node], make_out) -> fx.GraphModule:  # type: ignore[no-untyped-def]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for b in boundary:
        env[b] = g.placeholder(b.name)
    for n in inner:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(make_out(g, env.__getitem__))
    return fx.GraphModule(torch.nn.Module(), g)


def _synthetic_cases(boundary: list[fx.Node], base: list[object], region: MoERegion) -> list[tuple[str, list[object]]]:
    if region.topk not in boundary:
        return []
    i = boundary.index(region.topk)
    topk_value = base[i]  # topk's (values, indices)
    assert isinstance(topk_value, tuple)
    vals: torch.Tensor = topk_value[0]
    idx: torch.Tensor = topk_value[1]
    e, k = region.num_experts, region.top_k
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(idx.shape, generator=gen).to(device=vals.device, dtype=vals.dtype)
    w = w.sort(dim=-1, descending=True).values
    flat = torch.arange(idx.numel(), device=idx.device)
    # token t takes experts tK..tK+K-1 (mod E): distinct per row, every expert used
    balanced = flat.remainder(e).view(idx.shape)
    skewed = (flat % k).view(idx.shape)
    out = []
    for label, new_idx in (("balanced routing", balanced), ("skewed routing", skewed)):
        vals_list = list(base)
        vals_list[i] = (w.clone(), new_idx.to(idx.dtype))
        out.append((label, vals_list))
    return out


def _fresh(vals: list[object]) -> list[object]:
    return [_copy(v, share=False) for v in vals]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the larger magnitude; inf on a shape mismatch."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    a64, b64 = a.detach().double(), b.detach().double()
    diff = (a64 - b64).abs().max().item()
    scale = max(a64.abs().max().item(), b64.abs().max().item())
    return 0.0 if diff == 0 else diff / max(scale, 1e-30)


def _passes(err: float, a: torch.Tensor, b: torch.Tensor, compute: torch.dtype) -> bool:
    # a value computed from low-precision expert outputs (e.g. an fp32 routing-weight gradient
    # of a bf16 layer) is only as exact as the layer's compute dtype
    return err <= max(_RTOL.get(a.dtype, 1e-4), _RTOL.get(b.dtype, 1e-4), _RTOL.get(compute, 1e-4))


def _compare_forward(original: fx.GraphModule, replacement: fx.GraphModule, vals: list[object],
                     compute: torch.dtype) -> tuple[float, bool]:
    with torch.no_grad():
        y_o = original(*_fresh(vals))
        y_n = replacement(*_fresh(vals))
    err = _rel_err(y_n, y_o)
    return err, _passes(err, y_n, y_o, compute)


def _compare_backward(original: fx.GraphModule, replacement: fx.GraphModule, vals: list[object],
                      is_param: list[bool], compute: torch.dtype) -> tuple[float, bool]:
    leaves: list[torch.Tensor] = []

    def with_leaves() -> list[object]:
        out: list[object] = []
        for v, p in zip(vals, is_param):
            if isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor) and v[0].is_floating_point():
                out.append((leaf_of(v[0], p).clone(), *v[1:]))
            elif isinstance(v, torch.Tensor) and v.is_floating_point():
                leaf = leaf_of(v, p)
                out.append(leaf if p else leaf.clone())  # clone: the region may update it in place
            else:
                out.append(_copy(v, share=False))
        return out

    cache: dict[int, torch.Tensor] = {}

    def leaf_of(v: torch.Tensor, share: bool) -> torch.Tensor:
        if id(v) not in cache:
            leaf = v.detach() if share else v.detach().clone()
            cache[id(v)] = leaf.requires_grad_()
            leaves.append(cache[id(v)])
        return cache[id(v)]

    with torch.enable_grad():
        y_o = original(*with_leaves())
        y_n = replacement(*with_leaves())
        if not y_o.requires_grad:
            return 0.0, True
        gen = torch.Generator().manual_seed(1)
        g = torch.randn(y_o.shape, generator=gen, dtype=torch.float32).to(y_o)
        g_o = torch.autograd.grad(y_o, leaves, g, allow_unused=True)
        g_n = torch.autograd.grad(y_n, leaves, g, allow_unused=True) if y_n.requires_grad else [None] * len(leaves)
    err, ok = 0.0, True
    for a, b, leaf in zip(g_n, g_o, leaves):
        a = torch.zeros_like(leaf) if a is None else a
        b = torch.zeros_like(leaf) if b is None else b
        e = _rel_err(a, b)
        if not _passes(e, a, b, compute):
            ok = False
            log.debug("gradient mismatch for a boundary value of shape %s: relative error %.2e",
                      tuple(leaf.shape), e)
        err = max(err, e)
    return err, ok

