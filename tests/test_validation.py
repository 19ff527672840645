"""Bad input raises a clear TypeError/ValueError/NotImplementedError before any kernel launches."""

from __future__ import annotations

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile.ops import attention as triton_attention


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any kernel launch fails the test: errors must come first."""

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched for invalid input")

    monkeypatch.setattr(triton_attention, "attention_forward", launched)
    monkeypatch.setattr("flashtile.cpu.attention_forward", launched)


def qkv(dtype=torch.float16, q_shape=(1, 16, 4, 64), k_shape=(1, 16, 4, 64), v_shape=None):
    v_shape = k_shape if v_shape is None else v_shape
    return (
        torch.randn(q_shape, device=DEVICE).to(dtype),
        torch.randn(k_shape, device=DEVICE).to(dtype),
        torch.randn(v_shape, device=DEVICE).to(dtype),
    )


CASES = {
    "float32": (lambda: qkv(torch.float32), TypeError, "float16 and torch.bfloat16"),
    "int": (lambda: qkv(torch.int32), TypeError, "dtype torch.int32"),
    "mixed-dtype": (lambda: (qkv()[0], *qkv(torch.bfloat16)[1:]), TypeError, "share one dtype"),
    "not-a-tensor": (lambda: (qkv()[0], [1, 2], qkv()[2]), TypeError, "must be a torch.Tensor"),
    "rank-3": (lambda: qkv(q_shape=(16, 4, 64)), ValueError, "4 dimensions"),
    "batch-mismatch": (lambda: qkv(k_shape=(2, 16, 4, 64)), ValueError, "batch size"),
    "k-v-seqlen": (lambda: qkv(v_shape=(1, 15, 4, 64)), ValueError, "seqlen_k"),
    "k-v-heads": (lambda: qkv(v_shape=(1, 16, 2, 64)), ValueError, "nheads_k"),
    "q-k-headdim": (lambda: qkv(k_shape=(1, 16, 4, 32)), ValueError, "headdim"),
    "heads-not-divisible": (
        lambda: qkv(k_shape=(1, 16, 3, 64), v_shape=(1, 16, 3, 64)),
        ValueError,
        "divisible",
    ),
    "headdim-not-mult-8": (
        lambda: qkv(q_shape=(1, 16, 4, 60), k_shape=(1, 16, 4, 60)),
        ValueError,
        "multiple of 8",
    ),
    "headdim-too-big": (
        lambda: qkv(q_shape=(1, 16, 4, 264), k_shape=(1, 16, 4, 264)),
        ValueError,
        "at most 256|between 8 and 256",
    ),
    "headdim-v-not-mult-8": (lambda: qkv(v_shape=(1, 16, 4, 12)), ValueError, "headdim_v"),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_bad_inputs(case):
    make, error, message = CASES[case]
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(*make())


def test_device_mismatch():
    if DEVICE != "cuda":
        pytest.skip("needs a second device type")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        flashtile.flash_attn_func(q, k.cpu(), v)


@pytest.mark.parametrize(
    "kwargs, feature",
    [
        ({"dropout_p": 0.1}, "dropout"),
        ({"softcap": 30.0}, "softcap"),
        ({"alibi_slopes": torch.ones(4)}, "ALiBi"),
    ],
    ids=["dropout", "softcap", "alibi"],
)
def test_unimplemented_options_raise(kwargs, feature):
    with pytest.raises(NotImplementedError, match=feature):
        flashtile.flash_attn_func(*qkv(), **kwargs)


def test_bad_packed_shapes():
    with pytest.raises(ValueError, match="qkv must be"):
        flashtile.flash_attn_qkvpacked_func(torch.randn(1, 16, 2, 4, 64, device=DEVICE).half())
    with pytest.raises(ValueError, match="kv must be"):
        flashtile.flash_attn_kvpacked_func(*qkv()[:1], torch.randn(1, 16, 3, 4, 64, device=DEVICE).half())


def test_bad_window():
    with pytest.raises(TypeError, match="window_size"):
        flashtile.flash_attn_func(*qkv(), window_size=(1,))


def test_sdpa_errors():
    q, k, v = (t.transpose(1, 2) for t in qkv(k_shape=(1, 16, 2, 64)))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashtile.scaled_dot_product_attention(q, k, v)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout"):
        flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True)
