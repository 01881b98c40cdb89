"""Numerical verification of a region interpretation before it is rewritten (DESIGN.md: "A rewrite
never changes what the model computes").  It is the second line: ``account.unexplained_op``
first checks that every op the rewrite removes is one the expert op computes.

The region is cut out of the graph at its boundary (token input, router top-k, router scores,
expert parameters, ...) into a standalone graph; a second graph computes the same value with the
emitted expert op.  Both run on sample values, never on the compile's batch or the model's
expert weights: the graph is run once with the tokens (at the tensor they are a view or cast of)
replaced by N(0, 1) samples and every expert weight by N(0, 1/fan_in) samples (biases N(0, 1/4)),
drawn from generators seeded per region.  So a NaN or an odd batch on one rank cannot change the
decision, zero-initialized weights cannot hide a wrong layout, and every rank that compiles the
same graph decides the same.  The cases:

    router         the router's own top-k on the sample tokens
    balanced       every expert used (token t takes experts tK..tK+K-1 mod E)
    large values   the tokens x16 (pre-activations of about +-16 sigma), balanced routing: an op
                   that only acts on large values (a clamp, a saturation) shows up here
    skewed         all tokens on the first K experts (capacity-limited layers drop), forward only

Outputs and the gradients with respect to every floating boundary value (tokens, routing
weights, expert weights) must agree.  A region of 0 tokens verifies nothing (``vacuous``).

Under torch.autocast (entered inside the compiled code, ``autocast_at``, or around the call), the
op computes in the layer's matmul dtype (``region.dtype``); the interpretation is checked outside
autocast at the tokens' dtype (forward and backward), then the op as emitted against the layer
under autocast (forward).  A layer that cannot run outside autocast, or differs there beyond
fp32's tolerance, is checked under autocast alone, backward too, at the compute dtype's tolerance.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from moe_compile.passes import op_kinds as ops
from moe_compile.passes.emit import emit_expert_op, shape_source
from moe_compile.passes.graph_index import GraphIndex, example_value, static_shape, tensor_meta, value_shape
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


# how far the "large values" case scales the sample tokens (their pre-activations are ~N(0, 1))
LARGE_SCALE = 16.0
_BIAS_STD = 0.5

Override = Callable[[object], object]


class _Done(Exception):
    pass


def sample_overrides(index: GraphIndex, params: ParamTable, regions: Sequence[MoERegion]) -> dict[fx.Node, Override]:
    """What verification runs the graph on instead of the batch and the expert weights: for each
    region, the tensor its tokens are a view or cast of, and every expert weight and bias node of
    its layouts, each replaced by samples of its shape and dtype from a generator seeded by the
    region's position and the node's (the same on every rank)."""
    out: dict[fx.Node, Override] = {}
    for i, region in enumerate(regions):
        root = index.value_root(region.tokens)
        out.setdefault(root, _sampler(1000 * i, 1.0, last_dim=False))
        roles = {(role, bias) for lay in region.layouts
                 for role, bias in ((lay.up, False), (lay.gate, False), (lay.down, False),
                                    (lay.b_up, True), (lay.b_gate, True), (lay.b_down, True)) if role is not None}
        nodes = sorted({(n, bias) for role, bias in roles for n in role.nodes}, key=lambda nb: index.pos[nb[0]])
        for j, (n, bias) in enumerate(nodes):
            out.setdefault(n, _sampler(1000 * i + 1 + j, _BIAS_STD, last_dim=not bias))
    return out


def _sampler(seed: int, std: float, last_dim: bool) -> Override:
    """N(0, std^2) (N(0, 1/fan_in) with ``last_dim``: fan_in = the last dim) like a float tensor."""
    def sample(v: object) -> object:
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            return v
        gen = torch.Generator().manual_seed(seed)
        scale = 1.0 / max(1, v.shape[-1]) ** 0.5 if last_dim and v.dim() else std
        return (torch.randn(v.shape, generator=gen, dtype=torch.float32) * scale).to(v.dtype).to(v.device)
    return sample


def capture_boundary_values(gm: fx.GraphModule, example_inputs: Sequence[object], index: GraphIndex,
                            wanted: set[fx.Node], overrides: Mapping[fx.Node, Override] | None = None
                            ) -> dict[fx.Node, object]:
    """Run the graph on the example inputs, with ``overrides`` replacing the value of the nodes
    they name as it is produced, and keep a copy of each wanted node's value as it was produced
    (later in-place updates must not leak into the copy)."""
    store: dict[fx.Node, object] = {}
    if not wanted:
        return store
    subs: Mapping[fx.Node, Override] = overrides or {}
    mutated_inputs = {index.root(m) for muts in index.mutators.values() for m in muts}

    class Capture(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            if n in subs:
                out = subs[n](out)
            if n in wanted:
                store[n] = _copy(out, share=n.op in ("placeholder", "get_attr"))
                if len(store) == len(wanted):
                    raise _Done
            return out

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = [ex if n in subs and isinstance(ex, torch.Tensor) else _materialize(ex, n, clone=n in mutated_inputs)
            for n, ex in zip(placeholders, example_inputs)]
    grad_mode = torch.is_grad_enabled()
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    capture = Capture(gm)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            capture.run(*args)
    except _Done:
        pass
    finally:
        torch.set_grad_enabled(grad_mode)
        _leave_autocast(gm.graph, capture.env)
    return store


def _leave_autocast(graph: fx.Graph, env: Mapping[fx.Node, object]) -> None:
    """Exit the ``torch.autocast`` regions a run stopped inside (innermost first): the compile
    that follows must not run under the model's autocast."""
    exited = {n.args[0] for n in env if n.op == "call_function" and n.target is torch.amp.autocast_mode._exit_autocast}
    for n in reversed(list(env)):
        if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast and n not in exited:
            torch.amp.autocast_mode._exit_autocast(env[n])  # type: ignore[arg-type]


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


