"""Prototype: FlashAttention forward for Hopper (sm_90) in Gluon, warp specialized (FA-3 style).

STATUS: compile-checked for sm_90 without a GPU (Triton 3.7.1 and 3.6.0: no spills; D=128 2 stages 164 KB
of shared memory, D=64 3 stages 115 KB); never run. Next H200 session: `--check-only`, then the timing
table; if it beats the `tl` forward (src/flashtile/ops/attention/forward.py), it becomes the sm_90 path of
the forward launcher, with the `tl` kernel kept for other GPUs and the interpreter (issue 3).

Layout (batch, seqlen, nheads, headdim) contiguous, bf16/fp16, head dim 64 or 128, non-causal and causal
(bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q). Outputs out (B, S, H, D) and
lse (B, H, S) fp32, natural log.

PROTOTYPE RESTRICTIONS: seqlen_q must be a multiple of 2*M_WG (128) and seqlen_k a multiple of BLOCK_N
(128); the host asserts it (the 2-D TMA view (B*S, H*D) would otherwise read/write across batches).

Structure of one CTA (one (batch, head), 2*M_WG query rows):
  * producer partition, 1 warp: TMA loads of the two Q tiles, then K and V tiles into a ring of STAGES
    shared-memory buffers; k_ready/v_ready (tx-count) barriers signal the consumers, k_empty/v_empty
    (count 2, one arrival per consumer warpgroup) signal the producer that a slot is free.
  * two consumer warpgroups (the default partition = WG 0, one 4-warp worker = WG 1), M_WG query rows each:
    S = Q K^T (wgmma, A and B from smem), online softmax in base 2, O += P V (wgmma, P from registers).
    Intra-warpgroup pipelining: iteration i issues S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back,
    waits only for S_i, does softmax_i while P_{i-1} V_{i-1} runs, then waits for it and rescales O.
    Ping-pong (PINGPONG=True): two mbarriers hand a "turn" between the warpgroups so one issues its two
    GEMMs while the other does its softmax (FA-3's warp scheduler barriers).
  * epilogue: O / l cast to the input dtype, written to the (now free) Q smem tile, TMA store; lse by
    plain stores.

Usage:
  python benchmarks/experiments/gluon_forward_sm90.py                 # H100/H200: checks, then timing table
  python benchmarks/experiments/gluon_forward_sm90.py --check-only    # correctness only
  python benchmarks/experiments/gluon_forward_sm90.py --bench-only    # timing only
  python benchmarks/experiments/gluon_forward_sm90.py --compile-only  # no GPU: sm_90 regs / smem / spills
"""

from __future__ import annotations

import argparse
import re
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# ---------------------------------------------------------------------------------------------------------
# Triton 3.6 / 3.7 compatibility
# 3.6: gl.thread_barrier(); 3.7: gl.barrier(). mbarrier.expect's byte argument is `bytes` (3.6) vs
# `bytes_per_cta` (3.7): always pass it positionally. gl.warp_specialize(functions_and_args, worker_num_warps,
# worker_num_regs) is the same in both (worker_num_regs optional in 3.7 only).
# ---------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------ layouts
@gluon.constexpr_function
def _mma_layout(n):
    # one warpgroup, wgmma m64nNk16 tiles (bf16/fp16: k = 16), N = the full tile width
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


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
    q_row,
    kv_row,
    col,
    n_blocks,
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    # Q tiles of both consumer warpgroups
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * M_WG, col], q_bar.index(w), q_smem.index(w))
    for i in range(n_blocks):
        s = i % STAGES
        # a fresh barrier passes a wait on parity 1, so the first round through the ring does not block
        ph = ((i // STAGES) & 1) ^ 1
        row = kv_row + i * BLOCK_N
        mbarrier.wait(k_empty.index(s), ph)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), v_smem.index(s))


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
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    """One online-softmax step on the raw scores tile s_acc (fp32, mma layout). m_i is kept in
    scaled log2 units (max of s * softmax_scale * log2(e)). Returns p (fp32), alpha, m_new, l_new."""
    s_layout: gl.constexpr = s_acc.type.layout
    if CAUSAL:
        # only tiles that cross the diagonal of this warpgroup's rows need the mask
        if kv_start + BLOCK_N > q_pos0 + diag_off + 1:
            rows = q_pos0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, s_layout))
            cols = kv_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = cols[None, :] <= (rows + diag_off)[:, None]
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
    q_row,
    col,
    q_pos0,
    diag_off,
    n_blocks,
    qk_scale,
    M_WG: gl.constexpr,
    HEAD_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_pos0 = q_pos0 + WG * M_WG
    q_tile = q_smem.index(WG)
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
    s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn, count=1)
    s_acc, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_tile, k_smem.index(0)))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, qk_scale, 0, q_pos0, diag_off, M_WG, BLOCK_N, CAUSAL)
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
        s_tok = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sp), php)
        acc_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn, count=1)
        # wgmma groups retire in order: <= 1 outstanding means S_i is done
        s_acc, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_tile, k_smem.index(s)))
        mbarrier.arrive(k_empty.index(s), count=1)
        p, alpha, m_i, l_i = _softmax_step(
            s_acc, m_i, l_i, qk_scale, i * BLOCK_N, q_pos0, diag_off, M_WG, BLOCK_N, CAUSAL
        )
        acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, v_smem.index(sp)))
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    # ---- epilogue: O += P_{n-1} V_{n-1}
    sl = (n_blocks - 1) % STAGES
    phl = ((n_blocks - 1) // STAGES) & 1
    mbarrier.wait(v_ready.index(sl), phl)
    acc_tok = warpgroup_mma(p_op, v_smem.index(sl), acc, is_async=True)
    acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, v_smem.index(sl)))
    mbarrier.arrive(v_empty.index(sl), count=1)

    # ---- normalize, store O through the Q tile's shared memory, store lse
    l_safe = gl.where(l_i == 0.0, gl.full_like(l_i, 1.0), l_i)
    o = acc / gl.convert_layout(l_safe, row_o)[:, None]
    q_tile.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + WG * M_WG, col], q_tile)

    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # l_i == 0 (no key seen) gives -inf
    offs = lse_off + q_pos0 + gl.arange(0, M_WG, layout=row_s)
    gl.store(lse_ptr + offs, lse)
    tma.store_wait(0)


