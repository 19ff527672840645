"""The public functions under torch.compile: opcheck of the custom ops, tracing without graph breaks, and
shapes that change from call to call.

Every public entry point is compiled with ``dynamic=True`` (one graph with symbolic sizes for every call)
and with the default ``dynamic=None`` (a graph for the first call's sizes, then, when the second call brings
other lengths, batch sizes or max_seqlen, one graph with those sizes symbolic, which the later calls reuse).
Each call runs eagerly and compiled on copies of the same inputs; outputs and gradients must be equal bit
for bit, since the same kernels run on the same values (the custom ops are opaque to the compiler). The
calls after those that must compile run with torch.compile's stance "fail_on_recompile", so a recompile on
every new shape (which would soon reach ``torch._dynamo.config.recompile_limit`` and fall back to eager)
fails the test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile.padding import index_first_axis
from test_attention import make_inputs
from test_kvcache import Case
from test_kvcache import make_inputs as kvcache_inputs
from test_variants import sinks_like, slopes_like
from test_varlen import make_varlen
from test_varlen_paged import make_paged

BACKENDS = ["eager", "aot_eager"]
H, HK, D = 3, 1, 32
"""nheads, nheads_k and headdim of most calls below. Within a call no two sizes are equal (other than those
that must be), nor equal to these: torch's duck sizing gives equal sizes one symbol, and a later call where
they differ would recompile."""
SHAPES = [(2, 17, 30), (4, 9, 25), (5, 30, 13)]
"""(batch, seqlen_q, seqlen_k) of consecutive calls: all three change."""
DYNAMIC = {"dynamic": True, "automatic": None}
"""torch.compile's ``dynamic``: True marks every size symbolic from the start; None (the default) compiles the
first call's sizes and recompiles once with the sizes that changed made symbolic."""
ONE_PATH = pytest.mark.parametrize("path", ["cpu" if DEVICE == "cpu" else "triton"], indirect=True)
"""The path of the shape-changing tests: the custom ops are opaque to the compiler, so what is traced and
compiled does not depend on the kernels behind them. On a CPU-only machine these tests run flashtile.cpu (the
Triton interpreter took seven times as long on them: 998 s against 139 s on a 2-core machine); opcheck and the
inductor tests run both paths."""


def test_opcheck(path):
    q, k, v, _ = make_inputs(1, 33, 40, 2, 1, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashtile.attention_forward.default, (q, k, v, 0.2, None, 0))


@pytest.mark.parametrize("layout", ["rows", "head_major", "packed"])
def test_opcheck_backward_layouts(path, layout):
    """The backward op's gradients have the strides its register_fake declares (torch.empty_like of q, k, v) for
    (B, N, H, D) inputs, for torch's (B, H, N, D) layout seen as transposed views, and for views into a packed qkv
    tensor (not dense: contiguous gradients); torch.compile's generated code relies on them."""
    batch, seqlen, nheads, dim = 2, 33, 2, 32
    if layout == "packed":
        q, k, v = torch.randn(batch, seqlen, 3, nheads, dim, device=DEVICE).unbind(2)
    else:
        shape = (batch, nheads, seqlen, dim) if layout == "head_major" else (batch, seqlen, nheads, dim)
        q, k, v = (torch.randn(shape, device=DEVICE) for _ in range(3))
        if layout == "head_major":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = torch.ops.flashtile.attention_forward(q, k, v, 0.2, None, 0)
    args = (torch.randn_like(out), q, k, v, out, lse, None, 0.2, None, 0)
    grads = torch.ops.flashtile.attention_backward(*args)
    for grad, x in zip(grads, (q, k, v), strict=False):
        assert grad.stride() == torch.empty_like(x).stride()
    torch.library.opcheck(torch.ops.flashtile.attention_backward.default, args)


# ---------------------------------------------------------------------------------------------------
# Changing shapes


