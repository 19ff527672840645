"""Tile shapes, warps and pipeline depth per (GPU generation, pass, head dim).

The tables are measured, not guessed: docs/tuning-log.md records each entry's numbers. The
Triton interpreter (CPU tensors) gets small tiles so the tests run fast. ``override`` swaps in other
configs for a tuning sweep without touching the tables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class TileConfig:
    """block_m: query rows per tile; block_n: key rows per tile; num_warps, num_stages: as in Triton."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# pass -> [(largest padded head dim it serves, config)], smallest first.
_HOPPER = {
    "forward": [
        (64, TileConfig(128, 64, 4, 3)),
        (128, TileConfig(128, 64, 8, 3)),
        (256, TileConfig(64, 64, 4, 3)),
    ],
    "backward_dkdv": [
        (64, TileConfig(32, 128, 4, 4)),
        (128, TileConfig(64, 128, 8, 3)),
        (256, TileConfig(64, 64, 8, 1)),
    ],
    "backward_dq": [
        (64, TileConfig(128, 64, 8, 3)),
        (128, TileConfig(128, 64, 8, 3)),
        (256, TileConfig(128, 32, 8, 3)),
    ],
}
# Ampere, Ada and anything else: smaller shared memory, so shallower pipelines.
_OTHER = {
    "forward": [
        (64, TileConfig(128, 64, 4, 3)),
        (128, TileConfig(128, 64, 8, 2)),
        (256, TileConfig(64, 64, 8, 1)),
    ],
    "backward_dkdv": [
        (64, TileConfig(64, 64, 4, 2)),
        (128, TileConfig(64, 64, 8, 1)),
        (256, TileConfig(32, 64, 8, 1)),
    ],
    "backward_dq": [
        (64, TileConfig(64, 64, 4, 2)),
        (128, TileConfig(64, 64, 8, 1)),
        (256, TileConfig(64, 32, 8, 1)),
    ],
}
INTERPRETER = TileConfig(32, 64, 4, 1)
# Whether the backward adds dQ with fp32 atomics inside the dK/dV kernel (5 matrix products per
# tile pair) instead of a separate dQ kernel (7), when the caller allows non-determinism.
ATOMIC_DQ = {"hopper": False, "other": False, "interpreter": False}

_overrides: dict[str, TileConfig | bool] = {}


def padded_head_dim(head_dim: int) -> int:
    """The power-of-two tile width (at least 16, the smallest matrix-product width) for a head dim."""
    return max(16, triton.next_power_of_2(head_dim))


def config(pass_name: str, device: torch.device, head_dim: int, head_dim_v: int) -> TileConfig:
    """The tile config for ``pass_name`` ('forward', 'backward_dkdv', 'backward_dq') on ``device``."""
    if pass_name in _overrides:
        return _overrides[pass_name]
    if device.type != "cuda":
        return INTERPRETER
    table = _HOPPER if torch.cuda.get_device_capability(device)[0] == 9 else _OTHER
    width = padded_head_dim(max(head_dim, head_dim_v))
    return next(cfg for largest, cfg in table[pass_name] if width <= largest)


def use_atomic_dq(device: torch.device) -> bool:
    """Whether a non-deterministic backward on ``device`` accumulates dQ with atomics."""
    if "atomic_dq" in _overrides:
        return bool(_overrides["atomic_dq"])
    if device.type != "cuda":
        return ATOMIC_DQ["interpreter"]
    return ATOMIC_DQ["hopper" if torch.cuda.get_device_capability(device)[0] == 9 else "other"]


@contextlib.contextmanager
def override(**configs: TileConfig | bool) -> Iterator[None]:
    """Inside the block use the given configs (keyed by pass name: forward, backward_dkdv,
    backward_dq) and atomic_dq=True/False, e.g. for a tuning sweep."""
    unknown = set(configs) - {"forward", "backward_dkdv", "backward_dq", "atomic_dq"}
    if unknown:
        raise ValueError(f"unknown names {sorted(unknown)}; use forward, backward_dkdv, backward_dq, atomic_dq")
    saved = dict(_overrides)
    _overrides.update(configs)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
