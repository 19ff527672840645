"""Attention dropout (``dropout_p``) on every reachable path: reproducibility, statistics, and forward and
backward against the oracle with the SAME mask.

The mask is never exposed by the API, so the tests read it with a crafted input: with v the one-hot
rows of the keys (v[j] = e_j, headdim_v = seqlen_k padded to a multiple of 8), out[i, j] = P_ij Z_ij /
(1 - p), so Z = (out != 0) wherever P_ij > 0. The mask depends only on the seed drawn from torch's
generator and on (batch, head, query row, key column), not on q, k, v or the head dims, so a second call
after the same ``torch.manual_seed`` with the real v uses the same mask. q is scaled down for the
extraction call so that no visible probability underflows to 0. The oracle then applies that mask
(``attention_reference(dropout_mask=...)``) and the tolerance rule (``reference.within_tolerance``) holds as always.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile import cpu
from flashtile.reference import attention_probs, visibility_mask
from oracle import assert_within_rule, check_against_oracle
from test_attention import make_inputs
from test_variants import sinks_like, slopes_like

P = 0.3


def one_hot_values(batch, seqlen_k, nheads_k, dtype):
    """v (batch, seqlen_k, nheads_k, Dv) with v[:, j, :, j] = 1, Dv = seqlen_k rounded up to a multiple of 8."""
    width = max(8, -(-seqlen_k // 8) * 8)
    v = torch.zeros(batch, seqlen_k, nheads_k, width, dtype=dtype, device=DEVICE)
    j = torch.arange(seqlen_k)
    v[:, j, :, j] = 1.0
    return v


def extract_mask(seed, q, k, dropout_p=P, **kwargs):
    """The keep mask (batch, nheads, seqlen_q, seqlen_k) that flash_attn_func uses after
    torch.manual_seed(seed) for these shapes (True where kept; arbitrary where P = 0)."""
    seqlen_k = k.shape[1]
    torch.manual_seed(seed)
    out = flashtile.flash_attn_func(q * 0.01, k, one_hot_values(k.shape[0], seqlen_k, k.shape[2], q.dtype),
                                    dropout_p=dropout_p, **kwargs)  # fmt: skip
    return (out[..., :seqlen_k] != 0).permute(0, 2, 1, 3)


def run_dropout(seed, q, k, v, dout, learnable_sink=None, **kwargs):
    """torch.manual_seed(seed), then forward with return_attn_probs and backward of (out * dout).sum()."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink = None if learnable_sink is None else learnable_sink.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out, lse, probs = flashtile.flash_attn_func(*leaves, return_attn_probs=True, learnable_sink=sink, **kwargs)
    assert (probs is None) == (kwargs.get("dropout_p", 0.0) == 0.0)  # flash_attn's S_dmask, with dropout only
    out.backward(dout)
    results = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if sink is not None:
        results["dsink"] = sink.grad
    return results


CASES = {
    "fp16-causal-GQA4-2-Sq70-Sk45": ((1, 70, 45, 4, 2, 32), torch.float16, {"causal": True}),
    "bf16-full-Sq33-Sk64-B2": ((2, 33, 64, 2, 2, 32), torch.bfloat16, {}),
    "fp16-causal-MQA3-1-Sq17-Sk113": ((1, 17, 113, 3, 1, 32), torch.float16, {"causal": True}),
    "bf16-window-Dv16": ((1, 50, 70, 2, 1, 32, 16), torch.bfloat16, {"window_size": (10, 5)}),
    "fp16-all-options": ((2, 40, 57, 4, 2, 32), torch.float16, {"causal": True, "softcap": 5.0, "sink": True}),
}


