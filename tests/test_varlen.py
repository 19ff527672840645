"""flash_attn_varlen_func and its packed variants against the oracle, sequence by sequence.

Each case runs through the public API on every reachable path (fixture ``path``). The oracle
(``flashtile.reference``) runs on each sequence alone (a batch of one); its results are gathered back
into the packed layouts (out/dq rows, lse columns of (nheads, total_q), dk/dv rows, zeros for keys of a
sequence without queries, the sink's gradient summed over sequences) and the tolerance rule
(``flashtile.reference.within_tolerance``) is applied to the whole packed tensors. Outputs start as NaN
(conftest), so a row no program writes fails.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile.reference import reference_results
from oracle import assert_within_rule
from test_variants import sinks_like, slopes_like

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def make_varlen(seqlens_q, seqlens_k, nheads, nheads_k, head_dim, dtype=torch.float16, seed=0):
    """Fresh random packed q, k, v, dout and the cu_seqlens of the given lengths."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    q, k, v = randn(total_q, nheads, head_dim), randn(total_k, nheads_k, head_dim), randn(total_k, nheads_k, head_dim)
    return q, k, v, randn(total_q, nheads, head_dim), cu_seqlens(seqlens_q), cu_seqlens(seqlens_k)


def run_varlen(q, k, v, dout, cu_q, cu_k, dlse=None, learnable_sink=None, **kwargs):
    """flash_attn_varlen_func forward (return_attn_probs) and backward of (out * dout).sum() (+ lse * dlse);
    with dropout also its S_dmask ("s_dmask")."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink = None if learnable_sink is None else learnable_sink.detach().clone().requires_grad_()
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    out, lse, probs = flashtile.flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max_q, max_k, return_attn_probs=True, learnable_sink=sink, **kwargs
    )
    assert (probs is None) == (kwargs.get("dropout_p", 0.0) == 0.0)  # flash_attn's S_dmask, with dropout only
    torch.autograd.backward([out, lse] if dlse is not None else [out], [dout, dlse] if dlse is not None else [dout])
    results = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if probs is not None:
        results["s_dmask"] = probs
    if sink is not None:
        results["dsink"] = sink.grad
    return results


def varlen_oracle(q, k, v, dout, cu_q, cu_k, dtype, dlse=None, alibi_slopes=None, learnable_sink=None, **options):
    """The oracle in ``dtype`` on each sequence, gathered into the packed layouts of flash_attn_varlen_func."""
    nheads = q.shape[1]
    ref = {
        "out": torch.zeros(q.shape[0], nheads, v.shape[2], dtype=q.dtype, device=DEVICE),
        "lse": torch.zeros(nheads, q.shape[0], device=DEVICE),
        "dq": torch.zeros_like(q),
        "dk": torch.zeros_like(k),
        "dv": torch.zeros_like(v),
    }
    if learnable_sink is not None:
        ref["dsink"] = torch.zeros_like(learnable_sink)
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                                             cu_k[1:].tolist(), strict=True)):  # fmt: skip
        if q1 == q0:
            continue  # no queries: zero gradients at its keys
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b : b + 1]
        seq = reference_results(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], dtype,
            None if dlse is None else dlse[None, :, q0:q1], alibi_slopes=slopes, learnable_sink=learnable_sink,
            **options,
        )  # fmt: skip
        ref["out"][q0:q1], ref["lse"][:, q0:q1], ref["dq"][q0:q1] = seq["out"][0], seq["lse"][0], seq["dq"][0]
        ref["dk"][k0:k1], ref["dv"][k0:k1] = seq["dk"][0], seq["dv"][0]
        if learnable_sink is not None:
            ref["dsink"] += seq["dsink"]
    return ref


def check_varlen(results, q, k, v, dout, cu_q, cu_k, **options):
    """The tolerance rule on every packed result, against the oracle run sequence by sequence."""
    precise = torch.float64 if DEVICE == "cpu" or q.dtype == torch.float32 else torch.float32
    ref = varlen_oracle(q, k, v, dout, cu_q, cu_k, precise, **options)
    base = varlen_oracle(q, k, v, dout, cu_q, cu_k, q.dtype, **options)
    for name, x in results.items():
        assert_within_rule(name, x, ref[name], base[name])


def check(seqlens_q, seqlens_k, nheads=2, nheads_k=2, head_dim=32, dtype=torch.float16, dlse=False, **options):
    q, k, v, dout, cu_q, cu_k = make_varlen(seqlens_q, seqlens_k, nheads, nheads_k, head_dim, dtype)
    grad_lse = torch.randn(nheads, q.shape[0], device=DEVICE) if dlse else None
    results = run_varlen(q, k, v, dout, cu_q, cu_k, dlse=grad_lse, **options)
    oracle_options = {key: val for key, val in options.items() if key != "deterministic"}
    check_varlen(results, q, k, v, dout, cu_q, cu_k, dlse=grad_lse, **oracle_options)
    return results


# Lengths 0 and 1, 1 next to 200, seqlen_q != seqlen_k per sequence both ways, a sequence with no keys.
SEQLENS = {
    "uneven": ([1, 200, 0, 33, 7], [1, 200, 5, 33, 0]),
    "q<k": ([17, 3, 64], [113, 40, 65]),
    "q>k": ([113, 40, 1], [17, 3, 1]),
}


@pytest.mark.parametrize("seqlens", SEQLENS.values(), ids=SEQLENS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_seqlens(path, dtype, causal, seqlens):
    results = check(*seqlens, dtype=dtype, causal=causal)
    assert results["lse"].shape == (2, sum(seqlens[0]))


@pytest.mark.parametrize("window", [(7, 23), (16, 0), (-1, 5)], ids=lambda w: f"W{w[0]}_{w[1]}")
def test_window_gqa(path, window):
    check([50, 1, 90], [70, 4, 60], nheads=4, nheads_k=2, window_size=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_alibi_sink(path, causal):
    """All options together, per-sequence (batch, nheads) slopes, GQA, and a gradient at the LSE."""
    check(
        [30, 0, 1, 70], [45, 3, 1, 50], nheads=4, nheads_k=2, dtype=torch.bfloat16, dlse=True, causal=causal,
        softcap=5.0, alibi_slopes=slopes_like((4, 4)), learnable_sink=sinks_like(4),
    )  # fmt: skip


def test_head_alibi_and_sink_window(path):
    check([40, 9], [25, 60], nheads=3, nheads_k=1, window_size=(10, 4), alibi_slopes=slopes_like((3,)),
          learnable_sink=sinks_like(3))  # fmt: skip


def test_head_dim_v_and_scale(path):
    q, k, v, dout, cu_q, cu_k = make_varlen([20, 37], [50, 8], 2, 2, 64)
    v = v[..., :32]
    dout = dout[..., :32]
    results = run_varlen(q, k, v, dout, cu_q, cu_k, softmax_scale=0.3, causal=True)
    check_varlen(results, q, k, v, dout, cu_q, cu_k, softmax_scale=0.3, causal=True)


def test_only_empty_sequences(path):
    """Every sequence without queries: empty output; every key gets a zero gradient."""
    q, k, v, dout, cu_q, cu_k = make_varlen([0, 0], [5, 70], 2, 2, 32)
    results = run_varlen(q, k, v, dout, cu_q, cu_k, causal=True)
    assert results["out"].shape == (0, 2, 32) and results["lse"].shape == (2, 0)
    assert torch.all(results["dk"] == 0) and torch.all(results["dv"] == 0)


def test_matches_padded_batch(path):
    """Equal lengths: varlen gives what flash_attn_func gives on the (batch, seqlen) view (bitwise on the
    CPU path, which runs the same function per sequence; within rounding on the kernels)."""
    q, k, v, dout, cu_q, cu_k = make_varlen([40, 40], [40, 40], 2, 2, 32)
    varlen = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, causal=True)
    padded = flashtile.flash_attn_func(*(t.view(2, 40, 2, 32) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(varlen.view(2, 40, 2, 32), padded, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked(path, causal):
    """Strided q, k, v (slices of one (total, 3, H, D) tensor), gradients back into qkv."""
    lengths = [33, 1, 0, 70]
    qkv = torch.randn(sum(lengths), 3, 2, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    cu = cu_seqlens(lengths)
    out, lse, _ = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 70, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = qkv.grad.unbind(1)
    q, k, v = qkv.detach().unbind(1)
    assert not q.is_contiguous()
    results = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    check_varlen(results, q, k, v, dout, cu, cu, causal=causal)


def test_kvpacked(path):
    q = torch.randn(60, 4, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    kv = torch.randn(81, 2, 2, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    cu_q, cu_k = cu_seqlens([10, 50]), cu_seqlens([71, 10])
    sink = sinks_like(4).requires_grad_()
    out = flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 50, 71, causal=True, learnable_sink=sink)
    dout = torch.randn_like(out)
    out.backward(dout)
    dk, dv = kv.grad.unbind(1)
    k, v = kv.detach().unbind(1)
    results = {"out": out, "dq": q.grad, "dk": dk, "dv": dv, "dsink": sink.grad}
    check_varlen(results, q.detach(), k, v, dout, cu_q, cu_k, causal=True, learnable_sink=sink)


def test_larger_max_seqlen_is_fine(path):
    """max_seqlen may exceed the longest sequence (extra tiles exit at once)."""
    q, k, v, dout, cu_q, cu_k = make_varlen([9, 20], [31, 2], 2, 1, 32)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True)
    ref = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 31, causal=True)
    assert torch.equal(out, ref)


def test_opcheck(path):
    q, k, v, _, cu_q, cu_k = make_varlen([5, 0, 30], [20, 3, 30], 4, 2, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    args = (q, k, v, cu_q, cu_k, 30, 30, 0.2, None, 0, slopes_like((3, 4)), 5.0, sinks_like(4).requires_grad_())
    torch.library.opcheck(torch.ops.flashtile.varlen_attention_forward.default, args)


def test_compile_fullgraph(path):
    q, k, v, dout, cu_q, cu_k = make_varlen([17, 1, 40], [30, 2, 40], 2, 2, 32, dtype=torch.bfloat16)

    def attention_block(q, k, v, sink):
        out = flashtile.flash_attn_varlen_func(q * 1.5, k, v, cu_q, cu_k, 40, 40, causal=True, softcap=5.0,
                                               learnable_sink=sink)  # fmt: skip
        return out.float().square()

    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (attention_block, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks_like(2))]
        out = fn(*leaves)
        out.backward(dout.float())
        results.append([out, *(t.grad for t in leaves)])
    for eager, traced in zip(*results, strict=True):
        assert torch.equal(eager, traced)


@pytest.mark.parametrize("seqlens", [(30, 45), (45, 30)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_sdpa_key_padding_mask(path, seqlens):
    """A (batch, 1, 1, seqlen_k) boolean key padding mask: against the oracle with that mask per entry."""
    seqlen_q, seqlen_k = seqlens
    batch, nheads, nheads_k = 3, 4, 2
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (
        torch.randn(batch, h, s, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
        for h, s in ((nheads, seqlen_q), (nheads_k, seqlen_k), (nheads_k, seqlen_k), (nheads, seqlen_q))
    )
    keep = torch.rand(batch, seqlen_k, generator=gen) < 0.6
    keep[0] = True  # nothing padded
    keep[1, 5:] = False  # right padding
    keep[2, : seqlen_k // 2] = False  # left padding
    if seqlen_q < seqlen_k:
        keep[2] = False  # no key at all: output 0 (torch gives NaN), zero gradients
    keep = keep.to(DEVICE)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashtile.scaled_dot_product_attention(*leaves, attn_mask=keep[:, None, None, :], scale=0.2, enable_gqa=True)
    assert out.shape == (batch, nheads, seqlen_q, 32)
    out.backward(dout)
    precise = torch.float64 if DEVICE == "cpu" else torch.float32
    for b in range(batch):
        mask = keep[b][None, :].expand(seqlen_q, seqlen_k)
        args = [t[b : b + 1].transpose(1, 2) for t in (q, k, v, dout)]
        ref = reference_results(*args, precise, softmax_scale=0.2, mask=mask)
        base = reference_results(*args, q.dtype, softmax_scale=0.2, mask=mask)
        got = {"out": out[b : b + 1], **{n: t.grad[b : b + 1] for n, t in zip(("dq", "dk", "dv"), leaves, strict=True)}}
        for name, x in got.items():
            assert_within_rule(name, x.transpose(1, 2), ref[name], base[name])


def test_sdpa_bad_masks_refused():
    """Masks of any broadcastable shape work (tests/test_sdpa.py); others, and is_causal with one, raise."""
    q = torch.randn(2, 2, 8, 32, dtype=torch.float16, device=DEVICE)
    for mask in (torch.ones(3, 1, 8, 8, dtype=torch.bool), torch.zeros(2, 1, 1, 7), torch.ones(1, 2, 2, 8, 8)):
        with pytest.raises(ValueError, match="broadcast"):
            flashtile.scaled_dot_product_attention(q, q, q, attn_mask=mask.to(DEVICE))
    with pytest.raises(ValueError, match="is_causal"):
        flashtile.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.ones(2, 1, 1, 8, dtype=torch.bool, device=DEVICE), is_causal=True
        )


# Bad input: a clear error before anything launches.


@pytest.fixture
def no_launch(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched for invalid input")

    from flashtile import cpu
    from flashtile.ops import attention as triton_attention

    for module in (cpu, triton_attention):
        monkeypatch.setattr(module, "varlen_attention_forward", launched)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


BAD_CU_SEQLENS = {
    "int64": (lambda: torch.tensor([0, 5, 12], device=DEVICE), {}, TypeError, "int32"),
    "2-D": (lambda: _int32([[0, 5, 12]]), {}, ValueError, "1-D"),
    "not-a-tensor": (lambda: [0, 5, 12], {}, TypeError, "torch.Tensor"),
    "first-not-0": (lambda: _int32([1, 5, 12]), {}, ValueError, r"cu_seqlens_q\[0\] must be 0"),
    "decreasing": (lambda: _int32([0, 7, 5, 12]), {"cu_k": _int32([0, 4, 8, 12])}, ValueError, "non-decreasing"),
    "last-not-total": (lambda: _int32([0, 5, 11]), {}, ValueError, "number of tokens"),
    "max-too-small": (lambda: _int32([0, 5, 12]), {"max_q": 6}, ValueError, "max_seqlen_q = 6 is smaller"),
    "batch-mismatch": (lambda: _int32([0, 5, 12]), {"cu_k": _int32([0, 12])}, ValueError, "same batch_size"),
    "max-not-int": (lambda: _int32([0, 5, 12]), {"max_q": torch.tensor(7)}, TypeError, "Python int"),
}


@pytest.mark.parametrize("case", BAD_CU_SEQLENS.values(), ids=BAD_CU_SEQLENS.keys())
def test_bad_cu_seqlens(no_launch, case):
    make_cu, overrides, error, match = case
    q, k, v, *_ = make_varlen([5, 7], [6, 6], 2, 2, 32)
    cu_q, cu_k = make_cu(), overrides.get("cu_k", _int32([0, 6, 12]))
    with pytest.raises(error, match=match):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, overrides.get("max_q", 7), 6)


def test_bad_key_cu_seqlens_and_options(no_launch):
    q, k, v, _, cu_q, cu_k = make_varlen([5, 7], [6, 6], 2, 2, 32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] must equal the number of tokens of k and v \(12\)"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, _int32([0, 6, 13]), 7, 7)
    with pytest.raises(ValueError, match="max_seqlen_k = 5"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 5)
    with pytest.raises(ValueError, match="3 dimensions"):
        flashtile.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 7, 6)
    with pytest.raises(ValueError, match=r"\(nheads,\) = \(2,\) or \(batch_size, nheads\) = \(2, 2\)"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, alibi_slopes=slopes_like((3, 2)))
    with pytest.raises(ValueError, match="total_k"):
        flashtile.flash_attn_varlen_func(q, k, v[:11], cu_q, cu_k, 7, 6)
    with pytest.raises(ValueError, match="qkv must be"):
        flashtile.flash_attn_varlen_qkvpacked_func(q, cu_q, 7)
    with pytest.raises(ValueError, match="kv must be"):
        flashtile.flash_attn_varlen_kvpacked_func(q, k, cu_q, cu_k, 7, 6)
