"""Attention as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` traces through it.

``flashtile::attention_forward`` and ``flashtile::attention_backward`` run whichever path
``_backend`` picks for the inputs' device; ``register_fake`` gives their output shapes to the
compiler and ``register_autograd`` wires the backward, recomputing attention from the saved LSE.
``flashtile::attention_sink_backward`` gives the gradient of a learnable sink.
``flashtile::varlen_attention_forward`` / ``varlen_attention_backward`` are the same for packed
variable-length batches (cu_seqlens); separate ops because their layouts differ (lse (H, total_q)). Their
trailing ``block_table`` makes k and v pages (flash_attn_varlen_func's paged K/V): the forward reads them in
place, the backward gathers them into packed keys, runs the unpaged backward and adds the key gradients
back into pages (``flashtile.paged``), inside the op, so that torch.compile sees fixed shapes.
``attention_forward`` also takes SDPA's ``attn_mask`` (boolean or additive, 4-D with each dimension 1 or
full); its backward is ``flashtile::masked_attention_backward``, which also returns the mask's gradient.
Inputs reaching these ops are already validated (``interface``) and have a contiguous last dimension.

The score modifications (``alibi_slopes``, ``softcap``), ``learnable_sink`` and dropout (``dropout_p``,
``rng_state``) are trailing arguments with defaults, so callers that predate them
(``flashtile.distributed``) keep working unchanged.

Dropout's randomness is an input, not a side effect: ``rng_state`` is an int64 tensor (2,) = [seed,
philox offset] on q's device, drawn from torch's generator by the public functions
(``interface.dropout_rng_state``) before the op. A tensor rather than two ints: under torch.compile an
int argument would become a guard (a recompile per call), and on CUDA the kernels read it from device
memory, so drawing it needs no host synchronisation. The autograd context saves it, and the backward
regenerates the forward's mask from it.

Eager calls skip the ops' Python dispatch. ``attention`` and ``varlen_attention`` are what the public
functions call: while nothing compiles, traces or intercepts torch calls (no torch function or dispatch
mode, no functorch transform) and every tensor is a plain one, they call the ops' implementations directly,
through ``_EagerAttention`` / ``_EagerVarlenAttention`` (``torch.autograd.Function``) when a gradient is
wanted; otherwise they call the custom ops. Dispatching a custom op costs tens of µs of Python per call,
more than everything else before the launches (docs/tuning/host-path.md). Both routes
run the same functions: the custom ops wrap ``_attention_forward`` etc., and the autograd Functions'
``setup_context`` and ``backward`` are those registered with ``register_autograd``, given the
implementations (``_DIRECT``) instead of the ops (``_OPS``) for the backward's launches.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashtile import paged
from flashtile._backend import attention_path


def _empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call has nothing to compute: no query rows (batch, seqlen_q or nheads 0) or no keys."""
    return q.numel() == 0 or k.numel() == 0


