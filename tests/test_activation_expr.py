"""``expr:`` expert activations (lowering/activation.py): parsing, the op's forward and every
gradient against an independent float64 per-token loop written with the model's own formulas,
opcheck, and the Triton lowering's refusal.

Tolerances as in test_experts_op.py (fp32: 1e-5 of the output scale; the loop runs in float64):
an expression evaluated with the wrong constant, order or branch of a clamp is off by O(1).
If these fail, fix the op or the parser, not the tolerance.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_experts_op import OPCHECK_TESTS, ROUTINGS, loop_reference, make_case
from torch import Tensor

from moe_compile.lowering import activation as act_expr
from moe_compile.lowering.experts_ref import activation_error, check_activation

GPT_OSS = ("expr:mul(add(clamp(u,-7.0,7.0),1.0),mul(clamp(g,None,7.0),"
           "sigmoid(mul(clamp(g,None,7.0),1.702))))")
SOFTCAP = "expr:mul(mul(mul(tanh(div(g,4.0)),4.0),sigmoid(g)),mul(tanh(div(u,25.0)),25.0))"
RELU2 = "expr:square(relu(u))"
ONE_MINUS = "expr:mul(sub(1.0,sigmoid(g)),pow(u,3.0))"  # a number first, and pow


def _gpt_oss(g: Tensor, u: Tensor) -> Tensor:
    g = g.clamp(max=7.0)
    return (u.clamp(-7.0, 7.0) + 1) * (g * torch.sigmoid(g * 1.702))


FORMULAS: dict[str, tuple[bool, Callable[[Tensor | None, Tensor], Tensor]]] = {
    GPT_OSS: (True, lambda g, u: _gpt_oss(g, u)),  # type: ignore[arg-type]
    SOFTCAP: (True, lambda g, u: torch.tanh(g / 4) * 4 * torch.sigmoid(g) * (torch.tanh(u / 25) * 25)),  # type: ignore[operator]
    RELU2: (False, lambda g, u: torch.relu(u) ** 2),
    ONE_MINUS: (True, lambda g, u: (1 - torch.sigmoid(g)) * u**3),  # type: ignore[arg-type]
}


def test_spec_reads_back_exactly() -> None:
    for text in FORMULAS:
        assert act_expr.spec(act_expr.parse(text).tree) == text


@pytest.mark.parametrize("text, match", [
    ("expr:foo(u)", "unknown op 'foo'"),
    ("expr:mul(u", "ends early"),
    ("expr:mul(g,g)", "does not read the up projection u"),
    ("expr:clamp(u,1.0)", "clamp takes 3 arguments"),
    ("expr:relu(u)+1", "unexpected characters"),
    ("expr:relu(u) u", "text after the expression"),
    ("swish", "unknown expert activation"),
])
def test_bad_activations_are_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_activation(text)


def test_a_gate_expression_needs_a_gate() -> None:
    check_activation(RELU2, gated=False)
    with pytest.raises(ValueError, match="reads the gate g"):
        check_activation(GPT_OSS, gated=False)


# interleaved gate/up columns (GPT-OSS's layout) only where there is a gate
CASES = [(t, lay) for t, (gated, _) in FORMULAS.items() for lay in ("contiguous", "interleaved")[:1 + gated]]


@pytest.mark.parametrize("text, layout", CASES)
def test_op_matches_a_loop_of_the_formula(text: str, layout: str) -> None:
    gated, formula = FORMULAS[text]
    leaves, _, build = make_case(layout, gated, True, ROUTINGS["repeated_expert"])
    # pre-activations of +-8: GPT-OSS's clamps at 7 and the soft-caps' tanh both bend
    leaves["x"] = leaves["x"] * 8
    lv_op = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    lv_ref = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    y_op = torch.ops.hiermoe.experts(*build(lv_op), text)
    y_ref = loop_reference(build(lv_ref), formula)
    scale = max(1.0, y_ref.abs().max().item())
    assert (y_op.double() - y_ref).abs().max().item() <= 1e-5 * scale, "forward"
    grad_TH = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    names = list(leaves)
    g_op = torch.autograd.grad(y_op, [lv_op[k] for k in names], grad_TH.float())
    g_ref = torch.autograd.grad(y_ref, [lv_ref[k] for k in names], grad_TH)
    for name, a, b in zip(names, g_op, g_ref, strict=True):
        assert (a.double() - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()), f"grad of {name}"


def test_clamped_values_take_no_gradient() -> None:
    """At and beyond the clamp the gradient is torch's (inclusive bounds), not an approximation."""
    a = act_expr.parse(GPT_OSS)
    g = torch.tensor([-9.0, 6.0, 7.0, 9.0])
    u = torch.tensor([-9.0, -7.0, 7.0, 9.0])
    g_ref, u_ref = g.clone().requires_grad_(), u.clone().requires_grad_()
    d_g, d_u = torch.autograd.grad(_gpt_oss(g_ref, u_ref).sum(), (g_ref, u_ref))
    got_g, got_u = a.backward(torch.ones(4), g, u)
    assert torch.equal(got_g, d_g) and torch.equal(got_u, d_u)
    assert got_g[3] == 0 and got_u[0] == 0 and got_u[3] == 0


def test_opcheck_with_an_expression() -> None:
    leaves, _, build = make_case("interleaved", True, True, ROUTINGS["empty_experts"])
    args = build({k: v.requires_grad_() for k, v in leaves.items()})
    torch.library.opcheck(torch.ops.hiermoe.experts.default, (*args, GPT_OSS), test_utils=OPCHECK_TESTS)


def test_triton_kernels_refuse_expressions_with_the_reason() -> None:
    """The Triton kernels evaluate only the named activations in their tiles; lower_kernels keeps
    an expression layer on the torch lowering under "auto" and refuses "triton" with the reason."""
    from moe_compile.passes.lower_kernels import lower_kernels_pass

    assert activation_error("silu") is None
    assert "expression activation" in (activation_error(GPT_OSS) or "")

    def f(x: Tensor, idx: Tensor, w: Tensor, up: Tensor, gate: Tensor, down: Tensor) -> Tensor:
        return torch.ops.hiermoe.experts(x, idx, w, up, gate, down, None, None, None, GPT_OSS)

    leaves, idx, build = make_case("contiguous", True, False, ROUTINGS["random"])
    args = build(leaves)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(*[a for a in args if a is not None])
    assert lower_kernels_pass(gm, "auto") == {"triton": 0, "torch": 0, "composite": 1}
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(*[a for a in args if a is not None])  # "auto" retargeted it
    with pytest.raises(ValueError, match="expression activation"):
        lower_kernels_pass(gm, "triton")
