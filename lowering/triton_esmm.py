"""Expert-specific matrix multiplication (ESMM) in Triton: the forward of ``hiermoe::experts_triton``.

HEXA-MoE (papers/hexa-moe.txt) Sec. 4.1-4.2, App. A Alg. 3 and Table 5 (top-k column): each program
takes one block of BLK entries of the re-index vector v (Alg. 1, ``triton_reindex``), all of one
expert, gathers those slots' rows straight from the un-permuted input (x for the first projection,
the slot-indexed hidden h for the second: no dispatched copy of the tokens is made), multiplies by
that one expert's weight tile and adds its bias. Two launches for the FFN (Table 5, steps 1-3):

  up   (blocks x F tiles)  h[s] = act(x[t] W_gate^T + b_gate) * (x[t] W_up^T + b_up)
                           (or act(x[t] W_up^T + b_up) non-gated): the gated activation
                           (SwiGLU / GeGLU) is fused, so up and gate never reach memory.
  down (blocks x H tiles)  y[t] += w[s] * (h[s] W_down^T + b_down): the routing weight is
                           applied in the epilogue, and the top-k results are accumulated
                           either by atomic add into an fp32 [T, H] buffer (HEXA-MoE Sec. 4.2,
                           "Memory Optimization for Top-k Routing", Fig. 5c) or, with
                           combine="slots", stored per slot into an fp32 [N, H] buffer that
                           is summed over K afterwards (deterministic; no atomics needed).

Both grids are 1-D, (block, output tile) pairs in ``block_tile``'s grouped order: ``Tiles.group``
consecutive blocks take all their output tiles before the next blocks start, so the programs
resident at once share a few blocks' gathered rows and a few weight tiles in L2 (on an H100,
bf16, T = 8192, group 8 against all blocks at once: Mixtral's forward 13.1 -> 11.7 ms, its
training step 44.4 -> 38.5 ms, Qwen3-30B-A3B's 10.0 -> 9.0 ms: ``bench/results/kernels_h100_g0.md``
against ``kernels_h100_run1.json``, one lease; per kernel and group: ``tune_groups.json``).

Slot s = t*K + k is token t's k-th choice; h is indexed by slot, so it needs N*F elements, no
padding rows. All pointer offsets that scale with T or N are int64. Accumulation is fp32; h is
stored in x's dtype (what the second matmul reads, as in the torch lowering).

Shape legend: T tokens, K experts per token, N = T*K slots, E experts, H hidden size, F ffn
size, BLK slots per block; x_TH, topk_weights_TK (tw_N flattened, fp32), w_up_EFH, w_gate_EFH,
w_down_EHF, b_up_EF, b_gate_EF, b_down_EH, h_NF, y_TH.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton
from triton.runtime.interpreter import InterpretedFunction

from moe_compile.lowering.experts_ref import ACTIVATIONS, split_activation
from moe_compile.lowering.triton_reindex import Reindex, build_reindex

COMBINES = ("atomic", "slots")
WGRADS = ("estmm", "grouped")


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch: its tile over F, its tile over H, warps and software-pipeline stages.
    Which of F and H is the output tile and which the reduction tile depends on the kernel (see
    each launcher); the M tile is always ``KernelConfig.blk``."""

    block_f: int = 64
    block_h: int = 64
    # 8 warps: ptxas (sm_90, bf16, 64-wide tiles) then fits every kernel without spills; with 4 the
    # fused ESFK spills and the gated up kernel sits at 255 registers
    num_warps: int = 8
    num_stages: int = 3
    # program order (``block_tile``): how many consecutive re-index blocks take all their output
    # tiles before the next blocks start; 0: all blocks at once (each output tile in turn over
    # every block, the order before groups). A runtime argument: values compile once each
    # specialization Triton makes of an int (1, multiples of 16, others), not once per value.
    group: int = 8

    def __post_init__(self) -> None:
        for b in (self.block_f, self.block_h):
            assert b >= 16 and b & (b - 1) == 0, "tile sizes are tl.dot dimensions: powers of two >= 16"
        assert self.group >= 0, "group is a block count (0: all blocks)"

    def launch(self, num_blocks: Any) -> dict[str, Any]:
        """Launch keywords of a kernel over ``num_blocks`` re-index blocks."""
        return dict(BLOCK_F=self.block_f, BLOCK_H=self.block_h, num_warps=self.num_warps,
                    num_stages=self.num_stages, group=self.group or num_blocks)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the forward and backward kernels: one re-index block size and each
    kernel's own tiles (``up`` and ``down``: the forward's two ESMM launches; ``hidden``: the
    backward's first launch, ``kept`` the same reading kept pre-activations; ``esfk``: the fused
    ESTMM/ESMM/ESS launch)."""

    LAUNCHES: ClassVar[tuple[str, ...]] = ("up", "down", "hidden", "esfk", "kept")  # the Tiles fields

    blk: int = 64  # slots per block: the re-index padding unit and the M tile of every ESMM
    up: Tiles = Tiles()
    down: Tiles = Tiles()
    hidden: Tiles = Tiles()
    esfk: Tiles = Tiles()
    # the hidden launch when the forward kept the pre-activations: one matmul (g W_down) instead of
    # three, so its best tile differs
    kept: Tiles = Tiles()
    combine: str = "atomic"  # top-k accumulation of y and dx: "atomic" or "slots"
    fused: bool = True  # backward: one ESFK launch, or ESTMM, ESMM and ESS launched separately
    # backward's weight gradients: "estmm" (the ESTMM range of ESFK) or "grouped" (torch's grouped
    # GEMM over the rows the hidden launch stored in v's order, see triton_esfk)
    wgrad: str = "estmm"
    upcast: bool = False  # tl.dot on fp32 copies of the tiles (the interpreter's bf16 dot is wrong)
    precision: str = "ieee"  # tl.dot input_precision for fp32 tiles: "ieee" or "tf32"

    def __post_init__(self) -> None:
        assert self.combine in COMBINES, self.combine
        assert self.wgrad in WGRADS, self.wgrad
        assert self.blk >= 16 and self.blk & (self.blk - 1) == 0, "blk is a tl.dot dimension: a power of two >= 16"

    @classmethod
    def uniform(cls, blk: int, block_f: int, block_h: int, **kw: object) -> KernelConfig:
        """Every kernel with the same tiles."""
        return cls(blk=blk, **dict.fromkeys(cls.LAUNCHES, Tiles(block_f, block_h)), **kw)  # type: ignore[arg-type]

    def with_groups(self, groups: Mapping[str, int]) -> KernelConfig:
        """This config with the named launches' program groups (``Tiles.group``) replaced."""
        return replace(self, **{k: replace(getattr(self, k), group=v) for k, v in groups.items()})


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def act_fwd(z, ACT: tl.constexpr):
    """act(z) in fp32; ACT indexes ``ACTIVATIONS`` (silu, gelu, gelu_tanh, relu, sigmoid, identity)."""
    if ACT == 0:
        out = z * _sigmoid(z)
    elif ACT == 1:
        out = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACT == 2:  # 0.5 z (1 + tanh(u)) = z sigmoid(2u)
        out = z * _sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif ACT == 3:
        out = tl.maximum(z, 0.0)
    elif ACT == 4:
        out = _sigmoid(z)
    else:
        out = z
    return out


