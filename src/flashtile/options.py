"""The options of one attention call, decided once by the public functions and read by name below them.

``AttentionOptions`` travels from ``interface`` (and ``sdpa``, ``flash_attn_with_kvcache``'s checks, the
distributed functions) through ``_ops`` to the path modules (``cpu``, ``ops.attention``, ``ops.sm90``) and to
the dispatcher (``_backend``). Each option is decided here or at the face, never again below:

- the window: (window_left, window_right) as the kernels take it, None for an unbounded side; flash_attn's
  ``causal=True`` is window_right == 0 (``causal``), and a side past the lengths is None (``checks.bounded_window``);
- softmax_scale: the default 1 / sqrt(headdim) comes from ``default_scale`` alone;
- the score modifications (softcap, alibi_slopes), the learnable sink, dropout (dropout_p with its rng_state),
  SDPA's attn_mask and deterministic (for the backward);
- descale: float8 inputs' dequantization factors (``flashtile.float8``).

``Packing`` travels beside them for a variable-length batch: where each sequence's rows are, validated by
``interface.varlen_attention``, from there to the varlen launchers (``ops.attention``, ``cpu``). ``CacheOptions``
does the same for a decoding call: how ``flash_attn_with_kvcache`` addresses its cache and rotates its tokens,
validated by ``flashtile.kvcache``, from there to the decode paths (``ops.decode``, ``cpu_decode``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def default_scale(head_dim: int) -> float:
    """The default softmax_scale, 1 / sqrt(headdim), of every public function."""
    return 1.0 / math.sqrt(head_dim)


def scale_or_default(softmax_scale: float | None, head_dim: int) -> float:
    """softmax_scale as a float, or ``default_scale(head_dim)`` when it is None."""
    return default_scale(head_dim) if softmax_scale is None else float(softmax_scale)


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """Everything of an attention call besides its tensors q, k, v (and cu_seqlens / block_table for packed
    batches), validated.

    Query i sees key j when i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right (None: that side is
    unbounded). Scores: softmax_scale * q . k, capped to softcap * tanh(. / softcap) if softcap > 0, minus
    alibi_slopes[(b,) h] * |i + Sk - Sq - j| if given; learnable_sink (H,) float32 joins each row's softmax
    denominator. dropout_p > 0 drops probabilities with the keep mask of rng_state (int64 (2,) [seed, philox
    offset]). attn_mask: SDPA's 4-D mask (boolean or additive), each dimension 1 or full. deterministic: False
    lets the backward sum dQ in any order (the sm_90 kernel's atomics). descale: for float8 q, k, v,
    (B, Hk, 2) float32 [q_descale * k_descale, v_descale] per batch entry and KV head (``float8.combined``): the
    scores are multiplied by [..., 0] with the scale and out by [..., 1]; None: all ones.

    The fields' order is the custom ops' (``_ops.OPTIONS_SCHEMA``, made from these fields).
    """

    softmax_scale: float
    window_left: int | None = None
    window_right: int | None = None
    alibi_slopes: torch.Tensor | None = None
    softcap: float = 0.0
    learnable_sink: torch.Tensor | None = None
    dropout_p: float = 0.0
    rng_state: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    deterministic: bool = True
    descale: torch.Tensor | None = None

    @property
    def causal(self) -> bool:
        """Whether keys past each row's diagonal are hidden (flash_attn's causal=True is window_right = 0)."""
        return self.window_right == 0

    @property
    def local(self) -> bool:
        """Whether a window hides more than the causal mask does: a left side, or a right side other than 0."""
        return self.window_left is not None or self.window_right not in (None, 0)

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0


@dataclass(frozen=True, slots=True)
class Packing:
    """How a variable-length batch is packed: sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q
    (total_q, nheads, headdim) and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v (total_k, nheads_k, ...).

    cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 running sums on q's device; max_seqlen_q, max_seqlen_k: at least
    the longest sequence (they size the launch grid without reading cu_seqlens). block_table: None, or (batch,
    max_blocks_per_seq) int32: k and v are then pages (num_blocks, page_block_size, nheads_k, ...) and key j of
    sequence b is k[block_table[b, j // page_block_size], j % page_block_size].

    The fields' order is the varlen custom ops' (``_ops``), with block_table after the options.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        """The number of sequences."""
        return self.cu_seqlens_q.shape[0] - 1


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """How a decoding call (``flash_attn_with_kvcache``) reads and writes its KV cache, validated; its attention
    options (scale, window, softcap, ALiBi) travel beside it as an ``AttentionOptions``.

    cache_seqlens: (batch,) int32 cache lengths before the append, or None for the whole cache; cache_batch_idx:
    (batch,) int32 cache entry of each batch entry, or None for 0..batch-1; cache_leftpad: (batch,) int32 first
    cache position of each batch entry, or None for 0; block_table: (batch, max_blocks_per_seq) int32, or None for
    a contiguous cache. rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), or None: new key t is rotated at
    position cache_seqlens[b] + t, query i at cache_seqlens[b] + i if rotary_per_token else at cache_seqlens[b];
    rotary_interleaved rotates pairs (2f, 2f + 1) rather than (f, f + rotary_dim / 2). num_splits: splits of the
    keys, 0 to choose from the problem size.

    Every tensor here has a contiguous last dimension. The fields' order is the decode custom op's (``_ops``).
    """

    cache_seqlens: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None
    rotary_interleaved: bool = False
    rotary_per_token: bool = False
    num_splits: int = 0
