"""Split-KV attention over a KV cache ("flash-decoding"): one launch appends the new tokens, attends and
merges the splits.

One program per (batch entry x kv head, split, query tile). The query heads of one kv group are packed
into the rows of the tile, row r = token * group + head-in-group, so every key/value tile is read once
for the whole group (GQA/MQA decoding reads the cache nheads // nheads_k times less). A tile is padded to
at least 16 rows for ``tl.dot``; padded rows are computed and never stored.

Keys of batch entry b are the cache positions [leftpad_b, cache_seqlens[b] + seqlen_new), numbered
j = 0 .. seqlen_k - 1 from leftpad_b; masks and ALiBi are bottom-right aligned on them (diag =
seqlen_k - seqlen_q). The last seqlen_new are this step's new tokens. In a launch of one query tile (a
decode step; ``appends_first``) each split first writes those among its keys to the cache and reads them
back there with the others (APPEND_FIRST). Otherwise every program that attends to them reads them from k
and v (keys rotated as the cache will hold them), from j = new_lo on, and the programs of query tile 0
write them to the cache (``append``), after attending.

The key tiles a query tile sees are divided evenly among the splits (without APPEND_FIRST, a step's few new
keys, when there are several splits, go to a split of their own: ``NEW_SPLIT``); each split runs the online
softmax in base 2 over its share, giving its normalised output out_s and natural-log LSE lse_s. With
one split these are the final ``out`` and ``lse``. With more, every split writes them to fp32 buffers
with a leading split dimension and takes a ticket from its tile's counter (below); the split that draws
the last ticket merges all the splits of its tile's rows and writes ``out`` and ``lse``:

    lse = log sum_s exp(lse_s),    out = sum_s exp(lse_s - lse) out_s

A split (or a whole row) that sees no key has out_s = 0 and lse_s = -inf, so it weighs nothing.

Ticket counters: one int32 per (batch entry x kv head, query tile) in a zeroed buffer kept per device
(``split_counters``). A split stores its partials, then (after a barrier of its program, so that every
thread's stores come first) adds 1 to the counter with acquire-release semantics: the stores of every
split that took a ticket before are visible to the split that draws ticket num_splits - 1, which merges
and then sets the counter back to 0, as the next launch expects. Nothing resets it from the host, so a
launch costs no memset and a CUDA graph replays it as it is. The rules that follow:

* One buffer per device, shared by every launch on it: split launches on one device must not run at the
  same time on different streams (nor CUDA graphs holding them be replayed concurrently); launches in
  one stream, or ordered between streams, are fine.
* The buffer grows when a launch needs more counters than it has (``MIN_COUNTERS`` at first, which the
  split heuristic never exceeds: it splits only below two programs per SM). An outgrown buffer is kept
  alive, so a CUDA graph captured with it stays valid.
* A launch captured into a CUDA graph uses the device's buffer when it is large enough. Otherwise (no
  eager split launch of that size ran before the capture) the launch gets a buffer of its own, zeroed
  inside the graph: correct, but one more memset node per such launch in every replay. Run one eager
  step of the largest batch before capturing to avoid it.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashtile._backend import TRITON_INTERPRET
from flashtile.ops._alloc import empty_output
from flashtile.ops._launch import Plans, keyed_for, launch
from flashtile.ops.common.descriptors import tile_descriptor, tma_ready
from flashtile.ops.common.grid import cdiv, compute_capability, padded_head_dim
from flashtile.ops.common.math import IEEE, LN2, LOG2E, tanh
from flashtile.ops.common.paged import cache_slots, clamp, load_rows, load_tile
from flashtile.ops.decode import configs
from flashtile.ops.decode.append import BLOCK_NEW, BLOCK_T, append_new, load_new, store_new
from flashtile.ops.decode.tiles import cache_length, load_rotated
from flashtile.options import AttentionOptions, CacheOptions

MIN_COUNTERS = 1024  # ticket counters of a device's first buffer
MERGE_CHUNK = 4
"""The most splits per unrolled step of the merge (``_merge_splits``, ``merge_chunk``) for tiles of more than 16 query
rows. H200, B=1, Hkv 8, Hq 32, D 128, contiguous: kernel 10.9 / 14.3 / 27.7 -> 10.6 / 12.8 / 26.7 µs at contexts 1k / 4k
/ 16k against one split per step; loading the chunk as one [4, BLOCK_M, DV] tensor instead took 16.8 / 34.0 / 47.5."""
MERGE_CHUNK_16_ROWS = 8
"""The same for 16-row tiles (one token of a GQA group up to 16 heads, the decode steps' usual tile): H200, B=1, Hkv 8,
Hq 32, D 128, graph µs per step, chunk 4 / 8 / 16: contiguous 1k 13.6 / 13.4 / 14.3, 4k 19.7 / 19.2 / 19.4, 16k 35.2
/ 34.8 / 34.8; paged 4k 24.0 / 23.2 / 26.3, 16k 40.3 / 39.8 / 44.3 (docs/tuning/decode.md, 2026-12-01); this
rule against chunk 4 everywhere, one process: contiguous 1k 13.7 ->
13.3, 4k 19.6 -> 19.1, 16k 35.4 -> 34.7, paged 4k 24.1 -> 23.3, 16k 40.6 -> 39.6, B=4 unchanged. Eight at 32-64 rows
spills (sm90_compile: D=64 64 rows 0 -> 56 bytes of stack), so those keep MERGE_CHUNK."""

NEW_SPLIT_MAX = min(BLOCK_NEW.value, BLOCK_T.value)
"""The most new tokens a split launch gives a split of their own (``NEW_SPLIT``): one attention tile and one store tile
of them, a decode step's (or a few speculative tokens'); more are divided among the splits with the cache keys."""
NEW_SPLIT_MAX_KEYS = 1024
"""The most cache positions per split for which the new keys get their own split. H200, Hkv 8, Hq 32, D 128, one new
token, graph µs per step, main / with the split, two interleaved rounds each (docs/tuning/decode.md, 2026-12-02): B=1
contiguous 1k 11.7-12.0 / 11.3-11.4, 2k 13.8 / 13.3-13.4, 4k 17.8-17.9 / 17.3-17.6, 16k 32.8-33.0 / 32.2-32.5 (1024
positions per split); but 64k 79.7-79.8 / 80.3-80.5 (4096) and B=4 16k 80.0-80.4 / 80.6-81.5 (2048): with long splits
the one latency it hides weighs less than the extra program and merge step."""

LATE_APPEND_TILES = tl.constexpr(4)
"""How many key tiles past the first key of a split's unmasked loop its new token must lie for the split to append it
in that loop's first iteration instead of before it (``append_late`` in ``_split_kv_kernel``): the software pipeline
copies tile i + num_stages - 1 in iteration i, so a tile at least num_stages tiles in is copied after the barrier that
follows the stores; at least every decode config's num_stages (tests/test_kvcache.py checks it).

