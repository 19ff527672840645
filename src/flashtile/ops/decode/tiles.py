"""Triton helpers of the decode kernels: cache lengths, and rotary embedding (where a cache position lives is
``ops.common.paged``, which the paged attention forward reads too).

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

from flashtile.ops.common.paged import clamp, load_rows


@triton.jit
def cache_length(CacheSeqlens, off_b, seqlen_cache, seqlen_new, HAS_SEQLENS: tl.constexpr):
    """The cache length of batch entry ``off_b`` before the append: cache_seqlens[b] clamped to
    [0, seqlen_cache - seqlen_new] (the host checks seqlen_new <= seqlen_cache), or seqlen_cache."""
    if HAS_SEQLENS:
        return clamp(tl.load(CacheSeqlens + off_b), 0, seqlen_cache - seqlen_new)
    return seqlen_cache


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