def kept_nodes(index: GraphIndex, params: ParamTable, region: MoERegion, cand: OutputCandidate,
               weights: RoutingWeights) -> set[fx.Node]:
    """Region nodes the replacement keeps as they are: those computing the routing weights and the
    (masked) ids it reads."""
    inner = {n for n in cand.nodes if n not in params}
    kept = [n for n in (weights.node, region.ids) if n is not None and n in cand.nodes]
    return index.ancestors(kept, stop=set(boundary_of(index, params, region, cand))) & inner if kept else set()


def verify_interpretation(index: GraphIndex, params: ParamTable, region: MoERegion, cand: OutputCandidate,
                          layout: ExpertLayout, weights: RoutingWeights,
                          values: dict[fx.Node, object]) -> Verdict:
    boundary = boundary_of(index, params, region, cand)
    inner = [n for n in index.ordered(cand.nodes) if n not in params]
    keep = kept_nodes(index, params, region, cand, weights)
    # both graphs also return [T, K] routing weights the op reads when they compute them (the kept
    # nodes): their gradient is compared there, where it is well conditioned.  (Not [T, E] or
    # [T, E, C] weights: there the op's gradient is 0 at the (token, expert) pairs no slot
    # reads, where the layer's may not be; the mask in front of them zeroes it further back.)
    at_weights = bool(keep) and weights.kind == "topk"
    original = _subgraph(index.gm, boundary, inner, lambda g, m: (m(cand.node), *([m(weights.node)] if at_weights else [])))

    def replacement_as(r: MoERegion) -> fx.GraphModule:
        return _subgraph(index.gm, boundary, index.ordered(keep), lambda g, m: (
            emit_expert_op(g, r, layout, weights, cand.node, m)[1], *([m(weights.node)] if at_weights else [])))

    via_weights = _through_weights(index, params, region, boundary, set(inner), keep, weights) if at_weights \
        else [False] * len(boundary)
    base = [values[b] for b in boundary]
    cases = [("router", base)] + _synthetic_cases(index, boundary, base, region)
    is_param = [b in params for b in boundary]
    aliases = alias_pairs(boundary, base)
    routing = _routing_values(index, region, boundary)
    inside = autocast_at(index.gm.graph, region.topk)
    if not ambient_autocast() and not any(state[2] for state in inside):
        return _check(original, replacement_as(region), cases, is_param, via_weights, getattr(torch, region.dtype),
                      aliases=aliases, routing=routing)
    # Under torch.autocast, rounding differs between two correct computations more than a wrong
    # interpretation can hide in forward, not in backward (a ReLU whose bf16 pre-activation changes
    # sign flips a token's whole gradient).  So: the interpretation first, forward and backward,
    # both graphs outside autocast in the tokens' dtype; then the op as emitted, in the layer's
    # compute dtype, against the layer under autocast, forward (an op of the layer that autocast
    # changes unseen, a custom op's own matmuls, shows up there).
    # (values the graph computed under autocast before the region, router logits say, come in
    # the tokens' dtype there, as they would have without it)
    tokens = tensor_meta(region.tokens)
    plain = replace(region, dtype=str(tokens.dtype).removeprefix("torch.")) if tokens is not None else region
    widened = [(label, [_widened(v, getattr(torch, plain.dtype)) for v in vals]) for label, vals in cases]
    verdict = _check(original, replacement_as(plain), widened, is_param, via_weights, getattr(torch, plain.dtype),
                     _AUTOCAST_OFF, aliases=aliases, routing=routing)
    # where the layer cannot run outside autocast (a dtype read off an autocast result is baked into
    # the graph, as in `mask.to(gates.dtype)`: _check's verdict names the error) or differs there
    # from the op beyond fp32's tolerance (a value autocast rounded to bf16 before the region reaches
    # the gradients): both under autocast, gradients too, at the compute dtype's tolerance, as a
    # bf16 model is verified
    alone = not verdict.ok
    low = _check(original, replacement_as(region), cases, is_param, via_weights, getattr(torch, region.dtype), inside,
                 backward=alone, aliases=aliases, routing=routing)
    backward_err = low.backward_err if alone else verdict.backward_err
    if not low.ok:
        return Verdict(False, low.forward_err, backward_err, f"under torch.autocast, {low.reason}")
    return low if alone else Verdict(True, max(verdict.forward_err, low.forward_err), backward_err)


