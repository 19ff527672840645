"""FlashAttention on the CPU in plain PyTorch: the path flashtile takes for CPU tensors.

It computes exact attention

    S = scale * Q K^T,    P = softmax(S) (row-wise),    O = P V

without ever holding the (seqlen_q, seqlen_k) matrices S or P, so the extra memory is linear in the
sequence length. A call takes one of two routes, chosen by one rule (``torch_kernel_route``):

- **torch's fused kernel** (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, what
  ``torch.nn.functional.scaled_dot_product_attention`` runs on a CPU) when the call needs nothing it lacks:
  no softcap or dropout, no gradient at the mask, a mask only of the kinds it reads. With no window, or
  causal with Sq == Sk (top-left causal in general), one call computes it; under any other window (sliding
  windows, flash_attn's bottom-right causal with Sq != Sk) or with ALiBi, one call per block of BAND_BLOCK_M
  query rows does, on the keys that block sees, with the band's edges and ALiBi's bias as a float32 additive
  mask of that block (memory linear in the length). Its results are flashtile's: the kernel takes flash_attn's
  (batch, seqlen, nheads, headdim) layout as transposed views, handles GQA itself, and its LSE is the
  natural-log (batch, nheads, seqlen_q) one flashtile returns (made float32 and contiguous, -inf for a row
  that sees no key, where the kernel writes 0). A gradient at the LSE reaches its backward through Delta
  (``_fused_backward``).
- **the tiled path** below for everything else (softcap, dropout, a gradient at an additive mask, a float
  mask of another dtype than q's, ALiBi with an SDPA mask, softmax_scale 0, headdim_v != headdim, empty
  inputs), or for every call with ``TORCH_KERNEL = False``.

A learnable sink is added to either route's results afterwards (``_add_sink``).

The tiled path: forward by online softmax
-----------------------------------------
It works on a query tile of BLOCK_M rows against a key tile of BLOCK_N columns at a time (extra memory
O(seqlen * headdim + BLOCK_M * BLOCK_N) per head). For one query tile, stream the key/value tiles j = 0, 1,
... and keep, per query row, the running max ``m_i`` of the scores seen so far, the running sum
``l_i = sum exp(s - m_i)`` over them and an unnormalised output ``acc = sum exp(s - m_i) v``. On each new
score tile S_j:

    m_new = max(m_i, rowmax(S_j))
    P_j   = exp(S_j - m_new)
    alpha = exp(m_i - m_new)            # rescales what was summed against the old max
    l_i   = alpha * l_i + rowsum(P_j)
    acc   = alpha * acc + P_j V_j
    m_i   = m_new

After the last tile, ``O = acc / l_i`` and the log-sum-exp ``LSE = m_i + log(l_i)`` is saved for
the backward. Subtracting the running max keeps every exp() <= 1, so nothing overflows. ``m_i`` starts at
the dtype's most negative finite value rather than -inf, so that ``exp(m_i - m_new)`` is never
``exp(-inf + inf)``; a row that sees no key ends with ``l_i = 0``, output 0 and LSE -inf.

Backward: recompute P from the LSE
----------------------------------
P is not stored; from the saved LSE it is one exp away: ``P_ij = exp(S_ij - LSE_i)``. With
dO the gradient of O:

    Delta = rowsum(dO * O)              # = rowsum(P * dP), computed once per query row
    dV   += P^T dO
    dP    = dO V^T
    dS    = P * (dP - Delta)            # softmax backward
    dQ   += dS K * scale
    dK   += dS^T Q * scale

A gradient ``dlse`` arriving at the LSE adds ``dlse_i * P_ij`` to dS (d LSE_i / d S_ij = P_ij),
so it enters as ``Delta - dlse``. The outer loop runs over query tiles (dQ of a tile is finished
in place), the inner over key tiles; dK and dV are float32 accumulators of size (seqlen_k, headdim).

Layout and precision
--------------------
K and V are copied once per call into key tiles, each a contiguous (batch * nheads_k, BLOCK_N, headdim)
matrix batch (transposed where the product wants it), so that a tile of every (batch, head) pair is one
batched matrix product that copies nothing. With grouped-query attention (nheads =
group * nheads_k) the query tile of the ``group`` heads that share a key/value head is laid out as
(batch * nheads_k, group * BLOCK_M, headdim), so each key/value tile is used once per query tile. The
softmax and every accumulator are float32 (float64 for float64 inputs), and so are the products' results but for
fp16 inputs'. bf16 inputs take float32 products by default; with ``BF16_PRODUCTS`` the products are computed in
bf16 arithmetic by oneDNN (``_bf16_products``: float32 operands rounded to bf16 inside the product, float32
accumulation and result), which leaves Q, K, V and dO exact, as bf16 values, and rounds the probabilities and their
gradients (P, dS) where they enter P V, P^T dO, dS K and dS^T Q, as torch's kernel and the Triton kernels do; the
softmax scale is then folded into the query tile only where that stays exact (a power of two), and is applied to
the product's result otherwise. fp16 inputs take float32 score products and round P and dS to fp16 for the
others. In the backward the product dO V^T is taken as ``[dO, -Delta] [V, 1]^T = dP - Delta``, one product instead
of a product and a subtraction (-Delta as three bf16 parts under ``BF16_PRODUCTS``, exact). Each exp() argument
is clamped at -87 (``_exp``) where it may lie below: torch's CPU exp() is many times slower where its result
leaves float32's normal range. Where every score is known to lie within +-40 of 0 (``_score_bound``, from the
inputs' norms, the softcap and ALiBi's slopes), the forward takes exp(S) without a running max (``_fixed_offset``):
two passes less over each tile, O then divided by the sum of P as P V's product rounds it.

Score modifications and sinks
-----------------------------
With ``softcap > 0`` the scaled scores are capped, ``S = softcap * tanh(scale * Q K^T / softcap)``,
and with ALiBi slopes a bias ``-slope * |i + seqlen_k - seqlen_q - j|`` is added (flash_attn's order).
In the backward the cap multiplies dS by its derivative ``1 - tanh^2`` before dQ and dK. A learnable
sink joins each row's softmax denominator as one more score with no value: ``LSE' = log(exp(LSE) +
exp(sink))`` and ``O' = O * exp(LSE - LSE')``, so a row that sees no key gets output 0 and LSE = sink.
P computed from that LSE is already right for the backward, and Delta = rowsum(dO * O') too, so either
route's backward serves unchanged; the sink's own gradient is ``-sum_i exp(sink - LSE_i) * Delta_i``,
from ``attention_delta`` (see ``flashtile._ops``).

Dropout
-------
With ``dropout_p > 0`` the probabilities are dropped after the softmax, as flash_attn does:
``O = (P * Z / (1 - p)) V`` with the LSE unchanged (the row sum ``l_i`` keeps every probability), and
in the backward ``dV = (P * Z / (1 - p))^T dO``, ``dS = P * (Z / (1 - p) * dP - Delta)`` with Delta
from the dropped output as always. The keep mask Z is a pure function of (seed, offset, row id, key
index): an integer hash (``_dropout_keep``) in torch ops, so the backward regenerates it tile by tile
without storing it, and tile boundaries do not matter. It is deterministic for a seed but not bit for
bit the Triton kernels' Philox mask.

Masks are bottom-right aligned as in flash_attn: with a window (left, right), query i sees key j
iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (causal: no left
bound, right = 0). Key tiles that no row of the query tile can see are skipped, and a mask is
built only for tiles that the band's edges cut. A query row that sees no key
(possible when seqlen_q > seqlen_k) gets output 0, LSE -inf and zero gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from flashtile import paged
from flashtile._backend import Verdict, verdict
from flashtile.float8 import FLOAT8, dequantized, output_dtype
from flashtile.options import AttentionOptions, Packing

BLOCK_M = 128  # query rows per tile (times the GQA group size)
BLOCK_N = 512  # key columns per tile
BAND_BLOCK_M = 256  # query rows per call of torch's kernel under a window
FIXED_OFFSET_BOUND = 40.0  # largest |score| bound for which the forward skips the row max (``_fixed_offset``)
ALIBI_MASK_SIZE = 1 << 24  # values of one ALiBi block mask at most (64 MiB of float32; ``_block_rows``)

TORCH_KERNEL = True
"""Whether the calls that torch's fused kernel can compute run it (``torch_kernel_route``); False sends every call
down the tiled path (the tests and benchmarks use it to compare the two routes)."""
BF16_PRODUCTS = False
"""Whether the tiled path computes bf16 inputs' matrix products in oneDNN's bf16 mode for float32 products
(``_bf16_products``: bf16 x bf16 products with float32 results, exact for bf16 inputs; the tiled bf16 forward
1.1-1.3x faster on a Sapphire Rapids CPU, docs/tuning/cpu.md). Off by default because that mode is a process-wide
setting: while a call runs, the float32 products of the process's other threads would round their operands to bf16
too. Turn it on where no other thread computes float32 products during attention calls."""

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

_M32 = 0xFFFFFFFF
_EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38: float32's smallest normal numbers (``_exp``)


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) (int or int64 tensor) without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """murmur3's 32-bit finaliser: a bijection on [0, 2**32) that spreads every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@dataclass(frozen=True)
class _Dropout:
    """Dropout of one call: probability p, seed and offset (from rng_state), and how a tile row maps to
    a row id unique per (batch, head, query row): row_id = b * stride_b + h * stride_h + row0 + i."""

    p: float
    seed: int
    offset: int
    stride_b: int
    stride_h: int
    row0: int = 0


