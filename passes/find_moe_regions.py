"""find_moe_regions: semantic detection of Mixture-of-Experts layers in a Dynamo FX graph.

Contract
    Needs: a Dynamo torch-level graph (call_function / call_method nodes with ``example_value``
    metadata) and, for module paths, the example inputs Dynamo passed to the backend.
    Guarantees: every ``MoERegion`` names the router top-k, the token input, the routed output
    (the value the rest of the graph reads), the expert tensors and the interpretations of them
    that canonicalize must verify; the graph is not modified.  Every top-k that looks like a
    router but cannot be turned into a region is returned as a ``Skip`` with the reason.
    Refuses: top-k without a router projection, outputs that mix in non-expert parameters
    (e.g. shared experts accumulated into the same tensor), expert tensors that do not form
    up/down (and gate) projections of one of the supported layouts.

Detection is anchored on top-k and does not match one exact DAG (DESIGN.md, "Data flow"):

    for each routing anchor T (routing_anchor.py: a top-k, or K experts chosen by argmaxes, a
    sort or a fixed table) whose scores derive from a linear map with an [E, H] parameter (the
    router, router.py):
        x   <- that linear's token operand;  W <- nodes after x, minus the router itself
        Step 1: walk W in program order; the routed output Y is the first node that depends on
                T, has x's token count and hidden size, and whose parameter ancestors within W
                are exactly complete expert families (stacked [E, ...] or E modules)
        Step 2: split the expert tensors into up / gate / down roles and biases; list the
                layouts consistent with the shapes, most likely first
        Step 3: list routing-weight candidates: [T, K] weights, dense [T, E] weights, and
                [T, E, C] capacity combine tensors (drops then stay exact)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import op_kinds as ops
from moe_compile.passes.expert_layout import (
    ExpertParams,
    classify_params,
    compute_dtype,
    in_family,
    layout_hypotheses,
    valid_family_keys,
)
from moe_compile.passes.graph_index import GraphIndex, is_view, static_shape, tensor_meta
from moe_compile.passes.graph_params import ParamTable, common_prefix
from moe_compile.passes.regions import MoERegion, OutputCandidate, RoutingWeights, Skip
from moe_compile.passes.router import Router, find_router, router_kind
from moe_compile.passes.routing_anchor import routing_anchors

# interpretations to list per region, most likely first (canonicalize verifies them in order). A
# graph of 0 tokens has no limit: every per-slot tensor then has the tokens' shape [0, H], none
# can be told apart by verification, and the rank must find the one the ranks with tokens chose
# (moe_compile.ep.agreement), wherever it is in the list
_MAX_OUTPUT_CANDIDATES = 3
_MAX_WEIGHT_CANDIDATES = {"topk": 3, "dense": 2, "combine": 2}


@dataclass
class FindResult:
    regions: list[MoERegion]
    skipped: list[Skip]
    num_topk: int
    index: GraphIndex
    params: ParamTable


def find_moe_regions(gm: fx.GraphModule, example_inputs: list[object] | None = None) -> FindResult:
    index = GraphIndex(gm)
    params = ParamTable(gm, example_inputs)
    found_anchors = routing_anchors(index)
    anchors = [a.node for a in found_anchors]
    routers: dict[fx.Node, Router] = {}
    for anchor in found_anchors:
        r = find_router(index, params, anchor)
        if r is not None:
            routers[anchor.node] = r
    # A top-k inside another top-k's router picks expert groups (DeepSeek-V3 group-limited
    # routing); it is part of that router, not a layer of its own.
    inner = {a for r in routers.values() for a in anchors if a is not r.topk and a in r.nodes}
    regions: list[MoERegion] = []
    skipped: list[Skip] = []
    routing = [a for a in anchors if a in routers and a not in inner]
    for anchor in found_anchors:
        # an argmax or a sort that no router feeds is not a routing decision: nothing to report
        if anchor.node not in inner and anchor.node not in routers and anchor.kind == "topk":
            skipped.append(Skip(name=anchor.node.name, reason=(
                "top-k is not fed by a router projection (a linear map with an [E, hidden] "
                "parameter); not an MoE router, left alone")))
    # one layer per router projection: a router may hold several selections (PhiMoE's
    # sparsemixer takes argmaxes for its mask too); the widest that leads to a layer is the one
    groups: dict[fx.Node, list[fx.Node]] = {}
    for a in routing:
        groups.setdefault(routers[a].weight, []).append(a)
    layers = sorted(groups.values(), key=lambda g: index.pos[g[0]])
    for i, group in enumerate(layers):
        bound = index.pos[layers[i + 1][0]] if i + 1 < len(layers) else len(index.nodes)
        tries = sorted(group, key=lambda a: (-(routers[a].anchor.k or 0), index.pos[a]))
        first: MoERegion | Skip | None = None
        for a in tries:
            found = _region_for(index, params, routers[a], bound)
            first = first or found
            if isinstance(found, MoERegion):
                regions.append(found)
                break
        else:
            assert isinstance(first, Skip)
            skipped.append(first)
    num_topk = sum(1 for a in found_anchors if a.kind == "topk" or a.node in routers)
    return FindResult(regions=regions, skipped=skipped, num_topk=num_topk, index=index, params=params)


def _region_for(index: GraphIndex, params: ParamTable, router: Router, bound: int) -> MoERegion | Skip:
    a = router.topk
    k = router.anchor.k
    idx_node = router.anchor.ids()
    scores = router.anchor.scores
    scores_shape = static_shape(scores)
    assert scores_shape is not None  # find_router checked it
    num_experts = scores_shape[-1]
    t_shape = static_shape(router.tokens)
    assert t_shape is not None
    hidden = t_shape[-1]
    num_tokens = 1
    for s in t_shape[:-1]:
        num_tokens *= s
    label = _label(params, [router.weight], router.logits)
    if k is None or idx_node is None:
        return Skip(label, "top-k with a data-dependent k or unused indices; cannot tell the experts per token",
                    router_weight=router.weight)

    # the selection and the scores it was made from (a hash table's ids are not made from them)
    router_side = index.ancestors([a, scores])
    lo = index.pos[router.tokens]
    window = {n for n in index.nodes[lo + 1:bound] if n not in router_side}
    window |= set(params.path) - router_side
    # the selection and what is read off it (weights gathered at each argmax are not descendants
    # of the cat of the argmaxes)
    after_topk = index.descendants([a, *router.anchor.sources])
    win = _Window(router, k, window, after_topk, num_tokens, hidden, lo, bound, label)
    # E: the experts scored; a router may score more classes than there are experts (Zaya's skip
    # expert, whose slots are masked to expert 0 with weight 0): then the experts' own count
    stacked = {shape[0] for n in window if n in params and len(shape := static_shape(n) or ()) == 3}
    counts = [num_experts] + sorted((e for e in stacked if 1 < e < num_experts), reverse=True)
    first: MoERegion | Skip | None = None
    for count in counts:
        found = _region_with(index, params, win, count)
        first = first or found
        if isinstance(found, MoERegion):
            return found
    assert first is not None
    return first


@dataclass(frozen=True)
class _Window:
    """What a routing anchor's layer search works on, whatever the expert count."""

    router: Router
    k: int
    window: set[fx.Node]  # nodes the layer may contain
    after_topk: set[fx.Node]
    num_tokens: int
    hidden: int  # the router's
    lo: int  # position of the router's tokens
    bound: int  # position of the next layer's anchor
    label: str