def compiled_matches_eager(fn, calls, backend, dynamic, grads=(), fullgraph=True):
    """Run ``fn(*args)`` eagerly and compiled for each ``args`` of ``calls``, on copies of the inputs.

    grads: the positions of the arguments to differentiate: the backward of (out * dout).sum() over every
    floating point output (dout drawn per call) runs in both, and the gradients are compared too. The
    tensors among the arguments are compared after each call as well (in-place updates, e.g. a KV cache).
    Every result must be equal bit for bit.
    Only the first call (dynamic=True) or the first two (dynamic=None: the first call's sizes, then symbolic
    ones) may compile: the later calls run with torch.compile's stance "fail_on_recompile".
    """
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
    compiling_calls = 1 if dynamic else 2
    for number, args in enumerate(calls):
        stance = "default" if number < compiling_calls else "fail_on_recompile"
        with torch.compiler.set_stance(stance):
            results = [_run(f, args, grads, seed=number) for f in (fn, compiled)]
        for eager, traced in zip(*results, strict=True):
            _assert_equal(eager, traced)


def _run(fn, args, grads, seed):
    """fn on copies of args (those at ``grads`` requiring grad) with torch's generator seeded (dropout draws
    the same mask): its outputs, the copied tensor arguments afterwards, and the gradients."""
    args = [_copy(a, requires_grad=i in grads) for i, a in enumerate(args)]
    torch.manual_seed(seed)
    out = fn(*args)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    results = [*outs, *(a for a in args if isinstance(a, torch.Tensor))]
    if grads:
        gen = torch.Generator().manual_seed(seed)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs
                   if o.is_floating_point())  # fmt: skip
        results += torch.autograd.grad(loss, [args[i] for i in grads])
    return results


def _copy(a, requires_grad):
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().clone().requires_grad_(requires_grad)


def _assert_equal(eager, traced):
    assert eager.shape == traced.shape and eager.dtype == traced.dtype
    assert torch.equal(eager, traced), f"max difference {(eager.float() - traced.float()).abs().max()}"


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_func_dynamic(path, backend, dynamic):
    """Batch, seqlen_q and seqlen_k change, four times; MQA, causal, softmax_lse returned (and differentiated)."""

    def attention_block(q, k, v):
        return flashtile.flash_attn_func(q * 1.5, k, v, causal=True, return_attn_probs=True)

    shapes = [*SHAPES, (2, 5, 19)]
    calls = [make_inputs(b, sq, sk, H, HK, D, dtype=torch.bfloat16)[:3] for b, sq, sk in shapes]
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1, 2))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_qkvpacked_func_dynamic(path, backend, dynamic):
    """Batch and seqlen change; ALiBi slopes (nheads,), softcap and a head dim of 36 (zero-padded to 40)."""

    def attention_block(qkv, slopes):
        return flashtile.flash_attn_qkvpacked_func(qkv, causal=True, softcap=5.0, alibi_slopes=slopes)

    calls = []
    for b, s in ((2, 17), (4, 9), (5, 13)):
        q, k, v, _ = make_inputs(b, s, s, H, H, 36)
        calls.append((torch.stack([q, k, v], dim=2), slopes_like((H,))))
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0,))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_kvpacked_func_dynamic(path, backend, dynamic):
    """Batch, seqlen_q and seqlen_k change; MQA, a sliding window and a learnable sink."""

    def attention_block(q, kv, sink):
        return flashtile.flash_attn_kvpacked_func(q, kv, window_size=(7, 3), learnable_sink=sink)

    calls = []
    for b, sq, sk in ((4, 17, 30), (5, 9, 25), (2, 30, 13)):  # batch 2 first would share kv's packing dim's symbol
        q, k, v, _ = make_inputs(b, sq, sk, H, HK, D)
        calls.append((q, torch.stack([k, v], dim=2), sinks_like(H)))
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1, 2))


VARLEN_LENGTHS = [([5, 12, 9, 3], [7, 3, 14, 1]), ([9, 3, 20, 6, 11], [1, 35, 4, 8, 3]), ([17, 1, 20], [30, 2, 41])]
"""(seqlens_q, seqlens_k) of consecutive calls: the batch, the token counts and max_seqlen change."""