# ------------------------------------------------------------------------------------------------ kernel
@gluon.jit
def attn_fwd_ws(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    lse_ptr,
    qk_scale,
    seqlen_q,
    seqlen_k,
    nheads,
    HEAD_D: gl.constexpr,
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 2 * M_WG
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    if CAUSAL:
        # heaviest query tiles first
        pid_m = gl.num_programs(0) - 1 - pid_m
    b = bh // nheads
    h = bh % nheads
    m0 = pid_m * BLOCK_M
    diag_off = seqlen_k - seqlen_q
    if CAUSAL:
        kv_end = gl.minimum(seqlen_k, m0 + BLOCK_M + diag_off)
        kv_end = gl.maximum(kv_end, 1)  # a tile that sees no key still runs one (fully masked) block
    else:
        kv_end = seqlen_k
    n_blocks = gl.cdiv(kv_end, BLOCK_N)

    q_row = b * seqlen_q + m0
    kv_row = b * seqlen_k
    col = h * HEAD_D
    lse_off = bh.to(gl.int64) * seqlen_q

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, M_WG, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)

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

    # (tuples can not be concatenated here: `(0, ) + common` breaks the constexprs, so spell the args out)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    0,
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
                    q_row,
                    col,
                    m0,
                    diag_off,
                    n_blocks,
                    qk_scale,
                    M_WG,
                    HEAD_D,
                    BLOCK_N,
                    STAGES,
                    CAUSAL,
                    PINGPONG,
                ),
            ),
            (
                _consumer,
                (
                    1,
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
                    q_row,
                    col,
                    m0,
                    diag_off,
                    n_blocks,
                    qk_scale,
                    M_WG,
                    HEAD_D,
                    BLOCK_N,
                    STAGES,
                    CAUSAL,
                    PINGPONG,
                ),
            ),
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
                    q_row,
                    kv_row,
                    col,
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


# ------------------------------------------------------------------------------------------------ configs
def config(head_dim, causal):
    """(M_WG, BLOCK_N, STAGES, PINGPONG, consumer regs, producer regs)."""
    if head_dim == 128:
        return dict(M_WG=64, BLOCK_N=128, STAGES=2, PINGPONG=True, CONSUMER_REGS=240, PRODUCER_REGS=24)
    if head_dim == 64:
        return dict(M_WG=64, BLOCK_N=128, STAGES=3, PINGPONG=True, CONSUMER_REGS=240, PRODUCER_REGS=24)
    raise ValueError(f"head dim {head_dim} not in (64, 128)")


