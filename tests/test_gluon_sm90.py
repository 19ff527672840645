"""The Gluon kernels of sm_90 (``ops.sm90.forward``, ``ops.sm90.backward``): which calls take them,
and their results.

Which calls qualify is checked on any machine; the kernels themselves only run on a Hopper GPU (Gluon has
no CPU interpreter; tests/sm90_compile.py compiles them for sm_90 without one).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import flashtile
from conftest import DEVICE, capture
from flashtile import _backend, checks
from flashtile.ops import _launch
from flashtile.ops.attention import backward
from flashtile.ops.common import grid
from flashtile.ops.common.descriptors import tma_ready
from flashtile.ops.sm90 import backward as backward_sm90
from flashtile.ops.sm90 import common as sm90_common
from flashtile.ops.sm90 import forward as forward_sm90
from flashtile.options import AttentionOptions
from oracle import check_against_oracle
from test_attention import check, make_inputs, run_flashtile

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90)")


def options(causal: bool = False, softmax_scale: float = 0.1) -> AttentionOptions:
    """The options of a plain call, causal or not, whose backward may take atomics (deterministic=False)."""
    return AttentionOptions(softmax_scale, None, 0 if causal else None, deterministic=False)


def qkv(batch=2, seqlen_q=256, seqlen_k=384, nheads=4, nheads_k=2, head_dim=128, dtype=torch.bfloat16):
    q = torch.empty(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = torch.empty(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    return q, k, torch.empty_like(k)


def test_qualifies_plain_layouts():
    assert forward_sm90.qualifies(*qkv(), options())
    assert forward_sm90.qualifies(*qkv(dtype=torch.float16), options())
    assert forward_sm90.qualifies(*qkv(batch=1, seqlen_q=128, seqlen_k=128, nheads=1, nheads_k=1), options())
    packed = torch.empty(2, 256, 3, 4, 128, dtype=torch.bfloat16)  # q, k, v sliced from a packed qkv
    assert forward_sm90.qualifies(*packed.unbind(2), options())


@pytest.mark.parametrize("window", [(8, 0), (8, 8), (None, 8), (8, None), (None, -128)], ids=str)
def test_windows_qualify(window):
    """Both kernels take a sliding window (window_left, window_right as the options hold them; a negative right side
    is top-left causal with Sq < Sk), causal or not, at head dims 128 and 256, the backward at 64 too
    (``common.WINDOW_HEAD_DIMS``; the forward at 64 keeps the Triton kernel, named); the backward keeps its length
    rule."""
    opts = AttentionOptions(0.1, *window, deterministic=False)
    for head_dim in (128, 256):
        q, k, v = qkv(head_dim=head_dim)
        assert forward_sm90.qualifies(q, k, v, opts) and backward_sm90.qualifies(q, k, v, torch.empty_like(q), opts)
        q, k, v = qkv(seqlen_q=17, seqlen_k=113, head_dim=head_dim)
        assert forward_sm90.qualifies(q, k, v, opts) and not backward_sm90.qualifies(q, k, v, torch.empty_like(q), opts)
    q, k, v = qkv(head_dim=64)
    refusal = ("a sliding window at head dim 64 (the forward takes windows at 128, 256)",)
    assert forward_sm90.qualifies(q, k, v, opts).reasons == refusal
    assert backward_sm90.qualifies(q, k, v, torch.empty_like(q), opts)


def test_score_modifications_qualify():
    """Both kernels take softcap and ALiBi ((nheads,) or (batch, nheads) slopes), causal or not; ALiBi with a sliding
    window keeps the Triton kernels, and so does softcap in the backward at head dim 64 (its 128-row query tiles start
    S^T's accumulator at -lse, which the cap's tanh cannot follow)."""
    for head_dim in (64, 128, 256):
        q, k, v = qkv(head_dim=head_dim)
        dout = torch.empty_like(q)
        for slopes in (torch.ones(4), torch.ones(2, 4)):
            for causal in (False, True):
                opts = AttentionOptions(0.1, None, 0 if causal else None, alibi_slopes=slopes, deterministic=False)
                assert forward_sm90.qualifies(q, k, v, opts) and backward_sm90.qualifies(q, k, v, dout, opts)
        windowed = AttentionOptions(0.1, 8, 0, alibi_slopes=torch.ones(4), deterministic=False)
        for verdict in (forward_sm90.qualifies(q, k, v, windowed), backward_sm90.qualifies(q, k, v, dout, windowed)):
            assert verdict.reasons[0] == "ALiBi with a sliding window"
        capped = AttentionOptions(0.1, None, 0, softcap=30.0, deterministic=False)
        assert forward_sm90.qualifies(q, k, v, capped)
        found = backward_sm90.qualifies(q, k, v, dout, capped).reasons
        assert found == (
            () if head_dim != 64 else ("softcap at head dim 64 (its 128-row query tiles start S^T at -lse)",)
        )


def test_window_args():
    """The kernels' window arguments: an unbounded side past every key (seqlen_q + seqlen_k), unread zeros without a
    window."""
    assert sm90_common.window_args(None, 100, 300) == (0, 0)
    assert sm90_common.window_args((8, 0), 100, 300) == (8, 0)
    assert sm90_common.window_args((None, -200), 100, 300) == (400, -200)
    assert sm90_common.window_args((5, None), 100, 300) == (5, 400)


def test_window_launches_without_causal(monkeypatch):
    """A window launch runs with CAUSAL off and LOCAL on, its bounds the int arguments before the score
    modifications', and walks its items as a launch without causal does (persistent at D=128: min(items, SMs)
    CTAs); a causal launch keeps LOCAL off. Each its own plan."""
    launches = []
    monkeypatch.setattr(forward_sm90, "launch", lambda kernel, grid, args, cx, keyed: launches.append((grid, args, cx)))
    monkeypatch.setattr(
        backward_sm90, "launch", lambda kernel, grid, args, cx, keyed: launches.append((grid, args, cx))
    )
    monkeypatch.setattr(forward_sm90, "sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(forward_sm90, "_PLANS", _launch.Plans())
    q, k, v = qkv(batch=4, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_k=16)
    out, lse = torch.empty_like(q), torch.empty(4, 16, 1024)
    forward_sm90.attention_forward_sm90(q, k, v, out, lse, 0.1, True, window=(256, 0))
    grid, args, constexprs = launches[-1]
    assert constexprs["LOCAL"] and not constexprs["CAUSAL"] and args[-5:-3] == (256, 0) and grid == (132, 1, 1)
    forward_sm90.attention_forward_sm90(q, k, v, out, lse, 0.1, True)
    assert not launches[-1][2]["LOCAL"] and launches[-1][2]["CAUSAL"]
    assert len(forward_sm90._PLANS) == 2
    backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, lse, lse, 0.1, True, window=(None, 5))
    grid, args, constexprs = launches[-1]
    assert constexprs["LOCAL"] and not constexprs["CAUSAL"] and args[-5:-3] == (2048, 5)
    assert grid[0] == 1024 // backward_sm90.CONFIGS[128]["BLOCK_N"]  # one CTA per key tile: no causal pairs


@pytest.mark.parametrize("seqlens", [(1, 1), (17, 113), (113, 17), (64, 1000), (1000, 1000), (257, 1023)], ids=str)
def test_qualifies_any_lengths(seqlens):
    """Rank-3 descriptors zero-fill and clip at a batch entry's end: no length rule (the backward keeps its
    multiples of 128: test_backward_rejects)."""
    seqlen_q, seqlen_k = seqlens
    q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    assert forward_sm90.qualifies(q, k, v, options())
    packed = torch.empty(2, seqlen_q, 3, 4, 128, dtype=torch.float16)
    assert forward_sm90.qualifies(*packed.unbind(2), options())


@pytest.mark.parametrize(
    "case",
    [
        dict(head_dim=96),
        dict(head_dim=192),
        dict(dtype=torch.float32),
        dict(seqlen_k=0),
        dict(seqlen_q=0),
        dict(batch=0),
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_qualifies_rejects(case):
    assert not forward_sm90.qualifies(*qkv(**case), options())


def test_qualifies_head_dim_256_and_rejects_mixed_head_dims():
    assert forward_sm90.qualifies(*qkv(head_dim=256), options())
    q, k, _ = qkv(head_dim=256)
    headdim_v_128 = torch.empty(2, 384, 2, 128, dtype=torch.bfloat16)
    assert not forward_sm90.qualifies(q, k, headdim_v_128, options())


@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_qualifies_causal_per_head_dim_and_length(monkeypatch, head_dim):
    """Causal forwards run here at every length (CAUSAL_MIN_SEQLEN_Q); a head dim's threshold sends shorter ones to
    the Triton kernel."""
    assert forward_sm90.qualifies(*qkv(head_dim=head_dim), options())
    assert forward_sm90.qualifies(*qkv(seqlen_q=1, head_dim=head_dim), options(causal=True))
    monkeypatch.setitem(forward_sm90.CAUSAL_MIN_SEQLEN_Q, head_dim, 2048)
    assert forward_sm90.qualifies(*qkv(head_dim=head_dim), options())
    assert not forward_sm90.qualifies(*qkv(seqlen_q=2047, head_dim=head_dim), options(causal=True))
    assert forward_sm90.qualifies(*qkv(seqlen_q=2048, head_dim=head_dim), options(causal=True))


def head_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, seqlen, nheads, headdim) with torch's (batch, nheads, seqlen, headdim) memory: a transposed view
    of a contiguous tensor, what ``flashtile.scaled_dot_product_attention`` hands the kernels."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def test_qualifies_head_major_and_other_strided_layouts():
    """Any layout whose last dimension is contiguous and whose other strides are 16-byte multiples (``tma_ready``,
    ``common.layout_refusal``): torch's (B, H, N, D) for q, k and v or for k and v alone (a cache's), and (B, N, H, D)
    with heads or batch entries apart; the first through rank-3 descriptors where heads of a token lie side by
    side."""
    q, k, v = qkv()
    assert forward_sm90.qualifies(*map(head_major, (q, k, v)), options())
    assert forward_sm90.qualifies(q, head_major(k), head_major(v), options(causal=True))
    assert forward_sm90.qualifies(head_major(q), k, v, options())
    for head_dim in (64, 256):
        assert forward_sm90.qualifies(*map(head_major, qkv(seqlen_q=17, seqlen_k=113, head_dim=head_dim)), options())
    padded_heads = torch.empty(2, 256, 4, 136, dtype=torch.bfloat16)[..., :128]  # heads 272 bytes apart
    batch_strided = torch.empty(2, 512, 4, 128, dtype=torch.bfloat16)[:, :256]  # rows not evenly strided
    cache = torch.empty(2, 2, 1024, 128, dtype=torch.bfloat16)[:, :, :384].transpose(1, 2)  # (B, H, N_max, D) cache
    for x in (padded_heads, batch_strided):
        assert not sm90_common.rows_view_ok(x) and tma_ready(x)
        assert forward_sm90.qualifies(x, k, v, options())
    assert forward_sm90.qualifies(q, cache, cache, options())


def test_qualifies_rejects_layouts_a_descriptor_cannot_read():
    q, k, v = qkv()
    heads_strided = torch.empty(2, 384, 128, 2, dtype=torch.bfloat16).transpose(2, 3)  # (B, S, H, D), D strided
    assert not forward_sm90.qualifies(q, heads_strided, v, options())
    rows_unaligned = torch.empty(2, 4, 256, 132, dtype=torch.bfloat16)[..., :128].transpose(1, 2)  # 264-byte rows
    assert not forward_sm90.qualifies(rows_unaligned, k, v, options())
    heads_broadcast = torch.empty(2, 384, 1, 128, dtype=torch.bfloat16).expand(2, 384, 2, 128)  # stride 0
    assert not forward_sm90.qualifies(q, heads_broadcast, v, options())
    misaligned = torch.empty(2 * 256 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 256, 4, 128)
    assert not forward_sm90.qualifies(misaligned, k, v, options())
    v_unaligned = torch.empty(2, 2, 384, 132, dtype=torch.bfloat16)[..., :128].transpose(1, 2)
    reason = forward_sm90.qualifies(q, heads_strided, v_unaligned, options()).reasons
    assert reason == ("layouts a tensor descriptor cannot read (k, v)",)


def rows_only(x: torch.Tensor) -> torch.Tensor:
    """``x`` (batch 1) with a batch stride that is no 16-byte multiple: a rows view reads it (the batch stride does
    not matter there), a head-major descriptor does not (its strides must be)."""
    assert x.shape[0] == 1
    return x.as_strided(x.shape, (7, *x.stride()[1:]))


def test_one_form_per_group_of_tensors():
    """Tensors read at the same coordinates go through descriptors of one form (``common.layout_refusal``): a tensor
    that only a rows view reads qualifies beside tensors with rows views, and is named beside a head-major one (the
    forward's k and v; the backward's q and dout, and k and v)."""
    q, k, v = qkv(batch=1)
    k_rows = rows_only(k)
    assert sm90_common.rows_view_ok(k_rows) and not tma_ready(k_rows)
    assert forward_sm90.qualifies(q, k_rows, v, options())
    found = forward_sm90.qualifies(q, k_rows, head_major(v), options()).reasons
    assert found == ("layouts a tensor descriptor cannot read (k)",)
    dout = torch.empty_like(q)
    assert backward_sm90.qualifies(q, k_rows, v, dout, options())
    found = backward_sm90.qualifies(rows_only(q), k_rows, head_major(v), head_major(dout), options()).reasons
    assert found == ("layouts a tensor descriptor cannot read (q, k)",)


@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_backward_qualifies_head_major_layouts(head_dim):
    """The Gluon backward reads torch's (B, H, N, D) memory through head-major descriptors: q, k, v and dout, or any
    of them (SDPA's dout usually has out's (B, N, H, D) memory), MHA, GQA and MQA; the length rule stays (multiples
    of 128), and layouts no descriptor reads are named."""
    for nheads_k in (4, 2, 1):
        q, k, v = qkv(nheads=4, nheads_k=nheads_k, head_dim=head_dim)
        dout = torch.empty_like(q)
        for major in ("q k v dout", "q k v", "k v", "q dout", "dout"):
            inputs = head_major_inputs(major, q=q, k=k, v=v, dout=dout)
            assert backward_sm90.qualifies(*inputs, options(causal=True)), (nheads_k, major)
    odd = [head_major(x) for x in qkv(seqlen_q=113, seqlen_k=256, head_dim=head_dim)]
    found = backward_sm90.qualifies(*odd, torch.empty_like(odd[0]), options()).reasons
    assert found == ("seqlen_q 113, seqlen_k 256 (positive multiples of 128 only)",)
    rows_unaligned = torch.empty(2, 4, 256, head_dim + 4, dtype=torch.bfloat16)[..., :head_dim].transpose(1, 2)
    q, k, v = qkv(head_dim=head_dim)
    found = backward_sm90.qualifies(q, head_major(k), head_major(v), rows_unaligned, options()).reasons
    assert found == ("layouts a tensor descriptor cannot read (dout)",)


def test_gluon_refusal(monkeypatch):
    """An sm_90 GPU with the switch on; not a CPU, another GPU generation, or FLASHTILE_GLUON=0: each with its
    reason."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(grid, "compute_capability", lambda index: (9, 0))
    assert _backend.gluon_refusal(cuda) is None
    assert _backend.gluon_refusal(torch.device("cpu")) == "the device is cpu, not an sm_90 GPU"
    monkeypatch.setattr(_backend, "GLUON", False)
    assert _backend.gluon_refusal(cuda) == "switched off (FLASHTILE_GLUON=0)"
    monkeypatch.setattr(_backend, "GLUON", True)
    monkeypatch.setattr(grid, "compute_capability", lambda index: (8, 0))
    assert _backend.gluon_refusal(cuda) == "the GPU is sm_80, not sm_90"


