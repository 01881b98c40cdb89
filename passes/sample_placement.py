"""sample_placement: NetMoE's dynamic sample placement as a graph rewrite (ICLR 2025;
papers/netmoe-notes-zh.md Sec. 4; DESIGN.md "Sample placement").

Between two MoE layers nothing but sample-wise work runs (norms, attention inside a sample, the
router, token-wise expert ops), so a sample may continue on another rank: if it moves to a rank
whose node holds the experts its tokens use, the next layer's dispatch and combine stay inside
the node. This pass cuts the graph after each MoE layer that has another MoE layer after it, and
at the cut moves every per-sample value the rest of the displaced computation reads (found by
liveness, not by name: the residual stream, attention masks, anything live there) in one exchange
(``lowering.sample_exchange``); after the last MoE layer a cut moves the samples home, and
anything that mixes samples (a loss, a mean over the batch) or leaves the graph reads values that
were returned first. Each rank keeps B samples, so shapes stay static.

Fused cuts (NetMoE places samples in the layer's second all-to-all): where a layer's combine can
carry its output to the new ranks (``fusable``: token all-to-all stages, in one chunk or several), its cut is
right after its expert op; after expert_parallel, ``passes.sample_binding.fuse_combines`` takes
the op's output out of the move and makes the combine ``hiermoe::ep_combine_to``, and moves the
rest (the residual stream before the layer, masks) with its plan before the layer's local expert
stage, so that it travels while the experts compute.

Contract
    needs     the hiermoe::experts nodes canonicalize emitted, with their layer names, before
              expert_parallel (which binds the cuts to its runtime layers:
              ``passes.sample_binding.bind``); the
              compile's example inputs (verification); world size and a two-level topology.
    does      per cut (after MoE layer i, decided by layer i's routing at run time):
                  perm, keys = hiermoe::sample_plan(topk_idx_i, keys_prev, W, B, layer)
                  moved = hiermoe::sample_move([live per-sample values], perm, B, layer)
              rewires the displaced nodes to the moved values; a node that is not sample-wise
              (``passes.sample_axis``), and the output, read values moved home by
              ``sample_move(..., argsort(keys))``. The whole rewrite is verified first on one
              process: the same rewrite with every exchange a fixed derangement of the local
              samples must give the original graph's outputs; otherwise nothing changes.
    refuses   (leaves the graph alone, with the reason in the report) one MoE layer, no sample
              dimension in the tokens, fewer than 2 samples per rank (verification would be
              vacuous), a value mutated in place across a cut, a mismatch in verification.

Pseudo-code:
    B <- the sample dimension of the first layer's tokens ([B, S, H] flattened to [B*S, H])
    cuts <- after each MoE layer but the last: the point before the next one where the live
            per-sample bytes are fewest (a fusable layer: right after its op, unless that moves
            more than half its output's bytes more); after the last: the same, returning home
    displaced <- closure: sample-wise nodes after a cut reading a displaced value or the layer's output
    for each node in order: convert its per-sample inputs to its generation (displaced: the
            last cut's; else home), insert each cut's plan and move after its point
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import moe_compile.lowering  # noqa: F401  (registers torch.ops.hiermoe)
from moe_compile.passes.graph_index import example_value, is_inplace
from moe_compile.passes.graph_params import ParamTable
from moe_compile.passes.sample_axis import NOT_TENSOR, RESHAPES, Axes, op_name, out_axis, sample_wise
from moe_compile.passes.verify import _passes, _rel_err

PLAN_OP = torch.ops.hiermoe.sample_plan.default
START_OP = torch.ops.hiermoe.sample_plan_start.default
MOVE_OP = torch.ops.hiermoe.sample_move.default
LAYER_META = "hiermoe_sample_layer"


@dataclass(frozen=True)
class Cut:
    """One exchange point: after ``after`` (a node name), decided by ``layer``'s routing, moving
    ``moved`` (value names) of ``sample_bytes`` per sample; ``home``: the cut that returns samples.
    ``fused``: the cut is right after the layer's expert op, whose output reaches the samples' new
    ranks in the layer's own combine (``fuse_combines``), not in the move: ``sample_bytes`` does
    not count it."""

    layer: str
    after: str
    moved: tuple[str, ...]
    sample_bytes: int
    home: bool
    fused: bool = False


@dataclass
class PlacementResult:
    samples: int = 0  # B
    cuts: list[Cut] = field(default_factory=list)
    returns: list[str] = field(default_factory=list)  # nodes that read samples moved home early
    fused: set[str] = field(default_factory=set)  # layers whose combine took their output to the new ranks
    reason: str | None = None  # why the graph was left alone (None: rewritten or nothing to do)
    verify_err: float | None = None

    def counters(self) -> dict[str, int]:
        return {"cuts": len(self.cuts), "samples": self.samples, "early_returns": len(self.returns)}


@dataclass(frozen=True)
class Layer:
    """What the pass needs of one MoE layer: its name, its expert op node, its [T, K] expert ids."""

    name: str
    op: fx.Node
    topk_idx: fx.Node
    top_k: int
    hidden_bytes: int  # bytes of one token's hidden row
    # the routing weights scale the experts' input (Llama-4): the op's rows are (token, expert)
    # pairs, w_k x, not the tokens themselves
    input_scaled: bool = False


# -- analysis --------------------------------------------------------------------------------------

def layer_tokens(lay: Layer) -> fx.Node | None:
    """The [T, H] tokens of a layer's expert op: its first argument, or where the routing weights
    scale the experts' input (Llama-4) the tokens they scale. There the op's rows are the K
    products w_tk x_t of each token, token-major (``emit``: reshape(unsqueeze(x, 1) *
    unsqueeze(w, -1), -1, H)), so a sample's rows are still one block, K times its tokens', and
    its [T*K, 1] routing says where each of them goes; the samples are counted on x."""
    tokens = lay.op.args[0]
    if not isinstance(tokens, fx.Node):
        return None
    if not lay.input_scaled:
        return tokens
    prod = tokens.args[0] if op_name(tokens) == "reshape" and tokens.args else None
    if not isinstance(prod, fx.Node) or prod.target is not operator.mul or not prod.args:
        return None
    scaled = prod.args[0]
    if not isinstance(scaled, fx.Node) or op_name(scaled) != "unsqueeze" or not scaled.args:
        return None
    x = scaled.args[0]
    return x if isinstance(x, fx.Node) else None


def sample_dimension(tokens: fx.Node) -> int | None:
    """B where the tokens [T, H] are a [B, S, H] value flattened (followed back through views)."""
    t_val = example_value(tokens)
    if not isinstance(t_val, torch.Tensor) or t_val.ndim != 2:
        return None
    node: Any = tokens
    for _ in range(8):
        v = example_value(node)
        if isinstance(v, torch.Tensor) and v.ndim >= 3 and v.shape[0] * v.shape[1] == t_val.shape[0]:
            return int(v.shape[0])
        if not isinstance(node, fx.Node) or op_name(node) not in RESHAPES | {"contiguous", "to", "float", "type"}:
            return None
        node = node.args[0]
    return None


def _per_sample(gm: fx.GraphModule, params: ParamTable, samples: int) -> tuple[Axes, set[fx.Node]]:
    """Where each per-sample value holds its samples, and the tensors computed from the compile's
    inputs that do not hold samples (a batch mean, a [1, S] input: they differ between ranks).
    A value is per-sample when a sample-wise op (``passes.sample_axis.out_axis``) makes it from per-sample values;
    values the rules cannot follow (mask building with advanced indexing, before the first cut) are
    taken as per-sample in dim 0 where it is a multiple of B long, which the verification checks."""
    from_inputs: set[fx.Node] = set()
    from_any: set[fx.Node] = set()  # computed from some placeholder (an input or the model's state)
    axes: Axes = {}
    for n in gm.graph.nodes:
        v = example_value(n)
        if n.op == "placeholder":
            from_any.add(n)
            if n not in params:
                from_inputs.add(n)
        elif any(a in from_any for a in n.all_input_nodes):
            from_any.add(n)
        if n.op != "placeholder" and any(a in from_inputs for a in n.all_input_nodes):
            from_inputs.add(n)
        if n.op != "placeholder" and any(a in axes for a in n.all_input_nodes):
            axis = out_axis(n, axes, samples)
            if axis is not None and axis != NOT_TENSOR:
                axes[n] = axis
                continue
        if n in from_inputs and _dim0_per_sample(v, samples):
            axes[n] = 0
        elif n not in from_any and isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == samples:
            # a constant with a row per local sample (a causal mask expanded to [B, 1, S, S]): the same
            # on every rank, so a moved sample takes its row along and meets what eager gives it
            axes[n] = 0
    rank_local = {n for n in from_inputs if n not in axes and isinstance(example_value(n), torch.Tensor)}
    return axes, rank_local


def _dim0_per_sample(v: object, samples: int) -> bool:
    vals = v if isinstance(v, tuple | list) and v else [v]
    return all(isinstance(i, torch.Tensor) and i.ndim and i.shape[0] and i.shape[0] % samples == 0 for i in vals)


def _bytes_per_sample(n: fx.Node, samples: int) -> int:
    v = example_value(n)
    return v.numel() * v.element_size() // samples if isinstance(v, torch.Tensor) else 0


def _choose_cut(order: list[fx.Node], lo: int, hi: int, live_bytes: list[int]) -> int:
    """The position p in [lo, hi) (cut after order[p]) with the fewest live per-sample bytes
    (``live_bytes[p]``: of the values defined at or before p and read after it)."""
    return min((p for p in range(lo, hi) if order[p].op != "placeholder"), key=live_bytes.__getitem__, default=lo)


def _live_bytes(length: int, live: list[tuple[int, int, int]]) -> list[int]:
    """Per position, the bytes of the (defined, last read, bytes) intervals that span it."""
    delta = [0] * (length + 1)
    for start, end, nb in live:
        delta[start] += nb
        delta[end] -= nb
    return list(itertools.accumulate(delta))[:length]


Agree = Callable[[str | None, int, int, tuple[str, ...]], str | None]


def sample_placement_pass(gm: fx.GraphModule, layers: Sequence[Layer], example_inputs: Sequence[object],
                          params: ParamTable, world: int, verify: bool = True, agree: Agree | None = None,
                          fusable: frozenset[str] = frozenset()) -> PlacementResult:
    """Rewrite ``gm`` (module docstring); ``layers`` in graph order. ``agree(reason, B, cuts, fused)``
    (under expert parallelism) turns this rank's verdict into the one every rank takes: the reason
    to leave the graph alone, or None to rewrite it (its fourth argument: the layers whose cuts
    are fused, the same on every rank or the graphs would differ). ``fusable``: the layers whose combine can
    take their samples to their new ranks (token all-to-all stages, chunked or not): a cut that places
    samples after one of them is made right after its expert op (``Cut.fused``), where the rewrite
    allows it (else where the fewest bytes are live)."""
    res = PlacementResult()
    _fill_example_values(gm, example_inputs)
    reason, samples, cuts, fused = _trial(gm, layers, example_inputs, params, verify, res, fusable)
    if agree is not None:
        reason = agree(reason, samples, cuts, tuple(sorted(fused)))
    if reason is not None:
        res.reason = reason
        return res
    res.samples = samples
    reason = _rewrite(gm, layers, params, samples, world, res, fused)
    if reason is not None:  # the trial made the same rewrite: it cannot refuse now
        raise AssertionError(f"sample placement refused after its trial passed: {reason}")
    return res


def _fill_example_values(gm: fx.GraphModule, example_inputs: Sequence[object]) -> None:
    """Example values for the nodes earlier passes made without one (the expert ops, the pieces
    of a tuple): fake tensor propagation of the whole graph, kept only where one was missing."""
    if all(example_value(n) is not None for n in gm.graph.nodes if n.op in ("call_function", "call_method")
           and n.users):
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    known = {n: n.meta.get("val") for n in gm.graph.nodes}
    FakeTensorProp(gm, mode).propagate(*example_inputs)
    for n in gm.graph.nodes:
        if "example_value" not in n.meta and n.meta.get("val") is not None:
            n.meta["example_value"] = n.meta["val"]
        if known[n] is None:
            n.meta.pop("val", None)
        else:
            n.meta["val"] = known[n]


def _trial(gm: fx.GraphModule, layers: Sequence[Layer], example_inputs: Sequence[object], params: ParamTable,
           verify: bool, res: PlacementResult, fusable: frozenset[str]) -> tuple[str | None, int, int, frozenset[str]]:
    """(why not, B, cuts, the layers whose cut is fused): the rewrite made on a copy with every
    exchange a local derangement, and compared with the graph; with the fusable layers' cuts right
    after their expert ops first, else (that rewrite refused) with none fused."""
    if len(layers) < 2:
        return "one MoE layer in this graph: no later all-to-all gains from moving samples", 0, 0, frozenset()
    tokens = layer_tokens(layers[0])
    samples = sample_dimension(tokens) if tokens is not None else None
    if samples is None:
        return ("the tokens are not a [batch, seq, hidden] value flattened: no sample dimension found", 0, 0,
                frozenset())
    if samples < 2:
        return (f"{samples} sample per rank: the rewrite cannot be verified on one process (a permutation "
                "of one sample is the identity); run at least 2 samples per rank"), samples, 0, frozenset()
    fused = frozenset(lay.name for lay in layers[:-1] if lay.name in fusable)
    reason, cuts = _trial_rewrite(gm, layers, example_inputs, params, verify, res, samples, fused)
    if reason is not None and fused:
        reason, cuts = _trial_rewrite(gm, layers, example_inputs, params, verify, res, samples, frozenset())
    return reason, samples, len(cuts), frozenset(c.layer for c in cuts if c.fused)


def _trial_rewrite(gm: fx.GraphModule, layers: Sequence[Layer], example_inputs: Sequence[object], params: ParamTable,
                   verify: bool, res: PlacementResult, samples: int, fused: frozenset[str]
                   ) -> tuple[str | None, list[Cut]]:
    graph = fx.Graph()
    node_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, node_map)  # nodes keep their meta (example values)
    graph.output(out)
    trial = fx.GraphModule(gm, graph)
    trial_layers = [Layer(lay.name, node_map[lay.op], node_map[lay.topk_idx], lay.top_k, lay.hidden_bytes,
                          lay.input_scaled) for lay in layers]
    probe = PlacementResult(samples=samples)
    reason = _rewrite(trial, trial_layers, ParamTable(trial, example_inputs), samples, 1, probe, fused)
    if reason is not None:
        return reason, []
    if probe.returns:
        return (f"samples would go home early, before {', '.join(sorted(set(probe.returns)))}: ops there move or "
                "mix the sample dimension (e.g. a permute that takes dim 0 elsewhere), so the next layers would "
                "not run where the samples were placed"), []
    if verify:
        err, ok = _verify(gm, trial, example_inputs)
        res.verify_err = err
        if not ok:
            return (f"with the samples permuted the graph computes something else (max rel err {err:.2e}): "
                    "an op between two MoE layers mixes samples that the analysis took as sample-wise"), []
    return None, probe.cuts


def _verify(original: fx.GraphModule, rewritten: fx.GraphModule, example_inputs: Sequence[object]) -> tuple[float, bool]:
    def run(g: fx.GraphModule) -> list[torch.Tensor]:
        vals = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
        with torch.no_grad():
            out = g(*vals)
        flat = out if isinstance(out, list | tuple) else [out]
        return [o for o in flat if isinstance(o, torch.Tensor)]

    a, b = run(original), run(rewritten)
    errs = [_rel_err(x, y) for x, y in zip(a, b, strict=True)]
    worst = max(errs, default=0.0)
    ok = len(a) == len(b) and all(_passes(e, x, y, x.dtype) for e, x, y in zip(errs, a, b, strict=True))
    return worst, ok


def _rewrite(gm: fx.GraphModule, layers: Sequence[Layer], params: ParamTable, samples: int, world: int,
             res: PlacementResult, fused: frozenset[str] = frozenset()) -> str | None:
    graph = gm.graph
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    for n in order:  # an element of a tuple some pass split off without its example value
        if n.target is operator.getitem and example_value(n) is None and isinstance(n.args[0], fx.Node):
            whole = example_value(n.args[0])
            if isinstance(whole, tuple | list) and isinstance(n.args[1], int):
                n.meta["example_value"] = whole[n.args[1]]
    output = order[-1]
    per_sample, rank_local = _per_sample(gm, params, samples)
    # live intervals of per-sample tensors: (defined, last read, bytes; a value with its samples
    # in another dim cannot move: as many bytes as make any other cut cheaper)
    live = [(pos[n], max(pos[u] for u in n.users),
             _bytes_per_sample(n, samples) if per_sample[n] == 0 else 1 << 60)
            for n in per_sample if n.users and isinstance(example_value(n), torch.Tensor)]
    live_bytes = _live_bytes(len(order), live)
    # cuts: (position, layer index, home)
    cuts: list[tuple[int, int, bool]] = []
    fused_at: set[int] = set()  # layers whose cut is right after their op, fused with their combine
    for i, lay in enumerate(layers):
        lo = pos[lay.op]
        last = i == len(layers) - 1
        hi = pos[output] if last else pos[layers[i + 1].op]
        if last:  # home before the first reader of the samples that is not sample-wise (e.g. a loss)
            ahead = {lay.op}
            for q in range(lo + 1, hi):
                n = order[q]
                if not any(a in ahead for a in n.all_input_nodes):
                    continue
                if not sample_wise(n, per_sample, samples, rank_local):
                    hi = q
                    break
                ahead.add(n)
        best = _choose_cut(order, lo, hi, live_bytes)
        # a fused cut right after the op: its output rides the layer's combine (fuse_combines),
        # which then sends a moved sample's results inside the node of its experts instead of to
        # its old rank; taken unless what moves besides the output exceeds the best cut's bytes by
        # more than half the output's (the combine saved, for a sample half of whose tokens' experts
        # are where it goes): the residual stream before the layer instead of after it passes, a
        # shared expert's output beside it (as much again) does not
        out_bytes = _bytes_per_sample(lay.op, samples)
        if (lay.name in fused and not last and per_sample.get(lay.op) == 0
                and live_bytes[lo] - out_bytes <= live_bytes[best] + out_bytes // 2):
            best = lo
            fused_at.add(i)
        cuts.append((best, i, last))
    first_cut, home_cut = cuts[0][0], cuts[-1][0]
    # displaced nodes: sample-wise, after the first cut and up to the home cut, reading the output of
    # a layer that cuts or a displaced value (generation: the last cut before them)
    gen_of_cut = {p: g + 1 for g, (p, _, home) in enumerate(cuts) if not home}
    anchors = {layers[i].op for _, i, home in cuts if not home}
    derived: set[fx.Node] = set()  # sample-wise descendants of a placing layer's output
    blockers: list[fx.Node] = []  # readers of those that are not sample-wise
    for n in order[pos[layers[0].op]: home_cut + 1]:
        if n.op in ("call_function", "call_method") and any(a in derived or a in anchors for a in n.all_input_nodes):
            if sample_wise(n, per_sample, samples, rank_local):
                derived.add(n)
                if is_inplace(n) and n.args and isinstance(n.args[0], fx.Node):
                    # later readers of the value it mutates read this (Llama-4: shared.add_(routed))
                    derived.add(n.args[0])
            else:
                blockers.append(n)
    for _, i, home in cuts:
        if not home and layers[i + 1].op not in derived:
            why = f" (it reads samples through {blockers[0].name}, which is not sample-wise)" if blockers else ""
            return (f"the tokens of {layers[i + 1].name} do not follow the samples placed after {layers[i].name}"
                    f"{why}: moving them would not change where that layer's all-to-all starts")
    displaced: dict[fx.Node, int] = {}  # node -> generation (the last cut before it)
    gen = 0
    for p in range(first_cut + 1, home_cut + 1):
        gen = gen_of_cut.get(p - 1, gen)
        if order[p] in derived:
            displaced[order[p]] = gen
    # a value mutated in place across a cut would be mutated in one copy only
    for n in order:
        if is_inplace(n) and n.args and isinstance(src := n.args[0], fx.Node):
            if any(pos[src] <= p < pos[n] for p, _, _ in cuts):
                return (f"{n.name} mutates {src.name} in place after a sample exchange point: moving it would "
                        "leave the other copy stale")
    # -- emit ---------------------------------------------------------------------------------------
    versions: dict[fx.Node, dict[int, fx.Node]] = {}
    home_gen: dict[fx.Node, int] = {}
    keys: dict[int, fx.Node | None] = {0: None}
    perm_cache: dict[tuple[int, int], fx.Node] = {}
    cut_at = {p: (i, home) for p, i, home in cuts}
    plan_of_topk = {layers[i].topk_idx: layers[i].name for _, i, home in cuts if not home}
    tickets: dict[str, fx.Node] = {}
    layer_of_gen: dict[int, str] = {}
    returns: list[str] = []

    def fake_ints(n_rows: int) -> torch.Tensor:
        like = example_value(layers[0].topk_idx)
        if not isinstance(like, torch.Tensor):
            like = example_value(layers[0].op.args[0])  # type: ignore[arg-type]
        assert isinstance(like, torch.Tensor)
        return like.new_empty((n_rows,), dtype=torch.int64)

    def perm_between(a: int, b: int, where: fx.Node) -> tuple[fx.Node, fx.Node]:
        """perm moving values of generation a to generation b (out[n] = in[perm[n]]), and the last
        node inserted after ``where`` for it (``where`` when none)."""
        if (a, b) in perm_cache:
            return perm_cache[(a, b)], where
        with graph.inserting_after(where):
            if b == 0:
                ka = keys[a]
                assert ka is not None
                node = graph.call_function(torch.argsort, (ka,))
            elif a == 0:
                kb = keys[b]
                assert kb is not None
                node = kb
            else:
                ka, kb = keys[a], keys[b]
                assert ka is not None and kb is not None
                inv = graph.call_function(torch.argsort, (ka,))
                inv.meta["example_value"] = fake_ints(world * samples)
                with graph.inserting_after(inv):
                    node = graph.call_function(operator.getitem, (inv, kb))
        node.meta["example_value"] = fake_ints(world * samples)
        perm_cache[(a, b)] = node
        return node, (where if a == 0 else node)

    def layer_name(g: int) -> str:
        return layer_of_gen.get(g, layers[-1].name)

    def move(values: list[fx.Node], a: int, b: int, where: fx.Node) -> fx.Node:
        """Emit the move of ``values`` (generation a) to generation b after ``where``; returns the last node."""
        perm, anchor = perm_between(a, b, where)
        with graph.inserting_after(anchor):
            mv = graph.call_function(MOVE_OP, ([versions[v][a] for v in values], perm, samples, -1))
        mv.meta["example_value"] = [example_value(v) for v in values]
        mv.meta[LAYER_META] = layer_name(max(a, b))
        last = mv
        for k, v in enumerate(values):
            with graph.inserting_after(last):
                got = graph.call_function(operator.getitem, (mv, k))
            got.meta["example_value"] = example_value(v)
            versions[v][b] = got
            last = got
        return last

    def version(v: fx.Node, b: int, before: fx.Node) -> fx.Node:
        have = versions.setdefault(v, {home_gen.get(v, 0): v})
        if b in have:
            return have[b]
        a = max(have)  # the latest generation it was moved to
        prev = before.prev
        move([v], a, b, prev)
        if b == 0:
            returns.append(before.name)
        return versions[v][b]

    for p, n in enumerate(order):
        if n.op in ("call_function", "call_method", "output"):
            target = displaced.get(n, 0)
            if n not in displaced and n.op != "output" and not any(a in per_sample for a in n.all_input_nodes):
                target = 0

            def swap(a: object, target: int = target, n: fx.Node = n) -> object:
                if isinstance(a, fx.Node) and a in per_sample and isinstance(example_value(a), torch.Tensor):
                    if per_sample[a] != 0 and target != home_gen.get(a, 0):
                        raise _Unsupported(f"{n.name} reads {a.name}, which holds its samples in dim {per_sample[a]}, "
                                           "where the samples are placed differently")
                    return version(a, target, n)
                if isinstance(a, fx.Node) and a in per_sample and a in home_gen and home_gen[a] != target:
                    raise _Unsupported(f"{n.name} reads the tuple {a.name} in another sample placement")
                return a

            src = n.args[0] if n.args else None
            if is_inplace(n) and isinstance(src, fx.Node) and src in per_sample and home_gen.get(src, 0) != target:
                return (f"{n.name} mutates {src.name} in place where the samples are placed differently: the "
                        "mutation would reach one copy only")
            try:
                if op_name(n) == "getitem" and not isinstance(example_value(n.args[0]), torch.Tensor):
                    target = home_gen.get(n.args[0], 0)  # type: ignore[arg-type]
                else:
                    n.args = fx.node.map_aggregate(n.args, swap)  # type: ignore[assignment,arg-type]
                    n.kwargs = fx.node.map_aggregate(n.kwargs, swap)  # type: ignore[assignment,arg-type]
            except _Unsupported as e:
                return str(e)
            if n in per_sample:
                home_gen[n] = target
        if n in plan_of_topk:  # the plan's exchange starts with the layer's routing
            with graph.inserting_after(n):
                ticket = graph.call_function(START_OP, (n, world, samples, -1))
            ticket.meta["example_value"] = fake_ints(1)
            ticket.meta[LAYER_META] = plan_of_topk[n]
            tickets[plan_of_topk[n]] = ticket
        if p in cut_at:
            i, home = cut_at[p]
            lay = layers[i]
            g_prev = max(keys)
            g_new = 0 if home else g_prev + 1
            # what moves: per-sample values defined up to here, read after here by a displaced node (or,
            # at the home cut, by anything)
            moving = []
            for v in order[: p + 1]:
                if v not in per_sample or not isinstance(example_value(v), torch.Tensor):
                    continue
                later = [u for u in v.users if pos.get(u, -1) > p]
                if home:
                    need = bool(later) and 0 not in versions.get(v, {home_gen.get(v, 0): v})
                else:
                    need = any(u in displaced for u in later)
                if need:
                    if per_sample[v] != 0:
                        return (f"{v.name} holds its samples in dim {per_sample[v]} where the samples move after "
                                f"{n.name}: the exchange moves dim 0")
                    moving.append(v)
            where = n
            if not home:
                if home_gen.get(lay.topk_idx, 0) != g_prev:
                    return f"the routing of {lay.name} is not where its samples are when it is computed"
                with graph.inserting_after(where):
                    plan = graph.call_function(PLAN_OP, (tickets[lay.name], keys[g_prev], world, samples, -1))
                plan.meta["example_value"] = (fake_ints(world * samples), fake_ints(world * samples))
                plan.meta[LAYER_META] = lay.name
                with graph.inserting_after(plan):
                    perm = graph.call_function(operator.getitem, (plan, 0))
                perm.meta["example_value"] = fake_ints(world * samples)
                with graph.inserting_after(perm):
                    new_keys = graph.call_function(operator.getitem, (plan, 1))
                new_keys.meta["example_value"] = fake_ints(world * samples)
                keys[g_new] = new_keys
                perm_cache[(g_prev, g_new)] = perm
                layer_of_gen[g_new] = lay.name
                where = new_keys
            by_gen: dict[int, list[fx.Node]] = {}
            for v in moving:
                have = versions.setdefault(v, {home_gen.get(v, 0): v})
                if g_new not in have:
                    by_gen.setdefault(max(have), []).append(v)
            for a, vals in sorted(by_gen.items()):
                where = move(vals, a, g_new, where)
            fuses = i in fused_at
            res.cuts.append(Cut(lay.name, n.name, tuple(v.name for v in moving),
                                sum(_bytes_per_sample(v, samples) for v in moving if not (fuses and v is lay.op)),
                                home, fuses))
    res.returns = returns
    graph.lint()
    gm.recompile()
    return None


class _Unsupported(Exception):
    pass


__all__ = ["LAYER_META", "MOVE_OP", "PLAN_OP", "START_OP", "Cut", "Layer", "PlacementResult", "sample_dimension",
           "sample_placement_pass"]
