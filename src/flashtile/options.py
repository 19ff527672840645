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
