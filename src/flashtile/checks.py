"""The input checks every entry point shares, and the normalisation that goes with them (window sides, scales).

Each raises a ``flashtile.errors`` exception that says what was expected, what came and how to fix it, before
anything launches. Checks that run on every call build their messages only on failure.
"""

from __future__ import annotations

import math
import operator

import torch

from flashtile.errors import InputError, InputTypeError, UnsupportedDtypeError, UnsupportedHeadDimError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
NO_WINDOW = (-1, -1)
"""``window_size`` for full attention: a side of -1 (any negative value) is unbounded."""
INT32_MAX = torch.iinfo(torch.int32).max


def check_head_dim(name: str, head_dim: int) -> None:
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise UnsupportedHeadDimError(
            f"{name} must be between 1 and {MAX_HEAD_DIM} (flash_attn's limit), got {head_dim}."
        )
    if head_dim % 8 != 0:  # q, k and v of one head dim are padded before this check (pad_head_dim)
        raise UnsupportedHeadDimError(
            f"{name} must be a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {head_dim}. "
            "Pad the head dimension with zeros up to the next multiple of 8 (and slice the output)."
        )


def check_dtype(name: str, t: torch.Tensor) -> None:
    """Raise UnsupportedDtypeError unless ``t`` is float16, bfloat16 or float32. Float32 computes in float32 on
    every path: the CPU path, the Triton interpreter, and on CUDA the Triton kernels with IEEE float32 products
    (not TF32; the sm_90 Gluon kernels take 16-bit inputs only)."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(
            f"{name} has dtype {t.dtype}; flashtile supports torch.float16 and torch.bfloat16 (and torch.float32). "
            f"Cast the inputs, e.g. {name}.to(torch.bfloat16)."
        )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, float8: bool = False) -> None:
    """Raise TypeError/ValueError unless q, k, v are valid flash_attn-layout inputs.

    q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
    v (batch, seqlen_k, nheads_k, headdim_v); fp16, bf16 or fp32 (float8 e4m3 too if ``float8``: the caller
    checked them with ``float8.check_float8``), one device, nheads % nheads_k == 0.
    Messages are built only on failure: this runs on every call.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES and not (float8 and t.dtype == torch.float8_e4m3fn):
            check_dtype(name, t)
        if t.dim() != 4:
            raise InputError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}. "
                "For variable-length batches use flash_attn_varlen_func."
            )
    if not q.dtype == k.dtype == v.dtype:
        raise InputTypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not q.device == k.device == v.device:
        raise InputError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}.")
    batch, _, nheads, head_dim = q.shape
    k_batch, seqlen_k, nheads_k, k_head_dim = k.shape
    if not k_batch == v.shape[0] == batch:
        raise InputError(f"q, k and v must share the batch size, got {batch}, {k_batch}, {v.shape[0]}.")
    if (seqlen_k, nheads_k) != tuple(v.shape[1:3]):
        raise InputError(
            f"k and v must share seqlen_k (dim 1) and nheads_k (dim 2), got k {tuple(k.shape)} and v {tuple(v.shape)}."
        )
    if k_head_dim != head_dim:
        raise InputError(f"q and k must share headdim (dim 3), got q {tuple(q.shape)} and k {tuple(k.shape)}.")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise InputError(
            f"nheads ({nheads}) must be divisible by nheads_k ({nheads_k}) for grouped-query attention: "
            "each group of nheads // nheads_k query heads shares one key/value head."
        )
    check_head_dim("headdim", head_dim)
    check_head_dim("headdim_v", v.shape[3])


def check_unimplemented(dropout_p: float = 0.0, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None) -> None:
    """Raise NotImplementedError for options the calling function does not implement (never ignore them).

    dropout_p, softcap and alibi_slopes work in ``flash_attn_func``, its packed variants and
    ``scaled_dot_product_attention``, which do not pass them here; functions that do not support them
    yet (ring and Ulysses attention, for now ``flash_attn_varlen_func``'s dropout) pass them to be refused.
    """
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: attention dropout is not implemented for this function yet "
            "(flash_attn_func has it); pass dropout_p=0.0."
        )
    if softcap != 0.0:
        raise NotImplementedError(
            f"softcap={softcap}: softcapping is not implemented for this function yet (flash_attn_func has it)."
        )
    if alibi_slopes is not None:
        raise NotImplementedError(
            "alibi_slopes: ALiBi is not implemented for this function yet (flash_attn_func has it)."
        )


