"""Attention as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` traces through it.

``flashtile::attention_forward`` and ``flashtile::attention_backward`` run whichever path
``_backend`` picks for the inputs' device; ``register_fake`` gives their output shapes to the
compiler and ``register_autograd`` wires the backward, recomputing attention from the saved LSE.
Inputs reaching these ops are already validated (``interface``) and have a contiguous last dimension.
"""

from __future__ import annotations

import torch

from flashtile._backend import attention_path


@torch.library.custom_op("flashtile::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> out (B, Sq, H, Dv), lse (B, H, Sq) fp32.

    Query i sees key j when i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right; a side
    given as None is unbounded.
    """
    return attention_path(q.device).attention_forward(q, k, v, softmax_scale, window_left, window_right)


@attention_forward.register_fake
def _(q, k, v, softmax_scale, window_left, window_right):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v.shape[3]))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashtile::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) shaped like (q, k, v); dlse (B, H, Sq) fp32 is the gradient at lse, or None."""
    return attention_path(q.device).attention_backward(
        dout, q, k, v, out, lse, softmax_scale, window_left, window_right, dlse
    )


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.window = (window_left, window_right)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    window_left, window_right = ctx.window
    if dout is None:
        dout = torch.zeros_like(out)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.float().contiguous()
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, dlse, ctx.softmax_scale, window_left, window_right)
    return dq, dk, dv, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
