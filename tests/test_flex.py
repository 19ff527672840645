"""flashtile.flex_attention and create_block_mask against a dense oracle: the full score matrix materialised, the
mods evaluated by broadcasting index tensors (not by the vmap the implementation uses), the mask expanded from the
block table, and the tolerance rule of tests/oracle.py applied to the output, the LSE and every gradient (q, k, v
and captured tensors). The PyTorch route runs on every machine; the Triton kernel runs in the interpreter here
(tiny shapes) and compiled on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashtile
from flashtile import _backend
from flashtile.bench import results
from flashtile.flex import patterns
from flashtile.flex.api import _checked_block_mask
from flashtile.flex.block_mask import FULL, PARTIAL, TILE, BlockMask, _ordered, tiles
from oracle import assert_within_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LISTS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip
DOCS = (5, 17, 1, 30, 9, 64, 3, 100)  # packed document lengths (cut to the sequence)


def _document_ids(n: int) -> torch.Tensor:
    """Document ids of n packed tokens: the lengths DOCS, repeated as often as needed."""
    lengths = torch.tensor(DOCS).repeat(n // sum(DOCS) + 1)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:n].to(DEVICE)


def _params(nheads: int, seqlen_q: int, seqlen_k: int, grads: bool = True) -> dict[str, torch.Tensor]:
    """The tensors the mods capture: with ``grads`` the float ones require grad."""
    return {
        "bias": torch.randn(nheads, seqlen_q, seqlen_k, device=DEVICE, requires_grad=grads),
        "rel": torch.randn(nheads, seqlen_q + seqlen_k, device=DEVICE, requires_grad=grads),
        "slopes": torch.rand(nheads, device=DEVICE).mul(0.5).requires_grad_(grads),
        "key_bias": torch.randn(seqlen_k, device=DEVICE, requires_grad=grads),
        "query_scale": (1 + 0.1 * torch.randn(seqlen_q, device=DEVICE)).requires_grad_(grads),
        "doc": _document_ids(max(seqlen_q, seqlen_k)),
        "rel_offset": torch.tensor(seqlen_k - 1, device=DEVICE),  # rel[h, q_idx - kv_idx + seqlen_k - 1]
    }


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _mods(name: str, p: dict[str, torch.Tensor]):
    """(score_mod, mask_mod) of a case, capturing the tensors of ``p``."""
    if name == "causal":
        return None, causal
    if name == "sliding_window":
        return None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 20)
    if name == "sliding_window_lt":  # the other bound's form, as and_masks builds it
        return None, flashtile.and_masks(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 20, causal)
    if name == "plain":
        return None, None
    if name == "document":
        return None, lambda b, h, q_idx, kv_idx: p["doc"][q_idx] == p["doc"][kv_idx]
    if name == "prefix_lm":
        return None, lambda b, h, q_idx, kv_idx: (kv_idx < 24) | (q_idx >= kv_idx)
    if name == "prefix_lm_softcap":  # or_masks' form, the prefix's bound written the other way
        return _mods("softcap", p)[0], flashtile.or_masks(causal, lambda b, h, q_idx, kv_idx: kv_idx <= 22)
    if name == "alibi":
        return (lambda s, b, h, q_idx, kv_idx: s + p["slopes"][h] * (kv_idx - q_idx)), causal
    if name == "softcap":
        return (lambda s, b, h, q_idx, kv_idx: 2.0 * torch.tanh(s / 2.0)), None
    if name == "softcap_window":
        return (lambda s, b, h, q_idx, kv_idx: torch.tanh(s / 2) * 2), _mods("sliding_window", p)[1]
    if name == "softcap_alibi":  # flash_attn's order: the capped score, then the ALiBi term
        return (lambda s, b, h, q_idx, kv_idx: 2.0 * torch.tanh(s / 2.0) - p["slopes"][h] * (q_idx - kv_idx)), causal
    if name == "bias":
        return (
            lambda s, b, h, q_idx, kv_idx: (
                (s + p["bias"][h, q_idx, kv_idx] + p["key_bias"][kv_idx]) * p["query_scale"][q_idx]
            )
        ), None
    if name == "relative_bias":
        return (lambda s, b, h, q_idx, kv_idx: s + p["rel"][h, q_idx - kv_idx + p["rel_offset"]]), causal
    if name == "empty_rows":  # rows q_idx % 7 == 3 attend to nothing
        score_mod = lambda s, b, h, q_idx, kv_idx: s * (1 + b) - h  # noqa: E731
        return score_mod, _sparse_rows
    if name == "empty_rows_mask":  # the same rows, the scores unchanged
        return None, _sparse_rows
    if name == "block_causal":  # blocks of 32 see whole earlier blocks: with BLOCK_SIZE 32, full blocks only
        return None, lambda b, h, q_idx, kv_idx: kv_idx // 32 <= q_idx // 32
    raise ValueError(name)


def _sparse_rows(b, h, q_idx, kv_idx):
    return (q_idx % 7 != 3) & ((q_idx + kv_idx) % 3 != 0)


CASES = ["causal", "sliding_window", "document", "prefix_lm", "alibi", "softcap", "bias", "relative_bias", "empty_rows"]


def _dense_mask(block_mask: BlockMask, mask_mod, batch: int, nheads: int, seqlen_q: int, seqlen_k: int):
    """bool (B, H, L, S): what the block table and mask_mod let attend, expanded position by position."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    kinds = _kinds_of(block_mask).expand(batch, nheads, -1, -1)
    kinds = kinds.repeat_interleave(q_block, 2).repeat_interleave(kv_block, 3)[:, :, :seqlen_q, :seqlen_k]
    b, h, q_idx, kv_idx = _broadcast_indices(batch, nheads, seqlen_q, seqlen_k)
    by_mod = mask_mod(b, h, q_idx, kv_idx).expand(batch, nheads, seqlen_q, seqlen_k)
    return (kinds == FULL) | ((kinds == PARTIAL) & by_mod)


def _kinds_of(block_mask: BlockMask) -> torch.Tensor:
    """(Bm, Hm, Qb, Kb): 0, PARTIAL or FULL, from the lists, entry by entry."""
    bm, hm, rows = block_mask.kv_num_blocks.shape
    kinds = torch.zeros(bm, hm, rows, block_mask.kv_blocks, dtype=torch.int64)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL))
    for num, indices, kind in lists:
        for b in range(bm):
            for h in range(hm):
                for r in range(rows):
                    for j in indices[b, h, r, : int(num[b, h, r])].tolist():
                        kinds[b, h, r, j] = kind
    return kinds.to(block_mask.kv_indices.device)


def _broadcast_indices(batch, nheads, seqlen_q, seqlen_k):
    return (
        torch.arange(batch, device=DEVICE).view(-1, 1, 1, 1),
        torch.arange(nheads, device=DEVICE).view(1, -1, 1, 1),
        torch.arange(seqlen_q, device=DEVICE).view(1, 1, -1, 1),
        torch.arange(seqlen_k, device=DEVICE).view(1, 1, 1, -1),
    )