def _dropout(dropout_p: float, rng_state: Tensor | None, nheads: int, seqlen_q: int, row0: int = 0,
             stride_b: int | None = None, stride_h: int | None = None) -> _Dropout | None:  # fmt: skip
    """The dropout of a call (None when off); row ids default to (b * nheads + h) * seqlen_q + i."""
    if dropout_p <= 0.0:
        return None
    seed, offset = (int(x) for x in rng_state.tolist())
    stride_h = seqlen_q if stride_h is None else stride_h
    stride_b = nheads * seqlen_q if stride_b is None else stride_b
    return _Dropout(dropout_p, seed, offset, stride_b, stride_h, row0)


def _dropout_keep(drop: _Dropout, B: int, Hk: int, group: int, q0: int, q1: int, k0: int, k1: int) -> Tensor:
    """Boolean keep mask (B, Hk, group * (q1 - q0), k1 - k0) of a tile, True with probability 1 - p."""
    b = torch.arange(B)[:, None, None, None]
    h = (torch.arange(Hk)[:, None] * group + torch.arange(group)[None, :])[None, :, :, None]
    row = b * drop.stride_b + h * drop.stride_h + drop.row0 + torch.arange(q0, q1)[None, None, None, :]
    key = _mix32((drop.seed & _M32) ^ _mix32((drop.seed >> 32) ^ _mix32((drop.offset & _M32) ^ (drop.offset >> 32))))
    r = _mix32(_mix32((row & _M32) ^ key) ^ (row >> 32)).reshape(B, Hk, -1, 1)
    cols = _mix32((torch.arange(k0, k1) + key) & _M32)
    u = _mix32(r ^ cols[None, None, None, :]) >> 8  # 24 uniform bits
    return u >= round(drop.p * (1 << 24))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16/fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tiled path's product operands other than the scores' (values, probabilities and their
    gradients, dO, the keys and queries of dQ and dK): float32 for bf16 inputs (float32 products, or under
    ``_bf16_products`` float32 operands rounded to bf16 inside the product: the probabilities are rounded there, the
    inputs are bf16 values already), with float32 results; the inputs' dtype otherwise."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _bf16_mode(dtype: torch.dtype) -> bool:
    """Whether a call on inputs of ``dtype`` runs its products in oneDNN's bf16 mode (``_bf16_products``): bf16
    inputs, ``BF16_PRODUCTS`` on, and a torch that has the setting. Decides too what that mode needs to stay exact
    (the scale folded only where exact, -Delta in three parts), which float32 products do not."""
    setting = getattr(torch.backends.mkldnn, "matmul", None)  # absent from older torch: float32 products there
    return dtype == torch.bfloat16 and BF16_PRODUCTS and hasattr(setting, "fp32_precision")


@contextlib.contextmanager
def _bf16_products(dtype: torch.dtype) -> Iterator[None]:
    """For bf16 inputs (``dtype``), float32 matrix products computed by oneDNN in bf16 (bf16 x bf16 products
    accumulated and returned in float32) within the block; nothing otherwise.

    PyTorch has no bf16 x bf16 -> float32 product on the CPU (``out_dtype`` is CUDA-only); oneDNN's bf16 math mode
    for float32 products (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``) is one, 2-3x faster than the
    float32 product on CPUs with bf16 instructions (AVX512-BF16, AMX) and ignored elsewhere. It rounds each
    operand to bf16: exact for the tiled path's inputs, which are bf16 values (the query tile takes the softmax
    scale only where that stays exact, ``_score_mods``; -Delta enters dP as three bf16 parts, ``_split``). Only
    with ``BF16_PRODUCTS`` on: the setting is process-wide."""
    if not _bf16_mode(dtype):
        yield
        return
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    setting.fp32_precision = "bf16"
    try:
        yield
    finally:
        setting.fp32_precision = before


def _visible_keys(
    q0: int, q1: int, seqlen_q: int, seqlen_k: int, left: int | None, right: int | None
) -> tuple[int, int]:
    """The keys [k0, k1) that some query row in [q0, q1) may see (k0 >= k1 if none sees any key)."""
    diag = seqlen_k - seqlen_q
    k0 = 0 if left is None else max(0, q0 + diag - left)
    k1 = seqlen_k if right is None else min(seqlen_k, q1 + diag + right)
    return k0, k1


