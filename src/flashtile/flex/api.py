"""flashtile.flex_attention: FlexAttention's function (``torch.nn.attention.flex_attention.flex_attention``), its
checks, and the choice between flashtile's built-in attention (for mods that are one of its options, ``patterns``),
the Triton kernel generated from the mods and the PyTorch route."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypedDict

import torch

from flashtile import _backend, _ops, interface
from flashtile.errors import InputError, InputTypeError, UnsupportedDtypeError
from flashtile.flex import patterns
from flashtile.flex.block_mask import BlockMask, as_block_mask, check_lists, full_block_mask, require_mod
from flashtile.flex.mods import ScoreMod
from flashtile.flex.torch_route import flex_attention_torch
from flashtile.options import scale_or_default

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("AUTO", "TRITON", "TORCH")
TORCH_BACKENDS = {"TRITON_DECODE": "TRITON"}
"""FlexAttention's BACKEND values that flashtile runs as one of its own: its decoding kernel's as the generated
kernel, which serves every query length. Its "FLASH" (FlashAttention's CuTe DSL kernels) is refused, as
FlexAttention refuses it where those kernels are not installed: "AUTO" runs flashtile's FlashAttention kernels
wherever the mods are their options."""


class FlexKernelOptions(TypedDict, total=False):
    """flex_attention's ``kernel_options``, as FlexAttention's type of that name: a dict whose "BACKEND" picks the
    implementation (``flex_attention``); FlexAttention's other keys (tile sizes, warps, stages, ...) are accepted
    and ignored: flashtile chooses its kernels' tiles itself."""

    BACKEND: str


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``flex_attention(..., return_aux=AuxRequest(...))`` returns besides out, as
    FlexAttention's ``AuxRequest`` (which flex_attention accepts too)."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary outputs of ``flex_attention(..., return_aux=...)``, as FlexAttention's ``AuxOutput``: lse
    (B, Hq, L) float32, the log-sum-exp of each row's scores (natural log); max_scores (B, Hq, L) float32, each row's
    largest score after score_mod among the positions it attends (-inf where it attends to none; no gradient). A
    field not requested is None."""

    lse: torch.Tensor | None = None
    max_scores: torch.Tensor | None = None


def _aux_request(return_lse: bool, return_aux: Any) -> AuxRequest | None:
    """``return_aux`` as an AuxRequest (fields read by name, so torch's own AuxRequest works); InputError where
    return_lse is given with it, InputTypeError where it is not a request."""
    if return_aux is None:
        return None
    if return_lse:
        raise InputError(
            "flex_attention: give return_lse or return_aux, not both: return_aux=AuxRequest(lse=True) returns the "
            "lse in the AuxOutput."
        )
    fields = tuple(getattr(return_aux, name, None) for name in AuxRequest._fields)
    if not all(isinstance(field, bool) for field in fields):
        raise InputTypeError(
            f"flex_attention: return_aux must be an AuxRequest (fields lse and max_scores, bools) or None, got "
            f"{return_aux!r}."
        )
    return AuxRequest(*fields)


def _check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> None:
    """InputError (or InputTypeError) for inputs flex_attention cannot take, saying what was expected."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"flex_attention: {name} must be a torch.Tensor, got {type(x).__name__}.")
        if x.dim() != 4:
            raise InputError(f"flex_attention: {name} must be 4-D (B, H, seqlen, headdim), got shape {tuple(x.shape)}.")
        if x.dtype not in DTYPES:
            raise UnsupportedDtypeError(
                f"flex_attention takes float16, bfloat16 or float32 tensors, got {name} of dtype {x.dtype}."
            )
    if not query.dtype == key.dtype == value.dtype:
        raise InputTypeError(
            f"flex_attention: query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}."
        )
    if not query.device == key.device == value.device:
        raise InputError(
            f"flex_attention: query, key and value must be on one device, got {query.device}, {key.device}, "
            f"{value.device}."
        )
    (batch, nheads, _, dim), (batch_k, nheads_k, _, dim_k) = query.shape, key.shape
    if dim != dim_k:
        raise InputError(f"flex_attention: query and key must have the same head dim E, got {dim} and {dim_k}.")
    if value.shape[:3] != key.shape[:3]:
        raise InputError(
            f"flex_attention: value (B, Hkv, S, Ev) must match key's (B, Hkv, S) = {tuple(key.shape[:3])}, "
            f"got {tuple(value.shape)}."
        )
    if batch_k not in (batch, 1):
        raise InputError(
            f"flex_attention: key and value must have query's batch size {batch} (or 1, shared by every entry), "
            f"got {batch_k}."
        )
    if not enable_gqa and nheads != nheads_k:
        raise InputError(
            f"flex_attention: query and key/value must have the same number of heads, got Hq={nheads} and "
            f"Hkv={nheads_k}. Try setting enable_gqa=True for GQA."
        )
    if nheads % nheads_k:
        raise InputError(
            f"flex_attention: for GQA the number of query heads must be a multiple of kv heads, got Hq={nheads} and "
            f"Hkv={nheads_k}."
        )


def _checked_block_mask(block_mask: Any, query: torch.Tensor, key: torch.Tensor) -> BlockMask:
    """The BlockMask to use: ``block_mask`` (flashtile's or torch's) after checking it fits the inputs, or one
    with every block full when it is None."""
    (batch, nheads, seqlen_q, _), seqlen_k = query.shape, key.shape[2]
    if block_mask is None:
        return full_block_mask(seqlen_q, seqlen_k, query.device)
    mask = as_block_mask(block_mask)
    if tuple(mask.seq_lengths) != (seqlen_q, seqlen_k):
        raise InputError(
            f"flex_attention: block_mask was created for Q_LEN, KV_LEN = {tuple(mask.seq_lengths)} but the inputs "
            f"have {seqlen_q} queries and {seqlen_k} keys: create the block mask for these lengths."
        )
    mask_batch, mask_heads = mask.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, nheads):
        raise InputError(
            f"flex_attention: block_mask has B={mask_batch}, H={mask_heads}; it needs B of 1 or {batch} and H of 1 or "
            f"{nheads} (the query's). Create it with B={batch} (or None) and H={nheads} (or None)."
        )
    if mask.kv_num_blocks.device != query.device:
        raise InputError(
            f"flex_attention: block_mask is on {mask.kv_num_blocks.device} and the inputs on {query.device}: "
            f"create it with device={str(query.device)!r} (or move it with block_mask.to(device))."
        )
    check_lists(mask)
    return mask


def _backend_of(kernel_options: FlexKernelOptions | None) -> str:
    """kernel_options["BACKEND"] (default "AUTO"; FlexAttention's own values as ``TORCH_BACKENDS`` maps them);
    InputError for a value neither knows."""
    if kernel_options is None:
        return "AUTO"
    if not isinstance(kernel_options, dict):
        raise InputTypeError(f"flex_attention: kernel_options must be a dict or None, got {type(kernel_options)}.")
    backend = kernel_options.get("BACKEND", "AUTO")
    if backend not in BACKENDS and backend not in TORCH_BACKENDS:
        raise InputError(
            f"flex_attention: kernel_options['BACKEND'] must be one of {BACKENDS} (or FlexAttention's "
            f"{tuple(TORCH_BACKENDS)}), got {backend!r}; 'AUTO' runs flashtile's FlashAttention kernels wherever "
            "the mods are their options."
        )
    return TORCH_BACKENDS.get(backend, backend)


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: FlexKernelOptions | None = None,
    *,
    return_aux: AuxRequest | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, AuxOutput]:
    """Attention with a programmable score and a block-sparse mask: FlexAttention's ``flex_attention`` (same
    arguments, layout and results; switch by importing it from flashtile).

    query: (B, Hq, L, E); key: (B or 1, Hkv, S, E); value: (B or 1, Hkv, S, Ev). float16, bfloat16 or float32,
    one dtype and one device (CUDA or CPU). Hkv == Hq, or with ``enable_gqa=True`` any divisor of Hq (query head
    h reads kv head h // (Hq // Hkv)). A key/value batch of 1 is shared by every query batch entry.
    score_mod(score, b, h, q_idx, kv_idx) -> score: changes each scaled score (float32 0-d; b, h, q_idx, kv_idx
    are int32 0-d), e.g. ``score + bias[h, q_idx, kv_idx]``, ``score - slopes[h] * (q_idx - kv_idx)``,
    ``cap * torch.tanh(score / cap)``. Captured tensors that require grad get gradients. Default None: unchanged.
    block_mask: a BlockMask from ``create_block_mask`` (or torch's), made for Q_LEN = L and KV_LEN = S and batch
    and heads of 1 or B and Hq. Blocks it skips are never computed; in its partial blocks its mask_mod hides the
    positions where it is False; in its full blocks every position attends. Default None: nothing masked.
    scale: multiplies q k^T before score_mod; default 1 / sqrt(E).
    return_lse: also return the log-sum-exp of each row's scores (natural log).
    return_aux: keyword only; an ``AuxRequest(lse=..., max_scores=...)`` (flashtile's or torch's): also return an
    ``AuxOutput`` with the requested fields, the lse as return_lse gives it and max_scores each row's largest score
    after score_mod (float32, -inf in a row that attends to nothing, without a gradient). Not with return_lse.
    kernel_options: dict; its "BACKEND" key picks the implementation: "AUTO" (default: where the mods and block
    mask are one of flashtile's built-in options (causal, causal sliding window, softcap, ALiBi; docs/flex.md),
    flashtile's built-in attention, the kernels of ``flash_attn_func``, on CUDA and CPU alike; else the Triton
    kernel generated from the mods on CUDA where it can take them, else the PyTorch route), "TRITON" (the generated
    kernel, never the built-in one, or InputError saying why it cannot run), "TORCH" (flashtile's tiled PyTorch
    route); FlexAttention's "TRITON_DECODE" runs as "TRITON". Other keys are ignored.

    Returns out (B, Hq, L, Ev) in query's dtype (from the built-in attention, a transposed view of a (B, L, Hq, Ev)
    tensor); with return_lse (out, lse), lse (B, Hq, L) float32; with return_aux (out, AuxOutput). A row that attends
    to no key gets out 0 and lse -inf.

    Raises:
        flashtile.InputTypeError (a TypeError): a non-tensor input, a dtype other than float16, bfloat16 or float32
            (UnsupportedDtypeError), mods that are not functions of 5 (score_mod) arguments, kernel_options not a dict
        flashtile.InputError (a ValueError and a RuntimeError): shapes, dtypes or devices that do not fit together,
            a block mask made for other sizes, an unknown BACKEND, or BACKEND "TRITON" for a call the kernel cannot
            take (the message says why), return_lse with return_aux; all before computing anything.
    """
    aux = _aux_request(return_lse, return_aux)
    _check_tensors(query, key, value, enable_gqa)
    require_mod(score_mod, "score_mod", 5)
    mask = _checked_block_mask(block_mask, query, key)
    backend = _backend_of(kernel_options)
    scale = scale_or_default(scale, query.shape[-1])
    if key.shape[0] != query.shape[0]:
        key = key.expand(query.shape[0], *key.shape[1:])
        value = value.expand(query.shape[0], *value.shape[1:])
    output_max = aux is not None and aux.max_scores
    out, lse, max_scores = _eager_run()(query, key, value, score_mod, mask, scale, backend, output_max)
    if aux is not None:
        return out, AuxOutput(lse=lse if aux.lse else None, max_scores=max_scores if output_max else None)
    return (out, lse) if return_lse else out