def _region_with(index: GraphIndex, params: ParamTable, win: _Window, num_experts: int) -> MoERegion | Skip:
    router, k, window, after_topk, num_tokens, hidden = (win.router, win.k, win.window, win.after_topk, win.num_tokens,
                                                         win.hidden)
    a, lo, bound, label = router.topk, win.lo, win.bound, win.label
    idx_node = router.anchor.ids()
    assert idx_node is not None  # _region_for checked it
    family_keys = valid_family_keys(params, num_experts)
    # the layer's inputs: [T, H] floats the window computes without the routing decision or an
    # expert tensor (the experts' own normalized copy of the tokens, Gemma-4's
    # pre_feedforward_layernorm_2): the layer reads them, they are not part of it
    inputs = _layer_inputs(index, params, window - after_topk, num_tokens, num_experts, family_keys)
    outside = (set(index.nodes) - window) | inputs

    # Step 1: the routed output (a few candidates; canonicalize verifies them in order)
    token_shapes = _token_shapes(router.tokens, num_tokens, hidden)
    # the experts' hidden size need not be the router's: a latent projection before the logits
    # (Zaya), or the experts' own copy of the tokens; their output has the shape of those
    for n in inputs | index.ancestors([router.tokens]):
        shape = static_shape(n)
        if shape and len(shape) >= 2 and _numel(shape[:-1]) == num_tokens and _is_float(n):
            token_shapes |= _token_shapes(n, num_tokens, shape[-1])
    experts: ExpertParams | None = None
    outputs: list[OutputCandidate] = []
    reason = "no value after the top-k combines expert outputs into a [tokens, hidden] tensor"
    # floats after the top-k that no parameter of the window feeds: routing weights (and what
    # the router's scores become); the routed output multiplies by them, per-slot results do not
    from_state = index.descendants([n for n in window if n in params])
    routing_floats = {n for n in after_topk & window - from_state if _is_float(n)}
    for y in index.nodes[lo + 1:bound]:
        if y not in after_topk or y not in window or not _is_token_tensor(y, token_shapes):
            continue
        if _is_mutated_later(index, y):
            continue  # a partial sum: the tensor is still being accumulated into
        nodes = index.ancestors([y], stop=outside) & window - inputs
        if not nodes & routing_floats:
            continue  # not weighted by the routing yet: an expert's output for its own slots
        state = [n for n in nodes if n in params]
        if not state:
            continue
        cls = classify_params(params, state, num_experts, family_keys)
        if len(cls.weight_roles) < 2:
            continue  # not the experts' output yet (the routing weights, a value made from them)
        # parameters that only scale the routing weights (Gemma-4's per_expert_scale[ids]) are the
        # router's: the weights the op reads are computed with them, as written
        cls.foreign = [n for n in cls.foreign if not _weighs_only(index, n, nodes, cls, after_topk, num_tokens * k)]
        if cls.foreign:
            if not outputs:
                names = ", ".join(sorted(params.path[n] for n in cls.foreign)[:3])
                reason = (f"the combined output also depends on non-expert parameters ({names}); "
                          "shared experts or other layers are mixed into the routed sum, so the "
                          "routed part cannot be isolated")
            break
        if not cls.complete or len(cls.weight_roles) < 2:
            continue
        if _running_sum_part(index, y, {n for r in cls.weight_roles for n in r.nodes}, outside):
            continue  # a running sum over experts, or one expert's part of it, not the whole sum
        if experts is None:
            experts = cls
        elif _roles(cls) > _roles(experts):
            # an expert tensor the earlier candidates did not reach: they were intermediates that
            # have the tokens' shape (per-slot [T*K, H] results at K = 1, [T*K, F] ones when F = H)
            experts, outputs = cls, []
        elif _roles(cls) < _roles(experts):
            continue  # such an intermediate of a later expert (a loop over experts, at 0 tokens)
        elif _roles(cls) != _roles(experts):
            break
        outputs.append(OutputCandidate(node=y, nodes=frozenset(nodes)))
        if len(outputs) == _MAX_OUTPUT_CANDIDATES and num_tokens:
            break
    # a candidate the layer sums over a dimension into a later one is the per-slot product, a token
    # tensor only by its shape: [T, K, H] at T = K = 1 is the [1, 1, H] of a one-token input; the sum
    # is the output, as on a rank with more tokens (where the product is no candidate)
    summed = {o.node.args[0] for o in outputs if ops.op_name(o.node) == "sum" and o.node.args}
    outputs = [o for o in outputs if o.node not in summed]
    if experts is None or not outputs:
        return Skip(label, reason + _graph_break_hint(index, a), router_weight=router.weight)
    region_nodes = set(outputs[0].nodes)
    hidden = static_shape(outputs[0].node)[-1]  # type: ignore[index]  # the experts', not the router's
    tokens = _expert_tokens(index, params, region_nodes, router.tokens, inputs, hidden)

    # Step 2: expert roles and layouts
    name = _label(params, [router.weight, *[r.first for r in experts.weight_roles]], router.logits)
    layouts, why = layout_hypotheses(index, region_nodes, experts, hidden, num_experts,
                                     index.value_root(tokens))
    if not layouts:
        return Skip(name, why, router_weight=router.weight)

    # Step 3: routing weight candidates
    all_nodes = set().union(*(o.nodes for o in outputs))
    expert_state = [n for r in experts.weight_roles + experts.bias_roles for n in r.nodes]
    weights = _weight_candidates(index, all_nodes, after_topk - index.descendants(expert_state), num_tokens, k,
                                 num_experts)
    if not weights:
        return Skip(name, "no routing-weight tensor ([T, K], [T, E] or [T, E, C]) feeds the combine",
                    router_weight=router.weight)

    ffn = layouts[0].ffn_size
    existing = next((n for n in index.ordered(region_nodes) if ops.qualified_op(n) == "hiermoe::experts"), None)
    # what the expert op computes in: the layer's own matmuls' dtype (torch.autocast's, a cast the
    # layer writes), else the tokens'
    dtype = compute_dtype(experts, region_nodes) or tensor_meta(router.tokens).dtype  # type: ignore[union-attr]
    return MoERegion(
        name=name,
        pattern=_pattern(region_nodes, experts, any(w.kind == "combine" for w in weights)),
        router=router_kind(index, router, weights),
        topk=a,
        router_weight=router.weight,
        tokens=tokens,
        num_experts=num_experts,
        top_k=k,
        hidden_size=hidden,
        ffn_size=ffn,
        num_tokens=num_tokens,
        dtype=str(dtype).replace("torch.", ""),
        drops=False,
        outputs=tuple(outputs),
        layouts=tuple(h.layout for h in layouts),
        weights=tuple(weights),
        existing_op=existing,
        ids=_expert_ids(index, idx_node, region_nodes, num_tokens * k),
        num_scored=(static_shape(router.anchor.scores) or (num_experts,))[-1],
        selection=router.anchor.sources,
    )


