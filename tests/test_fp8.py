"""float8 (e4m3) forward with FlashAttention-3's descale factors, against the float64 oracle of the dequantized inputs.

Tolerance, derived from what a float8 forward must round (``ops.fp8.forward``'s docstring). The products Q K^T of
e4m3 values are exact in float32 but for the sums' rounding; the one large rounding is P's, to e4m3 before P V
(3 mantissa bits: a relative error up to 2**-4 for every p = exp(s - rowmax) >= 2**-14, the kernel's 2**8 shift
keeping those out of e4m3's subnormals), then out's to bf16 (2**-9 relative). So:

- the rule (tests/oracle.py's, DESIGN's): max|out - ref| <= 2 * max|base - ref| + 2 ulps of bf16, where ref is the
  float64 oracle on the dequantized inputs and ``base`` the same computation with P rounded as a plain float8
  forward rounds it (p relative to the row's final max, times 2**8, to e4m3), in float64 otherwise, out to bf16;
- and the worst case those roundings allow: |out - ref| <= 2**-4 * max|v| + 2**-8 * max|ref| (out is a weighted
  mean of the values whose weights err by at most 2**-4 relative; the rest is bf16's rounding), which holds
  whatever the rounding's luck.

The CPU path computes in float32 (no float8 product), so it meets both with room. GPU-only cases (long sequences,
the shipped configs) are marked ``gpu``; ``test_compiles_for_sm90`` lowers the kernel for sm_90 without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashtile
from conftest import DEVICE
from flashtile import _backend
from flashtile.errors import InputError, InputTypeError, UnsupportedDtypeError
from flashtile.float8 import combined, dequantized
from flashtile.ops.attention import configs
from flashtile.reference import attention_probs, attention_reference

E4M3 = torch.float8_e4m3fn
P_SHIFT = 2.0**8  # ops.fp8.forward.P_SHIFT, as a factor


def fp8(*shape: int) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE).to(E4M3)


def quantized(shape: tuple[int, ...], spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random values quantized to e4m3 with a factor per (batch, KV head) as a serving stack computes it: the
    largest |x| of each (batch, head) maps to 448, e4m3's largest. Returns (x in e4m3, descale (B, Hk) float32)."""
    x = torch.randn(shape, device=DEVICE) * spread
    amax = x.abs().amax(dim=(1, 3)).clamp_min(1e-6)  # (B, Hk)
    descale = (amax / 448.0).float()
    return (x / descale[:, None, :, None]).to(E4M3), descale


def float8_base(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                window: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The plain float8 forward's output on dequantized float64 inputs: P rounded as the kernel rounds it (relative
    to the row's final max, times 2**8, to e4m3), everything else in float64, out rounded to bf16."""
    probs, _ = attention_probs(q, k, scale, causal, window)  # (B, H, Sq, Sk)
    peak = probs.amax(-1, keepdim=True)
    p = probs / torch.where(peak > 0, peak, 1.0)
    rounded = (p * P_SHIFT).float().to(E4M3).double() / P_SHIFT
    total = p.sum(-1, keepdim=True)
    values = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    out = torch.einsum("bhqk,bkhd->bqhd", rounded / torch.where(total > 0, total, 1.0), values)
    return out.to(torch.bfloat16)


FP8_ACCUMULATION = 2**-13
"""Relative precision of a sum of float8 products on a GPU's tensor cores: Hopper's float8 MMA keeps about 14
significant bits of the accumulated sum (DeepSeek-V3 technical report, section 3.3.2), not float32's 24; one bit
of margin. The interpreter and the CPU path add in float32."""


def accumulation_error(q: torch.Tensor, k: torch.Tensor, scale: float, device: torch.device) -> float:
    """Bound on a score's error from the float8 products' accumulation on ``device`` (0 off a GPU): the precision
    above times scale * sum_d |q_d k_d|, the largest magnitude the sum passes through. The LSE, a smooth maximum of
    the scores, moves by at most the largest score error."""
    if device.type != "cuda":
        return 0.0
    group = q.shape[2] // k.shape[2]
    magnitudes = torch.einsum("bqhd,bkhd->bhqk", q.abs(), k.abs().repeat_interleave(group, dim=2))
    return FP8_ACCUMULATION * scale * magnitudes.max().item()


def check_float8(out, lse, q8, k8, v8, descale, softmax_scale, causal, window) -> dict:
    """Assert out and lse of a float8 call against the oracle (the module docstring); return the errors."""
    scale = softmax_scale if softmax_scale is not None else q8.shape[-1] ** -0.5
    q, k, v = dequantized(q8, k8, v8, descale, torch.float64)  # on the inputs' device: float64 is fast on a GPU
    ref, ref_lse = attention_reference(q, k, v, scale, causal, window)
    base = float8_base(q, k, v, scale, causal, window).double()
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in out (unwritten elements?)"
    error = (out.double() - ref).abs().max().item()
    base_error = (base - ref).abs().max().item()
    ulps = 2 * torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
    assert error <= 2 * base_error + ulps, f"out: error {error:.3e} > 2 x base {base_error:.3e} + {ulps:.1e}"
    worst = 2**-4 * v.abs().max().item() + 2**-8 * ref.abs().max().item()
    assert error <= worst, f"out: error {error:.3e} above the worst case of float8's roundings {worst:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: rows that see no key differ"
    lse_error = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    lse_bound = 1e-5 * max(1.0, ref_lse[finite].abs().max().item()) + accumulation_error(q, k, scale, out.device)
    assert lse_error <= lse_bound, f"lse: error {lse_error:.3e} > {lse_bound:.3e}"
    return {"error": error, "base_error": base_error, "worst": worst, "lse_error": lse_error}


CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v, causal, window)
    (2, 33, 47, 4, 2, 64, 64, False, (-1, -1)),
    (1, 70, 45, 2, 1, 40, 40, True, (-1, -1)),  # seqlen_q > seqlen_k: rows that see no key; padded head dim
    (1, 45, 70, 2, 2, 64, 64, True, (-1, -1)),
    (2, 64, 100, 2, 1, 64, 32, False, (5, 3)),  # a sliding window, headdim_v != headdim
    (1, 1, 113, 3, 3, 16, 16, False, (-1, -1)),
]


