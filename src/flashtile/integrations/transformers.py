"""flashtile as an ``attn_implementation`` of Hugging Face transformers models, for training and generation.

    import flashtile.integrations.transformers as fth
    name = fth.register()  # "tile_attention"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    model.set_attn_implementation(name)  # the same on a model already built

``register`` puts two functions into transformers' public registries, nothing else (no transformers class is
patched): ``attention_forward`` into ``AttentionInterface`` (what every attention layer calls) and ``mask`` into
``AttentionMaskInterface`` (what the model calls once per forward to describe which keys each query sees).

How they talk. transformers builds a mask per mask type and forward (causal, sliding-window, bidirectional) by
calling the registered mask function with a *mask function* of indices (``mask_function``), the 2-D padding mask
and the cache's offsets, and hands the result to every layer of that type. ``mask`` reads that description
instead of materialising it: when ``mask_function`` is one of transformers' standard patterns (causal,
bidirectional, sliding window either way, packed sequences) it returns a ``Visibility`` (the window as flash_attn's
``window_size``, the key padding as a (batch, kv_length) mask, the packed sequence ids), and ``attention_forward``
serves it with flashtile's kernels:

- padding (a 2-D ``attention_mask``, left or right): ``flash_attn_varlen_func`` on the unpadded tokens
  (``unpad_input`` / ``pad_input``); no (seqlen x seqlen) mask is ever built;
- packed sequences (``position_ids`` that restart, or the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keywords of
  ``DataCollatorWithFlattening``): ``flash_attn_varlen_func`` with those boundaries;
- one new token per sequence against a cache (decoding): ``flash_attn_with_kvcache`` reading transformers' cache
  in place (``cache_leftpad`` for left padding), unless a gradient, dropout or a learnable sink needs the
  general kernels;
- otherwise ``flash_attn_func``.

Any other pattern (a model's own ``or_mask_function`` / ``and_mask_function``, chunked attention, block overlays)
goes to transformers' own boolean mask (``sdpa_mask``) served by ``flashtile.scaled_dot_product_attention``'s
``attn_mask``, as is a 4-D mask that a caller passes in: exact, at the cost of that mask's memory.

The results are those of the model's "sdpa" and "eager" attention at every query that is not padding (at the
padding positions of a causal or windowed pattern flashtile writes zeros, where SDPA writes values nobody reads).
Tested with transformers 5.17.0 and 5.23.0.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers import masking_utils as _masking
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "flashtile.integrations.transformers needs Hugging Face transformers (5.17 or later): "
        "pip install 'flashtile[transformers]'."
    ) from error

import flashtile
from flashtile.bert_padding import index_first_axis
from flashtile.kvcache import Decoder

__all__ = ["DEFAULT_NAME", "Visibility", "attention_forward", "mask", "register"]

DEFAULT_NAME = "tile_attention"
"""The name ``register()`` registers. Not "flashtile": transformers 5 reads any name containing "flash" as a
request for a Hugging Face hub kernel of that name and fails to build the model."""

_RESERVED = ("flash", "sdpa", "eager", "flex_attention", "paged", "/", ":")
"""Substrings of implementation names that transformers treats specially (hub kernels, its own implementations,
the paged prefix), so a name holding one would not reach flashtile."""


def register(name: str | None = None) -> str:
    """Register flashtile's attention and mask functions with transformers under ``name`` and return it.

    Then ``attn_implementation=name`` in ``from_pretrained`` / ``from_config``, or
    ``model.set_attn_implementation(name)``, runs every attention layer of the model on flashtile. Registering
    again (the same or another name) is harmless.

    Args:
        name: the implementation name; default ``DEFAULT_NAME`` ("tile_attention"). It must not contain "flash"
            (transformers would look for a hub kernel), "sdpa", "eager", "flex_attention", "paged", "/" or ":".

    Raises:
        TypeError: ``name`` is not a non-empty str
        ValueError: ``name`` holds one of the substrings above, which transformers would not route to flashtile

    Returns:
        the registered name, to pass as ``attn_implementation``.
    """
    name = DEFAULT_NAME if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}.")
    clash = [part for part in _RESERVED if part in name.lower()]
    if clash:
        raise ValueError(
            f"name={name!r} contains {clash[0]!r}, which transformers treats specially: a name with 'flash' is loaded "
            "as a Hugging Face hub kernel (the model then fails to build), 'sdpa' / 'eager' / 'flex_attention' / "
            f"'paged' select transformers' own code, '/' and ':' name hub repositories. Use another name, e.g. the "
            f"default {DEFAULT_NAME!r}."
        )
    # Both registries: without the mask function transformers builds no mask at all for an unknown name, and the
    # attention would silently ignore the padding.
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask)
    return name


# ---------------------------------------------------------------------------------------------------------------
# The mask function


class Visibility(NamedTuple):
    """Which keys each query sees, as ``mask`` returns it and ``attention_forward`` reads it: one per mask type and
    forward, shared by the layers of that type.

    Query i and key j (indices into this layer's query and key tensors) are at positions
    ``query_start + i`` and ``j`` on one axis; query i sees key j when
        - ``window_left`` is None or i' - j <= window_left and ``window_right`` is None or j - i' <= window_right,
          with i' = query_start + i (``window_right`` = 0: causal);
        - ``key_mask`` is None or key_mask[b, j] (padding, or an unfilled slot of a static cache);
        - ``sequence_ids`` is None or both belong to the same packed sequence (sequence_ids[b, i] == [b, j], with
          the queries and keys one and the same tokens).

    It also passes where transformers expects a prepared 4-D mask (``shape``, ``ndim``, ``contiguous()``): with a
    static cache, ``generate`` builds the masks before the (compiled) forward and hands them in, and the model's
    mask creation returns a prepared mask as it is.
    """

    window_left: int | None
    window_right: int | None
    key_mask: torch.Tensor | None
    """(batch, kv_length) bool, or None when every key exists."""
    query_start: int | torch.Tensor
    """Where query 0 sits among the keys (a 0-d tensor for a static cache, whose length is a tensor)."""
    sequence_ids: torch.Tensor | None
    """(batch, seqlen) int: tokens with one id form one packed sequence; None: one sequence per row."""
    shape: tuple[int, int, int, int]
    """(batch, 1, q_length, kv_length): the shape of the boolean mask this stands for."""
    memo: dict
    """What the layers derive from the mask, made once per forward and reused by every layer (not while compiling):
    decoding's cache lengths, unpadding indices, packed-sequence boundaries."""

    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    def contiguous(self) -> Visibility:
        return self


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable = _masking.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> Visibility | torch.Tensor | None:
    """transformers' mask-function interface (``AttentionMaskInterface``): describe which keys each query sees.

    Args (as transformers passes them):
        batch_size, q_length, kv_length: sizes of this forward's queries and of the layer's keys
        q_offset, kv_offset: positions of query 0 and key 0 (q_offset is a 0-d tensor for a static cache)
        mask_function: transformers' index function of the pattern (causal, sliding window, packed, ...)
        attention_mask: (batch_size, past + q_length) bool padding mask, or None
        kwargs: the rest of transformers' arguments (config, dtype, device, local_size, ...), passed on to
            ``sdpa_mask`` for patterns read through a boolean mask

    Returns:
        a ``Visibility`` for the standard patterns; otherwise transformers' own 4-D boolean mask
        (batch_size, 1, q_length, kv_length).
    """
    if isinstance(attention_mask, Visibility):  # prepared by generate before the forward (a static cache)
        return attention_mask
    pattern = _pattern(mask_function)
    if pattern is None:
        sdpa_kwargs = {**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}
        return _masking.sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **sdpa_kwargs
        )
    window_left, window_right, sequence_ids = pattern
    query_start = q_offset - kv_offset
    keys = None
    if attention_mask is not None:
        end = kv_offset + kv_length
        if attention_mask.shape[-1] < end:  # a static cache is longer than what was seen: the rest is unfilled
            attention_mask = torch.nn.functional.pad(attention_mask, (0, end - attention_mask.shape[-1]))
        keys = attention_mask[:, kv_offset:end]
    # Keys past the last query's reach are never seen; with a static cache they are unfilled slots. Marking them
    # lets every path read the filled part only (and the queries be the last keys a row has).
    query_end = query_start + q_length
    if window_right is not None and (isinstance(query_end, torch.Tensor) or query_end + window_right < kv_length):
        device = kwargs.get("device", keys.device if keys is not None else "cpu")
        reach = torch.arange(kv_length, device=device) < query_end + window_right
        keys = reach.expand(batch_size, kv_length) if keys is None else keys & reach
    memo = {}
    if keys is not None and not torch.compiler.is_compiling():
        # One sync, as transformers' own: whether every key exists, and for a decoding step whether each row's keys
        # are one run, with the cache lengths that ``_decode`` hands every layer.
        if q_length == 1:
            cache_seqlens, cache_leftpad, one_run = _key_runs(keys, query_start, q_length)
            every, one_run = torch.stack([keys.all(), one_run]).tolist()
            memo["decode"] = (cache_seqlens, cache_leftpad) if one_run else None
        else:
            every = bool(keys.all())
        if every:
            keys, memo = None, {}
    shape = (batch_size, 1, q_length, kv_length)
    return Visibility(window_left, window_right, keys, query_start, sequence_ids, shape, memo)


