"""Context parallelism: exact attention over one long sequence split across the ranks of a
``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs).

    import torch.distributed as dist
    from flashtile.distributed import ring_flash_attn_func, shard, unshard

    q, k, v = (shard(x, layout="zigzag") for x in (q_full, k_full, v_full))   # (B, N / W, H, D) each
    out = ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")         # this rank's rows
    out_full = unshard(out, layout="zigzag")                                  # (B, N, H, D), all ranks

``ring`` explains the algorithm; ``layout`` the ways a sequence is split. ``ulysses_flash_attn_func``
splits the heads instead, by all-to-all (contiguous shards); ``ulysses`` says when to prefer which.

Replicated parameters (``learnable_sink``): each rank's gradient is its own share, not all-reduced
inside; the sum over the group (the usual gradient all-reduce) is the gradient of the full-sequence loss.
"""

from flashtile.distributed.layout import shard, unshard
from flashtile.distributed.ring import ring_flash_attn_func, ring_flash_attn_qkvpacked_func
from flashtile.distributed.ulysses import ulysses_flash_attn_func

__all__ = ["ring_flash_attn_func", "ring_flash_attn_qkvpacked_func", "shard", "ulysses_flash_attn_func", "unshard"]
