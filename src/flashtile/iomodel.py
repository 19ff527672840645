"""FLOPs and HBM bytes of attention: what flashtile computes and moves, and what standard attention moves.

The one place these are counted: ``flashtile.profile()``, ``flashtile check``, ``flashtile bench`` and the scripts in
``benchmarks/`` all use it.

FLOPs follow FlashAttention's convention: the two matrix products of the forward, 2 * (D + Dv) FLOP per visible
(query, key) pair and head (4 * N^2 * D for one full head at D = Dv), the backward 2.5 times the forward (its five
products against the forward's two), nothing for the softmax. Only visible pairs count: a causal mask or a window
hides the rest (``visible_pairs``, exact); the field's tables halve N^2 for causal instead (``convention_flops``).

Bytes are a model of the algorithm, checked against Nsight Compute's DRAM counters (``benchmarks/ncu_io.py``;
docs/profiling.md has the table and the tolerance). The programs of one head run together, so the L2 cache serves the
repeated reads of what they share (K and V forward; Q, dO, LSE, delta backward) and each kernel moves every tensor
it touches once. Each kernel of a pass counts separately (the L2 does not carry data from one kernel to the next
in the model, nor in the measurement, which flushes it between kernels):

- forward (one kernel): Q, K, V (an attn_mask's visible part) read; O and LSE written.
- backward: the delta kernel reads O and dO and writes delta = rowsum(dO * O). The Triton backward (``dq_atomic``
  False): the dK/dV kernel and the dQ kernel each read Q, K, V, dO, LSE, delta (an attn_mask); the first writes dK
  and dV, the second dQ. The sm_90 Gluon backward (``dq_atomic``): an fp32 dQ accumulator is zeroed (written);
  the kernel reads Q, K, V, dO, LSE and delta, reduce-adds its dQ partials into the accumulator (each row read and
  written back once: the adds meet in the L2), and writes dK and dV; a last kernel reads the accumulator and writes
  dQ in the inputs' dtype.
- The limit: where the working set of the heads in flight (K and V of a head forward; Q, dO and the fp32 dQ rows of
  a head backward, about two heads at a time at the benchmark's grids) outgrows the L2, re-reads reach HBM again and
  the measurement exceeds the model (on an H100, 8.4 MB per head holds and 16.8 MB does not; docs/profiling.md).
- decode: q, the visible part of the K/V cache once, the new keys and values read and appended, out and LSE written.
- the floor (``compulsory_bytes``): every input read once, every output written once, across all the kernels of a
  pass; the model equals it forward and adds the backward's extra kernels and its dQ accumulator.
- standard attention (``standard_bytes``): the same problem with the score matrix S (B, H, Sq, Sk) in HBM, in the
  inputs' dtype: the forward writes S, reads it, writes P = softmax(S) and reads P (4 S-sized transfers) besides
  reading Q, K, V and writing O; the backward writes dP, reads P and dP and writes dS, reads dS twice (dQ, dK) and P
  once (dV): 7 transfers, besides Q, K, V, dO and the gradients. Causal attention materialises the full S.

GQA: K and V (and dK, dV) have nheads_k heads and are counted once; the L2 serves the query heads of a group that
share them (not measured yet).
"""

from __future__ import annotations

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


def _by_pass(pass_: str, forward: float, backward: float) -> float:
    """The figure of ``pass_`` ('fwd', 'bwd' or 'fwd+bwd') from the forward's and the backward's."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {', '.join(PASSES)}, got {pass_!r}.")
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[pass_]


def pass_factor(pass_: str) -> float:
    """FLOPs of ``pass_`` ('fwd', 'bwd' or 'fwd+bwd') over the forward's: 1, 2.5, 3.5."""
    return _by_pass(pass_, 1.0, BWD_FLOPS_FACTOR)


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

    def _tensors(self) -> tuple[int, int, int, int, int]:
        """Bytes of Q (or dQ), O (or dO), K and V together (or dK and dV), one row statistic (LSE or delta) and an
        attn_mask's visible part."""
        q = self._rows(self.seqlen_q, self.nheads, self.head_dim)
        o = self._rows(self.seqlen_q, self.nheads, self.head_dim_v)
        kv = self._rows(self.seqlen_k, self.nheads_k, self.head_dim + self.head_dim_v)
        stats = self.batch * self.nheads * self.seqlen_q * LSE_BYTES
        mask = self.batch * self.nheads * self.pairs * self.mask_element_size
        return q, o, kv, stats, mask

    def hbm_bytes(self, pass_: str = "fwd", dq_atomic: bool = False) -> float:
        """HBM bytes of ``pass_``, the prediction (see the module's model): every tensor each kernel of the pass
        touches, once per kernel. ``dq_atomic``: the backward of the sm_90 Gluon kernels (dQ through an fp32
        accumulator), else the Triton backward (a dK/dV kernel and a dQ kernel)."""
        q, o, kv, stats, mask = self._tensors()
        forward = q + kv + mask + o + stats  # read Q, K, V, an attn_mask; write O, LSE
        delta = 2 * o + stats  # read O and dO, write delta
        reads = q + kv + o + 2 * stats + mask  # a backward kernel reads Q, K, V, dO, LSE, delta, an attn_mask
        if dq_atomic:
            accumulator = self.batch * self.seqlen_q * self.nheads * self.head_dim * LSE_BYTES  # fp32 dQ rows
            zero, cast = accumulator, accumulator + q  # zeroed; read and cast to dQ
            backward = delta + zero + (reads + 2 * accumulator + kv) + cast  # the kernel's adds: a read, a write
        else:
            backward = delta + (reads + kv) + (reads + q)  # the dK/dV kernel, the dQ kernel
        return _by_pass(pass_, forward, backward)

    def compulsory_bytes(self, pass_: str = "fwd") -> float:
        """The floor of ``pass_``: each input read once and each output written once (forward: Q, K, V, an
        attn_mask's visible part; O and LSE; backward: Q, K, V, O, dO, LSE, and delta written and read; dQ, dK, dV),
        whatever the kernels."""
        q, o, kv, stats, mask = self._tensors()
        forward = q + kv + mask + o + stats
        backward = q + kv + o + o + stats + 2 * stats + mask + q + kv
        return _by_pass(pass_, forward, backward)

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
        q, o, kv, _, _ = self._tensors()
        forward = q + kv + 4 * scores + mask + o
        backward = o + q + kv + 7 * scores + q + kv  # dO, Q, K, V read; dQ, dK, dV written
        return _by_pass(pass_, forward, backward)


def total(problems: Sequence[Problem], method: str, *args, **kwargs) -> float:
    """The sum of ``problem.<method>(*args, **kwargs)`` over ``problems`` (the sequences of a packed batch)."""
    return sum(getattr(p, method)(*args, **kwargs) for p in problems)