def dense_scores(q, k, score_mod, mask: torch.Tensor, scale: float):
    """The materialised (B, H, L, S) scores after score_mod, -inf where ``mask`` hides them, in the inputs' dtype."""
    batch, nheads, seqlen_q, _ = q.shape
    k = k.repeat_interleave(nheads // k.shape[1], 1)
    s = q @ k.transpose(-2, -1) * scale
    if score_mod is not None:
        s = score_mod(s, *_broadcast_indices(batch, nheads, seqlen_q, k.shape[2])).to(q.dtype)
    return s.masked_fill(~mask, float("-inf"))


def dense_flex(q, k, v, score_mod, mask: torch.Tensor, scale: float):
    """The oracle, in the inputs' dtype: (out, lse) from the materialised (B, H, L, S) scores."""
    s = dense_scores(q, k, score_mod, mask, scale)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def _oracle(name, inputs, params, mask, scale, dtype, dout, dlse=None):
    """Output, LSE and gradients (q, k, v, then float params; of out with ``dout`` and, where given, of lse with
    ``dlse``) of the oracle in ``dtype``, cast to the dtypes of flashtile's results."""
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    ps = {n: t.detach().to(dtype).requires_grad_(t.requires_grad) if t.is_floating_point() else t
          for n, t in params.items()}  # fmt: skip
    score_mod, _ = _mods(name, ps)
    out, lse = dense_flex(*xs, score_mod, mask, scale)
    wrt = xs + [t for t in ps.values() if t.requires_grad]
    if dlse is None:
        grads = torch.autograd.grad(out, wrt, dout.to(dtype), allow_unused=True)
    else:
        grads = torch.autograd.grad((out, lse), wrt, (dout.to(dtype), dlse.to(dtype)), allow_unused=True)
    floats = [t for t in params.values() if t.requires_grad]
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt, strict=True)]
    like = list(inputs) + floats
    return [out.to(inputs[0].dtype), lse.float()] + [g.to(x.dtype) for g, x in zip(grads, like, strict=True)]


def run_case(
    name, backend, dtype=torch.float32, B=2, H=2, H_kv=2, L=45, S=45, D=16, block=16, grads=True, scale=None,
    learned=None, lse_grad=False, out_grad=True,
):  # fmt: skip
    """flashtile's output, LSE and gradients (of captured tensors too) for case ``name`` against the oracle's, by
    the tolerance rule; ``scale`` defaults to flex_attention's, 1 / sqrt(D); ``learned``: whether the captured float
    tensors require grad (default: ``grads``); ``lse_grad``: the loss reads the LSE too (a gradient arrives at
    both outputs); ``out_grad=False`` (with ``lse_grad``): the loss reads only the LSE."""
    params = _params(H, L, S, grads if learned is None else learned)
    score_mod, mask_mod = _mods(name, params)
    q = torch.randn(B, H, L, D, device=DEVICE, dtype=dtype, requires_grad=grads)
    k = torch.randn(B, H_kv, S, D, device=DEVICE, dtype=dtype, requires_grad=grads)
    v = torch.randn(B, H_kv, S, D, device=DEVICE, dtype=dtype, requires_grad=grads)
    block_mask = None
    mask = torch.ones(B, H, L, S, dtype=torch.bool, device=DEVICE)
    if mask_mod is not None:
        block_mask = flashtile.create_block_mask(mask_mod, B, None, L, S, device=DEVICE, BLOCK_SIZE=block)
        mask = _dense_mask(block_mask, mask_mod, B, H, L, S)
    scale = 1 / math.sqrt(D) if scale is None else scale
    out, lse = flashtile.flex_attention(
        q, k, v, score_mod, block_mask, scale, enable_gqa=H != H_kv, return_lse=True,
        kernel_options={"BACKEND": backend},
    )  # fmt: skip
    results = {"out": out, "lse": lse}
    dout = torch.randn_like(out) if out_grad else torch.zeros_like(out)
    dlse = torch.randn_like(lse) if lse_grad else None
    if grads:
        floats = {n: t for n, t in params.items() if t.requires_grad}
        outputs, grad_outputs = ((out, lse), (dout, dlse)) if lse_grad else (out, dout)
        if not out_grad:
            outputs, grad_outputs = lse, dlse
        got = torch.autograd.grad(outputs, [q, k, v, *floats.values()], grad_outputs, allow_unused=True)
        names = ["dq", "dk", "dv", *(f"d{n}" for n in floats)]
        results.update({n: torch.zeros_like(t) if g is None else g for n, g, t in
                        zip(names, got, [q, k, v, *floats.values()], strict=True)})  # fmt: skip
    precise = _oracle(name, (q, k, v), params, mask, scale, torch.float64, dout, dlse)
    base = _oracle(name, (q, k, v), params, mask, scale, dtype, dout, dlse)
    for i, (result_name, x) in enumerate(results.items()):
        assert_within_rule(result_name if i < 2 else "grad " + result_name, x, precise[i], base[i])
    return out, lse


# ------------------------------------------------------------------------------------------- the PyTorch route


@pytest.mark.parametrize("name", CASES)
def test_torch_route_mods(name):
    run_case(name, "TORCH")


@pytest.mark.parametrize("L, S, name", [(37, 53, "softcap"), (53, 29, "prefix_lm"), (1, 17, "prefix_lm")])
def test_torch_route_lengths(L, S, name):
    run_case(name, "TORCH", L=L, S=S, block=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torch_route_low_precision_gqa(dtype):
    run_case("alibi", "TORCH", dtype=dtype, H=4, H_kv=2, L=40, S=33)


def test_empty_rows_are_zero_with_lse_minus_inf():
    out, lse = run_case("empty_rows", "TORCH", B=1, L=30, S=30, grads=False)
    rows = torch.arange(30) % 7 == 3
    assert (out[:, :, rows] == 0).all() and (lse[:, :, rows] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, ~rows]).all()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    L=st.integers(1, 40), S=st.integers(1, 40), block=st.sampled_from([8, 16]), per_head=st.booleans(),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_random_block_masks(L, S, block, per_head, seed):
    """Any block table: skipped, partial and full blocks at random (rows with no block, blocks hidden entirely
    by mask_mod), per head or shared; the oracle expands the same table position by position."""
    check_random_block_mask(L, S, block, per_head, seed, "TORCH")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(1, 40), S=st.integers(1, 40), per_head=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_random_block_masks(L, S, per_head, seed):
    check_random_block_mask(L, S, 16, per_head, seed, "TRITON")


def check_random_block_mask(L, S, block, per_head, seed, backend):
    """flashtile on a random block table against the oracle expanding the same table (table and float16 inputs
    drawn from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    H = 2
    rows, cols = -(-L // block), -(-S // block)
    kinds = torch.randint(0, 3, (1, H if per_head else 1, rows, cols), generator=generator).to(DEVICE)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx * 7 + kv_idx * 3 + h) % 5 != 0

    block_mask = BlockMask.from_kv_blocks(*_ordered(kinds == PARTIAL), *_ordered(kinds == FULL), BLOCK_SIZE=block,
                                          mask_mod=mask_mod, seq_lengths=(L, S))  # fmt: skip
    q, k, v = (torch.randn(1, H, n, 16, generator=generator).to(DEVICE, torch.float16).requires_grad_()
               for n in (L, S, S))  # fmt: skip
    out, lse = flashtile.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                        kernel_options={"BACKEND": backend})  # fmt: skip
    dout = torch.randn(out.shape, generator=generator).to(DEVICE, out.dtype)
    names = ("out", "lse", "dq", "dk", "dv")
    got = dict(zip(names, (out, lse, *torch.autograd.grad(out, (q, k, v), dout)), strict=True))
    mask = _dense_mask(block_mask, mask_mod, 1, H, L, S)
    for dtype, found in ((torch.float64, {}), (torch.float16, {})):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, s = dense_flex(*xs, None, mask, 1 / 4)
        found.update(zip(names, (o, s, *torch.autograd.grad(o, xs, dout.to(dtype))), strict=True))
        if dtype == torch.float64:
            precise = found
        else:
            base = found
    for name, x in got.items():
        assert_within_rule(name if name in ("out", "lse") else "grad", x, precise[name].to(x.dtype), base[name])


@pytest.mark.parametrize("enable_gqa", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_matches_torch_flex_attention(name, enable_gqa):
    """The same mods and torch's own BlockMask give what torch's flex_attention gives (its eager path, which
    materialises the scores), on the PyTorch route and, on the CPU, as flex_attention runs by default (AUTO: the
    built-in attention where the mods are its options); with two query heads per key/value head too."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, H, L, S, D = 2, 4, 33, 47, 16
    score_mod, mask_mod = _mods(name, _params(H, L, S))
    q = torch.randn(B, H, L, D, device=DEVICE)
    k, v = (torch.randn(B, H // 2 if enable_gqa else H, S, D, device=DEVICE) for _ in range(2))
    block_mask = flex.create_block_mask(mask_mod or flex.noop_mask, B, H, L, S, device=DEVICE, BLOCK_SIZE=16)
    with torch.no_grad():
        theirs = flex.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=enable_gqa, return_lse=True)
        for backend in ("TORCH", "AUTO") if DEVICE == "cpu" else ("TORCH",):
            ours = flashtile.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=enable_gqa, return_lse=True,
                                            kernel_options={"BACKEND": backend})  # fmt: skip
            for mine, torchs in zip(ours, theirs, strict=True):
                torch.testing.assert_close(mine, torchs, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["AUTO", "TRITON", "TORCH"])
