"""FlashAttention on the CPU: the tiled online-softmax algorithm in plain PyTorch.

This is the path flashtile takes for CPU tensors. It computes exact attention

    S = scale * Q K^T,    P = softmax(S) (row-wise),    O = P V

without ever holding the (seqlen_q, seqlen_k) matrices S or P: it works on a query tile of
BLOCK_M rows against a key tile of BLOCK_N columns at a time, so the extra memory is
O(seqlen * headdim + BLOCK_M * BLOCK_N), linear in the sequence length. It is the same algorithm
as the Triton kernels, written to be read.

Forward: online softmax
-----------------------
For one query tile, stream the key/value tiles j = 0, 1, ... and keep, per query row, the
running max ``m_i`` of the scores seen so far, the running sum ``l_i = sum exp(s - m_i)`` over
them and an unnormalised output ``acc = sum exp(s - m_i) v``. On each new score tile S_j:

    m_new = max(m_i, rowmax(S_j))
    P_j   = exp(S_j - m_new)
    alpha = exp(m_i - m_new)            # rescales what was summed against the old max
    l_i   = alpha * l_i + rowsum(P_j)
    acc   = alpha * acc + P_j V_j
    m_i   = m_new

After the last tile, ``O = acc / l_i`` and the log-sum-exp ``LSE = m_i + log(l_i)`` is saved for
the backward. Subtracting the running max keeps every exp() <= 1, so nothing overflows.

Backward: recompute P from the LSE
----------------------------------
P is not stored; from the saved LSE it is one exp away: ``P_ij = exp(S_ij - LSE_i)``. With
dO the gradient of O:

    Delta = rowsum(dO * O)              # = rowsum(P * dP), computed once per query row
    dV   += P^T dO
    dP    = dO V^T
    dS    = P * (dP - Delta)            # softmax backward
    dQ   += dS K * scale
    dK   += dS^T Q * scale

A gradient ``dlse`` arriving at the LSE adds ``dlse_i * P_ij`` to dS (d LSE_i / d S_ij = P_ij),
so it enters as ``Delta - dlse``. The outer loop runs over query tiles (dQ of a tile is finished
in place), the inner over key tiles; dK and dV are float32 accumulators of size (seqlen_k, headdim).

Layout and precision
--------------------
Inputs are flash_attn's (batch, seqlen, nheads, headdim) with any strides; they are viewed as
(batch, nheads, seqlen, headdim) without a copy, and all (batch, head) pairs of a tile go through
one batched matmul. With grouped-query attention (nheads = group * nheads_k) the query tile of
the ``group`` heads that share a key/value head is reshaped to (batch, nheads_k, group * BLOCK_M,
headdim), so each key/value tile is used once per query tile. Tiles are upcast to float32
(float64 stays float64) and accumulated there; results are cast back at the end.

Score modifications and sinks
-----------------------------
With ``softcap > 0`` the scaled scores are capped, ``S = softcap * tanh(scale * Q K^T / softcap)``,
and with ALiBi slopes a bias ``-slope * |i + seqlen_k - seqlen_q - j|`` is added (flash_attn's order).
In the backward the cap multiplies dS by its derivative ``1 - tanh^2`` before dQ and dK. A learnable
sink joins each row's softmax denominator as one more score with no value: the online softmax starts
from ``m_i = sink, l_i = 1`` instead of ``-inf, 0``, so the LSE includes it and a row that sees no key
gets output 0 and LSE = sink. P computed from that LSE is already right for the backward; the sink's
own gradient is ``-sum_i exp(sink - LSE_i) * Delta_i``, from ``attention_delta`` (see ``flashtile._ops``).

Dropout
-------
With ``dropout_p > 0`` the probabilities are dropped after the softmax, as flash_attn does:
``O = (P * Z / (1 - p)) V`` with the LSE unchanged (the row sum ``l_i`` keeps every probability), and
in the backward ``dV = (P * Z / (1 - p))^T dO``, ``dS = P * (Z / (1 - p) * dP - Delta)`` with Delta
from the dropped output as always. The keep mask Z is a pure function of (seed, offset, row id, key
index): an integer hash (``_dropout_keep``) in torch ops, so the backward regenerates it tile by tile
without storing it, and tile boundaries do not matter. It is deterministic for a seed but not bit for
bit the Triton kernels' Philox mask.

Masks are bottom-right aligned as in flash_attn: with a window (left, right), query i sees key j
iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (causal: no left
bound, right = 0). Key tiles that no row of the query tile can see are skipped, and a mask is
built only for tiles that the band's edges cut. A query row that sees no key
(possible when seqlen_q > seqlen_k) gets output 0, LSE -inf and zero gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashtile import paged

BLOCK_M = 128  # query rows per tile (times the GQA group size)
BLOCK_N = 256  # key columns per tile; 128x256 to 256x512 all ran within ~10% here


_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) (int or int64 tensor) without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """murmur3's 32-bit finaliser: a bijection on [0, 2**32) that spreads every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@dataclass(frozen=True)
class _Dropout:
    """Dropout of one call: probability p, seed and offset (from rng_state), and how a tile row maps to
    a row id unique per (batch, head, query row): row_id = b * stride_b + h * stride_h + row0 + i."""

    p: float
    seed: int
    offset: int
    stride_b: int
    stride_h: int
    row0: int = 0


