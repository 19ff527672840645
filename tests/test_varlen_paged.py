"""flash_attn_varlen_func with a block_table (paged K/V), against the oracle sequence by sequence.

Each case draws random pages and a shuffled block table: sequences' pages in no order, pages that no
sequence uses, entries past a sequence's last page set to -1 (never read) and, where said, a page shared
by two sequences. The packed keys the oracle sees are gathered from the pages by hand; the oracle's key
gradients are added back into pages by hand (a page's gradient sums over the keys it holds, zero for an
unused page) and the tolerance rule (``reference.within_tolerance``) is applied to the page tensors. The same call
without pages on the gathered keys must give the same bits on every path (same kernels, same tiles,
dropout's mask included). Outputs start as NaN (conftest), so a row no program writes fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile import _backend
from oracle import assert_within_rule
from test_variants import sinks_like, slopes_like
from test_varlen import _int32, cu_seqlens, no_launch, run_varlen, varlen_oracle  # noqa: F401 (fixture)

SPARE_PAGES = 3  # pages no sequence uses


@dataclass
class Paged:
    q: torch.Tensor
    k_pages: torch.Tensor  # (num_blocks, page_size, nheads_k, head_dim)
    v_pages: torch.Tensor
    block_table: torch.Tensor  # (batch, max_blocks) int32
    dout: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    slots: tuple[torch.Tensor, torch.Tensor]  # (page, row) of each packed key, gathered by hand
    k: torch.Tensor  # the packed keys: k_pages[slots]
    v: torch.Tensor


def make_paged(seqlens_q, seqlens_k, page_size, nheads=4, nheads_k=2, head_dim=32, head_dim_v=None,
               dtype=torch.float16, share=False, seed=0) -> Paged:  # fmt: skip
    """Random pages and q, a shuffled block table for the given lengths; with ``share`` sequence 1's first
    block is sequence 0's first page (its own first page goes unused)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    blocks = [-(-length // page_size) for length in seqlens_k]
    num_blocks = sum(blocks) + SPARE_PAGES
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seqlens_k), max(blocks) + 1), -1, dtype=torch.int32)  # a column no sequence reaches
    for b, n in enumerate(blocks):
        table[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        del order[:n]
    if share:
        table[1, 0] = table[0, 0]
    table = table.to(DEVICE)
    seq = torch.repeat_interleave(torch.arange(len(seqlens_k)), torch.tensor(seqlens_k)).to(DEVICE)
    pos = torch.cat([torch.arange(length) for length in seqlens_k]).to(DEVICE)
    slots = (table[seq, pos // page_size].long(), pos % page_size)
    k_pages = randn(num_blocks, page_size, nheads_k, head_dim)
    v_pages = randn(num_blocks, page_size, nheads_k, head_dim_v or head_dim)
    q = randn(sum(seqlens_q), nheads, head_dim)
    dout = randn(sum(seqlens_q), nheads, head_dim_v or head_dim)
    return Paged(q, k_pages, v_pages, table, dout, cu_seqlens(seqlens_q), cu_seqlens(seqlens_k), slots,
                 k_pages[slots], v_pages[slots])  # fmt: skip


def into_pages(rows, x: Paged, pages, accumulate_dtype):
    """Packed key gradients added into zeros shaped like ``pages``, by hand."""
    total = torch.zeros(pages.shape, dtype=accumulate_dtype, device=DEVICE)
    return total.index_put_(x.slots, rows.to(accumulate_dtype), accumulate=True).to(pages.dtype)


def run_paged(x: Paged, **kwargs):
    """The paged call (return_attn_probs) and its backward: out, lse, dq, dk and dv as pages (, dsink)."""
    return run_varlen(x.q, x.k_pages, x.v_pages, x.dout, x.cu_q, x.cu_k, block_table=x.block_table, **kwargs)


def check_paged(results, x: Paged, **options):
    """The tolerance rule: packed results against the oracle on the gathered keys, dk and dv as pages."""
    precise = torch.float64 if DEVICE == "cpu" else torch.float32
    ref = varlen_oracle(x.q, x.k, x.v, x.dout, x.cu_q, x.cu_k, precise, **options)
    base = varlen_oracle(x.q, x.k, x.v, x.dout, x.cu_q, x.cu_k, x.q.dtype, **options)
    for oracle in (ref, base):
        oracle["dk"] = into_pages(oracle["dk"], x, x.k_pages, torch.float64)
        oracle["dv"] = into_pages(oracle["dv"], x, x.v_pages, torch.float64)
    for name, value in results.items():
        assert_within_rule(name, value, ref[name], base[name])


def assert_same_as_unpaged(paged, x: Paged, seed=0, **kwargs):
    """Bit for bit what the call without pages gives on the gathered keys (its key gradients added into
    pages in float32, as flashtile does)."""
    torch.manual_seed(seed)
    unpaged = run_varlen(x.q, x.k, x.v, x.dout, x.cu_q, x.cu_k, **kwargs)
    unpaged["dk"] = into_pages(unpaged["dk"], x, x.k_pages, torch.float32)
    unpaged["dv"] = into_pages(unpaged["dv"], x, x.v_pages, torch.float32)
    for name, value in paged.items():
        assert torch.equal(value, unpaged[name]), f"{name} differs from the call without pages"


def unused_pages(x: Paged) -> torch.Tensor:
    used = torch.zeros(x.k_pages.shape[0], dtype=torch.bool, device=DEVICE)
    used[x.slots[0]] = True
    return ~used


# Lengths 0 and 1, seqlen_q != seqlen_k both ways, keys over several pages, a sequence without keys.
SEQLENS_Q, SEQLENS_K = [1, 40, 0, 60, 7], [1, 150, 5, 33, 0]


@pytest.mark.parametrize("page_size", [16, 32, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_against_oracle(path, causal, page_size):
    x = make_paged(SEQLENS_Q, SEQLENS_K, page_size)
    results = run_paged(x, causal=causal)
    check_paged(results, x, causal=causal)
    assert torch.all(results["dk"][unused_pages(x)] == 0) and torch.all(results["dv"][unused_pages(x)] == 0)
    assert_same_as_unpaged(results, x, causal=causal)


def test_bf16_window_mqa(path):
    x = make_paged([30, 1, 50], [45, 17, 20], 16, nheads=3, nheads_k=1, dtype=torch.bfloat16, seed=1)
    results = run_paged(x, window_size=(7, 3))
    check_paged(results, x, window_size=(7, 3))


def test_shared_page_gets_both_gradients(path):
    """Sequences 0 and 1 start with the same page (a shared prefix): its gradient is the sum of both."""
    x = make_paged([20, 9], [40, 25], 16, share=True, seed=2)
    assert x.block_table[0, 0] == x.block_table[1, 0]
    results = run_paged(x, causal=True)
    check_paged(results, x, causal=True)
    assert_same_as_unpaged(results, x, causal=True)


OPTIONS = {
    "window-gqa": {"window_size": (7, 23)},
    "softcap-alibi-sink-dlse": {"causal": True, "softcap": 5.0, "alibi_slopes": slopes_like((5, 4))},
    "dropout": {"causal": True, "dropout_p": 0.3},
    "scale-head-dim-v": {"softmax_scale": 0.3},
}


@pytest.mark.parametrize("name", OPTIONS, ids=OPTIONS.keys())
def test_options_same_as_unpaged(path, name):
    """Every option gives, bit for bit, what it gives without pages on the gathered keys (which
    tests/test_varlen.py checks against the oracle); dropout's keep mask included."""
    kwargs = dict(OPTIONS[name])
    x = make_paged(SEQLENS_Q, SEQLENS_K, 32, head_dim_v=64 if name == "scale-head-dim-v" else None, seed=3)
    if name.startswith("softcap"):
        kwargs.update(learnable_sink=sinks_like(4), dlse=torch.randn(4, x.q.shape[0], device=DEVICE))
    torch.manual_seed(0)
    assert_same_as_unpaged(run_paged(x, **kwargs), x, **kwargs)


def test_opcheck(path):
    x = make_paged([5, 0, 30], [20, 3, 30], 16)
    q, k, v = (t.requires_grad_() for t in (x.q, x.k_pages, x.v_pages))
    rng = torch.tensor([123, 4], dtype=torch.int64, device=DEVICE)
    args = (q, k, v, x.cu_q, x.cu_k, 30, 30, 0.2, None, 0, slopes_like((3, 4)), 5.0, sinks_like(4).requires_grad_(),
            0.2, rng)  # fmt: skip
    op = torch.ops.flashtile.varlen_attention_forward.default
    torch.library.opcheck(op, args, kwargs=dict(block_table=x.block_table))


def test_compile_fullgraph(path):
    x = make_paged([17, 1, 40], [30, 2, 40], 16, dtype=torch.bfloat16)

    def attention_block(q, k_pages, v_pages):
        out = flashtile.flash_attn_varlen_func(q * 1.5, k_pages, v_pages, x.cu_q, x.cu_k, 40, 40, causal=True,
                                               block_table=x.block_table)  # fmt: skip
        return out.float().square()

    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (attention_block, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k_pages, x.v_pages)]
        out = fn(*leaves)
        out.backward(x.dout.float())
        results.append([out, *(t.grad for t in leaves)])
    for eager, traced in zip(*results, strict=True):
        assert torch.equal(eager, traced)


# Bad input: a clear error before anything launches.


def _paged_call(x: Paged, **changes):
    kwargs = dict(q=x.q, k=x.k_pages, v=x.v_pages, cu_seqlens_q=x.cu_q, cu_seqlens_k=x.cu_k, max_seqlen_q=9,
                  max_seqlen_k=40, block_table=x.block_table)  # fmt: skip
    kwargs.update(changes)
    return flashtile.flash_attn_varlen_func(**kwargs)


BAD = {
    "int64": (lambda x: {"block_table": x.block_table.long()}, TypeError, "dtype torch.int32"),
    "1-D": (lambda x: {"block_table": x.block_table[0]}, ValueError, r"\(batch_size, max_num_blocks_per_seq\)"),
    "rows-not-batch": (lambda x: {"block_table": x.block_table[:1]}, ValueError, "batch_size = 2"),
    "k-packed": (lambda x: {"k": x.k, "v": x.v}, ValueError, "4 dimensions"),
    "v-pages-differ": (lambda x: {"v": x.v_pages[:, :8]}, ValueError, "share num_blocks, page_block_size"),
    "page-not-multiple-of-16": (
        lambda x: {"k": x.k_pages[:, :8], "v": x.v_pages[:, :8]},
        ValueError,
        "multiple of 16",
    ),
    "no-pages": (lambda x: {"k": x.k_pages[:0], "v": x.v_pages[:0]}, ValueError, "at least one page"),
    "entry-past-pages": (
        lambda x: {"block_table": x.block_table.masked_fill(x.block_table == x.block_table[1, 1], 99)},
        ValueError,
        r"block_table entries that cover a key must lie in \[0, 9\).*\[99\] at \[\[1, 1\]\]",
    ),
    "entry-negative": (
        lambda x: {"block_table": x.block_table.index_fill(1, _int32([0]).long(), -1)},
        ValueError,
        "cover a key",
    ),
    "too-few-blocks": (lambda x: {"block_table": x.block_table[:, :2]}, ValueError, "row reaches only 32"),
    "max-seqlen-k": (lambda x: {"max_seqlen_k": 39}, ValueError, "max_seqlen_k = 39 is smaller"),
    "sink-heads": (lambda x: {"learnable_sink": sinks_like(3)}, ValueError, "learnable_sink must have shape"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input(no_launch, case):  # noqa: F811 (the fixture)
    changes, error, match = case
    x = make_paged([5, 9], [33, 40], 16)  # 3 blocks each, 9 pages, a -1 column
    with pytest.raises(error, match=match):
        _paged_call(x, **changes(x))


def test_unread_entries_may_hold_anything(path):
    """Entries past a sequence's last page are never read."""
    x = make_paged([5, 9], [33, 40], 16)
    table = x.block_table.clone()
    table[:, -1] = torch.tensor([2**30, -7])
    assert torch.equal(_paged_call(x, block_table=table), _paged_call(x))


@pytest.fixture
def unchecked(monkeypatch):
    """Values are not checked (as on a GPU with check_values(False))."""
    monkeypatch.setattr(_backend, "values_checked", lambda device: False)


WILD = 2**30


@pytest.mark.parametrize("bad", ["entries", "lengths"])
def test_bad_values_unchecked_stay_inside(path, unchecked, bad):
    """Unchecked wild block-table entries or key lengths past a row's pages: forward and backward finish and
    stay inside the tensors (clamped; the interpreter dereferences raw addresses like a GPU)."""
    x = make_paged([5, 9], [33, 40], 16)
    if bad == "entries":
        x.block_table.masked_fill_(x.block_table >= 0, WILD)
    else:
        x.cu_k = _int32([0, 30, WILD])
    q, k, v = (t.requires_grad_() for t in (x.q, x.k_pages, x.v_pages))
    out = _paged_call(x, q=q, k=k, v=v, cu_seqlens_k=x.cu_k, max_seqlen_k=64, block_table=x.block_table)
    out.backward(x.dout)
    for name, value in {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        assert torch.isfinite(value).all(), name
