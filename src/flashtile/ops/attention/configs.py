"""Tile shapes, warps and pipeline depth per (GPU generation, pass, head dim).

The tables are measured, not guessed: docs/tuning/forward.md records each entry's numbers. The
Triton interpreter (CPU tensors) gets small tiles so the tests run fast. ``override`` swaps in other
configs for a tuning sweep without touching the tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flashtile.errors import InputError
from flashtile.ops.common.grid import compute_capability, padded_head_dim


@dataclass(frozen=True)
class TileConfig:
    """block_m: query rows per tile; block_n: key rows per tile; num_warps, num_stages: as in Triton;
    tma: tiles move through the copy engine (tensor descriptors, Hopper and later) where the kernel and the
    tensors allow it (``descriptors.tma_ready``), otherwise through pointer loads."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


# pass -> [(largest padded head dim it serves, config)], smallest first.
_HOPPER = {
    # Tensor-descriptor loads at D <= 128 (N=8k, full/causal: D=64 450/425 against 426/398 with pointer
    # loads, D=128 567/518 against 480/447; docs/tuning/forward.md, 2026-11-30).
    "forward": [
        (64, TileConfig(128, 64, 8, 4, tma=True)),
        (128, TileConfig(128, 128, 8, 3, tma=True)),
        (256, TileConfig(64, 64, 4, 3)),
    ],
    # Not banded, seqlen_k <= SHORT_SEQLEN: at N=1k the 128 x 128 tiles leave each program 8 key tiles,
    # and D=128 fell to 289 TFLOP/s against 394 for (128, 64, 8, 3) with pointer loads (standard table
    # at 5cca84e against aa5bb66; docs/tuning/forward.md).
    "forward_short": [
        (64, TileConfig(128, 64, 8, 4, tma=True)),
        (128, TileConfig(128, 64, 8, 3)),
        (256, TileConfig(64, 64, 4, 3)),
    ],
    # Banded (causal or windowed) with seqlen_k <= SHORT_SEQLEN: smaller query tiles, fewer masked
    # diagonal tiles per program (N=1k causal: 286 vs 260 at D=64, 317 vs 287 at D=128). D=64 (the Triton
    # kernel serves its causal forwards on sm_90 too): three stages with tensor descriptors, 336 TFLOP/s
    # against 300 with pointer loads and 284 for (64, 64, 4, 2) in the standard table (2026-11-30 sweep);
    # 333 in the next table. With softcap, ALiBi, a
    # sink, dropout and a mask all on it spills 472-544 bytes on Triton 3.7.1 (0 on 3.6; 16-72 before), unmeasured.
    "forward_banded_short": [
        (64, TileConfig(64, 64, 4, 3, tma=True)),
        (128, TileConfig(64, 64, 4, 3)),
        (256, TileConfig(64, 64, 4, 3)),
    ],
    # D=128 keeps pointer loads: in the shipped kernel (GQA loop, options) TMA made dK/dV slower there
    # (whole backward at N=8k 340 against 371 TFLOP/s; docs/tuning/forward.md).
    "backward_dkdv": [
        (64, TileConfig(32, 64, 4, 4, tma=True)),
        (128, TileConfig(64, 128, 8, 3)),
        (256, TileConfig(64, 64, 8, 1)),
    ],
    "backward_dq": [
        (64, TileConfig(64, 64, 4, 4, tma=True)),
        (128, TileConfig(64, 64, 4, 3, tma=True)),
        (256, TileConfig(128, 32, 8, 3)),
    ],
    # flashtile.flex_attention's kernels (pointer loads; the tiles shrink to divide the block mask's block sizes).
    # Causal, N=4096, B*N=16k, H=2048/D (docs/tuning/flex.md, 2026-12-06); head dim 256 not swept.
    "flex_forward": [
        (64, TileConfig(128, 64, 4, 3)),
        (128, TileConfig(64, 64, 4, 3)),
        (256, TileConfig(64, 32, 4, 2)),
    ],
    "flex_backward_dq": [
        (64, TileConfig(64, 64, 4, 3)),
        (128, TileConfig(64, 64, 4, 2)),
        (256, TileConfig(32, 32, 4, 1)),
    ],
    "flex_backward_dkdv": [
        (64, TileConfig(64, 64, 4, 3)),
        (128, TileConfig(64, 64, 4, 2)),
        (256, TileConfig(32, 32, 4, 1)),
    ],
    # The float8 forward (ops.fp8; sm_89 and later). Head dims 128 and 256 from a sweep on an H100 at N=8k, full
    # and causal (docs/fp8.md): 64 x 128 tiles with 4 warps at 128 (728 / 616 TFLOP/s full / causal against 652 /
    # 554 for 128 x 128 with 8 warps), 128 x 128 with pointer loads at 256 (820 / 682 against 787 / 654 with tensor
    # descriptors, 644 / 534 for 128 x 64 with 2 stages). Head dim 64 (not swept): the bf16 forward's tiles doubled
    # along the keys. The pointer-load variants spill above head dim 64 (472 to 1096 bytes of stack per thread,
    # compiled for sm_90 with Triton 3.7.1, tests/fp8_compile.py).
    "fp8_forward": [
        (64, TileConfig(128, 128, 8, 3, tma=True)),
        (128, TileConfig(64, 128, 4, 3, tma=True)),
        (256, TileConfig(128, 128, 8, 3)),
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
_OTHER["forward_short"] = _OTHER["forward_banded_short"] = _OTHER["forward"]  # not tuned apart there
INTERPRETER = TileConfig(32, 64, 4, 1)
FLOAT32 = TileConfig(32, 32, 4, 1)
"""Every pass on float32 inputs (CUDA): IEEE float32 products run on the FMA units with both operands in registers,
so the tiles are small. Compiled for sm_90 with Triton 3.6 every variant fits in shared memory, but only the
forward at head dim 64 keeps its values in registers; the others spill (the backward at head dim 256 up to ~24 KB
of stack per thread). float32 on a GPU is for correctness, not speed: use bf16 or fp16 for speed."""
SHORT_SEQLEN = 1024
PASSES = ("forward", "forward_short", "forward_banded_short", "backward_dkdv", "backward_dq")
FLEX_PASSES = ("flex_forward", "flex_backward_dq", "flex_backward_dkdv")
"""The kernels of flashtile.flex_attention (``flashtile.flex.kernel``)."""
FP8_PASSES = ("fp8_forward",)
"""The float8 forward's kernel (``ops.fp8.forward``)."""
ALL_PASSES = PASSES + FLEX_PASSES + FP8_PASSES
_OTHER.update({name: _HOPPER[name] for name in FLEX_PASSES + FP8_PASSES})  # not tuned apart there

_overrides: dict[str, TileConfig] = {}


MASK_MAX_STAGES = 2
"""Pipeline depth with SDPA's attn_mask at head dims above 128 or with 128 x 128 tiles: its tiles are
pipelined too, and three stages of K, V and mask tiles exceed the H200's 227 KiB of shared memory
(tests/sm90_compile.py)."""


def with_mask(cfg: TileConfig, width: int) -> TileConfig:
    """``cfg`` for a launch that reads an attn_mask, at padded head dim ``width``."""
    large = width > 128 or cfg.block_m * cfg.block_n >= 128 * 128
    if large and cfg.num_stages > MASK_MAX_STAGES:
        return dataclasses.replace(cfg, num_stages=MASK_MAX_STAGES)
    return cfg


def config(
    pass_name: str,
    device: torch.device,
    head_dim: int,
    head_dim_v: int,
    has_mask: bool = False,
    element_size: int = 2,
) -> TileConfig:
    """The tile config for ``pass_name`` (one of ALL_PASSES) on ``device`` (``has_mask``: with an
    attn_mask) for inputs of ``element_size`` bytes (float32: ``FLOAT32``)."""
    if pass_name in _overrides:
        return _overrides[pass_name]
    if device.type != "cuda":
        return INTERPRETER
    if element_size == 4:
        return FLOAT32
    table = _HOPPER if compute_capability(device.index)[0] == 9 else _OTHER
    width = padded_head_dim(max(head_dim, head_dim_v))
    cfg = next(cfg for largest, cfg in table[pass_name] if width <= largest)
    return with_mask(cfg, width) if has_mask else cfg


@contextlib.contextmanager
def override(**configs: TileConfig) -> Iterator[None]:
    """Use the given configs (keyed by pass name) inside the block, e.g. for a tuning sweep."""
    unknown = set(configs) - set(ALL_PASSES)
    if unknown:
        raise InputError(f"unknown pass names {sorted(unknown)}; use {', '.join(ALL_PASSES)}")
    saved = dict(_overrides)
    _overrides.update(configs)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