def _check(original: fx.GraphModule, replacement: fx.GraphModule, cases: list[tuple[str, list[object]]],
           is_param: list[bool], via_weights: list[bool], compute: torch.dtype,
           autocast: Sequence[tuple[object, ...]] = (), backward: bool = True,
           aliases: Sequence[tuple[int, int]] = (), routing: Sequence[bool] = ()) -> Verdict:
    """Run both graphs on each case (forwards under the ``autocast`` states): outputs, and where
    ``backward``, gradients must agree to ``compute``'s tolerance (``aliases``: ``alias_pairs``;
    ``routing``: ``_routing_values``)."""
    fwd_err = bwd_err = 0.0
    for label, vals in cases:
        try:
            err, ok = _compare_forward(original, replacement, vals, compute, autocast)
        except Exception as e:  # a wrong interpretation may not even run (shape mismatch)
            return Verdict(False, float("inf"), float("inf"), f"{label}: {type(e).__name__}: {e}")
        fwd_err = max(fwd_err, err)
        if not ok:
            return Verdict(False, fwd_err, bwd_err, f"{label}: outputs differ (relative error {err:.2e})")
        if backward and label != "skewed":
            try:
                err, ok = _compare_backward(original, replacement, vals, is_param, via_weights, compute, autocast,
                                            aliases, routing)
            except Exception as e:  # e.g. the replacement's backward cannot run on these shapes
                return Verdict(False, fwd_err, float("inf"), f"{label}: backward: {type(e).__name__}: {e}")
            bwd_err = max(bwd_err, err)
            if not ok:
                return Verdict(False, fwd_err, bwd_err, f"{label}: gradients differ (relative error {err:.2e})")
    return Verdict(True, fwd_err, bwd_err)


