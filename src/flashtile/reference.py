"""Naive exact attention: the oracle every test compares against.

It materialises the full (seqlen_q, seqlen_k) score matrix, so it is only for small problems.
Inputs use flash_attn's layout; computation happens in the dtype of the inputs, so passing
float64 tensors gives a float64-exact answer and passing fp16/bf16 tensors gives the error a
plain low-precision implementation makes (the ``base`` of the tolerance rule, ``within_tolerance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtile.dense import alibi_distance, attention_probs, visibility_mask

__all__ = [
    "ToleranceResult",
    "alibi_distance",
    "attention_probs",
    "attention_reference",
    "reference_results",
    "visibility_mask",
    "within_tolerance",
]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *visibility,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    **scores,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in the inputs' dtype: ``v`` weighted by ``dense.attention_probs(q, k, *visibility, **scores)``
    (``visibility``: softmax_scale, causal, window_size, mask, by position or name; ``scores``: softcap,
    alibi_slopes, learnable_sink, bias), dropped by ``dropout_mask``.

    The score of query i and key j (flash_attn 2.x's order: scale, then cap, then bias):
        s_ij = softmax_scale * q_i . k_j
        s_ij = softcap * tanh(s_ij / softcap)                    if softcap > 0
        s_ij = s_ij - slope * |i + seqlen_k - seqlen_q - j|     if alibi_slopes is given
        s_ij = s_ij + bias[b, h, i, j]                          if bias is given (SDPA's additive mask)
    and with a learnable sink the softmax denominator gains exp(sink_h): for head h,
        out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)),  lse_i = log(exp(sink_h) + sum_j exp(s_ij)).
    With a dropout mask Z (True = kept), the probabilities P are dropped after the softmax, as flash_attn:
        out = (P * Z / (1 - dropout_p)) V, lse unchanged.

    Args:
        q: (batch, seqlen_q, nheads, headdim)
        k: (batch, seqlen_k, nheads_k, headdim), nheads divisible by nheads_k
        v: (batch, seqlen_k, nheads_k, headdim_v)
        softmax_scale: defaults to 1 / sqrt(headdim)
        causal, window_size: flash_attn's masks (see ``visibility_mask``)
        mask: boolean broadcastable to (batch, nheads, seqlen_q, seqlen_k), e.g. (seqlen_q, seqlen_k), True = visible;
            replaces causal/window_size when given
        softcap: > 0 caps the scaled scores with tanh; 0 leaves them
        alibi_slopes: (nheads,) or (batch, nheads), cast to the inputs' dtype
        learnable_sink: (nheads,), cast to the inputs' dtype (differentiable)
        dropout_p, dropout_mask: the dropout probability and a given boolean keep mask broadcastable to
            (batch, nheads, seqlen_q, seqlen_k); no dropout when the mask is None
        bias: additive float tensor broadcastable to (batch, nheads, seqlen_q, seqlen_k), cast to the
            inputs' dtype (differentiable; -inf entries hide a key)

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v), 0 for a query row that sees no key
        lse: (batch, nheads, seqlen_q), natural-log sum of exp of the scores (and the sink); -inf for a
            row that sees no key and has no sink, the sink's value if it has one
    """
    probs, lse = attention_probs(q, k, *visibility, **scores)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(probs.dtype) / (1.0 - dropout_p)
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
    **options,
) -> dict[str, torch.Tensor]:
    """The oracle's out, lse and gradients of (out * dout).sum() (+ (lse * dlse).sum() if dlse is
    given) for q, k, v, computed in ``dtype`` and cast back: out and gradients to q's dtype, lse to
    float32. ``options`` go to ``attention_reference`` (softmax_scale, causal, window_size, mask,
    softcap, alibi_slopes, learnable_sink, dropout_p, dropout_mask, bias); a learnable_sink is a leaf too,
    converted to ``dtype`` like q, k, v, and its gradient comes back as "dsink" in the sink's dtype; so does a
    ``bias`` that requires grad, as "dbias" (in the bias's dtype)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    names = list(RESULT_NAMES)
    sink = options.get("learnable_sink")
    if sink is not None:
        leaves.append(sink.detach().to(dtype).requires_grad_())
        options = dict(options, learnable_sink=leaves[-1])
        names.append("dsink")
    bias = options.get("bias")
    if bias is not None and bias.requires_grad:
        leaves.append(bias.detach().to(dtype).requires_grad_())
        options = dict(options, bias=leaves[-1])
        names.append("dbias")
    out, lse = attention_reference(*leaves[:3], **options)
    loss = (out * dout.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(lse == float("-inf"), 0.0) * dlse.to(dtype)).sum()
    loss.backward()
    grads = [t.grad.to(q.dtype) for t in leaves[:3]]
    if sink is not None:
        grads.append(leaves[3].grad.to(sink.dtype))
    if "dbias" in names:
        grads.append(leaves[-1].grad.to(bias.dtype))
    return dict(zip(names, [out.detach().to(q.dtype), lse.detach().float(), *grads], strict=True))


@dataclass(frozen=True)
class ToleranceResult:
    """One tensor checked against the oracle: its error, the plain low-precision error, the bound."""

    error: float
    base_error: float
    bound: float
    ok: bool


def within_tolerance(x: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, factor: float) -> ToleranceResult:
    """flashtile's tolerance rule (the one of flash-attention's own tests) for a result ``x`` of flashtile.

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
