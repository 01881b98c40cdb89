"""Split every expert-parallel all-to-all stage into start and wait, and put independent graph
work between them.

Runs on the graphs AOTAutograd hands the inner compiler (forward and backward, after autograd:
Inductor's ``post_grad_custom_post_pass``, or the aot_eager compilers), so the backward's stages
(``ep_combine_backward``, ``ep_dispatch_backward``) are split as well as the forward's.

Contract:
    needs     a post-grad FX graph that may call the stage ops of ``lowering.ep_stages``
              (``SPLIT_STAGES``: ``hiermoe::ep_dispatch``, ``ep_combine`` and their backward ops).
    does      replaces each such call ``out = stage(*args)`` by ``t = stage_start(*args)`` and
              ``out = stage_wait(t, *args)`` at the same place (the wait takes the arguments again
              so that the compiler keeps every buffer the stage reads alive until it is done),
              moves each start up to where its arguments are ready (an expert gather, whose
              arguments are the graph's weights, at most ``prefetch`` layers ahead: not above
              the wait of the gather ``prefetch`` gathers before it; 0: it stays; None, "auto":
              a gather whose weights are kept for backward as far up as its arguments allow, one
              gathered again in backward one layer ahead), then moves before each wait
              every later node that neither depends on it (or on a later stage) nor comes after
              a node with side effects (a mutation, a seeded random op, anything not a plain
              operator or a read of a module constant): on the caller's thread it runs while the worker's lanes
              (``moe_compile.ep.worker``) move the tokens. The stages keep their order among
              themselves (the chunked pipeline's order, ``cost.pipeline``), so every rank issues
              its collectives in the same order.
              A stage left with nothing but views and indexing between its start and wait is
              joined again (it runs where it stands: a split would only cost two thread switches).
    guarantees the graph computes what it computed (only the order of independent pure nodes
              changes); ``split_stages`` returns, per graph, the stages left split and the nodes
              moved.

Pseudo-code::

    for n in graph with target in SPLIT_STAGES:                      # Step 1: split
        t = stage_start(*n.args); w = stage_wait(t, *n.args); n -> w
    for t in starts: move t up to just below the last of: its         # Step 2: start early
        arguments, the previous start (a gather: the previous gather's start and the wait
        of the gather `prefetch` gathers before), a node with side effects
    for w in waits, in graph order:                                  # Step 3: overlap
        dependent = {w}
        for m after w until a node with side effects or the output:
            if m is another stage or reads a dependent node: dependent.add(m)
            else: move m before w
    for t, w in pairs: if only views/getitems lie between t and w:    # Step 4: join the idle
        replace t, w by the stage itself at w
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import moe_compile.lowering  # noqa: F401  (registers torch.ops.hiermoe)
from moe_compile.ep import runtime
from moe_compile.lowering.ep_stages import COLLECTIVE_OPS, GATHER_STAGES, SPLIT_STAGES


@dataclass
class Split:
    """What ``split_stages`` did to one graph."""

    stages: int  # start/wait pairs made and kept (a stage with no work between them is joined again)
    moved: int  # nodes moved between a start and its wait
    # where each expert gather starts: "<its start> after <the node before it>" (the prefetch)
    gather_starts: list[str] = field(default_factory=list)


def _stage_targets() -> dict[Any, tuple[Any, Any]]:
    ops = torch.ops.hiermoe
    return {getattr(ops, s).default: (getattr(ops, f"{s}_start").default, getattr(ops, f"{s}_wait").default)
            for s in SPLIT_STAGES}


def _pure(n: fx.Node) -> bool:
    """Whether ``n`` may run earlier than written: a plain function of its inputs, or a read of one
    of the module's constants (``get_attr``: AOTAutograd lifts tensors the model builds from
    literals, such as the empty key/value cache transformers makes, to ``_tensor_constant`` reads
    in the middle of a layer; a prefetch must pass them)."""
    if n.op == "get_attr":
        return True
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem or getattr(t, "__module__", None) in ("_operator", "math", "torch.fx.experimental.sym_node"):
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False  # higher-order ops (effects, rng state), Python callables: leave where they are
    return not t._schema.is_mutable and torch.Tag.nondeterministic_seeded not in t.tags


def _communicates(n: fx.Node) -> bool:
    """A stage op or a step's begin (``ep_stages.collective_op``): collectives, kept in graph order."""
    return n.op == "call_function" and n.target in COLLECTIVE_OPS


