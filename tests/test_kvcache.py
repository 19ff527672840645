"""flash_attn_with_kvcache against the oracle, on every reachable path, and its in-place cache update.

The oracle gathers each batch entry's logical cache (through cache_batch_idx or the block table),
rotates q and the new k with a plain rotary written here, appends, and runs
``flashtile.reference.attention_reference`` on the visible keys (with softcap or ALiBi, the same naive
attention with those terms added). It runs in float64 (``ref``) and in the low dtype (``base``); the
tolerance rule (``reference.within_tolerance``) compares them (tests/oracle.py). After every call the cache must
hold the new rows where they belong and be bitwise unchanged everywhere else.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, replace
from functools import partial

import pytest
import torch

import flashtile._ops
import flashtile.cpu_decode
import flashtile.kvcache
import flashtile.ops.decode
import tune_decode  # benchmarks/, on the path from conftest
from conftest import DEVICE, capture
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.ops._launch import Plans
from flashtile.ops.common.grid import cdiv
from flashtile.ops.decode import configs, split_kv
from flashtile.reference import attention_reference, visibility_mask
from oracle import assert_within_rule

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """One call of flash_attn_with_kvcache: shapes and options (the inputs are drawn from them)."""

    batch: int = 2
    seqlen_q: int = 1
    seqlen_new: int = 1  # 0: no new k/v
    nheads: int = 4
    nheads_k: int = 2
    head_dim: int = 64
    head_dim_v: int | None = None
    seqlen_cache: int = 96  # per batch entry; a multiple of page_size when paged
    page_size: int = 0  # 0: contiguous cache
    dtype: torch.dtype = torch.float16
    batch_idx: bool = False
    leftpad: bool = False
    rotary_dim: int = 0
    rotary_interleaved: bool = True
    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""  # "", "heads" for (nheads,), "batch" for (batch, nheads)
    num_splits: int = 1
    cache_seqlens: tuple[int, ...] | None = None  # drawn when None
    softmax_scale: float | None = None


@dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    rotary_cos: torch.Tensor | None
    rotary_sin: torch.Tensor | None
    cache_seqlens: torch.Tensor
    cache_batch_idx: torch.Tensor | None
    cache_leftpad: torch.Tensor | None
    block_table: torch.Tensor | None
    alibi_slopes: torch.Tensor | None


def make_inputs(case: Case) -> Inputs:
    """Fresh random inputs for ``case`` (never zeros), seeded by the case itself."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    c = case
    head_dim_v = c.head_dim if c.head_dim_v is None else c.head_dim_v

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(c.dtype)

    def randint(low, high, size=()):
        return torch.randint(low, high, size, generator=gen)

    if c.page_size:
        blocks = c.seqlen_cache // c.page_size
        num_blocks = c.batch * blocks + 3  # spare blocks that no batch entry uses
        block_table = torch.randperm(num_blocks, generator=gen)[: c.batch * blocks].view(c.batch, blocks)
        slots, rows = num_blocks, c.page_size
    else:
        block_table = None
        slots, rows = c.batch + (1 if c.batch_idx else 0), c.seqlen_cache
    k_cache = randn(slots, rows, c.nheads_k, c.head_dim)
    v_cache = randn(slots, rows, c.nheads_k, head_dim_v)
    if c.cache_seqlens is None:
        cache_seqlens = randint(0, c.seqlen_cache - c.seqlen_new + 1, (c.batch,))
    else:
        cache_seqlens = torch.tensor(c.cache_seqlens)
    k = randn(c.batch, c.seqlen_new, c.nheads_k, c.head_dim) if c.seqlen_new else None
    v = randn(c.batch, c.seqlen_new, c.nheads_k, head_dim_v) if c.seqlen_new else None
    rotary_cos = rotary_sin = None
    if c.rotary_dim:
        inv_freq = 1.0 / 10000 ** (torch.arange(0, c.rotary_dim, 2) / c.rotary_dim)
        angles = torch.arange(c.seqlen_cache)[:, None] * inv_freq[None, :]  # (seqlen_ro, rotary_dim / 2)
        rotary_cos, rotary_sin = angles.cos().to(c.dtype), angles.sin().to(c.dtype)
    batch_idx = torch.randperm(slots, generator=gen)[: c.batch] if c.batch_idx else None
    leftpad = torch.stack([randint(0, int(n) + 1) for n in cache_seqlens]) if c.leftpad else None
    alibi = None
    if c.alibi:
        shape = (c.nheads,) if c.alibi == "heads" else (c.batch, c.nheads)
        alibi = torch.rand(*shape, generator=gen) * 0.3 + 0.02

    def dev(t, dtype=None):
        return None if t is None else t.to(device=DEVICE, dtype=dtype or t.dtype)

    i32 = torch.int32
    return Inputs(
        dev(randn(c.batch, c.seqlen_q, c.nheads, c.head_dim)), dev(k_cache), dev(v_cache), dev(k), dev(v),
        dev(rotary_cos), dev(rotary_sin), dev(cache_seqlens, i32), dev(batch_idx, i32), dev(leftpad, i32),
        dev(block_table, i32), dev(alibi),
    )  # fmt: skip


def call(case: Case, x: Inputs, **overrides):
    """flash_attn_with_kvcache on copies of the caches; returns out, lse, k_cache, v_cache."""
    k_cache, v_cache = x.k_cache.clone(), x.v_cache.clone()
    kwargs = dict(
        k=x.k, v=x.v, rotary_cos=x.rotary_cos, rotary_sin=x.rotary_sin, cache_seqlens=x.cache_seqlens,
        cache_batch_idx=x.cache_batch_idx, cache_leftpad=x.cache_leftpad, block_table=x.block_table,
        softmax_scale=case.softmax_scale, causal=case.causal, window_size=case.window_size, softcap=case.softcap,
        rotary_interleaved=case.rotary_interleaved, alibi_slopes=x.alibi_slopes, num_splits=case.num_splits,
        return_softmax_lse=True,
    )  # fmt: skip
    kwargs.update(overrides)
    out, lse = flash_attn_with_kvcache(kwargs.pop("q", x.q), k_cache, v_cache, **kwargs)
    return out, lse, k_cache, v_cache


