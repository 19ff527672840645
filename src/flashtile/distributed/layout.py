"""How a sequence is split across the ranks of a process group, and ``shard`` / ``unshard``.

A sequence of length N split over a group of W ranks is cut into equal chunks; each rank holds some
of them, concatenated in increasing position order (its shard has N / W positions):

``"contiguous"``: W chunks, rank r holds chunk r. With W = 4 (one letter per chunk)::

    sequence  | A | B | C | D |         rank 0: A   rank 1: B   rank 2: C   rank 3: D

``"zigzag"``: 2W chunks, rank r holds chunks r and 2W - 1 - r. With W = 4::

    sequence  | A | B | C | D | E | F | G | H |
              rank 0: A H   rank 1: B G   rank 2: C F   rank 3: D E

With a causal mask, a rank's work is the area of the lower triangle its queries cover: under
"contiguous" rank 0 sees one chunk of keys and rank W - 1 all of them, so the ring waits for the last
rank; under "zigzag" every rank holds one early and one late chunk and does the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashtile.errors import require

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Segment:
    """Positions [start, start + length) of the full sequence, stored at [offset, offset + length) of a shard."""

    start: int
    offset: int
    length: int


def check_layout(layout: str) -> None:
    """Raise ValueError unless ``layout`` is one of LAYOUTS."""
    require(layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {layout!r}.")


def num_chunks(layout: str, world_size: int) -> int:
    """How many equal chunks the sequence is cut into: 2 * world_size for "zigzag", world_size otherwise."""
    check_layout(layout)
    return 2 * world_size if layout == "zigzag" else world_size


def chunks_of(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """Indices of the chunks that ``rank`` holds, in the order its shard stores them (increasing)."""
    check_layout(layout)
    return (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (rank,)


def segments(rank: int, world_size: int, layout: str, shard_len: int) -> tuple[Segment, ...]:
    """The positions of the full sequence held by ``rank``'s shard of length ``shard_len``."""
    held = chunks_of(rank, world_size, layout)
    chunk = shard_len // len(held)
    return tuple(Segment(start=c * chunk, offset=i * chunk, length=chunk) for i, c in enumerate(held))


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    require(
        dist.is_available() and dist.is_initialized(),
        "torch.distributed is not initialised: call torch.distributed.init_process_group first.",
        RuntimeError,
    )
    return dist.get_rank(group), dist.get_world_size(group)


def shard_tensor(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """``rank``'s shard of the full tensor ``x`` along ``dim`` (no communication; see ``shard``)."""
    n = num_chunks(layout, world_size)
    require(
        x.shape[dim] % n == 0,
        f"The sequence (dim {dim}, length {x.shape[dim]}) does not split into {n} equal chunks for "
        f"layout={layout!r} on {world_size} ranks. Pad it at the end to a multiple of {n}; with causal "
        "attention, keys after every real query change nothing, so the real positions' outputs stay exact.",
    )
    pieces = x.chunk(n, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, world_size, layout)], dim=dim)


def shard(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, *, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor that every rank of ``group`` holds.

    No communication happens: each rank slices its own chunks out of ``x``. Gradients flow back to ``x``.
    For rotary embeddings, the global positions of this rank's tokens are
    ``shard(torch.arange(seqlen), group, layout=layout, dim=0)``.

    Args:
        x: (..., seqlen, ...) with the sequence on ``dim``, e.g. q (batch, seqlen, nheads, headdim) with
           dim=1, or softmax_lse (batch, nheads, seqlen) with dim=2; seqlen divisible by the number of
           chunks (world_size, or 2 * world_size for "zigzag")
        group: the process group the sequence is split over; None is the default group
        layout: "zigzag" (rank r holds chunks r and 2W - 1 - r of 2W) or "contiguous" (chunk r of W)
        dim: the sequence dimension

    Raises:
        flashtile.InputError (a ValueError and a RuntimeError): an unknown layout, or a seqlen on ``dim`` that
            the chunks do not divide; raised before anything is sliced.

    Returns:
        a new tensor like x with seqlen / world_size positions on ``dim``
    """
    rank, world_size = _rank_and_size(group)
    return shard_tensor(x, rank, world_size, layout, dim)


def unshard(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, *, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard: the inverse of ``shard``, by all_gather.

    A collective: every rank of ``group`` must call it with shards of one shape. Not differentiable
    (gathering is for results, checkpoints and logging, not for the training graph).

    Args:
        x: this rank's shard, (..., seqlen / world_size, ...) with the sequence on ``dim``
        group, layout, dim: as given to ``shard``

    Raises:
        flashtile.InputError (a ValueError and a RuntimeError): an unknown layout, or a shard length the held
            chunks do not divide; raised before the collective.

    Returns:
        (..., seqlen, ...) on every rank, positions in sequence order
    """
    rank, world_size = _rank_and_size(group)
    n_held = len(chunks_of(rank, world_size, layout))
    require(
        x.shape[dim] % n_held == 0,
        f"A {layout!r} shard holds {n_held} equal chunks, but its length on dim {dim} is {x.shape[dim]}.",
    )
    gathered = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    pieces: dict[int, torch.Tensor] = {}  # chunk index -> its positions
    for r, shard_x in enumerate(gathered):
        pieces.update(zip(chunks_of(r, world_size, layout), shard_x.chunk(n_held, dim=dim), strict=True))
    return torch.cat([pieces[c] for c in range(num_chunks(layout, world_size))], dim=dim)
