"""V as the float8 forward reads it: (batch, nheads_k, headdim_v, seqlen_k) with the keys contiguous.

Hopper's float8 wgmma reads both operands K-major from shared memory, and the K of P V is the keys, so the forward
(``ops.fp8.forward``) takes V transposed, written once per call by ``transposed_values``. The copy moves every
byte of V once each way; a torch copy of the permuted view (``vt.copy_(v.permute(0, 2, 3, 1))``) does it at about
a tenth of the memory bandwidth (0.44 ms for 32k tokens of 16 heads of 128 on an H100; docs/fp8.md), the kernel
here in tiles of [BLOCK_N keys, BLOCK_DV] read along v's rows, transposed in registers (``tl.trans``) and written
along vt's rows, both sides coalesced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtile.ops._alloc import empty_output
from flashtile.ops._launch import launch
from flashtile.ops.attention.tiles import batch_head, head_base, load_tile, rows_at, store_tile
from flashtile.ops.common.grid import cdiv, head_grid, padded_head_dim

KEY_ALIGN = 16
"""Transposed V's rows hold seqlen_k rounded up to this many keys, so that its row stride is 16-byte aligned (a
tensor descriptor's condition); the keys past seqlen_k hold zeros and are never read (out of the descriptor's
shape, or masked)."""

BLOCK_N = 64
"""Keys per program: a [64, BLOCK_DV] tile is 1-16 KiB of float8, thousands of programs at prefill lengths."""
NUM_WARPS = 4


@triton.jit
def _transpose_values_kernel(
    V,
    VT,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_vtb,
    stride_vth,
    stride_vtd,
    nheads_k,
    seqlen_k,
    padded_k,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """V (B, Sk, Hk, DV) with a contiguous last dimension -> VT (B, Hk, DV, padded_k) with a contiguous last
    dimension, keys [BLOCK_N * program_id(0), + BLOCK_N) of head program_id(1) of batch entry program_id(2).

    padded_k: seqlen_k rounded up to KEY_ALIGN. The keys in [seqlen_k, padded_k) are written as zeros: a store
    bounded by a multiple of 16 keys stays 16-byte vectors whatever seqlen_k (a bound Triton cannot prove a
    multiple of 16 splits every store into bytes)."""
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V
    off_b, off_hk, _ = batch_head(nheads_k)
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    v_rows = rows_at(head_base(V, off_b, off_hk, stride_vb, stride_vh), start_n, stride_vn, offs_dv, BLOCK_N)
    tile = load_tile(v_rows, offs_n, seqlen_k, offs_dv, HEAD_DIM_V, True, PAD_DV)  # [BLOCK_N, BLOCK_DV]
    # the tile's first key offsets the scalar pointer; vt's rows are the head dim, its columns the keys
    vt_rows = rows_at(head_base(VT, off_b, off_hk, stride_vtb, stride_vth) + start_n, 0, stride_vtd,
                      tl.arange(0, BLOCK_N), BLOCK_DV)  # fmt: skip
    store_tile(vt_rows, tl.trans(tile), offs_dv, HEAD_DIM_V, offs_n, padded_k, True)  # [BLOCK_DV, BLOCK_N]


def transposed_values(v: torch.Tensor) -> torch.Tensor:
    """v (B, Sk, Hk, DV) with a contiguous last dimension (``interface.prepared`` makes it so; any other strides) as
    the float8 forward reads it: (B, Hk, DV, Sk) with the keys contiguous, each row KEY_ALIGN-padded (with zeros, never
    read), returned as the (B, Hk, DV, Sk) view."""
    batch, seqlen_k, nheads_k, head_dim_v = v.shape
    rows = cdiv(seqlen_k, KEY_ALIGN) * KEY_ALIGN
    vt = empty_output((batch, nheads_k, head_dim_v, rows), v.dtype, v.device)[..., :seqlen_k]
    args = (v, vt, v.stride(0), v.stride(1), v.stride(2), *vt.stride()[:3], nheads_k, seqlen_k, rows)
    constexprs = dict(HEAD_DIM_V=head_dim_v, BLOCK_N=BLOCK_N, BLOCK_DV=padded_head_dim(head_dim_v))
    launch(_transpose_values_kernel, head_grid(cdiv(seqlen_k, BLOCK_N), batch, nheads_k), args, constexprs,
           num_warps=NUM_WARPS)  # fmt: skip
    return vt
