"""Tests of the HEXA-MoE Triton kernels behind ``hiermoe::experts_triton`` and of the
``lower_kernels`` pass: re-index vector (Alg. 1), ESMM forward, ESMM/ESTMM/ESS and fused ESFK
backward, against the torch lowering of ``hiermoe::experts`` and an independent per-token loop.

Where they run. On CPU the kernels run in the Triton interpreter, which needs TRITON_INTERPRET=1
before triton is first imported. This module sets it when it is the first to import torch/triton
in the process and no GPU is present (``pytest tests/test_triton_kernels.py``). In a process that
imported triton earlier (a full ``pytest`` run imports moe_compile from other modules first), the
interpreter tests skip here and ``test_interpreter_tests_in_fresh_process`` runs this file again
in a new process with the variable set. GPU tests (bf16, large offsets, Inductor) skip without
CUDA. Interpreter shapes stay small (T <= 40, H, F <= 40): the interpreter runs every program in
Python.

Tolerances, as max |a - b| / max(1, max |b|):
  vs the float64 per-token loop (the kernels' own rounding): fp32 1e-5 (three chained fp32
  matmuls over H, F <= 40 and a K-term sum round at ~1e-6; a wrong index or a missing term is
  O(1)); fp16 4e-3 and bf16 3e-2: h and the slot gradients are stored in the 16-bit dtype once
  (unit roundoff 4.9e-4 / 3.9e-3) and go through one more matmul; measured <= 5e-4 / 1.3e-2.
  vs the torch op in the same dtype: the sum of both ops' errors, fp32 1e-5, fp16 6e-3, bf16 6e-2
  (the torch op also rounds every matmul output, see tests/test_experts_op.py).
If these fail, fix the kernels, not the tolerance.

Shape legend: T tokens, K experts per token, N = T*K slots, E experts, H hidden, F ffn; x_TH,
topk_idx_TK, topk_weights_TK, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sys

if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
    import torch  # importing torch does not import triton

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from compile_utils import compare_compiled  # noqa: E402
from test_experts_op import loop_reference  # noqa: E402  (the per-token loop reference, shared)
from torch import Tensor  # noqa: E402
from torch._subclasses import FakeTensorMode  # noqa: E402

import moe_compile.lowering as lowering  # noqa: E402
from moe_compile.lowering.experts_ref import experts_reference_backward  # noqa: E402
from moe_compile.passes.lower_kernels import lower_kernels_pass  # noqa: E402
from moe_compile.samples import SAMPLES, example_input  # noqa: E402

if lowering.HAS_TRITON:
    from moe_compile.lowering import triton_esfk, triton_esmm, triton_experts, triton_reindex

    INTERPRETED = triton_experts.INTERPRETED
else:
    INTERPRETED = False
CUDA = torch.cuda.is_available()

needs_triton = pytest.mark.skipif(not lowering.HAS_TRITON, reason="the triton package is not installed")
interp = pytest.mark.skipif(
    not INTERPRETED, reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import); "
    "test_interpreter_tests_in_fresh_process runs it")
gpu = pytest.mark.skipif(not CUDA or INTERPRETED or not lowering.HAS_TRITON, reason="needs CUDA and compiled Triton")

TOL_LOOP = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
TOL_OP = {torch.float32: 1e-5, torch.float16: 6e-3, torch.bfloat16: 6e-2}
T, K, E, H, F = 37, 2, 6, 40, 24  # N = 74 slots: not a multiple of BLK; H, F not multiples of the tiles

def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


def routing(kind: str, num_t: int = T, num_k: int = K, num_e: int = E, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.rand(num_t, num_e, generator=g).topk(num_k, dim=-1).indices
    if kind == "one_expert":  # every slot on expert 3
        return torch.full((num_t, num_k), 3)
    if kind == "empty_experts":  # only experts 0 and E-1 get tokens
        return torch.randint(0, 2, (num_t, num_k), generator=g) * (num_e - 1)
    if kind == "repeated":  # a token may pick the same expert twice; each slot counts
        return torch.randint(0, 2, (num_t, num_k), generator=g)
    raise AssertionError(kind)


Build = Callable[[dict[str, Tensor]], list[Any]]


def make_case(gated: bool, bias: bool, dtype: torch.dtype, layout: str = "contiguous", route: str = "random",
              num_h: int = H, num_f: int = F, num_e: int = E, num_t: int = T) -> tuple[dict[str, Tensor], Build]:
    """Leaves (what requires grad) and build(leaves) -> the op's 9 tensor args (views of the
    leaves for the transposed / fused / interleaved layouts, so weights are read in place)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    lv = {"x": rnd(num_t, num_h), "tw": torch.rand(num_t, K, generator=g) + 0.1,
          "b_up": rnd(num_e, num_f, scale=0.1), "b_gate": rnd(num_e, num_f, scale=0.1),
          "b_down": rnd(num_e, num_h, scale=0.1), "w_down": rnd(num_e, num_h, num_f, scale=num_f**-0.5)}
    if layout == "contiguous":
        lv |= {"w_up": rnd(num_e, num_f, num_h, scale=num_h**-0.5), "w_gate": rnd(num_e, num_f, num_h, scale=num_h**-0.5)}
    elif layout == "transposed":  # stored [E, in, out] as some checkpoints do
        lv |= {"w_up": rnd(num_e, num_h, num_f, scale=num_h**-0.5), "w_gate": rnd(num_e, num_h, num_f, scale=num_h**-0.5),
               "w_down": rnd(num_e, num_f, num_h, scale=num_f**-0.5)}
    else:  # one gate_up [E, 2F, H]
        lv["gate_up"] = rnd(num_e, 2 * num_f, num_h, scale=num_h**-0.5)
    if not gated:
        lv.pop("w_gate", None)
        lv.pop("b_gate")
    if not bias:
        for name in ("b_up", "b_gate", "b_down"):
            lv.pop(name, None)

    def build(v: dict[str, Tensor]) -> list[Any]:
        if layout == "contiguous":
            w_up, w_gate, w_down = v["w_up"], v.get("w_gate"), v["w_down"]
        elif layout == "transposed":
            w_up, w_down = v["w_up"].mT, v["w_down"].mT
            w_gate = v["w_gate"].mT if gated else None
        else:
            gate_sl, up_sl = ((slice(0, num_f), slice(num_f, None)) if layout == "fused"
                              else (slice(0, None, 2), slice(1, None, 2)))  # interleaved rows: stride 2H
            w_up, w_down = v["gate_up"][:, up_sl], v["w_down"]
            w_gate = v["gate_up"][:, gate_sl] if gated else None
        return [v["x"], idx_TK, v["tw"], w_up, w_gate, w_down, v.get("b_up"), v.get("b_gate"), v.get("b_down")]

    idx_TK = routing(route, num_t, num_e=num_e)
    return lv, build