@pytest.mark.parametrize("name", ["alibi", "empty_rows", "plain"])
def test_return_aux(name, backend):
    """return_aux=AuxRequest(lse=True, max_scores=True): the LSE return_lse gives and each row's largest score after
    the mods, against the oracle's by the tolerance rule (-inf in a row that sees no key), without a gradient; the
    alibi case is one AUTO would otherwise run on the built-in kernels, which give no largest scores."""
    B, H, L, S, D = 1, 2, 40, 33, 16
    params = _params(H, L, S, grads=False)
    score_mod, mask_mod = _mods(name, params)
    q, k, v = (torch.randn(B, H, n, D, device=DEVICE, requires_grad=True) for n in (L, S, S))
    block_mask, mask = None, torch.ones(B, H, L, S, dtype=torch.bool, device=DEVICE)
    if mask_mod is not None:
        block_mask = flashtile.create_block_mask(mask_mod, B, None, L, S, device=DEVICE, BLOCK_SIZE=16)
        mask = _dense_mask(block_mask, mask_mod, B, H, L, S)
    options = {"BACKEND": backend}
    out, aux = flashtile.flex_attention(q, k, v, score_mod, block_mask, return_aux=flashtile.AuxRequest(True, True),
                                        kernel_options=options)  # fmt: skip
    assert isinstance(aux, flashtile.AuxOutput)
    precise, base = (dense_scores(q.detach().to(t), k.detach().to(t), score_mod, mask, D**-0.5).amax(-1).float()
                     for t in (torch.float64, torch.float32))  # fmt: skip
    assert_within_rule("max_scores", aux.max_scores, precise, base)
    assert not aux.max_scores.requires_grad
    if name == "empty_rows":
        assert (aux.max_scores[:, :, 3::7] == float("-inf")).all()
    _, lse = flashtile.flex_attention(q, k, v, score_mod, block_mask, return_lse=True, kernel_options=options)
    torch.testing.assert_close(aux.lse, lse, atol=0, rtol=0)
    dout = torch.randn_like(out)
    plain = flashtile.flex_attention(q, k, v, score_mod, block_mask, kernel_options=options)
    got, expected = (torch.autograd.grad(x, (q, k, v), dout) for x in (out, plain))
    checked = _checked_block_mask(block_mask, q, k)
    if backend == "AUTO" and patterns.builtin_options(q, k, v, score_mod, checked, D**-0.5) is not None:
        # the plain call takes the built-in attention where return_aux takes the generated kernel or the PyTorch
        # route: two implementations, whose last bits differ (with the machine's vector width too); both against the
        # oracle by the tolerance rule
        oracle = [_oracle(name, (q, k, v), params, mask, D**-0.5, t, dout)[2:] for t in (torch.float64, q.dtype)]
        for grads in (got, expected):
            for grad_name, x, precise, base in zip(("dq", "dk", "dv"), grads, *oracle, strict=True):
                assert_within_rule("grad " + grad_name, x, precise, base)
    else:  # one implementation for both calls: the same gradients as without return_aux, bit for bit
        for x, y in zip(got, expected, strict=True):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
    _, only_lse = flashtile.flex_attention(q, k, v, score_mod, block_mask, return_aux=flashtile.AuxRequest(lse=True),
                                           kernel_options=options)  # fmt: skip
    assert only_lse.max_scores is None and torch.equal(only_lse.lse, lse)


def test_return_aux_takes_torch_requests_and_checks_them():
    """torch's own AuxRequest works; return_lse with return_aux, or a return_aux that is not a request, is an error
    before anything runs."""
    q = k = v = torch.randn(1, 2, 24, 16, device=DEVICE)
    with pytest.raises(flashtile.InputError, match="return_lse or return_aux"):
        flashtile.flex_attention(q, k, v, return_lse=True, return_aux=flashtile.AuxRequest(lse=True))
    with pytest.raises(flashtile.InputTypeError, match="AuxRequest"):
        flashtile.flex_attention(q, k, v, return_aux=True)
    _, aux = flashtile.flex_attention(q, k, v, return_aux=flashtile.AuxRequest())
    assert aux == flashtile.AuxOutput(None, None)
    torch_request = getattr(pytest.importorskip("torch.nn.attention.flex_attention"), "AuxRequest", None)
    if torch_request is None:
        pytest.skip("this torch has no AuxRequest (torch 2.9 added it)")
    out, aux = flashtile.flex_attention(q, k, v, return_aux=torch_request(max_scores=True))
    assert aux.lse is None and aux.max_scores.shape == (1, 2, 24)
    torch.testing.assert_close(out, flashtile.flex_attention(q, k, v), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------- the Triton kernel
# In the interpreter on a CPU (compiled on a GPU): tiny shapes, block size 32, head dim 32.


@pytest.mark.parametrize("name", ["document", "prefix_lm", "alibi", "softcap", "bias", "relative_bias", "empty_rows"])
def test_kernel_mods(name):
    run_case(name, "TRITON", B=1, L=50, S=50, D=32, block=32)


@pytest.mark.parametrize("backend", ["TRITON", "TORCH"])
@pytest.mark.parametrize("name", ["bias", "prefix_lm"])
def test_gradient_through_lse(name, backend):
    """A loss reading the LSE (as one that merges attention over chunks does): its gradient reaches q, k and the
    captured tensors through the backward's delta (rowsum(dO * O) - dLSE)."""
    run_case(name, backend, L=40, S=33, lse_grad=True)


@pytest.mark.parametrize("out_grad", [True, False], ids=["out and lse", "lse only"])
def test_prefix_lm_gradients_through_the_builtin_calls(out_grad, builtin_calls):
    """Prefix-LM on the built-in attention (two calls, one backward over both): gradients reaching out and the LSE,
    or the LSE alone (no gradient at out), with GQA and a head dim that is padded, against the oracle."""
    run_case("prefix_lm", "AUTO", B=2, H=4, H_kv=2, L=37, S=37, D=20, learned=False, lse_grad=True,
             out_grad=out_grad)  # fmt: skip
    assert len(builtin_calls) == 2


@pytest.mark.parametrize("name", ["document", "sliding_window"])
def test_kernel_tiles_smaller_than_blocks(name):
    """Sparse blocks of several tiles each ((64, 128) against the interpreter's 32 x 64 tiles): one loop walks the
    tiles of all listed blocks, partial and full, forward and backward."""
    run_case(name, "TRITON", B=1, L=150, S=260, D=32, block=(64, 128))


@pytest.mark.parametrize("L, S", [(256, 256), (200, 300)])
def test_kernel_walks_the_finer_tiles(L, S, monkeypatch):
    """A document mask made with 128 x 128 blocks keeps a 64 x 64 table (``tiles``), which the generated kernel
    walks forward and backward: against the oracle, lengths even and ragged, Sq != Sk."""
    from flashtile.flex import kernel  # imports Triton

    walked = []
    forward = kernel._forward
    monkeypatch.setattr(kernel, "_forward", lambda *args: walked.append(args[5].BLOCK_SIZE) or forward(*args))
    run_case("document", "TRITON", B=1, L=L, S=S, D=32, block=128)
    assert walked == [(TILE, TILE)]


@pytest.mark.parametrize(
    "name, L, S",
    [
        ("causal", 64, 64),  # lengths multiples of the blocks (EVEN_M, EVEN_N); the scale folded into exp2
        ("causal", 64, 96),  # Sq != Sk both ways, both multiples
        ("causal", 96, 64),
        ("causal", 50, 64),  # queries ragged, keys even
        ("causal", 64, 50),  # keys ragged, queries even
        ("alibi", 64, 96),  # a score_mod with even lengths
        ("block_causal", 64, 96),  # full blocks only: no per-element mask at all
        ("block_causal", 96, 50),
        ("empty_rows", 64, 64),  # rows that see no key, with a score_mod
        ("empty_rows_mask", 64, 64),  # and without one (the folded scale)
        ("empty_rows_mask", 50, 64),
    ],
    ids=lambda x: str(x),
)
def test_kernel_even_and_ragged_lengths(name, L, S):
    """The bounds checks the kernels compile out where a length is a multiple of the block size, and keep where it
    is not, on each side and for each kind of block."""
    run_case(name, "TRITON", B=1, L=L, S=S, D=32, block=32)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.7])