# The oracle ---------------------------------------------------------------------------------------------


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding in x's dtype: x (S, H, D), cos/sin (S, R / 2) at the rows' positions."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:  # pairs (2f, 2f + 1)
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        swapped = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:  # pairs (f, f + R / 2)
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        swapped = torch.cat((-rot[..., rotary_dim // 2 :], rot[..., : rotary_dim // 2]), dim=-1)
    return torch.cat((rot * cos[:, None] + swapped * sin[:, None], rest), dim=-1)


def logical_cache(cache: torch.Tensor, x: Inputs) -> torch.Tensor:
    """(batch, seqlen_cache, nheads_k, d): each batch entry's cache, gathered."""
    if x.block_table is not None:
        return cache[x.block_table.long()].flatten(1, 2)
    if x.cache_batch_idx is not None:
        return cache[x.cache_batch_idx.long()]
    return cache[: x.q.shape[0]]


def oracle(case: Case, x: Inputs, dtype: torch.dtype):
    """out (B, Sq, H, Dv) in case.dtype and lse (B, H, Sq) fp32, computed in ``dtype``; and the new keys
    as rotated in ``dtype``, cast to case.dtype."""
    c = case

    def host(t):  # floating-point inputs in ``dtype``, indices as they are
        return None if t is None else t.cpu() if t.dtype == torch.int32 else t.cpu().to(dtype)

    x = Inputs(**{name: host(t) for name, t in vars(x).items()})
    seqlens, leftpad = x.cache_seqlens.tolist(), x.cache_leftpad
    k_cache, v_cache = logical_cache(x.k_cache, x), logical_cache(x.v_cache, x)
    scale = 1.0 / math.sqrt(c.head_dim) if c.softmax_scale is None else c.softmax_scale
    outs, lses, new_keys = [], [], []
    for b in range(c.batch):
        n = seqlens[b]
        pos_k = torch.arange(n, n + c.seqlen_new)
        q = x.q[b]
        k = x.k[b] if c.seqlen_new else k_cache[b, :0]
        if c.rotary_dim:
            # flash_attn: a window side as wide as the cache (or wider) is no window at all
            per_token = c.causal or any(0 <= w < c.seqlen_cache for w in c.window_size)
            pos_q = n + (torch.arange(c.seqlen_q) if per_token else torch.zeros(c.seqlen_q, dtype=torch.long))
            q = rotary_reference(q, x.rotary_cos[pos_q], x.rotary_sin[pos_q], c.rotary_interleaved)
            k = rotary_reference(k, x.rotary_cos[pos_k], x.rotary_sin[pos_k], c.rotary_interleaved)
        new_keys.append(k.to(c.dtype))
        start = 0 if leftpad is None else int(leftpad[b])
        keys = torch.cat((k_cache[b, start:n], k))
        values = torch.cat((v_cache[b, start:n], x.v[b] if c.seqlen_new else v_cache[b, :0]))
        mask = visibility_mask(c.seqlen_q, keys.shape[0], c.causal, c.window_size)
        slopes = None
        if c.alibi:
            slopes = x.alibi_slopes if c.alibi == "heads" else x.alibi_slopes[b]
        out, lse = attention_reference(
            q[None], keys[None], values[None], scale, mask=mask, softcap=c.softcap, alibi_slopes=slopes
        )
        outs.append(out[0].to(c.dtype))
        lses.append(lse[0].float())
    return torch.stack(outs), torch.stack(lses), new_keys


def new_rows(case: Case, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical (slot, row) indices (batch, seqlen_new) where the new tokens must land."""
    pos = x.cache_seqlens.long()[:, None] + torch.arange(case.seqlen_new, device=DEVICE)[None, :]
    if x.block_table is not None:
        return x.block_table.long().gather(1, pos // case.page_size), pos % case.page_size
    slots = torch.arange(case.batch, device=DEVICE) if x.cache_batch_idx is None else x.cache_batch_idx.long()
    return slots[:, None].expand_as(pos), pos


def check(case: Case, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``case``; check out, lse and the cache against the oracle. Returns out, lse."""
    x = make_inputs(case)
    out, lse, k_cache, v_cache = call(case, x, **overrides)
    ref_out, ref_lse, ref_keys = oracle(case, x, torch.float64)
    base_out, base_lse, base_keys = oracle(case, x, case.dtype)
    assert_within_rule("out", out.cpu(), ref_out, base_out)
    assert_within_rule("lse", lse.cpu(), ref_lse, base_lse)

    # The cache: new rows where they belong, every other element bitwise untouched.
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    if case.seqlen_new:
        slot, row = new_rows(case, x)
        written[slot, row] = True
        assert torch.equal(v_cache[slot, row], x.v), "v_cache: new values not where they belong"
        if case.rotary_dim:
            for b in range(case.batch):
                assert_within_rule("out", k_cache[slot[b], row[b]].cpu(), ref_keys[b], base_keys[b])
        else:
            assert torch.equal(k_cache[slot, row], x.k), "k_cache: new keys not where they belong"
    assert torch.equal(k_cache[~written], x.k_cache[~written]), "k_cache changed outside the new rows"
    assert torch.equal(v_cache[~written], x.v_cache[~written]), "v_cache changed outside the new rows"
    return out, lse


def record_launches(monkeypatch) -> list[tuple[tuple, dict]]:
    """(grid, constexprs) of every split-KV launch from here on, in order; the launches still run."""
    seen = []
    launch = split_kv.launch

    def recording(kernel, grid, args, constexprs, keyed=None, **options):
        seen.append((grid, constexprs))
        return launch(kernel, grid, args, constexprs, keyed, **options)

    monkeypatch.setattr(split_kv, "launch", recording)
    return seen


# The cases ----------------------------------------------------------------------------------------------

HEADS = {"MHA2": (2, 2), "GQA6-2": (6, 2), "MQA4-1": (4, 1)}
LAYOUTS = {"contiguous": 0, "page16": 16, "page48": 48}


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS.keys())
@pytest.mark.parametrize("heads", HEADS, ids=HEADS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.keys())
def test_decode_step(path, dtype, heads, layout):
    """One new token per batch entry appended and attended: dtypes x head groupings x cache layouts."""
    nheads, nheads_k = HEADS[heads]
    check(Case(dtype=DTYPES[dtype], nheads=nheads, nheads_k=nheads_k, page_size=LAYOUTS[layout]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "seqlens", [(3, 3), (4, 0), (17, 17), (5, 2)], ids=lambda s: f"Sq{s[0]}-new{s[1]}"
)  # fmt: skip
def test_seqlen_q(path, seqlens, causal):
    """Several query tokens (speculative decoding, chunked prefill), with and without new k/v; 17 tokens
    x 4 heads per group are 68 packed rows: two query tiles."""
    seqlen_q, seqlen_new = seqlens
    check(Case(seqlen_q=seqlen_q, seqlen_new=seqlen_new, nheads=8, causal=causal, page_size=16))


def test_rows_that_see_no_key(path):
    """seqlen_q > seqlen_k, causal: the first rows see nothing (0 out, -inf lse); an empty cache sees nothing."""
    case = Case(seqlen_q=5, seqlen_new=0, cache_seqlens=(3, 0))
    out, lse = check(case)
    assert torch.all(out[0, :2] == 0) and torch.all(lse[0, :, :2] == float("-inf"))
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


@pytest.mark.parametrize("seqlen_q", [4, 40], ids=lambda n: f"Sq{n}")
@pytest.mark.parametrize("window", [(8, 0), (0, 0), (5, 3), (-1, 2), (20, -1)], ids=lambda w: f"W{w[0]}_{w[1]}")
def test_window(path, window, seqlen_q):
    """Sliding windows; with 40 query tokens the band's edges cross several key tiles within one query tile."""
    check(
        Case(seqlen_q=seqlen_q, seqlen_new=seqlen_q, causal=False, window_size=window, page_size=16, seqlen_cache=128)
    )


def test_causal_with_window(path):
    check(Case(seqlen_q=3, seqlen_new=3, causal=True, window_size=(10, 7)))


@pytest.mark.parametrize("layout", ["contiguous", "page32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["rot64", "rot32"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rotary(path, interleaved, rotary_dim, causal, layout):
    """q and the new k rotated at their positions; causal/local: q at cache_seqlens + i, else all at
    cache_seqlens. rotary_dim 32 < headdim 64 leaves the last 32 dims as they are."""
    check(
        Case(
            seqlen_q=3, seqlen_new=3, rotary_dim=rotary_dim, rotary_interleaved=interleaved, causal=causal,
            page_size=32 if layout == "page32" else 0,
        )
    )  # fmt: skip


@pytest.mark.parametrize("window", [(95, -1), (96, -1), (-1, 200)], ids=lambda w: f"W{w[0]}_{w[1]}")
def test_rotary_with_wide_window(path, window):
    """As in flash_attn, a window side >= the cache length (96) is unbounded, and with no window left q
    is rotated at cache_seqlens for every token; (95, -1) is still a window: q rotated per token."""
    check(Case(seqlen_q=3, seqlen_new=3, rotary_dim=64, causal=False, window_size=window))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.keys())
def test_rotary_gqa_dtypes(path, dtype):
    check(Case(dtype=DTYPES[dtype], nheads=6, nheads_k=2, seqlen_q=2, seqlen_new=2, rotary_dim=48, page_size=16))


@pytest.mark.parametrize(
    "options",
    [
        {"batch_idx": True},
        {"leftpad": True},
        {"leftpad": True, "page_size": 16},
        {"batch_idx": True, "leftpad": True, "rotary_dim": 32, "seqlen_q": 2, "seqlen_new": 2},
        {"leftpad": True, "window_size": (6, 0), "alibi": "heads", "seqlen_q": 3, "seqlen_new": 3},
    ],
    ids=["batch_idx", "leftpad", "leftpad-paged", "batch_idx-leftpad-rotary", "leftpad-window-alibi"],
)
def test_batch_idx_and_leftpad(path, options):
    check(Case(batch=3, **options))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("alibi", ["", "heads", "batch"], ids=["no-alibi", "alibi-H", "alibi-BH"])
@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["no-softcap", "softcap"])
def test_softcap_and_alibi(path, softcap, alibi, causal):
    if not softcap and not alibi:
        pytest.skip("covered by the other tests")
    check(Case(seqlen_q=3, seqlen_new=2, softcap=softcap, alibi=alibi, causal=causal, nheads=4, nheads_k=1))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 0], ids=lambda n: f"splits{n}")
def test_num_splits(path, num_splits):
    """Split-KV: every split count gives the oracle's answer within the rule (and splits past the number
    of key tiles are empty and weigh nothing)."""
    check(Case(seqlen_q=2, seqlen_new=2, nheads=6, seqlen_cache=224, page_size=32, num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [1, 5, 11], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.keys())
def test_long_cache(path, dtype, num_splits):
    """A 1000-position cache read by 32 key tiles (interpreter) or 16 (GPU), 8 query heads per kv head (16-row
    tiles); 11 splits merge in two unrolled chunks, the second part empty (``split_kv.MERGE_CHUNK_16_ROWS``)."""
    check(Case(batch=1, nheads=16, seqlen_cache=1024, cache_seqlens=(999,), dtype=DTYPES[dtype], num_splits=num_splits))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.keys())
def test_everything_at_once(path, dtype):
    """Paged (page 48), GQA with two query tiles, leftpad, partial NeoX rotary, softcap, per-batch ALiBi,
    a window and four splits in one call."""
    check(
        Case(
            batch=3, seqlen_q=9, seqlen_new=9, nheads=16, nheads_k=2, page_size=48, seqlen_cache=192, leftpad=True,
            rotary_dim=32, rotary_interleaved=False, softcap=2.0, alibi="batch", window_size=(40, 3), causal=False,
            num_splits=4, dtype=DTYPES[dtype],
        )
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda n: f"splits{n}")
def test_splits_with_window_and_alibi(path, num_splits):
    """The same inputs, split or not: a window makes the splits share only the keys the rows see."""
    check(Case(seqlen_cache=160, window_size=(70, -1), alibi="heads"), num_splits=num_splits)


def test_new_tokens_straddle_pages(path):
    """New tokens that cross a page boundary land on both pages; the rest of both pages is untouched."""
    check(Case(page_size=16, cache_seqlens=(14, 30), seqlen_new=5, seqlen_q=5, nheads=6))


@pytest.mark.parametrize("head_dims", [(40, 40), (128, 64), (32, 96)], ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_head_dims(path, head_dims):
    check(Case(head_dim=head_dims[0], head_dim_v=head_dims[1], seqlen_new=2, seqlen_q=2, page_size=16))


def test_strided_inputs(path):
    """q, new k/v and the index tensors as strided views: the caches must still be written in place."""
    case = Case(seqlen_q=2, seqlen_new=2, page_size=16, leftpad=True, alibi="batch")
    x = make_inputs(case)

    def strided(t):  # the same values, every other element of a wider tensor
        wide = torch.stack((t, t), dim=-1)
        return wide[..., 0]

    assert not strided(x.cache_seqlens).is_contiguous()
    check(
        case, cache_seqlens=strided(x.cache_seqlens), cache_leftpad=strided(x.cache_leftpad),
        block_table=strided(x.block_table), alibi_slopes=strided(x.alibi_slopes), q=strided(x.q), k=strided(x.k),
        v=strided(x.v),
    )  # fmt: skip


def test_int64_tile_offsets(monkeypatch):
    """Contiguous caches whose key tile spans 2**31 elements or more take int64 offsets inside a tile
    (``split_kv.INT32_LIMIT``, INT64_OFFSETS): forced here at a small size, over several tiles, a batch index
    and a left pad, the answer and the cache are those of the oracle. The plans are set aside (INT32_LIMIT is read
    when a plan is made, not part of its key)."""
    monkeypatch.setattr(split_kv, "_PLANS", Plans())
    monkeypatch.setattr(split_kv, "INT32_LIMIT", 1)
    seen = record_launches(monkeypatch)
    check(Case(seqlen_q=2, seqlen_new=2, batch_idx=True, leftpad=True, num_splits=2))
    assert [constexprs["INT64_OFFSETS"] for _, constexprs in seen] == [True]


@pytest.mark.parametrize(
    "seqlen_q, seqlen_new, page_size, window, max_keys, launched, own_split",
    [(40, 1, 0, (-1, -1), 1024, 4, True), (1, 1, 0, (100, 0), 1024, 4, True), (1, 16, 32, (100, 0), 1024, 4, True),
     (1, 17, 0, (100, 0), 1024, 3, False), (1, 1, 0, (100, 0), 170, 3, False)],
    ids=["2qtiles", "window", "16new-paged-window", "17new-window", "long-splits-window"],
)  # fmt: skip
def test_new_keys_split_of_their_own(
    monkeypatch, seqlen_q, seqlen_new, page_size, window, max_keys, launched, own_split
):
    """A launch that does not append first (two query tiles, or a left window: ``split_kv.appends_first``) with
    several splits of at most NEW_SPLIT_MAX_KEYS cache positions and at most NEW_SPLIT_MAX new tokens adds a split
    that attends to the new keys alone and appends them; more new tokens (or longer splits: 171 positions each here)
    are shared among the requested splits. 40 queries make two query tiles, the first of which sees none of the new
    key (its own split is empty), and the cache rows after the new ones stay as they were (``check``). 512
    positions: several key tiles on a GPU (64 keys each in a contiguous cache, 128 in a paged one) and under the
    interpreter (32). The plans are set aside (NEW_SPLIT_MAX_KEYS is read when a plan is made, not part of its key)."""
    monkeypatch.setattr(split_kv, "_PLANS", Plans())
    monkeypatch.setattr(split_kv, "NEW_SPLIT_MAX_KEYS", max_keys)
    seen = record_launches(monkeypatch)
    check(Case(seqlen_q=seqlen_q, seqlen_new=seqlen_new, page_size=page_size, seqlen_cache=512, window_size=window,
               cache_seqlens=(64, 400), num_splits=3))  # fmt: skip
    assert [(grid[1], constexprs["NEW_SPLIT"], constexprs["APPEND_FIRST"]) for grid, constexprs in seen] == [
        (launched, own_split, False)
    ]


@pytest.mark.parametrize(
    "seqlen_q, seqlen_new, page_size, cache_seqlens, num_splits",
    [(1, 1, 0, (64, 400), 3), (16, 16, 32, (64, 400), 3), (17, 17, 0, (64, 400), 3), (1, 16, 0, (250, 40), 9),
     (1, 16, 32, (250, 40), 9), (1, 16, 0, (250, 40), 1), (4, 16, 0, (0, 496), 2)],
    ids=["step", "16new-paged", "17new", "straddle", "straddle-paged", "one-split", "empty-and-full"],
)  # fmt: skip
def test_new_keys_appended_first(monkeypatch, seqlen_q, seqlen_new, page_size, cache_seqlens, num_splits):
    """A launch of one query tile without a left window (``split_kv.appends_first``) has no split of the new keys'
    own: each split writes the new tokens among its keys to the cache and reads them back from there. Sixteen new
    tokens at 250..265 straddle a split boundary (256: 32-key tiles one split each under the interpreter, 128-key
    tiles on a GPU), so two splits each write and read their part; a cache empty before the step and one filled to
    its last row (0 and 496 of 512 positions). The answer and the cache are the oracle's (``check``: rows before
    cache_seqlens untouched, the new tokens where they belong, the rows after them as they were)."""
    seen = record_launches(monkeypatch)
    check(Case(seqlen_q=seqlen_q, seqlen_new=seqlen_new, page_size=page_size, seqlen_cache=512,
               cache_seqlens=cache_seqlens, num_splits=num_splits))  # fmt: skip
    [(grid, constexprs)] = seen
    launched = min(num_splits, 512 // constexprs["BLOCK_N"])  # the requested splits, at most one per key tile
    assert (grid[1], constexprs["NEW_SPLIT"], constexprs["APPEND_FIRST"]) == (launched, False, True)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"page_size": 32},
        {"batch_idx": True, "rotary_dim": 32},
        {"num_splits": 3},
        {"seqlen_q": 3, "nheads": 4},
        {"seqlen_new": 2},
    ],
    ids=["contiguous", "page32", "batch-idx-rotary", "splits3", "three-queries", "two-new"],
)
def test_new_keys_appended_late(monkeypatch, options):
    """A one-split launch (LATE_APPEND) whose one new key lies ``split_kv.LATE_APPEND_TILES`` key tiles or more past
    the first key of its unmasked loop writes it to the cache in that loop's first iteration (``append_late``), the
    others before it. Cache lengths on both sides of the rule under the interpreter (32-key tiles: 127 early, 128
    late with the new key in the masked tail, 255 late with it in the unmasked loop, 300 late), an empty cache, and
    three splits or two new tokens (no LATE_APPEND: all early); the answer and the cache are the oracle's
    (``check``)."""
    seen = record_launches(monkeypatch)
    check(Case(**{"batch": 5, "seqlen_cache": 320, "cache_seqlens": (0, 127, 128, 255, 300), **options}))
    [(_, constexprs)] = seen
    late = options.get("num_splits", 1) == 1 and options.get("seqlen_new", 1) == 1
    assert (constexprs["APPEND_FIRST"], constexprs["LATE_APPEND"]) == (True, late)


def test_late_append_waits_for_every_pipeline():
    """``append_late`` needs the new keys' tile to be copied after its first iteration: every decode config's
    pipeline copies tile i + num_stages - 1 in iteration i, so LATE_APPEND_TILES must be at least num_stages."""
    decode_configs = [value for value in vars(configs).values() if isinstance(value, configs.DecodeConfig)]
    assert decode_configs and max(c.num_stages for c in decode_configs) <= split_kv.LATE_APPEND_TILES


@pytest.mark.parametrize(
    "options",
    [{}, {"head_dim_v": 32, "num_splits": 3, "seqlen_new": 2}, {"page_size": 32}, {"batch_idx": True},
     {"nheads_k": 1, "seqlen_q": 3, "rotary_dim": 32}],
    ids=["one-split", "dv32-splits", "paged", "batch-idx", "mqa-rotary"],
)  # fmt: skip
def test_fixed_row_strides(monkeypatch, options):
    """A config with ``fixed_row_strides`` (on a GPU CUDA_FEW_PROGRAMS, for every case here; on the CPU the
    interpreter's config with it on) compiles each cache's own row stride into the kernel, K's and V's apart
    (head_dim_v 32: V's rows are half K's), and gives the oracle's answer and cache; a cache of another layout is a
    launch of its own with its strides."""
    cfg = configs.CUDA_FEW_PROGRAMS if DEVICE == "cuda" else replace(configs.INTERPRETER, fixed_row_strides=True)
    monkeypatch.setattr(configs, "config_and_splits", tune_decode.fixed(cfg))
    monkeypatch.setattr(split_kv, "_PLANS", Plans())
    seen = record_launches(monkeypatch)
    case = Case(**{"seqlen_cache": 128, "cache_seqlens": (45, 120), **options})
    check(case)
    [(_, constexprs)] = seen
    head_dim_v = case.head_dim if case.head_dim_v is None else case.head_dim_v
    rows = (case.nheads_k * case.head_dim, case.nheads_k * head_dim_v)
    assert (constexprs["ROW_STRIDE_K"], constexprs["ROW_STRIDE_V"]) == rows
    if not options:
        check(replace(case, nheads=6, nheads_k=3))
        assert (seen[-1][1]["ROW_STRIDE_K"], seen[-1][1]["ROW_STRIDE_V"]) == (3 * case.head_dim,) * 2


@pytest.mark.parametrize(
    "page_size, seqlen_cache, options",
    [(32, 512, {}), (32, 512, {"window_size": (70, 0), "seqlen_q": 5}), (128, 512, {}),
     (128, 512, {"head_dim": 64, "head_dim_v": 32, "nheads": 6, "nheads_k": 1}), (48, 480, {}),
     (128, 512, {"leftpad": True}), (128, 512, {"head_dim": 40}), (0, 300, {})],
    ids=["page32", "page32-window", "page128", "page128-dv32-mqa", "page48", "page128-leftpad", "page128-headdim40",
         "contiguous"],
)  # fmt: skip
@pytest.mark.parametrize("captured", [True, False], ids=["captured", "eager"])
def test_tma_tiles(monkeypatch, page_size, seqlen_cache, options, captured):
    """On a device with a copy engine (stood in for on the CPU: the interpreter reads tensor descriptors too), the
    unmasked key tiles of a paged cache whose pages hold whole tiles, with no left pad shifting them, come through
    tensor descriptors (``split_kv.use_tma``) in a launch captured in a CUDA graph (stood in for too); eager launches,
    other pages, head dims that are not powers of two and contiguous caches keep pointer loads. Either way the answer
    and the cache are the oracle's, over several tiles and splits (on a GPU, 128-key tiles: the 32-row pages then
    take pointer loads)."""
    monkeypatch.setattr(split_kv, "has_copy_engine", lambda device: True)
    monkeypatch.setattr(split_kv, "_capturing", lambda device: captured)
    monkeypatch.setattr(split_kv, "_PLANS", Plans())
    seen = record_launches(monkeypatch)
    case = Case(**{"seqlen_q": 3, "seqlen_new": 2, "seqlen_cache": seqlen_cache, "page_size": page_size,
                   "num_splits": 3, "cache_seqlens": (100, seqlen_cache - 2), **options})  # fmt: skip
    check(case)
    [(tma, block_n)] = [(constexprs["TMA"], constexprs["BLOCK_N"]) for _, constexprs in seen]
    whole_tiles = page_size > 0 and page_size % block_n == 0 and not case.leftpad
    head_dims = {case.head_dim, case.head_dim if case.head_dim_v is None else case.head_dim_v}
    assert tma == (captured and whole_tiles and head_dims <= {16, 32, 64, 128, 256})


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_tma_tiles_in_cuda_graph(monkeypatch, num_splits):
    """On sm_90 a paged step captured in a CUDA graph reads its key tiles through tensor descriptors, an eager step
    through pointers (``split_kv.use_tma``): the replay's answer is within the rule of the oracle and its cache is
    the eager step's, bitwise."""
    if not split_kv.has_copy_engine(torch.device(DEVICE)):
        pytest.skip("tensor descriptors need an sm_90 GPU")
    seen = record_launches(monkeypatch)
    case = Case(batch=2, nheads=8, nheads_k=2, head_dim=128, seqlen_cache=1024, page_size=256, dtype=torch.bfloat16,
                num_splits=num_splits, cache_seqlens=(300, 1000))  # fmt: skip
    x = make_inputs(case)
    _, _, eager_k, eager_v = call(case, x)
    k_cache, v_cache = x.k_cache.clone(), x.v_cache.clone()

    def step() -> torch.Tensor:
        return flash_attn_with_kvcache(x.q, k_cache, v_cache, x.k, x.v, cache_seqlens=x.cache_seqlens,
                                       block_table=x.block_table, causal=True, num_splits=num_splits)  # fmt: skip

    graph, out = capture(step)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not seen[0][1]["TMA"] and seen[-1][1]["TMA"]
    ref_out, _, _ = oracle(case, x, torch.float64)
    base_out, _, _ = oracle(case, x, case.dtype)
    assert_within_rule("out", out.cpu(), ref_out, base_out)
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


def test_int_cache_seqlens(path):
    case = Case(cache_seqlens=(50, 50), seqlen_new=3, seqlen_q=3)
    check(case, cache_seqlens=50)


def test_whole_cache_without_seqlens(path):
    """cache_seqlens=None and no new k/v: every position of the cache is a key."""
    case = Case(seqlen_new=0, seqlen_q=2, cache_seqlens=(96, 96), page_size=16)
    check(case, cache_seqlens=None)


@pytest.mark.parametrize("shape", [(2, 0), (0, 1)], ids=["Sq0", "B0"])
def test_empty_query(path, shape):
    batch, seqlen_q = shape
    k_cache = torch.randn(2, 32, 2, 64, device=DEVICE).half()
    q = torch.randn(batch, seqlen_q, 4, 64, device=DEVICE).half()
    seqlens = torch.full((batch,), 5, dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, 4, seqlen_q)


def test_softmax_scale_and_lse_flag(path):
    case = Case(softmax_scale=0.3)
    out, _ = check(case)
    x = make_inputs(case)
    plain = flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache, x.k, x.v, cache_seqlens=x.cache_seqlens,
                                    softmax_scale=0.3, causal=True)  # fmt: skip
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def test_merge_chunk():
    """The merge's unrolled step: MERGE_CHUNK_16_ROWS splits for 16-row tiles, MERGE_CHUNK for more rows, at most
    the split count rounded up to a power of two."""
    assert [split_kv.merge_chunk(16, n) for n in (1, 2, 3, 5, 8, 11, 128)] == [1, 2, 4, 8, 8, 8, 8]
    assert [split_kv.merge_chunk(64, n) for n in (1, 2, 3, 5, 128)] == [1, 2, 4, 4, 4]


