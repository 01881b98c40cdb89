"""The op ``hiermoe::experts_triton``: ``hiermoe::experts`` lowered to the expert-specific Triton
kernels of HEXA-MoE (papers/hexa-moe.txt Sec. 4.2, App. A): re-index (``triton_reindex``), ESMM
forward (``triton_esmm``), ESMM/ESTMM/ESS and the fused ESFK backward (``triton_esfk``).

Same arguments, schema and semantics as ``hiermoe::experts`` (see ``experts_ref``), so the
``lower_kernels`` pass swaps one for the other; differences are rounding only: inside the kernels
the intermediates (up, gate, the expert output) stay in fp32 where the torch lowering rounds them to
x's dtype, so low-precision results are slightly more accurate.

Registration. ``experts_triton`` and its backward ``experts_triton_backward`` are
``torch.library.triton_op``s whose kernels are launched through ``wrap_triton``, so Inductor
sees (and can schedule) every launch on CUDA; both have a fake implementation, and the forward has
``register_autograd`` (backward recomputes the activations from the inputs, like the torch op).

Where the kernels run:
  * CUDA tensors: compiled Triton kernels.
  * CPU tensors: the Triton interpreter, which needs TRITON_INTERPRET=1 in the environment
    *before triton is first imported* (importing moe_compile imports it): triton 3.x reads the
    variable when ``@triton.jit`` decorates a function, both ours and triton.language's own
    (tl.sum, tl.cumsum, ...), so it cannot be switched on later, nor per device, without
    re-creating triton.language. Without it the op raises ValueError on CPU (and the
    ``lower_kernels`` pass refuses kernels="triton" before that). With it, CUDA tensors are
    interpreted too (slowly): set it only on machines without a GPU. Interpreted kernels cannot be
    traced with fake tensors, so on this path the op calls the opaque custom ops
    ``hiermoe::experts_triton_interpreted`` / ``..._backward_interpreted``. bf16 works in the
    interpreter as well: tiles are upcast to fp32 before tl.dot (the interpreter's own bf16 dot is
    wrong; on CUDA the tensor cores multiply bf16 exactly into fp32 anyway), and its fp32->bf16
    stores may differ from CUDA's by one bf16 ulp.

Top-k accumulation (``KernelConfig.combine``), chosen per call from HIERMOE_TRITON_COMBINE:
  "atomic" (default on CUDA and in the interpreter): fp32 atomic add into a [T, H] buffer, the
      memory-light scheme of HEXA-MoE Fig. 5c; sums in a run-dependent order on CUDA.
  "slots": each slot writes its own row of an fp32 [N, H] buffer, then a sum over K in fixed
      order: for backends without float atomics, and chosen by "auto" (the default value) whenever
      torch.are_deterministic_algorithms_enabled() (bitwise reproducible, K times the buffer).
HIERMOE_TRITON_FUSED=0 runs the backward's ESTMM, ESMM and ESS as three launches instead of ESFK.
HIERMOE_TRITON_WGRAD (auto, estmm, grouped): the backward's weight gradients by the ESTMM kernel or by
torch's grouped GEMM over the rows the hidden launch stores in v's order; "auto" (the default) takes
grouped GEMM wherever it accepts the operands. HIERMOE_TRITON_GROUP (a block count, 0: all) overrides every
GPU launch's program grouping (``Tiles.group``, ``triton_esmm.block_tile``), for sweeps. All four
variables are read when the op runs (or is traced: a compiled graph keeps its choice).

Shape legend: T tokens, K experts per token, N = T*K, E experts, H hidden, F ffn; x_TH, topk_idx_TK,
topk_weights_TK, w_up_EFH, w_gate_EFH, w_down_EHF, b_up_EF, b_gate_EF, b_down_EH, grad_TH.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import triton
from torch import Tensor

from moe_compile.lowering import triton_esmm
from moe_compile.lowering.experts import _EXPERTS_BACKWARD_SCHEMA, _EXPERTS_SCHEMA
from moe_compile.lowering.experts_ref import activation_error, check_activation, out_dtype
from moe_compile.lowering.triton_esfk import esfk_backward, grouped_wgrad_ok
from moe_compile.lowering.triton_esmm import KernelConfig, Tiles, esmm_forward
from moe_compile.lowering.triton_reindex import Reindex, build_reindex, num_blocks_bound

__all__ = ["INTERPRETED", "KernelConfig", "experts_triton", "experts_triton_backward", "experts_triton_backward_keep",
           "experts_triton_keep", "interpreter_error", "keep_blk", "kernel_config"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
Grads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
Kept = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # y, up_PF, gate_PF, v_P, block_expert_B, starts_E1


INTERPRETED = triton_esmm.INTERPRETED  # TRITON_INTERPRET=1 was set when triton was imported


def interpreter_error(device: torch.device) -> str | None:
    """Why the kernels cannot run for tensors on ``device`` in this process, or None when they can."""
    if device.type == "cuda" and not INTERPRETED:
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return (f"the Triton expert kernels run on {device.type} tensors only in the Triton interpreter: set "
                "TRITON_INTERPRET=1 in the environment before importing torch/triton/moe_compile "
                "(e.g. `TRITON_INTERPRET=1 python train.py`), or use options={'kernels': 'torch'}")
    if not INTERPRETED:
        return ("TRITON_INTERPRET=1 was set after triton had been imported, so the kernels were compiled for a "
                "GPU, not interpreted: set it in the environment before the process imports "
                "torch/triton/moe_compile, or use options={'kernels': 'torch'}")
    return None


def _combine() -> str:
    mode = os.environ.get("HIERMOE_TRITON_COMBINE", "auto")
    if mode not in ("auto", "atomic", "slots"):
        raise ValueError(f"HIERMOE_TRITON_COMBINE must be auto, atomic or slots, got {mode!r}")
    if mode == "auto":
        return "slots" if torch.are_deterministic_algorithms_enabled() else "atomic"
    return mode


# GPU launch tiles per kernel (block_f, block_h, warps, stages), chosen by bench/tune_kernels.py on an
# H100 (bench/results/tune_kernels.md; ``kept`` by its --from-shipped sweep, tune_kept.json: 64x128 at
# 4 stages, 1-4 % of the backward faster than 128x128 at Mixtral's and Qwen3's shapes), each with
# the default program group 8 (--groups: within 1 % of the best group per shape, tune_groups.json).
# They need up to ~200 KiB of shared memory per block (the up kernel's two 128x128 weight tiles and
# its x tile, 3 stages deep), which Hopper has (227 KiB);
# devices with less get 64-wide tiles (about 72 KiB per block for 16-bit types; only run on the
# H100 so far, where they were the default before the sweep).
HOPPER_TILES = KernelConfig(up=Tiles(128, 128, 8, 3), down=Tiles(64, 256, 8, 4), hidden=Tiles(128, 128, 8, 3),
                            esfk=Tiles(128, 128, 8, 3), kept=Tiles(64, 128, 8, 4))
SMALL_TILES = KernelConfig()  # 64-wide tiles for every kernel (Tiles' defaults)
GPU_BLK_MAX = 128


def gpu_tiles(device: torch.device, dtype: torch.dtype) -> KernelConfig:
    """The launch tiles for ``dtype`` tensors on ``device`` (a config whose other fields the caller
    sets): the tuned Hopper tiles for 16-bit types where a block may take 227 KiB of shared memory,
    else 64-wide ones (fp32 tiles take twice the bytes)."""
    if device.type != "cuda":
        return SMALL_TILES
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return HOPPER_TILES if optin >= 227 * 1024 and dtype.itemsize == 2 else SMALL_TILES


def gpu_blk(num_slots: int, num_e: int, blk_max: int = GPU_BLK_MAX) -> int:
    """Re-index block (the M tile) for N = T*K slots over E experts: the mean expert load rounded up to
    a power of two, between 16 (tl.dot's least M) and ``blk_max``, so small batches are not padded
    to a large tile (every expert is padded by at most blk - 1 slots, Alg. 1)."""
    if not isinstance(num_slots, int):  # a symbolic T (dynamic shapes): no guard on the load
        return blk_max
    mean = -(-num_slots // max(num_e, 1))
    return min(blk_max, max(16, triton.next_power_of_2(mean)))


def _wgrad(x_TH: Tensor, num_f: int) -> str:
    mode = os.environ.get("HIERMOE_TRITON_WGRAD", "auto")
    if mode not in ("auto", "estmm", "grouped"):
        raise ValueError(f"HIERMOE_TRITON_WGRAD must be auto, estmm or grouped, got {mode!r}")
    ok = grouped_wgrad_ok(x_TH.dtype, x_TH.device, x_TH.shape[1], num_f)
    if mode == "grouped" and not ok:
        raise ValueError(f"HIERMOE_TRITON_WGRAD=grouped: torch's grouped GEMM does not take {x_TH.dtype} on "
                         f"{x_TH.device.type} with H={x_TH.shape[1]}, F={num_f} (needs bf16 on CUDA sm_80+, or "
                         "fp32/fp16/bf16 on CPU, and 16-byte rows); unset it or use estmm")
    if mode == "auto":
        return "grouped" if ok else "estmm"
    return mode


def kernel_config(x_TH: Tensor, num_k: int, num_e: int, num_f: int, blk: int | None = None) -> KernelConfig:
    """Tile sizes and modes for one call: on GPU the tuned ``gpu_tiles`` and a re-index block sized to
    the mean expert load; small tiles in the interpreter (its cost grows with every element a
    program touches, padding included). The backward's weight gradients are grouped GEMMs wherever
    torch's grouped GEMM takes the operands (``triton_esfk.grouped_wgrad_ok``; the ESTMM kernel
    elsewhere, or with HIERMOE_TRITON_WGRAD=estmm)."""
    fused = os.environ.get("HIERMOE_TRITON_FUSED", "1") != "0"
    num_h = x_TH.shape[1]
    wgrad = _wgrad(x_TH, num_f)
    if INTERPRETED:
        def tile(n: int) -> int:
            return min(32, max(16, triton.next_power_of_2(n)))

        return _grouped(KernelConfig.uniform(blk or 16, tile(num_f), tile(num_h), combine=_combine(), fused=fused,
                                             upcast=True, wgrad=wgrad))
    tf32 = x_TH.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
    return dataclasses.replace(_grouped(gpu_tiles(x_TH.device, x_TH.dtype)),
                               blk=blk or gpu_blk(x_TH.shape[0] * num_k, num_e), combine=_combine(), fused=fused,
                               precision="tf32" if tf32 else "ieee", wgrad=wgrad)


def _grouped(cfg: KernelConfig) -> KernelConfig:
    """``cfg`` with every launch's program group set from HIERMOE_TRITON_GROUP, where it is set."""
    value = os.environ.get("HIERMOE_TRITON_GROUP")
    if value is None:
        return cfg
    if not value.isdigit():
        raise ValueError(f"HIERMOE_TRITON_GROUP must be a block count >= 0 (0: all blocks), got {value!r}")
    return cfg.with_groups(dict.fromkeys(KernelConfig.LAUNCHES, int(value)))