def test_kernel_scale_signs(scale):
    """Without a score_mod a positive scale goes into exp2's factor; a negative or zero one keeps the general path
    (a factor <= 0 would turn hidden positions' -inf into +inf or NaN)."""
    run_case("causal", "TRITON", B=1, L=64, S=64, D=32, block=32, scale=scale)


def test_identity_score_mod_is_recognised():
    """What makes the kernels fold the scale: a score_mod returning its score unchanged, through no-ops only."""
    from flashtile.flex import codegen

    names = ("score", "b", "h", "q_idx", "kv_idx")
    cases = [
        (lambda s, b, h, q_idx, kv_idx: s, True),
        (lambda s, b, h, q_idx, kv_idx: s.clone().detach(), True),
        (lambda s, b, h, q_idx, kv_idx: s * 1.0, False),
        (lambda s, b, h, q_idx, kv_idx: s + kv_idx, False),
        (lambda s, b, h, q_idx, kv_idx: q_idx.float(), False),
    ]
    for fn, expected in cases:
        assert codegen.returns_score(codegen.trace(fn, names, torch.device(DEVICE))) is expected


def test_kernel_gqa_lengths_bf16():
    run_case("sliding_window", "TRITON", dtype=torch.bfloat16, B=1, H=4, H_kv=2, L=33, S=50, D=32, block=32)


@pytest.mark.parametrize("backend", ["TRITON", "AUTO"])
def test_kernel_without_mods_and_key_batch_shared(backend):
    """No score_mod, no block mask (every block full), and a key/value batch of 1 shared by two query entries: the
    generated kernel, and the built-in attention AUTO runs for it, against the oracle by the tolerance rule (dk and
    dv summed over the query entries that share them)."""
    q = torch.randn(2, 2, 40, 32, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 2, 40, 32, device=DEVICE, requires_grad=True) for _ in range(2))
    out, lse = flashtile.flex_attention(q, k, v, return_lse=True, kernel_options={"BACKEND": backend})
    dout = torch.randn_like(out)
    results = {"out": out, "lse": lse}
    results.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout), strict=True))
    mask = torch.ones(2, 2, 40, 40, dtype=torch.bool, device=DEVICE)
    precise = _oracle("plain", (q, k, v), {}, mask, 32**-0.5, torch.float64, dout)
    base = _oracle("plain", (q, k, v), {}, mask, 32**-0.5, torch.float32, dout)
    for i, (name, x) in enumerate(results.items()):
        assert_within_rule(name if i < 2 else "grad " + name, x, precise[i], base[i])


def test_kernel_takes_torch_block_masks():
    """torch's own BlockMask (its q_* lists used as they are) gives what flashtile's gives, forward and backward."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (torch.randn(1, 2, 40, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    found = []
    for create in (flashtile.create_block_mask, flex.create_block_mask):
        block_mask = create(causal, None, None, 40, 40, device=DEVICE, BLOCK_SIZE=32)
        out = flashtile.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "TRITON"})
        found.append([out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))])
    for ours, theirs in zip(*found, strict=True):
        assert torch.equal(ours, theirs)


HEAD_SCALE = torch.ones(2)
SHIFT = 0.0


def _scaled(score, b, h, q_idx, kv_idx):
    return score * HEAD_SCALE[h] + SHIFT * kv_idx


def test_kernel_follows_rebound_globals():
    """A mod's global rebound to another tensor or number between calls is read anew (not from the first trace)."""
    global HEAD_SCALE, SHIFT
    q, k, v = (torch.randn(1, 2, 20, 32, device=DEVICE) for _ in range(3))
    options = {"BACKEND": "TRITON"}
    other = torch.tensor([3.0, -2.0], device=DEVICE)
    for scale, shift in ((torch.ones(2, device=DEVICE), 0.0), (other, 0.0), (other, 0.5)):  # one change at a time
        HEAD_SCALE, SHIFT = scale, shift
        out = flashtile.flex_attention(q, k, v, _scaled, kernel_options=options)
        torch.testing.assert_close(out, flashtile.flex_attention(q, k, v, _scaled, kernel_options={"BACKEND": "TORCH"}))


