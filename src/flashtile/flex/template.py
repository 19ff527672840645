"""The Triton kernels of flex_attention, as a template: ``kernel.py`` reads this file's text, appends the translated
mods (``codegen``), which replace the identity stubs below (and SCORE_MOD_IS_IDENTITY), replaces the token ``CAPTURED``
in signatures and calls with the captured tensors' parameters, and imports the result. The file is also valid Python
on its own (the stubs, without captured tensors).

Forward: one program per (query tile, head, batch entry). The query tile's row of the block table lists its partial
key blocks (scores through score_mod and mask_mod) and its full ones (score_mod only); each sparse block is walked
in BLOCK_N tiles and folded into an online softmax in base 2. A row that attends to nothing writes out 0 and
LSE -inf. Backward: dQ per query tile over the same lists; dK and dV per key tile over the transposed lists (the
q_* tensors of the BlockMask) and over the query heads of its kv head (GQA sums stay in registers); dS = P (dP -
delta) goes through ``score_grad`` (the chain rule through score_mod) before the products with K and Q.

What a tile costs besides its two or three products is decided at compile time, as in the built-in kernels:
- EVEN_N (seqlen_k a multiple of the key block size, so every listed block lies inside the keys): key tiles load
  without a row mask and scores need no bounds test; EVEN_M likewise for the query tiles of the dK/dV kernel. The
  dK/dV kernel never tests key bounds (a key row past the end only feeds its own dK, dV row, which is not stored),
  and no kernel tests query bounds in its loop (a row past the end has LSE +inf in the backward, so its P is 0,
  and is not stored by the forward and dQ).
- MASKED (partial blocks) evaluates mask_mod; full blocks do not.
- FOLD_SCALE (score_mod is the identity and scale > 0): the scores are the raw products, the scale joins log2(e)
  in one factor applied in exp2's argument (one fused multiply-add per score), the backward skips the chain rule,
  and a row's max needs no guard against -inf in full tiles.
"""

import triton
import triton.language as tl

from flashtile.ops.attention.tiles import head_base, load_rows, load_tile, store_rows
from flashtile.ops.common.math import IEEE, LN2, LOG2E, tanh  # noqa: F401  (tanh: called by translated mods)

SCORE_MOD_IS_IDENTITY = True
"""Whether score_mod returns its score unchanged (the stub's; the translation restates it): the launcher reads it
to set FOLD_SCALE."""


@triton.jit
def score_mod(score, b, h, q_idx, kv_idx, CAPTURED):
    """Stub: the translated score_mod replaces it."""
    return score


@triton.jit
def mask_mod(b, h, q_idx, kv_idx, CAPTURED):
    """Stub: the translated mask_mod replaces it."""
    return q_idx >= 0


@triton.jit
def score_grad(score, b, h, q_idx, kv_idx, grad, CAPTURED, ACCUMULATE: tl.constexpr):
    """Stub: grad * d score_mod / d score, translated, replaces it (with ACCUMULATE it also adds the gradients of
    captured tensors that require grad into their buffers)."""
    return grad


@triton.jit
def _load(src, start, stride, offs_cols, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, CHECK_ROWS: tl.constexpr,
          CHECK_COLS: tl.constexpr):  # fmt: skip
    """Rows [start, start + BLOCK_ROWS) (zero at or past n_rows where CHECK_ROWS) and columns ``offs_cols`` (zero at
    or past n_cols where CHECK_COLS) of a head whose row 0 is at ``src``, each row's 64-bit offset computed where
    the tile is loaded. The dK/dV loop's loads: there ``tiles.load_rows``, whose in-tile offsets do not depend on
    the tile and stay in registers across the loop, made the kernel spill (its dK and dV take half the registers;
    24-31 spill instructions per tile against 1-4, sm_90, head dim 128)."""
    offs_rows = start + tl.arange(0, BLOCK_ROWS)
    ptrs = src + offs_rows[:, None].to(tl.int64) * stride + offs_cols[None, :]
    return load_tile(ptrs, offs_rows, n_rows, offs_cols, n_cols, CHECK_ROWS, CHECK_COLS)


