"""FlashAttention forward: Triton kernel and its launcher.

One program per (query tile, batch * head). The query tile stays in registers while key/value tiles
stream through; the row max ``m`` and row sum ``l`` of the online softmax are kept in base 2 (the
softmax scale and log2(e) folded into one multiply), and only O and the natural-log LSE are written.

Options are constexpr flags, so each costs nothing when off: HAS_SOFTCAP and HAS_ALIBI modify the
scores (``tiles.score_mod``); HAS_SINK starts each row's online softmax from the head's sink logit
(m = sink, l = 1) instead of (-inf, 0), which puts the sink in the denominator and in the LSE and gives
a row that sees no key output 0 and LSE = sink.

IS_VARLEN runs the same kernels on packed variable-length batches: a program reads its sequence's
first token and length from cu_seqlens (``tiles.seq_bounds``), offsets by the first token where it
offset by the batch entry, and exits at once, writing nothing, when its tile starts past the
sequence's end (the grid is sized by the longest sequence). With the flag off the compiled code is
instruction-identical to the kernels without it (SASS for sm_90 compared).

PAGE_SIZE > 0 (with IS_VARLEN) reads K and V from pages (num_blocks, PAGE_SIZE, nheads_k, headdim) through
a block table, flash_attn_varlen_func's ``block_table``: key j of sequence b is row j % PAGE_SIZE of page
block_table[b, j // PAGE_SIZE], located per key row by the decode kernels' ``cache_slots`` and read with
pointer loads. The rest of the kernel is unchanged (keys are counted within their sequence as without
pages). PAGE_SIZE = 0 compiles to the same SASS as before the flag existed.

HAS_DROPOUT drops attention probabilities after the softmax, as flash_attn: out = (P * Z / (1 - p)) V
with the LSE unchanged (the row sum l keeps every probability). The keep mask Z comes from Philox
(``tl.rand4x``, one call per four keys of a row) keyed by the seed and a counter of (row, key)
(``tiles.dropout_rows``), so the backward regenerates it instead of storing it. Off, the kernel's
signature and code are those without it.

HAS_MASK applies SDPA's attn_mask (``tiles.mask_scores``): read one [BLOCK_M, BLOCK_N] tile at a time through
the strides of its (B, H, Sq, Sk) broadcast view (0 on broadcast dimensions, so it is never expanded in
memory); MASK_IS_BOOL picks a boolean mask (uint8, hides keys) or an additive one (added to the scores).
A row that the mask hides entirely behaves as a row that sees no key: output 0, LSE -inf. Off, the kernel's
signature and SASS are those without it (sm_90 SASS of every features-off variant compared).

On sm_90 the dispatcher (``flashtile._backend.forward_choice``) sends the forwards that ``ops.sm90.forward.qualifies``
(no options, causal or not, head dims 64, 128 and 256, any lengths) to the warp-specialized Gluon kernel instead.
"""

import functools

import torch
import triton
import triton.language as tl

from flashtile.ops._alloc import empty_output
from flashtile.ops._device import on_input_device
from flashtile.ops._launch import launch
from flashtile.ops.attention.configs import SHORT_SEQLEN, config
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
    mask_for_kernel,
    mask_scores,
    mask_strides,
    paged_seq_bounds,
    range_part,
    score_mod,
    score_scales,
    seq_bounds,
    store_rows,
    tile_sources,
    visible,
)
from flashtile.ops.common.descriptors import tma_ready
from flashtile.ops.common.grid import cdiv, head_grid, padded_head_dim
from flashtile.ops.common.math import IEEE, LN2, LOG2E
from flashtile.ops.common.paged import cache_slots
from flashtile.ops.common.paged import load_rows as load_cache_rows
from flashtile.options import AttentionOptions, Packing


