"""Prototype: FlashAttention backward for Hopper (sm_90) in Gluon, warp specialized (FA-3 style), 5 GEMMs.

STATUS: compile-checked for sm_90 without a GPU (Triton 3.7.1 and 3.6.0, bf16 and fp16, D 64/128, causal
or not, every timing variant); never run. Shared memory: D=128 165,344 B with 2 stages (198,688 B with 3),
D=64 116,768 B with 3 stages (133,664 B with 4). Registers: consumers setmaxnreg 240, producer 24 (ptxas
REG=168 is the launch-time count for 384 threads). D=64: no spills. D=128: no tile spills; ptxas reports
20-52 bytes of spill stores (default config: 20-32; a few scalars, the dq base pointer among them: 1-2
local loads, sometimes a store, per query tile; LOCAL=0). A PyTorch simulation of the same tiling on
the CPU (not in this file: tile loop, causal start tile and mask, lse = -inf rows, dQ column halves)
passed check()'s tolerance rule. Next H100/H200 session: `--check-only`, then the timing table.

Math (same conventions as src/flashtile/ops/attention/backward.py): with s = softmax_scale * q k^T,
P = exp(s - lse), dP = dO V^T, delta = rowsum(dO * O), dS = P * (dP - delta):
    dV = P^T dO,   dK = softmax_scale * dS^T Q,   dQ = softmax_scale * dS K.
Five matrix products per (query tile, key tile) pair: S, dP, dV, dK, dQ (the `tl` backward needs seven,
since its separate dQ kernel recomputes S and dP). dQ is accumulated over key tiles with fp32 atomics
(not deterministic, like FA2/FA3). softmax_scale is folded into dS (before its cast to the input dtype),
so dK and dQ need no final scaling.

Layout (batch, seqlen, nheads, headdim) contiguous, bf16/fp16, head dim 64 or 128, MHA only (as many
key/value heads as query heads), non-causal and causal (bottom-right aligned: query i sees key j iff
j <= i + seqlen_k - seqlen_q). lse (B, H, Sq) fp32, natural log, -inf for a row that sees no key.

PROTOTYPE RESTRICTIONS: seqlen_q and seqlen_k multiples of 128; the host asserts it (the 2-D TMA view
(B*S, H*D) would otherwise read across batches).

Host side (`run`):
  1. delta (B, H, Sq) fp32 = rowsum(dO * O) (a small `tl` kernel, `_delta_kernel`);
     dq_accum (B, Sq, H, D) fp32 zeros.
  2. the main kernel, grid (Sk / BLOCK_N, B * H): adds dQ partials into dq_accum, writes dK and dV.
  3. dq = dq_accum.to(dtype) (dq_accum has the layout of q: one elementwise cast, no transpose).

Structure of one CTA (one (batch, head), BLOCK_N = 128 key rows, 64 per consumer warpgroup):
  * producer partition, 1 warp: TMA loads of the CTA's K and V tiles (once, kv_bar), then per query tile
    (BLOCK_M = 64 rows) Q and dO by TMA into a ring of STAGES buffers (q_ready / do_ready, tx-count), and
    the rows' lse (base 2) and delta by plain loads into shared memory (stat_ready). qdo_empty (count 2,
    one arrival per consumer warpgroup) frees a slot once both warpgroups' dV and dK products are done.
  * two consumer warpgroups (the default partition = WG 0, one 4-warp worker = WG 1), 64 key rows each.
    Per query tile, all products are wgmma with fp32 accumulators:
        S^T  = K_wg Q^T            (smem, smem)          [64 keys, 64 queries]
        dP^T = V_wg dO^T           (smem, smem)
        P^T  = exp2(S^T * scale * log2 e - lse * log2 e)  (causal mask on tiles crossing the diagonal)
        dS^T = P^T * (dP^T - delta) * scale
        dV_wg += P^T dO            (registers, smem)
        dK_wg += dS^T Q            (registers, smem)
    and dS^T goes to a shared buffer [128 keys, 64 queries] (each warpgroup writes its 64 rows; two
    buffers, used alternately). Once both halves are there (ds_ready, count 2), dQ partial = dS K
    (A = the dS^T buffer transposed, from smem; B = K) is added to dq_accum with relaxed fp32 atomics
    (red.global.add.f32):
      D=128 (DQ_SPLIT): each warpgroup computes half of the columns, dQ[:, wg*64 : (wg+1)*64];
      D=64: warpgroup (i % 2) computes all of it for query tile i (a 32-column slice of K would cut the
      128-byte swizzle atom, which a wgmma operand can not start inside).
    ds_free (count 2) tells the warpgroups that a dS buffer has been read, before it is written again.
  * epilogue: dV_wg goes to this warpgroup's rows of the V tile in shared memory (only it reads them);
    dK_wg to its rows of the K tile once both warpgroups have left the loop (kv_done, count 2: the dQ
    products read all of K); then TMA stores.
  Causal: a key tile visits only the query tiles from the one holding row kv_start - (Sk - Sq) (clipped
  at 0); only tiles crossing the diagonal apply the mask. Rows with lse = -inf (they see no key) get
  lse = +inf, so exp2 gives exactly 0 there, not NaN.

Register-pressure notes (what made the D=128 spills go away; keep them in mind when editing):
  * LLVM hoists loop-invariant address arithmetic out of the query-tile loop and ptxas then spills it.
    The wgmma descriptors of the K and V tiles (24 64-bit values) are kept in the loop by indexing the
    (single-slot) K/V buffers with an opaque zero from inline asm; lse/delta come from shared memory
    (no pointer tensors in the consumers); dK/dV leave through TMA, not pointer tensors.
  * P^T and dS^T are both computed before the dV and dK products are issued (issuing dV first kept one
    more [64, 64] fp32 tile live).

Usage:
  python benchmarks/experiments/gluon_backward_sm90.py                 # H100/H200: checks, then timing table
  python benchmarks/experiments/gluon_backward_sm90.py --check-only    # correctness only
  python benchmarks/experiments/gluon_backward_sm90.py --bench-only    # timing only
  python benchmarks/experiments/gluon_backward_sm90.py --compile-only  # no GPU: sm_90 regs / smem / spills
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
_LOG2E = gl.constexpr(LOG2E)  # the same, readable from jitted code

# ---------------------------------------------------------------------------------------------------------
# Triton 3.6 / 3.7 compatibility
# 3.6: gl.thread_barrier(); 3.7: gl.barrier() (both: a barrier among the warps of the calling partition).
# mbarrier.expect's byte argument is `bytes` (3.6) vs `bytes_per_cta` (3.7): always pass it positionally.
# gl.warp_specialize(functions_and_args, worker_num_warps, worker_num_regs) is the same in both.
# ---------------------------------------------------------------------------------------------------------
_partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


# ------------------------------------------------------------------------------------------------ layouts
@gluon.constexpr_function
def _mma_layout(n):
    # one warpgroup, wgmma m64nNk16 tiles (bf16/fp16: k = 16), N = the full tile width
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


# ------------------------------------------------------------------------------------------------ delta
@triton.jit
def _delta_kernel(out_ptr, dout_ptr, delta_ptr, seqlen_q, nheads, HEAD_D: tl.constexpr, BLOCK: tl.constexpr):
    """delta (B, H, Sq) fp32 = rowsum(dO * O) for one (batch, head) and BLOCK query rows; O and dO are
    (B, Sq, H, D) contiguous."""
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    offs = ((b * seqlen_q + m).to(tl.int64) * nheads + h)[:, None] * HEAD_D + tl.arange(0, HEAD_D)[None, :]
    o = tl.load(out_ptr + offs).to(tl.float32)
    do = tl.load(dout_ptr + offs).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * seqlen_q + m, tl.sum(o * do, 1))


# ------------------------------------------------------------------------------------------------ producer
@gluon.jit
def _producer(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    q_ready,
    do_ready,
    stat_ready,
    qdo_empty,
    lse_ptr,
    delta_ptr,
    q_row0,
    m_start,
    kv_row,
    col,
    n_iters,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    """K and V once, then per query tile i (rows m_start + i * BLOCK_M; q_row0 = its row in the 2-D view):
    Q and dO by TMA, and the rows' lse (in base 2, +inf where it is -inf) and delta by plain loads into
    shared memory, so that the consumers read them with shared-memory loads (no pointer tensors there).
    lse_ptr / delta_ptr point at this (batch, head)'s rows."""
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, col], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [kv_row, col], kv_bar, v_smem.index(0))
    for i in range(n_iters):
        s = i % STAGES
        # a fresh barrier passes a wait on parity 1, so the first round through the ring does not block
        ph = ((i // STAGES) & 1) ^ 1
        row = q_row0 + i * BLOCK_M
        # the row statistics are loaded before waiting for the slot, so their latency overlaps the wait
        offs = m_start + i * BLOCK_M + gl.arange(0, BLOCK_M, layout=stat_layout)
        lse = gl.load(lse_ptr + offs)
        delta = gl.load(delta_ptr + offs)
        mbarrier.wait(qdo_empty.index(s), ph)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(s), q_smem.index(s))
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(s), do_smem.index(s))
        # rows that see no key (lse = -inf): +inf makes exp2(s - lse) exactly 0 instead of NaN
        lse_smem.index(s).store(gl.where(lse == float("-inf"), gl.full_like(lse, float("inf")), lse * _LOG2E))
        delta_smem.index(s).store(delta)
        _partition_barrier()  # all 32 lanes have stored before the (single-thread) arrive
        mbarrier.arrive(stat_ready.index(s), count=1)


