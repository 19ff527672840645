"""Triton helpers shared by the forward and backward kernels: which tiles a band of keys covers,
which (query, key) pairs are visible, how a score is modified (softcap, ALiBi), and bounds-checked
tile loads.

Visibility (flash_attn's semantics, bottom-right aligned): with ``diag = seqlen_k - seqlen_q``,
query row i sees key j when

    i + diag - left <= j <= i + diag + right   and   0 <= j < seqlen_k

where a side is unbounded when its ``MASK_*`` flag is off. Causal attention is ``left`` unbounded and
``right = 0``. Every kernel walks its loop in three ranges so that only tiles cut by the band edge or
the sequence end pay for a mask:

    [lo, mid_lo)     tiles cut by the left edge of the band      (masked)
    [mid_lo, mid_hi) tiles every row sees completely             (no mask)
    [mid_hi, hi)     tiles cut by the right edge or the end      (masked)

Scores (flash_attn 2.x's order: scale, cap, bias): for the raw product qk = q . k of query i and key j,

    s = qk * scale                                            no softcap
    s = softcap * tanh(qk * scale / softcap)                  softcap > 0
    s = s - slope * |i + diag - j|                            ALiBi

The kernels hold s * log2(e), so the softmax runs on exp2. ``score_mod`` computes it in every kernel
(forward, dK/dV, dQ) from the launcher's ``score_scales``; ``score_mod_grad`` applies the cap's
derivative 1 - tanh^2 in the backward kernels.
"""

import torch
import triton
import triton.language as tl

from flashtile.ops.common.descriptors import tile_descriptor
from flashtile.ops.common.math import LOG2E, tanh


def score_scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' (qk_scale, softcap) for ``score_mod``: (scale * log2(e), 0) without a cap,
    (scale / softcap, softcap * log2(e)) with one."""
    if softcap > 0.0:
        return softmax_scale / softcap, softcap * LOG2E.value
    return softmax_scale * LOG2E.value, 0.0


def alibi_batch_stride(alibi_slopes: torch.Tensor | None) -> int:
    """Stride between batch entries of the slopes: 0 for (nheads,) slopes shared by the batch."""
    return alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0


@triton.jit
def batch_head(nheads):
    """(batch entry, head, batch entry * nheads + head) of this program: the launchers' grids are (tiles,
    nheads, batch) (``grid.head_grid``), so neither count meets the 65535 limit of a grid's y and z."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    return off_b, off_h, off_b * nheads + off_h


@triton.jit
def head_base(ptr, off_b, off_h, stride_b, stride_h):
    """Pointer to row 0 of head ``off_h`` of batch entry ``off_b`` of a (B, S, H, D) tensor (64-bit offsets)."""
    return ptr + tl.cast(off_b, tl.int64) * stride_b + tl.cast(off_h, tl.int64) * stride_h


@triton.jit
def head_source(x, off_b, off_h, stride_b, stride_h, TMA: tl.constexpr):
    """What ``load_rows`` / ``store_rows`` take for head ``off_h`` of batch entry ``off_b`` of x: x itself when
    TMA (a tensor descriptor of the whole tensor; the loads pick the head), else ``head_base``'s pointer."""
    if TMA:
        source = x
    else:
        source = head_base(x, off_b, off_h, stride_b, stride_h)
    return source


@triton.jit
def seq_bounds(CuSeqlens, off_b, off_h, total):
    """For variable-length batches: (first token, length, LSE offset) of sequence ``off_b``, from the
    int32 (batch + 1,) cumulative lengths; the LSE offset is that of head ``off_h``'s first row in an
    (nheads, total) LSE (64-bit)."""
    start = tl.load(CuSeqlens + off_b)
    seqlen = tl.load(CuSeqlens + off_b + 1) - start
    return start, seqlen, tl.cast(off_h, tl.int64) * total + start


