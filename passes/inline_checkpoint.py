"""inline_checkpoint: open activation checkpointing's regions so that the MoE layers inside them
can be found, keeping their recompute tags.

A model trained with activation checkpointing (``torch.utils.checkpoint``; transformers'
``gradient_checkpointing_enable()``, ``TrainingArguments(gradient_checkpointing=True)``) reaches
the backend as Dynamo's ``torch.ops.higher_order.tag_activation_checkpoint(wrap_body_i, *args)``
calls: each decoder layer, its MoE layer with it, is a subgraph the later passes would not see
(find_moe_regions would report "no top-k router in this graph"). AOTAutograd itself opens such a
call when it traces it (``torch._higher_order_ops.wrap.tag_activation_checkpoint_impl``): it runs
the body under a selective-checkpoint policy that tags every op ``PREFER_RECOMPUTE`` with one
``ac_graph_id`` per call, and the partitioner recomputes those ops in backward instead of saving
their outputs. This pass does the same one stage earlier: it copies each body's nodes into the
graph, tagged so (``node.meta["recompute"]``, ``["ac_graph_id"]``, which AOTAutograd copies onto
the ops it traces from them), so the graph AOTAutograd partitions is the one it would have built
from the call, and the MoE layers are in it.

Contract
    needs     a Dynamo torch-level graph (before find_moe_regions).
    does      replaces each plain ``tag_activation_checkpoint`` call (outermost first: a call
              nested in a body is opened after that body) by its body's nodes, each tagged
              ``CheckpointPolicy.PREFER_RECOMPUTE`` with a fresh ``ac_graph_id`` per call
              (``torch._higher_order_ops.wrap.uid``, the counter AOTAutograd's own tagging
              draws from), and rewires the call's ``getitem`` users to the body's outputs.
              With ``selective`` (the pipeline sets it), also a call whose
              checkpoint has a ``context_fn`` (selective activation checkpointing: its policy
              decides per op at trace time, which no static tag can stand for): its nodes are
              copied untagged, marked ``meta[SELECTIVE]`` with the call's id, and
              ``outline_selective`` closes them, with what the other passes emitted among them,
              into a call again after the rewrite.
    keeps     a selective call nested in or holding another checkpoint, and a call
              read other than through ``getitem``; when its body takes a top-k, the pipeline
              reports the reason as a layer left alone. A layer partly inside an opened selective
              call (``straddles``) is left alone too.
    guarantees the graph computes what it computed; the partitioner sees the same tags, and a
              selective checkpoint's policy is asked about the ops of the rewritten layer, about
              the expert op's matmuls as about the matmuls the layer was written with
              (``asking_as_written``: what it saved of the model's experts it saves of the
              expert op's); never about an
              exchange between ranks (the expert-parallel stages, gathers, sample moves), which
              stays outside the calls it is closed into, so backward never runs one again.

A checkpoint around a layer's experts alone (its router outside) holds no value the expert op
reads: ``tag_expert_ops`` gives the op that checkpoint (the recompute tag, or the selective mark)
after canonicalize, so it is recomputed (or under the policy) as the experts were; under expert
parallelism its local expert stage takes it instead (``mark_local_stage``).

After the other passes, ``tag_rewrites`` gives the nodes they emitted inside a checkpointed
region (the expert op, its lowering) that region's tag, so backward recomputes them from the
layer's input as it recomputes what they replaced, rather than keeping their intermediates
(the gathered rows, the routing slots). Nodes that exchange data between ranks or count into
the runtime layers (the expert-parallel stages, the gathers, sample exchanges) are not tagged:
recomputing them would send and count twice; their outputs are kept instead (the partitioner
keeps a region's untagged inputs). Before that, ``checkpoint_local_stages`` decides what each
local expert stage keeps: in a plain checkpoint nothing else (``ep_local_experts(keep=False)``:
its backward recomputes the pre-activations), in a selective one what the policy says of the
grouped matmuls of the gate and up projections (asked once per checkpoint, ``policy_saves``).

Pseudo-code::

    while a tag_activation_checkpoint call c = hop(body, *args) is left:
        if (body has a context_fn and not selective) or nested or c has a non-getitem user:
            keep c (reason); continue
        env <- body placeholders -> args;  gid <- next(uid)
        for node in body (not placeholder/output): copy before c with env;
            tag (PREFER_RECOMPUTE, gid), or for a context_fn mark SELECTIVE = sid (remember body.meta)
        replace getitem(c, i) by env[body output i]; erase c and its body

    outline_selective, after the other passes:
        emitted nodes take the one selective id of what they read (else of their users)
        exchanges (ep_*, sample_* ops and their getitems) are in no region
        for each sid, for each convex piece S of its nodes (split where a path leaves it):
            body <- S over placeholders for what S reads from outside, returning what is read
            outside; body.meta <- the original body's (context_fn); insert hop(body, *inputs)
            after S's last node, getitems for its outputs; move the outside nodes between that
            read S after them; erase S
        (the context_fn's policy, asked about an expert-op matmul, answers for the sid's
        replaced matmuls: written_matmuls / asking_as_written)
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._higher_order_ops.wrap import uid as _ac_graph_ids
from torch.utils.checkpoint import CheckpointPolicy

from moe_compile.passes.checkpoint_policy import asking_as_written, policy_saves, written_matmuls

_HOP = torch.ops.higher_order.tag_activation_checkpoint


@dataclass
class InlineResult:
    inlined: int = 0  # checkpoint calls opened
    # (call, why it stays closed) for each call left closed whose body holds a top-k
    kept: list[tuple[str, str]] = field(default_factory=list)
    # selective checkpoints opened (``selective=True``), by the id their nodes carry in
    # ``node.meta[SELECTIVE]``: what ``outline_selective`` closes them again with
    selective: dict[int, Selective] = field(default_factory=dict)

    def counters(self) -> dict[str, int]:
        return {"inlined": self.inlined, "kept": len(self.kept), "selective": len(self.selective)}


# node.meta key: the id of the opened selective checkpoint (InlineResult.selective) a node computes in
SELECTIVE = "hiermoe_selective_checkpoint"


@dataclass(frozen=True)
class Selective:
    """An opened selective checkpoint call: what closing it again needs."""

    call: str  # the call's node name (for messages)
    body_meta: dict[str, Any]  # its body's GraphModule.meta (the ``_checkpoint_context_fn``)
    kwargs: dict[str, Any]  # the call's keyword arguments (``use_reentrant``)


def _local(target: Any) -> bool:
    """Whether a hiermoe op computes on this process alone and keeps no state, so that backward
    may run it again: the expert op and its lowerings (``experts*``, ``grouped_*``), not the
    expert-parallel runtime's (``ep_*``: exchanges, counters) nor the sample exchanges
    (``sample_*``)."""
    name = target.name().split("::", 1)[1]
    return not name.startswith(("ep_", "sample_"))


def region_of(node: fx.Node) -> int | None:
    """The ``ac_graph_id`` of the opened checkpoint ``node`` computes in (backward recomputes
    it), or None."""
    return node.meta.get("ac_graph_id") if node.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE else None


def checkpoint_note(node: fx.Node, exchanged: bool = False, stage: str = "") -> str:
    """What ``explain`` adds to a rewritten layer's layout whose router top-k (or, for a checkpoint
    around the experts alone, expert op) is ``node``: whether it runs in an opened checkpoint, plain
    or selective; "" when in none. ``exchanged``: the layer runs expert parallel (what its exchanges
    received is kept, not received again); ``stage``: what ``checkpoint_local_stages`` decided for
    its local expert stage under a selective checkpoint."""
    if region_of(node) is not None:
        return ", activation-checkpointed (recomputed in backward" + ("; what its exchanges received kept)"
                                                                     if exchanged else ")")
    if SELECTIVE in node.meta:
        return (", selectively activation-checkpointed (the checkpoint's policy decides what backward recomputes"
                + (f"; not for its exchanges, kept; its local expert stage {stage or 'keeps its pre-activations'})"
                   if exchanged else ")"))
    return ""


def tag_rewrites(gm: fx.GraphModule, original: set[fx.Node]) -> int:
    """Give each node the passes emitted (not in ``original``, the graph as inline_checkpoints
    left it) the checkpoint tag of the region it computes in. A node's region is the one
    ``ac_graph_id`` of the ``PREFER_RECOMPUTE`` nodes and in-region emitted nodes it reads (none
    when it reads two regions' values, or none), followed through the exchanges: tokens an
    expert-parallel stage received are computed on in the region of the tokens it sent. Tagged
    are aten ops, Python operators on values and the local hiermoe ops (``_local``); not the
    exchanges (their outputs are kept, and a getitem of them too), nor ``ep_local_experts``,
    which counts into its runtime layer (``checkpoint_local_stages`` decides what it keeps). In
    program order, so chains carry the region along. Returns how many nodes were tagged."""
    region: dict[fx.Node, int] = {}
    tagged = 0
    for node in gm.graph.nodes:
        if (own := region_of(node)) is not None:
            region[node] = own
            continue
        if node in original or node.op != "call_function" or "recompute" in node.meta:
            continue
        ids = {region[a] for a in node.all_input_nodes if a in region}
        if len(ids) != 1:
            continue
        gid = region[node] = ids.pop()
        target = node.target
        if _exchange(node):
            continue  # an exchange (or a stage that counts) or an output of one: kept, never run again
        if getattr(target, "namespace", None) != "hiermoe" and not (
                isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
                or getattr(target, "__module__", None) in ("_operator", "operator", "torch")):
            continue
        node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        node.meta["ac_graph_id"] = gid
        tagged += 1
    # an emitted node that reads no computed value (an arange of token positions) takes the
    # region of its users, when they all are in one
    for node in reversed(gm.graph.nodes):
        if (node in original or node.op != "call_function" or "recompute" in node.meta or not node.users
                or any(a.op == "call_function" for a in node.all_input_nodes)
                or getattr(node.target, "namespace", None) == "hiermoe"):
            continue
        users = {region_of(u) for u in node.users}
        if len(users) == 1 and None not in users:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            node.meta["ac_graph_id"] = users.pop()
            tagged += 1
    return tagged


def straddles(topk: fx.Node, nodes: Iterable[fx.Node]) -> str | None:
    """Why a layer (its router's ``topk`` and ``nodes``, the nodes its interpretations read)
    cannot be rewritten for an opened selective checkpoint, or None. It can when all its nodes are
    in one or none, and when its router is outside and the rest in one (a checkpoint around the
    experts alone: ``tag_expert_ops`` puts the expert op in it; under expert parallelism its local
    stage, ``checkpoint_local_stages``). It cannot when its router is in one and other nodes are
    not (the policy would decide for the whole expert op), or when they are in two."""
    marks = {n.meta.get(SELECTIVE) for n in (topk, *nodes) if n.op in ("call_function", "call_method", "call_module")}
    if len(marks) <= 1:
        return None
    if SELECTIVE not in topk.meta and len(marks - {None}) == 1:
        return None
    return ("the layer is partly inside a selective activation checkpoint (torch.utils.checkpoint with a "
            "context_fn) and partly outside it: its policy could not be applied to the expert op as to the ops it "
            "replaces. Checkpoint the whole MoE layer, its experts alone, or none of it")


def tag_expert_ops(layers: Iterable[tuple[fx.Node, fx.Node, Iterable[fx.Node]]]) -> int:
    """For each rewritten layer (expert op, router top-k, the nodes it replaced) whose router is in
    no checkpoint but whose replaced nodes are all in one (a checkpoint around the experts alone,
    as Megatron recomputes only the MoE part): give the expert op that checkpoint, the plain one's
    recompute tag or the selective one's mark, so backward recomputes it (or the policy decides)
    as for the experts it replaced. A layer whose router is in the checkpoint needs nothing here:
    the op reads the router's values, and ``tag_rewrites`` / ``outline_selective`` give it their
    region. Under expert parallelism the op becomes stages: ``mark_local_stage`` carries what it
    was given to its local expert stage. Returns how many ops were given one."""
    given = 0
    for op, topk, nodes in layers:
        if region_of(topk) is not None or SELECTIVE in topk.meta:
            continue
        nodes = list(nodes)
        plain = {region_of(n) for n in nodes} - {None}
        selective = {n.meta.get(SELECTIVE) for n in nodes} - {None}
        if len(plain) == 1 and not selective:
            op.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            op.meta["ac_graph_id"] = plain.pop()
        elif len(selective) == 1 and not plain:
            op.meta[SELECTIVE] = selective.pop()
        else:
            continue
        given += 1
    return given


# node.meta key of an expert-parallel local expert stage (``ep_local_experts``): the layer it runs
# and the checkpoint its expert op was given (``mark_local_stage``)
LOCAL_STAGE = "hiermoe_local_stage"

def mark_local_stage(stage: fx.Node, op: fx.Node, layer: str) -> None:
    """Record on an expert-parallel local stage the layer it runs and the checkpoint ``tag_expert_ops``
    gave the expert op it replaces (a checkpoint around the experts alone)."""
    stage.meta[LOCAL_STAGE] = {"layer": layer, "ac_graph_id": region_of(op), "selective": op.meta.get(SELECTIVE)}


def checkpoint_local_stages(gm: fx.GraphModule, original: set[fx.Node], regions: dict[int, Selective]
                            ) -> dict[str, str]:
    """Decide what each expert-parallel local expert stage keeps for backward in a checkpointed
    layer. The stage counts into its runtime layer, so no checkpoint runs it again; its checkpoint
    is the one ``mark_local_stage`` recorded (the experts alone checkpointed) or else the one of the
    tokens and routing it computes on (followed back through the exchanges and what the passes
    emitted to the original nodes). Plain: it keeps nothing (``keep=False``: its backward
    recomputes the pre-activations from the rows it received, as backward recomputes the
    checkpointed layer). Selective: it keeps them where the checkpoint's policy saves the gate and
    up projections' grouped matmuls (``policy_saves``), and where the policy cannot be asked.
    Returns per layer what a selective one's stage does (``checkpoint_note``'s ``stage``)."""
    notes: dict[str, str] = {}
    answers: dict[int, bool | str] = {}
    for node in gm.graph.nodes:
        mark = node.meta.get(LOCAL_STAGE)
        if mark is None:
            continue
        plain, selective = _source_checkpoints(node, original)
        if mark["ac_graph_id"] is not None or mark["selective"] is not None:
            plain, selective = {mark["ac_graph_id"]} - {None}, {mark["selective"]} - {None}
        if len(plain) + len(selective) != 1:
            continue
        if plain:
            node.update_kwarg("keep", False)
            continue
        sid = selective.pop()
        if sid not in answers:
            answers[sid] = policy_saves(regions[sid].body_meta.get("_checkpoint_context_fn"),
                                        written_matmuls(_replaced(original, sid)))
        saves = answers[sid]
        node.update_kwarg("keep", saves is not False)
        notes[mark["layer"]] = ("recomputes its pre-activations (the policy recomputes the grouped matmuls)"
                                if saves is False else
                                "keeps its pre-activations (the policy saves the grouped matmuls)" if saves is True else
                                f"keeps its pre-activations (the policy could not be asked: {saves})")
    return notes


def _source_checkpoints(node: fx.Node, original: set[fx.Node]) -> tuple[set[int], set[int]]:
    """(plain ac_graph_ids, selective ids) of the original nodes ``node`` reads, followed back
    through the nodes the passes emitted (the exchanges among them)."""
    plain: set[int] = set()
    selective: set[int] = set()
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if (gid := region_of(a)) is not None:
            plain.add(gid)
        elif SELECTIVE in a.meta and a in original:
            selective.add(a.meta[SELECTIVE])
        elif a not in original:
            stack.extend(a.all_input_nodes)
    return plain, selective


def _exchange(node: fx.Node) -> bool:
    """Whether ``node`` is (or reads an output of) an op that exchanges data between ranks or
    counts into a runtime layer (``_local`` is False: the expert-parallel stages, gathers, sample
    exchanges): no checkpoint may run it again in backward."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _exchange(node.args[0])
    return getattr(node.target, "namespace", None) == "hiermoe" and not _local(node.target)


def outline_selective(gm: fx.GraphModule, original: set[fx.Node], regions: dict[int, Selective]) -> int:
    """Close each opened selective checkpoint (``regions``, its nodes marked ``meta[SELECTIVE]``)
    into ``tag_activation_checkpoint`` calls again, with what the other passes emitted in it,
    each body keeping the original body's ``_checkpoint_context_fn``: AOTAutograd then runs the
    rewritten layer under the user's policy, which decides per op (the expert op's grouped
    matmuls among them) what backward recomputes, as for the ops they replaced.

    An emitted node (not in ``original``) is in the region of the marked and emitted nodes it
    reads, when they are all in one; one that reads none takes its users' region, when they are
    all in one. Exchanges (``_exchange``) are never in a region: backward must not run them again,
    whatever the policy says. So a region with exchanges in it (expert parallelism) closes into
    one call per piece between them: a piece is the region's nodes that reach each other without
    passing through a node outside the region (``_pieces``), which makes every call's inputs
    computable before it and its outputs read after it. A call's outputs are its values read
    outside it (``getitem``), its inputs what it reads from outside. Returns how many calls were
    made."""
    made = 0
    for node in gm.graph.nodes:
        if _exchange(node):  # an exchange that copied a replaced node's meta is in no region
            node.meta.pop(SELECTIVE, None)
    for node in gm.graph.nodes:  # emitted nodes: the region of what they read
        if (node in original or node.op not in ("call_function", "call_method") or SELECTIVE in node.meta
                or _exchange(node)):
            continue
        ids = {a.meta[SELECTIVE] for a in node.all_input_nodes if SELECTIVE in a.meta}
        if len(ids) == 1:
            node.meta[SELECTIVE] = ids.pop()
    for node in reversed(gm.graph.nodes):  # emitted nodes that read no value computed in one: their users'
        if (node in original or node.op not in ("call_function", "call_method") or SELECTIVE in node.meta
                or _exchange(node)):
            continue
        ids = {u.meta.get(SELECTIVE) for u in node.users}
        if len(ids) == 1 and None not in ids and not any(SELECTIVE in a.meta for a in node.all_input_nodes):
            node.meta[SELECTIVE] = ids.pop()
    for sid, sel in regions.items():
        written = written_matmuls(_replaced(original, sid))
        if written and "_checkpoint_context_fn" in sel.body_meta:
            meta = {**sel.body_meta, "_checkpoint_context_fn": asking_as_written(sel.body_meta["_checkpoint_context_fn"],
                                                                                 written)}
            sel = Selective(sel.call, meta, sel.kwargs)
        for piece in _pieces(gm, sid):
            made += _outline(gm, piece, sel)
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _replaced(original: set[fx.Node], sid: int) -> list[fx.Node]:
    """The nodes of opened selective checkpoint ``sid`` that the rewrite erased (what the expert op
    replaced)."""
    return [n for n in original if n.meta.get(SELECTIVE) == sid and getattr(n, "_erased", False)]


def _pieces(gm: fx.GraphModule, sid: int) -> list[list[fx.Node]]:
    """Region ``sid``'s nodes in convex pieces, in graph order: a node's generation is the most
    nodes outside the region on a path to it from the region's nodes; a piece is one generation's
    nodes. A path that leaves the region and comes back (through an exchange) raises the
    generation, so no piece reads a value that depends on the same piece through the outside."""
    gen: dict[fx.Node, int] = {}  # region nodes and the outside nodes that depend on one
    for node in gm.graph.nodes:
        inside = node.meta.get(SELECTIVE) == sid
        before = [gen[a] for a in node.all_input_nodes if a in gen]
        if inside:
            gen[node] = max(before, default=0)
        elif before:
            gen[node] = max(before) + 1
    pieces: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.meta.get(SELECTIVE) == sid:
            pieces.setdefault(gen[node], []).append(node)
    return [pieces[g] for g in sorted(pieces)]


def _outline(gm: fx.GraphModule, members: list[fx.Node], sel: Selective) -> bool:
    """Close ``members`` (one convex piece) into a checkpoint call; False (left as they are) where
    nothing outside reads them: a call without outputs has nothing to checkpoint."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}  # an earlier piece's call moved some nodes
    members = sorted(members, key=order.__getitem__)
    inside = set(members)
    inputs: list[fx.Node] = []
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    if not outputs:
        return False
    # the piece is convex (_pieces): no value outside it both reads from it and feeds it
    nodes = list(graph.nodes)
    first, last = nodes.index(members[0]), nodes.index(members[-1])
    after: list[fx.Node] = []  # nodes between its first and last node that read from it
    tainted = set(inside)
    for n in nodes[first:last + 1]:
        if n in inside:
            if any(a in tainted and a not in inside for a in n.all_input_nodes):
                raise AssertionError(f"selective checkpoint {sel.call}: a value outside it both reads from it "
                                     f"and feeds {n.name}; it cannot be closed again")
        elif any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
            after.append(n)
    body_graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body_graph.placeholder(a.name)
        if "example_value" in a.meta:
            env[a].meta["example_value"] = a.meta["example_value"]
    for n in members:
        if n.op == "get_attr":  # a constant the body reads: carried into the body module
            value = _attr(gm, str(n.target))
            name = str(n.target).replace(".", "_")
            if isinstance(value, torch.nn.Module):
                root.add_module(name, value)
            else:
                setattr(root, name, value)
            env[n] = body_graph.get_attr(name)
            env[n].meta = {k: v for k, v in n.meta.items() if k != SELECTIVE}
            continue
        env[n] = body_graph.node_copy(n, lambda a: env[a])
        env[n].meta.pop(SELECTIVE, None)
    body_graph.output(tuple(env[o] for o in outputs))
    body = fx.GraphModule(root, body_graph)
    body.meta.update(sel.body_meta)
    name = _fresh_attr(gm, "hiermoe_selective_body")
    gm.register_module(name, body)
    with graph.inserting_after(members[-1]):
        ref = graph.get_attr(name)
    with graph.inserting_after(ref):
        call = graph.call_function(_HOP, (ref, *inputs), dict(sel.kwargs))
    call.meta["example_value"] = tuple(o.meta.get("example_value") for o in outputs)
    anchor = call
    items = []
    for i, o in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = {k: v for k, v in o.meta.items() if k != SELECTIVE}
        items.append(item)
        anchor = item
    for n in after:  # what reads the region's values now comes after the call
        anchor.append(n)
        anchor = n
    for o, item in zip(outputs, items, strict=True):
        o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for n in reversed(members):
        graph.erase_node(n)
    return True


def _body(gm: fx.GraphModule, call: fx.Node) -> fx.GraphModule:
    ref = call.args[0]
    assert isinstance(ref, fx.Node) and ref.op == "get_attr", f"{call.name}: its body is not a submodule"
    body = gm.get_submodule(str(ref.target))
    assert isinstance(body, fx.GraphModule)
    return body


def _why_kept(gm: fx.GraphModule, call: fx.Node, selective: bool) -> str | None:
    body = _body(gm, call)
    if "_checkpoint_context_fn" in body.meta:
        if not selective:
            return ("torch.utils.checkpoint with a context_fn (selective activation checkpointing): opened only "
                    "with inline_checkpoints(selective=True), whose caller closes it again (outline_selective)")
        if any(m is not body and isinstance(m, fx.GraphModule) for m in body.modules()) \
                or "recompute" in call.meta or SELECTIVE in call.meta:
            return ("a selective activation checkpoint (torch.utils.checkpoint with a context_fn) nested in "
                    "another checkpoint, or holding one: hiermoe opens a selective one only on its own; the MoE "
                    "layers inside it are not rewritten")
    if any(u.op != "call_function" or u.target is not operator.getitem or not isinstance(u.args[1], int)
           for u in call.users):
        return "the activation-checkpointed call's result is read other than by indexing its outputs"
    return None


def _inline(gm: fx.GraphModule, call: fx.Node, selective_id: int | None = None) -> None:
    """Copy ``call``'s body into ``gm`` in its place: its nodes tagged PREFER_RECOMPUTE with a fresh
    ``ac_graph_id``, or (``selective_id``) marked ``meta[SELECTIVE] = selective_id`` and untagged
    (the policy decides once ``outline_selective`` has closed them into a call again)."""
    body = _body(gm, call)
    graph = gm.graph
    operands = list(call.args[1:])
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(operands), \
        f"{call.name}: its body takes {len(placeholders)} inputs, the call passes {len(operands)}"
    env: dict[fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    gid = next(_ac_graph_ids)
    outputs: Any = None
    with graph.inserting_before(call):
        for bn in body.graph.nodes:
            if bn.op == "placeholder":
                continue
            if bn.op == "output":
                outputs = fx.map_arg(bn.args[0], lambda a: env[a])
                continue
            if bn.op == "get_attr":  # a constant or a nested body: carried over under a fresh name
                name = _fresh_attr(gm, f"{call.name}_{str(bn.target).replace('.', '_')}")
                value = _attr(body, str(bn.target))
                if isinstance(value, torch.nn.Module):
                    gm.register_module(name, value)
                else:
                    setattr(gm, name, value)
                new = graph.get_attr(name)
                new.meta = dict(bn.meta)
            else:
                new = graph.node_copy(bn, lambda a: env[a])
                if selective_id is None:
                    new.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                    new.meta["ac_graph_id"] = gid
            if selective_id is not None:
                new.meta[SELECTIVE] = selective_id
            env[bn] = new
    outs = outputs if isinstance(outputs, list | tuple) else (outputs,)
    for user in list(call.users):
        user.replace_all_uses_with(outs[user.args[1]])  # type: ignore[index]
        graph.erase_node(user)
    ref = call.args[0]
    graph.erase_node(call)
    assert isinstance(ref, fx.Node)
    if not ref.users:
        graph.erase_node(ref)
        # Dynamo may install one body for several identical calls: drop it with its last reader
        if not any(n.op == "get_attr" and n.target == ref.target for n in graph.nodes):
            gm.delete_submodule(str(ref.target))


def _routes(body: fx.GraphModule) -> bool:
    """Whether a body (or one nested in it) takes a top-k: it may hold an MoE layer."""
    return any(n.target in (torch.topk, "topk") for m in body.modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes)


def _attr(mod: torch.nn.Module, target: str) -> Any:
    obj: Any = mod
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def inline_checkpoints(gm: fx.GraphModule, selective: bool = False) -> InlineResult:
    """Open every plain activation-checkpoint call of ``gm`` in place (see the module docstring);
    ``selective``: also each selective one (a body with a ``_checkpoint_context_fn``) not nested in
    or holding another checkpoint, its nodes marked for ``outline_selective``."""
    res = InlineResult()
    kept: set[fx.Node] = set()
    while True:
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _HOP and n not in kept]
        if not calls:
            break
        for call in calls:
            why = _why_kept(gm, call, selective)
            if why is not None:
                kept.add(call)
                if _routes(_body(gm, call)):
                    res.kept.append((call.name, why))
                continue
            body = _body(gm, call)
            if "_checkpoint_context_fn" in body.meta:
                sid = len(res.selective)
                res.selective[sid] = Selective(call.name, dict(body.meta), dict(call.kwargs))
                _inline(gm, call, selective_id=sid)
            else:
                _inline(gm, call)
            res.inlined += 1
    if res.inlined:
        gm.graph.lint()
        gm.recompile()
    return res