The late append (one-split launches, one new token): the token's load is in flight with the first key tiles instead of
ahead of them. H200, Hkv 8, D 128, graph µs per step, before -> after, two alternating processes each: B=16 1k Hq 32
28.48 / 28.38 -> 28.26 / 28.19, Hq 64 28.93 / 28.86 -> 28.77 / 28.64, 4k 76.29 / 76.03 -> 75.58 / 75.65; B=64 1k, 4k and
B=16 16k unchanged (B=64 runs two programs per SM, which hide the round trip). Split launches keep the append before the
loop: with it late there (the token held in a 16-row tile) B=4 1k and B=1 4k lost 0.5-0.6 µs to the registers
(docs/tuning/decode.md, 2026-12-03)."""

INTERPRETED = tl.constexpr(TRITON_INTERPRET)

INT32_LIMIT = 2**31
"""Element offsets inside one key tile of a contiguous cache from this on are computed in int64 (INT64_OFFSETS), so
that a cache with a huge sequence stride is still read where it is; below it in int32."""

_counters: dict[torch.device, torch.Tensor] = {}  # device -> its ticket counters, int32, zero between launches
_kept: list[torch.Tensor] = []  # buffers a captured CUDA graph may still use: outgrown, or zeroed in a graph


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """Ticket counters for a launch on ``device``: (n,) int32 with n >= ``count``, zero between launches.

    The device's buffer, the same tensor on every call until a call asks for more; during a CUDA graph
    capture that would need a larger one, a buffer for this launch only, whose zeroing the graph records
    (the zeros exist only once the graph replays, so no eager launch may use it). Module docstring: the
    rules for streams and graphs.
    """
    counters = _counters.get(device)
    if counters is not None and counters.numel() >= count:
        return counters
    fresh = torch.zeros(max(MIN_COUNTERS, configs.next_power_of_2(count)), dtype=torch.int32, device=device)
    if _capturing(device):
        _kept.append(fresh)
        return fresh
    if counters is not None:
        _kept.append(counters)
    _counters[device] = fresh
    return fresh


@triton.jit
def cta_barrier():
    """A barrier of all the program's threads, which also orders their global stores before the others' later loads
    (bar.sync). Unlike ``tl.debug_barrier`` it leaves a loop that holds it to Triton's software pipeliner (Triton
    3.6-3.7 do not pipeline a loop with a debug_barrier in it; sm_90 SASS of the decode kernel, docs/tuning/decode.md,
    2026-12-03). The interpreter, which has no inline assembly, takes the debug_barrier."""
    if INTERPRETED:
        tl.debug_barrier()
    else:
        tl.inline_asm_elementwise("bar.sync 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decode_tile(
    acc,
    m_i,
    l_sums,
    q,
    KCache,
    VCache,
    KNew,
    VNew,
    BatchIdx,
    BlockTable,
    Cos,
    Sin,
    KDesc,
    VDesc,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_bt,
    stride_knn,
    stride_vnn,
    stride_cos,
    seqlen_ro,
    num_slots,
    off_b,
    off_hk,
    leftpad,
    start_n,
    tok,
    slope,
    offs_d,
    offs_dv,
    new_lo,
    n_end,
    diag,
    left,
    right,
    qk_scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    MASKED: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    FROM_NEW: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr,
    TMA: tl.constexpr,
    SUMS_BY_COLUMN: tl.constexpr,
):
    """One online-softmax step over the keys [start_n, start_n + BLOCK_N) of one batch entry and kv head,
    those before n_end (the end of the keys this loop reads).

    Keys are read from the cache, or with FROM_NEW (keys >= new_lo, this step's new tokens) from KNew,
    VNew, token j - new_lo, the keys rotated (``append.load_new``). TMA: KDesc, VDesc are tensor descriptors of
    the caches with [1, BLOCK_N, 1, BLOCK_D / BLOCK_DV] blocks, through which the copy engine reads the unmasked
    tiles (of a paged cache, each in one page: ``use_tma``).

    The state: acc [BLOCK_M, BLOCK_DV], the running max m_i [BLOCK_M] (log2 units) and the softmax sums l_sums,
    [BLOCK_M] or with SUMS_BY_COLUMN [BLOCK_M, the kernel's BLOCK_N] by key column, summed over the columns once
    after the loop (``_split_kv_kernel``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_end
    if FROM_NEW:
        k, v = load_new(
            KNew, VNew, stride_knn, stride_vnn, offs_n - new_lo, n_ok, leftpad + offs_n, Cos, Sin, stride_cos,
            seqlen_ro, offs_d, offs_dv, HEAD_DIM, HEAD_DIM_V, ROTARY_DIM, ROTARY_INTERLEAVED,
        )  # fmt: skip
    elif TMA and not MASKED:  # a paged cache's tile, BLOCK_N rows of one page (``use_tma``)
        slot, first = cache_slots(
            leftpad + start_n, True, off_b, BatchIdx, BlockTable, stride_bt, num_slots, PAGE_SIZE, HAS_BATCH_IDX
        )
        at = [slot.to(tl.int32), first.to(tl.int32), off_hk, 0]
        k = KDesc.load(at).reshape(BLOCK_N, offs_d.shape[0])
        v = VDesc.load(at).reshape(BLOCK_N, offs_dv.shape[0])
    elif PAGE_SIZE > 0:
        slot, row = cache_slots(
            leftpad + offs_n, n_ok, off_b, BatchIdx, BlockTable, stride_bt, num_slots, PAGE_SIZE, HAS_BATCH_IDX
        )
        k_rows = KCache + slot * stride_kb + row * stride_kn + off_hk * stride_kh  # [BLOCK_N]
        v_rows = VCache + slot * stride_vb + row * stride_vn + off_hk * stride_vh
        k = load_rows(k_rows, n_ok, offs_d, HEAD_DIM, MASKED)  # [BLOCK_N, D]
        v = load_rows(v_rows, n_ok, offs_dv, HEAD_DIM_V, MASKED)  # [BLOCK_N, DV]
    else:
        slot, first = cache_slots(
            leftpad + start_n, True, off_b, BatchIdx, BlockTable, stride_bt, num_slots, PAGE_SIZE, HAS_BATCH_IDX
        )
        rel = tl.arange(0, BLOCK_N)  # the tile's rows, offsets from its first: the same for every tile
        if INT64_OFFSETS:
            rel = rel.to(tl.int64)
        k_tile = KCache + slot * stride_kb + first * stride_kn + off_hk * stride_kh
        v_tile = VCache + slot * stride_vb + first * stride_vn + off_hk * stride_vh
        k = load_tile(k_tile, rel[:, None] * stride_kn + offs_d[None, :], n_ok, offs_d, HEAD_DIM, MASKED)
        v = load_tile(v_tile, rel[:, None] * stride_vn + offs_dv[None, :], n_ok, offs_dv, HEAD_DIM_V, MASKED)
    # [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]
    qk = tl.dot(q, tl.trans(k), input_precision=IEEE if k.dtype == tl.float32 else None)
    if HAS_SOFTCAP:
        s = tanh(qk * qk_scale) * softcap  # softcap * tanh(scale * qk / softcap), in log2 units
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        distance = tl.abs(tok[:, None] + diag - offs_n[None, :]).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        s = s - slope[:, None] * distance
    if MASKED:
        ok = n_ok[None, :]
        if MASK_LEFT:
            ok = ok & (offs_n[None, :] >= tok[:, None] + diag - left)
        if MASK_RIGHT:
            ok = ok & (offs_n[None, :] <= tok[:, None] + diag + right)
        s = tl.where(ok, s, float("-inf"))
    m_new, m_shift, alpha = _raise_max(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
    if not SUMS_BY_COLUMN:
        l_sums = l_sums * alpha + tl.sum(p, 1)
    elif FROM_NEW:  # a tile of BLOCK_NEW keys: its row sums go to the sums' first column
        first_column = tl.arange(0, l_sums.shape[1]) == 0
        l_sums = l_sums * alpha[:, None] + tl.where(first_column[None, :], tl.sum(p, 1)[:, None], 0.0)
    else:
        l_sums = l_sums * alpha[:, None] + p
    acc = acc * alpha[:, None]
    # [BLOCK_M, BLOCK_N] @ [BLOCK_N, DV] -> [BLOCK_M, DV]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=IEEE if v.dtype == tl.float32 else None)
    return acc, m_new, l_sums


@triton.jit
def _raise_max(m_i, m_seen):
    """The online softmax's step for rows whose running max m_i [ROWS] (log2 units) meets values of max
    m_seen [ROWS]: the new max, the shift to subtract before exp2 (the new max, or 0 where it is still
    -inf, so that exp2 gives 0 rather than NaN for a row that has seen nothing), and exp2(m_i - shift),
    the factor that rescales what was summed so far."""
    m_new = tl.maximum(m_i, m_seen)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_shift, tl.math.exp2(m_i - m_shift)


@triton.jit
def _normalize(acc, m_i, l_i):
    """Online-softmax state acc [ROWS, DV], m_i, l_i [ROWS] (log2 units) -> the output acc / l and the
    natural-log LSE; a row that saw no key (l = 0) gets output 0 and LSE -inf."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    return acc / l_safe[:, None], lse


@triton.jit
def _merge_splits(
    OPart,
    LsePart,
    stride_ps,
    stride_ls,
    row_ok,
    o_mask,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The splits' partials of BLOCK_M rows merged by an online log-sum-exp: OPart [BLOCK_M, BLOCK_DV]
    pointers to split 0's out_s, LsePart [BLOCK_M] to its lse_s; split s is stride_ps / stride_ls further.
    The loop is unrolled by CHUNK splits (``merge_chunk``) whose loads do not depend on each other, so the merge
    waits for about one round trip to L2 per chunk of splits rather than one per split.
    Returns the online-softmax state acc, m, l of ``_normalize``; masked-out elements read as an empty split."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for first in range(0, num_splits, CHUNK):
        for offset in tl.static_range(CHUNK):
            split = first + offset
            s64 = tl.cast(split, tl.int64)
            s_ok = split < num_splits
            # .cg: read from L2, where the other programs' stores are (not a line this SM cached earlier)
            lse_s = tl.load(
                LsePart + s64 * stride_ls, mask=row_ok & s_ok, other=float("-inf"), cache_modifier=".cg"
            ) * LOG2E  # fmt: skip
            o_s = tl.load(OPart + s64 * stride_ps, mask=o_mask & s_ok, other=0.0, cache_modifier=".cg")
            m_i, m_shift, alpha = _raise_max(m_i, lse_s)
            weight = tl.math.exp2(lse_s - m_shift)  # l_s exp2(m_s - shift): split s's softmax sum
            l_i = l_i * alpha + weight
            acc = acc * alpha[:, None] + weight[:, None] * o_s
    return acc, m_i, l_i


@triton.jit
def _split_kv_kernel(
    Q,
    KCache,
    VCache,
    KNew,
    VNew,
    Out,
    Lse,
    OutPart,
    LsePart,
    Counters,
    CacheSeqlens,
    BatchIdx,
    LeftPad,
    BlockTable,
    Alibi,
    Cos,
    Sin,
    KDesc,
    VDesc,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_knb,
    stride_knn,
    stride_knh,
    stride_vnb,
    stride_vnn,
    stride_vnh,
    stride_ob,
    stride_om,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_ps,
    stride_ls,
    stride_bt,
    stride_ab,
    stride_cos,
    nheads_k,
    seqlen_q,
    seqlen_new,
    seqlen_cache,
    seqlen_ro,
    num_slots,
    num_splits,
    left,
    right,
    qk_scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    HAS_SEQLENS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr,
    ROTARY_PER_TOKEN: tl.constexpr,
    HAS_NEW: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    NEW_SPLIT: tl.constexpr,
    APPEND_FIRST: tl.constexpr,
    LATE_APPEND: tl.constexpr,
    TMA: tl.constexpr,
    CHUNK: tl.constexpr,
    ROW_STRIDE_K: tl.constexpr,
    ROW_STRIDE_V: tl.constexpr,
):
    """Q (B, Sq, H, D), caches (slots, rows, Hk, D / DV) -> Out (B, Sq, H, DV) in q's dtype, Lse (B, H, Sq) fp32.

    HAS_NEW: KNew (B, Sn, Hk, D) and VNew (B, Sn, Hk, DV), Sn = seqlen_new, are this step's new tokens, the
    last keys of each batch entry: appended to the caches (``append.append_new``) by the splits that hold them
    before they attend (APPEND_FIRST), or else read from KNew, VNew (``append.load_new``) and appended by the
    programs of query tile 0 after, the token tiles divided among the splits.

    GROUP = nheads // nheads_k, a constexpr: the packed rows' division by it (every program's first instructions)
    is then a constant's, a shift for powers of two. INT64_OFFSETS: ``INT32_LIMIT``.

    NEW_SPLIT (IS_SPLIT, HAS_NEW, short splits and few new tokens: ``NEW_SPLIT_MAX``, ``NEW_SPLIT_MAX_KEYS``): the last
    split attends to the new keys alone and appends them; the others divide the cache keys among them.

    APPEND_FIRST (HAS_NEW, one query tile, queries, no left window: ``appends_first``): each split first writes the
    new tokens among its keys to the cache and then reads them there with the cache keys, in the same loops; no
    program reads them from KNew, VNew and none appends after attending.

    TMA: KDesc and VDesc are tensor descriptors of the caches (``use_tma``), through which the copy engine reads the
    unmasked key tiles; without TMA they are None.

    IS_SPLIT (num_splits > 1): split s also writes its partials to OutPart (S, B, Sq, H, DV) and LsePart
    (S, B, H, Sq), fp32, laid out as Out and Lse behind a split stride (stride_ps, stride_ls), and takes a
    ticket from Counters (B * Hk, query tiles) int32, zero between launches; the last split to finish a
    tile merges (module docstring), CHUNK splits per unrolled step (``merge_chunk``). Without IS_SPLIT, OutPart,
    LsePart and Counters are not read.
    ROW_STRIDE_K, ROW_STRIDE_V: the caches' row strides (stride_kn, stride_vn) as constants, so that the key tiles'
    addresses fold them in (``DecodeConfig.fixed_row_strides``); 0: that cache's runtime stride.
    Index values are clamped into the cache (``tiles``): bad ones give wrong numbers, never a bad access.
    """
    if ROW_STRIDE_K:
        stride_kn = ROW_STRIDE_K
    if ROW_STRIDE_V:
        stride_vn = ROW_STRIDE_V
    off_bhk = tl.program_id(0)
    split = tl.program_id(1)
    tile_m = tl.program_id(2)
    off_b = off_bhk // nheads_k
    off_hk = off_bhk % nheads_k
    b64 = tl.cast(off_b, tl.int64)

    cache_len = cache_length(CacheSeqlens, off_b, seqlen_cache, seqlen_new, HAS_SEQLENS)
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = clamp(tl.load(LeftPad + off_b), 0, cache_len)
    seqlen_k = cache_len + seqlen_new - leftpad
    diag = seqlen_k - seqlen_q

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (token, head in group)
    row_ok = rows < seqlen_q * GROUP
    tok = rows // GROUP
    off_h = off_hk * GROUP + rows % GROUP  # [BLOCK_M] query heads
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k_new = KNew
    v_new = VNew
    if HAS_NEW:
        k_new = KNew + b64 * stride_knb + off_hk * stride_knh  # token 0 of this batch entry and kv head
        v_new = VNew + b64 * stride_vnb + off_hk * stride_vnh

    q_rows = Q + b64 * stride_qb + tok * stride_qm + off_h * stride_qh  # [BLOCK_M]
    if ROTARY_PER_TOKEN:
        q_pos = cache_len + tok
    else:
        q_pos = cache_len + tl.zeros_like(tok)
    q = load_rotated(
        q_rows, row_ok, q_pos, Cos, Sin, stride_cos, seqlen_ro, offs_d, HEAD_DIM, ROTARY_DIM, ROTARY_INTERLEAVED
    )
    slope = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_ab + off_h) * LOG2E

    # The keys any row of this tile sees: [lo, hi); the keys every row sees: [full_lo, full_hi).
    first_tok = tile_m * BLOCK_M // GROUP
    last_tok = tl.minimum((tile_m * BLOCK_M + BLOCK_M - 1) // GROUP, seqlen_q - 1)
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if MASK_LEFT:
        lo = tl.maximum(first_tok + diag - left, 0)
        full_lo = tl.maximum(last_tok + diag - left, 0)
    if MASK_RIGHT:
        hi = tl.minimum(tl.maximum(last_tok + diag + right + 1, 0), seqlen_k)
        full_hi = tl.minimum(tl.maximum(first_tok + diag + right + 1, 0), seqlen_k)
    new_lo = seqlen_k  # the first key read from KNew, VNew (none with APPEND_FIRST)
    first_new = seqlen_k - seqlen_new
    if HAS_NEW:
        if not APPEND_FIRST:
            new_lo = first_new
        if TMA or not APPEND_FIRST:
            # the cache keys' tiles end there: masked (pointer loads, which see the program's own stores of
            # APPEND_FIRST after its barrier; the copy engine's reads would need a proxy fence)
            full_hi = tl.minimum(full_hi, first_new)
        hi = tl.where(seqlen_q > 0, hi, 0)  # a call without queries only appends
    lo = lo // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, lo)
    # This split's share of the key tiles, [start, end): cache keys in tiles masked | unmasked | masked up
    # to cache_end, then the new keys from max(start, new_lo) in tiles of BLOCK_NEW. An empty segment is skipped
    # before its loop: the software pipeline's prologue would otherwise compute the addresses of its first tiles
    # and issue their (predicated-off) loads. Decode steps are chains of dependent instructions with one warp
    # per SM sub-partition, so every instruction counts (docs/tuning/decode.md, 2026-12-02).
    # With NEW_SPLIT the last split takes the new keys alone: they are read (and appended) off the other splits'
    # path, each of which would otherwise add a dependent load after its pipelined loop.
    shared_hi = hi
    shared_splits = num_splits
    if NEW_SPLIT:
        shared_hi = tl.maximum(tl.minimum(hi, new_lo), lo)
        shared_splits = num_splits - 1
    tiles_per_split = tl.cdiv(tl.cdiv(shared_hi - lo, BLOCK_N), shared_splits)
    start = tl.minimum(lo + split * tiles_per_split * BLOCK_N, shared_hi)
    end = tl.minimum(start + tiles_per_split * BLOCK_N, shared_hi)
    if NEW_SPLIT:
        end = tl.where(split == shared_splits, hi, end)  # its start is shared_hi
    cache_end = end
    if HAS_NEW:
        cache_end = tl.minimum(end, new_lo)
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, start), cache_end)
    mid_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N * BLOCK_N, mid_lo), cache_end)
    # APPEND_FIRST: this split's new tokens, keys [max(start, first_new), end), go to the cache its loops read, either
    # here or (append_late) in the first iteration of the unmasked loop (segment 1 below), where the key tiles in flight
    # hide the token's load (docs/tuning/decode.md, 2026-12-03). Late only in one-split launches of one new token
    # (LATE_APPEND), where that loop runs and the token lies LATE_APPEND_TILES tiles or more past its first key (so
    # that its tile, in the loop or after it, is copied after the barrier that follows the stores).
    append_late = False
    if LATE_APPEND:
        append_late = (mid_lo < mid_hi) & (first_new - mid_lo >= LATE_APPEND_TILES * BLOCK_N)
    if APPEND_FIRST:
        if not append_late:
            append_new(
                k_new, v_new, KCache, VCache, BatchIdx, BlockTable, Cos, Sin, stride_knn, stride_vnn,
                stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, stride_cos, seqlen_ro,
                num_slots, off_b, off_hk, cache_len, tl.maximum(start - first_new, 0), end - first_new, BLOCK_T,
                offs_d, offs_dv, HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, HAS_BATCH_IDX, ROTARY_DIM, ROTARY_INTERLEAVED,
            )  # fmt: skip
            tl.debug_barrier()  # every thread's stores before any thread's loads of those rows
    if LATE_APPEND:  # the one new token, loaded here (when append_late) and stored in the loop's first iteration
        t_late = tl.arange(0, 1)
        late_ok = (t_late < end - first_new) & append_late
        k_late, v_late = load_new(
            k_new, v_new, stride_knn, stride_vnn, t_late, late_ok, cache_len + t_late, Cos, Sin, stride_cos,
            seqlen_ro, offs_d, offs_dv, HEAD_DIM, HEAD_DIM_V, ROTARY_DIM, ROTARY_INTERLEAVED,
        )  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # The softmax sums. Sixteen rows (one matrix-product height) are shared by all the warps, each holding other key
    # columns of a tile, so a sum per row and tile would be a cross-warp exchange through shared memory, three
    # barriers on every tile: they are kept by key column instead, an FFMA per element, and summed once after the
    # loop (docs/tuning/decode.md, 2026-12-03). Taller tiles keep row sums: their BLOCK_M x BLOCK_N columns would cost
    # 32-64 registers a thread, and spill.
    SUMS_BY_COLUMN: tl.constexpr = BLOCK_M == 16
    if SUMS_BY_COLUMN:
        l_sums = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        l_sums = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for segment in tl.static_range(4):  # the four ranges above, each with its tile width and masking
        if segment == 0:
            seg_lo, seg_hi = start, mid_lo
        elif segment == 1:
            seg_lo, seg_hi = mid_lo, mid_hi
        elif segment == 2:
            seg_lo, seg_hi = mid_hi, cache_end
        else:
            seg_lo, seg_hi = tl.maximum(start, new_lo), end
        if segment < 3 or (HAS_NEW and not APPEND_FIRST):
            if seg_lo < seg_hi:
                for start_n in range(seg_lo, seg_hi, BLOCK_N if segment < 3 else BLOCK_NEW):
                    if LATE_APPEND and segment == 1:
                        if append_late and start_n == seg_lo:
                            store_new(
                                k_late, v_late, t_late, late_ok, KCache, VCache, BatchIdx, BlockTable, stride_kb,
                                stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, num_slots, off_b,
                                off_hk, cache_len, offs_d, offs_dv, HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, HAS_BATCH_IDX,
                            )  # fmt: skip
                            cta_barrier()  # the stores before the copy of their tile (a later iteration)
                    acc, m_i, l_sums = _decode_tile(
                        acc, m_i, l_sums, q, KCache, VCache, k_new, v_new, BatchIdx, BlockTable, Cos, Sin, KDesc, VDesc,
                        stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, stride_knn,
                        stride_vnn, stride_cos, seqlen_ro, num_slots, off_b, off_hk, leftpad, start_n, tok, slope,
                        offs_d, offs_dv, new_lo, end if segment == 3 else new_lo, diag, left, right, qk_scale, softcap,
                        HEAD_DIM, HEAD_DIM_V, BLOCK_N if segment < 3 else BLOCK_NEW, PAGE_SIZE, INT64_OFFSETS,
                        HAS_BATCH_IDX, segment != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, segment == 3,
                        ROTARY_DIM, ROTARY_INTERLEAVED, TMA, SUMS_BY_COLUMN,
                    )  # fmt: skip

    if SUMS_BY_COLUMN:
        l_sums = tl.sum(l_sums, 1)
    out, lse = _normalize(acc, m_i, l_sums)
    o_rows = b64 * stride_ob + tok * stride_om + off_h * stride_oh  # [BLOCK_M] row offsets in Out (and OutPart)
    l_rows = b64 * stride_lb + off_h * stride_lh + tok  # [BLOCK_M] in Lse (and LsePart)
    o_ptrs = o_rows[:, None] + offs_dv[None, :]  # [BLOCK_M, BLOCK_DV]
    o_mask = row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    if IS_SPLIT:
        s64 = tl.cast(split, tl.int64)
        tl.store(OutPart + s64 * stride_ps + o_ptrs, out, mask=o_mask)
        tl.store(LsePart + s64 * stride_ls + l_rows, lse, mask=row_ok)
        tl.debug_barrier()  # every thread's stores before the ticket, which one thread takes with release
        counter = Counters + off_bhk * tl.num_programs(2) + tile_m
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:  # the other splits have stored theirs
            acc, m_i, l_i = _merge_splits(
                OutPart + o_ptrs, LsePart + l_rows, stride_ps, stride_ls, row_ok, o_mask, num_splits, BLOCK_M,
                BLOCK_DV, CHUNK,
            )  # fmt: skip
            out, lse = _normalize(acc, m_i, l_i)
            tl.store(Out + o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
            tl.store(Lse + l_rows, lse, mask=row_ok)
            tl.store(counter, 0)  # no other program touches it in this launch any more
    else:
        tl.store(Out + o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
        tl.store(Lse + l_rows, lse, mask=row_ok)

    # Without APPEND_FIRST, the new tokens to the cache, for the steps to come (this launch reads them from KNew,
    # VNew): token tiles split, split + num_splits, ... by query tile 0; with NEW_SPLIT their one tile by the last
    # split (the others' first tile, num_splits - 1 - split, lies past the new tokens). Last, so that under the
    # interpreter, which runs the programs one by one, a program that read new keys from the cache would read stale
    # rows.
    if HAS_NEW and not APPEND_FIRST:
        if tile_m == 0:
            first_tile = split
            if NEW_SPLIT:
                first_tile = num_splits - 1 - split
            append_new(
                k_new, v_new, KCache, VCache, BatchIdx, BlockTable, Cos, Sin, stride_knn, stride_vnn,
                stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, stride_cos, seqlen_ro,
                num_slots, off_b, off_hk, cache_len, first_tile * BLOCK_T, seqlen_new, num_splits * BLOCK_T, offs_d,
                offs_dv, HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, HAS_BATCH_IDX, ROTARY_DIM, ROTARY_INTERLEAVED,
            )  # fmt: skip


class DecodePlan(NamedTuple):
    """What a decode launch follows from its inputs' layouts and options (``_plan_key``), kept per key: the split
    count with the new keys' own split (``num_splits``), the ticket counters it needs with splits (``programs``:
    batch x nheads_k x query tiles), the grid, the kernel's int arguments (strides, lengths, the split count, the
    window; the parameters from stride_qb to right), the constexprs, Triton's options (num_warps, num_stages) and
    ``launch``'s ``keyed`` (the constexprs in parameter order and the arguments' ``specialization_key``; None for a
    kernel that is not a compiled JITFunction, the interpreter's); ``tma_blocks``: (BLOCK_N, BLOCK_D, BLOCK_DV) where
    the kernel reads the caches through tensor descriptors (``use_tma``), else None. Nothing a call may change under
    one key: the tensors (inputs, outputs, partials, counters, the caches' descriptors) and the two scales are the
    call's own."""

    num_splits: int
    programs: int
    grid: tuple[int, int, int]
    ints: tuple[int, ...]
    constexprs: dict
    options: dict
    keyed: tuple[list, tuple] | None
    tma_blocks: tuple[int, int, int] | None


_PLANS = Plans()
"""``decode_attention``'s plans by ``_plan_key``."""


def _plan_key(inputs: tuple, settings: tuple) -> tuple:
    """What a plan follows from: each of the inputs' (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, alibi_slopes, rotary_cos, rotary_sin) shape, strides and dtype (None where absent),
    q's device, ``settings`` (window_left, window_right, softcap > 0, rotary_interleaved, rotary_per_token, the
    requested split count and whether a paged launch is being captured in a CUDA graph, ``use_tma``), and whether
    every input's address is 16-byte aligned (Triton specializes on it; the outputs, partials and counters come from
    torch's allocator, aligned). The config and split count (``configs.config_and_splits``) follow from these and
    the device's SM count, and are decided when a plan is made, as are module constants (INT32_LIMIT) read: tests
    and tuning scripts that change them clear ``_PLANS``."""
    layouts = []
    addresses = 0
    for t in inputs:
        if t is None:
            layouts.append(None)
        else:
            layouts.append((t.shape, t.stride(), t.dtype))
            addresses |= t.data_ptr()
    return (*layouts, inputs[0].device, *settings, addresses % 16 == 0)


def appends_first(has_new: bool, seqlen_q: int, m_tiles: int, window_left: int | None) -> bool:
    """Whether a launch writes its new tokens to the cache before attending (APPEND_FIRST) rather than reading them
    from k, v in a tile of their own and appending them after: where every new key lies in the keys of the launch's
    one query tile (``m_tiles`` = 1, ``seqlen_q`` > 0, no left window, which could leave early new keys unseen), so
    that each split writes exactly the new tokens among its own keys and no other program reads those rows.

    H200, Hkv 8, Hq 32, D 128, one new token, graph µs per step against the previous path (a 16-key tile of the new
    keys after the pipelined loop, the append after attending, NEW_SPLIT where it applied), two processes of two
    rounds: contiguous B=1 1k 11.4 -> 10.8, B=16 1k
    31.9 -> 30.2, 4k 80.1-80.6 -> 78.1-78.7, B=64 1k 81.4-81.6 -> 78.6-78.8, paged B=1 4k 18.5 -> 18.0; where the
    cache's last tile stays partly empty (40 positions short) B=16 1k 31.5-31.7 -> 29.9-30.1 but B=1 4k 16.0-16.1 ->
    16.3: the split holding the new token waits for it before its loop (docs/tuning/decode.md, 2026-12-03)."""
    return has_new and seqlen_q > 0 and m_tiles == 1 and window_left is None


def merge_chunk(block_m: int, num_splits: int) -> int:
    """Splits per unrolled step of the merge (``_merge_splits``) of a launch of ``num_splits`` splits and ``block_m``
    query rows per tile: MERGE_CHUNK_16_ROWS for 16-row tiles, else MERGE_CHUNK, but no more than num_splits rounded
    up to a power of two (a step's loads of splits past the last are predicated off, but its arithmetic on the whole
    [block_m, DV] tile is not). 1 without splits.

    H200, Hkv 8, Hq 32, D 128, one new token, graph µs per step, the rule before (8 or 4 whatever the split count) ->
    this one, two interleaved rounds in one process: two
    splits, contiguous B=16 1k 30.05 -> 29.57, 4k 77.63 -> 77.28, paged B=16 1k 31.74 -> 31.31; B=1 (16 splits, the
    same chunk) and B=64 1k (no split) unchanged."""
    return min(MERGE_CHUNK_16_ROWS if block_m == 16 else MERGE_CHUNK, configs.next_power_of_2(num_splits))


def has_copy_engine(device: torch.device) -> bool:
    """Whether ``device`` reads tiles through tensor descriptors: a GPU of sm_90 or later (the tensor memory
    accelerator)."""
    return device.type == "cuda" and compute_capability(device.index)[0] >= 9


def use_tma(
    k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool, captured: bool, leftpad: bool, block_n: int
) -> bool:
    """Whether the kernel reads the unmasked key tiles of these caches through tensor descriptors: a ``paged`` cache
    whose tiles never straddle two pages (``block_n`` divides the page size and no ``leftpad`` shifts the tiles off
    the page boundaries), in a launch ``captured`` in a CUDA graph, on a device with a copy engine
    (``has_copy_engine``), with head dims that fill their tiles (powers of two, at least 16) and caches the copy
    engine can address (``descriptors.tma_ready``).

    Paged caches only, as measured on the H200 (Hkv 8, Hq 32, D 128, one new token, graph µs per step, two
    interleaved rounds against pointer loads): paged B=1 4k
    19.0-19.1 -> 18.2-18.5, 16k 35.6-35.8 -> 33.7-34.2, 64k 84.6-84.8 -> 82.0-82.4, B=4 4k 33.0-33.1 -> 31.6-31.9,
    B=16 4k 83.0 -> 81.1-81.2, B=64 16k 983 -> 966. Contiguous caches gained at most 1-4% (B=4 4k 32.1-32.3 ->
    31.2-31.5) and lost badly on some rows (B=64 1k 81.3 -> 87.5, 16k 960 -> 1092 µs, though the attention alone
    took as long as before), not understood yet (docs/tuning/decode.md, 2026-12-02): they keep pointer loads.

    Captured launches only: Triton encodes a launch's descriptors and walks its arguments in Python on every launch,
    which a graph replay skips but an eager call pays. Eager paged steps (check_values(False), wall clock per call
    over 2000 calls, three interleaved rounds): B=1 1k 105-145 µs
    with pointer loads against 129-135 with descriptors, B=1 4k 79-110 against 132-138, B=4 4k 107-116 against
    133-138, B=1 64k 89-102 against 117-126: ~25 µs more per step, where a step's kernel gains 1-3 µs."""
    return (
        paged
        and captured
        and k_cache.shape[1] % block_n == 0
        and not leftpad
        and has_copy_engine(k_cache.device)
        and k_cache.shape[3] == padded_head_dim(k_cache.shape[3])
        and v_cache.shape[3] == padded_head_dim(v_cache.shape[3])
        and tma_ready(k_cache, v_cache)
    )


def _descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, tma_blocks: tuple[int, int, int] | None) -> tuple:
    """The kernel's KDesc and VDesc: the caches' tensor descriptors with [1, BLOCK_N, 1, BLOCK_D / BLOCK_DV] blocks,
    or two None without ``tma_blocks``."""
    if tma_blocks is None:
        return None, None
    block_n, block_d, block_dv = tma_blocks
    return tile_descriptor(k_cache, block_n, block_d), tile_descriptor(v_cache, block_n, block_dv)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A stand-in of an output a plan is made for: its layout, no memory (outputs are contiguous and aligned)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _make_plan(inputs: tuple, scales: tuple[float, float], settings: tuple) -> tuple[DecodePlan, bool]:
    """``decode_attention``'s plan made anew for a call's ``inputs`` (``_plan_key``'s), ``scales`` (qk_scale, softcap,
    whose values the plan does not keep) and ``settings`` (``_plan_key``): the config and split count
    (``configs.config_and_splits``), whether the new keys are appended first (``appends_first``) or get a split of
    their own, and the launch's arguments, its outputs, partials and counters stood in for by their layouts; and
    whether to keep it: only where every input's address is 16-byte aligned (a call with an unaligned input, whose
    key says so, is planned anew each time, its launch key holding its tensors' own alignment)."""
    q, k_cache, v_cache, k, v, seqlens, batch_idx, leftpad, block_table, alibi_slopes, rotary_cos, _ = inputs
    window_left, window_right, has_softcap, rotary_interleaved, rotary_per_token, requested, captured = settings
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    group = nheads // nheads_k
    paged = block_table is not None
    seqlen_cache = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    has_new = k is not None  # None when there are no new tokens (``decode_attention``)
    block_m = configs.block_m(seqlen_q * group)
    m_tiles = max(1, cdiv(seqlen_q * group, block_m))  # one without queries: it appends
    programs = batch * nheads_k * m_tiles
    cfg, num_splits = configs.config_and_splits(
        requested, q.device, max(head_dim, head_dim_v), programs, paged, seqlen_cache, q.element_size()
    )
    append_first = appends_first(has_new, seqlen_q, m_tiles, window_left)
    new_split = (
        has_new
        and not append_first
        and k.shape[1] <= NEW_SPLIT_MAX
        and num_splits > 1
        and cdiv(seqlen_cache, num_splits) <= NEW_SPLIT_MAX_KEYS
    )
    num_splits += new_split  # the new keys' own split
    out = _meta((batch, seqlen_q, nheads, head_dim_v), q.dtype)
    lse = _meta((batch, nheads, seqlen_q), torch.float32)
    out_part = lse_part = counters = None
    if num_splits > 1:
        out_part = _meta((num_splits, *out.shape), torch.float32)
        lse_part = _meta((num_splits, *lse.shape), torch.float32)
        counters = _meta((programs,), torch.int32)
    # the largest element offset inside one key tile of a contiguous cache (``_decode_tile``)
    tile_extent = (cfg.block_n - 1) * max(k_cache.stride(1), v_cache.stride(1)) + max(head_dim, head_dim_v)
    ints = (
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *((*k.stride()[:3], *v.stride()[:3]) if k is not None else (0,) * 6),
        *out.stride()[:3], *lse.stride()[:2],
        0 if out_part is None else out_part.stride(0), 0 if lse_part is None else lse_part.stride(0),
        0 if block_table is None else block_table.stride(0),
        0 if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes.stride(0),
        0 if rotary_cos is None else rotary_cos.stride(0),
        nheads_k, seqlen_q, 0 if k is None else k.shape[1], seqlen_cache,
        0 if rotary_cos is None else rotary_cos.shape[0], k_cache.shape[0], num_splits,
        0 if window_left is None else window_left, 0 if window_right is None else window_right,
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=padded_head_dim(head_dim),
        BLOCK_DV=padded_head_dim(head_dim_v),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        GROUP=group,
        PAGE_SIZE=k_cache.shape[1] if paged else 0,
        INT64_OFFSETS=not paged and tile_extent >= INT32_LIMIT,  # paged tiles keep per-row pointers
        HAS_SEQLENS=seqlens is not None,
        HAS_BATCH_IDX=batch_idx is not None,
        HAS_LEFTPAD=leftpad is not None,
        MASK_LEFT=window_left is not None,
        MASK_RIGHT=window_right is not None,
        HAS_SOFTCAP=has_softcap,
        HAS_ALIBI=alibi_slopes is not None,
        ROTARY_DIM=0 if rotary_cos is None else 2 * rotary_cos.shape[1],
        ROTARY_INTERLEAVED=rotary_interleaved,
        ROTARY_PER_TOKEN=rotary_per_token,
        HAS_NEW=k is not None,
        IS_SPLIT=num_splits > 1,
        NEW_SPLIT=new_split,
        APPEND_FIRST=append_first,
        LATE_APPEND=append_first and num_splits == 1 and k.shape[1] == 1,
        TMA=use_tma(k_cache, v_cache, paged, captured, leftpad is not None, cfg.block_n),
        CHUNK=merge_chunk(block_m, num_splits),
        ROW_STRIDE_K=k_cache.stride(1) if cfg.fixed_row_strides else 0,
        ROW_STRIDE_V=v_cache.stride(1) if cfg.fixed_row_strides else 0,
    )
    tma_blocks = (cfg.block_n, constexprs["BLOCK_D"], constexprs["BLOCK_DV"]) if constexprs["TMA"] else None
    launch_options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tensors = (q, k_cache, v_cache, k, v, out, lse, out_part, lse_part, counters, *inputs[5:])
    args = (*tensors, *_descriptors(k_cache, v_cache, tma_blocks), *ints, *scales)
    keyed = keyed_for(_split_kv_kernel, args, constexprs, launch_options)
    grid = (batch * nheads_k, num_splits, m_tiles)
    aligned = all(t is None or t.data_ptr() % 16 == 0 for t in inputs)
    plan = DecodePlan(num_splits, programs, grid, ints, constexprs, launch_options, keyed, tma_blocks)
    return plan, aligned


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    options: AttentionOptions,
    cache: CacheOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k, v to the caches in place and attend q to each batch entry's keys: one launch.

    Per call: the plan of the inputs' layouts and options (``_plan_key``: made on a key's first call and kept, with
    the config and split count), the scales, and the outputs (and with splits the partials and the counters); the
    launch takes the plan's grid, int arguments, constexprs and launch key as they are.

    Args:
        q: (batch, seqlen_q, nheads, headdim), last dimension contiguous
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim[_v]), or (num_blocks,
            page_block_size, nheads_k, headdim[_v]) with a block_table; last dimension contiguous
        k, v: (batch, seqlen_new, nheads_k, headdim[_v]) new tokens (k rotated on the way in) to append
            at cache_seqlens[b] + [0, seqlen_new), last dimension contiguous; or both None
        options: softmax_scale, softcap (scores softcap * tanh(scale * q k / softcap), scale * q k if softcap = 0),
            the visible band window_left, window_right (bottom-right aligned; None is unbounded) and alibi_slopes
            ((nheads,) or (batch, nheads) fp32, or None); its other fields do not apply to decoding
        cache: the cache's addressing and the rotary tables (``options.CacheOptions``); its num_splits: splits of
            the keys, 0 to choose from the problem size and the SM count; a split launch that does not append
            first (``appends_first``) with at most NEW_SPLIT_MAX new tokens and at most NEW_SPLIT_MAX_KEYS cache
            positions per split gets one more split, which reads the new tokens alone

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, lse (batch, nheads, seqlen_q) float32
    """
    if k is not None and k.numel() == 0:
        k = v = None  # no new tokens: nothing to append
    inputs = (q, k_cache, v_cache, k, v, *_indices(options, cache))
    settings = _settings(options, cache, captured=cache.block_table is not None and _capturing(q.device))
    scales = _scales(options)
    out_shape, lse_shape = _output_shapes(q, v_cache)
    out = empty_output(out_shape, q.dtype, q.device)
    lse = empty_output(lse_shape, torch.float32, q.device)
    if out.numel() == 0 and k is None:
        return out, lse
    plan = _PLANS.plan(_plan_key(inputs, settings), _make_plan, inputs, scales, settings)
    _run(plan, inputs, scales, out, lse)
    return out, lse


def _output_shapes(q: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of out (batch, seqlen_q, nheads, headdim_v) and lse (batch, nheads, seqlen_q)."""
    batch, seqlen_q, nheads, _ = q.shape
    return (batch, seqlen_q, nheads, v_cache.shape[3]), (batch, nheads, seqlen_q)


