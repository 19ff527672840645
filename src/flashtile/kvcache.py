"""``flash_attn_with_kvcache``: attention for inference against a KV cache, with flash_attn 2.x's
signature and semantics (new keys/values appended in place, rotary, paged cache, split-KV decoding).

Inputs are checked here, before anything launches. Which implementation runs is decided by
``flashtile._backend.decode_choice``: the Triton kernels of ``flashtile.ops.decode`` (compiled on CUDA,
interpreted under ``TRITON_INTERPRET=1``) or ``flashtile.cpu_decode``. The checked call becomes an
``options.AttentionOptions`` (scale, window, softcap, ALiBi) and an ``options.CacheOptions`` (the cache's
addressing, rotary, splits), built once here and read by name below. The work is the custom op
``flashtile::kvcache_forward`` of ``flashtile._ops``, declared as mutating k_cache and v_cache, so
``torch.compile(fullgraph=True)`` traces through it; in plain eager calls (``_ops.kvcache``) the implementation
is called directly instead: the custom op's Python dispatch costs tens of µs per call, more than everything else
before the launch (docs/tuning/host-path.md).

Host cost per call is part of decoding's latency, so the checks that run on every call build their
messages only on failure, and the checks of index values (a device-to-host copy on CUDA) can be switched
off (docs/validation.md). ``Decoder`` serves the calls of a decoding step's layers, which share everything but
q and their caches: checked once per layout, the others go to ``_ops.kvcache`` directly.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from flashtile import _backend, _ops
from flashtile.checks import (
    NO_WINDOW,
    bounded_window,
    check_block_table,
    check_block_table_entries,
    check_dtype,
    check_head_dim,
    check_options,
    check_page_size,
    check_qkv,
    check_softmax_scale,
    last_dim_contiguous,
    window_bounds,
)
from flashtile.errors import InputError, InputTypeError, require
from flashtile.interface import pad_head_dim, sliced
from flashtile.options import AttentionOptions, CacheOptions, scale_or_default

INDEX_DTYPE = torch.int32


def _check_index(name: str, t: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> None:
    """A (shape) int32 tensor on ``device``, or None. Runs on every call: messages are built only on failure."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}.")
    if t.dtype != INDEX_DTYPE:
        raise InputTypeError(
            f"{name} must have dtype torch.int32, got {t.dtype}. Convert it with {name}.to(torch.int32)."
        )
    if t.shape != shape:
        raise InputError(f"{name} must have shape {shape}, got {tuple(t.shape)}.")
    if t.device != device:
        raise InputError(f"{name} must be on {device} like q, got {t.device}.")


