"""Tile shapes and the split count of the decode kernels.

Decoding reads the whole KV cache for a few query rows, so its speed is the speed of that read: the
key tile is wide enough to keep loads in flight, and when batch x kv-heads leaves SMs idle the keys are
split across programs ("flash-decoding"). The CUDA numbers for head dims up to 128 come from H200 sweeps
with benchmarks/tune_decode.py (docs/tuning/decode.md; measured with the
kernel of that time, which still launched the append and the merge separately); the D > 128 tile is a
first choice, not measured. The Triton interpreter gets small tiles so the tests run fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtile.ops._device import sm_count
from flashtile.ops.common.grid import cdiv

MAX_SPLITS = 128
MAX_BLOCK_M = 64  # packed query rows (tokens x heads of one kv group) per program
WIDE_MERGE = 16
"""The most splits the heuristic lets read a single key tile each: more splits than this get at least two tiles each
(``num_splits``), down to WIDE_MERGE. H200, B=1 (8 programs), Hkv 8, D 128, (128, 4, 2) config, graph µs per step by
split count: paged 4k (32 tiles) 21.9 with 16 splits, 22.6 with 24, 24.1 with 32; paged 2k (16 tiles) 17.9 with 16
against 19.0 with 8; paged 16k (128 tiles) 39.4 with 32 against 41.7 with 16: a wide merge pays off only when the splits
have more than one tile to read. Re-measured on 2026-12-02 with that day's kernel: paged 4k 18.8 µs with 32 splits
against 19.5 with 16 (one process), but with the new keys' own split (``split_kv.NEW_SPLIT``)
19.5-19.7 with 33 against 19.1-19.4 with 17 (two interleaved rounds each, docs/tuning/decode.md, 2026-12-02): kept."""


@dataclass(frozen=True)
class DecodeConfig:
    """block_n: key rows per tile; num_warps, num_stages: as in Triton; programs_per_sm: how many programs
    (batch x nheads_k x query tiles x splits) the split heuristic aims at per SM; fixed_row_strides: compile the
    caches' row strides into the kernel (one compile per stride, i.e. per model's nheads_k x head_dim) instead of
    reading them at run time."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 2
    fixed_row_strides: bool = False