def _through_weights(index: GraphIndex, params: ParamTable, region: MoERegion, boundary: list[fx.Node],
                     inner: set[fx.Node], keep: set[fx.Node], weights: RoutingWeights) -> list[bool]:
    """Per boundary value: does its gradient reach the output only through the routing weights the
    kept nodes compute?  Then both graphs compute it from the gradient at those weights by the
    same nodes, and it is compared there: a renormalization at K = 1 makes it cancel to rounding
    noise, whose two copies need not agree."""
    replaced = inner - keep
    after_weights = index.descendants([weights.node])
    token_root = index.value_root(region.tokens)
    out = []
    for b in boundary:
        start = ops.topk_output(b, 0) if b is region.topk else b
        out.append(start is not None and b not in params and index.value_root(b) is not token_root
                   and index.descendants([start]) & replaced <= after_weights)
    return out


def _subgraph(root: fx.GraphModule, boundary: list[fx.Node], inner: list[fx.Node], make_out) -> fx.GraphModule:  # type: ignore[no-untyped-def]
    """A graph of ``inner`` over placeholders for ``boundary``; it returns ``make_out``'s tuple
    (the output, and the routing weights when both graphs compute them).  ``root`` holds what
    the nodes' get_attrs read (the bodies of an autograd.Function a router calls)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for b in boundary:
        env[b] = g.placeholder(b.name)
    for n in inner:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(make_out(g, env.__getitem__)))
    return fx.GraphModule(root, g)


def _synthetic_cases(index: GraphIndex, boundary: list[fx.Node], base: list[object],
                     region: MoERegion) -> list[tuple[str, list[object]]]:
    if region.topk not in boundary:
        return []
    i = boundary.index(region.topk)
    anchor_value = base[i]  # topk's (values, indices), or the [.., K] ids of another anchor
    # ids over every class the router scores (Zaya's skip class too: the layer masks it, the op
    # must read the masked ids), K distinct per token as a router picks them
    e, k = max(region.num_experts, region.num_scored), region.top_k
    flat_idx = anchor_value[1] if isinstance(anchor_value, tuple) else anchor_value
    assert isinstance(flat_idx, torch.Tensor)
    flat = torch.arange(flat_idx.numel(), device=flat_idx.device)
    # token t takes experts tK..tK+K-1 (mod E): distinct per row, every expert used
    balanced_idx = flat.remainder(e).view(flat_idx.shape).to(flat_idx.dtype)
    skewed_idx = (flat % k).view(flat_idx.shape).to(flat_idx.dtype)
    balanced: object = balanced_idx
    skewed: object = skewed_idx
    if isinstance(anchor_value, tuple):
        vals: torch.Tensor = anchor_value[0]
        gen = torch.Generator().manual_seed(0)
        w = torch.rand(flat_idx.shape, generator=gen).to(device=vals.device, dtype=vals.dtype)
        w = w.sort(dim=-1, descending=True).values
        balanced, skewed = (w.clone(), balanced_idx), (w.clone(), skewed_idx)
    token_root = index.value_root(region.tokens)
    large = [_scaled(v, LARGE_SCALE) if index.value_root(b) is token_root else v for b, v in zip(boundary, base)]
    out = []
    for label, vals_list, routing in (("balanced", list(base), balanced), ("large values", large, balanced),
                                      ("skewed", list(base), skewed)):
        vals_list[i] = routing
        out.append((label, vals_list))
    return out


def _scaled(v: object, factor: float) -> object:
    return v * factor if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _fresh(vals: list[object]) -> list[object]:
    return [_copy(v, share=False) for v in vals]


def _rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| relative to the larger magnitude over the finite entries (at least ``floor``);
    inf on a shape mismatch or where the non-finite entries differ (a NaN in the user's batch
    makes its token's output NaN in both graphs: they agree when NaN and inf sit at the same
    places)."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    a64, b64 = a.detach().double(), b.detach().double()
    fin_a, fin_b = torch.isfinite(a64), torch.isfinite(b64)
    if not (bool(fin_a.all()) and bool(fin_b.all())):
        same = (fin_a == fin_b) & (fin_a | (a64 == b64) | (a64.isnan() & b64.isnan()))
        if not bool(same.all()):
            return float("inf")
        a64, b64 = a64[fin_a], b64[fin_b]
        if not a64.numel():
            return 0.0
    diff = (a64 - b64).abs().max().item()
    scale = max(a64.abs().max().item(), b64.abs().max().item(), floor, 1e-30)
    return 0.0 if diff == 0 else diff / scale


def _reshaped_from(n: fx.Node) -> fx.Node:
    """The node ``n`` holds the elements of in the same order: through views that only reshape
    (``op_kinds.SHAPE_VIEWS``; not a transpose or a slice)."""
    while ops.op_name(n) in ops.SHAPE_VIEWS and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def alias_pairs(boundary: list[fx.Node], values: list[object]) -> list[tuple[int, int]]:
    """(i, j), j < i: boundary values i and j are one tensor of the model in two shapes (one a
    reshape of the other, or both of a third: a top-1 layer's tokens ``x`` and ``x.unsqueeze(1)``
    feeding different projections), the same number of elements."""
    first: dict[fx.Node, int] = {}
    pairs = []
    for i, (b, v) in enumerate(zip(boundary, values, strict=True)):
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            continue
        j = first.setdefault(_reshaped_from(b), i)
        ref = values[j]
        if j != i and isinstance(ref, torch.Tensor) and ref.numel() == v.numel():
            pairs.append((i, j))
    return pairs


def _merge_aliases(pairs: list[tuple[int, int]], g_o: list[torch.Tensor | None], g_n: list[torch.Tensor | None],
                   compared: list[bool], shapes: list[torch.Size]) -> list[bool]:
    """Sum into leaf j the gradients of leaf i for each pair (``alias_pairs``, as leaf indices):
    one value of the model, whose gradient is what reaches either form. The two graphs may read it
    in different forms (the op reads the tokens once), so the sum is compared, at j, and i not
    apart. Updates ``g_o`` and ``g_n`` in place; returns the new ``compared``."""
    compared = list(compared)
    for i, j in pairs:
        for grads in (g_o, g_n):
            gi = grads[i]
            if gi is not None:
                add = gi.reshape(shapes[j])
                gj = grads[j]
                grads[j] = add if gj is None else gj + add
            grads[i] = None
        compared[j] = compared[j] or compared[i]
        compared[i] = False
    return compared


def _routing_values(index: GraphIndex, region: MoERegion, boundary: list[fx.Node]) -> list[bool]:
    """Which boundary values are routing weights: the top-k itself (its values), floats of shape
    [T, K] computed from it, the [T, E] scores the weights are gathered from (DeepSeek-V3
    chooses on biased scores and gathers the weights from the unbiased ones), and a selection's
    (values, ids) the weights are read off (a descending sort cut at K: ``sort(s)[0][:, :K]``):
    their gradients are dot products with the expert outputs (``_weights_grad_scale``)."""
    after = region.routed(index)
    weighs = index.ancestors([w.node for w in region.weights], stop=set(boundary))  # not past the region's inputs
    per_token = {(region.num_tokens, region.top_k), (region.num_tokens, region.num_scored)}

    def routing(b: fx.Node) -> bool:
        if not (b in after or b in weighs):
            return False
        m = tensor_meta(b)
        if m is None:  # a (values, ids) tuple: its values
            v = example_value(b)
            return isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], torch.Tensor) \
                and v[0].is_floating_point() and value_shape(v[0]) in per_token
        return static_shape(b) in per_token and m.is_floating_point()

    return [b is region.topk or routing(b) for b in boundary]


def _weights_grad_scale(g: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    """The magnitude at which the gradient of routing weights ``w`` ([.., K]) is rounded, given
    the output ``y`` ([.., H], the same tokens) and its cotangent ``g``: w[t, k]'s gradient is the
    dot product <g_t, y_tk> of the token's cotangent and its k-th expert's output. Each term's
    rounding (y_tk rounded to a low-precision dtype, relative error u per entry) adds up as
    random signs do, to about u |g_t * y_tk| (the 2-norm of the elementwise product), while the
    sum itself can cancel far below that: one token, by chance, and nothing averages it out.
    |g_t * y_tk| is estimated from the output as |g_t * y_t| / sum_k |w_tk| (y_t = sum_k w_tk
    y_tk; exact at K = 1). The max over tokens; 0 where the shapes do not say it. A gradient the
    replacement gets wrong differs by about the size of the terms, which this floor keeps
    visible: it is the typical size of <g_t, y_tk> itself, not a bound that grows with H."""
    k = w.shape[-1] if w.dim() else 0
    if not k or not y.numel() or g.shape != y.shape or w.numel() % k or y.numel() % (w.numel() // k):
        return 0.0
    tokens = w.numel() // k
    w_sum = w.detach().double().reshape(tokens, k).abs().sum(1)
    terms = (g.detach().double() * y.detach().double()).reshape(tokens, -1).norm(dim=1)
    per = terms / w_sum.clamp_min(1e-30)
    per = per[(w_sum > 0) & torch.isfinite(per)]
    return float(per.max()) if per.numel() else 0.0


def _passes(err: float, a: torch.Tensor, b: torch.Tensor, compute: torch.dtype) -> bool:
    # a value computed from low-precision expert outputs (e.g. an fp32 routing-weight gradient
    # of a bf16 layer) is only as exact as the layer's compute dtype
    return err <= max(_RTOL.get(a.dtype, 1e-4), _RTOL.get(b.dtype, 1e-4), _RTOL.get(compute, 1e-4))


def autocast_at(graph: fx.Graph, node: fx.Node) -> tuple[tuple[object, ...], ...]:
    """The ``torch.autocast`` regions of the graph (Dynamo's ``_enter_autocast`` /
    ``_exit_autocast`` nodes: a ``with torch.autocast`` inside the compiled code, as accelerate's
    ``autocast`` forward wrapper writes it) open at ``node``, outermost first: each the
    (device_type, dtype, enabled, cache_enabled) it was entered with.  Verification runs both
    graphs under them, as the model runs there; an autocast around the compiled call is in
    effect already while the backend compiles."""
    open_: list[fx.Node] = []
    for n in graph.nodes:
        if n is node:
            break
        if n.op != "call_function":
            continue
        if n.target is torch.amp.autocast_mode._enter_autocast:
            open_.append(n)
        elif n.target is torch.amp.autocast_mode._exit_autocast and n.args and n.args[0] in open_:
            open_.remove(n.args[0])  # type: ignore[arg-type]
    return tuple(tuple(n.args) for n in open_)


_AUTOCAST_OFF = (("cpu", None, False, None), ("cuda", None, False, None))


def ambient_autocast() -> tuple[tuple[str, torch.dtype], ...]:
    """The (device type, dtype) of each torch.autocast in effect around this call (the compiled
    call's, while the backend compiles)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def _widened(v: object, dtype: torch.dtype) -> object:
    if isinstance(v, tuple):
        return tuple(_widened(u, dtype) for u in v)
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize < dtype.itemsize:
        return v.to(dtype)
    return v


def _under(autocast: Sequence[tuple[object, ...]]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device, dtype, enabled, cache, *_ in autocast:
        stack.enter_context(torch.autocast(str(device), dtype=dtype, enabled=bool(enabled),  # type: ignore[arg-type]
                                           cache_enabled=cache))  # type: ignore[arg-type]
    return stack


def _compare_forward(original: fx.GraphModule, replacement: fx.GraphModule, vals: list[object],
                     compute: torch.dtype, autocast: Sequence[tuple[object, ...]] = ()) -> tuple[float, bool]:
    with torch.no_grad(), _under(autocast):
        y_o = original(*_fresh(vals))[0]
        y_n = replacement(*_fresh(vals))[0]
    err = _rel_err(y_n, y_o)
    return err, _passes(err, y_n, y_o, compute)


def _compare_backward(original: fx.GraphModule, replacement: fx.GraphModule, vals: list[object],
                      is_param: list[bool], via_weights: list[bool], compute: torch.dtype,
                      autocast: Sequence[tuple[object, ...]] = (),
                      aliases: Sequence[tuple[int, int]] = (), routing: Sequence[bool] = ()) -> tuple[float, bool]:
    """Gradients of both graphs at every floating boundary value (``aliases``: pairs of boundary
    positions holding one tensor in two shapes, compared summed: ``alias_pairs``) and at the
    routing weights both return.

    A gradient that misses the tolerance is judged once more against the original graph run in
    a wider dtype on the same values (``_widened``: fp32 for a 16-bit layer, fp64 for an fp32
    one): the replacement passes if it is no farther from that reference than twice the original
    is, plus the tolerance (two computations as exact as each other, rounded apart, each land
    about as far from it; tests/test_fuzz.py judges compiled against eager alike).

    Two correct computations round differently: a model that rounds a product before adding its
    bias, where the other rounds once, as nn.Linear does; the op accumulating in fp32 where a
    model rounds partial sums; another summation order. A ReLU's or a clamp's pre-activation
    within that rounding of its kink takes the other side in one of them, flipping its unit's
    gradient; a saturated activation's derivative (GELU's tanh form far below 0, 1 - tanh^2
    cancelling) moves by far more than the rounding of its input, and an expert whose gradient
    holds only such terms has a small one, relatively far off in both. The wider reference sides
    with the more exact one, and a wrong interpretation stays O(1) away from it."""
    g_o, g_n, leaves, compared, floors = _gradients(original, replacement, vals, is_param, via_weights, autocast,
                                                    aliases, routing)
    if g_o is None:
        return 0.0, True

    def grad(i: int, grads: list[torch.Tensor | None]) -> torch.Tensor:
        got = grads[i]
        return torch.zeros_like(leaves[i]) if got is None else got

    checked = [i for i, check in enumerate(compared) if check]
    errs = {i: _rel_err(grad(i, g_n), grad(i, g_o), floors[i]) for i in checked}
    failed = [i for i in checked if not _passes(errs[i], grad(i, g_n), grad(i, g_o), compute)]
    wide = torch.float32 if compute.itemsize < 4 else torch.float64
    if failed and wide.itemsize > compute.itemsize:
        try:
            g_r = _gradients(_in_dtype(original, compute, wide), None,
                             [_widened(v, wide) for v in vals], is_param, via_weights, autocast, aliases)[0]
        except Exception:  # the original graph cannot run in the wider dtype
            g_r = None
        if g_r is not None and len(g_r) == len(g_o):
            for i in list(failed):
                e_n, e_o = (_rel_err(grad(i, g), grad(i, g_r), floors[i]) for g in (g_n, g_o))
                if e_n <= 2 * e_o + _RTOL[compute]:
                    failed.remove(i)
                    errs[i] = e_n
    for i in failed:
        log.debug("gradient mismatch for a boundary value of shape %s: relative error %.2e",
                  tuple(leaves[i].shape), errs[i])
    return max(errs.values(), default=0.0), not failed


def _in_dtype(gm: fx.GraphModule, low: torch.dtype, high: torch.dtype) -> fx.GraphModule:
    """A copy of ``gm`` whose ops that name dtype ``low`` (``.to(torch.bfloat16)``, ``zeros(...,
    dtype=torch.bfloat16)``: a model's own casts, baked into its graph) name ``high`` instead."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))

    def swap(a: fx.node.Argument) -> fx.node.Argument:
        return high if a is low else a

    for n in graph.nodes:
        n.args = fx.node.map_aggregate(n.args, swap)  # type: ignore[assignment]
        n.kwargs = fx.node.map_aggregate(n.kwargs, swap)  # type: ignore[assignment]
    return fx.GraphModule(gm, graph)


def _gradients(original: fx.GraphModule, replacement: fx.GraphModule | None, vals: list[object],
               is_param: list[bool], via_weights: list[bool], autocast: Sequence[tuple[object, ...]],
               aliases: Sequence[tuple[int, int]], routing: Sequence[bool] = ()
               ) -> tuple[list[torch.Tensor | None] | None, list[torch.Tensor | None], list[torch.Tensor], list[bool],
                          list[float]]:
    """(original's gradients, replacement's (Nones without one), the tensors they are gradients
    of, which of them are compared, each one's floor): every floating boundary value becomes a
    leaf (one per tensor); the gradients of a fixed random cotangent are taken at the leaves and
    at the routing weights both graphs return; (None, ...) where the output needs none."""
    leaves: list[torch.Tensor] = []
    compared: list[bool] = []  # per leaf: compare its gradient (else: at the routing weights)
    pos_leaf: dict[int, int] = {}  # boundary position -> its tensor's leaf
    first_leaf: dict[int, int] = {}  # boundary position of a tuple -> its first tensor's leaf

    def with_leaves() -> list[object]:
        out: list[object] = []
        for pos, (v, p, via) in enumerate(zip(vals, is_param, via_weights, strict=True)):
            if isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor) and v[0].is_floating_point():
                out.append((leaf_of(v[0], p, via).clone(), *v[1:]))
                first_leaf[pos] = cache[id(v[0])]  # a top-k's (values, indices): its values' leaf
            elif isinstance(v, torch.Tensor) and v.is_floating_point():
                leaf = leaf_of(v, p, via)
                pos_leaf[pos] = cache[id(v)]
                out.append(leaf if p else leaf.clone())  # clone: the region may update it in place
            else:
                out.append(_copy(v, share=False))
        return out

    cache: dict[int, int] = {}

    def leaf_of(v: torch.Tensor, share: bool, via: bool) -> torch.Tensor:
        if id(v) not in cache:
            leaf = v.detach() if share else v.detach().clone()
            cache[id(v)] = len(leaves)
            leaves.append(leaf.requires_grad_())
            compared.append(False)
        i = cache[id(v)]
        compared[i] = compared[i] or not via
        return leaves[i]

    with torch.enable_grad():
        with _under(autocast):  # the forwards only: a model's backward runs outside its autocast
            y_o, *w_o = original(*with_leaves())
            y_n, *w_n = replacement(*with_leaves()) if replacement is not None else (y_o, *w_o)
        if not y_o.requires_grad:
            return None, [], leaves, compared, []
        if not (w_o and w_o[0].requires_grad and w_n[0].requires_grad):
            # routing weights no leaf reaches (computed from ids alone): compare every leaf
            w_o, w_n, compared = [], [], [True] * len(leaves)
        gen = torch.Generator().manual_seed(1)
        g = torch.randn(y_o.shape, generator=gen, dtype=torch.float32).to(y_o)
        with _under(_AUTOCAST_OFF):  # an autocast around the compile would cast the backward's matmuls
            g_o: list[torch.Tensor | None] = list(torch.autograd.grad(y_o, leaves + w_o, g, allow_unused=True))
            g_n: list[torch.Tensor | None] = [None] * len(g_o)
            if replacement is not None and y_n.requires_grad:
                g_n = list(torch.autograd.grad(y_n, leaves + w_n, g, allow_unused=True))
    leaf_pairs = [(pos_leaf[i], pos_leaf[j]) for i, j in aliases if pos_leaf.get(i, -1) >= 0
                  and pos_leaf.get(j, -1) >= 0 and pos_leaf[i] != pos_leaf[j]]
    compared = _merge_aliases(leaf_pairs, g_o, g_n, compared, [leaf.shape for leaf in leaves])
    # the routing weights' gradients (compared where the leaves behind them are not) are dot
    # products that can cancel: their rounding is judged at the size of their terms
    floors = [0.0] * len(leaves) + [_weights_grad_scale(g, y_o, w) for w in w_o]
    # and so are those of the routing values the region reads (``_routing_values``: [T, K] after
    # the top-k, the [T, E] scores the weights are gathered from): at K = 1 renormalized
    # (w / w.sum() = 1) the gradient is 0 up to that rounding, which either graph may round to
    # exactly 0 where the other does not
    for pos, is_routing in enumerate(routing):
        i = pos_leaf.get(pos, first_leaf.get(pos))
        if is_routing and i is not None:
            floors[i] = _weights_grad_scale(g, y_o, leaves[i])
    return g_o, g_n, leaves + w_o, compared + [True] * len(w_o), floors
