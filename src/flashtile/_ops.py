"""Attention as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` traces through it.

``flashtile::attention_forward`` and ``flashtile::attention_backward`` run whichever kernel family the
dispatcher picks (``_backend.forward_choice`` / ``backward_choice``); ``register_fake`` gives their output shapes to the
compiler and ``register_autograd`` wires the backward, recomputing attention from the saved LSE.
``flashtile::attention_sink_backward`` gives the gradient of a learnable sink.
``flashtile::varlen_attention_forward`` / ``varlen_attention_backward`` are the same for packed
variable-length batches (cu_seqlens); separate ops because their layouts differ (lse (H, total_q)). Their
trailing ``block_table`` makes k and v pages (flash_attn_varlen_func's paged K/V): the forward reads them in
place, the backward gathers them into packed keys, runs the unpaged backward and adds the key gradients
back into pages (``flashtile.paged``), inside the op, so that torch.compile sees fixed shapes.
``attention_forward`` also takes SDPA's ``attn_mask`` (boolean or additive, 4-D with each dimension 1 or
full); ``attention_backward`` then also returns the mask's gradient (empty unless ``mask_needs_grad``).
Inputs reaching these ops are already validated (``interface``) and have a contiguous last dimension.

The public functions decide a call's options once, as an ``options.AttentionOptions``; the ops take them as flat
arguments (torch.library needs a flat schema), made from the dataclass's fields in one place (``OPTIONS_SCHEMA``,
``_flat``, ``AttentionOptions(*flat)``) and named like its fields. Every option has a default but softmax_scale, so
``torch.ops.flashtile.attention_forward(q, k, v, scale, left, right, softcap=...)`` works as written.

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

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import torch

from flashtile import _backend, paged
from flashtile.float8 import output_dtype
from flashtile.options import AttentionOptions, CacheOptions, Packing

_SCHEMA_TYPES = {
    "float": "float",
    "int": "int",
    "int | None": "SymInt?",
    "torch.Tensor | None": "Tensor?",
    "bool": "bool",
}


def _schema_argument(field: dataclasses.Field) -> str:
    default = "" if field.default is dataclasses.MISSING else f"={field.default}"
    return f"{_SCHEMA_TYPES[field.type]} {field.name}{default}"


_TENSOR = "torch.Tensor | None"


def _names(cls: type, *, tensors: bool = False) -> tuple[str, ...]:
    """The field names of the dataclass ``cls`` in order, or those of its fields that hold a tensor."""
    return tuple(field.name for field in dataclasses.fields(cls) if not tensors or field.type == _TENSOR)


def _values(obj: object, names: tuple[str, ...]) -> tuple:
    """``obj``'s fields ``names``, in that order (a list first: a tuple of a generator costs more per call)."""
    return tuple([getattr(obj, name) for name in names])


OPTIONS_SCHEMA = ", ".join(map(_schema_argument, dataclasses.fields(AttentionOptions)))
"""The options' part of the ops' schemas: one argument per field of ``AttentionOptions``, in its order."""
_CACHE_SCHEMA = ", ".join(map(_schema_argument, dataclasses.fields(CacheOptions)))
"""The decode op's part for a ``CacheOptions``, likewise."""

_OPTION_NAMES = _names(AttentionOptions)
_TENSOR_OPTIONS = _names(AttentionOptions, tensors=True)
"""The options that are tensors: saved for the backward with ``save_for_backward``, the others kept on ``ctx``."""
_CACHE_NAMES = _names(CacheOptions)
_CACHE_TENSORS = _names(CacheOptions, tensors=True)


def _flat(options: AttentionOptions) -> tuple:
    """The options' flat arguments, in ``OPTIONS_SCHEMA``'s order: ``AttentionOptions(*_flat(options))`` is
    ``options``."""
    return _values(options, _OPTION_NAMES)


def _op(name: str, schema: str, implementation, mutates_args: tuple[str, ...] = ()):
    """The custom op ``flashtile::name`` with this schema (``OPTIONS`` stands for the options' arguments,
    ``CACHE`` for a decoding call's ``CacheOptions``)."""
    schema = schema.replace("OPTIONS", OPTIONS_SCHEMA).replace("CACHE", _CACHE_SCHEMA)
    return torch.library.custom_op(f"flashtile::{name}", implementation, mutates_args=mutates_args, schema=schema)


