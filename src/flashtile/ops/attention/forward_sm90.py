"""FlashAttention forward for Hopper (sm_90) in Gluon: warp specialized, FA-3 style.

On an H100/H200 (``configs.gluon_device``) the forwards that qualify (``qualifies``, and the launcher in forward.py:
no options) run this kernel instead of the portable Triton one (which every other GPU and the CPU
interpreter run): no dropout, attn_mask, ALiBi, softcap, sink, window or packed batch; causal or not; head
dim 128 or 256 for q, k and v (``CONFIGS``; at 64 the Triton kernel was as fast); bf16/fp16; any seqlen_q
and seqlen_k >= 1; heads of a token contiguous and tokens of a batch entry evenly strided (a contiguous
tensor, or q/k/v sliced from a packed qkv). ``FLASHTILE_GLUON=0`` turns it off (``flashtile._backend.GLUON``).
Gluon has no CPU interpreter: tests/sm90_compile.py compiles it for sm_90 without a GPU, and the GPU tests run
it against the oracle.

Measured on an H200 (D=128, bf16, TFLOP/s; benchmarks/results/2026-11-30-h200x2-gluon-3a0d6e0.log): N=1k
555 / 389 causal against 393 / 316 for the Triton kernel, N=4k 642 / 530 against 536 / 478, N=16k 646 / 586
against 548 / 541 (cuDNN in the same session's table: 565 / 437, 605 / 541, 630 / 577). Those runs read
through 2-D (batch * seqlen, nheads * headdim) descriptors (lengths multiples of 128 only). With the rank-3
ones below (benchmarks/results/2026-11-30-h200x2-quick-af06b80.md): N=1k 553 / 389, N=4k 655 / 537, N=16k
647 / 615; lengths that are not multiples of 128, which took the Triton kernel before, B=4 N=4000 624 / 521
against 543 / 463 and B=8 N=1000 causal 340 against 273 (results/2026-11-30-h200x2-branchcmp-04d26b7.log).

q, k, v and out are read and written through rank-3 tensor descriptors of the (batch, seqlen, nheads *
headdim) view with [1, rows, headdim] boxes (``batch_descriptor``), so a tile never crosses a batch entry:
the copy engine fills a box's rows past seqlen with zeros on loads and drops them on stores. Keys past
seqlen_k in the last key tile (zeros) get score -inf; query rows past seqlen_q (zeros) compute rows that the
O store drops and the LSE store masks. Outputs: out (B, Sq, H, D) and lse (B, H, Sq) fp32, natural log; a
query row that sees no key (causal, seqlen_q > seqlen_k) gets out 0 and lse -inf, as the Triton kernel.

One CTA per (2 * M_WG query rows, batch * head):
  * producer partition, 1 warp: TMA loads of the two Q tiles, then K and V tiles into a ring of STAGES
    shared-memory buffers (each a [1, rows, headdim] box, which ``_tile`` views as the [rows, headdim] tile
    wgmma reads); k_ready/v_ready (tx-count) barriers signal the consumers, k_empty/v_empty
    (count 2, one arrival per consumer warpgroup) signal the producer that a slot is free.
  * two consumer warpgroups (the default partition = WG 0, one 4-warp worker = WG 1), M_WG query rows each:
    S = Q K^T (wgmma, A and B from shared memory), online softmax in base 2, O += P V (wgmma, P from
    registers). Iteration i issues S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back, waits only for S_i,
    does softmax_i while P_{i-1} V_{i-1} runs, then waits for it and rescales O. With PINGPONG two mbarriers
    hand a "turn" between the warpgroups so one issues its two products while the other does its softmax
    (FA-3's warp scheduler barriers).
  * epilogue: O / l cast to the input dtype, written to the (now free) Q tile, TMA store; lse by masked stores.
Causal launches take the heaviest query tiles first.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.ops.attention.configs import cdiv, head_grid
from flashtile.ops.attention.tiles import LN2, LOG2E

CONFIGS = {
    128: {"M_WG": 64, "BLOCK_N": 128, "STAGES": 2, "PINGPONG": True, "CONSUMER_REGS": 240, "PRODUCER_REGS": 24},
    # [64, 256] fp32 output accumulators: 64-key tiles (S and P stay small); two stages fill 197 KiB
    256: {"M_WG": 64, "BLOCK_N": 64, "STAGES": 2, "PINGPONG": True, "CONSUMER_REGS": 240, "PRODUCER_REGS": 24},
}
"""Per head dim this path serves: query rows per consumer warpgroup, key rows per tile, K/V ring depth,
ping-pong, registers per thread of the consumers and the producer (setmaxnreg). D=128: 164 KiB of shared
memory, D=256: 197 KiB; no spills (tests/sm90_compile.py). At D=64 the Triton kernel was as fast."""
ROWS = 2 * CONFIGS[128]["M_WG"]
"""Query rows per CTA (= BLOCK_N); the Gluon backward's lengths must be multiples of this (``descriptor``)."""