def case_inputs(case, seed):
    """q, k, v, dout of a CASES entry and its flash_attn_func options ("sink": ALiBi slopes and a sink)."""
    shape, dtype, options = case
    options = dict(options)
    if options.pop("sink", False):
        options["alibi_slopes"] = slopes_like((shape[3],))
        options["learnable_sink"] = sinks_like(shape[3])
    return (*make_inputs(*shape, dtype=dtype, seed=seed), options)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_against_oracle_with_the_same_mask(path, case):
    shape = case[0]
    q, k, v, dout, options = case_inputs(case, seed=3)
    mask_options = {key: options[key] for key in ("causal", "window_size") if key in options}
    mask = extract_mask(11, q, k, **mask_options)
    visible = visibility_mask(shape[1], shape[2], **mask_options).to(DEVICE)
    dropped = 1.0 - mask[:, :, visible].float().mean().item()
    assert abs(dropped - P) < 0.05, f"dropped fraction {dropped:.3f} of the visible entries, expected {P}"
    results = run_dropout(11, q, k, v, dout, dropout_p=P, **options)
    check_against_oracle(results, q, k, v, dout, dropout_p=P, dropout_mask=mask, **options)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_attn_probs_carry_the_dropout_pattern(path, case):
    """return_attn_probs with dropout gives flash_attn's S_dmask (batch, nheads, seqlen_q, seqlen_k): the
    probabilities (the oracle's, within the tolerance rule) with the forward's own mask as their sign, negative
    where dropped (flash_attn_func's docstring); the mask read back from S_dmask >= 0 reproduces out and the
    gradients through the oracle, as flash_attn's tests use it."""
    shape, dtype, _ = case
    q, k, v, dout, options = case_inputs(case, seed=5)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(13)
    out, lse, s_dmask = flashtile.flash_attn_func(*leaves, dropout_p=P, return_attn_probs=True, **options)
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    assert s_dmask.shape == (batch, nheads, seqlen_q, seqlen_k) and s_dmask.dtype == dtype
    mask_options = {key: options[key] for key in ("causal", "window_size") if key in options}
    probs = s_dmask.abs()
    shown = probs > 0
    assert torch.equal((s_dmask >= 0)[shown], extract_mask(13, q, k, **mask_options)[shown])
    oracle_options = {key: options[key] for key in ("softcap", "alibi_slopes", "learnable_sink") if key in options}
    ref, _ = attention_probs(q.double(), k.double(), causal=options.get("causal", False),
                             window_size=options.get("window_size", (-1, -1)), **oracle_options)  # fmt: skip
    base, _ = attention_probs(q, k, causal=options.get("causal", False),
                              window_size=options.get("window_size", (-1, -1)), **oracle_options)  # fmt: skip
    assert_within_rule("out", probs, ref.to(dtype), base.to(dtype))
    out.backward(dout)
    results = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    check_against_oracle(results, q, k, v, dout, dropout_p=P, dropout_mask=s_dmask >= 0, **options)


def test_same_seed_same_results_other_seed_different(path, monkeypatch):
    # the CPU path's tiled route for the call without dropout too (it would take torch's kernel), so that the
    # LSEs with and without dropout come from the same arithmetic and must match bit for bit
    monkeypatch.setattr(cpu, "TORCH_KERNEL", False)
    q, k, v, dout = make_inputs(2, 45, 60, 4, 2, 32, seed=4)
    first = run_dropout(5, q, k, v, dout, dropout_p=P, causal=True)
    again = run_dropout(5, q, k, v, dout, dropout_p=P, causal=True)
    other = run_dropout(6, q, k, v, dout, dropout_p=P, causal=True)
    plain = run_dropout(5, q, k, v, dout, causal=True)
    for name in first:
        assert torch.equal(first[name], again[name]), name
    assert torch.equal(first["lse"], plain["lse"]), "dropout must leave the LSE unchanged"
    for name in ("out", "dq", "dk", "dv"):
        assert not torch.equal(first[name], other[name]), name
        assert not torch.equal(first[name], plain[name]), name


def test_consecutive_calls_differ(path):
    q, k, v, _ = make_inputs(1, 30, 30, 2, 2, 32)
    torch.manual_seed(0)
    first = flashtile.flash_attn_func(q, k, v, dropout_p=P)
    second = flashtile.flash_attn_func(q, k, v, dropout_p=P)
    assert not torch.equal(first, second)


def test_zero_dropout_is_no_dropout(path):
    q, k, v, dout = make_inputs(1, 40, 50, 4, 2, 32, dtype=torch.bfloat16)
    plain = run_dropout(1, q, k, v, dout, causal=True)
    zero = run_dropout(1, q, k, v, dout, dropout_p=0.0, causal=True)
    for name in plain:
        assert torch.equal(plain[name], zero[name]), name