def _key_span(q0: int, q1: int, seqlen_q: int, seqlen_k: int, left: int | None, right: int | None) -> range:
    """Start of each key tile (a multiple of BLOCK_N) that a query row in [q0, q1) may see (empty if none)."""
    k0, k1 = _visible_keys(q0, q1, seqlen_q, seqlen_k, left, right)
    return range(k0 // BLOCK_N * BLOCK_N, k1, BLOCK_N)


def _band_mask(
    q0: int, q1: int, k0: int, k1: int, seqlen_q: int, seqlen_k: int, left: int | None, right: int | None
) -> Tensor | None:
    """Boolean (q1 - q0, k1 - k0) mask, True where query i may see key j; None if all may."""
    diag = seqlen_k - seqlen_q
    left_clear = left is None or k0 >= q1 - 1 + diag - left  # the last row sees the tile's first key
    right_clear = right is None or k1 - 1 <= q0 + diag + right  # the first row sees the tile's last key
    if left_clear and right_clear:
        return None
    i = torch.arange(q0, q1)[:, None]
    j = torch.arange(k0, k1)[None, :]
    visible = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
    if left is not None:
        visible &= j >= i + diag - left
    if right is not None:
        visible &= j <= i + diag + right
    return visible


def torch_kernel_route(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, *, dlse: Tensor | None = None,
    dmask: Tensor | None = None,
) -> tuple[str | None, Verdict]:  # fmt: skip
    """The route rule: (route, YES), how torch's fused kernel computes this call, or (None, the reasons) when the tiled
    path must (arguments as ``attention_forward`` / ``attention_backward`` take them).

    torch's kernel computes softmax(scale * Q K^T + mask) V for fp16/bf16/fp32/fp64, with GQA, an optional
    causal mask aligned to the top left (query i sees keys j <= i) and an additive mask of q's dtype, and
    its backward takes the forward's output and LSE. It serves a call when all of these hold:

    - ``TORCH_KERNEL`` is on;
    - batch, seqlen_q, seqlen_k and nheads are all > 0 (the kernel divides by zero on an empty sequence)
      and headdim_v == headdim;
    - no softcap, no dropout; in the backward, no gradient wanted at the mask (dmask);
    - softmax_scale != 0 (torch's kernel gives NaN for masked keys at scale 0: it scales the -inf scores);
    - attn_mask is None, boolean (given to the kernel as 0 / -inf of q's dtype) or of q's dtype; with ALiBi,
      None.

    The route then follows the window (bottom-right aligned, as flash_attn's):

    - "full": window_left is None or >= seqlen_k - 1 and window_right is None or >= seqlen_q - 1 (the
      window hides nothing): one call, is_causal=False;
    - "causal": window_left as above and window_right == seqlen_q - seqlen_k (the bottom-right diagonal is
      then the top-left one; with seqlen_q == seqlen_k that is flash_attn's causal=True): one call,
      is_causal=True;
    - "band": any other window, or ALiBi, without attn_mask: one call per BAND_BLOCK_M query rows on the keys
      they see, with the block's band edges and ALiBi bias as its additive float32 mask (``_banded_forward``);
      with ALiBi fewer rows where (batch or 1) * nheads * seqlen_k is large (``_block_rows``), or the tiled path
      where fewer than 16 would fit.

    A learnable sink does not matter here: it is added to either route's results (``_add_sink``); nor does a
    gradient at the LSE: the backward takes it through two more value columns (``_fused_backward``).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    attn_mask, left, right = options.attn_mask, options.window_left, options.window_right
    alibi = options.alibi_slopes
    found = verdict((
        None if TORCH_KERNEL else "switched off (cpu.TORCH_KERNEL)",
        "softcap" if options.softcap > 0.0 else None,
        "dropout" if options.dropout_p > 0.0 else None,
        "softmax_scale 0 (torch's kernel scales the masked -inf scores)" if options.softmax_scale == 0 else None,
        "a gradient at the mask" if dmask is not None else None,
        f"an attn_mask of dtype {attn_mask.dtype} (bool or q's dtype only)"
        if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype) else None,
        "an empty input" if min(batch, seqlen_q, seqlen_k, nheads) == 0 else None,
        f"headdim_v {v.shape[-1]} != headdim {head_dim}" if v.shape[-1] != head_dim else None,
    ))  # fmt: skip
    if not found:
        return None, found
    if alibi is not None and _block_rows(alibi, nheads, seqlen_k) < 16:
        # the tiled path's tiles take less memory than a mask of so few rows, and fewer calls
        return None, Verdict(("ALiBi over so many keys that a block's bias mask would hold fewer than 16 rows",))
    if alibi is None and (left is None or left >= seqlen_k - 1):
        if right is None or right >= seqlen_q - 1:
            return "full", found
        if right == seqlen_q - seqlen_k:
            return "causal", found
    if attn_mask is None:
        return "band", found
    return None, Verdict(("a window other than causal, or ALiBi, with an attn_mask",))


def _kernel_mask(attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """SDPA's (B, H, Sq, Sk) mask view as torch's kernel takes it: its broadcast (stride 0) dimensions back to
    size 1, without a copy; a boolean mask as 0 / -inf of ``dtype`` (a tensor the size of the mask as given)."""
    if attn_mask is None:
        return None
    mask = attn_mask[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in attn_mask.stride())]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return mask


def _fused_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, is_causal: bool, attn_mask: Tensor | None,
    hidden: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, lse) of one call of torch's fused kernel in flashtile's layouts: out (B, Sq, H, D) contiguous, lse
    (B, H, Sq) float32 contiguous, -inf for a row that the mask hides entirely (the kernel gives it out 0, LSE 0):
    the rows ``hidden`` (boolean, broadcast to lse) names, or if None, those the mask hides."""
    mask = _kernel_mask(attn_mask, q.dtype)
    out, lse = _FLASH(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, attn_mask=mask, scale=scale
    )  # out: (B, H, Sq, D) over (B, Sq, H, D) memory; lse: (B, H, Sq) over (B, Sq, H) memory
    lse = lse.float().contiguous()
    if mask is not None:
        lse.masked_fill_((mask == float("-inf")).all(dim=-1) if hidden is None else hidden, float("-inf"))
    return out.transpose(1, 2).contiguous(), lse


def _fused_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, is_causal: bool,
    attn_mask: Tensor | None, dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv) of one call of torch's fused backward, contiguous in flashtile's layouts (dk, dv summed over
    each GQA group by the kernel).

    A gradient dlse (B, H, Sq) at the LSE enters dS = P (dP - Delta + dlse) (module docstring) through Delta, which
    the kernel computes as rowsum(dO * O): q, k and v get two more columns of zeros (scores, dP and the results'
    first D columns are unchanged), O two of ones and dO the columns -dlse split in two parts of dO's dtype
    (``_split``), so that the kernel's Delta is rowsum(dO * O) - dlse to 16 bits of dlse."""
    mask = _kernel_mask(attn_mask, q.dtype)
    lse = lse.to(_compute_dtype(q.dtype))  # the kernel reads the LSE in its accumulation dtype
    if mask is not None:  # a row the mask hides entirely: any finite LSE gives P = exp(-inf - LSE) = 0
        lse = lse.masked_fill(lse == float("-inf"), 0.0)
    head_dim = q.shape[-1]
    if dlse is not None:
        dout = torch.cat([dout, *_split(-dlse.transpose(1, 2)[..., None], dout.dtype)], dim=-1)
        out = torch.cat([out, torch.ones(*out.shape[:3], 2, dtype=out.dtype)], dim=-1)
        q, k, v = (torch.nn.functional.pad(t, (0, 2)) for t in (q, k, v))
    grads = _FLASH_BACKWARD(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )  # fmt: skip
    return tuple(g[..., :head_dim].transpose(1, 2).contiguous() for g in grads)


