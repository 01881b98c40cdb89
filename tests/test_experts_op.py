"""Tests of the expert op ``hiermoe::experts`` (torch reference lowering) against an independent
per-token loop: forward and every gradient, over activations, biases, weight layouts and
degenerate routings; opcheck of both ops; torch.compile (aot_eager, inductor) vs eager.

Shape legend: T tokens, K experts per token, E experts, H hidden, F ffn;
x_TH, topk_idx_TK, topk_weights_TK, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF,
b_down_EH, gate_up_E2FH (fused gate+up weight as some checkpoints store it).

Tolerances. The loop reference runs in float64, so the difference measures only the op's own
rounding. fp32: max abs diff <= 1e-5 * max(1, max |reference|); the op does at most three chained
fp32 matmuls over H, F <= 16 plus a K-term sum, whose rounding is ~1e-6 relative, so 1e-5 leaves
room for summation order without hiding a wrong index or a missing term (those give O(1) errors).
bf16 / fp16: every matmul output and activation is rounded to 8 / 11 mantissa bits (as in the
model itself), over three chained matmuls and a K-term sum: 6e-2 / 6e-3 of the output scale.
Measured on these cases the op is off by <= 4.5e-2 / 2.6e-3, and a per-token loop run in bf16 /
fp16 (the eager model's own error) by about the same, so the bound is not hiding anything.
If these fail, fix the op, not the tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

from moe_compile.lowering import (  # registers hiermoe::*
    ACTIVATIONS,
    experts_flops,
    experts_ref,
    experts_reference,
)

E, H, FF = 4, 8, 16  # H, F multiples of 4 fp32 elements: the grouped_mm path on CPU
TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 6e-3}

_ACT: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": lambda z: z * torch.sigmoid(z),
    "gelu": lambda z: 0.5 * z * (1 + torch.erf(z / 2**0.5)),
    "gelu_tanh": lambda z: 0.5 * z * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (z + 0.044715 * z**3))),
    "relu": lambda z: torch.clamp(z, min=0),
    "sigmoid": torch.sigmoid,
    "identity": lambda z: z,
}


def loop_reference(args: list[Any], activation: str | Callable[[Tensor | None, Tensor], Tensor]) -> Tensor:
    """for t, for k: w * FFN_e(x_t), written without sorting, grouping or scatter; ``activation`` a
    named one, or h(gate, up) itself (gate None when the experts are not gated)."""
    x_TH, topk_idx_TK, topk_weights_TK, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH = args
    if isinstance(activation, str):
        act = _ACT[activation]

        def h_of(gate: Tensor | None, up: Tensor) -> Tensor:
            return act(up) if gate is None else act(gate) * up
    else:
        h_of = activation
    rows = []
    for t in range(x_TH.shape[0]):
        acc_H = torch.zeros_like(x_TH[t])
        for k in range(topk_idx_TK.shape[1]):
            e = int(topk_idx_TK[t, k])
            up = w_up_EFH[e] @ x_TH[t] + (b_up_EF[e] if b_up_EF is not None else 0)
            gate = None
            if w_gate_EFH is not None:
                gate = w_gate_EFH[e] @ x_TH[t] + (b_gate_EF[e] if b_gate_EF is not None else 0)
            y = w_down_EHF[e] @ h_of(gate, up) + (b_down_EH[e] if b_down_EH is not None else 0)
            acc_H = acc_H + topk_weights_TK[t, k] * y
        rows.append(acc_H)
    return torch.stack(rows)


# A case is (leaves, topk_idx, build): leaves are what requires grad, build(leaves) makes the
# op's tensor arguments from them (views, slices, transposes), so grads land on the real storage.
Build = Callable[[dict[str, Tensor]], list[Any]]  # the op's 9 tensor args, optional ones may be None


def make_case(
    layout: str, gated: bool, bias: bool, topk_idx_TK: Tensor, dtype: torch.dtype = torch.float32,
    num_h: int = H, num_f: int = FF, num_e: int = E,
) -> tuple[dict[str, Tensor], Tensor, Build]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    num_t = topk_idx_TK.shape[0]
    leaves = {
        "x": rnd(num_t, num_h),
        "tw": torch.rand(topk_idx_TK.shape, generator=g) + 0.1,  # routing weights stay fp32
        "b_up": rnd(num_e, num_f, scale=0.1), "b_gate": rnd(num_e, num_f, scale=0.1),
        "b_down": rnd(num_e, num_h, scale=0.1),
    }
    s_h, s_f = num_h**-0.5, num_f**-0.5
    if layout == "contiguous":
        leaves |= {"w_up": rnd(num_e, num_f, num_h, scale=s_h), "w_gate": rnd(num_e, num_f, num_h, scale=s_h),
                   "w_down": rnd(num_e, num_h, num_f, scale=s_f)}
    elif layout == "transposed":  # stored [E, in, out], viewed in nn.Linear layout by .mT
        leaves |= {"w_up": rnd(num_e, num_h, num_f, scale=s_h), "w_gate": rnd(num_e, num_h, num_f, scale=s_h),
                   "w_down": rnd(num_e, num_f, num_h, scale=s_f)}
    else:  # one fused gate_up [E, 2F, H], split in halves ("fused") or by alternating rows
        leaves |= {"gate_up": rnd(num_e, 2 * num_f, num_h, scale=s_h),
                   "w_down": rnd(num_e, num_h, num_f, scale=s_f)}
    halves = (slice(0, num_f), slice(num_f, None))
    gate_sl, up_sl = {"fused": halves, "fused_up_first": halves[::-1]}.get(layout, (slice(0, None, 2), slice(1, None, 2)))
    if not gated:
        leaves.pop("w_gate", None)
        leaves.pop("b_gate")
    if not bias:
        for name in ("b_up", "b_gate", "b_down"):
            leaves.pop(name, None)

    def weights(lv: dict[str, Tensor]) -> tuple[Tensor, Tensor | None, Tensor]:
        if layout == "contiguous":
            return lv["w_up"], lv.get("w_gate"), lv["w_down"]
        if layout == "transposed":
            w_gate = lv.get("w_gate")
            return lv["w_up"].mT, None if w_gate is None else w_gate.mT, lv["w_down"].mT
        return lv["gate_up"][:, up_sl], lv["gate_up"][:, gate_sl] if gated else None, lv["w_down"]

    def build(lv: dict[str, Tensor]) -> list[Any]:
        w_up, w_gate, w_down = weights(lv)
        return [lv["x"], topk_idx_TK, lv["tw"], w_up, w_gate, w_down,
                lv.get("b_up"), lv.get("b_gate"), lv.get("b_down")]

    return leaves, topk_idx_TK, build


def random_routing(num_t: int, num_k: int, num_e: int = E, seed: int = 1) -> Tensor:
    scores = torch.rand(num_t, num_e, generator=torch.Generator().manual_seed(seed))
    return scores.topk(num_k, dim=-1).indices


ROUTINGS = {
    "random": random_routing(6, 2),
    "all_one_expert": torch.full((5, 1), 2),
    "repeated_expert": torch.tensor([[1, 1], [0, 3], [3, 3]]),
    "k_eq_e": random_routing(3, E),
    "t1": torch.tensor([[3, 0]]),
    "empty_experts": torch.tensor([[0, 3], [3, 0], [0, 3], [3, 0]]),
    "int32_idx": random_routing(5, 2).to(torch.int32),
}


def check_against_loop(
    leaves: dict[str, Tensor], build: Build, activation: str, dtype: torch.dtype = torch.float32,
    op: str = "experts", build_op: Build | None = None,
    formula: Callable[[Tensor | None, Tensor], Tensor] | None = None,
) -> None:
    """``op``: the opaque ``experts`` (its own backward) or ``experts_composite`` (autograd's);
    ``build_op``: the op's arguments where they differ from the loop's (``build``); ``formula``:
    the loop's h(gate, up) for an ``expr:`` activation."""
    lv_op = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    lv_ref = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    y_op = getattr(torch.ops.hiermoe, op)(*(build_op or build)(lv_op), activation)
    y_ref = loop_reference(build(lv_ref), formula or activation)
    # the result is in promote(x, topk_weights): fp32 routing weights give an fp32 sum of bf16 experts
    assert y_op.dtype == torch.promote_types(dtype, leaves["tw"].dtype) and y_op.shape == y_ref.shape
    tol = TOL[dtype]
    scale = max(1.0, y_ref.abs().max().item())
    assert (y_op.double() - y_ref).abs().max().item() <= tol * scale, "forward"

    grad_TH = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    names = list(leaves)
    g_op = torch.autograd.grad(y_op, [lv_op[k] for k in names], grad_TH.to(y_op.dtype))
    # the loop never touches an expert no token chose: its gradient is zero, not absent
    g_ref = torch.autograd.grad(y_ref, [lv_ref[k] for k in names], grad_TH, materialize_grads=True)
    for name, a, b in zip(names, g_op, g_ref, strict=True):
        assert a.dtype == leaves[name].dtype and a.shape == b.shape, name
        scale = max(1.0, b.abs().max().item())
        assert (a.double() - b).abs().max().item() <= tol * scale, f"grad of {name}"


@pytest.fixture(params=["grouped_mm", "loop"])
def matmul_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "loop":  # no dtype qualifies for grouped_mm: every matmul takes the loop
        monkeypatch.setattr(experts_ref, "_GROUPED_MM_DTYPES", {})
    return request.param


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_activations(activation: str, gated: bool, bias: bool) -> None:
    leaves, _, build = make_case("contiguous", gated, bias, ROUTINGS["random"])
    check_against_loop(leaves, build, activation)


@pytest.mark.parametrize("layout", ["transposed", "fused", "interleaved"])
@pytest.mark.parametrize("gated", [True, False])
def test_noncontiguous_weights(layout: str, gated: bool, matmul_path: str) -> None:
    leaves, _, build = make_case(layout, gated, True, ROUTINGS["random"])
    check_against_loop(leaves, build, "silu")


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_routings(routing: str, matmul_path: str) -> None:
    leaves, _, build = make_case("fused", True, True, ROUTINGS[routing])
    check_against_loop(leaves, build, "gelu")


def test_unaligned_dims_take_the_loop() -> None:
    # H=6, F=10 fp32 rows are not 16-byte multiples: grouped_mm refuses them, the loop must run.
    leaves, _, build = make_case("contiguous", True, True, ROUTINGS["random"], num_h=6, num_f=10)
    x, _, _, w_up, w_gate, w_down, *_ = build(leaves)
    assert not experts_ref._use_grouped_mm(x, w_up, w_gate, w_down)
    check_against_loop(leaves, build, "relu")


def test_ops_compute_in_their_inputs_dtype_under_autocast() -> None:
    """A custom op's kernel runs with its caller's autocast state: before, the per-expert loop's
    fp32 matmuls inside hiermoe::experts (and its backward) were cast to bf16 under an ambient
    torch.autocast. Every hiermoe op now leaves autocast (the passes cast its inputs to the dtype
    the layer computes in): fp32 inputs give the fp32 results, forward and backward, bit for bit."""
    leaves, _, build = make_case("contiguous", True, True, ROUTINGS["random"], num_h=6, num_f=10)
    results = []
    for autocast in (False, True):
        inputs = {k: t.detach().clone().requires_grad_() for k, t in leaves.items()}
        args = build(inputs)
        assert not experts_ref._use_grouped_mm(args[0], *args[3:6])  # the loop: aten matmuls inside
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = torch.ops.hiermoe.experts(*args, "silu")
            grads = torch.autograd.grad(y, list(inputs.values()), torch.ones_like(y))
        assert y.dtype == torch.float32
        results.append((y, grads))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y0, y1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_grouped_mm_path_is_taken() -> None:
    # Guards the test matrix: without this the "grouped_mm" cases could silently test the loop.
    for layout in ("contiguous", "transposed", "fused", "interleaved"):
        leaves, _, build = make_case(layout, True, True, ROUTINGS["random"])
        x, _, _, w_up, w_gate, w_down, *_ = build(leaves)
        assert experts_ref._use_grouped_mm(x, w_up, w_gate, w_down), layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype, matmul_path: str) -> None:
    leaves, _, build = make_case("fused", True, True, ROUTINGS["repeated_expert"], dtype=dtype)
    check_against_loop(leaves, build, "silu", dtype=dtype)


