"""Split-KV attention over a KV cache ("flash-decoding"), and the kernel that merges the splits.

Attention kernel: one program per (batch entry x kv head, split, query tile). The query heads of one
kv group are packed into the rows of the tile, row r = token * group + head-in-group, so every key/value
tile is read once for the whole group (GQA/MQA decoding reads the cache nheads // nheads_k times less).
A tile is padded to at least 16 rows for ``tl.dot``; padded rows are computed and never stored.

Keys of batch entry b are the cache positions [leftpad_b, cache_seqlens[b] + seqlen_new), numbered
j = 0 .. seqlen_k - 1 from leftpad_b; masks and ALiBi are bottom-right aligned on them (diag =
seqlen_k - seqlen_q). The key tiles a query tile sees are divided evenly among the splits; each split
runs the online softmax in base 2 over its share and writes its normalised output and natural-log LSE.
With one split these are the final ``out`` and ``lse``; with more they go to fp32 buffers with a
leading split dimension and the combine kernel merges them:

    lse = log sum_s exp(lse_s),    out = sum_s exp(lse_s - lse) out_s

A split (or a whole row) that sees no key has out_s = 0 and lse_s = -inf, so it weighs nothing.
"""

import torch
import triton
import triton.language as tl

from flashtile.ops._alloc import empty_output
from flashtile.ops.attention.tiles import LN2, LOG2E, tanh
from flashtile.ops.decode import configs
from flashtile.ops.decode.tiles import cache_length, cache_slots, clamp, load_rotated, load_rows