def check_options(
    q: torch.Tensor,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    learnable_sink: torch.Tensor | None,
    batch: int | None = None,
) -> tuple[float, torch.Tensor | None, torch.Tensor | None]:
    """Validate softcap, alibi_slopes and learnable_sink against q (batch, seqlen_q, nheads, headdim), or
    against a packed q (total_q, nheads, headdim) of ``batch`` sequences.

    Returns them ready for the kernels: softcap as a float, the tensors with a contiguous last dimension.
    """
    if softcap != 0.0:
        if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0.0):
            raise InputError(f"softcap must be a finite number >= 0 (0 turns it off), got {softcap!r}.")
    nheads = q.shape[-2]
    batch = q.shape[0] if batch is None else batch
    if alibi_slopes is not None:
        _check_fp32_tensor("alibi_slopes", alibi_slopes, q.device)
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise InputError(
                f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch_size, nheads) = ({batch}, {nheads}), "
                f"got {tuple(alibi_slopes.shape)}."
            )
        alibi_slopes = last_dim_contiguous(alibi_slopes)
    if learnable_sink is not None:
        _check_fp32_tensor("learnable_sink", learnable_sink, q.device)
        if not (tuple(learnable_sink.shape) == (nheads,)):
            raise InputError(
                f"learnable_sink must have shape (nheads,) = ({nheads},), one logit per query head, "
                f"got {tuple(learnable_sink.shape)}."
            )
        learnable_sink = last_dim_contiguous(learnable_sink)
    return float(softcap), alibi_slopes, learnable_sink


def _check_fp32_tensor(name: str, t: object, device: torch.device) -> None:
    if not (isinstance(t, torch.Tensor)):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if not (t.dtype == torch.float32):
        raise InputTypeError(f"{name} must be float32, got {t.dtype}. Cast it with {name}.float().")
    if not (t.device == device):
        raise InputError(f"{name} must be on the device of q ({device}), got {t.device}.")


def window_bounds(window_size: tuple[int, int], causal: bool) -> tuple[int | None, int | None]:
    """flash_attn's (window_size, causal) as the kernels' (left, right), None meaning unbounded.

    window_size: a tuple or list of two integers (Python ints, or anything with ``__index__`` such as
    numpy integers; not bools)."""
    if len(window_size) != 2 or not all(type(w) is int for w in window_size):  # every call: no eager f-string
        window_size = window_pair(window_size)
    left, right = window_size
    if causal:
        right = 0
    return (None if left < 0 else left), (None if right < 0 else right)


FAR_SIDE = 2**30
"""A window side at least this large is unbounded whatever the lengths: the kernels add sides to 32-bit positions,
so a side this far past a sequence of fewer than 2**30 tokens still fits in int32 (``bounded_window``)."""


def bounded_window(left: int | None, right: int | None, seqlen_q: int, seqlen_k: int) -> tuple[int | None, int | None]:
    """The kernels' (left, right) with every side that cannot hide a key made unbounded (None).

    Query i sees key j when i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right: a left
    side >= seqlen_k or a right side >= seqlen_q bounds no row, so it is the same as no bound. flash_attn
    treats any side >= the sequence lengths as unbounded, and callers pass "no limit" as INT32_MAX or
    ``sys.maxsize``; the kernels add the sides to 32-bit positions, so such values must never reach them.
    For packed batches pass the token counts (each sequence is at most that long).

    Under torch.compile a length can be a size known only at run time (the token count of an unpadded batch):
    a side is then dropped when it is at least 2**30 (``FAR_SIDE``: past any sequence the kernels' 32-bit
    positions serve), and kept otherwise, which is still exact."""
    if left is not None and (left >= FAR_SIDE or _known_true(left >= seqlen_k)):
        left = None
    if right is not None and (right >= FAR_SIDE or _known_true(right >= seqlen_q)):
        right = None
    return left, right


def at_most(value: int, bound: int) -> int:
    """min(value, bound), where ``bound`` may be a size torch.compile knows only at run time (then ``value``)."""
    return bound if _known_true(bound < value) else value


def _known_true(condition: bool | torch.SymBool) -> bool:
    """``condition``, where a symbolic one that torch.compile can decide only at run time counts as False. The
    symbolic module imports sympy (a third of a second), so only calls under torch.compile import it."""
    if not torch.compiler.is_compiling():
        return bool(condition)
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(condition)