def _empty_forward(
    q: torch.Tensor, learnable_sink: torch.Tensor | None, out_shape: tuple, lse_shape: tuple, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call with no query rows or no keys, as torch's SDPA gives them: every row sees no key,
    so out is 0 and lse is -inf, or the row's sink logit (the sink is its softmax's only term). ``heads``: the
    dimension of lse that holds the heads."""
    out = q.new_zeros(out_shape, dtype=q.dtype)
    if learnable_sink is None:
        return out, q.new_full(lse_shape, float("-inf"), dtype=torch.float32)
    sink = learnable_sink.float().view([-1 if d == heads else 1 for d in range(len(lse_shape))])
    return out, sink.expand(lse_shape).contiguous()


def _attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> out (B, Sq, H, Dv), lse (B, H, Sq) fp32.

    Query i sees key j when i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right; a side
    given as None is unbounded. Scores: scale * q.k, capped to softcap * tanh(. / softcap) if
    softcap > 0, minus alibi_slopes[(b,) h] * |i + Sk - Sq - j| if given; learnable_sink (H,) fp32
    joins each row's softmax denominator (and the LSE). dropout_p > 0 drops each probability with that
    probability (keep mask from rng_state, int64 (2,) [seed, offset]) and scales the kept by 1 / (1 - p);
    the LSE is unchanged. attn_mask (SDPA's): 4-D, each dimension 1 or (B, H, Sq, Sk)'s, boolean (True =
    attend) or additive (added to the scaled scores); it is read through a broadcast view, never expanded.
    deterministic is for the backward (the autograd context keeps it): False allows atomics there.
    """
    if _empty(q, k):
        return _empty_forward(q, learnable_sink, (*q.shape[:3], v.shape[3]), (q.shape[0], q.shape[2], q.shape[1]), 1)
    path = attention_path(q.device)
    if attn_mask is None:
        return path.attention_forward(
            q, k, v, softmax_scale, window_left, window_right, alibi_slopes, softcap, learnable_sink, dropout_p,
            rng_state,
        )  # fmt: skip
    return path.attention_forward(
        q, k, v, softmax_scale, window_left, window_right, alibi_slopes, softcap, learnable_sink, dropout_p, rng_state,
        attn_mask=_mask_view(attn_mask, q, k),
    )  # fmt: skip


attention_forward = torch.library.custom_op("flashtile::attention_forward", _attention_forward, mutates_args=())


def _mask_view(attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """attn_mask as a (B, H, Sq, Sk) view: stride 0 on its broadcast dimensions, no copy."""
    return attn_mask.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])


@attention_forward.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, *options):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v.shape[3]))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


def _attention_backward(
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
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) shaped like (q, k, v); dlse (B, H, Sq) fp32 is the gradient at lse, or None.

    The sink's gradient is ``attention_sink_backward``. dropout_p and rng_state: the forward's.
    deterministic: False allows a kernel whose atomics make the bits vary from run to run."""
    if _empty(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return attention_path(q.device).attention_backward(
        dout, q, k, v, out, lse, softmax_scale, window_left, window_right, dlse, alibi_slopes, softcap, learnable_sink,
        dropout_p, rng_state, deterministic=deterministic,
    )  # fmt: skip


attention_backward = torch.library.custom_op("flashtile::attention_backward", _attention_backward, mutates_args=())


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_sink_backward(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, learnable_sink: torch.Tensor
) -> torch.Tensor:
    """Gradient (H,) of a learnable sink (H,): d loss / d sink_h = -sum over batch and rows i of
    p_i * delta_i, where p_i = exp(sink_h - lse_i) is the sink's share of row i's softmax and
    delta_i = rowsum(dout_i * out_i) - dlse_i (a row whose lse is -inf has no share)."""
    if out.numel() == 0:  # no rows: the sink had no share
        return torch.zeros_like(learnable_sink)
    delta = attention_path(out.device).attention_delta(dout, out, dlse)  # (B, H, Sq)
    log_share = learnable_sink.float()[None, :, None] - lse
    share = torch.where(lse == float("-inf"), 0.0, torch.exp(log_share))
    return -(share * delta).sum(dim=(0, 2)).to(learnable_sink.dtype)


attention_sink_backward = torch.library.custom_op(
    "flashtile::attention_sink_backward", _attention_sink_backward, mutates_args=()
)


@attention_sink_backward.register_fake
def _(dout, out, lse, dlse, learnable_sink):
    return torch.empty_like(learnable_sink)


def _masked_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    softmax_scale: float,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    dropout_p: float,
    rng_state: torch.Tensor | None,
    attn_mask: torch.Tensor,
    mask_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_backward`` with SDPA's attn_mask (no window): (dq, dk, dv, dmask). With mask_needs_grad
    (an additive mask), dmask is the gradient at the mask, shaped and typed like it: dS = P (dP - delta)
    of every (b, h, i, j), written by the dQ pass into a (B, H, Sq, Sk) fp32 buffer and summed over the
    mask's broadcast dimensions; otherwise an empty tensor."""
    if _empty(q, k):
        dmask = torch.zeros_like(attn_mask) if mask_needs_grad else attn_mask.new_empty((0,))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask
    view = _mask_view(attn_mask, q, k)
    dmask = None
    if mask_needs_grad:
        dmask = torch.zeros(view.shape, dtype=torch.float32, device=q.device)
    dq, dk, dv = attention_path(q.device).attention_backward(
        dout, q, k, v, out, lse, softmax_scale, None, None, dlse, alibi_slopes, softcap, None, dropout_p, rng_state,
        attn_mask=view, dmask=dmask,
    )  # fmt: skip
    if dmask is None:
        return dq, dk, dv, attn_mask.new_empty((0,))
    return dq, dk, dv, dmask.sum_to_size(attn_mask.shape).to(attn_mask.dtype)


