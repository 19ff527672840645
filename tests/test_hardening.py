"""Edge values of every entry point: window sides up to ``sys.maxsize``, empty inputs, softmax_scale 0 / NaN /
inf, SDPA's leading dimensions, varlen grids sized by the tokens, and the error classes.

Each runs through every path reachable here (``path``: the CPU path and the Triton interpreter on a CPU-only
machine, the compiled kernels on a GPU) and is checked against the oracle by the tolerance rule.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashtile
from conftest import DEVICE
from flashtile.errors import InputError, InputTypeError
from oracle import assert_within_rule, check_against_oracle
from test_kvcache import Case
from test_kvcache import check as check_kvcache
from test_varlen import check_varlen, make_varlen, run_varlen

# "No limit" as callers spell it: past int32 (the kernels' positions), past int64 arithmetic with a position.
HUGE = [2**31 - 1, 2**31, 2**40, sys.maxsize]


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype=dtype, device=DEVICE)


def run_dense(q, k, v, dout, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_func(*leaves, return_attn_probs=True, **options)
    out.backward(dout)
    return {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


# Window sides past the lengths ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(40, 70, 32), (128, 256, 128)], ids=["ragged-D32", "D128"])
@pytest.mark.parametrize("side", HUGE, ids=lambda s: f"{s:#x}")
def test_huge_window_sides_are_unbounded(path, side, shape):
    """Any side >= the lengths is unbounded (flash_attn's rule): the same bits as (-1, -1) or (-1, 0), forward and
    backward, for each side alone and both together, causal or not (at D=128 on sm_90: the Gluon kernels)."""
    seqlen_q, seqlen_k, head_dim = shape
    q, k, v = randn(1, seqlen_q, 2, head_dim), randn(1, seqlen_k, 2, head_dim), randn(1, seqlen_k, 2, head_dim)
    dout = randn(1, seqlen_q, 2, head_dim)
    for causal in (False, True):
        unbounded = run_dense(q, k, v, dout, causal=causal)
        for window in ((-1, side), (side, -1), (side, side)):
            got = run_dense(q, k, v, dout, causal=causal, window_size=window)
            for name, x in got.items():
                assert torch.equal(x, unbounded[name]), f"{name} differs for window {window}, causal={causal}"


@pytest.mark.parametrize("side", [2**31 - 1, sys.maxsize], ids=lambda s: f"{s:#x}")
def test_huge_window_sides_packed_varlen_paged(path, side):
    """The packed functions, varlen and paged varlen give the unbounded answer for huge sides too."""
    q, k, v = randn(1, 33, 2, 32), randn(1, 33, 2, 32), randn(1, 33, 2, 32)
    qkv = torch.stack([q, k, v], 2)
    for window in ((side, side), (-1, side), (side, 0)):
        causal = window[1] == 0
        want = flashtile.flash_attn_qkvpacked_func(qkv, causal=causal)
        assert torch.equal(flashtile.flash_attn_qkvpacked_func(qkv, window_size=window), want)
        assert torch.equal(flashtile.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), window_size=window), want)

    lengths_q, lengths_k = [5, 0, 17, 40], [9, 3, 17, 21]
    qv, kv, vv, dout_v, cu_q, cu_k = make_varlen(lengths_q, lengths_k, 2, 1, 32)
    for window in ((side, side), (-1, side), (side, -1)):
        got = run_varlen(qv, kv, vv, dout_v, cu_q, cu_k, window_size=window)
        check_varlen(got, qv, kv, vv, dout_v, cu_q, cu_k)

    # Paged keys: 16-token pages in reverse order, one row of the block table per sequence.
    pages = 4
    k_pages = randn(len(lengths_k) * pages, 16, 1, 32)
    v_pages = randn(len(lengths_k) * pages, 16, 1, 32)
    table = torch.arange(len(lengths_k) * pages, device=DEVICE, dtype=torch.int32).flip(0).view(len(lengths_k), pages)
    args = (qv, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k))
    want = flashtile.flash_attn_varlen_func(*args, block_table=table)
    got = flashtile.flash_attn_varlen_func(*args, window_size=(side, side), block_table=table)
    assert torch.equal(got, want)


@pytest.mark.parametrize("side", [2**31 - 1, sys.maxsize], ids=lambda s: f"{s:#x}")
def test_huge_window_sides_kvcache(path, side):
    check_kvcache(Case(seqlen_q=3, seqlen_new=3, causal=False, window_size=(side, side)))
    check_kvcache(Case(seqlen_q=3, seqlen_new=3, causal=True, window_size=(side, -1), num_splits=3))


SIDES = st.one_of(
    st.just(-1), st.just(0), st.integers(1, 6), st.integers(40, 90), st.sampled_from(HUGE)
)  # unbounded, zero, small, >= the lengths, "no limit" spellings


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    left=SIDES,
    right=SIDES,
    causal=st.booleans(),
    seqlen_q=st.sampled_from([1, 17, 40]),
    seqlen_k=st.sampled_from([1, 33, 70]),
    groups=st.sampled_from([1, 2]),
    softcap=st.sampled_from([0.0, 5.0]),
    alibi=st.booleans(),
    sink=st.booleans(),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_fuzz_windows_dense(path, left, right, causal, seqlen_q, seqlen_k, groups, softcap, alibi, sink, dtype):
    """Window sides from every class against the oracle, with the other options, forward and backward."""
    q, k = randn(1, seqlen_q, 2, 32, dtype=dtype), randn(1, seqlen_k, 2 // groups, 32, dtype=dtype)
    v, dout = randn(1, seqlen_k, 2 // groups, 32, dtype=dtype), randn(1, seqlen_q, 2, 32, dtype=dtype)
    options = dict(causal=causal, window_size=(left, right), softcap=softcap)
    if alibi:
        options["alibi_slopes"] = torch.tensor([0.5, 0.25], device=DEVICE)
    if sink:
        options["learnable_sink"] = torch.tensor([0.3, -1.0], device=DEVICE)
    results = run_dense(q, k, v, dout, **options)
    check_against_oracle(results, q, k, v, dout, **options)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(left=SIDES, right=SIDES, causal=st.booleans(), softcap=st.sampled_from([0.0, 5.0]), sink=st.booleans())
def test_fuzz_windows_varlen(path, left, right, causal, softcap, sink):
    q, k, v, dout, cu_q, cu_k = make_varlen([1, 17, 0, 40], [33, 5, 2, 70], 2, 1, 32)
    options = dict(causal=causal, window_size=(left, right), softcap=softcap)
    if sink:
        options["learnable_sink"] = torch.tensor([0.3, -1.0], device=DEVICE)
    check_varlen(run_varlen(q, k, v, dout, cu_q, cu_k, **options), q, k, v, dout, cu_q, cu_k, **options)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    left=SIDES,
    right=SIDES,
    causal=st.booleans(),
    seqlen_q=st.sampled_from([1, 3]),
    num_splits=st.sampled_from([1, 3]),
    page_size=st.sampled_from([0, 16]),
)
def test_fuzz_windows_kvcache(path, left, right, causal, seqlen_q, num_splits, page_size):
    check_kvcache(
        Case(
            seqlen_q=seqlen_q, seqlen_new=seqlen_q, causal=causal, window_size=(left, right), num_splits=num_splits,
            page_size=page_size, seqlen_cache=96,
        )
    )  # fmt: skip


# Empty inputs ------------------------------------------------------------------------------------------------


EMPTY = {"batch0": (0, 40, 70), "seqlen_q0": (2, 0, 70), "seqlen_k0": (2, 40, 0), "all0": (0, 0, 0)}


@pytest.mark.parametrize("shape", EMPTY.values(), ids=EMPTY.keys())
@pytest.mark.parametrize("sink", [False, True], ids=["", "sink"])
def test_empty_dense(path, shape, sink):
    """Empty inputs give empty outputs and gradients (zero where the inputs have elements), as torch's SDPA:
    with no keys the output is 0 and softmax_lse -inf, or the sink's logit."""
    batch, seqlen_q, seqlen_k = shape
    q, k, v = randn(batch, seqlen_q, 4, 32), randn(batch, seqlen_k, 2, 32), randn(batch, seqlen_k, 2, 16)
    dout = randn(batch, seqlen_q, 4, 16)
    options = {"learnable_sink": torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)} if sink else {}
    for causal in (False, True):
        results = run_dense(q, k, v, dout, causal=causal, **options)
        assert results["out"].shape == (batch, seqlen_q, 4, 16) and results["lse"].shape == (batch, 4, seqlen_q)
        assert torch.all(results["out"] == 0)
        want_lse = options["learnable_sink"][None, :, None] if sink else float("-inf")
        assert torch.all(results["lse"] == want_lse)
        for name, t in (("dq", q), ("dk", k), ("dv", v)):
            assert results[name].shape == t.shape and torch.all(results[name] == 0), name
        check_against_oracle(results, q, k, v, dout, causal=causal, **options)


