"""Random combinations of options against the oracle (hypothesis, derandomized: the same examples on every run).

flash_attn_func: each example draws a shape (batch 1-3, lengths 1-80 with Sq != Sk, MHA / GQA / MQA, head dims
that run as they are or get padded to a multiple of 8) and options (causal, a sliding window, softcap, ALiBi per
head or per batch entry, softmax_scale, a gradient at the LSE), runs the forward and the backward through the
public API and checks out, lse, dq, dk, dv with the tolerance rule (``flashtile.reference.within_tolerance``)
(``oracle.check_against_oracle``).

flash_attn_with_kvcache: each example draws a ``test_kvcache.Case`` (contiguous or paged cache with a page size
that is a multiple of 16, new tokens or none, rotary of either layout on part or all of the head dim,
cache_batch_idx, cache_leftpad, causal, windows, softcap, ALiBi, seqlen_q > 1, split counts) and checks out, lse
and the cache (new rows where they belong, every other element bitwise unchanged) with ``test_kvcache.check``.

flash_attn_varlen_func: each example draws 1-4 sequences with independent query and key lengths 0-60 (empty
sequences included), heads, head dim, dtype and the attention options above, checked by ``test_varlen.check``.

scaled_dot_product_attention: torch's own SDPA is the oracle (float64 for ref, the input dtype for base): random
lengths, heads (enable_gqa), head dims, is_causal (top-left) or a boolean / additive attn_mask of a random
broadcast shape (every query row keeps key 0 visible: torch gives NaN for a row that sees nothing), and scale;
out and the gradients of q, k, v.

The parametrized tests of test_attention.py, test_varlen.py, test_kvcache.py and test_sdpa.py cover the options
one at a time; these cover their combinations.

On a CPU-only machine the CPU path (``flashtile.cpu``) takes every example and the Triton interpreter (the real
kernels, one program at a time) a smaller set; with CUDA both run on the GPU kernels.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashtile
import test_kvcache
import test_varlen
from conftest import DEVICE
from flashtile import _backend
from oracle import assert_within_rule, check_against_oracle
from test_attention import make_inputs, run_flashtile
from test_variants import slopes_like

HEAD_DIMS = [8, 12, 16, 20, 32, 40, 64, 72, 96, 128]
"""Multiples of 8 run as they are; 12 and 20 are zero-padded to 16 and 24 (flash_attn's rule)."""


@st.composite
def cases(draw) -> dict:
    """One example: make_inputs' arguments, flash_attn_func's keyword options, and an optional dlse flag."""
    nheads_k = draw(st.integers(1, 3))
    shape = dict(
        batch=draw(st.integers(1, 3)),
        seqlen_q=draw(st.integers(1, 80)),
        seqlen_k=draw(st.integers(1, 80)),
        nheads=nheads_k * draw(st.integers(1, 3)),
        nheads_k=nheads_k,
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
    )
    options = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        side = st.integers(-1, 40)
        options["window_size"] = (draw(side), draw(side))
    if draw(st.booleans()):
        options["softcap"] = draw(st.floats(1.0, 30.0))
    alibi = draw(st.sampled_from([None, "per head", "per batch entry"]))
    if alibi is not None:
        slopes_shape = (shape["nheads"],) if alibi == "per head" else (shape["batch"], shape["nheads"])
        gen = torch.Generator().manual_seed(shape["seed"])
        options["alibi_slopes"] = torch.rand(slopes_shape, generator=gen).to(DEVICE)
    if draw(st.booleans()):
        options["softmax_scale"] = draw(st.floats(0.05, 1.0))
    return {"shape": shape, "options": options, "dlse": draw(st.booleans())}


def check_case(case: dict) -> None:
    shape, options = case["shape"], case["options"]
    q, k, v, dout = make_inputs(**shape)
    dlse = None
    if case["dlse"]:
        gen = torch.Generator().manual_seed(shape["seed"] + 1)
        lse_shape = (shape["batch"], shape["nheads"], shape["seqlen_q"])
        dlse = torch.randn(lse_shape, generator=gen).to(DEVICE)
    results = run_flashtile(q, k, v, dout, dlse=dlse, **options)
    check_against_oracle(results, q, k, v, dout, dlse=dlse, **options)


def cpu_path():
    """The CPU path on a CPU-only machine (else nothing changes)."""
    if DEVICE == "cpu":
        return mock.patch.object(_backend, "TRITON_INTERPRET", False)
    return contextlib.nullcontext()


EXAMPLE_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=80, **EXAMPLE_SETTINGS)
@given(case=cases())
def test_option_combinations_cpu_path(case):
    with cpu_path():
        check_case(case)


