"""Attention computed with the full (seqlen_q, seqlen_k) score matrix: the visibility mask, the ALiBi distances
and the probabilities P with flash_attn's score (softcap, ALiBi, sink).

O(seqlen_q * seqlen_k) memory, so only for small problems: flash_attn's S_dmask (``return_attn_probs`` with
dropout) is built from it, and it is the building block of the test oracle (``flashtile.reference``).
Computation happens in the dtype of the inputs.
"""

from __future__ import annotations

import torch

from flashtile.options import scale_or_default


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
    # A side past the lengths hides nothing; clamping it first keeps the arithmetic below in int64 range
    # for "no limit" values such as sys.maxsize.
    left, right = min(window_size[0], seqlen_k), min(window_size[1], seqlen_q)
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


def alibi_distance(seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Integer (seqlen_q, seqlen_k) |i + seqlen_k - seqlen_q - j|: the ALiBi distance of query i to key j,
    measured from the bottom-right aligned diagonal as in flash_attn."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return (i + seqlen_k - seqlen_q - j).abs()


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    mask: torch.Tensor | None = None,
    *,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention probabilities P (batch, nheads, seqlen_q, seqlen_k) and the lse (batch, nheads, seqlen_q) of
    ``flashtile.reference.attention_reference`` (same arguments and score; P is 0 where a key is hidden and in a
    row that sees no key), in the inputs' dtype."""
    scale = scale_or_default(softmax_scale, q.shape[-1])
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    group = nheads // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype).expand(batch, nheads)[:, :, None, None]
        scores = scores - slopes * alibi_distance(seqlen_q, seqlen_k, q.device).to(scores.dtype)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if mask is None:
        mask = visibility_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    if learnable_sink is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        sink = learnable_sink.to(scores.dtype)[None, :, None, None].expand(batch, nheads, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    probs = torch.exp(scores - lse[..., None].masked_fill(lse[..., None] == float("-inf"), 0.0))
    return probs, lse
