"""``scaled_dot_product_attention`` in torch's layout and with torch's semantics."""

from __future__ import annotations

import torch

from flashtile.checks import shape_of
from flashtile.errors import InputError, InputTypeError
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
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on fp16, bf16 and fp32 inputs.

    Unlike ``flash_attn_func``, ``is_causal`` follows torch: the mask is aligned to the top left,
    query i sees key j when j <= i, whatever seqlen_q and seqlen_k are. With seqlen_q = 2 and
    seqlen_k = 5 (1 = visible):
        1 0 0 0 0
        1 1 0 0 0

    Args:
        query: (batch, nheads, seqlen_q, headdim), float16, bfloat16 or float32; as in torch, any number of
            leading dimensions works: (seqlen_q, headdim), (nheads, seqlen_q, headdim), (batch, ..., nheads,
            seqlen_q, headdim), the leading ones flattened into one batch dimension
        key: (batch, nheads_k, seqlen_k, headdim) (leading dimensions as query's, or broadcast to them)
        value: (batch, nheads_k, seqlen_k, headdim_v)
        attn_mask: None, or a mask broadcastable to (batch, nheads, seqlen_q, seqlen_k) (at most 4-D,
            each dimension 1 or the full size, e.g. (seqlen_q, seqlen_k), (batch, 1, seqlen_q, seqlen_k),
            (1, nheads, 1, seqlen_k)), as in torch:
            - boolean: True = attend, False = the key is hidden from that query;
            - float (any floating dtype, usually q's): added to the scaled scores (-inf hides a key). If it
              requires grad it gets its gradient, dS = P (dP - delta) summed over its broadcast dimensions,
              in its own dtype (the backward holds one (batch, nheads, seqlen_q, seqlen_k) fp32 buffer for it,
              the size of a full mask; a mask that does not require grad costs no such memory).
            The kernels read the mask tile by tile through its broadcast strides (stride 0 on broadcast
            dimensions): it is never expanded in memory. A query row that sees no key (all False, or all
            -inf) returns 0 with zero gradients, where torch returns NaN.
            A boolean (batch, 1, 1, seqlen_k) key padding mask (what Hugging Face models build from a
            padded batch's attention_mask) takes a faster route: a
            variable-length batch whose kept keys and values are packed (``unpad_input``, differentiable),
            so nothing is computed for the padding; it costs two host synchronisations (counting the
            kept keys; checking cu_seqlens on CUDA). Same results, same fully-masked-row convention.
            With is_causal=True, ValueError, as in torch.
        dropout_p: dropout probability on the attention probabilities, kept ones scaled by 1 / (1 - p), as
            in torch: applied whenever > 0 (pass 0.0 in evaluation); randomness as in ``flash_attn_func``
        is_causal: top-left aligned causal mask
        scale: scaling of query @ key^T; default 1 / sqrt(headdim)
        enable_gqa: allow nheads_k < nheads (nheads divisible by nheads_k), as in torch

    Raises:
        flashtile.InputTypeError (a TypeError): a non-tensor input, a dtype other than float16, bfloat16 or
            float32, or an attn_mask neither boolean nor of query's dtype
        flashtile.UnsupportedHeadDimError: a head dimension the kernels do not take
        flashtile.InputError (a ValueError and a RuntimeError): shapes that do not broadcast as torch's SDPA
            requires (leading dims, GQA without enable_gqa, an attn_mask of another shape), attn_mask with
            is_causal=True, dropout_p outside [0, 1), scale NaN or infinite; raised before anything launches.

    Returns:
        (batch, nheads, seqlen_q, headdim_v) (query's leading dimensions), for 4-D inputs a transposed view of a
        (batch, seqlen_q, nheads, headdim_v) tensor
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{name} must be a tensor (..., seqlen, headdim) of at least 2 dimensions, got {got}.")
    if not query.dim() == key.dim() == value.dim() == 4:
        return _any_leading_dims(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None:
        attn_mask = _check_attn_mask(attn_mask, query, key, is_causal)
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise InputError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: set enable_gqa=True for grouped-query attention."
        )
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool and tuple(attn_mask.shape) == (query.shape[0], 1, 1, key.shape[2]):
            return _key_padding_attention(query, key, value, attn_mask, scale, dropout_p)
        out, _ = attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scale,
            dropout_p=dropout_p, attn_mask=attn_mask,
        )  # fmt: skip
        return out.transpose(1, 2)
    # Top-left causal (j <= i) in the kernels' bottom-right terms: j <= i + (Sk - Sq) + (Sq - Sk).
    right = seqlen_q - seqlen_k if is_causal else None
    out, _ = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scale, window_right=right,
        dropout_p=dropout_p, deterministic=torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip
    return out.transpose(1, 2)


def _any_leading_dims(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """SDPA on inputs of other than 4 dimensions, as torch takes them: (..., nheads, seqlen, headdim), where a
    2-D (seqlen, headdim) input is one head, a 3-D one (nheads, seqlen, headdim), and the dimensions before the
    heads of a 5-D or larger input are batch dimensions (key's and value's broadcast to query's). Those are
    flattened into one batch dimension (a view where the strides allow), the mask's with them."""
    shape, dims = query.shape, max(query.dim(), 3)
    if key.dim() > dims or value.dim() > dims:
        raise InputError(
            f"key and value may not have more dimensions than query: got query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}."
        )
    query, key, value = (t.reshape((1,) * (dims - t.dim()) + tuple(t.shape)) for t in (query, key, value))
    leading = query.shape[:-3]
    try:
        key, value = (t.expand(*leading, *t.shape[-3:]) for t in (key, value))
    except RuntimeError as error:
        raise InputError(
            "key's and value's leading (batch) dimensions must be query's or broadcast to them: got query "
            f"{tuple(shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}."
        ) from error
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() > dims:
            raise InputError(
                f"attn_mask must broadcast to (..., nheads, seqlen_q, seqlen_k) = "
                f"{(*query.shape[:-1], key.shape[-2])}, got {shape_of(attn_mask)}."
            )
        mask = attn_mask.reshape((1,) * (dims - attn_mask.dim()) + tuple(attn_mask.shape))
        attn_mask = mask.expand(*leading, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:])
    out = scaled_dot_product_attention(
        *(t.reshape(-1, *t.shape[-3:]) for t in (query, key, value)), attn_mask, dropout_p, is_causal, scale,
        enable_gqa,
    )  # fmt: skip
    return out.reshape(*shape[:-1], out.shape[-1])


def _check_attn_mask(attn_mask: object, query: torch.Tensor, key: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Validate SDPA's attn_mask and return it as a 4-D view (leading dimensions of size 1 added): ValueError
    with is_causal=True (as in torch) or when it does not broadcast to (batch, nheads, seqlen_q, seqlen_k),
    TypeError for a tensor neither boolean nor floating point."""
    if is_causal:
        raise InputError("attn_mask and is_causal=True cannot be combined (as in torch); pass one of them.")
    if not isinstance(attn_mask, torch.Tensor):
        raise InputTypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}.")
    if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise InputTypeError(
            f"attn_mask must be boolean (True = attend) or floating point (added to the scores), got {attn_mask.dtype}."
        )
    if attn_mask.device != query.device:
        raise InputError(f"attn_mask must be on the device of query ({query.device}), got {attn_mask.device}.")
    target = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(n not in (1, t) for n, t in zip(reversed(shape), reversed(target), strict=False)):
        raise InputError(
            f"attn_mask of shape {shape} does not broadcast to (batch, nheads, seqlen_q, seqlen_k) = {target}: "
            "each of its (at most 4) dimensions must be 1 or the full size, e.g. (seqlen_q, seqlen_k)."
        )
    return attn_mask.view((1,) * (4 - len(shape)) + shape)


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
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqlen_q, max_seqlen_k, softmax_scale=scale, dropout_p=dropout_p
    )
    return out.view(batch, seqlen_q, nheads, -1).transpose(1, 2)