def test_inside_torch_compile():
    """In a torch.compile'd function flex_attention runs eagerly (a graph break), forward and backward."""
    q, k, v = (torch.randn(1, 2, 20, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    score_mod = _mods("softcap", {})[0]
    compiled = torch.compile(lambda q, k, v: flashtile.flex_attention(q, k, v, score_mod) * 2, backend="eager")
    out = compiled(q, k, v)
    expected = flashtile.flex_attention(q, k, v, score_mod) * 2
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for x, y in zip(grads, torch.autograd.grad(expected, (q, k, v), torch.ones_like(out)), strict=True):
        torch.testing.assert_close(x, y)


def test_kernel_falls_back_or_explains():
    """What the kernel cannot take runs on the PyTorch route under AUTO, and BACKEND='TRITON' says why not."""
    q, k, v = (torch.randn(1, 2, 20, 32, device=DEVICE) for _ in range(3))
    table = torch.randn(2, 20, 20, device=DEVICE)
    temperature = torch.tensor(2.0, device=DEVICE, requires_grad=True)
    cases = [
        ((lambda s, b, h, q_idx, kv_idx: s + torch.cos(table[h, q_idx, kv_idx])), "aten.cos"),
        ((lambda s, b, h, q_idx, kv_idx: s / temperature), "used other than read at indices"),
        ((lambda s, b, h, q_idx, kv_idx: s if h > 0 else -s), "value in Python"),
    ]
    for score_mod, reason in cases[:2]:
        out = flashtile.flex_attention(q, k, v, score_mod)
        expected = flashtile.flex_attention(q, k, v, score_mod, kernel_options={"BACKEND": "TORCH"})
        torch.testing.assert_close(out, expected)
        with pytest.raises(flashtile.InputError, match=reason):
            flashtile.flex_attention(q, k, v, score_mod, kernel_options={"BACKEND": "TRITON"})
    assert torch.autograd.grad(out.sum(), temperature)[0] != 0  # the PyTorch route gave temperature its gradient
    with pytest.raises(flashtile.InputError, match=cases[2][1]):
        flashtile.flex_attention(q, k, v, cases[2][0], kernel_options={"BACKEND": "TRITON"})


# ------------------------------------------------------------------------- recognised mods on the built-in kernels

BUILTIN = {  # case: the options flex_attention's AUTO passes to the built-in attention
    "plain": dict(window_left=None, window_right=None, softcap=0.0),
    "causal": dict(window_left=None, window_right=0, softcap=0.0),
    "sliding_window": dict(window_left=20, window_right=0, softcap=0.0),
    "sliding_window_lt": dict(window_left=19, window_right=0, softcap=0.0),
    "alibi": dict(window_left=None, window_right=0, softcap=0.0),
    "softcap": dict(window_left=None, window_right=None, softcap=2.0),
    "softcap_window": dict(window_left=20, window_right=0, softcap=2.0),
    "softcap_alibi": dict(window_left=None, window_right=0, softcap=2.0),
    "prefix_lm": dict(window_left=None, window_right=0, softcap=0.0, rows=2),
    "prefix_lm_softcap": dict(window_left=None, window_right=0, softcap=2.0, rows=2),
}
"""``rows``: calls on parts of the query rows (prefix-LM: the prefix's rows, no mask, then the others, causal; the
second call's options given)."""


@pytest.fixture
def builtin_calls(monkeypatch):
    """The options (window, softcap, ALiBi slopes) of every call flex_attention makes to the built-in attention
    (``_ops.attention``, which ``flash_attn_func`` calls too)."""
    from flashtile import _ops

    calls, attention = [], _ops.attention
    names = ("window_left", "window_right", "softcap", "alibi_slopes")

    def spy(q, k, v, options):
        calls.append({name: getattr(options, name) for name in names})
        return attention(q, k, v, options)

    monkeypatch.setattr(_ops, "attention", spy)
    return calls


@pytest.mark.parametrize("name", list(BUILTIN))
def test_recognised_mods_run_the_builtin_kernels(name, path, builtin_calls):
    """Each recognised pattern runs the built-in attention with its options (the spy), within the tolerance rule of
    the oracle (output, LSE, dq, dk, dv), and gives what the generated kernel (the PyTorch route on the CPU path)
    gives for the same inputs."""
    case = dict(B=1, L=40, S=40, D=16, block=16, learned=False)
    seed = torch.initial_seed()
    out, lse = run_case(name, "AUTO", **case)
    expected = dict(BUILTIN[name])
    calls = expected.pop("rows", 1)
    assert len(builtin_calls) == calls
    options = builtin_calls[-1]
    assert {n: options[n] for n in expected} == expected
    assert (options["alibi_slopes"] is not None) == ("alibi" in name)
    if calls == 2:
        assert (builtin_calls[0]["window_left"], builtin_calls[0]["window_right"]) == (None, None)
    torch.manual_seed(seed)
    generated = run_case(name, "TRITON" if path == "triton" else "TORCH", **case)
    assert len(builtin_calls) == calls
    for x, y in zip((out, lse), generated, strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_recognised_mods_gqa_and_lengths(dtype, builtin_calls):
    """GQA (4 query heads on 2 kv heads), a head dim and lengths that are not multiples of the tiles, low precision:
    causal ALiBi and prefix-LM, against the oracle."""
    run_case("alibi", "AUTO", dtype=dtype, B=2, H=4, H_kv=2, L=37, S=37, D=24, block=16, learned=False)
    assert len(builtin_calls) == 1 and builtin_calls[0]["alibi_slopes"].shape == (4,)
    run_case("prefix_lm", "AUTO", dtype=dtype, B=2, H=4, H_kv=2, L=37, S=37, D=24, block=16, learned=False)
    assert len(builtin_calls) == 3  # the prefix's rows, then the others


def _window(width: int):
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= width)


def _near_misses():
    """(name, score_mod, block_mask or a function of the lengths giving one, lengths (L, S)): calls one step away from
    a recognised pattern, each of which must stay on the generated kernel."""
    slopes = torch.rand(2, device=DEVICE)
    learned = slopes.clone().requires_grad_()

    def alibi(t):
        return lambda s, b, h, q_idx, kv_idx: s + t[h] * (kv_idx - q_idx)

    def mask(mask_mod, L=48, S=48):
        return flashtile.create_block_mask(mask_mod, None, None, L, S, device=DEVICE, BLOCK_SIZE=16)

    def lists_of(lists_mod, mask_mod):  # the block lists of one mod, labelled with another
        built = mask(lists_mod)
        built.mask_mod = mask_mod
        return built

    width = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= torch.tensor(16))  # noqa: E731
    doc = _document_ids(48)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < 20) | (q_idx >= kv_idx)

    return [
        ("strict causal", None, mask(lambda b, h, q_idx, kv_idx: q_idx > kv_idx), (48, 48)),
        ("or", None, mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (q_idx - kv_idx <= 16)), (48, 48)),
        ("window off by one", None, lists_of(_window(16), _window(17)), (48, 48)),
        ("lists of another mod", None, lists_of(causal, _window(16)), (48, 48)),
        ("window bound a tensor", None, mask(width), (48, 48)),
        ("causal, Sq != Sk", None, mask(causal, 40, 48), (40, 48)),
        ("slopes require grad", alibi(learned), mask(causal), (48, 48)),
        ("ALiBi without a mask", alibi(slopes), None, (48, 48)),
        ("ALiBi float64 slopes", alibi(slopes.double()), mask(causal), (48, 48)),
        ("ALiBi read at b", lambda s, b, h, q_idx, kv_idx: s + slopes[b] * (kv_idx - q_idx), mask(causal), (48, 48)),
        ("softcap caps differ", lambda s, b, h, q_idx, kv_idx: 2.0 * torch.tanh(s / 3.0), None, (48, 48)),
        ("softcap of a biased score", lambda s, b, h, q_idx, kv_idx: 2.0 * torch.tanh((s + 1) / 2.0), None, (48, 48)),
        ("document mask", None, mask(lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]), (48, 48)),
        (
            "prefix or a window",
            None,
            mask(lambda b, h, q_idx, kv_idx: (kv_idx < 20) | _window(5)(b, h, q_idx, kv_idx)),
            (48, 48),
        ),
        ("prefix or strict causal", None, mask(lambda b, h, q_idx, kv_idx: (kv_idx < 20) | (q_idx > kv_idx)), (48, 48)),
        ("prefix of queries", None, mask(lambda b, h, q_idx, kv_idx: (q_idx < 20) | (q_idx >= kv_idx)), (48, 48)),
        ("prefix, Sq != Sk", None, mask(prefix_lm, 40, 48), (40, 48)),
        ("prefix with ALiBi", alibi(slopes), mask(prefix_lm), (48, 48)),
        ("lists of causal, prefix mod", None, lists_of(causal, prefix_lm), (48, 48)),
    ]


