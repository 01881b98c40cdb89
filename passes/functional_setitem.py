"""functional_setitem: an accumulator written by indexed assignment becomes a chain of values.

mistral-inference's MoeLayer, and much code written after it, sums its experts into a buffer by
indexed assignment::

    results = torch.zeros_like(inputs)
    for i, expert in enumerate(self.experts):
        batch_idx, nth_expert = torch.where(selected_experts == i)
        results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])

Dynamo records each ``+=`` as ``operator.setitem(results, batch_idx, results[batch_idx] + v)``:
an update that returns nothing, so no node of the graph holds the routed sum, and
find_moe_regions found no layer ("no value after the top-k combines expert outputs"). This pass
rewrites each such assignment into the functional ``torch.index_put(results_i, (batch_idx,),
value)`` and points every later
read of the buffer at the newest value: the same computation, now with the sum as the last value
of the chain, which find_moe_regions reads as the layer's output (and its earlier values as parts
of it, ``find_moe_regions._running_sum_part``).

Contract
    needs     a Dynamo torch-level graph (before find_moe_regions).
    does      for a tensor the graph makes itself (not an input, a parameter or a view of one)
              whose only writes are ``operator.setitem`` with tensor indices (integer tensors of
              at least one dimension, or masks) and a tensor value, and that nothing views (reads
              by such indices copy), replaces the writes by ``torch.index_put`` values in program
              order and rewires each read to the value current at it.
    keeps     any other buffer: one written by slices or numbers, mutated otherwise, viewed, or
              one the graph received (an input's update must stay an update of the input).
    guarantees the graph computes what it computed; index_put with ``accumulate=False`` is what
              assignment is, repeated indices included (one of the written values lands).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes.graph_index import example_value, is_inplace, is_view


def functionalize_setitems(gm: fx.GraphModule) -> int:
    """Rewrite the graph's indexed-assignment accumulators (module docstring); returns how many.
    Runs on every graph the backend gets: it reads only each assignment's buffer and its users."""
    done = 0
    # in program order (the new nodes' names the same on every rank)
    for buf in dict.fromkeys(n.args[0] for n in gm.graph.nodes if _is_setitem(n) and isinstance(n.args[0], fx.Node)):
        writes = [u for u in buf.users if _is_setitem(u) and u.args[0] is buf]
        if not _own_tensor(buf) or not all(_functional(w) for w in writes):
            continue
        # what reads the buffer: a copying read holds its own tensor (an in-place op on it, the
        # ``+=`` of ``buf[idx] += v``, changes that copy); any other view, or any other update of
        # the buffer, would see or make changes a chain of values does not
        if any(u not in writes and ((is_view(u) and not _copying_read(u)) or (is_inplace(u) and u.args[0] is buf))
               for u in buf.users):
            continue
        current = buf
        # in the graph's order as it is now (fx nodes compare by position): an earlier buffer's
        # rewrite may have added readers of this one (``a[idx] = b`` becomes ``index_put(a, idx, b)``)
        for u in sorted(buf.users):
            if u in writes:
                current = _index_put(gm.graph, current, u)
                gm.graph.erase_node(u)
            else:
                u.replace_input_with(buf, current)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _is_setitem(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.setitem


def _own_tensor(n: fx.Node) -> bool:
    """A tensor the graph computes itself, not a view or an update of another value (the nodes
    ``GraphIndex`` gives another alias root)."""
    return (n.op in ("call_function", "call_method") and isinstance(example_value(n), torch.Tensor)
            and not ((is_view(n) or is_inplace(n)) and n.args and isinstance(n.args[0], fx.Node)))


def _tensor_indices(idx: object) -> tuple[fx.Node, ...] | None:
    """The index of an assignment as index_put's tensors: one tensor or a tuple of them, each an
    integer tensor of at least one dimension (a 0-d one indexes as a number: a view) or a mask."""
    items = idx if isinstance(idx, tuple) else (idx,)
    out = []
    for i in items:
        v = example_value(i) if isinstance(i, fx.Node) else None
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.is_floating_point() or v.is_complex():
            return None
        out.append(i)
    return tuple(out)  # type: ignore[arg-type]


def _functional(w: fx.Node) -> bool:
    return (len(w.args) == 3 and not w.kwargs and _tensor_indices(w.args[1]) is not None
            and isinstance(w.args[2], fx.Node) and isinstance(example_value(w.args[2]), torch.Tensor))


def _copying_read(n: fx.Node) -> bool:
    """A read of the buffer that copies (``buf[tensor_index]``), so it holds the value current at
    it; any other view would see later writes."""
    return n.op == "call_function" and n.target is operator.getitem and _tensor_indices(n.args[1]) is not None


def _index_put(graph: fx.Graph, current: fx.Node, w: fx.Node) -> fx.Node:
    """``torch.index_put(current, indices, value)`` in place of assignment ``w`` (by tensor indices
    it takes the value in the buffer's dtype only, as index_put does)."""
    buf_value = example_value(current)
    assert isinstance(buf_value, torch.Tensor)
    with graph.inserting_before(w):
        new = graph.call_function(torch.index_put, (current, _tensor_indices(w.args[1]), w.args[2]))
    new.meta.update({k: v for k, v in w.meta.items() if k != "example_value"})
    with _mode(buf_value):
        new.meta["example_value"] = torch.empty_like(buf_value)
    return new


def _mode(fake: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The fake mode a Dynamo example value belongs to (a no-op context for a real tensor)."""
    mode = getattr(fake, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()
