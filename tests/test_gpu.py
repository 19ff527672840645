"""Larger shapes, index overflow, memory and races: cases that only a GPU can run in reasonable time."""

from __future__ import annotations

import pytest
import torch

import flashtile
from oracle import check_against_oracle
from test_attention import check, make_inputs, run_flashtile

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seqlens", [(1024, 1024), (1023, 4097), (4097, 1023), (2048, 2048)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_large(dtype, causal, head_dim, seqlens):
    check(*make_inputs(2, *seqlens, 8, 2, head_dim, dtype=dtype), causal=causal)


@pytest.mark.parametrize("head_dim", [40, 72, 96, 160, 192], ids=lambda d: f"D{d}")
def test_large_odd_head_dims(head_dim):
    check(*make_inputs(2, 1500, 1100, 4, 4, head_dim, dtype=torch.bfloat16), causal=True)


def test_more_batch_heads_than_a_grid_dimension():
    """batch * nheads above 65535 (the y limit of a CUDA grid): the grid is (tiles, nheads, batch)."""
    check(*make_inputs(2049, 16, 16, 32, 8, 64, dtype=torch.bfloat16), causal=True)


def test_batch_offsets_past_int32():
    """q, k, v of more than 2**31 elements each: batch offsets need 64-bit arithmetic."""
    batch, seqlen, nheads, head_dim = 1040, 1024, 16, 128  # 2.18e9 elements per tensor
    q = torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
    assert q.numel() > 2**31
    out = flashtile.flash_attn_func(q, q, q, causal=True)
    tail = slice(batch - 2, batch)  # the last batch entries sit past the 2**31 boundary
    small = [t[tail].contiguous() for t in (q, q, q)]
    torch.testing.assert_close(out[tail], flashtile.flash_attn_func(*small, causal=True), rtol=0, atol=0)


def test_sequence_offsets_past_int32():
    """A key sequence of more than 2**31 elements in one (batch, head): 64-bit row offsets."""
    seqlen_k, head_dim = 2**31 // 128 + 4096, 128
    k = torch.randn(1, seqlen_k, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 64, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    tail = k[:, -3000:]  # with window (0, 0) and bottom-right alignment, q only sees the last 64 keys
    out = flashtile.flash_attn_func(q, k, k, window_size=(0, 0))
    expected = flashtile.flash_attn_func(q, tail.contiguous(), tail.contiguous(), window_size=(0, 0))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("seqlen", [4096, 16384])
def test_memory_is_linear(seqlen):
    """fwd+bwd peak extra memory: outputs, LSE and gradients only, nothing of size seqlen**2."""
    q, k, v, dout = make_inputs(1, seqlen, seqlen, 16, 16, 128, dtype=torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    flashtile.flash_attn_func(q, k, v, causal=True).backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    tensor_bytes = q.numel() * q.element_size()
    # out, dq, dk, dv, and on sm_90 the atomic backward's fp32 dQ accumulator (two tensors' worth) while dq
    # is cast from it; plus the LSE and delta
    assert extra <= 7 * tensor_bytes, f"{extra / 2**20:.0f} MiB extra for {tensor_bytes / 2**20:.0f} MiB tensors"


def test_backward_is_bitwise_repeatable():
    """50 reruns of a deterministic GQA causal backward: a race would show as a changing bit."""
    q, k, v, dout = make_inputs(2, 1031, 1031, 8, 2, 128, dtype=torch.bfloat16)
    first = run_flashtile(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(50):
        again = run_flashtile(q, k, v, dout, causal=True, deterministic=True)
        assert all(torch.equal(first[n], again[n]) for n in first)
    check_against_oracle(first, q, k, v, dout, causal=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")  # Triton kernels; Gluon ones on sm_90
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
def test_inputs_on_a_gpu_that_is_not_the_current_one(head_dim, deterministic):
    """Tensors on cuda:1 while cuda:0 is current: forward, backward, varlen and the KV-cache decode run on
    cuda:1 (flash_attn's device guard) and give the bits of the same calls made with cuda:1 current. With
    deterministic=False the backward may add dQ with atomics (the Gluon backward on sm_90), whose order varies
    from run to run: there dq is left out of the bitwise comparison (test_gluon_sm90 checks it against the
    oracle), every other result is compared."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 256, 4, head_dim, generator=gen).to("cuda:1", torch.bfloat16) for _ in range(4))
    cu = torch.tensor([0, 100, 512], dtype=torch.int32, device="cuda:1")
    k_cache, v_cache = (torch.randn(2, 512, 4, head_dim, generator=gen).to("cuda:1", torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([300, 17], dtype=torch.int32, device="cuda:1")

    def run() -> dict[str, torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashtile.flash_attn_func(*leaves, causal=True, deterministic=deterministic)
        out.backward(dout)
        packed = [t.flatten(0, 1) for t in (q, k, v)]
        varlen = flashtile.flash_attn_varlen_func(*packed, cu, cu, 412, 412, causal=True)
        decode = flashtile.flash_attn_with_kvcache(
            q[:, :1], k_cache.clone(), v_cache.clone(), k[:, :1], v[:, :1], cache_seqlens=seqlens
        )
        grads = dict(zip(("dq", "dk", "dv"), (t.grad for t in leaves), strict=True))
        return {"out": out, **grads, "varlen": varlen, "decode": decode}

    with torch.cuda.device(1):
        expected = run()
    with torch.cuda.device(0):
        got = run()
    torch.cuda.synchronize(1)
    for name, value in got.items():
        assert value.device == torch.device("cuda:1"), name
        if deterministic or name != "dq":
            assert torch.equal(value, expected[name]), name
