"""Make every rewritten MoE layer expert-parallel over a device mesh.

Contract:
    needs     the ``hiermoe::experts`` nodes that canonicalize emitted (one per layer), a mesh
              that ``moe_compile.parallel.check_mesh`` accepted, and either a topology (d* per
              step) or a fixed dimension.
    does      replaces each by ``hiermoe::ep_experts`` reading only this rank's experts: a
              ``narrow`` view of stacked [E, ...] weights (no copy), or a stack of only the local
              modules' weights for experts kept as E modules, or, for weights sharded by
              ``moe_compile.shard_experts``, this rank's ``_shard`` parameter in place of the
              full-shape placeholder input (returned in "input_swaps": the backend feeds the
              shard at that input position on every call, after Dynamo's guards have checked the
              placeholder, so autograd reaches the parameter); registers the layer's runtime state
              (placement, process groups, cost model) and passes its id to the op.
    refuses   (ValueError, at compile time, before any collective of the step) E not divisible
              by the number of ranks, a mesh on another device than the tokens, a dimension
              outside 1..D.

Pseudo-code:
    for each rewritten layer:
        Step 1: build its runtime state (moe_compile.parallel.build_layer)
        Step 2: give each weight argument its local experts: E modules -> stack the local
                ones; stacked tensor -> narrow(0, first local expert, E/G)
        Step 3: call ep_experts with the layer id, read its output, erase the old op
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

import moe_compile.lowering  # noqa: F401  (registers torch.ops.hiermoe)
from moe_compile import shard
from moe_compile.cost.topology import Topology
from moe_compile.parallel import build_layer
from moe_compile.passes.canonicalize import Rewritten
from moe_compile.passes.graph_index import tensor_meta

_WEIGHT_ARGS = range(3, 9)  # w_up, w_gate, w_down, b_up, b_gate, b_down in hiermoe::experts
# ops emit.py puts between a weight's storage and the op; all keep dim 0 (experts) in place
_VIEWS = {torch.transpose, torch.narrow, operator.getitem}


def expert_parallel_pass(gm: fx.GraphModule, rewritten: Sequence[Rewritten], *, mesh: Any,
                         topology: Topology | None, dimension: int | None, dedup: bool,
                         example_inputs: Sequence[object] = ()) -> dict[str, Any]:
    """Returns counters, under "layers" the runtime layer id of every layer by name, and under
    "input_swaps" {input position: shard parameter} for the backend to feed."""
    ids: dict[str, int] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shards = {n: s for n, ex in zip(placeholders, example_inputs) if (s := shard.lookup(ex)) is not None}
    swaps: dict[int, torch.Tensor] = {}  # graph input position -> the shard parameter fed there
    for r in rewritten:
        op, reg, name = r.op_node, r.region, r.region.name
        x_meta = tensor_meta(reg.tokens)
        assert x_meta is not None
        num_experts = reg.num_experts
        # Step 1
        lay = build_layer(name=name, mesh=mesh, topology=topology, dimension=dimension, dedup=dedup,
                          num_experts=num_experts, top_k=reg.top_k, hidden_size=reg.hidden_size,
                          ffn_size=r.layout.ffn_size, gated=r.layout.gated, dtype=getattr(torch, reg.dtype),
                          device=x_meta.device)
        first, count = lay.local_experts[0], len(lay.local_experts)
        # Step 2
        args = list(op.args)
        restacked: set[fx.Node] = set()
        with gm.graph.inserting_before(op):
            for i in _WEIGHT_ARGS:
                a = args[i]
                if not isinstance(a, fx.Node):
                    continue
                root = _root(a)
                if root in shards:  # sharded by shard_experts: this input will carry the rank's shard
                    sh = shards[root]
                    if sh.local is None or (sh.first, sh.num_local) != (first, count):
                        raise ValueError(f"layer {name}: {sh.name} was sharded for experts {sh.first}.."
                                         f"{sh.first + sh.num_local - 1} but this rank runs experts {first}.."
                                         f"{first + count - 1}; shard with the same mesh you compile with")
                    swaps[placeholders.index(root)] = sh.local
                    continue
                stack = _stack_root(a, num_experts)
                if stack is not None:
                    if stack not in restacked:
                        stack.args = (list(stack.args[0])[first:first + count], *stack.args[1:])  # type: ignore[arg-type]
                        restacked.add(stack)
                    continue
                args[i] = gm.graph.call_function(torch.narrow, (a, 0, first, count))
            # Step 3
            ep = gm.graph.call_function(torch.ops.hiermoe.ep_experts.default, (*args, lay.layer_id))
            y = gm.graph.call_function(operator.getitem, (ep, 0))
        op.replace_all_uses_with(y)
        gm.graph.erase_node(op)
        ids[name] = lay.layer_id
    for node in shards:
        if node.users and placeholders.index(node) not in swaps:
            raise ValueError(f"{shards[node].name} is sharded (moe_compile.shard_experts) but a part of the graph "
                             "that was not rewritten into the expert op reads it; see moe_compile.explain for the "
                             "layers left alone and why")
    gm.graph.lint()
    gm.recompile()
    return {"expert_parallel": len(ids), "sharded_weights": len(swaps), "layers": ids,
            "input_swaps": swaps}


def _root(n: fx.Node) -> fx.Node:
    """The storage under a chain of views."""
    while n.op == "call_function" and n.target in _VIEWS and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _stack_root(n: fx.Node, num_experts: int) -> fx.Node | None:
    """The ``torch.stack`` of per-expert module weights under a chain of views, if any."""
    n = _root(n)
    if n.op == "call_function" and n.target is torch.stack:
        items = n.args[0]
        if isinstance(items, list | tuple) and len(items) == num_experts:
            return n
    return None
