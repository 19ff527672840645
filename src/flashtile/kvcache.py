"""``flash_attn_with_kvcache``: attention for inference against a KV cache, with flash_attn 2.x's
signature and semantics (new keys/values appended in place, rotary, paged cache, split-KV decoding).

Inputs are checked here, before anything launches. Which implementation runs is decided by
``flashtile._backend.path_name``: the Triton kernels of ``flashtile.ops.decode`` (compiled on CUDA,
interpreted under ``TRITON_INTERPRET=1``) or ``flashtile.cpu_decode``. The work happens inside the
custom op ``flashtile::kvcache_forward``, declared as mutating k_cache and v_cache, so
``torch.compile(fullgraph=True)`` traces through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashtile import _backend
from flashtile._backend import path_name
from flashtile.interface import (
    NO_WINDOW,
    SUPPORTED_DTYPES,
    check_head_dim,
    check_options,
    check_qkv,
    last_dim_contiguous,
    require,
)

PAGE_MULTIPLE = 16
INDEX_DTYPE = torch.int32


@torch.library.custom_op("flashtile::kvcache_forward", mutates_args=("k_cache", "v_cache"))
def kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    rotary_interleaved: bool,
    rotary_per_token: bool,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs (see ``flash_attn_with_kvcache``) -> out (B, Sq, H, Dv), lse (B, H, Sq) fp32.

    Appends k, v into k_cache, v_cache in place. window_left/window_right: the visible band, None unbounded;
    rotary_per_token: q rotated at cache_seqlens[b] + i (else all at cache_seqlens[b]).
    """
    if path_name(q.device) == "cpu":
        from flashtile.cpu_decode import kvcache_forward as implementation
    else:
        from flashtile.ops.decode import kvcache_forward as implementation
    return implementation(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, alibi_slopes, softmax_scale, window_left, window_right, softcap, rotary_interleaved,
        rotary_per_token, num_splits,
    )  # fmt: skip


@kvcache_forward.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
      block_table, alibi_slopes, softmax_scale, window_left, window_right, softcap, rotary_interleaved,
      rotary_per_token, num_splits):  # fmt: skip
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v_cache.shape[3]))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


def _check_index(name: str, t: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> None:
    if t is None:
        return
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor or None, got {type(t).__name__}.", TypeError)
    require(
        t.dtype == INDEX_DTYPE,
        f"{name} must have dtype torch.int32, got {t.dtype}. Convert it with {name}.to(torch.int32).",
        TypeError,
    )
    require(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}.")
    require(t.device == device, f"{name} must be on {device} like q, got {t.device}.")


def _check_q(q: torch.Tensor) -> None:
    require(isinstance(q, torch.Tensor), f"q must be a torch.Tensor, got {type(q).__name__}.", TypeError)
    require(
        q.dtype in SUPPORTED_DTYPES,
        f"q has dtype {q.dtype}; flashtile supports torch.float16 and torch.bfloat16. Cast the inputs, "
        "e.g. q.to(torch.bfloat16), and the cache likewise.",
        TypeError,
    )
    require(q.dim() == 4, f"q must have 4 dimensions (batch_size, seqlen_q, nheads, headdim), got {tuple(q.shape)}.")


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool) -> None:
    layout = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if paged
        else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}.", TypeError)
        require(
            t.dtype == q.dtype,
            f"{name} has dtype {t.dtype} but q has {q.dtype}: the cache and q must share one dtype.",
            TypeError,
        )
        require(t.dim() == 4, f"{name} must have 4 dimensions {layout}, got shape {tuple(t.shape)}.")
        require(t.device == q.device, f"{name} must be on {q.device} like q, got {t.device}.")
        require(
            t.stride(-1) == 1,
            f"{name} must have a contiguous last dimension (new keys/values are written into it in place), "
            f"got strides {t.stride()}.",
        )
    require(
        k_cache.shape[:3] == v_cache.shape[:3],
        f"k_cache and v_cache must agree in their first three dimensions, got {tuple(k_cache.shape)} "
        f"and {tuple(v_cache.shape)}.",
    )
    nheads, nheads_k = q.shape[2], k_cache.shape[2]
    require(
        nheads_k > 0 and nheads % nheads_k == 0,
        f"nheads ({nheads}) must be divisible by nheads_k ({nheads_k}) for grouped-query attention: "
        "each group of nheads // nheads_k query heads shares one key/value head.",
    )
    require(
        k_cache.shape[3] == q.shape[3],
        f"q and k_cache must share headdim (dim 3), got q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}.",
    )
    check_head_dim("headdim", q.shape[3])
    check_head_dim("headdim_v", v_cache.shape[3])