def _dropout(dropout_p: float, rng_state: Tensor | None, nheads: int, seqlen_q: int, row0: int = 0,
             stride_b: int | None = None, stride_h: int | None = None) -> _Dropout | None:  # fmt: skip
    """The dropout of a call (None when off); row ids default to (b * nheads + h) * seqlen_q + i."""
    if dropout_p <= 0.0:
        return None
    seed, offset = (int(x) for x in rng_state.tolist())
    stride_h = seqlen_q if stride_h is None else stride_h
    stride_b = nheads * seqlen_q if stride_b is None else stride_b
    return _Dropout(dropout_p, seed, offset, stride_b, stride_h, row0)


def _dropout_keep(drop: _Dropout, B: int, Hk: int, group: int, q0: int, q1: int, k0: int, k1: int) -> Tensor:
    """Boolean keep mask (B, Hk, group * (q1 - q0), k1 - k0) of a tile, True with probability 1 - p."""
    b = torch.arange(B)[:, None, None, None]
    h = (torch.arange(Hk)[:, None] * group + torch.arange(group)[None, :])[None, :, :, None]
    row = b * drop.stride_b + h * drop.stride_h + drop.row0 + torch.arange(q0, q1)[None, None, None, :]
    key = _mix32((drop.seed & _M32) ^ _mix32((drop.seed >> 32) ^ _mix32((drop.offset & _M32) ^ (drop.offset >> 32))))
    r = _mix32(_mix32((row & _M32) ^ key) ^ (row >> 32)).reshape(B, Hk, -1, 1)
    cols = _mix32((torch.arange(k0, k1) + key) & _M32)
    u = _mix32(r ^ cols[None, None, None, :]) >> 8  # 24 uniform bits
    return u >= round(drop.p * (1 << 24))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16/fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _key_span(q0: int, q1: int, seqlen_q: int, seqlen_k: int, left: int | None, right: int | None) -> range:
    """Start of each key tile that a query row in [q0, q1) may see (empty if none sees any key)."""
    diag = seqlen_k - seqlen_q
    lo = 0 if left is None else max(0, q0 + diag - left)
    hi = seqlen_k if right is None else min(seqlen_k, q1 + diag + right)
    return range(lo, hi, BLOCK_N)


def _band_mask(
    q0: int, q1: int, k0: int, k1: int, seqlen_q: int, seqlen_k: int, left: int | None, right: int | None
) -> Tensor | None:
    """Boolean (q1 - q0, k1 - k0) mask, True where query i may see key j; None if all may."""
    diag = seqlen_k - seqlen_q
    left_clear = left is None or k0 >= q1 - 1 + diag - left  # the last row sees the tile's first key
    right_clear = right is None or k1 - 1 <= q0 + diag + right  # the first row sees the tile's last key
    if left_clear and right_clear:
        return None
    i = torch.arange(q0, q1)[:, None]
    j = torch.arange(k0, k1)[None, :]
    visible = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
    if left is not None:
        visible &= j >= i + diag - left
    if right is not None:
        visible &= j <= i + diag + right
    return visible


@dataclass(frozen=True)
class _ScoreMods:
    """What changes a scaled score besides the mask: a tanh cap (0 = off) and ALiBi slopes, shaped
    (B or 1, Hk, group, 1, 1) in the compute dtype (None = off); ``diag`` is seqlen_k - seqlen_q."""

    softcap: float = 0.0
    slopes: Tensor | None = None
    diag: int = 0