@pytest.mark.parametrize("shape", EMPTY.values(), ids=EMPTY.keys())
def test_empty_packed_and_sdpa(path, shape):
    batch, seqlen_q, seqlen_k = shape
    q, k, v = randn(batch, seqlen_q, 2, 32), randn(batch, seqlen_k, 2, 32), randn(batch, seqlen_k, 2, 32)
    assert torch.all(flashtile.flash_attn_kvpacked_func(q, torch.stack([k, v], 2)) == 0)
    if seqlen_q == seqlen_k:
        out = flashtile.flash_attn_qkvpacked_func(torch.stack([q, q, q], 2).requires_grad_())
        assert out.shape == q.shape
    query, key, value = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
    for options in ({}, {"is_causal": True}, {"attn_mask": torch.ones(seqlen_q, seqlen_k, device=DEVICE).bool()}):
        out = flashtile.scaled_dot_product_attention(query, key, value, **options)
        assert out.shape == query.shape and torch.all(out == 0)
        out.sum().backward()
        assert query.grad.shape == query.shape and key.grad.shape == key.shape


def test_empty_varlen(path):
    """No query tokens, no key tokens, and a batch of empty sequences."""
    for lengths_q, lengths_k in (([0, 0], [3, 4]), ([3, 4], [0, 0]), ([0], [0])):
        q, k, v, dout, cu_q, cu_k = make_varlen(lengths_q, lengths_k, 2, 1, 32)
        results = run_varlen(q, k, v, dout, cu_q, cu_k, causal=True)
        assert results["out"].shape == (sum(lengths_q), 2, 32) and torch.all(results["out"] == 0)
        assert torch.all(results["lse"] == float("-inf"))
        assert torch.all(results["dk"] == 0) and torch.all(results["dv"] == 0)