INTERPRETER = DecodeConfig(32, 4, 1)
CUDA_HEAD_DIM_128 = DecodeConfig(128, 4, 2)  # head dims <= 128
CUDA_HEAD_DIM_256 = DecodeConfig(64, 8, 2)
CUDA_FEW_PROGRAMS = DecodeConfig(64, 4, 3, programs_per_sm=1, fixed_row_strides=True)
"""Head dims <= 128, a contiguous cache and at most one program per SM before splitting (batch x kv heads x query
tiles <= the SM count: B <= 16 with 8 kv heads on the H200), unless every split would read at most two key tiles
(``config_and_splits``): one program per SM with two key tiles in flight (CUDA_FEW_PROGRAMS_LONG: two of 128 keys, for
long splits). H200, B=1, Hkv 8, D 128, graph µs per step at 16 splits (the kernel of 2026-12-02): 4k 16.6, 16k 31.9, 64k
78.9 against 17.5, 32.7, 79.0 for (128, 8, 3), the config before, and 17.8, 35.1, 88.3 for (128, 4, 2) at 16 splits. A
paged cache is slower with it (64k: 145 µs at 16 splits, 86-95 at 32-48, against 83.8 for the general config), so paged
caches keep the general config.

Up to one program per SM, not only B=1's 8 (2026-12-03; the general config (128, 4, 2) with its split count -> this
rule, graph µs per step, one new token, Hq 32, two interleaved rounds in one process): B=2 4k 21.70 -> 20.05; B=4 1k
15.64 -> 14.72, 4k 30.55 -> 29.94, 16k 77.59 -> 76.56; B=8 1k 20.50
-> 19.96, 4k 47.60 -> 47.57; B=16 1k 29.54 -> 29.06, 4k 77.30 -> 75.83, 16k 249.9 -> 247.2, 64k 943.2 -> 933.2 (the
long rows with CUDA_FEW_PROGRAMS_LONG).

fixed_row_strides (2026-12-04): its one-token step compiles for sm_90 (Triton 3.7.1) to 138 registers and 2,280
instructions instead of 183 and 2,320. Graph µs, runtime -> compiled-in strides, median of three alternating processes:
B=16 1k Hq 32 28.22 -> 27.97, Hq 64 28.67 -> 28.38,
B=8 1k 19.71 -> 19.65, but B=4 1k 14.46 -> 14.56, 4k 29.86 -> 29.92, B=1 4k 15.42 -> 15.49, 16k 30.69 -> 30.78, B=16
1k with 4 query tokens 29.73 -> 29.89 (rows of other configs, unchanged code, moved 0 to +0.3% in the same
processes). 2026-12-04 measured B=16 1k 1.1-1.7% faster and B=4 / B=1 4k 0.3-0.5% faster. Kept for B=16, the row at
parity with cuDNN; the small-batch rows, 1.05-1.15x SDPA at 8b5b4b6, move within noise. The 128-key configs keep runtime
strides: with them compiled in (2026-12-04) CUDA_FEW_PROGRAMS_LONG was 0.3-0.9% slower and CUDA_HEAD_DIM_128
spilled."""
CUDA_FEW_PROGRAMS_LONG = DecodeConfig(128, 4, 3, programs_per_sm=1)
CUDA_FP32 = DecodeConfig(64, 4, 2)
CUDA_FP32_HEAD_DIM_256 = DecodeConfig(32, 8, 2)
"""Float32 caches: the 16-bit configs' tiles at half the rows, so two stages of K and V fit in shared memory."""
DEEP_PIPELINE_TILES = 64
"""CUDA_FEW_PROGRAMS with more bytes in flight, for splits of at least DEEP_PIPELINE_TILES of its (64-key) tiles: H200,
graph µs per step, (64, 4, 3) -> (64, 4, 4), three 64-key tiles in flight (2026-12-03), by 64-key tiles per split: 1024
(B=16 64k) 976.7 -> 933.2, 256 (B=16 16k) 256.6 -> 247.2, 128 (B=1 128k) 138.0 -> 134.8, 64 (B=1 64k) 78.46 -> 77.54,
B=16 4k 76.85 -> 75.83, B=4 16k 77.44 -> 76.56; but 32 (B=8 4k) 47.57 -> 48.0, 16 (B=4 4k) 29.94 -> 30.39, B=1 16k 30.96
-> 31.23, B=16 1k 29.06 -> 29.08, and 4-8 tiles 0.5-1.1 µs slower (B=1 4k 15.60 -> 16.35). Then (64, 4, 4) -> (128, 4,
3), two 128-key tiles in flight and half the softmax steps (2026-12-03, the kernel with column sums): B=16 4k 75.82 ->
75.36, 16k 247.8 -> 247.1, 64k 936.7 -> 937.9, B=4 16k 77.27 -> 76.75, B=1 64k 77.70 -> 77.57, 128k 134.96 -> 134.52.
All
measured with one query token (16-row tiles); taller tiles (several query tokens) take the same configs, not timed."""


# A host helper in plain Python (as ``cdiv``): it runs on every decode step, and Triton's own
# ``triton.next_power_of_2`` is a constexpr function that costs microseconds per call on the host.
def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1; 0 for 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def config(
    device: torch.device, head_dim: int, programs: int | None = None, paged: bool = True, element_size: int = 2
) -> DecodeConfig:
    """The tile config of the split-KV kernel for ``head_dim`` (the larger of headdim and headdim_v),
    ``programs`` = batch x nheads_k x query tiles (None: more than the SMs), a ``paged`` cache or not (the
    defaults: the general config), and cache elements of ``element_size`` bytes (float32: CUDA_FP32)."""
    if device.type != "cuda":
        return INTERPRETER
    if element_size == 4:
        return CUDA_FP32 if head_dim <= 128 else CUDA_FP32_HEAD_DIM_256
    if head_dim > 128:
        return CUDA_HEAD_DIM_256
    if paged or programs is None or programs > sm_count(device):
        return CUDA_HEAD_DIM_128
    return CUDA_FEW_PROGRAMS