@pytest.mark.parametrize(
    "head_dim, causal, launch_kind",
    [(64, False, "persistent"), (64, True, "listed"), (128, False, "persistent"), (128, True, "pair-slots"),
     (256, False, "items"), (256, True, "pair-slots")],
    ids=["D64-full", "D64-causal", "D128-full", "D128-causal", "D256-full", "D256-causal"],
)  # fmt: skip
def test_launch_grid_per_head_dim_and_mask(monkeypatch, head_dim, causal, launch_kind):
    """A one-dimensional grid of min(work items, SMs) CTAs at D=64 and 128 without causal (persistent, O through
    its own tile) and at D=64 with causal (CAUSAL_SCHEDULE: lists of items from ``causal_schedule``, passed as the
    kernel's ``schedule``); min(pair slots, SMs) with causal at D=128 and 256 (CAUSAL_PAIRS and CAUSAL_PERSISTENT: a
    slot per pair of a head's query tiles, an odd count's middle tile one of its own); one CTA per work item (query
    tiles x heads x batch entries) otherwise. A work item is a 192-row query tile at D=64 without causal (three consumer
    warpgroups), 128 rows elsewhere (D=64 causal: CAUSAL_CHANGES). The constexprs of the head dim's config."""
    launches = []
    monkeypatch.setattr(
        forward_sm90, "launch", lambda kernel, grid, args, constexprs, keyed: launches.append((grid, args, constexprs))
    )
    monkeypatch.setattr(forward_sm90, "sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the plan's launch key
    # (batch, seqlen_q, heads, {query rows per item: (work items, pair slots)})
    shapes = ((4, 1024, 16, {128: (512, 256), 192: (384, 192)}), (3, 200, 2, {128: (12, 6), 192: (12, 6)}),
              (1, 300, 2, {128: (6, 4), 192: (4, 2)}), (1, 100, 2, {128: (2, 2), 192: (2, 2)}),
              (1, 600, 3, {128: (15, 9), 192: (12, 6)}), (1, 193, 2, {128: (4, 2), 192: (4, 2)}),
              (1, 960, 4, {128: (32, 16), 192: (20, 12)}))  # fmt: skip
    rows = 192 if head_dim == 64 and not causal else 128
    for batch, seqlen_q, nheads, counts in shapes:
        q, k, v = qkv(batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads, head_dim=head_dim)
        out = torch.empty_like(q)
        lse = torch.empty(batch, nheads, seqlen_q)
        forward_sm90.attention_forward_sm90(q, k, v, out, lse, 0.1, causal)
        grid, args, constexprs = launches[-1]
        items, slots = counts[rows]
        expected = {"persistent": min(items, 132), "listed": min(items, 132), "pair-slots": min(slots, 132),
                    "items": items}[launch_kind]  # fmt: skip
        assert grid == (expected, 1, 1), (batch, seqlen_q, nheads)
        listed = launch_kind == "listed"
        assert constexprs["CAUSAL_SCHEDULE"] == (head_dim == 64)  # the kernel reads it with CAUSAL only
        schedule = args[11]
        assert (schedule is not None) == listed
        if listed:  # (CTAs + 1) offsets, then the items
            assert schedule.dtype == torch.int32 and schedule.numel() == expected + 1 + items
        assert constexprs["NUM_WG"] * constexprs["M_WG"] == rows
        assert constexprs["O_TILE"] == (head_dim in (64, 128))
        assert constexprs["CAUSAL_PAIRS"] and constexprs["CAUSAL_PERSISTENT"]
        assert constexprs["CAUSAL"] == causal and constexprs["HEAD_D"] == head_dim


def test_forward_plans_follow_layouts_and_configs(monkeypatch):
    """``forward_plan``: calls on new tensors of one layout reuse the plan (descriptors rebased on the new tensors,
    the same grid, constexprs and launch key); another length, a changed CONFIGS entry or another SM count make
    another (which inputs qualify is the dispatcher's: ``qualifies``)."""
    launches = []
    monkeypatch.setattr(forward_sm90, "launch", lambda kernel, grid, args, cx, keyed: launches.append((grid, args, cx)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(forward_sm90, "_PLANS", _launch.Plans())

    def call(seqlen_q=256, dtype=torch.bfloat16, offset=0):
        q, k, v = qkv(seqlen_q=seqlen_q, dtype=dtype)
        if offset:
            q = torch.empty(q.numel() + offset, dtype=dtype)[offset:].view(q.shape)
        out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], seqlen_q)
        forward_sm90.attention_forward_sm90(q, k, v, out, lse, 0.1, True)
        return q, k, v, out

    for _ in range(2):
        tensors = call()
        assert [d.base for d in launches[-1][1][:4]] == list(tensors)
    assert len(forward_sm90._PLANS) == 1 and launches[0][0] == launches[1][0] and launches[0][2] == launches[1][2]
    call(seqlen_q=384)
    monkeypatch.setitem(forward_sm90.CONFIGS[128], "CAUSAL_PERSISTENT", False)
    call()
    assert launches[-1][2]["CAUSAL_PERSISTENT"] is False and launches[-1][0] != launches[0][0]
    monkeypatch.setattr(forward_sm90, "sm_count", lambda device: 7)
    monkeypatch.setitem(forward_sm90.CONFIGS[128], "CAUSAL_PERSISTENT", True)
    call()
    assert launches[-1][0] == (7, 1, 1)
    call(offset=16)  # another alignment of q's address: 32 bytes, still 16-byte aligned
    assert len(forward_sm90._PLANS) == 4 and len(launches) == 6


def check_head_major_descriptor(desc, x: torch.Tensor, rows: int) -> None:
    """``desc`` is ``common.head_major_descriptor(x, rows)``: rank 4, [1, 1, rows, D] boxes of x's (B, H, N, D) view."""
    batch, seqlen, nheads, head_dim = x.shape
    s_b, s_s, s_h, _ = x.stride()
    assert desc.base is x and desc.block_shape == [1, 1, rows, head_dim]
    assert desc.shape == [batch, nheads, seqlen, head_dim] and desc.strides == [s_b, s_h, s_s, 1]


def test_forward_descriptors_follow_each_layout(monkeypatch):
    """q and out through head-major descriptors where q's heads are apart, k and v where either's are (the kernel
    reads v at k's coordinates): rank 4, [1, 1, rows, D] boxes of the (B, H, N, D) view; rank 3, [1, rows, D] boxes
    of the (B, N, H * D) view otherwise. out stays (B, N, H, D) contiguous. Each combination its own launch key."""
    launches = []
    monkeypatch.setattr(forward_sm90, "launch", lambda kernel, grid, args, cx, keyed: launches.append((args, keyed)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(forward_sm90, "_PLANS", _launch.Plans())
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = 2, 100, 200, 4, 2, 128
    m_wg, block_n = forward_sm90.CONFIGS[head_dim]["M_WG"], forward_sm90.CONFIGS[head_dim]["BLOCK_N"]
    q, k, v = qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)

    def rank3(desc, x, rows):
        heads = x.shape[2]
        assert desc.base is x and desc.block_shape == [1, rows, head_dim]
        assert desc.shape == [batch, x.shape[1], heads * head_dim] and desc.strides == [x.stride(0), x.stride(1), 1]

    keys = set()
    for q_major, k_major, v_major in [(False, False, False), (True, True, True), (False, True, True),
                                      (True, False, False), (False, False, True)]:  # fmt: skip
        inputs = [head_major(x) if major else x for x, major in ((q, q_major), (k, k_major), (v, v_major))]
        out, lse = torch.empty_like(q), torch.empty(batch, nheads, seqlen_q)
        forward_sm90.attention_forward_sm90(*inputs, out, lse, 0.1, causal=False)
        args, keyed = launches[-1]
        (check_head_major_descriptor if q_major else rank3)(args[0], inputs[0], m_wg)
        (check_head_major_descriptor if q_major else rank3)(args[3], out, m_wg)
        for desc, x in zip(args[1:3], inputs[1:], strict=True):
            (check_head_major_descriptor if k_major or v_major else rank3)(desc, x, block_n)
        keys.add(keyed[1])
    assert len(keys) == 4  # (False, False, True) launches as (False, True, True)


@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_backward_descriptors_and_gradients_follow_each_layout(monkeypatch, head_dim):
    """q and dout through head-major descriptors where either's heads are apart, k, v, dk and dv where k's or v's are
    (the kernel reads each group at the same coordinates): rank 4, [1, 1, rows, D] boxes of the (B, H, N, D) view;
    2-D [rows, D] boxes of the (B * N, H * D) rows otherwise. dq_accum keeps its contiguous rows and its descriptor.
    The gradients come in their inputs' layouts (``torch.empty_like``'s, as the op's register_fake gives them; dense
    inputs here), dq converted from dq_accum (all zeros, as no kernel ran: every element written over NaN). Each
    combination of forms its own launch key."""
    launches = []
    monkeypatch.setattr(backward_sm90, "launch", lambda kernel, grid, args, cx, keyed: launches.append((args, keyed)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(backward_sm90, "_PLANS", _launch.Plans())
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 256, 384, 4, 2
    cfg = backward_sm90.CONFIGS[head_dim]
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows_out = block_n if cfg["OUTPUT_SPLIT"] else block_n // 2  # the dK / dV rows one warpgroup stores
    q, k, v = qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    names = backward_sm90._attention_backward_sm90_kernel.arg_names

    def rows_view(desc, x, rows):
        assert desc.base is x and desc.block_shape == [rows, head_dim]
        assert desc.shape == [batch * x.shape[1], x.shape[2] * head_dim] and desc.strides == [x.stride(1), 1]

    keys = set()
    for major in ("", "q k v dout", "q k v", "k v", "v", "q dout", "dout"):
        given = dict(q=q, k=k, v=v, dout=torch.empty_like(q))
        x = {name: head_major(t) if name in major.split() else t for name, t in given.items()}
        stats = torch.zeros(batch, nheads, seqlen_q)
        grads = backward_sm90.attention_backward_sm90(x["dout"], x["q"], x["k"], x["v"], stats, stats, 0.1, False)
        args, keyed = launches[-1]
        arg = dict(zip(names, args, strict=False))  # args: the parameters before the constexprs
        q_form = check_head_major_descriptor if {"q", "dout"} & set(major.split()) else rows_view
        kv_form = check_head_major_descriptor if {"k", "v"} & set(major.split()) else rows_view
        q_form(arg["q_desc"], x["q"], block_m)
        q_form(arg["do_desc"], x["dout"], block_m)
        kv_form(arg["k_desc"], x["k"], block_n)
        kv_form(arg["v_desc"], x["v"], block_n)
        kv_form(arg["dk_desc"], grads[1], rows_out)
        kv_form(arg["dv_desc"], grads[2], rows_out)
        dq_accum = arg["dq_ptr"]
        assert dq_accum.is_contiguous() and dq_accum.shape == q.shape and arg["dq_desc"].base is dq_accum
        for grad, name in zip(grads, "qkv", strict=True):
            assert grad.shape == x[name].shape and grad.stride() == x[name].stride() and grad.dtype == x[name].dtype
        assert torch.equal(grads[0], torch.zeros_like(q))
        keys.add(keyed[1])
    assert len(keys) == 4  # rows views or head-major for q and dout, and for k and v


def test_backward_plans_follow_layouts_and_configs(monkeypatch):
    """``backward_plan``: calls on new tensors of one layout reuse the plan (descriptors rebased on the call's
    tensors and fresh outputs, one grid, constexprs and launch key; the plan's output templates on the meta device);
    a changed CONFIGS entry makes another (which inputs qualify is the dispatcher's: ``qualifies``)."""
    launches = []
    monkeypatch.setattr(
        backward_sm90, "launch", lambda kernel, grid, args, cx, keyed: launches.append((grid, args, cx))
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(backward_sm90, "_PLANS", _launch.Plans())
    outputs = backward_sm90._outputs
    devices = []  # where each call's outputs and each plan's templates are allocated
    monkeypatch.setattr(
        backward_sm90, "_outputs", lambda q, k, v, device: devices.append(device.type) or outputs(q, k, v, device)
    )

    def call():
        q, k, v = qkv()
        dout, stats = torch.empty_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return backward_sm90.attention_backward_sm90(dout, q, k, v, stats, stats, 0.1, causal=True), (q, dout, k, v)

    for _ in range(2):
        grads, tensors = call()
        args = launches[-1][1]
        assert [d.base for d in args[:4]] == list(tensors) and [d.base for d in args[4:6]] == list(grads[1:])
        assert args[9].base is args[8] and args[8].shape == tensors[0].shape
    assert len(backward_sm90._PLANS) == 1 and launches[0][0] == launches[1][0] and launches[0][2] == launches[1][2]
    assert devices == ["meta", "cpu", "cpu"]  # the plan's templates allocate nothing on the inputs' device
    monkeypatch.setitem(backward_sm90.CONFIGS[128], "KEY_PAIRS", False)
    call()
    assert launches[-1][2]["KEY_PAIRS"] is False and launches[-1][0] != launches[0][0]
    assert len(launches) == 3 and len(backward_sm90._PLANS) == 2


def test_d64_causal_launches_take_three_warpgroups_from_8k(monkeypatch):
    """CAUSAL_CHANGES_UNTIL: a causal D=64 launch takes CAUSAL_CHANGES (two consumer warpgroups, 128-row items) below
    seqlen_q 8192 and the head dim's CONFIGS as they are (three, 192-row items) from there; full launches take three
    at any length, and D=128 two."""
    launches = []
    monkeypatch.setattr(forward_sm90, "launch", lambda kernel, grid, args, cx, keyed: launches.append(cx))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the plan's launch key
    for head_dim, causal, seqlen_q, num_wg in ((64, True, 8191, 2), (64, True, 8192, 3), (64, True, 20000, 3),
                                               (64, False, 1000, 3), (128, True, 16384, 2)):  # fmt: skip
        q, k, v = qkv(batch=1, seqlen_q=seqlen_q, nheads=1, nheads_k=1, head_dim=head_dim)
        forward_sm90.attention_forward_sm90(q, k, v, torch.empty_like(q), torch.empty(1, 1, seqlen_q), 0.1, causal)
        assert (launches[-1]["NUM_WG"], launches[-1]["CONSUMER_REGS"]) == (num_wg, 160 if num_wg == 3 else 240)


def test_register_split_fits_the_register_file():
    """Each config's consumer warpgroups and the producer (padded to a warpgroup: its 1 warp's setmaxnreg counts
    for 128 threads) within the 65536 registers of an SM (D=64: three consumer warpgroups, two with causal)."""
    causal = [forward_sm90.config(d, causal=True, seqlen_q=2048) for d in forward_sm90.CONFIGS]
    assert [cfg["NUM_WG"] for cfg in (*forward_sm90.CONFIGS.values(), *causal)] == [3, 2, 2, 2, 2, 2]
    for cfg in (*forward_sm90.CONFIGS.values(), *causal):
        assert cfg["NUM_WG"] * 128 * cfg["CONSUMER_REGS"] + 128 * cfg["PRODUCER_REGS"] <= 65536


def test_backward_qualifies():
    q, k, v = qkv(nheads_k=4)
    dout = torch.empty_like(q)
    assert backward_sm90.qualifies(q, k, v, dout, options())
    assert backward_sm90.qualifies(
        *qkv(nheads_k=4, head_dim=64), torch.empty(2, 256, 4, 64, dtype=torch.bfloat16), options(causal=True)
    )
    packed = torch.empty(2, 256, 3, 4, 128, dtype=torch.float16)
    assert backward_sm90.qualifies(
        *packed.unbind(2), torch.empty(2, 256, 4, 128, dtype=torch.float16), options(causal=True)
    )
    q, k, v = qkv(nheads_k=4, head_dim=256)  # the OUTPUT_SPLIT config
    assert backward_sm90.qualifies(q, k, v, torch.empty_like(q), options(causal=True))


@pytest.mark.parametrize(
    "nheads, nheads_k, head_dim",
    [(4, 2, 128), (8, 2, 64), (8, 2, 256), (8, 1, 128), (8, 1, 64), (8, 1, 256)],
    ids=["gqa", "gqa-D64", "gqa-D256", "mqa", "mqa-D64", "mqa-D256"],
)
def test_backward_qualifies_gqa(nheads, nheads_k, head_dim):
    q, k, v = qkv(nheads=nheads, nheads_k=nheads_k, head_dim=head_dim)
    assert backward_sm90.qualifies(q, k, v, torch.empty_like(q), options())


def test_backward_causal_group_limit():
    """Causal: up to MAX_CAUSAL_GROUP query heads per K/V head (larger groups measured faster in Triton);
    without causal any group."""
    limit = backward_sm90.MAX_CAUSAL_GROUP
    for nheads_k, causal, expected in ((1, True, False), (1, False, True), (2, True, True), (2, False, True)):
        q, k, v = qkv(nheads=2 * limit, nheads_k=nheads_k)  # 16 or 8 query heads per K/V head
        assert bool(backward_sm90.qualifies(q, k, v, torch.empty_like(q), options(causal))) == expected, (
            nheads_k,
            causal,
        )


@pytest.mark.parametrize(
    "case",
    [
        dict(nheads=4, nheads_k=3),
        dict(nheads=2, nheads_k=4),
        dict(nheads_k=4, head_dim=96),
        dict(nheads_k=4, seqlen_q=200),
        dict(nheads_k=4, seqlen_k=200),
        dict(nheads_k=4, head_dim=256, seqlen_q=192),
        dict(nheads_k=4, head_dim=192),
    ],
    ids=["H4_3", "H2_4", "D96", "Sq200", "Sk200", "D256-Sq192", "D192"],
)
def test_backward_rejects(case):
    q, k, v = qkv(**case)
    assert not backward_sm90.qualifies(q, k, v, torch.empty_like(q), options())


@pytest.mark.parametrize("block_m", [64, 128], ids=lambda m: f"BLOCK_M{m}")
def test_backward_length_rule_at_head_dim_64(monkeypatch, block_m):
    """D=64's two tile heights (BLOCK_M 128, the default, and 64, tune_gluon.py's A/B) take the same lengths:
    both positive multiples of ROWS = 128 (a 128-row query tile never crosses a batch entry or, causal, the
    first visited tile of a 128-key CTA)."""
    monkeypatch.setitem(backward_sm90.CONFIGS[64], "BLOCK_M", block_m)
    for seqlen_q, seqlen_k, expected in ((128, 128, True), (384, 640, True), (192, 256, False), (256, 192, False)):
        q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64)
        for causal in (False, True):
            assert bool(backward_sm90.qualifies(q, k, v, torch.empty_like(q), options(causal))) == expected, (
                seqlen_q,
                seqlen_k,
            )


def test_dq_rows():
    """One warpgroup's dQ rows: D=64 at BLOCK_M = 128 splits them (64 each); BLOCK_M = 64 (the warpgroups take
    turns) and DQ_SPLIT (D=128/256: the columns are split) keep all."""
    assert backward_sm90.dq_rows(128, False) == 64
    assert backward_sm90.dq_rows(64, False) == 64
    assert backward_sm90.dq_rows(64, True) == 64


@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_backward_needs_a_positive_softmax_scale(head_dim):
    """D=64's 128-row tiles start S^T's accumulator at -lse / scale: the kernel takes positive scales only (one
    rule for every head dim); other scales go to the Triton backward."""
    q, k, v = qkv(head_dim=head_dim)
    dout = torch.empty_like(q)
    assert backward_sm90.qualifies(q, k, v, dout, options())
    for scale in (0.0, -0.1, float("nan")):
        assert not backward_sm90.qualifies(q, k, v, dout, options(softmax_scale=scale)), scale


def test_backward_rejects_k_and_v_with_different_heads():
    q, k, _ = qkv(nheads=4, nheads_k=2)
    v = torch.empty(2, 384, 4, 128, dtype=torch.bfloat16)
    assert not backward_sm90.qualifies(q, k, v, torch.empty_like(q), options())


def test_backward_rejects_broadcast_dout_and_huge_offsets():
    q, k, v = qkv(nheads_k=4)
    ones = torch.ones(1, 1, 1, 1, dtype=q.dtype).expand(q.shape)  # the dout of out.sum().backward()
    assert not backward_sm90.qualifies(q, k, v, ones, options())
    huge = torch.empty(1, 2**20, 16, 128, dtype=torch.bfloat16, device="meta")  # 2**31 elements per batch entry
    assert not backward_sm90.qualifies(huge, huge, huge, huge, options())


@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_backward_launch_passes_the_dq_descriptor_with_dq_tma(monkeypatch, head_dim):
    """DQ_TMA (every head dim): the launch passes a descriptor of dq_accum's fp32 rows whose blocks hold one
    warpgroup's [64, 64] dQ partial (``dq_rows``: D=64 splits its 128-row tiles' dQ by rows; head dim 256's
    128-column halves go through the tile in two chunks) in the 128-byte swizzle of the kernel's staging tiles:
    with DQ_PERMUTED (D=64 and D=128) of the rank-4 view of ``dq_staging_block``'s row order, otherwise of the
    2-D (batch * seqlen_q, nheads * head_dim) rows; with DQ_TMA off None, which compiles the atomic path. The
    views' rows are those of dq_accum, the tensor the kernel's atomics use. Stages: D=64 two
    (its 128-row tiles), D=128 three, D=256 two Q and one dO stage (the staging tiles take the second's
    memory)."""
    calls = []
    monkeypatch.setattr(backward_sm90, "launch", lambda kernel, grid, args, cx, keyed: calls.append((args, cx)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the plan's launch key
    q, k, v = qkv(batch=2, seqlen_q=256, seqlen_k=384, nheads=4, nheads_k=2, head_dim=head_dim)
    stats = torch.zeros(2, 4, 256)
    backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, stats, stats, 0.1, causal=False)
    ((args, constexprs),) = calls
    names = backward_sm90._attention_backward_sm90_kernel.arg_names
    dq_accum = args[names.index("dq_ptr")]
    cfg = backward_sm90.CONFIGS[head_dim]
    assert constexprs["DQ_TMA"] == cfg["DQ_TMA"]
    assert (constexprs["STAGES"], constexprs["DO_STAGES"]) == {64: (2, 2), 128: (3, 3), 256: (2, 1)}[head_dim]
    assert constexprs["BLOCK_M"] == (128 if head_dim == 64 else 64)
    assert list(args[names.index("q_desc")].block_shape) == [constexprs["BLOCK_M"], head_dim]
    assert args[names.index("dq_desc")].base is dq_accum and dq_accum.shape == (2, 256, 4, head_dim)
    assert dq_accum.is_contiguous()
    assert constexprs["DQ_PERMUTED"] == (head_dim != 256)  # measured: backward_sm90.dq_staging_block
    monkeypatch.setitem(cfg, "DQ_PERMUTED", True)
    backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, stats, stats, 0.1, causal=False)
    dq_desc = calls[-1][0][names.index("dq_desc")]
    row = 4 * head_dim  # dq_accum's row stride; rows 8 R + 4 a + b at (R, b, a) of the rank-4 view
    assert list(dq_desc.shape) == [2 * 256 // 8, 4, 2, row] and list(dq_desc.strides) == [8 * row, row, 4 * row, 1]
    rows = backward_sm90.dq_rows(cfg["BLOCK_M"], cfg["DQ_SPLIT"])
    assert list(dq_desc.block_shape) == [rows // 8, 4, 2, backward_sm90.DQ_TILE_COLS] == [8, 4, 2, 64]
    assert (dq_desc.layout.swizzle_byte_width, dq_desc.layout.element_bitwidth, dq_desc.layout.rank) == (128, 32, 4)
    monkeypatch.setitem(cfg, "DQ_PERMUTED", False)
    backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, stats, stats, 0.1, causal=False)
    plain = calls[-1][0][names.index("dq_desc")]
    assert list(plain.shape) == [2 * 256, row] and list(plain.strides) == [row, 1]
    assert list(plain.block_shape) == [rows, backward_sm90.DQ_TILE_COLS] == [64, 64]
    assert (plain.layout.swizzle_byte_width, plain.layout.element_bitwidth) == (128, 32)
    monkeypatch.setitem(cfg, "DQ_TMA", False)
    backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, stats, stats, 0.1, causal=False)
    assert calls[-1][0][names.index("dq_desc")] is None and calls[-1][1]["DQ_TMA"] is False


def test_permuted_dq_descriptor_adds_each_staging_row_into_its_own_row():
    """DQ_PERMUTED: the kernel stores a [64, C] dQ partial x into its staging tile as
    x.reshape(8, 2, 4, C).permute(0, 2, 1, 3) (``_dq_step``), and the copy engine adds the tile at (row0 / 8, 0, 0,
    col) of ``dq_descriptor``'s rank-4 view. Through that view (its shape and strides, as the copy engine reads
    them), the tile written at a tile-aligned row of a later batch entry and a later head's columns lands as x
    itself in dq_accum's plain layout, and nowhere else."""
    batch, seqlen, nheads, head_dim = 2, 256, 4, 128
    dq_accum = torch.zeros(batch, seqlen, nheads, head_dim)
    desc = backward_sm90.dq_descriptor(dq_accum, 64, True)
    view = dq_accum.as_strided(desc.shape, desc.strides)
    x = torch.randn(64, 64)
    row0, col = seqlen + 128, 2 * head_dim + 64  # batch entry 1, query rows 128.., head 2's second half
    assert list(desc.block_shape) == [8, 4, 2, 64]
    view[row0 // 8 : row0 // 8 + 8, :, :, col : col + 64] = x.reshape(8, 2, 4, 64).permute(0, 2, 1, 3)
    rows = dq_accum.view(batch * seqlen, nheads * head_dim)
    torch.testing.assert_close(rows[row0 : row0 + 64, col : col + 64], x, rtol=0, atol=0)
    assert rows.count_nonzero() == x.count_nonzero()


def test_backward_key_pairs_launch_one_cta_per_pair_of_key_tiles(monkeypatch):
    """KEY_PAIRS (on at every head dim): a causal launch gets n_n - n_n // 2 CTAs per (K/V head,
    batch entry) for n_n key tiles (an odd n_n's middle tile alone, ``backward_sm90.programs``), a grid
    (programs, nheads_k, batch); off, or without causal, one CTA per key tile."""
    assert {d: cfg["KEY_PAIRS"] for d, cfg in backward_sm90.CONFIGS.items()} == {64: True, 128: True, 256: True}
    paired = dict(backward_sm90.CONFIGS[128], KEY_PAIRS=True)
    assert [backward_sm90.programs(n_n, paired, True) for n_n in (1, 2, 5, 8)] == [1, 1, 3, 4]
    assert backward_sm90.programs(5, paired, False) == 5
    assert backward_sm90.programs(5, dict(paired, KEY_PAIRS=False), True) == 5
    grids = []
    monkeypatch.setattr(
        backward_sm90, "launch", lambda kernel, grid, args, cx, kd: grids.append((grid, cx["KEY_PAIRS"]))
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the plan's launch key
    for head_dim in (64, 128, 256):
        q, k, v = qkv(batch=3, seqlen_q=256, seqlen_k=640, nheads=4, nheads_k=2, head_dim=head_dim)
        stats = torch.zeros(3, 4, 256)
        n_n = 640 // backward_sm90.CONFIGS[head_dim]["BLOCK_N"]  # 5 key tiles of 128 rows, 10 of 64 (D=256)
        monkeypatch.setitem(backward_sm90.CONFIGS[head_dim], "KEY_PAIRS", False)
        backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, stats, stats, 0.1, causal=True)
        monkeypatch.setitem(backward_sm90.CONFIGS[head_dim], "KEY_PAIRS", True)
        for causal in (True, False):
            backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, stats, stats, 0.1, causal)
        assert grids[-3:] == [((n_n, 2, 3), False), ((n_n - n_n // 2, 2, 3), True), ((n_n, 2, 3), True)]


def _recorded(launch, tag, calls):
    """``launch`` (a Gluon launcher, called only for inputs the dispatcher found qualifying) appending (tag,
    causal), or (tag, window) for a window launch, to ``calls`` at each launch."""

    def recorded(*args, **kwargs):
        calls.append((tag, kwargs.get("window") or kwargs["causal"]))
        return launch(*args, **kwargs)

    return recorded


@pytest.fixture
def launches(monkeypatch):
    """Records the launches of the Gluon kernels: ("fwd" or "bwd", causal or the window)."""
    calls = []
    monkeypatch.setattr(
        forward_sm90, "attention_forward_sm90", _recorded(forward_sm90.attention_forward_sm90, "fwd", calls)
    )
    monkeypatch.setattr(
        backward_sm90, "attention_backward_sm90", _recorded(backward_sm90.attention_backward_sm90, "bwd", calls)
    )
    return calls


ORACLE_CASES = {
    **{f"D128-B{b}-Sq{sq}-Sk{sk}-H{h}_{hk}": (128, (b, sq, sk, h, hk))
       for b, sq, sk, h, hk in [(2, 128, 128, 4, 4), (1, 256, 512, 4, 2), (2, 512, 256, 4, 4), (1, 384, 1152, 2, 1),
                                (1, 1024, 1024, 8, 8)]},
    **{f"D256-B{b}-Sq{sq}-Sk{sk}-H{h}_{hk}": (256, (b, sq, sk, h, hk))
       for b, sq, sk, h, hk in [(2, 128, 128, 4, 4), (1, 256, 512, 4, 2), (2, 512, 256, 2, 2), (1, 1000, 1000, 4, 4),
                                (2, 17, 113, 4, 1)]},
}  # fmt: skip
"""(head dim, (B, Sq, Sk, H, Hk)): MHA, GQA and MQA; Sq > Sk (causal: query rows that see no key); at D=256 odd
lengths too."""


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", ORACLE_CASES.values(), ids=ORACLE_CASES.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_against_oracle(launches, dtype, causal, case):
    """Forward and backward against the oracle. The forward is Gluon at both head dims; the backward is Gluon
    where backward_sm90 serves the head dim (its CONFIGS) and both lengths are multiples
    of 128, the Triton one otherwise."""
    head_dim, shape = case
    check(*make_inputs(*shape, head_dim, dtype=dtype), causal=causal)
    gluon_backward = head_dim in backward_sm90.CONFIGS and shape[1] % 128 == 0 and shape[2] % 128 == 0
    assert launches == [("fwd", causal)] + ([("bwd", causal)] if gluon_backward else [])


def gluon_launches(window: bool, head_dim: int, seqlen_q: int, seqlen_k: int, launched) -> list[tuple]:
    """The sm_90 launches (``launches``) of one forward+backward with ``launched`` its mask: without a window both
    kernels, with one each kernel at its ``common.WINDOW_HEAD_DIMS``; the backward only where both lengths are
    multiples of 128."""
    forward, backward = (
        not window or head_dim in sm90_common.WINDOW_HEAD_DIMS[kernel] for kernel in ("forward", "backward")
    )
    backward = backward and seqlen_q % 128 == 0 and seqlen_k % 128 == 0
    return [("fwd", launched)] * forward + [("bwd", launched)] * backward


WINDOW_CASES = {
    **{f"D{d}-B{b}-Sq{sq}-Sk{sk}-H{h}_{hk}": (d, (b, sq, sk, h, hk))
       for d in (64, 128, 256)
       for b, sq, sk, h, hk in [(2, 512, 512, 4, 2), (1, 384, 1152, 2, 1), (1, 640, 256, 4, 4), (2, 257, 1023, 4, 2)]},
}  # fmt: skip
"""(head dim, (B, Sq, Sk, H, Hk)) of the window tests: lengths the Gluon backward takes (multiples of 128; equal,
Sq < Sk and Sq > Sk) and odd ones (its backward the Triton kernels'), MHA, GQA and MQA."""

WINDOWS = [(200, 0), (64, 0), (100, 100), (-1, 50), (300, -1), (0, 0), (1, 300)]
"""flash_attn window_size values: causal sliding windows (one of a tile's width or less), both sides, a right or a
left side alone, the diagonal alone, and a window wider on the right."""


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", WINDOW_CASES.values(), ids=WINDOW_CASES.keys())
@pytest.mark.parametrize("window_size", WINDOWS, ids=str)
def test_window_against_oracle(launches, window_size, case):
    """Sliding windows on the Gluon kernels: out, lse, dq, dk and dv against the oracle by the tolerance rule, out and
    lse written over NaN. Rows and key tiles that see nothing (Sq > Sk; keys outside every row's window) run one
    fully masked tile: out 0, lse -inf, no gradient. The forward is Gluon for every case at head dims 128 and 256,
    the backward where both lengths are multiples of 128 (one launch each, with the window the options hold), at
    head dim 64 too, whose forward runs the Triton kernel (``common.WINDOW_HEAD_DIMS``)."""
    head_dim, shape = case
    q, k, v, dout = make_inputs(*shape, head_dim, dtype=torch.bfloat16)
    results = run_flashtile(q, k, v, dout, window_size=window_size)
    check_against_oracle(results, q, k, v, dout, window_size=window_size)
    seqlen_q, seqlen_k = shape[1:3]
    opts = AttentionOptions(1.0, *checks.bounded_window(*checks.window_bounds(window_size, False), seqlen_q, seqlen_k))
    launched = sm90_common.window_of(opts) or opts.causal
    assert launches == gluon_launches(opts.local, head_dim, seqlen_q, seqlen_k, launched)


SCORE_MOD_CASES = {
    f"D{d}-B{b}-Sq{sq}-Sk{sk}-H{h}_{hk}": (d, (b, sq, sk, h, hk))
    for d in (64, 128, 256)
    for b, sq, sk, h, hk in [(2, 384, 384, 4, 2), (1, 256, 640, 2, 1), (2, 200, 77, 4, 4)]
}
"""(head dim, (B, Sq, Sk, H, Hk)) of the softcap and ALiBi tests: lengths the Gluon backward takes (Sq = Sk and Sq <
Sk) and odd ones with Sq > Sk (the backward the Triton kernels'), MHA, GQA and MQA."""


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", SCORE_MOD_CASES.values(), ids=SCORE_MOD_CASES.keys())
@pytest.mark.parametrize("mods", ["softcap", "softcap-tight", "alibi", "alibi-batch", "softcap+alibi"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_score_modifications_against_oracle(launches, causal, mods, case):
    """softcap (30, and 2: most scores in the tanh's curve) and ALiBi ((nheads,) slopes, and (batch, nheads)) on the
    Gluon kernels: out, lse, dq, dk and dv against the oracle by the tolerance rule. The forward is Gluon for every
    case; the backward where both lengths are multiples of 128, but not with softcap at head dim 64."""
    head_dim, shape = case
    batch, seqlen_q, seqlen_k, nheads, _ = shape
    q, k, v, dout = make_inputs(*shape, head_dim, dtype=torch.bfloat16)
    options = {}
    if "softcap" in mods:
        options["softcap"] = 2.0 if mods == "softcap-tight" else 30.0
    if "alibi" in mods:
        slopes = torch.rand(batch, nheads) if mods == "alibi-batch" else torch.rand(nheads)
        options["alibi_slopes"] = slopes.to("cuda")
    check(q, k, v, dout, causal=causal, **options)
    gluon_backward = seqlen_q % 128 == 0 and seqlen_k % 128 == 0 and not ("softcap" in mods and head_dim == 64)
    assert launches == [("fwd", causal)] + [("bwd", causal)] * gluon_backward


BACKWARD_HEAD_MAJOR_SHAPES = [(2, 128, 128, 4, 4), (1, 256, 640, 4, 2), (2, 512, 256, 2, 2), (1, 384, 1152, 8, 1),
                              (2, 384, 384, 8, 2)]  # fmt: skip
"""(B, Sq, Sk, H, Hk) with lengths the Gluon backward takes (multiples of 128): MHA, GQA and MQA, Sq < Sk and Sq > Sk
(causal: query rows that see no key)."""

HEAD_MAJOR_SHAPES = [(2, 1, 1, 4, 4), (1, 17, 113, 4, 2), (2, 113, 17, 2, 2), (2, 257, 1023, 4, 1),
                     (3, 1000, 1000, 8, 8), *BACKWARD_HEAD_MAJOR_SHAPES]  # fmt: skip
"""(B, Sq, Sk, H, Hk) of the head-major tests: odd lengths (the backward then the Triton kernel's), Sq > Sk, MHA,
GQA and MQA."""

HEAD_MAJOR_LAYOUTS = {"qkv": "q k v", "qkv-dout": "q k v dout", "kv": "k v", "q-dout": "q dout"}
"""Which of q, k, v and dout have torch's (B, H, N, D) memory: SDPA's q, k and v (its dout usually has out's (B, N,
H, D) memory), all four, a cache's k and v (as transformers hands prefill), q and dout alone."""


def head_major_inputs(major: str, **tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` (q, k, v, dout of make_inputs) in order, those named in ``major`` as ``head_major`` views."""
    return [head_major(x) if name in major.split() else x for name, x in tensors.items()]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("shape", HEAD_MAJOR_SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s))
@pytest.mark.parametrize("layouts", HEAD_MAJOR_LAYOUTS.values(), ids=HEAD_MAJOR_LAYOUTS.keys())
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_major_against_oracle(launches, causal, head_dim, layouts, shape):
    """q, k, v and dout in torch's (B, H, N, D) memory, all or some (``HEAD_MAJOR_LAYOUTS``), as transposed views
    through ``flash_attn_func``: the Gluon forward and backward read them through head-major descriptors (the
    backward where both lengths are multiples of 128, the Triton one otherwise); out, lse, dq, dk and dv against the
    oracle by the tolerance rule, and the gradients in the inputs' layouts."""
    q, k, v, dout = make_inputs(*shape, head_dim, dtype=torch.bfloat16)
    q, k, v, dout = head_major_inputs(layouts, q=q, k=k, v=v, dout=dout)
    results = run_flashtile(q, k, v, dout, causal=causal)
    check_against_oracle(results, q, k, v, dout, causal=causal)
    assert [results[name].stride() for name in ("dq", "dk", "dv")] == [q.stride(), k.stride(), v.stride()]
    gluon_backward = shape[1] % 128 == 0 and shape[2] % 128 == 0
    assert launches == [("fwd", causal)] + ([("bwd", causal)] if gluon_backward else [])


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("shape", HEAD_MAJOR_SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s))
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_head_major_sdpa_against_oracle(launches, is_causal, head_dim, shape):
    """``flashtile.scaled_dot_product_attention`` on contiguous (B, H, N, D) tensors (GQA through enable_gqa) against
    the oracle: the Gluon forward runs for every call (a causal one with Sq != Sk as the window (None, Sq - Sk):
    top-left causal in the kernels' bottom-right terms, but at head dim 64, whose windows run the Triton kernels), the
    Gluon backward for those with lengths multiples of 128; the gradients come back in the leaves' (B, H, N, D)
    layout."""
    q, k, v, dout = make_inputs(*shape, head_dim, dtype=torch.bfloat16)
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out = flashtile.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=0.2, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    grads = {name: x.grad.transpose(1, 2) for name, x in zip(("dq", "dk", "dv"), leaves, strict=True)}
    results = {"out": out.transpose(1, 2), **grads}
    seqlen_q, seqlen_k = shape[1:3]
    top_left = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda").tril() if is_causal else None
    check_against_oracle(results, q, k, v, dout, softmax_scale=0.2, mask=top_left)
    assert [x.grad.stride() for x in leaves] == [x.stride() for x in leaves]
    window = is_causal and seqlen_q != seqlen_k
    launched = (None, seqlen_q - seqlen_k) if window else is_causal
    assert launches == gluon_launches(window, head_dim, seqlen_q, seqlen_k, launched)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("shape", HEAD_MAJOR_SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s))
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_major_matches_rows_layout_bit_for_bit(causal, head_dim, shape):
    """The same values in (B, H, N, D) and (B, N, H, D) memory give the same out and lse bit for bit (one kernel,
    only the copy engine's addressing differs), written over NaN: every row of out and lse is written, out in q's
    layout (allocated like q, as the dispatcher does)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    q, k, v, _ = make_inputs(*shape, head_dim, dtype=torch.bfloat16)

    def forward(q, k, v):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, nheads, seqlen_q), float("nan"), device=q.device)
        forward_sm90.attention_forward_sm90(q, k, v, out, lse, head_dim**-0.5, causal)
        return out, lse

    rows = forward(q, k, v)
    assert not rows[0].isnan().any() and not rows[1].isnan().any()
    for inputs in ((head_major(q), head_major(k), head_major(v)), (q, head_major(k), head_major(v))):
        out, lse = forward(*inputs)
        assert out.stride() == inputs[0].stride() and torch.equal(out, rows[0]) and torch.equal(lse, rows[1])


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("shape", BACKWARD_HEAD_MAJOR_SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s))
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_major_backward_matches_rows_layout(causal, head_dim, shape):
    """The Gluon backward on the same values in (B, H, N, D) and (B, N, H, D) memory (every ``HEAD_MAJOR_LAYOUTS``
    mix): dk and dv bit for bit (one kernel, only the copy engine's addressing differs; their sums run in one order),
    dq up to the order of its fp32 sums (atomic adds: about one rounding of bf16 at the largest magnitude), each
    written over NaN and in its input's layout."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    q, k, v, dout = make_inputs(*shape, head_dim, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    out, lse = torch.empty_like(q), torch.empty(batch, nheads, seqlen_q, device=q.device)
    forward_sm90.attention_forward_sm90(q, k, v, out, lse, scale, causal)
    delta = backward.attention_delta(dout, out, None)
    rows = backward_sm90.attention_backward_sm90(dout, q, k, v, lse, delta, scale, causal)
    assert not any(x.isnan().any() for x in rows)
    for layouts in HEAD_MAJOR_LAYOUTS.values():
        hq, hk, hv, hdout = head_major_inputs(layouts, q=q, k=k, v=v, dout=dout)
        dq, dk, dv = backward_sm90.attention_backward_sm90(hdout, hq, hk, hv, lse, delta, scale, causal)
        assert [dq.stride(), dk.stride(), dv.stride()] == [hq.stride(), hk.stride(), hv.stride()], layouts
        assert torch.equal(dk, rows[1]) and torch.equal(dv, rows[2]), layouts
        assert (dq.float() - rows[0].float()).abs().max().item() <= 2**-7 * rows[0].float().abs().max().item()


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2, 1, 1, 4, 4), (1, 17, 113, 4, 2), (2, 113, 17, 2, 2), (1, 1000, 1000, 8, 8), (2, 257, 1023, 4, 1),
     (3, 130, 250, 2, 2)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_any_lengths_against_oracle(launches, dtype, causal, shape):
    """Lengths that are not multiples of 128: the last query tile's rows past seqlen_q (zeros) are neither
    stored to out nor to lse, the last key tile's keys past seqlen_k (zeros) get no weight, and no tile reads
    or writes the next batch entry's rows; Sq > Sk causal has query rows that see no key. The backward is the
    Triton one (the Gluon backward takes multiples of 128 only)."""
    check(*make_inputs(*shape, 128, dtype=dtype), causal=causal)
    assert launches == [("fwd", causal)]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(4, 1024, 1024, 16, 4), (3, 1000, 1100, 16, 16), (2, 2048, 1536, 32, 8)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)
@pytest.mark.parametrize(
    "head_dim, causal",
    [(64, False), (128, False), (128, True), (256, False), (256, True)],
    ids=["D64-full", "D128-full", "D128-causal", "D256-full", "D256-causal"],
)  # causal D=64 below N=2k runs the Triton kernel: test_causal_persistent_against_oracle runs it here
def test_persistent_programs_take_several_work_items(monkeypatch, launches, head_dim, causal, shape):
    """More query tiles x heads x batch entries than SMs, min(items, SMs) CTAs: each walks several work items,
    so the K/V ring, the Q hand-over, the ping-pong turns and the O staging carry on from one item to the next.
    D=64 and 128 without causal launch so; the other variants launch one CTA per item and are made persistent here
    (the kernel takes any CTA count): causal's heaviest-first order, and at D=256 (no O tile) the Q tile that O
    leaves through, handed to the next item once the store has read it."""
    batch, seqlen_q, _, nheads, _ = shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert -(-seqlen_q // 128) * nheads * batch > 2 * sms
    if head_dim == 256 or causal:
        monkeypatch.setattr(forward_sm90, "programs", lambda n_m, n_bh, *rest: min(n_m * n_bh, sms))
    check(*make_inputs(*shape, head_dim, dtype=torch.bfloat16), causal=causal)
    assert launches[0] == ("fwd", causal)


CAUSAL_PAIR_SHAPES = [
    (2, 1024, 1024, 4, 2), (3, 640, 640, 2, 2), (1, 100, 100, 3, 1), (2, 1000, 1500, 4, 4), (2, 1500, 1000, 2, 1),
    (1, 384, 1280, 2, 2),
]  # fmt: skip
"""(B, Sq, Sk, H, Hk) of the causal query-tile pair tests: even and odd tile counts (8 / 5 / 1 tiles of 128 rows),
seqlen_q != seqlen_k both ways, GQA and MQA, odd lengths."""


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    CAUSAL_PAIR_SHAPES,
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_causal_pairs_against_oracle(monkeypatch, launches, head_dim, shape):
    """CAUSAL_PAIRS on (D=64's causal forwards on this kernel at every length): a CTA walks a head's heaviest query tile
    and then its lightest; even and odd tile counts (the middle tile alone), one tile, seqlen_q != seqlen_k both ways
    (rows that see no key), GQA, odd lengths; out and lse against the oracle, the backward after it."""
    monkeypatch.setitem(forward_sm90.CONFIGS[head_dim], "CAUSAL_PAIRS", True)
    monkeypatch.setitem(forward_sm90.CONFIGS[head_dim], "CAUSAL_PERSISTENT", False)
    monkeypatch.setitem(forward_sm90.CONFIGS[head_dim], "CAUSAL_SCHEDULE", False)
    check(*make_inputs(*shape, head_dim, dtype=torch.bfloat16), causal=True)
    assert launches[0] == ("fwd", True)


def test_causal_persistent_launches_one_cta_per_sm_at_most(monkeypatch):
    """CAUSAL_PERSISTENT (on at every head dim, with CAUSAL_PAIRS): with causal and CAUSAL_PAIRS min(pair slots,
    SMs) CTAs, n_bh * ceil(n_m / 2) slots (an odd n_m's middle tile one of its own); without CAUSAL_PAIRS one CTA
    per item; without CAUSAL_PERSISTENT one per slot."""
    assert {d: cfg["CAUSAL_PERSISTENT"] for d, cfg in forward_sm90.CONFIGS.items()} == {64: True, 128: True, 256: True}
    monkeypatch.setattr(forward_sm90, "sm_count", lambda device: 132)
    persistent = dict(forward_sm90.CONFIGS[128], CAUSAL_PAIRS=True, CAUSAL_PERSISTENT=True)
    cpu = torch.device("cpu")
    # (n_m, n_bh, CTAs): n_bh * ceil(n_m / 2) slots (n_m = 5: two pairs and a middle tile per head), at most 132
    for n_m, n_bh, ctas in ((2, 6, 6), (5, 20, 60), (1, 40, 40), (1, 200, 132), (8, 128, 132), (5, 100, 132)):
        assert forward_sm90.programs(n_m, n_bh, persistent, True, cpu) == ctas, (n_m, n_bh)
    assert forward_sm90.programs(5, 20, dict(persistent, CAUSAL_PAIRS=False), True, cpu) == 100
    assert forward_sm90.programs(5, 100, dict(persistent, CAUSAL_PERSISTENT=False), True, cpu) == 300


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [*CAUSAL_PAIR_SHAPES, (4, 1152, 1152, 16, 4)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("ctas", [3, None], ids=["3-ctas", "sm-count"])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_causal_persistent_against_oracle(monkeypatch, launches, head_dim, ctas, shape):
    """CAUSAL_PERSISTENT with CAUSAL_PAIRS (D=64's causal forwards on this kernel at every length): persistent CTAs walk
    pair slots, three CTAs (``sm_count`` patched: each walks many slots, pairs and then an odd n_m's middle tiles) or
    the GPU's SMs (B4-Sq1152: 320 slots, n_m = 9); even and odd tile counts, one tile, seqlen_q != seqlen_k both ways
    (rows that see no key), GQA / MQA, odd lengths; out and lse against the oracle, the backward after it."""
    monkeypatch.setitem(forward_sm90.CONFIGS[head_dim], "CAUSAL_PAIRS", True)
    monkeypatch.setitem(forward_sm90.CONFIGS[head_dim], "CAUSAL_PERSISTENT", True)
    monkeypatch.setitem(forward_sm90.CONFIGS[head_dim], "CAUSAL_SCHEDULE", False)
    if ctas is not None:
        monkeypatch.setattr(forward_sm90, "sm_count", lambda device: ctas)
    check(*make_inputs(*shape, head_dim, dtype=torch.bfloat16), causal=True)
    assert launches[0] == ("fwd", True)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [*CAUSAL_PAIR_SHAPES, (4, 1152, 1152, 16, 4)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("ctas", [3, None], ids=["3-ctas", "sm-count"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, "64-three"], ids=lambda d: f"D{d}")
def test_causal_schedule_against_oracle(monkeypatch, launches, head_dim, ctas, shape):
    """CAUSAL_SCHEDULE: persistent CTAs walk the lists ``causal_schedule`` deals them, three CTAs
    (``sm_count`` patched: long lists) or the GPU's SMs; even and odd tile counts, one tile, seqlen_q != seqlen_k
    both ways (rows that see no key), GQA / MQA, odd lengths; D=64 with two warpgroups (128-row items) and with three
    (192-row items); out and lse against the oracle, the backward after it."""
    if head_dim == "64-three":
        head_dim = 64
        monkeypatch.setitem(forward_sm90.CAUSAL_CHANGES, 64, {})
    monkeypatch.setitem(forward_sm90.CONFIGS[head_dim], "CAUSAL_SCHEDULE", True)
    if ctas is not None:
        monkeypatch.setattr(forward_sm90, "sm_count", lambda device: ctas)
    check(*make_inputs(*shape, head_dim, dtype=torch.bfloat16), causal=True)
    assert launches[0] == ("fwd", True)


@pytest.mark.parametrize(
    "n_m, n_bh, n_ctas, seqlen_q, seqlen_k, block_m, block_n",
    [(16, 256, 132, 2048, 2048, 128, 128), (43, 32, 132, 8192, 8192, 192, 128), (5, 3, 132, 600, 300, 128, 128),
     (9, 64, 3, 1152, 1152, 128, 64), (3, 2, 4, 300, 1280, 128, 128)],
)  # fmt: skip
def test_causal_schedule_deals_every_item_once(n_m, n_bh, n_ctas, seqlen_q, seqlen_k, block_m, block_n):
    """``_lpt_schedule``: n_ctas + 1 offsets from 0 to the item count, then every item bh * n_m + m exactly once,
    and CTA loads (key tiles + SCHEDULE_ITEM_COST per item) within one item's cost of each other where every CTA
    gets an item (each item goes to the least loaded CTA, so the last item of the most loaded one raised a load no
    larger than the final least). Shapes: D=64 at 2k and with three warpgroups at 8k, more CTAs than
    items, Sq > Sk and Sq < Sk, a few CTAs with long lists."""
    schedule = forward_sm90._lpt_schedule(n_m, n_bh, n_ctas, seqlen_q, seqlen_k, block_m, block_n)
    offsets, items = schedule[: n_ctas + 1], schedule[n_ctas + 1 :]
    assert offsets[0] == 0 and offsets[-1] == len(items) == n_m * n_bh
    assert list(offsets) == sorted(offsets)
    assert sorted(items) == list(range(n_m * n_bh))
    diag = seqlen_k - seqlen_q

    def cost(item: int) -> int:
        kv_end = max(min(seqlen_k, (item % n_m + 1) * block_m + diag), 1)
        return -(-kv_end // block_n) + forward_sm90.SCHEDULE_ITEM_COST

    loads = [sum(map(cost, items[offsets[p] : offsets[p + 1]])) for p in range(n_ctas)]
    if n_m * n_bh >= n_ctas:
        assert max(loads) - min(loads) <= max(map(cost, items)), loads


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2, 1024, 1024, 4, 2), (3, 576, 640, 2, 2), (1, 100, 100, 3, 1), (1, 192, 128, 2, 2), (2, 1000, 1500, 4, 4),
     (2, 1500, 1000, 2, 1)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("ctas", ["launched", "three"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_three_warpgroups_at_head_dim_64_against_oracle(monkeypatch, launches, causal, ctas, shape):
    """D=64's config: 192-row work items of three consumer warpgroups, the turn going round all three (causal, at
    every length here: shipped causal launches take three from seqlen_q 16k, two below, CAUSAL_CHANGES_UNTIL);
    seqlen_q a multiple of 192 and not, one tile, seqlen_q != seqlen_k both ways (causal: rows that see no key),
    GQA and MQA, odd and ragged lengths; out and lse against the oracle, the backward after it. "launched": the
    CTAs ``programs`` picks (causal: min(items, SMs) walking ``causal_schedule``'s lists, CAUSAL_SCHEDULE); "three":
    three CTAs (pairs and lists off), so each walks several items and the ring, the Q hand-over, the turns and the O
    tile carry on across them."""
    assert forward_sm90.CONFIGS[64]["NUM_WG"] == 3
    monkeypatch.setitem(forward_sm90.CONFIGS[64], "CAUSAL_PAIRS", ctas == "launched")
    monkeypatch.setitem(forward_sm90.CONFIGS[64], "CAUSAL_SCHEDULE", ctas == "launched")
    monkeypatch.setitem(forward_sm90.CAUSAL_CHANGES, 64, {})
    if ctas == "three":
        monkeypatch.setattr(forward_sm90, "programs", lambda n_m, n_bh, *rest: min(n_m * n_bh, 3))
    check(*make_inputs(*shape, 64, dtype=torch.bfloat16), causal=causal)
    assert launches[0] == ("fwd", causal)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_any_lengths_stay_in_their_batch_entry(head_dim, causal):
    """Each batch entry's out and lse, written over NaN, equal bit for bit a launch on that entry alone: the
    clipped last tiles write every row of their entry and nothing of the next one (whose rows follow in
    memory), and the zero-filled loads read nothing of it."""
    batch, seqlen_q, seqlen_k, nheads = 3, 77, 200, 2
    q, k, v, _ = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads, head_dim, dtype=torch.bfloat16)

    def forward(q, k, v):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], nheads, seqlen_q), float("nan"), device=q.device)
        forward_sm90.attention_forward_sm90(q, k, v, out, lse, 128**-0.5, causal)
        return out, lse

    out, lse = forward(q, k, v)
    for b in range(batch):
        out_b, lse_b = forward(q[b : b + 1], k[b : b + 1], v[b : b + 1])
        assert torch.equal(out[b : b + 1], out_b) and torch.equal(lse[b : b + 1], lse_b)  # NaN != NaN


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(2, 256, 384, 4), (1, 512, 256, 2), (2, 1024, 1024, 8), (1, 2048, 2048, 4), (1, 2048, 1920, 2)], ids=str
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_backward_head_dim_64(launches, dtype, causal, shape):
    """Head dim 64: the forward and the backward Gluon, causal or not; with a gradient at the LSE too (delta =
    rowsum(dout * out) - dlse)."""
    batch, seqlen_q, seqlen_k, nheads = shape
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads, 64, dtype=dtype)
    dlse = torch.randn(batch, nheads, seqlen_q, device="cuda")
    check(q, k, v, dout, dlse=dlse, causal=causal)
    assert launches == [("fwd", causal), ("bwd", causal)]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2, 128, 128, 4), (1, 256, 640, 2), (2, 640, 256, 4), (1, 2048, 1024, 4), (1, 1024, 2048, 2)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}".format(*s),
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_backward_head_dim_256(launches, dtype, causal, shape):
    """Head dim 256, the OUTPUT_SPLIT kernel (64-key CTAs; WG 0: S, P and dV, WG 1: dP, dS and dK, dQ split by
    columns): one key tile and many, Sq != Sk both ways (Sq > Sk causal: query rows that see no key; Sq < Sk
    causal: key tiles past the last query's diagonal), with a gradient at the LSE too; dq, dk and dv against
    the oracle through ``check``."""
    batch, seqlen_q, seqlen_k, nheads = shape
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads, 256, dtype=dtype)
    dlse = torch.randn(batch, nheads, seqlen_q, device="cuda")
    check(q, k, v, dout, dlse=dlse, causal=causal)
    assert launches == [("fwd", causal), ("bwd", causal)]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_head_dim_256_many_ctas(launches, causal):
    """Head dim 256 with more CTAs (64-key tiles x K/V heads x batch entries) than SMs and long query walks:
    the Q/dO ring, the P^T hand-over and the two dS^T buffers carry on over many iterations and query heads
    (GQA 4:1)."""
    q, k, v, dout = make_inputs(2, 4096, 4096, 8, 2, 256, dtype=torch.bfloat16)
    check(q, k, v, dout, causal=causal)
    assert launches == [("fwd", causal), ("bwd", causal)]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2, 256, 384, 8, 2), (1, 512, 512, 8, 1), (2, 1024, 1024, 16, 4)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_backward_gqa(launches, dtype, causal, head_dim, shape):
    """GQA / MQA: one CTA per K/V head walks every query head of its group, summing dK and dV over them and
    adding each head's dQ into that head's slice; with a gradient at the LSE (a delta that differs per head)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype=dtype)
    dlse = torch.randn(batch, nheads, seqlen_q, device="cuda")
    check(q, k, v, dout, dlse=dlse, causal=causal)
    gluon_forward = [("fwd", causal)] if forward_sm90.qualifies(q, k, v, options(causal)) else []
    assert launches == [*gluon_forward, ("bwd", causal)]


def _matches_other_config(monkeypatch, inputs, causal, head_dim, changes, same_probs=True):
    """The default config's backward against the oracle and against the same inputs' backward under
    ``changes`` to CONFIGS[head_dim] (also against the oracle): with ``same_probs`` dk and dv bit for bit (their
    sums run in the same order whatever the dQ path or ring depths), dq up to the order of its fp32 sums, so by
    at most about one rounding of the input dtype at the largest magnitude; without it (the configs compute P
    and dS with different fp32 roundings: D=64's BLOCK_M) dk and dv by that rule too."""
    check(*inputs, causal=causal)
    default = run_flashtile(*inputs, causal=causal)
    for key, value in changes.items():
        monkeypatch.setitem(backward_sm90.CONFIGS[head_dim], key, value)
    check(*inputs, causal=causal)
    other = run_flashtile(*inputs, causal=causal)
    if same_probs:
        assert torch.equal(default["dk"], other["dk"]) and torch.equal(default["dv"], other["dv"])
        close = ("dq",)
    else:
        close = ("dq", "dk", "dv")
    for name in close:
        scale = other[name].float().abs().max().item()
        assert (default[name].float() - other[name].float()).abs().max().item() <= 2**-7 * scale, name


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "head_dim, atomics",
    [(64, dict(DQ_TMA=False)), (128, dict(DQ_TMA=False)), (256, dict(DQ_TMA=False, DO_STAGES=2)),
     (256, dict(DQ_TMA=False))],
    ids=["D64", "D128", "D256", "D256-one-dO-stage"],
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_dq_tma_matches_the_atomics(monkeypatch, launches, causal, head_dim, atomics):
    """DQ_TMA (each warpgroup's dQ partial staged in shared memory, added by TMA reduces: one per iteration at
    D=64/128, two [64, 64] chunks through the one staging tile at D=256) on long walks, GQA 4:1 with 32 query
    tiles per head (D=64: 16 of 128 rows, each warpgroup reducing its 64 rows): 128 (64) iterations per CTA,
    each warpgroup's staging tile reused across query heads. Against the oracle and against the per-thread
    atomics it replaces: at D=256 main's kernel (two dO stages, DQ_TMA=0,DO_STAGES=2) and the atomics with the
    one dO stage."""
    inputs = make_inputs(2, 2048, 2048, 8, 2, head_dim, dtype=torch.bfloat16)
    _matches_other_config(monkeypatch, inputs, causal, head_dim, atomics)
    assert [call for call in launches if call[0] == "bwd"] == [("bwd", causal)] * 4


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(3, 384, 640, 6, 3), (1, 1024, 512, 5, 1), (5, 256, 256, 3, 3), (1, 4096, 1024, 2, 1)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_head_dim_256_dq_tma_odd_shapes(monkeypatch, launches, causal, shape):
    """D=256 with DQ_TMA and one dO stage at odd batch and head counts, GQA / MQA, Sq != Sk both ways (Sq > Sk
    causal: rows that see no key) and a long walk (64 query tiles per head, MQA 2:1: 128 iterations, the
    one-slot dO ring turning every iteration): against the oracle and against main's kernel (atomics, two dO
    stages)."""
    inputs = make_inputs(*shape, 256, dtype=torch.bfloat16)
    _matches_other_config(monkeypatch, inputs, causal, 256, dict(DQ_TMA=False, DO_STAGES=2))
    assert [call for call in launches if call[0] == "bwd"] == [("bwd", causal)] * 4


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("do_stages", [1, 2], ids=lambda n: f"dO{n}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_key_split_with_a_shallower_do_ring(monkeypatch, launches, causal, head_dim, do_stages):
    """The key split (D=64/128) with DO_STAGES below STAGES = 3 (D=64's 128-row tiles: 216,656 bytes of shared
    memory with two dO stages), a tuning option (tune_gluon.py's DO_STAGES variants reach it): separate empty
    barriers for the Q and dO rings, both released by each warpgroup once its dV and dK products have retired.
    GQA 4:1, 32 (D=64: 16) query tiles per head, against the oracle and the default config."""
    inputs = make_inputs(2, 2048, 2048, 8, 2, head_dim, dtype=torch.bfloat16)
    _matches_other_config(monkeypatch, inputs, causal, head_dim, dict(STAGES=3, DO_STAGES=do_stages))
    assert [call for call in launches if call[0] == "bwd"] == [("bwd", causal)] * 4


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2, 1024, 1024, 4, 2), (3, 640, 640, 2, 2), (2, 128, 128, 4, 4), (2, 1024, 384, 4, 2), (1, 384, 1280, 2, 2),
     (1, 2048, 2048, 8, 1)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_backward_key_pairs_against_oracle(monkeypatch, launches, head_dim, shape):
    """KEY_PAIRS: one CTA per pair of key tiles, the heaviest and then the lightest, one after the other (the K/V
    tiles handed from the first item's epilogue to the second's loads, the ring's positions running on). Key
    tiles of 128 rows (D=64/128): 8, 5 (the middle one alone), 1, 3 (Sq > Sk: rows that see no key), 10 (Sq <
    Sk: the first tiles see every query), 16 (MQA 8:1, long walks); D=256's 64-row tiles, twice as many, are
    always even. The forward, dq, dk and dv against the oracle, without and with KEY_PAIRS, and against each
    other: dk and dv bit for bit (the same sums in the same order), dq up to the order of its fp32 adds; the
    recorded launches show the paired grid."""
    grids = []
    launch = backward_sm90.launch

    def recorded(kernel, grid, args, constexprs, keyed):
        grids.append((grid, constexprs["KEY_PAIRS"]))
        launch(kernel, grid, args, constexprs, keyed)

    monkeypatch.setattr(backward_sm90, "launch", recorded)
    inputs = make_inputs(*shape, head_dim, dtype=torch.bfloat16)
    monkeypatch.setitem(backward_sm90.CONFIGS[head_dim], "KEY_PAIRS", False)
    _matches_other_config(monkeypatch, inputs, True, head_dim, dict(KEY_PAIRS=True))
    assert [call for call in launches if call[0] == "bwd"] == [("bwd", True)] * 4
    batch, _, seqlen_k, _, nheads_k = shape
    n_n = seqlen_k // backward_sm90.CONFIGS[head_dim]["BLOCK_N"]
    assert grids == [((n_n, nheads_k, batch), False)] * 2 + [((n_n - n_n // 2, nheads_k, batch), True)] * 2


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(3, 384, 640, 6, 3), (1, 1024, 512, 5, 1), (5, 256, 256, 3, 3), (1, 4096, 1024, 2, 1), (2, 2048, 2048, 8, 2),
     (1, 128, 128, 1, 1)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("changes", [dict(), dict(DQ_TMA=False)], ids=["dq-tma", "atomics"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_head_dim_64_tiles_of_128_rows(monkeypatch, launches, causal, changes, shape):
    """D=64's 128-row query tiles (BLOCK_M = 128: S^T and dP^T [64 keys, 128 queries] per warpgroup, started at
    -lse / scale and -delta; dQ split by rows, each warpgroup its 64 rows over all 128 keys) against the oracle
    and against main's config (BLOCK_M = 64, three stages: the warpgroups take turns with the whole dQ), with
    DQ_TMA and with the atomics: odd batch and head counts, GQA / MQA, Sq != Sk both ways (Sq > Sk causal: rows
    that see no key; Sq < Sk causal: key tiles past the last query's diagonal), long walks (MQA 2:1 with 32
    query tiles per head: 64 iterations; GQA 4:1, 16 per head) and a single tile."""
    for key, value in changes.items():
        monkeypatch.setitem(backward_sm90.CONFIGS[64], key, value)
    inputs = make_inputs(*shape, 64, dtype=torch.bfloat16)
    main_config = dict(BLOCK_M=64, STAGES=3, DO_STAGES=3)
    _matches_other_config(monkeypatch, inputs, causal, 64, main_config, same_probs=False)
    assert [call for call in launches if call[0] == "bwd"] == [("bwd", causal)] * 4


@hopper
@pytest.mark.gpu
def test_backward_head_dim_64_fp16_and_softmax_scale(launches):
    """fp16 and an explicit softmax_scale at D=64's 128-row tiles (the S^T accumulator starts at -lse / scale),
    causal, Sq > Sk, with a gradient at the LSE."""
    q, k, v, dout = make_inputs(2, 768, 512, 4, 2, 64, dtype=torch.float16)
    dlse = torch.randn(2, 4, 768, device="cuda")
    check(q, k, v, dout, dlse=dlse, causal=True, softmax_scale=0.3)
    assert launches[-1] == ("bwd", True)


@hopper
@pytest.mark.gpu
def test_deterministic_keeps_the_triton_backward(launches):
    """deterministic=True: the Triton backward, bitwise repeatable; the default (False) takes the atomic one."""
    q, k, v, dout = make_inputs(1, 512, 512, 4, 4, 128, dtype=torch.bfloat16)
    first = run_flashtile(q, k, v, dout, causal=True, deterministic=True)
    again = run_flashtile(q, k, v, dout, causal=True, deterministic=True)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert launches == [("fwd", True), ("fwd", True)]
    check(q, k, v, dout, causal=True)
    assert launches[-1] == ("bwd", True)


@hopper
@pytest.mark.gpu
def test_packed_qkv_and_softmax_scale(launches):
    packed = torch.randn(2, 256, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = packed.unbind(2)
    check(q, k, v, dout, causal=True, softmax_scale=0.3)
    assert launches == [("fwd", True), ("bwd", True)]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_switched_off_runs_the_triton_kernel(monkeypatch, launches, causal):
    """The same call with FLASHTILE_GLUON=0 (``_backend.GLUON``) runs the Triton kernels; both pass the rule."""
    inputs = make_inputs(2, 512, 768, 8, 8, 128, dtype=torch.bfloat16)
    check(*inputs, causal=causal)
    monkeypatch.setattr(_backend, "GLUON", False)
    check(*inputs, causal=causal)
    assert launches == [("fwd", causal), ("bwd", causal)]


@hopper
@pytest.mark.gpu
def test_cuda_graph_replay(launches):
    q, k, v, _ = make_inputs(2, 256, 256, 4, 4, 128, dtype=torch.bfloat16)
    expected = flashtile.flash_attn_func(q, k, v, causal=True)
    graph, out = capture(lambda: flashtile.flash_attn_func(q, k, v, causal=True))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert launches and set(launches) == {("fwd", True)}


@hopper
@pytest.mark.gpu
def test_causal_schedule_falls_back_to_pairs_under_graph_capture(monkeypatch, launches):
    """A D=64 causal forward whose shape is first launched while a CUDA graph is being captured gets no schedule (no
    copy to the GPU may run then, ``causal_schedule``) and walks pair slots; the replay equals, bit for bit, an
    eager call afterwards, which makes the schedule and walks it (each item's arithmetic is the same either way)."""
    monkeypatch.setattr(forward_sm90, "_SCHEDULES", {})
    q, k, v, _ = make_inputs(2, 640, 640, 4, 2, 64, dtype=torch.bfloat16)
    with monkeypatch.context() as off:  # the pair walk's kernel compiled before the capture
        off.setitem(forward_sm90.CONFIGS[64], "CAUSAL_SCHEDULE", False)
        flashtile.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert not forward_sm90._SCHEDULES
    out.fill_(float("nan"))
    graph.replay()
    expected = flashtile.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert len(forward_sm90._SCHEDULES) == 1
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert set(launches) == {("fwd", True)}


class _Routed:
    """Stands in for the Gluon launchers on any device: records each call's ``causal`` (and each backward's
    softmax_scale), launches as if the inputs qualified and gives zeros, so that which calls reach them is checked
    without an sm_90 GPU (the device check is patched to say yes)."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.backward_scales = []
        monkeypatch.setattr(_backend, "gluon_refusal", lambda device: None)
        monkeypatch.setattr(forward_sm90, "attention_forward_sm90", self.forward)
        monkeypatch.setattr(backward_sm90, "attention_backward_sm90", self.backward)

    def forward(self, q, k, v, out, lse, softmax_scale, causal, window=None, softcap=0.0, alibi_slopes=None):
        self.calls.append(("fwd", window or causal))
        out.zero_()
        lse.zero_()
        return True

    def backward(self, dout, q, k, v, lse, delta, softmax_scale, causal, window=None, softcap=0.0, alibi_slopes=None):
        self.calls.append(("bwd", window or causal))
        self.backward_scales.append(softmax_scale)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _forward_backward(q, k, v, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtile.flash_attn_func(*leaves, **kwargs)
    out.backward(torch.ones_like(out))


@pytest.mark.skipif(not _backend.TRITON_INTERPRET and DEVICE == "cpu", reason="needs the Triton launchers")
@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(), [("fwd", False), ("bwd", False)]),
        (dict(causal=True), [("fwd", True), ("bwd", True)]),
        (dict(window_size=(-1, 0)), [("fwd", True), ("bwd", True)]),
        (dict(causal=True, deterministic=True), [("fwd", True)]),
        (dict(window_size=(8, 0)), [("fwd", (8, 0)), ("bwd", (8, 0))]),
        (dict(softcap=5.0), [("fwd", False), ("bwd", False)]),
        (dict(dropout_p=0.1), []),
        (dict(alibi_slopes=torch.ones(2)), [("fwd", False), ("bwd", False)]),
        (dict(learnable_sink=torch.zeros(2)), [("bwd", False)]),
    ],
    ids=["full", "causal", "window-causal", "deterministic", "window", "softcap", "dropout", "alibi", "sink"],
)
def test_which_calls_take_the_gluon_kernels(monkeypatch, options, expected):
    """The launchers route calls without options (a sink changes nothing in the backward: the LSE holds it)
    and, for the backward, only with deterministic=False, through the autograd context."""
    routed = _Routed(monkeypatch)
    q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 128, dtype=torch.bfloat16)
    options = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    _forward_backward(q, k, v, **options)
    assert routed.calls == expected


@pytest.mark.skipif(not _backend.TRITON_INTERPRET and DEVICE == "cpu", reason="needs the Triton launchers")
@pytest.mark.parametrize("seqlen", [128, 64])
@pytest.mark.parametrize("face", ["sdpa", "flash_attn_func"])
def test_head_major_calls_take_the_gluon_kernels(monkeypatch, face, seqlen):
    """torch's (B, H, N, D) tensors, through ``scaled_dot_product_attention`` or as transposed views through
    ``flash_attn_func``: the forward and the backward take the Gluon kernels (head-major descriptors), the backward
    where the lengths are multiples of 128 (otherwise the Triton one, from the Gluon forward's out and lse)."""
    routed = _Routed(monkeypatch)
    q, k, v, _ = make_inputs(1, seqlen, seqlen, 2, 2, 64, dtype=torch.bfloat16)
    if face == "sdpa":
        leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        out = flashtile.scaled_dot_product_attention(*leaves, is_causal=True)
        out.backward(torch.ones_like(out))
        assert [x.grad.stride() for x in leaves] == [x.stride() for x in leaves]
    else:
        _forward_backward(*map(head_major, (q, k, v)), causal=True)
    assert routed.calls == [("fwd", True)] + ([("bwd", True)] if seqlen % 128 == 0 else [])


@pytest.mark.skipif(not _backend.TRITON_INTERPRET and DEVICE == "cpu", reason="needs the Triton launchers")
def test_scales_not_above_zero_keep_the_triton_kernels(monkeypatch):
    """The dispatcher hands the Gluon kernels positive scales only (``common.option_refusals``: the forward scales
    masked -inf scores, the backward's D=64 tiles start at -lse / scale); a positive one reaches the launcher as
    given."""
    routed = _Routed(monkeypatch)
    q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 128, dtype=torch.bfloat16)
    _forward_backward(q, k, v, softmax_scale=-0.1)
    assert routed.calls == []
    _forward_backward(q, k, v, softmax_scale=0.1)
    assert routed.backward_scales == [0.1]


@pytest.mark.skipif(not _backend.TRITON_INTERPRET and DEVICE == "cpu", reason="needs the Triton launchers")
def test_sdpa_backward_follows_torch_deterministic_setting(monkeypatch):
    routed = _Routed(monkeypatch)
    # (batch, seqlen, heads, headdim) memory, as the Gluon kernels' descriptors read it, in SDPA's layout
    q, k, v = (torch.randn(1, 128, 2, 128, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2).requires_grad_()
               for _ in range(3))  # fmt: skip
    flashtile.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert [tag for tag, _ in routed.calls] == ["fwd", "bwd"]
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    flashtile.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert [tag for tag, _ in routed.calls] == ["fwd", "bwd", "fwd"]


@pytest.mark.skipif(not _backend.TRITON_INTERPRET and DEVICE == "cpu", reason="needs the Triton launchers")
def test_compiled_calls_keep_deterministic(monkeypatch):
    """Under torch.compile the flag travels through the custom op's arguments."""
    routed = _Routed(monkeypatch)
    q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 128, dtype=torch.bfloat16)
    torch._dynamo.reset()
    for deterministic in (False, True):
        compiled = torch.compile(
            lambda q, k, v, d=deterministic: flashtile.flash_attn_func(q, k, v, causal=True, deterministic=d),
            fullgraph=True,
            backend="eager",
        )
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        compiled(*leaves).sum().backward()
    assert routed.calls == [("fwd", True), ("bwd", True), ("fwd", True)]


def test_launchers_import_gluon_on_sm90_only():
    """Importing the Triton launchers (and running them anywhere but on an sm_90 GPU) leaves Gluon unimported:
    its modules cost ~50 ms at import."""
    code = (
        "import sys, flashtile.ops.attention.forward, flashtile.ops.attention.backward\n"
        "print(sorted(m for m in sys.modules if m.startswith('triton.experimental.gluon') or m.endswith('_sm90')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]", result.stdout


@hopper
@pytest.mark.gpu
def test_one_compiled_kernel_serves_every_length(monkeypatch, launches):
    """Lengths 128 to 1024 and 1, 4 and 8 heads share one compiled forward and one backward (``launch``: the
    ints are not specialized), which the oracle checks at each; the first launch of each went through Triton.
    (The delta kernel, a Triton one, has a key per length in the same cache.)"""
    monkeypatch.setattr(_launch, "_COMPILED", {})
    for seqlen, nheads in ((128, 1), (384, 4), (1024, 8), (256, 8)):
        check(*make_inputs(2, seqlen, seqlen, nheads, nheads, 128, dtype=torch.bfloat16), causal=False)
    kernels = [kernel for kernel, _ in _launch._COMPILED.values() if kernel is not backward._delta_kernel]
    assert sorted(kernel.fn.__name__ for kernel in kernels) == [
        "_attention_backward_sm90_kernel",
        "_attention_forward_sm90_kernel",
    ]
    assert len(launches) == 8


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
def test_launched_int_parameters_are_not_specialized(monkeypatch, head_dim, causal):
    """Every int the launchers pass the Gluon kernels is a ``do_not_specialize`` parameter: ``launch_key`` keys an
    int by its width alone, so a specialized one would compile as the constant 1 (or as a multiple of 16) for its
    first value and serve every later value from that compile."""
    calls = []
    for module in (forward_sm90, backward_sm90):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, args, cx, *keyed: calls.append((kernel, args)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the forward plan's launch key
    q, k, v = qkv(batch=2, seqlen_q=2048, seqlen_k=2048, nheads=4, nheads_k=2, head_dim=head_dim)
    stats = torch.zeros(2, 4, 2048)
    forward_sm90.attention_forward_sm90(q, k, v, torch.empty_like(q), stats, 0.1, causal)
    backward_sm90.attention_backward_sm90(torch.empty_like(q), q, k, v, stats, stats, 0.1, causal)
    assert [kernel for kernel, _ in calls] == [
        forward_sm90._attention_forward_sm90_kernel,
        backward_sm90._attention_backward_sm90_kernel,
    ]
    for kernel, args in calls:
        ints = [p for p, a in zip(kernel.params, args, strict=False) if isinstance(a, int)]
        assert ints and all(p.do_not_specialize for p in ints), [p.name for p in ints]


def test_launch_key_follows_triton_specialization(monkeypatch):
    """Arguments Triton compiles alike share a key (other int values below 2**31, other floats, other tensors
    of one dtype and alignment, descriptors of one dtype and box over other shapes); what it compiles apart
    does not (an int of 2**31, an unaligned tensor, another dtype or box, another constexpr, another device)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    lse = torch.empty(64)
    consts = {"CAUSAL": True}

    def key(desc=None, tensor=lse, n=300, scale=0.5, **constexprs):
        args = (desc or forward_sm90.batch_descriptor(x, 64), tensor, scale, n)
        return sm90_common.launch_key("kernel", args, list((constexprs or consts).values()), {"num_warps": 4})

    base = key()
    other_x = torch.empty(1, 17, 2, 128, dtype=torch.bfloat16)
    assert key(n=1) == key(n=16) == key(n=2**31 - 1) == key(scale=3.0) == key(tensor=torch.empty(8)) == base
    assert key(desc=forward_sm90.batch_descriptor(other_x, 64)) == base
    assert key(n=2**31) != base
    assert key(tensor=lse[1:]) != base
    assert key(tensor=lse.double()) != base
    assert key(desc=forward_sm90.batch_descriptor(x.half(), 64)) != base
    assert key(desc=forward_sm90.batch_descriptor(x, 128)) != base
    assert key(CAUSAL=False) != base
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert key() != base