@functools.cache
def _eager_run() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``_run`` left out of torch.compile's tracing, made at the first call: ``torch.compiler.disable`` imports
    dynamo (about a second), which ``import flashtile`` does not pay."""
    return torch.compiler.disable(_run)


def _run(
    query, key, value, score_mod, mask, scale, backend, output_max: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(out, lse, the rows' largest scores after the mods, or None where the implementation does not give them) from
    the implementation ``backend`` asks for (``flex_attention``'s docstring). The built-in attention does not give
    them and the generated kernel only with ``output_max``: a call with ``output_max`` takes the generated kernel or
    the PyTorch route. Inside a torch.compile'd function this runs eagerly (a graph break): the mods are traced and
    the kernels launched here, which dynamo cannot follow."""
    if backend == "AUTO" and not output_max:
        builtin = patterns.builtin_options(query, key, value, score_mod, mask, scale)
        if builtin is not None:
            return *_builtin(query, key, value, scale, builtin), None
    if backend == "TORCH" or (backend == "AUTO" and _backend.path_name(query.device) == "cpu"):
        return flex_attention_torch(query, key, value, score_mod, mask, scale)
    if _backend.path_name(query.device) == "cpu":
        raise InputError(
            "flex_attention: kernel_options BACKEND='TRITON' needs CUDA tensors (or the Triton interpreter, "
            "TRITON_INTERPRET=1); use 'AUTO' or 'TORCH' on the CPU."
        )
    from flashtile.flex import kernel  # the kernel's module imports Triton: only where it runs

    reason = kernel.unsupported(query, key, value, score_mod, mask)
    if reason is None:
        return kernel.flex_attention_triton(query, key, value, score_mod, mask, scale, output_max)
    if backend == "TRITON":
        raise InputError(f"flex_attention: the Triton kernel cannot run this call: {reason}.")
    return flex_attention_torch(query, key, value, score_mod, mask, scale)