# ------------------------------------------------------------------------------------------------ consumer
@gluon.jit
def _probs(
    s_acc,
    lse2,
    qk_scale,
    key0,
    q0,
    diag_off,
    N_WG: gl.constexpr,
    BLOCK_M: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """P^T (fp32, mma layout) of a [N_WG keys, BLOCK_M queries] tile from S^T and the queries' lse in base 2
    (lse2, +inf for rows that see no key, so that exp2 gives 0). Keys key0.., queries q0..; the causal
    mask (key j visible to query i iff j <= i + diag_off) only on tiles that cross the diagonal."""
    s_layout: gl.constexpr = s_acc.type.layout
    p = gl.exp2(s_acc * qk_scale - lse2[None, :])
    if CAUSAL:
        if key0 + N_WG - 1 > q0 + diag_off:
            # (written so that no loop-invariant [BLOCK_M] tensor is formed, which LLVM would hoist out of the
            # loop into registers)
            keys = key0 - diag_off + gl.arange(0, N_WG, layout=gl.SliceLayout(1, s_layout))
            queries = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            keep = keys[:, None] <= queries[None, :]
            p = gl.where(keep, p, gl.zeros_like(p))
    return p


@gluon.jit
def _dq_step(
    dv_tok,
    dk_tok,
    ds_buf,
    k_cols,
    q_tile,
    do_tile,
    ds_ready,
    ds_phase,
    qdo_empty,
    ds_free,
    dq_ptr,
    q0,
    col0,
    row_stride,
    BLOCK_M: gl.constexpr,
    DQ_COLS: gl.constexpr,
    RED_V2: gl.constexpr,
):
    """Once both warpgroups' dS^T halves are in ds_buf [BLOCK_N keys, BLOCK_M queries]: dQ[:, col0 : col0 +
    DQ_COLS] of query rows q0.. = dS K[:, cols] (k_cols: those columns of K), added to dq (rows of
    row_stride floats) with relaxed fp32 atomics. Also retires this iteration's dV and dK products (issued
    before, so they complete first) and releases the Q/dO slot and the dS buffer. Returns dv, dk."""
    dq_layout: gl.constexpr = _mma_layout(DQ_COLS)
    mbarrier.wait(ds_ready, ds_phase)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
    dv, dk = warpgroup_mma_wait(1, deps=(dv_tok, dk_tok, q_tile, do_tile))[:2]
    mbarrier.arrive(qdo_empty, count=1)
    dq = warpgroup_mma_wait(0, deps=(dq_tok, ds_buf, k_cols))[0]
    mbarrier.arrive(ds_free, count=1)
    rows = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    cols = col0 + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    ptrs = dq_ptr + rows[:, None] * row_stride + cols[None, :]
    if RED_V2:
        # red.global.add.v2.f32 on the pairs of adjacent columns each thread holds: the accumulator layout's
        # registers go (row, c), (row, c + 1), ... so pack=2 hands the asm two neighbours ($2 = the first
        # one's address; $3 = $2 + 4 is not used); the int32 results are dummies
        gl.inline_asm_elementwise(
            "red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;",
            "=r,=r,l,l,f,f",
            [ptrs.to(gl.int64, bitcast=True), dq],
            dtype=gl.int32,
            is_pure=False,
            pack=2,
        )
    else:
        gl.atomic_add(ptrs, dq, sem="relaxed")
    return dv, dk


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    ds_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    q_ready,
    do_ready,
    stat_ready,
    qdo_empty,
    ds_ready,
    ds_free,
    kv_done,
    dk_desc,
    dv_desc,
    dq_ptr,
    kv_row,
    col,
    row_stride,
    m_start,
    kv_start,
    diag_off,
    n_iters,
    qk_scale,
    sm_scale,
    HEAD_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    N_WG: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
    RED_V2: gl.constexpr,
):
    """One consumer warpgroup (WG 0 or 1): key rows kv_start + WG * N_WG .. + N_WG of the CTA's tile, all
    n_iters query tiles; accumulates dK_wg and dV_wg in registers, adds dQ partials to dq (see _dq_step),
    stores dK_wg and dV_wg at the end."""
    dtype: gl.constexpr = q_smem.dtype
    DQ_COLS: gl.constexpr = HEAD_D // 2 if DQ_SPLIT else HEAD_D
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)  # S^T, dP^T: [N_WG keys, BLOCK_M queries]
    kv_layout: gl.constexpr = _mma_layout(HEAD_D)  # dK, dV: [N_WG keys, HEAD_D]
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    key0 = kv_start + WG * N_WG

    s_zero = gl.zeros([N_WG, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([N_WG, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([N_WG, HEAD_D], gl.float32, kv_layout)

    mbarrier.wait(kv_bar, 0)
    for i in range(n_iters):
        s = i % STAGES
        ph = (i // STAGES) & 1
        b = i % 2
        bph = (i // 2) & 1
        q0 = m_start + i * BLOCK_M
        q_tile = q_smem.index(s)
        do_tile = do_smem.index(s)
        ds_buf = ds_smem.index(b)
        # an opaque 0 (side-effecting inline asm, so not hoisted): the K/V wgmma descriptors are computed
        # in the loop instead of being hoisted out of it into ~48 registers that ptxas would spill
        zero = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
        k_it = k_smem.index(zero)
        v_it = v_smem.index(zero)
        k_wg = k_it.slice(WG * N_WG, N_WG)
        v_wg = v_it.slice(WG * N_WG, N_WG)

        # ---- S^T and dP^T in flight together; the row statistics come from shared memory meanwhile
        mbarrier.wait(q_ready.index(s), ph)
        s_tok = warpgroup_mma(k_wg, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(s), ph)
        dp_tok = warpgroup_mma(v_wg, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(stat_ready.index(s), ph)
        lse2 = lse_smem.index(s).load(col_s)
        delta = delta_smem.index(s).load(col_s)

        # ---- P^T and dS^T, then dV += P^T dO and dK += dS^T Q (A from registers)
        s_acc = warpgroup_mma_wait(1, deps=(s_tok,))
        p = _probs(s_acc, lse2, qk_scale, key0, q0, diag_off, N_WG, BLOCK_M, CAUSAL)
        dp_acc = warpgroup_mma_wait(0, deps=(dp_tok, k_wg, v_wg))[0]
        ds16 = (p * (dp_acc - delta[None, :]) * sm_scale).to(dtype)
        dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_tile, dv, is_async=True)
        dk_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_tile, dk, is_async=True)

        # ---- dS^T to shared memory (both warpgroups' halves), then dQ += dS K (A = the dS^T buffer transposed)
        mbarrier.wait(ds_free.index(b), bph ^ 1)  # the dQ product(s) of iteration i - 2 have read ds_buf
        ds_buf.slice(WG * N_WG, N_WG).store(ds16)
        fence_async_shared()
        _partition_barrier()  # every thread of this warpgroup has written (and fenced) its part
        mbarrier.arrive(ds_ready.index(b), count=1)
        if DQ_SPLIT:
            # each warpgroup: columns [WG * D/2, (WG + 1) * D/2) of the dQ partial
            dv, dk = _dq_step(
                dv_tok, dk_tok, ds_buf, k_it.slice(WG * DQ_COLS, DQ_COLS, dim=1), q_tile, do_tile,
                ds_ready.index(b), bph, qdo_empty.index(s), ds_free.index(b),
                dq_ptr, q0, WG * DQ_COLS, row_stride, BLOCK_M, DQ_COLS, RED_V2,
            )  # fmt: skip
        elif b == WG:
            # warpgroup (i % 2) computes the whole dQ partial of iteration i
            dv, dk = _dq_step(
                dv_tok, dk_tok, ds_buf, k_it, q_tile, do_tile,
                ds_ready.index(b), bph, qdo_empty.index(s), ds_free.index(b),
                dq_ptr, q0, 0, row_stride, BLOCK_M, DQ_COLS, RED_V2,
            )  # fmt: skip
        else:
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, q_tile, do_tile))[:2]
            mbarrier.arrive(qdo_empty.index(s), count=1)
            mbarrier.arrive(ds_free.index(b), count=1)  # this warpgroup does not read ds_buf

    # ---- epilogue: dV and dK (softmax_scale is already in dS) in the input dtype, through shared memory and
    # TMA stores. V_wg is read only by this warpgroup, so it can take dV at once; K is read by both
    # warpgroups' dQ products, so dK waits until both have left the loop (kv_done, count 2).
    mbarrier.arrive(kv_done, count=1)
    dv_tile = v_smem.index(0).slice(WG * N_WG, N_WG)
    dv_tile.store(dv.to(dtype))
    dk_tile = k_smem.index(0).slice(WG * N_WG, N_WG)
    mbarrier.wait(kv_done, 0)
    dk_tile.store(dk.to(dtype))
    fence_async_shared()
    _partition_barrier()
    tma.async_copy_shared_to_global(dv_desc, [kv_row + WG * N_WG, col], dv_tile)
    tma.async_copy_shared_to_global(dk_desc, [kv_row + WG * N_WG, col], dk_tile)
    tma.store_wait(0)


# ------------------------------------------------------------------------------------------------ kernel
@gluon.jit
def attn_bwd_ws(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    dk_desc,
    dv_desc,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    qk_scale,
    sm_scale,
    seqlen_q,
    seqlen_k,
    nheads,
    HEAD_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
    RED_V2: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    N_WG: gl.constexpr = BLOCK_N // 2
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    kv_start = pid_n * BLOCK_N
    diag_off = seqlen_k - seqlen_q
    if CAUSAL:
        # the first query row that sees key kv_start is kv_start - diag_off
        m_start = (gl.maximum(kv_start - diag_off, 0) // BLOCK_M) * BLOCK_M
        m_start = gl.minimum(m_start, seqlen_q)
    else:
        m_start = 0
    n_iters = (seqlen_q - m_start) // BLOCK_M

    row_stride = nheads * HEAD_D
    col = h * HEAD_D
    stat_off = bh.to(gl.int64) * seqlen_q
    stat_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    dq_off = b.to(gl.int64) * seqlen_q * row_stride + col
    kv_row = b * seqlen_k + kv_start

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_D], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)

    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    stat_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_done, count=2)  # one arrival per consumer warpgroup
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(stat_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=2)  # one arrival per consumer warpgroup
    for j in gl.static_range(2):
        mbarrier.init(ds_ready.index(j), count=2)
        mbarrier.init(ds_free.index(j), count=2)

    # (tuples can not be concatenated here: `(0, ) + common` breaks the constexprs, so spell the args out)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    0,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    ds_smem,
                    lse_smem,
                    delta_smem,
                    kv_bar,
                    q_ready,
                    do_ready,
                    stat_ready,
                    qdo_empty,
                    ds_ready,
                    ds_free,
                    kv_done,
                    dk_desc,
                    dv_desc,
                    dq_ptr + dq_off,
                    kv_row,
                    col,
                    row_stride,
                    m_start,
                    kv_start,
                    diag_off,
                    n_iters,
                    qk_scale,
                    sm_scale,
                    HEAD_D,
                    BLOCK_M,
                    N_WG,
                    STAGES,
                    CAUSAL,
                    DQ_SPLIT,
                    RED_V2,
                ),
            ),
            (
                _consumer,
                (
                    1,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    ds_smem,
                    lse_smem,
                    delta_smem,
                    kv_bar,
                    q_ready,
                    do_ready,
                    stat_ready,
                    qdo_empty,
                    ds_ready,
                    ds_free,
                    kv_done,
                    dk_desc,
                    dv_desc,
                    dq_ptr + dq_off,
                    kv_row,
                    col,
                    row_stride,
                    m_start,
                    kv_start,
                    diag_off,
                    n_iters,
                    qk_scale,
                    sm_scale,
                    HEAD_D,
                    BLOCK_M,
                    N_WG,
                    STAGES,
                    CAUSAL,
                    DQ_SPLIT,
                    RED_V2,
                ),
            ),
            (
                _producer,
                (
                    q_desc,
                    do_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    kv_bar,
                    q_ready,
                    do_ready,
                    stat_ready,
                    qdo_empty,
                    lse_ptr + stat_off,
                    delta_ptr + stat_off,
                    b * seqlen_q + m_start,
                    m_start,
                    kv_row,
                    col,
                    n_iters,
                    BLOCK_M,
                    STAGES,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ------------------------------------------------------------------------------------------------ configs
def config(head_dim, causal):
    """(BLOCK_M, BLOCK_N, STAGES, DQ_SPLIT, RED_V2, consumer regs, producer regs).

    DQ_SPLIT: each warpgroup computes half of the dQ partial's columns. That slices K along its contiguous
    dimension, which a wgmma operand with the 128-byte swizzle only allows at whole swizzle atoms (64
    bf16/fp16 columns), so only for head dim 128; at 64 the warpgroups take turns computing all of it.
    RED_V2: dQ atomics as red.global.add.v2.f32 (inline asm, half the instructions) instead of
    gl.atomic_add's scalar ones."""
    common = dict(BLOCK_M=64, BLOCK_N=128, RED_V2=False, CONSUMER_REGS=240, PRODUCER_REGS=24)
    if head_dim == 128:
        return dict(common, STAGES=2, DQ_SPLIT=True)
    if head_dim == 64:
        return dict(common, STAGES=3, DQ_SPLIT=False)
    raise ValueError(f"head dim {head_dim} not in (64, 128)")


# timing variants: name -> (head dim -> config overrides)
VARIANTS = {
    "default": lambda D: {},
    "more-stages": lambda D: {"STAGES": 3 if D == 128 else 4},
    "dq-one-wg": lambda D: {"DQ_SPLIT": False},
    "red-v2": lambda D: {"RED_V2": True},
}


def _gl_dtype(torch_dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


def run(q, k, v, out, dout, lse, causal=False, softmax_scale=None, **overrides):
    """Gradients dq, dk, dv (B, S, H, D) of softmax(q k^T * scale) v. q, out, dout: (B, Sq, H, D), k, v:
    (B, Sk, H, D), contiguous bf16/fp16; lse (B, H, Sq) fp32 natural log (the forward's)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    assert k.shape == (B, Sk, H, D) and v.shape == k.shape, "prototype: MHA only (same number of heads)"
    assert out.shape == q.shape and dout.shape == q.shape and lse.shape == (B, H, Sq)
    assert q.dtype in (torch.bfloat16, torch.float16) and all(t.dtype == q.dtype for t in (k, v, out, dout))
    assert lse.dtype == torch.float32
    assert all(t.is_contiguous() for t in (q, k, v, out, dout, lse))
    cfg = dict(config(D, causal))
    cfg.update(overrides)
    BLOCK_M, BLOCK_N = cfg["BLOCK_M"], cfg["BLOCK_N"]
    assert Sq % 128 == 0 and Sk % BLOCK_N == 0 and Sq % BLOCK_M == 0, (
        f"prototype: seqlen_q ({Sq}) and seqlen_k ({Sk}) must be multiples of 128"
    )
    assert not cfg["DQ_SPLIT"] or (D // 2) * q.element_size() % 128 == 0, "DQ_SPLIT needs head dim 128"
    if softmax_scale is None:
        softmax_scale = D**-0.5

    delta = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    _delta_kernel[(Sq // 64, B * H)](out, dout, delta, Sq, H, HEAD_D=D, BLOCK=64, num_warps=4)
    dq_accum = torch.zeros((B, Sq, H, D), device=q.device, dtype=torch.float32)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)

    gdt = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gdt)
    q2, do2, k2, v2 = (t.view(t.shape[0] * t.shape[1], H * D) for t in (q, dout, k, v))
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, D], q_layout)
    do_desc = TensorDescriptor.from_tensor(do2, [BLOCK_M, D], q_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, D], kv_layout)
    # dK and dV: one [BLOCK_N / 2, D] tile per consumer warpgroup
    wg_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N // 2, D], gdt)
    dk_desc = TensorDescriptor.from_tensor(dk.view(B * Sk, H * D), [BLOCK_N // 2, D], wg_layout)
    dv_desc = TensorDescriptor.from_tensor(dv.view(B * Sk, H * D), [BLOCK_N // 2, D], wg_layout)
    attn_bwd_ws[(Sk // BLOCK_N, B * H)](
        q_desc,
        do_desc,
        k_desc,
        v_desc,
        dk_desc,
        dv_desc,
        lse,
        delta,
        dq_accum,
        softmax_scale * LOG2E,
        softmax_scale,
        Sq,
        Sk,
        H,
        HEAD_D=D,
        CAUSAL=causal,
        num_warps=4,
        **cfg,
    )
    return dq_accum.to(q.dtype), dk, dv


# ------------------------------------------------------------------------------------------------ compile only
def _desc_sig(dt, rows, d, gdt):
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
    return f"tensordesc<{dt}[{rows},{d}],{layout!r}>"


def compile_only(dtypes=("bf16", "fp16"), variants=None):
    """Compile every (dtype, head dim, causal) for sm_90 with the default config, and the timing variants
    (VARIANTS) for bf16; print shared memory, setmaxnreg, register / stack / local use and spill bytes.
    With DUMP_DIR set, also write each main kernel's TTGIR and PTX there."""
    import itertools

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # Gluon kernels need GluonASTSource (same constructor as ASTSource; sets Language.GLUON and builds the
    # module with the ttg.* attributes); the same class path exists in Triton 3.6 and 3.7.
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    ok = True
    print(f"triton {triton.__version__}")
    for dt in dtypes:
        for D in (64, 128):
            src = ASTSource(
                _delta_kernel,
                {"out_ptr": f"*{dt}", "dout_ptr": f"*{dt}", "delta_ptr": "*fp32", "seqlen_q": "i32", "nheads": "i32"}
                | {"HEAD_D": "constexpr", "BLOCK": "constexpr"},
                constexprs={"HEAD_D": D, "BLOCK": 64},
            )
            try:
                triton.compile(src, target=target, options={"num_warps": 4})
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"FAIL delta kernel {dt} D={D}: {type(e).__name__}: {str(e)[:2000]}")
    for dt in dtypes:
        gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dt]
        for D, causal, (vname, ov) in itertools.product((64, 128), (False, True), (variants or VARIANTS).items()):
            cfg = dict(config(D, causal))
            cfg.update(ov(D))
            if vname != "default" and (dt != "bf16" or cfg == config(D, causal)):
                continue
            BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
            sig = {
                "q_desc": _desc_sig(dt, BM, D, gdt),
                "do_desc": _desc_sig(dt, BM, D, gdt),
                "k_desc": _desc_sig(dt, BN, D, gdt),
                "v_desc": _desc_sig(dt, BN, D, gdt),
                "dk_desc": _desc_sig(dt, BN // 2, D, gdt),
                "dv_desc": _desc_sig(dt, BN // 2, D, gdt),
                "lse_ptr": "*fp32",
                "delta_ptr": "*fp32",
                "dq_ptr": "*fp32",
                "qk_scale": "fp32",
                "sm_scale": "fp32",
                "seqlen_q": "i32",
                "seqlen_k": "i32",
                "nheads": "i32",
            }
            constexprs = dict(HEAD_D=D, CAUSAL=causal, **cfg)
            for name in constexprs:
                sig[name] = "constexpr"
            attrs = {name: [["tt.divisibility", 16]] for name in sig if name.endswith("_ptr") or "seqlen" in name}
            src = GluonASTSource(attn_bwd_ws, sig, constexprs=constexprs, attrs=attrs)
            tag = f"{dt} D={D} causal={int(causal)} [{vname}] {cfg}"
            try:
                c = triton.compile(src, target=target, options={"num_warps": 4})
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"FAIL {tag}: {type(e).__name__}: {str(e)[:3000]}")
                continue
            ptx = c.asm["ptx"]
            maxnreg = re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)
            local = re.findall(r"\.local \.align \d+ \.b8 \S+\[(\d+)\]", ptx)
            md = c.metadata
            info = _sass_info(c)
            print(
                f"ok   {tag}\n     shared={md.shared} B  num_warps(total)={md.num_warps}  "
                f"setmaxnreg={maxnreg}  ptx .local={local}  {info}"
            )
            if md.shared > 232448:
                ok = False
                print("     FAIL: shared memory exceeds 227 KiB")
            if os.environ.get("DUMP_DIR"):
                name = f"{dt}_d{D}_c{int(causal)}_{vname}"
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(os.environ["DUMP_DIR"], f"{name}.{ext}"), "w") as f:
                        f.write(c.asm[ext])
    return ok