@triton.jit
def _tile_start(indices, j, SPARSE: tl.constexpr, TILE: tl.constexpr):
    """First row of the j-th TILE-row tile over the sparse blocks listed at ``indices``: the blocks' tiles form one
    loop, so the software pipeline runs across block boundaries (a loop per block would restart it every
    SPARSE / TILE tiles)."""
    return tl.load(indices + j // (SPARSE // TILE)) * SPARSE + (j % (SPARSE // TILE)) * TILE


@triton.jit
def _log2_scale(scale, FOLD_SCALE: tl.constexpr):
    """The factor taking ``_scores``' s to log2 units: scale * log2(e) when the scale is folded there, else log2(e)."""
    return LOG2E * (scale if FOLD_SCALE else 1.0)


@triton.jit
def _scores(q, k, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED: tl.constexpr,
            CHECK_N: tl.constexpr, FOLD_SCALE: tl.constexpr):  # fmt: skip
    """(qk, s), both [BLOCK_M, BLOCK_N] fp32: qk the products q k^T times scale, s the scores after score_mod with
    hidden positions at -inf (mask_mod where MASKED, keys at or past seqlen_k where CHECK_N); in units that
    ``_log2_scale`` takes to log2. With FOLD_SCALE both are the unscaled products (score_mod is the identity).
    score_mod's result has the tile's shape: one that does not read its score never reaches the kernel (the trace of
    its gradient fails, ``codegen.score_grad_function``)."""
    # [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    qk = tl.dot(q, tl.trans(k), input_precision=IEEE if k.dtype == tl.float32 else None)
    if FOLD_SCALE:
        s = qk
    else:
        qk = qk * scale
        s = score_mod(qk, off_b, off_h, offs_m[:, None], offs_n[None, :], CAPTURED)
    if MASKED:
        ok = mask_mod(off_b, off_h, offs_m[:, None], offs_n[None, :], CAPTURED)
        if CHECK_N:
            ok = ok & (offs_n[None, :] < seqlen_k)
        s = tl.where(ok, s, float("-inf"))
    elif CHECK_N:
        s = tl.where(offs_n[None, :] < seqlen_k, s, float("-inf"))
    return qk, s


@triton.jit
def _forward_tile(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv, seqlen_k,
                  scale, log2_scale, off_b, off_h, CAPTURED, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  CHECK_N: tl.constexpr, FOLD_SCALE: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(k_src, 0, 0, start_n, stride_kn, offs_d, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, CHECK_N,
                  BLOCK_D != HEAD_DIM, False)  # [BLOCK_N, D]  # fmt: skip
    v = load_rows(v_src, 0, 0, start_n, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, CHECK_N,
                  BLOCK_DV != HEAD_DIM_V, False)  # [BLOCK_N, DV]  # fmt: skip
    _, s = _scores(q, k, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED, CHECK_N, FOLD_SCALE)
    m_new = tl.maximum(m_i, tl.max(s, 1) * log2_scale)  # log2_scale > 0: the max of the scaled scores
    shift = m_new
    if MASKED or CHECK_N or not FOLD_SCALE:  # s may hold -inf: a row that has seen no key shifts by 0 (exp2 gives 0)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * log2_scale - shift[:, None])
    alpha = tl.math.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    # [BLOCK_M, BLOCK_N] @ [BLOCK_N, DV] -> [BLOCK_M, DV]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=IEEE if v.dtype == tl.float32 else None)
    return acc, m_new, l_i


@triton.jit
def _query_program(
    Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_vb, stride_vh, stride_nb, stride_nh,
    stride_ib, stride_ih, stride_ir, group, seqlen_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, SPARSE_Q: tl.constexpr,
):  # fmt: skip
    """What a program of one query tile (the forward's and dQ's) starts from: its batch entry and head, first row,
    row and column offsets, its Q tile [BLOCK_M, D], the K and V of its kv head, and where its row of the block
    table's lists starts."""
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_rows(head_base(Q, off_b, off_h, stride_qb, stride_qh), 0, 0, start_m, stride_qm, offs_d, seqlen_q,
                  HEAD_DIM, BLOCK_M, BLOCK_D, True, BLOCK_D != HEAD_DIM, False)  # fmt: skip
    k_src = head_base(K, off_b, off_hk, stride_kb, stride_kh)
    v_src = head_base(V, off_b, off_hk, stride_vb, stride_vh)
    row = start_m // SPARSE_Q
    num_base = off_b * stride_nb + off_h * stride_nh + row
    idx_base = off_b * stride_ib + off_h * stride_ih + row * stride_ir
    return off_b, off_h, start_m, offs_m, offs_d, offs_dv, q, k_src, v_src, num_base, idx_base


@triton.jit
def flex_forward(
    Q, K, V, Out, Lse, Max, KvNum, KvIdx, FullNum, FullIdx,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_nb, stride_nh, stride_ib, stride_ih, stride_ir,
    nheads, group, seqlen_q, seqlen_k, scale, CAPTURED,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_FULL: tl.constexpr, EVEN_N: tl.constexpr, FOLD_SCALE: tl.constexpr, OUTPUT_MAX: tl.constexpr,
):  # fmt: skip
    """Out (B, H, L, DV) and Lse (B, H, L) fp32 (natural log) for one query tile of one head; with OUTPUT_MAX also
    Max (B, H, L) fp32, each row's largest score after the mods (natural units; -inf where it sees no key)."""
    off_b, off_h, start_m, offs_m, offs_d, offs_dv, q, k_src, v_src, num_base, idx_base = _query_program(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_vb, stride_vh, stride_nb, stride_nh,
        stride_ib, stride_ih, stride_ir, group, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_DV, BLOCK_M, SPARSE_Q,
    )  # fmt: skip
    log2_scale = _log2_scale(scale, FOLD_SCALE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j in range(tl.load(KvNum + num_base) * (SPARSE_KV // BLOCK_N)):
        start = _tile_start(KvIdx + idx_base, j, SPARSE_KV, BLOCK_N)
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d,
                                      offs_dv, seqlen_k, scale, log2_scale, off_b, off_h, CAPTURED, HEAD_DIM,
                                      HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, not EVEN_N,
                                      FOLD_SCALE)  # fmt: skip
    if HAS_FULL:
        for j in range(tl.load(FullNum + num_base) * (SPARSE_KV // BLOCK_N)):
            start = _tile_start(FullIdx + idx_base, j, SPARSE_KV, BLOCK_N)
            acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d,
                                          offs_dv, seqlen_k, scale, log2_scale, off_b, off_h, CAPTURED, HEAD_DIM,
                                          HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, not EVEN_N,
                                          FOLD_SCALE)  # fmt: skip
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]  # acc is 0 in a row that saw no key
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    store_rows(head_base(Out, off_b, off_h, stride_ob, stride_oh), out.to(Out.dtype.element_ty), 0, 0, start_m,
               stride_om, offs_dv, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV, BLOCK_DV != HEAD_DIM_V, False)  # fmt: skip
    lse_offs = (off_b * nheads + off_h).to(tl.int64) * seqlen_q + offs_m
    tl.store(Lse + lse_offs, lse, mask=offs_m < seqlen_q)
    if OUTPUT_MAX:  # m_i: the largest score times log2_scale
        tl.store(Max + lse_offs, m_i * LN2, mask=offs_m < seqlen_q)


@triton.jit
def _row_stats(Lse, Delta, lse_offs, offs_m, seqlen_q, CHECK_M: tl.constexpr):
    """LSE in base 2 (+inf for a row that saw no key or, where CHECK_M, lies past the end, so its P is 0) and
    delta."""
    if CHECK_M:
        lse = tl.load(Lse + lse_offs, mask=offs_m < seqlen_q, other=float("inf"))
        delta = tl.load(Delta + lse_offs, mask=offs_m < seqlen_q, other=0.0)
    else:
        lse = tl.load(Lse + lse_offs)
        delta = tl.load(Delta + lse_offs)
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), delta


@triton.jit
def _grad_scores(q, k, v, do, lse, delta, scale, log2_scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED,
                 MASKED: tl.constexpr, CHECK_N: tl.constexpr, FOLD_SCALE: tl.constexpr,
                 ACCUMULATE: tl.constexpr):  # fmt: skip
    """(P, dL/d(q k^T * scale)) of a [BLOCK_M, BLOCK_N] tile, recomputed from the saved LSE; with ACCUMULATE (the dQ
    kernel, which sees every position once) also the gradients of captured tensors (``score_grad``)."""
    qk, s = _scores(q, k, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED, CHECK_N, FOLD_SCALE)
    p = tl.math.exp2(s * log2_scale - lse[:, None])
    # [BLOCK_M, DV] @ [DV, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    dp = tl.dot(do, tl.trans(v), input_precision=IEEE if v.dtype == tl.float32 else None)
    ds = p * (dp - delta[:, None])
    if not FOLD_SCALE:  # the chain rule through score_mod; 0 where P is (its derivative there need not be finite)
        ds = score_grad(qk, off_b, off_h, offs_m[:, None], offs_n[None, :], ds, CAPTURED, ACCUMULATE)
        ds = tl.where(p > 0.0, ds, 0.0)
    return p, ds


@triton.jit
def _dq_tile(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv, seqlen_k,
             scale, log2_scale, off_b, off_h, CAPTURED, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             CHECK_N: tl.constexpr, FOLD_SCALE: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(k_src, 0, 0, start_n, stride_kn, offs_d, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, CHECK_N,
                  BLOCK_D != HEAD_DIM, False)  # [BLOCK_N, D]  # fmt: skip
    v = load_rows(v_src, 0, 0, start_n, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, CHECK_N,
                  BLOCK_DV != HEAD_DIM_V, False)  # [BLOCK_N, DV]  # fmt: skip
    _, ds = _grad_scores(q, k, v, do, lse, delta, scale, log2_scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED,
                         MASKED, CHECK_N, FOLD_SCALE, True)  # fmt: skip
    # [BLOCK_M, BLOCK_N] @ [BLOCK_N, D] -> [BLOCK_M, D]
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=IEEE if k.dtype == tl.float32 else None)


@triton.jit
def flex_backward_dq(
    Q, K, V, DOut, Lse, Delta, DQ, KvNum, KvIdx, FullNum, FullIdx,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    stride_nb, stride_nh, stride_ib, stride_ih, stride_ir,
    nheads, group, seqlen_q, seqlen_k, scale, CAPTURED,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_FULL: tl.constexpr, EVEN_N: tl.constexpr, FOLD_SCALE: tl.constexpr,
):  # fmt: skip
    """dQ (B, H, L, D) of one query tile of one head, over the key blocks of its row of the block table."""
    off_b, off_h, start_m, offs_m, offs_d, offs_dv, q, k_src, v_src, num_base, idx_base = _query_program(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_vb, stride_vh, stride_nb, stride_nh,
        stride_ib, stride_ih, stride_ir, group, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_DV, BLOCK_M, SPARSE_Q,
    )  # fmt: skip
    do = load_rows(head_base(DOut, off_b, off_h, stride_dob, stride_doh), 0, 0, start_m, stride_dom, offs_dv, seqlen_q,
                   HEAD_DIM_V, BLOCK_M, BLOCK_DV, True, BLOCK_DV != HEAD_DIM_V, False)  # [BLOCK_M, DV]  # fmt: skip
    lse, delta = _row_stats(Lse, Delta, (off_b * nheads + off_h).to(tl.int64) * seqlen_q + offs_m, offs_m, seqlen_q,
                            True)  # fmt: skip
    log2_scale = _log2_scale(scale, FOLD_SCALE)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(tl.load(KvNum + num_base) * (SPARSE_KV // BLOCK_N)):
        start = _tile_start(KvIdx + idx_base, j, SPARSE_KV, BLOCK_N)
        dq = _dq_tile(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d, offs_dv,
                      seqlen_k, scale, log2_scale, off_b, off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                      BLOCK_N, True, not EVEN_N, FOLD_SCALE)  # fmt: skip
    if HAS_FULL:
        for j in range(tl.load(FullNum + num_base) * (SPARSE_KV // BLOCK_N)):
            start = _tile_start(FullIdx + idx_base, j, SPARSE_KV, BLOCK_N)
            dq = _dq_tile(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d, offs_dv,
                          seqlen_k, scale, log2_scale, off_b, off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                          BLOCK_DV, BLOCK_N, False, not EVEN_N, FOLD_SCALE)  # fmt: skip
    store_rows(head_base(DQ, off_b, off_h, stride_dqb, stride_dqh), (dq * scale).to(DQ.dtype.element_ty), 0, 0,
               start_m, stride_dqm, offs_d, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D != HEAD_DIM,
               False)  # fmt: skip


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_src, do_src, stride_qm, stride_dom, lse_base, delta_base, start_m, offs_n, offs_d,
               offs_dv, seqlen_q, seqlen_k, scale, log2_scale, off_b, off_h, CAPTURED, HEAD_DIM: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
               MASKED: tl.constexpr, CHECK_M: tl.constexpr, FOLD_SCALE: tl.constexpr):  # fmt: skip
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load(q_src, start_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, BLOCK_M, CHECK_M, BLOCK_D != HEAD_DIM)  # [M, D]
    do = _load(do_src, start_m, stride_dom, offs_dv, seqlen_q, HEAD_DIM_V, BLOCK_M, CHECK_M,
               BLOCK_DV != HEAD_DIM_V)  # [BLOCK_M, DV]  # fmt: skip
    lse, delta = _row_stats(lse_base, delta_base, offs_m, offs_m, seqlen_q, CHECK_M)
    # keys past seqlen_k need no mask here: they only reach their own rows of dK and dV, which are not stored
    p, ds = _grad_scores(q, k, v, do, lse, delta, scale, log2_scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED,
                         MASKED, False, FOLD_SCALE, False)  # fmt: skip
    # [BLOCK_N, BLOCK_M] @ [BLOCK_M, DV] -> [BLOCK_N, DV]
    dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=IEEE if do.dtype == tl.float32 else None)
    # [BLOCK_N, BLOCK_M] @ [BLOCK_M, D] -> [BLOCK_N, D]
    dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=IEEE if q.dtype == tl.float32 else None)
    return dk, dv


@triton.jit
def flex_backward_dkdv(
    Q, K, V, DOut, Lse, Delta, DK, DV, QNum, QIdx, FullQNum, FullQIdx,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_nb, stride_nh, stride_ib, stride_ih, stride_ir,
    nheads, group, seqlen_q, seqlen_k, scale, CAPTURED,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_FULL: tl.constexpr, EVEN_M: tl.constexpr, FOLD_SCALE: tl.constexpr,
):  # fmt: skip
    """dK (B, Hk, S, D) and dV (B, Hk, S, DV) of one key tile of one kv head, over the query blocks of its column
    of the block table, for every query head of the kv head."""
    start_n = tl.program_id(0) * BLOCK_N
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_rows(head_base(K, off_b, off_hk, stride_kb, stride_kh), 0, 0, start_n, stride_kn, offs_d, seqlen_k,
                  HEAD_DIM, BLOCK_N, BLOCK_D, True, BLOCK_D != HEAD_DIM, False)  # [BLOCK_N, D]  # fmt: skip
    v = load_rows(head_base(V, off_b, off_hk, stride_vb, stride_vh), 0, 0, start_n, stride_vn, offs_dv, seqlen_k,
                  HEAD_DIM_V, BLOCK_N, BLOCK_DV, True, BLOCK_DV != HEAD_DIM_V, False)  # [BLOCK_N, DV]  # fmt: skip
    log2_scale = _log2_scale(scale, FOLD_SCALE)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    col = start_n // SPARSE_KV
    for off_h in range(off_hk * group, off_hk * group + group):
        q_src = head_base(Q, off_b, off_h, stride_qb, stride_qh)
        do_src = head_base(DOut, off_b, off_h, stride_dob, stride_doh)
        row_base = (off_b * nheads + off_h).to(tl.int64) * seqlen_q
        num_base = off_b * stride_nb + off_h * stride_nh + col
        idx_base = off_b * stride_ib + off_h * stride_ih + col * stride_ir
        for j in range(tl.load(QNum + num_base) * (SPARSE_Q // BLOCK_M)):
            start = _tile_start(QIdx + idx_base, j, SPARSE_Q, BLOCK_M)
            dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, stride_qm, stride_dom, Lse + row_base, Delta + row_base,
                                start, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, scale, log2_scale, off_b,
                                off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, not EVEN_M,
                                FOLD_SCALE)  # fmt: skip
        if HAS_FULL:
            for j in range(tl.load(FullQNum + num_base) * (SPARSE_Q // BLOCK_M)):
                start = _tile_start(FullQIdx + idx_base, j, SPARSE_Q, BLOCK_M)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, stride_qm, stride_dom, Lse + row_base,
                                    Delta + row_base, start, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, scale,
                                    log2_scale, off_b, off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                                    BLOCK_M, False, not EVEN_M, FOLD_SCALE)  # fmt: skip
    store_rows(head_base(DK, off_b, off_hk, stride_dkb, stride_dkh), (dk * scale).to(DK.dtype.element_ty), 0, 0,
               start_n, stride_dkn, offs_d, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_D != HEAD_DIM,
               False)  # fmt: skip
    store_rows(head_base(DV, off_b, off_hk, stride_dvb, stride_dvh), dv.to(DV.dtype.element_ty), 0, 0, start_n,
               stride_dvn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, BLOCK_DV != HEAD_DIM_V,
               False)  # fmt: skip