def test_num_splits_heuristic(monkeypatch):
    """num_splits=0 on an H200's 132 SMs (the config's programs per SM), capped at one split per key tile and at
    MAX_SPLITS."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    two_per_sm, one_per_sm = configs.DecodeConfig(128, 4, 2), configs.DecodeConfig(128, 8, 3, programs_per_sm=1)

    def splits(programs, n_blocks, cfg=two_per_sm):
        return configs.num_splits(0, torch.device("cpu"), programs, n_blocks * cfg.block_n, cfg)

    assert splits(programs=264, n_blocks=2048) == 1  # two programs per SM
    assert splits(programs=128, n_blocks=2048) == 2  # rounded down
    assert splits(programs=8, n_blocks=2048) == 33
    assert splits(programs=8, n_blocks=16) == 16  # one key tile per split at most
    assert splits(programs=8, n_blocks=8, cfg=one_per_sm) == 8  # B=1, 1k
    assert splits(programs=1, n_blocks=100_000) == configs.MAX_SPLITS
    assert splits(programs=8, n_blocks=2) == 2
    assert splits(programs=8, n_blocks=1) == 1
    assert splits(programs=8, n_blocks=2048, cfg=one_per_sm) == 16
    assert configs.num_splits(5, torch.device("cpu"), 8, 3 * 128, two_per_sm) == 3  # a request, capped too


def test_wide_merges_read_two_tiles_per_split(monkeypatch):
    """Past WIDE_MERGE (16) splits the heuristic gives every split at least two key tiles (132 SMs, 128-key tiles, B=1
    with 8 kv heads on a paged cache: 33 splits wanted); up to 16 a split may read one tile; a request is kept."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda, general = torch.device("cuda", 0), configs.CUDA_HEAD_DIM_128

    def splits(n_blocks, requested=0):
        return configs.num_splits(requested, cuda, 8, n_blocks * general.block_n, general)

    assert splits(16) == 16  # 2k: one tile each, 16 splits
    assert splits(24) == 16  # 3k: not 24 splits of one tile
    assert splits(32) == 16  # 4k: two tiles each, not 32 of one
    assert splits(48) == 24  # 6k
    assert splits(66) == 33  # two tiles each already
    assert splits(32, requested=32) == 32