def check_op(gated: bool, bias: bool, activation: str, dtype: torch.dtype, route: str = "random",
             layout: str = "contiguous") -> None:
    """experts_triton (forward + autograd) vs the float64 loop and vs hiermoe::experts."""
    lv, build = make_case(gated, bias, dtype, layout, route)
    names = list(lv)
    runs = {}
    for op in ("experts_triton", "experts"):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in lv.items()}
        y = getattr(torch.ops.hiermoe, op)(*build(leaves), activation)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        runs[op] = (y, torch.autograd.grad(y, [leaves[k] for k in names], cot.to(y.dtype)))
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in lv.items()}
    y_ref = loop_reference(build(ref_leaves), activation)
    g_ref = torch.autograd.grad(y_ref, [ref_leaves[k] for k in names], cot.double())
    y, grads = runs["experts_triton"]
    assert y.dtype == torch.promote_types(dtype, lv["tw"].dtype) and y.shape == y_ref.shape
    assert rel_err(y, y_ref) <= TOL_LOOP[dtype], f"forward vs loop: {rel_err(y, y_ref):.2e}"
    assert rel_err(y, runs["experts"][0]) <= TOL_OP[dtype], "forward vs hiermoe::experts"
    for name, a, b, c in zip(names, grads, g_ref, runs["experts"][1], strict=True):
        assert a.dtype == lv[name].dtype and a.shape == b.shape, name
        assert rel_err(a, b) <= TOL_LOOP[dtype], f"grad of {name} vs loop: {rel_err(a, b):.2e}"
        assert rel_err(a, c) <= TOL_OP[dtype], f"grad of {name} vs hiermoe::experts: {rel_err(a, c):.2e}"


# ---- re-index vector (HEXA-MoE Alg. 1) ---------------------------------------------------------