@triton.jit
def _forward_tile(
    acc,
    m_i,
    l_i,
    q,
    k_src,
    v_src,
    off_kb,
    off_hk,
    stride_kn,
    stride_vn,
    BlockTable,
    stride_bt,
    num_blocks,
    stride_kb,
    stride_vb,
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
    TMA: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """One online-softmax step over the key tile [start_n, start_n + BLOCK_N).

    With PAGE_SIZE > 0, k_src and v_src point at the head's row 0 of page 0 and off_kb is the batch entry:
    each key row is found through row off_kb of the block table (``cache_slots``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if PAGE_SIZE > 0:
        n_ok = offs_n < seqlen_k
        slot, row = cache_slots(offs_n, n_ok, off_kb, None, BlockTable, stride_bt, num_blocks, PAGE_SIZE, False)
        k = load_cache_rows(k_src + slot * stride_kb + row * stride_kn, n_ok, offs_d, HEAD_DIM, MASKED)  # [BLOCK_N, D]
        v = load_cache_rows(v_src + slot * stride_vb + row * stride_vn, n_ok, offs_dv, HEAD_DIM_V, MASKED)
    else:
        k = load_rows(
            k_src, off_kb, off_hk, start_n, stride_kn, offs_d, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, PAD_D, TMA
        )  # [BLOCK_N, D]
        v = load_rows(
            v_src, off_kb, off_hk, start_n, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, MASKED, PAD_DV,
            TMA,
        )  # [BLOCK_N, DV]  # fmt: skip
    # [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    qk = tl.dot(q, tl.trans(k), input_precision=IEEE if k.dtype == tl.float32 else None)
    if MASKED or HAS_SOFTCAP or HAS_ALIBI or HAS_MASK:
        s, _ = score_mod(
            qk, offs_m[:, None], offs_n[None, :], diag, qk_scale, softcap, slope, HAS_SOFTCAP, HAS_ALIBI
        )  # [BLOCK_M, BLOCK_N], log2 units
        if HAS_MASK:
            s = mask_scores(
                s, mask_base, stride_mm, stride_mn, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, MASK_IS_BOOL
            )
        if MASKED:
            s = tl.where(visible(offs_m, offs_n, seqlen_k, diag, left, right, MASK_LEFT, MASK_RIGHT), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
        if MASKED or HAS_MASK:
            # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
    else:  # plain scores: the scale folds into the max and into exp2's argument
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_shift = m_new
        p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:  # the softmax sum l keeps every p; only P V sees the mask (1 / (1 - p) at the end)
        p = tl.where(dropout_keep(seed, rng_base, start_n, dropout_p, BLOCK_N), p, 0.0)
    # [BLOCK_M, BLOCK_N] @ [BLOCK_N, DV] -> [BLOCK_M, DV]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=IEEE if v.dtype == tl.float32 else None)
    return acc, m_new, l_i


@triton.jit
def _attention_forward_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Alibi,
    Sink,
    CuSeqlensQ,
    CuSeqlensK,
    Rng,
    Mask,
    BlockTable,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_om,
    stride_oh,
    stride_ab,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_bt,
    nheads,
    group,
    seqlen_q,
    seqlen_k,
    num_blocks,
    left,
    right,
    qk_scale,
    softcap,
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
    HAS_SINK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    TMA: tl.constexpr,
):
    """Q (B, Sq, H, D), K (B, Sk, Hk, D), V (B, Sk, Hk, DV) -> Out (B, Sq, H, DV), Lse (B, H, Sq) fp32.

    TMA: Q, K, V and Out are tensor descriptors of those tensors (``tiles.tile_sources``), read and written
    by the copy engine (``tiles.load_rows``); not combined with IS_VARLEN.

    Alibi: (H,) or (B, H) fp32 slopes (batch stride stride_ab) if HAS_ALIBI; Sink: (H,) fp32 if HAS_SINK.
    IS_VARLEN: Q (total_q, H, D), K (total_k, Hk, D), V (total_k, Hk, DV) -> Out (total_q, H, DV),
    Lse (H, total_q); sequence b holds tokens [CuSeqlensQ[b], CuSeqlensQ[b + 1]) of Q (likewise for
    K/V), the batch strides are the token strides, and seqlen_q is total_q (the Lse row stride).
    PAGE_SIZE > 0 (IS_VARLEN only): K (num_blocks, PAGE_SIZE, Hk, D) and V (num_blocks, PAGE_SIZE, Hk, DV) are
    pages, stride_kb / stride_vb their page strides; key j of sequence b is row j % PAGE_SIZE of page
    BlockTable[b, j // PAGE_SIZE] (int32, row stride stride_bt; entries clamped to [0, num_blocks)), and
    seqlen_k is the block table's capacity, max_blocks_per_seq * PAGE_SIZE, which bounds each sequence's keys.
    HAS_DROPOUT: Rng holds int64 [seed, offset]; P V uses P * Z / (1 - dropout_p), Z the Philox keep mask
    of each row (its Lse offset) and key, counters as ``tiles.dropout_rows`` with seqlen_k as passed.
    HAS_MASK: Mask is SDPA's attn_mask as a (B, H, Sq, Sk) view with strides stride_m* (0 on broadcast
    dimensions), read tile by tile (``tiles.mask_scores``): uint8 (nonzero = attend) if MASK_IS_BOOL, else
    additive (any float dtype). Not combined with IS_VARLEN.
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
    rng_stride = seqlen_k  # >= every sequence's seqlen_k (total_k if IS_VARLEN)
    if IS_VARLEN:
        off_qb, seqlen_q, lse_base = seq_bounds(CuSeqlensQ, off_b, off_h, seqlen_q)
        if PAGE_SIZE > 0:  # off_kb stays the batch entry: the block-table row
            seqlen_k, rng_stride = paged_seq_bounds(CuSeqlensK, off_b, tl.num_programs(2), seqlen_k)
        else:
            off_kb, seqlen_k, _ = seq_bounds(CuSeqlensK, off_b, off_h, seqlen_k)
        if start_m >= seqlen_q:  # a tile past this sequence's end: nothing to write
            return
    diag = seqlen_k - seqlen_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_src = head_source(Q, off_qb, off_h, stride_qb, stride_qh, TMA)
    if PAGE_SIZE > 0:  # page 0: each tile adds its rows' pages (_forward_tile)
        k_src = head_base(K, 0, off_hk, stride_kb, stride_kh)
        v_src = head_base(V, 0, off_hk, stride_vb, stride_vh)
    else:
        k_src = head_source(K, off_kb, off_hk, stride_kb, stride_kh, TMA)
        v_src = head_source(V, off_kb, off_hk, stride_vb, stride_vh, TMA)
    out_dst = head_source(Out, off_qb, off_h, stride_ob, stride_oh, TMA)
    q = load_rows(
        q_src, off_qb, off_h, start_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, PAD_D, TMA
    )  # [BLOCK_M, D]

    if HAS_SINK:  # the sink is the first score seen: m = sink, l = exp2(sink - m) = 1
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sink + off_h) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    slope = alibi_slope(Alibi, off_b, off_h, stride_ab, HAS_ALIBI)
    seed, rng_base = 0, 0
    if HAS_DROPOUT:  # [BLOCK_M] counters of key 0, from the rows' Lse offsets
        if IS_VARLEN:
            seed, rng_base = dropout_rows(Rng, lse_base + offs_m, rng_stride)
        else:
            seed, rng_base = dropout_rows(Rng, off_bh.to(tl.int64) * seqlen_q + offs_m, rng_stride)
    mask_base = Mask
    if HAS_MASK:
        mask_base = head_base(Mask, off_b, off_h, stride_mb, stride_mh)
    lo, mid_lo, mid_hi, hi = key_range(start_m, seqlen_k, diag, left, right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    for part in tl.static_range(3):  # key tiles of the band's left edge (masked), the middle, the right edge (masked)
        if part > 0 or MASK_LEFT:
            start, end = range_part(part, lo, mid_lo, mid_hi, hi)
            for start_n in range(start, end, BLOCK_N):
                acc, m_i, l_i = _forward_tile(
                    acc, m_i, l_i, q, k_src, v_src, off_kb, off_hk, stride_kn, stride_vn, BlockTable, stride_bt,
                    num_blocks, stride_kb, stride_vb, start_n, offs_m, offs_d, offs_dv,
                    seqlen_k, diag, left, right, qk_scale, softcap, slope, seed, rng_base, dropout_p,
                    mask_base, stride_mm, stride_mn, seqlen_q, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                    BLOCK_N, part != 1, MASK_LEFT, MASK_RIGHT, PAD_D, PAD_DV, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                    HAS_MASK, MASK_IS_BOOL, TMA, PAGE_SIZE,
                )  # fmt: skip

    # A row that saw no key (and has no sink) has l = 0: its output is 0 and its LSE -inf.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    if HAS_DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    store_rows(
        out_dst, acc.to(q.dtype), off_qb, off_h, start_m, stride_om, offs_dv, seqlen_q, HEAD_DIM_V, BLOCK_M,
        BLOCK_DV, PAD_DV, TMA,
    )  # fmt: skip
    if IS_VARLEN:
        lse_ptrs = Lse + lse_base + offs_m
    else:
        lse_ptrs = Lse + off_bh.to(tl.int64) * seqlen_q + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


