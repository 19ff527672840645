"""flash_attn 2.x's functions, with its names, argument order, layouts and return values.

Switching from flash_attn is one import: ``from flashtile import flash_attn_func``.
Inputs are checked here, before anything launches; errors say what was expected, what came, and
how to fix it.
"""

from __future__ import annotations

import torch

from flashtile import _backend, _ops, float8, paged
from flashtile.checks import (
    INT32_MAX,
    MAX_HEAD_DIM,
    NO_WINDOW,
    at_most,
    bounded_window,
    check_block_table,
    check_cu_seqlens,
    check_cu_seqlens_values,
    check_max_seqlen,
    check_options,
    check_pages,
    check_qkv,
    check_softmax_scale,
    last_dim_contiguous,
    shape_of,
    window_bounds,
    window_size_of,
)
from flashtile.dense import attention_probs
from flashtile.errors import InputError
from flashtile.options import AttentionOptions, Packing, scale_or_default


def pad_head_dim(
    q: object, k: object, v: object, softmax_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int] | None:
    """flash_attn's handling of a head dimension that is not a multiple of 8: when q, k and v share it
    (flash_attn's layout) and it is at most MAX_HEAD_DIM, zero-pad the last dimension of all three up to
    the next multiple of 8. Zero columns add nothing to q . k and give zero output columns, so the output
    sliced back to the original width, softmax_lse and the gradients (through the pad) are exact.

    Returns None when nothing is padded (also for inputs check_qkv will refuse), else (q, k, v padded,
    softmax_scale with its default 1 / sqrt of the original headdim, the original headdim); slice the
    output back with ``sliced``.
    """
    # Every call runs this: the common case (a tensor q whose headdim is a multiple of 8) returns first.
    if not isinstance(q, torch.Tensor) or not q.dim() or q.shape[-1] % 8 == 0:
        return None
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM or not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    if not (k.dim() and v.dim()):
        return None
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return None
    pad = (0, 8 - head_dim % 8)
    return (*(torch.nn.functional.pad(t, pad) for t in (q, k, v)), scale_or_default(softmax_scale, head_dim), head_dim)