def _roles(cls: ExpertParams) -> set[tuple[fx.Node, ...]]:
    return {r.nodes for r in cls.weight_roles + cls.bias_roles}


def _expert_tokens(index: GraphIndex, params: ParamTable, nodes: set[fx.Node], router_tokens: fx.Node,
                   inputs: set[fx.Node], hidden: int) -> fx.Node:
    """The token tensor the experts read: the router may reshape or cast its own copy (HF
    routers call ``hidden_states.reshape(-1, H)`` inside), or the experts read a copy of their
    own (one of the layer's ``inputs``), and the op must read the same node the experts did so
    gradients reach the same place."""
    root = index.value_root(router_tokens)
    shape = static_shape(router_tokens)
    reads = {d for n in nodes if n not in params for d in index.deps[n]} - nodes
    for d in index.ordered(reads):
        if index.value_root(d) is root and static_shape(d) is not None and d is not router_tokens:
            if _numel(static_shape(d)) == _numel(shape) and tensor_meta(d).dtype == tensor_meta(router_tokens).dtype:  # type: ignore[union-attr]
                return d
    if shape and shape[-1] == hidden and router_tokens in reads:
        return router_tokens
    def projected(d: fx.Node) -> bool:  # read by the experts' matmuls (not an accumulator's zeros)
        return (static_shape(d) or (0,))[-1] == hidden and any(ops.is_matmul(u) for u in index.descendants([d]) & nodes)

    own = [d for d in index.ordered(reads & inputs) if projected(d)]
    if own:
        return own[0]
    # a latent projection before the logits: the experts read a tensor the router projected
    rows = _numel(shape[:-1]) if shape else 0
    before = [d for d in index.ordered(reads & index.ancestors([router_tokens])) if _is_float(d) and projected(d)
              and _numel((static_shape(d) or (0,))[:-1]) == rows]
    return before[-1] if before else router_tokens