def _varlen_call(seqlens_q, seqlens_k, nheads_k=HK, **kwargs):
    q, k, v, _, cu_q, cu_k = make_varlen(seqlens_q, seqlens_k, H, nheads_k, D, **kwargs)
    return q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k)


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_varlen_func_dynamic(path, backend, dynamic):
    """Batch, token counts and max_seqlen change; causal, softcap, a learnable sink, softmax_lse returned."""

    def attention_block(q, k, v, cu_q, cu_k, max_q, max_k, sink):
        return flashtile.flash_attn_varlen_func(q * 1.5, k, v, cu_q, cu_k, max_q, max_k, causal=True, softcap=5.0,
                                               return_attn_probs=True, learnable_sink=sink)  # fmt: skip

    calls = [(*_varlen_call(lq, lk, dtype=torch.bfloat16), sinks_like(H)) for lq, lk in VARLEN_LENGTHS]
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1, 2, 7))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_varlen_qkvpacked_func_dynamic(path, backend, dynamic):
    """Batch, token count and max_seqlen change; (batch, nheads) ALiBi slopes (their batch changes too)."""

    def attention_block(qkv, cu, max_seqlen, slopes):
        return flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, max_seqlen, causal=True, alibi_slopes=slopes)

    calls = []
    for lengths, _ in VARLEN_LENGTHS:
        q, k, v, cu, _, max_seqlen, _ = _varlen_call(lengths, lengths, nheads_k=H)
        calls.append((torch.stack([q, k, v], dim=1), cu, max_seqlen, slopes_like((len(lengths), H))))
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0,))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_varlen_kvpacked_func_dynamic(path, backend, dynamic):
    """Batch, token counts and max_seqlen change; MQA and a sliding window."""

    def attention_block(q, kv, cu_q, cu_k, max_q, max_k):
        return flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k, window_size=(5, -1))

    calls = []
    for lq, lk in VARLEN_LENGTHS:
        q, k, v, *rest = _varlen_call(lq, lk)
        calls.append((q, torch.stack([k, v], dim=1), *rest))
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_varlen_func_paged_dynamic(path, backend, dynamic):
    """Paged keys and values (block_table): batch, token counts, max_seqlen, the number of pages and the
    block table's width change."""

    def attention_block(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, block_table):
        return flashtile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, causal=True,
                                               block_table=block_table)  # fmt: skip

    calls = []
    for lq, lk in VARLEN_LENGTHS:
        x = make_paged(lq, lk, 16, nheads=H, nheads_k=HK, head_dim=D)
        calls.append((x.q, x.k_pages, x.v_pages, x.cu_q, x.cu_k, max(lq), max(lk), x.block_table))
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1, 2))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_func_dropout_dynamic(path, backend, dynamic):
    """dropout_p arrives as an argument; the seed is drawn in the graph. The custom op takes dropout_p as a
    Python float, so a graph holds one value of it (another value compiles again), as a model's does."""

    def attention_block(q, k, v, dropout_p):
        return flashtile.flash_attn_func(q, k, v, dropout_p, causal=True)

    calls = [(*make_inputs(b, sq, sk, H, HK, D)[:3], 0.25) for b, sq, sk in SHAPES]
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1, 2))


KVCACHE_CASES = [
    Case(batch=2, seqlen_q=5, seqlen_new=5, nheads=H, nheads_k=HK, head_dim=D, seqlen_cache=64),
    Case(batch=4, seqlen_q=7, seqlen_new=7, nheads=H, nheads_k=HK, head_dim=D, seqlen_cache=128),
    Case(batch=5, seqlen_q=3, seqlen_new=3, nheads=H, nheads_k=HK, head_dim=D, seqlen_cache=80),
]
"""Consecutive calls of flash_attn_with_kvcache: batch, new tokens (queries) and the cache length change. Not
to one query: torch specializes sizes 0 and 1, so seqlen_q = 1 after seqlen_q > 1 compiles once more."""


