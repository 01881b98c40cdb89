"""Re-index vector construction for the expert-specific Triton kernels (HEXA-MoE App. A, Alg. 1).

The re-index vector v lists the token-slot ids (slot = t*K + k) grouped by expert, each expert's
group padded with -1 up to a multiple of the block size BLK, so that every block of BLK entries
belongs to one expert; ``block_expert_B[b]`` is that expert (-1 for an unused block) and
``starts_E1`` is Alg. 1's idx vector (idx[0] = 0, idx[E] = N', the used length of v).

Differences from Alg. 1, and why:
  * Positions come from per-chunk histograms and prefix sums instead of an atomicAdd per slot, so
    v is deterministic and *stable*: inside an expert, slots keep token order (the same order as
    the torch lowering's stable argsort). Three launches: count (one histogram per chunk of
    CHUNK slots), scan (one program: prefix sums over chunks and over experts), scatter.
  * v and block_expert_B have a static length, the worst case over all routings,
    P = BLK * num_blocks with num_blocks = (N + E * (BLK - 1)) // BLK, so no size is read back to
    the host (no device sync, symbolic T works; the kernels that follow skip blocks whose expert
    is -1).
    The used prefix N' = starts_E1[E] is at most N + E*(BLK - 1): each non-empty expert is padded by
    at most BLK - 1 slots, an empty expert by none.
  * Expert ids outside [0, E) are skipped (never read or written out of bounds); the op's
    contract is ids in [0, E).

Shape legend: T tokens, K experts per token, N = T*K slots, E experts, C chunks of CHUNK slots,
P padded length of v, B = P / BLK blocks. idx_N (flattened topk_idx), counts_CE, chunk_off_CE
(slots of expert e in earlier chunks), starts_E1, v_P, block_expert_B.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton


class Reindex(NamedTuple):
    v_P: Tensor  # int32 slot ids grouped by expert, -1 = padding
    block_expert_B: Tensor  # int32 expert of each block of BLK entries of v, -1 = unused block
    starts_E1: Tensor  # int32 start of each expert's group in v; starts_E1[E] = N'
    blk: int


def num_blocks_bound(num_slots: int, num_experts: int, blk: int) -> int:
    """Most blocks any routing of ``num_slots`` slots over ``num_experts`` experts can need:
    sum_e ceil(c_e / BLK) <= sum_e (c_e + BLK - 1) / BLK = (N + E * (BLK - 1)) / BLK. (Plain
    arithmetic, no min/max, so a symbolic N stays symbolic.)"""
    return (num_slots + num_experts * (blk - 1)) // blk


@triton.jit
def _count_kernel(idx_ptr, counts_ptr, num_slots, num_experts,
                  CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    """counts_CE[c, e] = number of slots of chunk c routed to expert e (Alg. 1, first loop)."""
    c = tl.program_id(0).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ex = tl.load(idx_ptr + offs, mask=offs < num_slots, other=-1)
    for e0 in range(0, num_experts, E_BLOCK):
        es = e0 + tl.arange(0, E_BLOCK)
        hit = (ex[:, None] == es[None, :]).to(tl.int32)
        tl.store(counts_ptr + c * num_experts + es, tl.sum(hit, axis=0), mask=es < num_experts)


@triton.jit
def _scan_kernel(counts_ptr, chunk_off_ptr, starts_ptr, num_chunks, num_experts,
                 BLK: tl.constexpr, C_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    """One program: chunk_off_CE = exclusive prefix sum of counts_CE over chunks; starts_E1 =
    exclusive prefix sum over experts of the counts rounded up to BLK (Alg. 1, ctr and idx)."""
    carry = tl.sum(tl.zeros([E_BLOCK], tl.int32), axis=0)  # padded slots of earlier experts
    for e0 in range(0, num_experts, E_BLOCK):
        es = e0 + tl.arange(0, E_BLOCK)
        e_ok = es < num_experts
        run = tl.zeros([E_BLOCK], tl.int32)  # slots of these experts in earlier chunks
        for c0 in range(0, num_chunks, C_BLOCK):
            cs = (c0 + tl.arange(0, C_BLOCK)).to(tl.int64)
            ptrs = cs[:, None] * num_experts + es[None, :]
            ok = (cs[:, None] < num_chunks) & e_ok[None, :]
            tile = tl.load(counts_ptr + ptrs, mask=ok, other=0)
            tl.store(chunk_off_ptr + ptrs, tl.cumsum(tile, axis=0) - tile + run[None, :], mask=ok)
            run += tl.sum(tile, axis=0)
        padded = (run + BLK - 1) // BLK * BLK  # Alg. 1: ctr[i] = BLK * ceil(ctr[i] / BLK)
        tl.store(starts_ptr + es, carry + tl.cumsum(padded, axis=0) - padded, mask=e_ok)
        carry += tl.sum(padded, axis=0)
    tl.store(starts_ptr + num_experts, carry)


@triton.jit
def _scatter_kernel(idx_ptr, chunk_off_ptr, starts_ptr, v_ptr, block_expert_ptr, num_slots, num_experts,
                    BLK: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    """v[pos] = slot with pos = starts[e] + (slots of e in earlier chunks) + (slots of e earlier in
    this chunk) (Alg. 1, last loop, without atomics); the slot at rank 0 mod BLK of its expert
    opens a block and writes that block's expert id."""
    c = tl.program_id(0).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < num_slots
    ex = tl.load(idx_ptr + offs, mask=in_range, other=-1)
    rank = tl.zeros([CHUNK], tl.int32)  # rank of the slot among its expert's slots
    pos = tl.zeros([CHUNK], tl.int32)
    for e0 in range(0, num_experts, E_BLOCK):
        es = e0 + tl.arange(0, E_BLOCK)
        e_ok = es < num_experts
        hit = (ex[:, None] == es[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # same-expert slots earlier in this chunk
        off = tl.load(chunk_off_ptr + c * num_experts + es, mask=e_ok, other=0)
        start = tl.load(starts_ptr + es, mask=e_ok, other=0)
        r = before + off[None, :]
        rank += tl.sum(hit * r, axis=1)
        pos += tl.sum(hit * (r + start[None, :]), axis=1)
    ok = in_range & (ex >= 0) & (ex < num_experts)
    tl.store(v_ptr + pos, offs.to(tl.int32), mask=ok)
    tl.store(block_expert_ptr + pos // BLK, ex.to(tl.int32), mask=ok & (rank % BLK == 0))


def build_reindex(topk_idx_TK: Tensor, num_experts: int, blk: int, chunk: int = 128) -> Reindex:
    """Alg. 1 on the device of ``topk_idx_TK``: three launches, no host sync, no loop over experts."""
    assert blk >= 16 and blk & (blk - 1) == 0, "BLK is a tl.dot dimension: a power of two >= 16"
    idx_N = topk_idx_TK.reshape(-1)
    num_slots = idx_N.numel()
    num_chunks = num_slots // chunk + 1  # >= 1 without max(), which would guard a symbolic N
    num_blocks = num_blocks_bound(num_slots, num_experts, blk)
    e_block = min(64, triton.next_power_of_2(max(num_experts, 16)))
    # C_BLOCK * E_BLOCK <= 4096 elements per tile in the one-program scan
    c_block = 4096 // e_block
    dev = idx_N.device
    counts_CE = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=dev)
    chunk_off_CE = torch.empty_like(counts_CE)
    starts_E1 = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    v_P = torch.full((num_blocks * blk,), -1, dtype=torch.int32, device=dev)
    block_expert_B = torch.full((num_blocks,), -1, dtype=torch.int32, device=dev)
    wrap_triton(_count_kernel)[(num_chunks,)](idx_N, counts_CE, num_slots, num_experts,
                                               CHUNK=chunk, E_BLOCK=e_block)
    wrap_triton(_scan_kernel)[(1,)](counts_CE, chunk_off_CE, starts_E1, num_chunks, num_experts,
                                    BLK=blk, C_BLOCK=c_block, E_BLOCK=e_block)
    wrap_triton(_scatter_kernel)[(num_chunks,)](idx_N, chunk_off_CE, starts_E1, v_P, block_expert_B,
                                                 num_slots, num_experts, BLK=blk, CHUNK=chunk, E_BLOCK=e_block)
    return Reindex(v_P, block_expert_B, starts_E1, blk)
