"""unpad_input / pad_input: flash_attn.bert_padding's return values, round trips, gradients, errors."""

from __future__ import annotations

import doctest

import pytest
import torch

from conftest import DEVICE
from flashtile import padding
from flashtile.padding import index_first_axis, index_put_first_axis, pad_input, unpad_input


def as_mask(rows, dtype=torch.int64):
    return torch.tensor(rows, device=DEVICE).to(dtype)


def expected_unpad(mask, unused=None):
    """The oracle, one row at a time: (indices, cu_seqlens, max_seqlen, seqused) as plain lists."""
    selected = mask.bool() if unused is None else mask.bool() | unused.bool()
    batch, seqlen = mask.shape
    indices, cu_seqlens, seqused = [], [0], []
    for b in range(batch):
        row = [b * seqlen + s for s in range(seqlen) if selected[b, s]]
        indices += row
        cu_seqlens.append(cu_seqlens[-1] + len(row))
        seqused.append(int(mask[b].bool().sum()))
    lengths = [hi - lo for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    return indices, cu_seqlens, max(lengths, default=0), seqused


def check_unpad(x, mask, unused=None):
    """Every return value of unpad_input against the oracle; returns them."""
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = out = unpad_input(x, mask, unused)
    want_indices, want_cu, want_max, want_seqused = expected_unpad(mask.cpu(), None if unused is None else unused.cpu())
    assert indices.dtype == torch.int64 and indices.shape == (len(want_indices),)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (mask.shape[0] + 1,)
    assert seqused.dtype == torch.int32 and seqused.shape == (mask.shape[0],)
    assert type(max_seqlen) is int
    assert all(t.device == x.device for t in (x_unpad, indices, cu_seqlens, seqused))
    assert indices.tolist() == want_indices
    assert cu_seqlens.tolist() == want_cu
    assert max_seqlen == want_max
    assert seqused.tolist() == want_seqused
    assert x_unpad.shape == (len(want_indices), *x.shape[2:]) and x_unpad.dtype == x.dtype
    assert torch.equal(x_unpad, x.reshape(-1, *x.shape[2:])[indices])
    return out


# Hand-made masks with their values written out: (mask, indices, cu_seqlens, max_seqlen, seqused).
HAND_MADE = {
    "all-ones": ([[1, 1, 1], [1, 1, 1]], [0, 1, 2, 3, 4, 5], [0, 3, 6], 3, [3, 3]),
    "right-padding": ([[1, 1, 1, 0], [1, 0, 0, 0]], [0, 1, 2, 4], [0, 3, 4], 3, [3, 1]),
    "left-padding": ([[0, 0, 1, 1], [0, 1, 1, 1]], [2, 3, 5, 6, 7], [0, 2, 5], 3, [2, 3]),
    "zero-row-first": ([[0, 0, 0], [1, 1, 0], [1, 0, 0]], [3, 4, 6], [0, 0, 2, 3], 2, [0, 2, 1]),
    "zero-row-middle": ([[1, 0], [0, 0], [1, 1]], [0, 4, 5], [0, 1, 1, 3], 2, [1, 0, 2]),
    "zero-row-last": ([[1, 1], [0, 0]], [0, 1], [0, 2, 2], 2, [2, 0]),
    "all-zeros": ([[0, 0, 0], [0, 0, 0]], [], [0, 0, 0], 0, [0, 0]),
    "holes": ([[1, 0, 1, 0, 1]], [0, 2, 4], [0, 3], 3, [3]),
    "one-token": ([[1]], [0], [0, 1], 1, [1]),
}


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32, torch.uint8], ids=str)
@pytest.mark.parametrize("case", HAND_MADE.values(), ids=HAND_MADE.keys())
def test_unpad_hand_made(case, mask_dtype):
    rows, want_indices, want_cu, want_max, want_seqused = case
    mask = as_mask(rows, mask_dtype)
    x = torch.randn(*mask.shape, 2, device=DEVICE)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = check_unpad(x, mask)
    assert indices.tolist() == want_indices
    assert cu_seqlens.tolist() == want_cu
    assert max_seqlen == want_max
    assert seqused.tolist() == want_seqused
    padded = pad_input(x_unpad, indices, *mask.shape)
    assert torch.equal(padded, x * mask.bool()[..., None])