def _check_layout(
    batch: int, k_cache: torch.Tensor, cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None
) -> int:
    """Check the paged or contiguous layout; return the cache length of one batch entry."""
    if block_table is None:
        require(
            cache_batch_idx is not None or k_cache.shape[0] >= batch,
            f"k_cache has {k_cache.shape[0]} batch entries for a batch of {batch}; pass cache_batch_idx to pick them.",
        )
        return k_cache.shape[1]
    require(
        isinstance(block_table, torch.Tensor) and block_table.dim() == 2,
        f"block_table must be (batch_size, max_num_blocks_per_seq), got {_shape_of(block_table)}.",
    )
    _check_index("block_table", block_table, (batch, block_table.shape[1]), k_cache.device)
    page = k_cache.shape[1]
    require(
        page > 0 and page % PAGE_MULTIPLE == 0,
        f"page_block_size (k_cache.shape[1]) must be a multiple of {PAGE_MULTIPLE}, got {page}.",
    )
    require(
        cache_batch_idx is None,
        "cache_batch_idx cannot be used with a paged cache (block_table): index pages through block_table.",
    )
    return block_table.shape[1] * page


def _check_rotary(
    q: torch.Tensor, k: torch.Tensor | None, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
    seqlen_cache: int,
) -> None:  # fmt: skip
    require(
        (rotary_cos is None) == (rotary_sin is None), "rotary_cos and rotary_sin must be given together, or neither."
    )
    if rotary_cos is None:
        return
    require(k is not None, "rotary_cos/rotary_sin rotate the new keys: pass k and v with them.")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}.", TypeError)
        require(
            t.dtype in (q.dtype, torch.float32),
            f"{name} must have q's dtype ({q.dtype}) or float32, got {t.dtype}.",
            TypeError,
        )
        require(t.device == q.device, f"{name} must be on {q.device} like q, got {t.device}.")
    require(
        rotary_cos.dim() == 2 and rotary_cos.shape == rotary_sin.shape,
        f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(rotary_cos.shape)} "
        f"and {tuple(rotary_sin.shape)}.",
    )
    rotary_dim = 2 * rotary_cos.shape[1]
    require(
        0 < rotary_dim <= q.shape[3],
        f"rotary_dim (2 x rotary_cos.shape[1] = {rotary_dim}) must lie in [2, headdim = {q.shape[3]}].",
    )
    require(
        rotary_cos.shape[0] >= seqlen_cache,
        f"rotary_cos/rotary_sin must cover every cache position: seqlen_ro ({rotary_cos.shape[0]}) must be at "
        f"least the cache length ({seqlen_cache}).",
    )


def _window(window_size: tuple[int, int], causal: bool, seqlen_cache: int) -> tuple[int | None, int | None]:
    """flash_attn's (window_size, causal) as (left, right), None unbounded; a side >= seqlen_cache is unbounded."""
    require(
        len(window_size) == 2 and all(isinstance(w, int) for w in window_size),
        f"window_size must be a pair of ints (left, right), got {window_size!r}.",
        TypeError,
    )
    left, right = (None if w < 0 or w >= seqlen_cache else w for w in window_size)
    return left, 0 if causal else right