# Triton 3.6 and 3.7 differ in mbarrier.expect's byte-count keyword (bytes / bytes_per_cta): it is always
# passed positionally here.


# ------------------------------------------------------------------------------------------------ layouts
@gluon.constexpr_function
def mma_layout(n):
    # one warpgroup, wgmma m64nNk16 tiles (bf16/fp16: k = 16), N = the full tile width
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _tile(boxes, i):
    """Buffer i of ``boxes`` ([n, 1, rows, D] shared memory in a rank-3 descriptor's layout, what its TMA copies
    write and read) as the [rows, D] tile of wgmma and local stores: the same bytes in the same 128-byte
    swizzle (a [1, rows, D] box lands as rows x D)."""
    box = boxes.index(i)
    return box.reshape([box.shape[1], box.shape[2]])


# ------------------------------------------------------------------------------------------------ producer
@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_bar,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    b,
    m0,
    q_col,
    kv_col,
    n_blocks,
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    # Coordinates are (batch entry, row, column) of the (batch, seqlen, nheads * headdim) view. A box that
    # reaches past seqlen (or lies wholly past it) is zero-filled there and still completes its full byte
    # count on the barrier, so the expected bytes are always the box's.
    # Q tiles of both consumer warpgroups
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, m0 + w * M_WG, q_col], q_bar.index(w), q_smem.index(w))
    for i in range(n_blocks):
        s = i % STAGES
        # a fresh barrier passes a wait on parity 1, so the first round through the ring does not block
        ph = ((i // STAGES) & 1) ^ 1
        row = i * BLOCK_N
        mbarrier.wait(k_empty.index(s), ph)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, row, kv_col], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, row, kv_col], v_ready.index(s), v_smem.index(s))


