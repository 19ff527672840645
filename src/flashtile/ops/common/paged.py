"""Where a position of a key-value cache lives, and its rows as tiles: the Triton code the decode kernels and the
attention forward over a paged cache (``block_table``) share.

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
"""

import triton
import triton.language as tl


@triton.jit
def clamp(x, lo, hi):
    """x limited to [lo, hi] (hi >= lo)."""
    return tl.minimum(tl.maximum(x, lo), hi)


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