@settings(max_examples=25, **EXAMPLE_SETTINGS)
@given(case=cases())
def test_option_combinations_kernels(case):
    check_case(case)


@st.composite
def kvcache_cases(draw) -> test_kvcache.Case:
    """One flash_attn_with_kvcache call (``test_kvcache.Case``) within flash_attn's rules: rotary needs new
    tokens and a rotary_dim that is a multiple of 16 up to the head dim, and the tables (one row per cache
    position) must cover q's positions; cache_batch_idx needs a contiguous cache; the cache holds every new
    token."""
    nheads_k = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([32, 64, 40]))
    page_size = draw(st.sampled_from([0, 16, 32, 48]))
    seqlen_new = draw(st.integers(0, 3))
    seqlen_cache = draw(st.integers(max(seqlen_new, 1), 120))
    if page_size:
        seqlen_cache = -(-seqlen_cache // page_size) * page_size
    rotary_dim = 0
    seqlen_q = draw(st.integers(1, 4))
    if seqlen_new and draw(st.booleans()):
        rotary_dim = draw(st.sampled_from([d for d in (16, 32, 48, 64) if d <= head_dim]))
        seqlen_q = min(seqlen_q, seqlen_new)  # q's positions stay inside the cache's (and the tables') rows
    side = st.integers(-1, 30)
    return test_kvcache.Case(
        batch=draw(st.integers(1, 3)),
        seqlen_q=seqlen_q,
        seqlen_new=seqlen_new,
        nheads=nheads_k * draw(st.integers(1, 4)),
        nheads_k=nheads_k,
        head_dim=head_dim,
        seqlen_cache=seqlen_cache,
        page_size=page_size,
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
        batch_idx=not page_size and draw(st.booleans()),
        leftpad=draw(st.booleans()),
        rotary_dim=rotary_dim,
        rotary_interleaved=draw(st.booleans()),
        causal=draw(st.booleans()),
        window_size=(draw(side), draw(side)) if draw(st.booleans()) else (-1, -1),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0, 25.0])),
        alibi=draw(st.sampled_from(["", "", "heads", "batch"])),
        num_splits=draw(st.sampled_from([0, 1, 2, 3, 5])),
        softmax_scale=draw(st.sampled_from([None, 0.3])),
    )


@settings(max_examples=80, **EXAMPLE_SETTINGS)
@given(case=kvcache_cases())
def test_kvcache_option_combinations_cpu_path(case):
    with cpu_path():
        test_kvcache.check(case)


@settings(max_examples=25, **EXAMPLE_SETTINGS)
@given(case=kvcache_cases())
def test_kvcache_option_combinations_kernels(case):
    test_kvcache.check(case)


@st.composite
def varlen_cases(draw) -> dict:
    """test_varlen.check's arguments: per-sequence query and key lengths, heads, head dim, dtype, options."""
    n = draw(st.integers(1, 4))
    lengths = st.lists(st.integers(0, 60), min_size=n, max_size=n)
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.integers(1, 3))
    options = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        side = st.integers(-1, 30)
        options["window_size"] = (draw(side), draw(side))
    if draw(st.booleans()):
        options["softcap"] = draw(st.floats(1.0, 30.0))
    alibi = draw(st.sampled_from([None, (nheads,), (n, nheads)]))
    if alibi is not None:
        options["alibi_slopes"] = slopes_like(alibi)
    return dict(
        seqlens_q=draw(lengths), seqlens_k=draw(lengths), nheads=nheads, nheads_k=nheads_k,
        head_dim=draw(st.sampled_from([16, 32, 40, 64])), dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
        dlse=draw(st.booleans()), **options,
    )  # fmt: skip