def _builtin(query, key, value, scale: float, builtin: patterns.Builtin) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) by flashtile's built-in attention with the options ``patterns.builtin_options`` found: the path
    of ``flash_attn_func`` (``interface.attention``: its autograd, GQA, CPU path and kernel choice) on the inputs
    transposed to its (B, L, H, E) layout; for a prefix-LM mask, two calls on the query rows before and after the
    prefix, whose keys are each one range: the prefix's keys for the first (no mask), every key causally for the
    others (bottom-right aligned, so query ``prefix + i`` sees keys up to ``prefix + i``). out is transposed back to
    (B, H, L, Ev)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if builtin.prefix is not None:
        return _prefix_lm(q, k, v, scale, builtin, deterministic)
    out, lse = interface.attention(q, k, v, softmax_scale=scale, deterministic=deterministic, **builtin.options)
    return out.transpose(1, 2), lse


def _prefix_lm(q, k, v, scale: float, builtin: patterns.Builtin, deterministic: bool):
    """``_builtin`` for a prefix-LM mask, from q, k, v in (B, L, H, E): ``_PrefixLM`` on the inputs as the built-in
    attention takes them (``interface.prepared``: checked, a head dim that is not a multiple of 8 padded, the output
    sliced back)."""
    p = builtin.prefix
    q, k, v, options, head_dim = interface.prepared(
        q, k, v, softmax_scale=scale, deterministic=deterministic, **builtin.options
    )  # fmt: skip
    prefix_options = interface.attention_options(
        q, p, p, softmax_scale=options.softmax_scale, softcap=options.softcap, deterministic=deterministic
    )  # fmt: skip
    result = _PrefixLM.apply(q, k, v, p, prefix_options, options)
    out, lse = result if head_dim is None else interface.sliced(result, head_dim)
    return out.transpose(1, 2), lse


