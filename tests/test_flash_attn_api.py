"""The public API against flash_attn 2.x's docstrings (flash_attn_interface.py): positional calls in the
documented argument order, return values and their shapes, the accepted forms of the options, the errors,
and flash_attn's padding of a head dimension that is not a multiple of 8.

Numbers are compared with the oracle (tests/oracle.py); the other suites cover the numerics of each option.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashtile
from conftest import DEVICE
from oracle import check_against_oracle


def randn(*shape, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def test_flash_attn_module_paths():
    """flash_attn 2.x's module paths, so imports from flash_attn.bert_padding and flash_attn.flash_attn_interface
    become imports from flashtile by the package name alone."""
    from flashtile import bert_padding, flash_attn_interface, kvcache, padding

    assert bert_padding.unpad_input is padding.unpad_input and bert_padding.pad_input is padding.pad_input
    assert bert_padding.index_first_axis is padding.index_first_axis
    assert bert_padding.index_put_first_axis is padding.index_put_first_axis
    for name in flash_attn_interface.__all__:
        assert getattr(flash_attn_interface, name) is getattr(flashtile, name)
    assert flash_attn_interface.flash_attn_with_kvcache is kvcache.flash_attn_with_kvcache


def test_positional_calls_and_return_shapes():
    """Every argument positionally, in flash_attn's order: dropout_p, softmax_scale, causal, window_size,
    softcap, alibi_slopes, deterministic, return_attn_probs -> (out, softmax_lse, S_dmask)."""
    b, sq, sk, h, hk, d = 2, 5, 7, 4, 2, 16
    q, k, v = randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d)
    slopes = torch.rand(h, device=DEVICE)
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, 0.0, None, True, (2, -1), 5.0, slopes, True, True)
    assert out.shape == (b, sq, h, d) and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert s_dmask is None  # on purpose: the probabilities are never materialised (flash_attn_func's docstring)

    qkv = randn(b, sq, 3, h, d)
    result = flashtile.flash_attn_qkvpacked_func(qkv, 0.0, None, True, (-1, -1), 0.0, slopes, True, True)
    assert [t.shape for t in result[:2]] == [(b, sq, h, d), (b, h, sq)] and result[2] is None
    kv = randn(b, sk, 2, hk, d)
    result = flashtile.flash_attn_kvpacked_func(q, kv, 0.0, None, True, (-1, -1), 0.0, None, False, True)
    assert [t.shape for t in result[:2]] == [(b, sq, h, d), (b, h, sq)] and result[2] is None

    cu_q, cu_k, total_q, total_k = int32([0, 2, 5]), int32([0, 4, 7]), 5, 7
    qv, kv_, vv = randn(total_q, h, d), randn(total_k, hk, d), randn(total_k, hk, d)
    out, lse, s_dmask = flashtile.flash_attn_varlen_func(
        qv, kv_, vv, cu_q, cu_k, 3, 4, 0.0, None, True, (-1, -1), 0.0, slopes, False, True, None
    )
    assert out.shape == (total_q, h, d) and lse.shape == (h, total_q) and s_dmask is None
    result = flashtile.flash_attn_varlen_qkvpacked_func(
        randn(total_k, 3, h, d), cu_k, 4, 0.0, None, True, (-1, -1), 0.0, None, False, True
    )
    assert [t.shape for t in result[:2]] == [(total_k, h, d), (h, total_k)] and result[2] is None
    result = flashtile.flash_attn_varlen_kvpacked_func(
        qv, randn(total_k, 2, hk, d), cu_q, cu_k, 3, 4, 0.0, None, True, (-1, -1), 0.0, None, False, True
    )
    assert [t.shape for t in result[:2]] == [(total_q, h, d), (h, total_q)] and result[2] is None
    # without return_attn_probs: the output alone
    assert isinstance(flashtile.flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 3, 4), torch.Tensor)


def test_kvcache_positional_call_and_softmax_lse():
    """flash_attn_with_kvcache's order: k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
    num_splits, return_softmax_lse -> (out, softmax_lse (batch, nheads, seqlen))."""
    b, h, hk, d = 2, 4, 2, 16
    q = randn(b, 3, h, d)
    k_cache, v_cache = randn(b, 16, hk, d), randn(b, 16, hk, d)
    k, v = randn(b, 3, hk, d), randn(b, 3, hk, d)
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, None, None, int32([4, 9]), None, None, None, None, True, [-1, -1], 0.0, True,
        None, 0, True,
    )  # fmt: skip
    assert out.shape == (b, 3, h, d) and lse.shape == (b, h, 3) and lse.dtype == torch.float32
    assert isinstance(flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5), torch.Tensor)


def test_kvcache_int_cache_seqlens_equals_tensor():
    """cache_seqlens: int, or (batch_size,) int32: an int is every batch entry's length."""
    q, k, v = randn(2, 1, 2, 16), randn(2, 1, 2, 16), randn(2, 1, 2, 16)
    caches = [(randn(2, 8, 2, 16, seed=1), randn(2, 8, 2, 16, seed=2)) for _ in range(2)]
    from_int = flashtile.flash_attn_with_kvcache(q, *caches[0], k, v, cache_seqlens=3, causal=True)
    from_tensor = flashtile.flash_attn_with_kvcache(q, *caches[1], k, v, cache_seqlens=int32([3, 3]), causal=True)
    assert torch.equal(from_int, from_tensor)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize(
    "window", [[3, 1], (np.int64(3), np.int64(1)), (torch.tensor(3).item(), 1)], ids=["list", "numpy", "item"]
)
def test_window_size_forms(window):
    """window_size: (left, right) as a tuple, a list, or any integers (numpy's too) gives the same result."""
    q, k, v = randn(1, 9, 2, 16), randn(1, 9, 2, 16), randn(1, 9, 2, 16)
    expected = flashtile.flash_attn_func(q, k, v, window_size=(3, 1))
    assert torch.equal(flashtile.flash_attn_func(q, k, v, window_size=window), expected)
    k_cache, v_cache = randn(1, 16, 2, 16), randn(1, 16, 2, 16)
    expected = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=12, window_size=(3, 1))
    assert torch.equal(flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=12, window_size=window),
                       expected)  # fmt: skip