def _has_head_dim(t: object, head_dim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[-1] == head_dim


def _check_q(q: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor):
        raise InputTypeError(f"q must be a torch.Tensor, got {type(q).__name__}.")
    check_dtype("q", q)
    if q.dim() != 4:
        raise InputError(f"q must have 4 dimensions (batch_size, seqlen_q, nheads, headdim), got {tuple(q.shape)}.")


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dtype != q.dtype:
            raise InputTypeError(
                f"{name} has dtype {t.dtype} but q has {q.dtype}: the cache and q must share one dtype."
            )
        if t.dim() != 4:
            layout = (
                "(num_blocks, page_block_size, nheads_k, headdim)"
                if paged
                else "(batch_cache, seqlen_cache, nheads_k, headdim)"
            )
            raise InputError(f"{name} must have 4 dimensions {layout}, got shape {tuple(t.shape)}.")
        if t.device != q.device:
            raise InputError(f"{name} must be on {q.device} like q, got {t.device}.")
        if t.stride(-1) != 1:
            raise InputError(
                f"{name} must have a contiguous last dimension (new keys/values are written into it in place), "
                f"got strides {t.stride()}."
            )
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise InputError(
            f"k_cache and v_cache must agree in their first three dimensions, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}."
        )
    nheads, nheads_k = q.shape[2], k_cache.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise InputError(
            f"nheads ({nheads}) must be divisible by nheads_k ({nheads_k}) for grouped-query attention: "
            "each group of nheads // nheads_k query heads shares one key/value head."
        )
    if k_cache.shape[3] != q.shape[3]:
        raise InputError(
            f"q and k_cache must share headdim (dim 3), got q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}."
        )
    check_head_dim("headdim", q.shape[3])
    check_head_dim("headdim_v", v_cache.shape[3])


def _check_layout(
    batch: int, k_cache: torch.Tensor, cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None
) -> int:
    """Check the paged or contiguous layout; return the cache length of one batch entry."""
    if block_table is None:
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            raise InputError(
                f"k_cache has {k_cache.shape[0]} batch entries for a batch of {batch}; pass cache_batch_idx to "
                "pick them."
            )
        return k_cache.shape[1]
    check_block_table(block_table, batch, k_cache.device)
    page = check_page_size(k_cache, "k_cache")
    if cache_batch_idx is not None:
        raise InputError(
            "cache_batch_idx cannot be used with a paged cache (block_table): index pages through block_table."
        )
    return block_table.shape[1] * page


def _check_rotary(
    q: torch.Tensor, k: torch.Tensor | None, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
    seqlen_cache: int,
) -> None:  # fmt: skip
    if (rotary_cos is None) != (rotary_sin is None):
        raise InputError("rotary_cos and rotary_sin must be given together, or neither.")
    if rotary_cos is None:
        return
    require(k is not None, "rotary_cos/rotary_sin rotate the new keys: pass k and v with them.")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dtype != q.dtype and t.dtype != torch.float32:
            raise InputTypeError(f"{name} must have q's dtype ({q.dtype}) or float32, got {t.dtype}.")
        if t.device != q.device:
            raise InputError(f"{name} must be on {q.device} like q, got {t.device}.")
    if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape:
        raise InputError(
            f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(rotary_cos.shape)} "
            f"and {tuple(rotary_sin.shape)}."
        )
    rotary_dim = 2 * rotary_cos.shape[1]
    if not 0 < rotary_dim <= q.shape[3]:
        raise InputError(
            f"rotary_dim (2 x rotary_cos.shape[1] = {rotary_dim}) must lie in [2, headdim = {q.shape[3]}]."
        )
    if rotary_cos.shape[0] < seqlen_cache:
        raise InputError(
            f"rotary_cos/rotary_sin must cover every cache position: seqlen_ro ({rotary_cos.shape[0]}) must be at "
            f"least the cache length ({seqlen_cache})."
        )