_ID_STEPS = frozenset({"masked_fill", "masked_fill_", "where", "clamp", "clamp_", "reshape", "view", "flatten",
                       "contiguous", "to", "long", "int", "squeeze", "unsqueeze"})


def _expert_ids(index: GraphIndex, ids: fx.Node, nodes: set[fx.Node], slots: int) -> fx.Node | None:
    """The ids the experts read, when the layer changes the anchor's ids before it dispatches
    (a mask, a clamp): the end of the chain of such steps from the anchor's ids; None when the
    chain only reshapes them (the op reads the anchor's)."""
    n, changed = ids, False
    while True:
        steps = [u for u in n.users if u in nodes and ops.op_name(u) in _ID_STEPS and u.args and u.args[0] is n
                 and (t := tensor_meta(u)) is not None and not t.dtype.is_floating_point and t.dtype != torch.bool
                 and _numel(static_shape(u)) == slots]
        if len(steps) != 1:
            return n if changed else None
        n = steps[0]
        changed = changed or ops.op_name(n) in ("masked_fill", "masked_fill_", "where", "clamp", "clamp_")


def _layer_inputs(index: GraphIndex, params: ParamTable, candidates: set[fx.Node], num_tokens: int,
                  num_experts: int, family_keys: set[str]) -> set[fx.Node]:
    """Float [T, H'] (or [B, S, H']) nodes among ``candidates`` that no expert-like parameter
    feeds ([E, ...] tensors or members of an E-expert family): inputs of the layer."""
    expert_like = [n for n in candidates if n in params and _expert_like(params, n, num_experts, family_keys)]
    from_experts = index.descendants(expert_like)
    out = set()
    for n in candidates - from_experts:
        if ops.op_name(index.root(n)) in _ALLOCATIONS:
            continue  # an accumulator's zeros: no token values in it
        shape = static_shape(n)
        if n not in params and shape and len(shape) >= 2 and shape[-1] > 1 and _numel(shape[:-1]) == num_tokens \
                and _is_float(n):
            out.add(n)
    return out