@on_input_device
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        q: (batch, seqlen_q, nheads, headdim), last dimension contiguous
        k: (batch, seqlen_k, nheads_k, headdim), last dimension contiguous
        v: (batch, seqlen_k, nheads_k, headdim_v), last dimension contiguous
        options: the window (see ``tiles``), scale, score modifications, sink, dropout and attn_mask; alibi_slopes
            (nheads,) / (batch, nheads) float32 and learnable_sink (nheads,) float32 with a contiguous last
            dimension; attn_mask a (batch, nheads, seqlen_q, seqlen_k) view (stride 0 on broadcast dimensions),
            boolean (True = attend) or additive (float, added to the scaled scores)

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, lse (batch, nheads, seqlen_q) float32
    """
    batch, seqlen_q, nheads, _ = q.shape
    out = empty_output((batch, seqlen_q, nheads, v.shape[3]), q.dtype, q.device)
    lse = empty_output((batch, nheads, seqlen_q), torch.float32, q.device)
    _launch(q, k, v, out, lse, batch, seqlen_q, k.shape[1], options)
    return out, lse


@on_input_device
def varlen_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, options: AttentionOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on a variable-length batch (the kernel's IS_VARLEN).

    Args:
        q: (total_q, nheads, headdim), k: (total_k, nheads_k, headdim), v: (total_k, nheads_k, headdim_v),
            last dimensions contiguous, or with packing.block_table k and v pages (the kernel's PAGE_SIZE)
        packing: where each sequence's rows are (``options.Packing``), validated by the caller; max_seqlen_q and
            max_seqlen_k size the grid
        options: as ``attention_forward`` (no attn_mask); (batch, nheads) alibi slopes are per sequence

    Returns:
        out (total_q, nheads, headdim_v) in q's dtype, lse (nheads, total_q) float32
    """
    total_q, nheads, _ = q.shape
    out = empty_output((total_q, nheads, v.shape[-1]), q.dtype, q.device)
    lse = empty_output((nheads, total_q), torch.float32, q.device)
    _launch(q, k, v, out, lse, packing.batch, packing.max_seqlen_q, packing.max_seqlen_k, options,
            packing.cu_seqlens_q, packing.cu_seqlens_k, packing.block_table)  # fmt: skip
    return out, lse


