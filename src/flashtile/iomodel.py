"""FLOPs and HBM bytes of attention: what flashtile computes and moves, and what standard attention moves.

The one place these are counted: ``flashtile.profile()``, ``flashtile check``, ``flashtile bench`` and the scripts in
``benchmarks/`` all use it.

FLOPs follow FlashAttention's convention: the two matrix products of the forward, 2 * (D + Dv) FLOP per visible
(query, key) pair and head (4 * N^2 * D for one full head at D = Dv), the backward 2.5 times the forward (its five
products against the forward's two), nothing for the softmax. Only visible pairs count: a causal mask or a window
hides the rest (``visible_pairs``, exact); the field's tables halve N^2 for causal instead (``convention_flops``).

Bytes are a model of the algorithm, not a measurement (``benchmarks/ncu_io.py`` checks it against Nsight Compute's
DRAM counters). It counts each tensor a kernel reads or writes in HBM, at the tile sizes of the kernels that run,
and assumes no reuse through the L2 cache (a real GPU's L2 serves some of the repeated K/V reads, so a measurement
comes out at or below the model):

- forward: Q once; K and V once per query tile, for the key tiles that tile sees (n_query_tiles x the visible
  fraction of the keys); O and LSE written; an attn_mask read where visible.
- backward (``dq_atomic`` False, the Triton kernels): delta = rowsum(dO * O) reads O and dO and writes delta; the
  dK/dV kernel reads K and V once and Q, dO, LSE and delta once per key tile (n_key_tiles x visible fraction), and
  writes dK and dV; the dQ kernel reads Q, dO, LSE and delta once and K and V once per query tile, and writes dQ.
  With ``dq_atomic`` (the sm_90 Gluon backward): one kernel reads K and V once and Q, dO, LSE, delta once per key
  tile, adds dQ partials into an fp32 accumulator (a read and a write of its rows per key tile, zeroed first and
  cast to dQ at the end) and writes dK and dV.
- decode: q, the visible part of the K/V cache once, the new keys and values read and appended, out and LSE written.
- the floor (``compulsory_bytes``): every input read once, every output written once, what a GPU whose L2 cache
  served all repeated reads would move; real traffic lies between it and the model.
- standard attention (``standard_bytes``): the same problem with the score matrix S (B, H, Sq, Sk) in HBM, in the
  inputs' dtype: the forward writes S, reads it, writes P = softmax(S) and reads P (4 S-sized transfers) besides
  reading Q, K, V and writing O; the backward writes dP, reads P and dP and writes dS, reads dS twice (dQ, dK) and P
  once (dV): 7 transfers, besides Q, K, V, dO and the gradients. Causal attention materialises the full S.

GQA: the query heads of one K/V head each read its K and V (a program per query head), so K/V reads scale with the
query heads; K and V themselves, and dK and dV, have nheads_k heads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BWD_FLOPS_FACTOR = 2.5
"""Backward FLOPs over forward FLOPs: five matrix products against two (FlashAttention's convention)."""
LSE_BYTES = 4
"""Bytes of one row statistic (LSE, delta): float32."""
PASSES = ("fwd", "bwd", "fwd+bwd")


def _pairs_below(x: int, seqlen_q: int, seqlen_k: int) -> int:
    """Pairs (i, j), 0 <= i < seqlen_q, 0 <= j < seqlen_k, with j - i <= x: sum over i of clamp(i + x + 1, 0, Sk),
    in closed form."""

    def ramp(t: int) -> int:  # sum of clamp(s, 0, seqlen_k) for s <= t
        if t <= 0:
            return 0
        if t <= seqlen_k:
            return t * (t + 1) // 2
        return seqlen_k * (seqlen_k + 1) // 2 + (t - seqlen_k) * seqlen_k

    return ramp(x + seqlen_q) - ramp(x)


def visible_pairs(seqlen_q: int, seqlen_k: int, window_left: int | None = None, window_right: int | None = None) -> int:
    """(query, key) pairs of one head that attention computes: query i sees key j when
    i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right (flash_attn's bottom-right alignment; a side given
    as None is unbounded; causal is window_right = 0). Exact, O(1).

    Example: ``visible_pairs(4, 4, None, 0)`` is 10 (causal 4 x 4: 1 + 2 + 3 + 4)."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    offset = seqlen_k - seqlen_q
    upper = seqlen_q * seqlen_k if window_right is None else _pairs_below(offset + window_right, seqlen_q, seqlen_k)
    lower = 0 if window_left is None else _pairs_below(offset - window_left - 1, seqlen_q, seqlen_k)
    return max(0, upper - lower)


def pass_factor(pass_: str) -> float:
    """FLOPs of ``pass_`` ('fwd', 'bwd' or 'fwd+bwd') over the forward's: 1, 2.5, 3.5."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {', '.join(PASSES)}, got {pass_!r}.")
    return {"fwd": 1.0, "bwd": BWD_FLOPS_FACTOR, "fwd+bwd": 1.0 + BWD_FLOPS_FACTOR}[pass_]


def attention_flops(pairs: int, nheads: int, head_dim: int, head_dim_v: int | None = None, pass_: str = "fwd") -> float:
    """FLOPs of ``pass_`` over ``pairs`` visible (query, key) pairs per head (summed over the batch) and ``nheads``
    query heads: 2 * (D + Dv) per pair and head in the forward (4 * D when Dv = D)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 2.0 * (head_dim + dv) * pairs * nheads * pass_factor(pass_)


def convention_flops(batch: int, nheads: int, seqlen: int, head_dim: int, causal: bool, pass_: str = "fwd") -> float:
    """The benchmark tables' FLOPs (``flashtile bench``, the field's convention): 4 * B * H * N^2 * D for the
    forward, halved when causal (not N(N+1)/2), times 2.5 for the backward."""
    return attention_flops(batch * seqlen * seqlen, nheads, head_dim, pass_=pass_) * (0.5 if causal else 1.0)


@dataclass(frozen=True)
class Problem:
    """One attention problem: ``batch`` entries of seqlen_q queries and seqlen_k keys (a packed variable-length
    batch is a list of these, one per sequence), ``nheads`` query and ``nheads_k`` key/value heads, head dims, the
    inputs' element size in bytes, the visible band (None: unbounded; causal: window_right 0) and the bytes per
    element of an attn_mask (0: none)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    head_dim_v: int
    element_size: int
    window_left: int | None = None
    window_right: int | None = None
    mask_element_size: int = 0

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs of one head and batch entry."""
        return visible_pairs(self.seqlen_q, self.seqlen_k, self.window_left, self.window_right)

    def flops(self, pass_: str = "fwd") -> float:
        """FLOPs of ``pass_`` over the batch (``attention_flops``)."""
        return attention_flops(self.batch * self.pairs, self.nheads, self.head_dim, self.head_dim_v, pass_)

    def _rows(self, seqlen: int, heads: int, width: int) -> int:
        """Bytes of a (batch, seqlen, heads, width) tensor in the inputs' dtype."""
        return self.batch * seqlen * heads * width * self.element_size

    def _sweeps(self, block: int, along_q: bool) -> float:
        """Per head: how many times the other side's rows are read when tiles of ``block`` rows walk one side
        (queries if ``along_q``), each reading only the rows it sees: tiles x visible fraction x the other side's
        length = ceil(n / block) * pairs / n."""
        n = self.seqlen_q if along_q else self.seqlen_k
        return 0.0 if n == 0 else math.ceil(n / block) * self.pairs / n

    def forward_bytes(self, block_m: int) -> float:
        """HBM bytes of the forward with query tiles of ``block_m`` rows (see the module's model)."""
        q = self._rows(self.seqlen_q, self.nheads, self.head_dim)
        kv = self.batch * self.nheads * self._sweeps(block_m, True) * (self.head_dim + self.head_dim_v)
        out = self._rows(self.seqlen_q, self.nheads, self.head_dim_v)
        lse = self.batch * self.nheads * self.seqlen_q * LSE_BYTES
        mask = self.batch * self.nheads * self.pairs * self.mask_element_size
        return q + kv * self.element_size + out + lse + mask

    def backward_bytes(self, block_n: int, block_m: int, dq_atomic: bool = False) -> float:
        """HBM bytes of the backward: key tiles of ``block_n`` rows (the dK/dV pass), query tiles of ``block_m``
        rows (the dQ kernel; unused with ``dq_atomic``, whose dQ partials go through an fp32 accumulator)."""
        d, dv, e = self.head_dim, self.head_dim_v, self.element_size
        stats = self.batch * self.nheads * self.seqlen_q * LSE_BYTES  # one of LSE, delta
        o = self._rows(self.seqlen_q, self.nheads, dv)
        delta = 2 * o + stats  # read O and dO, write delta
        kv = self._rows(self.seqlen_k, self.nheads_k, d + dv)  # K and V, or dK and dV
        key_tiles = self.batch * self.nheads * self._sweeps(block_n, False)  # rows of Q read per head, summed
        per_key_tile = key_tiles * ((d + dv) * e + 2 * LSE_BYTES)  # Q, dO, LSE, delta per key tile
        mask = self.batch * self.nheads * self.pairs * self.mask_element_size
        if dq_atomic:
            accumulator = self.batch * self.seqlen_q * self.nheads * d * LSE_BYTES  # fp32 dQ rows
            adds = key_tiles * d * LSE_BYTES * 2  # each partial: a read and a write of its accumulator rows
            cast = accumulator + self._rows(self.seqlen_q, self.nheads, d)  # read the accumulator, write dQ
            return delta + accumulator + kv + per_key_tile + adds + kv + cast + mask
        dkdv = kv + per_key_tile + kv + mask
        q_rows = self._rows(self.seqlen_q, self.nheads, d + dv) + 2 * stats  # Q, dO, LSE, delta once
        kv_reads = self.batch * self.nheads * self._sweeps(block_m, True) * (d + dv) * e
        dq = q_rows + kv_reads + self._rows(self.seqlen_q, self.nheads, d) + mask
        return delta + dkdv + dq

    def compulsory_bytes(self, pass_: str = "fwd") -> float:
        """The bytes no implementation of ``pass_`` can avoid: each input read once and each output written once
        (forward: Q, K, V, an attn_mask's visible part; O and LSE; backward: Q, K, V, O, dO, LSE, and delta written
        and read; dQ, dK, dV). A GPU whose L2 served every repeated K/V read would move this; the model's figure
        (``forward_bytes``, ``backward_bytes``) assumes it serves none, so measurements fall in between."""
        q = self._rows(self.seqlen_q, self.nheads, self.head_dim)
        o = self._rows(self.seqlen_q, self.nheads, self.head_dim_v)  # O, or dO
        kv = self._rows(self.seqlen_k, self.nheads_k, self.head_dim + self.head_dim_v)  # K and V, or dK and dV
        stats = self.batch * self.nheads * self.seqlen_q * LSE_BYTES
        mask = self.batch * self.nheads * self.pairs * self.mask_element_size
        forward = q + kv + mask + o + stats
        backward = q + kv + o + o + stats + 2 * stats + mask + q + kv
        return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[pass_]

    def decode_bytes(self, seqlen_new: int = 0) -> float:
        """HBM bytes of decoding with a KV cache of seqlen_k keys (the new ones included): q, the cache rows some query
        sees (all of them without a window) of K and V once (per K/V head: the query heads of a group share the
        read), ``seqlen_new`` new keys and values read and written into the cache, out and LSE written."""
        q = self._rows(self.seqlen_q, self.nheads, self.head_dim)
        offset = self.seqlen_k - self.seqlen_q
        first = 0 if self.window_left is None else max(0, offset - self.window_left)
        last = self.seqlen_k if self.window_right is None else min(self.seqlen_k, self.seqlen_k + self.window_right)
        cache = self._rows(max(0, last - first), self.nheads_k, self.head_dim + self.head_dim_v)
        new = 2 * self._rows(seqlen_new, self.nheads_k, self.head_dim + self.head_dim_v)
        out = self._rows(self.seqlen_q, self.nheads, self.head_dim_v)
        lse = self.batch * self.nheads * self.seqlen_q * LSE_BYTES
        return q + cache + new + out + lse

    def standard_bytes(self, pass_: str = "fwd") -> float:
        """HBM bytes of standard attention on this problem (S and P in HBM, in the inputs' dtype; see the module's
        model): forward 4 S-sized transfers, backward 7, besides the inputs and outputs."""
        scores = self.batch * self.nheads * self.seqlen_q * self.seqlen_k * self.element_size
        mask = self.batch * self.nheads * self.seqlen_q * self.seqlen_k * self.mask_element_size
        q = self._rows(self.seqlen_q, self.nheads, self.head_dim)
        o = self._rows(self.seqlen_q, self.nheads, self.head_dim_v)  # O, or dO
        kv = self._rows(self.seqlen_k, self.nheads_k, self.head_dim + self.head_dim_v)  # K and V, or dK and dV
        forward = q + kv + 4 * scores + mask + o
        backward = o + q + kv + 7 * scores + q + kv  # dO, Q, K, V read; dQ, dK, dV written
        return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[pass_]


def total(problems: Sequence[Problem], method: str, *args, **kwargs) -> float:
    """The sum of ``problem.<method>(*args, **kwargs)`` over ``problems`` (the sequences of a packed batch)."""
    return sum(getattr(p, method)(*args, **kwargs) for p in problems)
