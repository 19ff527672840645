"""The CPU path's two routes (``flashtile.cpu``) against the oracle, each forced in turn, for float32, bfloat16
and float16.

``torch_kernel_route`` sends a call to torch's fused kernel (whole or one block of query rows at a time under
a window) or down the tiled path. Fixture ``route`` runs each case twice through the public API: with torch's
kernel allowed ("torch") and with it switched off (``cpu.TORCH_KERNEL = False``: "tiled"), counting the kernel's
forward and backward calls so that a test can assert which route ran. Odd lengths, seqlen_q != seqlen_k both
ways, GQA, flash_attn's bottom-right causal and SDPA's top-left one, windows, sinks, masks, the LSE's gradient,
varlen, pages and the kvcache decode.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import flashtile
import test_kvcache as kvcache_cases
import test_varlen as varlen_cases
import test_varlen_paged as paged_cases
from conftest import DEVICE
from flashtile import _backend, cpu
from flashtile._backend import Verdict
from flashtile.options import AttentionOptions
from oracle import check_against_oracle
from test_attention import make_inputs, run_flashtile
from test_variants import sinks_like, slopes_like

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda", reason="the helpers draw inputs on the GPU, which the CPU path never sees"
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(params=["torch", "tiled", "tiled-bf16-products"])
def route(request, monkeypatch):
    """The CPU path by the public API, with torch's fused kernel allowed ("torch") or not ("tiled"; with
    ``cpu.BF16_PRODUCTS``: "tiled-bf16-products", for the bf16 cases only); ``calls`` counts the kernel's forward
    and backward calls."""
    if request.param == "tiled-bf16-products" and request.node.callspec.params.get("dtype") != torch.bfloat16:
        pytest.skip("cpu.BF16_PRODUCTS changes only bf16 calls (the cases with a bf16 dtype parameter)")
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    monkeypatch.setattr(cpu, "TORCH_KERNEL", request.param == "torch")
    monkeypatch.setattr(cpu, "BF16_PRODUCTS", request.param == "tiled-bf16-products")
    calls = {"forward": 0, "backward": 0}

    def counted(name, op):
        def call(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)

        return call

    monkeypatch.setattr(cpu, "_FLASH", counted("forward", cpu._FLASH))
    monkeypatch.setattr(cpu, "_FLASH_BACKWARD", counted("backward", cpu._FLASH_BACKWARD))
    return SimpleNamespace(name=request.param, calls=calls)


def assert_route(route, forward: bool, backward: bool) -> None:
    """With torch's kernel allowed, it ran the forward / backward exactly when expected; switched off, never."""
    ran = {"forward": route.calls["forward"] > 0, "backward": route.calls["backward"] > 0}
    expected = {"forward": forward, "backward": backward} if route.name == "torch" else dict.fromkeys(ran, False)
    assert ran == expected, f"torch's kernel ran for {ran}, expected {expected}"


def check(route, q, k, v, dout, torch_forward=True, torch_backward=True, dlse=None, **options):
    results = run_flashtile(q, k, v, dout, dlse=dlse, **options)
    check_against_oracle(results, q, k, v, dout, dlse=dlse, **options)
    assert_route(route, torch_forward, torch_backward)
    return results