@triton.jit
def paged_seq_bounds(CuSeqlensK, off_b, batch, capacity):
    """For variable-length batches whose keys are pages: (number of keys, total keys) of sequence ``off_b``.

    Its length from the int32 (batch + 1,) cumulative key lengths, clamped to ``capacity`` (the keys its
    block-table row reaches, so that unchecked lengths never index past the row), and the packed batch's
    key count CuSeqlensK[batch]: the total_k of the same batch without pages (the dropout counters' row
    stride, so that the keep mask is the unpaged one).
    """
    start = tl.load(CuSeqlensK + off_b)
    seqlen = tl.minimum(tl.load(CuSeqlensK + off_b + 1) - start, capacity)
    return seqlen, tl.load(CuSeqlensK + batch)


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
def range_part(PART: tl.constexpr, lo, mid_lo, mid_hi, hi):
    """Bounds [start, end) of part PART of a ``key_range`` / ``query_range``: 0 the masked tiles before the unmasked
    ones, 1 the unmasked middle, 2 the masked tiles after (the kernels walk the parts in a ``tl.static_range(3)``)."""
    start, end = mid_lo, mid_hi
    if PART == 0:
        start, end = lo, mid_lo
    if PART == 2:
        start, end = mid_hi, hi
    return start, end


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
def alibi_slope(Alibi, off_b, off_h, stride_ab, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of one (batch entry, head) in log2 units (Alibi is (H,) with stride_ab = 0,
    or (B, H)); 0.0 when ALiBi is off."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + off_b * stride_ab + off_h) * LOG2E
    return slope


@triton.jit
def score_mod(qk, pos_q, pos_k, diag, qk_scale, softcap, slope, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Scores in log2 units from raw products ``qk`` (see the module docstring), and tanh of the
    scaled products when capped (for ``score_mod_grad``; ``qk`` itself otherwise, unused).

    pos_q and pos_k hold the query and key indices shaped to broadcast against qk: [BLOCK_M, 1] and
    [1, BLOCK_N] for a [BLOCK_M, BLOCK_N] tile, or the transpose for a transposed tile.
    """
    if HAS_SOFTCAP:
        t = tanh(qk * qk_scale)
        s = t * softcap
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        s = s - slope * tl.abs(pos_q + diag - pos_k).to(tl.float32)
    return s, t


@triton.jit
def score_mod_grad(x, t, HAS_SOFTCAP: tl.constexpr):
    """x times the cap's derivative d(softcap * tanh(y / softcap))/dy = 1 - tanh^2, given t = tanh from
    ``score_mod`` (x itself without a cap). The backward kernels apply it to P, so that
    dS = P (1 - tanh^2) (dP - delta) is the gradient with respect to the scaled products."""
    if HAS_SOFTCAP:
        x = x * (1.0 - t * t)
    return x


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


@triton.jit
def load_rows(
    src,
    off_b,
    off_h,
    start,
    stride_row,
    offs_cols,
    n_rows,
    n_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    CHECK_COLS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Rows [start, start + BLOCK_ROWS) of one head as a [BLOCK_ROWS, BLOCK_COLS] tile, zero past the ends.

    TMA: ``src`` is a tensor descriptor of the whole (B, S, H, D) tensor with block [1, BLOCK_ROWS, 1,
    BLOCK_COLS] (``tile_sources``) and (off_b, off_h) pick the head; the copy engine zero-fills rows and
    columns out of bounds, so no check is needed. Otherwise ``src`` points at the head's row 0
    (``head_base``) and the CHECK flags say which bounds ``load_tile`` checks.
    """
    if TMA:
        tile = src.load([off_b, start, off_h, 0]).reshape(BLOCK_ROWS, BLOCK_COLS)
    else:
        offs_rows = start + tl.arange(0, BLOCK_ROWS)
        ptrs = rows_at(src, start, stride_row, offs_cols, BLOCK_ROWS)
        tile = load_tile(ptrs, offs_rows, n_rows, offs_cols, n_cols, CHECK_ROWS, CHECK_COLS)
    return tile


@triton.jit
def store_rows(
    dst,
    value,
    off_b,
    off_h,
    start,
    stride_row,
    offs_cols,
    n_rows,
    n_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    CHECK_COLS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Store a [BLOCK_ROWS, BLOCK_COLS] tile as rows [start, start + BLOCK_ROWS) of one head, nothing past
    the ends; ``dst`` as ``src`` of ``load_rows`` (the copy engine clips what lies out of bounds)."""
    if TMA:
        dst.store([off_b, start, off_h, 0], value.reshape(1, BLOCK_ROWS, 1, BLOCK_COLS))
    else:
        offs_rows = start + tl.arange(0, BLOCK_ROWS)
        ptrs = rows_at(dst, start, stride_row, offs_cols, BLOCK_ROWS)
        store_tile(ptrs, value, offs_rows, n_rows, offs_cols, n_cols, CHECK_COLS)


def tile_sources(tma: bool, *tiles: tuple[torch.Tensor, int, int]):
    """What the kernels' ``load_rows``/``store_rows`` read and write for each (tensor, block rows, block
    cols): a tensor descriptor with block [1, rows, 1, cols] when ``tma`` (``tile_descriptor``), otherwise the
    tensor itself."""
    if not tma:
        return tuple(x for x, _, _ in tiles)
    return tuple(tile_descriptor(x, rows, cols) for x, rows, cols in tiles)


@triton.jit
def dropout_rows(Rng, row_ids, row_stride):
    """(seed, Philox counter of each row's first group of keys) for dropout.

    Rng holds int64 [seed, philox offset] (drawn from torch's generator by the caller); row_ids are the
    rows' LSE offsets (a unique index of each (batch, head, query row), or (head, query token) if
    IS_VARLEN) and row_stride is at least every sequence's seqlen_k. One Philox call yields four numbers,
    so keys go in groups of four: key j of a row draws number j % 4 of counter
    offset // 4 + row_id * cdiv(row_stride, 4) + j // 4, unique per (batch, head, query row, key).
    """
    seed = tl.load(Rng)
    base = tl.load(Rng + 1) // 4 + row_ids.to(tl.int64) * ((row_stride + 3) // 4)
    return seed, base


@triton.jit
def dropout_keep(seed, rows, start_n, dropout_p, BLOCK_N: tl.constexpr):
    """[rows, BLOCK_N] Philox keep mask of keys [start_n, start_n + BLOCK_N) (start_n a multiple of 4) for
    the rows whose counters ``dropout_rows`` gave: True with probability 1 - dropout_p. A pure function of
    (seed, counter), so the backward regenerates the forward's mask; one ``tl.rand4x`` per four keys."""
    groups = rows[:, None] + (start_n // 4 + tl.arange(0, BLOCK_N // 4))[None, :]  # [rows, BLOCK_N / 4]
    u0, u1, u2, u3 = tl.rand4x(seed, groups)
    u = tl.join(tl.join(u0, u1), tl.join(u2, u3))  # [rows, BLOCK_N / 4, 2, 2]: [.., a, b] is u_(2a + b)
    return tl.reshape(u, (rows.shape[0], BLOCK_N)) >= dropout_p  # key 4g + l draws u_l of group g


@triton.jit
def mask_scores(s, mask_base, stride_mm, stride_mn, pos_q, pos_k, seqlen_q, seqlen_k, MASK_IS_BOOL: tl.constexpr):
    """Apply an attention mask (``attn_mask`` of SDPA) to scores ``s`` in log2 units.

    mask_base points at element (0, 0) of one (batch entry, head) of the mask, read with its strides (0 on
    broadcast dimensions: the mask is never expanded in memory); pos_q and pos_k are shaped to broadcast
    against s, as for ``score_mod``. A boolean mask (stored as uint8, nonzero = attend) sets the others to
    -inf; an additive one is added (times log2(e)). Positions past seqlen_q or seqlen_k read nothing (the
    kernels mask those keys themselves, and those rows are never stored).
    """
    inside = (pos_q < seqlen_q) & (pos_k < seqlen_k)
    ptrs = mask_base + pos_q.to(tl.int64) * stride_mm + pos_k.to(tl.int64) * stride_mn
    if MASK_IS_BOOL:
        keep = tl.load(ptrs, mask=inside, other=0) != 0
        s = tl.where(keep, s, float("-inf"))
    else:
        s = s + tl.load(ptrs, mask=inside, other=0.0).to(tl.float32) * LOG2E
    return s


def mask_strides(attn_mask: torch.Tensor | None) -> tuple:
    """The kernels' (stride_mb, stride_mh, stride_mm, stride_mn) of a (B, H, Sq, Sk) broadcast view of the
    mask, or four None when there is none (a None argument leaves the kernel's signature as without it)."""
    if attn_mask is None:
        return (None, None, None, None)
    return tuple(attn_mask.stride())


def mask_for_kernel(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask as the kernels read it: a bool mask as uint8 (same bytes and strides), others as they are."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        return attn_mask.view(torch.uint8)
    return attn_mask