def test_config_and_splits_leaves_short_splits_to_the_general_config(monkeypatch):
    """Where the few-programs config would give every split at most two key tiles, the general config runs with its
    own split count (132 SMs, 64-key tiles in the few-programs config, 128 in the general one): B=1 Hkv 8 up to 2048
    positions, and requests of that many splits; three tiles per split keep the few-programs config; paged caches and
    the interpreter are not switched."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda, few, general = torch.device("cuda", 0), configs.CUDA_FEW_PROGRAMS, configs.CUDA_HEAD_DIM_128

    def chosen(seqlen_cache, programs=8, requested=0, paged=False, device=cuda):
        return configs.config_and_splits(requested, device, 128, programs, paged, seqlen_cache)

    assert chosen(1024) == (general, 8)
    assert chosen(2048) == (general, 16)
    assert chosen(2049) == (few, 16)  # 33 tiles over 16 splits: three for some
    assert chosen(4096) == (few, 16)
    assert chosen(65536) == (configs.CUDA_FEW_PROGRAMS_LONG, 16)  # 64 tiles per split: the long-split config
    assert chosen(64512) == (few, 16)  # 1008 tiles: 63 per split
    assert chosen(1024, programs=128) == (few, 1)  # B=16: one program per SM
    assert chosen(4096, programs=128) == (configs.CUDA_FEW_PROGRAMS_LONG, 1)
    assert chosen(4096, programs=64) == (few, 2)
    assert chosen(1024, programs=133) == (general, 1)  # more programs than SMs
    assert chosen(1024, requested=8) == (general, 8)
    assert chosen(1024, requested=4) == (few, 4)
    assert chosen(8192, programs=1) == (general, 32)  # the few-programs config's 128 splits would read one tile each
    assert chosen(16384, programs=1) == (general, 64)
    assert chosen(16385, programs=1) == (few, 128)
    assert chosen(1024, paged=True) == (general, 8)
    assert chosen(1024, device=torch.device("cpu")) == (configs.INTERPRETER, 16)  # 32 tiles of 32 keys, not switched


def test_few_programs_config(monkeypatch):
    """Up to one program per SM (132 here) on a contiguous cache: one program per SM with deeper pipelining; paged
    caches, more programs, an unknown count and head dims above 128 keep their configs (CUDA only: the interpreter
    has its own)."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert configs.config(cuda, 128, programs=8, paged=False) == configs.CUDA_FEW_PROGRAMS
    assert configs.config(cuda, 64, programs=1, paged=False) == configs.CUDA_FEW_PROGRAMS
    assert configs.config(cuda, 128, programs=132, paged=False) == configs.CUDA_FEW_PROGRAMS
    assert configs.config(cuda, 128, programs=8, paged=True) == configs.CUDA_HEAD_DIM_128
    assert configs.config(cuda, 128, programs=133, paged=False) == configs.CUDA_HEAD_DIM_128
    assert configs.config(cuda, 128, paged=False) == configs.CUDA_HEAD_DIM_128
    assert configs.config(cuda, 256, programs=8, paged=False) == configs.CUDA_HEAD_DIM_256
    assert configs.config(torch.device("cpu"), 128, programs=8, paged=False) == configs.INTERPRETER


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph(path, backend):
    """torch.compile traces the custom op (declared as mutating the caches) without graph breaks."""
    case = Case(seqlen_new=1, page_size=16, rotary_dim=32)
    x = make_inputs(case)

    def step(q, k_cache, v_cache, k, v, cos, sin, seqlens, table):
        out = flash_attn_with_kvcache(q * 0.5, k_cache, v_cache, k, v, cos, sin, seqlens, block_table=table,
                                      causal=True)  # fmt: skip
        return out.float().square()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    results = []
    for fn in (step, compiled):
        k_cache, v_cache = x.k_cache.clone(), x.v_cache.clone()
        out = fn(x.q, k_cache, v_cache, x.k, x.v, x.rotary_cos, x.rotary_sin, x.cache_seqlens, x.block_table)
        results.append((out, k_cache, v_cache))
    for eager, traced in zip(*results, strict=True):
        assert torch.equal(eager, traced)