def test_empty_kvcache(path):
    """A batch of 0 and 0 query tokens decode to empty outputs."""
    k_cache, v_cache = randn(2, 32, 2, 32), randn(2, 32, 2, 32)
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    out, lse = flashtile.flash_attn_with_kvcache(
        randn(2, 0, 4, 32), k_cache, v_cache, cache_seqlens=seqlens, return_softmax_lse=True
    )
    assert out.shape == (2, 0, 4, 32) and lse.shape == (2, 4, 0)
    out = flashtile.flash_attn_with_kvcache(randn(0, 1, 4, 32), k_cache[:0], v_cache[:0], cache_seqlens=seqlens[:0])
    assert out.shape == (0, 1, 4, 32)


# softmax_scale ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_non_finite_softmax_scale_is_refused(scale):
    q = randn(1, 4, 2, 32)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    for call in (
        lambda: flashtile.flash_attn_func(q, q, q, softmax_scale=scale),
        lambda: flashtile.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, softmax_scale=scale),
        lambda: flashtile.flash_attn_with_kvcache(q, q, q, softmax_scale=scale),
        lambda: flashtile.scaled_dot_product_attention(q, q, q, scale=scale),
    ):
        with pytest.raises(InputError, match="softmax_scale must be a finite number"):
            call()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_softmax_scale(path, causal):
    """softmax_scale=0 is uniform attention over the visible keys, on every kernel family: dense forward and
    backward (64-aligned and ragged lengths), varlen, decode (one and three splits), and SDPA with a mask."""
    for seqlen_q, seqlen_k, head_dim in ((64, 128, 64), (37, 53, 64), (128, 256, 128)):
        q, k, v = randn(2, seqlen_q, 2, head_dim), randn(2, seqlen_k, 2, head_dim), randn(2, seqlen_k, 2, head_dim)
        dout = randn(2, seqlen_q, 2, head_dim)
        results = run_dense(q, k, v, dout, causal=causal, softmax_scale=0.0)
        check_against_oracle(results, q, k, v, dout, causal=causal, softmax_scale=0.0)
    q, k, v, dout, cu_q, cu_k = make_varlen([3, 40], [17, 40], 2, 2, 32)
    results = run_varlen(q, k, v, dout, cu_q, cu_k, causal=causal, softmax_scale=0.0)
    check_varlen(results, q, k, v, dout, cu_q, cu_k, causal=causal, softmax_scale=0.0)
    for num_splits in (1, 3):
        check_kvcache(Case(causal=causal, softmax_scale=0.0, num_splits=num_splits))
    query, key, value = randn(1, 2, 9, 32), randn(1, 2, 21, 32), randn(1, 2, 21, 32)
    mask = torch.rand(9, 21, device=DEVICE) > 0.3
    got = flashtile.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.0)
    want = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=mask, scale=0.0)
    base = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.0)
    assert_within_rule("out", got, want.to(got.dtype), base)