TRAILING = {"none": (), "D3": (3,), "H2-D3": (2, 3), "H2-K1-D4": (2, 1, 4)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.complex64]


def random_tensor(shape, dtype):
    x = torch.randn(shape, device=DEVICE, dtype=torch.float32) * 5
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.complex64:
        return torch.complex(x, -x)
    return x.to(dtype) + (1 if not dtype.is_floating_point else 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trailing", TRAILING.values(), ids=TRAILING.keys())
@pytest.mark.parametrize("batch,seqlen", [(1, 1), (3, 17), (5, 113)], ids=lambda v: str(v))
def test_round_trip_random(batch, seqlen, trailing, dtype):
    """pad(unpad(x)) is x where the mask is set and zero elsewhere; unpad(pad(u)) is u."""
    torch.manual_seed(batch * 1000 + seqlen)
    x = random_tensor((batch, seqlen, *trailing), dtype)
    mask = torch.rand(batch, seqlen, device=DEVICE) < 0.6
    mask[0] = False  # a whole row of padding
    x_unpad, indices, *_ = check_unpad(x, mask)
    padded = pad_input(x_unpad, indices, batch, seqlen)
    assert padded.shape == x.shape and padded.dtype == x.dtype
    keep = mask.reshape(batch, seqlen, *(1,) * len(trailing))
    assert torch.equal(padded, torch.where(keep, x, torch.zeros_like(x)))

    u = random_tensor(x_unpad.shape, dtype)
    again, indices_again, *_ = unpad_input(pad_input(u, indices, batch, seqlen), mask)
    assert torch.equal(again, u) and torch.equal(indices_again, indices)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_random_lengths(padding_side):
    """Masks built from random lengths, as tokenizers pad: every value against the oracle."""
    torch.manual_seed(0)
    batch, seqlen = 8, 33
    lengths = torch.randint(0, seqlen + 1, (batch,), device=DEVICE)
    lengths[1] = seqlen
    positions = torch.arange(seqlen, device=DEVICE)
    mask = positions < lengths[:, None] if padding_side == "right" else positions >= seqlen - lengths[:, None]
    x = torch.randn(batch, seqlen, 4, 8, device=DEVICE)
    _, _, cu_seqlens, max_seqlen, seqused = check_unpad(x, mask)
    assert torch.equal(cu_seqlens.diff().long(), lengths)
    assert max_seqlen == seqlen and torch.equal(seqused.long(), lengths)


def test_non_contiguous_hidden_states():
    x = torch.randn(6, 2, 5, device=DEVICE).transpose(0, 1)  # (batch=2, seqlen=6, 5), not contiguous
    mask = as_mask([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    x_unpad, indices, *_ = check_unpad(x, mask)
    assert torch.equal(pad_input(x_unpad, indices, 2, 6), x * mask[..., None])


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)], ids=lambda s: f"B{s[0]}-S{s[1]}")
def test_empty(shape):
    x = torch.randn(*shape, 2, device=DEVICE, requires_grad=True)
    mask = torch.ones(shape, dtype=torch.bool, device=DEVICE)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = check_unpad(x, mask)
    assert x_unpad.shape == (0, 2) and cu_seqlens.tolist() == [0] * (shape[0] + 1) and max_seqlen == 0
    out = pad_input(x_unpad, indices, *shape)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape


# unused_mask: FlashAttention-3's tests build it as the tokens between two random right-padded lengths,
# so a row is [valid..., unused..., padding...]; the unused tokens are kept and counted in cu_seqlens and
# max_seqlen but not in seqused.