def test_opcheck(path):
    case = Case(seqlen_new=1, page_size=16)
    x = make_inputs(case)
    args = (x.q, x.k_cache.clone(), x.v_cache.clone(), x.k, x.v, 0.125)
    kwargs = dict(window_right=0, cache_seqlens=x.cache_seqlens, block_table=x.block_table, rotary_interleaved=True,
                  rotary_per_token=True, num_splits=1)  # fmt: skip
    torch.library.opcheck(torch.ops.flashtile.kvcache_forward.default, args, kwargs)


# Bad input ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch (or CPU-path call) fails the test: errors must come first."""

    def launched(*args, **kwargs):
        raise AssertionError("an implementation was called for invalid input")

    monkeypatch.setattr(flashtile.ops.decode, "kvcache_forward", launched)
    monkeypatch.setattr(flashtile.cpu_decode, "kvcache_forward", launched)


def _bad(**changes):
    """Keyword arguments of a valid paged call (batch 2, page 16, 3 blocks each) with ``changes``."""
    x = make_inputs(Case(page_size=16, seqlen_cache=48, cache_seqlens=(10, 20)))
    kwargs = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, k=x.k, v=x.v, cache_seqlens=x.cache_seqlens,
                  block_table=x.block_table)  # fmt: skip
    kwargs.update({name: change(kwargs) if callable(change) else change for name, change in changes.items()})
    return kwargs


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