def case_id(case) -> str:
    b, sq, sk, h, hk, d, dv, causal, window = case
    mask = "causal" if causal else "full" if window == (-1, -1) else f"window{window[0]}-{window[1]}"
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}-Dv{dv}-{mask}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_oracle(path, case):
    b, sq, sk, h, hk, d, dv, causal, window = case
    q8, q_d = quantized((b, sq, h, d))
    k8, k_d = quantized((b, sk, hk, d))
    v8, v_d = quantized((b, sk, hk, dv), spread=2.0)
    q_d = q_d[:, :hk].contiguous()  # q's factors are per KV head (FlashAttention-3's (batch, nheads_k))
    out, lse, _ = flashtile.flash_attn_func(
        q8, k8, v8, causal=causal, window_size=window, return_attn_probs=True, q_descale=q_d, k_descale=k_d,
        v_descale=v_d,
    )  # fmt: skip
    check_float8(out, lse, q8, k8, v8, combined(q_d, k_d, v_d, b, hk, q8.device), None, causal, window)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=case_id)
def test_tensor_descriptors(case):
    """The kernel's tensor-descriptor loads and stores (the GPU configs' TMA; pointer loads in the other tests):
    interpreted on a CPU, compiled on a GPU."""
    b, sq, sk, h, hk, d, dv, causal, window = case
    (q8, q_d), (k8, k_d), (v8, v_d) = quantized((b, sq, h, d)), quantized((b, sk, hk, d)), quantized((b, sk, hk, dv))
    q_d = q_d[:, :hk].contiguous()
    cfg = dataclasses.replace(configs.config("fp8_forward", torch.device(DEVICE), d, dv), tma=True)
    with configs.override(fp8_forward=cfg):
        out, lse, _ = flashtile.flash_attn_func(
            q8, k8, v8, causal=causal, window_size=window, return_attn_probs=True, q_descale=q_d, k_descale=k_d,
            v_descale=v_d,
        )  # fmt: skip
    check_float8(out, lse, q8, k8, v8, combined(q_d, k_d, v_d, b, hk, q8.device), None, causal, window)


@pytest.mark.parametrize("given", ["none", "v", "qk"])
def test_descale_factors_optional(path, given):
    """A factor left out is 1.0 (FlashAttention-3's None); a per-tensor factor is the (batch, nheads_k) expansion of
    one value."""
    b, s, h, d = 1, 40, 2, 32
    q8, k8, v8 = (torch.randn(b, s, h, d, device=DEVICE).to(E4M3) for _ in range(3))
    factor = torch.tensor(0.37, device=DEVICE).expand(b, h)
    descales = dict(
        none={}, v=dict(v_descale=factor), qk=dict(q_descale=factor, k_descale=factor.clone().contiguous())
    )[given]  # fmt: skip
    out, lse, _ = flashtile.flash_attn_func(q8, k8, v8, softmax_scale=0.5, return_attn_probs=True, **descales)
    check_float8(out, lse, q8, k8, v8, combined(*(descales.get(n) for n in ("q_descale", "k_descale", "v_descale")),
                                                b, h, q8.device), 0.5, False, (-1, -1))  # fmt: skip