def _empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call has nothing to compute: no query rows (batch, seqlen_q or nheads 0) or no keys."""
    return q.numel() == 0 or k.numel() == 0


def _empty_forward(
    q: torch.Tensor, learnable_sink: torch.Tensor | None, out_shape: tuple, lse_shape: tuple, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call with no query rows or no keys, as torch's SDPA gives them: every row sees no key,
    so out is 0 and lse is -inf, or the row's sink logit (the sink is its softmax's only term). ``heads``: the
    dimension of lse that holds the heads."""
    out = q.new_zeros(out_shape, dtype=output_dtype(q.dtype))
    if learnable_sink is None:
        return out, q.new_full(lse_shape, float("-inf"), dtype=torch.float32)
    sink = learnable_sink.float().view([-1 if d == heads else 1 for d in range(len(lse_shape))])
    return out, sink.expand(lse_shape).contiguous()


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions):
    """q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> out (B, Sq, H, Dv), lse (B, H, Sq) fp32, by the
    family ``_backend.forward_choice`` picks (``options.AttentionOptions`` says what each option does). An
    attn_mask is read through a (B, H, Sq, Sk) broadcast view, never expanded."""
    if _empty(q, k):
        return _empty_forward(
            q, options.learnable_sink, (*q.shape[:3], v.shape[3]), (q.shape[0], q.shape[2], q.shape[1]), 1
        )
    if options.attn_mask is not None:
        options = dataclasses.replace(options, attn_mask=_mask_view(options.attn_mask, q, k))
    choice = _backend.forward_choice(q, k, v, options)
    return _backend.family_module(choice, "forward").attention_forward(q, k, v, options)


def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *flat) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, AttentionOptions(*flat))


attention_forward = _op(
    "attention_forward", "(Tensor q, Tensor k, Tensor v, OPTIONS) -> (Tensor, Tensor)", _attention_forward
)


def _mask_view(attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """attn_mask as a (B, H, Sq, Sk) view: stride 0 on its broadcast dimensions, no copy."""
    return attn_mask.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])


@attention_forward.register_fake
def _(q, k, v, *flat):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v.shape[3]), dtype=output_dtype(q.dtype))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


def _attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, *trailing,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients (dq, dk, dv, dmask): dq, dk, dv shaped like (q, k, v); dlse (B, H, Sq) fp32 is the gradient at lse,
    or None. The options are the forward's; the sink's gradient is ``attention_sink_backward``; deterministic=False
    allows a kernel whose atomics make the bits vary from run to run.

    With SDPA's attn_mask (no window, no sink) and mask_needs_grad (an additive mask), dmask is the gradient at the
    mask, shaped and typed like it: dS = P (dP - delta) of every (b, h, i, j), written by the dQ pass into a
    (B, H, Sq, Sk) fp32 buffer and summed over the mask's broadcast dimensions; otherwise an empty tensor."""
    options, mask_needs_grad = _options_and(trailing, False)
    attn_mask = options.attn_mask
    no_dmask = q.new_empty((0,)) if attn_mask is None else attn_mask.new_empty((0,))
    if _empty(q, k):
        dmask = torch.zeros_like(attn_mask) if mask_needs_grad else no_dmask
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask
    dmask = None
    if attn_mask is not None:
        options = dataclasses.replace(options, attn_mask=_mask_view(attn_mask, q, k))
        if mask_needs_grad:
            dmask = torch.zeros(options.attn_mask.shape, dtype=torch.float32, device=q.device)
    choice = _backend.backward_choice(q, k, v, dout, options)
    module = _backend.family_module(choice, "backward")
    if dmask is None:
        return (*_in_layouts_of(module.attention_backward(dout, q, k, v, out, lse, options, dlse), (q, k, v)), no_dmask)
    grads = module.attention_backward(dout, q, k, v, out, lse, options, dlse, dmask=dmask)
    dmask = dmask.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
    return _in_layouts_of((*grads, dmask), (q, k, v, attn_mask))