def _indices(options: AttentionOptions, cache: CacheOptions) -> tuple:
    """The launch's index and table tensors after q, the caches, k and v, in ``_plan_key``'s order."""
    return (cache.cache_seqlens, cache.cache_batch_idx, cache.cache_leftpad, cache.block_table, options.alibi_slopes,
            cache.rotary_cos, cache.rotary_sin)  # fmt: skip


def _settings(options: AttentionOptions, cache: CacheOptions, captured: bool) -> tuple:
    """``_plan_key``'s settings; ``captured``: whether a paged launch is being captured in a CUDA graph (descriptors
    only where a graph replays the launch: ``use_tma``)."""
    return (options.window_left, options.window_right, options.softcap > 0.0, cache.rotary_interleaved,
            cache.rotary_per_token, cache.num_splits, captured)  # fmt: skip


def _scales(options: AttentionOptions) -> tuple[float, float]:
    """The kernel's (qk_scale, softcap): scores softcap * tanh(qk_scale * q k) in base 2 with a softcap, else
    qk_scale * q k with the base-2 factor folded into qk_scale."""
    softmax_scale, softcap = options.softmax_scale, options.softcap
    if softcap > 0.0:
        return softmax_scale / softcap, softcap * LOG2E.value
    return softmax_scale * LOG2E.value, 0.0


