"""``scaled_dot_product_attention`` in torch's layout and with torch's semantics."""

from __future__ import annotations

import torch

from flashtile.interface import attention, varlen_attention
from flashtile.padding import _gather_rows, unpad_input


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on fp16/bf16 inputs.

    Unlike ``flash_attn_func``, ``is_causal`` follows torch: the mask is aligned to the top left,
    query i sees key j when j <= i, whatever seqlen_q and seqlen_k are. With seqlen_q = 2 and
    seqlen_k = 5 (1 = visible):
        1 0 0 0 0
        1 1 0 0 0

    Args:
        query: (batch, nheads, seqlen_q, headdim), float16 or bfloat16
        key: (batch, nheads_k, seqlen_k, headdim)
        value: (batch, nheads_k, seqlen_k, headdim_v)
        attn_mask: None, or a boolean key padding mask of shape (batch, 1, 1, seqlen_k), True = attend
            (what Hugging Face models build from a padded batch's attention_mask). It runs as a
            variable-length batch: the kept keys and values are packed (``unpad_input``, differentiable)
            and every query row of batch entry b sees exactly the kept keys of entry b; nothing is
            computed for the padding. A row whose entry keeps no key returns 0 (torch returns NaN).
            Costs two host synchronisations (counting the kept keys; checking cu_seqlens on CUDA).
            Other masks (float, per-query, per-head) raise NotImplementedError; with is_causal=True,
            ValueError, as in torch.
        dropout_p: dropout probability on the attention probabilities, kept ones scaled by 1 / (1 - p), as
            in torch: applied whenever > 0 (pass 0.0 in evaluation); randomness as in ``flash_attn_func``
        is_causal: top-left aligned causal mask
        scale: scaling of query @ key^T; default 1 / sqrt(headdim)
        enable_gqa: allow nheads_k < nheads (nheads divisible by nheads_k), as in torch

    Returns:
        (batch, nheads, seqlen_q, headdim_v), a transposed view of a (batch, seqlen_q, nheads, headdim_v) tensor
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (batch, nheads, seqlen, headdim), got {got}.")
    if attn_mask is not None:
        _check_key_padding_mask(attn_mask, query.shape[0], key.shape[2], is_causal)
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: set enable_gqa=True for grouped-query attention."
        )
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if attn_mask is not None:
        return _key_padding_attention(query, key, value, attn_mask, scale, dropout_p)
    # Top-left causal (j <= i) in the kernels' bottom-right terms: j <= i + (Sk - Sq) + (Sq - Sk).
    right = seqlen_q - seqlen_k if is_causal else None
    out, _ = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale, None, right, dropout_p=dropout_p
    )
    return out.transpose(1, 2)


def _check_key_padding_mask(attn_mask: object, batch: int, seqlen_k: int, is_causal: bool) -> None:
    """Raise NotImplementedError unless attn_mask is a boolean (batch, 1, 1, seqlen_k) key padding mask,
    ValueError if is_causal is set too (as torch does)."""
    if not (
        isinstance(attn_mask, torch.Tensor)
        and attn_mask.dtype == torch.bool
        and tuple(attn_mask.shape) == (batch, 1, 1, seqlen_k)
    ):
        got = f"{attn_mask.dtype} {tuple(attn_mask.shape)}" if isinstance(attn_mask, torch.Tensor) else "non-tensor"
        raise NotImplementedError(
            f"attn_mask: flashtile supports a boolean key padding mask of shape (batch, 1, 1, seqlen_k) = "
            f"({batch}, 1, 1, {seqlen_k}) (True = attend), got {got}. Use is_causal=True for causal masks, or "
            "torch.nn.functional.scaled_dot_product_attention for arbitrary masks."
        )
    if is_causal:
        raise ValueError("attn_mask and is_causal=True cannot be combined (as in torch); pass one of them.")


def _key_padding_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA with a boolean (batch, 1, 1, seqlen_k) key padding mask, through the varlen kernels.

    Queries stay as they are, each batch entry one query "sequence" of seqlen_q rows (cu_seqlens_q =
    b * seqlen_q); keys and values are packed to the kept ones (cu_seqlens_k from the mask). Exact: without
    a causal mask or position bias, which keys a row sees is all that matters, not where they sat.
    """
    batch, nheads, seqlen_q, head_dim = query.shape
    seqlen_k = key.shape[2]
    keep = attn_mask.reshape(batch, seqlen_k).to(query.device)
    k, indices, cu_seqlens_k, max_seqlen_k, _ = unpad_input(key.transpose(1, 2), keep)
    v = _gather_rows(value.transpose(1, 2).reshape(batch * seqlen_k, value.shape[1], value.shape[3]), indices)
    q = query.transpose(1, 2).reshape(batch * seqlen_q, nheads, head_dim)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=query.device) * seqlen_q
    out, _ = varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqlen_q, max_seqlen_k, scale, None, None, dropout_p=dropout_p
    )
    return out.view(batch, seqlen_q, nheads, -1).transpose(1, 2)
