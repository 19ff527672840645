"""Triton helpers shared by the decode kernels: where a cache position lives, and rotary embedding.

Cache positions. A position ``pos`` of batch entry b is a row of b's logical key sequence (0 is the
first row of the cache, ``cache_leftpad`` and ``cache_seqlens`` count in the same units). It lives at

    contiguous cache (batch_cache, seqlen_cache, nheads_k, headdim):   [cache_batch_idx[b], pos]
    paged cache (num_blocks, PAGE_SIZE, nheads_k, headdim):            [block_table[b, pos // PAGE_SIZE],
                                                                        pos % PAGE_SIZE]

Index values are clamped where they are read, so that bad ones (which ``flashtile.kvcache`` rejects
unless value checks are off: docs/validation.md) give wrong numbers, never an illegal memory access:
cache_seqlens to [0, seqlen_cache - seqlen_new], cache_leftpad to [0, cache_seqlens], cache_batch_idx and
block-table entries to [0, num_slots), rotary positions to [0, seqlen_ro). Valid values pass unchanged,
at the cost of a min and a max.

Rotary embedding, for a row at position p and a column d < ROTARY_DIM, with cos/sin tables of shape
(seqlen_ro, ROTARY_DIM / 2) and R = ROTARY_DIM:

    interleaved (GPT-J):         x'[2f]     = x[2f]     cos[p, f] - x[2f + 1] sin[p, f]
                                 x'[2f + 1] = x[2f + 1] cos[p, f] + x[2f]     sin[p, f]
    non-interleaved (GPT-NeoX):  x'[f]       = x[f]       cos[p, f] - x[f + R/2] sin[p, f]
                                 x'[f + R/2] = x[f + R/2] cos[p, f] + x[f]       sin[p, f]

Columns d >= ROTARY_DIM pass through unchanged. The rotation runs in fp32 and is rounded once, to the
tile's dtype.
"""

import triton
import triton.language as tl


@triton.jit
def clamp(x, lo, hi):
    """x limited to [lo, hi] (hi >= lo)."""
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def cache_length(CacheSeqlens, off_b, seqlen_cache, seqlen_new, HAS_SEQLENS: tl.constexpr):
    """The cache length of batch entry ``off_b`` before the append: cache_seqlens[b] clamped to
    [0, seqlen_cache - seqlen_new] (the host checks seqlen_new <= seqlen_cache), or seqlen_cache."""
    if HAS_SEQLENS:
        return clamp(tl.load(CacheSeqlens + off_b), 0, seqlen_cache - seqlen_new)
    return seqlen_cache


@triton.jit
def cache_slots(
    pos,
    pos_ok,
    off_b,
    BatchIdx,
    BlockTable,
    stride_bt,
    num_slots,
    PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
):
    """(slot, row), int64, of the cache positions ``pos`` [ROWS] of batch entry ``off_b``.

    ``slot`` indexes dim 0 of the cache (a page, or a batch entry: then a scalar), ``row`` dim 1.
    PAGE_SIZE = 0 means a contiguous cache. Block-table entries are read only where ``pos_ok``; they and
    cache_batch_idx are clamped to [0, num_slots) (num_slots = the cache's dim 0).
    """
    if PAGE_SIZE > 0:
        table = BlockTable + tl.cast(off_b, tl.int64) * stride_bt
        slot = clamp(tl.load(table + pos // PAGE_SIZE, mask=pos_ok, other=0), 0, num_slots - 1).to(tl.int64)
        row = (pos % PAGE_SIZE).to(tl.int64)
    else:
        if HAS_BATCH_IDX:
            slot = clamp(tl.load(BatchIdx + off_b), 0, num_slots - 1).to(tl.int64)
        else:
            slot = tl.cast(off_b, tl.int64)
        row = pos.to(tl.int64)
    return slot, row


@triton.jit
def load_rows(row_ptrs, row_ok, offs_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The [ROWS, BLOCK_D] tile ``row_ptrs[:, None] + offs_d[None, :]``.

    Zero past HEAD_DIM, and (when CHECK_ROWS) in rows that are not ``row_ok``.
    """
    return load_tile(row_ptrs[:, None], offs_d[None, :], row_ok, offs_d, HEAD_DIM, CHECK_ROWS)


@triton.jit
def load_tile(base, offsets, row_ok, offs_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The [ROWS, BLOCK_D] tile ``base + offsets`` (pointers and offsets that broadcast to it; columns offs_d
    [BLOCK_D]), masked as ``load_rows``. A tile at one pointer plus offsets that do not change from tile to tile
    leaves the compiler one pointer addition per element, where per-row pointers cost a 64-bit product per row."""
    PAD_D: tl.constexpr = offs_d.shape[0] != HEAD_DIM
    ptrs = base + offsets
    if CHECK_ROWS and PAD_D:
        tile = tl.load(ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif PAD_D:
        tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def load_rotated(
    row_ptrs,
    row_ok,
    pos,
    Cos,
    Sin,
    stride_cos,
    seqlen_ro,
    offs_d,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """``load_rows`` (rows checked), rotated at positions ``pos`` [ROWS] (clamped to [0, seqlen_ro), the
    rows of the cos/sin tables); in the tile's own dtype."""
    x = load_rows(row_ptrs, row_ok, offs_d, HEAD_DIM, True)  # [ROWS, BLOCK_D]
    if ROTARY_DIM > 0:
        rotated = offs_d < ROTARY_DIM
        if INTERLEAVED:
            partner = offs_d ^ 1
            freq = offs_d // 2
            sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
        else:
            HALF: tl.constexpr = ROTARY_DIM // 2
            partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
            freq = tl.where(offs_d < HALF, offs_d, offs_d - HALF)
            sign = tl.where(offs_d < HALF, -1.0, 1.0)
        partner = tl.where(rotated, partner, offs_d)
        table_mask = row_ok[:, None] & rotated[None, :]
        table = clamp(pos, 0, seqlen_ro - 1).to(tl.int64)[:, None] * stride_cos + freq[None, :]  # [ROWS, BLOCK_D]
        cos = tl.load(Cos + table, mask=table_mask, other=1.0).to(tl.float32)
        sin = tl.load(Sin + table, mask=table_mask, other=0.0).to(tl.float32)
        x_partner = load_rows(row_ptrs, row_ok, partner, HEAD_DIM, True).to(tl.float32)
        x = (x.to(tl.float32) * cos + sign[None, :] * x_partner * sin).to(x.dtype)
    return x