def _block_rows(alibi_slopes: Tensor | None, nheads: int, seqlen_k: int) -> int:
    """Query rows per call of torch's kernel on the banded route: BAND_BLOCK_M, or with ALiBi as many as keep the
    block's float mask ((1 or batch) x nheads x rows x seqlen_k) within ALIBI_MASK_SIZE values."""
    if alibi_slopes is None:
        return BAND_BLOCK_M
    per_row = alibi_slopes.numel() // alibi_slopes.shape[-1] * nheads * seqlen_k
    return max(1, min(BAND_BLOCK_M, ALIBI_MASK_SIZE // max(per_row, 1)))


def _band_blocks(
    seqlen_q: int, seqlen_k: int, left: int | None, right: int | None, rows: int = BAND_BLOCK_M
) -> Iterator[tuple[int, int, int, int, Tensor | None]]:
    """(q0, q1, k0, k1, mask) per block of ``rows`` query rows that sees a key: keys [k0, k1) are the ones its
    rows may see, mask the boolean (q1 - q0, k1 - k0) band over them (None if it hides nothing)."""
    for q0 in range(0, seqlen_q, rows):
        q1 = min(q0 + rows, seqlen_q)
        k0, k1 = _visible_keys(q0, q1, seqlen_q, seqlen_k, left, right)
        if k0 < k1:
            yield q0, q1, k0, k1, _band_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, left, right)


def _block_mask(
    band: Tensor | None, alibi_slopes: Tensor | None, q0: int, q1: int, k0: int, k1: int, diag: int,
    dtype: torch.dtype,
) -> Tensor | None:  # fmt: skip
    """The mask of one block of torch's kernel (``_band_blocks``): the band (M, N) as a boolean (1, 1, M, N), or with
    ALiBi slopes (H,) or (B, H) the additive (1 or B, H, M, N) mask -slope * |i + diag - j| of ``dtype`` (the compute
    dtype, not rounded to q's), -inf where the band hides a key; None if neither."""
    if alibi_slopes is None:
        return None if band is None else band[None, None]
    i = torch.arange(q0, q1)[:, None]
    j = torch.arange(k0, k1)[None, :]
    bias = (i + diag - j).abs_().to(dtype) * alibi_slopes.to(dtype).reshape(-1, alibi_slopes.shape[-1], 1, 1).neg()
    if band is not None:  # added as a (M, N) -inf / 0 mask: masked_fill_ over broadcast heads is ~10x slower
        bias.add_(torch.zeros(band.shape, dtype=dtype).masked_fill_(~band, float("-inf")))
    return bias


def _banded_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, left: int | None, right: int | None,
    alibi_slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``_fused_forward`` under a window or with ALiBi: one call per block of query rows (``_band_blocks``), with
    its band and bias as the additive mask (``_block_mask``). A row that sees no key gets out 0 and LSE -inf."""
    B, Sq, H, _ = q.shape
    Sk = k.shape[1]
    out = torch.zeros(B, Sq, H, v.shape[-1], dtype=q.dtype)
    lse = torch.full((B, H, Sq), float("-inf"))
    for q0, q1, k0, k1, band in _band_blocks(Sq, Sk, left, right, _block_rows(alibi_slopes, H, Sk)):
        mask = _block_mask(band, alibi_slopes, q0, q1, k0, k1, Sk - Sq, _compute_dtype(q.dtype))
        out[:, q0:q1], lse[:, :, q0:q1] = _fused_forward(
            q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], scale, False, mask, None if band is None else ~band.any(dim=-1)
        )
    return out, lse


def _banded_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, left: int | None,
    right: int | None, alibi_slopes: Tensor | None = None, dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``_fused_backward`` block by block as ``_banded_forward``; dK and dV summed in float32."""
    dtype = _compute_dtype(q.dtype)
    Sq, Sk = q.shape[1], k.shape[1]
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(k.shape, dtype=dtype)
    dv = torch.zeros(v.shape, dtype=dtype)
    for q0, q1, k0, k1, band in _band_blocks(Sq, Sk, left, right, _block_rows(alibi_slopes, q.shape[2], Sk)):
        dq[:, q0:q1], dk_block, dv_block = _fused_backward(
            dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1], lse[:, :, q0:q1], scale, False,
            _block_mask(band, alibi_slopes, q0, q1, k0, k1, Sk - Sq, dtype), None if dlse is None else dlse[..., q0:q1],
        )  # fmt: skip
        dk[:, k0:k1] += dk_block
        dv[:, k0:k1] += dv_block
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _add_sink(out: Tensor, lse: Tensor, learnable_sink: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) with a sink's logit (H,) joined to each row's softmax: LSE' = log(exp(LSE) + exp(sink)) and
    out' = out * exp(LSE - LSE') (the sink takes its share of the probability and brings no value)."""
    with_sink = torch.logaddexp(lse, learnable_sink.float()[None, :, None])  # (B, H, Sq)
    finite = with_sink.clamp(min=torch.finfo(torch.float32).min)  # a sink of -inf and no key: -inf - min = -inf
    share = torch.exp(lse - finite).transpose(1, 2)[..., None]  # (B, Sq, H, 1); 0 where no key was seen
    return (out * share).to(out.dtype), with_sink


@dataclass(frozen=True)
class _ScoreMods:
    """How a tile's scores are made: the softmax scale, a tanh cap (0 = off), ALiBi slopes shaped
    (B * Hk, group, 1, 1) in the compute dtype (None = off), ``diag`` = seqlen_k - seqlen_q."""

    softmax_scale: float
    softcap: float = 0.0
    slopes: Tensor | None = None
    diag: int = 0
    folded: bool = True

    @property
    def query_scale(self) -> float:
        """What multiplies Q K^T to give the scaled score (or the cap's tanh argument)."""
        return self.softmax_scale / self.softcap if self.softcap > 0.0 else self.softmax_scale

    def query_tile(self, q: Tensor, q0: int, q1: int, nheads_k: int) -> Tensor:
        """Rows [q0, q1) of q as the left operand of Q K^T, (B * Hk, group * M, D) in the compute dtype, multiplied
        by ``query_scale`` if ``folded`` (else ``_scores`` multiplies the product)."""
        tile = _query_tile(q, q0, q1, nheads_k, _compute_dtype(q.dtype))
        return tile.mul_(self.query_scale) if self.folded else tile


def _score_mods(
    alibi_slopes: Tensor | None, softcap: float, batch: int, nheads_k: int, diag: int, dtype: torch.dtype,
    softmax_scale: float, bf16_products: bool,
) -> _ScoreMods:  # fmt: skip
    """The score modifications of a call, slopes reshaped to broadcast against a tile's scores. With
    ``bf16_products`` (``_bf16_products``) the scale is folded into the query tile only if it is a power of two
    (the scaled bf16 query is then still exact in bf16); otherwise the product's result is multiplied by it."""
    slopes = None
    if alibi_slopes is not None:  # (H,) or (B, H) -> (B * Hk, group, 1, 1)
        nheads = alibi_slopes.shape[-1]
        slopes = alibi_slopes.to(dtype).expand(batch, nheads).reshape(batch * nheads_k, nheads // nheads_k, 1, 1)
    mods = _ScoreMods(softmax_scale, softcap, slopes, diag)
    folded = not bf16_products or abs(math.frexp(mods.query_scale)[0]) == 0.5
    return dataclasses.replace(mods, folded=folded)


def _scores(
    q_t: Tensor, k_t: Tensor, mods: _ScoreMods, group: int, q0: int, k0: int, out: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Scores of one tile before any mask, and tanh of the scaled scores if they are capped (for the backward).

    q_t: (B * Hk, group * M, D) holding query rows from q0 (``mods.query_tile``); k_t: (B * Hk, D, N) holding keys
    from k0, transposed; out: flat scratch (``_scratch``) of the compute dtype, twice a tile's size if capped -> s:
    (B * Hk, group * M, N) in the compute dtype, in out's memory (its second half if capped); t: like s in the
    first half, or None.
    """
    shape = (*q_t.shape[:2], k_t.shape[2])
    s = torch.bmm(q_t, k_t, out=_scratch(out, shape))  # [gM, D] @ [D, N]
    if not mods.folded:
        s.mul_(mods.query_scale)
    t = None
    if mods.softcap > 0.0:
        t = s.tanh_()
        s = torch.mul(t, mods.softcap, out=_scratch(out[t.numel() :], shape))
    if mods.slopes is not None:
        rows, n = s.shape[1:]
        s_heads = s.view(s.shape[0], group, rows // group, n)  # query heads of a group apart: (B * Hk, group, M, N)
        i = torch.arange(q0, q0 + s_heads.shape[2])[:, None]
        j = torch.arange(k0, k0 + n)[None, :]
        s_heads.sub_(mods.slopes * (i + mods.diag - j).abs().to(s.dtype))  # -slope * |i + Sk - Sq - j|
    return s, t


def _mask_tile(
    x: Tensor, band: tuple[Tensor, Tensor] | None, attn_mask: Tensor | None, group: int, q0: int, q1: int, k0: int,
    k1: int, probs: bool = False,
) -> None:  # fmt: skip
    """Hide the keys that the band (``_tile_band``) or the tile [q0, q1) x [k0, k1) of SDPA's (B, H, Sq, Sk) mask
    view hide from x (B * Hk, group * M, N), in place: scores get -inf (and an additive mask added), or with
    ``probs``, probabilities computed from such scores get exactly 0 (``_exp``)."""
    fill = 0.0 if probs else float("-inf")
    if band is not None:  # a broadcast product or sum: masked_fill_ is ~10x slower over the group's heads
        x_heads = x.view(x.shape[0], group, x.shape[1] // group, x.shape[2])  # (B * Hk, group, M, N)
        bias, keep = band
        if probs:
            x_heads.mul_(keep)
        else:
            x_heads.add_(bias)
    if attn_mask is not None:
        tile = attn_mask[:, :, q0:q1, k0:k1]  # (B, H, M, N), read through the broadcast view
        x_heads = x.view(tile.shape)
        if tile.dtype == torch.bool:
            x_heads.masked_fill_(~tile, fill)
        elif probs:
            x_heads.masked_fill_(tile == float("-inf"), 0.0)
        else:
            x_heads.add_(tile)


@functools.lru_cache(maxsize=16)
def _tile_band(
    offset: int, rows: int, cols: int, left: int | None, right: int | None, dtype: torch.dtype
) -> tuple[Tensor, Tensor] | None:
    """The band over a tile of the tiled path whose first row i and first key j have i + seqlen_k - seqlen_q - j =
    ``offset`` (what alone decides it), as (rows, cols) tensors of ``dtype``: an additive mask (0 visible, -inf
    hidden) and a factor (1 visible, 0 hidden); None if the tile hides nothing. Cached: a call's diagonal tiles
    repeat a few offsets (16 tiles of at most 128 x 512 values: 16 MiB at most)."""
    visible = _band_mask(offset, offset + rows, 0, cols, 0, 0, left, right)
    if visible is None:
        return None
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return bias, visible.to(dtype)


def _exp(x: Tensor, offset: Tensor | None, floor: bool = True) -> Tensor:
    """exp(x - offset) in x's memory (exp(x) if offset is None), for x - offset <= 0 (a row's max or LSE
    subtracted), or |x| <= FIXED_OFFSET_BOUND.

    torch's CPU exp() takes a slow path (about 4x for -inf, 40x for a result below float32's smallest normal
    number) where x - offset < -87.3, so with ``floor`` it is clamped there first: such a term is below 1.7e-38 of
    the row's largest term (1), which the sum cannot see, and the keys a mask hides get their exact 0 from
    ``_mask_tile`` after this. Without ``floor`` (a tile no mask cuts, where ``_score_bound`` says no x - offset
    gets there) the clamp's pass over the tile is saved; the result is the same."""
    if offset is not None:
        x = x.sub_(offset)
    return (x.clamp_(min=_EXP_FLOOR) if floor else x).exp_()


def _score_bound(q: Tensor, k: Tensor, mods: _ScoreMods, attn_mask: Tensor | None) -> float:
    """A bound on |score| for q (B, Sq, H, D) and k (B, Sk, Hk, D), the band aside: |softmax_scale| max_i |q_i|
    max_j |k_j| (at most softcap) plus ALiBi's largest bias; inf with an attn_mask or an empty input. The speed of
    the tiled path depends on it (``_exp``'s clamp, ``_fixed_offset``), its results do not."""
    if attn_mask is not None or min(q.numel(), k.numel()) == 0:
        return math.inf
    q_norm, k_norm = (torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).max().item() for x in (q, k))
    bound = abs(mods.softmax_scale) * q_norm * k_norm
    if mods.softcap > 0.0:
        bound = min(bound, mods.softcap)
    if mods.slopes is not None:
        bound += mods.slopes.abs().max().item() * (q.shape[1] + k.shape[1])
    return bound