def _fake_ticket(n: fx.Node) -> Any:
    vals = n.meta.get("val")
    for v in vals if isinstance(vals, (tuple, list)) else (vals,):
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            with mode:
                return torch.empty((1,), dtype=torch.long, device="cpu")
    return None


def split_stages(graph: fx.Graph, prefetch: int | None = 1) -> Split:
    """The module docstring's steps on ``graph`` (in place); ``prefetch``: options['gather_prefetch']
    (None for "auto": ``gather_ahead``)."""
    targets = _stage_targets()
    gather_waits = {getattr(torch.ops.hiermoe, f"{s}_wait").default for s in GATHER_STAGES}
    waits: list[fx.Node] = []
    # Step 1: split each stage where it is.
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in targets:
            continue
        start_op, wait_op = targets[n.target]
        with graph.inserting_before(n):
            start = graph.call_function(start_op, n.args, dict(n.kwargs))
            wait = graph.call_function(wait_op, (start, *n.args), dict(n.kwargs))
        start.name, wait.name = f"{n.name}_start", f"{n.name}_wait"
        # the start takes the stage's arguments (and their recorded eager values); the wait
        # produces its outputs (the same fake values and unbacked sizes)
        start.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "unbacked_bindings")})
        ticket = _fake_ticket(n)
        if ticket is not None:
            start.meta["val"] = ticket
        wait.meta.update({k: v for k, v in n.meta.items() if k != "eager_input_vals"})
        n.replace_all_uses_with(wait)
        graph.erase_node(n)
        waits.append(wait)
    # Step 2: each start as early as its arguments allow (not above a node with side effects,
    # nor above the previous start: the stages keep their order).
    # A gather may pass other stages' starts (its collectives run on its own lane, and every rank
    # moves it alike), not an earlier gather's start, nor the wait of the gather ``prefetch``
    # before it (what bounds the gathered weights in memory at once).
    previous: fx.Node | None = None
    previous_gather: fx.Node | None = None
    gathers: list[fx.Node] = []
    for wait in waits:
        arg = wait.args[0]
        assert isinstance(arg, fx.Node)
        start = arg
        inputs = set(start.all_input_nodes)
        is_gather = wait.target in gather_waits
        ahead = gather_ahead(start, prefetch) if is_gather else 0
        if is_gather:
            stops = {previous_gather, gathers[-ahead] if 0 < ahead <= len(gathers) else None}
            gathers.append(wait)
        else:
            stops = {previous}
        if is_gather and ahead:  # what it reads of the weights (views, a stack) comes along
            for a in _pure_ancestors(start):
                _hoist(a, set(a.all_input_nodes), stops, seeded=True)
        if not (is_gather and not ahead):
            _hoist(start, inputs, stops, seeded=is_gather)
        previous = start
        if is_gather:
            previous_gather = start
    # Step 3: independent work before each wait.
    moved = 0
    for wait in waits:
        dependent = {wait}
        later: list[fx.Node] = []
        m = wait.next
        while m.op != "output" and m.op != "root":
            if _communicates(m):  # another stage (or a step's begin): stays, in order; what needs it stays too
                dependent.add(m)
                m = m.next
                continue
            if not _pure(m):
                break
            if any(a in dependent for a in m.all_input_nodes):
                dependent.add(m)
            else:
                later.append(m)
            m = m.next
        for m in later:
            wait.prepend(m)
        moved += len(later)
    # Step 4: a stage with nothing between its start and wait runs where it stands: the split
    # would only hand it to a lane and back (a thread switch each way on cores the ranks share).
    originals = {wait_op: stage for stage, (_, wait_op) in targets.items()}
    kept = 0
    joined: set[fx.Node] = set()
    for wait in waits:
        ticket = wait.args[0]
        assert isinstance(ticket, fx.Node)
        start = ticket
        if any(not _cheap(m) for m in _nodes_between(start, wait)):
            kept += 1
            continue
        with graph.inserting_before(wait):
            stage = graph.call_function(originals[wait.target], start.args, dict(start.kwargs))
        stage.name = wait.name.removesuffix("_wait")
        stage.meta.update(wait.meta)
        stage.meta.update({k: v for k, v in start.meta.items() if k == "eager_input_vals"})
        wait.replace_all_uses_with(stage)
        graph.erase_node(wait)
        graph.erase_node(start)
        joined.add(wait)
    starts = [f"{w.args[0].name} after {w.args[0].prev.name}" for w in waits  # type: ignore[union-attr]
              if w.target in gather_waits and w not in joined]
    return Split(kept, moved, starts)