@triton.jit
def act_grad(z, ACT: tl.constexpr):
    """d act(z) / dz in fp32 (the formulas behind aten's silu/gelu/threshold/sigmoid backward)."""
    if ACT == 0:
        s = _sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    elif ACT == 1:
        d = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACT == 2:
        t = 2.0 * _sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z)) - 1.0  # tanh(u)
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    elif ACT == 3:
        d = tl.where(z > 0.0, 1.0, 0.0)
    elif ACT == 4:
        s = _sigmoid(z)
        d = s * (1.0 - s)
    else:
        d = z * 0.0 + 1.0
    return d


@triton.jit
def block_tile(pid, num_blocks, num_tiles, group):
    """(re-index block, output tile) of program ``pid`` of a 1-D grid of num_blocks * num_tiles:
    programs go through ``group`` consecutive blocks at a time, blocks fastest, all output tiles of
    those blocks before the next group (the grouped ordering of Triton's matmul tutorial, "L2 cache
    optimizations"). A wave of resident programs then reads a few blocks' rows and a few weight
    tiles, where blocks-fastest over all blocks streams every gathered row once per output tile
    (Mixtral's up launch at T = 8192: all of x, 128 MB, per F tile). group >= num_blocks gives that
    old order."""
    per_group = group * num_tiles
    first = (pid // per_group) * group
    size = tl.minimum(num_blocks - first, group)
    r = pid % per_group
    return first + r % size, r // size


@triton.jit
def esmm_tile(acc, a_ptr, a_row, row_ok, w_ptr, w_off, s_wo, s_wi, offs_o, num_o, num_in,
              BLOCK_I: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc[BLK, BLOCK_O] += A[a_row, :] @ W[offs_o, :]^T (Alg. 3 inner loop). A has contiguous rows
    of num_in elements, gathered by ``a_row`` (int64 token or slot ids; rows with row_ok False read
    as zeros, i.e. the -1 padding of v); W's element (o, i) is at w_off + o*s_wo + i*s_wi, so any
    weight layout (transposed views, strided slices) is read in place."""
    o_ok = offs_o < num_o
    for i0 in range(0, num_in, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        i_ok = offs_i < num_in
        a = tl.load(a_ptr + a_row[:, None] * num_in + offs_i[None, :], mask=row_ok[:, None] & i_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + w_off + offs_i[:, None] * s_wi + offs_o[None, :] * s_wo,
                    mask=i_ok[:, None] & o_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _esmm_up_kernel(x_ptr, w_up_ptr, w_gate_ptr, b_up_ptr, b_gate_ptr, h_ptr, keep_up_ptr, keep_gate_ptr, v_ptr,
                    block_expert_ptr, num_h, num_f, top_k,
                    s_up_e, s_up_f, s_up_h, s_gate_e, s_gate_f, s_gate_h, s_bup_e, s_bup_f, s_bgate_e, s_bgate_f,
                    num_blocks, group,
                    ACT: tl.constexpr, GATED: tl.constexpr, HAS_B_UP: tl.constexpr, HAS_B_GATE: tl.constexpr,
                    BLK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr, KEEP: tl.constexpr):
    """Table 5 steps 1-2: h[s, f-tile] for the BLK slots of one block (``block_tile``). With KEEP,
    also the pre-activations up (and gate) of every row of the block, stored in v's order for the
    backward."""
    pid_b, pid_f = block_tile(tl.program_id(0), num_blocks, tl.cdiv(num_f, BLOCK_F), group)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= 0:  # blocks past N' hold no slots
        slot = tl.load(v_ptr + pid_b * BLK + tl.arange(0, BLK)).to(tl.int64)
        ok = slot >= 0
        tok = slot // top_k
        e64 = expert.to(tl.int64)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        f_ok = offs_f < num_f
        up = esmm_tile(tl.zeros((BLK, BLOCK_F), tl.float32), x_ptr, tok, ok, w_up_ptr, e64 * s_up_e,
                       s_up_f, s_up_h, offs_f, num_f, num_h, BLOCK_H, UPCAST, PRECISION)
        if HAS_B_UP:
            up += tl.load(b_up_ptr + e64 * s_bup_e + offs_f * s_bup_f, mask=f_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            gate = esmm_tile(tl.zeros((BLK, BLOCK_F), tl.float32), x_ptr, tok, ok, w_gate_ptr, e64 * s_gate_e,
                             s_gate_f, s_gate_h, offs_f, num_f, num_h, BLOCK_H, UPCAST, PRECISION)
            if HAS_B_GATE:
                gate += tl.load(b_gate_ptr + e64 * s_bgate_e + offs_f * s_bgate_f, mask=f_ok,
                                other=0.0).to(tl.float32)[None, :]
            h = act_fwd(gate, ACT) * up
            if KEEP:
                pos = pid_b * BLK + tl.arange(0, BLK).to(tl.int64)
                tl.store(keep_gate_ptr + pos[:, None] * num_f + offs_f[None, :],
                         gate.to(keep_gate_ptr.dtype.element_ty), mask=(pos >= 0)[:, None] & f_ok[None, :])
        else:
            h = act_fwd(up, ACT)
        if KEEP:
            pos = pid_b * BLK + tl.arange(0, BLK).to(tl.int64)
            tl.store(keep_up_ptr + pos[:, None] * num_f + offs_f[None, :], up.to(keep_up_ptr.dtype.element_ty),
                     mask=(pos >= 0)[:, None] & f_ok[None, :])
        tl.store(h_ptr + slot[:, None] * num_f + offs_f[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=ok[:, None] & f_ok[None, :])
    elif KEEP:  # a block past the last expert's: its kept rows are zeros (the op's outputs are defined)
        pos = pid_b * BLK + tl.arange(0, BLK).to(tl.int64)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (pos >= 0)[:, None] & (offs_f < num_f)[None, :]
        zero_q = tl.zeros((BLK, BLOCK_F), tl.float32).to(keep_up_ptr.dtype.element_ty)
        tl.store(keep_up_ptr + pos[:, None] * num_f + offs_f[None, :], zero_q, mask=mask)
        if GATED:
            tl.store(keep_gate_ptr + pos[:, None] * num_f + offs_f[None, :], zero_q, mask=mask)


# @triton.jit made InterpretedFunctions: TRITON_INTERPRET=1 was set when triton was imported.
INTERPRETED = isinstance(_esmm_up_kernel, InterpretedFunction)


@triton.jit
def _esmm_down_kernel(h_ptr, w_down_ptr, b_down_ptr, tw_ptr, out_ptr, v_ptr, block_expert_ptr,
                      num_h, num_f, top_k, s_down_e, s_down_h, s_down_f, s_bdown_e, s_bdown_h, num_blocks, group,
                      HAS_B_DOWN: tl.constexpr, ATOMIC: tl.constexpr, BLK: tl.constexpr,
                      BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Table 5 step 3: w[s] * (h[s] W_down^T + b_down) accumulated into token t's output row."""
    pid_b, pid_h = block_tile(tl.program_id(0), num_blocks, tl.cdiv(num_h, BLOCK_H), group)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= 0:
        slot = tl.load(v_ptr + pid_b * BLK + tl.arange(0, BLK)).to(tl.int64)
        ok = slot >= 0
        e64 = expert.to(tl.int64)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < num_h
        acc = esmm_tile(tl.zeros((BLK, BLOCK_H), tl.float32), h_ptr, slot, ok, w_down_ptr, e64 * s_down_e,
                        s_down_h, s_down_f, offs_h, num_h, num_f, BLOCK_F, UPCAST, PRECISION)
        if HAS_B_DOWN:
            acc += tl.load(b_down_ptr + e64 * s_bdown_e + offs_h * s_bdown_h, mask=h_ok,
                           other=0.0).to(tl.float32)[None, :]
        acc = acc * tl.load(tw_ptr + slot, mask=ok, other=0.0)[:, None]
        mask = ok[:, None] & h_ok[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptr + (slot // top_k)[:, None] * num_h + offs_h[None, :], acc, mask=mask, sem="relaxed")
        else:
            tl.store(out_ptr + slot[:, None] * num_h + offs_h[None, :], acc, mask=mask)


def strides3(w: Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if w is None else (w.stride(0), w.stride(1), w.stride(2))


def strides2(b: Tensor | None) -> tuple[int, int]:
    return (0, 0) if b is None else (b.stride(0), b.stride(1))


def esmm_forward(
    x_TH: Tensor, topk_idx_TK: Tensor, tw_N: Tensor,
    w_up_EFH: Tensor, w_gate_EFH: Tensor | None, w_down_EHF: Tensor,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str, cfg: KernelConfig, r: Reindex | None = None,
    keep: tuple[Tensor, Tensor | None] | None = None, out_dtype: torch.dtype | None = None,
) -> Tensor:
    """y_TH of ``hiermoe::experts`` with two ESMM launches after the re-index (x_TH contiguous,
    tw_N the flattened routing weights in fp32). Returns y_TH in ``out_dtype`` (None: x's dtype). ``keep``: (up_PF,
    gate_PF or None) buffers of P = len(r.v_P) rows in x's dtype, filled with the pre-activations of
    every row of every used block of v (what ``esfk_backward(kept=...)`` reads instead of
    recomputing them; rows of unused blocks are zeros)."""
    num_t, num_h = x_TH.shape
    num_k = topk_idx_TK.shape[1]
    num_e, num_f = w_up_EFH.shape[0], w_up_EFH.shape[1]
    if r is None:
        r = build_reindex(topk_idx_TK, num_e, cfg.blk)
    num_blocks = r.block_expert_B.shape[0]
    absent = x_TH  # stands in for a missing optional tensor; its HAS_* flag keeps it unread
    h_NF = x_TH.new_empty(num_t * num_k, num_f)
    wrap_triton(_esmm_up_kernel)[(num_blocks * triton.cdiv(num_f, cfg.up.block_f),)](
        x_TH, w_up_EFH, absent if w_gate_EFH is None else w_gate_EFH,
        absent if b_up_EF is None else b_up_EF, absent if b_gate_EF is None else b_gate_EF,
        h_NF, absent if keep is None else keep[0], absent if keep is None or keep[1] is None else keep[1],
        r.v_P, r.block_expert_B, num_h, num_f, num_k,
        *strides3(w_up_EFH), *strides3(w_gate_EFH), *strides2(b_up_EF), *strides2(b_gate_EF), num_blocks,
        ACT=ACTIVATIONS.index(split_activation(activation)[0]), GATED=w_gate_EFH is not None, HAS_B_UP=b_up_EF is not None,
        HAS_B_GATE=b_gate_EF is not None, BLK=cfg.blk, UPCAST=cfg.upcast, PRECISION=cfg.precision,
        KEEP=keep is not None, **cfg.up.launch(num_blocks),
    )
    atomic = cfg.combine == "atomic"
    rows = num_t if atomic else num_t * num_k
    out = torch.zeros(rows, num_h, dtype=torch.float32, device=x_TH.device)
    wrap_triton(_esmm_down_kernel)[(num_blocks * triton.cdiv(num_h, cfg.down.block_h),)](
        h_NF, w_down_EHF, absent if b_down_EH is None else b_down_EH, tw_N, out, r.v_P, r.block_expert_B,
        num_h, num_f, num_k, *strides3(w_down_EHF), *strides2(b_down_EH), num_blocks,
        HAS_B_DOWN=b_down_EH is not None, ATOMIC=atomic, BLK=cfg.blk, UPCAST=cfg.upcast, PRECISION=cfg.precision,
        **cfg.down.launch(num_blocks),
    )
    y_TH = out if atomic else out.view(num_t, num_k, num_h).sum(1)  # fixed order over k
    return y_TH.to(out_dtype or x_TH.dtype)