def _fixed_offset(bound: float, v: Tensor, dtype: torch.dtype) -> bool:
    """Whether the forward may take exp(s) itself instead of exp(s - running row max): scores within +-``bound`` of
    0 (``_score_bound``) with bound <= FIXED_OFFSET_BOUND keep exp(s) a normal float32, and the sums of exp(s) and
    exp(s) v stay finite; not for fp16 inputs, whose P (rounded to fp16 for P V) would leave fp16's range. It saves
    the row max and the subtraction: two of the forward's four passes over a tile. O is then divided by the sum of
    P as P V rounds it (a column of ones in V), not by the float32 sum that gives the LSE: with the row max
    subtracted the largest term is exactly 1, unrounded, and a row with one key gets O = V exactly; without it,
    only a denominator rounded alike keeps that."""
    if dtype == torch.float16 or bound > FIXED_OFFSET_BOUND or v.numel() == 0:
        return False
    return math.exp(bound) * v.shape[1] * max(1.0, v.abs().max().item()) < 1e37


def _score_operands(
    q: Tensor, k: Tensor, softmax_scale: float, alibi_slopes: Tensor | None, softcap: float
) -> tuple[torch.dtype, _ScoreMods, list[Tensor]]:
    """What the tiled forward and backward compute scores from: the compute dtype (``_compute_dtype``), the score
    modifications (``_score_mods``) and k's tiles (B * Hk, D, N) in that dtype, the scores' right operands."""
    dtype = _compute_dtype(q.dtype)
    batch, seqlen_k, nheads_k = k.shape[:3]
    mods = _score_mods(alibi_slopes, softcap, batch, nheads_k, seqlen_k - q.shape[1], dtype, softmax_scale,
                       _bf16_mode(q.dtype))  # fmt: skip
    return dtype, mods, _key_tiles(k, dtype, transposed=True)