_ALLOCATIONS = frozenset({"zeros", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty", "full", "full_like",
                          "new_full", "ones", "ones_like", "new_ones"})


def _expert_like(params: ParamTable, n: fx.Node, num_experts: int, family_keys: set[str]) -> bool:
    shape = static_shape(n) or ()
    if len(shape) == 3 and shape[0] == num_experts:
        return True
    return in_family(params.path[n], num_experts, family_keys)


def _weighs_only(index: GraphIndex, p: fx.Node, nodes: set[fx.Node], cls: ExpertParams, routed: set[fx.Node],
                 slots: int) -> bool:
    """Whether parameter ``p`` reaches the experts' values only through routing weights: values
    made from the routing decision (in ``routed``), one per (token, slot) ([T*K], [T, K], a loop's
    [n, 1] rows of them).  It scales or shifts the weights, which the op reads as computed."""
    experts = [n for r in cls.weight_roles + cls.bias_roles for n in r.nodes]
    merged = index.descendants(experts)
    before = (index.descendants([p]) & nodes) - merged
    crossings = [d for d in before if any(u in merged for u in index.rdeps[d] if u in nodes)]

    def per_slot(d: fx.Node) -> bool:
        t = tensor_meta(d)
        one_per_row = t is not None and t.dim() >= 1 and isinstance(t.shape[-1], int) and t.shape[-1] == 1
        return d in routed and _is_float(d) and (one_per_row or _numel(static_shape(d)) == slots)

    return bool(crossings) and all(per_slot(d) for d in crossings)


def _numel(shape: tuple[int, ...] | None) -> int:
    out = 1
    for s in shape or ():
        out *= s
    return out


def _token_shapes(tokens: fx.Node, num_tokens: int, hidden: int) -> set[tuple[int, ...]]:
    """Shapes the routed output may have: [T, H] or a shape the token input had on its way to
    the router ([B, S, H] before a flattening view).  Equal numel alone is not enough: an
    [E, C, H] expert buffer can hold exactly T*H elements."""
    shapes: set[tuple[int, ...]] = {(num_tokens, hidden)}
    n: object = tokens
    while isinstance(n, fx.Node):
        shape = static_shape(n)
        if shape is None or _numel(shape) != num_tokens * hidden:
            break
        shapes.add(shape)
        n = n.args[0] if (is_view(n) or ops.op_name(n) in ("to", "float")) and n.args else None
    return shapes


def _is_token_tensor(n: fx.Node, shapes: set[tuple[int, ...]]) -> bool:
    t = tensor_meta(n)
    return t is not None and t.dtype.is_floating_point and static_shape(n) in shapes


def _is_float(n: fx.Node) -> bool:
    t = tensor_meta(n)
    return t is not None and t.dtype.is_floating_point


def _is_mutated_later(index: GraphIndex, n: fx.Node) -> bool:
    muts = index.mutators.get(index.root(n), [])
    return any(index.pos[m] > index.pos[n] for m in muts)