def _gl_dtype(torch_dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


def run(q, k, v, causal=False, softmax_scale=None, **overrides):
    """q: (B, Sq, H, D), k/v: (B, Sk, H, D), contiguous bf16/fp16. Returns out (B, Sq, H, D), lse (B, H, Sq)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    assert k.shape == (B, Sk, H, D) and v.shape == k.shape
    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    cfg = dict(config(D, causal))
    cfg.update(overrides)
    M_WG, BLOCK_N = cfg["M_WG"], cfg["BLOCK_N"]
    assert Sq % (2 * M_WG) == 0 and Sk % BLOCK_N == 0, (
        f"prototype: seqlen_q ({Sq}) must be a multiple of {2 * M_WG}, seqlen_k ({Sk}) of {BLOCK_N}"
    )
    if softmax_scale is None:
        softmax_scale = D**-0.5
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    gdt = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([M_WG, D], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gdt)
    q2, k2, v2, o2 = (t.view(t.shape[0] * t.shape[1], H * D) for t in (q, k, v, out))
    q_desc = TensorDescriptor.from_tensor(q2, [M_WG, D], q_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [BLOCK_N, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [BLOCK_N, D], kv_layout)
    o_desc = TensorDescriptor.from_tensor(o2, [M_WG, D], q_layout)
    grid = (Sq // (2 * M_WG), B * H)
    attn_fwd_ws[grid](
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        lse,
        softmax_scale * LOG2E,
        Sq,
        Sk,
        H,
        HEAD_D=D,
        CAUSAL=causal,
        num_warps=4,
        **cfg,
    )
    return out, lse


# ------------------------------------------------------------------------------------------------ compile only
def _desc_sig(dt, rows, d, gdt):
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
    return f"tensordesc<{dt}[{rows},{d}],{layout!r}>"


def compile_only(dtypes=("bf16", "fp16"), variants=None):
    """Compile every (dtype, head dim, causal) for sm_90 with the default config, and the timing variants
    (VARIANTS) for bf16; print shared memory, setmaxnreg and ptxas register / stack / local use."""
    import itertools

    from triton.backends.compiler import GPUTarget

    # Gluon kernels need GluonASTSource (same constructor as ASTSource; sets Language.GLUON and builds the
    # module with the ttg.* attributes); the same class path exists in Triton 3.6 and 3.7.
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    ok = True
    print(f"triton {triton.__version__}")
    for dt in dtypes:
        gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dt]
        for D, causal, (vname, ov) in itertools.product((64, 128), (False, True), (variants or VARIANTS).items()):
            if vname != "default" and dt != "bf16":
                continue
            if True:  # (keeps the indentation of the body below)
                cfg = dict(config(D, causal))
                cfg.update(ov(D))
                M_WG, BN = cfg["M_WG"], cfg["BLOCK_N"]
                sig = {
                    "q_desc": _desc_sig(dt, M_WG, D, gdt),
                    "k_desc": _desc_sig(dt, BN, D, gdt),
                    "v_desc": _desc_sig(dt, BN, D, gdt),
                    "o_desc": _desc_sig(dt, M_WG, D, gdt),
                    "lse_ptr": "*fp32",
                    "qk_scale": "fp32",
                    "seqlen_q": "i32",
                    "seqlen_k": "i32",
                    "nheads": "i32",
                }
                constexprs = dict(HEAD_D=D, CAUSAL=causal, **cfg)
                for name in constexprs:
                    sig[name] = "constexpr"
                attrs = {
                    "lse_ptr": [["tt.divisibility", 16]],
                    "seqlen_q": [["tt.divisibility", 16]],
                    "seqlen_k": [["tt.divisibility", 16]],
                }
                src = GluonASTSource(attn_fwd_ws, sig, constexprs={k: v for k, v in constexprs.items()}, attrs=attrs)
                tag = f"{dt} D={D} causal={int(causal)} [{vname}] {cfg}"
                try:
                    c = triton.compile(src, target=target, options={"num_warps": 4})
                except Exception as e:  # noqa: BLE001
                    ok = False
                    print(f"FAIL {tag}: {type(e).__name__}: {str(e)[:3000]}")
                    continue
                ptx = c.asm["ptx"]
                maxnreg = re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)
                local = re.findall(r"\.local \.align \d+ \.b8 \S+\[(\d+)\]", ptx)
                md = c.metadata
                info = _sass_info(c)
                print(
                    f"ok   {tag}\n     shared={md.shared} B  num_warps(total)={md.num_warps}  "
                    f"setmaxnreg={maxnreg}  ptx .local={local}  {info}"
                )
                if md.shared > 232448:
                    ok = False
                    print("     FAIL: shared memory exceeds 227 KiB")
    return ok


def _sass_info(c):
    """Registers / stack / spills from cuobjdump -res-usage on the cubin (ptxas output)."""
    import os
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump) or "cubin" not in c.asm:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        r = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
    if not m:
        return r.stdout.strip()[-300:]
    return f"sass REG={m.group(1)} STACK={m.group(2)} LOCAL={m.group(4)}"


# ------------------------------------------------------------------------------------------------ GPU main
def _reference(q, k, v, causal, scale, dtype):
    """float32 (dtype=float32) or in-dtype attention; rows that see no key give 0 (and lse -inf)."""
    import torch

    qf, kf, vf = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        Sq, Sk = q.shape[1], k.shape[1]
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Sk - Sq, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.matmul(p.to(dtype), vf).transpose(1, 2)
    return o, lse


def check():
    import torch

    torch.manual_seed(0)
    cases = []
    for D in (64, 128):
        for causal in (False, True):
            for B, H, Sq, Sk in [
                (2, 3, 128, 128),
                (1, 2, 256, 512),
                (2, 2, 512, 256),
                (1, 4, 1024, 1024),
                (1, 2, 384, 1152),
            ]:
                for dt in (torch.bfloat16, torch.float16):
                    cases.append((D, causal, B, H, Sq, Sk, dt))
    n_fail = 0
    for D, causal, B, H, Sq, Sk, dt in cases:
        q = torch.randn(B, Sq, H, D, device="cuda", dtype=dt)
        k = torch.randn(B, Sk, H, D, device="cuda", dtype=dt)
        v = torch.randn(B, Sk, H, D, device="cuda", dtype=dt)
        scale = D**-0.5
        out, lse = run(q, k, v, causal, scale)
        torch.cuda.synchronize()
        ref32, lse32 = _reference(q, k, v, causal, scale, torch.float32)
        base, _ = _reference(q, k, v, causal, scale, dt)
        ref = ref32.to(dt)
        err = (out.float() - ref.float()).abs().max().item()
        base_err = (base.float() - ref.float()).abs().max().item()
        floor = 4 * torch.finfo(dt).eps * ref.float().abs().max().item()
        fin = torch.isfinite(lse32)
        lse_err = (lse[fin] - lse32[fin]).abs().max().item() if fin.any() else 0.0
        lse_inf_ok = bool((lse[~fin] == float("-inf")).all()) if (~fin).any() else True
        ok = (err <= 2 * base_err + floor) and not torch.isnan(out).any().item() and lse_err < 1e-3 and lse_inf_ok
        n_fail += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} D={D} causal={int(causal)} B={B} H={H} Sq={Sq} Sk={Sk} {str(dt)[6:]}: "
            f"err={err:.3e} base={base_err:.3e} floor={floor:.1e} lse_err={lse_err:.2e}"
        )
    return n_fail == 0


def bench(variants=None):
    import torch
    from triton.testing import do_bench

    torch.manual_seed(0)
    for D, H in ((128, 16), (64, 32)):
        for N in (1024, 4096, 16384):
            B = 16384 // N
            q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn_like(q)
            v = torch.randn_like(q)
            for causal in (False, True):
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                for name, ov in (variants or {"default": lambda D: {}}).items():
                    overrides = ov(D)
                    try:
                        ms = do_bench(
                            lambda q=q, k=k, v=v, c=causal, o=overrides: run(q, k, v, c, None, **o), warmup=25, rep=100
                        )
                        tf = flops / ms * 1e-9
                        print(
                            f"D={D:3d} H={H:2d} B={B:2d} N={N:5d} causal={int(causal)} {name:>12}: "
                            f"{ms:8.3f} ms {tf:6.1f} TFLOP/s",
                            flush=True,
                        )
                    except Exception as e:  # noqa: BLE001
                        print(
                            f"D={D:3d} N={N:5d} causal={int(causal)} {name:>12}: FAIL {type(e).__name__}: "
                            f"{str(e)[:300]}",
                            flush=True,
                        )
                try:
                    import flashtile

                    ms = do_bench(
                        lambda q=q, k=k, v=v, c=causal: flashtile.flash_attn_func(q, k, v, causal=c), warmup=25, rep=100
                    )
                    print(
                        f"D={D:3d} H={H:2d} B={B:2d} N={N:5d} causal={int(causal)} {'flashtile tl':>12}: "
                        f"{ms:8.3f} ms {flops / ms * 1e-9:6.1f} TFLOP/s",
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001
                    print(f"flashtile FAIL {e}")
                try:
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    ms = do_bench(
                        lambda qt=qt, kt=kt, vt=vt, c=causal: torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=c
                        ),
                        warmup=25,
                        rep=100,
                    )
                    print(
                        f"D={D:3d} H={H:2d} B={B:2d} N={N:5d} causal={int(causal)} {'torch sdpa':>12}: "
                        f"{ms:8.3f} ms {flops / ms * 1e-9:6.1f} TFLOP/s",
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001
                    print(f"sdpa FAIL {e}")


# timing variants: name -> (head dim -> config overrides)
VARIANTS = {
    "default": lambda D: {},
    "no-pingpong": lambda D: {"PINGPONG": False},
    "more-stages": lambda D: {"STAGES": 3 if D == 128 else 4},
}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        sys.exit(0 if compile_only() else 1)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("needs a Hopper GPU (sm_90); use --compile-only without one")
    good = True
    if not args.bench_only:
        good = check()
        print("CHECK", "PASSED" if good else "FAILED", flush=True)
    if not args.check_only:
        bench(VARIANTS)
    sys.exit(0 if good else 1)