def _pattern(fn: Callable) -> tuple[int | None, int | None, torch.Tensor | None] | None:
    """transformers' mask function as (window_left, window_right, sequence_ids) in flash_attn's terms (None:
    unbounded / no packing), or None when it is not made of the standard patterns alone.

    Read from what built it: ``causal_mask_function``, ``bidirectional_mask_function``, the sliding-window overlays
    (causal: kv > q - w, i.e. left w - 1; bidirectional: |q - kv| <= w), the packed-sequence functions (same sequence;
    positions remapped within it) and ``and_masks`` of those."""
    if fn is _masking.causal_mask_function:
        return None, 0, None
    if fn is _masking.bidirectional_mask_function:
        return None, None, None
    cells = _closure(fn)
    name = getattr(fn, "__qualname__", "")
    if name == "sliding_window_overlay.<locals>.inner_mask":
        return cells["sliding_window"] - 1, None, None
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        return cells["sliding_window"], cells["sliding_window"], None
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return None, None, cells["packed_sequence_mask"]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        # Positions step by 1 inside a packed sequence (that is how its boundaries are found): the remapped pattern
        # is the pattern within each sequence.
        return _pattern(cells["mask_function"])
    if name == "and_masks.<locals>.and_mask":
        left = right = ids = None
        for part in cells["mask_functions"]:
            described = _pattern(part)
            if described is None or (ids is not None and described[2] is not None):
                return None
            left, right = _tighter(left, described[0]), _tighter(right, described[1])
            ids = described[2] if ids is None else ids
        return left, right, ids
    return None