def check_softmax_scale(softmax_scale: object) -> None:
    """Raise unless softmax_scale is None (the default, 1 / sqrt(headdim)) or a finite real number (0 is
    allowed: uniform attention over the visible keys). Runs on every call: the message is built on failure."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, torch.SymFloat, torch.SymInt)):
        raise InputTypeError(
            f"softmax_scale must be a float or None (1 / sqrt(headdim)), got {type(softmax_scale).__name__}."
        )
    # x - x is 0 for every finite x and NaN for NaN and +-inf; unlike math.isfinite it also traces under torch.compile
    # (a symbolic scale, e.g. 1 / sqrt(headdim) of a padded head dim, simplifies to 0 there).
    if not softmax_scale - softmax_scale == 0:
        raise InputError(f"softmax_scale must be a finite number (or None for 1 / sqrt(headdim)), got {softmax_scale}.")


def window_size_of(left: int | None, right: int | None) -> tuple[int, int]:
    """The kernels' (left, right) bounds as flash_attn's window_size, -1 for an unbounded side (``window_bounds``
    the other way, without causal)."""
    return (-1 if left is None else left), (-1 if right is None else right)


def window_pair(window_size: object) -> tuple[int, int]:
    """window_size as two Python ints, or TypeError."""
    try:
        if len(window_size) == 2 and not any(isinstance(w, bool) for w in window_size):
            return operator.index(window_size[0]), operator.index(window_size[1])
    except TypeError:
        pass
    raise InputTypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}.")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def shape_of(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


# ---------------------------------------------------------------------------------------------------
# Paged keys and values (block_table), shared with flash_attn_with_kvcache

PAGE_MULTIPLE = 16
"""page_block_size must be a multiple of this (flash_attn asks for multiples of 256)."""


def check_page_size(pages: torch.Tensor, name: str) -> int:
    """Raise ValueError unless pages (num_blocks, page_block_size, ...) has a page_block_size that is a positive
    multiple of PAGE_MULTIPLE; return it."""
    page = pages.shape[1]
    if page <= 0 or page % PAGE_MULTIPLE != 0:
        raise InputError(
            f"page_block_size ({name}.shape[1]) must be a multiple of {PAGE_MULTIPLE}, got {page}. Allocate the "
            f"pages with a page size such as {PAGE_MULTIPLE * 16}."
        )
    return page


def check_block_table(block_table: object, batch: int, device: torch.device) -> None:
    """Raise unless block_table is (batch, max_num_blocks_per_seq) int32 on ``device``. Runs on every call:
    messages are built only on failure."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise InputError(
            f"block_table must be (batch_size, max_num_blocks_per_seq) with batch_size = {batch}, one row of page "
            f"indices per sequence, got {shape_of(block_table)}."
        )
    if block_table.dtype != torch.int32:
        raise InputTypeError(
            f"block_table must have dtype torch.int32, got {block_table.dtype}. Convert it with "
            "block_table.to(torch.int32)."
        )
    if block_table.device != device:
        raise InputError(f"block_table must be on {device} like q, got {block_table.device}.")


def check_block_table_entries(table: torch.Tensor, used: torch.Tensor, num_blocks: int, pages_name: str) -> None:
    """Raise ValueError unless the entries of a block table on the host where ``used`` (the blocks that hold
    keys) lie in [0, num_blocks); the others are never read and may hold anything."""
    outside = used & ((table < 0) | (table >= num_blocks))
    if outside.any():
        raise InputError(
            f"block_table entries that cover a key must lie in [0, {num_blocks}) ({pages_name}.shape[0], the number "
            f"of blocks); got {table[outside].tolist()} at {outside.nonzero().tolist()} ([sequence, block])."
        )


# ---------------------------------------------------------------------------------------------------
# Variable-length batches


def check_cu_seqlens(name: str, cu: object, device: torch.device) -> None:
    if not (isinstance(cu, torch.Tensor)):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}.")
    if not (cu.dtype == torch.int32):
        raise InputTypeError(
            f"{name} must be int32 (the cumulative sequence lengths, as flash_attn takes them), got {cu.dtype}. "
            f"Cast it with {name}.to(torch.int32)."
        )
    if not (cu.dim() == 1 and cu.shape[0] >= 2):
        raise InputError(
            f"{name} must be 1-D of shape (batch_size + 1,) with batch_size >= 1, got shape {tuple(cu.shape)}."
        )
    if not (cu.device == device):
        raise InputError(f"{name} must be on the device of q ({device}), got {cu.device}.")