def test_unused_mask_hand_made():
    mask = as_mask([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    unused = as_mask([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    x = torch.randn(4, 5, 3, device=DEVICE)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = check_unpad(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 3, 5, 10, 11, 12, 15, 16, 17, 18, 19]
    assert cu_seqlens.tolist() == [0, 4, 5, 8, 13]
    assert max_seqlen == 5
    assert seqused.tolist() == [2, 1, 0, 5]
    padded = pad_input(x_unpad, indices, 4, 5)
    assert torch.equal(padded, x * (mask | unused).bool()[..., None])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64], ids=str)
def test_unused_mask_random(mask_dtype):
    """FlashAttention-3's construction: valid = below min(len1, len2), unused = between them."""
    torch.manual_seed(1)
    batch, seqlen = 6, 29
    positions = torch.arange(seqlen, device=DEVICE)
    first = positions < torch.randint(0, seqlen + 1, (batch,), device=DEVICE)[:, None]
    second = positions < torch.randint(0, seqlen + 1, (batch,), device=DEVICE)[:, None]
    mask, unused = (first & second).to(mask_dtype), (first ^ second).to(mask_dtype)
    x = torch.randn(batch, seqlen, 2, 8, device=DEVICE)
    _, _, cu_seqlens, max_seqlen, seqused = check_unpad(x, mask, unused)
    assert torch.equal(cu_seqlens.diff(), (first | second).sum(-1, dtype=torch.int32))
    assert torch.equal(seqused, (first & second).sum(-1, dtype=torch.int32))
    assert max_seqlen == int((first | second).sum(-1).max())


def test_unused_mask_none_or_empty_matches_plain():
    mask = as_mask([[1, 1, 0], [0, 1, 0]])
    x = torch.randn(2, 3, 4, device=DEVICE)
    plain = unpad_input(x, mask)
    with_empty = unpad_input(x, mask, torch.zeros_like(mask))
    for a, b in zip(plain, with_empty, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert torch.equal(plain[4], plain[2].diff())


def test_overlapping_and_non_binary_masks_count_each_token_once():
    """Where flash_attn's sum would count a token twice (int masks), cu_seqlens still matches indices."""
    mask = as_mask([[2, 1, 0, 0], [1, 1, 1, 0]])
    unused = as_mask([[1, 0, 1, 0], [0, 0, 1, 1]])
    x = torch.randn(2, 4, device=DEVICE)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = check_unpad(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert cu_seqlens.tolist() == [0, 3, 7] and cu_seqlens[-1] == x_unpad.shape[0]
    assert max_seqlen == 4 and seqused.tolist() == [2, 3]


# Gradients: float64 gradcheck (and gradgradcheck: each backward is the other function).


def gradcheck_inputs(seed=0):
    torch.manual_seed(seed)
    mask = as_mask([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], torch.bool)
    x = torch.randn(3, 5, 2, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
    return x, mask


def test_gradcheck_unpad():
    x, mask = gradcheck_inputs()
    assert torch.autograd.gradcheck(lambda t: unpad_input(t, mask)[0], (x,))
    assert torch.autograd.gradgradcheck(lambda t: unpad_input(t, mask)[0], (x,))


def test_gradcheck_pad():
    x, mask = gradcheck_inputs()
    _, indices, *_ = unpad_input(x, mask)
    u = torch.randn(indices.shape[0], 2, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pad_input(t, indices, 3, 5), (u,))
    assert torch.autograd.gradgradcheck(lambda t: pad_input(t, indices, 3, 5), (u,))


def test_gradcheck_round_trip_with_unused_mask():
    x, mask = gradcheck_inputs()
    unused = as_mask([[1, 0, 0, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], torch.bool)

    def round_trip(t):
        t_unpad, indices, *_ = unpad_input(t, mask, unused)
        return pad_input(t_unpad * 3, indices, 3, 5)

    assert torch.autograd.gradcheck(round_trip, (x,))


def test_gradient_values():
    """d(sum(w * unpad(x)))/dx is w scattered to the selected tokens and zero on padding; likewise for pad."""
    x, mask = gradcheck_inputs()
    x_unpad, indices, *_ = unpad_input(x, mask)
    w = torch.randn_like(x_unpad)
    (grad_x,) = torch.autograd.grad((w * x_unpad).sum(), x)
    assert torch.equal(grad_x, pad_input(w, indices, 3, 5))
    assert torch.equal(grad_x[~mask], torch.zeros_like(grad_x[~mask]))

    u = x_unpad.detach().requires_grad_()
    g = torch.randn_like(x)
    (grad_u,) = torch.autograd.grad((g * pad_input(u, indices, 3, 5)).sum(), u)
    assert torch.equal(grad_u, g[mask])


def test_index_first_axis_and_put_as_hugging_face_unpads():
    """Hugging Face's attention layers unpad q with unpad_input and k, v (other heads, other lengths) with
    index_first_axis on the key mask's indices, then pad the output back with pad_input: the gather and the
    scatter as flash_attn.bert_padding, with their gradients (each row written once)."""
    x, mask = gradcheck_inputs()
    _, indices, *_ = unpad_input(x, mask)
    rows = x.reshape(15, 2, 3)
    gathered = index_first_axis(rows, indices)
    assert torch.equal(gathered, rows[indices])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (rows.detach().requires_grad_(),))
    scattered = index_put_first_axis(gathered, indices, 15)
    assert torch.equal(scattered[indices], gathered) and not scattered[~mask.flatten()].any()
    u = gathered.detach().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: index_put_first_axis(t, indices, 15), (u,))
    assert torch.equal(
        index_put_first_axis(gathered, indices, 15).reshape(3, 5, 2, 3), pad_input(gathered, indices, 3, 5)
    )


def test_deterministic_mode():
    x, mask = gradcheck_inputs()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        x_unpad, indices, *_ = unpad_input(x, mask)
        pad_input(x_unpad * 2, indices, 3, 5).sum().backward()
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(x.grad, 2 * mask[..., None, None].expand_as(x).double())


def test_docstring_examples():
    result = doctest.testmod(padding, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


# Errors: what was expected, what came.


def x_and_mask():
    return torch.randn(2, 4, 3, device=DEVICE), torch.ones(2, 4, dtype=torch.bool, device=DEVICE)


UNPAD_ERRORS = {
    "x-not-tensor": (lambda x, m: ([[1.0]], m, None), TypeError, "hidden_states must be a torch.Tensor"),
    "x-1d": (lambda x, m: (x[0, 0], m, None), ValueError, "at least 2 dims"),
    "mask-not-tensor": (lambda x, m: (x, [[1, 1, 1, 1]] * 2, None), TypeError, "attention_mask must be a torch"),
    "mask-1d": (lambda x, m: (x, m[0], None), ValueError, r"attention_mask must be 2-D .* got shape \(4,\)"),
    "mask-3d": (lambda x, m: (x, m[..., None], None), ValueError, "attention_mask must be 2-D"),
    "mask-batch": (lambda x, m: (x, m[:1], None), ValueError, r"first two dims \(2, 4\), got shape \(1, 4\)"),
    "mask-seqlen": (lambda x, m: (x, m[:, :3], None), ValueError, r"got shape \(2, 3\)"),
    "mask-transposed": (lambda x, m: (x, m.T, None), ValueError, r"got shape \(4, 2\)"),
    "mask-float": (lambda x, m: (x, m.float(), None), TypeError, r"bool or an integer dtype.*== 0"),
    "unused-shape": (lambda x, m: (x, m, m[:, :2]), ValueError, "unused_mask must be 2-D"),
    "unused-float": (lambda x, m: (x, m, m.half()), TypeError, "unused_mask must be bool or an integer"),
    "mask-device": (lambda x, m: (x, m.to("meta"), None), ValueError, "attention_mask is on meta"),
}


@pytest.mark.parametrize("case", UNPAD_ERRORS.values(), ids=UNPAD_ERRORS.keys())
def test_unpad_errors(case):
    make, error, match = case
    with pytest.raises(error, match=match):
        unpad_input(*make(*x_and_mask()))


def packed():
    return torch.randn(5, 3, device=DEVICE), torch.tensor([0, 1, 2, 5, 6], device=DEVICE)


PAD_ERRORS = {
    "x-not-tensor": (lambda u, i: ([1.0], i, 2, 4), TypeError, "hidden_states must be a torch.Tensor"),
    "x-0d": (lambda u, i: (u[0, 0], i[:1], 2, 4), ValueError, "at least 1 dim"),
    "indices-not-tensor": (lambda u, i: (u, [0, 1, 2, 5, 6], 2, 4), TypeError, "indices must be a torch.Tensor"),
    "indices-int32": (lambda u, i: (u, i.int(), 2, 4), ValueError, r"1-D int64 .* dtype torch.int32"),
    "indices-2d": (lambda u, i: (u, i[None], 2, 4), ValueError, r"1-D int64 .* shape \(1, 5\)"),
    "indices-float": (lambda u, i: (u, i.float(), 2, 4), ValueError, "1-D int64"),
    "length-mismatch": (lambda u, i: (u, i[:4], 2, 4), ValueError, "indices has 4 entries but hidden_states has 5"),
    "batch-float": (lambda u, i: (u, i, 2.0, 4), TypeError, "batch must be an int"),
    "seqlen-tensor": (lambda u, i: (u, i, 2, torch.tensor(4)), TypeError, "seqlen must be an int"),
    "batch-bool": (lambda u, i: (u, i, True, 4), TypeError, "batch must be an int"),
    "seqlen-negative": (lambda u, i: (u, i, 2, -4), ValueError, "seqlen must be >= 0"),
    "indices-device": (lambda u, i: (u, i.to("meta"), 2, 4), ValueError, "indices is on meta"),
}
if DEVICE == "cpu":  # index values are only checked on CPU tensors (on CUDA it would synchronise)
    PAD_ERRORS["index-too-big"] = (lambda u, i: (u, i, 2, 3), ValueError, r"\[0, 6\), got values in \[0, 6\]")
    PAD_ERRORS["index-negative"] = (lambda u, i: (u, i - 1, 2, 4), ValueError, r"got values in \[-1, 5\]")


@pytest.mark.parametrize("case", PAD_ERRORS.values(), ids=PAD_ERRORS.keys())
def test_pad_errors(case):
    make, error, match = case
    with pytest.raises(error, match=match):
        pad_input(*make(*packed()))


INDEX_ERRORS = {
    "gather-not-tensor": (lambda u, i: index_first_axis([1.0], i), TypeError, "input must be a torch.Tensor"),
    "gather-0d": (lambda u, i: index_first_axis(u[0, 0], i), ValueError, "input must be .* at least 1 dim"),
    "gather-int32": (lambda u, i: index_first_axis(u, i.int()), ValueError, r"1-D int64 .* dtype torch.int32"),
    "gather-device": (lambda u, i: index_first_axis(u, i.to("meta")), ValueError, "but input is on"),
    "put-length": (lambda u, i: index_put_first_axis(u, i[:4], 8), ValueError, "indices has 4 entries but values"),
    "put-2d": (lambda u, i: index_put_first_axis(u, i[None], 8), ValueError, r"shape \(1, 5\)"),
}
if DEVICE == "cpu":  # index values are only checked on CPU tensors (on CUDA it would synchronise)
    INDEX_ERRORS["gather-too-big"] = (lambda u, i: index_first_axis(u, i + 1), ValueError, r"\[0, 5\), got .*\[1, 7\]")
    INDEX_ERRORS["put-too-big"] = (lambda u, i: index_put_first_axis(u, i, 6), ValueError, r"\[0, 6\), got .*6\]")


@pytest.mark.parametrize("case", INDEX_ERRORS.values(), ids=INDEX_ERRORS.keys())
def test_index_errors(case):
    call, error, match = case
    with pytest.raises(error, match=match):
        call(*packed())


@pytest.mark.gpu
def test_pad_input_does_not_synchronise():
    x = torch.randn(4, 64, 8, device="cuda", requires_grad=True)
    mask = torch.rand(4, 64, device="cuda") < 0.5
    x_unpad, indices, *_ = unpad_input(x, mask)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = pad_input(x_unpad, indices, 4, 64)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(x.grad, mask[..., None].expand_as(x).float())