def _score_mods(
    alibi_slopes: Tensor | None, softcap: float, nheads_k: int, diag: int, dtype: torch.dtype
) -> _ScoreMods:
    """The score modifications of a call, slopes reshaped to broadcast against a tile's scores."""
    slopes = None
    if alibi_slopes is not None:  # (H,) or (B, H) -> (B or 1, Hk, group, 1, 1)
        slopes = alibi_slopes.to(dtype).reshape(-1, nheads_k, alibi_slopes.shape[-1] // nheads_k, 1, 1)
    return _ScoreMods(softcap, slopes, diag)


def _scores(
    q_t: Tensor, k_t: Tensor, scale: float, mask: Tensor | None, group: int, mods: _ScoreMods, q0: int, k0: int
) -> tuple[Tensor, Tensor | None]:
    """Scores of one tile, and tanh of the scaled scores if they are capped (for the backward).

    q_t: (B, Hk, group * M, D) holding query rows from q0, k_t: (B, Hk, N, D) holding keys from k0,
    mask: (M, N) or None -> s: (B, Hk, group * M, N), masked entries -inf; t: like s, or None.
    """
    s = torch.matmul(q_t, k_t.transpose(-1, -2))  # [gM, D] @ [D, N] -> [gM, N]
    t = None
    if mods.softcap > 0.0:
        t = s.mul_(scale / mods.softcap).tanh_()
        s = t * mods.softcap
    else:
        s.mul_(scale)
    B, Hk, _, N = s.shape
    s_heads = s.view(B, Hk, group, -1, N)  # query heads of a group apart
    if mods.slopes is not None:
        i = torch.arange(q0, q0 + s_heads.shape[3])[:, None]
        j = torch.arange(k0, k0 + N)[None, :]
        s_heads.sub_(mods.slopes * (i + mods.diag - j).abs().to(s.dtype))  # -slope * |i + Sk - Sq - j|
    if mask is not None:
        s_heads.masked_fill_(~mask, float("-inf"))
    return s, t


def _apply_attn_mask(
    s: Tensor, attn_mask: Tensor | None, q0: int, q1: int, k0: int, k1: int, nheads_k: int, dtype: torch.dtype
) -> None:
    """Apply the tile [q0, q1) x [k0, k1) of SDPA's (B, H, Sq, Sk) mask view to s (B, Hk, group * M, N) in place."""
    if attn_mask is None:
        return
    tile = attn_mask[:, :, q0:q1, k0:k1].reshape(s.shape[0], nheads_k, -1, k1 - k0)  # copies one tile at most
    if tile.dtype == torch.bool:
        s.masked_fill_(~tile, float("-inf"))
    else:
        s.add_(tile.to(dtype))


def _query_tile(x: Tensor, q0: int, q1: int, nheads_k: int, dtype: torch.dtype) -> Tensor:
    """Rows [q0, q1) of x (B, S, H, D) as (B, Hk, group * (q1 - q0), D) in ``dtype``."""
    B, _, H, D = x.shape
    return x[:, q0:q1].transpose(1, 2).to(dtype).reshape(B, nheads_k, -1, D)


def _key_tile(x: Tensor, k0: int, k1: int, dtype: torch.dtype) -> Tensor:
    """Rows [k0, k1) of x (B, S, Hk, D) as (B, Hk, k1 - k0, D) in ``dtype``."""
    return x[:, k0:k1].transpose(1, 2).to(dtype)


def _store_query_tile(dst: Tensor, q0: int, q1: int, tile: Tensor) -> None:
    """Write tile (B, Hk, group * M, D) into rows [q0, q1) of dst (B, S, H, D), casting."""
    B, _, H, D = dst.shape
    dst[:, q0:q1] = tile.view(B, H, q1 - q0, D).transpose(1, 2)


def _delta_tile(
    dout: Tensor, out: Tensor, dlse: Tensor | None, q0: int, q1: int, nheads_k: int, dtype: torch.dtype
) -> Tensor:
    """rowsum(dO * O) - dLSE for rows [q0, q1) as (B, Hk, group * (q1 - q0), 1) in ``dtype``."""
    B = dout.shape[0]
    delta = (_query_tile(dout, q0, q1, nheads_k, dtype) * _query_tile(out, q0, q1, nheads_k, dtype)).sum(
        dim=-1, keepdim=True
    )
    if dlse is not None:
        delta -= dlse[:, :, q0:q1].reshape(B, nheads_k, -1, 1).to(dtype)
    return delta


@torch.no_grad()
def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    alibi_slopes: Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    _drop: _Dropout | None = None,
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention by tiles with online softmax.

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32/fp64, any strides
        k: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0; query head h uses
           key/value head h // (nheads // nheads_k)
        v: (batch, seqlen_k, nheads_k, headdim_v)
        softmax_scale: multiplies Q K^T before the softmax
        window_left, window_right: the visible band, bottom-right aligned as in flash_attn: query i
           sees key j iff i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right;
           None leaves a side unbounded. Causal is (None, 0): j <= i + seqlen_k - seqlen_q.
           For seqlen_q = 5, seqlen_k = 3 (1 = visible), the first two rows see nothing:
               0 0 0
               0 0 0
               1 0 0
               1 1 0
               1 1 1
           and for seqlen_q = 2, seqlen_k = 5:
               1 1 1 1 0
               1 1 1 1 1
        alibi_slopes: (nheads,) or (batch, nheads) float32: adds -slope * |i + seqlen_k - seqlen_q - j|
        softcap: > 0 caps the scaled scores to softcap * tanh(score / softcap) (before ALiBi)
        learnable_sink: (nheads,) float32 logit that joins each row's softmax denominator
        dropout_p: probability of dropping each attention probability (kept ones scaled by 1 / (1 - p))
        rng_state: with dropout, int64 (2,) [seed, offset] (see the module docstring)
        _drop: the varlen path's per-sequence dropout (replaces dropout_p and rng_state)
        attn_mask: SDPA's mask as a (batch, nheads, seqlen_q, seqlen_k) view (broadcast dimensions of stride 0,
           never expanded in memory): boolean (True = attend) or additive (added to the scaled scores);
           read one (query tile, key tile) at a time

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v) in q.dtype, contiguous; 0 for a row that sees no key
        lse: (batch, nheads, seqlen_q) float32, natural-log sum of exp of the scores (and the sink);
           for a row that sees no key -inf, or the sink's value
    """
    B, Sq, H, _ = q.shape
    _, Sk, Hk, Dv = v.shape
    group = H // Hk
    dtype = _compute_dtype(q.dtype)
    mods = _score_mods(alibi_slopes, softcap, Hk, Sk - Sq, dtype)
    drop = _drop if _drop is not None else _dropout(dropout_p, rng_state, H, Sq)
    out = torch.empty(B, Sq, H, Dv, dtype=q.dtype)
    lse = torch.empty(B, H, Sq, dtype=torch.float32)
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        q_t = _query_tile(q, q0, q1, Hk, dtype)  # (B, Hk, gM, D)
        if learnable_sink is None:
            m_i = torch.full((*q_t.shape[:-1], 1), float("-inf"), dtype=dtype)  # running row max
            l_i = torch.zeros_like(m_i)  # running row sum of exp(s - m_i)
        else:  # the sink is the first score seen: m = sink, l = exp(sink - m) = 1
            m_i = learnable_sink.to(dtype).view(1, Hk, group, 1, 1).expand(B, Hk, group, q1 - q0, 1)
            m_i = m_i.reshape(B, Hk, -1, 1)
            l_i = torch.ones_like(m_i)
        acc = torch.zeros(*q_t.shape[:-1], Dv, dtype=dtype)  # running sum of exp(s - m_i) v
        for k0 in _key_span(q0, q1, Sq, Sk, window_left, window_right):
            k1 = min(k0 + BLOCK_N, Sk)
            mask = _band_mask(q0, q1, k0, k1, Sq, Sk, window_left, window_right)
            s, _ = _scores(q_t, _key_tile(k, k0, k1, dtype), softmax_scale, mask, group, mods, q0, k0)
            _apply_attn_mask(s, attn_mask, q0, q1, k0, k1, Hk, dtype)
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with no key seen yet
            p = torch.exp_(s.sub_(m_safe))
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            if drop is not None:  # l_i keeps every probability; only P V sees the mask
                p.mul_(_dropout_keep(drop, B, Hk, group, q0, q1, k0, k1))
            acc = acc.mul_(alpha).add_(torch.matmul(p, _key_tile(v, k0, k1, dtype)))  # [gM, N] @ [N, Dv]
            m_i = m_new
        if drop is not None:
            acc.mul_(1.0 / (1.0 - drop.p))
        _store_query_tile(out, q0, q1, acc / l_i.masked_fill(l_i == 0, 1.0))
        lse[:, :, q0:q1] = (m_i + torch.log(l_i)).view(B, H, q1 - q0)  # -inf + log 0 = -inf if nothing seen
    return out, lse


@torch.no_grad()
def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    dlse: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    _drop: _Dropout | None = None,
    attn_mask: Tensor | None = None,
    dmask: Tensor | None = None,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention, recomputing P tile by tile from the saved LSE.

    Args:
        dout: (batch, seqlen_q, nheads, headdim_v), gradient of ``out``
        q, k, v, softmax_scale, window_left, window_right, alibi_slopes, softcap: as given to
           ``attention_forward``
        out: (batch, seqlen_q, nheads, headdim_v), as returned by ``attention_forward``
        lse: (batch, nheads, seqlen_q) float32, as returned by ``attention_forward``
        dlse: (batch, nheads, seqlen_q) float32 gradient of ``lse``, or None for zero
        learnable_sink: unused (the LSE includes it); its gradient comes from ``attention_delta``
        dropout_p, rng_state, _drop: as given to ``attention_forward`` (the mask is regenerated)
        attn_mask: as given to ``attention_forward``
        dmask: None, or a (batch, nheads, seqlen_q, seqlen_k) float buffer that receives dS = P (dP - delta),
           the gradient at an additive mask before any reduction over its broadcast dimensions
        deterministic: unused: this path is always deterministic

    Returns:
        dq: (batch, seqlen_q, nheads, headdim) in q.dtype
        dk: (batch, seqlen_k, nheads_k, headdim) in k.dtype, summed over each group of query heads
        dv: (batch, seqlen_k, nheads_k, headdim_v) in v.dtype, likewise
    """
    B, Sq, H, _ = q.shape
    _, Sk, Hk, _ = k.shape
    group = H // Hk
    dtype = _compute_dtype(q.dtype)
    mods = _score_mods(alibi_slopes, softcap, Hk, Sk - Sq, dtype)
    drop = _drop if _drop is not None else _dropout(dropout_p, rng_state, H, Sq)
    dq = torch.empty(q.shape, dtype=q.dtype)
    dk = torch.zeros(B, Sk, Hk, k.shape[-1], dtype=dtype)
    dv = torch.zeros(B, Sk, Hk, v.shape[-1], dtype=dtype)
    dk_acc, dv_acc = dk.transpose(1, 2), dv.transpose(1, 2)  # (B, Hk, Sk, D) views of the accumulators
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        q_t = _query_tile(q, q0, q1, Hk, dtype)  # (B, Hk, gM, D)
        do_t = _query_tile(dout, q0, q1, Hk, dtype)  # (B, Hk, gM, Dv)
        delta = _delta_tile(dout, out, dlse, q0, q1, Hk, dtype)  # (B, Hk, gM, 1)
        lse_t = lse[:, :, q0:q1].reshape(B, Hk, -1, 1).to(dtype)
        lse_t = lse_t.masked_fill(lse_t == float("-inf"), 0.0)  # rows with no key: P = exp(-inf) = 0
        dq_t = torch.zeros_like(q_t)
        for k0 in _key_span(q0, q1, Sq, Sk, window_left, window_right):
            k1 = min(k0 + BLOCK_N, Sk)
            mask = _band_mask(q0, q1, k0, k1, Sq, Sk, window_left, window_right)
            k_t = _key_tile(k, k0, k1, dtype)
            v_t = _key_tile(v, k0, k1, dtype)
            s, t = _scores(q_t, k_t, softmax_scale, mask, group, mods, q0, k0)
            _apply_attn_mask(s, attn_mask, q0, q1, k0, k1, Hk, dtype)
            p = torch.exp_(s.sub_(lse_t))  # (B, Hk, gM, N)
            dp = torch.matmul(do_t, v_t.transpose(-1, -2))  # [gM, Dv] @ [Dv, N] -> [gM, N]
            if drop is None:
                dv_acc[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), do_t)  # [N, gM] @ [gM, Dv]
            else:  # the gradient at P is Z / (1 - p) * dP; dV's 1 / (1 - p) is applied at the end
                keep = _dropout_keep(drop, B, Hk, group, q0, q1, k0, k1)
                dv_acc[:, :, k0:k1] += torch.matmul((p * keep).transpose(-1, -2), do_t)
                dp.mul_(keep).mul_(1.0 / (1.0 - drop.p))
            ds = p.mul_(dp.sub_(delta))  # reuses p's memory: p is not needed after this
            if dmask is not None:  # the gradient at the mask: dS before the cap's derivative
                dmask[:, :, q0:q1, k0:k1] = ds.view(B, -1, q1 - q0, k1 - k0)
            if t is not None:
                ds.mul_(t.mul_(t).neg_().add_(1.0))  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
            dq_t += torch.matmul(ds, k_t)  # [gM, N] @ [N, D]
            dk_acc[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), q_t)  # [N, gM] @ [gM, D]
        _store_query_tile(dq, q0, q1, dq_t.mul_(softmax_scale))
    if drop is not None:
        dv.mul_(1.0 / (1.0 - drop.p))
    return dq, dk.mul_(softmax_scale).to(k.dtype), dv.to(v.dtype)