def test_family_choice(path):
    """float8 tensors run the float8 kernel (compiled, or in the interpreter), else (CPU tensors without the
    interpreter) the CPU path's dequantized float32."""
    q = fp8(1, 8, 2, 32)
    options = flashtile.interface.prepared(q, q, q)[3]
    choice = _backend.forward_choice(q, q, q, options)
    assert choice.path == ("triton-fp8" if path == "triton" else "cpu"), choice


def test_empty(path):
    q = torch.randn(2, 0, 2, 32, device=DEVICE).to(E4M3)
    k = torch.randn(2, 5, 2, 32, device=DEVICE).to(E4M3)
    out = flashtile.flash_attn_func(q, k, k)
    assert out.shape == (2, 0, 2, 32) and out.dtype == torch.bfloat16


TRANSPOSE_SHAPES = [  # (batch, seqlen_k, nheads_k, headdim_v)
    (1, 1, 1, 32),
    (2, 17, 3, 72),  # a head dim in a wider tile (128), keys short of one tile
    (1, 130, 2, 128),  # two full tiles and two keys
    (1, 17, 1, 256),
    (2, 65, 1, 96),
    pytest.param((2, 4099, 3, 128), marks=pytest.mark.gpu),  # prefill lengths, compiled
    pytest.param((1, 1000, 2, 72), marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "qkv-slice"])
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=lambda s: "B{}-Sk{}-Hk{}-Dv{}".format(*s))
def test_transposed_values(shape, packed):
    """V as the kernel reads it: v.permute(0, 2, 3, 1) bit for bit, in rows of seqlen_k rounded up to KEY_ALIGN
    keys (zeros past seqlen_k), also from a v that is a slice of a packed (B, S, 3, H, D) qkv tensor."""
    from flashtile.ops.fp8.transpose import KEY_ALIGN, transposed_values

    b, sk, hk, dv = shape
    v = fp8(b, sk, 3, hk, dv)[:, :, 2] if packed else fp8(b, sk, hk, dv)
    vt = transposed_values(v)
    assert vt.shape == (b, hk, dv, sk) and vt.stride(-1) == 1
    rows = -(-sk // KEY_ALIGN) * KEY_ALIGN
    assert vt.stride(2) == rows and vt.stride(1) == dv * rows
    assert torch.equal(vt.view(torch.uint8), v.permute(0, 2, 3, 1).view(torch.uint8))
    padding = torch.as_strided(vt, (b, hk, dv, rows - sk), vt.stride(), vt.storage_offset() + sk)
    assert not padding.view(torch.uint8).any(), "the keys past seqlen_k hold something other than zeros"


def test_qkvpacked(path):
    """A packed qkv tensor (v a strided slice of it) gives what its contiguous q, k, v give."""
    qkv = fp8(2, 37, 3, 2, 32)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    expected = flashtile.flash_attn_func(*(qkv[:, :, i].contiguous() for i in range(3)), causal=True)
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------
# Errors: each raised before anything launches, saying what to change


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(dropout_p=0.1), InputError, "dropout_p"),
        (dict(softcap=30.0), InputError, "softcap"),
        (dict(alibi_slopes=torch.ones(2)), InputError, "alibi_slopes"),
        (dict(learnable_sink=torch.ones(2)), InputError, "learnable_sink"),
        (dict(q_descale=torch.ones(2, 2)), InputError, "(batch, nheads_k) = (2, 1)"),
        (dict(k_descale=torch.ones(2, 1, dtype=torch.float64)), InputTypeError, "float32"),
        (dict(v_descale=0.5), InputTypeError, "float32 tensor"),
    ],
    ids=["dropout", "softcap", "alibi", "sink", "descale-shape", "descale-dtype", "descale-float"],
)
def test_refused_options(kwargs, error, words):
    q, k = fp8(2, 16, 2, 32), fp8(2, 16, 1, 32)
    kwargs = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in kwargs.items()}
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        flashtile.flash_attn_func(q, k, k, **kwargs)


def test_descale_without_float8():
    q = torch.randn(1, 8, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="descale factors dequantize float8 inputs only"):
        flashtile.flash_attn_func(q, q, q, v_descale=torch.ones(1, 2, device=DEVICE))


