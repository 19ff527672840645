"""Naive exact attention: the oracle every test compares against.

It materialises the full (seqlen_q, seqlen_k) score matrix, so it is only for small problems.
Inputs use flash_attn's layout; computation happens in the dtype of the inputs, so passing
float64 tensors gives a float64-exact answer and passing fp16/bf16 tensors gives the error a
plain low-precision implementation makes (the ``base`` of the tolerance rule in DESIGN.md).
"""

from __future__ import annotations

import math

import torch


def visibility_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k), True where query i may see key j, with flash_attn's semantics.

    Bottom-right aligned: query i sees keys j with
    i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1];
    a negative side is unbounded, and causal sets window_size[1] = 0.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = seqlen_k - seqlen_q
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= j >= i + diag - left
    if right >= 0:
        allowed &= j <= i + diag + right
    return allowed


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in the inputs' dtype.

    Args:
        q: (batch, seqlen_q, nheads, headdim)
        k: (batch, seqlen_k, nheads_k, headdim), nheads divisible by nheads_k
        v: (batch, seqlen_k, nheads_k, headdim_v)
        softmax_scale: defaults to 1 / sqrt(headdim)
        causal, window_size: flash_attn's masks (see ``visibility_mask``)
        mask: (seqlen_q, seqlen_k) boolean, True = visible; replaces causal/window_size when given

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v), 0 for a query row that sees no key
        lse: (batch, nheads, seqlen_q), natural-log sum of exp of the scaled scores, -inf for such rows
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is None:
        mask = visibility_mask(q.shape[1], k.shape[1], causal, window_size, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None].masked_fill(lse[..., None] == float("-inf"), 0.0))
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)
    return out, lse
