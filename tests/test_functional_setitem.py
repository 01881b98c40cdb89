"""passes/functional_setitem.py: an accumulator written by indexed assignment as a chain of values,
so the layer mistral-inference's MoeLayer writes (``results[batch_idx] += ...``) is found."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from compile_utils import compare_compiled, op_count
from torch import nn

from moe_compile.passes.functional_setitem import functionalize_setitems


class FeedForward(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False), nn.Linear(h, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoeLayer(nn.Module):
    """mistral-inference's MoeLayer (mistral_inference/moe.py), as written there."""

    def __init__(self, h: int = 16, f: int = 24, e: int = 4, k: int = 2) -> None:
        super().__init__()
        self.experts = nn.ModuleList(FeedForward(h, f) for _ in range(e))
        self.gate = nn.Linear(h, e, bias=False)
        self.k = k

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


def test_mistral_inference_moe_layer_is_rewritten_and_equals_eager() -> None:
    """Its ``+=`` by index was an update returning nothing: no node held the routed sum, and the
    layer was left alone ("no value after the top-k combines expert outputs")."""
    torch.manual_seed(0)
    c = compare_compiled(MoeLayer(), [torch.randn(12, 16)])
    assert op_count(c.report) == 1, [s.reason for g in c.report.graphs for s in g.skipped]
    assert c.out_err <= 1e-5 and max(c.grad_errs.values()) <= 1e-5, c


def _graph(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.fx.GraphModule:
    """Dynamo's graph of ``fn`` (with the example values the pass reads)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, ex: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def _setitems(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is operator.setitem for n in gm.graph.nodes)


def _accumulate(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    other = torch.ones_like(x)  # made first, so rewritten first: its index_put then reads buf
    buf = torch.zeros_like(x)
    before = buf[idx].sum()  # read before the first write: the zeros
    buf[idx] += v
    middle = buf[idx] * 2  # between the writes: the first one's value
    other[idx] = buf  # one chained buffer written into another: read as it is here
    buf[idx[:2]] = v[:2] * 3.0  # an assignment, not an update
    buf[idx == idx] += 1.0 * v  # a boolean mask
    return buf + before + middle.sum() + other


def test_assignments_become_index_put_values_and_compute_the_same() -> None:
    """Repeated indices included: ``index_put`` without accumulation is what assignment is."""
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    for idx in (torch.tensor([4, 0, 2, 1, 3, 5]), torch.tensor([1, 1, 3, 0, 1, 2])):
        gm = _graph(_accumulate, x, idx, v)
        want = gm(x, idx, v)[0]
        assert _setitems(gm) == 4 and functionalize_setitems(gm) == 2 and _setitems(gm) == 0
        assert sum(n.target is torch.index_put for n in gm.graph.nodes) == 4
        torch.testing.assert_close(gm(x, idx, v)[0], want, rtol=0, atol=0)
        torch.testing.assert_close(want, _accumulate(x, idx, v), rtol=0, atol=0)


def _into_input(buf: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    buf[idx] += v  # the caller's tensor: its update must stay an update
    return buf.sum()


def _by_slice(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(x)
    buf[1:3] = v[:2]
    buf[idx] += v
    return buf


def _viewed(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(x)
    head = buf[:2]  # a view: it sees the write below
    buf[idx] += v
    return head * 1.0


def test_buffers_it_cannot_chain_are_left_as_written() -> None:
    g = torch.Generator().manual_seed(0)
    x, v, idx = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), torch.tensor([4, 0, 2, 1, 3, 5])
    for fn in (_into_input, _by_slice, _viewed):
        gm = _graph(fn, x.clone(), idx, v)
        before = _setitems(gm)
        assert before >= 1 and functionalize_setitems(gm) == 0 and _setitems(gm) == before, fn.__name__
    # and the one left as written still computes the update of the caller's tensor
    buf = x.clone()
    gm = _graph(_into_input, x.clone(), idx, v)
    functionalize_setitems(gm)
    gm(buf, idx, v)
    torch.testing.assert_close(buf, x + v[torch.argsort(idx)], rtol=0, atol=0)
