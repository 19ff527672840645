"""Append new keys and values to the KV cache in place, rotating the keys on the way.

One program per (tile of new tokens, batch entry, kv head). Token t of batch entry b goes to cache
position ``cache_seqlens[b] + t`` (see ``tiles.cache_slots`` for where that is); nothing else in the
cache is written.
"""

import torch
import triton
import triton.language as tl

from flashtile.ops.decode import configs
from flashtile.ops.decode.tiles import cache_length, cache_slots, load_rotated, load_rows

BLOCK_T = 16  # new tokens per program


@triton.jit
def _append_kernel(
    K,
    V,
    KCache,
    VCache,
    CacheSeqlens,
    BatchIdx,
    BlockTable,
    Cos,
    Sin,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_kcb,
    stride_kcn,
    stride_kch,
    stride_vcb,
    stride_vcn,
    stride_vch,
    stride_bt,
    stride_cos,
    seqlen_new,
    seqlen_cache,
    seqlen_ro,
    num_slots,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr,
):
    """K (B, Sn, Hk, D), V (B, Sn, Hk, DV) -> rows cache_seqlens[b] + [0, Sn) of KCache, VCache.

    Index values are clamped into the cache as the attention kernel clamps them (``tiles``)."""
    tile_t = tl.program_id(0)
    off_b = tl.program_id(1)
    off_h = tl.program_id(2)
    offs_t = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    t_ok = offs_t < seqlen_new
    pos = cache_length(CacheSeqlens, off_b, seqlen_cache, seqlen_new, True) + offs_t  # [BLOCK_T] cache positions
    slot, row = cache_slots(pos, t_ok, off_b, BatchIdx, BlockTable, stride_bt, num_slots, PAGE_SIZE, HAS_BATCH_IDX)

    b64 = tl.cast(off_b, tl.int64)
    k_rows = K + b64 * stride_kb + off_h * stride_kh + offs_t * stride_kn  # [BLOCK_T]
    k = load_rotated(
        k_rows, t_ok, pos, Cos, Sin, stride_cos, seqlen_ro, offs_d, HEAD_DIM, ROTARY_DIM, ROTARY_INTERLEAVED
    )
    kc_rows = KCache + slot * stride_kcb + row * stride_kcn + off_h * stride_kch  # [BLOCK_T]
    tl.store(kc_rows[:, None] + offs_d[None, :], k, mask=t_ok[:, None] & (offs_d < HEAD_DIM)[None, :])

    v_rows = V + b64 * stride_vb + off_h * stride_vh + offs_t * stride_vn
    v = load_rows(v_rows, t_ok, offs_dv, HEAD_DIM_V, True)  # [BLOCK_T, DV]
    vc_rows = VCache + slot * stride_vcb + row * stride_vcn + off_h * stride_vch
    tl.store(vc_rows[:, None] + offs_dv[None, :], v, mask=t_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


def append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    rotary_interleaved: bool,
) -> None:
    """Write k, v (rotating k) into k_cache, v_cache at rows cache_seqlens[b] + [0, seqlen_new).

    Args:
        k: (batch, seqlen_new, nheads_k, headdim), last dimension contiguous
        v: (batch, seqlen_new, nheads_k, headdim_v), last dimension contiguous
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim[_v]), or
            (num_blocks, page_block_size, nheads_k, headdim[_v]) with a block_table; last dimension contiguous
        cache_seqlens: (batch,) int32, the cache length of each batch entry before the append
        cache_batch_idx: (batch,) int32 cache entry of each batch entry, or None for 0..batch-1
        block_table: (batch, max_blocks_per_seq) int32 page indices, or None for a contiguous cache
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) contiguous, or None for no rotary
        rotary_interleaved: rotate pairs (2f, 2f + 1) rather than (f, f + rotary_dim / 2)
    """
    batch, seqlen_new, nheads_k, head_dim = k.shape
    if k.numel() == 0:
        return
    head_dim_v = v.shape[3]
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    seqlen_cache = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    grid = (configs.cdiv(seqlen_new, BLOCK_T), batch, nheads_k)
    _append_kernel[grid](
        k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
        *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        0 if block_table is None else block_table.stride(0),
        0 if rotary_cos is None else rotary_cos.stride(0),
        seqlen_new, seqlen_cache, 0 if rotary_cos is None else rotary_cos.shape[0], k_cache.shape[0],
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=configs.tile_width(head_dim),
        BLOCK_DV=configs.tile_width(head_dim_v),
        BLOCK_T=BLOCK_T,
        PAGE_SIZE=0 if block_table is None else k_cache.shape[1],
        HAS_BATCH_IDX=cache_batch_idx is not None,
        ROTARY_DIM=rotary_dim,
        ROTARY_INTERLEAVED=rotary_interleaved,
    )  # fmt: skip