masked_attention_backward = torch.library.custom_op(
    "flashtile::masked_attention_backward", _masked_attention_backward, mutates_args=()
)


@masked_attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, alibi_slopes, softcap, dropout_p, rng_state, attn_mask,
      mask_needs_grad):  # fmt: skip
    dmask = torch.empty_like(attn_mask) if mask_needs_grad else attn_mask.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


OPTION_DEFAULTS = (None, 0.0, None, 0.0, None, None, True)
"""``attention_forward``'s trailing arguments when not given: alibi_slopes, softcap, learnable_sink, dropout_p,
rng_state, attn_mask, deterministic."""
_VARLEN_OPTION_DEFAULTS = (*OPTION_DEFAULTS[:5], None)  # the varlen op's: the first five, then block_table


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, *options = inputs
    alibi_slopes, softcap, learnable_sink, dropout_p, rng_state, attn_mask, deterministic = (
        *options, *OPTION_DEFAULTS[len(options) :]
    )  # fmt: skip
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, learnable_sink, rng_state, attn_mask)
    ctx.softmax_scale = softmax_scale
    ctx.window = (window_left, window_right)
    ctx.softcap = softcap
    ctx.dropout_p = dropout_p
    ctx.deterministic = deterministic
    ctx.num_inputs = len(inputs)
    # An output the loss does not use (lse, usually) gets None, not a zero tensor: no (B, H, Sq) fill and
    # no dlse read per backward. Same results: delta = rowsum(dout * out) - 0 is rowsum(dout * out).
    ctx.set_materialize_grads(False)


def _backward_with(ops, ctx, dout, dlse):
    """The backward of ``attention_forward`` (``register_autograd``'s function), launching through ``ops``:
    ``_OPS`` (the custom ops, which torch.compile traces) or ``_DIRECT`` (their implementations)."""
    q, k, v, out, lse, alibi_slopes, learnable_sink, rng_state, attn_mask = ctx.saved_tensors
    window_left, window_right = ctx.window
    if dout is None:
        dout = torch.zeros_like(out)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.float().contiguous()
    dmask = None
    if attn_mask is None:
        dq, dk, dv = ops.attention_backward(
            dout, q, k, v, out, lse, dlse, ctx.softmax_scale, window_left, window_right,
            alibi_slopes, ctx.softcap, learnable_sink, ctx.dropout_p, rng_state, ctx.deterministic,
        )  # fmt: skip
    else:  # SDPA's attn_mask: no window, no sink (the public function combines neither with it)
        needs_grad = ctx.needs_input_grad[11] and attn_mask.is_floating_point()
        dq, dk, dv, dmask = ops.masked_attention_backward(
            dout, q, k, v, out, lse, dlse, ctx.softmax_scale, alibi_slopes, ctx.softcap, ctx.dropout_p, rng_state,
            attn_mask, needs_grad,
        )  # fmt: skip
        dmask = dmask if needs_grad else None
    dsink = None
    if learnable_sink is not None and ctx.needs_input_grad[8]:
        dsink = ops.attention_sink_backward(dout, out, lse, dlse, learnable_sink)
    grads = (dq, dk, dv, None, None, None, None, None, dsink, None, None, dmask, None)  # alibi: none (flash_attn)
    return grads[: ctx.num_inputs]


