"""FlashAttention backward: Triton kernels and their launcher.

Nothing of size seqlen_q x seqlen_k is stored: P is recomputed from Q, K and the saved LSE.
Three launches, no atomics (so the backward is deterministic; on sm_90 the dispatcher sends ``deterministic=False``
backwards without options to the Gluon kernel of ``ops.sm90.backward`` instead, whose dQ sums are unordered):
  1. delta = rowsum(dO * O) - dLSE                                    (B, H, Sq) fp32
  2. per key tile and kv head: dV = sum P^T dO, dK = scale * sum dS^T Q over the tile's query tiles
     and over every query head of the kv head's group (GQA sums happen in registers)
  3. per query tile and head: dQ = scale * sum dS K over its key tiles
with dP = dO V^T and dS = P * (dP - delta).

HAS_DROPOUT regenerates the forward's keep mask Z (same Philox counters, ``tiles.dropout_rows``) and
uses the gradient at the dropped probabilities: dV = sum (P * Z / (1 - p))^T dO, and
dS = P * (Z / (1 - p) * dP - delta), where delta = rowsum(dO * O) = sum_j P_ij Z_ij / (1 - p) dP_ij
is computed from the dropped output exactly as without dropout.

Options: HAS_SOFTCAP and HAS_ALIBI recompute the scores as the forward did (``tiles.score_mod``), and a
cap multiplies dS by 1 - tanh^2 (``tiles.score_mod_grad``, applied to P before dP's product, which keeps
fewer tiles live through it). A learnable sink needs nothing here: the
saved LSE includes it, so P and delta are already right; its own gradient, -sum_i exp(sink - LSE_i) *
delta_i, is a reduction over ``attention_delta`` done by the caller (``flashtile._ops``).

HAS_MASK (SDPA's attn_mask) recomputes the masked scores as the forward did, in both kernels. With
MASK_NEEDS_GRAD (an additive mask that requires grad) the dQ kernel, which visits every (row, key) pair of
its query tile exactly once, also writes dS = P (dP - delta) to a (B * H, Sq, Sk) fp32 buffer; the caller
sums it over the mask's broadcast dimensions (``flashtile._ops.attention_backward``).

IS_VARLEN (packed variable-length batches) works as in the forward kernel; the delta kernel needs no flag,
since (nheads, total_q) is the (1, nheads, total_q) layout of one packed row of tokens.
"""

import torch
import triton
import triton.language as tl

from flashtile.ops._alloc import empty_output_like
from flashtile.ops._device import on_input_device
from flashtile.ops._launch import launch
from flashtile.ops.attention.configs import config
from flashtile.ops.attention.forward import block_widths, token_strides
from flashtile.ops.attention.tiles import (
    alibi_batch_stride,
    alibi_slope,
    batch_head,
    dropout_keep,
    dropout_rows,
    head_base,
    head_source,
    key_range,
    load_rows,
    load_tile,
    mask_for_kernel,
    mask_scores,
    mask_strides,
    query_range,
    range_part,
    rows_at,
    score_mod,
    score_mod_grad,
    score_scales,
    seq_bounds,
    store_rows,
    tile_sources,
    visible,
)
from flashtile.ops.common.descriptors import tma_ready
from flashtile.ops.common.grid import cdiv, head_grid
from flashtile.ops.common.math import IEEE, LOG2E
from flashtile.options import AttentionOptions, Packing


