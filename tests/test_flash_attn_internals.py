"""flash_attn 2.8's lower-level entry points under ``flashtile.flash_attn_interface``: ``_flash_attn_forward`` /
``_flash_attn_backward`` and their varlen forms, as ring-attention libraries call them.

The decisive case is ring attention's: keys split into blocks, each block's forward on its own, the outputs merged
by their LSEs, and each block's backward given the *merged* output and LSE; the summed gradients must be those of
attention over all keys (the oracle, by the tolerance rule).
"""

from __future__ import annotations

import pytest
import torch

from flashtile import flash_attn_func
from flashtile.flash_attn_interface import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)
from flashtile.reference import reference_results
from oracle import assert_within_rule, check_against_oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NO_WINDOW = (-1, -1)


def merge(blocks: list[tuple[torch.Tensor, torch.Tensor]], lse_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention's merge of block results (out, lse): lse = logsumexp of the blocks', out = their sum weighted
    by exp(lse_block - lse). lse_dim: where lse's head dimension sits relative to out's rows."""
    lse = torch.logsumexp(torch.stack([b[1] for b in blocks]), 0)
    out = sum(b[0].float() * torch.exp(b[1] - lse).movedim(lse_dim, -1).unsqueeze(-1) for b in blocks)
    return out.to(blocks[0][0].dtype), lse


def inputs(dtype, batch=2, seqlen_q=23, seqlen_k=41, nheads=4, nheads_k=2, head_dim=32):
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, device=DEVICE, dtype=dtype)
    return q, k, v, torch.randn_like(q)


CPU = pytest.mark.parametrize("path", ["cpu"], indirect=True)
"""The CPU path only (conftest's ``path``): the interpreter's cases are few, its tiles slow."""


@pytest.mark.parametrize(
    "path,dtype,softcap",
    [("cpu", torch.float16, 0.0), ("cpu", torch.bfloat16, 5.0), ("triton", torch.bfloat16, 5.0)],
    indirect=["path"],
    ids=["cpu-fp16", "cpu-bf16-softcap", "triton-bf16-softcap"],
)
def test_ring_of_two_blocks(path, dtype, softcap):
    """Causal attention of 23 queries over 41 keys (bottom-right) as ring attention computes it: the 18 keys before
    the queries in one block (no mask), the 23 beside them in another (causal)."""
    q, k, v, dout = inputs(dtype)
    split = k.shape[1] - q.shape[1]
    scale = q.shape[-1] ** -0.5
    blocks = [(slice(0, split), False), (slice(split, None), True)]
    results = [
        _flash_attn_forward(q, k[:, keys], v[:, keys], 0.0, scale, causal, -1, -1, softcap, None, False)
        for keys, causal in blocks
    ]
    for out, lse, s_dmask, rng_state in results:
        assert s_dmask.numel() == 0 and rng_state.shape == (2,) and lse.dtype == torch.float32
        assert not out.requires_grad
    out, lse = merge([r[:2] for r in results], lse_dim=1)
    dq, dk, dv = torch.zeros_like(q), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    dq_block = torch.empty_like(q)
    for (keys, causal), result in zip(blocks, results, strict=True):
        softmax_d = _flash_attn_backward(
            dout, q, k[:, keys], v[:, keys], out, lse, dq_block, dk[:, keys], dv[:, keys], 0.0, scale, causal, -1, -1,
            softcap, None, False, result[3],
        )  # fmt: skip
        dq += dq_block
    assert softmax_d.shape == (2, 4, 128)
    assert torch.allclose(softmax_d[..., : q.shape[1]], (dout.float() * out.float()).sum(-1).transpose(1, 2))
    assert (softmax_d[..., q.shape[1] :] == 0).all()
    results = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    check_against_oracle(results, q, k, v, dout, causal=True, softcap=softcap)


@CPU
def test_one_block_with_its_own_output(path):
    """A single call pair is plain attention: window, ALiBi, and a gradient left out (dk=None)."""
    q, k, v, dout = inputs(torch.float16, seqlen_q=41, seqlen_k=41)
    options = dict(softmax_scale=0.2, window_size=(7, 3))
    slopes = torch.rand(4, device=DEVICE)
    out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, 0.2, False, 7, 3, 0.0, slopes, True)
    dq, dv = torch.empty_like(q), torch.empty_like(v)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, None, dv, 0.0, 0.2, False, 7, 3, 0.0, slopes, True, rng_state)
    check_against_oracle(dict(out=out, lse=lse, dq=dq, dv=dv), q, k, v, dout, alibi_slopes=slopes, **options)


@CPU
def test_dropout_replays_the_forwards_mask(path):
    """With dropout the backward runs with the forward's rng_state: its gradients are those of autograd through
    flash_attn_func under the same seed (torch's generator of q's device seeded with rng_state[0])."""
    q, k, v, dout = inputs(torch.float16, seqlen_q=17, seqlen_k=17)
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, 0.3, 0.25, True, -1, -1, 0.0, None, True)
    assert s_dmask.shape == (2, 4, 17, 17) and (s_dmask < 0).any()
    grads = [torch.empty_like(t) for t in (q, k, v)]
    _flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.3, 0.25, True, -1, -1, 0.0, None, True, rng_state)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(rng_state[0])) if DEVICE == "cpu" else torch.cuda.manual_seed(int(rng_state[0]))
        expected = flash_attn_func(*leaves, 0.3, 0.25, True)
    assert torch.equal(expected, out)
    expected.backward(dout)
    for grad, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(grad, leaf.grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rng_state"):
        _flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.3, 0.25, True, -1, -1, 0.0, None, True, None)


def test_varlen_ring_of_two_blocks(path):
    """The varlen forms on two packed sequences (queries 9 and 14, keys 20 and 31), keys split into a block before
    the queries and a causal block beside them, merged as ring attention does; each sequence against the oracle."""
    dtype = torch.bfloat16
    seqlens_q, seqlens_k = [9, 14], [20, 31]
    q = torch.randn(sum(seqlens_q), 4, 16, device=DEVICE, dtype=dtype)
    k = torch.randn(sum(seqlens_k), 2, 16, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)

    starts_k = [0, seqlens_k[0]]
    before = torch.cat([torch.arange(s, s + n - m) for s, n, m in zip(starts_k, seqlens_k, seqlens_q, strict=True)])
    beside = torch.cat([torch.arange(s + n - m, s + n) for s, n, m in zip(starts_k, seqlens_k, seqlens_q, strict=True)])
    blocks = [
        (before.to(DEVICE), cu([n - m for n, m in zip(seqlens_k, seqlens_q, strict=True)]), False),
        (beside.to(DEVICE), cu(seqlens_q), True),
    ]
    cu_q = cu(seqlens_q)
    results = [
        _flash_attn_varlen_forward(q, k[keys], v[keys], cu_q, cu_k, 14, 17, 0.0, 0.25, causal)
        for keys, cu_k, causal in blocks
    ]
    out, lse = merge([r[:2] for r in results], lse_dim=0)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (keys, cu_k, causal), result in zip(blocks, results, strict=True):
        grads = [torch.empty_like(t) for t in (q, k[keys], v[keys])]
        softmax_d = _flash_attn_varlen_backward(
            dout, q, k[keys], v[keys], out, lse, *grads, cu_q, cu_k, 14, 17, 0.0, 0.25, causal, -1, -1, 0.0, None,
            False, result[3],
        )  # fmt: skip
        dq += grads[0]
        dk[keys] += grads[1]
        dv[keys] += grads[2]
    assert softmax_d.shape == (4, sum(seqlens_q) + 2 * 128)
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1)
    assert torch.allclose(softmax_d[:, 128 + 9 : 128 + 23], delta[:, 9:]) and (softmax_d[:, 9 : 128 + 9] == 0).all()
    for b in range(2):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(starts_k[b], starts_k[b] + seqlens_k[b])
        args = (q[None, rows_q], k[None, rows_k], v[None, rows_k], dout[None, rows_q])
        ref = reference_results(*args, torch.float64, softmax_scale=0.25, causal=True)
        base = reference_results(*args, dtype, softmax_scale=0.25, causal=True)
        got = dict(out=out[None, rows_q], lse=lse[None, :, rows_q], dq=dq[None, rows_q], dk=dk[None, rows_k],
                   dv=dv[None, rows_k])  # fmt: skip
        for name, x in got.items():
            assert_within_rule(name, x, ref[name], base[name])


def test_unsupported_arguments_are_refused():
    q = torch.randn(5, 2, 16, device=DEVICE, dtype=torch.float16)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="seqused_k"):
        _flash_attn_varlen_forward(q, q, q, cu, cu, 5, 5, 0.0, 0.25, False, seqused_k=cu[1:])
