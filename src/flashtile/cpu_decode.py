"""``flash_attn_with_kvcache`` on the CPU, in plain PyTorch: the path for CPU tensors.

Same inputs and results as the Triton kernels (``flashtile.ops.decode``), computed directly:

1. Append. New token t of batch entry b goes to cache position ``cache_seqlens[b] + t``; the key is
   first rotated (rotary embedding, in fp32, rounded once to the cache's dtype) at that position.
2. Attend, one batch entry at a time. Its keys are the cache positions ``[leftpad_b, cache_seqlens[b] +
   seqlen_new)``, gathered from the contiguous or paged cache; the query is rotated at positions
   ``cache_seqlens[b] + i`` (or all at ``cache_seqlens[b]``) and rounded to its dtype, as the kernels do.
   Then ``flashtile.cpu.attention_forward`` attends the query to those keys (scores ``softcap * tanh(scale *
   q k / softcap)`` or ``scale * q k``, minus the ALiBi bias, under the bottom-right aligned window): torch's
   fused kernel where it serves (no softcap or ALiBi, a window it has), the tiled path otherwise.

Memory: one batch entry's gathered keys and values beyond the inputs (the attention itself is linear in
seqlen_k). Where a cache position lives: ``[cache_batch_idx[b], pos]`` in a contiguous cache,
``[block_table[b, pos // page], pos % page]`` in a paged one. ``num_splits`` does not apply here: the result
is the unsplit one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtile import cpu
from flashtile.options import AttentionOptions, CacheOptions


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16/fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _slots(
    b: int, pos: Tensor, cache_batch_idx: Tensor | None, block_table: Tensor | None, page_size: int
) -> tuple[Tensor, Tensor]:
    """(dim-0, dim-1) cache indices of the positions ``pos`` (any shape) of batch entry b."""
    if block_table is not None:
        return block_table[b, pos // page_size].long(), pos % page_size
    slot = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return torch.full_like(pos, slot), pos


def rotate(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of x (seqlen, nheads, headdim) at positions pos (seqlen,), in x's dtype.

    cos, sin: (seqlen_ro, rotary_dim / 2). Columns past rotary_dim are unchanged. Interleaved rotates
    the pairs (2f, 2f + 1), otherwise (f, f + rotary_dim / 2).
    """
    dtype = _compute_dtype(x.dtype)
    half = cos.shape[1]
    cos = cos[pos].to(dtype)[:, None, :]  # (seqlen, 1, rotary_dim / 2)
    sin = sin[pos].to(dtype)[:, None, :]
    rot = x[..., : 2 * half].to(dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)


@torch.no_grad()
def kvcache_forward(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    options: AttentionOptions,
    cache: CacheOptions,
) -> tuple[Tensor, Tensor]:
    """Append k, v to the caches in place, then attend q to each batch entry's keys.

    Args:
        q: (batch, seqlen_q, nheads, headdim)
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim[_v]), or (num_blocks,
            page_block_size, nheads_k, headdim[_v]) with a block_table; written in place
        k, v: (batch, seqlen_new, nheads_k, headdim[_v]) to append, or None
        options: softmax_scale, softcap, ALiBi and the window (``AttentionOptions``), applied to each batch entry's
            queries and keys by ``cpu.attention_forward``
        cache: where each batch entry's keys are and how they and q are rotated (``CacheOptions``); its
            num_splits does not apply (the CPU path does not split)

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v) in q's dtype; 0 for a row that sees no key
        lse: (batch, nheads, seqlen_q) float32; -inf for a row that sees no key
    """
    cache_seqlens, cache_batch_idx, block_table = cache.cache_seqlens, cache.cache_batch_idx, cache.block_table
    rotary_cos, rotary_sin, rotary_interleaved = cache.rotary_cos, cache.rotary_sin, cache.rotary_interleaved
    batch, seqlen_q, nheads, _ = q.shape
    head_dim_v = v_cache.shape[3]
    page_size = k_cache.shape[1]
    seqlen_cache = block_table.shape[1] * page_size if block_table is not None else page_size
    seqlen_new = 0 if k is None else k.shape[1]
    lengths = [seqlen_cache] * batch if cache_seqlens is None else cache_seqlens.tolist()
    leftpads = [0] * batch if cache.cache_leftpad is None else cache.cache_leftpad.tolist()
    out = torch.empty(batch, seqlen_q, nheads, head_dim_v, dtype=q.dtype)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32)

    for b in range(batch):
        if k is not None:
            pos = torch.arange(lengths[b], lengths[b] + seqlen_new)
            k_b = k[b] if rotary_cos is None else rotate(k[b], rotary_cos, rotary_sin, pos, rotary_interleaved)
            slot, row = _slots(b, pos, cache_batch_idx, block_table, page_size)
            k_cache[slot, row] = k_b
            v_cache[slot, row] = v[b]

    for b in range(batch):
        slot, row = _slots(b, torch.arange(leftpads[b], lengths[b] + seqlen_new), cache_batch_idx, block_table,
                           page_size)  # fmt: skip
        q_b = q[b]
        if rotary_cos is not None:
            offsets = torch.arange(seqlen_q) if cache.rotary_per_token else torch.zeros(seqlen_q, dtype=torch.long)
            q_b = rotate(q_b, rotary_cos, rotary_sin, lengths[b] + offsets, rotary_interleaved)
        out_b, lse_b = cpu.attention_forward(
            q_b[None], k_cache[slot, row][None], v_cache[slot, row][None], cpu._sequence_options(options, b)
        )
        out[b], lse[b] = out_b[0], lse_b[0]
    return out, lse


def prepare(q: Tensor, k_cache: Tensor, v_cache: Tensor, options: AttentionOptions, cache: CacheOptions):
    """``kvcache_forward(q, k_cache, v_cache, None, None, options, cache)[0]`` for later calls of these layouts: the
    CPU path has nothing to prepare ahead of a call."""

    def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return kvcache_forward(q, k_cache, v_cache, None, None, options, cache)[0]

    return attend
