"""The new keys and values of a decode step, as the split-KV kernel reads them and appends them to the cache.

Token t of batch entry b goes to cache position ``cache_seqlens[b] + t`` (``paged.cache_slots`` says where
that is); nothing else in the cache is written. One program per (batch entry, kv head, token) writes them to the
cache (``append_new``), the keys rotated. With APPEND_FIRST (``split_kv.appends_first``) that program is the one
whose keys include the token, before it attends, and it reads them back from the cache after a barrier of its own
threads; otherwise no program reads those cache rows: a program that attends to new keys reads them from k and v
(``load_new``), rotated exactly as they are stored, so no program waits for another's write.
"""

import triton
import triton.language as tl

from flashtile.ops.common.paged import cache_slots, load_rows
from flashtile.ops.decode.tiles import load_rotated

BLOCK_T = tl.constexpr(16)  # new tokens per store
BLOCK_NEW = tl.constexpr(16)  # new keys per attention tile (the smallest tl.dot width)


@triton.jit
def load_new(
    KNew,
    VNew,
    stride_knn,
    stride_vnn,
    t,
    t_ok,
    pos,
    Cos,
    Sin,
    stride_cos,
    seqlen_ro,
    offs_d,
    offs_dv,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr,
):
    """New tokens t [ROWS] of one batch entry and kv head (KNew, VNew point at its token 0, token t is
    stride_knn / stride_vnn further): keys [ROWS, BLOCK_D] rotated at cache positions pos [ROWS] and values
    [ROWS, BLOCK_DV], in their own dtype; zero in the rows that are not t_ok."""
    t64 = t.to(tl.int64)
    k = load_rotated(
        KNew + t64 * stride_knn, t_ok, pos, Cos, Sin, stride_cos, seqlen_ro, offs_d, HEAD_DIM, ROTARY_DIM,
        ROTARY_INTERLEAVED,
    )  # fmt: skip
    v = load_rows(VNew + t64 * stride_vnn, t_ok, offs_dv, HEAD_DIM_V, True)
    return k, v


@triton.jit
def store_new(
    k,
    v,
    t,
    t_ok,
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
    cache_len,
    offs_d,
    offs_dv,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
):
    """Write new tokens t [ROWS] (those that are t_ok) of batch entry ``off_b`` and kv head ``off_hk``, keys k
    [ROWS, BLOCK_D] and values v [ROWS, BLOCK_DV] as ``load_new`` gives them, to rows cache_len + t of KCache, VCache
    (slots, rows, Hk, D / DV)."""
    slot, row = cache_slots(
        cache_len + t, t_ok, off_b, BatchIdx, BlockTable, stride_bt, num_slots, PAGE_SIZE, HAS_BATCH_IDX
    )  # fmt: skip
    k_rows = KCache + slot * stride_kb + row * stride_kn + off_hk * stride_kh  # [ROWS]
    tl.store(k_rows[:, None] + offs_d[None, :], k, mask=t_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    v_rows = VCache + slot * stride_vb + row * stride_vn + off_hk * stride_vh
    tl.store(v_rows[:, None] + offs_dv[None, :], v, mask=t_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit
def append_new(
    KNew,
    VNew,
    KCache,
    VCache,
    BatchIdx,
    BlockTable,
    Cos,
    Sin,
    stride_knn,
    stride_vnn,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_bt,
    stride_cos,
    seqlen_ro,
    num_slots,
    off_b,
    off_hk,
    cache_len,
    t_first,
    t_end,
    t_step,
    offs_d,
    offs_dv,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr,
):
    """Write the new tokens t < t_end in tiles [t0, t0 + BLOCK_T) for t0 = t_first, t_first + t_step, ... of batch
    entry ``off_b`` and kv head ``off_hk`` (KNew, VNew as in ``load_new``) to rows cache_len + t of KCache, VCache
    (slots, rows, Hk, D / DV), the keys rotated."""
    for t0 in range(t_first, t_end, t_step):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < t_end
        k, v = load_new(
            KNew, VNew, stride_knn, stride_vnn, t, t_ok, cache_len + t, Cos, Sin, stride_cos, seqlen_ro, offs_d,
            offs_dv, HEAD_DIM, HEAD_DIM_V, ROTARY_DIM, ROTARY_INTERLEAVED,
        )  # fmt: skip
        store_new(
            k, v, t, t_ok, KCache, VCache, BatchIdx, BlockTable, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
            stride_vh, stride_bt, num_slots, off_b, off_hk, cache_len, offs_d, offs_dv, HEAD_DIM, HEAD_DIM_V,
            PAGE_SIZE, HAS_BATCH_IDX,
        )  # fmt: skip