NEAR_MISSES = _near_misses()


@pytest.mark.parametrize("case", NEAR_MISSES, ids=[case[0] for case in NEAR_MISSES])
def test_near_misses_stay_on_the_generated_kernel(case, monkeypatch, builtin_calls):
    """Mods, block masks and lengths one step from a recognised pattern never reach the built-in attention (on the
    CPU path they take the PyTorch route, and give what BACKEND='TORCH' gives)."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    _, score_mod, block_mask, (L, S) = case
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for n in (L, S, S))
    with torch.no_grad():
        out = flashtile.flex_attention(q, k, v, score_mod, block_mask)
        expected = flashtile.flex_attention(q, k, v, score_mod, block_mask, kernel_options={"BACKEND": "TORCH"})
    assert builtin_calls == []
    torch.testing.assert_close(out, expected)


def test_recognised_mask_forms():
    """The mask_mod forms read as an interval lo <= q_idx - kv_idx <= hi, or as keys before a prefix or a causal
    interval ((lo, hi, prefix)), and those that are not (a document mask among them)."""
    from flashtile.flex import codegen, patterns

    doc = _document_ids(40)
    forms = [
        (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, (0, math.inf)),
        (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, (0, math.inf)),
        (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= 5) & (q_idx >= kv_idx), (0, 5)),
        (lambda b, h, q_idx, kv_idx: torch.logical_and(kv_idx <= q_idx, 5 > q_idx - kv_idx), (0, 4)),
        (lambda b, h, q_idx, kv_idx: kv_idx - q_idx >= -5, (-math.inf, 5)),
        (lambda b, h, q_idx, kv_idx: q_idx + 3 >= kv_idx, (-3, math.inf)),
        (flashtile.noop_mask, (-math.inf, math.inf)),
        (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + h, None),
        (lambda b, h, q_idx, kv_idx: 2 * q_idx >= kv_idx, None),
        (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 2.5), None),
        (lambda b, h, q_idx, kv_idx: q_idx != kv_idx, None),
        (lambda b, h, q_idx, kv_idx: (doc[kv_idx] == doc[q_idx]) & (q_idx >= kv_idx), None),
        (lambda b, h, q_idx, kv_idx: (kv_idx < 7) | (q_idx >= kv_idx), (0, math.inf, 7)),
        (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (6 >= kv_idx), (0, math.inf, 7)),
        (flashtile.or_masks(lambda b, h, q_idx, kv_idx: kv_idx - 3 < 0, causal), (0, math.inf, 3)),
        (lambda b, h, q_idx, kv_idx: (kv_idx < 7) | (kv_idx < 9), None),
        (lambda b, h, q_idx, kv_idx: (kv_idx < 7) | (q_idx >= kv_idx) | (q_idx < 2), None),
        (lambda b, h, q_idx, kv_idx: (kv_idx > 7) | (q_idx >= kv_idx), None),
    ]
    for mask_mod, expected in forms:
        form = patterns.mask_form(codegen.trace(mask_mod, ("b", "h", "q_idx", "kv_idx"), DEVICE))
        assert form == (None if expected is None else (*expected, None)[:3])


def test_block_masks_that_compute_the_pattern_are_routed(builtin_calls, monkeypatch):
    """A block mask routes when its lists compute what its mask_mod says, whoever built it: torch's
    create_block_mask, lists with every computed block partial, another BLOCK_SIZE; and again after its lists
    change in place only if they still do."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    q, k, v = (torch.randn(1, 2, 50, 16, device=DEVICE) for _ in range(3))
    built = flashtile.create_block_mask(causal, None, None, 50, 50, device=DEVICE, BLOCK_SIZE=16)
    partial_only = BlockMask.from_kv_blocks(*_ordered(built.to_dense() > 0), BLOCK_SIZE=16, mask_mod=causal,
                                            seq_lengths=(50, 50))  # fmt: skip
    masks = [built, partial_only, flex.create_block_mask(causal, None, None, 50, 50, device=DEVICE, BLOCK_SIZE=32)]
    with torch.no_grad():
        expected = flashtile.flex_attention(q, k, v, block_mask=built, kernel_options={"BACKEND": "TORCH"})
        for block_mask in masks:
            torch.testing.assert_close(flashtile.flex_attention(q, k, v, block_mask=block_mask), expected)
        assert len(builtin_calls) == len(masks)
        built.full_kv_num_blocks[..., 1] = 0  # the second row's full block skipped: no longer causal
        flashtile.flex_attention(q, k, v, block_mask=built)
    assert len(builtin_calls) == len(masks)


@settings(max_examples=60, deadline=None)
@given(
    seqlen_q=st.integers(1, 60),
    seqlen_k=st.integers(1, 60),
    blocks=st.tuples(st.integers(1, 17), st.integers(1, 17)),
    lo=st.sampled_from([-math.inf, -7, -1, 0]),
    hi=st.sampled_from([0, 1, 6, math.inf]),
    prefix=st.one_of(st.none(), st.integers(0, 70)),
)
def test_attended_blocks(seqlen_q, seqlen_k, blocks, lo, hi, prefix):
    """Which blocks some / every position attends (what the block lists are checked against before routing), against
    the mask evaluated position by position: intervals holding the diagonal at equal lengths, the keys before a
    prefix or causal ones, and every key at any lengths."""
    from flashtile.flex import patterns

    if prefix is not None:
        lo, hi = 0, math.inf
    if (lo, hi) != (-math.inf, math.inf):
        seqlen_k = seqlen_q
    block_mask = flashtile.create_block_mask(flashtile.noop_mask, None, None, seqlen_q, seqlen_k, device=DEVICE,
                                             BLOCK_SIZE=blocks)  # fmt: skip
    some, every = patterns._attends(block_mask, lo, hi, prefix)
    q_idx, kv_idx = torch.arange(seqlen_q, device=DEVICE)[:, None], torch.arange(seqlen_k, device=DEVICE)
    attended = (q_idx - kv_idx >= lo) & (q_idx - kv_idx <= hi)
    if prefix is not None:
        attended = attended | (kv_idx < prefix)
    for found, fill, reduce in ((every, True, torch.all), (some, False, torch.any)):
        padded = torch.nn.functional.pad(attended, (0, -seqlen_k % blocks[1], 0, -seqlen_q % blocks[0]), value=fill)
        cells = padded.unflatten(1, (-1, blocks[1])).unflatten(0, (-1, blocks[0]))  # (Qb, q_block, Kb, kv_block)
        assert torch.equal(found, reduce(reduce(cells, 3), 1))


