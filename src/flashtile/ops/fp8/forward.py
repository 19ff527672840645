"""FlashAttention forward on float8 (e4m3) inputs: Triton kernel, launcher and the family's ``qualifies`` (its tile
configs: pass ``fp8_forward`` of ``ops.attention.configs``).

The algorithm is ``ops.attention.forward``'s (one program per (query tile, batch * head), online softmax in base 2,
the key tiles walked in ``tiles.key_range``'s three parts), with both products on float8 tensor cores (sm_89 and
later; Triton's ``tl.dot`` on float8e4nv operands, float32 accumulators):

- S = Q K^T from the float8 tiles as they are; the descale factors are scalars per (batch entry, KV head), so
  q_descale * k_descale folds into the softmax scale (``qk_scale``) and v_descale multiplies O at the end.
- P V with P rounded to float8: p = exp2(s - m + P_SHIFT) lies in [0, 2**P_SHIFT] = [0, 256] (e4m3 holds up to
  448) instead of [0, 1]. The shift is exact (a power of two, folded into the row max's subtraction), leaves
  out = sum p v / sum p unchanged (l sums the same shifted p), and keeps small probabilities out of e4m3's
  subnormals: e4m3's smallest normal is 2**-6, so unshifted every p < 2**-6 would lose relative precision and
  p < 2**-10 would round to 0; shifted, p down to 2**-14 keeps e4m3's full 3-bit mantissa. l sums p in float32
  before the rounding, so the LSE is that of the exact scores.
- Hopper's float8 wgmma reads both operands K-major from shared memory: for P V that is V with the keys
  contiguous, so the launcher hands the kernel V transposed, (batch, nheads_k, headdim_v, seqlen_k), written once
  per call by ``ops.fp8.transpose`` (one read and one write of V; docs/fp8.md).

The output is bfloat16 (``float8.OUTPUT_DTYPE``), the LSE float32. The kernel takes the causal mask, sliding
windows, MQA/GQA and any lengths; not the options of ``ops.attention`` (softcap, ALiBi, sink, dropout, varlen,
pages, attn_mask): ``qualifies`` lists them. The bf16/fp16/fp32 kernels are not touched by this module.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile._backend import Verdict, verdict
from flashtile.float8 import OUTPUT_DTYPE, refusals
from flashtile.ops._alloc import empty_output
from flashtile.ops._device import on_input_device
from flashtile.ops._launch import launch
from flashtile.ops.attention.configs import config
from flashtile.ops.attention.tiles import (
    batch_head,
    head_source,
    key_range,
    load_rows,
    load_tile,
    range_part,
    store_rows,
    tile_sources,
    visible,
)
from flashtile.ops.common.descriptors import per_layout, tma_ready
from flashtile.ops.common.grid import cdiv, compute_capability, head_grid, padded_head_dim
from flashtile.ops.common.math import LN2, LOG2E
from flashtile.ops.fp8.transpose import transposed_values
from flashtile.options import AttentionOptions

P_SHIFT = tl.constexpr(8.0)
"""log2 of the factor p carries before its rounding to float8 (the module docstring)."""

MIN_BLOCK_D = 32
"""The smallest head-dim tile: a float8 product reduces over at least 32 elements (Hopper's wgmma k)."""


@triton.jit
def _value_columns(vt_src, off_b, off_hk, start_n, stride_vtd, offs_dv, seqlen_k, head_dim_v,
                   BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, PAD_DV: tl.constexpr,
                   TMA: tl.constexpr):  # fmt: skip
    """Keys [start_n, start_n + BLOCK_N) of transposed V as a [BLOCK_DV, BLOCK_N] tile, zero past the ends.

    TMA: ``vt_src`` is a descriptor of the (B, Hk, DV, Sk) tensor with [1, 1, BLOCK_DV, BLOCK_N] blocks (the copy
    engine zero-fills what lies out of bounds); otherwise it points at the head's row 0 (keys contiguous)."""
    if TMA:
        tile = vt_src.load([off_b, off_hk, 0, start_n]).reshape(BLOCK_DV, BLOCK_N)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # the tile's start offsets the scalar pointer; offsets inside the tile stay 32-bit (as ``tiles.rows_at``)
        ptrs = (vt_src + start_n) + (offs_dv[:, None] * stride_vtd + tl.arange(0, BLOCK_N)[None, :])
        tile = load_tile(ptrs, offs_dv, head_dim_v, offs_n, seqlen_k, PAD_DV, MASKED)
    return tile


@triton.jit
def _fp8_forward_kernel(
    Q,
    K,
    VT,
    Out,
    Lse,
    Descale,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vtb,
    stride_vth,
    stride_vtd,
    stride_ob,
    stride_om,
    stride_oh,
    nheads,
    nheads_k,
    seqlen_q,
    seqlen_k,
    left,
    right,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_DESCALE: tl.constexpr,
    TMA: tl.constexpr,
):
    """Q (B, Sq, H, D), K (B, Sk, Hk, D) float8e4nv, VT (B, Hk, DV, >= Sk) float8e4nv with the keys contiguous
    -> Out (B, Sq, H, DV) bf16, Lse (B, H, Sq) fp32 (natural log).

    qk_scale: softmax_scale * log2(e); HAS_DESCALE: Descale (B, Hk, 2) fp32 contiguous, [q_descale * k_descale,
    v_descale] of each (batch entry, KV head). TMA: Q, K, Out are descriptors with [1, rows, 1, cols] blocks and
    VT one with [1, 1, BLOCK_DV, BLOCK_N] blocks (``tiles.load_rows``, ``_value_columns``)."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V
    tile_m = tl.program_id(0)
    if MASK_RIGHT:  # banded: the programs with the most key tiles start first
        tile_m = tl.num_programs(0) - 1 - tile_m
    off_b, off_h, off_bh = batch_head(nheads)
    off_hk = off_h // (nheads // nheads_k)
    start_m = tile_m * BLOCK_M
    diag = seqlen_k - seqlen_q
    if HAS_DESCALE:
        factors = Descale + (off_b * nheads_k + off_hk) * 2
        qk_scale = qk_scale * tl.load(factors)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_src = head_source(Q, off_b, off_h, stride_qb, stride_qh, TMA)
    k_src = head_source(K, off_b, off_hk, stride_kb, stride_kh, TMA)
    vt_src = head_source(VT, off_b, off_hk, stride_vtb, stride_vth, TMA)
    out_dst = head_source(Out, off_b, off_h, stride_ob, stride_oh, TMA)
    q = load_rows(
        q_src, off_b, off_h, start_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, PAD_D, TMA
    )  # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, mid_lo, mid_hi, hi = key_range(start_m, seqlen_k, diag, left, right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    for part in tl.static_range(3):  # key tiles of the band's left edge (masked), the middle, the right edge (masked)
        if part > 0 or MASK_LEFT:
            MASKED = part != 1
            start, end = range_part(part, lo, mid_lo, mid_hi, hi)
            for start_n in range(start, end, BLOCK_N):
                k = load_rows(
                    k_src, off_b, off_hk, start_n, stride_kn, offs_d, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED,
                    PAD_D, TMA,
                )  # [BLOCK_N, D]  # fmt: skip
                vt = _value_columns(
                    vt_src, off_b, off_hk, start_n, stride_vtd, offs_dv, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV,
                    MASKED, PAD_DV, TMA,
                )  # [DV, BLOCK_N]  # fmt: skip
                # [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]
                qk = tl.dot(q, tl.trans(k))
                if MASKED:
                    offs_n = start_n + tl.arange(0, BLOCK_N)
                    s = tl.where(
                        visible(offs_m, offs_n, seqlen_k, diag, left, right, MASK_LEFT, MASK_RIGHT),
                        qk * qk_scale,
                        float("-inf"),
                    )
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
                    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.math.exp2(s - (m_shift - P_SHIFT)[:, None])
                else:
                    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                    m_shift = m_new
                    p = tl.math.exp2(qk * qk_scale - (m_shift - P_SHIFT)[:, None])
                alpha = tl.math.exp2(m_i - m_shift)
                l_i = l_i * alpha + tl.sum(p, 1)
                # [BLOCK_M, BLOCK_N] @ [BLOCK_N, DV] -> [BLOCK_M, DV]
                acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc * alpha[:, None])
                m_i = m_new

    # A row that saw no key has l = 0: its output is 0 and its LSE -inf.
    seen = l_i > 0.0
    scale_out = 1.0 / tl.where(seen, l_i, 1.0)
    if HAS_DESCALE:
        scale_out = scale_out * tl.load(factors + 1)
    acc = acc * scale_out[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) - P_SHIFT) * LN2, float("-inf"))
    store_rows(
        out_dst, acc.to(tl.bfloat16), off_b, off_h, start_m, stride_om, offs_dv, seqlen_q, HEAD_DIM_V, BLOCK_M,
        BLOCK_DV, PAD_DV, TMA,
    )  # fmt: skip
    tl.store(Lse + off_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


# ---------------------------------------------------------------------------------------------------
# The family's entry


MIN_CAPABILITY = (8, 9)
"""float8 tensor cores: Ada (sm_89), Hopper (sm_90) and later."""


def qualifies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, varlen: bool = False
) -> Verdict:
    """Whether this kernel computes attention(q, k, v, options): float8 e4m3 q, k, v (``check_qkv``'s layouts and
    head dims), none of the options it lacks (``float8.refusals``), on a GPU with float8 tensor cores (or the
    Triton interpreter, for CPU tensors)."""
    capability = compute_capability(q.device.index) if q.device.type == "cuda" else None
    return verdict((
        None if q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn else f"dtypes {q.dtype}, {k.dtype}, {v.dtype}",
        "a packed variable-length batch" if varlen else None,
        *refusals(options),
        f"the GPU is sm_{capability[0]}{capability[1]}, without float8 tensor cores (sm_89 or later)"
        if capability is not None and capability < MIN_CAPABILITY else None,
    ))  # fmt: skip


@per_layout
def _value_descriptor(vt: torch.Tensor, block_dv: int, block_n: int) -> TensorDescriptor:
    """A descriptor of transposed V (B, Hk, DV, Sk) with [1, 1, block_dv, block_n] blocks."""
    return TensorDescriptor(vt, shape=list(vt.shape), strides=list(vt.stride()), block_shape=[1, 1, block_dv, block_n])


@functools.cache
def block_widths(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DV): ``padded_head_dim``, at least MIN_BLOCK_D."""
    return max(MIN_BLOCK_D, padded_head_dim(head_dim)), max(MIN_BLOCK_D, padded_head_dim(head_dim_v))


@on_input_device
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the float8 forward.

    Args:
        q: (batch, seqlen_q, nheads, headdim) float8_e4m3fn, last dimension contiguous
        k: (batch, seqlen_k, nheads_k, headdim) float8_e4m3fn, last dimension contiguous
        v: (batch, seqlen_k, nheads_k, headdim_v) float8_e4m3fn
        options: softmax_scale, the window and descale ((batch, nheads_k, 2) float32 contiguous, or None for ones);
            the others off (``qualifies``)

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) bfloat16, lse (batch, nheads, seqlen_q) float32
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    out = empty_output((batch, seqlen_q, nheads, head_dim_v), OUTPUT_DTYPE, q.device)
    lse = empty_output((batch, nheads, seqlen_q), torch.float32, q.device)
    vt = transposed_values(v)
    cfg = config("fp8_forward", q.device, head_dim, head_dim_v)
    block_d, block_dv = block_widths(head_dim, head_dim_v)
    tma = cfg.tma and tma_ready(q, k)  # out: fresh; vt: KEY_ALIGN-padded rows (ops.fp8.transpose)
    sources = tile_sources(tma, (q, cfg.block_m, block_d), (k, cfg.block_n, block_d))
    out_dst = tile_sources(tma, (out, cfg.block_m, block_dv))[0]
    vt_src = _value_descriptor(vt, block_dv, cfg.block_n) if tma else vt
    window_left, window_right = options.window_left, options.window_right
    args = (
        *sources, vt_src, out_dst, lse, options.descale,
        *q.stride()[:3], *k.stride()[:3], *vt.stride()[:3], *out.stride()[:3],
        nheads, nheads_k, seqlen_q, seqlen_k,
        0 if window_left is None else window_left,
        0 if window_right is None else window_right,
        options.softmax_scale * LOG2E.value,
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
        HAS_DESCALE=options.descale is not None,
        TMA=tma,
    )
    grid = head_grid(cdiv(seqlen_q, cfg.block_m), batch, nheads)
    launch(_fp8_forward_kernel, grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse
