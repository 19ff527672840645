"""softcap, ALiBi and learnable sinks against the oracle, forward and backward, on every reachable path.

Each case runs through the public ``flash_attn_func`` (fixture ``path``: the Triton kernels in the
interpreter and ``flashtile.cpu`` on a CPU-only machine, the GPU otherwise) and is checked with the
tolerance rule (``reference.within_tolerance``); the sink's gradient is one more result ("dsink"), whose ``base``
is the oracle run with q, k, v (and the sink) in the low dtype.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile.reference import visibility_mask
from oracle import check_against_oracle
from test_attention import make_inputs


def slopes_like(shape, seed=1):
    """ALiBi-like slopes in [0.05, 0.55): fp32, positive, never all equal."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=gen) * 0.5 + 0.05).to(DEVICE)


def sinks_like(nheads, seed=2):
    """Sink logits of either sign and about the size of a row's log-sum-exp, so the sink matters."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(nheads, generator=gen) * 2.0 + 1.0).to(DEVICE)


def run_variant(q, k, v, dout, learnable_sink=None, dlse=None, **kwargs):
    """Forward with return_attn_probs and backward of (out * dout).sum() (+ (lse * dlse).sum());
    returns out, lse, dq, dk, dv and, with a sink, dsink."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink = None if learnable_sink is None else learnable_sink.detach().clone().requires_grad_()
    out, lse, _ = flashtile.flash_attn_func(*leaves, return_attn_probs=True, learnable_sink=sink, **kwargs)
    if dlse is None:
        out.backward(dout)
    else:
        torch.autograd.backward([out, lse], [dout, dlse])
    results = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if sink is not None:
        results["dsink"] = sink.grad
    return results


def check(q, k, v, dout, dlse=None, **kwargs):
    results = run_variant(q, k, v, dout, dlse=dlse, **kwargs)
    check_against_oracle(results, q, k, v, dout, dlse, **kwargs)
    return results