def sliced(result: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call on inputs ``pad_head_dim`` padded -> (out[..., :head_dim], lse)."""
    return result[0][..., :head_dim], result[1]


def dropout_rng_state(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    """Validate dropout_p and draw the dropout's randomness: None if dropout_p == 0, else an int64 (2,)
    tensor [seed, philox offset] on ``device``, from torch's default generator of that device (the CPU
    generator for CPU tensors, ``torch.cuda.default_generators`` for CUDA ones), each in [0, 2**62).

    So ``torch.manual_seed`` fixes the masks, and consecutive calls draw new ones. A tensor, not ints:
    on CUDA the draw is one tiny kernel and the attention kernels read it from device memory (no host
    synchronisation), and under torch.compile it is a graph op instead of a guard on Python ints
    (with inductor the draw follows inductor's own RNG, so compiled masks differ from eager ones).
    """
    if dropout_p == 0.0:
        return None
    if not (isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and 0.0 <= dropout_p < 1.0):
        raise InputError(
            f"dropout_p must be a number in [0, 1) (the probability of dropping an attention probability), "
            f"got {dropout_p!r}."
        )
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def prepared(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    descales: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionOptions, int | None]:
    """A call as the custom op takes it: (q, k, v checked, with a contiguous last dimension, the call's options
    decided once (``attention_options``, which takes ``options`` by name), and the head dim to slice the output
    back to, or None). ``descales``: (q_descale, k_descale, v_descale) of float8 inputs (``flashtile.float8``). A
    head dimension that is not a multiple of 8 is padded as flash_attn does (``pad_head_dim``, which also decides
    the default softmax_scale of the original head dim)."""
    is_float8 = float8.check_float8(q, k, v, descales)
    padded = pad_head_dim(q, k, v, softmax_scale)
    head_dim = None
    if padded is not None:
        q, k, v, softmax_scale, head_dim = padded
    check_qkv(q, k, v, is_float8)
    check_softmax_scale(softmax_scale)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    options = attention_options(
        q, q.shape[1], k.shape[1], softmax_scale=softmax_scale,
        descale=float8.descale_of(q, k, descales) if is_float8 else None, **options,
    )  # fmt: skip
    if is_float8:
        float8.check_options(options)
    return q, k, v, options, head_dim


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated entry to the custom op (``_ops.attention``), the options by name as ``prepared`` takes them: returns
    (out, lse) in flash_attn's layouts."""
    q, k, v, options, head_dim = prepared(q, k, v, **options)
    result = _ops.attention(q, k, v, options)
    return result if head_dim is None else sliced(result, head_dim)


def attention_options(
    q: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    deterministic: bool = True,
    batch: int | None = None,
    descale: torch.Tensor | None = None,
) -> AttentionOptions:
    """The options of a call on q (checked), validated and decided once: the window bounded by the lengths
    (``bounded_window``; packed batches pass their token counts), the default scale (``scale_or_default``), the
    score modifications and sink checked (``check_options``; ``batch``: a packed q's number of sequences), and the
    dropout's rng_state drawn when None (``dropout_rng_state``).

    attn_mask: SDPA's mask, validated by ``flashtile.sdpa`` (4-D, each dimension 1 or full).
    deterministic: False lets the backward add dQ with atomics (on sm_90, ``ops.sm90.backward``).
    rng_state: the dropout's randomness (``dropout_rng_state``), drawn when None and dropout_p > 0.
    descale: float8 inputs' factors, checked (``float8.descale_of``)."""
    window_left, window_right = bounded_window(window_left, window_right, seqlen_q, seqlen_k)
    if rng_state is None:
        rng_state = dropout_rng_state(dropout_p, q.device)
    if softcap != 0.0 or alibi_slopes is not None or learnable_sink is not None or batch is not None:
        softcap, alibi_slopes, learnable_sink = check_options(q, softcap, alibi_slopes, learnable_sink, batch)
    return AttentionOptions(
        softmax_scale=scale_or_default(softmax_scale, q.shape[-1]), window_left=window_left,
        window_right=window_right, alibi_slopes=alibi_slopes, softcap=float(softcap), learnable_sink=learnable_sink,
        dropout_p=float(dropout_p), rng_state=rng_state, attn_mask=attn_mask, deterministic=deterministic,
        descale=descale,
    )  # fmt: skip


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Exact attention, softmax(q @ k^T * softmax_scale) @ v, without materialising the score matrix.

    Multi-query and grouped-query attention: k and v may have fewer heads than q; nheads must be
    divisible by nheads_k, and query head h uses key/value head h // (nheads // nheads_k).

    If causal=True, the causal mask is aligned to the bottom right corner of the attention matrix:
    query i sees key j when j <= i + seqlen_k - seqlen_q. With seqlen_q = 2 and seqlen_k = 5
    (1 = visible):
        1 1 1 1 0
        1 1 1 1 1
    With seqlen_q = 5 and seqlen_k = 2:
        0 0
        0 0
        0 0
        1 0
        1 1
    A query row that sees no key (the first three above) returns 0, with softmax_lse -inf.

    If window_size != (-1, -1), sliding-window (local) attention: query i sees keys j with
        i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1].
    A negative side (-1) is unbounded; causal=True sets window_size[1] = 0.

    The score of query i and key j in head h (of batch entry b), in flash_attn 2.x's order:
        s_ij = softmax_scale * q_i . k_j
        s_ij = softcap * tanh(s_ij / softcap)                             if softcap > 0
        s_ij = s_ij - alibi_slopes[(b,) h] * |i + seqlen_k - seqlen_q - j|  if alibi_slopes is given
    and with learnable_sink the softmax of row i gets one more logit, sink_h, that has no value:
        out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))
    so softmax_lse includes it, and a row that sees no key returns 0 with softmax_lse = sink_h.
    softcap, alibi_slopes and learnable_sink combine with each other, with causal and window_size,
    with MQA/GQA, fp16/bf16/fp32, seqlen_q != seqlen_k and headdim_v != headdim, and with dropout.

    Dropout (dropout_p > 0), as flash_attn: on the attention probabilities after the softmax,
        out_i = sum_j P_ij Z_ij / (1 - dropout_p) v_j,   Z_ij = 1 with probability 1 - dropout_p, else 0,
    with softmax_lse unchanged (that of the scores above). It applies whenever dropout_p > 0 (pass 0.0
    in evaluation). The mask comes from a counter-based RNG (Philox, ``tl.rand``, in the Triton kernels;
    an integer hash in the CPU path) keyed by a seed and offset drawn from torch's default generator for
    q's device at each call: the same ``torch.manual_seed`` gives the same result, consecutive calls
    different masks, and the backward regenerates the mask instead of storing it. The CPU path's masks
    are not bit for bit those of the Triton kernels.

    With causal=True, flash_attn's own kernel adds slope * j instead of the bias above:
    the same output, but its softmax_lse is larger by slope * (i + seqlen_k - seqlen_q); flashtile's
    softmax_lse is that of the scores written above, causal or not.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim), float16, bfloat16 or float32
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim_v); headdim and headdim_v at most 256 and multiples of 8,
            except that a headdim == headdim_v that is not a multiple of 8 is zero-padded up to one and the
            output sliced back, as flash_attn does (``pad_head_dim``; out is then a non-contiguous view)
        dropout_p: dropout probability in [0, 1) on the attention probabilities (above); 0.0 is off
        softmax_scale: scaling of q @ k^T before the softmax; default 1 / sqrt(headdim)
        causal: bottom-right aligned causal mask (drawn above)
        window_size: (left, right) for sliding-window attention, -1 for an unbounded side
        softcap: > 0 caps the scaled scores at softcap * tanh(score / softcap) (Gemma 2 uses 50);
            0.0 turns it off; the gradient flows through the tanh
        alibi_slopes: (nheads,) or (batch_size, nheads), float32, on q's device: the ALiBi bias above,
            for causal and non-causal attention alike; it gets no gradient (as in flash_attn)
        deterministic: False (flash_attn's default) lets the backward add dQ with atomics where that is
            faster (on sm_90: head dim 64/128/256, lengths multiples of 128, no dropout or attn_mask, ALiBi
            without a window, softcap at head dims 128/256; MHA, GQA or MQA, causal with at most 8 query heads per
            K/V head), so its bits may vary from run to run; True always gives bitwise repeatable gradients
        return_attn_probs: also return softmax_lse and, with dropout, flash_attn's S_dmask (for tests: the
            probabilities with the dropout pattern, ``dropout_probabilities``, O(seqlen_q * seqlen_k) memory);
            without dropout the third element is None, as in flash_attn
        learnable_sink: keyword only, (nheads,) float32 on q's device, one logit per query head that
            joins the softmax denominator (as in gpt-oss and FlashAttention-4); differentiable
        q_descale, k_descale, v_descale: keyword only, for q, k, v in torch.float8_e4m3fn (FlashAttention-3's
            float8 forward): (batch_size, nheads_k) float32 on q's device, or None for 1.0; the attention is then
            softmax(softmax_scale * (q * q_descale) @ (k * k_descale)^T) @ (v * v_descale), query head h taking
            the factors of its KV head, and out is bfloat16. Forward only (no gradient), with causal, window_size
            and MQA/GQA; not with dropout, softcap, alibi_slopes or learnable_sink (``flashtile.float8``)

    Raises:
        flashtile.InputTypeError (a TypeError): an input of the wrong type or dtype (q, k or v not float16,
            bfloat16, float32 or all three float8_e4m3fn: its subclass UnsupportedDtypeError; alibi_slopes,
            learnable_sink or a descale factor not float32)
        flashtile.UnsupportedHeadDimError: a head dimension the kernels do not take (above 256, or headdim !=
            headdim_v and either not a multiple of 8)
        flashtile.InputError (a ValueError and a RuntimeError, as flash_attn raises): shapes, devices or options
            that do not fit together (batch or heads of q, k, v, nheads not a multiple of nheads_k, window_size,
            dropout_p outside [0, 1), softmax_scale NaN or infinite, ...), each message saying what to change.
            All are raised before anything launches.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim_v), in q's dtype (bfloat16 for float8 inputs)
        if return_attn_probs: (out, softmax_lse, S_dmask) with softmax_lse (batch_size, nheads, seqlen_q),
            float32, the natural-log sum of exp of each row's scores (and of the sink), and S_dmask (batch_size,
            nheads, seqlen_q, seqlen_k) in q's dtype with dropout (negative where dropped), else None
    """
    left, right = window_bounds(window_size, causal)
    rng_state = dropout_rng_state(dropout_p, q.device) if return_attn_probs and isinstance(q, torch.Tensor) else None
    out, lse = attention(
        q, k, v, softmax_scale=softmax_scale, window_left=left, window_right=right, softcap=softcap,
        alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, dropout_p=dropout_p, deterministic=deterministic,
        rng_state=rng_state, descales=(q_descale, k_descale, v_descale),
    )  # fmt: skip
    if not return_attn_probs:
        return out
    if rng_state is None:
        return out, lse, None
    options = dict(softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    return out, lse, dropout_probabilities(q, k, softmax_scale, left, right, dropout_p, rng_state, **options)


def dropout_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    softmax_scale: float | None,
    window_left: int | None,
    window_right: int | None,
    dropout_p: float,
    rng_state: torch.Tensor,
    **options,
) -> torch.Tensor:
    """flash_attn's S_dmask for a forward with dropout: (batch, nheads, seqlen_q, seqlen_k) in q's dtype, the
    attention probabilities P, negated where the dropout dropped them (flash_attn's encoding: negative means
    dropped; a key that is hidden from a row has P = 0). For tests: it takes O(seqlen_q * seqlen_k) memory.

    P comes from ``dense.attention_probs`` in float32 (``options``: softcap, alibi_slopes, learnable_sink);
    the keep mask is the forward's own, read back by ``_dropout_keep_mask``."""
    batch, seqlen_q, nheads, _ = q.shape
    window = window_size_of(window_left, window_right)
    with torch.no_grad():
        zero_q, zero_k = q.new_zeros(batch, seqlen_q, nheads, 8), k.new_zeros(*k.shape[:3], 8)

        def forward(v: torch.Tensor) -> torch.Tensor:
            return attention(
                zero_q, zero_k, v, softmax_scale=1.0, window_left=window_left, window_right=window_right,
                dropout_p=dropout_p, rng_state=rng_state,
            )[0]  # fmt: skip

        kept = _dropout_keep_mask(forward, (batch,), k.shape[1], k.shape[2], q)
        probs, _ = attention_probs(q.float(), k.float(), softmax_scale, window_size=window, **options)
    return torch.where(kept, probs, -probs).to(q.dtype)


