"""Triton helpers shared by the forward and backward kernels: which tiles a band of keys covers,
which (query, key) pairs are visible, and bounds-checked tile loads.

Visibility (flash_attn's semantics, bottom-right aligned): with ``diag = seqlen_k - seqlen_q``,
query row i sees key j when

    i + diag - left <= j <= i + diag + right   and   0 <= j < seqlen_k

where a side is unbounded when its ``MASK_*`` flag is off. Causal attention is ``left`` unbounded and
``right = 0``. Every kernel walks its loop in three ranges so that only tiles cut by the band edge or
the sequence end pay for a mask:

    [lo, mid_lo)     tiles cut by the left edge of the band      (masked)
    [mid_lo, mid_hi) tiles every row sees completely             (no mask)
    [mid_hi, hi)     tiles cut by the right edge or the end      (masked)
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def head_base(ptr, off_b, off_h, stride_b, stride_h):
    """Pointer to row 0 of head ``off_h`` of batch entry ``off_b`` of a (B, S, H, D) tensor (64-bit offsets)."""
    return ptr + tl.cast(off_b, tl.int64) * stride_b + tl.cast(off_h, tl.int64) * stride_h


@triton.jit
def rows_at(head_ptr, start, stride_row, offs_cols, BLOCK_ROWS: tl.constexpr):
    """[BLOCK_ROWS, cols] pointers to rows [start, start + BLOCK_ROWS) from a head's row 0.

    The tile's start is offset in 64 bits; offsets inside the tile stay 32-bit.
    """
    rows = tl.arange(0, BLOCK_ROWS)
    return head_ptr + tl.cast(start, tl.int64) * stride_row + (rows[:, None] * stride_row + offs_cols[None, :])


@triton.jit
def key_range(
    start_m,
    seqlen_k,
    diag,
    left,
    right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Key-tile bounds (lo, mid_lo, mid_hi, hi) for the query rows [start_m, start_m + BLOCK_M).

    lo, mid_lo and mid_hi are multiples of BLOCK_N; hi is the end of the last key any row sees.
    """
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if MASK_LEFT:
        lo = tl.maximum(start_m + diag - left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + diag - left, 0), BLOCK_N) * BLOCK_N
    if MASK_RIGHT:
        hi = tl.maximum(tl.minimum(start_m + BLOCK_M + diag + right, seqlen_k), 0)
        full_hi = tl.maximum(tl.minimum(start_m + diag + right + 1, seqlen_k), 0)
    full_hi = full_hi // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def query_range(
    start_n,
    seqlen_q,
    diag,
    left,
    right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Query-tile bounds (lo, mid_lo, mid_hi, hi) for the key columns [start_n, start_n + BLOCK_N).

    lo, mid_lo and mid_hi are multiples of BLOCK_M. Rows past seqlen_q need no mask in the backward
    (they load as zero with an infinite LSE, so their probabilities are zero).
    """
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if MASK_RIGHT:
        lo = tl.maximum(start_n - diag - right, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag - right, 0), BLOCK_M) * BLOCK_M
    if MASK_LEFT:
        hi = tl.maximum(tl.minimum(start_n + BLOCK_N - diag + left, seqlen_q), 0)
        full_hi = tl.maximum(tl.minimum(start_n - diag + left + 1, seqlen_q), 0) // BLOCK_M * BLOCK_M
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def visible(
    offs_m,
    offs_n,
    seqlen_k,
    diag,
    left,
    right,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] boolean: True where query offs_m[i] may see key offs_n[j]."""
    ok = offs_n[None, :] < seqlen_k
    if MASK_LEFT:
        ok = ok & (offs_n[None, :] >= offs_m[:, None] + diag - left)
    if MASK_RIGHT:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag + right)
    return ok


@triton.jit
def load_tile(ptrs, offs_rows, n_rows, offs_cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a [rows, cols] tile, zero where a checked index is out of bounds."""
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=(offs_rows[:, None] < n_rows) & (offs_cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=offs_cols[None, :] < n_cols, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def store_tile(ptrs, value, offs_rows, n_rows, offs_cols, n_cols, CHECK_COLS: tl.constexpr):
    """Store a [rows, cols] tile where rows < n_rows (and cols < n_cols when checked)."""
    if CHECK_COLS:
        tl.store(ptrs, value, mask=(offs_rows[:, None] < n_rows) & (offs_cols[None, :] < n_cols))
    else:
        tl.store(ptrs, value, mask=offs_rows[:, None] < n_rows)
