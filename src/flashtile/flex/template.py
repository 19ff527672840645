"""The Triton kernels of flex_attention, as a template: ``kernel.py`` reads this file's text, appends the translated
mods (``codegen``), which replace the identity stubs below, replaces the token ``CAPTURED`` in signatures and calls
with the captured tensors' parameters, and imports the result. The file is also valid Python on its own (the
stubs, without captured tensors).

Forward: one program per (query tile, head, batch entry). The query tile's row of the block table lists its partial
key blocks (scores through score_mod and mask_mod) and its full ones (score_mod only); each sparse block is walked
in BLOCK_N tiles and folded into an online softmax in base 2. A row that attends to nothing writes out 0 and
LSE -inf. Backward: dQ per query tile over the same lists; dK and dV per key tile over the transposed lists (the
q_* tensors of the BlockMask) and over the query heads of its kv head (GQA sums stay in registers); dS = P (dP -
delta) goes through ``score_grad`` (the chain rule through score_mod) before the products with K and Q.
"""

import triton
import triton.language as tl

from flashtile.ops.common.math import IEEE, LN2, LOG2E, tanh  # noqa: F401  (tanh: called by translated mods)


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
def _load(ptr, offs, stride, n, offs_d, d, PAD: tl.constexpr):
    """Rows ``offs`` (< n) and columns ``offs_d`` (< d) of a row-major view; 0 outside."""
    ok = offs[:, None] < n
    if PAD:
        ok = ok & (offs_d[None, :] < d)
    return tl.load(ptr + offs[:, None].to(tl.int64) * stride + offs_d[None, :], mask=ok, other=0.0)