def keep_blk(x_TH: Tensor, num_k: int, num_e: int) -> int:
    """The re-index block ``hiermoe::experts_triton_keep`` is given (its kept buffers have
    num_blocks_bound(N, E, blk) * blk rows, so the block must be known when the graph is traced):
    ``kernel_config``'s choice for x's shape, the largest block where T is symbolic."""
    return 16 if INTERPRETED else gpu_blk(x_TH.shape[0] * num_k, num_e)


def _check(x: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor, activation: str) -> None:
    check_activation(activation, gated=w_gate is not None)
    if activation_error(activation) is not None:
        raise ValueError(activation_error(activation))
    why = interpreter_error(x.device)
    if why is not None:
        raise ValueError(why)
    if x.dtype not in _DTYPES:
        raise ValueError(f"hiermoe::experts_triton supports {_DTYPES}, got x of dtype {x.dtype}; "
                         "use options={'kernels': 'torch'} for other dtypes")
    for name, w in (("w_up", w_up), ("w_gate", w_gate), ("w_down", w_down)):
        if w is not None and w.dtype != x.dtype:
            raise ValueError(f"hiermoe::experts_triton needs {name} in x's dtype {x.dtype}, got {w.dtype}; "
                             "cast the expert weights or use options={'kernels': 'torch'}")


