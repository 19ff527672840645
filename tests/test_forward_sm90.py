"""The Gluon forward of sm_90 (``ops.attention.forward_sm90``): which launches take it, and its results.

Which launches qualify is checked on any machine; the kernel itself only runs on a Hopper GPU (Gluon has
no CPU interpreter; tests/sm90_compile.py compiles it for sm_90 without one).
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import _backend
from flashtile.ops.attention import forward_sm90
from test_attention import check, make_inputs

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90)")


def qkv(batch=2, seqlen_q=256, seqlen_k=384, nheads=4, nheads_k=2, head_dim=128, dtype=torch.bfloat16):
    q = torch.empty(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = torch.empty(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    return q, k, torch.empty_like(k)


def test_qualifies_plain_layouts():
    assert forward_sm90.qualifies(*qkv())
    assert forward_sm90.qualifies(*qkv(dtype=torch.float16))
    assert forward_sm90.qualifies(*qkv(batch=1, seqlen_q=128, seqlen_k=128, nheads=1, nheads_k=1))
    packed = torch.empty(2, 256, 3, 4, 128, dtype=torch.bfloat16)  # q, k, v sliced from a packed qkv
    assert forward_sm90.qualifies(*packed.unbind(2))


@pytest.mark.parametrize(
    "case",
    [
        dict(head_dim=64),
        dict(head_dim=256),
        dict(seqlen_q=1000),
        dict(seqlen_k=1000),
        dict(seqlen_q=64),
        dict(dtype=torch.float32),
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_qualifies_rejects(case):
    assert not forward_sm90.qualifies(*qkv(**case))


def test_qualifies_rejects_layouts_a_descriptor_cannot_read():
    q, k, v = qkv()
    heads_strided = torch.empty(2, 384, 128, 2, dtype=torch.bfloat16).transpose(2, 3)  # (B, S, H, D), D strided
    assert not forward_sm90.qualifies(q, heads_strided, v)
    batch_strided = torch.empty(2, 512, 4, 128, dtype=torch.bfloat16)[:, :256]  # rows not evenly strided
    assert not forward_sm90.qualifies(batch_strided, k, v)
    head_major = torch.empty(2, 4, 256, 128, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, S, D) memory
    assert not forward_sm90.qualifies(head_major, k, v)
    misaligned = torch.empty(2 * 256 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 256, 4, 128)
    assert not forward_sm90.qualifies(misaligned, k, v)


def test_cpu_tensors_never_take_it():
    assert not forward_sm90.applies(*qkv())


@pytest.fixture
def launches(monkeypatch):
    """Counts the launches of the Gluon forward."""
    calls = []
    launch = forward_sm90.attention_forward_sm90

    def counted(*args, **kwargs):
        calls.append(kwargs["causal"])
        return launch(*args, **kwargs)

    monkeypatch.setattr(forward_sm90, "attention_forward_sm90", counted)
    return calls


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2, 128, 128, 4, 4), (1, 256, 512, 4, 2), (2, 512, 256, 4, 4), (1, 384, 1152, 2, 1), (1, 1024, 1024, 8, 8)],
    ids=lambda s: "B{}-Sq{}-Sk{}-H{}_{}".format(*s),
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_against_oracle(launches, dtype, causal, shape):
    """Forward and backward (the Triton backward on the Gluon forward's out and LSE) against the oracle;
    Sq > Sk causal has query rows that see no key."""
    check(*make_inputs(*shape, 128, dtype=dtype), causal=causal)
    assert launches == [causal]


@hopper
@pytest.mark.gpu
def test_packed_qkv_and_softmax_scale(launches):
    packed = torch.randn(2, 256, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = packed.unbind(2)
    check(q, k, v, dout, causal=True, softmax_scale=0.3)
    assert launches == [True]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_switched_off_runs_the_triton_kernel(monkeypatch, launches, causal):
    """The same call with FLASHTILE_GLUON=0 (``_backend.GLUON``) runs the Triton kernel; both pass the rule."""
    inputs = make_inputs(2, 512, 768, 8, 2, 128, dtype=torch.bfloat16)
    check(*inputs, causal=causal)
    monkeypatch.setattr(_backend, "GLUON", False)
    check(*inputs, causal=causal)
    assert launches == [causal]


@hopper
@pytest.mark.gpu
def test_cuda_graph_replay(launches):
    from conftest import capture

    q, k, v, _ = make_inputs(2, 256, 256, 4, 4, 128, dtype=torch.bfloat16)
    expected = flashtile.flash_attn_func(q, k, v, causal=True)
    graph, out = capture(lambda: flashtile.flash_attn_func(q, k, v, causal=True))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