BAD = {
    "k-without-v": (lambda: _bad(v=None), ValueError, "k and v must be given together"),
    "v-without-k": (lambda: _bad(k=None), ValueError, "k and v must be given together"),
    "seqlens-beyond-cache": (lambda: _bad(cache_seqlens=_i32(10, 48)), ValueError, r"cache_seqlens \+ seqlen_new"),
    "negative-seqlens": (lambda: _bad(cache_seqlens=_i32(-1, 3)), ValueError, r"cache_seqlens \+ seqlen_new"),
    "int-seqlens-beyond-cache": (lambda: _bad(cache_seqlens=48), ValueError, r"cache_seqlens \+ seqlen_new"),
    "seqlens-int64": (
        lambda: _bad(cache_seqlens=lambda kw: kw["cache_seqlens"].long()),
        TypeError,
        "must have dtype torch.int32",
    ),
    "k-without-seqlens": (lambda: _bad(cache_seqlens=None), ValueError, "cache_seqlens must be given"),
    "block-table-outside": (
        lambda: _bad(
            block_table=lambda kw: kw["block_table"].masked_fill(kw["block_table"] == kw["block_table"][1, 1], 999)
        ),
        ValueError,
        "block_table entries",
    ),  # fmt: skip
    "block-table-negative": (
        lambda: _bad(block_table=lambda kw: kw["block_table"].index_fill(1, torch.tensor([0], device=DEVICE), -1)),
        ValueError,
        "block_table",
    ),
    "page-not-multiple-of-16": (
        lambda: _bad(k_cache=lambda kw: kw["k_cache"][:, :8], v_cache=lambda kw: kw["v_cache"][:, :8]),
        ValueError,
        "multiple of 16",
    ),
    "cache-dtype": (lambda: _bad(k_cache=lambda kw: kw["k_cache"].bfloat16()), TypeError, "share one dtype"),
    "q-float64": (lambda: _bad(q=lambda kw: kw["q"].double()), TypeError, "float16 and torch.bfloat16"),
    "headdim-mismatch": (lambda: _bad(q=lambda kw: kw["q"][..., :32]), ValueError, "share headdim"),
    "heads-not-divisible": (lambda: _bad(q=lambda kw: kw["q"][:, :, :3]), ValueError, "divisible"),
    "headdim-not-mult-8": (
        lambda: _bad(q=lambda kw: kw["q"][..., :60], k_cache=lambda kw: kw["k_cache"][..., :60], k=None, v=None),
        ValueError,
        "multiple of 8",
    ),
    "new-k-heads": (
        lambda: _bad(k=lambda kw: kw["k"][:, :, :1], v=lambda kw: kw["v"][:, :, :1]),
        ValueError,
        "nheads_k",
    ),
    "cache-last-dim-strided": (
        lambda: _bad(k_cache=lambda kw: kw["k_cache"].transpose(-1, -2).contiguous().transpose(-1, -2)),
        ValueError,
        "contiguous last dimension",
    ),
    "batch-idx-with-pages": (lambda: _bad(cache_batch_idx=_i32(0, 1)), ValueError, "cannot be used with a paged"),
    "batch-idx-outside": (
        lambda: _bad(block_table=None, cache_batch_idx=_i32(0, 99), cache_seqlens=_i32(1, 2)),
        ValueError,
        "cache_batch_idx entries",
    ),
    "leftpad-beyond-seqlens": (lambda: _bad(cache_leftpad=_i32(0, 21)), ValueError, "cache_leftpad"),
    "rotary-without-k": (
        lambda: _bad(
            k=None,
            v=None,
            rotary_cos=torch.ones(48, 16, dtype=torch.float16, device=DEVICE),
            rotary_sin=torch.ones(48, 16, dtype=torch.float16, device=DEVICE),
        ),
        ValueError,
        "pass k and v",
    ),  # fmt: skip
    "rotary-cos-without-sin": (
        lambda: _bad(rotary_cos=torch.ones(48, 16, dtype=torch.float16, device=DEVICE)),
        ValueError,
        "together",
    ),
    "rotary-too-short": (
        lambda: _bad(
            rotary_cos=torch.ones(40, 16, dtype=torch.float16, device=DEVICE),
            rotary_sin=torch.ones(40, 16, dtype=torch.float16, device=DEVICE),
        ),
        ValueError,
        "seqlen_ro",
    ),  # fmt: skip
    "rotary-dim-too-big": (
        lambda: _bad(
            rotary_cos=torch.ones(48, 40, dtype=torch.float16, device=DEVICE),
            rotary_sin=torch.ones(48, 40, dtype=torch.float16, device=DEVICE),
        ),
        ValueError,
        "rotary_dim",
    ),  # fmt: skip
    "alibi-shape": (lambda: _bad(alibi_slopes=torch.ones(3, device=DEVICE)), ValueError, "alibi_slopes must have"),
    "alibi-dtype": (lambda: _bad(alibi_slopes=torch.ones(4, dtype=torch.float16, device=DEVICE)), TypeError, "float32"),
    "negative-softcap": (lambda: _bad(softcap=-1.0), ValueError, "softcap"),
    "negative-splits": (lambda: _bad(num_splits=-1), ValueError, "num_splits"),
    "bad-window": (lambda: _bad(window_size=(1,)), TypeError, "window_size"),
}


@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_bad_inputs(no_launch, path, case):
    make, error, message = BAD[case]
    kwargs = make()
    k_cache, v_cache = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
    with pytest.raises(error, match=message):
        flash_attn_with_kvcache(**kwargs)
    assert torch.equal(kwargs["k_cache"], k_cache) and torch.equal(kwargs["v_cache"], v_cache)


AFTER_A_GOOD_CALL = {
    "int-seqlens": (dict(cache_seqlens=10), dict(cache_seqlens=48), ValueError, r"cache_seqlens \+ seqlen_new"),
    "scale-bool": (dict(softmax_scale=1), dict(softmax_scale=True), TypeError, "softmax_scale must be a float"),
    "window-bool": (dict(window_size=(1, 0)), dict(window_size=(True, 0)), TypeError, "window_size"),
}
"""(changes of a valid call, changes of an invalid one that differs from it only in an argument's type or value,
error, message)."""


@pytest.mark.parametrize("case", [*BAD, *AFTER_A_GOOD_CALL])
def test_bad_inputs_after_a_good_call(monkeypatch, case):
    """The checks a call passed are kept for its layouts and options (``flashtile.kvcache._call_key``): a call that
    differs in anything a check reads (a dtype, shape, stride, an option's type or value, an int cache_seqlens) is
    checked again, and index values are checked on every call."""
    launches = []

    def launched(q, *args):
        launches.append(q)
        return q, q

    monkeypatch.setattr(flashtile.ops.decode, "kvcache_forward", launched)
    monkeypatch.setattr(flashtile.cpu_decode, "kvcache_forward", launched)
    if case in BAD:
        good, (make, error, message) = {}, BAD[case]
    else:
        good, bad, error, message = AFTER_A_GOOD_CALL[case]
        make = partial(_bad, **bad)
    for _ in range(2):  # checked, then kept
        flash_attn_with_kvcache(**_bad(**good))
    with pytest.raises(error, match=message):
        flash_attn_with_kvcache(**make())
    assert len(launches) == 2