# ------------------------------------------------------------------------------------------------ consumer
@gluon.jit
def _softmax_step(
    s_acc,
    m_i,
    l_i,
    qk_scale,
    kv_start,
    q_pos0,
    diag_off,
    seqlen_k,
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    EVEN_K: gl.constexpr,
):
    """One online-softmax step on the raw scores tile s_acc [M_WG, BLOCK_N] (fp32, mma layout) of keys
    kv_start.. and query rows q_pos0.. . m_i is kept in scaled log2 units (max of s * softmax_scale *
    log2(e)). Returns p (fp32), alpha, m_new, l_new."""
    s_layout: gl.constexpr = s_acc.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    if CAUSAL:
        # Only tiles that cross the diagonal of this warpgroup's rows need the mask. It also hides the keys
        # past seqlen_k from every query row below seqlen_q (cols <= row + seqlen_k - seqlen_q < seqlen_k),
        # and a tile with such keys crosses the diagonal of any warpgroup that has such a row.
        if kv_start + BLOCK_N > q_pos0 + diag_off + 1:
            rows = q_pos0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, s_layout))
            cols = kv_start + gl.arange(0, BLOCK_N, layout=col_layout)
            keep = cols[None, :] <= (rows + diag_off)[:, None]
            s_acc = gl.where(keep, s_acc, gl.full(s_acc.shape, float("-inf"), gl.float32, s_layout))
    elif not EVEN_K:
        # (EVEN_K, seqlen_k a multiple of BLOCK_N, compiles this out: aligned full forwards ran ~3% slower on
        # the H200 with the check)
        if kv_start + BLOCK_N > seqlen_k:
            # the last tile: its keys past seqlen_k are zeros
            cols = kv_start + gl.arange(0, BLOCK_N, layout=col_layout)
            keep = cols[None, :] < seqlen_k
            s_acc = gl.where(keep, s_acc, gl.full(s_acc.shape, float("-inf"), gl.float32, s_layout))
    m_new = gl.maximum(m_i, gl.max(s_acc, 1) * qk_scale)
    if CAUSAL:
        # rows that have seen no key yet (only when seqlen_q > seqlen_k): keep exp2 finite
        m_use = gl.where(m_new == float("-inf"), gl.zeros_like(m_new), m_new)
    else:
        m_use = m_new
    p = gl.exp2(s_acc * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    args,
    M_WG: gl.constexpr,
    HEAD_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    EVEN_K: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """One consumer warpgroup (WG 0 or 1): query rows q_pos0 + WG * M_WG.. of the CTA's tile; ``args``: the
    kernel's consumer_args (its runtime values, the same for both warpgroups)."""
    (
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_bar,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        turn,
        lse_ptr,
        lse_off,
        b,
        col,
        q_pos0,
        diag_off,
        seqlen_q,
        seqlen_k,
        n_blocks,
        qk_scale,
    ) = args
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_pos0 = q_pos0 + WG * M_WG
    q_tile = _tile(q_smem, WG)
    my_turn = turn.index(WG)
    other_turn = turn.index(1 - WG)
    # WG 0 starts with the turn (parity 1 on a fresh barrier passes), WG 1 waits for WG 0's first hand-off
    turn_ph = 1 - WG

    s_zero = gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([M_WG, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([M_WG], float("-inf"), gl.float32, row_s)
    l_i = gl.full([M_WG], 0.0, gl.float32, row_s)

    mbarrier.wait(q_bar.index(WG), 0)

    # ---- prologue: S_0 and softmax_0
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(my_turn, turn_ph)
        turn_ph ^= 1
    k_tile = _tile(k_smem, 0)
    s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn, count=1)
    s_acc, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_tile, k_tile))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_step(
        s_acc, m_i, l_i, qk_scale, 0, q_pos0, diag_off, seqlen_k, M_WG, BLOCK_N, CAUSAL, EVEN_K
    )
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    # ---- steady state: S_i = Q K_i^T and O += P_{i-1} V_{i-1} in flight together
    for i in range(1, n_blocks):
        s = i % STAGES
        ph = (i // STAGES) & 1
        sp = (i - 1) % STAGES
        php = ((i - 1) // STAGES) & 1
        mbarrier.wait(k_ready.index(s), ph)
        if PINGPONG:
            mbarrier.wait(my_turn, turn_ph)
            turn_ph ^= 1
        k_tile = _tile(k_smem, s)
        s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sp), php)
        v_tile = _tile(v_smem, sp)
        acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn, count=1)
        # wgmma groups retire in order: <= 1 outstanding means S_i is done
        s_acc, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_tile, k_tile))
        mbarrier.arrive(k_empty.index(s), count=1)
        p, alpha, m_i, l_i = _softmax_step(
            s_acc, m_i, l_i, qk_scale, i * BLOCK_N, q_pos0, diag_off, seqlen_k, M_WG, BLOCK_N, CAUSAL, EVEN_K
        )
        acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, v_tile))
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    # ---- epilogue: O += P_{n-1} V_{n-1}
    sl = (n_blocks - 1) % STAGES
    phl = ((n_blocks - 1) // STAGES) & 1
    mbarrier.wait(v_ready.index(sl), phl)
    v_tile = _tile(v_smem, sl)
    acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, v_tile))
    mbarrier.arrive(v_empty.index(sl), count=1)

    # ---- normalize, store O through the Q tile's shared memory (rows past seqlen_q are dropped), store lse
    l_safe = gl.where(l_i == 0.0, gl.full_like(l_i, 1.0), l_i)
    o = acc / gl.convert_layout(l_safe, row_o)[:, None]
    q_tile.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, q_pos0, col], q_smem.index(WG))

    lse = (m_i + gl.log2(l_i)) * LN2  # l_i == 0 (no key seen) gives -inf
    rows = q_pos0 + gl.arange(0, M_WG, layout=row_s)
    gl.store(lse_ptr + lse_off + rows, lse, mask=rows < seqlen_q)
    tma.store_wait(0)