@pytest.mark.parametrize(
    "softcap, scale", [(30.0, None), (5.0, None), (5.0, 1.0)], ids=["cap30", "cap5", "cap5-scale1"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap(path, causal, softcap, scale):
    """scale 1.0 with D=32 puts most scores deep in tanh's flat part, where the gradient shrinks."""
    dtype = torch.bfloat16 if causal else torch.float16
    check(*make_inputs(1, 77, 91, 2, 2, 32, dtype=dtype), softcap=softcap, softmax_scale=scale, causal=causal)


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-H", "slopes-BH"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi(path, causal, per_batch):
    batch, nheads = 2, 2
    dtype = torch.bfloat16 if per_batch else torch.float16
    slopes = slopes_like((batch, nheads) if per_batch else (nheads,))
    check(*make_inputs(batch, 70, 100, nheads, 1, 32, dtype=dtype), alibi_slopes=slopes, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_learnable_sink(path, dtype, causal):
    check(*make_inputs(2, 65, 80, 4, 2, 32, dtype=dtype), learnable_sink=sinks_like(4), causal=causal)


def all_options(nheads, batch=None):
    slopes = slopes_like((nheads,) if batch is None else (batch, nheads))
    return {"softcap": 5.0, "alibi_slopes": slopes, "learnable_sink": sinks_like(nheads)}


@pytest.mark.parametrize("heads", [(6, 2), (3, 1)], ids=["GQA6-2", "MQA3-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_heads_with_all(path, causal, heads):
    check(*make_inputs(2, 45, 70, *heads, 32, dtype=torch.float16), causal=causal, **all_options(heads[0], batch=2))


@pytest.mark.parametrize("seqlens", [(113, 17), (17, 113), (1, 1)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqlens_with_all(path, causal, seqlens):
    check(*make_inputs(1, *seqlens, 2, 1, 32, dtype=torch.bfloat16), causal=causal, **all_options(2))


@pytest.mark.parametrize("window", [(7, 23), (16, 0), (40, -1)], ids=lambda w: f"W{w[0]}_{w[1]}")
def test_window_with_all(path, window):
    check(*make_inputs(1, 100, 120, 2, 2, 32, dtype=torch.float16), window_size=window, **all_options(2))


@pytest.mark.parametrize(
    "options",
    [
        {"softcap": 30.0, "learnable_sink": "sink"},
        {"softcap": 5.0, "alibi_slopes": "H"},
        {"alibi_slopes": "BH", "learnable_sink": "sink"},
    ],
    ids=["cap-sink", "cap-alibi", "alibi-sink"],
)
def test_pairs(path, options):
    nheads, batch = 4, 2
    made = {"sink": sinks_like(nheads), "H": slopes_like((nheads,)), "BH": slopes_like((batch, nheads))}
    options = {name: made.get(value, value) for name, value in options.items()}
    check(*make_inputs(batch, 50, 64, nheads, 2, 32, dtype=torch.float16), causal=True, **options)


@pytest.mark.parametrize("head_dims", [(40, 64), (64, 32)], ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_head_dims_with_all(path, head_dims):
    check(*make_inputs(1, 60, 75, 2, 2, *head_dims, dtype=torch.bfloat16), causal=True, **all_options(2))


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_rows_that_see_no_key(path, sink):
    """Causal with seqlen_q > seqlen_k: the first 70 rows see no key. Without a sink: out 0, lse -inf;
    with one: out 0, lse = the sink. Gradients finite (dq exactly 0 on those rows)."""
    q, k, v, dout = make_inputs(2, 100, 30, 2, 2, 64, dtype=torch.float16)
    options = {"softcap": 5.0, "alibi_slopes": slopes_like((2,))}
    if sink:
        options["learnable_sink"] = sinks_like(2)
    results = check(q, k, v, dout, causal=True, **options)
    blind = (~visibility_mask(100, 30, causal=True).any(dim=1)).to(DEVICE)
    assert blind.sum() == 70
    assert torch.all(results["out"][:, blind] == 0)
    lse = results["lse"][:, :, blind]
    if sink:
        torch.testing.assert_close(lse, options["learnable_sink"][None, :, None].expand_as(lse))
    else:
        assert torch.all(lse == float("-inf"))
    assert torch.all(results["dq"][:, blind] == 0)
    assert all(torch.isfinite(x).all() for name, x in results.items() if name != "lse")


def test_gradient_through_lse_with_all(path):
    """A gradient at softmax_lse reaches q, k and the sink (d lse_i / d sink = exp(sink - lse_i))."""
    q, k, v, dout = make_inputs(1, 37, 53, 4, 2, 32)
    dlse = torch.randn(1, 4, 37, device=DEVICE)
    check(q, k, v, dout, dlse=dlse, causal=True, **all_options(4))


def test_sink_gradient_from_lse_alone(path):
    """A loss of lse only: d(sum_i lse_i dlse_i)/d sink = sum_i exp(sink - lse_i) dlse_i (1 on a row that
    sees no key, where lse = sink)."""
    q, k, v, _ = make_inputs(1, 40, 8, 2, 2, 32)
    sink = sinks_like(2).requires_grad_()
    _, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink)
    dlse = torch.randn(1, 2, 40, device=DEVICE)
    (lse * dlse).sum().backward()
    expected = (torch.exp(sink.detach()[None, :, None] - lse.detach()) * dlse).sum(dim=(0, 2))
    torch.testing.assert_close(sink.grad, expected)


def test_minus_infinite_sink_is_no_sink(path):
    """A sink of -inf takes no share of any row: the same results as no sink, and a zero gradient."""
    q, k, v, dout = make_inputs(1, 50, 40, 2, 2, 32)
    plain = run_variant(q, k, v, dout, causal=True, softcap=5.0)
    sunk = run_variant(q, k, v, dout, learnable_sink=torch.full((2,), float("-inf"), device=DEVICE), causal=True,
                       softcap=5.0)  # fmt: skip
    for name, x in plain.items():
        torch.testing.assert_close(sunk[name], x, msg=name)  # compiled variants may round apart
    assert torch.all(sunk["dsink"] == 0)


def test_sink_without_grad_and_alibi_never_gets_one(path):
    """A sink that does not require grad is a constant; ALiBi slopes never get a gradient."""
    q, k, v, dout = make_inputs(1, 30, 30, 2, 2, 32)
    q.requires_grad_()
    slopes = slopes_like((2,)).requires_grad_()
    sink = sinks_like(2)
    out = flashtile.flash_attn_func(q, k, v, alibi_slopes=slopes, learnable_sink=sink)
    out.backward(dout)
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert slopes.grad is None and sink.grad is None


def test_packed_with_sink_and_softcap(path):
    qkv = torch.randn(2, 40, 3, 2, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    sink = sinks_like(2).requires_grad_()
    out, lse, _ = flashtile.flash_attn_qkvpacked_func(
        qkv, causal=True, softcap=5.0, alibi_slopes=slopes_like((2,)), return_attn_probs=True, learnable_sink=sink
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = qkv.grad.unbind(2)
    q, k, v = qkv.detach().unbind(2)
    results = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dsink": sink.grad}
    check_against_oracle(
        results, q, k, v, dout, causal=True, softcap=5.0, alibi_slopes=slopes_like((2,)), learnable_sink=sink
    )


def test_kvpacked_with_sink(path):
    q = torch.randn(1, 30, 4, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    kv = torch.randn(1, 45, 2, 2, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    sink = sinks_like(4).requires_grad_()
    out = flashtile.flash_attn_kvpacked_func(q, kv, learnable_sink=sink, alibi_slopes=slopes_like((1, 4)))
    dout = torch.randn_like(out)
    out.backward(dout)
    dk, dv = kv.grad.unbind(2)
    k, v = kv.detach().unbind(2)
    results = {"out": out, "dq": q.grad, "dk": dk, "dv": dv, "dsink": sink.grad}
    check_against_oracle(results, q.detach(), k, v, dout, learnable_sink=sink, alibi_slopes=slopes_like((1, 4)))


def test_opcheck_with_options(path):
    q, k, v, dout = make_inputs(1, 33, 40, 4, 2, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink = sinks_like(4).requires_grad_()
    args = (q, k, v, 0.2, None, 0, slopes_like((1, 4)), 5.0, sink)
    torch.library.opcheck(torch.ops.flashtile.attention_forward.default, args)
    out, lse = torch.ops.flashtile.attention_forward(*args)
    torch.library.opcheck(
        torch.ops.flashtile.attention_sink_backward.default, (dout, out.detach(), lse.detach(), None, sink.detach())
    )


def test_compile_fullgraph_with_options(path):
    q, k, v, dout = make_inputs(1, 45, 45, 2, 2, 32, dtype=torch.bfloat16)
    slopes = slopes_like((2,))

    def attention_block(q, k, v, sink):
        out = flashtile.flash_attn_func(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes, learnable_sink=sink)
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