class _PrefixLM(torch.autograd.Function):
    """(out (B, L, H, Ev), lse (B, H, L)) of a prefix-LM mask from q, k, v (B, L, H, E) by two built-in calls: the
    first ``prefix`` query rows on the prefix's keys with ``prefix_options`` (no mask), the others on every key with
    ``options`` (causal, bottom-right aligned). The backward writes dQ in q's layout and adds the first call's dK
    and dV into the prefix rows of the second's: autograd over slices and a concatenation would zero-fill and add
    whole gradients and copy them again into the leaves' layout."""

    @staticmethod
    def forward(ctx, q, k, v, prefix: int, prefix_options, options):
        calls = (
            (slice(None, prefix), slice(None, prefix), prefix_options),
            (slice(prefix, None), slice(None), options),
        )
        parts = [_ops.attention(q[:, rows], k[:, keys], v[:, keys], opts) for rows, keys, opts in calls]
        ctx.save_for_backward(q, k, v, *(out for out, _ in parts), *(lse for _, lse in parts))
        ctx.calls = calls  # (query rows, keys, options) of each call
        ctx.set_materialize_grads(False)  # no (B, H, L) zeros for an lse the loss does not read
        return torch.cat([out for out, _ in parts], 1), torch.cat([lse for _, lse in parts], 2)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, *saved = ctx.saved_tensors
        grads = []
        for (rows, keys, opts), out, lse in zip(ctx.calls, saved[:2], saved[2:], strict=True):
            dout_rows, dlse_rows = _ops.grad_inputs(
                None if dout is None else dout[:, rows], out, None if dlse is None else dlse[..., rows]
            )  # fmt: skip
            grads.append(_ops.attention_gradients(dout_rows, q[:, rows], k[:, keys], v[:, keys], out, lse, dlse_rows,
                                                  opts))  # fmt: skip
        (dq_prefix, dk_prefix, dv_prefix), (dq_rest, dk, dv) = grads
        (prefix_rows, prefix_keys, _), (rest_rows, _, _) = ctx.calls
        dq = torch.empty_like(q)
        dq[:, prefix_rows], dq[:, rest_rows] = dq_prefix, dq_rest
        dk[:, prefix_keys] += dk_prefix
        dv[:, prefix_keys] += dv_prefix
        return dq, dk, dv, None, None, None