def token_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (batch, seqlen, nheads, d) tensor, or of a packed (total, nheads, d)
    one, whose batch stride is its token stride (the kernels offset a sequence by its first token)."""
    strides = x.stride()
    if len(strides) == 3:
        return strides[0], strides[0], strides[1]
    return strides[0], strides[1], strides[2]


@functools.cache
def block_widths(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The kernels' (BLOCK_D, BLOCK_DV) for these head dims (``padded_head_dim``), computed once per pair."""
    return padded_head_dim(head_dim), padded_head_dim(head_dim_v)


def _launch(
    q, k, v, out, lse, batch, seqlen_q, seqlen_k, options: AttentionOptions, cu_seqlens_q=None, cu_seqlens_k=None,
    block_table=None,
) -> None:  # fmt: skip
    """The forward launch shared by both layouts; seqlen_q and seqlen_k are the (longest) lengths."""
    nheads, head_dim = q.shape[-2:]
    nheads_k, head_dim_v = k.shape[-2], v.shape[-1]
    is_varlen = cu_seqlens_q is not None
    paged = block_table is not None
    window_left, window_right = options.window_left, options.window_right
    alibi_slopes, softcap, attn_mask = options.alibi_slopes, options.softcap, options.attn_mask
    has_dropout = options.dropout_p > 0.0
    pass_name = "forward"
    if seqlen_k <= SHORT_SEQLEN:
        pass_name = "forward_banded_short" if window_right is not None else "forward_short"
    cfg = config(pass_name, q.device, head_dim, head_dim_v, attn_mask is not None, q.element_size())
    block_d, block_dv = block_widths(head_dim, head_dim_v)
    tma = cfg.tma and not is_varlen and tma_ready(q, k, v)  # out: fresh, so ready when they are
    rows_q, rows_k = cfg.block_m, cfg.block_n
    sources = tile_sources(
        tma, (q, rows_q, block_d), (k, rows_k, block_d), (v, rows_k, block_dv), (out, rows_q, block_dv)
    )
    grid = head_grid(cdiv(seqlen_q, cfg.block_m), batch, nheads)
    args = (
        *sources, lse, alibi_slopes, options.learnable_sink, cu_seqlens_q, cu_seqlens_k,
        options.rng_state if has_dropout else None, mask_for_kernel(attn_mask), block_table,
        *token_strides(q), *token_strides(k), *token_strides(v), *token_strides(out),
        alibi_batch_stride(alibi_slopes), *mask_strides(attn_mask),
        block_table.stride(0) if paged else None,  # None (like a None tensor) leaves the signature as without pages
        nheads, nheads // nheads_k,
        q.shape[0] if is_varlen else seqlen_q,  # the LSE's row stride: total_q if IS_VARLEN
        block_table.shape[1] * k.shape[1] if paged else k.shape[0] if is_varlen else seqlen_k,
        k.shape[0] if paged else None,  # the number of pages
        0 if window_left is None else window_left,
        0 if window_right is None else window_right,
        *score_scales(options.softmax_scale, softcap),
        options.dropout_p if has_dropout else None,  # None (like a None tensor) leaves the signature as without dropout
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        MASK_LEFT=window_left is not None,
        MASK_RIGHT=window_right is not None,
        HEAVY_FIRST=window_right is not None,
        HAS_SOFTCAP=softcap > 0.0,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_SINK=options.learnable_sink is not None,
        IS_VARLEN=is_varlen,
        PAGE_SIZE=k.shape[1] if paged else 0,
        HAS_DROPOUT=has_dropout,
        HAS_MASK=attn_mask is not None,
        MASK_IS_BOOL=attn_mask is not None and attn_mask.dtype == torch.bool,
        TMA=tma,
    )
    launch(_attention_forward_kernel, grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
