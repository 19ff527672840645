"""Ulysses: exact attention over one sequence split across the ranks of a group, by all-to-all over heads.

Every rank holds a contiguous shard of the sequence (``layout="contiguous"``: rank r holds positions
[r * S, (r + 1) * S) of N = W * S), (batch, S, nheads, headdim). One all_to_all per tensor trades the
sequence split for a head split: afterwards rank r holds ALL N positions of its nheads / W heads,
computes plain ``flash_attn_func`` on them (every mask, softcap, ALiBi and sinks work unchanged: the
whole sequence is local), and one all_to_all trades the output back::

    q, k, v (B, S, H, D) --all_to_all--> (B, N, H/W, D) --flash_attn_func--> (B, N, H/W, Dv)
        --all_to_all--> out (B, S, H, Dv)

The backward is the same in reverse: each all_to_all's gradient is the inverse all_to_all.
With GQA and fewer key/value heads than ranks (W divisible by nheads_k), each key/value head is
repeated W / nheads_k times before the exchange, so every rank receives the one its query heads use.

Ring or Ulysses (rule of thumb)
-------------------------------
- Per rank, Ulysses moves about 4 * N * H * D / W elements in the forward (q, k, v, out; less with GQA)
  and the same in the backward: its traffic per rank SHRINKS as W grows, but an all_to_all waits for every
  rank and does not overlap with compute. The ring moves K/V (and dK/dV in the backward) W - 1 times,
  about 2 * N * Hk * D elements per rank whatever W, hidden behind the attention of the shard in hand
  when each step's compute outlasts its transfer (long shards: seqlen / W in the thousands).
- Ulysses needs nheads % W == 0 (and nheads_k % W == 0, or W % nheads_k == 0 at the cost of repeating
  K/V heads); the ring works for any head count.
- Ulysses is load-balanced under any mask (every rank sees every position of its heads) and supports
  ALiBi; the ring needs layout="zigzag" for causal balance and does not support ALiBi yet.
- So: within one node (fast all-to-all, e.g. NVLink), with many heads and moderate sequence lengths,
  prefer Ulysses; across nodes, with few (key/value) heads, more ranks than heads, or very long
  sequences where the ring's transfers hide behind compute, prefer the ring.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from flashtile.checks import NO_WINDOW, check_unimplemented, window_bounds
from flashtile.distributed.group import Ring, agreed_options, on_device
from flashtile.errors import require
from flashtile.interface import attention


class _AllToAll(torch.autograd.Function):
    """``Ring.all_to_all`` with autograd: the gradient goes back by the inverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter_dim: int, gather_dim: int, comm: Ring) -> Tensor:
        ctx.dims, ctx.comm = (scatter_dim, gather_dim), comm
        return comm.all_to_all(x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scatter_dim, gather_dim = ctx.dims
        return ctx.comm.all_to_all(grad, gather_dim, scatter_dim), None, None, None


def _check_head_split(q: Tensor, k: Tensor, v: Tensor, world: int) -> None:
    """Raise ValueError unless the heads of q, k, v split over ``world`` ranks."""
    nheads, nheads_k = q.shape[2], k.shape[2]
    require(
        nheads % world == 0 and (nheads_k % world == 0 or world % nheads_k == 0),
        f"ulysses_flash_attn_func splits the heads across the {world} ranks of the group: nheads ({nheads}) "
        f"must be divisible by {world}, and nheads_k ({nheads_k}) divisible by {world} or a divisor of it. "
        "Use ring_flash_attn_func, which works for any number of heads.",
    )


def ulysses_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    learnable_sink: Tensor | None = None,
):
    """``flash_attn_func`` over a sequence split across the ranks of ``group``, by all-to-all over heads.

    A collective: every rank of ``group`` calls it with its contiguous shard of q, k and v (shard full
    tensors with ``flashtile.distributed.shard(x, group, layout="contiguous")``) and, when training,
    backpropagates through the same outputs. Each rank gets its shard of exactly what ``flash_attn_func``
    gives on the whole sequence of N = world_size * seqlen positions, forward and backward. The module
    docstring says when to prefer ``ring_flash_attn_func``.

    Args:
        q: (batch_size, seqlen, nheads, headdim), float16, bfloat16 or float32: this rank's contiguous shard;
            nheads divisible by the group's size W
        k: (batch_size, seqlen, nheads_k, headdim); nheads_k divisible by W, or W divisible by nheads_k
            (then each key/value head is repeated W / nheads_k times for the exchange)
        v: (batch_size, seqlen, nheads_k, headdim_v)
        dropout_p: must be 0.0 (not implemented; NotImplementedError)
        softmax_scale, causal, window_size, softcap: as ``flash_attn_func``, over the global positions
        alibi_slopes: (nheads,) or (batch_size, nheads) float32, as ``flash_attn_func``, over the global
            positions; the same on every rank
        deterministic: as in flash_attn_func: True gives bitwise repeatable gradients; False (the default)
            lets the backward add dQ with atomics where that is faster (sm_90)
        return_attn_probs: also return softmax_lse (the third element is None, as in flash_attn_func)
        group: the process group the sequence is split over; None is the default group
        learnable_sink: keyword only, (nheads,) float32, the same on every rank; differentiable with the
            convention of ``ring_flash_attn_func``: each rank's gradient is its share, not all-reduced
            here, and the sum over the group is the gradient of the full-sequence loss (here rank r's
            share holds the whole gradient of its heads and zeros elsewhere)

    Returns:
        out: (batch_size, seqlen, nheads, headdim_v), this rank's rows of the full-sequence output
        if return_attn_probs: (out, softmax_lse, None) with softmax_lse (batch_size, nheads, seqlen) float32

    Raises:
        ValueError / TypeError on every rank when any rank's inputs are invalid or the ranks' shapes,
        dtypes or options differ; RuntimeError when another rank fails or does not call within the
        process group's timeout.
    """
    check_unimplemented(dropout_p)
    left, right = window_bounds(window_size, causal)
    comm = Ring(group, caller="ulysses_flash_attn_func")
    with on_device(q):
        options = agreed_options(
            comm, q, k, v, partial(_check_head_split, world=comm.size), "contiguous", softmax_scale=softmax_scale,
            window_left=left, window_right=right, softcap=softcap, alibi_slopes=alibi_slopes,
            learnable_sink=learnable_sink,
        )  # fmt: skip
        world, nheads, nheads_k = comm.size, q.shape[2], k.shape[2]
        if nheads_k % world != 0:  # world % nheads_k == 0: rank r's query heads use key/value head r // repeats
            k, v = (t.repeat_interleave(world // nheads_k, dim=2) for t in (k, v))
        q, k, v = (_AllToAll.apply(t, 2, 1, comm) for t in (q, k, v))  # (B, N, heads / W, d)
        heads = slice(comm.rank * nheads // world, (comm.rank + 1) * nheads // world)
        alibi_slopes, learnable_sink = options.alibi_slopes, options.learnable_sink
        out, lse = attention(
            q, k, v, softmax_scale=options.softmax_scale, window_left=left, window_right=right, softcap=options.softcap,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes[..., heads],
            learnable_sink=None if learnable_sink is None else learnable_sink[heads], deterministic=deterministic,
        )  # fmt: skip
        out = _AllToAll.apply(out, 1, 2, comm)  # (B, N, H / W, Dv) -> (B, S, H, Dv)
        if not return_attn_probs:
            return out
        return out, _AllToAll.apply(lse, 2, 1, comm), None  # lse (B, H / W, N) -> (B, H, S)