def _key_tiles(x: Tensor, dtype: torch.dtype, transposed: bool = False) -> list[Tensor]:
    """x (B, Sk, Hk, D) cut into tiles of BLOCK_N keys, tile t = keys [t * BLOCK_N, (t + 1) * BLOCK_N), each a
    contiguous (B * Hk, N, D) tensor of ``dtype``, or (B * Hk, D, N) if transposed: one copy of x per call, after
    which every tile is a plain batched matrix (a matrix product copies an operand whose batch is strided)."""
    B, Sk, Hk, D = x.shape
    tiles = []
    for k0 in range(0, Sk, BLOCK_N):
        tile = x[:, k0 : k0 + BLOCK_N].permute(0, 2, 3, 1) if transposed else x[:, k0 : k0 + BLOCK_N].transpose(1, 2)
        tiles.append(torch.empty(tile.shape, dtype=dtype).copy_(tile).view(B * Hk, *tile.shape[2:]))
    return tiles


def _scratch(buffer: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A contiguous tensor of ``shape`` over the start of a flat buffer: per-tile results written with ``out=``
    reuse one allocation for the whole call."""
    return buffer[: math.prod(shape)].view(shape)


def _in_dtype(x: Tensor, buffer: Tensor) -> Tensor:
    """x in the flat buffer's dtype, written over its start (``_scratch``), or x itself if it has that dtype."""
    return x if x.dtype == buffer.dtype else _scratch(buffer, x.shape).copy_(x)


def _query_tile(x: Tensor, q0: int, q1: int, nheads_k: int, dtype: torch.dtype) -> Tensor:
    """Rows [q0, q1) of x (B, S, H, D) as a new (B * Hk, group * (q1 - q0), D) tensor of ``dtype``."""
    B, _, H, D = x.shape
    tile = torch.empty(B, H, q1 - q0, D, dtype=dtype)
    return tile.copy_(x[:, q0:q1].transpose(1, 2)).view(B * nheads_k, H // nheads_k * (q1 - q0), D)


def _store_query_tile(dst: Tensor, q0: int, q1: int, tile: Tensor) -> None:
    """Write tile (B * Hk, group * M, D) into rows [q0, q1) of dst (B, S, H, D), casting."""
    B, _, H, D = dst.shape
    dst[:, q0:q1] = tile.view(B, H, q1 - q0, D).transpose(1, 2)


def _delta_tile(
    dout: Tensor, out: Tensor, dlse: Tensor | None, q0: int, q1: int, nheads_k: int, dtype: torch.dtype
) -> Tensor:
    """rowsum(dO * O) - dLSE for rows [q0, q1) as (B * Hk, group * (q1 - q0), 1) in ``dtype``."""
    do_t = _query_tile(dout, q0, q1, nheads_k, dtype)
    delta = do_t.mul_(_query_tile(out, q0, q1, nheads_k, dtype)).sum(dim=-1, keepdim=True)
    if dlse is not None:
        delta -= dlse[:, :, q0:q1].reshape(delta.shape).to(dtype)
    return delta


@torch.no_grad()
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, _drop: _Dropout | None = None
) -> tuple[Tensor, Tensor]:
    """Exact attention, by torch's fused kernel or by tiles with online softmax (``torch_kernel_route`` decides).

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32/fp64 or float8 e4m3 (with options.descale:
           dequantized, computed in float32, out in bf16; ``flashtile.float8``), last dimension contiguous
        k: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0; query head h uses
           key/value head h // (nheads // nheads_k)
        v: (batch, seqlen_k, nheads_k, headdim_v)
        options: softmax_scale multiplies Q K^T before the softmax; (window_left, window_right) is the visible
           band, bottom-right aligned as in flash_attn: query i sees key j iff
           i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right;
           None leaves a side unbounded. Causal is (None, 0): j <= i + seqlen_k - seqlen_q.
           For seqlen_q = 5, seqlen_k = 3 (1 = visible), the first two rows see nothing:
               0 0 0
               0 0 0
               1 0 0
               1 1 0
               1 1 1
           and for seqlen_q = 2, seqlen_k = 5:
               1 1 1 1 0
               1 1 1 1 1
           alibi_slopes (nheads,) or (batch, nheads) float32 adds -slope * |i + seqlen_k - seqlen_q - j|;
           softcap > 0 caps the scaled scores to softcap * tanh(score / softcap) (before ALiBi); learnable_sink
           (nheads,) float32 joins each row's softmax denominator; dropout_p drops each attention probability (kept
           ones scaled by 1 / (1 - p)) by the mask of rng_state, int64 (2,) [seed, offset] (the module docstring);
           attn_mask: SDPA's mask as a (batch, nheads, seqlen_q, seqlen_k) view (broadcast dimensions of stride 0,
           never expanded in memory): boolean (True = attend) or additive (added to the scaled scores)
        _drop: the varlen path's per-sequence dropout (replaces options' dropout_p and rng_state)

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v) in q.dtype, contiguous; 0 for a row that sees no key
        lse: (batch, nheads, seqlen_q) float32, natural-log sum of exp of the scores (and the sink);
           for a row that sees no key -inf, or the sink's value
    """
    if q.dtype in FLOAT8:  # dequantized to float32 and computed as float32 inputs; out in bf16
        q, k, v = dequantized(q, k, v, options.descale, torch.float32)
        out, lse = attention_forward(q, k, v, dataclasses.replace(options, descale=None))
        return out.to(output_dtype(FLOAT8[0])), lse
    drop = _drop if _drop is not None else _dropout(options.dropout_p, options.rng_state, q.shape[2], q.shape[1])
    route, _ = torch_kernel_route(q, k, v, options)
    softmax_scale, window_left, window_right = options.softmax_scale, options.window_left, options.window_right
    alibi_slopes, softcap, attn_mask = options.alibi_slopes, options.softcap, options.attn_mask
    if route is None:
        with _bf16_products(q.dtype):
            out, lse = _tiled_forward(q, k, v, softmax_scale, window_left, window_right, alibi_slopes, softcap, drop,
                                      attn_mask)  # fmt: skip
    elif route == "band":
        out, lse = _banded_forward(q, k, v, softmax_scale, window_left, window_right, alibi_slopes)
    else:
        out, lse = _fused_forward(q, k, v, softmax_scale, route == "causal", attn_mask)
    if options.learnable_sink is not None:
        out, lse = _add_sink(out, lse, options.learnable_sink)
    return out, lse


def _tiled_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    window_left: int | None,
    window_right: int | None,
    alibi_slopes: Tensor | None,
    softcap: float,
    drop: _Dropout | None,
    attn_mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``attention_forward`` by tiles with online softmax (the module docstring), without the sink."""
    B, Sq, H, _ = q.shape
    _, Sk, Hk, Dv = v.shape
    group = H // Hk
    dtype, mods, keys = _score_operands(q, k, softmax_scale, alibi_slopes, softcap)
    low = _operand_dtype(q.dtype)
    bound = _score_bound(q, k, mods, attn_mask)
    fixed = drop is None and _fixed_offset(bound, v, q.dtype)  # m_i stays 0
    if fixed:  # a column of ones: P V's last column is the sum of P as the product rounds it, O's denominator
        v = torch.cat([v, torch.ones(*v.shape[:3], 1, dtype=v.dtype)], dim=-1)
    values = _key_tiles(v, low)  # (B * Hk, N, Dv (+ 1)) each, operands of P V
    out = torch.empty(B, Sq, H, Dv, dtype=q.dtype)
    lse = torch.empty(B, H, Sq, dtype=torch.float32)
    tile_size = B * H * min(BLOCK_M, Sq) * min(BLOCK_N, Sk)
    scores = torch.empty(tile_size * (2 if softcap > 0.0 else 1), dtype=dtype)  # (``_scores``)
    probs = torch.empty(tile_size, dtype=low)
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        q_t = mods.query_tile(q, q0, q1, Hk)  # (B * Hk, gM, D)
        m_i = torch.full((*q_t.shape[:2], 1), 0.0 if fixed else torch.finfo(dtype).min, dtype=dtype)  # running max
        l_i = torch.zeros_like(m_i)  # running row sum of exp(s - m_i)
        acc = torch.zeros(*q_t.shape[:2], v.shape[-1], dtype=dtype)  # running sum of exp(s - m_i) v
        for k0 in _key_span(q0, q1, Sq, Sk, window_left, window_right):
            k1 = min(k0 + BLOCK_N, Sk)
            band = _tile_band(q0 + Sk - Sq - k0, q1 - q0, k1 - k0, window_left, window_right, dtype)
            s, _ = _scores(q_t, keys[k0 // BLOCK_N], mods, group, q0, k0, scores)
            _mask_tile(s, band, attn_mask, group, q0, q1, k0, k1)
            if fixed:  # exp(s) itself (``_fixed_offset``)
                p = _exp(s, None, band is not None)
            else:
                m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
                p = _exp(s, m_new, band is not None or 2.0 * bound > -_EXP_FLOOR)
                alpha = m_i.sub_(m_new).exp_()
                l_i.mul_(alpha)
                acc.mul_(alpha)
                m_i = m_new
            _mask_tile(p, band, attn_mask, group, q0, q1, k0, k1, probs=True)
            l_i.add_(p.sum(dim=-1, keepdim=True))
            if drop is not None:  # l_i keeps every probability; only P V sees the mask
                p.mul_(_dropout_keep(drop, B, Hk, group, q0, q1, k0, k1).view(p.shape))
            acc.add_(torch.bmm(_in_dtype(p, probs), values[k0 // BLOCK_N]))  # [gM, N] @ [N, Dv]
        if drop is not None:
            acc.mul_(1.0 / (1.0 - drop.p))
        norm = acc[..., Dv:] if fixed else l_i
        _store_query_tile(out, q0, q1, acc[..., :Dv].div_(norm.masked_fill(norm == 0, 1.0)))
        lse[:, :, q0:q1] = m_i.add_(l_i.log_()).view(B, H, q1 - q0)  # log 0 = -inf if nothing was seen
    return out, lse


@torch.no_grad()
def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    options: AttentionOptions,
    dlse: Tensor | None = None,
    dmask: Tensor | None = None,
    _drop: _Dropout | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention, by torch's fused kernel or by tiles recomputing P from the saved LSE
    (``torch_kernel_route`` decides).

    Args:
        dout: (batch, seqlen_q, nheads, headdim_v), gradient of ``out``
        q, k, v, options, _drop: as given to ``attention_forward`` (the dropout mask is regenerated;
           options.learnable_sink is unused: the LSE includes it, and its gradient comes from ``attention_delta``;
           options.deterministic is unused: both routes are deterministic)
        out: (batch, seqlen_q, nheads, headdim_v), as returned by ``attention_forward``
        lse: (batch, nheads, seqlen_q) float32, as returned by ``attention_forward``
        dlse: (batch, nheads, seqlen_q) float32 gradient of ``lse``, or None for zero
        dmask: None, or a (batch, nheads, seqlen_q, seqlen_k) float buffer that receives dS = P (dP - delta),
           the gradient at an additive mask before any reduction over its broadcast dimensions

    Returns:
        dq: (batch, seqlen_q, nheads, headdim) in q.dtype
        dk: (batch, seqlen_k, nheads_k, headdim) in k.dtype, summed over each group of query heads
        dv: (batch, seqlen_k, nheads_k, headdim_v) in v.dtype, likewise
    """
    drop = _drop if _drop is not None else _dropout(options.dropout_p, options.rng_state, q.shape[2], q.shape[1])
    route, _ = torch_kernel_route(q, k, v, options, dlse=dlse, dmask=dmask)
    softmax_scale, window_left, window_right = options.softmax_scale, options.window_left, options.window_right
    alibi_slopes, softcap, attn_mask = options.alibi_slopes, options.softcap, options.attn_mask
    if route == "band":
        return _banded_backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, alibi_slopes, dlse)
    if route is not None:
        return _fused_backward(dout, q, k, v, out, lse, softmax_scale, route == "causal", attn_mask, dlse)
    with _bf16_products(q.dtype):
        return _tiled_backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, alibi_slopes,
                               softcap, drop, attn_mask, dlse, dmask)  # fmt: skip