@triton.jit
def _tile_start(indices, j, SPARSE: tl.constexpr, TILE: tl.constexpr):
    """First row of the j-th TILE-row tile over the sparse blocks listed at ``indices``: the blocks' tiles form one
    loop, so the software pipeline runs across block boundaries (a loop per block would restart it every
    SPARSE / TILE tiles)."""
    return tl.load(indices + j // (SPARSE // TILE)) * SPARSE + (j % (SPARSE // TILE)) * TILE


@triton.jit
def _scores(q, k, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED: tl.constexpr):
    """(scores before score_mod, scores after score_mod in log2 units with hidden positions at -inf), both
    [BLOCK_M, BLOCK_N] fp32."""
    # [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    qk = tl.dot(q, tl.trans(k), input_precision=IEEE if k.dtype == tl.float32 else None) * scale
    s = score_mod(qk, off_b, off_h, offs_m[:, None], offs_n[None, :], CAPTURED) + tl.zeros_like(qk)
    ok = (offs_n[None, :] < seqlen_k) & (offs_m[:, None] >= 0)
    if MASKED:
        ok = ok & mask_mod(off_b, off_h, offs_m[:, None], offs_n[None, :], CAPTURED)
    return qk, tl.where(ok, s * LOG2E, float("-inf"))


@triton.jit
def _forward_tile(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv, seqlen_k,
                  scale, off_b, off_h, CAPTURED, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(k_src, offs_n, stride_kn, seqlen_k, offs_d, HEAD_DIM, True)  # [BLOCK_N, D]
    v = _load(v_src, offs_n, stride_vn, seqlen_k, offs_dv, HEAD_DIM_V, True)  # [BLOCK_N, DV]
    _, s = _scores(q, k, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: exp2 gives 0
    p = tl.math.exp2(s - shift[:, None])
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
    """What a program of one query tile (the forward's and dQ's) starts from: its batch entry and head, row and
    column offsets, its Q tile [BLOCK_M, D], the K and V of its kv head, and where its row of the block table's
    lists starts."""
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load(Q + off_b.to(tl.int64) * stride_qb + off_h * stride_qh, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM,
              True)  # fmt: skip
    k_src = K + off_b.to(tl.int64) * stride_kb + off_hk * stride_kh
    v_src = V + off_b.to(tl.int64) * stride_vb + off_hk * stride_vh
    row = start_m // SPARSE_Q
    num_base = off_b * stride_nb + off_h * stride_nh + row
    idx_base = off_b * stride_ib + off_h * stride_ih + row * stride_ir
    return off_b, off_h, offs_m, offs_d, offs_dv, q, k_src, v_src, num_base, idx_base


@triton.jit
def flex_forward(
    Q, K, V, Out, Lse, KvNum, KvIdx, FullNum, FullIdx,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_nb, stride_nh, stride_ib, stride_ih, stride_ir,
    nheads, group, seqlen_q, seqlen_k, scale, CAPTURED,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_FULL: tl.constexpr,
):  # fmt: skip
    """Out (B, H, L, DV) and Lse (B, H, L) fp32 (natural log) for one query tile of one head."""
    off_b, off_h, offs_m, offs_d, offs_dv, q, k_src, v_src, num_base, idx_base = _query_program(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_vb, stride_vh, stride_nb, stride_nh,
        stride_ib, stride_ih, stride_ir, group, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_DV, BLOCK_M, SPARSE_Q,
    )  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j in range(tl.load(KvNum + num_base) * (SPARSE_KV // BLOCK_N)):
        start = _tile_start(KvIdx + idx_base, j, SPARSE_KV, BLOCK_N)
        acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d,
                                      offs_dv, seqlen_k, scale, off_b, off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                                      True)  # fmt: skip
    if HAS_FULL:
        for j in range(tl.load(FullNum + num_base) * (SPARSE_KV // BLOCK_N)):
            start = _tile_start(FullIdx + idx_base, j, SPARSE_KV, BLOCK_N)
            acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d,
                                          offs_dv, seqlen_k, scale, off_b, off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V,
                                          BLOCK_N, False)  # fmt: skip
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]  # acc is 0 in a row that saw no key
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    o_ptrs = Out + off_b.to(tl.int64) * stride_ob + off_h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om
    tl.store(o_ptrs + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen_q) & (offs_dv[None, :] < HEAD_DIM_V))  # fmt: skip
    lse_offs = (off_b * nheads + off_h).to(tl.int64) * seqlen_q + offs_m
    tl.store(Lse + lse_offs, lse, mask=offs_m < seqlen_q)


@triton.jit
def _row_stats(Lse, Delta, lse_offs, offs_m, seqlen_q):
    """LSE in base 2 (+inf for a row that saw no key or lies past the end, so its P is 0) and delta."""
    lse = tl.load(Lse + lse_offs, mask=offs_m < seqlen_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return lse, tl.load(Delta + lse_offs, mask=offs_m < seqlen_q, other=0.0)


@triton.jit
def _grad_scores(q, k, v, do, lse, delta, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED,
                 MASKED: tl.constexpr, ACCUMULATE: tl.constexpr):  # fmt: skip
    """(P, dL/d(q k^T * scale)) of a [BLOCK_M, BLOCK_N] tile, recomputed from the saved LSE; with ACCUMULATE (the dQ
    kernel, which sees every position once) also the gradients of captured tensors (``score_grad``)."""
    qk, s = _scores(q, k, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED)
    p = tl.math.exp2(s - lse[:, None])
    # [BLOCK_M, DV] @ [DV, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    dp = tl.dot(do, tl.trans(v), input_precision=IEEE if v.dtype == tl.float32 else None)
    ds = score_grad(qk, off_b, off_h, offs_m[:, None], offs_n[None, :], p * (dp - delta[:, None]), CAPTURED,
                    ACCUMULATE)  # fmt: skip
    return p, tl.where(p > 0.0, ds, 0.0)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv, seqlen_k,
             scale, off_b, off_h, CAPTURED, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(k_src, offs_n, stride_kn, seqlen_k, offs_d, HEAD_DIM, True)
    v = _load(v_src, offs_n, stride_vn, seqlen_k, offs_dv, HEAD_DIM_V, True)
    _, ds = _grad_scores(q, k, v, do, lse, delta, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED,
                         True)  # fmt: skip
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
    HAS_FULL: tl.constexpr,
):  # fmt: skip
    """dQ (B, H, L, D) of one query tile of one head, over the key blocks of its row of the block table."""
    off_b, off_h, offs_m, offs_d, offs_dv, q, k_src, v_src, num_base, idx_base = _query_program(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_vb, stride_vh, stride_nb, stride_nh,
        stride_ib, stride_ih, stride_ir, group, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_DV, BLOCK_M, SPARSE_Q,
    )  # fmt: skip
    do = _load(DOut + off_b.to(tl.int64) * stride_dob + off_h * stride_doh, offs_m, stride_dom, seqlen_q, offs_dv,
               HEAD_DIM_V, True)  # [BLOCK_M, DV]  # fmt: skip
    lse, delta = _row_stats(Lse, Delta, (off_b * nheads + off_h).to(tl.int64) * seqlen_q + offs_m, offs_m, seqlen_q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(tl.load(KvNum + num_base) * (SPARSE_KV // BLOCK_N)):
        start = _tile_start(KvIdx + idx_base, j, SPARSE_KV, BLOCK_N)
        dq = _dq_tile(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d, offs_dv,
                      seqlen_k, scale, off_b, off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True)  # fmt: skip
    if HAS_FULL:
        for j in range(tl.load(FullNum + num_base) * (SPARSE_KV // BLOCK_N)):
            start = _tile_start(FullIdx + idx_base, j, SPARSE_KV, BLOCK_N)
            dq = _dq_tile(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start, offs_m, offs_d, offs_dv,
                          seqlen_k, scale, off_b, off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False)  # fmt: skip
    dq_ptrs = DQ + off_b.to(tl.int64) * stride_dqb + off_h * stride_dqh + offs_m[:, None].to(tl.int64) * stride_dqm
    tl.store(dq_ptrs + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))  # fmt: skip


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_src, do_src, stride_qm, stride_dom, lse_base, delta_base, start_m, offs_n, offs_d,
               offs_dv, seqlen_q, seqlen_k, scale, off_b, off_h, CAPTURED, HEAD_DIM: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load(q_src, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, True)  # [BLOCK_M, D]
    do = _load(do_src, offs_m, stride_dom, seqlen_q, offs_dv, HEAD_DIM_V, True)  # [BLOCK_M, DV]
    lse, delta = _row_stats(lse_base, delta_base, offs_m, offs_m, seqlen_q)
    p, ds = _grad_scores(q, k, v, do, lse, delta, scale, off_b, off_h, offs_m, offs_n, seqlen_k, CAPTURED, MASKED,
                         False)  # fmt: skip
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
    HAS_FULL: tl.constexpr,
):  # fmt: skip
    """dK (B, Hk, S, D) and dV (B, Hk, S, DV) of one key tile of one kv head, over the query blocks of its column
    of the block table, for every query head of the kv head."""
    start_n = tl.program_id(0) * BLOCK_N
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load(K + off_b.to(tl.int64) * stride_kb + off_hk * stride_kh, offs_n, stride_kn, seqlen_k, offs_d, HEAD_DIM,
              True)  # [BLOCK_N, D]  # fmt: skip
    v = _load(V + off_b.to(tl.int64) * stride_vb + off_hk * stride_vh, offs_n, stride_vn, seqlen_k, offs_dv,
              HEAD_DIM_V, True)  # [BLOCK_N, DV]  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    col = start_n // SPARSE_KV
    for off_h in range(off_hk * group, off_hk * group + group):
        q_src = Q + off_b.to(tl.int64) * stride_qb + off_h * stride_qh
        do_src = DOut + off_b.to(tl.int64) * stride_dob + off_h * stride_doh
        row_base = (off_b * nheads + off_h).to(tl.int64) * seqlen_q
        num_base = off_b * stride_nb + off_h * stride_nh + col
        idx_base = off_b * stride_ib + off_h * stride_ih + col * stride_ir
        for j in range(tl.load(QNum + num_base) * (SPARSE_Q // BLOCK_M)):
            start = _tile_start(QIdx + idx_base, j, SPARSE_Q, BLOCK_M)
            dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, stride_qm, stride_dom, Lse + row_base, Delta + row_base,
                                start, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, scale, off_b, off_h, CAPTURED,
                                HEAD_DIM, HEAD_DIM_V, BLOCK_M, True)  # fmt: skip
        if HAS_FULL:
            for j in range(tl.load(FullQNum + num_base) * (SPARSE_Q // BLOCK_M)):
                start = _tile_start(FullQIdx + idx_base, j, SPARSE_Q, BLOCK_M)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, stride_qm, stride_dom, Lse + row_base,
                                    Delta + row_base, start, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, scale, off_b,
                                    off_h, CAPTURED, HEAD_DIM, HEAD_DIM_V, BLOCK_M, False)  # fmt: skip
    dk_ptrs = DK + off_b.to(tl.int64) * stride_dkb + off_hk * stride_dkh + offs_n[:, None].to(tl.int64) * stride_dkn
    tl.store(dk_ptrs + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM))  # fmt: skip
    dv_ptrs = DV + off_b.to(tl.int64) * stride_dvb + off_hk * stride_dvh + offs_n[:, None].to(tl.int64) * stride_dvn
    tl.store(dv_ptrs + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=(offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V))  # fmt: skip