def block_m(packed_rows: int) -> int:
    """Query rows per program for ``packed_rows`` = seqlen_q x (nheads // nheads_k): a power of two in
    [16, MAX_BLOCK_M] (16 is the smallest matrix-product height)."""
    return max(16, min(MAX_BLOCK_M, next_power_of_2(packed_rows)))


def choose_num_splits(programs: int, num_sms: int, programs_per_sm: int = 2) -> int:
    """How many splits of the keys the heuristic wants for ``programs`` = batch x nheads_k x query tiles on
    ``num_sms`` SMs: about ``programs_per_sm`` programs per SM in all, rounded down (on the H200 with two per SM,
    two splits of 128 programs beat three, and 256 or more programs want no split); ``num_splits`` caps it.
    """
    return max(1, programs_per_sm * num_sms // programs)


def num_splits(requested: int, device: torch.device, programs: int, seqlen_cache: int, cfg: DecodeConfig) -> int:
    """The split count to launch: ``requested``, or the heuristic's choice for ``cfg`` when it is 0
    (``choose_num_splits``), capped at the number of key tiles of the cache and at MAX_SPLITS. ``programs`` =
    batch x nheads_k x query tiles.

    One key tile per split is allowed up to WIDE_MERGE splits: on the H200 at B=1 (Hkv 8, D 128) a 1k context took
    9.3 µs per step with 8 splits of one tile against 10.6 with 4 of two, 2k 10.6 with 16 against 11.2 with 8; B=4
    at 1k 10.8 with 8 against 10.6 with 4. Past
    WIDE_MERGE the heuristic gives each split two tiles or more (``WIDE_MERGE``)."""
    tiles = cdiv(seqlen_cache, cfg.block_n)
    if requested > 0:
        return max(1, min(requested, tiles, MAX_SPLITS))
    splits = min(choose_num_splits(programs, sm_count(device), cfg.programs_per_sm), tiles, MAX_SPLITS)
    if splits > WIDE_MERGE and 2 * splits > tiles:
        splits = max(WIDE_MERGE, tiles // 2)
    return max(1, splits)


def config_and_splits(
    requested: int,
    device: torch.device,
    head_dim: int,
    programs: int,
    paged: bool,
    seqlen_cache: int,
    element_size: int = 2,
) -> tuple[DecodeConfig, int]:
    """The config (``config``) and split count (``num_splits``) of a launch, with two exceptions. Where the
    few-programs config would give each split DEEP_PIPELINE_TILES key tiles or more, CUDA_FEW_PROGRAMS_LONG runs
    instead. Where it would leave every split at most two key tiles, the general config runs instead (with its own split
    count), since four warps with two stages start and finish a tile sooner; from three tiles per split the few-programs
    config's deeper pipeline wins. H200, B=1 (8 programs), Hkv 8, D 128, graph µs per step, general / few-programs
    config with the split heuristic, one process: 1k 13.4 / 14.5 and 2k 15.5 / 16.3 (one tile per split), 3k 17.6 / 18.5
    and 4k 18.9 / 19.3 (two), 6k 22.6 / 21.9 and 8k 25.9 / 24.1 (three, four), 64k 85.2 / 81.8 (the few-programs config
    then (128, 8, 3): its two tiles per split reached 4k at B=1, the (64, 4, 3) config's reach 2k). On 2026-12-02 (that
    day's kernel): 1k 11.5 against 12.2 for (64, 4, 3) at 16 splits of one tile, 4k 17.8 (general, 16 splits) against
    16.6 (four tiles each). Measured at 8 programs only: with fewer (Hkv < 8) the few-programs config
    splits more, so the switch reaches longer caches, not timed."""
    cfg = config(device, head_dim, programs, paged, element_size)
    splits = num_splits(requested, device, programs, seqlen_cache, cfg)
    if cfg == CUDA_FEW_PROGRAMS:
        tiles_per_split = cdiv(cdiv(seqlen_cache, cfg.block_n), splits)
        if tiles_per_split <= 2:
            cfg = CUDA_HEAD_DIM_128
            splits = num_splits(requested, device, programs, seqlen_cache, cfg)
        elif tiles_per_split >= DEEP_PIPELINE_TILES:
            cfg = CUDA_FEW_PROGRAMS_LONG  # the same programs per SM: the same split count
    return cfg, splits