def _check_cache_values(
    cache_seqlens: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    seqlen_new: int,
    seqlen_cache: int,
    num_slots: int,
    seqlen_q: int,
    seqlen_ro: int,
    rotary_per_token: bool,
) -> None:
    """Check index values against the cache, with one device-to-host copy when all are valid.

    cache_seqlens + seqlen_new <= seqlen_cache; 0 <= cache_leftpad <= cache_seqlens; cache_batch_idx and
    every block_table entry that covers a key in [0, num_slots) (k_cache.shape[0]); with rotary tables of
    seqlen_ro > 0 rows, q's positions (cache_seqlens + seqlen_q - 1 if rotary_per_token, else
    cache_seqlens) below seqlen_ro.
    """
    checks: list[tuple[torch.Tensor, Callable[[], str]]] = []
    if cache_seqlens is not None:
        end = cache_seqlens.long() + seqlen_new
        checks.append((
            ((cache_seqlens < 0) | (end > seqlen_cache)).any(),
            lambda: f"cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache length) with "
            f"seqlen_new = {seqlen_new}, got cache_seqlens {cache_seqlens.tolist()}. Allocate a longer cache.",
        ))  # fmt: skip
    if seqlen_ro and cache_seqlens is not None and seqlen_q:
        last_q = cache_seqlens.long() + (seqlen_q - 1 if rotary_per_token else 0)
        checks.append((
            (last_q >= seqlen_ro).any(),
            lambda: f"rotary_cos/rotary_sin have {seqlen_ro} rows (positions), but q is rotated at positions up to "
            f"{int(last_q.max())} (cache_seqlens {cache_seqlens.tolist()}, seqlen_q = {seqlen_q}): pass tables "
            "that cover every query position.",
        ))  # fmt: skip
    if cache_leftpad is not None:
        lengths = torch.full_like(cache_leftpad, seqlen_cache) if cache_seqlens is None else cache_seqlens
        checks.append((
            ((cache_leftpad < 0) | (cache_leftpad > lengths)).any(),
            lambda: f"cache_leftpad must lie in [0, cache_seqlens], got {cache_leftpad.tolist()} "
            f"for cache_seqlens {lengths.tolist()}.",
        ))  # fmt: skip
    if cache_batch_idx is not None:
        checks.append((
            ((cache_batch_idx < 0) | (cache_batch_idx >= num_slots)).any(),
            lambda: f"cache_batch_idx entries must lie in [0, {num_slots}) (k_cache.shape[0]), "
            f"got {cache_batch_idx.tolist()}.",
        ))  # fmt: skip
    if block_table is not None:
        page = seqlen_cache // block_table.shape[1]
        blocks = torch.arange(block_table.shape[1], device=block_table.device)[None, :]
        used = blocks < (seqlen_cache if cache_seqlens is None else (end[:, None] + page - 1) // page)
        if cache_leftpad is not None:
            used &= blocks >= (cache_leftpad.long() // page)[:, None]
        outside = used & ((block_table < 0) | (block_table >= num_slots))
        checks.append((
            outside.any(),
            lambda: f"block_table entries that cover a key must lie in [0, {num_slots}) (k_cache.shape[0], the "
            f"number of blocks); got {block_table[outside].tolist()} at {outside.nonzero().tolist()}.",
        ))  # fmt: skip
    if checks:
        failed = torch.stack([bad for bad, _ in checks]).tolist()
        for bad, (_, message) in zip(failed, checks, strict=True):
            require(not bad, message())


def _shape_of(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


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
        q: (batch_size, seqlen_q, nheads, headdim), float16 or bfloat16; headdim a multiple of 8, <= 256
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
            batch entry's new keys end up in the cache is unspecified.
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

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim_v), q's dtype
        softmax_lse (if return_softmax_lse): (batch_size, nheads, seqlen_q), float32, the natural-log sum
            of exp of each row of scores (after scale, softcap and ALiBi); -inf for a row that sees no key

    Validation. Shapes, dtypes and devices are always checked. The *values* of cache_seqlens,
    cache_leftpad, cache_batch_idx and block_table are checked against the cache too, which for CUDA
    tensors costs one device-to-host copy (a synchronisation) per call; it is skipped while torch.compile
    traces, during CUDA-graph capture, and when switched off (``flashtile._backend.check_values(False)`` or
    ``FLASHTILE_CHECK_VALUES=0``). Unchecked bad values give wrong numbers (and may write the new k/v to a
    wrong place in the cache), never an illegal memory access: the kernels clamp them into the cache.
    CPU tensors are always checked. See docs/validation.md.
    """
    _check_q(q)
    batch, _, nheads, head_dim = q.shape
    _check_cache(q, k_cache, v_cache, block_table is not None)
    seqlen_cache = _check_layout(batch, k_cache, cache_batch_idx, block_table)
    _check_index("cache_batch_idx", cache_batch_idx, (batch,), q.device)
    _check_index("cache_leftpad", cache_leftpad, (batch,), q.device)

    require((k is None) == (v is None), "k and v must be given together (new keys and their values), or neither.")
    seqlen_new = 0
    if k is not None:
        check_qkv(q, k, v)
        require(
            k.shape[2:] == k_cache.shape[2:] and v.shape[2:] == v_cache.shape[2:],
            f"k and v must be (batch_size, seqlen_new, nheads_k, headdim[_v]) matching the cache's last two dims "
            f"{tuple(k_cache.shape[2:])} and {tuple(v_cache.shape[2:])}, got {tuple(k.shape)} and {tuple(v.shape)}.",
        )
        require(cache_seqlens is not None, "cache_seqlens must be given with k and v: it says where they go.")
        seqlen_new = k.shape[1]
        require(
            seqlen_new <= seqlen_cache,
            f"k and v hold {seqlen_new} new tokens but the cache has room for {seqlen_cache}. Allocate a longer cache.",
        )
        k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    if isinstance(cache_seqlens, int):
        require(
            0 <= cache_seqlens <= seqlen_cache - seqlen_new,
            f"cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache length), got "
            f"cache_seqlens={cache_seqlens} and seqlen_new={seqlen_new}. Allocate a longer cache.",
        )
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=INDEX_DTYPE, device=q.device)
    _check_index("cache_seqlens", cache_seqlens, (batch,), q.device)
    _check_rotary(q, k, rotary_cos, rotary_sin, seqlen_cache)
    softcap, alibi_slopes, _ = check_options(q, softcap, alibi_slopes, None)
    require(
        isinstance(num_splits, int) and num_splits >= 0,
        f"num_splits must be an int >= 0 (0 = choose automatically), got {num_splits!r}.",
    )
    left, right = _window(window_size, causal, seqlen_cache)
    if _backend.values_checked(q.device):  # one device-to-host copy on CUDA (docs/validation.md)
        _check_cache_values(
            cache_seqlens, cache_leftpad, cache_batch_idx, block_table, seqlen_new, seqlen_cache, k_cache.shape[0],
            q.shape[1], 0 if rotary_cos is None else rotary_cos.shape[0], left is not None or right is not None,
        )  # fmt: skip

    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    # The kernels index these small tensors as dense rows: make them so (a no-op when they are).
    rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes = (
        None if t is None else t.contiguous()
        for t in (rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes)
    )
    out, lse = kvcache_forward(
        last_dim_contiguous(q), k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, alibi_slopes, float(softmax_scale), left, right, float(softcap),
        rotary_interleaved, left is not None or right is not None, num_splits,
    )  # fmt: skip
    return (out, lse) if return_softmax_lse else out
