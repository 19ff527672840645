"""``scaled_dot_product_attention`` in torch's layout and with torch's semantics."""

from __future__ import annotations

import torch

from flashtile.interface import attention, check_unimplemented


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
        attn_mask: must be None (masks are not supported yet and raise NotImplementedError)
        dropout_p: must be 0.0 (dropout is not implemented yet)
        is_causal: top-left aligned causal mask
        scale: scaling of query @ key^T; default 1 / sqrt(headdim)
        enable_gqa: allow nheads_k < nheads (nheads divisible by nheads_k), as in torch

    Returns:
        (batch, nheads, seqlen_q, headdim_v), a transposed view of a (batch, seqlen_q, nheads, headdim_v) tensor
    """
    if attn_mask is not None:
        raise NotImplementedError(
            "attn_mask is not supported by flashtile yet; use is_causal=True for causal masks, or "
            "torch.nn.functional.scaled_dot_product_attention for arbitrary masks."
        )
    check_unimplemented(dropout_p=dropout_p)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (batch, nheads, seqlen, headdim), got {got}.")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: set enable_gqa=True for grouped-query attention."
        )
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    # Top-left causal (j <= i) in the kernels' bottom-right terms: j <= i + (Sk - Sq) + (Sq - Sk).
    right = seqlen_q - seqlen_k if is_causal else None
    out, _ = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale, None, right)
    return out.transpose(1, 2)