def test_dropped_fraction_and_independence(path):
    """The fraction dropped is p within 5 standard deviations (sqrt(p (1 - p) / n) for n entries), and masks
    of different heads, batch entries and rows are independent: two masks agree on a fraction p^2 + (1 -
    p)^2 of entries (within 5 sigma), not on all of them as they would if counters repeated."""
    batch, seqlen, nheads = 2, 64, 4
    q, k, _, _ = make_inputs(batch, seqlen, seqlen, nheads, nheads, 32)
    for p in (0.1, 0.5):
        mask = extract_mask(7, q, k, dropout_p=p)  # (B, H, Sq, Sk), every entry visible
        n = mask.numel()
        dropped = 1.0 - mask.float().mean().item()
        assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n), f"p={p}: dropped {dropped:.4f}"
        agree = p * p + (1 - p) ** 2
        for a, b in ((mask[:, 0], mask[:, 1]), (mask[0], mask[1]), (mask[:, :, :-1], mask[:, :, 1:])):
            same = (a == b).float().mean().item()
            sigma = math.sqrt(agree * (1 - agree) / a.numel())
            assert abs(same - agree) < 5 * sigma, f"p={p}: masks agree on {same:.4f}, expected {agree:.4f}"


def test_unbiased_on_average(path):
    """E[out] = the output without dropout. Replicating one (q, k, v) over the batch gives independent
    masks per entry (the counters include the batch entry); over N = 4 calls x 48 entries the mean's
    error at each element has standard deviation sigma / sqrt(N), with the exact per-sample variance
    sigma^2 = p / (1 - p) * sum_j P_ij^2 v_jd^2 (independent Bernoulli keeps) from the float64 oracle's P.
    Pass when every z-score is below 5.5 (192 elements) and their mean square is within [0.6, 1.5]
    (its standard deviation is about 0.1), which also checks the 1 / (1 - p) scaling and the variance."""
    q, k, v, _ = make_inputs(1, 16, 24, 2, 1, 32, seed=8)
    copies, calls = 48, 4
    torch.manual_seed(123)
    outs = [
        flashtile.flash_attn_func(*(t.expand(copies, *t.shape[1:]) for t in (q, k, v)), dropout_p=P, causal=True)
        for _ in range(calls)
    ]
    mean = torch.cat(outs).double().mean(dim=0)
    plain = flashtile.flash_attn_func(q, k, v, causal=True)[0].double()
    scores = torch.einsum("qhd,khd->hqk", q[0].double(), k[0].double().expand(-1, 2, -1)) / math.sqrt(32)
    scores = scores.masked_fill(~visibility_mask(16, 24, causal=True).to(DEVICE), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (H, Sq, Sk)
    var = P / (1 - P) * torch.einsum("hqk,kd->qhd", probs**2, v[0, :, 0].double() ** 2)
    z = (mean - plain) / (var / (copies * calls)).sqrt()
    assert z.abs().max() < 5.5, f"max |z| = {z.abs().max():.2f}"
    assert 0.6 < (z**2).mean() < 1.5, f"mean z^2 = {(z**2).mean():.3f}"


def test_packed_variants(path):
    """The packed functions reach the same op: same seed, same result as flash_attn_func."""
    qkv = torch.randn(1, 40, 3, 2, 32, dtype=torch.float16, device=DEVICE)
    torch.manual_seed(2)
    packed = flashtile.flash_attn_qkvpacked_func(qkv, dropout_p=P, causal=True)
    torch.manual_seed(2)
    plain = flashtile.flash_attn_func(*qkv.unbind(2), dropout_p=P, causal=True)
    assert torch.equal(packed, plain)
    torch.manual_seed(2)
    kvpacked = flashtile.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], dropout_p=P, causal=True)
    assert torch.equal(kvpacked, plain)