def _backward(ctx, dout, dlse):
    return _backward_with(_OPS, ctx, dout, dlse)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


# Variable-length batches: packed q (total_q, H, D), k/v (total_k, Hk, D / Dv), cu_seqlens (batch + 1,)
# int32, lse (H, total_q). max_seqlen_* are ints so that the grid is known without reading cu_seqlens.


def _varlen_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_forward`` per sequence of a packed batch -> out (total_q, H, Dv), lse (H, total_q) fp32.

    Sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1])
    of k and v; masks and ALiBi distances are measured within it ((batch, H) slopes: row b is its own).
    With block_table (batch, max_blocks) int32, k and v are pages (num_blocks, page_block_size, Hk, D / Dv):
    key j of sequence b is row j % page_block_size of page block_table[b, j // page_block_size]."""
    if _empty(q, k):
        return _empty_forward(q, learnable_sink, (*q.shape[:2], v.shape[-1]), (q.shape[1], q.shape[0]), 0)
    return attention_path(q.device).varlen_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
        alibi_slopes, softcap, learnable_sink, dropout_p, rng_state, block_table,
    )  # fmt: skip


varlen_attention_forward = torch.library.custom_op(
    "flashtile::varlen_attention_forward", _varlen_attention_forward, mutates_args=()
)


@varlen_attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
      *options):  # fmt: skip
    total_q, nheads, _ = q.shape
    return q.new_empty((total_q, nheads, v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)


def _varlen_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) shaped like (q, k, v); dlse (H, total_q) fp32 or None. Rows of k/v that
    no query sees (e.g. of a sequence without queries) get zero gradients.

    With a block_table (paged k and v, as in the forward; flash_attn has no backward for them) the pages
    are gathered into packed keys, the unpaged backward runs on those, and dk, dv are its gradients added
    back into pages (``flashtile.paged``): a page that several sequences use gets their sum, one that none
    uses zeros. Sizing the packed keys reads cu_seqlens_k[-1] on the host (one synchronisation on CUDA)."""
    if _empty(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    slots = None if block_table is None else paged.packed_slots(block_table, cu_seqlens_k, k)
    packed_k, packed_v = (k, v) if slots is None else (k[slots], v[slots])
    dq, dk, dv = attention_path(q.device).varlen_attention_backward(
        dout, q, packed_k, packed_v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
        window_left, window_right, dlse, alibi_slopes, softcap, learnable_sink, dropout_p, rng_state,
    )  # fmt: skip
    if slots is not None:
        dk, dv = paged.scatter_add(dk, slots, k), paged.scatter_add(dv, slots, v)
    return dq, dk, dv


varlen_attention_backward = torch.library.custom_op(
    "flashtile::varlen_attention_backward", _varlen_attention_backward, mutates_args=()
)


@varlen_attention_backward.register_fake
def _(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window_left, window_right, *options = inputs
    alibi_slopes, softcap, learnable_sink, dropout_p, rng_state, block_table = (
        *options, *_VARLEN_OPTION_DEFAULTS[len(options) :]
    )  # fmt: skip
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, learnable_sink, rng_state, block_table)
    ctx.args = (max_q, max_k, softmax_scale, window_left, window_right)
    ctx.softcap = softcap
    ctx.dropout_p = dropout_p
    ctx.num_inputs = len(inputs)
    ctx.set_materialize_grads(False)  # as in _setup_context


def _varlen_backward_with(ops, ctx, dout, dlse):
    """The backward of ``varlen_attention_forward``, launching through ``ops`` (as ``_backward_with``)."""
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, learnable_sink, rng_state, block_table = ctx.saved_tensors
    max_q, max_k, softmax_scale, window_left, window_right = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.float().contiguous()
    dq, dk, dv = ops.varlen_attention_backward(
        dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, softmax_scale, window_left, window_right,
        alibi_slopes, ctx.softcap, learnable_sink, ctx.dropout_p, rng_state, block_table,
    )  # fmt: skip
    dsink = None
    if learnable_sink is not None and ctx.needs_input_grad[12]:
        # (H, total_q) is the (1, H, total_q) layout of one packed row of tokens
        dsink = ops.attention_sink_backward(
            dout[None], out[None], lse[None], None if dlse is None else dlse[None], learnable_sink
        )
    grads = (dq, dk, dv, *(None,) * 9, dsink, None, None, None)  # cu_seqlens, ints, floats, alibi, table: none
    return grads[: ctx.num_inputs]


def _varlen_backward(ctx, dout, dlse):
    return _varlen_backward_with(_OPS, ctx, dout, dlse)


varlen_attention_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------------------------------------------
# Eager calls past the dispatcher

_OPS = SimpleNamespace(
    attention_backward=attention_backward,
    masked_attention_backward=masked_attention_backward,
    attention_sink_backward=attention_sink_backward,
    varlen_attention_backward=varlen_attention_backward,
)
_DIRECT = SimpleNamespace(
    attention_backward=_attention_backward,
    masked_attention_backward=_masked_attention_backward,
    attention_sink_backward=_attention_sink_backward,
    varlen_attention_backward=_varlen_attention_backward,
)


def _eager_function(name: str, forward, setup_context, backward_with) -> type[torch.autograd.Function]:
    """A ``torch.autograd.Function`` named ``name``: a custom op's implementation ``forward`` with its registered
    autograd (``setup_context``, ``backward_with`` given ``_DIRECT``), minus the custom op's dispatch. Its
    forward calls ``setup_context`` itself: a separate setup_context would make apply() bind the signature
    on every call."""

    def eager_forward(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    def eager_backward(ctx, dout, dlse):
        return backward_with(_DIRECT, ctx, dout, dlse)

    methods = {"forward": staticmethod(eager_forward), "backward": staticmethod(eager_backward)}
    return type(name, (torch.autograd.Function,), methods)


_EagerAttention = _eager_function("_EagerAttention", _attention_forward, _setup_context, _backward_with)
_EagerVarlenAttention = _eager_function(
    "_EagerVarlenAttention", _varlen_attention_forward, _varlen_setup_context, _varlen_backward_with
)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a Parameter (e.g. a learnable sink) behaves as a tensor


def _eager(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a call may skip the custom op's dispatch: nothing compiles, traces or intercepts torch calls
    (no torch function or dispatch mode such as ``torch.device(...)``, FakeTensorMode or make_fx, no
    functorch transform) and every tensor is a plain one (no subclass: fake, functional, DTensor...)."""
    if (
        torch.compiler.is_compiling()  # first: dynamo must not trace the queries below
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
    ):
        return False
    for t in tensors:  # a loop, not all() over a generator: this runs on every call
        if t is not None and type(t) not in _PLAIN_TENSORS:
            return False
    return True


def _wants_grad(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def attention(*args):
    """``attention_forward(*args)`` (same arguments, 6 to 13 of them), called directly in plain eager mode
    (``_eager``): through ``_EagerAttention`` when a gradient is wanted, else the implementation itself."""
    tensors = (*args[:3], *args[6:7], *args[8:9], *args[10:12])  # q, k, v, alibi_slopes, sink, rng_state, mask
    if not _eager(tensors):
        return attention_forward(*args)
    if _wants_grad(tensors):
        return _EagerAttention.apply(*args)
    return _attention_forward(*args)


def varlen_attention(*args):
    """``varlen_attention_forward(*args)``, past the dispatcher in plain eager mode, as ``attention``."""
    tensors = (*args[:5], *args[10:11], *args[12:13], *args[14:16])  # q, k, v, cu_seqlens, alibi, sink, rng, table
    if not _eager(tensors):
        return varlen_attention_forward(*args)
    if _wants_grad(tensors):
        return _EagerVarlenAttention.apply(*args)
    return _varlen_attention_forward(*args)