def _on_host(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The given int32 tensors on the CPU: as they are if they are there, else with one device-to-host copy."""
    given = {name: t for name, t in tensors.items() if t is not None}
    if not given or all(t.device.type == "cpu" for t in given.values()):
        return given
    return _copy_to_host(given)


def _copy_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One concatenation and one copy (the one synchronisation) for all of ``tensors``, then split."""
    flat = torch.cat([t.reshape(-1) for t in tensors.values()]).cpu()
    host, start = {}, 0
    for name, t in tensors.items():
        host[name] = flat[start : start + t.numel()].view(t.shape)
        start += t.numel()
    return host


def _check_cache_values(
    cache_seqlens: int | torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    batch: int,
    seqlen_new: int,
    seqlen_cache: int,
    num_slots: int,
    seqlen_q: int,
    seqlen_ro: int,
    rotary_per_token: bool,
) -> None:
    """Check index values against the cache; on CUDA one device-to-host copy of all of them.

    cache_seqlens + seqlen_new <= seqlen_cache; 0 <= cache_leftpad <= cache_seqlens; cache_batch_idx and
    every block_table entry that covers a key in [0, num_slots) (k_cache.shape[0]); with rotary tables of
    seqlen_ro > 0 rows, q's positions (cache_seqlens + seqlen_q - 1 if rotary_per_token, else
    cache_seqlens) below seqlen_ro. An int cache_seqlens has been checked already.
    """
    host = _on_host(
        {
            "cache_seqlens": cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
            "cache_leftpad": cache_leftpad,
            "cache_batch_idx": cache_batch_idx,
            "block_table": block_table,
        }
    )
    seqlens = None
    if isinstance(cache_seqlens, int):
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int64)
    elif cache_seqlens is not None:
        seqlens = host["cache_seqlens"].long()
        end = seqlens + seqlen_new
        if ((seqlens < 0) | (end > seqlen_cache)).any():
            raise InputError(
                f"cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache length) with seqlen_new = "
                f"{seqlen_new}, got cache_seqlens {seqlens.tolist()}. Allocate a longer cache."
            )
    if seqlen_ro and seqlens is not None and seqlen_q:
        last_q = seqlens + (seqlen_q - 1 if rotary_per_token else 0)
        if (last_q >= seqlen_ro).any():
            raise InputError(
                f"rotary_cos/rotary_sin have {seqlen_ro} rows (positions), but q is rotated at positions up to "
                f"{int(last_q.max())} (cache_seqlens {seqlens.tolist()}, seqlen_q = {seqlen_q}): pass tables that "
                "cover every query position."
            )
    leftpad = host.get("cache_leftpad")
    if leftpad is not None:
        lengths = torch.full_like(leftpad, seqlen_cache) if seqlens is None else seqlens
        if ((leftpad < 0) | (leftpad > lengths)).any():
            raise InputError(
                f"cache_leftpad must lie in [0, cache_seqlens], got {leftpad.tolist()} for cache_seqlens "
                f"{lengths.tolist()}."
            )
    batch_idx = host.get("cache_batch_idx")
    if batch_idx is not None and ((batch_idx < 0) | (batch_idx >= num_slots)).any():
        raise InputError(
            f"cache_batch_idx entries must lie in [0, {num_slots}) (k_cache.shape[0]), got {batch_idx.tolist()}."
        )
    table = host.get("block_table")
    if table is not None and table.numel():
        page = seqlen_cache // table.shape[1]
        blocks = torch.arange(table.shape[1])[None, :]
        used = blocks < (seqlen_cache if seqlens is None else (seqlens[:, None] + seqlen_new + page - 1) // page)
        if leftpad is not None:
            used &= blocks >= (leftpad.long() // page)[:, None]
        check_block_table_entries(table, used, num_slots, "k_cache")


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """``last_dim_contiguous`` for an optional tensor (the kernels index rows by a stride and columns densely)."""
    return None if t is None else last_dim_contiguous(t)


MAX_CHECKED = 256
"""Checked call layouts kept before ``_CHECKED`` starts over (a growing cache makes a new layout per decoding step)."""

_CHECKED: dict[tuple, tuple] = {}
"""What ``_check_call`` returned, by ``_call_key``: a later eager call of the same layouts and options skips the
checks of shapes, dtypes, devices and options (which depend on nothing else) and runs only the checks of index
values."""


def _tensor_keys(tensors: tuple) -> list | None:
    """Each tensor's shape, strides, dtype and device (None where absent; an int by its value), or None (no key) when
    one is a tensor subclass or of any other type."""
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is torch.Tensor:
            key.append((t.shape, t.stride(), t.dtype, t.device))
        elif type(t) is int:
            key.append(t)
        else:
            return None
    return key


def _call_key(tensors: tuple, scalars: tuple, window_size: object) -> tuple | None:
    """Everything ``_check_call`` reads of a call: each tensor's shape, strides, dtype and device (None where absent;
    an int cache_seqlens by type and value), each option by type and value, and window_size's items by type and
    value; None (no key: the call is checked) for a tensor subclass or any other argument type."""
    key = _tensor_keys(tensors)
    if key is None:
        return None
    for x in scalars:
        if type(x) not in (int, float, bool, type(None)):
            return None
        key.append((type(x), x))
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    for w in window_size:
        if type(w) is not int:
            return None
    return (*key, window_size)


def _check_call(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
) -> tuple[int, int, AttentionOptions]:  # fmt: skip
    """Check everything of a ``flash_attn_with_kvcache`` call but the index values: the tensors' types, shapes,
    dtypes, devices and layouts, an int cache_seqlens, and the options. Returns (seqlen_new, seqlen_cache, the
    call's options): the window as the kernels take it, the scale, softcap; alibi_slopes None (a tensor of each
    call, joined by the caller)."""
    _check_q(q)
    batch, _, _, head_dim = q.shape
    device = q.device
    _check_cache(q, k_cache, v_cache, block_table is not None)
    seqlen_cache = _check_layout(batch, k_cache, cache_batch_idx, block_table)
    _check_index("cache_batch_idx", cache_batch_idx, (batch,), device)
    _check_index("cache_leftpad", cache_leftpad, (batch,), device)

    if (k is None) != (v is None):
        raise InputError("k and v must be given together (new keys and their values), or neither.")
    seqlen_new = 0
    if k is not None:
        check_qkv(q, k, v)
        if k.shape[2:] != k_cache.shape[2:] or v.shape[2:] != v_cache.shape[2:]:
            raise InputError(
                f"k and v must be (batch_size, seqlen_new, nheads_k, headdim[_v]) matching the cache's last two "
                f"dims {tuple(k_cache.shape[2:])} and {tuple(v_cache.shape[2:])}, got {tuple(k.shape)} and "
                f"{tuple(v.shape)}."
            )
        if cache_seqlens is None:
            raise InputError("cache_seqlens must be given with k and v: it says where they go.")
        seqlen_new = k.shape[1]
        if seqlen_new > seqlen_cache:
            raise InputError(
                f"k and v hold {seqlen_new} new tokens but the cache has room for {seqlen_cache}. Allocate a "
                "longer cache."
            )
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= seqlen_cache - seqlen_new:
            raise InputError(
                f"cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache length), got "
                f"cache_seqlens={cache_seqlens} and seqlen_new={seqlen_new}. Allocate a longer cache."
            )
    else:
        _check_index("cache_seqlens", cache_seqlens, (batch,), device)
    _check_rotary(q, k, rotary_cos, rotary_sin, seqlen_cache)
    softcap = check_options(q, softcap, alibi_slopes, None)[0]
    if not isinstance(num_splits, int) or num_splits < 0:
        raise InputError(f"num_splits must be an int >= 0 (0 = choose automatically), got {num_splits!r}.")
    # A side past the cache (or past the new tokens, on the right) hides no key: unbounded (``bounded_window``).
    left, right = bounded_window(*window_bounds(window_size, causal), q.shape[1], seqlen_cache)
    check_softmax_scale(softmax_scale)
    options = AttentionOptions(
        softmax_scale=scale_or_default(softmax_scale, head_dim),
        window_left=left,
        window_right=right,
        softcap=float(softcap),
    )
    return seqlen_new, seqlen_cache, options


def _prepared(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
) -> tuple[AttentionOptions, CacheOptions]:  # fmt: skip
    """A ``flash_attn_with_kvcache`` call (its head dim a multiple of 8) checked (``_check_call``, kept per call
    layout in ``_CHECKED``; the index values where ``_backend.values_checked``) and turned into the options the
    decode paths take."""
    key = None if torch.compiler.is_compiling() else _call_key(
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
         alibi_slopes),
        (softmax_scale, causal, softcap, num_splits), window_size,
    )  # fmt: skip
    checked = _CHECKED.get(key) if key is not None else None
    if checked is None:
        checked = _check_call(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
        )  # fmt: skip
        if key is not None:
            if len(_CHECKED) >= MAX_CHECKED:
                _CHECKED.clear()
            _CHECKED[key] = checked
    seqlen_new, seqlen_cache, options = checked
    batch, seqlen_q = q.shape[:2]
    device = q.device
    rotary_per_token = options.window_left is not None or options.window_right is not None
    if _backend.values_checked(device):  # one device-to-host copy on CUDA (docs/validation.md)
        _check_cache_values(
            cache_seqlens, cache_leftpad, cache_batch_idx, block_table, batch, seqlen_new, seqlen_cache,
            k_cache.shape[0], seqlen_q, 0 if rotary_cos is None else rotary_cos.shape[0], rotary_per_token,
        )  # fmt: skip
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=INDEX_DTYPE, device=device)
    if alibi_slopes is not None:
        options = dataclasses.replace(options, alibi_slopes=_dense(alibi_slopes))
    # The kernels index these as dense rows: make them so (a no-op when they are; 1-D tensors are rows too).
    return options, CacheOptions(
        cache_seqlens=_dense(cache_seqlens),
        cache_batch_idx=_dense(cache_batch_idx),
        cache_leftpad=_dense(cache_leftpad),
        block_table=_dense(block_table),
        rotary_cos=_dense(rotary_cos),
        rotary_sin=_dense(rotary_sin),
        rotary_interleaved=rotary_interleaved,
        rotary_per_token=rotary_per_token,
        num_splits=num_splits,
    )


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of q against a KV cache, appending new keys/values to the cache in place first.

    For incremental decoding: k_cache and v_cache hold the keys and values of earlier steps (allocated
    once with the maximum length), cache_seqlens how many positions of each batch entry are filled. If k
    and v are given they are written *in place* into the cache at positions cache_seqlens[b],
    cache_seqlens[b] + 1, ..., and attention runs over the cache including them, in one call. Nothing
    else in the cache is written. No backward pass.

    Keys of batch entry b are the cache positions [cache_leftpad[b], cache_seqlens[b] + seqlen_new):
    seqlen_k = cache_seqlens[b] + seqlen_new - cache_leftpad[b] keys, numbered j = 0, 1, ... from
    cache_leftpad[b].

    Rotary embedding, if rotary_cos and rotary_sin are given (only with k and v): the new keys are rotated
    at their positions cache_seqlens[b] + t. If causal or local (window_size != (-1, -1)), query i is
    rotated at position cache_seqlens[b] + i; otherwise every query at cache_seqlens[b] (all of q is
    taken to be at the position of the first new token). rotary_interleaved=True rotates the pairs of
    dimensions (0, 1), (2, 3), ... (GPT-J); False the pairs (0, rotary_dim / 2), (1, rotary_dim / 2 + 1),
    ... (GPT-NeoX). Dimensions past rotary_dim are not rotated.

    Multi-query and grouped-query attention: nheads must be divisible by nheads_k; query head h uses
    key/value head h // (nheads // nheads_k). All query heads of a group read each key tile once.

    If causal=True, the mask is aligned to the bottom right corner: query i sees key j when
    j <= i + seqlen_k - seqlen_q, i.e. the new tokens see the cache and the new tokens before them.
    With seqlen_q = 2 and seqlen_k = 5 (1 = visible):
        1 1 1 1 0
        1 1 1 1 1
    With seqlen_q = 5 and seqlen_k = 2:
        0 0
        0 0
        0 0
        1 0
        1 1
    A query row that sees no key returns 0, with softmax_lse -inf.

    If window_size != (-1, -1), sliding-window attention: query i sees keys j with
        i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1].
    A negative side, or one >= the cache length, is unbounded; causal=True sets window_size[1] = 0.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim), float16, bfloat16 or float32; headdim <= 256 (padding below)
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) without a block_table, or
            (num_blocks, page_block_size, nheads_k, headdim) with one (paged cache; page_block_size a
            multiple of 16); q's dtype and device, last dimension contiguous. Updated in place.
        v_cache: like k_cache, with headdim_v (a multiple of 8, <= 256) as the last dimension
        k: (batch_size, seqlen_new, nheads_k, headdim) new keys to append at cache_seqlens, or None
        v: (batch_size, seqlen_new, nheads_k, headdim_v) new values; given exactly when k is
        rotary_cos: (seqlen_ro, rotary_dim / 2), q's dtype or float32; rotary_dim <= headdim;
            seqlen_ro >= the cache length (seqlen_cache, or max_num_blocks_per_seq * page_block_size)
        rotary_sin: (seqlen_ro, rotary_dim / 2), like rotary_cos
        cache_seqlens: int, or (batch_size,) int32: the filled length of each batch entry's cache before
            the append. None: the whole cache (then k and v must be None).
            cache_seqlens + seqlen_new must not exceed the cache length.
        cache_batch_idx: (batch_size,) int32: the k_cache/v_cache entry of each batch entry (contiguous
            cache only); None for 0, 1, ..., batch_size - 1. With duplicate indices and k/v given, which
            batch entry's new keys end up in the cache, and which keys the other entries sharing those
            rows attend to, is unspecified (the same holds for pages that several block_table rows share
            where new keys are written).
        cache_leftpad: (batch_size,) int32: the first cache position of each batch entry; None for 0
        block_table: (batch_size, max_num_blocks_per_seq) int32: page b's j-th block of positions
            [j * page_block_size, (j + 1) * page_block_size) is k_cache[block_table[b, j]]
        softmax_scale: scaling of q @ k^T before the softmax; default 1 / sqrt(headdim)
        causal: bottom-right aligned causal mask (drawn above)
        window_size: (left, right) for sliding-window attention, -1 for an unbounded side
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (after softmax_scale)
        rotary_interleaved: the rotary layout (above); only used with rotary_cos and rotary_sin
        alibi_slopes: (nheads,) or (batch_size, nheads), float32: a bias of
            -alibi_slopes[h] * |i + seqlen_k - seqlen_q - j| is added to the score of query i, key j
            (after softcap)
        num_splits: split the keys into this many chunks processed in parallel and merged by their
            log-sum-exp (split-KV, "flash-decoding"); 1 never splits; 0 chooses from the problem size
            and the number of SMs. The result does not depend on it beyond rounding.
        return_softmax_lse: also return softmax_lse

    Raises:
        the errors of ``flashtile.flash_attn_func`` for q, the caches, k, v and the options (flashtile.InputError,
        InputTypeError, UnsupportedHeadDimError), and flashtile.InputError for cache_seqlens, cache_batch_idx,
        cache_leftpad or block_table out of the cache's range (their values are checked on CPU tensors, and on
        CUDA unless ``check_values(False)``), all before anything launches

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim_v), q's dtype
        softmax_lse (if return_softmax_lse): (batch_size, nheads, seqlen_q), float32, the natural-log sum
            of exp of each row of scores (after scale, softcap and ALiBi); -inf for a row that sees no key

    Validation. Shapes, dtypes and devices are always checked: in eager calls once per combination of
    the tensors' shapes, strides, dtypes and devices and the options, which later calls with the same
    combination reuse (a decoding loop's layers pay the checks once per step). The *values* of cache_seqlens,
    cache_leftpad, cache_batch_idx and block_table are checked against the cache too, which for CUDA
    tensors costs one device-to-host copy (a synchronisation) per call; it is skipped while torch.compile
    traces, during CUDA-graph capture, and when switched off (``flashtile.check_values(False)`` or
    ``FLASHTILE_CHECK_VALUES=0``). Unchecked bad values give wrong numbers (and may write the new k/v to a
    wrong place in the cache), never an illegal memory access: the kernels clamp them into the cache.
    CPU tensors are always checked. See docs/validation.md.

    A headdim that is not a multiple of 8 (q, caches, k and v sharing it, <= 256) is padded as flash_attn
    does: q, the caches and k, v are zero-padded to the next multiple of 8, and the padded caches' new rows
    copied back into k_cache and v_cache. That costs a copy of the whole cache per call: allocate caches
    with a headdim that is a multiple of 8 for speed.
    """
    padded = pad_head_dim(q, k_cache, v_cache, softmax_scale)
    if padded is not None and (k is None or all(_has_head_dim(t, padded[4]) for t in (k, v))):
        q_padded, k_cache_padded, v_cache_padded, scale, head_dim = padded
        k_padded, v_padded = (None, None) if k is None else pad_head_dim(k, v, v)[:2]
        out, lse = sliced(
            flash_attn_with_kvcache(
                q_padded, k_cache_padded, v_cache_padded, k_padded, v_padded, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, scale, causal, window_size, softcap, rotary_interleaved,
                alibi_slopes, num_splits, True,
            ),
            head_dim,
        )  # fmt: skip
        if k is not None:
            k_cache.copy_(k_cache_padded[..., :head_dim])
            v_cache.copy_(v_cache_padded[..., :head_dim])
        return (out, lse) if return_softmax_lse else out
    options, cache = _prepared(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
    )  # fmt: skip
    if k is not None:
        k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    out, lse = _ops.kvcache(last_dim_contiguous(q), k_cache, v_cache, k, v, options, cache)
    return (out, lse) if return_softmax_lse else out


_UNPREPARED = object()


class Decoder:
    """``flash_attn_with_kvcache(q, k_cache, v_cache, **arguments)`` without new tokens, for calls that share every
    argument but q, k_cache and v_cache: the layers of one decoding step, each reading its own cache with the step's
    cache lengths and options (``flashtile.integrations.transformers`` makes one per step).

    The first call of each layout (q's, k_cache's and v_cache's shapes, strides, dtypes, devices and 16-byte
    alignment) is checked as ``flash_attn_with_kvcache`` checks it, turned into the decode paths' options and, where
    the decode family prepares one, into a launch for that layout (``_ops.prepared_kvcache``: the plan, the scales and
    the index tensors taken once); later calls of that layout key three tensors and take the prepared launch in plain
    eager mode (``_ops.direct``), else the decode path (``_ops.kvcache``) with those options: per layer, no checks of
    the arguments the layers share and no plan lookup. The index tensors' values (cache_seqlens, cache_leftpad, ...)
    are checked on a layout's first call only, where ``flash_attn_with_kvcache`` would check them: they must not
    change while the decoder is in use, nor may the decode configs (a prepared launch keeps its plan).
    ``check_values``: False for index tensors valid by construction (no value checks, which on CUDA cost a host
    synchronisation), True to check them, None to follow ``flashtile.check_values`` at each call.
    A head dim that is not a multiple of 8, a tensor subclass and calls that torch.compile traces take
    ``flash_attn_with_kvcache`` itself. Same errors and results as ``flash_attn_with_kvcache``.
    """

    def __init__(
        self,
        cache_seqlens: int | torch.Tensor | None = None,
        cache_batch_idx: torch.Tensor | None = None,
        cache_leftpad: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = NO_WINDOW,
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        num_splits: int = 0,
        check_values: bool | None = None,
    ) -> None:
        self.arguments = dict(
            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
        )  # fmt: skip
        self._prepared: dict[tuple, tuple | None] = {}
        self._check_values = check_values

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """out (batch_size, seqlen_q, nheads, headdim_v) of ``flash_attn_with_kvcache(q, k_cache, v_cache,
        **self.arguments)``."""
        key = None if torch.compiler.is_compiling() else _tensor_keys((q, k_cache, v_cache))
        prepared = None
        if key is not None:
            key = (*key, (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16 == 0)
            prepared = self._prepared.get(key, _UNPREPARED)
            if prepared is _UNPREPARED:
                prepared = None if q.dim() == 0 or q.shape[-1] % 8 else self._prepare(q, k_cache, v_cache)
                if len(self._prepared) >= MAX_CHECKED:
                    self._prepared.clear()
                self._prepared[key] = prepared
        if prepared is None:
            with self._values_setting():
                return flash_attn_with_kvcache(q, k_cache, v_cache, **self.arguments)
        options, cache, launch = prepared
        q = last_dim_contiguous(q)
        if launch is not None and _ops.direct((q, k_cache, v_cache)):
            return launch(q, k_cache, v_cache)
        return _ops.kvcache(q, k_cache, v_cache, None, None, options, cache)[0]

    def _values_setting(self) -> contextlib.AbstractContextManager:
        """The decoder's ``check_values``, where it was given."""
        setting = self._check_values
        return contextlib.nullcontext() if setting is None else _backend.check_values(setting)

    def _prepare(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        """(options, cache, launch) for a layout's calls: the call checked and its options built as
        ``flash_attn_with_kvcache`` does it, and the decode family's launch prepared for the layout
        (``_ops.prepared_kvcache``; None where it prepares none)."""
        with self._values_setting():  # no new tokens: no k, v or rotary tables
            options, cache = _prepared(
                q, k_cache, v_cache, None, None, None, None, rotary_interleaved=True, **self.arguments
            )
        return options, cache, _ops.prepared_kvcache(last_dim_contiguous(q), k_cache, v_cache, options, cache)