def test_window_size_of_bools_refused():
    q = randn(1, 4, 1, 16)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        flashtile.flash_attn_func(q, q, q, window_size=(True, False))


def test_alibi_slopes_per_head_equals_per_batch():
    """alibi_slopes: (nheads,) or (batch_size, nheads), fp32; the (nheads,) form is every row's."""
    q, k, v = randn(2, 6, 3, 16), randn(2, 8, 3, 16), randn(2, 8, 3, 16)
    slopes = torch.tensor([0.5, 0.25, 0.125], device=DEVICE)
    one = flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    per_batch = flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes.expand(2, 3).contiguous())
    assert torch.equal(one, per_batch)


def test_unsupported_dtypes_raise_a_clear_error():
    """flash_attn raises (a RuntimeError) for dtypes it does not take; flashtile's error is both a TypeError and a
    RuntimeError, and says which dtypes work (float64 here; float32 runs on CPU tensors)."""
    q = randn(1, 4, 1, 16, dtype=torch.float64)
    for call in (
        lambda: flashtile.flash_attn_func(q, q, q),
        lambda: flashtile.flash_attn_qkvpacked_func(torch.stack([q, q, q], 2)),
        lambda: flashtile.flash_attn_varlen_func(q[0], q[0], q[0], int32([0, 4]), int32([0, 4]), 4, 4),
        lambda: flashtile.flash_attn_with_kvcache(q, q, q),
    ):
        with pytest.raises(RuntimeError, match="torch.float64; flashtile supports torch.float16 and torch.bfloat16"):
            call()
        with pytest.raises(TypeError):
            call()


def test_head_dim_above_256_raises():
    q = randn(1, 2, 1, 264)
    with pytest.raises(RuntimeError, match="between 1 and 256 .flash_attn.s limit., got 264"):
        flashtile.flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="between 1 and 256 .flash_attn.s limit., got 264"):
        flashtile.flash_attn_with_kvcache(q, q, q)


