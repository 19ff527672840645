"""scaled_dot_product_attention: torch's layout and semantics (top-left causal), against the oracle."""

from __future__ import annotations

import pytest
import torch

import flashtile
from conftest import DEVICE
from oracle import assert_within_rule, check_against_oracle
from test_attention import make_inputs


@pytest.mark.parametrize("seqlens", [(64, 64), (30, 97), (97, 30)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_matches_oracle(path, is_causal, seqlens):
    seqlen_q, seqlen_k = seqlens
    q, k, v, dout = make_inputs(2, seqlen_q, seqlen_k, 4, 2, 64, dtype=torch.bfloat16)
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    out = flashtile.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=0.2, enable_gqa=True)
    assert out.shape == (2, 4, seqlen_q, 64)
    out.backward(dout.transpose(1, 2))
    top_left = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril() if is_causal else None
    results = {
        "out": out.transpose(1, 2),
        **{n: t.grad.transpose(1, 2) for n, t in zip(("dq", "dk", "dv"), leaves, strict=True)},
    }
    check_against_oracle(
        results, q, k, v, dout, softmax_scale=0.2, mask=None if top_left is None else top_left.to(DEVICE)
    )


@pytest.mark.parametrize("seqlens", [(50, 50), (20, 61), (61, 20)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
def test_sdpa_agrees_with_torch(path, seqlens):
    """torch's own SDPA is the oracle here (its is_causal, not ours): float64 for ref, fp16 for base."""
    q = torch.randn(1, 4, seqlens[0], 32, dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(1, 4, seqlens[1], 32, dtype=torch.float16, device=DEVICE) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    precise = torch.float64 if DEVICE == "cpu" else torch.float32
    ref = sdpa(q.to(precise), k.to(precise), v.to(precise), is_causal=True).half()
    base = sdpa(q, k, v, is_causal=True)
    assert_within_rule("out", flashtile.scaled_dot_product_attention(q, k, v, is_causal=True), ref, base)