def _sass_info(c):
    """Registers / stack / local use (cuobjdump -res-usage on the cubin) and spill bytes (the bundled ptxas
    run again with -v on the PTX)."""
    import subprocess
    import tempfile

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump, ptxas = os.path.join(bin_dir, "cuobjdump"), os.path.join(bin_dir, "ptxas")
    if not os.path.exists(cuobjdump) or "cubin" not in c.asm:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(c.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(c.asm["ptx"])
        r = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True)
        v = subprocess.run([ptxas, "-v", "-arch=sm_90a", ptx, "-o", os.path.join(tmp, "v.cubin")], capture_output=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
    if not m:
        return r.stdout.strip()[-300:]
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v.stderr.decode())
    spill_txt = f" spill stores/loads={spills.group(1)}/{spills.group(2)} B" if spills else ""
    return f"sass REG={m.group(1)} STACK={m.group(2)} LOCAL={m.group(4)}{spill_txt}"


# ------------------------------------------------------------------------------------------------ GPU main
def _forward_prototype():
    """The sibling forward prototype (benchmarks/experiments/gluon_forward_sm90.py): run() gives out and
    lse (B, H, Sq) in the layout this backward takes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gluon_forward_sm90

    return gluon_forward_sm90


def _reference_grads(q, k, v, dout, causal, scale, dtype):
    """dq, dk, dv by PyTorch autograd with q, k, v, dout cast to dtype (float32: the reference; the input
    dtype: the baseline error). Softmax written out so that a row that sees no key gives 0, not NaN."""
    import torch

    qf, kf, vf = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (qf, kf, vf))
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if causal:
        Sq, Sk = q.shape[1], k.shape[1]
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Sk - Sq, float("-inf"))
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    o = torch.matmul(p, vt).transpose(1, 2)
    o.backward(dout.to(dtype))
    return qf.grad, kf.grad, vf.grad


def check(variants=None):
    """dq, dk, dv against float32 autograd: err <= 2 * (error of the same computation in the input dtype)
    + 4 * eps * max|ref|, per gradient; out and lse come from the forward prototype. The default config on
    every case; the other timing variants (bf16) on the shapes with Sq != Sk."""
    import itertools

    import torch

    fwd = _forward_prototype()
    torch.manual_seed(0)
    shapes = [(2, 3, 128, 128), (1, 2, 256, 512), (2, 2, 512, 256), (1, 4, 1024, 1024), (1, 2, 384, 1152)]
    cases = []
    for D, causal in itertools.product((64, 128), (False, True)):
        for (name, ov), shape, dt in itertools.product(
            (variants or VARIANTS).items(), shapes, (torch.bfloat16, torch.float16)
        ):
            overrides = ov(D)
            if name != "default" and (
                dt != torch.bfloat16 or shape[2] == shape[3] or {**config(D, causal), **overrides} == config(D, causal)
            ):
                continue
            cases.append((D, causal, shape, dt, name, overrides))
    n_fail = 0
    for D, causal, (B, H, Sq, Sk), dt, name, overrides in cases:
        q = torch.randn(B, Sq, H, D, device="cuda", dtype=dt)
        k = torch.randn(B, Sk, H, D, device="cuda", dtype=dt)
        v = torch.randn(B, Sk, H, D, device="cuda", dtype=dt)
        dout = torch.randn(B, Sq, H, D, device="cuda", dtype=dt)
        scale = D**-0.5
        out, lse = fwd.run(q, k, v, causal, scale)
        grads = run(q, k, v, out, dout, lse, causal, scale, **overrides)
        torch.cuda.synchronize()
        refs = _reference_grads(q, k, v, dout, causal, scale, torch.float32)
        bases = _reference_grads(q, k, v, dout, causal, scale, dt)
        ok = True
        msg = []
        for gname, g, ref, base in zip(("dq", "dk", "dv"), grads, refs, bases, strict=True):
            err = (g.float() - ref).abs().max().item()
            base_err = (base.float() - ref).abs().max().item()
            floor = 4 * torch.finfo(dt).eps * ref.abs().max().item()
            good = err <= 2 * base_err + floor and not torch.isnan(g).any().item()
            ok &= good
            msg.append(f"{gname} {err:.2e} (base {base_err:.2e}){'' if good else ' <-'}")
        n_fail += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} D={D} causal={int(causal)} B={B} H={H} Sq={Sq} Sk={Sk} {str(dt)[6:]} "
            f"[{name}]: " + ", ".join(msg),
            flush=True,
        )
    return n_fail == 0


def _print_time(label, fn, flops, grad_to_none=None):
    from triton.testing import do_bench

    try:
        ms = do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none)
        print(f"{label}: {ms:8.3f} ms {flops / ms * 1e-9:6.1f} TFLOP/s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{label}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)


def bench(variants=None):
    """Backward time (everything after the forward: delta, the kernel, the dq cast) beside flashtile's
    current backward and SDPA's cuDNN backward; flops = 2.5 * 4 * B * H * N^2 * D, halved when causal."""
    import functools

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fwd = _forward_prototype()
    torch.manual_seed(0)
    for D, H in ((128, 16), (64, 32)):
        for N in (1024, 4096, 16384):
            B = 16384 // N
            q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn_like(q)
            v = torch.randn_like(q)
            dout = torch.randn_like(q)
            for causal in (False, True):
                flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
                head = f"D={D:3d} H={H:2d} B={B:2d} N={N:5d} causal={int(causal)}"
                out, lse = fwd.run(q, k, v, causal)
                for name, ov in (variants or {"default": lambda D: {}}).items():
                    if name != "default" and {**config(D, causal), **ov(D)} == config(D, causal):
                        continue  # (this variant is the default config at this head dim)
                    fn = functools.partial(run, q, k, v, out, dout, lse, causal, None, **ov(D))
                    _print_time(f"{head} {name:>14}", fn, flops)
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                try:
                    import flashtile

                    o = flashtile.flash_attn_func(qg, kg, vg, causal=causal)
                    fn = functools.partial(o.backward, dout, retain_graph=True)
                    _print_time(f"{head} {'flashtile tl':>14}", fn, flops, [qg, kg, vg])
                except Exception as e:  # noqa: BLE001
                    print(f"{head} flashtile tl: FAIL {e}")
                qt, kt, vt = (t.transpose(1, 2) for t in (qg, kg, vg))
                try:
                    # the backward kernel is chosen when the forward runs
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    fn = functools.partial(o.backward, dout.transpose(1, 2), retain_graph=True)
                    _print_time(f"{head} {'sdpa cudnn':>14}", fn, flops, [qg, kg, vg])
                except Exception as e:  # noqa: BLE001
                    print(f"{head} sdpa cudnn: FAIL {e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        sys.exit(0 if compile_only() else 1)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("needs a Hopper GPU (sm_90); use --compile-only without one")
    good = True
    if not args.bench_only:
        good = check()
        print("CHECK", "PASSED" if good else "FAILED", flush=True)
    if not args.check_only:
        bench(VARIANTS)
    sys.exit(0 if good else 1)
