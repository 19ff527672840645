"""BlockMask: which (query block, key block) tiles attention computes; create_block_mask that builds one and
create_mask, the dense mask of a mod.

The format is FlexAttention's: for every (batch, head, query block) row, ``kv_num_blocks`` counts the key blocks
that are computed and the first that many entries of ``kv_indices`` name them (the rest of a row is unused). A
block is *partial* (listed in kv_*: mask_mod decides per position) or *full* (listed in full_kv_*: every position
attends and mask_mod is not evaluated); a block in neither list is skipped. The q_* tensors are the same lists
transposed (for each key block, its query blocks), which the backward pass iterates. Batch and head dimensions of
size 1 broadcast over the attention's batch and heads. ``block_mask[b, h]`` slices a mask and ``_adjust`` crops it
to shorter lengths, as FlexAttention's do.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import sys
import weakref
from collections.abc import Callable

import torch

from flashtile import _backend
from flashtile.errors import InputError, InputTypeError
from flashtile.flex.mods import MaskMod, ScoreMod, apply_score_mod, evaluate_mask, index, noop_mask

DEFAULT_BLOCK_SIZE = 128
_TENSORS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices) int32 of a dense (..., rows, cols) block table: per row, how many blocks are set and
    their column indices in increasing order, followed by the unset columns."""
    dense = dense.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1).to(torch.int32).contiguous(), indices.to(torch.int32).contiguous()