def test_varlen_against_oracle_with_the_same_mask(path):
    """Packed sequences (lengths 0 included) with causal GQA: the mask is read with one-hot values over the
    packed keys, and the oracle runs on the whole packed batch with a block-diagonal visibility mask.
    Through the public flash_attn_varlen_func."""
    seqlens_q, seqlens_k = [5, 0, 40, 17], [30, 12, 9, 50]
    nheads, nheads_k, dim = 4, 2, 32
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    cu_q = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(seqlens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v, dout = (x[0] for x in make_inputs(1, total_q, total_k, nheads, nheads_k, dim, seed=9))
    blocks = torch.zeros(total_q, total_k, dtype=torch.bool, device=DEVICE)
    for b in range(len(seqlens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        blocks[q0:q1, k0:k1] = visibility_mask(q1 - q0, k1 - k0, causal=True).to(DEVICE)

    def varlen(q, k, v):  # causal: window (None, 0)
        return flashtile.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), dropout_p=P, causal=True, return_attn_probs=True
        )

    torch.manual_seed(21)
    onehot = varlen(q * 0.01, k, one_hot_values(1, total_k, nheads_k, q.dtype)[0])[0]
    mask = (onehot[..., :total_k] != 0).permute(1, 0, 2)[None]  # (1, H, total_q, total_k)
    dropped = 1.0 - mask[:, :, blocks].float().mean().item()
    assert abs(dropped - P) < 0.05, f"dropped fraction {dropped:.3f}"
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(21)
    out, lse, s_dmask = varlen(*leaves)
    # S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k): each sequence's probabilities, negative where dropped
    assert s_dmask.shape == (len(seqlens_q), nheads, max(seqlens_q), max(seqlens_k))
    for b in range(len(seqlens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        block = s_dmask[b, :, : q1 - q0, : k1 - k0]
        assert torch.equal((block != 0), blocks[None, q0:q1, k0:k1].expand_as(block))
        assert torch.equal((block > 0)[block != 0], mask[0, :, q0:q1, k0:k1][block != 0])
        assert not s_dmask[b, :, q1 - q0 :].any() and not s_dmask[b, :, :, k1 - k0 :].any()
    out.backward(dout)
    results = {
        "out": out[None],
        "lse": lse[None],
        **{f"d{n}": t.grad[None] for n, t in zip("qkv", leaves, strict=True)},
    }
    check_against_oracle(results, q[None], k[None], v[None], dout[None], mask=blocks, dropout_p=P, dropout_mask=mask)


def test_sdpa_dropout(path):
    """SDPA's dropout_p is flash_attn_func's, in torch's layout (same seed, same result)."""
    q, k, v, _ = make_inputs(1, 30, 30, 2, 2, 32)
    torch.manual_seed(4)
    sdpa = flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=P)
    torch.manual_seed(4)
    plain = flashtile.flash_attn_func(q, k, v, dropout_p=P)
    assert torch.equal(sdpa.transpose(1, 2), plain)
    keep = torch.ones(1, 1, 1, 30, dtype=torch.bool, device=DEVICE)
    keep[..., 20:] = False
    masked = flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=keep,
                                                    dropout_p=P)  # fmt: skip
    assert torch.isfinite(masked).all()


def test_opcheck_with_dropout(path):
    q, k, v, _ = make_inputs(1, 20, 33, 4, 2, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rng = torch.tensor([12345, 678], dtype=torch.int64, device=DEVICE)
    args = (q, k, v, 0.2, None, 0, None, 0.0, None, P, rng)
    torch.library.opcheck(torch.ops.flashtile.attention_forward.default, args)


def test_compile_fullgraph_with_dropout(path):
    """The draw of the seed is traced as a graph op (no graph break, no int guard); with aot_eager it uses
    the same generator as eager, so results are bitwise equal for one seed."""
    q, k, v, dout = make_inputs(1, 30, 40, 2, 1, 32, dtype=torch.bfloat16)

    def attention_block(q, k, v):
        return flashtile.flash_attn_func(q, k, v, dropout_p=P, causal=True).float().square()

    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (attention_block, compiled, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(9)
        out = fn(*leaves)
        out.backward(dout.float())
        results.append([out, *(t.grad for t in leaves)])
    for eager, traced, again in zip(*results, strict=True):
        assert torch.equal(eager, traced)
        assert torch.equal(eager, again)