@pytest.mark.parametrize("layout", ["paged-rotary", "contiguous-int-seqlens"])
@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_flash_attn_with_kvcache_dynamic(path, backend, dynamic, layout):
    """The caches are updated in place (compared after each call too). Paged with rotary: the number of pages
    and the block table's width change; contiguous: cache_seqlens is a Python int that changes every call,
    as a decoding loop's step counter would."""

    def step(q, k_cache, v_cache, k, v, cos, sin, seqlens, table):
        return flashtile.flash_attn_with_kvcache(q * 0.5, k_cache, v_cache, k, v, cos, sin, seqlens,
                                                 block_table=table, causal=True, return_softmax_lse=True)  # fmt: skip

    calls = []
    for number, case in enumerate(KVCACHE_CASES):
        if layout == "paged-rotary":
            x = kvcache_inputs(replace(case, page_size=16, rotary_dim=24))
            calls.append((x.q, x.k_cache, x.v_cache, x.k, x.v, x.rotary_cos, x.rotary_sin, x.cache_seqlens,
                          x.block_table))  # fmt: skip
        else:
            filled = 9 + 11 * number
            x = kvcache_inputs(replace(case, cache_seqlens=(filled,) * case.batch))
            calls.append((x.q, x.k_cache, x.v_cache, x.k, x.v, None, None, filled, None))
    compiled_matches_eager(step, calls, backend, dynamic)


def _sdpa_inputs(batch, seqlen_q, seqlen_k):
    return [t.transpose(1, 2) for t in make_inputs(batch, seqlen_q, seqlen_k, H, HK, D, dtype=torch.bfloat16)[:3]]


@pytest.mark.parametrize("mask", ["causal", "additive", "bool"])
@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_scaled_dot_product_attention_dynamic(path, backend, dynamic, mask):
    """is_causal (top left, Sq != Sk both ways), an additive (batch, 1, seqlen_q, seqlen_k) mask that gets a
    gradient, a boolean (seqlen_q, seqlen_k) mask; three query heads per key head (enable_gqa) throughout."""

    def attention_block(query, key, value, attn_mask):
        causal = attn_mask is None
        return flashtile.scaled_dot_product_attention(query, key, value, attn_mask, is_causal=causal, scale=0.3,
                                                      enable_gqa=True)  # fmt: skip

    calls = []
    for b, sq, sk in SHAPES:
        gen = torch.Generator().manual_seed(sq)
        attn_mask = {
            "causal": None,
            "additive": torch.randn(b, 1, sq, sk, generator=gen).to(torch.bfloat16),
            "bool": torch.rand(sq, sk, generator=gen) > 0.3,
        }[mask]
        calls.append((*_sdpa_inputs(b, sq, sk), None if attn_mask is None else attn_mask.to(DEVICE)))
    grads = (0, 1, 2, 3) if mask == "additive" else (0, 1, 2)
    compiled_matches_eager(attention_block, calls, backend, dynamic, grads=grads)