@interp
@pytest.mark.parametrize(("route", "num_e", "chunk"), [
    ("random", 6, 16),  # 5 chunks: positions carried across chunks
    ("empty_experts", 6, 16),
    ("one_expert", 6, 128),
    ("random", 80, 32),  # E > 64: experts in two E_BLOCK tiles
])
def test_reindex_groups_slots_by_expert_with_minimal_padding(route: str, num_e: int, chunk: int) -> None:
    idx_TK = routing(route, num_e=num_e)
    blk = 16
    r = triton_reindex.build_reindex(idx_TK, num_e, blk, chunk=chunk)
    flat = idx_TK.reshape(-1)
    counts = torch.bincount(flat, minlength=num_e)
    starts = r.starts_E1.long()
    assert starts[0] == 0 and torch.equal(starts[1:] - starts[:-1], (counts + blk - 1) // blk * blk)
    padding = starts[1:] - starts[:-1] - counts
    assert padding.max() <= blk - 1 and padding.min() >= 0  # HEXA-MoE: padded only up to BLK
    used = int(starts[-1])
    assert used <= flat.numel() + num_e * (blk - 1) and r.v_P.numel() >= used
    for e in range(num_e):
        seg = r.v_P[starts[e]:starts[e + 1]].long()
        n = int(counts[e])
        # slots of expert e in increasing order (stable, like the torch lowering's argsort), then -1
        assert torch.equal(seg[:n], (flat == e).nonzero().flatten()), e
        assert (seg[n:] == -1).all()
        assert (r.block_expert_B[starts[e] // blk:starts[e + 1] // blk] == e).all()
    assert (r.v_P[used:] == -1).all() and (r.block_expert_B[used // blk:] == -1).all()


# ---- ESMM forward, ESMM/ESTMM/ESS/ESFK backward, through the op ----------------------------------

@interp
@pytest.mark.parametrize(("activation", "gated", "bias", "dtype"), [
    ("silu", True, True, torch.float32),
    ("gelu", False, True, torch.float32),
    ("gelu_tanh", True, False, torch.float16),
    ("relu", False, False, torch.float16),
    ("sigmoid", True, True, torch.float32),
    ("identity", False, True, torch.float16),
])
def test_op_matches_loop_and_torch_op(activation: str, gated: bool, bias: bool, dtype: torch.dtype) -> None:
    check_op(gated, bias, activation, dtype)


@interp
@pytest.mark.parametrize("route", ["empty_experts", "one_expert", "repeated"])
def test_degenerate_routings(route: str) -> None:
    check_op(True, True, "silu", torch.float32, route=route)


@interp
@pytest.mark.parametrize("layout", ["transposed", "interleaved"])
def test_weight_views_are_read_in_place(layout: str) -> None:
    check_op(True, True, "gelu", torch.float32, layout=layout)


@interp
def test_bf16_in_the_interpreter() -> None:
    # tl.dot tiles are upcast to fp32 in the interpreter (its bf16 dot is wrong)
    check_op(True, True, "silu", torch.bfloat16)


@interp
def test_slot_buffer_combine_and_unfused_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIERMOE_TRITON_COMBINE", "slots")
    monkeypatch.setenv("HIERMOE_TRITON_FUSED", "0")  # ESTMM, ESMM, ESS as three launches
    x = torch.zeros(2, 16)
    cfg = triton_experts.kernel_config(x, 2, 4, 16)
    assert cfg.combine == "slots" and not cfg.fused
    check_op(True, True, "silu", torch.float32)


@needs_triton
def test_wgrad_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped GEMM for the weight gradients wherever torch's grouped GEMM takes the operands: the
    dtype on the device and 16-byte rows (F = 6 fp32 elements is 24 bytes: the ESTMM kernel)."""
    monkeypatch.delenv("HIERMOE_TRITON_WGRAD", raising=False)
    x = torch.zeros(2, 16)
    assert triton_experts.kernel_config(x, 2, 4, 16).wgrad == "grouped"
    assert triton_experts.kernel_config(x, 2, 4, 6).wgrad == "estmm"
    monkeypatch.setenv("HIERMOE_TRITON_WGRAD", "estmm")
    assert triton_experts.kernel_config(x, 2, 4, 16).wgrad == "estmm"
    monkeypatch.setenv("HIERMOE_TRITON_WGRAD", "grouped")
    with pytest.raises(ValueError, match="H=16, F=6"):
        triton_experts.kernel_config(x, 2, 4, 6)
    monkeypatch.setenv("HIERMOE_TRITON_WGRAD", "often")
    with pytest.raises(ValueError, match="HIERMOE_TRITON_WGRAD"):
        triton_experts.kernel_config(x, 2, 4, 16)


@needs_triton
def test_combine_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIERMOE_TRITON_COMBINE", raising=False)
    x = torch.zeros(2, 16)
    assert triton_experts.kernel_config(x, 2, 4, 16).combine == "atomic"
    torch.use_deterministic_algorithms(True)
    try:  # atomics add in a run-dependent order: deterministic mode takes the per-slot buffer
        assert triton_experts.kernel_config(x, 2, 4, 16).combine == "slots"
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("HIERMOE_TRITON_COMBINE", "sometimes")
    with pytest.raises(ValueError, match="HIERMOE_TRITON_COMBINE"):
        triton_experts.kernel_config(x, 2, 4, 16)


@interp
@pytest.mark.parametrize("fused,wgrad", [(True, "estmm"), (False, "estmm"), (True, "grouped"), (False, "grouped")])
def test_launchers_with_many_small_tiles(fused: bool, wgrad: str) -> None:
    """16-wide tiles: H = 40 and F = 24 span 3 and 2 tiles with masked tails; both combines; weight
    gradients by the ESTMM kernel and by grouped GEMM over v's order."""
    args, grad, want_y, want = _launcher_case(20, 3, "gelu")
    x, idx, tw, w_up, w_gate, w_down, b_up, b_gate, b_down = args
    for combine in ("atomic", "slots"):
        cfg = triton_esmm.KernelConfig.uniform(16, 16, 16, combine=combine, fused=fused, upcast=True, wgrad=wgrad)
        tw_N = tw.reshape(-1).float()
        y = triton_esmm.esmm_forward(x, idx, tw_N, w_up, w_gate, w_down, b_up, b_gate, b_down, "gelu", cfg)
        got = triton_esfk.esfk_backward(grad, x, idx, tw_N, w_up, w_gate, w_down, b_up, b_gate, b_down, "gelu", cfg)
        assert rel_err(y, want_y) <= 1e-5
        _assert_grads(got, want, combine)


def _launcher_case(num_t: int, seed: int, activation: str) -> tuple[list[Any], Tensor, Tensor, list[Tensor]]:
    """A gated fp32 case with biases for calling the launchers directly: the op's args, an upstream
    gradient, and the torch op's output and reference gradients."""
    lv, build = make_case(True, True, torch.float32, num_t=num_t)
    args = build(lv)
    grad = torch.randn(num_t, H, generator=torch.Generator().manual_seed(seed))
    return (args, grad, torch.ops.hiermoe.experts(*args, activation),
            list(experts_reference_backward(grad, *args, activation)))


def _assert_grads(got: tuple[Tensor | None, ...], want: list[Tensor], tag: object) -> None:
    """esfk_backward's eight gradients equal the reference's (fp32: 1e-5)."""
    for name, a, b in zip(("x", "tw", "w_up", "w_gate", "w_down", "b_up", "b_gate", "b_down"), got, want,
                          strict=True):
        assert a is not None and rel_err(a.reshape(b.shape), b) <= 1e-5, (tag, name)


@interp
@pytest.mark.parametrize("group", [1, 4, 0])
def test_program_groups_cover_every_block_and_tile(group: int) -> None:
    """Every launch's grouped program order (``block_tile``): one block per group, a group that
    does not divide the block count (the last group is short) and all blocks at once (0) give the
    same results; 16-wide tiles so H = 40 and F = 24 span 3 and 2 output tiles; the backward with
    and without kept pre-activations (its hidden launch has tiles of its own). Weight gradients by
    grouped GEMM only: the ESTMM range walks experts, not blocks (other tests cover it)."""
    args, grad, want_y, want = _launcher_case(30, 4, "silu")
    x, idx, tw, w_up, w_gate, w_down, b_up, b_gate, b_down = args
    base = triton_esmm.KernelConfig.uniform(16, 16, 16, upcast=True)
    tw_N = tw.reshape(-1).float()
    cfg = dataclasses.replace(base.with_groups(dict.fromkeys(base.LAUNCHES, group)), wgrad="grouped")
    r = triton_reindex.build_reindex(idx, E, cfg.blk)
    assert r.block_expert_B.shape[0] % 4 == 1  # 9 blocks: with group 4, two whole groups and a short one
    rows = r.v_P.shape[0]
    kept = (x.new_empty(rows, F), x.new_empty(rows, F))
    y = triton_esmm.esmm_forward(x, idx, tw_N, w_up, w_gate, w_down, b_up, b_gate, b_down, "silu", cfg, r, keep=kept)
    assert rel_err(y, want_y) <= 1e-5
    for keep in (None, kept):
        got = triton_esfk.esfk_backward(grad, x, idx, tw_N, w_up, w_gate, w_down, b_up, b_gate, b_down, "silu", cfg,
                                        r, kept=keep)
        _assert_grads(got, want, keep is None)


@needs_triton
def test_program_group_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """HIERMOE_TRITON_GROUP sets every launch's group; anything but a count is refused."""
    x = torch.empty(64, 32)
    monkeypatch.setenv("HIERMOE_TRITON_GROUP", "0")
    cfg = triton_experts._grouped(triton_experts.HOPPER_TILES)
    assert {cfg.up.group, cfg.down.group, cfg.hidden.group, cfg.esfk.group, cfg.kept.group} == {0}
    assert cfg.up.block_f == triton_experts.HOPPER_TILES.up.block_f  # only the group changes
    monkeypatch.setenv("HIERMOE_TRITON_GROUP", "-2")
    with pytest.raises(ValueError, match="HIERMOE_TRITON_GROUP must be a block count"):
        triton_experts.kernel_config(x, 2, 4, 16)


@interp
def test_backward_op_matches_reference_backward_and_fills_absent_grads() -> None:
    lv, build = make_case(False, False, torch.float32)
    args = build(lv)
    grad = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    got = torch.ops.hiermoe.experts_triton_backward(grad, *args, "relu")
    want = experts_reference_backward(grad, *args, "relu")
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        if b.numel():
            assert rel_err(a, b) <= 1e-5
    assert [t.numel() for t in got[3:4] + got[5:]] == [0, 0, 0, 0]  # w_gate and biases absent


@interp
def test_no_tokens() -> None:
    lv, build = make_case(True, True, torch.float32, num_t=0)
    leaves = {k: v.requires_grad_() for k, v in lv.items()}
    y = torch.ops.hiermoe.experts_triton(*build(leaves), "silu")
    assert y.shape == (0, H)
    grads = torch.autograd.grad(y.sum(), list(leaves.values()), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


@interp
def test_opcheck() -> None:
    lv, build = make_case(True, True, torch.float32, num_t=8, num_h=16, num_f=16, num_e=3)
    args = [a.requires_grad_() if isinstance(a, Tensor) and a.is_floating_point() else a for a in build(lv)]
    torch.library.opcheck(torch.ops.hiermoe.experts_triton.default, (*args, "silu"))
    plain = [a.detach() if isinstance(a, Tensor) else a for a in args]
    torch.library.opcheck(torch.ops.hiermoe.experts_triton_backward.default,
                          (torch.randn(8, 16), *plain, "silu"))
    # the training form: its kept buffers (unused blocks zeroed) and autograd through them, also
    # non-gated and with no tokens
    keep = torch.ops.hiermoe.experts_triton_keep.default
    torch.library.opcheck(keep, (*args, "silu", 16))
    lv_ng, build_ng = make_case(False, False, torch.float32, num_t=8, num_h=16, num_f=16, num_e=3)
    non_gated = [a.requires_grad_() if isinstance(a, Tensor) and a.is_floating_point() else a
                 for a in build_ng(lv_ng)]
    torch.library.opcheck(keep, (*non_gated, "gelu", 16))
    empty = [args[0][:0], args[1][:0], args[2][:0], *args[3:]]
    torch.library.opcheck(keep, (*empty, "silu", 16))


@interp
def test_user_errors_say_what_to_change() -> None:
    lv, build = make_case(True, False, torch.float32, num_t=4, num_h=16, num_f=16)
    args = build(lv)
    bad = list(args)
    bad[3] = args[3].double()
    with pytest.raises(ValueError, match="w_up in x's dtype"):
        torch.ops.hiermoe.experts_triton(*bad, "silu")
    with pytest.raises(ValueError, match="unknown expert activation"):
        torch.ops.hiermoe.experts_triton(*args, "swish")


# ---- the lower_kernels pass ---------------------------------------------------------------------

def _op_graph(device: str = "cpu", fakes: str = "x") -> tuple[fx.GraphModule, list[Any]]:
    """A graph calling hiermoe::experts, with Dynamo-style fake values (on ``device``) on x alone
    (``fakes="x"``), or on every input, weights requiring grad (``"train"``) or not (``"infer"``)."""
    lv, build = make_case(True, True, torch.float32, num_t=8, num_h=16, num_f=16)
    args = build(lv)
    graph = fx.Graph()
    names = ["x", "topk_idx", "topk_weights", "w_up", "w_gate", "w_down", "b_up", "b_gate", "b_down"]
    nodes = [graph.placeholder(n) for n in names]
    with FakeTensorMode():
        for i, (node, a) in enumerate(zip(nodes, args, strict=True)):
            if a is not None and (i == 0 or fakes != "x"):
                fake = torch.empty(a.shape, dtype=a.dtype, device=device)
                node.meta["example_value"] = fake.requires_grad_(fakes == "train" and i >= 3)
    out = graph.call_function(torch.ops.hiermoe.experts.default, (*nodes, "silu"))
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph), args


def _targets(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_torch_and_auto_on_cpu_leave_the_graph_alone() -> None:
    for kernels in ("torch", "auto"):
        gm, _ = _op_graph()
        # only x has a fake value here: the composite cannot be judged, the opaque op stays
        assert lower_kernels_pass(gm, kernels) == {"triton": 0, "torch": 1, "composite": 0}
        assert _targets(gm) == [torch.ops.hiermoe.experts.default]


@needs_triton
def test_pass_auto_on_cuda_follows_the_measured_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels="auto" on CUDA (fake CUDA values: no GPU needed to decide) takes what the table
    measured faster at the nearest shape on this device: here Triton for training, torch for
    inference; a device never measured gets torch. A trained op lowered to Triton takes the
    training form experts_triton_keep(...)[0], or plain experts_triton with HIERMOE_TRITON_KEEP=0."""
    from moe_compile.lowering import kernel_table

    def entry(mode: str, triton_ms: float, torch_ms: float) -> kernel_table.Entry:
        return kernel_table.Entry("GPU X", (9, 0), "float32", mode, 8, K, E, 16, 16, triton_ms, torch_ms)

    table = (entry("fwd+bwd", 1.0, 2.0), entry("fwd", 2.0, 1.0), dataclasses.replace(entry("fwd+bwd", 9.0, 1.0), tokens=10**6))
    monkeypatch.setattr(kernel_table, "load", lambda: table)
    monkeypatch.setattr(kernel_table, "device_key", lambda device: ("GPU X", (9, 0)))
    monkeypatch.delenv("HIERMOE_TRITON_KEEP", raising=False)
    gm, _ = _op_graph("cuda", "train")
    assert lower_kernels_pass(gm, "auto") == {"triton": 1, "torch": 0, "composite": 0}
    assert _targets(gm) == [torch.ops.hiermoe.experts_triton_keep.default, operator.getitem]
    gm, _ = _op_graph("cuda", "infer")
    assert lower_kernels_pass(gm, "auto") == {"triton": 0, "torch": 1, "composite": 0}  # fp32 CUDA: no grouped_mm
    monkeypatch.setenv("HIERMOE_TRITON_KEEP", "0")
    gm, _ = _op_graph("cuda", "train")
    assert lower_kernels_pass(gm, "auto") == {"triton": 1, "torch": 0, "composite": 0}
    assert _targets(gm) == [torch.ops.hiermoe.experts_triton.default]
    monkeypatch.setattr(kernel_table, "device_key", lambda device: ("GPU Y", (8, 0)))
    gm, _ = _op_graph("cuda", "train")
    assert lower_kernels_pass(gm, "auto") == {"triton": 0, "torch": 1, "composite": 0}
    why = kernel_table.choose(("GPU Y", (8, 0)), torch.float32, 8, K, E, 16, 16, True, table).why
    assert "no fwd+bwd measurement" in why and "GPU Y" in why


def test_kernel_table_takes_each_device_from_its_own_run() -> None:
    """--write-table's merge (kernel_table.merged): a bench run's entries (Triton's training form
    against the torch lowering for fwd+bwd, the plain op for fwd; failed rows skipped) replace its
    device's and keep every other device's, also from a table of the older one-source form."""
    from moe_compile.lowering import kernel_table

    models = {"m": (16, 32, 4, 2)}

    def run(device: str, keep_ms: float, command: str) -> dict[str, Any]:
        rows = [dict(model="m", tokens=64, mode="fwd+bwd", impl="triton_keep", median_ms=keep_ms),
                dict(model="m", tokens=64, mode="fwd+bwd", impl="triton", median_ms=0.1),  # not the training form
                dict(model="m", tokens=64, mode="fwd+bwd", impl="composite", median_ms=2.0),
                dict(model="m", tokens=64, mode="fwd", impl="triton", median_ms=1.5),
                dict(model="m", tokens=64, mode="fwd", impl="composite", median_ms=1.0),
                dict(model="m", tokens=512, mode="fwd", impl="triton", median_ms=None, error="OOM"),
                dict(model="m", tokens=512, mode="fwd", impl="composite", median_ms=3.0)]
        return dict(machine=dict(gpu=device, capability=[9, 0]), command=command, source=f"{device}.json",
                    rows=rows)

    old = dict(source="h200.json", command="bench on the H200",
               entries=kernel_table.entries_from_bench(run("H200", 3.0, "x"), models))
    table = kernel_table.merged(old, run("H100", 1.0, "bench on the H100"), models)
    assert [s["device"] for s in table["sources"]] == ["H100", "H200"]
    assert table["sources"][1] == {"device": "H200", "source": "h200.json", "command": "bench on the H200"}
    by = {(e["device"], e["mode"]): e for e in table["entries"]}
    assert len(table["entries"]) == 4  # (H100, H200) x (fwd, fwd+bwd) at T=64; T=512 has no Triton row
    assert (by["H100", "fwd+bwd"]["triton_ms"], by["H100", "fwd+bwd"]["torch_ms"]) == (1.0, 2.0)
    assert (by["H100", "fwd"]["triton_ms"], by["H100", "fwd"]["torch_ms"]) == (1.5, 1.0)
    assert by["H200", "fwd+bwd"]["triton_ms"] == 3.0
    again = kernel_table.merged(table, run("H100", 5.0, "a later H100 run"), models)
    assert len(again["entries"]) == 4 and again["sources"][0]["command"] == "a later H100 run"
    assert {e["triton_ms"] for e in again["entries"] if e["mode"] == "fwd+bwd"} == {5.0, 3.0}


def test_pass_rejects_unknown_choice() -> None:
    with pytest.raises(ValueError, match="kernels must be one of"):
        lower_kernels_pass(_op_graph()[0], "cuda")


@needs_triton
def test_pass_triton_on_cpu_without_interpreter_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gm, args = _op_graph()
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 in the environment before importing"):
        lower_kernels_pass(gm, "triton")
    assert _targets(gm) == [torch.ops.hiermoe.experts.default]  # refused before changing anything
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):  # the op itself, called directly
        torch.ops.hiermoe.experts_triton(*args, "silu")
    spec = SAMPLES["grouped_gemm"]
    torch._dynamo.reset()
    compiled = torch.compile(spec.make(), backend="hiermoe", options={"kernels": "triton", "inner_compiler": "eager"})
    with pytest.raises(Exception, match="TRITON_INTERPRET=1"):
        compiled(example_input(spec))


@interp
def test_pass_triton_retargets_and_keeps_the_function() -> None:
    gm, args = _op_graph()
    assert lower_kernels_pass(gm, "triton") == {"triton": 1, "torch": 0, "composite": 0}
    assert _targets(gm) == [torch.ops.hiermoe.experts_triton.default]
    assert rel_err(gm(*args), torch.ops.hiermoe.experts(*args, "silu")) <= 1e-5


@interp
def test_compile_with_triton_kernels_matches_eager() -> None:
    """torch.compile(backend="hiermoe", kernels="triton"): one experts_triton op, outputs and
    every gradient equal eager within fp32 rounding (compare_compiled's 1e-5 of the scale)."""
    spec = SAMPLES["grouped_gemm"]
    torch.manual_seed(0)
    cmp = compare_compiled(spec.make(), [example_input(spec)], {"kernels": "triton", "inner_compiler": "aot_eager"})
    cmp.assert_close()
    after = cmp.report.graphs[0].after
    assert after.count("torch.ops.hiermoe.experts_triton.default(") == 1
    assert after.count("torch.ops.hiermoe.experts.default(") == 0
    assert cmp.report.graphs[0].counters["lower_kernels"] == {"triton": 1, "torch": 0, "composite": 0}


@pytest.mark.skipif(INTERPRETED or not lowering.HAS_TRITON, reason="this process already runs the interpreter tests")
def test_interpreter_tests_in_fresh_process() -> None:
    """Triton was imported before this module set TRITON_INTERPRET=1 (or a GPU is present): run
    this file again in a new process that sets it before anything imports triton; there every
    test this process skips for want of the interpreter must pass."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-rs", "-p", "no:cacheprovider"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    # no failure, and the only skips there are the GPU tests (and this one): so every test that
    # needs the interpreter passed
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("needs CUDA" in line or "already runs the interpreter tests" in line for line in skips), \
        "\n".join(skips)


# ---- GPU: compiled kernels, bf16 --------------------------------------------------------------

def _cuda_case(num_t: int, num_k: int, num_e: int, num_h: int, num_f: int, dtype: torch.dtype,
               gated: bool = True, bias: bool = True) -> list[Any]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    idx = torch.rand(num_t, num_e, generator=g, device="cuda").topk(num_k, dim=-1).indices
    tw = torch.rand(num_t, num_k, generator=g, device="cuda") + 0.1
    return [rnd(num_t, num_h), idx, tw, rnd(num_e, num_f, num_h, scale=num_h**-0.5),
            rnd(num_e, num_f, num_h, scale=num_h**-0.5) if gated else None, rnd(num_e, num_h, num_f, scale=num_f**-0.5),
            rnd(num_e, num_f, scale=0.1) if bias else None, rnd(num_e, num_f, scale=0.1) if bias and gated else None,
            rnd(num_e, num_h, scale=0.1) if bias else None]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("combine", ["atomic", "slots"])
@pytest.mark.parametrize("num_t", [1000, 40])  # re-index blocks of 128 and of 16 slots (gpu_blk)
def test_gpu_matches_torch_op(dtype: torch.dtype, combine: str, num_t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIERMOE_TRITON_COMBINE", combine)
    cfg = triton_experts.kernel_config(torch.empty(num_t, 256, device="cuda", dtype=dtype), 2, 8, 352)
    assert cfg.blk == (128 if num_t == 1000 else 16)
    args = _cuda_case(num_t, 2, 8, 256, 352, dtype)  # F = 352: a masked tail tile at 64- and 128-wide tiles
    leaves = [a.requires_grad_() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args]
    grad = torch.randn(num_t, 256, device="cuda").to(dtype)
    y = torch.ops.hiermoe.experts_triton(*leaves, "silu")
    ref = torch.ops.hiermoe.experts(*[a.detach().float() if isinstance(a, Tensor) and a.is_floating_point() else a
                                      for a in leaves], "silu")
    assert rel_err(y, ref) <= TOL_OP[dtype]
    got = torch.ops.hiermoe.experts_triton_backward(grad, *[a.detach() if isinstance(a, Tensor) else a for a in args],
                                                     "silu")
    want = experts_reference_backward(grad.float(), *[a.detach().float() if isinstance(a, Tensor) and
                                                      a.is_floating_point() else a for a in args], "silu")
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) <= TOL_OP[dtype]
    # the training form: the same y, and autograd's gradients through the kept pre-activations
    y_keep = torch.ops.hiermoe.experts_triton_keep(*leaves, "silu", triton_experts.keep_blk(args[0], 2, 8))[0]
    assert rel_err(y_keep, ref) <= TOL_OP[dtype]
    floats = [a for a in leaves if isinstance(a, Tensor) and a.requires_grad]
    for a, b in zip(torch.autograd.grad(y_keep, floats, grad.to(y_keep.dtype)), want, strict=True):
        assert rel_err(a, b) <= TOL_OP[dtype]


@gpu
def test_gpu_int64_offsets() -> None:
    """T*H > 2**31: token rows past the int32 range are read and written at the right place."""
    num_h, num_t = 1024, 2**21 + 64
    args = _cuda_case(num_t, 1, 4, num_h, 64, torch.bfloat16, bias=False)
    y = torch.ops.hiermoe.experts_triton(*args, "silu")
    tail = slice(num_t - 64, num_t)
    sub = [args[0][tail], args[1][tail], args[2][tail], *args[3:]]
    assert rel_err(y[tail], torch.ops.hiermoe.experts(*sub, "silu")) <= TOL_OP[torch.bfloat16]


@gpu
def test_gpu_compile_triton_with_inductor_trains() -> None:
    """kernels="triton" under Inductor, bf16: the trained layer takes the training form (kept
    pre-activations); output and every parameter's gradient near eager's."""
    spec = SAMPLES["grouped_gemm"]
    torch.manual_seed(0)
    model = spec.make().cuda().to(torch.bfloat16)
    x = example_input(spec).cuda().to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    torch._dynamo.reset()
    from moe_compile.backend import collect_reports

    with collect_reports() as graphs:
        y = torch.compile(model, backend="hiermoe", options={"kernels": "triton"})(x)
    assert sum(g.counters.get("lower_kernels", {}).get("triton", 0) for g in graphs) == 1
    y_e = model(x)
    assert rel_err(y, y_e) <= 3e-2
    grads = torch.autograd.grad(y.float().square().sum(), params)
    for a, b in zip(grads, torch.autograd.grad(y_e.float().square().sum(), params), strict=True):
        assert rel_err(a, b) <= 6e-2


@gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_gpu_hf_training_step_matches_eager(family: str) -> None:
    """A transformers MoE model on CUDA, compiled with hiermoe (kernels="triton", Inductor):
    the loss and every parameter's gradient equal eager's. fp32, so the check is tight (the
    kernels' tl.dot runs in ieee fp32 unless matmul precision allows tf32)."""
    pytest.importorskip("transformers")
    from hf_models import build, input_ids

    from moe_compile.backend import collect_reports

    model = build(family, "batched_mm").cuda()  # batched_mm: grouped_mm needs bf16 on CUDA
    ids = input_ids().cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    torch._dynamo.reset()
    with collect_reports() as graphs:
        loss_c = torch.compile(model, backend="hiermoe", options={"kernels": "triton"})(ids, labels=ids).loss
    grads_c = torch.autograd.grad(loss_c, params)
    loss_e = model(ids, labels=ids).loss
    grads_e = torch.autograd.grad(loss_e, params)
    assert sum(g.counters.get("lower_kernels", {}).get("triton", 0) for g in graphs) == 2
    assert rel_err(loss_c, loss_e) <= 1e-5
    worst = max(rel_err(a, b) for a, b in zip(grads_c, grads_e, strict=True))
    assert worst <= 1e-4, f"gradients differ from eager by {worst:.2e}"