# -- hiermoe::experts_composite: the same function as aten ops a compiler traces (lower_kernels) --

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gated", [True, False])
def test_composite_activations(activation: str, gated: bool) -> None:
    leaves, _, build = make_case("contiguous", gated, True, ROUTINGS["random"])
    check_against_loop(leaves, build, activation, op="experts_composite")


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("layout", ["transposed", "fused", "interleaved"])
def test_composite_routings_and_layouts(routing: str, layout: str) -> None:
    leaves, _, build = make_case(layout, True, layout != "transposed", ROUTINGS[routing])
    check_against_loop(leaves, build, "gelu", op="experts_composite")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_composite_low_precision(dtype: torch.dtype) -> None:
    leaves, _, build = make_case("fused", True, True, ROUTINGS["repeated_expert"], dtype=dtype)
    check_against_loop(leaves, build, "silu", dtype=dtype, op="experts_composite")


GATE_UP_ORDERS = {"fused": "gate_first", "fused_up_first": "up_first", "interleaved": "interleaved"}


@pytest.mark.parametrize("layout", list(GATE_UP_ORDERS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("routing", ["random", "repeated_expert", "t1", "empty_experts"])
def test_composite_gate_up_matches_loop(layout: str, bias: bool, routing: str) -> None:
    """``experts_composite_gate_up`` (gate and up as one stored [E, 2F, H] tensor, one matmul for
    both): forward and every gradient against the float64 loop over the two views, in each of the
    three orders, with per-expert biases (the weighting then stays after the down projection)
    and without (it moves before it)."""
    leaves, _, build = make_case(layout, True, bias, ROUTINGS[routing])

    def build_op(lv: dict[str, Tensor]) -> list[Any]:
        args = build(lv)
        return [*args[:3], lv["gate_up"], GATE_UP_ORDERS[layout], *args[5:]]

    check_against_loop(leaves, build, "silu", op="experts_composite_gate_up", build_op=build_op)
    from test_activation_expr import FORMULAS, GPT_OSS  # clamped SwiGLU with its (up + 1) term

    leaves["x"] = leaves["x"] * 8  # pre-activations of +-8: the clamps at 7 bend
    check_against_loop(leaves, build, GPT_OSS, op="experts_composite_gate_up", build_op=build_op,
                       formula=FORMULAS[GPT_OSS][1])


def test_composite_gate_up_low_precision() -> None:
    leaves, _, build = make_case("fused", True, False, ROUTINGS["repeated_expert"], dtype=torch.bfloat16)

    def build_op(lv: dict[str, Tensor]) -> list[Any]:
        args = build(lv)
        return [*args[:3], lv["gate_up"], "gate_first", *args[5:]]

    check_against_loop(leaves, build, "silu", dtype=torch.bfloat16, op="experts_composite_gate_up",
                       build_op=build_op)


def test_composite_runs_where_grouped_mm_does() -> None:
    """``grouped_mm_ok`` (strides, offsets and dtype only, so it can judge fake values) says yes
    exactly where the opaque op's own check (which reads the data pointer) takes grouped_mm."""
    from moe_compile.lowering import grouped_mm_ok

    for layout in ("contiguous", "transposed", "fused", "interleaved"):
        for dims in ((H, FF), (6, 10)):
            leaves, _, build = make_case(layout, True, True, ROUTINGS["random"], num_h=dims[0], num_f=dims[1])
            x, _, _, w_up, w_gate, w_down, *_ = build(leaves)
            assert grouped_mm_ok(x, w_up, w_gate, w_down) == experts_ref._use_grouped_mm(x, w_up, w_gate, w_down)
    x64 = torch.zeros(3, H, dtype=torch.float64)
    w = torch.zeros(E, FF, H, dtype=torch.float64)
    assert not grouped_mm_ok(x64, w, w, torch.zeros(E, H, FF, dtype=torch.float64))  # no grouped_mm kernel


def test_opcheck_grouped_mm() -> None:
    """The grouped matmul the composite traces: its fake (torch's own meta refuses fp32) and its
    autograd, on blocks with an empty expert."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, H, generator=g, requires_grad=True)
    b = torch.randn(E, H, FF, generator=g, requires_grad=True)
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)
    torch.library.opcheck(torch.ops.hiermoe.grouped_mm.default, (a, b, offs), test_utils=OPCHECK_TESTS)
    ga = torch.randn(7, FF, generator=g)
    torch.library.opcheck(torch.ops.hiermoe.grouped_mm_wgrad.default, (a.detach(), ga, offs),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _as_modules(leaves: dict[str, Tensor], build: Build) -> tuple[dict[str, Tensor], Build]:
    """The same case with every expert's weight its own leaf (experts stored as E modules): build
    gives the weights as lists of E tensors, which ``experts_composite_list`` takes and
    ``loop_reference`` indexes alike."""
    names = [n for n in ("w_up", "w_gate", "w_down") if n in leaves]
    per = {k: v for k, v in leaves.items() if k not in names}
    per |= {f"{n}.{e}": leaves[n][e].clone() for n in names for e in range(leaves[n].shape[0])}

    def build_lists(lv: dict[str, Tensor]) -> list[Any]:
        args = build({k: v for k, v in lv.items() if "." not in k} | {n: leaves[n] for n in names})
        for i, n in ((3, "w_up"), (4, "w_gate"), (5, "w_down")):
            args[i] = [lv[f"{n}.{e}"] for e in range(E)] if n in names else None
        return args

    return per, build_lists


@pytest.mark.parametrize("routing", ["random", "repeated_expert", "t1", "empty_experts", "int32_idx"])
@pytest.mark.parametrize(("gated", "bias"), [(True, False), (True, True), (False, True)])
def test_composite_list_matches_loop(routing: str, gated: bool, bias: bool) -> None:
    """``experts_composite_list`` (weights as E separate tensors, ``grouped_linear``): forward and
    every gradient against the float64 loop, empty experts included."""
    leaves, _, build = make_case("contiguous", gated, bias, ROUTINGS[routing])
    per, build_lists = _as_modules(leaves, build)
    check_against_loop(per, build_lists, "silu" if gated else "gelu", op="experts_composite_list")


def test_composite_weight_grads_keep_the_weights_layout() -> None:
    """Each weight's gradient comes out with the weight's own strides, so AccumulateGrad keeps it as
    ``.grad`` (no copy): separate row-major [O, I] tensors for E modules, and for a stacked
    nn.Linear-layout [E, O, I] weight a contiguous [E, O, I] (grouped_mm computes g^T a for it)."""
    leaves, _, build = make_case("contiguous", True, False, ROUTINGS["random"])
    per, build_lists = _as_modules(leaves, build)
    for op, lv, bld in (("experts_composite", leaves, build), ("experts_composite_list", per, build_lists)):
        lv = {k: v.detach().clone().requires_grad_() for k, v in lv.items()}
        getattr(torch.ops.hiermoe, op)(*bld(lv), "silu").square().sum().backward()
        for name, leaf in lv.items():
            if name.startswith("w_"):
                assert leaf.grad is not None and leaf.grad.is_contiguous(), (op, name, leaf.grad)


def test_opcheck_grouped_linear() -> None:
    """The list form of the grouped matmul (E separate weights), both orientations, and its
    weight gradient: fake kernels, schema and autograd, on blocks with an empty expert."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, H, generator=g, requires_grad=True)
    w_oi = [torch.randn(FF, H, generator=g, requires_grad=True) for _ in range(E)]
    w_io = [torch.randn(H, FF, generator=g, requires_grad=True) for _ in range(E)]
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)
    for w, transpose in ((w_oi, True), (w_io, False)):
        torch.library.opcheck(torch.ops.hiermoe.grouped_linear.default, (a, w, offs, transpose, None),
                              test_utils=OPCHECK_TESTS)
        y = torch.ops.hiermoe.grouped_linear(a, w, offs, transpose, None)
        blocks = [(0, 2), (2, 2), (2, 5), (5, 7)]
        ref = torch.cat([a[s:t] @ (w[e].t() if transpose else w[e]) for e, (s, t) in enumerate(blocks)])
        torch.testing.assert_close(y, ref)
    # with per-expert biases (nn.Linear's [O, I] weights): added inside each block's addmm
    b = torch.randn(E, FF, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.hiermoe.grouped_linear.default, (a, w_oi, offs, True, b), test_utils=OPCHECK_TESTS)
    y = torch.ops.hiermoe.grouped_linear(a, w_oi, offs, True, b)
    ref = torch.cat([torch.nn.functional.linear(a[s:t], w_oi[e], b[e]) for e, (s, t) in enumerate(blocks)])
    torch.testing.assert_close(y, ref)
    cot = torch.randn(7, FF, generator=g)
    for got, want in zip(torch.autograd.grad((y * cot).sum(), [a, *w_oi, b]),
                         torch.autograd.grad((ref * cot).sum(), [a, *w_oi, b]), strict=True):
        torch.testing.assert_close(got, want)  # the empty expert's bias gradient 0 on both sides
    ga = torch.randn(7, FF, generator=g)
    torch.library.opcheck(torch.ops.hiermoe.grouped_linear_wgrad.default, (ga, a.detach(), offs),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    dw = torch.ops.hiermoe.grouped_linear_wgrad(ga, a.detach(), offs)
    assert torch.equal(dw[1], torch.zeros(FF, H))  # the empty expert
    torch.testing.assert_close(dw[2], ga[2:5].t() @ a.detach()[2:5])


@pytest.mark.parametrize("layout", ["EIO", "EOI.mT"])
def test_opcheck_grouped_mm_rows(layout: str) -> None:
    """The grouped matmul of gathered token rows (gathered again in its backward): fake kernel,
    schema and autograd, values and gradients against indexing and matmuls written out, on blocks
    with an empty expert and a token taken twice, with the weight as [E, I, O] and as the
    transpose of an nn.Linear-layout [E, O, I] (its gradient then in that layout)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=g, requires_grad=True)
    rows = torch.tensor([0, 3, 1, 1, 4, 2, 0])
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)
    stored = torch.randn(E, H, FF, generator=g) if layout == "EIO" else torch.randn(E, FF, H, generator=g)
    stored.requires_grad_()
    w = stored if layout == "EIO" else stored.mT
    torch.library.opcheck(torch.ops.hiermoe.grouped_mm_rows.default, (x, rows, w, offs), test_utils=OPCHECK_TESTS)
    y = torch.ops.hiermoe.grouped_mm_rows(x, rows, w, offs)
    blocks = [(0, 2), (2, 2), (2, 5), (5, 7)]
    ref = torch.cat([x[rows[s:t]] @ w[e] for e, (s, t) in enumerate(blocks)])
    torch.testing.assert_close(y, ref)
    cot = torch.randn(7, FF, generator=g)
    got = torch.autograd.grad((y * cot).sum(), [x, stored])
    want = torch.autograd.grad((ref * cot).sum(), [x, stored])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert got[1].stride() == stored.stride()  # the gradient in the parameter's own layout


@pytest.mark.parametrize("op", ["experts_composite", "experts_composite_gate_up"])
def test_composite_keeps_no_gathered_rows(op: str) -> None:
    """The composite forms keep the tokens and the routing for the backward, never the [T*K, H]
    copy of the tokens gathered in expert order (the matmuls regather it): nothing saved for
    the backward has T*K rows and H columns, and the gradients still equal the loop's."""
    leaves, _, build = make_case("fused", True, True, ROUTINGS["random"])

    def build_op(lv: dict[str, Tensor]) -> list[Any]:
        args = build(lv)
        return [*args[:3], lv["gate_up"], "gate_first", *args[5:]] if op.endswith("gate_up") else args

    lv = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        getattr(torch.ops.hiermoe, op)(*build_op(lv), "silu")
    num_n, num_h = ROUTINGS["random"].numel(), leaves["x"].shape[1]
    assert saved and (num_n, num_h) not in saved, saved
    check_against_loop(leaves, build, "silu", op=op, build_op=build_op)


def test_opcheck_grouped_linear_gate_up() -> None:
    """E modules' gate and up projections of gathered token rows in one op (its rows gathered
    again in the backward): fake kernels, schema and autograd, and the values against indexing
    and matmuls written out, on blocks with an empty expert and a token taken twice."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=g, requires_grad=True)
    rows = torch.tensor([0, 3, 1, 1, 4, 2, 0])
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)
    w_g = [torch.randn(FF, H, generator=g, requires_grad=True) for _ in range(E)]
    w_u = [torch.randn(FF, H, generator=g, requires_grad=True) for _ in range(E)]
    torch.library.opcheck(torch.ops.hiermoe.grouped_linear_gate_up.default, (x, rows, w_g, w_u, offs, None, None),
                          test_utils=OPCHECK_TESTS)
    gate, up = torch.ops.hiermoe.grouped_linear_gate_up(x, rows, w_g, w_u, offs, None, None)
    blocks = [(0, 2), (2, 2), (2, 5), (5, 7)]
    ref_g = torch.cat([x[rows[s:t]] @ w_g[e].t() for e, (s, t) in enumerate(blocks)])
    ref_u = torch.cat([x[rows[s:t]] @ w_u[e].t() for e, (s, t) in enumerate(blocks)])
    torch.testing.assert_close(gate, ref_g)
    torch.testing.assert_close(up, ref_u)
    leaves = [x, *w_g, *w_u]
    cot = torch.randn(7, FF, generator=g), torch.randn(7, FF, generator=g)
    got = torch.autograd.grad((gate * cot[0]).sum() + (up * cot[1]).sum(), leaves)
    want = torch.autograd.grad((ref_g * cot[0]).sum() + (ref_u * cot[1]).sum(), leaves, materialize_grads=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    # with biases, inside each block's addmm
    b_g, b_u = torch.randn(E, FF, generator=g, requires_grad=True), torch.randn(E, FF, generator=g, requires_grad=True)
    args = (x, rows, w_g, w_u, offs, b_g, b_u)
    torch.library.opcheck(torch.ops.hiermoe.grouped_linear_gate_up.default, args, test_utils=OPCHECK_TESTS)
    gate, up = torch.ops.hiermoe.grouped_linear_gate_up(*args)
    ref_g = torch.cat([torch.nn.functional.linear(x[rows[s:t]], w_g[e], b_g[e]) for e, (s, t) in enumerate(blocks)])
    ref_u = torch.cat([torch.nn.functional.linear(x[rows[s:t]], w_u[e], b_u[e]) for e, (s, t) in enumerate(blocks)])
    torch.testing.assert_close(gate, ref_g)
    torch.testing.assert_close(up, ref_u)
    leaves = [x, *w_g, *w_u, b_g, b_u]
    got = torch.autograd.grad((gate * cot[0]).sum() + (up * cot[1]).sum(), leaves)
    want = torch.autograd.grad((ref_g * cot[0]).sum() + (ref_u * cot[1]).sum(), leaves, materialize_grads=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("storage", ["modules", "stacked"])
def test_a_16_bit_bias_rounds_as_the_layer_rounds_it(storage: str) -> None:
    """On the CPU, a bf16 expert projection with a bias equals the layer's bit for bit in both
    forms: where the layer adds it inside its matmul (``nn.Linear``; the op's ``once``, from the
    ``BIAS_IN_MATMUL`` suffix) rounded once with the product, where it adds it to the product
    (``x @ w + b``) rounded twice. The two differ in a third of the entries, and the fuzz found a
    ReLU unit at its kink that took the other side: a layer refused on one token."""
    from moe_compile.lowering.experts_ref import _linear, _route

    g = torch.Generator().manual_seed(0)
    num_t, k = 64, 2
    a = torch.randn(num_t, H, generator=g).bfloat16()
    w = torch.randn(E, FF, H, generator=g).bfloat16()
    b = torch.randn(E, FF, generator=g).bfloat16()
    idx = torch.randint(0, E, (num_t, k), generator=g)
    r = _route(idx, E, grouped=True)
    rows = a.index_select(0, r.tok_N)
    weights = list(w.unbind(0)) if storage == "modules" else w
    ends = r.offs_E.tolist()
    blocks = list(zip([0, *ends[:-1]], ends, strict=True))
    once = torch.cat([torch.nn.functional.linear(rows[s:t], w[e], b[e]) for e, (s, t) in enumerate(blocks)])
    twice = torch.cat([torch.nn.functional.linear(rows[s:t], w[e]) + b[e] for e, (s, t) in enumerate(blocks)])
    assert (twice != once).float().mean() > 0.1  # the two forms are told apart
    assert torch.equal(_linear(rows, weights, b, r, True), once)
    assert torch.equal(_linear(rows, weights, b, r, False), twice)


def test_reference_matches_op_and_rejects_unknown_activation() -> None:
    leaves, _, build = make_case("contiguous", True, False, ROUTINGS["random"])
    args = build(leaves)
    assert torch.equal(experts_reference(*args, "silu"), torch.ops.hiermoe.experts(*args, "silu"))
    with pytest.raises(ValueError, match="unknown expert activation"):
        experts_reference(*args, "swish")


def test_flops() -> None:
    assert experts_flops(T=3, K=2, H=8, F=16, gated=True) == 3 * 2 * (3 * 2 * 8 * 16)
    assert experts_flops(T=3, K=2, H=8, F=16, gated=False) == 2 * 2 * (3 * 2 * 8 * 16)


def test_double_backward_raises() -> None:
    leaves, _, build = make_case("contiguous", False, False, ROUTINGS["t1"])
    lv = {k: v.requires_grad_() for k, v in leaves.items()}
    y = torch.ops.hiermoe.experts(*build(lv), "silu")
    (g,) = torch.autograd.grad(y.sum(), lv["x"], create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def _opcheck_samples(requires_grad: bool) -> list[list[Any]]:
    samples = []
    for layout, gated, bias, routing, dims in [
        ("fused", True, True, "random", (H, FF)),
        ("interleaved", True, False, "empty_experts", (H, FF)),
        ("contiguous", False, True, "int32_idx", (6, 10)),  # loop path
    ]:
        leaves, _, build = make_case(layout, gated, bias, ROUTINGS[routing], num_h=dims[0], num_f=dims[1])
        samples.append(build({k: v.requires_grad_(requires_grad) for k, v in leaves.items()}))
    return samples


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_experts() -> None:
    for args in _opcheck_samples(requires_grad=True):
        torch.library.opcheck(torch.ops.hiermoe.experts.default, (*args, "gelu_tanh"), test_utils=OPCHECK_TESTS)


def test_opcheck_experts_backward() -> None:
    for args in _opcheck_samples(requires_grad=False):
        grad_TH = torch.randn_like(args[0])
        torch.library.opcheck(
            torch.ops.hiermoe.experts_backward.default, (grad_TH, *args, "sigmoid"), test_utils=OPCHECK_TESTS
        )


class TinyMoE(torch.nn.Module):
    """Router + fused gate_up experts calling the op directly, as the canonicalize pass emits it."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.router = torch.nn.Linear(H, E, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * FF, H, generator=g) * H**-0.5)
        self.w_down = torch.nn.Parameter(torch.randn(E, H, FF, generator=g) * FF**-0.5)
        self.b_down = torch.nn.Parameter(torch.randn(E, H, generator=g) * 0.1)

    def forward(self, x_TH: Tensor) -> Tensor:
        probs_TE = self.router(x_TH).softmax(-1)
        topk_weights_TK, topk_idx_TK = probs_TE.topk(2, dim=-1)
        y_TH = torch.ops.hiermoe.experts(
            x_TH, topk_idx_TK, topk_weights_TK, self.gate_up[:, FF:], self.gate_up[:, :FF], self.w_down,
            None, None, self.b_down, "silu",
        )
        return (y_TH.sin() * x_TH).sum()


def _train_grads(model: torch.nn.Module, fn: Callable[[Tensor], Tensor], x_TH: Tensor) -> list[Tensor]:
    x_TH = x_TH.clone().requires_grad_()
    loss = fn(x_TH)
    return [loss.detach(), *torch.autograd.grad(loss, [x_TH, *model.parameters()])]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_train_step_matches_eager(backend: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    model = TinyMoE()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=backend == "aot_eager")
    # Two token counts: with dynamic=True the second reuses the graph with a symbolic T.
    for num_t in (7, 5) if backend == "aot_eager" else (7,):
        x_TH = torch.randn(num_t, H, generator=torch.Generator().manual_seed(num_t))
        for a, b in zip(_train_grads(model, compiled, x_TH), _train_grads(model, model, x_TH), strict=True):
            # Same op kernels on both sides; only the surrounding pointwise ops may be fused
            # differently by inductor, hence the fp32 tolerance rather than equality.
            assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    assert counters["stats"]["unique_graphs"] == 1  # fake kernels handled the symbolic T