def test_block_lists_with_rows_past_the_lengths_are_routed(builtin_calls, monkeypatch):
    """Lists made for longer queries than the mask's seq_lengths (rows past them are never read) are checked on the
    rows the lengths use, and route."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    made = flashtile.create_block_mask(causal, None, None, 40, 40, device=DEVICE, BLOCK_SIZE=16)

    def one_more_row(num_blocks, indices):  # a fourth row of blocks, listing none
        return torch.cat([num_blocks, 0 * num_blocks[..., :1]], -1), torch.cat([indices, 0 * indices[..., :1, :]], -2)

    lists = (*one_more_row(made.kv_num_blocks, made.kv_indices), *one_more_row(made.full_kv_num_blocks,
                                                                                made.full_kv_indices))  # fmt: skip
    block_mask = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=16, mask_mod=causal, seq_lengths=(40, 40))
    assert block_mask.kv_num_blocks.shape[-1] > block_mask.q_blocks
    q, k, v = (torch.randn(1, 2, 40, 16, device=DEVICE) for _ in range(3))
    with torch.no_grad():
        out = flashtile.flex_attention(q, k, v, block_mask=block_mask)
        expected = flashtile.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "TORCH"})
    assert len(builtin_calls) == 1
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("backend", ["TRITON", "AUTO"])
def test_forcing_the_generated_kernel(backend, builtin_calls):
    """BACKEND 'TRITON' keeps the generated kernel for a recognised pattern; 'AUTO' routes it."""
    q, k, v = (torch.randn(1, 2, 32, 16, device=DEVICE) for _ in range(3))
    block_mask = flashtile.create_block_mask(causal, None, None, 32, 32, device=DEVICE, BLOCK_SIZE=16)
    flashtile.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
    assert len(builtin_calls) == (backend == "AUTO")


@pytest.mark.parametrize("L, S", [(0, 5), (5, 0)])
def test_builtin_kernels_on_empty_inputs(L, S, builtin_calls):
    """No queries or no keys, without mods: the built-in attention's result, every row seeing no key (out 0, lse
    -inf)."""
    q = torch.randn(1, 2, L, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, S, 16, device=DEVICE) for _ in range(2))
    out, lse = flashtile.flex_attention(q, k, v, return_lse=True)
    assert len(builtin_calls) == 1
    assert out.shape == (1, 2, L, 16) and lse.shape == (1, 2, L)
    assert (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", ["causal", "document", "alibi", "softcap", "bias", "relative_bias"])
def test_gpu_kernel_long(name, D):
    """Compiled kernels at lengths past one block (and not a multiple of it), GQA, bf16, the default block size,
    gradients of captured tensors included."""
    run_case(name, "TRITON", dtype=torch.bfloat16, B=2, H=4, H_kv=2, L=1000, S=1023, D=D, block=128)


@pytest.mark.gpu
@pytest.mark.parametrize("L, S", [(1024, 2048), (2048, 1024)])
@pytest.mark.parametrize("name", ["causal", "document", "alibi", "softcap"])
def test_gpu_kernel_even_lengths(name, L, S):
    """Compiled kernels at lengths that are multiples of the block size (no bounds checks in their loops)."""
    run_case(name, "TRITON", dtype=torch.bfloat16, B=1, H=4, H_kv=2, L=L, S=S, D=128, block=128)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "sliding_window", "alibi", "softcap_alibi", "prefix_lm"])
def test_gpu_recognised_mods_long(name, builtin_calls):
    """Recognised mods on the compiled built-in kernels: GQA, bf16, lengths past one block, the default block size."""
    run_case(name, "AUTO", dtype=torch.bfloat16, B=2, H=4, H_kv=2, L=1000, S=1000, D=128, block=128, learned=False)
    assert len(builtin_calls) == BUILTIN[name].get("rows", 1)


@pytest.mark.gpu
def test_gpu_matches_compiled_flex_attention():
    """Against torch.compile'd FlexAttention with the same mods and torch's own block mask, forward and backward."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    params = _params(4, 1024, 1024, grads=False)
    score_mod, mask_mod = _mods("alibi", params)
    q, k, v = (torch.randn(2, 4, 1024, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    block_mask = flex.create_block_mask(mask_mod, None, None, 1024, 1024, device=DEVICE)
    found = []
    for fn in (flashtile.flex_attention, torch.compile(flex.flex_attention)):
        out = fn(q, k, v, score_mod, block_mask)
        found.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for ours, theirs in zip(*found, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------ benchmark


def test_benchmark_dry_run(tmp_path, monkeypatch):
    """benchmarks/bench_flex.py --dry-run on the CPU path (the interpreter switched off, as the ``path`` fixture
    does): records in the one schema, flashtile (the mod as called, routed to the built-in kernels; the mod on the
    route it takes without them; the built-in option) measured and matching FlexAttention, FlexAttention's missing
    CPU backward recorded."""
    import bench_flex  # benchmarks/ is on the path (conftest)

    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    bench_flex.main(["--dry-run", "--out", str(tmp_path), "--commit", "test", "--mods", "alibi"])
    records = results.load(tmp_path / "flex.jsonl")
    assert len(records) == 4 * 2 and all(list(r) == list(results.FIELDS) for r in records)
    ours = [r for r in records if r["implementation"] in ("flashtile", "flashtile_generated", "flashtile_builtin")]
    assert len(ours) == 3 * 2
    assert all(r["time_ms"] > 0 and r["tflops"] > 0 and not r["extra"]["flagged"] for r in ours), ours
    assert {r["error"] for r in records if r["implementation"] == "flex" and r["pass"] == "fwd+bwd"} == {
        "FlexAttention has no backward on the CPU"
    }


# ------------------------------------------------------------------------------------------------ block masks


def test_block_mask_matches_torch():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    mask_mod = flashtile.and_masks(causal, flashtile.or_masks(lambda b, h, q, kv: q - kv < 20,
                                                              lambda b, h, q, kv: h == 1))  # fmt: skip
    ours = flashtile.create_block_mask(mask_mod, 2, 2, 64, 96, device=DEVICE, BLOCK_SIZE=(16, 32))
    theirs = flex.create_block_mask(mask_mod, 2, 2, 64, 96, device=DEVICE, BLOCK_SIZE=(16, 32))
    for name in LISTS:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.shape == theirs.shape == (2, 2, 64, 96) and ours.BLOCK_SIZE == (16, 32)
    assert ours.seq_lengths == (64, 96) and ours.mask_mod is mask_mod
    assert torch.equal(ours.to_dense(), theirs.to_dense().to(torch.int32))
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    assert "BLOCK_SIZE=(16, 32)" in repr(ours) and "sparsity=" in repr(ours) and "█" in str(ours)
    assert flashtile.create_block_mask(flashtile.noop_mask, None, None, 8, 8, device=DEVICE).sparsity() == 0
    half = flashtile.create_block_mask(lambda b, h, q, kv: kv < 16, None, None, 20, 20, device=DEVICE, BLOCK_SIZE=16)
    assert half.sparsity() == pytest.approx(100 * 4 / 20)  # the 4 keys past 16 sit in a skipped block


@pytest.mark.parametrize("L, S", [(256, 256), (300, 200)])
def test_block_mask_with_tiles_matches_torch(L, S):
    """At BLOCK_SIZE 128 the positions are counted per 64 x 64 tile and summed per block: the lists are still
    torch's, ragged lengths included; the finer table kept beside them (``tiles``, where it costs the kernels less)
    is create_block_mask's at BLOCK_SIZE 64."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    doc = _document_ids(max(L, S))

    def mask_mod(b, h, q_idx, kv_idx):  # documents, and causal on head 1 of batch entry 1
        return (doc[q_idx] == doc[kv_idx]) | ((b == 1) & (h == 1) & (q_idx >= kv_idx))

    ours = flashtile.create_block_mask(mask_mod, 2, 2, L, S, device=DEVICE)
    theirs = flex.create_block_mask(mask_mod, 2, 2, L, S, device=DEVICE)
    for name in LISTS:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    finer = tiles(ours)
    assert finer is not ours and finer.BLOCK_SIZE == (64, 64) and finer.seq_lengths == (L, S)
    at_64 = flashtile.create_block_mask(mask_mod, 2, 2, L, S, device=DEVICE, BLOCK_SIZE=64)
    for name in LISTS:
        assert torch.equal(getattr(finer, name), getattr(at_64, name)), name


def test_finer_tiles_only_where_they_cost_less(monkeypatch):
    """The finer table is kept only where the kernels' work on it (``_cost``: computed positions, partial ones
    twice) is at most TILE_SHARE of their work on the mask's blocks, only for block sizes TILE divides (and is
    smaller than one of), not past MAX_TILE_ENTRIES, and is forgotten once the mask's lists change in place."""
    n = 4096
    doc = _document_ids(n)
    documents = flashtile.create_block_mask(lambda b, h, q, kv: doc[q] == doc[kv], None, None, n, n, device=DEVICE)
    documents_tiles = tiles(documents)
    assert documents_tiles.BLOCK_SIZE == (TILE, TILE)
    unseparated = flashtile.create_block_mask(lambda b, h, q, kv: doc[q] == doc[kv], None, None, n, n,
                                              device=DEVICE, separate_full_blocks=False)  # fmt: skip
    finer = tiles(unseparated)  # its table has no full tiles either (its tiles: 55% of the blocks' work)
    assert finer.BLOCK_SIZE == (TILE, TILE) and finer.full_kv_num_blocks is None
    assert torch.equal(finer.kv_num_blocks, documents_tiles.kv_num_blocks + documents_tiles.full_kv_num_blocks)
    causal_mask = flashtile.create_block_mask(causal, None, None, n, n, device=DEVICE)
    assert tiles(causal_mask) is causal_mask  # 96% of the work: not worth the smaller tiles
    for block in (TILE, (128, 96)):
        other = flashtile.create_block_mask(lambda b, h, q, kv: doc[q] == doc[kv], None, None, 512, 512,
                                            device=DEVICE, BLOCK_SIZE=block)  # fmt: skip
        assert tiles(other) is other
    documents.kv_num_blocks.add_(0)  # an in-place change (its version moves)
    assert tiles(documents) is documents
    from flashtile.flex import block_mask

    monkeypatch.setattr(block_mask, "MAX_TILE_ENTRIES", 64 * 64 - 1)  # one entry fewer than this table needs
    large = flashtile.create_block_mask(lambda b, h, q, kv: doc[q] == doc[kv], None, None, n, n, device=DEVICE)
    assert tiles(large) is large


# ----------------------------------------------------------------------------------------------------- errors


def _qkv(B=1, H=2, L=8, S=8, D=16, **changes):
    q, k, v = (torch.randn(B, H, n, D, device=DEVICE) for n in (L, S, S))
    return {"query": q, "key": k, "value": v, **changes}


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"query": torch.randn(2, 8, 16)}, "4-D"),
        ({"key": torch.randn(1, 2, 8, 32)}, "head dim"),
        ({"value": torch.randn(1, 2, 9, 16)}, "must match key"),
        ({"key": torch.randn(1, 1, 8, 16), "value": torch.randn(1, 1, 8, 16)}, "enable_gqa=True"),
        ({"query": torch.randn(1, 2, 8, 16, dtype=torch.float64)}, "float16, bfloat16 or float32"),
        ({"query": torch.randn(1, 2, 8, 16, dtype=torch.float16)}, "share a dtype"),
        ({"block_mask": "causal"}, "must be a BlockMask"),
        ({"score_mod": causal}, "score_mod must be a function"),
        ({"kernel_options": {"BACKEND": "FLASH"}}, "BACKEND"),
    ],
)
def test_bad_inputs_raise_input_error(changes, match):
    changes = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in changes.items()}
    with pytest.raises(flashtile.InputError, match=match):
        flashtile.flex_attention(**_qkv(**changes))


