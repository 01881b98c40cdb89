"""sample_binding: what the sample placement needs once expert_parallel has made the runtime layers
(papers/netmoe-notes-zh.md Sec. 4; DESIGN.md "Sample placement").

``passes.sample_placement`` cuts the graph between the MoE layers and emits each cut's plan and
move with the layer's name; after expert_parallel:

- ``bind`` gives the plans and moves their runtime layer ids (``lowering.sample_exchange`` finds
  the layer's routing record and process groups by them);
- ``fuse_combines`` makes a fused cut's layer combine to the samples' new ranks
  (``hiermoe::ep_combine_to``, every chunk's where the layer runs in chunks) instead of moving its
  output after the combine brought it home;
- ``register_records`` gives each deciding cut the runtime record its plan weighs a move with
  (``cost.netmoe``: the bytes a sample moves, the all-to-alls a move serves, the redirects it adds).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

import moe_compile.lowering  # noqa: F401  (registers torch.ops.hiermoe)
from moe_compile.ep import runtime
from moe_compile.lowering import sample_exchange
from moe_compile.passes.sample_placement import LAYER_META, MOVE_OP, PLAN_OP, START_OP, PlacementResult


def bind(gm: fx.GraphModule, layer_ids: dict[str, int], world: int) -> int:
    """Point the sample exchanges at the runtime layers expert_parallel registered (by layer name)."""
    bound = 0
    for n in gm.graph.nodes:
        name = n.meta.get(LAYER_META)
        if name is None:
            continue
        lid = layer_ids[name]
        if n.target is PLAN_OP:
            n.args = (n.args[0], n.args[1], world, n.args[3], lid)
        elif n.target is START_OP:
            n.args = (n.args[0], world, n.args[2], lid)
        else:
            n.args = (*n.args[:3], lid)
        bound += 1
    gm.recompile()
    return bound


def register_records(res: PlacementResult, layer_ids: dict[str, int], topology: Any,
                     token_bytes: dict[str, int], chunks: dict[str, int]) -> None:
    """The runtime record of every cut that plans (its topology, B, the bytes a sample moves, the
    all-to-alls its placement serves: the next layer's two, and with a cut fused into the layer's
    combine (``res.fused``, ``fuse_combines``) that combine too, redirected in each of the layer's
    ``chunks``)."""
    for cut in res.cuts:
        if cut.home:
            continue
        fused = cut.fused and cut.layer in res.fused
        sample_exchange.register(layer_ids[cut.layer], sample_exchange.PlacementRecord(
            topology=topology, samples=res.samples, sample_bytes=cut.sample_bytes,
            token_bytes=token_bytes[cut.layer], fused=fused, chunks=chunks.get(cut.layer, 1) if fused else 1))


def _hoist(graph: fx.Graph, node: fx.Node, before: fx.Node) -> bool:
    """Move ``node`` and what it needs of the nodes after ``before`` (the plan of a move, its
    permutation) to just before ``before``, in their order; False (nothing moved) when ``node``
    needs ``before`` or something computed from it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    later: set[fx.Node] = set()
    stack = [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if order[a] >= order[before] and a not in later:
                if a is before:
                    return False
                later.add(a)
                stack.append(a)
    for n in sorted(later | {node}, key=order.__getitem__):
        before.prepend(n)
    return True


def _hoist_before(graph: fx.Graph, node: fx.Node, before: fx.Node) -> bool:
    """``node`` comes before ``before``: already, or hoisted there (``_hoist``); False where it cannot."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order[node] < order[before] or _hoist(graph, node, before)


def _size_here(graph: fx.Graph, num_tokens: Any) -> Any:
    """A later chunk's token count (its combine's ``sym_size(x_chunk, 0)``) taken again at the
    insertion point: the chunks are split before the first dispatch, their sizes read just before
    each combine."""
    if isinstance(num_tokens, fx.Node) and num_tokens.target is torch.ops.aten.sym_size.int:
        return graph.call_function(torch.ops.aten.sym_size.int, num_tokens.args)
    return num_tokens


def _combines(x: Any) -> list[fx.Node] | None:
    """The ``ep_combine`` nodes whose results make ``x`` and nothing else: [x] for a layer's
    combine, its chunks' in order for a layer run in chunks (``x`` = torch.cat of them,
    ``strategies.common.emit_stages``); None when ``x`` is neither or something else reads them."""
    combine = torch.ops.hiermoe.ep_combine.default
    if not isinstance(x, fx.Node) or len(x.users) != 1:
        return None
    if x.target is combine:
        return [x]
    if x.target is torch.cat and len(x.args) == 1 and isinstance(x.args[0], (list, tuple)):
        parts = list(x.args[0])
        if parts and all(isinstance(c, fx.Node) and c.target is combine and len(c.users) == 1 for c in parts):
            return parts  # type: ignore[return-value]
    return None


def fuse_combines(gm: fx.GraphModule) -> list[int]:
    """After expert_parallel: each sample move that carries an MoE layer's output straight from its
    ``ep_combine`` (a fused cut, ``Cut.fused``) takes it out, and the layer combines to the
    samples' new ranks instead (``hiermoe::ep_combine_to`` with the move's permutation, its
    dispatch carrying the rows' origin: ``EPLayer.carry_origin``). A sample whose experts are in
    the node it moves to then gets its layer output from inside that node, not over the slow link
    to its old rank and again in the move. A layer run in chunks (its output the concatenation of
    the chunks' combines) combines every chunk to the new ranks, each into the rank's whole [T, H]
    at the chunk's rows (``ep_combine_to``'s offset), and the graph sums them; the move's plan is
    then waited for before the first chunk's combine. A combine that something else reads too keeps
    the plain combine and the move. What the move still carries (the residual stream, masks) is
    moved, with the plan that decides it, to before the layer's local expert stage: the move is a
    stage (``sample_exchange``), so ``passes.overlap`` runs the experts while it is in flight.
    Returns the runtime layers whose combines were fused."""
    graph = gm.graph
    fused: list[int] = []
    for mv in [n for n in graph.nodes if n.target is MOVE_OP]:
        xs, perm, samples, layer = mv.args
        found = {k: cs for k, x in enumerate(xs) if (cs := _combines(x)) is not None}
        # the plan must be known before the first chunk combines (unchunked: it is, at the cut)
        take = [k for k, combs in found.items()
                if not isinstance(perm, fx.Node) or _hoist_before(graph, perm, combs[0])]
        if not take:
            continue
        items = {u.args[1]: u for u in mv.users if u.target is operator.getitem}
        partial: Any = found[take[0]][0].args[0]  # ep_combine(getitem(ep_local_experts(...), 0), ...)
        local = partial.args[0]
        for k in take:
            combs = found[k]
            route: Any = combs[0].args[1]  # getitem(ep_dispatch(...), 3)
            dispatch = route.args[0]
            layer_id = int(dispatch.args[3])
            runtime.layer(layer_id).carry_origin = True
            fused.append(layer_id)
            # every chunk's offset and, last, the rank's tokens (the first chunk's count is read before
            # its combine already; the later ones' are read again here)
            offsets: list[Any] = [0, combs[0].args[2]]
            with graph.inserting_before(combs[0]):
                for c in combs[1:]:
                    offsets.append(graph.call_function(operator.add, (offsets[-1], _size_here(graph, c.args[2]))))
            outs = []
            for c, offset in zip(combs, offsets):
                partial, route, num_tokens = c.args
                with graph.inserting_before(c):
                    to = graph.call_function(torch.ops.hiermoe.ep_combine_to.default,
                                             (partial, route, perm, samples, num_tokens, offset, offsets[-1]))
                    outs.append(graph.call_function(operator.getitem, (to, 0)))
            y = outs[0]
            with graph.inserting_before(xs[k]):
                for part in outs[1:]:  # the chunks' rows are apart: their sum is the layer's output
                    y = graph.call_function(torch.add, (y, part))
            y.meta = dict(items[k].meta) if k in items else {}
            if k in items:
                items[k].replace_all_uses_with(y)
                graph.erase_node(items[k])
        keep = [k for k in range(len(xs)) if k not in take]
        mv.args = ([xs[k] for k in keep], perm, samples, layer)
        if isinstance(mv.meta.get("example_value"), list):
            mv.meta["example_value"] = [mv.meta["example_value"][k] for k in keep]
        for new, k in enumerate(keep):
            if k in items:
                items[k].args = (mv, new)
        for k in take:
            graph.erase_node(xs[k])
            if xs[k] not in found[k]:  # a concatenation: its chunks' combines too
                for c in found[k]:
                    graph.erase_node(c)
        if not keep:
            graph.erase_node(mv)
        else:  # the rest of the samples' values move while the layer's experts compute
            _hoist(graph, mv, local)
    if fused:
        graph.lint()
        gm.recompile()
    return fused


__all__ = ["bind", "fuse_combines", "register_records"]