def _key_padding(batch, seqlen, seed):
    """A (batch, seqlen) boolean mask: each row keeps a random number (at least 1) of leading tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seqlen + 1, (batch, 1), generator=gen)
    return (torch.arange(seqlen)[None, :] < lengths).to(DEVICE)


CAPTURE = {
    "graph-breaks": {},
    "fullgraph": {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True},
}
"""torch._dynamo.config for unpad_input, whose output sizes (the number of kept tokens, max_seqlen_in_batch)
depend on the mask's values: by default dynamo breaks the graph there (as for flash_attn's unpad_input); with
these two options it captures them as symbolic sizes and the whole function is one graph."""


@pytest.mark.parametrize("capture", CAPTURE)
@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_scaled_dot_product_attention_key_padding_dynamic(path, backend, dynamic, capture):
    """A boolean (batch, 1, 1, seqlen_k) key padding mask takes the varlen route through unpad_input."""

    def attention_block(query, key, value, attn_mask):
        return flashtile.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, enable_gqa=True)

    shapes = [SHAPES[1], SHAPES[2], SHAPES[0]]  # batch 2 first: cu_seqlens (3,) would share nheads' symbol
    calls = [(*_sdpa_inputs(b, sq, sk), _key_padding(b, sk, sq)[:, None, None]) for b, sq, sk in shapes]
    with torch._dynamo.config.patch(CAPTURE[capture]):
        compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1, 2),
                               fullgraph=capture == "fullgraph")  # fmt: skip


@pytest.mark.parametrize("capture", CAPTURE)
@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_unpad_varlen_pad_dynamic(path, backend, dynamic, capture):
    """A padded batch through unpad_input, flash_attn_varlen_func and pad_input, as a Hugging Face attention
    layer does (k and v gathered with q's indices, so all three share one symbolic token count)."""

    def attention_block(q, k, v, mask):
        batch, seqlen = mask.shape
        q_packed, indices, cu_seqlens, max_seqlen, _ = flashtile.unpad_input(q, mask)
        k_packed, v_packed = (index_first_axis(t.flatten(0, 1), indices) for t in (k, v))
        out = flashtile.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens, cu_seqlens, max_seqlen,
                                               max_seqlen, causal=True)  # fmt: skip
        return flashtile.pad_input(out, indices, batch, seqlen)

    calls = [(*make_inputs(b, s, s, H, HK, D)[:3], _key_padding(b, s, s)) for b, s in ((4, 30), (5, 9), (2, 17))]
    with torch._dynamo.config.patch(CAPTURE[capture]):
        compiled_matches_eager(attention_block, calls, backend, dynamic, grads=(0, 1, 2),
                               fullgraph=capture == "fullgraph")  # fmt: skip


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("backend", BACKENDS)
@ONE_PATH
def test_pad_input_dynamic(path, backend, dynamic):
    """pad_input alone (its batch and seqlen symbolic) traces without a graph break."""

    def pad(x, indices, batch, seqlen):
        return flashtile.pad_input(x * 2.0, indices, batch, seqlen)

    calls = []
    for b, s in ((2, 17), (4, 30), (5, 9)):
        x = torch.randn(b, s, H, D, device=DEVICE)
        x_packed, indices, *_ = flashtile.unpad_input(x, _key_padding(b, s, s))
        calls.append((x_packed, indices, b, s))
    compiled_matches_eager(pad, calls, backend, dynamic, grads=(0,))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
def test_inductor_sdpa_layout(path, dynamic):
    """scaled_dot_product_attention on torch's (B, H, N, D) inputs under inductor, with gradients: inductor's code
    asserts that the backward op's gradients (of transposed views of the inputs) have the strides register_fake
    declares, and reads them with those strides."""

    def attention_block(q, k, v):
        out = flashtile.scaled_dot_product_attention(q * 1.5, k, v, is_causal=True, enable_gqa=True)
        return out.float().square()

    calls = [tuple(x.transpose(1, 2).contiguous() for x in make_inputs(b, sq, sk, H, HK, D)[:3])
             for b, sq, sk in SHAPES]  # fmt: skip
    compiled_matches_eager(attention_block, calls, "inductor", dynamic, grads=(0, 1, 2))


@pytest.mark.parametrize("dynamic", DYNAMIC.values(), ids=DYNAMIC.keys())
def test_inductor_dynamic(path, dynamic):
    """Inductor generates code for the operations around the custom ops (C++ on a CPU) and calls the ops as
    they are: flash_attn_func and flash_attn_varlen_func with a learnable sink, in one function."""

    def attention_block(q, k, v, q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k, sink):
        out = flashtile.flash_attn_func(q * 1.5, k, v, causal=True)
        out_packed = flashtile.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k,
                                                      learnable_sink=sink)  # fmt: skip
        return out.float().square(), out_packed

    calls = [
        (*make_inputs(b, sq, sk, H, HK, D, dtype=torch.bfloat16)[:3], *_varlen_call(lq, lk), sinks_like(H))
        for (b, sq, sk), (lq, lk) in zip(SHAPES, VARLEN_LENGTHS, strict=True)
    ]
    compiled_matches_eager(attention_block, calls, "inductor", dynamic, grads=(0, 1, 2, 3, 4, 5, 10))