def _in_layouts_of(grads: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Each gradient in the layout ``torch.empty_like`` gives its input (the input's strides where it is dense and
    non-overlapping, else contiguous): the layout the backward ops' register_fake declares, on which the code
    torch.compile generates around them relies. A gradient a kernel wrote in another layout (the Triton and CPU
    backwards write contiguous ones) is copied; for torch's (B, H, N, D) inputs, seen here as transposed views,
    autograd would otherwise make the same copy into the leaf's layout."""
    return tuple(
        grad if grad.stride() == _dense_strides(x) else torch.empty_like(x).copy_(grad)
        for grad, x in zip(grads, inputs, strict=True)
    )


def _dense_strides(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``torch.empty_like(x)``, without allocating (a contiguous x's own)."""
    return x.stride() if x.is_contiguous() else torch.empty_like(x, device="meta").stride()


def _options_and(trailing: tuple, default) -> tuple[AttentionOptions, object]:
    """(the options, the argument after them) from a custom op's trailing arguments as the call passed them (the
    options' defaults, and ``default`` for the last, where it stopped early)."""
    count = len(_OPTION_NAMES)
    return AttentionOptions(*trailing[:count]), (trailing[count] if len(trailing) > count else default)


attention_backward = _op(
    "attention_backward",
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, OPTIONS, "
    "bool mask_needs_grad=False) -> (Tensor, Tensor, Tensor, Tensor)",
    _attention_backward,
)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, *trailing):
    options, mask_needs_grad = _options_and(trailing, False)
    attn_mask = options.attn_mask
    if mask_needs_grad:
        dmask = torch.empty_like(attn_mask)
    else:
        dmask = q.new_empty((0,)) if attn_mask is None else attn_mask.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


def _attention_sink_backward(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, learnable_sink: torch.Tensor
) -> torch.Tensor:
    """Gradient (H,) of a learnable sink (H,): d loss / d sink_h = -sum over batch and rows i of
    p_i * delta_i, where p_i = exp(sink_h - lse_i) is the sink's share of row i's softmax and
    delta_i = rowsum(dout_i * out_i) - dlse_i (a row whose lse is -inf has no share)."""
    if out.numel() == 0:  # no rows: the sink had no share
        return torch.zeros_like(learnable_sink)
    delta = _backend.path_module(out.device).attention_delta(dout, out, dlse)  # (B, H, Sq)
    log_share = learnable_sink.float()[None, :, None] - lse
    share = torch.where(lse == float("-inf"), 0.0, torch.exp(log_share))
    return -(share * delta).sum(dim=(0, 2)).to(learnable_sink.dtype)


attention_sink_backward = torch.library.custom_op(
    "flashtile::attention_sink_backward", _attention_sink_backward, mutates_args=()
)


@attention_sink_backward.register_fake
def _(dout, out, lse, dlse, learnable_sink):
    return torch.empty_like(learnable_sink)


_FORWARD_INPUTS = ("q", "k", "v", *_OPTION_NAMES)
"""The inputs of ``attention_forward`` in order (autograd's needs_input_grad and gradients, by name)."""


def _tensors_of(options: AttentionOptions) -> tuple:
    """The tensor options of ``options``, in ``_TENSOR_OPTIONS``' order."""
    return _values(options, _TENSOR_OPTIONS)


def _save_options(ctx, options: AttentionOptions, num_inputs: int) -> None:
    """Keep ``options`` for the backward: its tensors saved (``_tensors_of``), the rest on ``ctx``; and how many inputs
    the op was given (under torch.compile trailing defaults may be left out: the backward returns that many)."""
    ctx.options = dataclasses.replace(options, **dict.fromkeys(_TENSOR_OPTIONS))
    ctx.num_inputs = num_inputs


def _input_grads(ctx, names: tuple[str, ...], grads: dict) -> tuple:
    """The backward's gradients of the op's ``names`` inputs, as many as it was given (``_save_options``)."""
    return tuple(grads.get(name) for name in names[: ctx.num_inputs])


def _needs_grad(ctx, names: tuple[str, ...], name: str) -> bool:
    index = names.index(name)
    return index < ctx.num_inputs and ctx.needs_input_grad[index]


def _saved_options(ctx, tensors: tuple) -> AttentionOptions:
    return dataclasses.replace(ctx.options, **dict(zip(_TENSOR_OPTIONS, tensors, strict=True)))


def grad_inputs(dout: torch.Tensor | None, out: torch.Tensor, dlse: torch.Tensor | None):
    """dout (zeros where the loss does not use out) with a contiguous last dimension, and dlse float32 contiguous: the
    gradients at (out, lse) as ``attention_gradients`` takes them (for callers that run their own backward too)."""
    if dout is None:
        dout = torch.zeros_like(out)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.float().contiguous()
    return dout, dlse


def _setup_context(ctx, inputs, output):
    q, k, v, *flat = inputs
    options = AttentionOptions(*flat)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *_tensors_of(options))
    _save_options(ctx, options, len(inputs))
    # An output the loss does not use (lse, usually) gets None, not a zero tensor: no (B, H, Sq) fill and
    # no dlse read per backward. Same results: delta = rowsum(dout * out) - 0 is rowsum(dout * out).
    ctx.set_materialize_grads(False)


def _backward_with(ops, ctx, dout, dlse):
    """The backward of ``attention_forward`` (``register_autograd``'s function), launching through ``ops``:
    ``_OPS`` (the custom ops, which torch.compile traces) or ``_DIRECT`` (their implementations)."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    options = _saved_options(ctx, tensors)
    dout, dlse = grad_inputs(dout, out, dlse)
    attn_mask = options.attn_mask
    mask_needs_grad = attn_mask is not None and _needs_grad(ctx, _FORWARD_INPUTS, "attn_mask")
    mask_needs_grad = mask_needs_grad and attn_mask.is_floating_point()
    dq, dk, dv, dmask = ops.attention_backward(dout, q, k, v, out, lse, dlse, *_flat(options), mask_needs_grad)
    dsink = None
    if options.learnable_sink is not None and _needs_grad(ctx, _FORWARD_INPUTS, "learnable_sink"):
        dsink = ops.attention_sink_backward(dout, out, lse, dlse, options.learnable_sink)
    # alibi_slopes get no gradient (as in flash_attn)
    grads = dict(q=dq, k=dk, v=dv, learnable_sink=dsink, attn_mask=dmask if mask_needs_grad else None)
    return _input_grads(ctx, _FORWARD_INPUTS, grads)


def _backward(ctx, dout, dlse):
    return _backward_with(_OPS, ctx, dout, dlse)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


# Variable-length batches: packed q (total_q, H, D), k/v (total_k, Hk, D / Dv), cu_seqlens (batch + 1,)
# int32, lse (H, total_q). max_seqlen_* are ints so that the grid is known without reading cu_seqlens.


def _varlen_flat(packing: Packing, options: AttentionOptions) -> tuple:
    """The varlen ops' arguments after q, k, v, in ``_VARLEN_INPUTS``' order: the packing's cu_seqlens and
    max_seqlens, the options (``_flat``), then the block_table."""
    cu_seqlens, max_seqlens = (packing.cu_seqlens_q, packing.cu_seqlens_k), (packing.max_seqlen_q, packing.max_seqlen_k)
    return (*cu_seqlens, *max_seqlens, *_flat(options), packing.block_table)


def _packing_and_options(flat: tuple) -> tuple[Packing, AttentionOptions]:
    """``_varlen_flat``'s inverse, for the arguments as a call passed them (``_options_and``)."""
    options, block_table = _options_and(flat[4:], None)
    return Packing(*flat[:4], block_table), options


def _varlen_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *flat
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_forward`` per sequence of a packed batch (``options.Packing``) -> out (total_q, H, Dv), lse
    (H, total_q) fp32. Masks and ALiBi distances are measured within each sequence ((batch, H) slopes: row b is
    sequence b's); with a block_table, k and v are pages."""
    packing, options = _packing_and_options(flat)
    if _empty(q, k):
        return _empty_forward(q, options.learnable_sink, (*q.shape[:2], v.shape[-1]), (q.shape[1], q.shape[0]), 0)
    return _backend.path_module(q.device).varlen_attention_forward(q, k, v, packing, options)


_VARLEN_INPUTS = "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, " \
    "SymInt max_seqlen_k, OPTIONS, Tensor? block_table=None"  # fmt: skip
varlen_attention_forward = _op(
    "varlen_attention_forward", f"({_VARLEN_INPUTS}) -> (Tensor, Tensor)", _varlen_attention_forward
)


@varlen_attention_forward.register_fake
def _(q, k, v, *rest):
    total_q, nheads, _ = q.shape
    return q.new_empty((total_q, nheads, v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)


def _varlen_attention_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *flat,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) shaped like (q, k, v); dlse (H, total_q) fp32 or None; the rest as the forward's. Rows
    of k/v that no query sees (e.g. of a sequence without queries) get zero gradients.

    With a block_table (paged k and v, as in the forward; flash_attn has no backward for them) the pages
    are gathered into packed keys, the unpaged backward runs on those, and dk, dv are its gradients added
    back into pages (``flashtile.paged``): a page that several sequences use gets their sum, one that none
    uses zeros. Sizing the packed keys reads cu_seqlens_k[-1] on the host (one synchronisation on CUDA)."""
    packing, options = _packing_and_options(flat)
    if _empty(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    slots = None
    if packing.block_table is not None:
        slots = paged.packed_slots(packing.block_table, packing.cu_seqlens_k, k)
        packing = dataclasses.replace(packing, block_table=None)  # the keys below are packed
    packed_k, packed_v = (k, v) if slots is None else (k[slots], v[slots])
    dq, dk, dv = _backend.path_module(q.device).varlen_attention_backward(
        dout, q, packed_k, packed_v, out, lse, packing, options, dlse
    )
    if slots is not None:
        dk, dv = paged.scatter_add(dk, slots, k), paged.scatter_add(dv, slots, v)
    return _in_layouts_of((dq, dk, dv), (q, k, v))


varlen_attention_backward = _op(
    "varlen_attention_backward",
    f"(Tensor dout, Tensor out, Tensor lse, Tensor? dlse, {_VARLEN_INPUTS}) -> (Tensor, Tensor, Tensor)",
    _varlen_attention_backward,
)


@varlen_attention_backward.register_fake
def _(dout, out, lse, dlse, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_VARLEN_INPUT_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                       *_OPTION_NAMES, "block_table")  # fmt: skip


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, *flat = inputs
    packing, options = _packing_and_options(flat)
    out, lse = output
    ctx.save_for_backward(
        q, k, v, out, lse, packing.cu_seqlens_q, packing.cu_seqlens_k, packing.block_table, *_tensors_of(options)
    )
    _save_options(ctx, options, len(inputs))
    ctx.max_seqlens = (packing.max_seqlen_q, packing.max_seqlen_k)
    ctx.set_materialize_grads(False)  # as in _setup_context


def _varlen_backward_with(ops, ctx, dout, dlse):
    """The backward of ``varlen_attention_forward``, launching through ``ops`` (as ``_backward_with``)."""
    q, k, v, out, lse, cu_q, cu_k, block_table, *tensors = ctx.saved_tensors
    packing, options = Packing(cu_q, cu_k, *ctx.max_seqlens, block_table), _saved_options(ctx, tensors)
    dout, dlse = grad_inputs(dout, out, dlse)
    dq, dk, dv = ops.varlen_attention_backward(dout, out, lse, dlse, q, k, v, *_varlen_flat(packing, options))
    dsink = None
    if options.learnable_sink is not None and _needs_grad(ctx, _VARLEN_INPUT_NAMES, "learnable_sink"):
        # (H, total_q) is the (1, H, total_q) layout of one packed row of tokens
        dsink = ops.attention_sink_backward(
            dout[None], out[None], lse[None], None if dlse is None else dlse[None], options.learnable_sink
        )
    grads = dict(q=dq, k=dk, v=dv, learnable_sink=dsink)  # cu_seqlens, ints, floats, alibi, table: none
    return _input_grads(ctx, _VARLEN_INPUT_NAMES, grads)


def _varlen_backward(ctx, dout, dlse):
    return _varlen_backward_with(_OPS, ctx, dout, dlse)


varlen_attention_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache


def _kvcache_flat(options: AttentionOptions, cache: CacheOptions) -> tuple:
    """``kvcache_forward``'s arguments after q, the caches, k and v: the options (``_flat``), then the cache's."""
    return _flat(options) + _values(cache, _CACHE_NAMES)


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    options: AttentionOptions, cache: CacheOptions,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Append k, v into k_cache, v_cache in place and attend q to each batch entry's keys, by the family
    ``_backend.decode_choice`` picks: ``cpu_decode``'s ``kvcache_forward`` or that of ``flashtile.ops.decode``
    (imported on first use: it imports Triton); inside ``flashtile.profile()``, recording the call under that
    choice. Returns out (B, Sq, H, Dv) in q's dtype, lse (B, H, Sq) float32."""
    choice = _backend.decode_choice(q.device)
    implementation = _backend.imported(_backend.DECODE_MODULES[choice.path]).kvcache_forward
    if _backend.RECORDING is not None:
        implementation = _backend.RECORDING.decode(implementation, choice)
    return implementation(q, k_cache, v_cache, k, v, options, cache)


def prepared_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, options: AttentionOptions, cache: CacheOptions
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``kvcache(q, k_cache, v_cache, None, None, options, cache)[0]`` prepared by the decode family
    (``_backend.decode_choice``'s module's ``prepare``) for later calls of q's, k_cache's and v_cache's layouts
    (shapes, strides, dtypes, devices, 16-byte alignment) with these options and cache; None where the family
    prepares nothing for these inputs or they are not plain tensors in eager mode (``_eager``). A call of what it
    returns skips the dispatch, the family choice and the plan lookup: make it only where ``direct`` holds for the
    call's three tensors (no caches are written without new tokens, so no versions are bumped)."""
    if not _eager((q, k_cache, v_cache, *_values(cache, _CACHE_TENSORS), *_tensors_of(options))):
        return None
    choice = _backend.decode_choice(q.device)
    return _backend.imported(_backend.DECODE_MODULES[choice.path]).prepare(q, k_cache, v_cache, options, cache)


def direct(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether a call on ``tensors`` may take a prepared launch (``prepared_kvcache``): plain eager mode with plain
    tensors (``_eager``), no gradient wanted and no ``flashtile.profile()`` recording (which records the calls the
    dispatcher makes)."""
    return _backend.RECORDING is None and _eager(tensors) and not _wants_grad(tensors)


def _kvcache_forward(q, k_cache, v_cache, k, v, *flat) -> tuple[torch.Tensor, torch.Tensor]:
    count = len(_OPTION_NAMES)
    return _decode(q, k_cache, v_cache, k, v, AttentionOptions(*flat[:count]), CacheOptions(*flat[count:]))


kvcache_forward = _op(
    "kvcache_forward",
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, OPTIONS, CACHE) -> (Tensor, Tensor)",
    _kvcache_forward,
    mutates_args=("k_cache", "v_cache"),
)


@kvcache_forward.register_fake
def _(q, k_cache, v_cache, k, v, *flat):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v_cache.shape[3]))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Eager calls past the dispatcher

_OPS = SimpleNamespace(
    attention_backward=attention_backward,
    attention_sink_backward=attention_sink_backward,
    varlen_attention_backward=varlen_attention_backward,
)
_DIRECT = SimpleNamespace(
    attention_backward=_attention_backward,
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions):
    """``attention_forward(q, k, v, *options)``, called directly in plain eager mode (``_eager``): through
    ``_EagerAttention`` when a gradient is wanted, else the implementation itself."""
    tensors = (q, k, v, *_tensors_of(options))
    if not _eager(tensors):
        return attention_forward(q, k, v, *_flat(options))
    if _wants_grad(tensors):
        return _EagerAttention.apply(q, k, v, *_flat(options))
    return _forward(q, k, v, options)


def attention_gradients(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, options: AttentionOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of ``attention_backward(dout, q, k, v, out, lse, dlse, *options)``, past the dispatcher in plain
    eager mode, as ``attention``: for callers that run their own backward over attention calls (ring attention).
    dout with a contiguous last dimension, lse and dlse (or None) float32 contiguous; no attn_mask gradient."""
    ops = _DIRECT if _eager((dout, q, k, v, out, lse, dlse, *_tensors_of(options))) else _OPS
    return ops.attention_backward(dout, q, k, v, out, lse, dlse, *_flat(options))[:3]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, options: AttentionOptions):
    """``varlen_attention_forward(q, k, v, *packing, *options)``, past the dispatcher in plain eager mode, as
    ``attention``."""
    args = (q, k, v, *_varlen_flat(packing, options))
    tensors = (q, k, v, packing.cu_seqlens_q, packing.cu_seqlens_k, packing.block_table, *_tensors_of(options))
    if not _eager(tensors):
        return varlen_attention_forward(*args)
    if _wants_grad(tensors):
        return _EagerVarlenAttention.apply(*args)
    return _varlen_attention_forward(*args)


def kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    options: AttentionOptions, cache: CacheOptions,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``kvcache_forward(q, k_cache, v_cache, k, v, *options, *cache)``: the implementation called directly in plain
    eager mode (``_eager``) when no gradient is wanted (the op has no backward), with the version bump the custom op
    gives its mutated caches."""
    tensors = (q, k_cache, v_cache, k, v, *_values(cache, _CACHE_TENSORS), *_tensors_of(options))
    if not _eager(tensors) or _wants_grad(tensors):
        return kvcache_forward(q, k_cache, v_cache, k, v, *_kvcache_flat(options, cache))
    out, lse = _decode(q, k_cache, v_cache, k, v, options, cache)
    torch.autograd.graph.increment_version((k_cache, v_cache))
    return out, lse