def _run(plan: DecodePlan, inputs: tuple, scales: tuple[float, float], out: torch.Tensor, lse: torch.Tensor) -> None:
    """Launch ``plan`` on ``inputs`` (``_plan_key``'s) with ``scales``, writing ``out`` and ``lse``; with splits on
    partials of its own and the device's ticket counters."""
    q, k_cache, v_cache = inputs[:3]
    out_part = lse_part = counters = None
    if plan.num_splits > 1:
        out_part = empty_output((plan.num_splits, *out.shape), torch.float32, q.device)
        lse_part = empty_output((plan.num_splits, *lse.shape), torch.float32, q.device)
        counters = split_counters(q.device, plan.programs)
    tensors = (*inputs[:5], out, lse, out_part, lse_part, counters, *inputs[5:])
    descriptors = _descriptors(k_cache, v_cache, plan.tma_blocks)
    args = (*tensors, *descriptors, *plan.ints, *scales)
    launch(_split_kv_kernel, plan.grid, args, plan.constexprs, plan.keyed, **plan.options)


class PreparedDecode:
    """``decode_attention(q, k_cache, v_cache, None, None, options, cache)[0]`` for calls of one layout: q's, the
    caches' shapes, strides, dtypes, devices and 16-byte alignment as on the call it was prepared from (``prepare``),
    and the same ``options`` and ``cache`` (their tensors and values). The plan, the scales and the index tensors are
    taken once; a call allocates the output (and with splits the partials) and launches. The LSE, which no caller
    of a prepared decode reads, goes to a buffer of its own, written by every call (stream-ordered like the kernel;
    nothing reads it). A paged launch captured in a CUDA graph, which plans its loads otherwise (``use_tma``), goes
    through ``decode_attention``."""

    def __init__(self, plan: DecodePlan, inputs: tuple, scales: tuple[float, float], options: AttentionOptions,
                 cache: CacheOptions) -> None:  # fmt: skip
        q, _, v_cache = inputs[:3]
        self.plan, self.indices, self.scales, self.options, self.cache = plan, inputs[3:], scales, options, cache
        self.out_shape, lse_shape = _output_shapes(q, v_cache)
        self.dtype, self.device, self.paged = q.dtype, q.device, cache.block_table is not None
        self.lse = empty_output(lse_shape, torch.float32, q.device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.paged and _capturing(self.device):
            return decode_attention(q, k_cache, v_cache, None, None, self.options, self.cache)[0]
        out = empty_output(self.out_shape, self.dtype, self.device)
        _run(self.plan, (q, k_cache, v_cache, *self.indices), self.scales, out, self.lse)
        return out


def prepare(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, options: AttentionOptions, cache: CacheOptions
) -> PreparedDecode | None:
    """A ``PreparedDecode`` for later calls of these layouts, options and cache without new tokens; None where the
    launch is not kept as a plan (an input not 16-byte aligned), a paged launch is being captured, or the output is
    empty: such calls go through ``decode_attention``."""
    if 0 in _output_shapes(q, v_cache)[0] or cache.block_table is not None and _capturing(q.device):
        return None
    inputs = (q, k_cache, v_cache, None, None, *_indices(options, cache))
    settings = _settings(options, cache, captured=False)
    scales = _scales(options)
    plan, aligned = _make_plan(inputs, scales, settings)
    return PreparedDecode(plan, inputs, scales, options, cache) if aligned else None