def test_kernel_options_as_flex_attention_takes_them():
    """``FlexKernelOptions`` is FlexAttention's kernel_options type: FlexAttention's BACKEND "TRITON_DECODE" runs the
    generated kernel ("TRITON"), its tuning keys are ignored, and its "FLASH" is refused with what to use instead."""
    q, k, v = (torch.randn(1, 2, 40, 16, device=DEVICE) for _ in range(3))
    block_mask = flashtile.create_block_mask(causal, None, None, 40, 40, device=DEVICE, BLOCK_SIZE=16)
    generated = flashtile.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "TRITON"})
    for options in (
        flashtile.FlexKernelOptions(BACKEND="TRITON_DECODE"),
        {"BACKEND": "TRITON", "BLOCK_M": 32, "num_warps": 2, "PRESCALE_QK": True},
    ):
        assert torch.equal(flashtile.flex_attention(q, k, v, block_mask=block_mask, kernel_options=options), generated)
    with pytest.raises(flashtile.InputError, match="'AUTO' runs flashtile's FlashAttention kernels"):
        flashtile.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"})


def test_hand_built_block_mask_lists_are_checked(monkeypatch):
    """A hand-built block mask whose lists name a block outside the lengths, count more blocks than a row holds, or
    have too few rows raises InputError before any kernel runs (the kernels read listed tiles without bounds checks
    where the lengths divide the blocks); its values are checked once, and again after an in-place change."""
    L = S = 32
    num, indices = torch.ones(1, 1, 2, dtype=torch.int32), torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32)

    def attend(num_blocks, kv_indices):
        block_mask = BlockMask.from_kv_blocks(num_blocks.to(DEVICE), kv_indices.to(DEVICE), BLOCK_SIZE=16,
                                              seq_lengths=(L, S))  # fmt: skip
        return flashtile.flex_attention(**_qkv(L=L, S=S), block_mask=block_mask)

    attend(num, indices)
    with pytest.raises(flashtile.InputError, match=r"kv lists name blocks outside \[0, 2\)"):
        attend(num, indices.masked_fill(indices == 1, 2))
    with pytest.raises(flashtile.InputError, match="count more than the 2 entries"):
        attend(num + 2, indices)
    with pytest.raises(flashtile.InputError, match="need 2 rows of blocks"):
        attend(num[..., :1], indices[..., :1, :])
    block_mask = BlockMask.from_kv_blocks(num.to(DEVICE), indices.to(DEVICE), BLOCK_SIZE=16, seq_lengths=(L, S))
    inputs = _qkv(L=L, S=S)
    checks = []
    values_checked = flashtile._backend.values_checked
    monkeypatch.setattr(flashtile._backend, "values_checked", lambda device: checks.append(1) or values_checked(device))
    for _ in range(2):
        flashtile.flex_attention(**inputs, block_mask=block_mask)
    assert len(checks) == 1
    block_mask.kv_indices[0, 0, 1, 0] = -1
    with pytest.raises(flashtile.InputError, match="kv lists name blocks outside"):
        flashtile.flex_attention(**inputs, block_mask=block_mask)
    created = flashtile.create_block_mask(causal, None, None, L, S, device=DEVICE, BLOCK_SIZE=16)
    flashtile.flex_attention(**inputs, block_mask=created)
    assert len(checks) == 2


def test_block_mask_for_other_sizes_raises():
    block_mask = flashtile.create_block_mask(causal, None, None, 16, 16, device=DEVICE)
    with pytest.raises(flashtile.InputError, match="created for Q_LEN, KV_LEN"):
        flashtile.flex_attention(**_qkv(L=8, S=16), block_mask=block_mask)
    heads = flashtile.create_block_mask(causal, 1, 3, 8, 8, device=DEVICE)
    with pytest.raises(flashtile.InputError, match="H of 1 or 2"):
        flashtile.flex_attention(**_qkv(), block_mask=heads)
    with pytest.raises(flashtile.InputError, match="Q_LEN must be a positive int"):
        flashtile.create_block_mask(causal, 1, 1, 0, 8, device=DEVICE)
    with pytest.raises(flashtile.InputTypeError, match="mask_mod must be a function"):
        flashtile.create_block_mask(lambda s, b, h, q, kv: s, 1, 1, 8, 8, device=DEVICE)
