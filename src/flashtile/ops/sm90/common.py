"""What the sm_90 Gluon forward (``forward``) and backward (``backward``) share: Gluon's Hopper API under the names
both Triton versions answer to, the wgmma and shared-memory layouts, the tensor descriptors of (batch, seqlen,
nheads, headdim) tensors (2-D rows views, and head-major ones for layouts whose heads are not side by side) with the
kernels' views of their boxes, and the launch past Triton's binder with its key."""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.ops import _launch
from flashtile.ops.attention.tiles import alibi_batch_stride, score_scales
from flashtile.ops.common.descriptors import per_layout, tma_ready
from flashtile.ops.common.math import LOG2E
from flashtile.options import AttentionOptions

# Gluon's TMA copies are tma.async_load / tma.async_store since triton 3.9, where the older names (the only ones
# triton 3.6 and 3.7 have) raise; the arguments are the same. Both kernels call them by these names.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# Triton 3.6 and 3.7 differ in mbarrier.expect's byte-count keyword (bytes / bytes_per_cta): it is always
# passed positionally here.

# Triton 3.6: gl.thread_barrier(); 3.7: gl.barrier() (both: a barrier among the warps of the calling partition).
partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def tanh_approx(x):
    """tanh of an fp32 tensor by the SFU's tanh.approx.f32 (one instruction, as exp2; relative error about 2**-11,
    below bf16's rounding): the softcap's in both kernels."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def capped_scores(s, qk_scale, softcap, SOFTCAP: gl.constexpr):
    """Scores in log2 units from raw products ``s`` (fp32), before any bias: s * qk_scale, or softcap * tanh(s *
    qk_scale) with SOFTCAP (the launchers pass ``tiles.score_scales``' qk_scale and softcap: scale / cap and cap *
    log2(e)), and tanh of the scaled products with SOFTCAP (the backward's 1 - tanh^2), s otherwise (unused)."""
    if SOFTCAP:
        t = tanh_approx(s * qk_scale)
        x = t * softcap
    else:
        t = s
        x = s * qk_scale
    return x, t


@gluon.jit
def alibi_slope(alibi_ptr, row, head, ALIBI: gl.constexpr):
    """The ALiBi slope at alibi_ptr + row + head in log2 units (row: the batch entry's offset, its index times the
    slopes' batch stride, 0 for (nheads,) slopes), 0.0 without ALiBi (alibi_ptr then None)."""
    if ALIBI:
        slope = gl.load(alibi_ptr + row + head) * LOG2E
    else:
        slope = 0.0
    return slope


@gluon.jit
def alibi_bias(queries, keys, slope, CAUSAL: gl.constexpr):
    """flash_attn's ALiBi bias in log2 units, -slope * |query + seqlen_k - seqlen_q - key|, from ``queries`` (query +
    seqlen_k - seqlen_q) and ``keys`` (the key indices), int32 vectors broadcast against each other; slope in log2
    units. With CAUSAL slope * key - slope * (query + seqlen_k - seqlen_q), one product per row and per column: the
    same where the causal mask leaves the score (key <= query + seqlen_k - seqlen_q), and no integer tile of the
    distances to hold."""
    if CAUSAL:
        bias = keys.to(gl.float32) * slope - queries.to(gl.float32) * slope
    else:
        bias = -slope * gl.abs(queries - keys).to(gl.float32)
    return bias


@gluon.constexpr_function
def mma_layout(n):
    # one warpgroup, wgmma m64nNk16 tiles (bf16/fp16: k = 16), N = the full tile width
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


Window = tuple[int | None, int | None]
"""flash_attn's sliding window as ``AttentionOptions`` holds it: (window_left, window_right), None for a side
without a bound."""


def window_of(options: AttentionOptions) -> Window | None:
    """The launchers' ``window`` for these options: (window_left, window_right) where the window hides more than the
    causal mask does (``options.local``), else None (causal or no mask)."""
    return (options.window_left, options.window_right) if options.local else None


def window_args(window: Window | None, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The kernels' window_left and window_right arguments: ``window``'s sides, an unbounded side as seqlen_q +
    seqlen_k (past every key: query i's keys then run from below 0 to past seqlen_k); (0, 0), unread, without a
    window."""
    if window is None:
        return 0, 0
    return tuple(seqlen_q + seqlen_k if side is None else side for side in window)


class ScoreMods(NamedTuple):
    """A launch's score modifications as both kernels take them (``capped_scores``, ``alibi_bias``): qk_scale and
    softcap from ``tiles.score_scales`` (softcap 0.0: off), and the ALiBi slopes or None."""

    qk_scale: float
    softcap: float
    alibi_slopes: torch.Tensor | None

    @classmethod
    def of(cls, softmax_scale: float, softcap: float, alibi_slopes: torch.Tensor | None) -> ScoreMods:
        return cls(*score_scales(softmax_scale, softcap), alibi_slopes)

    @property
    def constexprs(self) -> dict:
        return dict(SOFTCAP=self.softcap != 0.0, ALIBI=self.alibi_slopes is not None)

    @property
    def args(self) -> tuple:
        """The kernels' softcap, alibi_ptr and alibi_stride_b arguments."""
        return self.softcap, self.alibi_slopes, alibi_batch_stride(self.alibi_slopes)

    @property
    def key(self) -> tuple:
        """What a plan follows from (read on every launch): whether softcap is on, and the slopes' dimensions and
        16-byte alignment (a launch key's part, ``launch_key``), None without ALiBi."""
        slopes = self.alibi_slopes
        return self.softcap != 0.0, None if slopes is None else (slopes.dim(), slopes.data_ptr() % 16 == 0)


WINDOW_HEAD_DIMS = {"forward": (128, 256), "backward": (64, 128, 256)}
"""Head dims whose sliding-window calls take each sm_90 kernel (``window_refusal``): at each, the faster one (H100,
bf16, B=4, H=16, N=4096, a causal 1024-key window, flash_attn_func on (B, H, N, D) views, 2026-12-07). At D=64 the
Triton forward, 0.203 ms against the Gluon kernel's 0.253 (0.208-0.211 with two consumer warpgroups in an earlier
run), and the Gluon backward, 0.537 ms against 0.702 (do_bench medians of each pass; the device time of a
forward+backward 0.739-0.745 ms with it, 0.905-0.910 with the Triton one). At D=128 and 256 both Gluon kernels
(D=128: 0.280-0.288 against 0.333-0.337 ms forward, 1.14-1.25 against 1.45 ms forward+backward)."""


def window_refusal(options: AttentionOptions, head_dim: int, kernel: Literal["forward", "backward"]) -> str | None:
    """Why a sliding window keeps a call of this head dim off the sm_90 ``kernel`` ("forward" or "backward";
    ``WINDOW_HEAD_DIMS``), or None."""
    dims = WINDOW_HEAD_DIMS[kernel]
    if options.local and head_dim not in dims:
        return f"a sliding window at head dim {head_dim} (the {kernel} takes windows at {', '.join(map(str, dims))})"
    return None


def option_refusals(options: AttentionOptions, varlen: bool) -> tuple[str | None, ...]:
    """Why the options of a call keep it off both sm_90 kernels (None where a condition holds): they compute
    attention, causal, with a sliding window or with neither, softcap and ALiBi (not with a window), over a (batch,
    seqlen, nheads, headdim) batch, with softmax_scale > 0 (the forward scales masked (-inf) scores: 0 * -inf would
    be NaN)."""
    return (
        "ALiBi with a sliding window" if options.alibi_slopes is not None and options.local else None,
        "dropout" if options.dropout_p > 0.0 else None,
        "an attn_mask" if options.attn_mask is not None else None,
        "a packed variable-length batch" if varlen else None,
        None if options.softmax_scale > 0 else f"softmax_scale {options.softmax_scale} (> 0 only)",
    )


def dtype_refusal(q: torch.Tensor) -> str | None:
    return None if q.dtype in (torch.bfloat16, torch.float16) else f"dtype {q.dtype} (bf16 or fp16 only)"


def head_dim_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, configs: dict) -> str | None:
    """Why the head dims of q, k, v do not fit a kernel whose CONFIGS are ``configs`` (one of them for all three)."""
    head_dims = (q.shape[3], k.shape[3], v.shape[3])
    if head_dims[0] in configs and head_dims.count(head_dims[0]) == 3:
        return None
    return f"head dims {head_dims} of q, k, v (one of {sorted(configs)} for all three)"


def rows_view_ok(x: torch.Tensor) -> bool:
    """Whether (batch, seqlen, nheads, headdim) ``x`` reads as the 2-D (batch * seqlen, nheads * headdim) rows
    of a tensor descriptor: heads of a token contiguous, tokens evenly strided across batch entries, and the
    start address and the row stride 16-byte aligned."""
    batch, seqlen, nheads, head_dim = x.shape
    s_b, s_s, s_h, s_d = x.stride()
    evenly = batch == 1 or s_b == seqlen * s_s
    return s_d == 1 and s_h == head_dim and evenly and (s_s * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


def head_major_form(*tensors: torch.Tensor) -> bool:
    """Whether tensors a kernel reads in one form (at the same coordinates: the forward's q and out, k and v; the
    backward's q and dout, k, v, dk and dv) go through head-major descriptors (``head_major_descriptor``): where any
    of them has no rows view (``rows_view_ok``: its heads are not side by side, as in torch's (batch, nheads, seqlen,
    headdim) tensors). The kernels' code for rows views is what it was before head-major descriptors."""
    return not all(map(rows_view_ok, tensors))


def layout_refusal(*forms: dict[str, torch.Tensor]) -> str | None:
    """Which tensors a kernel's descriptors cannot read, or None. Each of ``forms`` names the tensors it reads in one
    form (``head_major_form``): through rows views where each has one, else through head-major descriptors, which
    read any layout whose last dimension is contiguous and whose other strides are 16-byte multiples
    (``descriptors.tma_ready``)."""
    bad = [name for form in forms if head_major_form(*form.values()) for name, x in form.items() if not tma_ready(x)]
    return f"layouts a tensor descriptor cannot read ({', '.join(bad)})" if bad else None


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA block: [rows, head_dim], [1, rows, head_dim] or [1, 1, rows,
    head_dim], all with the 128-byte swizzle of head_dim 64 and above (what TMA writes and wgmma reads); float32 for
    the backward's dQ reduce (dq_accum's ``descriptor``), 128-byte swizzle from 32 columns on."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


@per_layout
def descriptor(x: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """A tensor descriptor of the (batch * seqlen, nheads * headdim) rows of ``x`` (``rows_view_ok``) with
    [rows, cols] tiles, cols = headdim by default (the backward's dq_accum takes [rows, DQ_TILE_COLS] blocks): a
    tile never crosses a batch entry when seqlen is a multiple of rows (the Gluon backward's), nor a head when
    cols divides headdim."""
    batch, seqlen, nheads, head_dim = x.shape
    block = [rows, cols or head_dim]
    layout = shared_layout(tuple(block), x.dtype)
    return TensorDescriptor(x, [batch * seqlen, nheads * head_dim], [x.stride(1), 1], block, layout)


@per_layout
def head_major_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A rank-4 tensor descriptor of the (batch, nheads, seqlen, headdim) view of ``x`` (``descriptors.tma_ready``)
    with [1, 1, rows, headdim] boxes: for layouts the rows views cannot read (heads of a token apart, as in torch's
    (batch, nheads, seqlen, headdim) tensors). A box never crosses a batch entry or a head: the copy engine fills its
    rows past seqlen with zeros on loads and drops them on stores."""
    batch, seqlen, nheads, head_dim = x.shape
    s_b, s_s, s_h, _ = x.stride()
    layout = shared_layout((1, 1, rows, head_dim), x.dtype)
    return TensorDescriptor(x, [batch, nheads, seqlen, head_dim], [s_b, s_h, s_s, 1], [1, 1, rows, head_dim], layout)


@gluon.constexpr_function
def head_major(box):
    """Whether a descriptor of block shape ``box`` is ``head_major_descriptor``'s (rank 4: [1, 1, rows, D] boxes of
    the (batch, nheads, seqlen, headdim) view) rather than a rows view's ([rows, D] or [1, rows, D])."""
    return len(box) == 4


@gluon.constexpr_function
def box_buffers(n, box):
    """The shape of n shared-memory buffers of a descriptor's box ``box`` (its block shape)."""
    return [n, *box]


@gluon.jit
def box_tile(boxes, i):
    """Buffer i of ``boxes`` (``box_buffers`` in a descriptor's layout: what its TMA copies write and read) as the
    [rows, D] tile of wgmma and local stores: a [rows, D] box as it is; a [1, rows, D] or [1, 1, rows, D] one viewed
    as rows x D (the same bytes in the same 128-byte swizzle)."""
    box = boxes.index(i)
    if len(box.shape) > 2:
        box = box.reshape([box.shape[-2], box.shape[-1]])
    return box


def launch_key(kernel, args: tuple, constexprs: list, options: dict) -> tuple:
    """What Triton specializes a compiled Gluon kernel of this package on, for these arguments, these constexpr
    values (in parameter order) and options (the kernel by ``id``, as in ``_launch.specialization_key``): the device,
    every constexpr and option, each tensor's dtype and 16-byte alignment, each descriptor's dtype and box (its
    swizzle follows from them, ``shared_layout``), whether each int fits in 32 bits, and the type of any other
    argument. The kernels list their int parameters in ``do_not_specialize`` (tests/test_gluon_sm90.py checks the
    launches' ints against it), so no other property of an int (1, or a multiple of 16) changes the compiled code and
    one compile serves every length; floats compile as fp32 whatever their value."""
    parts = []
    for a in args:
        kind = type(a)
        if kind is int:
            parts.append(-(2**31) <= a < 2**31)
        elif kind is TensorDescriptor:
            parts.append((a.base.dtype, *a.block_shape))
        elif isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            parts.append(kind)
    return (id(kernel), torch.cuda.current_device(), *options.items(), *constexprs, *parts)


GLUON_OPTIONS = {"num_warps": 4}
"""Triton's options of every Gluon launch (its warp count is the default partition's; workers set their own)."""


def keyed_for(kernel, args: tuple, constexprs: dict) -> tuple[list, tuple]:
    """``launch``'s ``keyed`` for these arguments: the constexprs' values in parameter order and the ``launch_key``."""
    tail = _launch.constexpr_tail(kernel, args, constexprs)
    return tail, launch_key(kernel, args, tail, GLUON_OPTIONS)


def launch_through_binder(kernel, grid: tuple[int, int, int], args: tuple, constexprs: dict, keyed=None):
    """``kernel[grid](*args, **constexprs, num_warps=4)``: a launch through Triton's JITFunction.run (binding,
    specializing and hashing every argument, compiling on a new key; ``keyed`` is not used); returns the compiled
    kernel."""
    return kernel[grid](*args, **constexprs, **GLUON_OPTIONS)


def launch(
    kernel, grid: tuple[int, int, int], args: tuple, constexprs: dict, keyed: tuple[list, tuple] | None = None
) -> None:
    """The first launch of a ``launch_key`` through Triton's binder (as ``launch_through_binder``), later ones past
    it, on the current device and stream: ``ops._launch.launch`` with this module's key and 4 warps.

    ``JITFunction.run`` binds, specializes and hashes every argument on each call: in the traced host path of the H200
    machine the forward's JITFunction.run took 50.5 µs per call, 19.9 of them in the launcher that still runs here.
    Against binding every call (latency.py's flashtile-binder rows, median of three rounds with the order alternating,
    alone on the machine): host time per forward 119 / 114 / 108 / 113 µs against 127 / 188 / 128 / 138 (B*N = 16k,
    D=128: N=512 full, causal; N=1k full, causal): it saves 8-75 µs (two earlier runs had disagreed, each beside other
    work on the machine or in one round). The first launch of a key goes through the binder (compiling, or loading from
    Triton's disk cache) and keeps the compiled kernel it returns; later launches of the key hand that kernel the same
    arguments directly: ``args`` are the kernel's leading non-constexpr parameters in order, ``constexprs`` name all the
    rest. ``keyed``: the constexprs' values in parameter order and the ``launch_key`` of these arguments, kept by the
    caller (``forward.ForwardPlan``); computed here when None.
    """
    if keyed is None:
        keyed = keyed_for(kernel, args, constexprs)
    _launch.launch_keyed(kernel, grid, args, constexprs, *keyed, GLUON_OPTIONS)