@settings(max_examples=60, **EXAMPLE_SETTINGS)
@given(case=varlen_cases())
def test_varlen_option_combinations_cpu_path(case):
    with cpu_path():
        test_varlen.check(**case)


@settings(max_examples=20, **EXAMPLE_SETTINGS)
@given(case=varlen_cases())
def test_varlen_option_combinations_kernels(case):
    test_varlen.check(**case)


@st.composite
def sdpa_cases(draw) -> dict:
    """Inputs of scaled_dot_product_attention in torch's layout (B, H, S, D) and its options."""
    batch, seqlen_q, seqlen_k = draw(st.integers(1, 2)), draw(st.integers(1, 50)), draw(st.integers(1, 50))
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([16, 32, 40, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, dout = randn(batch, nheads, seqlen_q, head_dim), randn(batch, nheads, seqlen_q, head_dim)
    k, v = randn(batch, nheads_k, seqlen_k, head_dim), randn(batch, nheads_k, seqlen_k, head_dim)
    options = {"scale": draw(st.sampled_from([None, 0.1, 0.5])), "enable_gqa": nheads != nheads_k}
    mask_kind = draw(st.sampled_from([None, "causal", "bool", "additive"]))
    if mask_kind == "causal":
        options["is_causal"] = True
    elif mask_kind is not None:
        full = (batch, nheads, seqlen_q, seqlen_k)
        kept = draw(st.lists(st.booleans(), min_size=4, max_size=4))  # which dimensions the mask spans
        shape = tuple(n if keep or i >= 2 else 1 for i, (n, keep) in enumerate(zip(full, kept, strict=True)))
        shape = shape[draw(st.integers(0, 2)) :] if shape[0] == 1 else shape  # leading 1s may be left out
        if mask_kind == "bool":
            mask = torch.rand(shape, generator=gen) > 0.3
            mask[..., 0] = True
        else:
            mask = torch.randn(shape, generator=gen).to(dtype)
        options["attn_mask"] = mask
    return {"inputs": [t.to(DEVICE) for t in (q, k, v, dout)], "options": options}


def sdpa_results(sdpa, inputs, options, dtype=None) -> dict[str, torch.Tensor]:
    """out and the gradients of q, k, v of ``sdpa`` (computed in ``dtype`` if given, cast back)."""
    q, k, v, dout = inputs
    cast = dtype or q.dtype
    leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
    mask = options.get("attn_mask")
    options = dict(
        options, attn_mask=None if mask is None else mask.to(DEVICE, cast if mask.is_floating_point() else mask.dtype)
    )
    out = sdpa(*leaves, **options)
    out.backward(dout.to(cast))
    return {
        name: t.to(q.dtype) for name, t in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in leaves)), strict=True)
    }


def check_sdpa_case(case: dict) -> None:
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention
    precise = torch.float64 if DEVICE == "cpu" else torch.float32
    got = sdpa_results(flashtile.scaled_dot_product_attention, case["inputs"], case["options"])
    ref = sdpa_results(torch_sdpa, case["inputs"], case["options"], precise)
    base = sdpa_results(torch_sdpa, case["inputs"], case["options"])
    for name, x in got.items():
        assert_within_rule(name, x, ref[name], base[name])


@settings(max_examples=60, **EXAMPLE_SETTINGS)
@given(case=sdpa_cases())
def test_sdpa_option_combinations_cpu_path(case):
    with cpu_path():
        check_sdpa_case(case)


@settings(max_examples=20, **EXAMPLE_SETTINGS)
@given(case=sdpa_cases())
def test_sdpa_option_combinations_kernels(case):
    check_sdpa_case(case)