def check_max_seqlen(name: str, value: object) -> int:
    if not (isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) and value >= 0):
        raise InputTypeError(
            f"{name} must be a Python int >= 0 (the longest sequence; it sizes the launch grid), got {value!r}."
        )
    return value


def check_cu_seqlens_values(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor | None = None,
    pages: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless both cu_seqlens start at 0, never decrease, end at the token counts, and no
    sequence is longer than its max_seqlen. Reads the values on the host: for CUDA tensors that is one
    small device-to-host copy and a synchronisation per call.

    With a block_table and the pages of k it indexes (total_k None: the keys have no packed count), each
    sequence's keys must fit in its row of the block table and the entries that cover them index a page."""
    batch = cu_seqlens_q.shape[0] - 1
    host = torch.cat([cu_seqlens_q, cu_seqlens_k, *(() if block_table is None else (block_table.flatten(),))]).cpu()
    for name, cu, total, longest, max_name in (
        ("cu_seqlens_q", host[: batch + 1], total_q, max_seqlen_q, "max_seqlen_q"),
        ("cu_seqlens_k", host[batch + 1 : 2 * batch + 2], total_k, max_seqlen_k, "max_seqlen_k"),
    ):
        lengths = cu[1:] - cu[:-1]
        if cu[0] != 0:
            raise InputError(f"{name}[0] must be 0 (the first sequence starts at token 0), got {int(cu[0])}.")
        if (lengths < 0).any():
            b = int((lengths < 0).nonzero()[0])
            raise InputError(
                f"{name} must be non-decreasing (cumulative lengths), but {name}[{b + 1}] = {int(cu[b + 1])} < "
                f"{name}[{b}] = {int(cu[b])}."
            )
        if total is not None and cu[-1] != total:
            tensor = "q" if name.endswith("q") else "k and v"
            raise InputError(
                f"{name}[-1] must equal the number of tokens of {tensor} ({total}), got {int(cu[-1])}. "
                "Build it with torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))."
            )
        if int(lengths.max()) > longest:
            raise InputError(
                f"{max_name} = {longest} is smaller than the longest sequence ({int(lengths.max())}); "
                f"pass {max_name} >= the longest sequence length."
            )
    if block_table is not None:
        _check_paged_lengths(host[2 * batch + 2 :].view(block_table.shape), host[batch + 1 : 2 * batch + 2], pages)


def _check_paged_lengths(table: torch.Tensor, cu_seqlens_k: torch.Tensor, pages: torch.Tensor) -> None:
    """On the host: every sequence's keys (cu_seqlens_k, valid) fit in its row of the block table, and the
    entries of the blocks that hold them index one of the pages."""
    page = pages.shape[1]
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    capacity = table.shape[1] * page
    if (lengths > capacity).any():
        b = int((lengths > capacity).nonzero()[0])
        raise InputError(
            f"sequence {b} has {int(lengths[b])} keys (cu_seqlens_k) but a block_table row reaches only {capacity} "
            f"(max_num_blocks_per_seq {table.shape[1]} x page_block_size {page}): give block_table more columns."
        )
    used = torch.arange(table.shape[1])[None, :] < (lengths[:, None] + page - 1) // page
    check_block_table_entries(table, used, pages.shape[0], "k")


def check_pages(k: object, v: object) -> None:
    """Raise unless k and v are paged keys and values: (num_blocks, page_block_size, nheads_k, headdim[_v])
    tensors with num_blocks >= 1, one page size and one nheads_k. Messages are built only on failure."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise InputError(
                f"{name} must have 4 dimensions (num_blocks, page_block_size, nheads_k, headdim) with a block_table "
                f"(paged K/V), got shape {tuple(t.shape)}. Without pages pass block_table=None and packed "
                "(total_k, nheads_k, headdim) keys and values."
            )
    if k.shape[:3] != v.shape[:3]:
        raise InputError(
            f"k and v must share num_blocks, page_block_size and nheads_k (dims 0-2), got k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}."
        )
    check_page_size(k, "k")
    if k.shape[0] == 0:
        raise InputError(f"k and v must hold at least one page (num_blocks >= 1), got k {tuple(k.shape)}.")
