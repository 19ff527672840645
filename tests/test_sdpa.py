"""scaled_dot_product_attention: torch's layout and semantics (top-left causal), against the oracle."""

from __future__ import annotations

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile import cpu
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


# --- attn_mask: boolean and additive, broadcast shapes, read tile by tile by the kernels -------------------------

B, H, HK, D = 2, 4, 2, 32  # GQA: two query heads per key/value head


def _mask(kind: str, shape: tuple[int, ...], seed: int, hide_rows: bool = False) -> torch.Tensor:
    """A random boolean (about 70% True) or additive (bf16, N(0, 1)) mask; hide_rows hides every key from
    query rows 0 and 5 (False, or -inf) where the shape has a query dimension."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "bool":
        mask = torch.rand(shape, generator=gen) > 0.3
        if hide_rows:
            mask[..., [0, 5], :] = False
    else:
        mask = torch.randn(shape, generator=gen).to(torch.bfloat16)
        if hide_rows:
            mask[..., [0, 5], :] = float("-inf")
    return mask.to(DEVICE)


def _run_masked(q, k, v, dout, mask, scale=0.3):
    """flashtile's SDPA on flash-layout inputs; results named as the oracle's (dbias for a float mask)."""
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    if mask.is_floating_point():
        mask = mask.detach().requires_grad_()
    out = flashtile.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    results = {
        "out": out.transpose(1, 2),
        **{n: t.grad.transpose(1, 2) for n, t in zip(("dq", "dk", "dv"), leaves, strict=True)},
    }
    if mask.is_floating_point():
        results["dbias"] = mask.grad
    return results


def _oracle_options(mask: torch.Tensor) -> dict:
    if mask.dtype == torch.bool:
        return {"mask": mask}
    return {"bias": mask.detach().requires_grad_()}


MASK_SHAPES = {
    "SqSk": lambda sq, sk: (sq, sk),
    "B1SqSk": lambda sq, sk: (B, 1, sq, sk),
    "1H1Sk": lambda sq, sk: (1, H, 1, sk),
    "BHSqSk": lambda sq, sk: (B, H, sq, sk),
}


@pytest.mark.parametrize("seqlens", [(33, 70), (70, 17)], ids=lambda s: f"Sq{s[0]}-Sk{s[1]}")
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_attn_mask_matches_oracle(path, kind, shape, seqlens):
    """Forward and backward (and the additive mask's gradient, summed over its broadcast dimensions)."""
    seqlen_q, seqlen_k = seqlens
    q, k, v, dout = make_inputs(B, seqlen_q, seqlen_k, H, HK, D, dtype=torch.bfloat16, seed=7)
    mask = _mask(kind, MASK_SHAPES[shape](seqlen_q, seqlen_k), seed=len(shape) + seqlen_q)
    results = _run_masked(q, k, v, dout, mask)
    if kind == "additive":
        assert results["dbias"].shape == mask.shape and results["dbias"].dtype == mask.dtype
    check_against_oracle(results, q, k, v, dout, softmax_scale=0.3, **_oracle_options(mask))


@pytest.mark.parametrize("shape", ["SqSk", "BHSqSk"])
def test_sdpa_attn_mask_fully_masked_rows(path, shape, monkeypatch):
    """A query row that sees no key returns 0 with zero gradients (torch returns NaN), for a boolean mask and
    for an additive one of -inf, and the other rows are as the oracle's. Both masks take the same arithmetic (on
    the CPU path the tiled route: a mask that wants its gradient takes it; tests/test_cpu_fused.py covers torch's
    kernel with such rows), so their results must match bit for bit."""
    monkeypatch.setattr(cpu, "TORCH_KERNEL", False)
    seqlen_q, seqlen_k = 29, 45
    q, k, v, dout = make_inputs(B, seqlen_q, seqlen_k, H, HK, D, dtype=torch.bfloat16, seed=3)
    hidden = _mask("bool", MASK_SHAPES[shape](seqlen_q, seqlen_k), seed=11, hide_rows=True)
    results = _run_masked(q, k, v, dout, hidden)
    assert (results["out"][:, [0, 5]] == 0).all()
    assert (results["dq"][:, [0, 5]] == 0).all()
    check_against_oracle(results, q, k, v, dout, softmax_scale=0.3, mask=hidden)
    # the same visibility as an additive mask: 0 where visible, -inf where hidden
    additive = torch.zeros(hidden.shape, dtype=torch.bfloat16, device=DEVICE).masked_fill(~hidden, float("-inf"))
    from_bias = _run_masked(q, k, v, dout, additive)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(from_bias[name], results[name]), name
    assert torch.isfinite(from_bias["dbias"]).all()
    assert (from_bias["dbias"][..., [0, 5], :] == 0).all()


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_attn_mask_agrees_with_torch(path, kind):
    """torch's own SDPA with the same mask is the oracle: float64 for ref, fp16 for base."""
    seqlen_q, seqlen_k = 21, 50
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, seqlen_q, 32, generator=gen).to(torch.float16).to(DEVICE)
    k, v = (torch.randn(2, 4, seqlen_k, 32, generator=gen).to(torch.float16).to(DEVICE) for _ in range(2))
    mask = _mask("bool" if kind == "bool" else "additive", (2, 1, seqlen_q, seqlen_k), seed=9)
    mask = mask if kind == "bool" else mask.half()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    precise = torch.float64 if DEVICE == "cpu" else torch.float32
    precise_mask = mask if kind == "bool" else mask.to(precise)
    ref = sdpa(q.to(precise), k.to(precise), v.to(precise), attn_mask=precise_mask).half()
    base = sdpa(q, k, v, attn_mask=mask)
    assert_within_rule("out", flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask), ref, base)


def test_sdpa_attn_mask_errors():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16, device=DEVICE)
    mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="is_causal"):
        flashtile.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    with pytest.raises(ValueError, match="broadcast"):
        flashtile.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(TypeError, match="boolean"):
        flashtile.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.int32, device=DEVICE))