def gather_ahead(start: fx.Node, prefetch: int | None) -> int:
    """How many gathers ahead the expert gather ``start`` (``ep_gather_start(weights, layer, ...)``)
    may start: ``prefetch`` where given; for None ("auto") unbounded (``sys.maxsize``) where the
    layer keeps its gathered weights for backward (``gather_keep_bytes``), 1 where it frees them
    after its forward and gathers them again in backward (and in backward itself).

    Why unbounded costs no memory where the weights are kept: they are held from the gather to the
    end of the forward either way, and everything alive when the gather starts early is alive at
    the forward's end too, so the forward's peak (its end) does not rise. Why it pays: the gathers
    of a step run one after another on one lane per mesh level (``moe_compile.ep.worker``), so the
    slow link is busy from the graph's start on, instead of idling from the moment one layer's
    gather is done until that layer runs. This is HybridEP's asynchronous communicator (Section
    IV-B, Fig. 10): every MoE layer's experts go to its send queue, one layer after another, at the
    step's start, and each layer takes them from the receive queue when it runs. A layer gathered
    again in backward (the only gathers a backward graph has) would hold its weights longer for
    every layer ahead: one."""
    if prefetch is not None:
        return prefetch
    layer = start.args[1]
    assert isinstance(layer, int), f"{start}: the gather's layer is not a constant: {layer!r}"
    return 1 if runtime.layer(layer).regathered else sys.maxsize


def _hoist(n: fx.Node, inputs: set[fx.Node], stops: set[fx.Node | None], seeded: bool = False) -> None:
    """Move ``n`` up past pure nodes, to just below the first of: one of ``inputs``, one of
    ``stops``, a placeholder, a node with side effects. ``seeded``: also past random ops that
    mutate nothing (``n`` draws no random numbers, so their order stays)."""
    m: fx.Node = n.prev
    while m.op != "root" and m.op != "placeholder" and m not in inputs and m not in stops and (
            _pure(m) or seeded and _seeded(m)):
        m = m.prev
    if m is not n.prev:
        m.append(n)


def _seeded(n: fx.Node) -> bool:
    """A random op that mutates nothing (dropout inside an attention kernel)."""
    t = n.target
    return (n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable
            and torch.Tag.nondeterministic_seeded in t.tags)


def _pure_ancestors(n: fx.Node) -> list[fx.Node]:
    """The pure nodes ``n`` reads through pure nodes (not stages), upstream first."""
    seen: set[fx.Node] = set()
    stack = list(n.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in seen or not _pure(a) or _communicates(a):
            continue
        seen.add(a)
        stack.extend(a.all_input_nodes)
    order = {node: i for i, node in enumerate(n.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _nodes_between(a: fx.Node, b: fx.Node) -> list[fx.Node]:
    out = []
    m = a.next
    while m is not b:
        out.append(m)
        m = m.next
    return out


def _cheap(n: fx.Node) -> bool:
    """A node that is no work to overlap with: an index into a tuple, a symbolic size, a view."""
    if n.op != "call_function":
        return n.op in ("placeholder", "get_attr")
    t = n.target
    if t is operator.getitem or getattr(t, "__module__", None) in ("_operator", "math", "torch.fx.experimental.sym_node"):
        return True
    return isinstance(t, torch._ops.OpOverload) and t.is_view


class OverlapPass(CustomGraphPass):
    """``split_stages`` as Inductor's ``post_grad_custom_post_pass``. ``done(split, code)`` is
    called for every graph with stages."""

    def __init__(self, done: Callable[[Split, str], None] | None = None, prefetch: int | None = 1) -> None:
        self.done, self.prefetch = done, prefetch

    def __call__(self, graph: fx.Graph) -> None:
        split = split_stages(graph, self.prefetch)
        if split.stages and self.done is not None:
            self.done(split, graph.python_code("self").src)

    def uuid(self) -> Any:
        # None: Inductor does not cache the graphs this pass runs on (a cache hit would skip the
        # pass and with it what ``done`` records for explain and the dump), so a recompile of an
        # expert-parallel graph pays Inductor's compile time again.
        return None


__all__ = ["OverlapPass", "Split", "split_stages"]