SEQLENS = [(1, 1), (17, 113), (113, 17), (128, 128), (300, 1030), (1030, 300)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_flash_attn_func(route, dtype, causal, seqlens):
    """flash_attn's causal is bottom-right aligned: with seqlen_q != seqlen_k torch's kernel runs block by block."""
    if dtype == torch.float32 and seqlens == (1, 1):
        pytest.skip(ONE_KEY)
    check(route, *make_inputs(2, *seqlens, 6, 2, 64, dtype=dtype), causal=causal)


@pytest.mark.parametrize("seqlens", [(77, 200), (200, 77), (130, 130)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_sdpa_top_left_causal(route, dtype, seqlens):
    """SDPA's is_causal (query i sees keys j <= i) is torch's kernel's own causal, for any lengths."""
    q, k, v, dout = make_inputs(1, *seqlens, 4, 2, 40, dtype=dtype)
    leaves = [t.transpose(1, 2).detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtile.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    results = {"out": out.transpose(1, 2)}
    results |= {name: t.grad.transpose(1, 2) for name, t in zip(("dq", "dk", "dv"), leaves, strict=True)}
    top_left = torch.ones(seqlens, dtype=torch.bool).tril()
    check_against_oracle(results, q, k, v, dout, mask=top_left)
    assert_route(route, forward=True, backward=True)


ONE_KEY = (
    "every row sees one key, so the true dq is 0, and flash attention's Delta = rowsum(dO * O) (for dP - Delta) "
    "leaves float32 rounding of |dP| (~1e-6) that the rule's floor (2 ulps of 1.0 where ref is all 0) does not cover"
)
WINDOWS = {"W5_3": (5, 3), "W40_-1": (40, -1), "W-1_7": (-1, 7), "W0_0": (0, 0)}


@pytest.mark.parametrize("seqlens", [(300, 333), (333, 300)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_window(route, dtype, window, seqlens):
    if dtype == torch.float32 and window == (0, 0):
        pytest.skip(ONE_KEY)
    check(route, *make_inputs(1, *seqlens, 4, 2, 32, dtype=dtype), window_size=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_sink(route, dtype, causal):
    """A sink is joined to either route's results afterwards; rows that see no key get LSE = sink."""
    check(route, *make_inputs(2, 150, 90, 4, 4, 64, dtype=dtype), causal=causal, learnable_sink=sinks_like(4))


LSE_CASES = {  # (seqlen_q, seqlen_k, options): torch's kernel in one call, and block by block
    "causal": (140, 140, {"causal": True}),
    "window": (300, 333, {"window_size": (40, 7)}),
    "causal-q>k": (333, 300, {"causal": True}),
}


@pytest.mark.parametrize("case", LSE_CASES.values(), ids=LSE_CASES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_lse_gradient(route, dtype, case):
    """torch's backward takes the gradient at the LSE through its Delta (two more value columns)."""
    seqlen_q, seqlen_k, options = case
    q, k, v, dout = make_inputs(1, seqlen_q, seqlen_k, 4, 2, 64, dtype=dtype)
    dlse = torch.randn(1, 4, seqlen_q)
    check(route, q, k, v, dout, dlse=dlse, **options)


ALIBI_CASES = {  # (batch, seqlen_q, seqlen_k, options)
    "full": (1, 170, 150, {}),
    "causal-batch-slopes": (2, 170, 300, {"causal": True}),
    "window": (1, 300, 333, {"window_size": (40, 7)}),
}


@pytest.mark.parametrize("case", ALIBI_CASES.values(), ids=ALIBI_CASES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_alibi(route, dtype, case):
    """ALiBi runs torch's kernel block by block, the bias (float32) and the band as each block's mask."""
    batch, seqlen_q, seqlen_k, options = case
    slopes = slopes_like((batch, 4) if batch > 1 else (4,))
    check(route, *make_inputs(batch, seqlen_q, seqlen_k, 4, 2, 64, dtype=dtype), alibi_slopes=slopes, **options)


@pytest.mark.parametrize("rows", [20, 10])
def test_alibi_mask_size(route, monkeypatch, rows):
    """ALiBi's block masks stay within ALIBI_MASK_SIZE values: blocks of fewer rows (20 here), or the tiled path
    where fewer than 16 rows fit."""
    monkeypatch.setattr(cpu, "ALIBI_MASK_SIZE", rows * 4 * 150)  # nheads 4, seqlen_k 150
    check(route, *make_inputs(1, 170, 150, 4, 2, 64, dtype=torch.bfloat16), torch_forward=rows >= 16,
          torch_backward=rows >= 16, alibi_slopes=slopes_like((4,)), causal=True)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_softcap(route, dtype):
    """softcap is the tiled path's."""
    check(route, *make_inputs(1, 170, 150, 4, 2, 64, dtype=dtype), torch_forward=False, torch_backward=False,
          causal=True, softcap=3.0)  # fmt: skip


def test_head_dim_v(route):
    """torch's kernel wants headdim_v == headdim: other value widths are tiled."""
    check(route, *make_inputs(1, 70, 90, 2, 2, 64, head_dim_v=32, dtype=torch.float32), torch_forward=False,
          torch_backward=False)  # fmt: skip


def sdpa_masked(q, k, v, dout, mask):
    """flashtile's SDPA with attn_mask, in and out of flash_attn's layout; the mask's gradient if it wants one."""
    leaves = [t.transpose(1, 2).detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtile.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=0.3, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    results = {"out": out.transpose(1, 2)}
    results |= {name: t.grad.transpose(1, 2) for name, t in zip(("dq", "dk", "dv"), leaves, strict=True)}
    if mask.requires_grad:
        results["dbias"] = mask.grad
    return results


MASKS = {
    "bool": (torch.bool, False, True),  # mask dtype, requires grad, torch's backward runs
    "same-dtype": (None, False, True),
    "fp32-on-bf16": (torch.float32, False, False),  # a float mask of another dtype: tiled, both passes
    "wants-grad": (None, True, False),  # torch's backward gives no mask gradient
}


@pytest.mark.parametrize("kind", MASKS, ids=MASKS.keys())
def test_sdpa_mask(route, kind):
    dtype = torch.bfloat16
    mask_dtype, wants_grad, torch_backward = MASKS[kind]
    mask_dtype = mask_dtype or dtype
    q, k, v, dout = make_inputs(2, 65, 130, 4, 2, 32, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    visible = torch.rand(2, 1, 65, 130, generator=gen) > 0.3
    visible[:, :, 7] = False  # a row that sees no key: out 0, zero gradients
    if mask_dtype == torch.bool:
        mask = visible
    else:
        mask = (torch.randn(visible.shape, generator=gen) * 2).masked_fill(~visible, float("-inf")).to(mask_dtype)
        mask.requires_grad_(wants_grad)
    results = sdpa_masked(q, k, v, dout, mask)
    assert (results["out"][:, 7] == 0).all() and (results["dq"][:, 7] == 0).all()
    bias = None if mask.dtype == torch.bool else mask.detach().requires_grad_(wants_grad)
    check_against_oracle(results, q, k, v, dout, softmax_scale=0.3, mask=visible, bias=bias)
    assert_route(route, forward=kind != "fp32-on-bf16", backward=torch_backward)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fully_masked_rows_lse(route, dtype):
    """A row that the mask hides entirely has LSE -inf on both routes (torch's kernel itself writes 0)."""
    q, k, v, _ = make_inputs(1, 20, 30, 2, 2, 32, dtype=dtype)
    visible = torch.ones(20, 30, dtype=torch.bool)
    visible[[0, 13]] = False
    out, lse = cpu.attention_forward(q, k, v, AttentionOptions(0.2, attn_mask=visible.expand(1, 2, 20, 30)))
    assert torch.isneginf(lse[:, :, [0, 13]]).all() and torch.isfinite(lse[:, :, 1]).all()
    assert (out[:, [0, 13]] == 0).all()
    assert_route(route, forward=True, backward=False)


EMPTY = {"seqlen_k0": (2, 5, 0), "seqlen_q0": (2, 0, 5), "batch0": (0, 5, 5)}


@pytest.mark.parametrize("shape", EMPTY.values(), ids=EMPTY.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_empty_inputs(route, dtype, shape):
    """Empty inputs never reach torch's kernel (it divides by zero on them): out and gradients are empty or 0,
    and a query without keys gets LSE -inf."""
    batch, seqlen_q, seqlen_k = shape
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, 4, 2, 16, dtype=dtype)
    for window in ((None, None), (None, 0)):
        options = AttentionOptions(0.25, *window)
        out, lse = cpu.attention_forward(q, k, v, options)
        assert out.shape == dout.shape and lse.shape == (batch, 4, seqlen_q)
        assert (out == 0).all() and torch.isneginf(lse).all()
        dq, dk, dv = cpu.attention_backward(dout, q, k, v, out, lse, options)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert all((g == 0).all() for g in (dq, dk, dv))
    assert_route(route, forward=False, backward=False)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_varlen(route, dtype):
    """Sequences of a packed batch go one at a time, each by the rule (one without keys is tiled)."""
    varlen_cases.check([1, 200, 0, 33, 7], [1, 200, 5, 33, 0], 4, 2, 32, dtype=dtype, causal=True)
    assert_route(route, forward=True, backward=True)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_varlen_paged(route, dtype):
    x = paged_cases.make_paged([1, 40, 0, 60, 7], [1, 150, 5, 33, 0], 32, dtype=dtype)
    paged_cases.check_paged(paged_cases.run_paged(x, window_size=(20, 4)), x, window_size=(20, 4))
    assert_route(route, forward=True, backward=True)


KVCACHE = {
    "decode": dict(seqlen_q=1, seqlen_new=1),
    "prefill-gqa": dict(seqlen_q=9, seqlen_new=9, nheads=6, nheads_k=2),
    "paged-window": dict(seqlen_q=3, seqlen_new=2, page_size=16, seqlen_cache=96, window_size=(20, 0)),
    "rotary-leftpad": dict(seqlen_q=2, seqlen_new=2, rotary_dim=32, leftpad=True),
    "softcap-alibi": dict(seqlen_q=4, seqlen_new=1, softcap=2.0, alibi="batch"),
}


@pytest.mark.parametrize("options", KVCACHE.values(), ids=KVCACHE.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_kvcache(route, dtype, options):
    """flash_attn_with_kvcache on the CPU attends through flashtile.cpu: caches of any supported dtype."""
    kvcache_cases.check(kvcache_cases.Case(dtype=dtype, **options))
    assert_route(route, forward="softcap" not in options, backward=False)


RULE = {  # (seqlen_q, seqlen_k, window_left, window_right, options) -> route
    "full": ((64, 80, None, None, {}), "full"),
    "wide-window": ((64, 80, 79, 63, {}), "full"),
    "causal-square": ((64, 64, None, 0, {}), "causal"),
    "sdpa-causal": ((64, 80, None, -16, {}), "causal"),
    "causal-q<k": ((64, 80, None, 0, {}), "band"),
    "causal-q>k": ((80, 64, None, 0, {}), "band"),
    "window": ((64, 64, 8, 0, {}), "band"),
    "left-short": ((64, 80, 78, None, {}), "band"),
    "softcap": ((64, 64, None, None, {"softcap": 1.0}), None),
    "alibi": ((64, 64, None, None, {"alibi_slopes": torch.ones(4)}), "band"),
    "alibi-mask": (
        (64, 64, None, None, {"alibi_slopes": torch.ones(4), "attn_mask": torch.ones(1, 1, 64, 64) > 0}),
        None,
    ),
    "dropout": ((64, 64, None, None, {"dropout_p": 0.1}), None),
    "dlse": ((64, 64, None, None, {"dlse": torch.zeros(1, 4, 64)}), "full"),
    "dmask": ((64, 64, None, None, {"dmask": torch.zeros(1, 4, 64, 64)}), None),
    "bool-mask": ((64, 64, None, None, {"attn_mask": torch.ones(1, 1, 64, 64, dtype=torch.bool)}), "full"),
    "fp32-mask": ((64, 64, None, None, {"attn_mask": torch.zeros(1, 1, 64, 64)}), None),
    "mask-window": ((64, 64, 3, 0, {"attn_mask": torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)}), None),
    "empty-k": ((64, 0, None, None, {}), None),
}


@pytest.mark.parametrize("case", RULE.values(), ids=RULE.keys())
def test_route_rule(case):
    (seqlen_q, seqlen_k, left, right, options), expected = case
    q = torch.zeros(1, seqlen_q, 4, 32, dtype=torch.bfloat16)
    k = torch.zeros(1, seqlen_k, 2, 32, dtype=torch.bfloat16)
    gradients = {name: options.pop(name) for name in ("dlse", "dmask") if name in options}
    route, verdict = cpu.torch_kernel_route(q, k, k, AttentionOptions(1.0, left, right, **options), **gradients)
    assert route == expected
    assert bool(verdict.reasons) == (route is None)  # a reason for every refusal


def test_route_rule_switch(monkeypatch):
    q = torch.zeros(1, 8, 2, 32)
    assert cpu.torch_kernel_route(q, q, q, AttentionOptions(1.0))[0] == "full"
    monkeypatch.setattr(cpu, "TORCH_KERNEL", False)
    refused = (None, Verdict(("switched off (cpu.TORCH_KERNEL)",)))
    assert cpu.torch_kernel_route(q, q, q, AttentionOptions(1.0)) == refused
