"""Host-side sizes every launcher computes: grids, tile widths, the GPU generation."""

from __future__ import annotations

import functools

import torch

from flashtile.errors import InputError


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: the launchers (attention and decode) run it on every call, and
    ``triton.cdiv``, a constexpr function, costs microseconds per host call."""
    return -(-a // b)


MAX_GRID_YZ = 65535
"""The largest y and z of a CUDA grid."""


def head_grid(tiles: int, batch: int, nheads: int) -> tuple[int, int, int]:
    """The grid (tiles, nheads, batch) of an attention kernel (``attention.tiles.batch_head`` reads it back); a clear
    error, before any launch, for more batch entries or heads than a grid holds."""
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise InputError(
            f"flashtile's CUDA kernels take at most {MAX_GRID_YZ} batch entries (sequences) and {MAX_GRID_YZ} heads "
            f"per call, got batch {batch} and nheads {nheads}: split the batch into several calls."
        )
    return tiles, nheads, batch


def padded_head_dim(head_dim: int) -> int:
    """The power-of-two tile width (at least 16, the smallest matrix-product width) for a head dim (plain
    Python: it runs on every launch, and triton.next_power_of_2 costs ~2 µs a call)."""
    return max(16, 1 << (head_dim - 1).bit_length())


@functools.cache
def compute_capability(device_index: int | None) -> tuple[int, int]:
    """(major, minor) of a CUDA device ((9, 0) for Hopper), looked up once per device: the launchers ask on
    every call."""
    return torch.cuda.get_device_capability(device_index)
