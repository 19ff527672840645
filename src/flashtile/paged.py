"""Paged keys and values (``flash_attn_varlen_func``'s ``block_table``) as the packed rows of an unpaged call.

With a block_table (batch, max_num_blocks_per_seq) int32, k and v are pages (num_blocks, page_block_size,
nheads_k, headdim) and key j of sequence b (cu_seqlens_k still gives the lengths) is

    k[block_table[b, j // page_block_size], j % page_block_size].

The Triton forward reads the pages in place. The CPU forward and the backward of both paths gather them
into the packed (total_k, nheads_k, headdim) keys of the same batch without pages, run the unpaged
varlen functions on those, and the backward adds the packed key gradients back into pages: a page that
several sequences use gets the sum, a page that none uses gets zeros.
"""

from __future__ import annotations

import torch


def packed_slots(
    block_table: torch.Tensor, cu_seqlens_k: torch.Tensor, pages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row), int64 (total_k,) each: where each key of the packed batch lives in ``pages``, so that
    ``pages[slots]`` are the packed (total_k, nheads_k, headdim) keys (or values).

    total_k = cu_seqlens_k[-1] sizes the result, so it is read on the host (one synchronisation on CUDA).
    Indices are clamped into the block table and the pages (the kernels' clamps), so unchecked bad values
    (docs/validation.md) give wrong keys, never an out-of-bounds index.
    """
    page_size = pages.shape[1]
    cu = cu_seqlens_k.long()
    tokens = torch.arange(int(cu[-1]), device=cu.device)
    seq = (torch.searchsorted(cu, tokens, right=True) - 1).clamp_(0, block_table.shape[0] - 1)
    pos = tokens - cu[seq]  # the key's position in its sequence
    block = (pos // page_size).clamp_(max=block_table.shape[1] - 1)
    page = block_table[seq, block].long().clamp_(0, pages.shape[0] - 1)
    return page, pos % page_size


def scatter_add(rows: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor) -> torch.Tensor:
    """Packed rows (gradients of ``pages[slots]``) added into zeros shaped like ``pages``, in float32
    (a page used by several sequences sums their gradients) and returned in the pages' dtype."""
    total = torch.zeros(pages.shape, dtype=torch.float32, device=pages.device)
    return total.index_put_(slots, rows.float(), accumulate=True).to(pages.dtype)