@triton.jit
def _decode_tile(
    acc,
    m_i,
    l_i,
    q,
    KCache,
    VCache,
    BatchIdx,
    BlockTable,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_bt,
    num_slots,
    off_b,
    off_hk,
    leftpad,
    start_n,
    tok,
    slope,
    offs_d,
    offs_dv,
    seqlen_k,
    diag,
    left,
    right,
    qk_scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    MASKED: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """One online-softmax step over the keys [start_n, start_n + BLOCK_N) of one batch entry and kv head."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seqlen_k
    slot, row = cache_slots(
        leftpad + offs_n, n_ok, off_b, BatchIdx, BlockTable, stride_bt, num_slots, PAGE_SIZE, HAS_BATCH_IDX
    )
    k_rows = KCache + slot * stride_kb + row * stride_kn + off_hk * stride_kh  # [BLOCK_N]
    v_rows = VCache + slot * stride_vb + row * stride_vn + off_hk * stride_vh
    k = load_rows(k_rows, n_ok, offs_d, HEAD_DIM, MASKED)  # [BLOCK_N, D]
    v = load_rows(v_rows, n_ok, offs_dv, HEAD_DIM_V, MASKED)  # [BLOCK_N, DV]
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:
        s = tanh(qk * qk_scale) * softcap  # softcap * tanh(scale * qk / softcap), in log2 units
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        distance = tl.abs(tok[:, None] + diag - offs_n[None, :]).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        s = s - slope[:, None] * distance
    if MASKED:
        ok = n_ok[None, :]
        if MASK_LEFT:
            ok = ok & (offs_n[None, :] >= tok[:, None] + diag - left)
        if MASK_RIGHT:
            ok = ok & (offs_n[None, :] <= tok[:, None] + diag + right)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, DV] -> [BLOCK_M, DV]
    return acc, m_new, l_i


@triton.jit
def _split_kv_kernel(
    Q,
    KCache,
    VCache,
    Out,
    Lse,
    CacheSeqlens,
    BatchIdx,
    LeftPad,
    BlockTable,
    Alibi,
    Cos,
    Sin,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_os,
    stride_ob,
    stride_om,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    stride_bt,
    stride_ab,
    stride_cos,
    nheads_k,
    group,
    seqlen_q,
    seqlen_new,
    seqlen_cache,
    seqlen_ro,
    num_slots,
    num_splits,
    left,
    right,
    qk_scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_SEQLENS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr,
    ROTARY_PER_TOKEN: tl.constexpr,
):
    """Q (B, Sq, H, D), caches (slots, rows, Hk, D / DV) -> Out (S, B, Sq, H, DV), Lse (S, B, H, Sq) for split s.

    With one split, S is absent (stride 0) and Out, Lse are the final output (q's dtype) and LSE.
    Index values are clamped into the cache (``tiles``): bad ones give wrong numbers, never a bad access.
    """
    off_bhk = tl.program_id(0)
    split = tl.program_id(1)
    tile_m = tl.program_id(2)
    off_b = off_bhk // nheads_k
    off_hk = off_bhk % nheads_k
    b64 = tl.cast(off_b, tl.int64)

    cache_len = cache_length(CacheSeqlens, off_b, seqlen_cache, seqlen_new, HAS_SEQLENS)
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = clamp(tl.load(LeftPad + off_b), 0, cache_len)
    seqlen_k = cache_len + seqlen_new - leftpad
    diag = seqlen_k - seqlen_q

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (token, head in group)
    row_ok = rows < seqlen_q * group
    tok = rows // group
    off_h = off_hk * group + rows % group  # [BLOCK_M] query heads
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_rows = Q + b64 * stride_qb + tok * stride_qm + off_h * stride_qh  # [BLOCK_M]
    if ROTARY_PER_TOKEN:
        q_pos = cache_len + tok
    else:
        q_pos = cache_len + tl.zeros_like(tok)
    q = load_rotated(
        q_rows, row_ok, q_pos, Cos, Sin, stride_cos, seqlen_ro, offs_d, HEAD_DIM, ROTARY_DIM, ROTARY_INTERLEAVED
    )
    slope = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_ab + off_h) * LOG2E

    # The keys any row of this tile sees: [lo, hi); the keys every row sees: [full_lo, full_hi).
    first_tok = tile_m * BLOCK_M // group
    last_tok = tl.minimum((tile_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if MASK_LEFT:
        lo = tl.maximum(first_tok + diag - left, 0)
        full_lo = tl.maximum(last_tok + diag - left, 0)
    if MASK_RIGHT:
        hi = tl.minimum(tl.maximum(last_tok + diag + right + 1, 0), seqlen_k)
        full_hi = tl.minimum(tl.maximum(first_tok + diag + right + 1, 0), seqlen_k)
    lo = lo // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, lo)
    # This split's share of the key tiles, [start, end), split into masked | unmasked | masked.
    tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    start = tl.minimum(lo + split * tiles_per_split * BLOCK_N, hi)
    end = tl.minimum(start + tiles_per_split * BLOCK_N, hi)
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, start), end)
    mid_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N * BLOCK_N, mid_lo), end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(start, mid_lo, BLOCK_N):
        acc, m_i, l_i = _decode_tile(
            acc, m_i, l_i, q, KCache, VCache, BatchIdx, BlockTable,
            stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, num_slots,
            off_b, off_hk, leftpad, start_n, tok, slope, offs_d, offs_dv, seqlen_k, diag, left, right,
            qk_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, HAS_BATCH_IDX,
            True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
    for start_n in range(mid_lo, mid_hi, BLOCK_N):
        acc, m_i, l_i = _decode_tile(
            acc, m_i, l_i, q, KCache, VCache, BatchIdx, BlockTable,
            stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, num_slots,
            off_b, off_hk, leftpad, start_n, tok, slope, offs_d, offs_dv, seqlen_k, diag, left, right,
            qk_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, HAS_BATCH_IDX,
            False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
    for start_n in range(mid_hi, end, BLOCK_N):
        acc, m_i, l_i = _decode_tile(
            acc, m_i, l_i, q, KCache, VCache, BatchIdx, BlockTable,
            stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, num_slots,
            off_b, off_hk, leftpad, start_n, tok, slope, offs_d, offs_dv, seqlen_k, diag, left, right,
            qk_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, HAS_BATCH_IDX,
            True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        )  # fmt: skip

    # A row that saw no key has l = 0: its output is 0 and its LSE -inf.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    base_o = Out + tl.cast(split, tl.int64) * stride_os + b64 * stride_ob
    o_rows = base_o + tok * stride_om + off_h * stride_oh  # [BLOCK_M]
    o_mask = row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    tl.store(o_rows[:, None] + offs_dv[None, :], acc.to(Out.dtype.element_ty), mask=o_mask)
    base_l = Lse + tl.cast(split, tl.int64) * stride_ls + b64 * stride_lb
    tl.store(base_l + off_h * stride_lh + tok, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    OutPart,
    LsePart,
    Out,
    Lse,
    stride_ps,
    stride_pb,
    stride_pm,
    stride_ph,
    stride_lps,
    stride_lpb,
    stride_lph,
    stride_ob,
    stride_om,
    stride_oh,
    stride_lb,
    stride_lh,
    nheads,
    seqlen_q,
    num_splits,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """OutPart (S, B, Sq, H, DV) fp32, LsePart (S, B, H, Sq) fp32 -> Out (B, Sq, H, DV), Lse (B, H, Sq)."""
    off_bh = tl.program_id(0)
    off_b = tl.cast(off_bh // nheads, tl.int64)
    off_h = off_bh % nheads
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < seqlen_q
    mask = m_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    o_part = OutPart + off_b * stride_pb + off_h * stride_ph + offs_m[:, None] * stride_pm + offs_dv[None, :]
    lse_part = LsePart + off_b * stride_lpb + off_h * stride_lph + offs_m

    # Online log-sum-exp over the splits, as the attention kernel does over key tiles.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for split in range(num_splits):
        s64 = tl.cast(split, tl.int64)
        lse_s = tl.load(lse_part + s64 * stride_lps, mask=m_ok, other=float("-inf"))  # [BLOCK_M]
        o_s = tl.load(o_part + s64 * stride_ps, mask=mask, other=0.0)  # [BLOCK_M, DV]
        m_new = tl.maximum(m_i, lse_s)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m_i - m_shift) * LOG2E)
        weight = tl.math.exp2((lse_s - m_shift) * LOG2E)
        l_i = l_i * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * o_s
        m_i = m_new
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) * LN2, float("-inf"))
    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + offs_m, lse, mask=m_ok)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    seqlen_new: int,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    rotary_interleaved: bool,
    rotary_per_token: bool,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split-KV kernel (and the combine kernel when it splits) on a cache already appended to.

    Args:
        q: (batch, seqlen_q, nheads, headdim), last dimension contiguous
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim[_v]), or (num_blocks,
            page_block_size, nheads_k, headdim[_v]) with a block_table; last dimension contiguous
        cache_seqlens: (batch,) int32 cache lengths before the append, or None for the whole cache
        cache_batch_idx: (batch,) int32 cache entry of each batch entry, or None for 0..batch-1
        cache_leftpad: (batch,) int32 first cache position of each batch entry, or None for 0
        block_table: (batch, max_blocks_per_seq) int32, or None for a contiguous cache
        alibi_slopes: (nheads,) or (batch, nheads) fp32, or None
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), contiguous, or None: q is rotated at
            positions cache_seqlens[b] + i if rotary_per_token else cache_seqlens[b]
        seqlen_new: tokens appended this step (keys end at cache_seqlens[b] + seqlen_new)
        softmax_scale, softcap: scores are softcap * tanh(scale * q k / softcap) (scale * q k if softcap = 0)
        window_left, window_right: the visible band, bottom-right aligned; None is unbounded
        rotary_interleaved: rotate pairs (2f, 2f + 1) rather than (f, f + rotary_dim / 2)
        num_splits: splits of the keys, 0 to choose from the problem size and the SM count

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, lse (batch, nheads, seqlen_q) float32
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    out = empty_output((batch, seqlen_q, nheads, head_dim_v), q.dtype, q.device)
    lse = empty_output((batch, nheads, seqlen_q), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    group = nheads // nheads_k
    paged = block_table is not None
    seqlen_cache = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    cfg = configs.config(q.device, max(head_dim, head_dim_v))
    block_m = configs.block_m(seqlen_q * group)
    m_tiles = configs.cdiv(seqlen_q * group, block_m)
    num_splits = configs.num_splits(num_splits, q.device, batch * nheads_k * m_tiles, seqlen_cache, cfg.block_n)

    if num_splits == 1:
        out_s, lse_s, stride_os, stride_ls = out, lse, 0, 0
    else:
        out_s = empty_output((num_splits, *out.shape), torch.float32, q.device)
        lse_s = empty_output((num_splits, *lse.shape), torch.float32, q.device)
        stride_os, stride_ls = out_s.stride(0), lse_s.stride(0)
    o_strides = out_s.stride()[-4:-1]
    l_strides = lse_s.stride()[-3:-1]
    q_strides, k_strides, v_strides = q.stride()[:3], k_cache.stride()[:3], v_cache.stride()[:3]
    if softcap > 0.0:
        qk_scale, softcap_log2 = softmax_scale / softcap, softcap * LOG2E.value
    else:
        qk_scale, softcap_log2 = softmax_scale * LOG2E.value, 0.0
    grid = (batch * nheads_k, num_splits, m_tiles)
    _split_kv_kernel[grid](
        q, k_cache, v_cache, out_s, lse_s,
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos, rotary_sin,
        *q_strides, *k_strides, *v_strides,
        stride_os, *o_strides,
        stride_ls, *l_strides,
        0 if block_table is None else block_table.stride(0),
        0 if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes.stride(0),
        0 if rotary_cos is None else rotary_cos.stride(0),
        nheads_k, group, seqlen_q, seqlen_new, seqlen_cache, 0 if rotary_cos is None else rotary_cos.shape[0],
        k_cache.shape[0], num_splits,
        0 if window_left is None else window_left,
        0 if window_right is None else window_right,
        qk_scale, softcap_log2,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=configs.tile_width(head_dim),
        BLOCK_DV=configs.tile_width(head_dim_v),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        PAGE_SIZE=k_cache.shape[1] if paged else 0,
        HAS_SEQLENS=cache_seqlens is not None,
        HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=cache_leftpad is not None,
        MASK_LEFT=window_left is not None,
        MASK_RIGHT=window_right is not None,
        HAS_SOFTCAP=softcap > 0.0,
        HAS_ALIBI=alibi_slopes is not None,
        ROTARY_DIM=0 if rotary_cos is None else 2 * rotary_cos.shape[1],
        ROTARY_INTERLEAVED=rotary_interleaved,
        ROTARY_PER_TOKEN=rotary_per_token,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        combine_m = min(16, configs.next_power_of_2(seqlen_q))
        _combine_kernel[(batch * nheads, configs.cdiv(seqlen_q, combine_m))](
            out_s, lse_s, out, lse,
            *out_s.stride()[:4], *lse_s.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
            nheads, seqlen_q, num_splits,
            HEAD_DIM_V=head_dim_v,
            BLOCK_DV=configs.tile_width(head_dim_v),
            BLOCK_M=combine_m,
        )  # fmt: skip
    return out, lse