# SDPA's leading dimensions ---------------------------------------------------------------------------------


SDPA_SHAPES = {
    "2d": ((9, 32), (21, 32), {}),
    "3d": ((3, 9, 32), (3, 21, 32), {}),
    "3d-causal": ((3, 9, 32), (3, 21, 32), {"is_causal": True}),
    "5d": ((2, 3, 4, 9, 32), (2, 3, 4, 21, 32), {}),
    "5d-gqa-broadcast": ((2, 3, 4, 9, 32), (1, 3, 2, 21, 32), {"enable_gqa": True}),
    "5d-bool-mask": ((2, 3, 4, 9, 32), (2, 3, 4, 21, 32), {"attn_mask": "bool"}),
    "3d-float-mask": ((3, 9, 32), (3, 21, 32), {"attn_mask": "float"}),
}


@pytest.mark.parametrize("case", SDPA_SHAPES.values(), ids=SDPA_SHAPES.keys())
def test_sdpa_any_leading_dims(path, case):
    """torch takes (..., L, E): so does flashtile's SDPA, with the same result shape and values."""
    q_shape, k_shape, options = case
    query, key, value = randn(*q_shape), randn(*k_shape), randn(*k_shape)
    if options.get("attn_mask") == "bool":
        options = {"attn_mask": torch.rand(3, 1, 9, 21, device=DEVICE) > 0.3}
    elif options.get("attn_mask") == "float":
        options = {"attn_mask": torch.randn(9, 21, device=DEVICE).half()}
    got = flashtile.scaled_dot_product_attention(query, key, value, **options)
    precise = {
        n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in options.items()
    }
    want = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), **precise)
    base = F.scaled_dot_product_attention(query, key, value, **options)
    assert got.shape == base.shape
    assert_within_rule("out", got, want.to(got.dtype), base)


def test_sdpa_leading_dims_refused_clearly():
    query = randn(2, 3, 4, 9, 32)
    with pytest.raises(InputError, match="leading"):
        flashtile.scaled_dot_product_attention(query, randn(2, 5, 4, 9, 32), randn(2, 5, 4, 9, 32))
    with pytest.raises(InputError, match="at least 2 dimensions"):
        flashtile.scaled_dot_product_attention(randn(32), randn(32), randn(32))


# Varlen launches sized by the tokens ------------------------------------------------------------------------


