"""flash_attn_func and friends against the oracle, forward and backward, on every reachable path.

On a CPU-only machine each case runs twice (fixture ``path``): through the Triton kernels in the
Triton interpreter, and through ``flashtile.cpu``. With CUDA the same cases run on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile import _backend
from flashtile.ops.attention import backward as attention_backward_module
from flashtile.ops.attention import configs
from flashtile.ops.attention import forward as attention_forward_module
from flashtile.ops.attention.configs import TileConfig, override
from flashtile.ops.common.grid import MAX_GRID_YZ
from flashtile.reference import visibility_mask
from oracle import check_against_oracle

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v=None, dtype=torch.float16, seed=0):
    """Fresh random q, k, v, dout in flash_attn's layout (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    q = randn(batch, seqlen_q, nheads, head_dim)
    k = randn(batch, seqlen_k, nheads_k, head_dim)
    v = randn(batch, seqlen_k, nheads_k, head_dim_v)
    dout = randn(batch, seqlen_q, nheads, head_dim_v)
    return q, k, v, dout


def run_flashtile(q, k, v, dout, dlse=None, **kwargs):
    """Forward with return_attn_probs, backward of (out * dout).sum() (+ (lse * dlse).sum() if dlse
    is given); returns out, lse and the gradients."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, probs = flashtile.flash_attn_func(*leaves, return_attn_probs=True, **kwargs)
    assert probs is None
    if dlse is None:
        out.backward(dout)
    else:
        torch.autograd.backward([out, lse], [dout, dlse])
    return {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def check(q, k, v, dout, **kwargs):
    results = run_flashtile(q, k, v, dout, **kwargs)
    check_against_oracle(results, q, k, v, dout, **kwargs)


SEQLENS = [(1, 1), (17, 113), (113, 17), (128, 128), (255, 1023), (1023, 255)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_seqlens(path, dtype, causal, seqlens):
    seqlen_q, seqlen_k = seqlens
    check(*make_inputs(1, seqlen_q, seqlen_k, 2, 2, 64, dtype=dtype), causal=causal)


HEAD_DIMS = [8, 16, 32, 40, 64, 72, 96, 128, 160, 192, 256]


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_head_dims(path, dtype, head_dim):
    causal = head_dim % 16 == 8  # half the head dims causal, half not
    check(*make_inputs(2, 77, 45, 2, 1, head_dim, dtype=dtype), causal=causal)


@pytest.mark.parametrize("head_dims", [(64, 32), (40, 128), (128, 64), (256, 8)], ids=lambda d: f"D{d[0]}-Dv{d[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_v(path, causal, head_dims):
    check(*make_inputs(1, 70, 91, 2, 2, *head_dims, dtype=torch.bfloat16), causal=causal)


@pytest.mark.parametrize("heads", [(6, 2), (3, 1), (8, 8)], ids=["GQA6-2", "MQA3-1", "MHA8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_heads(path, dtype, causal, heads):
    check(*make_inputs(2, 65, 130, *heads, 32, dtype=dtype), causal=causal)


@pytest.mark.parametrize(
    "window", [(16, 0), (0, 0), (7, 23), (-1, 5), (40, -1), (200, 200)], ids=lambda w: f"W{w[0]}_{w[1]}"
)
@pytest.mark.parametrize("seqlens", [(100, 100), (60, 150), (150, 60)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_sliding_window(path, seqlens, window):
    check(*make_inputs(1, *seqlens, 2, 1, 32, dtype=torch.float16), window_size=window)


def test_causal_with_window(path):
    q, k, v, dout = make_inputs(1, 90, 120, 2, 2, 32)
    results = run_flashtile(q, k, v, dout, causal=True, window_size=(20, 20))
    check_against_oracle(results, q, k, v, dout, window_size=(20, 0))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rows_that_see_no_key(path, dtype):
    """Causal with seqlen_q > seqlen_k: the first rows see no key: 0 out, -inf LSE, finite grads."""
    q, k, v, dout = make_inputs(2, 100, 30, 2, 2, 64, dtype=dtype)
    results = run_flashtile(q, k, v, dout, causal=True)
    blind = ~visibility_mask(100, 30, causal=True).any(dim=1)
    assert blind.sum() == 70
    assert torch.all(results["out"][:, blind.to(DEVICE)] == 0)
    assert torch.all(results["lse"][:, :, blind.to(DEVICE)] == float("-inf"))
    assert torch.all(results["dq"][:, blind.to(DEVICE)] == 0)
    check_against_oracle(results, q, k, v, dout, causal=True)


TMA_TILES = TileConfig(32, 32, 4, 1, tma=True)
ALL_PASSES_TMA = dict.fromkeys(configs.PASSES, TMA_TILES)


def record_tma(monkeypatch) -> list[bool]:
    """Record the ``tma`` of every ``tile_sources`` call of the launchers (forward, dK/dV, dQ, in order)."""
    taken = []
    for module in (attention_forward_module, attention_backward_module):
        original = module.tile_sources
        monkeypatch.setattr(module, "tile_sources", lambda tma, *t, _f=original: taken.append(tma) or _f(tma, *t))
    return taken


@pytest.mark.parametrize(
    ("seqlens", "heads", "head_dim", "options"),
    [
        ((17, 113), (4, 2), 64, {"causal": True}),
        ((113, 17), (2, 2), 40, {}),
        ((128, 128), (3, 1), 32, {"causal": True, "softcap": 5.0, "alibi_slopes": True}),
        ((90, 120), (2, 1), 64, {"window_size": (20, 7), "deterministic": True}),
    ],
    ids=["causal-GQA", "D40-Sq>Sk", "softcap-alibi-MQA", "window"],
)
def test_tensor_descriptor_path(path, monkeypatch, seqlens, heads, head_dim, options):
    """The copy-engine (TMA) loads of the forward, dK/dV and dQ kernels, forced with small tiles, against the
    oracle; the launchers must really take that path (their tile_sources calls are recorded). The sm_90 Gluon
    kernels are switched off: they would serve D=64 in place of the Triton kernels this test forces."""
    if path != "triton":
        pytest.skip("tile configs only steer the Triton kernels")
    monkeypatch.setattr(_backend, "GLUON", False)
    taken = record_tma(monkeypatch)
    q, k, v, dout = make_inputs(2, *seqlens, *heads, head_dim, dtype=torch.bfloat16)
    if options.get("alibi_slopes"):
        options = dict(options, alibi_slopes=torch.rand(heads[0], device=DEVICE))
    with override(**ALL_PASSES_TMA):
        results = run_flashtile(q, k, v, dout, **options)
    assert taken == [True, True, True]  # forward, dK/dV, dQ
    options.pop("deterministic", None)
    check_against_oracle(results, q, k, v, dout, **options)


def test_tensor_descriptor_path_falls_back_to_pointers(path, monkeypatch):
    """Rows whose strides are not 16-byte aligned (a 64-wide slice of fp16 rows of 68: 136-byte strides)
    cannot be described to the copy engine: the launchers read them through pointers, with the same result."""
    if path != "triton":
        pytest.skip("tile configs only steer the Triton kernels")
    taken = record_tma(monkeypatch)
    wide = [x.requires_grad_() for x in make_inputs(1, 50, 70, 2, 2, 68)[:3]]
    q, k, v = (x[..., :64] for x in wide)
    dout = make_inputs(1, 50, 70, 2, 2, 64, seed=1)[3]
    with override(**ALL_PASSES_TMA):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
        out.backward(dout)
    assert taken == [False, False, False]  # forward, dK/dV, dQ
    grads = {name: x.grad[..., :64] for name, x in zip(("dq", "dk", "dv"), wide, strict=True)}
    check_against_oracle({"out": out, "lse": lse, **grads}, *(x.detach() for x in (q, k, v)), dout)


@pytest.mark.parametrize("major", [8, 9, 10], ids=lambda m: f"sm{m}x")
def test_every_pass_has_a_config_on_every_gpu_generation(monkeypatch, major):
    """Each pass the launchers ask for has a tile config on Hopper and on the table for other GPUs."""
    monkeypatch.setattr(configs, "compute_capability", lambda index: (major, 0))
    for pass_name in configs.PASSES:
        for head_dim in (8, 64, 128, 256):
            cfg = configs.config(pass_name, torch.device("cuda", 0), head_dim, head_dim)
            assert cfg.block_m >= 16 and cfg.block_n >= 16
            assert not cfg.tma or major >= 9, "the copy engine needs Hopper or later"


def test_strided_qkv_from_one_tensor(path):
    """q, k, v as views of one (B, S, 3, H, D) tensor: no copy needed, gradients correct."""
    qkv = torch.randn(2, 99, 3, 4, 64, dtype=torch.float16, device=DEVICE)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    dout = torch.randn(2, 99, 4, 64, dtype=torch.float16, device=DEVICE)
    check(q, k, v, dout, causal=True)


def test_non_contiguous_last_dim_and_dout(path):
    """A last dimension with stride != 1 and an expanded dout (stride 0) are handled."""
    q, k, v, _ = make_inputs(1, 40, 50, 2, 2, 32)
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q_t.stride(-1) != 1
    dout = torch.randn(1, 1, 1, 32, dtype=q.dtype, device=DEVICE).expand(1, 40, 2, 32)
    check(q_t, k, v, dout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked(path, causal):
    qkv = torch.randn(2, 70, 3, 2, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    out, lse, _ = flashtile.flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = qkv.grad.unbind(2)
    q, k, v = qkv.detach().unbind(2)
    results = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    check_against_oracle(results, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvpacked(path, causal):
    q = torch.randn(2, 50, 6, 64, dtype=torch.float16, device=DEVICE, requires_grad=True)
    kv = torch.randn(2, 81, 2, 2, 64, dtype=torch.float16, device=DEVICE, requires_grad=True)
    out = flashtile.flash_attn_kvpacked_func(q, kv, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    dk, dv = kv.grad.unbind(2)
    k, v = kv.detach().unbind(2)
    results = {"out": out, "dq": q.grad, "dk": dk, "dv": dv}
    check_against_oracle(results, q.detach(), k, v, dout, causal=causal)


def test_softmax_scale(path):
    q, k, v, dout = make_inputs(1, 33, 47, 2, 2, 64)
    check(q, k, v, dout, softmax_scale=0.37)


def test_gradient_through_lse(path):
    """softmax_lse is differentiable: d lse_i / d s_ij = p_ij enters the backward."""
    q, k, v, dout = make_inputs(1, 37, 53, 2, 1, 32)
    dlse = torch.randn(1, 2, 37, device=DEVICE)
    results = run_flashtile(q, k, v, dout, dlse=dlse, causal=True)
    check_against_oracle(results, q, k, v, dout, dlse=dlse, causal=True)


def test_deterministic_backward(path):
    """The backward has no atomics: repeated runs are bitwise identical."""
    q, k, v, dout = make_inputs(1, 130, 130, 4, 2, 64)
    first = run_flashtile(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(3):
        again = run_flashtile(q, k, v, dout, causal=True, deterministic=True)
        for name in first:
            assert torch.equal(first[name], again[name]), name


def test_default_scale_matches_explicit(path):
    q, k, v, _ = make_inputs(1, 20, 20, 2, 2, 40)
    assert torch.equal(
        flashtile.flash_attn_func(q, k, v),
        flashtile.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(40)),
    )


class _NoLaunch:
    """Stands in for a kernel: launching it fails the test."""

    def __getitem__(self, grid):
        raise AssertionError(f"a kernel was launched with grid {grid}")


@pytest.mark.skipif(DEVICE == "cpu" and not _backend.TRITON_INTERPRET, reason="the CPU path has no grid")
def test_too_many_batch_entries_for_the_kernels_raise_before_launch(monkeypatch):
    monkeypatch.setattr(attention_forward_module, "_attention_forward_kernel", _NoLaunch())
    q = torch.randn(MAX_GRID_YZ + 1, 1, 1, 8, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 65535 batch entries"):
        flashtile.flash_attn_func(q, q, q)
