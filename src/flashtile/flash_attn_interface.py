"""flash_attn 2.x's module path ``flash_attn.flash_attn_interface``: ``from flashtile.flash_attn_interface import
flash_attn_func`` works where code imported from flash_attn. The functions live in ``flashtile.interface`` and
``flashtile.kvcache``.

It also holds flash_attn 2.8's lower-level entry points that libraries built on flash_attn call directly (ring
attention implementations, for one): ``_flash_attn_forward`` / ``_flash_attn_backward`` and their varlen forms,
with flash_attn's signatures and semantics. The forward returns (out, softmax_lse, S_dmask, rng_state) without
building an autograd graph; the backward takes the output and softmax_lse to differentiate against, writes dq, dk,
dv into the tensors given and returns softmax_d = rowsum(dout * out). It differentiates against the out and
softmax_lse it is given, not against those of a forward of these q, k, v alone: ring attention passes the merged
output and LSE of all key blocks to each block's backward, and gets that block's share of the gradients.

They run on flashtile's public functions: the backward recomputes the block's attention (one more forward, as a
checkpointed layer would) and turns the gradients of that forward into those against the given out and
softmax_lse. With P_ij = exp(s_ij - lse_i) for the given lse and P'_ij = exp(s_ij - lse'_i) for the block's own,
P = c P' with c_i = exp(lse'_i - lse_i); the wanted dS = P (dP - D_i), D_i = rowsum(dout_i * out_i), equals the
block's own backward with upstream gradient c_i dout_i on its output and D'_i - c_i D_i on its LSE, where
D'_i = rowsum(c_i dout_i * out'_i). Dropout's mask is the forward's: rng_state holds the seed the forward ran with
(drawn from torch's generator of q's device), and the backward's forward runs with it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from flashtile.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtile.kvcache import flash_attn_with_kvcache

# The public functions; the lower-level ``_flash_attn_*`` are imported by name, as from flash_attn.
__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

ROW_PADDING = 128
"""flash_attn pads softmax_d's rows to multiples of this (per sequence in the varlen layout)."""


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn 2.8's ``_flash_attn_forward``: ``flash_attn_func``'s attention without an autograd graph.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); k, v: (batch_size, seqlen_k, nheads_k, headdim[_v])
        dropout_p, softmax_scale, causal, softcap, alibi_slopes: as ``flash_attn_func``
        window_size_left, window_size_right: ``flash_attn_func``'s window_size, one side each (-1 unbounded)
        return_softmax: with dropout, also return S_dmask (as ``flash_attn_func``'s return_attn_probs)

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim_v)
        softmax_lse: (batch_size, nheads, seqlen_q), float32
        S_dmask: (batch_size, nheads, seqlen_q, seqlen_k) with dropout and return_softmax, else an empty tensor
        rng_state: (2,) int64 on q's device: the dropout's seed, for ``_flash_attn_backward``
    """
    options = _options(causal, window_size_left, window_size_right, softcap, alibi_slopes)
    return _forward(
        lambda: flash_attn_func(q, k, v, dropout_p, softmax_scale, return_attn_probs=True, **options), q, dropout_p,
        return_softmax,
    )  # fmt: skip


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn 2.8's ``_flash_attn_varlen_forward``: ``flash_attn_varlen_func``'s attention without an autograd
    graph. q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim[_v]) or pages with a block_table; the
    other arguments as ``flash_attn_varlen_func`` and ``_flash_attn_forward``.

    Returns:
        out (total_q, nheads, headdim_v), softmax_lse (nheads, total_q) float32, S_dmask (batch_size, nheads,
        max_seqlen_q, max_seqlen_k) with dropout and return_softmax else empty, rng_state (2,) int64
    """
    for name, given in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if given is not None:
            raise NotImplementedError(
                f"{name} is not supported by flashtile's varlen attention: pass None and give each sequence's keys "
                "through cu_seqlens_k."
            )
    options = _options(causal, window_size_left, window_size_right, softcap, alibi_slopes)
    return _forward(
        lambda: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            return_attn_probs=True, block_table=block_table, **options,
        ),
        q, dropout_p, return_softmax,
    )  # fmt: skip


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attn 2.8's ``_flash_attn_backward``: the gradients of attention against a given output and LSE.

    Args:
        dout: (batch_size, seqlen_q, nheads, headdim_v), the gradient at out
        q, k, v: the forward's inputs
        out: (batch_size, seqlen_q, nheads, headdim_v) and softmax_lse: (batch_size, nheads, seqlen_q) float32: the
            output and LSE to differentiate against (this forward's own, or ring attention's merged ones)
        dq, dk, dv: tensors shaped like q, k, v that receive the gradients (a None one is not computed back)
        the rest: the forward's options; rng_state: ``_flash_attn_forward``'s, needed with dropout

    Returns:
        softmax_d: (batch_size, nheads, seqlen_q rounded up to a multiple of 128) float32, rowsum(dout * out) for
            each query (0 in the padding columns)
    """
    options = _options(causal, window_size_left, window_size_right, softcap, alibi_slopes)

    def forward(q, k, v):
        return flash_attn_func(q, k, v, dropout_p, softmax_scale, deterministic=deterministic, return_attn_probs=True,
                               **options)[:2]  # fmt: skip

    delta = _backward(forward, dout, q, k, v, out, softmax_lse.transpose(1, 2), (dq, dk, dv), dropout_p, rng_state)
    padded = -(-q.shape[1] // ROW_PADDING) * ROW_PADDING
    return torch.nn.functional.pad(delta.transpose(1, 2), (0, padded - q.shape[1]))


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attn 2.8's ``_flash_attn_varlen_backward``: ``_flash_attn_backward`` for packed sequences; dout and out
    (total_q, nheads, headdim_v), softmax_lse (nheads, total_q), the rest as ``_flash_attn_varlen_forward``.

    Returns:
        softmax_d: (nheads, total_q + 128 * batch_size) float32, flash_attn's layout: query i of sequence b in column
            cu_seqlens_q[b] + 128 * b + i (0 elsewhere)
    """
    options = _options(causal, window_size_left, window_size_right, softcap, alibi_slopes)

    def forward(q, k, v):
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            deterministic=deterministic, return_attn_probs=True, **options,
        )[:2]  # fmt: skip

    delta = _backward(forward, dout, q, k, v, out, softmax_lse.transpose(0, 1), (dq, dk, dv), dropout_p, rng_state)
    batch = cu_seqlens_q.shape[0] - 1
    tokens = torch.arange(q.shape[0], device=q.device)
    sequence = torch.searchsorted(cu_seqlens_q[1:].to(tokens.dtype), tokens, right=True)
    softmax_d = delta.new_zeros(q.shape[1], q.shape[0] + ROW_PADDING * batch)
    return softmax_d.index_copy_(1, tokens + ROW_PADDING * sequence, delta.transpose(0, 1))