@pytest.mark.parametrize("other", [torch.float8_e5m2, torch.bfloat16], ids=["e5m2", "mixed"])
def test_refused_dtypes(other):
    q = fp8(1, 8, 2, 32)
    with pytest.raises(UnsupportedDtypeError, match="float8_e4m3fn"):
        flashtile.flash_attn_func(q, q.float().to(other), q)
    with pytest.raises(UnsupportedDtypeError, match="float8_e5m2"):
        e5 = torch.randn(1, 8, 2, 32, device=DEVICE).to(torch.float8_e5m2)
        flashtile.flash_attn_func(e5, e5, e5)


def test_no_gradient():
    q = fp8(1, 8, 2, 32).requires_grad_()
    with pytest.raises(InputError, match="forward only"):
        flashtile.flash_attn_func(q, q.detach(), q.detach())
    with torch.no_grad():
        assert flashtile.flash_attn_func(q, q, q).dtype == torch.bfloat16


def test_other_functions():
    """The varlen function and the KV-cache function refuse float8 with the dtype message; SDPA computes it (no
    descale factors: 1.0), as flash_attn_func does."""
    q = fp8(16, 2, 32)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    with pytest.raises(UnsupportedDtypeError):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 16, 16)
    with pytest.raises(UnsupportedDtypeError):
        flashtile.flash_attn_with_kvcache(q[None, :1], q[None], q[None])
    out = flashtile.scaled_dot_product_attention(*(q[None].transpose(1, 2),) * 3, is_causal=True)
    expected = flashtile.flash_attn_func(q[None], q[None], q[None], causal=True).transpose(1, 2)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------
# GPU: the shipped configs at lengths the interpreter cannot reach


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(2048, 2048), (1023, 1537)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_matches_oracle(head_dim, causal, seqlens):
    sq, sk = seqlens
    b, h, hk = 1, 4, 2
    q8, q_d = quantized((b, sq, h, head_dim))
    k8, k_d = quantized((b, sk, hk, head_dim))
    v8, v_d = quantized((b, sk, hk, head_dim))
    q_d = q_d[:, :hk].contiguous()
    out, lse, _ = flashtile.flash_attn_func(
        q8, k8, v8, causal=causal, return_attn_probs=True, q_descale=q_d, k_descale=k_d, v_descale=v_d
    )
    check_float8(out, lse, q8, k8, v8, combined(q_d, k_d, v_d, b, hk, q8.device), None, causal, (-1, -1))


@pytest.mark.gpu
def test_gpu_window_and_unaligned():
    """A sliding window, and K/V whose strides a tensor descriptor cannot take (pointer loads)."""
    b, sq, sk, h, d = 2, 300, 517, 2, 72
    q8, k8 = fp8(b, sq, h, d), fp8(b, sk, h, d)
    v8 = fp8(b, sk, h, d + 8)[..., :d]  # a row stride of 80 bytes
    out, lse, _ = flashtile.flash_attn_func(q8, k8, v8, window_size=(100, 20), return_attn_probs=True)
    check_float8(out, lse, q8, k8, v8, None, None, False, (100, 20))


# ---------------------------------------------------------------------------------------------------
# sm_90 machine code, without a GPU


@pytest.mark.slow
def test_compiles_for_sm90():
    """Every shipped config and tuning candidate lowers for sm_90 with both products on float8 wgmma and fits in
    shared memory; the V transpose compiles with 16-byte global loads and stores (tests/fp8_compile.py, in a
    subprocess without TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flashtile.__file__).parents[1]), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("fp8_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    failed = [row for row in rows if "error" in row or (
        row["narrow_global"] > 0 if row["kernel"] == "transpose" else row["fp8_wgmma"] < 2)]  # fmt: skip
    assert not failed and proc.returncode == 0, failed


def test_torch_compile(path):
    """Under torch.compile the call goes through the custom op (its fake gives out in bf16) and matches eager; the
    op passes torch.library.opcheck with float8 inputs and descale factors."""
    from flashtile import _ops

    q, k, v = fp8(1, 40, 2, 32), fp8(1, 40, 1, 32), fp8(1, 40, 1, 32)
    v_d = torch.full((1, 1), 0.5, device=DEVICE)

    def call(q, k, v, v_d):
        return flashtile.flash_attn_func(q, k, v, causal=True, v_descale=v_d)

    eager = call(q, k, v, v_d)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v, v_d)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    options = flashtile.interface.prepared(q, k, v, window_right=0, descales=(None, None, v_d))[3]
    # not opcheck's test_schema: it multiplies the inputs, which torch does not implement for float8 on a CPU
    checks = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_ops.attention_forward, (q, k, v, *_ops._flat(options)), test_utils=checks)