def _tiled_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
    window_left: int | None, window_right: int | None, alibi_slopes: Tensor | None, softcap: float,
    drop: _Dropout | None, attn_mask: Tensor | None, dlse: Tensor | None, dmask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``attention_backward`` by tiles, recomputing P from the saved LSE (the module docstring)."""
    B, Sq, H, D = q.shape
    _, Sk, Hk, Dv = v.shape
    group = H // Hk
    dtype, mods, keys = _score_operands(q, k, softmax_scale, alibi_slopes, softcap)
    low_dtype = _operand_dtype(q.dtype)
    floor = 2.0 * _score_bound(q, k, mods, attn_mask) + math.log(max(Sk, 1)) > -_EXP_FLOOR  # s - LSE may be below
    parts = 3 if _bf16_mode(q.dtype) else 1  # Delta's columns: bf16-exact parts under bf16 products
    ones = torch.ones(B, Sk, Hk, parts, dtype=v.dtype)
    values = _key_tiles(torch.cat([v, ones], dim=-1), dtype, transposed=True)  # (B * Hk, Dv + parts, N)
    keys_low = _key_tiles(k, low_dtype)  # (B * Hk, N, D) each, operands of dQ = dS K
    dq = torch.empty(q.shape, dtype=q.dtype)
    dk = torch.zeros(B * Hk, Sk, D, dtype=dtype)  # accumulators, heads-major
    dv = torch.zeros(B * Hk, Sk, Dv, dtype=dtype)
    tile_size = B * H * min(BLOCK_M, Sq) * min(BLOCK_N, Sk)
    scores = torch.empty(tile_size * (2 if softcap > 0.0 else 1), dtype=dtype)  # (``_scores``)
    dprobs, low = torch.empty(tile_size, dtype=dtype), torch.empty(tile_size, dtype=low_dtype)
    dp_scratch = torch.empty(tile_size, dtype=dtype)  # dP - Delta
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        q_low = _query_tile(q, q0, q1, Hk, low_dtype)  # (B * Hk, gM, D), operand of dK = dS^T Q
        q_t = mods.query_tile(q, q0, q1, Hk)
        do_low = _query_tile(dout, q0, q1, Hk, low_dtype)  # (B * Hk, gM, Dv)
        delta = _delta_tile(dout, out, dlse, q0, q1, Hk, dtype)  # (B * Hk, gM, 1)
        do_t = torch.cat([do_low.to(dtype), *_split(-delta, torch.bfloat16, parts, dtype)], dim=-1)
        lse_t = lse[:, :, q0:q1].reshape(delta.shape).to(dtype)
        lse_t = lse_t.masked_fill(lse_t == float("-inf"), 0.0)  # rows with no key: P = exp(-inf) = 0
        dq_t = torch.zeros(*q_t.shape[:2], D, dtype=dtype)
        for k0 in _key_span(q0, q1, Sq, Sk, window_left, window_right):
            k1 = min(k0 + BLOCK_N, Sk)
            band = _tile_band(q0 + Sk - Sq - k0, q1 - q0, k1 - k0, window_left, window_right, dtype)
            s, t = _scores(q_t, keys[k0 // BLOCK_N], mods, group, q0, k0, scores)
            _mask_tile(s, band, attn_mask, group, q0, q1, k0, k1)
            p = _exp(s, lse_t, band is not None or floor)  # (B * Hk, gM, N)
            _mask_tile(p, band, attn_mask, group, q0, q1, k0, k1, probs=True)
            # dP - Delta = [dO, -Delta] [V, 1]^T: [gM, Dv + 1] @ [Dv + 1, N]
            dp = torch.bmm(do_t, values[k0 // BLOCK_N], out=_scratch(dp_scratch, p.shape))
            p_kept = p
            if drop is not None:  # the gradient at P is Z / (1 - p) * dP; dV's 1 / (1 - p) is applied at the end
                keep = _dropout_keep(drop, B, Hk, group, q0, q1, k0, k1).view(p.shape)
                p_kept = p * keep
                kept = keep.to(dtype).mul_(1.0 / (1.0 - drop.p))  # Z / (1 - p) dP - Delta from dP - Delta:
                dp = torch.mul(dp, kept, out=_scratch(dprobs, p.shape)).add_(kept.sub_(1.0).mul_(delta))
            dv[:, k0:k1] += torch.bmm(_in_dtype(p_kept, low).transpose(1, 2), do_low)  # [N, gM] @ [gM, Dv]
            ds = p.mul_(dp)  # reuses p's memory: p is not needed after this
            if dmask is not None:  # the gradient at the mask: dS before the cap's derivative
                dmask[:, :, q0:q1, k0:k1] = ds.view(B, H, q1 - q0, k1 - k0)
            if t is not None:
                ds.addcmul_(ds, t.mul_(t), value=-1.0)  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
            ds_low = _in_dtype(ds, low)
            dq_t += torch.bmm(ds_low, keys_low[k0 // BLOCK_N])  # [gM, N] @ [N, D]
            dk[:, k0:k1] += torch.bmm(ds_low.transpose(1, 2), q_low)  # [N, gM] @ [gM, D]
        _store_query_tile(dq, q0, q1, dq_t.mul_(softmax_scale))
    if drop is not None:
        dv.mul_(1.0 / (1.0 - drop.p))
    return dq, _heads_minor(dk.mul_(softmax_scale), k), _heads_minor(dv, v)


def _split(x: Tensor, dtype: torch.dtype, parts: int = 2, result_dtype: torch.dtype | None = None) -> list[Tensor]:
    """x as a sum of ``parts`` tensors whose values ``dtype`` holds, each what the ones before leave of x rounded to
    ``dtype`` (x itself if ``parts`` is 1), so that a product with a low-precision operand [A, hi, lo] sees x to
    ``parts`` times its bits (-dlse as columns of dO for torch's kernel, -Delta as columns of dO under
    ``_bf16_products``). The parts are returned in ``result_dtype`` (default ``dtype``)."""
    if parts == 1:
        return [x]
    found = []
    for _ in range(parts - 1):
        found.append(x.to(dtype))
        x = x - found[-1]
    found.append(x.to(dtype))
    return [part.to(result_dtype or dtype) for part in found]


def _heads_minor(x: Tensor, like: Tensor) -> Tensor:
    """A heads-major (B * Hk, S, D) accumulator as a contiguous (B, S, Hk, D) tensor of like's dtype."""
    B, S, Hk, D = like.shape
    return torch.empty(like.shape, dtype=like.dtype).copy_(x.view(B, Hk, S, D).transpose(1, 2))


