"""Naive exact attention: the oracle every test compares against.

It materialises the full (seqlen_q, seqlen_k) score matrix, so it is only for small problems.
Inputs use flash_attn's layout; computation happens in the dtype of the inputs, so passing
float64 tensors gives a float64-exact answer and passing fp16/bf16 tensors gives the error a
plain low-precision implementation makes (the ``base`` of the tolerance rule in DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


RESULT_NAMES = ("out", "lse", "dq", "dk", "dv")
OUTPUT_FACTOR = 2.0
GRADIENT_FACTOR = 3.0


def reference_results(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    dtype: torch.dtype,
    dlse: torch.Tensor | None = None,
    **mask_args,
) -> dict[str, torch.Tensor]:
    """The oracle's out, lse and gradients of (out * dout).sum() (+ (lse * dlse).sum() if dlse is
    given) for q, k, v, computed in ``dtype`` and cast back: out and gradients to q's dtype, lse to
    float32. ``mask_args`` go to ``attention_reference`` (softmax_scale, causal, window_size, mask)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, **mask_args)
    loss = (out * dout.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(lse == float("-inf"), 0.0) * dlse.to(dtype)).sum()
    loss.backward()
    grads = [t.grad.to(q.dtype) for t in leaves]
    return dict(zip(RESULT_NAMES, [out.detach().to(q.dtype), lse.detach().float(), *grads], strict=True))


@dataclass(frozen=True)
class ToleranceResult:
    """One tensor checked against the oracle: its error, the plain low-precision error, the bound."""

    error: float
    base_error: float
    bound: float
    ok: bool


def within_tolerance(x: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, factor: float) -> ToleranceResult:
    """The tolerance rule of the project (shared DESIGN.md) for a result ``x`` of flashtile.

    ref is the oracle in high precision cast to x's dtype, base the oracle computed in x's dtype.
    Pass when max|x - ref| <= factor * max|base - ref| + 2 ulps of ref's dtype at max|ref| (at 1.0
    if ref is all zero: a gradient that is exactly 0 has no scale of its own). Infinities (the LSE
    of a row that sees no key) must match ref's exactly and are left out of the maxima; a NaN in x
    fails. factor: OUTPUT_FACTOR for outputs, GRADIENT_FACTOR for gradients.
    """
    eps = torch.finfo(ref.dtype).eps
    x, ref, base = x.double(), ref.double(), base.double()
    finite = torch.isfinite(ref)
    same_infinities = torch.equal(torch.isfinite(x), finite) and torch.equal(x[~finite], ref[~finite])
    x, ref, base = x[finite], ref[finite], base[finite]
    if ref.numel() == 0:
        return ToleranceResult(0.0, 0.0, 0.0, same_infinities)
    error = (x - ref).abs().max().item()
    base_error = (base - ref).abs().max().item()
    bound = factor * base_error + 2 * eps * (ref.abs().max().item() or 1.0)
    return ToleranceResult(error, base_error, bound, same_infinities and error <= bound)