def _dropout_keep_mask(forward, leading: tuple[int, ...], seqlen_k: int, nheads_k: int, like: torch.Tensor):
    """The keep mask (*leading, nheads, seqlen_q, seqlen_k) bool of a forward with dropout, read back through
    ``forward(v)``: that forward again (same rng_state, same visibility) with q = k = 0, so that each visible key
    has probability 1 / (visible keys), never 0, on one-hot values v (*leading, seqlen_k, nheads_k, width),
    v[..., start + j, :, j] = 1 for up to MAX_HEAD_DIM keys at a time; it returns out (*leading, seqlen_q,
    nheads, width), and out[..., i, h, j] > 0 exactly where key start + j is kept for row i of head h. The
    kernels draw the mask from rng_state and the position alone (not the values or the head dims), so it is
    the mask of the call being reproduced. ``like``: a tensor of the values' dtype and device."""
    kept = []
    for start in range(0, seqlen_k, MAX_HEAD_DIM):
        width = min(MAX_HEAD_DIM, seqlen_k - start)
        one_hot = like.new_zeros(*leading, seqlen_k, nheads_k, -(-width // 8) * 8)
        one_hot[..., start + torch.arange(width), :, torch.arange(width)] = 1.0
        kept.append((forward(one_hot)[..., :width] > 0).movedim(-2, -3))
    return torch.cat(kept, dim=-1)


def unpacked(packed: object, name: str, layout: tuple[str | int, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors stacked in ``packed`` (flash_attn's qkv and kv layouts), as views, so that gradients flow back into
    it without a copy. ``layout`` names its dimensions and gives, at the stacked one, the number of tensors:
    ("total", 3, "nheads", "headdim"). Raises flashtile.InputError for a ``packed`` of another shape."""
    dim = next(i for i, size in enumerate(layout) if isinstance(size, int))
    if not (isinstance(packed, torch.Tensor) and packed.dim() == len(layout) and packed.shape[dim] == layout[dim]):
        raise InputError(f"{name} must be ({', '.join(map(str, layout))}), got {shape_of(packed)}.")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """``flash_attn_func`` on a packed qkv tensor; gradients flow back into ``qkv``.

    Args:
        qkv: (batch_size, seqlen, 3, nheads, headdim)
        the rest: as ``flash_attn_func``

    Raises:
        the errors of ``flash_attn_func`` (flashtile.InputError, InputTypeError, UnsupportedHeadDimError), for the
        packed tensor's shape too, before anything launches

    Returns:
        out: (batch_size, seqlen, nheads, headdim), or (out, softmax_lse, S_dmask) if
            return_attn_probs (as flash_attn_func)
    """
    q, k, v = unpacked(qkv, "qkv", ("batch_size", "seqlen", 3, "nheads", "headdim"))
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, learnable_sink=learnable_sink,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """``flash_attn_func`` with keys and values packed in one tensor; gradients flow back into ``kv``.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim)
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim)
        the rest: as ``flash_attn_func``

    Raises:
        the errors of ``flash_attn_func`` (flashtile.InputError, InputTypeError, UnsupportedHeadDimError), for the
        packed tensor's shape too, before anything launches

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse, S_dmask) if
            return_attn_probs (as flash_attn_func)
    """
    k, v = unpacked(kv, "kv", ("batch_size", "seqlen_k", 2, "nheads_k", "headdim"))
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, learnable_sink=learnable_sink,
    )  # fmt: skip


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None, **options,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Validated entry to the varlen custom op (``_ops.varlen_attention``), the options by name as
    ``attention_options`` takes them: returns (out (total_q, H, Dv), lse (H, total_q)).

    With a block_table, k and v are pages (num_blocks, page_block_size, nheads_k, headdim[_v]).
    A head dimension that is not a multiple of 8 is padded as flash_attn does (``pad_head_dim``)."""
    padded = pad_head_dim(q, k, v, softmax_scale)
    head_dim = None
    if padded is not None:
        q, k, v, softmax_scale, head_dim = padded
    paged = block_table is not None
    for name, t in (("q", q),) if paged else (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise InputError(
                f"{name} must have 3 dimensions (total_tokens, nheads, headdim) for flash_attn_varlen_func, got "
                f"shape {tuple(t.shape)}. Pack a padded batch with flashtile.unpad_input, or use flash_attn_func."
            )
    keys, values = k, v
    if paged:
        check_pages(k, v)
        keys, values = k[:, 0], v[:, 0]  # row 0 of each page, for check_qkv's dtypes, devices, heads, head dims
    elif isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        if k.shape[:2] != v.shape[:2]:
            raise InputError(
                f"k and v must share total_k (dim 0) and nheads_k (dim 1), got k {tuple(k.shape)} and "
                f"v {tuple(v.shape)}."
            )
    check_qkv(*(t[None] if isinstance(t, torch.Tensor) else t for t in (q, keys, values)))
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise InputError(
            f"cu_seqlens_q and cu_seqlens_k must hold the same batch_size + 1 entries, got {cu_seqlens_q.shape[0]} "
            f"and {cu_seqlens_k.shape[0]}."
        )
    batch = cu_seqlens_q.shape[0] - 1
    total_k = k.shape[0]
    if paged:
        check_block_table(block_table, batch, q.device)
        total_k = None  # pages: no packed key count, but each sequence fits in its block-table row
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if _backend.values_checked(q.device):  # values need the host: one sync on CUDA (docs/validation.md)
        check_cu_seqlens_values(
            cu_seqlens_q, cu_seqlens_k, q.shape[0], total_k, max_seqlen_q, max_seqlen_k, block_table, k
        )
    else:  # unchecked (switched off, CUDA-graph capture, torch.compile): keep every sequence inside the tensors
        cu_seqlens_q = torch.cummax(cu_seqlens_q.clamp(0, q.shape[0]), 0).values
        if paged:  # and inside its block-table row, so the backward gathers the keys the forward read
            lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).clamp(0, block_table.shape[1] * k.shape[1])
            cu_seqlens_k = torch.nn.functional.pad(lengths.cumsum(0).clamp(max=INT32_MAX), (1, 0)).to(torch.int32)
        else:
            cu_seqlens_k = torch.cummax(cu_seqlens_k.clamp(0, total_k), 0).values
    check_softmax_scale(softmax_scale)
    # No sequence is longer than its tensor's tokens (or, paged, its block-table row): the grid is sized by
    # what the batch can hold, whatever max_seqlen claims, and no window side reaches the kernels past it.
    keys_per_sequence = block_table.shape[1] * k.shape[1] if paged else k.shape[0]
    max_seqlen_q = at_most(max_seqlen_q, q.shape[0])
    max_seqlen_k = at_most(max_seqlen_k, keys_per_sequence)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    options = attention_options(q, q.shape[0], keys_per_sequence, softmax_scale=softmax_scale, batch=batch, **options)
    packing = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    result = _ops.varlen_attention(q, k, v, packing, options)
    return result if head_dim is None else sliced(result, head_dim)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """``flash_attn_func`` on a batch of sequences of different lengths, packed without padding.

    Sequence b is the rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b],
    cu_seqlens_k[b + 1]) of k and v; its queries see only its own keys. Everything of ``flash_attn_func``
    holds within each sequence, with that sequence's seqlen_q and seqlen_k (which may differ, either
    way, and may be 0 or 1): the causal mask is aligned to the bottom right corner of each sequence's
    own attention matrix, e.g. for seqlen_q = 2, seqlen_k = 5 (1 = visible):
        1 1 1 1 0
        1 1 1 1 1
    and for seqlen_q = 5, seqlen_k = 2:
        0 0
        0 0
        0 0
        1 0
        1 1
    window_size, softcap, ALiBi distances (|i + seqlen_k - seqlen_q - j| with i, j counted from the
    sequence's start) and learnable_sink likewise. A query whose sequence has no visible key (e.g.
    seqlen_k = 0) gets output 0 and softmax_lse -inf (or the sink); keys of a sequence without queries
    get zero gradients.

    Paged keys and values (block_table, as flash_attn 2.x): k and v are pages (num_blocks,
    page_block_size, nheads_k, headdim[_v]) and key j of sequence b (cu_seqlens_k still gives its length,
    cu_seqlens_k[b + 1] - cu_seqlens_k[b]) is
        k[block_table[b, j // page_block_size], j % page_block_size]
    (v likewise). Pages may come in any order, be shared by sequences or unused; entries past a sequence's
    last page are never read. Output, softmax_lse, every option above and dropout's mask are those of the
    call without pages on the gathered keys (packed in sequence order). page_block_size may be any multiple
    of 16 (flash_attn asks for 256). The Triton kernels read the pages in place. flash_attn has no backward
    here; flashtile's gathers the pages into packed keys, runs the unpaged backward and adds the key
    gradients back into pages (a page used twice gets both, unused pages zeros); sizing those packed keys
    reads cu_seqlens_k[-1] on the host (one synchronisation per backward on CUDA).

    Validation happens before anything launches. The cu_seqlens values (start at 0, non-decreasing, end at
    the token counts, no sequence longer than max_seqlen) are checked on the host: for CUDA tensors that
    costs one small device-to-host copy and a synchronisation per call. With a block_table the same copy
    checks that each sequence's keys fit in its row (max_num_blocks_per_seq * page_block_size keys) and
    that the entries covering them lie in [0, num_blocks). Under torch.compile tracing the value checks are
    skipped (a traced graph must not synchronise), as they are on CUDA with ``flashtile.check_values(False)``
    or during CUDA-graph capture; shapes, dtypes and devices are still checked. Inconsistent values there
    are undefined behaviour, as in flash_attn, but never an out-of-bounds access: the kernels clamp them.

    Args:
        q: (total_q, nheads, headdim), float16, bfloat16 or float32; total_q = the number of query tokens
        k: (total_k, nheads_k, headdim); nheads divisible by nheads_k (MQA/GQA as in flash_attn_func);
            with a block_table (num_blocks, page_block_size, nheads_k, headdim)
        v: (total_k, nheads_k, headdim_v); with a block_table (num_blocks, page_block_size, nheads_k, headdim_v)
        cu_seqlens_q: (batch_size + 1,), int32, on q's device: cumulative query lengths, [0, ..., total_q]
        cu_seqlens_k: (batch_size + 1,), int32, on q's device: cumulative key lengths, [0, ..., total_k]
            (with a block_table, total_k is the batch's number of keys, which no tensor size has to match)
        max_seqlen_q: int, at least the longest query sequence (sizes the launch grid)
        max_seqlen_k: int, at least the longest key sequence
        dropout_p: dropout probability on the attention probabilities, as ``flash_attn_func`` (the mask
            is keyed by head and packed token indices)
        softmax_scale, causal, window_size, softcap, deterministic: as ``flash_attn_func``
        alibi_slopes: (nheads,) or (batch_size, nheads), float32: row b holds sequence b's slopes
        return_attn_probs: also return softmax_lse (the third element is None)
        block_table: None, or (batch_size, max_num_blocks_per_seq) int32 on q's device: the pages of each
            sequence's keys and values, in order (above)
        learnable_sink: keyword only, (nheads,) float32, as ``flash_attn_func``

    Raises:
        the errors of ``flash_attn_func`` for q, k, v and the options (flashtile.InputError, InputTypeError,
        UnsupportedHeadDimError), and flashtile.InputError for cu_seqlens that are not int32 (batch + 1,) running
        sums or a max_seqlen below the longest sequence (their values are checked on CPU tensors, and on CUDA
        unless ``check_values(False)``), all before anything launches

    Returns:
        out: (total_q, nheads, headdim_v)
        if return_attn_probs: (out, softmax_lse, S_dmask) with softmax_lse (nheads, total_q), float32 (flash_attn
            2.x's varlen layout), differentiable, and with dropout S_dmask (batch_size, nheads, max_seqlen_q,
            max_seqlen_k) (``varlen_dropout_probabilities``; None without dropout)
    """
    left, right = window_bounds(window_size, causal)
    rng_state = dropout_rng_state(dropout_p, q.device) if return_attn_probs and isinstance(q, torch.Tensor) else None
    out, lse = varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=block_table,
        softmax_scale=softmax_scale, window_left=left, window_right=right, softcap=softcap, alibi_slopes=alibi_slopes,
        learnable_sink=learnable_sink, dropout_p=dropout_p, rng_state=rng_state,
    )  # fmt: skip
    if not return_attn_probs:
        return out
    if rng_state is None:
        return out, lse, None
    if block_table is not None:  # the keys of the call without pages (the same mask and probabilities)
        slots = paged.packed_slots(block_table, cu_seqlens_k, k)
        k = k[slots]
    s_dmask = varlen_dropout_probabilities(
        q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left, right, dropout_p,
        rng_state, softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
    )  # fmt: skip
    return out, lse, s_dmask


def varlen_dropout_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    window_left: int | None,
    window_right: int | None,
    dropout_p: float,
    rng_state: torch.Tensor,
    *,
    alibi_slopes: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """flash_attn's S_dmask of a varlen forward with dropout: (batch, nheads, max_seqlen_q, max_seqlen_k) in q's
    dtype, entry [b, h, i, j] for query i and key j of sequence b (0 past the sequence's lengths), as
    ``dropout_probabilities``: the probabilities, negated where dropped. q (total_q, H, D), k (total_k, Hk, D)
    packed. The keep mask is read back through the varlen forward (its mask is keyed by head and packed token
    indices: ``_dropout_keep_mask`` over the packed keys); the lengths are read on the host."""
    window = window_size_of(window_left, window_right)
    with torch.no_grad():
        zero_q, zero_k = q.new_zeros(*q.shape[:2], 8), k.new_zeros(*k.shape[:2], 8)

        def forward(v: torch.Tensor) -> torch.Tensor:
            return varlen_attention(
                zero_q, zero_k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=1.0,
                window_left=window_left, window_right=window_right, dropout_p=dropout_p, rng_state=rng_state,
            )[0]  # fmt: skip

        kept = _dropout_keep_mask(forward, (), k.shape[0], k.shape[1], q)  # (nheads, total_q, total_k)
        s_dmask = q.new_zeros(len(cu_seqlens_q) - 1, q.shape[1], max_seqlen_q, max_seqlen_k)
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b, (q0, q1, k0, k1) in enumerate(zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False)):
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
            probs, _ = attention_probs(
                q[None, q0:q1].float(), k[None, k0:k1].float(), softmax_scale, window_size=window,
                alibi_slopes=slopes, **options,
            )  # fmt: skip
            s_dmask[b, :, : q1 - q0, : k1 - k0] = torch.where(kept[:, q0:q1, k0:k1], probs[0], -probs[0])
    return s_dmask


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """``flash_attn_varlen_func`` on a packed qkv tensor (queries and keys share cu_seqlens); gradients
    flow back into ``qkv`` without a copy of q, k, v (the kernels read the strided slices).

    Args:
        qkv: (total, 3, nheads, headdim)
        cu_seqlens: (batch_size + 1,), int32; max_seqlen: int
        the rest: as ``flash_attn_varlen_func``

    Raises:
        the errors of ``flash_attn_varlen_func`` (flashtile.InputError, InputTypeError,
        UnsupportedHeadDimError), for the packed tensor's shape too, before anything launches

    Returns:
        out: (total, nheads, headdim), or (out, softmax_lse (nheads, total), None) if return_attn_probs
    """
    q, k, v = unpacked(qkv, "qkv", ("total", 3, "nheads", "headdim"))
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """``flash_attn_varlen_func`` with keys and values packed in one tensor; gradients flow back into ``kv``.

    Args:
        q: (total_q, nheads, headdim)
        kv: (total_k, 2, nheads_k, headdim)
        the rest: as ``flash_attn_varlen_func``

    Raises:
        the errors of ``flash_attn_varlen_func`` (flashtile.InputError, InputTypeError,
        UnsupportedHeadDimError), for the packed tensor's shape too, before anything launches

    Returns:
        out: (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q), None) if return_attn_probs
    """
    k, v = unpacked(kv, "kv", ("total_k", 2, "nheads_k", "headdim"))
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink,
    )  # fmt: skip