@torch.no_grad()
def attention_delta(dout: Tensor, out: Tensor, dlse: Tensor | None = None) -> Tensor:
    """Delta = rowsum(dout * out) - dlse, (batch, nheads, seqlen_q), float32 (float64 for float64 inputs).

    dout, out: (batch, seqlen_q, nheads, headdim_v); dlse: (batch, nheads, seqlen_q) or None.
    """
    B, Sq, H, _ = out.shape
    dtype = _compute_dtype(out.dtype)
    delta = torch.empty(B, H, Sq, dtype=dtype)
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        delta[:, :, q0:q1] = _delta_tile(dout, out, dlse, q0, q1, H, dtype).view(B, H, q1 - q0)
    return delta


def _sequences(packing: Packing) -> list[tuple[int, int, int, int, int]]:
    """(b, q0, q1, k0, k1) per sequence: its rows of the packed q and k."""
    cq, ck = packing.cu_seqlens_q.tolist(), packing.cu_seqlens_k.tolist()
    return [(b, cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _sequence_options(options: AttentionOptions, b: int) -> AttentionOptions:
    """The options of sequence b of a packed batch: its (nheads,) slopes where alibi_slopes is (batch, nheads)."""
    slopes = options.alibi_slopes
    if slopes is None or slopes.dim() == 1:
        return options
    return dataclasses.replace(options, alibi_slopes=slopes[b])


@torch.no_grad()
def varlen_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, packing: Packing, options: AttentionOptions
) -> tuple[Tensor, Tensor]:
    """``attention_forward`` on a variable-length batch (``options.Packing``), one sequence (a B=1 view) at a time.

    q (total_q, nheads, headdim), k (total_k, nheads_k, headdim), v (total_k, nheads_k, headdim_v). Returns out
    (total_q, nheads, headdim_v) and lse (nheads, total_q) float32. The max_seqlens are not needed here. Dropout
    row ids are h * total_q + (the query's token index), unique over the packed batch. With a block_table, k and v
    are pages (num_blocks, page_block_size, nheads_k, headdim[_v]), gathered first into those packed keys
    (``flashtile.paged``).
    """
    if packing.block_table is not None:
        slots = paged.packed_slots(packing.block_table, packing.cu_seqlens_k, k)
        k, v = k[slots], v[slots]
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for b, q0, q1, k0, k1 in _sequences(packing):
        if q1 == q0:
            continue
        o_b, lse_b = attention_forward(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], _sequence_options(options, b),
            _drop=_dropout(options.dropout_p, options.rng_state, q.shape[1], q.shape[0], row0=q0, stride_b=0),
        )  # fmt: skip
        out[q0:q1] = o_b[0]
        lse[:, q0:q1] = lse_b[0]
    return out, lse


@torch.no_grad()
def varlen_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, packing: Packing,
    options: AttentionOptions, dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``attention_backward`` on a variable-length batch, one sequence at a time (layouts as in
    ``varlen_attention_forward``; lse and dlse (nheads, total_q)). A sequence without queries or keys
    contributes zero gradients."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, q0, q1, k0, k1 in _sequences(packing):
        if q1 == q0 or k1 == k0:
            continue
        dq_b, dk_b, dv_b = attention_backward(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            lse[None, :, q0:q1], _sequence_options(options, b), None if dlse is None else dlse[None, :, q0:q1],
            _drop=_dropout(options.dropout_p, options.rng_state, q.shape[1], q.shape[0], row0=q0, stride_b=0),
        )  # fmt: skip
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = dq_b[0], dk_b[0], dv_b[0]
    return dq, dk, dv