def _forward(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
             w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
             activation: str) -> Tensor:
    if topk_idx.numel() == 0:
        return x.new_zeros(x.shape, dtype=out_dtype(x, topk_weights))
    cfg = kernel_config(x, topk_idx.shape[1], w_up.shape[0], w_up.shape[1])
    tw_N = topk_weights.reshape(-1).to(torch.float32).contiguous()
    return esmm_forward(x.contiguous(), topk_idx.contiguous(), tw_N, w_up, w_gate, w_down, b_up, b_gate, b_down,
                        activation, cfg, out_dtype=out_dtype(x, topk_weights))


def _keep_rows(num_slots: Any, num_e: int, blk: int) -> Any:
    return num_blocks_bound(num_slots, num_e, blk) * blk


def _forward_keep(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
                  w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
                  activation: str, blk: int) -> Kept:
    num_k, num_e, num_f = topk_idx.shape[1], w_up.shape[0], w_up.shape[1]
    rows = _keep_rows(topk_idx.numel(), num_e, blk)
    up_PF = x.new_empty(rows, num_f)
    gate_PF = x.new_empty(rows if w_gate is not None else 0, num_f)
    if topk_idx.numel() == 0:
        v = torch.full((rows,), -1, dtype=torch.int32, device=x.device)
        return (x.new_zeros(x.shape, dtype=out_dtype(x, topk_weights)), up_PF.zero_(), gate_PF.zero_(), v,
                torch.full((rows // blk,), -1, dtype=torch.int32, device=x.device),
                torch.zeros(num_e + 1, dtype=torch.int32, device=x.device))
    cfg = kernel_config(x, num_k, num_e, num_f, blk=blk)
    r = build_reindex(topk_idx.contiguous(), num_e, blk)
    tw_N = topk_weights.reshape(-1).to(torch.float32).contiguous()
    y = esmm_forward(x.contiguous(), topk_idx.contiguous(), tw_N, w_up, w_gate, w_down, b_up, b_gate, b_down,
                     activation, cfg, r=r, keep=(up_PF, gate_PF if w_gate is not None else None),
                     out_dtype=out_dtype(x, topk_weights))
    return y, up_PF, gate_PF, r.v_P, r.block_expert_B, r.starts_E1


def _backward(grad: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor,
              w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None,
              b_down: Tensor | None, activation: str, kept: tuple[Tensor, ...] | None = None) -> Grads:
    def fresh(t: Tensor | None) -> Tensor:  # outputs may not alias each other or an input
        return x.new_empty(0) if t is None else torch.zeros(t.shape, dtype=t.dtype, device=t.device)

    grad = grad.to(x.dtype)  # an fp32 result (fp32 routing weights) reads its gradient in x's dtype, as the kernels do

    if topk_idx.numel() == 0:
        return (fresh(x), fresh(topk_weights), fresh(w_up), fresh(w_gate), fresh(w_down), fresh(b_up),
                fresh(b_gate), fresh(b_down))
    r, pre = None, None
    if kept is not None:  # (up_PF, gate_PF, v_P, block_expert_B, starts_E1) of _forward_keep
        up_PF, gate_PF, v_P, block_expert_B, starts_E1 = kept
        blk = v_P.shape[0] // max(block_expert_B.shape[0], 1)
        r = Reindex(v_P, block_expert_B, starts_E1, blk)
        pre = (up_PF, gate_PF if w_gate is not None else None)
    cfg = kernel_config(x, topk_idx.shape[1], w_up.shape[0], w_up.shape[1], blk=None if r is None else r.blk)
    tw_N = topk_weights.reshape(-1).to(torch.float32).contiguous()
    dx, d_tw_N, d_w_up, d_w_gate, d_w_down, d_b_up, d_b_gate, d_b_down = esfk_backward(
        grad.contiguous(), x.contiguous(), topk_idx.contiguous(), tw_N, w_up, w_gate, w_down, b_up, b_gate, b_down,
        activation, cfg, r=r, kept=pre)

    def given(t: Tensor | None) -> Tensor:
        return x.new_empty(0) if t is None else t

    d_tw = d_tw_N.view(topk_weights.shape).to(topk_weights.dtype)
    return dx, d_tw, d_w_up, given(d_w_gate), d_w_down, given(d_b_up), given(d_b_gate), given(d_b_down)


@torch.library.triton_op("hiermoe::experts_triton", mutates_args=())
def experts_triton(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str,
) -> Tensor:
    """y_TH[t] = sum_k topk_weights[t, k] * FFN_{topk_idx[t, k]}(x[t]), by the ESMM kernels."""
    _check(x, w_up, w_gate, w_down, activation)
    if INTERPRETED:
        return torch.ops.hiermoe.experts_triton_interpreted(
            x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation)
    return _forward(x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation)


@torch.library.triton_op("hiermoe::experts_triton_backward", mutates_args=())
def experts_triton_backward(
    grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
    w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Grads of (x, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down); zero-size for an
    absent optional input (same contract as ``hiermoe::experts_backward``)."""
    _check(x, w_up, w_gate, w_down, activation)
    if INTERPRETED:
        return torch.ops.hiermoe.experts_triton_backward_interpreted(
            grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation)
    return _backward(grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down,
                     activation)


@torch.library.custom_op("hiermoe::experts_triton_interpreted", mutates_args=(), schema=_EXPERTS_SCHEMA)
def _experts_interpreted(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str,
) -> Tensor:
    return _forward(x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down,
                    activation)


@torch.library.custom_op("hiermoe::experts_triton_backward_interpreted", mutates_args=(),
                         schema=_EXPERTS_BACKWARD_SCHEMA)
def _experts_backward_interpreted(
    grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
    w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str,
) -> Grads:
    return _backward(grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up,
                     b_gate, b_down, activation)


def _fake(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
          b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str) -> Tensor:
    _check(x, w_up, w_gate, w_down, activation)  # fail at compile time, not at the first step
    return x.new_empty(x.shape, dtype=out_dtype(x, topk_weights))


def _fake_backward(grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor,
                   w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None,
                   b_down: Tensor | None, activation: str) -> Grads:
    _check(x, w_up, w_gate, w_down, activation)

    def like(t: Tensor | None) -> Tensor:
        return x.new_empty(0) if t is None else t.new_empty(t.shape)

    return (like(x), like(topk_weights), like(w_up), like(w_gate), like(w_down), like(b_up), like(b_gate),
            like(b_down))


# The triton ops' default fake is their own body run on fake tensors (every launch traced); the
# shapes are known without it.
for _op, _f in ((experts_triton, _fake), (_experts_interpreted, _fake),
                (experts_triton_backward, _fake_backward), (_experts_backward_interpreted, _fake_backward)):
    _op.register_fake(_f)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    *tensors, activation = inputs
    ctx.save_for_backward(*tensors)  # inputs only; backward recomputes h
    ctx.activation = activation


def _autograd_backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down = ctx.saved_tensors
    grads = torch.ops.hiermoe.experts_triton_backward(
        grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, ctx.activation)
    return _input_grads(grads, w_gate, b_up, b_gate, b_down)


def _input_grads(grads: Grads, w_gate: Tensor | None, b_up: Tensor | None, b_gate: Tensor | None,
                 b_down: Tensor | None) -> tuple[Tensor | None, ...]:
    """The backward op's eight gradients as autograd wants them for the op's inputs through
    ``activation``: None for topk_idx, each absent optional input and the activation."""
    d_x, d_tw, d_w_up, d_w_gate, d_w_down, d_b_up, d_b_gate, d_b_down = grads

    def given(grad: Tensor, inp: Tensor | None) -> Tensor | None:
        return None if inp is None else grad

    return (d_x, None, d_tw, d_w_up, given(d_w_gate, w_gate), d_w_down, given(d_b_up, b_up),
            given(d_b_gate, b_gate), given(d_b_down, b_down), None)


experts_triton.register_autograd(_autograd_backward, setup_context=_setup_context)


# ---- The training form: the forward keeps the pre-activations for the backward. ----------------------
# ``hiermoe::experts_triton_keep`` returns y and, in the re-index order v (P = num_blocks_bound(N, E,
# blk) * blk rows, x's dtype), up and gate before the activation, plus v itself; its backward reads
# them instead of recomputing the two input-side matmuls (the hidden launch then runs one matmul, not
# three). Cost: 2 * P * F elements kept from forward to backward (P * F non-gated), where the torch
# lowering under autograd keeps the dispatched tokens and three [N, F] activations. The lower_kernels
# pass emits it (and a getitem of y) for ops whose inputs require grad unless HIERMOE_TRITON_KEEP=0.
_KEEP_SCHEMA = _EXPERTS_SCHEMA.replace("str activation) -> Tensor",
                                      "str activation, int blk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_KEEP_BACKWARD_SCHEMA = _EXPERTS_BACKWARD_SCHEMA.replace(
    "str activation)", "str activation, Tensor up_PF, Tensor gate_PF, Tensor v_P, Tensor block_expert_B, "
    "Tensor starts_E1)")


@torch.library.triton_op("hiermoe::experts_triton_keep", mutates_args=())
def experts_triton_keep(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str, blk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, up_PF, gate_PF, v_P, block_expert_B, starts_E1): y as ``experts_triton``; the rest is what
    its backward reads (see the note above); ``blk`` the re-index block (``keep_blk``)."""
    _check(x, w_up, w_gate, w_down, activation)
    if INTERPRETED:
        return torch.ops.hiermoe.experts_triton_keep_interpreted(
            x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation, blk)
    return _forward_keep(x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation, blk)


@torch.library.triton_op("hiermoe::experts_triton_backward_keep", mutates_args=())
def experts_triton_backward_keep(
    grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
    w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str,
    up_PF: Tensor, gate_PF: Tensor, v_P: Tensor, block_expert_B: Tensor, starts_E1: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_triton_backward`` reading the kept pre-activations of ``experts_triton_keep``."""
    _check(x, w_up, w_gate, w_down, activation)
    kept = (up_PF, gate_PF, v_P, block_expert_B, starts_E1)
    if INTERPRETED:
        return torch.ops.hiermoe.experts_triton_backward_keep_interpreted(
            grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation, *kept)
    return _backward(grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation,
                     kept)


@torch.library.custom_op("hiermoe::experts_triton_keep_interpreted", mutates_args=(), schema=_KEEP_SCHEMA)
def _keep_interpreted(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None, w_down: Tensor,
    b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str, blk: int,
) -> Kept:
    return _forward_keep(x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation, blk)


@torch.library.custom_op("hiermoe::experts_triton_backward_keep_interpreted", mutates_args=(),
                         schema=_KEEP_BACKWARD_SCHEMA)
def _backward_keep_interpreted(
    grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
    w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None, activation: str,
    up_PF: Tensor, gate_PF: Tensor, v_P: Tensor, block_expert_B: Tensor, starts_E1: Tensor,
) -> Grads:
    return _backward(grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, activation,
                     (up_PF, gate_PF, v_P, block_expert_B, starts_E1))


def _fake_keep(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor, w_gate: Tensor | None,
               w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None, b_down: Tensor | None,
               activation: str, blk: int) -> Kept:
    _check(x, w_up, w_gate, w_down, activation)
    num_e, num_f = w_up.shape[0], w_up.shape[1]
    rows = _keep_rows(topk_idx.shape[0] * topk_idx.shape[1], num_e, blk)
    def i32(n: Any) -> Tensor:
        return torch.empty(n, dtype=torch.int32, device=x.device)

    return (x.new_empty(x.shape, dtype=out_dtype(x, topk_weights)), x.new_empty(rows, num_f),
            x.new_empty(rows if w_gate is not None else 0, num_f),
            i32(rows), i32(rows // blk), i32(num_e + 1))


def _fake_backward_keep(grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_up: Tensor,
                        w_gate: Tensor | None, w_down: Tensor, b_up: Tensor | None, b_gate: Tensor | None,
                        b_down: Tensor | None, activation: str, *kept: Tensor) -> Grads:
    return _fake_backward(grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down,
                          activation)


for _kop, _kf in ((experts_triton_keep, _fake_keep), (_keep_interpreted, _fake_keep),
                  (experts_triton_backward_keep, _fake_backward_keep),
                  (_backward_keep_interpreted, _fake_backward_keep)):
    _kop.register_fake(_kf)


def _setup_context_keep(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    *tensors, activation, _blk = inputs
    ctx.save_for_backward(*tensors, *output[1:])
    ctx.activation = activation


def _autograd_backward_keep(ctx: Any, grad_out: Tensor, *_unused: Tensor) -> tuple[Tensor | None, ...]:
    x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, *kept = ctx.saved_tensors
    grads = torch.ops.hiermoe.experts_triton_backward_keep(
        grad_out, x, topk_idx, topk_weights, w_up, w_gate, w_down, b_up, b_gate, b_down, ctx.activation, *kept)
    return (*_input_grads(grads, w_gate, b_up, b_gate, b_down), None)  # and none for blk


experts_triton_keep.register_autograd(_autograd_backward_keep, setup_context=_setup_context_keep)