def test_checks_kept_per_layout(monkeypatch):
    """Calls of one layout are checked once; a changed dtype, stride or option is checked anew."""
    checks = []
    check_call = flashtile.kvcache._check_call
    monkeypatch.setattr(flashtile.kvcache, "_check_call", lambda *args: checks.append(1) or check_call(*args))
    flashtile.kvcache._CHECKED.clear()
    calls = [
        _bad(), _bad(), _bad(q=lambda kw: kw["q"].float(), k_cache=lambda kw: kw["k_cache"].float(),
        v_cache=lambda kw: kw["v_cache"].float(), k=lambda kw: kw["k"].float(), v=lambda kw: kw["v"].float()),
        _bad(q=lambda kw: torch.cat([kw["q"], kw["q"]], -1)[..., : kw["q"].shape[-1]]),
        _bad(softcap=5.0), _bad(softcap=5.0),
    ]  # fmt: skip
    for kwargs in calls:
        flash_attn_with_kvcache(**kwargs)
    assert len(checks) == 4


def _decoder_layer(nheads_k: int, head_dim: int, seqlen_cache: int, dtype: torch.dtype, seed: int) -> tuple:
    """q (2, 1, 4, head_dim) and a contiguous cache (2, seqlen_cache, nheads_k, head_dim) of ``dtype``: one layer's
    tensors in a decoding step."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 1, 4, head_dim, generator=gen).to(DEVICE, dtype)
    k_cache, v_cache = (torch.randn(2, seqlen_cache, nheads_k, head_dim, generator=gen).to(DEVICE, dtype) for _ in "kv")
    return q, k_cache, v_cache


def test_decoder_matches_calls(path, monkeypatch):
    """``kvcache.Decoder`` (a decoding step's layers, sharing cache lengths and options) gives each call the result of
    ``flash_attn_with_kvcache`` with the same arguments, bitwise, with layouts alternating over two rounds (another
    nheads_k, cache length, dtype; a head dim not a multiple of 8, which the public function pads): each layout is
    checked and prepared once, and a layout seen before is never served another's options."""
    prepares = []
    prepare = flashtile.kvcache.Decoder._prepare
    monkeypatch.setattr(flashtile.kvcache.Decoder, "_prepare", lambda *a: prepares.append(1) or prepare(*a))
    seqlens, leftpad = _i32(40, 90), _i32(3, 0)
    arguments = dict(cache_seqlens=seqlens, cache_leftpad=leftpad, softmax_scale=0.3, causal=True, softcap=20.0)
    decoder = flashtile.kvcache.Decoder(**arguments)
    layouts = [(2, 64, 96, torch.float16), (1, 64, 128, torch.float16), (2, 32, 96, torch.float32),
               (2, 36, 96, torch.float16)]  # fmt: skip
    for round in range(2):
        for seed, layout in enumerate(layouts):
            q, k_cache, v_cache = _decoder_layer(*layout, seed=10 * round + seed)
            out = decoder(q, k_cache, v_cache)
            expected = flash_attn_with_kvcache(q, k_cache, v_cache, **arguments)
            assert out.shape == (2, 1, 4, layout[1]) and torch.equal(out, expected)
    assert len(prepares) == 3  # the padded layout takes the public function


def test_decoder_prepared_launch(path, monkeypatch):
    """A decoder's later calls of a layout take the launch prepared for it (past ``_ops.kvcache``) with the result of
    ``flash_attn_with_kvcache``, bitwise; calls that the dispatcher must see take ``_ops.kvcache``: under
    ``flashtile.profile()``, with a gradient wanted, and (on the Triton path) a q whose address is not 16-byte
    aligned, which the kernels specialize on."""
    arguments = dict(cache_seqlens=_i32(40, 90), cache_leftpad=_i32(3, 0), softmax_scale=0.3, causal=True)
    decoder = flashtile.kvcache.Decoder(**arguments)
    dispatched = []
    kvcache = flashtile._ops.kvcache
    monkeypatch.setattr(flashtile._ops, "kvcache", lambda *a: dispatched.append(1) or kvcache(*a))

    def dispatches(q, k_cache, v_cache) -> int:
        """How many calls of ``_ops.kvcache`` the decoder's call made; its result checked."""
        expected = flash_attn_with_kvcache(q.detach(), k_cache, v_cache, **arguments)
        before = len(dispatched)
        assert torch.equal(decoder(q, k_cache, v_cache), expected)
        return len(dispatched) - before

    q, k_cache, v_cache = _decoder_layer(2, 64, 96, torch.float16, seed=0)
    assert dispatches(q, k_cache, v_cache) == 0
    for seed in range(1, 3):  # the same layout, other values
        assert dispatches(*_decoder_layer(2, 64, 96, torch.float16, seed=seed)) == 0
    with flashtile.profile():
        assert dispatches(q, k_cache, v_cache) == 1
    before = len(dispatched)
    with pytest.raises(RuntimeError):  # as flash_attn_with_kvcache: no gradient
        decoder(q.clone().requires_grad_(), k_cache, v_cache).sum().backward()
    assert len(dispatched) == before + 1
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    assert dispatches(shifted, k_cache, v_cache) == (path == "triton")


def test_decoder_checks_each_layout(monkeypatch):
    """A decoder's first call of a layout is checked as ``flash_attn_with_kvcache`` checks it, whatever layouts passed
    before: a cache whose dtype differs from q's, or whose heads do not divide q's, raises; cache lengths that fit
    one cache raise for a shorter one (the index values are checked against each layout's cache); and the index
    values are checked under the decoder's own ``check_values`` where it was given one, whatever the setting around
    its calls."""
    decoder = flashtile.kvcache.Decoder(cache_seqlens=_i32(40, 150), causal=True)
    q, k_cache, v_cache = _decoder_layer(2, 64, 160, torch.float16, seed=0)
    decoder(q, k_cache, v_cache)
    with pytest.raises(TypeError, match="k_cache has dtype"):
        decoder(q, k_cache.float(), v_cache.float())
    with pytest.raises(ValueError, match="must be divisible by nheads_k"):
        decoder(*_decoder_layer(3, 64, 160, torch.float16, seed=1))
    with pytest.raises(ValueError, match=r"cache_seqlens \+ seqlen_new"):
        decoder(*_decoder_layer(2, 64, 96, torch.float16, seed=2))
    decoder(q, k_cache, v_cache)  # the layout that passed still passes
    settings = []
    values_checked = flashtile.kvcache._backend.values_checked
    monkeypatch.setattr(
        flashtile.kvcache._backend, "values_checked",
        lambda device: settings.append(flashtile.kvcache._backend._check_values.get()) or values_checked(device),
    )  # fmt: skip
    unchecked = flashtile.kvcache.Decoder(cache_seqlens=_i32(40, 150), causal=True, check_values=False)
    with flashtile.check_values(True):
        unchecked(q, k_cache, v_cache)
        unchecked(q, k_cache, v_cache)
    assert settings == [False]


def test_unused_block_table_entries_may_hold_anything(path):
    """Entries past cache_seqlens + seqlen_new (here -1, as a serving engine leaves them) are never read."""
    case = Case(page_size=16, seqlen_cache=96, cache_seqlens=(10, 40))
    x = make_inputs(case)
    table = x.block_table.clone()
    table[0, 1:] = -1  # batch entry 0 uses one block (positions 0..10)
    table[1, 3:] = -1  # batch entry 1 uses three (positions 0..40)
    out, *_ = call(case, x, block_table=table)
    expected, *_ = call(case, x)
    assert torch.equal(out, expected)


# The host path ------------------------------------------------------------------------------------------


class _Passthrough(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing: its presence routes calls through the custom op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", [Case(page_size=16, rotary_dim=32, seqlen_q=2, seqlen_new=2), Case(leftpad=True)])
def test_eager_call_matches_custom_op(path, case):
    """Plain eager calls skip the custom op's dispatch; the result, the cache and the caches' version
    counters (autograd's record of in-place writes) are those of the custom op."""
    x = make_inputs(case)
    results = []
    for through_op in (False, True):
        with _Passthrough() if through_op else contextlib.nullcontext():
            out, lse, k_cache, v_cache = call(case, x)
        results.append((out, lse, k_cache, v_cache, k_cache._version, v_cache._version))
    for eager, op in zip(*results, strict=True):
        assert torch.equal(eager, op) if isinstance(eager, torch.Tensor) else eager == op
    assert results[0][4] > 0 and results[0][5] > 0


def test_eager_path_skips_custom_op(path, monkeypatch):
    """The custom op runs only when something traces or intercepts (here a torch function mode)."""
    calls = []
    op = flashtile._ops.kvcache_forward

    def counted(*args):
        calls.append(1)
        return op(*args)

    monkeypatch.setattr(flashtile._ops, "kvcache_forward", counted)
    case = Case()
    x = make_inputs(case)
    call(case, x)
    assert not calls
    with _Passthrough():
        call(case, x)
    assert len(calls) == 1


def test_inference_mode(path):
    """Under torch.inference_mode (how serving stacks decode) the eager path runs; caches made outside it."""
    case = Case(page_size=16)
    x = make_inputs(case)
    expected, *_ = call(case, x)
    with torch.inference_mode():
        out, *_ = call(case, x)
    assert torch.equal(out, expected)


def test_host_copy_of_index_tensors():
    """The value checks copy every index tensor to the host in one piece and split it back."""
    tensors = {
        "a": torch.arange(3, dtype=torch.int32),
        "b": torch.arange(12, dtype=torch.int32).view(3, 4)[:, ::2],
        "c": torch.zeros(0, dtype=torch.int32),
    }
    host = flashtile.kvcache._copy_to_host(tensors)
    assert list(host) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(host[name], t)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 16, 17, 63, 64, 65, 1000])
