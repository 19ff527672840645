"""flash_attn 2.x's functions, with its names, argument order, layouts and return values.

Switching from flash_attn is one import: ``from flashtile import flash_attn_func``.
Inputs are checked here, before anything launches; errors say what was expected, what came, and
how to fix it.
"""

from __future__ import annotations

import math

import torch

from flashtile import _ops

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
NO_WINDOW = (-1, -1)
"""``window_size`` for full attention: a side of -1 (any negative value) is unbounded."""


def require(condition: bool, message: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error(message)`` unless ``condition`` (for checks off the per-call hot path)."""
    if not condition:
        raise error(message)


def _check_head_dim(name: str, head_dim: int) -> None:
    if head_dim % 8 != 0 or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"{name} must be a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {head_dim}. "
            "Pad the head dimension with zeros up to the next multiple of 8 (and slice the output)."
        )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless q, k, v are valid flash_attn-layout inputs.

    q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
    v (batch, seqlen_k, nheads_k, headdim_v); fp16 or bf16, one device, nheads % nheads_k == 0.
    Messages are built only on failure: this runs on every call.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; flashtile supports torch.float16 and torch.bfloat16. "
                f"Cast the inputs, e.g. {name}.to(torch.bfloat16)."
            )
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}. "
                "For variable-length batches use flash_attn_varlen_func."
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}.")
    batch, _, nheads, head_dim = q.shape
    k_batch, seqlen_k, nheads_k, k_head_dim = k.shape
    if not k_batch == v.shape[0] == batch:
        raise ValueError(f"q, k and v must share the batch size, got {batch}, {k_batch}, {v.shape[0]}.")
    if (seqlen_k, nheads_k) != tuple(v.shape[1:3]):
        raise ValueError(
            f"k and v must share seqlen_k (dim 1) and nheads_k (dim 2), got k {tuple(k.shape)} and v {tuple(v.shape)}."
        )
    if k_head_dim != head_dim:
        raise ValueError(f"q and k must share headdim (dim 3), got q {tuple(q.shape)} and k {tuple(k.shape)}.")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"nheads ({nheads}) must be divisible by nheads_k ({nheads_k}) for grouped-query attention: "
            "each group of nheads // nheads_k query heads shares one key/value head."
        )
    _check_head_dim("headdim", head_dim)
    _check_head_dim("headdim_v", v.shape[3])


def check_unimplemented(dropout_p: float = 0.0, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None) -> None:
    """Raise NotImplementedError for options flashtile does not implement yet (never ignore them)."""
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: attention dropout is not implemented in flashtile yet; pass dropout_p=0.0."
        )
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not implemented in flashtile yet.")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented in flashtile yet.")


def window_bounds(window_size: tuple[int, int], causal: bool) -> tuple[int | None, int | None]:
    """flash_attn's (window_size, causal) as the kernels' (left, right), None meaning unbounded."""
    require(
        len(window_size) == 2 and all(isinstance(w, int) for w in window_size),
        f"window_size must be a pair of ints (left, right), got {window_size!r}.",
        TypeError,
    )
    left, right = window_size
    if causal:
        right = 0
    return (None if left < 0 else left), (None if right < 0 else right)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    window_left: int | None,
    window_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated entry to the custom op: returns (out, lse) in flash_attn's layouts."""
    check_qkv(q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return _ops.attention_forward(q, k, v, float(softmax_scale), window_left, window_right)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Exact attention, softmax(q @ k^T * softmax_scale) @ v, without materialising the score matrix.

    Multi-query and grouped-query attention: k and v may have fewer heads than q; nheads must be
    divisible by nheads_k, and query head h uses key/value head h // (nheads // nheads_k).

    If causal=True, the causal mask is aligned to the bottom right corner of the attention matrix:
    query i sees key j when j <= i + seqlen_k - seqlen_q. With seqlen_q = 2 and seqlen_k = 5
    (1 = visible):
        1 1 1 1 0
        1 1 1 1 1
    With seqlen_q = 5 and seqlen_k = 2:
        0 0
        0 0
        0 0
        1 0
        1 1
    A query row that sees no key (the first three above) returns 0, with softmax_lse -inf.

    If window_size != (-1, -1), sliding-window (local) attention: query i sees keys j with
        i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1].
    A negative side (-1) is unbounded; causal=True sets window_size[1] = 0.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim), float16 or bfloat16
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim_v); headdim and headdim_v multiples of 8, at most 256
        dropout_p: must be 0.0 (dropout is not implemented yet; other values raise NotImplementedError)
        softmax_scale: scaling of q @ k^T before the softmax; default 1 / sqrt(headdim)
        causal: bottom-right aligned causal mask (drawn above)
        window_size: (left, right) for sliding-window attention, -1 for an unbounded side
        softcap: must be 0.0 (not implemented yet)
        alibi_slopes: must be None (not implemented yet)
        deterministic: accepted; flashtile's backward never uses atomics (measured slower, see
            docs/tuning-log.md), so it is always bitwise repeatable
        return_attn_probs: also return softmax_lse (the attention probabilities themselves are never
            materialised; the third element is None)

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim_v)
        if return_attn_probs: (out, softmax_lse, None) with softmax_lse (batch_size, nheads, seqlen_q),
            float32, the natural-log sum of exp of each row's scaled scores
    """
    check_unimplemented(dropout_p, softcap, alibi_slopes)
    left, right = window_bounds(window_size, causal)
    out, lse = attention(q, k, v, softmax_scale, left, right)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_func`` on a packed qkv tensor; gradients flow back into ``qkv``.

    Args:
        qkv: (batch_size, seqlen, 3, nheads, headdim)
        the rest: as ``flash_attn_func``

    Returns:
        out: (batch_size, seqlen, nheads, headdim), or (out, softmax_lse, None) if return_attn_probs
    """
    require(
        isinstance(qkv, torch.Tensor) and qkv.dim() == 5 and qkv.shape[2] == 3,
        f"qkv must be (batch_size, seqlen, 3, nheads, headdim), got {_shape_of(qkv)}.",
    )
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_func`` with keys and values packed in one tensor; gradients flow back into ``kv``.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim)
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim)
        the rest: as ``flash_attn_func``

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse, None) if return_attn_probs
    """
    require(
        isinstance(kv, torch.Tensor) and kv.dim() == 5 and kv.shape[2] == 2,
        f"kv must be (batch_size, seqlen_k, 2, nheads_k, headdim), got {_shape_of(kv)}.",
    )
    k, v = kv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


def _shape_of(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
