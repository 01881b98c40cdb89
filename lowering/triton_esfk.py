"""Backward of ``hiermoe::experts_triton``: ESMM with transposed weights, ESS, ESTMM and the fused
expert-specific kernel ESFK (HEXA-MoE, papers/hexa-moe.txt Sec. 4.2 "Fused Kernel in Backward
Propagation", App. A Alg. 2-4, Table 5 steps 4-10 top-k column, Table 6).

Two launches after the re-index (nothing but the op's inputs is saved by forward; the training
form ``experts_triton_keep`` also passes the forward's pre-activations, and the hidden launch then
runs one matmul with its own tiles, ``KernelConfig.kept``):

  hidden (blocks x F tiles, ``block_tile``'s grouped order; Table 5 steps 6-7, routing-weight gradient)
      recompute up, gate (ESMM over x), dhu[s] = g[t] W_down[e] (ESMM with the transposed
      down weight; g = dL/dy), then h = act(gate) * up, dh = w[s] dhu[s],
      d_up = dh act(gate), d_gate = dh up act'(gate) (non-gated: d_up = dh act'(up)), and the
      routing weight's gradient dL/dw[s] = <g[t], y_e[s]> = <dhu[s], h[s]> + <g[t], b_down[e]>
      (so y_e is never recomputed), summed over F tiles from a per-(slot, tile) partial buffer.
      Stores h, d_up, d_gate in v's order ([P, F], P = blocks x BLK, x's dtype; a padding entry's
      d_up and d_gate rows are zero, as w = 0 there, and its h row only ever meets zero rows of
      w g), so the launch below reads them as contiguous rows instead of gathering them through v
      (on an H100, Mixtral shape, T=8192: this launch 16.1 -> 13.5 ms; the ESTMM, which still
      gathers x and g by token, stayed at 36 ms, bench/results/tune_kernels.md).
  ESFK (one 1-D grid of three program ranges, HEXA-MoE's fused kernel with equal-shape blocks)
      ESTMM  dW_up[e] = sum_s d_up[s]^T x[t], dW_gate[e] likewise, dW_down[e] = sum_s (w[s] g[t])^T h[s]
             (Alg. 4; Table 5 steps 5, 9): one program per (expert, output tile), looping over that
             expert's blocks of v from starts[e] to starts[e+1].
      ESMM   dx[t] += d_up[s] W_up[e] + d_gate[s] W_gate[e] (Table 5 step 10), accumulated over the
             top-k like the forward's y: atomic add into fp32 [T, H] or per-slot [N, H] + sum;
             (block, H tile) programs in ``block_tile``'s grouped order (Mixtral's shape on an
             H100: all blocks at once streamed each expert's whole W_up and W_gate once per few
             blocks; grouped, the backward took 29.8 -> 25.2 ms at T = 8192).
      ESS    db_up[e] = sum_s d_up[s], db_gate[e], db_down[e] = sum_s w[s] g[t] (Alg. 2; steps 4, 8).
  The ESTMM range comes first in the grid: its programs loop over a whole expert (the longest
  work) and start earliest. With ``KernelConfig.fused = False`` the same kernel is launched three
  times, one range each (the unfused ESTMM / ESMM / ESS reference for tests and benchmarks).

As in the torch lowering, gradients of weights are returned in the weights' dtypes, dx in x's,
dL/dw in topk_weights'; accumulation is fp32 throughout.

Shape legend: T tokens, K experts per token, N = T*K slots, P = positions of v (blocks x BLK),
E experts, H hidden, F ffn, BLK slots per block; g_TH (grad of y), x_TH, tw_N (fp32 routing
weights), h_PF, d_up_PF, d_gate_PF, dw_part_NJ (J = F tiles), dx_TH, d_w_up_EFH, d_w_gate_EFH,
d_w_down_EHF, d_b_up_EF, d_b_gate_EF, d_b_down_EH.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from moe_compile.lowering.experts_ref import _GROUPED_MM_DTYPES, ACTIVATIONS, split_activation
from moe_compile.lowering.triton_esmm import (
    INTERPRETED,
    KernelConfig,
    act_fwd,
    act_grad,
    block_tile,
    esmm_tile,
    strides2,
    strides3,
)
from moe_compile.lowering.triton_reindex import Reindex, build_reindex


@triton.jit
def _hidden_grad_kernel(x_ptr, g_ptr, tw_ptr, w_up_ptr, w_gate_ptr, w_down_ptr, b_up_ptr, b_gate_ptr, b_down_ptr,
                        keep_up_ptr, keep_gate_ptr, h_ptr, d_up_ptr, d_gate_ptr, dw_part_ptr, v_ptr, block_expert_ptr,
                        num_h, num_f, top_k,
                        s_up_e, s_up_f, s_up_h, s_gate_e, s_gate_f, s_gate_h, s_down_e, s_down_h, s_down_f,
                        s_bup_e, s_bup_f, s_bgate_e, s_bgate_f, s_bdown_e, s_bdown_h, num_blocks, group,
                        ACT: tl.constexpr, GATED: tl.constexpr, HAS_B_UP: tl.constexpr, HAS_B_GATE: tl.constexpr,
                        HAS_B_DOWN: tl.constexpr, BLK: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_H: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        ZERO_UNUSED: tl.constexpr, KEPT: tl.constexpr):
    num_ft = tl.cdiv(num_f, BLOCK_F)
    pid_b, pid_f = block_tile(tl.program_id(0), num_blocks, num_ft, group)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= 0:
        pos = pid_b * BLK + tl.arange(0, BLK).to(tl.int64)
        slot = tl.load(v_ptr + pos).to(tl.int64)
        ok = slot >= 0
        tok = slot // top_k
        e64 = expert.to(tl.int64)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        f_ok = offs_f < num_f
        mask = (pos >= 0)[:, None] & f_ok[None, :]  # every row of the block: padding rows store zeros
        zero = tl.zeros((BLK, BLOCK_F), tl.float32)
        if KEPT:  # the forward stored the pre-activations (bias included) in v's order
            up = tl.load(keep_up_ptr + pos[:, None] * num_f + offs_f[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            up = esmm_tile(zero, x_ptr, tok, ok, w_up_ptr, e64 * s_up_e, s_up_f, s_up_h, offs_f, num_f, num_h,
                           BLOCK_H, UPCAST, PRECISION)
            if HAS_B_UP:
                up += tl.load(b_up_ptr + e64 * s_bup_e + offs_f * s_bup_f, mask=f_ok,
                              other=0.0).to(tl.float32)[None, :]
        # ESMM with W_down^T: element (o=f, i=h) of the operand is w_down[e, h, f]
        dhu = esmm_tile(zero, g_ptr, tok, ok, w_down_ptr, e64 * s_down_e, s_down_f, s_down_h, offs_f, num_f, num_h,
                        BLOCK_H, UPCAST, PRECISION)
        w = tl.load(tw_ptr + slot, mask=ok, other=0.0)
        if GATED:
            if KEPT:
                gate = tl.load(keep_gate_ptr + pos[:, None] * num_f + offs_f[None, :], mask=mask,
                               other=0.0).to(tl.float32)
            else:
                gate = esmm_tile(zero, x_ptr, tok, ok, w_gate_ptr, e64 * s_gate_e, s_gate_f, s_gate_h, offs_f,
                                 num_f, num_h, BLOCK_H, UPCAST, PRECISION)
                if HAS_B_GATE:
                    gate += tl.load(b_gate_ptr + e64 * s_bgate_e + offs_f * s_bgate_f, mask=f_ok,
                                    other=0.0).to(tl.float32)[None, :]
            a = act_fwd(gate, ACT)
            h = a * up
            dh = dhu * w[:, None]
            d_up = dh * a
            d_gate = dh * up * act_grad(gate, ACT)
            tl.store(d_gate_ptr + pos[:, None] * num_f + offs_f[None, :], d_gate.to(d_gate_ptr.dtype.element_ty),
                     mask=mask)
        else:
            h = act_fwd(up, ACT)
            d_up = dhu * w[:, None] * act_grad(up, ACT)
        h_q = h.to(h_ptr.dtype.element_ty)  # what the forward's second matmul read
        tl.store(h_ptr + pos[:, None] * num_f + offs_f[None, :], h_q, mask=mask)
        tl.store(d_up_ptr + pos[:, None] * num_f + offs_f[None, :], d_up.to(d_up_ptr.dtype.element_ty), mask=mask)
        part = tl.sum(dhu * h_q.to(tl.float32), axis=1)
        if HAS_B_DOWN:
            if pid_f == 0:  # <g[t], b_down[e]> once per slot
                for h0 in range(0, num_h, BLOCK_H):
                    offs_h = h0 + tl.arange(0, BLOCK_H)
                    h_ok = offs_h < num_h
                    gt = tl.load(g_ptr + tok[:, None] * num_h + offs_h[None, :], mask=ok[:, None] & h_ok[None, :],
                                 other=0.0).to(tl.float32)
                    bd = tl.load(b_down_ptr + e64 * s_bdown_e + offs_h * s_bdown_h, mask=h_ok, other=0.0)
                    part += tl.sum(gt * bd.to(tl.float32)[None, :], axis=1)
        tl.store(dw_part_ptr + slot * num_ft + pid_f, part, mask=ok)
    elif ZERO_UNUSED:  # a block past the last expert's: zero rows, so a grouped GEMM may read them
        pos = pid_b * BLK + tl.arange(0, BLK).to(tl.int64)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (pos >= 0)[:, None] & (offs_f < num_f)[None, :]
        zero_q = tl.zeros((BLK, BLOCK_F), tl.float32).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + pos[:, None] * num_f + offs_f[None, :], zero_q, mask=mask)
        tl.store(d_up_ptr + pos[:, None] * num_f + offs_f[None, :], zero_q, mask=mask)
        if GATED:
            tl.store(d_gate_ptr + pos[:, None] * num_f + offs_f[None, :], zero_q, mask=mask)


@triton.jit
def _rows(slot, pos, top_k, TOKEN: tl.constexpr):
    """The rows a block of v reads, and which are valid: its slots' tokens (slot // K, where
    slot >= 0) for token-indexed tensors (x, g), else its own positions in v for the tensors the
    hidden launch stored in v's order (h, d_up, d_gate: every row is read; see the module note on
    padding rows)."""
    if TOKEN:
        row = slot // top_k
        ok = slot >= 0
    else:
        row = pos
        ok = pos >= 0
    return row, ok


@triton.jit
def _estmm_tile(out_ptr, expert, start, end, a_ptr, num_a, tile_a, b_ptr, num_b, tile_b, tw_ptr, v_ptr, top_k,
                A_TOKEN: tl.constexpr, A_WEIGHTED: tl.constexpr, B_TOKEN: tl.constexpr, BLK: tl.constexpr,
                BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """out[e, a-tile, b-tile] = sum over expert e's slots s of A[s]^T B[s] (Alg. 4). Rows of A and B
    are gathered by token (t = s // K) or read at the slot's position in v; A_WEIGHTED multiplies
    A's row by w[s]."""
    offs_a = tile_a * BLOCK_A + tl.arange(0, BLOCK_A)
    offs_b = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    a_ok = offs_a < num_a
    b_ok = offs_b < num_b
    acc = tl.zeros((BLOCK_A, BLOCK_B), tl.float32)
    for p in range(start, end, BLK):
        pos = p + tl.arange(0, BLK).to(tl.int64)
        slot = tl.load(v_ptr + pos).to(tl.int64)
        row_a, ok_a = _rows(slot, pos, top_k, A_TOKEN)
        row_b, ok_b = _rows(slot, pos, top_k, B_TOKEN)
        a = tl.load(a_ptr + row_a[:, None] * num_a + offs_a[None, :], mask=ok_a[:, None] & a_ok[None, :],
                    other=0.0)
        if A_WEIGHTED:  # (w g) rounded to the compute dtype, as the torch lowering's dy
            w = tl.load(tw_ptr + slot, mask=slot >= 0, other=0.0)
            a = (a.to(tl.float32) * w[:, None]).to(a_ptr.dtype.element_ty)
        b = tl.load(b_ptr + row_b[:, None] * num_b + offs_b[None, :], mask=ok_b[:, None] & b_ok[None, :],
                    other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    out = out_ptr + expert.to(tl.int64) * num_a * num_b
    tl.store(out + offs_a[:, None] * num_b + offs_b[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=a_ok[:, None] & b_ok[None, :])


@triton.jit
def _ess_tile(out_ptr, expert, start, end, a_ptr, num_a, tile_a, tw_ptr, v_ptr, top_k,
              A_TOKEN: tl.constexpr, A_WEIGHTED: tl.constexpr, BLK: tl.constexpr, BLOCK_A: tl.constexpr):
    """out[e, a-tile] = sum over expert e's slots s of A[s] (Alg. 2), in fp32."""
    offs_a = tile_a * BLOCK_A + tl.arange(0, BLOCK_A)
    a_ok = offs_a < num_a
    acc = tl.zeros((BLOCK_A,), tl.float32)
    for p in range(start, end, BLK):
        pos = p + tl.arange(0, BLK).to(tl.int64)
        slot = tl.load(v_ptr + pos).to(tl.int64)
        row, ok = _rows(slot, pos, top_k, A_TOKEN)
        a = tl.load(a_ptr + row[:, None] * num_a + offs_a[None, :], mask=ok[:, None] & a_ok[None, :],
                    other=0.0).to(tl.float32)
        if A_WEIGHTED:
            a = a * tl.load(tw_ptr + slot, mask=slot >= 0, other=0.0)[:, None]
        acc += tl.sum(a, axis=0)
    tl.store(out_ptr + expert.to(tl.int64) * num_a + offs_a, acc.to(out_ptr.dtype.element_ty), mask=a_ok)


@triton.jit
def _esfk_kernel(x_ptr, g_ptr, tw_ptr, h_ptr, d_up_ptr, d_gate_ptr, w_up_ptr, w_gate_ptr,
                 dx_ptr, dw_up_ptr, dw_gate_ptr, dw_down_ptr, db_up_ptr, db_gate_ptr, db_down_ptr,
                 v_ptr, block_expert_ptr, starts_ptr, num_experts, num_blocks, num_h, num_f, top_k,
                 s_up_e, s_up_f, s_up_h, s_gate_e, s_gate_f, s_gate_h, group,
                 GATED: tl.constexpr, HAS_B_UP: tl.constexpr, HAS_B_GATE: tl.constexpr, HAS_B_DOWN: tl.constexpr,
                 ATOMIC: tl.constexpr, DO_ESTMM: tl.constexpr, DO_ESMM: tl.constexpr, DO_ESS: tl.constexpr,
                 BLK: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n_f = tl.cdiv(num_f, BLOCK_F)
    n_h = tl.cdiv(num_h, BLOCK_H)
    tiles = n_f * n_h
    per_expert = (2 + GATED) * tiles  # weight tiles of one expert: up, down (, gate)
    n_estmm = num_experts * per_expert * DO_ESTMM
    n_esmm = num_blocks * n_h * DO_ESMM
    if pid < n_estmm:
        e = pid // per_expert
        r = pid % per_expert
        mat = r // tiles
        t = r % tiles
        start = tl.load(starts_ptr + e)
        end = tl.load(starts_ptr + e + 1)
        if mat == 0:  # dW_up[e] [F, H]: A = d_up rows (position in v), B = x rows (token)
            _estmm_tile(dw_up_ptr, e, start, end, d_up_ptr, num_f, t // n_h, x_ptr, num_h, t % n_h, tw_ptr, v_ptr,
                        top_k, False, False, True, BLK, BLOCK_F, BLOCK_H, UPCAST, PRECISION)
        elif mat == 1:  # dW_down[e] [H, F]: A = w * g rows (token), B = h rows (position in v)
            _estmm_tile(dw_down_ptr, e, start, end, g_ptr, num_h, t // n_f, h_ptr, num_f, t % n_f, tw_ptr, v_ptr,
                        top_k, True, True, False, BLK, BLOCK_H, BLOCK_F, UPCAST, PRECISION)
        else:
            if GATED:
                _estmm_tile(dw_gate_ptr, e, start, end, d_gate_ptr, num_f, t // n_h, x_ptr, num_h, t % n_h, tw_ptr,
                            v_ptr, top_k, False, False, True, BLK, BLOCK_F, BLOCK_H, UPCAST, PRECISION)
    elif pid < n_estmm + n_esmm:
        b, tile_h = block_tile(pid - n_estmm, num_blocks, n_h, group)
        expert = tl.load(block_expert_ptr + b)
        if expert >= 0:
            pos = b * BLK + tl.arange(0, BLK).to(tl.int64)
            slot = tl.load(v_ptr + pos).to(tl.int64)
            ok = slot >= 0
            e64 = expert.to(tl.int64)
            offs_h = tile_h * BLOCK_H + tl.arange(0, BLOCK_H)
            # ESMM with W_up (not transposed: element (o=h, i=f) is w_up[e, f, h])
            acc = esmm_tile(tl.zeros((BLK, BLOCK_H), tl.float32), d_up_ptr, pos, pos >= 0, w_up_ptr, e64 * s_up_e,
                            s_up_h, s_up_f, offs_h, num_h, num_f, BLOCK_F, UPCAST, PRECISION)
            if GATED:
                acc = esmm_tile(acc, d_gate_ptr, pos, pos >= 0, w_gate_ptr, e64 * s_gate_e, s_gate_h, s_gate_f, offs_h,
                                num_h, num_f, BLOCK_F, UPCAST, PRECISION)
            mask = ok[:, None] & (offs_h < num_h)[None, :]
            if ATOMIC:
                tl.atomic_add(dx_ptr + (slot // top_k)[:, None] * num_h + offs_h[None, :], acc, mask=mask,
                              sem="relaxed")
            else:
                tl.store(dx_ptr + slot[:, None] * num_h + offs_h[None, :], acc, mask=mask)
    elif DO_ESS:
        q = pid - n_estmm - n_esmm
        n_bu = 0  # programs of the db_up range (none without b_up), then of db_gate
        if HAS_B_UP:
            n_bu = num_experts * n_f
        n_bg = 0
        if HAS_B_GATE:
            n_bg = num_experts * n_f
        if q < n_bu:
            e = q // n_f
            _ess_tile(db_up_ptr, e, tl.load(starts_ptr + e), tl.load(starts_ptr + e + 1), d_up_ptr, num_f, q % n_f,
                      tw_ptr, v_ptr, top_k, False, False, BLK, BLOCK_F)
        elif q < n_bu + n_bg:
            e = (q - n_bu) // n_f
            _ess_tile(db_gate_ptr, e, tl.load(starts_ptr + e), tl.load(starts_ptr + e + 1), d_gate_ptr, num_f,
                      (q - n_bu) % n_f, tw_ptr, v_ptr, top_k, False, False, BLK, BLOCK_F)
        else:
            e = (q - n_bu - n_bg) // n_h
            _ess_tile(db_down_ptr, e, tl.load(starts_ptr + e), tl.load(starts_ptr + e + 1), g_ptr, num_h,
                      (q - n_bu - n_bg) % n_h, tw_ptr, v_ptr, top_k, True, True, BLK, BLOCK_H)


def _esfk_ranges(num_e: int, num_blocks: int, num_h: int, num_f: int, cfg: KernelConfig, gated: bool,
                 biases: tuple[bool, bool, bool]) -> tuple[int, int, int]:
    """Program counts of the ESTMM, ESMM and ESS ranges (must match _esfk_kernel's arithmetic)."""
    n_f, n_h = triton.cdiv(num_f, cfg.esfk.block_f), triton.cdiv(num_h, cfg.esfk.block_h)
    has_up, has_gate, has_down = biases
    return (num_e * (2 + gated) * n_f * n_h, num_blocks * n_h,
            num_e * (n_f * has_up + n_f * has_gate + n_h * has_down))


def _empty_like(t: Tensor | None) -> Tensor | None:
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def esfk_backward(
    g_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor, tw_N: Tensor,
    w_up_EFH: Tensor, w_gate_EFH: Tensor | None, w_down_EHF: Tensor,
    b_up_EF: Tensor | None, b_gate_EF: Tensor | None, b_down_EH: Tensor | None,
    activation: str, cfg: KernelConfig, r: Reindex | None = None,
    kept: tuple[Tensor, Tensor | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(dx_TH, d_tw_N (fp32), d_w_up, d_w_gate, d_w_down, d_b_up, d_b_gate, d_b_down); an absent
    optional input gets None. g_TH and x_TH contiguous, tw_N fp32. ``kept``: the (up_PF, gate_PF)
    pre-activations ``esmm_forward(keep=...)`` stored for the same re-index ``r`` (then the hidden
    launch reads them instead of recomputing two of its three matmuls)."""
    num_t, num_h = x_TH.shape
    num_k = topk_idx_TK.shape[1]
    num_e, num_f = w_up_EFH.shape[0], w_up_EFH.shape[1]
    gated = w_gate_EFH is not None
    if r is None:
        r = build_reindex(topk_idx_TK, num_e, cfg.blk)
    num_blocks = r.block_expert_B.shape[0]
    dev = x_TH.device
    absent = x_TH
    common = dict(BLK=cfg.blk, UPCAST=cfg.upcast, PRECISION=cfg.precision)
    grouped = cfg.wgrad == "grouped"

    # Step 1: recompute h; dhu = g W_down (ESMM, transposed weight); activation backward; dL/dw partials.
    hidden = cfg.hidden if kept is None else cfg.kept
    num_ft = triton.cdiv(num_f, hidden.block_f)
    h_PF = x_TH.new_empty(r.v_P.shape[0], num_f)  # in v's order (rows of unused blocks are never read)
    d_up_PF = torch.empty_like(h_PF)
    d_gate_PF = torch.empty_like(h_PF) if gated else absent
    dw_part_NJ = torch.zeros(num_t * num_k, num_ft, dtype=torch.float32, device=dev)
    wrap_triton(_hidden_grad_kernel)[(num_blocks * num_ft,)](
        x_TH, g_TH, tw_N, w_up_EFH, absent if w_gate_EFH is None else w_gate_EFH, w_down_EHF,
        absent if b_up_EF is None else b_up_EF, absent if b_gate_EF is None else b_gate_EF,
        absent if b_down_EH is None else b_down_EH, absent if kept is None else kept[0],
        absent if kept is None or kept[1] is None else kept[1], h_PF, d_up_PF, d_gate_PF, dw_part_NJ,
        r.v_P, r.block_expert_B, num_h, num_f, num_k,
        *strides3(w_up_EFH), *strides3(w_gate_EFH), *strides3(w_down_EHF),
        *strides2(b_up_EF), *strides2(b_gate_EF), *strides2(b_down_EH), num_blocks,
        ACT=ACTIVATIONS.index(split_activation(activation)[0]), GATED=gated, HAS_B_UP=b_up_EF is not None,
        HAS_B_GATE=b_gate_EF is not None, HAS_B_DOWN=b_down_EH is not None, ZERO_UNUSED=grouped, KEPT=kept is not None, **common,
        **hidden.launch(num_blocks),
    )
    d_tw_N = dw_part_NJ.sum(1)

    # Step 2: ESTMM + ESMM + ESS, fused into one launch (or three).
    atomic = cfg.combine == "atomic"
    dx_acc = torch.zeros(num_t if atomic else num_t * num_k, num_h, dtype=torch.float32, device=dev)
    if grouped:  # Step 3 makes them
        d_w_up, d_w_gate, d_w_down = x_TH.new_empty(0), None, x_TH.new_empty(0)
    else:
        d_w_up = torch.empty(w_up_EFH.shape, dtype=w_up_EFH.dtype, device=dev)
        d_w_gate = _empty_like(w_gate_EFH)
        d_w_down = torch.empty(w_down_EHF.shape, dtype=w_down_EHF.dtype, device=dev)
    d_b_up, d_b_gate, d_b_down = (_empty_like(b) for b in (b_up_EF, b_gate_EF, b_down_EH))
    biases = (b_up_EF is not None, b_gate_EF is not None, b_down_EH is not None)
    ranges = _esfk_ranges(num_e, num_blocks, num_h, num_f, cfg, gated, biases)
    parts = [(1, 1, 1)] if cfg.fused else [(1, 0, 0), (0, 1, 0), (0, 0, 1)]
    if grouped:  # the weight gradients by grouped GEMM (Step 3), the rest of ESFK as before
        parts = [(0, 1, 1)] if cfg.fused else [(0, 1, 0), (0, 0, 1)]
    for do_estmm, do_esmm, do_ess in parts:
        grid = ranges[0] * do_estmm + ranges[1] * do_esmm + ranges[2] * do_ess
        if grid == 0:
            continue
        wrap_triton(_esfk_kernel)[(grid,)](
            x_TH, g_TH, tw_N, h_PF, d_up_PF, d_gate_PF, w_up_EFH, absent if w_gate_EFH is None else w_gate_EFH,
            dx_acc, d_w_up, absent if d_w_gate is None else d_w_gate, d_w_down,
            absent if d_b_up is None else d_b_up, absent if d_b_gate is None else d_b_gate,
            absent if d_b_down is None else d_b_down,
            r.v_P, r.block_expert_B, r.starts_E1, num_e, num_blocks, num_h, num_f, num_k,
            *strides3(w_up_EFH), *strides3(w_gate_EFH),
            GATED=gated, HAS_B_UP=biases[0], HAS_B_GATE=biases[1], HAS_B_DOWN=biases[2], ATOMIC=atomic,
            DO_ESTMM=do_estmm, DO_ESMM=do_esmm, DO_ESS=do_ess, **common, **cfg.esfk.launch(num_blocks),
        )
    if grouped:
        d_w_up, d_w_gate, d_w_down = _grouped_wgrad(g_TH, x_TH, tw_N, h_PF, d_up_PF, d_gate_PF if gated else None,
                                                    r, num_k)
        d_w_up, d_w_down = d_w_up.to(w_up_EFH.dtype), d_w_down.to(w_down_EHF.dtype)
        if d_w_gate is not None and w_gate_EFH is not None:
            d_w_gate = d_w_gate.to(w_gate_EFH.dtype)
    dx_TH = dx_acc if atomic else dx_acc.view(num_t, num_k, num_h).sum(1)
    return dx_TH.to(x_TH.dtype), d_tw_N, d_w_up, d_w_gate, d_w_down, d_b_up, d_b_gate, d_b_down


@triton.jit
def _gather_rows_kernel(src_ptr, tw_ptr, v_ptr, out_ptr, num_rows, num_h, top_k, WEIGHTED: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[p] = src[v[p] // K], times w[v[p]] in fp32 with WEIGHTED and rounded once to out's dtype;
    zero where v[p] = -1 (padding)."""
    pos = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    p_ok = pos < num_rows
    slot = tl.load(v_ptr + pos, mask=p_ok, other=-1).to(tl.int64)
    ok = slot >= 0
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < num_h
    row = tl.load(src_ptr + (slot // top_k)[:, None] * num_h + offs_h[None, :], mask=ok[:, None] & h_ok[None, :],
                  other=0.0)
    if WEIGHTED:
        row = row.to(tl.float32) * tl.load(tw_ptr + slot, mask=ok, other=0.0)[:, None]
    tl.store(out_ptr + pos[:, None] * num_h + offs_h[None, :], row.to(out_ptr.dtype.element_ty),
             mask=p_ok[:, None] & h_ok[None, :])


def gather_rows(src_TH: Tensor, v_P: Tensor, num_k: int, tw_N: Tensor | None = None) -> Tensor:
    """[P, H] rows of ``src_TH`` in v's order (row p = src[v[p] // K], zero at padding), each times
    its slot's routing weight where ``tw_N`` (fp32) is given: one read of the rows and one write,
    where index_select, the weight product in fp32, the cast and the padding mask each took a pass
    over [P, H] (the fp32 product alone 2 GB at Qwen3-30B-A3B's shape, T = 32768)."""
    num_rows, num_h = v_P.shape[0], src_TH.shape[1]
    out = src_TH.new_empty(num_rows, num_h)
    block_r = 16 if INTERPRETED else 32
    block_h = min(32 if INTERPRETED else 256, triton.next_power_of_2(num_h))
    wrap_triton(_gather_rows_kernel)[(triton.cdiv(num_rows, block_r), triton.cdiv(num_h, block_h))](
        src_TH, src_TH if tw_N is None else tw_N, v_P, out, num_rows, num_h, num_k, WEIGHTED=tw_N is not None,
        BLOCK_R=block_r, BLOCK_H=block_h)
    return out


def grouped_wgrad_ok(dtype: torch.dtype, device: torch.device, num_h: int, num_f: int) -> bool:
    """Whether torch's grouped GEMM takes the backward's weight-gradient operands: a dtype it
    multiplies on ``device`` (CUDA: bf16 from sm_80 on; CPU: fp32/fp16/bf16) and rows of H and F
    elements that are 16-byte multiples (its stride rule)."""
    if dtype not in _GROUPED_MM_DTYPES.get(device.type, ()):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return (num_h * dtype.itemsize) % 16 == 0 and (num_f * dtype.itemsize) % 16 == 0


def _grouped_wgrad(g_TH: Tensor, x_TH: Tensor, tw_N: Tensor, h_PF: Tensor, d_up_PF: Tensor,
                   d_gate_PF: Tensor | None, r: Reindex, num_k: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """Step 3 with ``KernelConfig.wgrad = "grouped"``: the ESTMM's three weight gradients
    (HEXA-MoE Alg. 4, Table 5 steps 5, 9) as grouped GEMMs whose groups are the experts' runs of v,
    ``starts_E1[1:]`` their ends (every run a whole number of BLK blocks):

        dW_up[e]   = d_up_P[run e]^T   x_P[run e]       x_P[p] = x[v[p] // K], 0 where v[p] = -1
        dW_gate[e] = d_gate_P[run e]^T x_P[run e]
        dW_down[e] = wg_P[run e]^T     h_P[run e]       wg_P[p] = w[v[p]] g[v[p] // K]

    The hidden launch stored h, d_up and d_gate in v's order, zero in the blocks past the last run,
    so only x and w g are gathered, by ``gather_rows`` (one [P, H] buffer at a time). Returns (dW_up, dW_gate or None,
    dW_down) in the operands' dtype (fp32 accumulation inside the GEMM)."""
    ends_E = r.starts_E1[1:]
    x_PH = gather_rows(x_TH, r.v_P, num_k)
    d_w_up = torch._grouped_mm(d_up_PF.t(), x_PH, offs=ends_E)
    d_w_gate = None if d_gate_PF is None else torch._grouped_mm(d_gate_PF.t(), x_PH, offs=ends_E)
    del x_PH
    wg_PH = gather_rows(g_TH, r.v_P, num_k, tw_N)
    return d_w_up, d_w_gate, torch._grouped_mm(wg_PH.t(), h_PF, offs=ends_E)