def test_host_helpers_match_triton(n):
    import triton

    assert configs.next_power_of_2(n) == triton.next_power_of_2(n)
    assert cdiv(n, 16) == triton.cdiv(n, 16)


# Splits merged in the kernel ----------------------------------------------------------------------------
# With num_splits > 1 every split takes a ticket from its tile's counter and the last one merges the
# splits (ops/decode/split_kv.py); the counters must be back at zero after each launch.


def counters_are_zero(device: torch.device) -> bool:
    counters = split_kv._counters.get(device)
    return counters is not None and not counters.any()


@pytest.mark.parametrize(
    "case",
    [
        Case(batch=2, seqlen_q=17, seqlen_new=3, nheads=8, seqlen_cache=256, cache_seqlens=(200, 90), num_splits=3),
        Case(batch=2, seqlen_q=17, seqlen_new=3, nheads=8, seqlen_cache=256, cache_seqlens=(200, 90), num_splits=7),
        Case(batch=1, nheads=2, nheads_k=1, seqlen_cache=2048, cache_seqlens=(2000,), num_splits=64, page_size=64),
    ],
    ids=["splits3-2tiles", "splits7-2tiles-some-empty", "splits64"],
)
def test_many_splits(case):
    """Several (batch entry x kv head, query tile) counters at once; 7 splits of 8 key tiles leave some
    empty (2 tiles each); 64 splits of one key tile each (interpreter; 16 on a GPU's wider tiles)."""
    out, _ = check(case)
    assert counters_are_zero(out.device)


def test_heuristic_splits_on_long_cache(monkeypatch):
    """num_splits=0 with an H200's 132 SMs: one program splits into every key tile (8 on the GPU), or every two past
    WIDE_MERGE splits (the interpreter's 32 tiles: 16 splits)."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    case = Case(batch=1, nheads=8, nheads_k=1, seqlen_cache=1024, cache_seqlens=(1000,), num_splits=0)
    cfg = configs.config(torch.device(DEVICE), case.head_dim)
    expected = {128: 8, 32: 16}[cfg.block_n]  # 8 tiles of 128 keys; 32 tiles of 32 keys, two per split
    assert configs.num_splits(0, torch.device(DEVICE), 1, case.seqlen_cache, cfg) == expected
    check(case)


def test_repeated_split_calls_reset_counters():
    """Ten steps in a row, with other cache lengths and split counts each time, reuse one zeroed buffer."""
    counters = None
    for step in range(10):
        case = Case(seqlen_cache=128, cache_seqlens=(10 * step + 3, 120 - 7 * step), num_splits=2 + step % 4)
        out, _ = check(case)
        device = out.device
        assert counters_are_zero(device), f"step {step}: counters not reset"
        counters = split_kv._counters[device] if counters is None else counters
        assert split_kv._counters[device] is counters, "the counters were reallocated"


def test_split_counters_grow_and_keep_old(monkeypatch):
    """One zeroed buffer per device, replaced by a larger one only when a launch needs more counters; the
    outgrown one stays alive (a captured CUDA graph may still use it)."""
    monkeypatch.setattr(split_kv, "_counters", {})
    monkeypatch.setattr(split_kv, "_kept", [])
    device = torch.device("cpu")
    first = split_kv.split_counters(device, 10)
    assert first.dtype == torch.int32 and first.numel() == split_kv.MIN_COUNTERS and not first.any()
    assert split_kv.split_counters(device, split_kv.MIN_COUNTERS) is first
    grown = split_kv.split_counters(device, split_kv.MIN_COUNTERS + 1)
    assert grown.numel() == 2 * split_kv.MIN_COUNTERS and not grown.any()
    assert split_kv._kept == [first] and split_kv.split_counters(device, 1) is grown


def test_split_counters_during_capture(monkeypatch):
    """A CUDA graph capture uses the device's buffer when it is large enough; otherwise each launch gets
    its own (zeroed by the graph on replay), kept alive, and the device's buffer stays as it was."""
    monkeypatch.setattr(split_kv, "_counters", {})
    monkeypatch.setattr(split_kv, "_kept", [])
    monkeypatch.setattr(split_kv, "_capturing", lambda device: True)
    device = torch.device("cpu")
    own = split_kv.split_counters(device, 10)
    assert split_kv._counters == {} and split_kv._kept == [own]
    assert split_kv.split_counters(device, 10) is not own  # nothing zeroes ``own`` before a replay
    monkeypatch.setattr(split_kv, "_capturing", lambda device: False)
    eager = split_kv.split_counters(device, 10)
    monkeypatch.setattr(split_kv, "_capturing", lambda device: True)
    assert split_kv.split_counters(device, 10) is eager


# The append folded into the attention kernel ------------------------------------------------------------
# New keys are read from k and v by every program that attends to them and written to the cache by one
# program each (ops/decode/append.py); these cases put them where the other tests rarely do.


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_new_tokens_fill_whole_key_tiles(path, causal):
    """40 new tokens after 24 and 7 cached ones: whole key tiles of new keys (interpreter tiles are 32
    wide), which without a mask would take the kernel's unmasked path; 3 splits share them."""
    check(Case(seqlen_q=40, seqlen_new=40, cache_seqlens=(24, 7), seqlen_cache=128, causal=causal, num_splits=3))


def test_new_tokens_without_queries(path):
    """seqlen_q = 0 with new k, v: nothing to attend, the cache is still appended to."""
    case = Case(seqlen_q=1, seqlen_new=3, page_size=16, rotary_dim=32, causal=False)
    x = make_inputs(case)
    out, lse, k_cache, v_cache = call(case, x, q=x.q[:, :0])
    assert out.shape == (case.batch, 0, case.nheads, case.head_dim) and lse.shape == (case.batch, case.nheads, 0)
    _, _, expected_k, expected_v = call(case, x)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_new", [1, 17])
@pytest.mark.parametrize("num_splits", [2, 4, 8, 64])
def test_split_merge_is_race_free_on_gpu(num_splits, seqlen_new):
    """The last-ticket merge under real concurrency: 300 eager steps and 300 CUDA-graph replays of one
    step give the first step's bits every time, and the counters end at zero (B=1, Hkv 8, Hq 32, D 128)."""
    gen = torch.Generator(device="cuda").manual_seed(num_splits)
    shape = (1, 4096, 8, 128)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new, v_new = (torch.randn(1, seqlen_new, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))  # fmt: skip
    seqlens = torch.full((1,), 3000, device="cuda", dtype=torch.int32)

    def step() -> torch.Tensor:
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                       num_splits=num_splits)  # fmt: skip

    first = step()
    outs = [step() for _ in range(300)]
    graph, replayed = capture(step)
    for _ in range(300):
        graph.replay()
        outs.append(replayed.clone())
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    assert counters_are_zero(first.device)
    assert torch.equal(k_cache[0, 3000 : 3000 + seqlen_new], k_new[0])
