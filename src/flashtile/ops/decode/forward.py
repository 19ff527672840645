"""``flash_attn_with_kvcache`` on the Triton kernels: one split-KV launch that also appends k, v (rotated)."""

import torch

from flashtile.ops._device import on_input_device
from flashtile.ops.decode import split_kv
from flashtile.ops.decode.split_kv import decode_attention
from flashtile.options import AttentionOptions, CacheOptions


@on_input_device
def kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    options: AttentionOptions,
    cache: CacheOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k, v to the caches in place and attend q to each batch entry's keys (the new ones included).

    Inputs are validated (``flashtile.kvcache``); shapes and meanings as in ``decode_attention``. k and v:
    (batch, seqlen_new, nheads_k, headdim[_v]) or None (then so are the rotary tables). Returns
    out (batch, seqlen_q, nheads, headdim_v), lse (batch, nheads, seqlen_q) fp32.
    """
    return decode_attention(q, k_cache, v_cache, k, v, options, cache)


def prepare(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, options: AttentionOptions, cache: CacheOptions
):
    """``kvcache_forward(q, k_cache, v_cache, None, None, options, cache)[0]`` prepared for later calls of these
    layouts (``split_kv.prepare``), run on its inputs' device; None where the launch is not prepared."""
    prepared = split_kv.prepare(q, k_cache, v_cache, options, cache)
    return None if prepared is None else on_input_device(prepared)
