"""``flashtile.layers.rotary``: flash_attn 2.8's rotary embedding (``apply_rotary_emb``, the in-place qkv / kv
forms, ``RotaryEmbedding``) against an oracle that rotates complex numbers in float64."""

from __future__ import annotations

import pytest
import torch

from flashtile.layers.rotary import RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tables(positions: int, rotary_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(
        torch.arange(positions, dtype=torch.float64), base ** -(torch.arange(0, rotary_dim, 2) / rotary_dim)
    )
    return torch.cos(angles).float().to(DEVICE), torch.sin(angles).float().to(DEVICE)


def oracle(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool):
    """x (..., tokens, nheads, headdim) with positions (..., tokens): each pair of rotated dimensions as a complex
    number times exp(i angle) (cos + i sin at the position; 1 past the tables), in float64, cast to x's dtype."""
    half = cos.shape[1]
    rot = x[..., : 2 * half].double()
    pairs = rot.unflatten(-1, (half, 2)) if interleaved else rot.unflatten(-1, (2, half)).transpose(-1, -2)
    inside = (positions < cos.shape[0])[..., None]
    rows = positions.clamp(max=cos.shape[0] - 1)
    turn = torch.complex(torch.where(inside, cos[rows].double(), 1.0), torch.where(inside, sin[rows].double(), 0.0))
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn[..., None, :])
    turned = turned.flatten(-2) if interleaved else turned.transpose(-1, -2).flatten(-2)
    return torch.cat([turned.to(x.dtype), x[..., 2 * half :]], -1)


def assert_rounded_once(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 math rounded once to the dtype: within one ulp of the float64 result rounded to it."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=2 * torch.finfo(got.dtype).eps * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_apply_rotary_emb(dtype, interleaved, offsets):
    x = torch.randn(3, 13, 4, 40, device=DEVICE, dtype=dtype)
    cos, sin = tables(20, 24)  # rotary_dim 24 of 40: the rest passes through
    seqlen_offsets = {"zero": 0, "int": 5, "tensor": torch.tensor([0, 4, 11], device=DEVICE)}[offsets]
    start = torch.as_tensor(seqlen_offsets, device=DEVICE).expand(3)
    positions = start[:, None] + torch.arange(13, device=DEVICE)  # up to 23: row 2 runs past the 20 rows
    expected = oracle(x, cos, sin, positions, interleaved)
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=seqlen_offsets)
    assert_rounded_once(out, expected)
    assert torch.equal(out[..., 24:], x[..., 24:])
    same = x.clone()
    assert apply_rotary_emb(same, cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets) is same
    assert torch.equal(same, out)


def test_varlen_positions_restart_per_sequence():
    lengths = [5, 1, 9]
    x = torch.randn(sum(lengths), 2, 16, device=DEVICE)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32, device=DEVICE)
    offsets = torch.tensor([3, 0, 7], device=DEVICE)
    cos, sin = tables(20, 16)
    positions = torch.cat([torch.arange(n) + int(o) for n, o in zip(lengths, offsets, strict=True)]).to(DEVICE)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=9)
    assert_rounded_once(out, oracle(x, cos, sin, positions, False))


def test_gradient_is_the_inverse_rotation():
    x = torch.randn(2, 5, 2, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    cos, sin = (t.double() for t in tables(8, 8))
    torch.autograd.gradcheck(lambda x: apply_rotary_emb(x, cos, sin, seqlen_offsets=2), (x,))


def test_qkv_and_kv_in_place():
    cos, sin = tables(16, 8)
    qkv = torch.randn(2, 7, 3, 4, 8, device=DEVICE)
    before = qkv.clone()
    assert apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=1) is qkv
    for part in (0, 1):
        assert torch.equal(qkv[:, :, part], apply_rotary_emb(before[:, :, part], cos, sin, seqlen_offsets=1))
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])
    gqa = torch.randn(2, 7, 4 + 2 * 1, 8, device=DEVICE)  # 4 query heads, 1 key and 1 value head
    before = gqa.clone()
    apply_rotary_emb_qkv_(gqa, cos, sin, num_heads_q=4)
    assert torch.equal(gqa[:, :, :5], apply_rotary_emb(before[:, :, :5], cos, sin))
    assert torch.equal(gqa[:, :, 5:], before[:, :, 5:])
    kv = torch.randn(2, 7, 2, 1, 8, device=DEVICE)
    before = kv.clone()
    apply_rotary_emb_kv_(kv, cos, sin)
    assert torch.equal(kv[:, :, 0], apply_rotary_emb(before[:, :, 0], cos, sin))
    assert torch.equal(kv[:, :, 1], before[:, :, 1])
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(gqa, cos, sin)


def test_rotary_embedding_module():
    """RotaryEmbedding's tables are base ** (-2f / dim) angles; with scale_base (XPos) q and k get inverse scales."""
    rotary = RotaryEmbedding(8, base=500.0)
    qkv = torch.randn(2, 6, 3, 2, 16, device=DEVICE)
    expected_q = oracle(qkv[:, :, 0], *tables(9, 8, base=500.0), torch.arange(3, 9, device=DEVICE), False)
    rotary(qkv, seqlen_offset=3)
    assert_rounded_once(qkv[:, :, 0], expected_q)
    q, kv = torch.randn(2, 6, 2, 16, device=DEVICE), torch.randn(2, 6, 2, 2, 16, device=DEVICE)
    xpos = RotaryEmbedding(8, scale_base=512, device=DEVICE)
    q0, k0 = q.clone(), kv[:, :, 0].clone()
    xpos(q, kv)
    scale = (torch.arange(0, 8, 2, device=DEVICE) + 0.4 * 8) / (1.4 * 8)
    power = (torch.arange(6, device=DEVICE) - 3) / 512
    cos, sin = tables(6, 8)
    factor = scale ** power[:, None]
    assert_rounded_once(q, oracle(q0, cos * factor, sin * factor, torch.arange(6, device=DEVICE), False))
    assert_rounded_once(kv[:, :, 0], oracle(k0, cos / factor, sin / factor, torch.arange(6, device=DEVICE), False))


def test_clear_errors():
    x = torch.randn(2, 9, 2, 8, device=DEVICE)
    cos, sin = tables(4, 8)
    with pytest.raises(ValueError, match="seqlen_rotary"):
        apply_rotary_emb(x, cos, sin)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(x, *tables(16, 10))
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, *tables(16, 8), seqlen_offsets=torch.zeros(3, dtype=torch.int64, device=DEVICE))