def _running_sum_part(index: GraphIndex, y: fx.Node, expert_state: set[fx.Node], outside: set[fx.Node]) -> bool:
    """Whether ``y`` is a part of an out-of-place sum over experts: a running sum that later ops
    add more experts' rows into (``y = y.index_add(0, tok, v)``, ``y = y + v``, a scatter-add), or
    one expert's rows added into one. With stacked weights every part reaches the [E, ...]
    tensors, so it looks like a whole layer's output; the layer's is the last sum. A value meeting
    only other parameters' values (a shared expert) is no part: ``y`` stays the routed output.
    Read inside the layer's window, as its candidates are (``outside``: up to the next layer's
    router; the expert tensors and the layer's inputs are reached, not walked through)."""
    for u in y.users:
        if u in outside:
            continue
        if ops.is_index_add(u) and u.args:
            # index_add / scatter_add (self, dim, index, source), index_put (self, indices, values)
            src = u.args[2] if "index_put" in ops.op_name(u) else u.args[3] if len(u.args) > 3 else None
            if y is not u.args[0] and y is not src:
                continue
            others = [a for a in (u.args[0], src) if isinstance(a, fx.Node) and a is not y]
        elif ops.is_add(u):
            others = [a for a in u.args if isinstance(a, fx.Node) and a is not y]
        else:
            continue
        # the other operand's own expert values, not those it reads through y (the next layer's
        # residual add reads this layer's output, and so its experts): y joins the stop set for
        # this walk only (no copy of ``outside`` per step)
        outside.add(y)
        try:
            own = index.ancestors(others, stop=outside) & expert_state
        finally:
            outside.discard(y)
        if own or _running_sum_part(index, u, expert_state, outside):
            return True
    return False


def _weight_candidates(index: GraphIndex, nodes: set[fx.Node], routing: set[fx.Node], num_tokens: int,
                       k: int, num_experts: int) -> list[RoutingWeights]:
    """Tensors the routing weights may be read from: after the top-k (``routing``: its
    descendants that do not depend on expert parameters, as no routing weight does)."""
    inputs = {d for n in nodes for d in index.deps[n]} - nodes
    pool = index.ordered((nodes | inputs) & routing)
    copies = _per_expert_copies(index, pool, routing, num_experts)
    by_kind: dict[str, list[RoutingWeights]] = {"topk": [], "dense": [], "combine": []}
    for n in reversed(pool):
        if n in copies:
            continue
        t = tensor_meta(n)
        shape = static_shape(n)
        if t is None or shape is None or not t.dtype.is_floating_point:
            continue
        if shape == (num_tokens, k):
            by_kind["topk"].append(RoutingWeights(n, "topk"))
        elif shape == (num_tokens, num_experts):
            by_kind["dense"].append(RoutingWeights(n, "dense"))
        elif len(shape) == 3 and shape[:2] == (num_tokens, num_experts):
            by_kind["combine"].append(RoutingWeights(n, "combine"))
    # a few of each kind is plenty: later ones are the processed (renormalized, scaled) weights
    return [w for kind, ws in by_kind.items() for w in (ws[:_MAX_WEIGHT_CANDIDATES[kind]] if num_tokens else ws)]


def _per_expert_copies(index: GraphIndex, pool: list[fx.Node], routing: set[fx.Node],
                       num_experts: int) -> set[fx.Node]:
    """The nodes of ``pool`` that the layer computes once per expert from the routing weights, the
    same ops on the same values but for constants (a dense loop's ``(w * (idx == e)).sum(-1)``:
    E masked [T, K] products): each is one expert's share of the weights, not the weights, and
    E of them would crowd the weights themselves out of the candidates. Told apart by a structural
    signature of each node's ops, dtype and shape inside ``routing`` (constants are alike, values
    outside ``routing`` are themselves; a top-k's values and indices differ by dtype), shared by
    exactly E nodes of the pool."""
    sig: dict[fx.Node, int] = {}
    interned: dict[object, int] = {}

    def arg_key(a: object) -> object:
        if isinstance(a, fx.Node):
            return sig.get(a, a.name)
        if isinstance(a, (list, tuple)):
            return tuple(arg_key(b) for b in a)
        return "constant"

    for n in index.ordered(index.ancestors(pool, stop=set(index.nodes) - routing) & routing):
        t = tensor_meta(n)
        key = (n.op, str(n.target), arg_key(n.args), tuple(sorted((k, arg_key(v)) for k, v in n.kwargs.items())),
               None if t is None else str(t.dtype), static_shape(n))
        sig[n] = interned.setdefault(key, len(interned))
    groups: dict[int, list[fx.Node]] = {}
    for n in pool:
        groups.setdefault(sig[n], []).append(n)
    return {n for members in groups.values() if len(members) == num_experts for n in members}