# ------------------------------------------------------------------------------------------------ kernel
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "nheads", "group"])  # ``launch``
def _attention_forward_sm90_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    lse_ptr,
    qk_scale,
    seqlen_q,
    seqlen_k,
    nheads,
    group,
    HEAD_D: gl.constexpr,
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    EVEN_K: gl.constexpr,
    PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 2 * M_WG
    pid_m = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    bh = b * nheads + h
    if CAUSAL:
        # heaviest query tiles first
        pid_m = gl.num_programs(0) - 1 - pid_m
    m0 = pid_m * BLOCK_M
    diag_off = seqlen_k - seqlen_q
    if CAUSAL:
        kv_end = gl.minimum(seqlen_k, m0 + BLOCK_M + diag_off)
        kv_end = gl.maximum(kv_end, 1)  # a tile that sees no key still runs one (fully masked) block
    else:
        kv_end = seqlen_k
    n_blocks = gl.cdiv(kv_end, BLOCK_N)

    col = h * HEAD_D
    kv_col = (h // group) * HEAD_D
    lse_off = bh.to(gl.int64) * seqlen_q

    dtype: gl.constexpr = q_desc.dtype
    # [1, rows, HEAD_D] boxes of the descriptors, viewed as [rows, HEAD_D] tiles by the consumers (_tile)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, M_WG, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_D], v_desc.layout)

    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(s), count=2)

    # constexprs travel as separate arguments (inside a tuple they would arrive as tensors); the runtime
    # arguments of both consumer warpgroups as one tuple
    consumer_args = (
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_bar,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        turn,
        lse_ptr,
        lse_off,
        b,
        col,
        m0,
        diag_off,
        seqlen_q,
        seqlen_k,
        n_blocks,
        qk_scale,
    )
    gl.warp_specialize(
        [
            (_consumer, (0, consumer_args, M_WG, HEAD_D, BLOCK_N, STAGES, CAUSAL, EVEN_K, PINGPONG)),
            (_consumer, (1, consumer_args, M_WG, HEAD_D, BLOCK_N, STAGES, CAUSAL, EVEN_K, PINGPONG)),
            (
                _producer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bar,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    b,
                    m0,
                    col,
                    kv_col,
                    n_blocks,
                    M_WG,
                    BLOCK_N,
                    STAGES,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def rows_view_ok(x: torch.Tensor) -> bool:
    """Whether (batch, seqlen, nheads, headdim) ``x`` reads as the 2-D (batch * seqlen, nheads * headdim) rows
    of a tensor descriptor: heads of a token contiguous, tokens evenly strided across batch entries, and the
    start address and the row stride 16-byte aligned."""
    batch, seqlen, nheads, head_dim = x.shape
    s_b, s_s, s_h, s_d = x.stride()
    evenly = batch == 1 or s_b == seqlen * s_s
    return s_d == 1 and s_h == head_dim and evenly and (s_s * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


def qualifies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel's own conditions on q, k, v (any device): bf16/fp16, one head dim of CONFIGS for q, k and v,
    any lengths but neither q nor k empty (a descriptor's dimensions are positive; no key would leave out and
    lse to fill), and layouts a tensor descriptor can read (``rows_view_ok``)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    head_dim = q.shape[3]
    if head_dim not in CONFIGS or k.shape[3] != head_dim or v.shape[3] != head_dim:
        return False
    if q.numel() == 0 or k.numel() == 0:
        return False
    return rows_view_ok(q) and rows_view_ok(k) and rows_view_ok(v)


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA block: [rows, head_dim] or [1, rows, head_dim], both with the
    128-byte swizzle of head_dim 64 and above (what TMA writes and wgmma reads)."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A tensor descriptor of the (batch * seqlen, nheads * headdim) rows of ``x`` (``rows_view_ok``) with
    [rows, headdim] tiles: a tile never crosses a batch entry when seqlen is a multiple of rows (the Gluon
    backward's)."""
    batch, seqlen, nheads, head_dim = x.shape
    layout = shared_layout((rows, head_dim), x.dtype)
    return TensorDescriptor(x, [batch * seqlen, nheads * head_dim], [x.stride(1), 1], [rows, head_dim], layout)


def batch_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A rank-3 tensor descriptor of the (batch, seqlen, nheads * headdim) view of ``x`` (``rows_view_ok``) with
    [1, rows, headdim] boxes: the copy engine zero-fills a box's rows past seqlen on loads and drops them on
    stores, so any seqlen works."""
    batch, seqlen, nheads, head_dim = x.shape
    layout = shared_layout((1, rows, head_dim), x.dtype)
    # seqlen * stride(1) is stride(0) when batch > 1 (rows_view_ok), and 16-byte aligned when batch == 1 too
    strides = [seqlen * x.stride(1), x.stride(1), 1]
    return TensorDescriptor(x, [batch, seqlen, nheads * head_dim], strides, [1, rows, head_dim], layout)


_COMPILED: dict[tuple, object] = {}
"""The compiled kernels ``launch`` has seen, by ``launch_key``."""


def launch_key(kernel, args: tuple, constexprs: dict) -> tuple:
    """What Triton specializes a compiled Gluon kernel of this module on, for these arguments: the device, every
    constexpr, each tensor's dtype and 16-byte alignment, each descriptor's dtype and box (its swizzle follows
    from them, ``shared_layout``), and whether each int fits in 32 bits. The kernels list their int parameters
    in ``do_not_specialize``, so no other property of an int (1, or a multiple of 16) changes the compiled code;
    floats compile as fp32 whatever their value."""
    parts = []
    for a in args:
        if isinstance(a, TensorDescriptor):
            parts.append((a.base.dtype, tuple(a.block_shape)))
        elif isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int):
            parts.append(-(2**31) <= a < 2**31)
    return (kernel, torch.cuda.current_device(), *constexprs.items(), *parts)


def launch(kernel, grid: tuple[int, int, int], args: tuple, constexprs: dict) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=4)`` on the current device and stream, past Triton's
    per-call binding after the first launch of a ``launch_key``.

    ``JITFunction.run`` binds, specializes and hashes every argument on each call, about 40 µs of the Gluon
    forward's host path on the H200 machine (docs/tuning-log.md, "Direct launches"). The first launch of a key
    goes through it (compiling, or loading from Triton's disk cache) and keeps the compiled kernel it returns;
    later launches of the key hand that kernel the same arguments directly: ``args`` are the kernel's leading
    non-constexpr parameters in order, ``constexprs`` name all the rest.
    """
    key = launch_key(kernel, args, constexprs)
    compiled = _COMPILED.get(key)
    if compiled is None:
        params = zip(kernel.params[: len(args)], args, strict=True)
        specialized = [p.name for p, a in params if isinstance(a, int) and not p.do_not_specialize]
        if specialized:
            raise TypeError(f"{kernel.fn.__name__}: add the int parameters {specialized} to do_not_specialize")
        _COMPILED[key] = kernel[grid](*args, **constexprs, num_warps=4)
        return
    compiled[grid](*args, *(constexprs[name] for name in kernel.arg_names[len(args) :]))


def attention_forward_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> None:
    """Launch the kernel; ``configs.gluon_device(q.device)`` and ``qualifies(q, k, v)`` must hold.

    Args:
        q: (batch, seqlen_q, nheads, D); k, v: (batch, seqlen_k, nheads_k, D), D in CONFIGS, nheads a multiple
            of nheads_k
        out: (batch, seqlen_q, nheads, D) in q's dtype, contiguous; written
        lse: (batch, nheads, seqlen_q) float32, contiguous; written (natural log)
        softmax_scale: multiplies q @ k^T before the softmax
        causal: query i sees key j iff j <= i + seqlen_k - seqlen_q
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    cfg = CONFIGS[head_dim]
    m_wg, block_n = cfg["M_WG"], cfg["BLOCK_N"]
    grid = head_grid(cdiv(seqlen_q, 2 * m_wg), batch, nheads)
    args = (
        batch_descriptor(q, m_wg), batch_descriptor(k, block_n), batch_descriptor(v, block_n),
        batch_descriptor(out, m_wg), lse,
        softmax_scale * LOG2E.value, seqlen_q, k.shape[1], nheads, nheads // k.shape[2],
    )  # fmt: skip
    constexprs = dict(HEAD_D=head_dim, CAUSAL=causal, EVEN_K=k.shape[1] % block_n == 0, **cfg)
    launch(_attention_forward_sm90_kernel, grid, args, constexprs)