@triton.jit
def _delta_kernel(
    Out,
    DOut,
    DLse,
    Delta,
    stride_ob,
    stride_om,
    stride_oh,
    stride_dob,
    stride_dom,
    stride_doh,
    nheads,
    seqlen_q,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """Delta (B, H, Sq) = rowsum(dO * O) - dLse, in fp32."""
    start_m = tl.program_id(0) * BLOCK_M
    off_b, off_h, off_bh = batch_head(nheads)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_ptrs = rows_at(head_base(Out, off_b, off_h, stride_ob, stride_oh), start_m, stride_om, offs_dv, BLOCK_M)
    do_ptrs = rows_at(head_base(DOut, off_b, off_h, stride_dob, stride_doh), start_m, stride_dom, offs_dv, BLOCK_M)
    o = load_tile(o_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
    lse_offs = off_bh.to(tl.int64) * seqlen_q + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + lse_offs, mask=offs_m < seqlen_q, other=0.0)
    tl.store(Delta + lse_offs, delta, mask=offs_m < seqlen_q)


@triton.jit
def _load_row_stats(Lse, Delta, lse_offs, offs_m, seqlen_q):
    """LSE in base 2 and delta for the rows offs_m. Rows past the end or that saw no key get an
    LSE of +inf, so their recomputed probabilities are exactly 0."""
    lse = tl.load(Lse + lse_offs, mask=offs_m < seqlen_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(Delta + lse_offs, mask=offs_m < seqlen_q, other=0.0)
    return lse, delta


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    off_qb,
    off_h,
    lse_base,
    delta_base,
    stride_qm,
    stride_dom,
    start_m,
    start_n,
    offs_d,
    offs_dv,
    seqlen_q,
    seqlen_k,
    diag,
    left,
    right,
    qk_scale,
    softcap,
    slope,
    Rng,
    row_base,
    rng_stride,
    dropout_p,
    mask_base,
    stride_mm,
    stride_mn,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    TMA: tl.constexpr,
):
    """Add the contribution of query rows [start_m, start_m + BLOCK_M) to key tile [start_n, start_n + BLOCK_N)'s
    dK, dV."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    q = load_rows(
        q_src, off_qb, off_h, start_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, PAD_D, TMA
    )  # [BLOCK_M, D]
    do = load_rows(
        do_src, off_qb, off_h, start_m, stride_dom, offs_dv, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV, True, PAD_DV, TMA
    )  # [BLOCK_M, DV]
    lse, delta = _load_row_stats(lse_base, delta_base, offs_m, offs_m, seqlen_q)
    # [BLOCK_N, D] @ [D, BLOCK_M] -> [BLOCK_N, BLOCK_M]
    qk_t = tl.dot(k, tl.trans(q), input_precision=IEEE if q.dtype == tl.float32 else None)
    s_t, t_t = score_mod(
        qk_t, offs_m[None, :], offs_n[:, None], diag, qk_scale, softcap, slope, HAS_SOFTCAP, HAS_ALIBI
    )  # [BLOCK_N, BLOCK_M], log2 units
    if HAS_MASK:
        s_t = mask_scores(
            s_t, mask_base, stride_mm, stride_mn, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, MASK_IS_BOOL
        )
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        ok_t = tl.trans(visible(offs_m, offs_n, seqlen_k, diag, left, right, MASK_LEFT, MASK_RIGHT))
        p_t = tl.where(ok_t, p_t, 0.0)
    if HAS_DROPOUT:  # the forward's mask, regenerated; dV's 1 / (1 - p) is applied once at the end
        seed, rng_rows = dropout_rows(Rng, row_base + offs_m, rng_stride)  # [BLOCK_M]
        keep_t = tl.trans(dropout_keep(seed, rng_rows, start_n, dropout_p, BLOCK_N))  # [BLOCK_N, BLOCK_M]
        # [BLOCK_N, BLOCK_M] @ [BLOCK_M, DV]
        dv = tl.dot(
            tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv, input_precision=IEEE if do.dtype == tl.float32 else None
        )
    else:
        # [BLOCK_N, BLOCK_M] @ [BLOCK_M, DV] -> [BLOCK_N, DV]
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=IEEE if do.dtype == tl.float32 else None)
    p_t = score_mod_grad(p_t, t_t, HAS_SOFTCAP)  # before dP's product, so tanh need not live through it
    # [BLOCK_N, DV] @ [DV, BLOCK_M] -> [BLOCK_N, BLOCK_M]
    dp_t = tl.dot(v, tl.trans(do), input_precision=IEEE if do.dtype == tl.float32 else None)
    if HAS_DROPOUT:  # the gradient at P is Z / (1 - p) * dP; delta = rowsum(dO * O) already includes Z
        dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - dropout_p)), 0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    # [BLOCK_N, BLOCK_M] @ [BLOCK_M, D] -> [BLOCK_N, D]
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=IEEE if q.dtype == tl.float32 else None)
    return dk, dv


@triton.jit
def _attention_dkdv_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    Alibi,
    CuSeqlensQ,
    CuSeqlensK,
    Rng,
    Mask,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_dom,
    stride_doh,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    stride_ab,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    nheads,
    nheads_k,
    group,
    seqlen_q,
    seqlen_k,
    left,
    right,
    qk_scale,
    softcap,
    softmax_scale,
    dropout_p,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    TMA: tl.constexpr,
):
    """dK (B, Sk, Hk, D) and dV (B, Sk, Hk, DV) for one key tile of one kv head.

    IS_VARLEN: packed (total, heads, d) tensors, Lse and Delta (H, total_q), as in the forward kernel;
    a key tile that starts past its sequence's end exits at once and writes nothing (rows past the end
    belong to the next sequences, whose programs write them).
    HAS_MASK: SDPA's attn_mask, read per query head of the group as in the forward kernel.
    TMA: Q, K, V, DOut, DK and DV are tensor descriptors (``tiles.tile_sources``), as in the forward kernel.
    """
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V
    start_n = tl.program_id(0) * BLOCK_N
    off_b, off_hk, _ = batch_head(nheads_k)
    off_qb, off_kb = off_b, off_b  # batch entries; first tokens of the sequence if IS_VARLEN
    lse_stride = seqlen_q  # between the LSE rows of two heads: seqlen_q, or total_q if IS_VARLEN
    rng_stride = seqlen_k  # dropout counters per query row, as in the forward
    if IS_VARLEN:
        off_qb, seqlen_q, _ = seq_bounds(CuSeqlensQ, off_b, 0, seqlen_q)
        off_kb, seqlen_k, _ = seq_bounds(CuSeqlensK, off_b, 0, seqlen_k)
        if start_n >= seqlen_k:
            return
    diag = seqlen_k - seqlen_q

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_src = head_source(K, off_kb, off_hk, stride_kb, stride_kh, TMA)
    v_src = head_source(V, off_kb, off_hk, stride_vb, stride_vh, TMA)
    dk_dst = head_source(DK, off_kb, off_hk, stride_dkb, stride_dkh, TMA)
    dv_dst = head_source(DV, off_kb, off_hk, stride_dvb, stride_dvh, TMA)
    k = load_rows(
        k_src, off_kb, off_hk, start_n, stride_kn, offs_d, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, True, PAD_D, TMA
    )  # [BLOCK_N, D]
    v = load_rows(
        v_src, off_kb, off_hk, start_n, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, True, PAD_DV, TMA
    )  # [BLOCK_N, DV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, mid_lo, mid_hi, hi = query_range(start_n, seqlen_q, diag, left, right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    for off_h in range(off_hk * group, off_hk * group + group):
        q_src = head_source(Q, off_qb, off_h, stride_qb, stride_qh, TMA)
        do_src = head_source(DOut, off_qb, off_h, stride_dob, stride_doh, TMA)
        if IS_VARLEN:
            row_base = tl.cast(off_h, tl.int64) * lse_stride + off_qb
        else:
            row_base = tl.cast(off_b * nheads + off_h, tl.int64) * seqlen_q
        slope = alibi_slope(Alibi, off_b, off_h, stride_ab, HAS_ALIBI)
        mask_base = Mask
        if HAS_MASK:
            mask_base = head_base(Mask, off_b, off_h, stride_mb, stride_mh)
        for part in tl.static_range(3):  # query tiles of the band's right edge (masked), the middle, the left edge
            if part == 1 or (part == 0 and MASK_RIGHT) or (part == 2 and MASK_LEFT):
                start, end = range_part(part, lo, mid_lo, mid_hi, hi)
                for start_m in range(start, end, BLOCK_M):
                    dk, dv = _dkdv_tile(
                        dk, dv, k, v, q_src, do_src, off_qb, off_h, Lse + row_base, Delta + row_base, stride_qm,
                        stride_dom, start_m, start_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, left, right, qk_scale,
                        softcap, slope, Rng, row_base, rng_stride, dropout_p, mask_base, stride_mm, stride_mn,
                        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, part != 1, MASK_LEFT, MASK_RIGHT,
                        PAD_D, PAD_DV, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HAS_MASK, MASK_IS_BOOL, TMA,
                    )  # fmt: skip

    store_rows(
        dk_dst, (dk * softmax_scale).to(k.dtype), off_kb, off_hk, start_n, stride_dkn, offs_d, seqlen_k, HEAD_DIM,
        BLOCK_N, BLOCK_D, PAD_D, TMA,
    )  # fmt: skip
    if HAS_DROPOUT:
        dv = dv * (1.0 / (1.0 - dropout_p))
    store_rows(
        dv_dst, dv.to(v.dtype), off_kb, off_hk, start_n, stride_dvn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV,
        PAD_DV, TMA,
    )  # fmt: skip


@triton.jit
def _dq_tile(
    dq,
    q,
    do,
    lse,
    delta,
    k_src,
    v_src,
    off_kb,
    off_hk,
    stride_kn,
    stride_vn,
    start_n,
    offs_m,
    offs_d,
    offs_dv,
    seqlen_k,
    diag,
    left,
    right,
    qk_scale,
    softcap,
    slope,
    seed,
    rng_base,
    dropout_p,
    mask_base,
    stride_mm,
    stride_mn,
    seqlen_q,
    DMask,
    lse_offs,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    MASK_NEEDS_GRAD: tl.constexpr,
    TMA: tl.constexpr,
):
    """Add the contribution of key tile [start_n, start_n + BLOCK_N) to one query tile's dQ."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(
        k_src, off_kb, off_hk, start_n, stride_kn, offs_d, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, PAD_D, TMA
    )  # [BLOCK_N, D]
    v = load_rows(
        v_src, off_kb, off_hk, start_n, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, MASKED, PAD_DV, TMA
    )  # [BLOCK_N, DV]
    # [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    qk = tl.dot(q, tl.trans(k), input_precision=IEEE if k.dtype == tl.float32 else None)
    s, t = score_mod(
        qk, offs_m[:, None], offs_n[None, :], diag, qk_scale, softcap, slope, HAS_SOFTCAP, HAS_ALIBI
    )  # [BLOCK_M, BLOCK_N], log2 units
    if HAS_MASK:
        s = mask_scores(
            s, mask_base, stride_mm, stride_mn, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, MASK_IS_BOOL
        )
    p = tl.math.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where(visible(offs_m, offs_n, seqlen_k, diag, left, right, MASK_LEFT, MASK_RIGHT), p, 0.0)
    p_scores = p  # the gradient at the additive mask is P (dP - delta), without the cap's derivative
    p = score_mod_grad(p, t, HAS_SOFTCAP)  # before dP's product, so tanh need not live through it
    # [BLOCK_M, DV] @ [DV, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    dp = tl.dot(do, tl.trans(v), input_precision=IEEE if v.dtype == tl.float32 else None)
    if HAS_DROPOUT:  # the gradient at P is Z / (1 - p) * dP, Z the forward's mask regenerated
        keep = dropout_keep(seed, rng_base, start_n, dropout_p, BLOCK_N)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    if MASK_NEEDS_GRAD:  # dMask (B * H, Sq, Sk) fp32: this tile's gradient at the masked scores
        dm_ptrs = DMask + lse_offs[:, None] * seqlen_k + offs_n[None, :]
        in_bounds = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        tl.store(dm_ptrs, p_scores * (dp - delta[:, None]), mask=in_bounds)
    # [BLOCK_M, BLOCK_N] @ [BLOCK_N, D] -> [BLOCK_M, D]
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=IEEE if k.dtype == tl.float32 else None)
    return dq


