"""create_mask, BlockMask slicing (``block_mask[b, h]``) and ``BlockMask._adjust`` against torch's own functions
(torch.nn.attention.flex_attention, on the same mods), and flex_attention with sliced and cropped masks against the
dense oracle of tests/test_flex.py by the tolerance rule, on the PyTorch route and the Triton kernel (the interpreter
here, tiny shapes; compiled on a GPU)."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

import flashtile
from flashtile.flex.block_mask import BlockMask, check_lists
from oracle import assert_within_rule
from test_flex import DEVICE, LISTS, dense_flex

flex = pytest.importorskip("torch.nn.attention.flex_attention")

DOC = torch.tensor([0] * 13 + [1] * 30 + [2] * 9 + [3] * 48, device=DEVICE)  # document ids of 100 packed tokens


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 20)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 24) | (q_idx >= kv_idx)


def document(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def per_entry(b, h, q_idx, kv_idx):
    """Different for every batch entry and head, in its block table too (skipped, partial and full blocks, rows that
    see no key): a causal band shifted by b and h, with holes that move with them in the keys from 32 on."""
    return (q_idx + 16 * b >= kv_idx + 24 * h) & ((kv_idx < 32) | ((q_idx + 2 * kv_idx + 3 * b + h) % 5 != 0))


def masked_score(score, b, h, q_idx, kv_idx):
    """A score_mod that hides positions by -inf (create_mask's mask: where it does not)."""
    return torch.where((kv_idx <= q_idx + h) & (kv_idx != b), score * 2, float("-inf"))


def shifted_score(score, b, h, q_idx, kv_idx):
    """A score_mod that hides nothing (finite everywhere)."""
    return score + (q_idx - kv_idx) * 0.5 + b - h


MASK_MODS = [causal, window, prefix_lm, document, per_entry, flashtile.noop_mask]


# ------------------------------------------------------------------------------------------------ create_mask


@pytest.mark.parametrize("mod", [*MASK_MODS, masked_score, shifted_score], ids=lambda m: m.__name__)
@pytest.mark.parametrize("B, H", [(None, None), (2, None), (None, 3), (2, 3)])
def test_create_mask_matches_torch(mod, B, H):
    for L, S in ((37, 53), (1, 100), (100, 1)):
        ours = flashtile.create_mask(mod, B, H, L, S, device=DEVICE)
        theirs = flex.create_mask(mod, B, H, L, S, device=DEVICE)
        assert ours.dtype == torch.bool and ours.shape == (B or 1, H or 1, L, S)
        assert torch.equal(ours, theirs.to(torch.bool))


def test_create_mask_empty_lengths_and_default_device():
    assert flashtile.create_mask(causal, 2, None, 0, 5, device=DEVICE).shape == (2, 1, 0, 5)
    assert flashtile.create_mask(masked_score, 1, 2, 4, 0, device=DEVICE).shape == (1, 2, 4, 0)
    default = torch.accelerator.current_accelerator() or torch.device("cpu")
    assert flashtile.create_mask(causal, 1, 1, 3, 3).device.type == default.type
    assert flashtile.flex.create_mask is flashtile.create_mask


@pytest.mark.parametrize(
    "mod, sizes, error, match",
    [
        (lambda b, h, q_idx: q_idx, (1, 1, 4, 4), flashtile.InputTypeError, "with 3 arguments"),
        (None, (1, 1, 4, 4), flashtile.InputTypeError, "mask_mod"),
        (causal, (1, 1, -1, 4), flashtile.InputError, "Q_LEN must be an int of 0 or more"),
        (causal, (0.5, 1, 4, 4), flashtile.InputError, "B must be an int of 0 or more"),
    ],
)
def test_create_mask_bad_inputs(mod, sizes, error, match):
    with pytest.raises(error, match=match):
        flashtile.create_mask(mod, *sizes, device=DEVICE)


# ------------------------------------------------------------------------------------------- create_block_mask


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("mod", [per_entry, document], ids=lambda m: m.__name__)
def test_create_block_mask_without_full_blocks(mod, backend):
    """separate_full_blocks=False lists every block that attends anywhere as partial and no full ones (torch's lists,
    where torch's create_block_mask takes the option); flex_attention with it is still right."""
    B, H, L, S = 2, 2, 48, 40
    ours = flashtile.create_block_mask(mod, B, H, L, S, device=DEVICE, BLOCK_SIZE=16, separate_full_blocks=False)
    separate = flashtile.create_block_mask(mod, B, H, L, S, device=DEVICE, BLOCK_SIZE=16)
    assert separate.full_kv_num_blocks.sum() > 0  # the masks have full blocks to list otherwise
    assert all(getattr(ours, name) is None for name in LISTS if name.startswith("full_"))
    assert torch.equal(ours.to_dense(), separate.to_dense())
    if "separate_full_blocks" in inspect.signature(flex.create_block_mask).parameters:
        _same_lists(ours, flex.create_block_mask(mod, B, H, L, S, DEVICE, 16, separate_full_blocks=False))
    _check_against_oracle(ours, flex.create_mask(mod, B, H, L, S, device=DEVICE), backend, B, H, L, S)


def test_create_block_mask_default_device_and_compile_flag():
    """device defaults to the current accelerator (the CPU without one), as FlexAttention's; ``_compile`` is accepted
    and gives the same lists."""
    default = torch.accelerator.current_accelerator() or torch.device("cpu")
    assert flashtile.create_block_mask(causal, 1, 1, 40, 40, BLOCK_SIZE=16).kv_indices.device.type == default.type
    compiled = flashtile.create_block_mask(document, 1, 1, 100, 100, DEVICE, 32, _compile=True)
    _same_lists(compiled, flashtile.create_block_mask(document, 1, 1, 100, 100, DEVICE, 32))


def test_dq_write_order_arguments_are_accepted():
    """FlexAttention's dQ write-order arguments (create_block_mask, the constructor, from_kv_blocks) are accepted and
    change nothing; the mask's write-order fields read None (flashtile's backward needs no write order)."""
    plain = flashtile.create_block_mask(document, 1, 1, 100, 100, DEVICE, 32)
    ordered = flashtile.create_block_mask(document, 1, 1, 100, 100, DEVICE, 32, compute_dq_write_order=True,
                                          dq_kv_order=False)  # fmt: skip
    _same_lists(ordered, plain)
    rebuilt = BlockMask.from_kv_blocks(plain.kv_num_blocks, plain.kv_indices, BLOCK_SIZE=32, seq_lengths=(100, 100),
                                       dq_write_order=plain.kv_indices, dq_kv_order=True)  # fmt: skip
    made = BlockMask(
        *plain.as_tuple(flatten=False)[:9], BLOCK_SIZE=(32, 32), dq_write_order=plain.kv_indices, dq_kv_order_spt=True
    )
    for mask in (ordered, rebuilt, made):
        assert mask.as_tuple()[10:14] == (None,) * 4
        assert (mask.dq_write_order, mask.dq_write_order_full, mask.dq_kv_order, mask.dq_kv_order_spt) == (None,) * 4


@pytest.mark.parametrize("flatten", [True, False])
def test_as_tuple_order(flatten):
    """as_tuple gives FlexAttention's fields in its order: seq_lengths, the eight lists, the four dQ write-order
    fields (None), the block size and mask_mod; the lengths and block size flattened or as pairs."""
    made = flashtile.create_block_mask(per_entry, 2, 2, 50, 45, DEVICE, 16)
    lengths, block_size = ((50, 45), (16, 16)) if flatten else (((50, 45),), ((16, 16),))
    expected = (*lengths, *(getattr(made, name) for name in LISTS), None, None, None, None, *block_size, per_entry)
    found = made.as_tuple(flatten)
    assert len(found) == len(expected) and all(x is y or x == y for x, y in zip(found, expected, strict=True))


@pytest.mark.skipif(
    "dq_write_order" not in inspect.signature(flex.BlockMask.__init__).parameters,
    reason=f"torch {torch.__version__}'s BlockMask has no dQ write-order fields (its as_tuple is shorter)",
)
@pytest.mark.parametrize("flatten", [True, False])
def test_as_tuple_matches_torch(flatten):
    """as_tuple of flashtile's mask equals torch's for the same mask_mod, entry by entry."""
    ours = flashtile.create_block_mask(per_entry, 2, 2, 50, 45, DEVICE, 16).as_tuple(flatten)
    theirs = flex.create_block_mask(per_entry, 2, 2, 50, 45, DEVICE, 16).as_tuple(flatten)
    assert len(ours) == len(theirs)
    for mine, torchs in zip(ours, theirs, strict=True):
        assert torch.equal(mine, torchs) if isinstance(mine, torch.Tensor) else mine == torchs


def test_to_string_grid_size_pair():
    """to_string takes grid_size as an int or a (rows, columns) pair, as FlexAttention's: the drawing of a causal mask
    of 16 x 16 blocks at (4, 8) has 4 rows of 8 two-character cells, and the last row's diagonal cell is mixed."""
    block_mask = flashtile.create_block_mask(causal, None, None, 256, 256, device=DEVICE, BLOCK_SIZE=16)
    rows = block_mask.to_string(grid_size=(4, 8)).splitlines()[1:]
    assert len(rows) == 4 and all(len(row) == 16 for row in rows)
    assert rows[-1] == "█" * 12 + "░" * 4
    assert block_mask.to_string(grid_size=4) == block_mask.to_string(grid_size=(4, 4))


@pytest.mark.parametrize("backend", ["AUTO", "TRITON"])
def test_from_kv_blocks_without_q_blocks(backend):
    """compute_q_blocks=False leaves the q_* lists None (a forward-only mask, as FlexAttention's): the generated
    kernel takes it without autograd; with a gradient wanted AUTO runs the PyTorch route, which needs no q_* lists
    (checked against the oracle), and BACKEND "TRITON" says why it cannot."""
    made = flashtile.create_block_mask(document, 1, None, 100, 100, device=DEVICE, BLOCK_SIZE=32)
    forward_only = BlockMask.from_kv_blocks(*made.as_tuple()[2:6], BLOCK_SIZE=32, mask_mod=document,
                                            seq_lengths=(100, 100), compute_q_blocks=False)  # fmt: skip
    assert all(getattr(forward_only, name) is None for name in LISTS if name.startswith(("q_", "full_q_")))
    q, k, v = (torch.randn(1, 2, 100, 32, device=DEVICE) for _ in range(3))
    with torch.no_grad():
        out = flashtile.flex_attention(q, k, v, block_mask=forward_only, kernel_options={"BACKEND": backend})
        expected = flashtile.flex_attention(q, k, v, block_mask=made, kernel_options={"BACKEND": backend})
    assert torch.equal(out, expected)
    dense = flex.create_mask(document, 1, None, 100, 100, device=DEVICE)
    if backend == "AUTO":
        _check_against_oracle(forward_only, dense, backend, 1, 2, 100, 100)
    else:
        with pytest.raises(flashtile.InputError, match="without its q_\\* lists"):
            flashtile.flex_attention(
                q.requires_grad_(), k, v, block_mask=forward_only, kernel_options={"BACKEND": backend}
            )


# ------------------------------------------------------------------------------------------- BlockMask slicing

INDICES = [
    0, -1, 2, (1, 1), (0, -2), (slice(0, 2),), (slice(None), 1), (slice(1, None), slice(None, None, 2)),
    [2, 0], (slice(None), torch.tensor([1, 0])), (slice(None), torch.tensor([True, False])),
    (slice(None), slice(None), torch.tensor([3])), (2, slice(None), slice(1, 5, 2)), (1, 0, [6, 0, 0]),
]  # fmt: skip


def _same_lists(ours, theirs, lengths: bool = True) -> None:
    """Every list, the block size and block table of ``ours`` are those of torch's mask ``theirs``; with ``lengths``
    its seq_lengths and shape too."""
    for name in LISTS:
        mine, torchs = getattr(ours, name), getattr(theirs, name)
        assert (mine is None and torchs is None) or torch.equal(mine, torchs), name
    assert ours.BLOCK_SIZE == tuple(theirs.BLOCK_SIZE)
    if lengths:
        assert ours.seq_lengths == tuple(theirs.seq_lengths) and ours.shape == theirs.shape
    assert torch.equal(ours.to_dense(), theirs.to_dense())


@pytest.mark.parametrize("mod", [per_entry, document], ids=lambda m: m.__name__)
@pytest.mark.parametrize("index", INDICES, ids=str)
def test_slicing_matches_torch(mod, index):
    """Every list (q_* recomputed), the lengths, shape and block table of ``block_mask[index]`` are torch's; the
    slice's mask_mod is unset, as torch's."""
    ours = flashtile.create_block_mask(mod, 3, 2, 100, 70, device=DEVICE, BLOCK_SIZE=16)
    theirs = flex.create_block_mask(mod, 3, 2, 100, 70, device=DEVICE, BLOCK_SIZE=16)
    _same_lists(ours, theirs)
    sliced = ours[index]
    _same_lists(sliced, theirs[index])
    with pytest.raises(flashtile.InputError, match="was sliced"):
        sliced.mask_mod(*(torch.tensor(0, dtype=torch.int32),) * 4)
    if sliced.kv_num_blocks.shape[-1] == ours.q_blocks:  # query-block rows whole: the lengths still fit
        fresh = {name: getattr(sliced, name).clone() for name in LISTS}  # not known valid: its values are checked
        check_lists(BlockMask(sliced.seq_lengths, **fresh, BLOCK_SIZE=sliced.BLOCK_SIZE))


@pytest.mark.parametrize(
    "index, error, match",
    [
        (3, flashtile.InputError, "out of range for the batch dimension of size 3"),
        ((0, -3), flashtile.InputError, "out of range for the head dimension of size 2"),
        ((0, 0, 7), flashtile.InputError, "out of range for the query block dimension of size 7"),
        ((0, 0, 0, 0), flashtile.InputError, "up to three indices"),
        (torch.tensor([0, 3]), flashtile.InputError, r"outside \[-3, 3\) of the batch dimension"),
        (torch.tensor(1), flashtile.InputError, "must be 1-D"),
        (torch.tensor([[0]]), flashtile.InputError, "must be 1-D"),
        (torch.tensor([True, False]), flashtile.InputError, "length 3, got 2"),
        ((torch.tensor([0]), torch.tensor([1])), flashtile.InputError, "at most one tensor or list"),
        (([0, 1], [1]), flashtile.InputError, "at most one tensor or list"),
        (slice(None, None, -1), flashtile.InputError, "a step of 1 or more"),
        ((0, slice(0, 2, 0)), flashtile.InputError, "a step of 1 or more, got slice.0, 2, 0. for the head"),
        (slice(0, 1.5), flashtile.InputError, "int bounds"),
        (torch.tensor([0.0]), flashtile.InputTypeError, "ints or bools, got torch.float32"),
        (1.0, flashtile.InputTypeError, "got float for the batch dimension"),
        (None, flashtile.InputTypeError, "got NoneType"),
        ((Ellipsis, 0), flashtile.InputTypeError, "got ellipsis"),
    ],
    ids=str,
)
def test_bad_indices_raise_input_error(index, error, match):
    block_mask = flashtile.create_block_mask(per_entry, 3, 2, 100, 70, device=DEVICE, BLOCK_SIZE=16)
    if isinstance(index, torch.Tensor):
        index = index.to(DEVICE)
    with pytest.raises(error, match=match):
        block_mask[index]


def test_sliced_mask_without_mask_mod_raises_in_flex_attention():
    """flex_attention refuses a slice (flashtile's or torch's) until its mask_mod is assigned, as torch's does."""
    if not hasattr(flex, "_sliced_mask_mod_error"):
        pytest.skip("this torch keeps the mask_mod of a sliced BlockMask")
    q = k = v = torch.randn(1, 2, 40, 16, device=DEVICE)
    for create in (flashtile.create_block_mask, flex.create_block_mask):
        sliced = create(causal, 2, 2, 40, 40, device=DEVICE, BLOCK_SIZE=16)[1]
        with pytest.raises(flashtile.InputError, match="was sliced"):
            flashtile.flex_attention(q, k, v, block_mask=sliced)
        sliced.mask_mod = causal
        flashtile.flex_attention(q, k, v, block_mask=sliced, kernel_options={"BACKEND": "TORCH"})


def test_slices_of_checked_masks_are_known_valid(monkeypatch):
    """A slice of lists already found valid is not checked again (no host synchronisation on CUDA); a mask found
    valid is checked again once its lengths change (as decoding code sets them on a slice)."""
    checks = []
    values_checked = flashtile._backend.values_checked
    monkeypatch.setattr(flashtile._backend, "values_checked", lambda device: checks.append(1) or values_checked(device))
    block_mask = flashtile.create_block_mask(causal, 2, 2, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    check_lists(block_mask[1])
    check_lists(block_mask[:, 0])
    assert not checks
    rebuilt = BlockMask.from_kv_blocks(block_mask.kv_num_blocks.clone(), block_mask.kv_indices.clone(), BLOCK_SIZE=16,
                                       seq_lengths=(64, 64))  # fmt: skip
    check_lists(rebuilt)
    check_lists(rebuilt)
    assert len(checks) == 1
    rebuilt.seq_lengths = (64, 40)  # the last row's partial block 3 lies outside the 3 key blocks of 40 keys
    with pytest.raises(flashtile.InputError, match=r"name blocks outside \[0, 3\)"):
        check_lists(rebuilt)


# ------------------------------------------------------------------------------------------- BlockMask._adjust


@pytest.mark.parametrize("mod", [causal, window, prefix_lm, document], ids=lambda m: m.__name__)
def test_adjust_matches_torch(mod):
    """Cropped to every (L, S) of a grid: where torch's _adjust gives lists inside the new lengths, every list is
    torch's; everywhere the block table is the upper left corner of the original's and mask_mod is kept."""
    ours = flashtile.create_block_mask(mod, 2, 1, 100, 70, device=DEVICE, BLOCK_SIZE=16)
    theirs = flex.create_block_mask(mod, 2, 1, 100, 70, device=DEVICE, BLOCK_SIZE=16)
    compared = 0
    for L, S in itertools.product(range(1, 101, 9), range(1, 71, 6)):
        adjusted = ours._adjust(L, S)
        rows, cols = -(-L // 16), -(-S // 16)
        assert adjusted.seq_lengths == (L, S) and adjusted.mask_mod is mod
        assert torch.equal(adjusted.to_dense(), ours.to_dense()[:, :, :rows, :cols])
        check_lists(adjusted)
        try:
            torch_adjusted = theirs._adjust(L, S)
        except IndexError:  # torch's crop lists blocks past the new key length, which its transposition indexes
            continue
        if all(_inside(torch_adjusted, side, cols) for side in ("kv", "full_kv")):
            # (torch's crop can keep lengths rounded up to whole blocks: on CUDA _adjust(1, 1) of this prefix-LM
            # mask reports seq_lengths (16, 16); ours are the new lengths, asserted above)
            _same_lists(adjusted, torch_adjusted, lengths=False)
            compared += 1
    assert compared > 50


def _inside(block_mask, side: str, cols: int) -> bool:
    num, indices = getattr(block_mask, f"{side}_num_blocks"), getattr(block_mask, f"{side}_indices")
    listed = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
    return not (listed & (indices >= cols)).any()


def test_adjust_bad_lengths_raise_input_error():
    block_mask = flashtile.create_block_mask(causal, 1, 1, 100, 70, device=DEVICE, BLOCK_SIZE=16)
    with pytest.raises(flashtile.InputError, match="needs 8 query-block rows and the mask has 7"):
        block_mask._adjust(120, 70)
    with pytest.raises(flashtile.InputError, match="new_kv_len must be a positive int"):
        block_mask._adjust(50, 0)
    assert block_mask._adjust(112, 90).to_dense()[..., 5:].sum() == 0  # key blocks it never listed stay skipped


# ---------------------------------------------------------------------- flex_attention with sliced masks


def _check_against_oracle(block_mask, mask: torch.Tensor, backend: str, B, H, L, S) -> None:
    """flex_attention's out, lse, dq, dk, dv with ``block_mask`` against the oracle with the dense ``mask``
    (float16 inputs; float64 reference, float16 base), by the tolerance rule."""
    q, k, v = (torch.randn(B, H, n, 32, device=DEVICE, dtype=torch.float16, requires_grad=True) for n in (L, S, S))
    out, lse = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                        kernel_options={"BACKEND": backend})  # fmt: skip
    dout = torch.randn_like(out)
    names = ("out", "lse", "dq", "dk", "dv")
    got = dict(zip(names, (out, lse, *torch.autograd.grad(out, (q, k, v), dout)), strict=True))
    found = {}
    for dtype in (torch.float64, torch.float16):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, s = dense_flex(*xs, None, mask.expand(B, H, L, S), 32**-0.5)
        found[dtype] = dict(zip(names, (o, s, *torch.autograd.grad(o, xs, dout.to(dtype))), strict=True))
    for name, x in got.items():
        precise, base = found[torch.float64][name].to(x.dtype), found[torch.float16][name]
        assert_within_rule(name if name in ("out", "lse") else "grad", x, precise, base)


SELECT = torch.tensor([2, 0], device=DEVICE)
SLICES = [
    # (index, the slice's mask_mod in terms of the original's, the dense mask's batch and head selection)
    (1, lambda b, h, q_idx, kv_idx: per_entry(b + 1, h, q_idx, kv_idx), [1], [0, 1]),
    ((slice(None), 1), lambda b, h, q_idx, kv_idx: per_entry(b, h + 1, q_idx, kv_idx), [0, 1, 2], [1]),
    (SELECT, lambda b, h, q_idx, kv_idx: per_entry(SELECT[b], h, q_idx, kv_idx), [2, 0], [0, 1]),
]


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("case", range(len(SLICES)))
def test_flex_attention_with_sliced_mask(backend, case):
    """A mask made for 3 batch entries and 2 heads, sliced, with its mask_mod assigned in the slice's indices: the
    attention of the selected entries and heads (backward through the recomputed q_* lists)."""
    index, mask_mod, batch, heads = SLICES[case]
    L, S = 50, 45
    block_mask = flashtile.create_block_mask(per_entry, 3, 2, L, S, device=DEVICE, BLOCK_SIZE=32)
    sliced = block_mask[index]
    sliced.mask_mod = mask_mod
    dense = flex.create_mask(per_entry, 3, 2, L, S, device=DEVICE)[batch][:, heads]
    _check_against_oracle(sliced, dense, backend, len(batch), len(heads), L, S)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("position", [0, 37, 63])
def test_flex_attention_decoding_step_with_sliced_rows(backend, position):
    """The decoding step of code written for FlexAttention: the row of query blocks holding the new token's position
    sliced out of a mask made for the whole cache, mask_mod shifted to that position, seq_lengths set to one query."""
    L = S = 64
    block_mask = flashtile.create_block_mask(prefix_lm, None, None, L, S, device=DEVICE, BLOCK_SIZE=32)
    step = block_mask[:, :, torch.tensor([position // 32], device=DEVICE)]
    step.mask_mod = lambda b, h, q_idx, kv_idx: prefix_lm(b, h, q_idx + position, kv_idx)
    step.seq_lengths = (1, S)
    dense = flex.create_mask(prefix_lm, None, None, L, S, device=DEVICE)[:, :, position : position + 1]
    _check_against_oracle(step, dense, backend, 1, 2, 1, S)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_flex_attention_with_adjusted_mask(backend):
    """A mask made for the longest lengths, cropped to shorter ones (ragged in both)."""
    block_mask = flashtile.create_block_mask(document, 1, None, 100, 100, device=DEVICE, BLOCK_SIZE=32)
    dense = flex.create_mask(document, 1, None, 57, 41, device=DEVICE)
    _check_against_oracle(block_mask._adjust(57, 41), dense, backend, 1, 2, 57, 41)