@torch.no_grad()
def attention_delta(dout: Tensor, out: Tensor, dlse: Tensor | None = None) -> Tensor:
    """Delta = rowsum(dout * out) - dlse, (batch, nheads, seqlen_q), float32 (float64 for float64 inputs).

    dout, out: (batch, seqlen_q, nheads, headdim_v); dlse: (batch, nheads, seqlen_q) or None.
    """
    B, Sq, H, _ = out.shape
    dtype = _compute_dtype(out.dtype)
    delta = torch.empty(B, H, Sq, dtype=dtype)
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        delta[:, :, q0:q1] = _delta_tile(dout, out, dlse, q0, q1, H, dtype).view(B, H, q1 - q0)
    return delta


def _sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> list[tuple[int, int, int, int, int]]:
    """(b, q0, q1, k0, k1) per sequence: its rows of the packed q and k."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(b, cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _slopes_of(alibi_slopes: Tensor | None, b: int) -> Tensor | None:
    """The (nheads,) slopes of sequence b from (nheads,) or (batch, nheads) slopes."""
    return alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]


@torch.no_grad()
def varlen_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    alibi_slopes: Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    block_table: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``attention_forward`` on a variable-length batch, one sequence (a B=1 view) at a time.

    q (total_q, nheads, headdim), k (total_k, nheads_k, headdim), v (total_k, nheads_k, headdim_v);
    sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]). Returns out (total_q, nheads, headdim_v) and
    lse (nheads, total_q) float32. max_seqlen_* are not needed here. Dropout row ids are
    h * total_q + (the query's token index), unique over the packed batch. With a block_table, k and v are
    pages (num_blocks, page_block_size, nheads_k, headdim[_v]), gathered first into those packed keys
    (``flashtile.paged``).
    """
    if block_table is not None:
        slots = paged.packed_slots(block_table, cu_seqlens_k, k)
        k, v = k[slots], v[slots]
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        o_b, lse_b = attention_forward(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, window_left, window_right,
            _slopes_of(alibi_slopes, b), softcap, learnable_sink,
            _drop=_dropout(dropout_p, rng_state, q.shape[1], q.shape[0], row0=q0, stride_b=0),
        )  # fmt: skip
        out[q0:q1] = o_b[0]
        lse[:, q0:q1] = lse_b[0]
    return out, lse


@torch.no_grad()
def varlen_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    dlse: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``attention_backward`` on a variable-length batch, one sequence at a time (layouts as in
    ``varlen_attention_forward``; lse and dlse (nheads, total_q)). A sequence without queries or keys
    contributes zero gradients."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        dq_b, dk_b, dv_b = attention_backward(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            lse[None, :, q0:q1], softmax_scale, window_left, window_right,
            None if dlse is None else dlse[None, :, q0:q1], _slopes_of(alibi_slopes, b), softcap, learnable_sink,
            _drop=_dropout(dropout_p, rng_state, q.shape[1], q.shape[0], row0=q0, stride_b=0),
        )  # fmt: skip
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = dq_b[0], dk_b[0], dv_b[0]
    return dq, dk, dv