def _pattern(nodes: set[fx.Node], experts: ExpertParams, capacity: bool) -> str:
    names = {ops.op_name(n) for n in nodes}
    if any(ops.qualified_op(n) == "hiermoe::experts" for n in nodes):
        return "experts_interface"
    if names & {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}:
        return "grouped_mm"
    if "einsum" in names and any(len(static_shape(n) or ()) == 3 for n in nodes if ops.is_einsum(n)):
        return "einsum_capacity" if capacity else "einsum_dispatch"
    if "bmm" in names and experts.weight_roles[0].stacked:
        return "gathered_bmm"
    if names & {"index_add_", "index_add", "scatter_add_", "scatter_add", "index_put_"}:
        return "expert_loop"
    return "dense_masked"


def _label(params: ParamTable, state: list[fx.Node], anchor: fx.Node) -> str:
    """The MoE block's module path (``model.layers.3.mlp``); the block's class name when the
    compiled module is the block itself."""
    paths = [params.path[n] for n in state if n in params]
    # module paths: drop the parameter name (``gate.weight`` -> ``gate``)
    prefix = common_prefix([p.rsplit(".", 1)[0] if "." in p else "" for p in paths])
    if len(paths) == 1:
        prefix = re.sub(r"\.(gate|router|wg)$", "", prefix)
    prefix = re.sub(r"^(experts|gate|router|wg)$", "", prefix)
    if prefix:
        return re.sub(r"\.(experts|gate|router)$", "", prefix)
    stack = anchor.meta.get("nn_module_stack") or {}
    first = next(iter(stack.values()), None)
    cls = first[1] if first else None
    name = getattr(cls, "__name__", None) or (str(cls).rsplit(".", 1)[-1].strip("'>") if cls else "")
    return f"{name} (compiled module)" if name else "<compiled module>"


def _graph_break_hint(index: GraphIndex, topk: fx.Node) -> str:
    """Explain the common reason a router is found but no expert compute: a graph break; and what
    to do about it, for a transformers model whether it can switch its experts implementation."""
    later = index.descendants([topk])
    # the graph returns integers made from the selection (expert ids, counts, an order): the code
    # after the graph reads them, which is where the experts run
    outputs: list[fx.Node] = []
    fx.node.map_arg(index.gm.graph.output_node().args, outputs.append)
    returned = [a for a in outputs if a in later and (t := tensor_meta(a)) is not None and not t.dtype.is_floating_point]
    if not (any(ops.op_name(n) in ("nonzero", "where", "one_hot") for n in later) or len(later) < 8 or returned):
        return ""
    hint = (". The expert computation is not in this graph: a graph break (usually a "
            "data-dependent loop such as `for e in expert_hit:` over `.nonzero()`, or "
            "`.tolist()`/`.item()`) split the layer. Fix: loop over `range(num_experts)` instead")
    model = _transformers_model(topk)
    if model is None:
        return hint + (", or for Hugging Face models use `model.set_experts_implementation(\"grouped_mm\")`, "
                       "\"batched_mm\" or \"hiermoe\"")
    family = model.__module__.split(".")[2]
    if model._can_set_experts_implementation():
        return hint + (f"; transformers' {family} models can switch their experts code: "
                       "`model.set_experts_implementation(\"grouped_mm\")`, \"batched_mm\" or \"hiermoe\"")
    return hint + (f"; transformers' {family} models have no other experts implementation to switch to "
                   "(`set_experts_implementation` refuses them), so their MoE layers stay as written unless "
                   "their experts loop is changed")


def _transformers_model(node: fx.Node) -> Any:
    """A transformers ``PreTrainedModel`` class of the modeling module ``node`` was traced from
    (the classes in Dynamo's ``nn_module_stack``, else the files of its ``stack_trace``: a graph
    resumed after a break has no module stack), or None."""
    classes = [cls for _, cls in (node.meta.get("nn_module_stack") or {}).values() if isinstance(cls, type)]
    names = [cls.__module__ for cls in classes]
    files = re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or "")
    if files:
        by_file = {getattr(m, "__file__", None): name for name, m in list(sys.modules.items())
                   if name.startswith("transformers.models.")}
        names += [by_file[f] for f in files if f in by_file]
    for name in names:
        module = sys.modules.get(name)
        if not name.startswith("transformers.models.") or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == name and hasattr(value, "_can_set_experts_implementation"):
                return value
    return None


__all__ = ["FindResult", "find_moe_regions"]
