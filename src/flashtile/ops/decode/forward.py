"""``flash_attn_with_kvcache`` on the Triton kernels: one split-KV launch that also appends k, v (rotated)."""

import torch

from flashtile.ops._device import on_input_device
from flashtile.ops.decode.split_kv import decode_attention


@on_input_device
def kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    rotary_interleaved: bool,
    rotary_per_token: bool,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k, v to the caches in place and attend q to each batch entry's keys (the new ones included).

    Inputs are validated (``flashtile.kvcache``); shapes and meanings as in ``decode_attention``. k and v:
    (batch, seqlen_new, nheads_k, headdim[_v]) or None (then so are rotary_cos and rotary_sin). Returns
    out (batch, seqlen_q, nheads, headdim_v), lse (batch, nheads, seqlen_q) fp32.
    """
    return decode_attention(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
        rotary_cos, rotary_sin, softmax_scale, window_left, window_right, softcap, rotary_interleaved,
        rotary_per_token, num_splits,
    )  # fmt: skip
