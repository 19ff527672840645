"""Bad input raises a clear TypeError/ValueError/NotImplementedError before any kernel launches."""

from __future__ import annotations

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile.interface import varlen_attention
from flashtile.ops import attention as triton_attention
from flashtile.ops.common import grid


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
    "float64": (lambda: qkv(torch.float64), TypeError, "float16 and torch.bfloat16"),
    "int": (lambda: qkv(torch.int32), TypeError, "dtype torch.int32"),
    "mixed-dtype": (lambda: (qkv()[0], *qkv(torch.bfloat16)[1:]), TypeError, "share one dtype"),
    "not-a-tensor": (lambda: (qkv()[0], [1, 2], qkv()[2]), TypeError, "must be a torch.Tensor"),
    "q-not-a-tensor": (lambda: ([1, 2], *qkv()[1:]), TypeError, "q must be a torch.Tensor"),
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
    "headdim-not-mult-8": (  # with headdim_v == headdim it is padded, as flash_attn does (test_flash_attn_api)
        lambda: qkv(q_shape=(1, 16, 4, 60), k_shape=(1, 16, 4, 60), v_shape=(1, 16, 4, 64)),
        ValueError,
        "multiple of 8",
    ),
    "headdim-too-big": (
        lambda: qkv(q_shape=(1, 16, 4, 264), k_shape=(1, 16, 4, 264)),
        ValueError,
        "between 1 and 256 .flash_attn.s limit., got 264",
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
    "dropout_p", [1.0, -0.1, float("nan"), 1.5, True], ids=["one", "negative", "nan", "big", "bool"]
)
def test_bad_dropout(dropout_p):
    """dropout_p must be in [0, 1): checked before the seed is drawn or anything launches."""
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        flashtile.flash_attn_func(*qkv(), dropout_p=dropout_p)
    q, k, v = (t[0] for t in qkv())
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_p must be"):
        varlen_attention(q, k, v, cu, cu, 16, 16, dropout_p=dropout_p)


def fp32(*shape, device=DEVICE):
    return torch.ones(*shape, device=device)


# q has batch 1 and 4 heads (see ``qkv``).
OPTION_CASES = {
    "negative-softcap": ({"softcap": -1.0}, ValueError, "softcap must be a finite number >= 0"),
    "nan-softcap": ({"softcap": float("nan")}, ValueError, "softcap must be a finite number"),
    "inf-softcap": ({"softcap": float("inf")}, ValueError, "softcap must be a finite number"),
    "alibi-shape": ({"alibi_slopes": fp32(3)}, ValueError, r"alibi_slopes must have shape \(nheads,\) = \(4,\)"),
    "alibi-batch-shape": ({"alibi_slopes": fp32(2, 4)}, ValueError, r"\(batch_size, nheads\) = \(1, 4\)"),
    "alibi-3d": ({"alibi_slopes": fp32(1, 4, 1)}, ValueError, "alibi_slopes must have shape"),
    "alibi-dtype": ({"alibi_slopes": fp32(4).half()}, TypeError, "alibi_slopes must be float32, got torch.float16"),
    "alibi-not-tensor": ({"alibi_slopes": [0.5] * 4}, TypeError, "alibi_slopes must be a torch.Tensor"),
    "sink-shape": ({"learnable_sink": fp32(1, 4)}, ValueError, r"learnable_sink must have shape \(nheads,\) = \(4,\)"),
    "sink-kv-heads": ({"learnable_sink": fp32(2)}, ValueError, "one logit per query head"),
    "sink-dtype": ({"learnable_sink": fp32(4).double()}, TypeError, "learnable_sink must be float32"),
}


@pytest.mark.parametrize("case", OPTION_CASES, ids=OPTION_CASES.keys())
def test_bad_options(case):
    kwargs, error, message = OPTION_CASES[case]
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(*qkv(k_shape=(1, 16, 2, 64)), **kwargs)


def test_bad_options_in_packed_functions():
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        flashtile.flash_attn_qkvpacked_func(torch.randn(1, 16, 3, 4, 64, device=DEVICE).half(), learnable_sink=fp32(3))
    with pytest.raises(ValueError, match="softcap"):
        flashtile.flash_attn_kvpacked_func(qkv()[0], torch.randn(1, 16, 2, 4, 64, device=DEVICE).half(), softcap=-2.0)


def test_learnable_sink_is_keyword_only():
    with pytest.raises(TypeError):
        flashtile.flash_attn_func(*qkv(), 0.0, None, False, (-1, -1), 0.0, None, False, False, fp32(4))


def test_option_device_mismatch():
    if DEVICE != "cuda":
        pytest.skip("needs a second device type")
    with pytest.raises(ValueError, match="alibi_slopes must be on the device of q"):
        flashtile.flash_attn_func(*qkv(), alibi_slopes=fp32(4, device="cpu"))
    with pytest.raises(ValueError, match="learnable_sink must be on the device of q"):
        flashtile.flash_attn_func(*qkv(), learnable_sink=fp32(4, device="cpu"))


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
    with pytest.raises(ValueError, match="attn_mask"):  # arbitrary masks work; this one does not broadcast
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p must be"):
        flashtile.scaled_dot_product_attention(q, k, v, dropout_p=1.0, enable_gqa=True)


def test_grid_limits():
    most = grid.MAX_GRID_YZ
    assert grid.head_grid(7, most, most) == (7, most, most)
    with pytest.raises(ValueError, match="at most 65535 batch entries"):
        grid.head_grid(1, grid.MAX_GRID_YZ + 1, 1)
    with pytest.raises(ValueError, match="split the batch"):
        grid.head_grid(1, 1, grid.MAX_GRID_YZ + 1)