@triton.jit
def _attention_dq_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    DMask,
    Alibi,
    CuSeqlensQ,
    CuSeqlensK,
    Rng,
    Mask,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_dom,
    stride_doh,
    stride_dqb,
    stride_dqm,
    stride_dqh,
    stride_ab,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    nheads,
    group,
    seqlen_q,
    seqlen_k,
    left,
    right,
    qk_scale,
    softcap,
    softmax_scale,
    dropout_p,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    MASK_NEEDS_GRAD: tl.constexpr,
    TMA: tl.constexpr,
):
    """dQ (B, Sq, H, D) for one query tile of one head (IS_VARLEN: as in the forward kernel).

    HAS_MASK: SDPA's attn_mask as in the forward kernel; MASK_NEEDS_GRAD (additive masks) also writes
    dS = P (dP - delta), the gradient at the masked scores, to DMask (B * H, Sq, Sk) fp32.
    TMA: Q, K, V, DOut and DQ are tensor descriptors (``tiles.tile_sources``), as in the forward kernel.
    """
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V
    tile_m = tl.program_id(0)
    if HEAVY_FIRST:
        tile_m = tl.num_programs(0) - 1 - tile_m
    off_b, off_h, off_bh = batch_head(nheads)
    off_hk = off_h // group
    start_m = tile_m * BLOCK_M
    off_qb, off_kb = off_b, off_b  # batch entries; first tokens of the sequence if IS_VARLEN
    lse_base = off_bh.to(tl.int64) * seqlen_q
    rng_stride = seqlen_k  # dropout counters per query row, as in the forward
    if IS_VARLEN:
        off_qb, seqlen_q, lse_base = seq_bounds(CuSeqlensQ, off_b, off_h, seqlen_q)
        off_kb, seqlen_k, _ = seq_bounds(CuSeqlensK, off_b, off_h, seqlen_k)
        if start_m >= seqlen_q:
            return
    diag = seqlen_k - seqlen_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_src = head_source(Q, off_qb, off_h, stride_qb, stride_qh, TMA)
    k_src = head_source(K, off_kb, off_hk, stride_kb, stride_kh, TMA)
    v_src = head_source(V, off_kb, off_hk, stride_vb, stride_vh, TMA)
    do_src = head_source(DOut, off_qb, off_h, stride_dob, stride_doh, TMA)
    dq_dst = head_source(DQ, off_qb, off_h, stride_dqb, stride_dqh, TMA)
    q = load_rows(
        q_src, off_qb, off_h, start_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, PAD_D, TMA
    )  # [BLOCK_M, D]
    do = load_rows(
        do_src, off_qb, off_h, start_m, stride_dom, offs_dv, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV, True, PAD_DV, TMA
    )  # [BLOCK_M, DV]
    lse_offs = lse_base + offs_m
    lse, delta = _load_row_stats(Lse, Delta, lse_offs, offs_m, seqlen_q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slope = alibi_slope(Alibi, off_b, off_h, stride_ab, HAS_ALIBI)
    seed, rng_base = 0, 0
    if HAS_DROPOUT:
        seed, rng_base = dropout_rows(Rng, lse_offs, rng_stride)  # [BLOCK_M] counters of key 0
    mask_base = Mask
    if HAS_MASK:
        mask_base = head_base(Mask, off_b, off_h, stride_mb, stride_mh)
    lo, mid_lo, mid_hi, hi = key_range(start_m, seqlen_k, diag, left, right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    for part in tl.static_range(3):  # key tiles of the band's left edge (masked), the middle, the right edge (masked)
        if part > 0 or MASK_LEFT:
            start, end = range_part(part, lo, mid_lo, mid_hi, hi)
            for start_n in range(start, end, BLOCK_N):
                dq = _dq_tile(
                    dq, q, do, lse, delta, k_src, v_src, off_kb, off_hk, stride_kn, stride_vn, start_n, offs_m, offs_d,
                    offs_dv, seqlen_k, diag, left, right, qk_scale, softcap, slope, seed, rng_base, dropout_p,
                    mask_base, stride_mm, stride_mn, seqlen_q, DMask, lse_offs, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                    BLOCK_N, part != 1, MASK_LEFT, MASK_RIGHT, PAD_D, PAD_DV, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                    HAS_MASK, MASK_IS_BOOL, MASK_NEEDS_GRAD, TMA,
                )  # fmt: skip
    store_rows(
        dq_dst, (dq * softmax_scale).to(q.dtype), off_qb, off_h, start_m, stride_dqm, offs_d, seqlen_q, HEAD_DIM,
        BLOCK_M, BLOCK_D, PAD_D, TMA,
    )  # fmt: skip


@on_input_device
def attention_delta(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the delta kernel: rowsum(dout * out) - dlse.

    Args:
        dout, out: (batch, seqlen_q, nheads, headdim_v), last dimension contiguous
        dlse: None or (batch, nheads, seqlen_q) float32, contiguous

    Returns:
        delta: (batch, nheads, seqlen_q) float32
    """
    batch, seqlen_q, nheads, head_dim_v = out.shape
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=out.device)
    block_rows = 64
    launch(
        _delta_kernel, head_grid(cdiv(seqlen_q, block_rows), batch, nheads),
        (out, dout, dlse, delta, *out.stride()[:3], *dout.stride()[:3], nheads, seqlen_q),
        dict(HEAD_DIM_V=head_dim_v, BLOCK_DV=block_widths(head_dim_v, head_dim_v)[1], BLOCK_M=block_rows,
             HAS_DLSE=dlse is not None),
    )  # fmt: skip
    return delta


@on_input_device
def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    options: AttentionOptions, dlse: torch.Tensor | None = None, dmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch the backward kernels (bitwise repeatable, whatever options.deterministic says).

    Args:
        dout: (batch, seqlen_q, nheads, headdim_v), the gradient of out; last dimension contiguous
        q, k, v, options: as given to the forward (options.learnable_sink is unused: the saved lse includes it; its
            gradient comes from ``attention_delta``; options.rng_state regenerates the forward's dropout mask)
        out, lse: as returned by the forward
        dlse: None or (batch, nheads, seqlen_q) float32, the gradient arriving at lse
        dmask: None, or a contiguous (batch, nheads, seqlen_q, seqlen_k) float32 buffer that receives
            dS = P (dP - delta), the gradient at the (additive) mask before any reduction

    Returns:
        dq, dk, dv with the shapes and dtypes of q, k, v (dk, dv summed over each GQA group)
    """
    delta = attention_delta(dout, out, dlse)
    return _launch(dout, q, k, v, lse, delta, q.shape[0], q.shape[1], k.shape[1], options, dmask=dmask)


@on_input_device
def varlen_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    packing: Packing, options: AttentionOptions, dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch the backward kernels on a variable-length batch (IS_VARLEN).

    Args:
        dout, out: (total_q, nheads, headdim_v); lse and dlse (or None): (nheads, total_q) float32
        the rest: as ``varlen_attention_forward``, with packed keys (no block_table)

    Returns:
        dq, dk, dv with the shapes and dtypes of q, k, v. The delta kernel needs no flag: (nheads, total_q)
        is the (1, nheads, total_q) layout of one packed row of tokens.
    """
    delta = attention_delta(dout[None], out[None], None if dlse is None else dlse[None])[0]
    return _launch(dout, q, k, v, lse, delta, packing.batch, packing.max_seqlen_q, packing.max_seqlen_k, options,
                   packing.cu_seqlens_q, packing.cu_seqlens_k)  # fmt: skip


def _launch(
    dout, q, k, v, lse, delta, batch, seqlen_q, seqlen_k, options: AttentionOptions, cu_seqlens_q=None,
    cu_seqlens_k=None, dmask=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The dK/dV and dQ launches shared by both layouts; seqlen_q and seqlen_k are the (longest) lengths."""
    window_left, window_right = options.window_left, options.window_right
    alibi_slopes, softcap, attn_mask = options.alibi_slopes, options.softcap, options.attn_mask
    softmax_scale, dropout_p = options.softmax_scale, options.dropout_p
    nheads, head_dim = q.shape[-2:]
    nheads_k, head_dim_v = k.shape[-2], v.shape[-1]
    is_varlen = cu_seqlens_q is not None
    rows_q = q.shape[0] if is_varlen else seqlen_q  # the LSE's row stride: total_q if IS_VARLEN
    rows_k = k.shape[0] if is_varlen else seqlen_k
    group = nheads // nheads_k
    block_d, block_dv = block_widths(head_dim, head_dim_v)
    left = 0 if window_left is None else window_left
    right = 0 if window_right is None else window_right
    qk_scale, softcap_log2 = score_scales(softmax_scale, softcap)
    flags = {
        "MASK_LEFT": window_left is not None,
        "MASK_RIGHT": window_right is not None,
        "HAS_SOFTCAP": softcap > 0.0,
        "HAS_ALIBI": alibi_slopes is not None,
        "IS_VARLEN": is_varlen,
        "HAS_DROPOUT": dropout_p > 0.0,
        "HAS_MASK": attn_mask is not None,
        "MASK_IS_BOOL": attn_mask is not None and attn_mask.dtype == torch.bool,
    }
    mask = mask_for_kernel(attn_mask)
    # Whether the copy engine can read the inputs; dq, dk, dv are fresh, so ready whenever the inputs are.
    inputs_tma_ready = not is_varlen and tma_ready(q, k, v, dout)
    rng = options.rng_state if dropout_p > 0.0 else None  # None, like a None tensor, leaves the signature as without
    p_drop = dropout_p if dropout_p > 0.0 else None

    # the gradients in their inputs' layouts (torch.empty_like's, as the op's register_fake declares): strided stores
    dk, dv = empty_output_like(k), empty_output_like(v)
    cfg = config("backward_dkdv", q.device, head_dim, head_dim_v, attn_mask is not None, q.element_size())
    tma = cfg.tma and inputs_tma_ready
    bm, bn = cfg.block_m, cfg.block_n
    q_src, k_src, v_src, do_src, dk_dst, dv_dst = tile_sources(
        tma, (q, bm, block_d), (k, bn, block_d), (v, bn, block_dv), (dout, bm, block_dv), (dk, bn, block_d),
        (dv, bn, block_dv),
    )  # fmt: skip
    launch(
        _attention_dkdv_kernel, head_grid(cdiv(seqlen_k, cfg.block_n), batch, nheads_k),
        (q_src, k_src, v_src, do_src, lse, delta, dk_dst, dv_dst, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng, mask,
         *token_strides(q), *token_strides(k), *token_strides(v), *token_strides(dout), *token_strides(dk),
         *token_strides(dv),
         alibi_batch_stride(alibi_slopes), *mask_strides(attn_mask),
         nheads, nheads_k, group, rows_q, rows_k, left, right,
         qk_scale, softcap_log2, softmax_scale, p_drop),
        dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags, TMA=tma),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip

    dq = empty_output_like(q)
    cfg = config("backward_dq", q.device, head_dim, head_dim_v, attn_mask is not None, q.element_size())
    tma = cfg.tma and inputs_tma_ready
    bm, bn = cfg.block_m, cfg.block_n
    q_src, k_src, v_src, do_src, dq_dst = tile_sources(
        tma, (q, bm, block_d), (k, bn, block_d), (v, bn, block_dv), (dout, bm, block_dv), (dq, bm, block_d)
    )
    launch(
        _attention_dq_kernel, head_grid(cdiv(seqlen_q, cfg.block_m), batch, nheads),
        (q_src, k_src, v_src, do_src, lse, delta, dq_dst, dmask, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng, mask,
         *token_strides(q), *token_strides(k), *token_strides(v), *token_strides(dout), *token_strides(dq),
         alibi_batch_stride(alibi_slopes), *mask_strides(attn_mask),
         nheads, group, rows_q, rows_k, left, right,
         qk_scale, softcap_log2, softmax_scale, p_drop),
        dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags, HEAVY_FIRST=window_right is not None,
             MASK_NEEDS_GRAD=dmask is not None, TMA=tma),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return dq, dk, dv