def test_varlen_grid_is_sized_by_the_tokens(monkeypatch):
    """max_seqlen far above the real lengths launches no more query tiles than the tokens fill: 10 tokens with
    max_seqlen 10**6 used to launch 10**6 / BLOCK_M tiles per sequence (over a minute in the interpreter)."""
    if DEVICE == "cpu" and not flashtile._backend.TRITON_INTERPRET:
        pytest.skip("the Triton kernels do not run here")
    from flashtile.ops.attention import backward, forward

    grids = []
    for module in (forward, backward):
        original = module.launch

        def recorded(kernel, grid, *args, _launch=original, **kwargs):
            grids.append(grid)
            return _launch(kernel, grid, *args, **kwargs)

        monkeypatch.setattr(module, "launch", recorded)
    q, k, v, dout, cu_q, cu_k = make_varlen([4, 6], [4, 6], 2, 2, 32)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtile.flash_attn_varlen_func(*leaves, cu_q, cu_k, 10**6, 10**6, causal=True)
    out.backward(dout)
    check_varlen({"out": out, "dq": leaves[0].grad}, q, k, v, dout, cu_q, cu_k, causal=True)
    assert grids and all(grid[0] <= 10 for grid in grids), grids


# Errors -----------------------------------------------------------------------------------------------------


def test_input_errors_are_value_and_runtime_errors():
    """flash_attn raises RuntimeError for bad inputs; code written for it catches that, Python code catches
    ValueError / TypeError: flashtile's input errors are all of them."""
    q = randn(1, 4, 2, 32)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    bad_table = torch.tensor([[0, 7]], dtype=torch.int32, device=DEVICE)
    for call, error in (
        (lambda: flashtile.flash_attn_func(q, q[:, :, :1].expand(1, 4, 3, 32), q), InputError),
        (lambda: flashtile.flash_attn_func(q, q, q, window_size=(1, 2, 3)), InputTypeError),
        (lambda: flashtile.flash_attn_func(q.double(), q.double(), q.double()), InputTypeError),
        (lambda: flashtile.flash_attn_varlen_func(q[0], q[0], q[0], cu.long(), cu, 4, 4), InputTypeError),
        (lambda: flashtile.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 2, 4), InputError),
        (lambda: flashtile.flash_attn_with_kvcache(q, q, q, cache_seqlens=cu[:1] + 9), InputError),
        (lambda: flashtile.scaled_dot_product_attention(q, q, q, enable_gqa=False, is_causal=True,
                                                         attn_mask=q[..., 0] > 0), InputError),
        (lambda: flashtile.unpad_input(q, torch.ones(2, 4, dtype=torch.bool, device=DEVICE)), InputError),
    ):  # fmt: skip
        for caught in (RuntimeError, ValueError, error):
            with pytest.raises(caught):
                call()
    with pytest.raises(TypeError):
        flashtile.flash_attn_func(q, q, q, window_size=(1, 2, 3))
    # flash_attn's own test (test_flash_attn_kvcache_paged_block_table_bounds) expects this.
    k_pages = randn(2, 16, 2, 32)
    with pytest.raises(RuntimeError, match="block_table"):
        flashtile.flash_attn_with_kvcache(
            q[:, :1], k_pages, k_pages, cache_seqlens=torch.tensor([20], dtype=torch.int32, device=DEVICE),
            block_table=bad_table,
        )  # fmt: skip


def test_float32(path):
    """float32 inputs compute in float32 on every path (on CUDA with IEEE float32 products, not TF32): the
    tolerance rule against the float64 oracle (float32 on a GPU: the rule's ``ref``), with the float32 oracle as
    the plain implementation's error."""
    q, k, v, dout = (
        randn(2, *shape, dtype=torch.float32) for shape in ((37, 4, 64), (53, 2, 64), (53, 2, 64), (37, 4, 64))
    )
    for options in ({"causal": True}, {"window_size": (7, 3), "softcap": 4.0}):
        check_against_oracle(run_dense(q, k, v, dout, **options), q, k, v, dout, **options)
    qv, kv, vv, dout_v, cu_q, cu_k = make_varlen([3, 0, 40], [17, 5, 33], 2, 1, 32, dtype=torch.float32)
    check_varlen(run_varlen(qv, kv, vv, dout_v, cu_q, cu_k, causal=True), qv, kv, vv, dout_v, cu_q, cu_k, causal=True)
    check_kvcache(Case(dtype=torch.float32, num_splits=3, page_size=16))
