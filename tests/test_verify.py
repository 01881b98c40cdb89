"""passes/verify.py's gradient comparisons: a routing weight's gradient, a dot product <g_t, y_tk> that
can cancel by chance, is judged at the size of its terms, so rounding in bf16 passes where the sum
nearly vanished, and a gradient that is wrong by the size of the terms still fails; boundary values
that are one tensor in two shapes are compared summed, and only reshapes count as one tensor; a 16-bit
gradient that two roundings put on different sides of a ReLU's kink is judged against fp32."""

from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.passes.verify import _merge_aliases, _passes, _rel_err, _weights_grad_scale, alias_pairs


def _cancelling(hidden: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's cotangent g and expert output y (fp32) whose dot product is about 1 % of its terms'
    size: y's last entry set to cancel all but that share."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(1, hidden, generator=gen)
    y = torch.randn(1, hidden, generator=gen)
    terms = (g * y).norm()
    y[0, -1] = (0.01 * terms - (g[0, :-1] * y[0, :-1]).sum()) / g[0, -1]
    return g, y


def test_a_cancelled_weight_gradient_is_judged_at_its_terms() -> None:
    g, y = _cancelling()
    w = torch.ones(1, 1)  # top-1 weight renormalized: exactly 1
    exact = (g.double() * y.double()).sum(-1, keepdim=True)  # the op's, accumulated wide
    rounded = (g.double() * y.bfloat16().double()).sum(-1, keepdim=True)  # eager's, y rounded to bf16
    floor = _weights_grad_scale(g, y, w)
    assert abs(floor - float((g.double() * y.double()).norm())) < 1e-9 * floor
    # relative to itself the sum's rounding is far beyond bf16's tolerance; at its terms it is within
    assert not _passes(_rel_err(exact, rounded), exact, rounded, torch.bfloat16)
    assert _passes(_rel_err(exact, rounded, floor), exact, rounded, torch.bfloat16)
    # wrong by a tenth of the terms' size (another expert's output, a missed factor): still refused
    for wrong in (exact + 0.1 * floor, exact - 0.1 * floor, 2 * exact + 0.1 * floor):
        assert not _passes(_rel_err(wrong, rounded, floor), wrong, rounded, torch.bfloat16)


def test_the_floor_reads_each_expert_output_through_the_weights() -> None:
    """y_t = sum_k w_tk y_tk: the floor is |g_t * y_t| / sum_k |w_tk|, the max over tokens; a token
    whose weights are all 0 gives nothing; shapes that do not match give 0."""
    g = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 5.0]])
    y = torch.tensor([[2.0, 1.0], [4.0, 1.0], [9.0, 9.0]])
    w = torch.tensor([[0.5, 0.5], [2.0, 2.0], [0.0, 0.0]])
    scale = _weights_grad_scale(g, y, w)
    expected = max(float(torch.tensor([2.0, 2.0]).norm()) / 1.0, float(torch.tensor([12.0, 0.0]).norm()) / 4.0)
    assert abs(scale - expected) < 1e-12
    assert _weights_grad_scale(g, y[:2], w) == 0.0
    assert _weights_grad_scale(g, y, torch.zeros(3, 2)) == 0.0


def test_reshapes_of_one_tensor_are_one_value_and_a_transpose_is_not() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    other = g.placeholder("other")
    flat = g.call_method("reshape", (x, -1, 4))
    unsq = g.call_method("unsqueeze", (flat, 1))
    trans = g.call_method("transpose", (flat, 0, 1))
    part = g.call_function(torch.narrow, (flat, 0, 0, 1))
    t = torch.randn(2, 4)
    nodes = [flat, unsq, trans, part, other]
    values: list[object] = [t, t.unsqueeze(1), t.t(), t[:1], t.clone()]
    assert alias_pairs(nodes, values) == [(1, 0)]  # not the transpose, the slice, another tensor
    # their gradients are summed at the first form, the second not compared apart
    g_o: list[torch.Tensor | None] = [torch.ones(2, 4), torch.full((2, 1, 4), 2.0)]
    g_n: list[torch.Tensor | None] = [None, torch.full((2, 1, 4), 3.0)]  # the op read only the second
    compared = _merge_aliases([(1, 0)], g_o, g_n, [True, True], [torch.Size((2, 4)), torch.Size((2, 1, 4))])
    assert compared == [True, False] and g_o[1] is None and g_n[1] is None
    assert torch.equal(g_o[0], torch.full((2, 4), 3.0)) and torch.equal(g_n[0], torch.full((2, 4), 3.0))


def _double_rounded(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.relu((x @ w.t()) + b),)  # a model's einsum, rounded to bf16, then its bias


def _single_rounded(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.relu(torch.nn.functional.linear(x, w, b)),)  # nn.Linear's: rounded once


def _bias_dropped(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.relu(torch.nn.functional.linear(x, w, 0.5 * b)),)  # a wrong interpretation


def test_a_16_bit_gradient_at_a_kink_is_judged_against_fp32() -> None:
    """A bf16 ReLU layer whose model adds its bias after a rounded product, against a
    replacement that rounds once (nn.Linear's way): where a pre-activation sits within that
    rounding of 0, the two take different sides and that unit's gradient flips, beyond bf16's
    tolerance. Verification then runs the original in fp32: the single rounding is the nearer, so
    it passes; halving the bias, far from the fp32 answer, still fails."""
    from moe_compile.passes.verify import _compare_backward, _gradients

    for seed in range(200):  # a batch where the two roundings put some unit on different sides
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 64, generator=gen).bfloat16()
        w = (torch.randn(512, 64, generator=gen) / 8).bfloat16()
        b = torch.randn(512, generator=gen).bfloat16()
        if not torch.equal(_double_rounded(x, w, b)[0] > 0, _single_rounded(x, w, b)[0] > 0):
            break
    else:
        raise AssertionError("no seed put a unit on different sides of the kink")
    original, single, wrong = (fx.symbolic_trace(f) for f in (_double_rounded, _single_rounded, _bias_dropped))
    args = ([x, w, b], [False, True, True], [False, False, False], torch.bfloat16)
    # the plain comparison misses bf16's tolerance: the flipped unit
    g_o, g_n, *_ = _gradients(original, single, *args[:3], (), ())
    assert g_o is not None
    assert any(not _passes(_rel_err(a, o), a, o, torch.bfloat16) for a, o in zip(g_n, g_o, strict=True)
               if a is not None and o is not None)
    assert _compare_backward(original, single, *args)[1]
    assert not _compare_backward(original, wrong, *args)[1]