def _closure(fn: Callable) -> dict:
    """The variables a closure captured, by name ({} for anything else)."""
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except TypeError:
        return {}


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


# ---------------------------------------------------------------------------------------------------------------
# The attention function


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Visibility | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface (``AttentionInterface``), on flashtile's kernels.

    Args (as transformers' attention layers pass them):
        module: the attention layer (its ``is_causal`` is read when no mask was built)
        query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_k, seqlen_k, headdim[_v]), nheads a
            multiple of nheads_k (GQA / MQA); float16, bfloat16 or float32
        attention_mask: what ``mask`` returned (``Visibility``, or a 4-D boolean mask), a 4-D boolean or additive
            float mask given by the caller, or None (no mask built: the layer's ``is_causal`` and ``sliding_window``)
        dropout: attention dropout probability (the layer passes 0 in evaluation)
        scaling: the softmax scale; default 1 / sqrt(headdim)
        sliding_window: the layer's window, read only when no mask was built (with a mask, the mask's window rules,
            as it does for SDPA)
        softcap: logit softcapping (Gemma 2): scores become softcap * tanh(scores / softcap)
        is_causal: overrides the layer's ``is_causal`` when no mask was built
        s_aux: (nheads,) learnable sinks (gpt-oss), one extra logit per head in each softmax denominator
        kwargs: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` (packed sequences, as
            transformers' DataCollatorWithFlattening gives them); the rest (position_ids, ...) is not needed

    Raises:
        NotImplementedError: what flashtile's attention does not serve (a T5-style ``position_bias``,
            continuous batching's paged ``cache``, a 4-D mask with softcap or sinks), naming the implementation
            to use instead
        TypeError: an attention_mask that is neither this module's ``Visibility``, a tensor nor None (the mask
            function was not registered with the attention function)
        ValueError: a tensor mask that is not 4-D; flashtile.InputError from the attention functions for inputs
            they cannot take

    Returns:
        (out (batch, seqlen_q, nheads, headdim_v), None): no attention weights are formed
    """
    _refuse_unserved(kwargs)
    options = {
        "softmax_scale": scaling,
        "softcap": 0.0 if softcap is None else float(softcap),
        "dropout_p": dropout,
        "learnable_sink": None if s_aux is None else s_aux.float(),
    }
    if isinstance(attention_mask, torch.Tensor):
        return _masked(query, key, value, attention_mask, options), None
    if attention_mask is None:
        attention_mask = _visibility_of_layer(module, query, key, is_causal, sliding_window)
    elif not isinstance(attention_mask, Visibility):
        raise TypeError(
            f"attention_mask is a {type(attention_mask).__name__}; flashtile's attention takes what its own mask "
            "function builds, a 4-D boolean or additive mask (batch, 1 or nheads, seqlen_q, seqlen_k), or None. Was "
            "the model's attn_implementation set to the name register() returned (it registers the mask function too)?"
        )
    # flash_attn's layout (batch, seqlen, heads, dim)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return _attend(q, k, v, attention_mask, kwargs, options), None


def _refuse_unserved(kwargs: dict) -> None:
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            "position_bias: flashtile's transformers attention does not add a learned position bias (T5-style models). "
            "Use attn_implementation='sdpa' or 'eager' for this model."
        )
    if kwargs.get("cache") is not None:
        raise NotImplementedError(
            "cache: transformers' continuous batching (a paged cache) is not served by flashtile's attention yet. "
            "Use model.generate(), or attn_implementation='sdpa' for continuous batching."
        )
    if kwargs.get("output_attentions"):
        warnings.warn(
            "output_attentions=True: flashtile never forms the attention weights and returns None for them; use "
            "attn_implementation='eager' to get them.",
            stacklevel=3,
        )


def _visibility_of_layer(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, is_causal: bool | None, sliding_window: int | None
) -> Visibility:
    """No mask was built: the layer's own flags, as flash_attn's integration reads them (a window w keeps w - 1
    keys on each side; causal cuts the right side)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = None if sliding_window is None else sliding_window - 1
    shape = (query.shape[0], 1, query.shape[2], key.shape[2])
    return Visibility(window, 0 if causal else window, None, key.shape[2] - query.shape[2], None, shape, {})


def _masked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor, options: dict
) -> torch.Tensor:
    """A 4-D mask (boolean, True = attend, or additive float) through flashtile's SDPA; the mask holds the
    pattern, as it does for transformers' SDPA."""
    if attn_mask.dim() != 4:
        raise ValueError(
            f"attention_mask of shape {tuple(attn_mask.shape)}: flashtile's attention takes a 4-D mask (batch, 1 or "
            "nheads, seqlen_q, seqlen_k). Let the model build its mask from a 2-D padding mask instead."
        )
    if options["softcap"] or options["learnable_sink"] is not None:
        raise NotImplementedError(
            "A 4-D attention mask cannot be combined with logit softcapping or learnable sinks in flashtile's "
            "attention: its masked kernels take neither. Pass the 2-D padding mask (batch, seqlen) and let the model "
            "build its own mask, or use attn_implementation='eager'."
        )
    out = flashtile.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=options["dropout_p"], scale=options["softmax_scale"],
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: Visibility, kwargs: dict, options: dict
) -> torch.Tensor:
    """q (B, Sq, H, D), k and v (B, Sk, Hk, D[v]) -> out (B, Sq, H, Dv) as ``seen`` describes."""
    batch, seqlen_q = q.shape[:2]
    causal = seen.window_right == 0
    window = (-1 if seen.window_left is None else seen.window_left, -1 if causal or seen.window_right is None
              else seen.window_right)  # fmt: skip
    options = {**options, "causal": causal, "window_size": window}
    if seqlen_q == 1 and _decodes(seen, q, k, v, options):
        return _decode(q, k, v, seen, options)
    if seen.key_mask is not None:
        return _padded(q, k, v, seen, options)
    cu_seqlens = _packed_boundaries(seen, kwargs, batch, seqlen_q)
    if cu_seqlens is not None:
        q, k, v = (t.reshape(batch * seqlen_q, *t.shape[2:]) for t in (q, k, v))
        cu, longest = cu_seqlens
        given = kwargs.get("cu_seq_lens_q") is not None  # the caller's boundaries are checked, ours are not
        with contextlib.nullcontext() if given else _built_here():
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **_varlen(options))
        return out.view(batch, seqlen_q, *out.shape[1:])
    return flashtile.flash_attn_func(q, k, v, **_varlen(options))


def _built_here() -> contextlib.AbstractContextManager:
    """For sequence lengths this module derived itself (valid by construction): no check of their values, which on
    CUDA would cost a host synchronisation in every layer (``flashtile.check_values``)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else flashtile.check_values(False)


def _varlen(options: dict) -> dict:
    """``options`` as keywords of flash_attn_func / flash_attn_varlen_func."""
    return {**options, "deterministic": torch.are_deterministic_algorithms_enabled()}


def _decodes(seen: Visibility, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict) -> bool:
    """Whether one query per row can go to ``flash_attn_with_kvcache``: it has no backward, dropout or sink, and it
    reads the keys of a row as one run [cache_leftpad, cache_seqlens) (checked once per forward when not compiling;
    under torch.compile a padding mask is taken to be left padding, as generation makes it)."""
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if wants_grad or options["dropout_p"] or options["learnable_sink"] is not None or not options["causal"]:
        return False
    if seen.key_mask is None or torch.compiler.is_compiling():
        return True
    if "decode" not in seen.memo:  # a mask built for several queries per row, read by one
        cache_seqlens, cache_leftpad, one_run = _key_runs(seen.key_mask, seen.query_start, q.shape[1])
        seen.memo["decode"] = (cache_seqlens, cache_leftpad) if bool(one_run) else None
    return seen.memo["decode"] is not None


def _key_runs(
    keys: torch.Tensor, query_start: int | torch.Tensor, seqlen_q: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache_seqlens, cache_leftpad, one_run) of a (batch, kv_length) key mask whose queries are its last keys:
    where each row's keys would end (the last query's position + 1) and where its first key is, as (batch,) int32,
    and whether every row's keys are that one run (a 0-d bool tensor: no sync)."""
    batch, device = keys.shape[0], keys.device
    if isinstance(query_start, torch.Tensor):  # a static cache's, on the device
        ends = (query_start + seqlen_q).to(device, torch.int32).expand(batch).contiguous()
    else:  # no host-to-device copy, which would synchronise
        ends = torch.full((batch,), query_start + seqlen_q, dtype=torch.int32, device=device)
    first = keys.int().argmax(-1).to(torch.int32)
    return ends, first, ((ends - first) == keys.sum(-1)).all()


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: Visibility, options: dict) -> torch.Tensor:
    """``flash_attn_with_kvcache`` on transformers' cache as it is (the new keys are in it already): keys
    [cache_leftpad, cache_seqlens) of each row, the query the last of them; the whole cache without padding. Outside
    torch.compile through a ``flashtile.kvcache.Decoder`` made once per forward and options, which every layer of
    the step shares (the checks of their common arguments run once)."""
    scale, causal, window = options["softmax_scale"], options["causal"], options["window_size"]
    softcap = options["softcap"]
    compiling = torch.compiler.is_compiling()
    name = ("decoder", scale, causal, window, softcap)
    decoder = None if compiling else seen.memo.get(name)
    if decoder is None:
        lengths = {}
        if seen.key_mask is not None:
            if compiling:
                cache_seqlens, cache_leftpad, _ = _key_runs(seen.key_mask, seen.query_start, q.shape[1])
            else:
                cache_seqlens, cache_leftpad = seen.memo["decode"]  # made once per forward (``mask``, ``_decodes``)
            lengths = {"cache_seqlens": cache_seqlens, "cache_leftpad": cache_leftpad}
        arguments = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, **lengths)
        if compiling:
            return flashtile.flash_attn_with_kvcache(q, k, v, **arguments)
        # the lengths are valid by construction: no checks of their values (as ``_built_here``)
        decoder = seen.memo[name] = Decoder(**arguments, check_values=False)
    return decoder(q, k, v)


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: Visibility, options: dict) -> torch.Tensor:
    """A padding mask through the varlen kernels: the existing keys of each row packed one after another, and its
    queries likewise when they are keys too (a window or causal mask aligns them to the keys' ends, which the
    unpadded queries keep); with no window, every query row stays (exact whatever the queries are, e.g. cross
    attention), so padding rows get what SDPA gives them."""
    batch, seqlen_q, nheads, _ = q.shape
    unpadding = seen.memo.get(seqlen_q)
    if unpadding is None:
        keys = seen.key_mask
        aligned = seen.window_left is not None or seen.window_right is not None
        rows = keys[:, int(seen.query_start) : int(seen.query_start) + seqlen_q] if aligned else None
        unpadding = _unpadding(keys), None if rows is None else _unpadding(rows)
        if not torch.compiler.is_compiling():
            seen.memo[seqlen_q] = unpadding
    (key_rows, cu_k, max_k), query_unpadding = unpadding
    k, v = (index_first_axis(t.reshape(-1, *t.shape[2:]), key_rows) for t in (k, v))
    if query_unpadding is None:
        q = q.reshape(batch * seqlen_q, nheads, -1)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
        with _built_here():
            out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqlen_q, max_k, **_varlen(options))
        return out.view(batch, seqlen_q, nheads, -1)
    query_rows, cu_q, max_q = query_unpadding
    q = index_first_axis(q.reshape(-1, nheads, q.shape[-1]), query_rows)
    with _built_here():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **_varlen(options))
    return flashtile.pad_input(out, query_rows, batch, seqlen_q)


def _unpadding(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row indices into the flattened (batch * seqlen) tokens, cu_seqlens, max_seqlen) of the True entries of a
    (batch, seqlen) mask, from ``unpad_input``."""
    _, indices, cu_seqlens, max_seqlen, _ = flashtile.unpad_input(kept, kept)
    return indices, cu_seqlens, max_seqlen


def _packed_boundaries(seen: Visibility, kwargs: dict, batch: int, seqlen: int) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens int32, max_seqlen) of packed sequences over the flattened (batch * seqlen) tokens: the
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keywords when given (they must agree: the tokens are their own keys),
    else where the packed sequence ids change or a row starts; None without packing."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        if cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
            raise ValueError(
                "cu_seq_lens_q and cu_seq_lens_k differ: flashtile's attention reads packed sequences whose tokens are "
                "both the queries and the keys (one cu_seq_lens for both)."
            )
        longest = kwargs.get("max_length_q")
        cu_q = cu_q.to(torch.int32)
        longest = int(longest) if longest is not None else int(cu_q.diff().max())
        return cu_q, longest
    if seen.sequence_ids is None:
        return None
    boundaries = seen.memo.get("packed")
    if boundaries is None:
        ids = seen.sequence_ids.expand(batch, seqlen)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        firsts = starts.flatten().nonzero().flatten()
        cu = torch.cat([firsts, firsts.new_full((1,), batch * seqlen)]).to(torch.int32)
        boundaries = cu, int(cu.diff().max())
        if not torch.compiler.is_compiling():
            seen.memo["packed"] = boundaries
    return boundaries