def _options(causal: bool, left: int, right: int, softcap: float, alibi_slopes: torch.Tensor | None) -> dict:
    """The public functions' keywords for these options (flash_attn's window_size from its two sides)."""
    return dict(causal=causal, window_size=(left, right), softcap=softcap, alibi_slopes=alibi_slopes)


def _forward(
    attend: Callable[[], tuple], q: torch.Tensor, dropout_p: float, return_softmax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``attend`` (a public function with return_attn_probs=True) without a graph, with dropout's seed drawn and
    set: (out, lse, S_dmask or an empty tensor, rng_state)."""
    rng_state = _draw_rng_state(dropout_p, q.device)
    with torch.no_grad(), _seeded(rng_state, dropout_p):
        out, lse, s_dmask = attend()
    if s_dmask is None or not return_softmax:
        s_dmask = q.new_empty((0,))
    return out, lse, s_dmask, rng_state


def _backward(
    forward: Callable,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grads: tuple[torch.Tensor | None, ...],
    dropout_p: float,
    rng_state: torch.Tensor | None,
) -> torch.Tensor:
    """The gradients against ``out`` and ``lse`` (lse with out's row layout: (..., nheads)), written into ``grads``;
    returns D = rowsum(dout * out) in that layout, float32. See the module's docstring for the algebra."""
    if dropout_p and rng_state is None:
        raise ValueError("rng_state is required with dropout_p > 0: pass the one _flash_attn_forward returned.")
    wanted = [given is not None for given in grads]
    leaves = [t.detach().requires_grad_(want) for t, want in zip((q, k, v), wanted, strict=True)]
    with torch.enable_grad(), _seeded(rng_state, dropout_p):
        block_out, block_lse = forward(*leaves)
    block_lse_rows = block_lse.transpose(-1, -2) if block_lse.dim() == 3 else block_lse.transpose(0, 1)
    block_lse_rows = block_lse_rows.detach()
    visible = torch.isfinite(block_lse_rows)
    scale = torch.where(visible, torch.exp(block_lse_rows - lse.float()), 0.0)  # c_i
    delta = (dout.float() * out.float()).sum(-1)
    upstream = dout.float() * scale[..., None]
    block_delta = (upstream * block_out.detach().float()).sum(-1)
    dlse_rows = block_delta - scale * delta
    dlse = dlse_rows.transpose(-1, -2) if block_lse.dim() == 3 else dlse_rows.transpose(0, 1)
    if any(wanted):
        computed = torch.autograd.grad(
            (block_out, block_lse), [leaf for leaf, want in zip(leaves, wanted, strict=True) if want],
            (upstream.to(dout.dtype), dlse.contiguous()),
        )  # fmt: skip
        for given, grad in zip([g for g in grads if g is not None], computed, strict=True):
            given.copy_(grad)
    return delta


def _draw_rng_state(dropout_p: float, device: torch.device) -> torch.Tensor:
    """rng_state (2,) int64 on ``device``: [seed, 0], the seed drawn from torch's CPU generator (no device
    synchronisation), or zeros without dropout."""
    if not dropout_p:
        return torch.zeros(2, dtype=torch.int64, device=device)
    seed = int(torch.randint(0, 2**62, (1,)))
    return torch.tensor([seed, 0], dtype=torch.int64, device=device)


@contextlib.contextmanager
def _seeded(rng_state: torch.Tensor | None, dropout_p: float):
    """With dropout, run the block with torch's generator of rng_state's device seeded by rng_state[0] (restored
    afterwards): the public functions draw their dropout randomness from it, so the same seed gives the same mask."""
    if not dropout_p:
        yield
        return
    device = rng_state.device
    seed = int(rng_state[0])
    index = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else None
    with torch.random.fork_rng(devices=[] if index is None else [index], device_type="cuda"):
        generator = torch.default_generator if index is None else torch.cuda.default_generators[index]
        generator.manual_seed(seed)
        yield