def test_odd_head_dim_is_padded(path):
    """A headdim that is not a multiple of 8 works as in flash_attn (zero-padded inside): exact output,
    softmax_lse and gradients, the default softmax_scale 1/sqrt of the original headdim."""
    q, k, v, dout = randn(1, 9, 2, 20), randn(1, 11, 1, 20), randn(1, 11, 1, 20), randn(1, 9, 2, 20)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    assert out.shape == (1, 9, 2, 20)
    out.backward(dout)
    results = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    check_against_oracle(results, q, k, v, dout, causal=True, softmax_scale=1 / math.sqrt(20))


def test_odd_head_dim_varlen_and_packed():
    """The padding in the varlen functions and through packed qkv, whose gradient reaches q, k and v."""
    qkv = randn(7, 3, 2, 12).requires_grad_()
    cu = int32([0, 3, 7])
    out, lse, _ = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 4, causal=True, return_attn_probs=True)
    assert out.shape == (7, 2, 12) and lse.shape == (2, 7)
    dout = randn(7, 2, 12, seed=1)
    out.backward(dout)
    assert all(qkv.grad[:, i].abs().sum() > 0 for i in range(3))
    for start, end in [(0, 3), (3, 7)]:
        q, k, v = (qkv.detach()[start:end, i][None] for i in range(3))
        results = {"out": out[start:end][None], "lse": lse[:, start:end][None]}
        results.update({f"d{n}": qkv.grad[start:end, i][None] for i, n in enumerate("qkv")})
        check_against_oracle(results, q, k, v, dout[start:end][None], causal=True)


def test_odd_head_dim_kvcache():
    """flash_attn_with_kvcache with headdim 20: the new keys land in the caches, the output is that of
    the same call on zero-padded tensors."""
    q, k, v = randn(2, 2, 2, 20), randn(2, 2, 1, 20, seed=1), randn(2, 2, 1, 20, seed=2)
    k_cache, v_cache = randn(2, 16, 1, 20, seed=3), randn(2, 16, 1, 20, seed=4)
    before = k_cache.clone(), v_cache.clone()
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=int32([3, 5]), causal=True, return_softmax_lse=True
    )
    assert out.shape == (2, 2, 2, 20) and lse.shape == (2, 2, 2)
    assert torch.equal(k_cache[0, 3:5], k[0]) and torch.equal(v_cache[1, 5:7], v[1])
    assert torch.equal(k_cache[0, :3], before[0][0, :3]) and torch.equal(v_cache[1, 7:], before[1][1, 7:])

    def pad(t):
        return torch.nn.functional.pad(t, (0, 4))

    expected, expected_lse = flashtile.flash_attn_with_kvcache(
        pad(q), pad(before[0]), pad(before[1]), pad(k), pad(v), cache_seqlens=int32([3, 5]), causal=True,
        softmax_scale=1 / math.sqrt(20), return_softmax_lse=True,
    )  # fmt: skip
    assert torch.equal(out, expected[..., :20]) and torch.equal(lse, expected_lse)


def test_causal_seqlen_q_above_seqlen_k_docstring_example():
    """The docstring's seqlen_q = 5, seqlen_k = 2 causal mask: the first three rows see no key and give
    output 0 (softmax_lse -inf: the log of an empty sum; flash_attn's kernel writes +inf there); row 3 sees
    key 0 alone, so its output is v[0]."""
    q, k, v = randn(1, 5, 1, 16), randn(1, 2, 1, 16), randn(1, 2, 1, 16)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    assert torch.isneginf(lse[0, 0, :3]).all() and torch.isfinite(lse[0, 0, 3:]).all()
    # row 3 is v[0] (the oracle's value), within the tolerance rule rather than a hand-picked atol
    check_against_oracle({"out": out, "lse": lse}, q, k, v, randn(1, 5, 1, 16), causal=True)


def test_dropout_applies_whenever_positive():
    """dropout_p > 0 drops probabilities on every call (no training flag; pass 0.0 in evaluation), and
    dropout_p = 0.0 is deterministic."""
    q, k, v = randn(1, 16, 2, 16), randn(1, 16, 2, 16), randn(1, 16, 2, 16)
    plain = flashtile.flash_attn_func(q, k, v)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, 0.0), plain)
    torch.manual_seed(0)
    dropped = flashtile.flash_attn_func(q, k, v, 0.5)
    assert not torch.equal(dropped, plain)
    torch.manual_seed(0)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, 0.5), dropped)