def _dense(num_blocks: torch.Tensor, indices: torch.Tensor, cols: int) -> torch.Tensor:
    """The bool (..., rows, cols) block table of (num_blocks, indices)."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    spill = torch.where(listed, indices.long(), cols)  # unlisted entries land in a column that is cut off
    dense = torch.zeros((*indices.shape[:-1], cols + 1), dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, spill, True)[..., :cols]


def _transposed(num_blocks: torch.Tensor | None, indices: torch.Tensor | None, cols: int):
    """The (num_blocks, indices) of the transposed block table (per column, its rows); (None, None) for None."""
    if num_blocks is None:
        return None, None
    return _ordered(_dense(num_blocks, indices, cols).transpose(-2, -1))


def _block_size(BLOCK_SIZE: int | tuple[int, int]) -> tuple[int, int]:
    """(query block, key block) from an int or a pair; InputError unless positive ints."""
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise InputError(f"BLOCK_SIZE must be a positive int or a pair of them (query, key), got {BLOCK_SIZE!r}.")
    return sizes


class BlockMask:
    """A block-sparse attention mask in FlexAttention's format (``torch.nn.attention.flex_attention.BlockMask``).

    Fields (Bm, Hm: the mask's batch and head sizes, 1 to broadcast; Qb = ceil(Q_LEN / BLOCK_SIZE[0]) query
    blocks, Kb = ceil(KV_LEN / BLOCK_SIZE[1]) key blocks; all index tensors int32 on one device):

    - ``kv_num_blocks`` (Bm, Hm, Qb), ``kv_indices`` (Bm, Hm, Qb, Kb): per query block, the partial key blocks
      (mask_mod is evaluated in them);
    - ``full_kv_num_blocks``, ``full_kv_indices`` (same shapes, or None): the full key blocks (every position
      attends, mask_mod is not evaluated);
    - ``q_num_blocks`` (Bm, Hm, Kb), ``q_indices`` (Bm, Hm, Kb, Qb), ``full_q_num_blocks``, ``full_q_indices``: the
      same lists per key block, for the backward pass (computed by ``from_kv_blocks``);
    - ``BLOCK_SIZE`` (query block, key block), ``mask_mod``, ``seq_lengths`` (Q_LEN, KV_LEN).

    ``shape`` is (Bm, Hm, Q_LEN, KV_LEN); ``to_dense()`` gives the (Bm, Hm, Qb, Kb) int32 table of computed blocks,
    ``sparsity()`` the percentage of skipped blocks, ``to_string()`` draws it, ``to(device)`` moves it and
    ``as_tuple()`` lists its fields in FlexAttention's order. Build one with ``create_block_mask`` or
    ``BlockMask.from_kv_blocks``; the constructor takes every field as given.

    FlexAttention's BlockMask also carries dQ write-order metadata (``dq_write_order``, ``dq_write_order_full``,
    ``dq_kv_order``, ``dq_kv_order_spt``) for the deterministic backward of its FlashAttention (CuTe DSL) kernel. The
    constructor, ``from_kv_blocks`` and ``create_block_mask`` accept those arguments, and the attributes read None:
    no flashtile kernel reads them. The generated kernels' backward computes dQ in a kernel of its own, one query
    tile per program, without atomic adds (the same bits on every run, gradients of captured tensors aside); the
    built-in kernels that recognised mods run are deterministic under ``torch.use_deterministic_algorithms(True)``.

    ``block_mask[index]`` is the mask of some batch entries, heads or query-block rows (``__getitem__``: ints keep
    their dimension; the result's mask_mod must be set before use, as in FlexAttention);
    ``block_mask._adjust(new_q_len, new_kv_len)`` crops it to shorter lengths (the upper left corner).
    """

    def __init__(
        self,
        seq_lengths: tuple[int, int],
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: torch.Tensor | None,
        full_kv_indices: torch.Tensor | None,
        q_num_blocks: torch.Tensor | None,
        q_indices: torch.Tensor | None,
        full_q_num_blocks: torch.Tensor | None,
        full_q_indices: torch.Tensor | None,
        BLOCK_SIZE: tuple[int, int] = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE),
        mask_mod: MaskMod = noop_mask,
        *,
        dq_write_order: torch.Tensor | None = None,
        dq_write_order_full: torch.Tensor | None = None,
        dq_kv_order: torch.Tensor | None = None,
        dq_kv_order_spt: bool | None = None,
    ) -> None:
        if kv_indices.dim() != 4 or kv_num_blocks.shape != kv_indices.shape[:-1]:
            raise InputError(
                f"A BlockMask needs kv_indices (B, H, query blocks, key blocks) and kv_num_blocks (B, H, query "
                f"blocks), got {tuple(kv_indices.shape)} and {tuple(kv_num_blocks.shape)}."
            )
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise InputError("full_kv_num_blocks and full_kv_indices must be given together (or both None).")
        self.seq_lengths = tuple(seq_lengths)
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.BLOCK_SIZE = _block_size(BLOCK_SIZE)
        self.mask_mod = mask_mod

    dq_write_order = dq_write_order_full = dq_kv_order = dq_kv_order_spt = None
    """FlexAttention's dQ write-order fields: None here (the class docstring says why)."""

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: torch.Tensor | None = None,
        full_kv_indices: torch.Tensor | None = None,
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        mask_mod: MaskMod | None = None,
        seq_lengths: tuple[int, int] | None = None,
        compute_q_blocks: bool = True,
        *,
        dq_write_order: torch.Tensor | None = None,
        dq_write_order_full: torch.Tensor | None = None,
        dq_kv_order: torch.Tensor | bool | None = None,
    ) -> BlockMask:
        """A BlockMask from its key-block lists (shapes as in the class docstring), with the query-block lists
        computed by transposing them, or left None with ``compute_q_blocks=False`` (a mask for the forward pass
        alone, as FlexAttention's: the generated kernel's backward walks those lists, so a call that needs a gradient
        then takes the PyTorch route). seq_lengths defaults to the blocks' extent (Qb * BLOCK_SIZE[0],
        Kb * BLOCK_SIZE[1]); mask_mod to ``noop_mask``. The dq_* arguments are accepted and not kept (class
        docstring)."""
        q_block, kv_block = _block_size(BLOCK_SIZE)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * q_block, kv_indices.shape[-1] * kv_block)
        cols = -(-seq_lengths[1] // kv_block)
        kv_lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        q_lists = (None,) * 4
        if compute_q_blocks:
            q_lists = (*_transposed(*kv_lists[:2], cols), *_transposed(*kv_lists[2:], cols))
        return cls(
            seq_lengths, *kv_lists, *q_lists,
            BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod or noop_mask,
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, ...]:
        """(Bm, Hm, Q_LEN, KV_LEN)."""
        return (*self.kv_indices.shape[:2], *self.seq_lengths)

    @property
    def q_blocks(self) -> int:
        """Qb, the number of query blocks: ceil(Q_LEN / BLOCK_SIZE[0])."""
        return -(-self.seq_lengths[0] // self.BLOCK_SIZE[0])

    @property
    def kv_blocks(self) -> int:
        """Kb, the number of key blocks: ceil(KV_LEN / BLOCK_SIZE[1])."""
        return -(-self.seq_lengths[1] // self.BLOCK_SIZE[1])

    def numel(self) -> int:
        """Positions the mask covers: Bm * Hm * Q_LEN * KV_LEN."""
        b, h, q, kv = self.shape
        return b * h * q * kv

    def to_dense(self) -> torch.Tensor:
        """(Bm, Hm, Qb, Kb) int32: 1 for every computed (partial or full) block, 0 for a skipped one."""
        cols = self.kv_blocks
        dense = _dense(self.kv_num_blocks, self.kv_indices, cols)
        if self.full_kv_num_blocks is not None:
            dense = dense | _dense(self.full_kv_num_blocks, self.full_kv_indices, cols)
        return dense.to(torch.int32)

    def sparsity(self) -> float:
        """The percentage of the mask's positions that lie in skipped blocks (0 when every block is computed). The
        blocks at the ends count only their positions within the lengths (FlexAttention counts whole blocks, which
        gives negative values for lengths shorter than a block)."""
        (q_len, kv_len), (q_block, kv_block) = self.seq_lengths, self.BLOCK_SIZE
        device = self.kv_indices.device
        rows = (q_len - torch.arange(0, q_len, q_block, device=device)).clamp(max=q_block)
        cols = (kv_len - torch.arange(0, kv_len, kv_block, device=device)).clamp(max=kv_block)
        computed = (self.to_dense() * rows[:, None] * cols[None, :]).sum().item()
        return 100 * (1 - computed / max(self.numel(), 1))

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A drawing of the block table of the first ``limit`` (batch, head) pairs, at most grid_size (rows,
        columns; an int for both) cells each, a cell two characters wide: '█' computed blocks, ' ' skipped ones,
        '░' a cell that merges both."""
        grid_rows, grid_cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
        dense = self.to_dense()
        rows, cols = dense.shape[-2:]
        row_step, col_step = -(-rows // grid_rows), -(-cols // grid_cols)
        pictures = []
        for n, (b, h) in enumerate((b, h) for b in range(dense.shape[0]) for h in range(dense.shape[1])):
            if n == limit:
                pictures.append("... (to_string(limit=N) draws more)")
                break
            lines = [f"(batch {b}, head {h})"]
            for r in range(0, rows, row_step):
                cells = [dense[b, h, r : r + row_step, c : c + col_step].float().mean()
                         for c in range(0, cols, col_step)]  # fmt: skip
                lines.append("".join(("█" if x == 1 else " " if x == 0 else "░") * 2 for x in cells))
            pictures.append("\n".join(lines))
        return "\n".join(pictures)

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%,\n{self.to_string()}\n)"

    def __repr__(self) -> str:
        def shape(x):
            return None if x is None else tuple(x.shape)

        fields = "".join(f"    {name}={shape(getattr(self, name))},\n" for name in _TENSORS)
        name = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        return (
            f"BlockMask(\n{fields}    BLOCK_SIZE={self.BLOCK_SIZE},\n    shape={self.shape},\n"
            f"    sparsity={self.sparsity():.2f}%,\n    mask_mod={name}\n)"
        )

    def as_tuple(self, flatten: bool = True) -> tuple:
        """The fields in FlexAttention's ``as_tuple`` order: seq_lengths, the eight kv_* / q_* lists, the four dQ
        write-order fields (None), BLOCK_SIZE and mask_mod; with ``flatten`` (default) seq_lengths and BLOCK_SIZE
        give two entries each, else one pair each."""
        pairs = (self.seq_lengths, self.BLOCK_SIZE)
        lengths, block_size = pairs if flatten else ((pairs[0],), (pairs[1],))
        write_order = (self.dq_write_order, self.dq_write_order_full, self.dq_kv_order, self.dq_kv_order_spt)
        return (*lengths, *(getattr(self, name) for name in _TENSORS), *write_order, *block_size, self.mask_mod)

    def to(self, device: torch.device | str) -> BlockMask:
        """A copy with every tensor on ``device``."""
        moved = {name: None if getattr(self, name) is None else getattr(self, name).to(device) for name in _TENSORS}
        return BlockMask(self.seq_lengths, **moved, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod)

    def __getitem__(self, index) -> BlockMask:
        """The mask of some batch entries, heads and query-block rows, as FlexAttention's ``block_mask[index]``.

        index: up to three entries, for the batch, head and query-block dimensions of the lists (the rest are
        kept whole): an int (which keeps its dimension, with size 1: ``block_mask[1]`` has Bm = 1), a slice, or a
        1-D tensor (or list) of ints or bools, at most one of these. The lists are indexed (views of this mask's
        where only ints and slices are given) and the q_* lists recomputed from them; seq_lengths and BLOCK_SIZE
        are kept, so a mask whose query-block rows were indexed needs its ``seq_lengths`` set to the new lengths.

        As in FlexAttention, the result does not keep mask_mod (in the slice, b, h and the rows count from 0, which
        the original mask_mod does not know): its mask_mod raises InputError, and so does flex_attention, until one
        is assigned (``sliced.mask_mod = block_mask.mask_mod`` where it depends on neither b nor h; otherwise a
        mask_mod that maps the slice's b, h and q_idx to the original's).

        Raises:
            flashtile.InputError: more than three entries, an int or index outside its dimension, a slice without
                int bounds or with a step below 1, more than one tensor or list, a tensor that is not 1-D, or a
                bool tensor of another length than its dimension
            flashtile.InputTypeError: an entry that is not an int, slice, tensor or list, or a tensor of floats
        """
        entries = index if isinstance(index, tuple) else (index,)
        if len(entries) > 3:
            raise InputError(
                f"A BlockMask takes up to three indices (batch, head, query block), got {len(entries)}: {index!r}."
            )
        dims = zip(self.kv_num_blocks.shape, ("batch", "head", "query block"), strict=True)
        index = tuple(_index_entry(entry, size, name, self.kv_indices.device)
                      for entry, (size, name) in zip(entries, dims, strict=False))  # fmt: skip
        if sum(isinstance(entry, torch.Tensor) for entry in index) > 1:
            raise InputError(
                f"A BlockMask takes at most one tensor or list index (with more, their dimensions would merge), got "
                f"{entries!r}: index the dimensions one after the other (block_mask[x][:, y])."
            )
        lists = [None if t is None else t[index] for t in (self.kv_num_blocks, self.kv_indices,
                                                            self.full_kv_num_blocks, self.full_kv_indices)]  # fmt: skip
        sliced = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=_unset_after_slicing,
                                          seq_lengths=self.seq_lengths)  # fmt: skip
        if recall(_VALID_LISTS, self) and sliced.kv_indices.shape[-2] <= sliced.q_blocks:
            _known_valid(sliced)  # rows of valid lists; the q_* lists then name only rows the lengths hold
        return sliced

    def _adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """This mask cropped to its upper left corner for new_q_len queries and new_kv_len keys, as FlexAttention's
        ``_adjust`` (used where a mask made for the longest lengths serves shorter ones): the first
        ceil(new_q_len / BLOCK_SIZE[0]) query-block rows, each listing, in its order, the listed blocks below
        ceil(new_kv_len / BLOCK_SIZE[1]); mask_mod is kept. The crop is right for masks whose positions do not
        depend on the lengths (causal with equal lengths, a window, documents); for others build a new mask.
        (FlexAttention keeps a row's first counted entries, which can name blocks beyond the new lengths where
        listed blocks lie past them; the lists kept here never do.)

        Raises:
            flashtile.InputError: a length that is not a positive int, or new_q_len needing more query-block rows
                than the mask has (it crops; it cannot grow: build a mask for the longer lengths)
        """
        for name, value in (("new_q_len", new_q_len), ("new_kv_len", new_kv_len)):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"BlockMask._adjust: {name} must be a positive int, got {value!r}.")
        rows = -(-new_q_len // self.BLOCK_SIZE[0])
        if rows > self.kv_num_blocks.shape[-1]:
            raise InputError(
                f"BlockMask._adjust({new_q_len}, {new_kv_len}) needs {rows} query-block rows and the mask has "
                f"{self.kv_num_blocks.shape[-1]} (seq_lengths {self.seq_lengths}, BLOCK_SIZE {self.BLOCK_SIZE}): it "
                "crops a mask; for longer lengths build a new one (create_block_mask)."
            )
        cols = -(-new_kv_len // self.BLOCK_SIZE[1])
        full = (None, None)
        if self.full_kv_num_blocks is not None:
            full = _cropped(self.full_kv_num_blocks, self.full_kv_indices, rows, cols)
        adjusted = BlockMask.from_kv_blocks(
            *_cropped(self.kv_num_blocks, self.kv_indices, rows, cols), *full, BLOCK_SIZE=self.BLOCK_SIZE,
            mask_mod=self.mask_mod, seq_lengths=(new_q_len, new_kv_len),
        )  # fmt: skip
        _known_valid(adjusted)  # valid by construction
        return adjusted


def _index_entry(entry, size: int, name: str, device: torch.device) -> slice | torch.Tensor:
    """One entry of a BlockMask index as the lists are indexed with it: an int as the slice of that one position
    (FlexAttention keeps the dimension), a slice as it is, a list or tensor as a 1-D tensor on ``device``;
    InputError or InputTypeError for anything else, or a position outside the dimension of ``size``."""
    if isinstance(entry, numbers.Integral) and not isinstance(entry, torch.Tensor):
        if not -size <= entry < size:
            raise InputError(f"BlockMask index {entry} is out of range for the {name} dimension of size {size}.")
        return slice(int(entry) % size, int(entry) % size + 1)
    if isinstance(entry, slice):
        ints = all(x is None or isinstance(x, numbers.Integral) for x in (entry.start, entry.stop, entry.step))
        if not ints or (entry.step is not None and entry.step < 1):
            raise InputError(
                f"A BlockMask slice needs int bounds and a step of 1 or more, got {entry} for the {name} dimension."
            )
        return entry
    if not isinstance(entry, torch.Tensor | list):
        raise InputTypeError(
            f"A BlockMask index entry must be an int, a slice or a 1-D tensor (or list) of ints or bools, got "
            f"{type(entry).__name__} for the {name} dimension."
        )
    entry = torch.as_tensor(entry, device=device)
    if entry.dtype not in _INDEX_DTYPES:
        raise InputTypeError(f"A BlockMask index tensor must hold ints or bools, got {entry.dtype} for the {name} "
                             "dimension.")  # fmt: skip
    if entry.dim() != 1:
        raise InputError(
            f"A BlockMask index tensor must be 1-D, got shape {tuple(entry.shape)} for the {name} dimension: use an "
            "int for one position (it keeps the dimension) or a 1-D tensor."
        )
    if entry.dtype == torch.bool and len(entry) != size:
        raise InputError(f"A bool BlockMask index must have the {name} dimension's length {size}, got {len(entry)}.")
    if entry.dtype != torch.bool and _backend.values_checked(device) and ((entry < -size) | (entry >= size)).any():
        raise InputError(f"A BlockMask index tensor holds positions outside [-{size}, {size}) of the {name} dimension: "
                         f"{entry.tolist()}.")  # fmt: skip
    return entry


_INDEX_DTYPES = (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64)


def _unset_after_slicing(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """The mask_mod of a sliced BlockMask until one is assigned: slicing does not keep the mask_mod (as in
    FlexAttention), so it raises InputError."""
    raise InputError(_UNSET_AFTER_SLICING)


_UNSET_AFTER_SLICING = (
    "This BlockMask was sliced (block_mask[...]), which does not keep its mask_mod (as in FlexAttention: in the slice "
    "b, h and the query-block rows count from 0): assign one before using it, e.g. sliced.mask_mod = "
    "block_mask.mask_mod where it depends on neither b nor h, or a mask_mod mapping the slice's indices to the "
    "original's."
)


def _cropped(num_blocks: torch.Tensor, indices: torch.Tensor, rows: int, cols: int):
    """(num_blocks, indices) of the first ``rows`` rows of a list, each keeping, in its order, the listed blocks in
    [0, cols), cut to ``cols`` entries a row."""
    num_blocks, indices = num_blocks[..., :rows], indices[..., :rows, :]
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    count, order = _ordered(listed & (indices >= 0) & (indices < cols))  # kept entries first, each part in order
    return count.clamp(max=cols), indices.gather(-1, order.long())[..., :cols].contiguous()


def _positional_args(fn: Callable) -> int:
    """How many positional arguments without a default ``fn`` takes (a mask_mod 4, a score_mod 5)."""
    return sum(
        1 for p in inspect.signature(fn).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )  # fmt: skip


def require_mod(fn: Callable | None, name: str, args: int) -> None:
    """InputTypeError unless ``fn`` is None or a function of ``args`` positional arguments."""
    if fn is not None and (not callable(fn) or _positional_args(fn) != args):
        signature = "(score, b, h, q_idx, kv_idx)" if args == 5 else "(b, h, q_idx, kv_idx)"
        raise InputTypeError(f"{name} must be a function {name}{signature}, got {fn!r}.")


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """The BlockMask of ``mask_mod`` (FlexAttention's ``create_block_mask``, same arguments and result).

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor: True where query q_idx of head h of batch entry b attends to key
    kv_idx (0-d int32 arguments; written with torch operations, it may index tensors it captures).
    B, H: the batch size and number of query heads the mask is made for; None makes that dimension 1, which
    broadcasts over any batch size or number of heads (the mask must then not depend on b or h).
    Q_LEN, KV_LEN: the query and key lengths (the lengths of the attention it is used with).
    device: where the mask is evaluated and kept; default (None) CUDA where there is a GPU, else the CPU
    (FlexAttention's: the current accelerator).
    BLOCK_SIZE: int or (query, key) pair, default 128: the tile of the block table. A block where mask_mod is
    True everywhere is *full* (mask_mod skipped), one where it is False everywhere is skipped, the rest *partial*.
    _compile: accepted for FlexAttention's signature (where it compiles the evaluation, a deprecated flag); the
    evaluation here is the same either way.
    separate_full_blocks: False lists every block that attends anywhere as partial (no full blocks: mask_mod is
    evaluated on all of them), as FlexAttention's.
    compute_dq_write_order, dq_kv_order: accepted for FlexAttention's signature; the mask keeps no dQ write order
    (``BlockMask``: no flashtile kernel reads one).

    mask_mod is evaluated one row of query blocks at a time (B * H * BLOCK_SIZE[0] * KV_LEN positions at once), so
    memory grows linearly with the lengths. Where TILE (64) divides both block sizes and is smaller than one of
    them, the counts are taken per TILE x TILE tile, and the mask keeps a second table of those tiles beside its own
    where it costs the kernels notably less (``tiles``: packed documents of a few hundred tokens leave whole 64 x 64
    tiles of their 128 x 128 blocks empty and others full); the generated kernel walks that one. Deciding reads two
    counts from the device (a host synchronisation on CUDA).

    Raises:
        flashtile.InputError: a size that is not a positive int (B and H may be None), or a bad BLOCK_SIZE
        flashtile.InputTypeError: mask_mod is not a function of 4 arguments
    """
    require_mod(mask_mod, "mask_mod", 4)
    if mask_mod is None:
        raise InputTypeError("create_block_mask needs a mask_mod(b, h, q_idx, kv_idx) function, got None.")
    B, H, Q_LEN, KV_LEN = _sizes("create_block_mask", 1, B, H, Q_LEN, KV_LEN)
    q_block, kv_block = _block_size(BLOCK_SIZE)
    device = _device(device)
    rows, cols = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    finer = q_block % TILE == 0 and kv_block % TILE == 0 and max(q_block, kv_block) > TILE
    finer = finer and B * H * -(-Q_LEN // TILE) * -(-KV_LEN // TILE) <= MAX_TILE_ENTRIES
    tile_q, tile_k = (TILE, TILE) if finer else (q_block, kv_block)
    per_q, per_k = q_block // tile_q, kv_block // tile_k  # tiles per block along each side
    b, h, kv = index(0, B, device), index(0, H, device), index(0, KV_LEN, device)
    counts = torch.empty(B, H, rows * per_q, cols * per_k, dtype=torch.int32, device=device)  # per tile
    for r in range(rows):  # one row of query blocks at a time: memory linear in the lengths
        mask = evaluate_mask(mask_mod, b, h, index(r * q_block, min((r + 1) * q_block, Q_LEN), device), kv)
        padding = (0, cols * kv_block - KV_LEN, 0, q_block - mask.shape[2])  # the padding never attends
        mask = torch.nn.functional.pad(mask, padding).reshape(B, H, per_q, tile_q, cols * per_k, tile_k)
        counts[:, :, r * per_q : (r + 1) * per_q] = mask.sum((3, 5), dtype=torch.int32)
    per_block = counts.reshape(B, H, rows, per_q, cols, per_k).sum((3, 5), dtype=torch.int32)
    blocks = _kinds(per_block, q_block * kv_block, separate_full_blocks=separate_full_blocks)
    block_mask = _from_kinds(*blocks, q_block, kv_block, mask_mod, (Q_LEN, KV_LEN))
    if finer:
        counts = counts[:, :, : -(-Q_LEN // tile_q), : -(-KV_LEN // tile_k)]  # the tiles within the lengths
        tiles = _kinds(counts, tile_q * tile_k, separate_full_blocks=separate_full_blocks)
        cost_tiles, cost_blocks = torch.stack(
            [_cost(*tiles, tile_q * tile_k), _cost(*blocks, q_block * kv_block)]
        ).tolist()
        if cost_tiles <= TILE_SHARE * cost_blocks:
            remember(_TILES, block_mask, _from_kinds(*tiles, tile_q, tile_k, mask_mod, (Q_LEN, KV_LEN)))
    return block_mask


def _kinds(counts: torch.Tensor, area: int, separate_full_blocks: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(partial, full) bool tables of blocks of ``area`` positions from their attended counts (B, H, rows, cols): full
    where every position attends (a block cut by the lengths never does), partial where some others do; without
    ``separate_full_blocks`` there are no full blocks (None): every block that attends anywhere is partial."""
    attended = counts > 0
    if not separate_full_blocks:
        return attended, None
    full = counts == area
    return attended & ~full, full


def _cost(partial: torch.Tensor, full: torch.Tensor | None, area: int) -> torch.Tensor:
    """What the kernels' work on a table of blocks of ``area`` positions comes to, in positions: each computed
    block's, once more for each partial one (its mask is evaluated position by position)."""
    return (2 * partial.sum() + (0 if full is None else full.sum())) * area


def _from_kinds(
    partial: torch.Tensor, full: torch.Tensor | None, q_block: int, kv_block: int, mask_mod: MaskMod,
    lengths: tuple[int, int],
) -> BlockMask:  # fmt: skip
    """The BlockMask of the (partial, full) tables of (q_block, kv_block) blocks (``_kinds``); blocks in neither are
    skipped."""
    full_lists = (None, None) if full is None else _ordered(full)
    block_mask = BlockMask.from_kv_blocks(
        *_ordered(partial), *full_lists, BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod, seq_lengths=lengths
    )
    _known_valid(block_mask)  # valid by construction
    return block_mask


TILE = 64
"""The tile of the finer table ``create_block_mask`` may keep beside a mask's (``tiles``): the generated kernels'
tiles are at most 64 x 64 but at head dim 64 forward (128 x 64)."""
TILE_SHARE = 0.85
"""The finer table is kept where its tiles' work is at most this share of the mask's blocks' (``_cost``)."""
MAX_TILE_ENTRIES = 2**24
"""Nor where its table would hold more (B * H * query tiles * key tiles) entries: each of its four lists is then
64 MiB of int32 (at most about 4096 x 4096 tiles, a 256k-token sequence, for one batch entry and head)."""
_TILES: dict[int, tuple] = {}
"""The finer tables ``create_block_mask`` kept (``remember``)."""


def tiles(mask: BlockMask) -> BlockMask:
    """The block table the generated kernel walks for ``mask``: the TILE x TILE table ``create_block_mask`` kept
    beside it (the same positions, fewer of them in computed tiles) while its lists are unchanged, else ``mask``."""
    return recall(_TILES, mask) or mask


def _sizes(caller: str, least: int, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int) -> tuple[int, ...]:
    """(B, H, Q_LEN, KV_LEN) with None for B or H as 1; InputError unless each is an int of at least ``least``."""
    sizes = (1 if B is None else B, 1 if H is None else H, Q_LEN, KV_LEN)
    for name, value in zip(("B", "H", "Q_LEN", "KV_LEN"), sizes, strict=True):
        if not isinstance(value, int) or value < least:
            kind = "a positive int" if least == 1 else "an int of 0 or more"
            raise InputError(f"{caller}: {name} must be {kind} (or None for B and H), got {value!r}.")
    return sizes


def create_mask(
    mod_fn: MaskMod | ScoreMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The dense mask of a mod: bool (B, H, Q_LEN, KV_LEN), True where a query attends to a key (FlexAttention's
    ``create_mask``, same arguments and result).

    mod_fn: a mask_mod(b, h, q_idx, kv_idx) -> bool tensor (the mask is its value at every position), or a
    score_mod(score, b, h, q_idx, kv_idx) -> score (the mask is True where it does not turn a score of 0 into
    -inf); told apart by their number of arguments without a default, 4 or 5, as FlexAttention does. It receives
    0-d int32 indices (as in flex_attention and create_block_mask; FlexAttention's create_mask passes int64) and,
    for a score_mod, a float32 score.
    B, H: the batch size and number of heads; None gives that dimension size 1.
    Q_LEN, KV_LEN: the query and key lengths.
    device: where the mod is evaluated and the mask made; default (None) CUDA where there is a GPU, else the CPU
    (FlexAttention's: the current accelerator).

    The whole mask is materialised (B * H * Q_LEN * KV_LEN booleans); ``create_block_mask`` needs memory linear in
    the lengths. A mask_mod's value that is the same everywhere comes back as an expanded tensor (stride 0), as
    FlexAttention's. A size of 0 gives an empty mask without calling mod_fn (FlexAttention's fails there for a
    score_mod).

    Raises:
        flashtile.InputError: a size that is not an int of 0 or more (B and H may be None)
        flashtile.InputTypeError: mod_fn is not a function of 4 or 5 arguments
    """
    arguments = _positional_args(mod_fn) if callable(mod_fn) else None
    if arguments not in (4, 5):
        raise InputTypeError(
            f"create_mask needs a mask_mod(b, h, q_idx, kv_idx) or a score_mod(score, b, h, q_idx, kv_idx), got "
            f"{mod_fn!r}" + ("." if arguments is None else f" with {arguments} arguments without a default.")
        )
    B, H, Q_LEN, KV_LEN = _sizes("create_mask", 0, B, H, Q_LEN, KV_LEN)
    device = _device(device)
    if 0 in (B, H, Q_LEN, KV_LEN):  # no position: the mod is not called (vmap over an empty score cannot be)
        return torch.empty(B, H, Q_LEN, KV_LEN, dtype=torch.bool, device=device)
    b, h, q_idx, kv_idx = (index(0, n, device) for n in (B, H, Q_LEN, KV_LEN))
    if arguments == 4:
        return evaluate_mask(mod_fn, b, h, q_idx, kv_idx)
    scores = torch.zeros(B, H, Q_LEN, KV_LEN, dtype=torch.float32, device=device)
    return ~torch.isneginf(apply_score_mod(mod_fn, scores, b, h, q_idx, kv_idx))


def _device(device: torch.device | str | None) -> torch.device:
    """The device masks are made on: ``device``, or (None) CUDA where there is a GPU, else the CPU."""
    return torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


def remember(store: dict, mask: BlockMask, value: object) -> None:
    """Keep ``value`` in ``store`` for ``mask``'s lists as they are now: by the id of its ``kv_indices`` (the entry
    leaves with the tensor), with the ids and versions of all its list tensors and its seq_lengths and BLOCK_SIZE,
    so that ``recall`` finds it until a list is replaced or changed in place or the lengths or block sizes are
    changed (as code that slices a mask for a decoding step does)."""
    key = id(mask.kv_indices)
    if key not in store:
        weakref.finalize(mask.kv_indices, store.pop, key, None)
    store[key] = _versions(mask), value


def recall(store: dict, mask: BlockMask) -> object:
    """What ``remember`` kept in ``store`` for ``mask``'s lists as they are now, or None."""
    versions, value = store.get(id(mask.kv_indices), (None, None))
    return value if versions == _versions(mask) else None


_VALID_LISTS: dict[int, tuple] = {}
"""The masks whose lists were found valid (``check_lists``; ``remember``)."""


def _known_valid(mask: BlockMask) -> None:
    remember(_VALID_LISTS, mask, True)


def _lists(mask: BlockMask) -> list[tuple[str, torch.Tensor, torch.Tensor, int, int]]:
    """(name, num_blocks, indices, rows it must cover, blocks it may name) of each list the mask has."""
    rows, cols = mask.q_blocks, mask.kv_blocks
    found = [("kv", mask.kv_num_blocks, mask.kv_indices, rows, cols),
             ("full_kv", mask.full_kv_num_blocks, mask.full_kv_indices, rows, cols),
             ("q", mask.q_num_blocks, mask.q_indices, cols, rows),
             ("full_q", mask.full_q_num_blocks, mask.full_q_indices, cols, rows)]  # fmt: skip
    return [entry for entry in found if entry[1] is not None]


def _versions(mask: BlockMask) -> tuple[tuple[int, ...], ...]:
    """Each list tensor's id and version, then the mask's seq_lengths and BLOCK_SIZE."""
    tensors = ((id(t), t._version) for _, num_blocks, indices, _, _ in _lists(mask) for t in (num_blocks, indices))
    return (*tensors, tuple(mask.seq_lengths), tuple(mask.BLOCK_SIZE))


def check_lists(mask: BlockMask) -> None:
    """InputError where a list of ``mask`` has fewer rows than its lengths need, or (index values) counts more blocks
    than its row holds or names a block outside the lengths: the kernels read the listed blocks' tiles without
    bounds checks where the lengths are multiples of the block sizes. The values are checked where
    ``flashtile.check_values`` has them checked (a host synchronisation on CUDA), once per mask's lists and again
    after an in-place change of them; ``create_block_mask``'s are valid by construction."""
    lists = _lists(mask)
    for name, num_blocks, indices, rows, _ in lists:
        if num_blocks.shape[-1] < rows or indices.shape[:-1] != num_blocks.shape:
            raise InputError(
                f"block_mask's {name}_num_blocks {tuple(num_blocks.shape)} and {name}_indices {tuple(indices.shape)} "
                f"need {rows} rows of blocks for seq_lengths {mask.seq_lengths} and BLOCK_SIZE {mask.BLOCK_SIZE}: "
                "build the mask for these lengths (flashtile.create_block_mask)."
            )
    if recall(_VALID_LISTS, mask) or not _backend.values_checked(mask.kv_indices.device):
        return
    bad = []
    for _, num_blocks, indices, _, cols in lists:
        listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
        outside = listed & ((indices < 0) | (indices >= cols))
        bad.append(((num_blocks < 0) | (num_blocks > indices.shape[-1])).any() | outside.any())
    found = torch.stack(bad).tolist()
    for (name, _, indices, _, cols), wrong in zip(lists, found, strict=True):
        if wrong:
            raise InputError(
                f"block_mask's {name} lists name blocks outside [0, {cols}) or count more than the {indices.shape[-1]} "
                f"entries a row holds (seq_lengths {mask.seq_lengths}, BLOCK_SIZE {mask.BLOCK_SIZE}): each row's first "
                f"{name}_num_blocks entries of {name}_indices must be block indices below {cols}."
            )
    _known_valid(mask)


def as_block_mask(block_mask) -> BlockMask:
    """flashtile's BlockMask for a BlockMask of flashtile or of torch (``torch.nn.attention.flex_attention``),
    whose fields it shares (its q_* lists are used as they are where torch computed them); InputTypeError for
    anything else, InputError for a sliced mask whose mask_mod was not assigned (flashtile's or torch's)."""
    torch_flex = sys.modules.get("torch.nn.attention.flex_attention")  # imported wherever torch's masks exist
    torch_unset = getattr(torch_flex, "_sliced_mask_mod_error", _unset_after_slicing)
    if any(getattr(block_mask, "mask_mod", None) is unset for unset in (_unset_after_slicing, torch_unset)):
        raise InputError(f"flex_attention: {_UNSET_AFTER_SLICING}")
    if isinstance(block_mask, BlockMask):
        return block_mask
    if not all(hasattr(block_mask, name) for name in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "seq_lengths")):
        raise InputTypeError(
            f"block_mask must be a BlockMask (flashtile.create_block_mask, or torch's), got {type(block_mask)}."
        )
    fields = {name: getattr(block_mask, name, None) for name in _TENSORS}
    if fields["q_indices"] is not None:
        return BlockMask(
            tuple(block_mask.seq_lengths), **fields, BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE),
            mask_mod=block_mask.mask_mod,
        )  # fmt: skip
    return BlockMask.from_kv_blocks(
        block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
        BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE), mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def full_block_mask(q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """The BlockMask of attention without a mask: every block full (mask_mod never evaluated). Kept per lengths and
    device (it is never changed), so that calls without a block mask do not build one each time."""
    rows, cols = -(-q_len // DEFAULT_BLOCK_SIZE), -(-kv_len // DEFAULT_BLOCK_SIZE)
    full = torch.ones(1, 1, rows, cols, dtype=torch.bool, device=device)
    return BlockMask.from_kv_blocks(*_ordered(~full), *_ordered(full), seq_lengths=(q_len, kv_len))


def block_kinds(block_mask: BlockMask) -> torch.Tensor:
    """(Bm, Hm, Qb, Kb) int8: 0 for a skipped block, PARTIAL or FULL."""
    cols = block_mask.kv_blocks
    kinds = _dense(block_mask.kv_num_blocks, block_mask.kv_indices, cols).to(torch.int8) * PARTIAL
    if block_mask.full_kv_num_blocks is not None:
        full = _dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, cols)
        kinds = torch.where(full, FULL, kinds).to(torch.int8)
    return kinds


PARTIAL, FULL = 1, 2
