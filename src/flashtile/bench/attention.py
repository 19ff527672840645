"""Attention speed and memory: flashtile against its peers, same inputs, same process, one GPU.

    PYTHONPATH=src python3 benchmarks/bench_attention.py --out DIR [--quick]
        [--shapes standard|memory|all|variants] [--providers flashtile,sdpa_flash,...] [--dtypes bf16,fp16]
        [--commit SHA] [--dry-run]

Shapes, the convention the field uses: total tokens B·N = 16384 and hidden
H·D = 2048, N in {512, ..., 16384}, D in {64, 128, 256}, causal and not; ``--quick`` keeps
D in {64, 128} and N in {1024, 4096, 16384}. q, k, v and dout are drawn once per shape from
N(0, 1) in layout (B, N, H, D); providers that want (B, H, N, D) get transposed views of the
same tensors, so every provider reads the same memory.

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call), median.
- fwd: one forward call with the inputs requiring grad (as in training, so the softmax
  statistics for the backward are kept).
- bwd: the backward alone, ``out.backward(dout, retain_graph=True)`` on a graph built once;
  ``do_bench(grad_to_none=[q, k, v])`` sets the grads to None outside the timed region, so the
  timed call writes fresh gradients and never accumulates.
FLOPs: fwd 4·B·H·N²·D, halved when causal; bwd 2.5 × fwd.

Correctness spot check, before timing each row, against ``sdpa_flash`` (FlashAttention-2
through SDPA) on the same inputs: fwd rows carry the max abs difference of the output, bwd
rows the max over dq, dk, dv. A row is flagged when the difference exceeds the dtype's
tolerance (bf16 0.05, fp16 0.01); for gradients the tolerance is scaled by max(1, max |ref|).

Memory (``--shapes memory``): B=1, H=16, D=128, causal, N in {2k, 8k, 32k}, flashtile and
sdpa_flash: peak memory allocated during one forward+backward minus what was held just before
it, counting q, k, v, dout and the three gradients as held before. In MiB.

A provider that fails (import, compile, unsupported shape, out of memory) is recorded with
the reason in every row it would have filled; nothing is dropped. If a failure leaves the
CUDA context unusable, the rows not yet run are recorded with that reason instead.

Variants (``--shapes variants``, issue 4; not part of ``all``), bf16, D=128, H=16, times in ms:
- window: full causal against ``window_size=(1024, 0)`` (causal, each query sees itself and the 1024
  keys before it) at N in {4k, 8k, 16k, 32k}, B=1 (the standard table's D=128 shape at N=16k, the
  headline row, run first); the windowed time should follow the window, not N.
- features: causal at N=4k (B=4) and 16k (B=1): baseline, softcap=30, alibi_slopes (H,),
  learnable_sink (H,), dropout_p=0.1, deterministic=True, GQA with H_k = H/4; each over the baseline.
- mask: ``flashtile.scaled_dot_product_attention`` with a boolean or additive ``attn_mask`` of shape
  (B, 1, N, N) or (1, 1, N, N), N=4k, B=4, non-causal, against torch's SDPA with the same mask
  (efficient backend, and cuDNN).
Peers run where they have the feature (FA2 through SDPA has no window, softcap, ALiBi or sink;
FlexAttention gets a block mask and a score_mod, compiled once per shape); a peer without it is
recorded as unsupported, with the reason, in its rows. FLOPs count only the visible (query, key)
pairs: 4·B·H·D·pairs forward, 2.5× that backward (full causal: N(N+1)/2 pairs; masks: N²).
Correctness spot check per case against the first peer that computes the same thing (sdpa_flash,
else flex, else sdpa_efficient; none for dropout and sinks); the deterministic row also checks that
two backward passes are bitwise equal. Timing: do_bench with warm-up 10 ms and repetition 50 ms
unless --warmup/--rep say otherwise. ``--budget-s`` (default 200 s for variants): once spent, only
flashtile rows still run, the peers' rows say why they are empty. Varlen rows: bench_varlen.py.
Expected on an H200 (estimated from the standard run, not yet measured): about 2.5 minutes, 26 cases;
the time goes to compilation (flashtile: one kernel set per feature flag, ~10 sets of ~5 s; FlexAttention:
one per shape and mask, 15) more than to the ~140 timed calls.

``--dry-run`` (variants only) runs the same cases on the CPU at tiny sizes: flashtile's CPU path, SDPA's
CPU kernels where torch has them, FlexAttention eagerly and forward only; it checks the plumbing and
the reports, its times mean nothing.

Outputs in --out: ``attention.json`` (header + rows, rewritten after every shape so a killed
run keeps what it measured), ``attention.md`` and ``attention.png`` (from ``report.py``; no plot for
variants). The markdown tables are printed last, without the provenance bullets (those are in the
files); a variants run then prints a short summary.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from report import FORWARD_FAILED, OURS, load, markdown, variant_summary, write_reports

TOTAL_TOKENS = 16384
HIDDEN = 2048
STANDARD_N = (512, 1024, 2048, 4096, 8192, 16384)
STANDARD_D = (64, 128, 256)
QUICK_N = (1024, 4096, 16384)
QUICK_D = (64, 128)
MEMORY_N = (2048, 8192, 32768)
MEMORY_B, MEMORY_H, MEMORY_D = 1, 16, 128
MEMORY_PROVIDERS = ("flashtile", "sdpa_flash")
REFERENCE = "sdpa_flash"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"bf16": 0.05, "fp16": 0.01}
BWD_FLOPS_FACTOR = 2.5
MIB = 1 << 20
REASON_CHARS = 400

Forward = Callable[[], Tensor]
"""A provider's forward on fixed inputs, returning the output in layout (B, N, H, D)."""
Builder = Callable[[Tensor, Tensor, Tensor, bool], Forward]
"""(q, k, v, causal) -> Forward, with q, k, v of shape (B, N, H, D). May raise."""


# ---------------------------------------------------------------- providers


def _build_flashtile(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Forward:
    from flashtile import flash_attn_func

    return lambda: flash_attn_func(q, k, v, causal=causal)


def _sdpa_builder(backend: SDPBackend) -> Builder:
    """SDPA restricted to one backend, on (B, H, N, D) views of the (B, N, H, D) inputs."""

    def build(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Forward:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def forward() -> Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        return forward

    return build


def _causal_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """FlexAttention mask_mod: query i sees keys j <= i."""
    return q_idx >= kv_idx


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    """``torch.compile(flex_attention)`` with static shapes: one compilation per shape.

    The recompile limits are raised so that the many shapes of one run never fall back to eager.
    """
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _causal_block_mask(n: int, device: torch.device) -> Any:
    """The causal BlockMask for sequence length ``n``, built once per length."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal_mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)


def _build_flex(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Forward:
    flex = _compiled_flex_attention()
    block_mask = _causal_block_mask(q.shape[1], q.device) if causal else None
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: flex(qt, kt, vt, block_mask=block_mask).transpose(1, 2)


def _build_fa4(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Forward:
    from flash_attn.cute import flash_attn_func

    def forward() -> Tensor:
        result = flash_attn_func(q, k, v, causal=causal)
        return result[0] if isinstance(result, tuple) else result

    return forward


# ---------------------------------------------------------------- providers for the variants (issue 4)


class Unsupported(Exception):
    """The provider has no such feature: its rows record the reason and nothing runs."""


@dataclass
class VariantInputs:
    """One variant case's tensors: q (B, N, H, D), k and v (B, N, H_k, D) and the options' tensors."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor
    alibi_slopes: Tensor | None = None
    """(H,) float32, no gradient (as in flash_attn)."""
    sink: Tensor | None = None
    """(H,) float32 learnable sink logits, requiring grad."""
    mask: Tensor | None = None
    """SDPA attn_mask (mask_batch, 1, N, N): boolean (True = attend) or additive in q's dtype, no gradient."""

    @property
    def leaves(self) -> list[Tensor]:
        """The tensors whose gradients the backward computes."""
        return [self.q, self.k, self.v] + ([self.sink] if self.sink is not None else [])


VariantBuilder = Callable[["VariantCase", VariantInputs], Forward]
"""(case, inputs) -> Forward in layout (B, N, H, D). Raises Unsupported, or anything else on failure."""

_FEATURE_NAMES = {
    "window": "no sliding window (window_size)",
    "softcap": "no softcap",
    "alibi": "no ALiBi slopes",
    "sink": "no learnable sink",
    "dropout": "no attention dropout",
    "deterministic": "no deterministic= switch (timed for flashtile only; its backward has no atomics either way)",
    "gqa": "no grouped-query attention",
    "mask": "no attn_mask (not compared here)",
}


def _refuse(case: VariantCase, who: str, supports: set[str]) -> None:
    """Raise Unsupported for the first feature of ``case`` that ``who`` lacks."""
    for feature in case.features():
        if feature not in supports:
            raise Unsupported(f"{who} has {_FEATURE_NAMES[feature]}")


def _variant_flashtile(case: VariantCase, t: VariantInputs) -> Forward:
    import flashtile

    if t.mask is not None:
        qt, kt, vt = (x.transpose(1, 2) for x in (t.q, t.k, t.v))
        gqa = case.H_k != case.H
        return lambda: flashtile.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=t.mask, dropout_p=case.dropout_p, enable_gqa=gqa
        ).transpose(1, 2)
    window = case.window or (-1, -1)
    return lambda: flashtile.flash_attn_func(
        t.q, t.k, t.v, dropout_p=case.dropout_p, causal=case.causal, window_size=window, softcap=case.softcap,
        alibi_slopes=t.alibi_slopes, deterministic=case.deterministic, learnable_sink=t.sink,
    )  # fmt: skip


def _sdpa_variant(backend: SDPBackend, who: str, supports: set[str]) -> VariantBuilder:
    """SDPA restricted to one backend, for the variants it has (dropout_p, enable_gqa, attn_mask)."""

    def build(case: VariantCase, t: VariantInputs) -> Forward:
        _refuse(case, who, supports)
        qt, kt, vt = (x.transpose(1, 2) for x in (t.q, t.k, t.v))
        options: dict[str, Any] = {"attn_mask": t.mask, "dropout_p": case.dropout_p, "is_causal": case.causal}
        if case.H_k != case.H:
            options["enable_gqa"] = True

        def forward() -> Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, **options).transpose(1, 2)

        return forward

    return build


@functools.cache
def _window_mask_mod(left: int, right: int) -> Callable[..., Tensor]:
    """FlexAttention mask_mod of flash_attn's window (left, right): key j visible from i when
    i - left <= j <= i + right. One function per window, so compiled graphs are reused."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    return mask_mod


@functools.cache
def _window_block_mask(n: int, left: int, right: int, device: torch.device) -> Any:
    """The sliding-window BlockMask for sequence length ``n``: key blocks outside the band are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_window_mask_mod(left, right), B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)


@functools.cache
def _alibi_slopes(nheads: int, device: torch.device) -> Tensor:
    """The usual ALiBi slopes 2^(-8 (h + 1) / H), float32 (nheads,)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], device=device)


@functools.cache
def _softcap_score_mod(cap: float) -> Callable[..., Tensor]:
    """FlexAttention score_mod of flashtile's softcap: cap · tanh(score / cap) on the scaled score."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


@functools.cache
def _alibi_score_mod(nheads: int, device: torch.device) -> Callable[..., Tensor]:
    """FlexAttention score_mod of flash_attn's ALiBi (Sq = Sk): score - slope[h] · |i - j|."""
    slopes = _alibi_slopes(nheads, device)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return score_mod


class _NoBackward(torch.autograd.Function):
    """Passes a forward-only result through and raises if a backward reaches it."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, anchor: Tensor) -> Tensor:
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        raise NotImplementedError("FlexAttention has no backward on the CPU (the dry run checks its forward only)")


def _variant_flex(case: VariantCase, t: VariantInputs) -> Forward:
    """FlexAttention: a block mask for causal and windows, a score_mod for softcap and ALiBi, enable_gqa.

    Compiled (dynamic=False, one compilation per shape and mask) on a GPU; eager and forward only on
    the CPU, where FlexAttention has no backward.
    """
    _refuse(case, "FlexAttention", {"window", "softcap", "alibi", "gqa"})
    from torch.nn.attention.flex_attention import flex_attention

    device = t.q.device
    on_cpu = device.type == "cpu"
    flex = flex_attention if on_cpu else _compiled_flex_attention()
    if case.window is not None:
        left, right = case.window
        block_mask = _window_block_mask(case.N, left, min(right, 0) if case.causal else right, device)
    else:
        block_mask = _causal_block_mask(case.N, device) if case.causal else None
    score_mod = None
    if case.softcap:
        score_mod = _softcap_score_mod(case.softcap)
    elif case.alibi:
        score_mod = _alibi_score_mod(case.H, device)
    gqa = case.H_k != case.H
    qt, kt, vt = (x.transpose(1, 2) for x in (t.q, t.k, t.v))
    if on_cpu:
        qd, kd, vd = (x.detach() for x in (qt, kt, vt))
        return lambda: _NoBackward.apply(
            flex(qd, kd, vd, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa), t.q
        ).transpose(1, 2)
    return lambda: flex(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa).transpose(1, 2)


def _variant_fa4(case: VariantCase, t: VariantInputs) -> Forward:
    """flash-attn-4 with the options passed by flash_attn's names; one it lacks fails the call, recorded."""
    _refuse(case, "flash-attn-4", set(_FEATURE_NAMES) - {"mask"})
    from flash_attn.cute import flash_attn_func

    options: dict[str, Any] = {"causal": case.causal}
    if case.window is not None:
        options["window_size"] = case.window
    if case.softcap:
        options["softcap"] = case.softcap
    if t.alibi_slopes is not None:
        options["alibi_slopes"] = t.alibi_slopes
    if t.sink is not None:
        options["learnable_sink"] = t.sink
    if case.dropout_p:
        options["dropout_p"] = case.dropout_p
    if case.deterministic:
        options["deterministic"] = True

    def forward() -> Tensor:
        result = flash_attn_func(t.q, t.k, t.v, **options)
        return result[0] if isinstance(result, tuple) else result

    return forward


@dataclass(frozen=True)
class Provider:
    """An attention implementation under test."""

    name: str
    description: str
    build: Builder
    variant: VariantBuilder
    """The same implementation for ``--shapes variants``."""


_SDPA_FEATURES = {"dropout", "gqa", "mask"}
PROVIDERS = {
    p.name: p
    for p in (
        Provider(
            "flashtile",
            "flashtile.flash_attn_func, layout (B, N, H, D); flashtile.scaled_dot_product_attention for masks",
            _build_flashtile,
            _variant_flashtile,
        ),
        Provider(
            "sdpa_flash",
            "SDPA, SDPBackend.FLASH_ATTENTION (FlashAttention-2); the accuracy reference",
            _sdpa_builder(SDPBackend.FLASH_ATTENTION),
            _sdpa_variant(SDPBackend.FLASH_ATTENTION, "SDPA's flash backend (FA2)", {"dropout", "gqa"}),
        ),
        Provider(
            "cudnn",
            "SDPA, SDPBackend.CUDNN_ATTENTION",
            _sdpa_builder(SDPBackend.CUDNN_ATTENTION),
            _sdpa_variant(SDPBackend.CUDNN_ATTENTION, "SDPA's cuDNN backend", _SDPA_FEATURES),
        ),
        Provider(
            "sdpa_efficient",
            "SDPA, SDPBackend.EFFICIENT_ATTENTION",
            _sdpa_builder(SDPBackend.EFFICIENT_ATTENTION),
            _sdpa_variant(SDPBackend.EFFICIENT_ATTENTION, "SDPA's efficient backend", _SDPA_FEATURES),
        ),
        Provider(
            "flex",
            "torch.compile(flex_attention, dynamic=False), causal and windows via create_block_mask, "
            "softcap and ALiBi as score_mod",
            _build_flex,
            _variant_flex,
        ),
        Provider(
            "fa4",
            "flash-attn-4, flash_attn.cute.flash_attn_func (CuTe DSL)",
            _build_fa4,
            _variant_fa4,
        ),
    )
}
SECTION_PROVIDERS = {
    "window": ("flashtile", "sdpa_flash", "cudnn", "flex", "fa4"),
    "features": ("flashtile", "sdpa_flash", "cudnn", "flex", "fa4"),
    "mask": ("flashtile", "sdpa_efficient", "cudnn"),
}
"""Which providers each variants section runs (those also asked for with --providers)."""
VARIANT_REFERENCES = ("sdpa_flash", "flex", "sdpa_efficient")
"""The accuracy reference of a variant case: the first of these that has its features."""


# ---------------------------------------------------------------- shapes and rows


@dataclass(frozen=True)
class Case:
    """One attention problem: q, k, v of shape (B, N, H, D) in ``dtype``."""

    dtype: str
    B: int
    N: int
    H: int
    D: int
    causal: bool

    @classmethod
    def standard(cls, dtype: str, d: int, n: int, causal: bool) -> Case:
        """B·N = TOTAL_TOKENS and H·D = HIDDEN."""
        return cls(dtype, TOTAL_TOKENS // n, n, HIDDEN // d, d, causal)

    def flops(self, pass_: str) -> float:
        """4·B·H·N²·D for the forward, halved when causal; 2.5 × that for the backward."""
        fwd = 4.0 * self.B * self.H * self.N * self.N * self.D * (0.5 if self.causal else 1.0)
        return fwd if pass_ == "fwd" else BWD_FLOPS_FACTOR * fwd

    def __str__(self) -> str:
        """'bf16 D=128 N=4096 B=4 H=16 causal=yes'."""
        causal = "yes" if self.causal else "no"
        return f"{self.dtype} D={self.D} N={self.N} B={self.B} H={self.H} causal={causal}"

    def inputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Fresh q, k, v (leaves requiring grad) and dout, all (B, N, H, D), from N(0, 1)."""
        shape, dtype = (self.B, self.N, self.H, self.D), DTYPES[self.dtype]
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        return q, k, v, torch.randn(shape, device="cuda", dtype=dtype)


@dataclass(frozen=True)
class VariantSizes:
    """The shapes of ``--shapes variants``; ``--dry-run`` swaps in tiny ones for the CPU."""

    head_dim: int
    nheads: int
    window: tuple[int, int]
    """flash_attn's window_size of the windowed rows (with causal=True)."""
    headline_n: int
    """The sequence length of the headline comparison (window against full causal), run first."""
    window_n: tuple[int, ...]
    window_batch: int
    feature_n: tuple[int, ...]
    mask_n: int
    total_tokens: int
    """B = total_tokens // N for the feature and mask rows, as in the standard table."""


VARIANT_SIZES = VariantSizes(
    head_dim=128,
    nheads=HIDDEN // 128,
    window=(1024, 0),
    headline_n=16384,
    window_n=(4096, 8192, 16384, 32768),
    window_batch=TOTAL_TOKENS // 16384,
    feature_n=(4096, 16384),
    mask_n=4096,
    total_tokens=TOTAL_TOKENS,
)
DRY_RUN_SIZES = VariantSizes(
    head_dim=32,
    nheads=4,
    window=(16, 0),
    headline_n=128,
    window_n=(64, 128, 256),
    window_batch=2,
    feature_n=(64, 128),
    mask_n=64,
    total_tokens=256,
)
SOFTCAP = 30.0
DROPOUT_P = 0.1
GQA_GROUP = 4
"""Query heads per key/value head in the GQA row."""
FEATURES = ("baseline", "softcap", "alibi", "sink", "dropout", "deterministic", "gqa")
MASK_TRUE_FRACTION = 0.7
VARIANT_WARMUP_MS, VARIANT_REP_MS = 10, 50
VARIANT_BUDGET_S = 200.0
DRY_RUN_REPS = 3


@dataclass(frozen=True)
class VariantCase:
    """One problem of ``--shapes variants``: q (B, N, H, D), k and v (B, N, H_k, D), and its options."""

    section: str
    """'window' (window against full causal), 'features' or 'mask' (SDPA attn_mask)."""
    variant: str
    """'causal' or 'window'; one of FEATURES; 'bool' or 'additive' for masks."""
    dtype: str
    B: int
    N: int
    H: int
    H_k: int
    D: int
    causal: bool
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: bool = False
    sink: bool = False
    dropout_p: float = 0.0
    deterministic: bool = False
    mask: str | None = None
    """'bool' or 'additive': an SDPA attn_mask of shape (mask_batch, 1, N, N)."""
    mask_batch: int = 0

    def features(self) -> list[str]:
        """What a provider needs to run this case (keys of _FEATURE_NAMES); [] for plain (causal) attention."""
        flags = {
            "window": self.window is not None,
            "softcap": self.softcap != 0.0,
            "alibi": self.alibi,
            "sink": self.sink,
            "dropout": self.dropout_p != 0.0,
            "deterministic": self.deterministic,
            "gqa": self.H_k != self.H,
            "mask": self.mask is not None,
        }
        return [name for name, on in flags.items() if on]

    @property
    def label(self) -> str:
        """The row's name in the tables: 'window (1024, 0)', 'softcap=30', 'bool mask (B,1,N,N)', ..."""
        if self.mask is not None:
            return f"{self.mask} mask ({'B' if self.mask_batch == self.B else self.mask_batch},1,N,N)"
        return {
            "window": f"window {self.window}",
            "baseline": "baseline (causal)",
            "softcap": f"softcap={self.softcap:g}",
            "alibi": "alibi_slopes (H,)",
            "sink": "learnable_sink (H,)",
            "dropout": f"dropout_p={self.dropout_p:g}",
            "deterministic": "deterministic=True",
            "gqa": f"GQA H_k={self.H_k}",
        }.get(self.variant, self.variant)

    @functools.cached_property
    def pairs(self) -> int:
        """Visible (query, key) pairs per (batch, head): N² without a mask (also with an attn_mask, which
        hides keys by value, not by position); N(N+1)/2 causal; each query's band under a window."""
        n = self.N
        if not self.causal and self.window is None:
            return n * n
        left, right = self.window if self.window is not None else (-1, -1)
        left = n if left < 0 else left
        right = n if right < 0 else right
        if self.causal:
            right = min(right, 0)
        return sum(max(0, min(n - 1, i + right) - max(0, i - left) + 1) for i in range(n))

    def flops(self, pass_: str) -> float:
        """4·B·H·D·pairs forward, 2.5 × that backward: only visible pairs count."""
        fwd = 4.0 * self.B * self.H * self.D * self.pairs
        return fwd if pass_ == "fwd" else BWD_FLOPS_FACTOR * fwd

    def __str__(self) -> str:
        """'features softcap=30 bf16 D=128 N=4096 B=4 H=16'."""
        return f"{self.section} {self.label} {self.dtype} D={self.D} N={self.N} B={self.B} H={self.H}"

    def inputs(self, device: torch.device) -> VariantInputs:
        """Fresh tensors from a fixed seed: q, k, v, dout from N(0, 1); sinks N(0, 1); a boolean mask with
        MASK_TRUE_FRACTION of the keys visible, or an additive one from N(0, 1)."""
        torch.manual_seed(0)
        dtype = DTYPES[self.dtype]

        def draw(heads: int, requires_grad: bool) -> Tensor:
            shape = (self.B, self.N, heads, self.D)
            return torch.randn(shape, device=device, dtype=dtype, requires_grad=requires_grad)

        t = VariantInputs(draw(self.H, True), draw(self.H_k, True), draw(self.H_k, True), draw(self.H, False))
        if self.alibi:
            t.alibi_slopes = _alibi_slopes(self.H, device)
        if self.sink:
            t.sink = torch.randn(self.H, device=device, requires_grad=True)
        if self.mask is not None:
            shape = (self.mask_batch, 1, self.N, self.N)
            if self.mask == "bool":
                t.mask = torch.rand(shape, device=device) < MASK_TRUE_FRACTION
            else:
                t.mask = torch.randn(shape, device=device, dtype=dtype)
        return t


def _variant_cases(dtypes: Sequence[str], sizes: VariantSizes) -> list[VariantCase]:
    """Every variants case, most important first (after --budget-s only flashtile runs): window against full
    causal at the headline length; the window at the other lengths; features; masks; full causal at the
    other lengths last (context for the window's flat cost, and the peers' causal rows cost compilations)."""
    d, h = sizes.head_dim, sizes.nheads
    others = [n for n in sizes.window_n if n != sizes.headline_n]
    options: dict[str, dict[str, Any]] = {
        "baseline": {},
        "softcap": {"softcap": SOFTCAP},
        "alibi": {"alibi": True},
        "sink": {"sink": True},
        "dropout": {"dropout_p": DROPOUT_P},
        "deterministic": {"deterministic": True},
        "gqa": {"H_k": h // GQA_GROUP},
    }
    cases = []
    for dtype in dtypes:

        def shape(n: int, batch: int, causal: bool = True, dtype: str = dtype) -> dict[str, Any]:
            return {"dtype": dtype, "B": batch, "N": n, "H": h, "H_k": h, "D": d, "causal": causal}

        wb = sizes.window_batch
        cases.append(VariantCase("window", "causal", **shape(sizes.headline_n, wb)))
        cases += [
            VariantCase("window", "window", **shape(n, wb), window=sizes.window) for n in [sizes.headline_n, *others]
        ]
        for n in sizes.feature_n:
            b = max(1, sizes.total_tokens // n)
            cases += [VariantCase("features", f, **(shape(n, b) | options[f])) for f in FEATURES]
        n = sizes.mask_n
        b = max(1, sizes.total_tokens // n)
        for kind in ("bool", "additive"):
            for mask_batch in dict.fromkeys((b, 1)):
                cases.append(VariantCase("mask", kind, **shape(n, b, causal=False), mask=kind, mask_batch=mask_batch))
        cases += [VariantCase("window", "causal", **shape(n, wb)) for n in others]
    return cases


def _variant_row(provider: str, case: VariantCase, pass_: str) -> dict[str, Any]:
    """A variants row, every field present; ``error`` stays None when the row was measured."""
    return {
        "provider": provider,
        **asdict(case),
        "label": case.label,
        "pass": pass_,
        "pairs": case.pairs,
        "reference": None,
        "ms": None,
        "tflops": None,
        "max_abs_diff": None,
        "flagged": False,
        "error": None,
        "note": None,
    }


def _speed_row(provider: str, case: Case, pass_: str) -> dict[str, Any]:
    """A speed row, every field present; ``error`` stays None when the row was measured."""
    return {
        "provider": provider,
        **asdict(case),
        "pass": pass_,
        "ms": None,
        "tflops": None,
        "max_abs_diff": None,
        "flagged": False,
        "error": None,
    }


def _describe(exc: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    """One line: the exception type and message, then the warnings that explain it (SDPA's)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:REASON_CHARS]
    notes = list(
        dict.fromkeys(" ".join(str(w.message).split())[:200] for w in caught if issubclass(w.category, UserWarning))
    )
    return text + (f" [warnings: {' | '.join(notes[:3])}]" if notes else "")


def _cuda_broken() -> bool:
    """True if the CUDA context no longer works (e.g. after an illegal memory access)."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() != 2.0
    except RuntimeError:
        return True


def _max_abs_diff(got: Sequence[Tensor], want: Sequence[Tensor]) -> float:
    """Max over the pairs of max |got - want|, computed in fp32; NaN if any value is not finite."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        diff = (g.float() - w.float()).abs().max().item()
        if not math.isfinite(diff):
            return math.nan
        worst = max(worst, diff)
    return worst


# ---------------------------------------------------------------- the run


class Run:
    """Collects the header and rows, writes the JSON after every shape, remembers fatal errors."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.json_path: Path = args.out / "attention.json"
        self.header = _header(args)
        self.rows: list[dict[str, Any]] = []
        self.memory: list[dict[str, Any]] = []
        self.variants: list[dict[str, Any]] = []
        self.fatal: str | None = None
        self.peers_until = math.inf if args.budget_s is None else time.perf_counter() + args.budget_s

    def save(self) -> None:
        """Rewrite the JSON (atomically, so an interrupted run leaves a readable file)."""
        data = {"header": self.header, "rows": self.rows, "memory": self.memory, "variants": self.variants}
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.json_path)

    def _bench(self, fn: Callable[[], Any], grad_to_none: list[Tensor] | None = None) -> float:
        """Median milliseconds of ``fn``: do_bench on the GPU, a wall clock over DRY_RUN_REPS calls on the CPU."""
        if self.device.type == "cpu":
            times = []
            for _ in range(DRY_RUN_REPS):
                for x in grad_to_none or ():
                    x.grad = None
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
            return sorted(times)[len(times) // 2]
        ms = do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, grad_to_none=grad_to_none, return_mode="median")
        return float(ms)

    def _after_failure(self, where: str, reason: str) -> None:
        """After a failure, stop running anything if the CUDA context went down with it."""
        if self.device.type == "cuda" and _cuda_broken():
            self.fatal = f"not run: the CUDA context broke when {where} failed: {reason}"

    def _budget_spent(self) -> bool:
        return time.perf_counter() > self.peers_until

    # ------------------------------------------------------------ speed

    def speed_case(self, case: Case, providers: Sequence[Provider]) -> None:
        """Check and time every provider on one shape, fwd and bwd."""
        torch.manual_seed(0)
        q, k, v, dout = case.inputs()
        reference = self._reference(case, q, k, v, dout)
        for provider in providers:
            fwd_row, bwd_row = _speed_row(provider.name, case, "fwd"), _speed_row(provider.name, case, "bwd")
            self.rows += [fwd_row, bwd_row]
            if self.fatal:
                fwd_row["error"] = bwd_row["error"] = self.fatal
                continue
            self._measure(
                functools.partial(provider.build, q, k, v, case.causal),
                case.flops,
                [q, k, v],
                dout,
                reference,
                TOLERANCE[case.dtype],
                fwd_row,
                bwd_row,
                f"{provider.name} on {case}",
            )
            for x in (q, k, v):
                x.grad = None
            torch.cuda.empty_cache()

    def _reference(
        self, case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        """sdpa_flash's output and (dq, dk, dv) on these inputs; None if it fails (its own rows say why)."""
        if self.fatal:
            return None
        try:
            out = PROVIDERS[REFERENCE].build(q, k, v, case.causal)()
            out.backward(dout)
            return out.detach(), (q.grad, k.grad, v.grad)
        except Exception:
            return None
        finally:
            for x in (q, k, v):
                x.grad = None

    def _measure(
        self,
        build: Callable[[], Forward],
        flops: Callable[[str], float],
        leaves: Sequence[Tensor],
        dout: Tensor,
        reference: tuple[Tensor, tuple[Tensor, ...] | None] | None,
        tol: float,
        fwd_row: dict[str, Any],
        bwd_row: dict[str, Any],
        where: str,
    ) -> Forward | None:
        """Fill the fwd and bwd rows of one provider on one shape; the forward it built, None if it failed.

        ``leaves``: the inputs that get gradients, q, k, v first (compared with the reference's, when it
        has gradients); the backward's timing sets all of them to None outside the timed region.
        """
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # SDPA says in warnings why a backend cannot run
                forward = build()
                out = forward()  # compiles or JITs where the provider does
            if reference is not None:
                diff = _max_abs_diff([out], [reference[0]])
                fwd_row["max_abs_diff"] = diff if math.isfinite(diff) else None
                fwd_row["flagged"] = not diff <= tol
            ms = self._bench(forward)
            fwd_row.update(ms=ms, tflops=flops("fwd") / ms * 1e-9)
        except Unsupported as exc:
            fwd_row["error"] = bwd_row["error"] = f"unsupported: {exc}"
            return None
        except Exception as exc:
            fwd_row["error"] = _describe(exc, caught)
            bwd_row["error"] = FORWARD_FAILED
            self._after_failure(where, fwd_row["error"])
            return None
        try:
            out.backward(dout, retain_graph=True)
            if reference is not None and reference[1] is not None:
                grads = [x.grad for x in leaves[:3]]
                diff = _max_abs_diff(grads, reference[1])
                scale = max(1.0, max(g.abs().max().item() for g in reference[1]))
                bwd_row["max_abs_diff"] = diff if math.isfinite(diff) else None
                bwd_row["flagged"] = not diff <= tol * scale
            ms = self._bench(lambda: out.backward(dout, retain_graph=True), grad_to_none=list(leaves))
            bwd_row.update(ms=ms, tflops=flops("bwd") / ms * 1e-9)
        except Exception as exc:
            bwd_row["error"] = _describe(exc)
            self._after_failure(where, bwd_row["error"])
        return forward

    # ------------------------------------------------------------ variants

    def variant_case(self, case: VariantCase, providers: Sequence[Provider]) -> None:
        """Check and time every provider that has the case's features, fwd and bwd.

        After the time budget only flashtile runs; the peers' rows record why they are empty.
        """
        t = case.inputs(self.device)
        forwards: dict[str, Forward] = {}
        reference_name, reference = self._variant_reference(case, t, providers, forwards)
        for provider in providers:
            fwd_row, bwd_row = _variant_row(provider.name, case, "fwd"), _variant_row(provider.name, case, "bwd")
            fwd_row["reference"] = bwd_row["reference"] = reference_name
            self.variants += [fwd_row, bwd_row]
            if self.fatal:
                fwd_row["error"] = bwd_row["error"] = self.fatal
                continue
            if provider.name != OURS and self._budget_spent():
                fwd_row["error"] = bwd_row["error"] = (
                    f"not run: the time budget (--budget-s {self.args.budget_s:g}) was spent; "
                    "only flashtile ran after it"
                )
                continue
            built = forwards.get(provider.name)
            forward = self._measure(
                (lambda built=built, provider=provider: built or provider.variant(case, t)),
                case.flops,
                t.leaves,
                t.dout,
                reference,
                TOLERANCE[case.dtype],
                fwd_row,
                bwd_row,
                f"{provider.name} on {case}",
            )
            if case.deterministic and provider.name == OURS and forward is not None and bwd_row["error"] is None:
                bwd_row["note"] = self._repeatable(forward, t)
            for x in t.leaves:
                x.grad = None
            torch.cuda.empty_cache()

    def _variant_reference(
        self, case: VariantCase, t: VariantInputs, providers: Sequence[Provider], forwards: dict[str, Forward]
    ) -> tuple[str | None, tuple[Tensor, tuple[Tensor, ...] | None] | None]:
        """(name, (output, (dq, dk, dv) or None)) of the first VARIANT_REFERENCES provider that computes this
        case and runs; (None, None) with dropout (random), when none can, or after the budget. The forward
        it built is kept in ``forwards`` so the timed run reuses it (FlexAttention compiles once)."""
        if self.fatal or case.dropout_p or self._budget_spent():
            return None, None
        asked = {p.name for p in providers}
        for name in (n for n in VARIANT_REFERENCES if n in asked):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    forward = PROVIDERS[name].variant(case, t)
                    out = forward()
            except Exception:
                continue  # Unsupported, or a failure its own rows will record
            forwards[name] = forward
            try:
                out.backward(t.dout)
                grads: tuple[Tensor, ...] | None = (t.q.grad, t.k.grad, t.v.grad)
            except Exception:
                grads = None  # e.g. FlexAttention on the CPU: forward only
            finally:
                for x in t.leaves:
                    x.grad = None
            return name, (out.detach(), grads)
        return None, None

    @staticmethod
    def _repeatable(forward: Forward, t: VariantInputs) -> str:
        """Whether two backward passes of one forward give bitwise equal gradients."""
        out = forward()
        first = torch.autograd.grad(out, t.leaves, t.dout, retain_graph=True)
        second = torch.autograd.grad(out, t.leaves, t.dout)
        same = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        return "backward bitwise repeatable over 2 runs: " + ("yes" if same else "NO")

    # ------------------------------------------------------------ memory

    def memory_case(self, case: Case, provider: Provider) -> None:
        """Peak extra memory of one forward+backward (after a warm-up call), in MiB."""
        row: dict[str, Any] = {
            "provider": provider.name,
            **asdict(case),
            "peak_extra_mib": None,
            "error": None,
        }
        self.memory.append(row)
        if self.fatal:
            row["error"] = self.fatal
            return
        try:
            torch.manual_seed(0)
            q, k, v, dout = case.inputs()
            forward = provider.build(q, k, v, case.causal)
            forward().backward(dout)  # warm-up: compilation, workspaces, library handles
            grad_bytes = sum(x.grad.numel() * x.grad.element_size() for x in (q, k, v))
            for x in (q, k, v):
                x.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            forward().backward(dout)
            torch.cuda.synchronize()
            row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - before - grad_bytes) / MIB
        except Exception as exc:
            row["error"] = _describe(exc)
            self._after_failure(f"{provider.name} on {case}", row["error"])
        finally:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- header and command line


def _git_commit() -> str | None:
    """HEAD of the repository holding this file, '+dirty' if it has changes; None without git."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def _driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi (a read-only query); None where it is absent."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def _version(distribution: str) -> str | None:
    """An installed distribution's version, None if it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cudnn_version() -> str | None:
    """'9.19.0' from torch's integer 91900."""
    v = torch.backends.cudnn.version()
    return None if v is None else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def _header(args: argparse.Namespace) -> dict[str, Any]:
    """Provenance: GPU, versions, commit, date, command, and how the numbers were taken."""
    if args.dry_run:
        device: dict[str, Any] = {"gpu": "none: --dry-run on the CPU, times mean nothing", "sm_count": None}
        device |= {"capability": None, "driver": None}
    else:
        props = torch.cuda.get_device_properties(0)
        device = {
            "gpu": torch.cuda.get_device_name(0),
            "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "driver": _driver_version(),
        }
    notes = {
        "timing": f"triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms, "
        "L2 flushed); fwd with inputs requiring grad; bwd = out.backward(dout, retain_graph=True) "
        "alone, grads set to None outside the timed region",
        "flops": "fwd 4·B·H·N²·D, halved when causal; bwd 2.5 × fwd",
        "accuracy": f"max abs diff vs {REFERENCE} on the same inputs; flagged above "
        + ", ".join(f"{k} {v}" for k, v in TOLERANCE.items())
        + " (gradients: tolerance × max(1, max |ref grad|))",
        "memory": "peak allocated during one fwd+bwd minus memory held before it, "
        "q, k, v, dout and their grads counted as held before",
    }
    if args.shapes == "variants":
        notes["flops"] = (
            "variants: only visible (query, key) pairs count: fwd 4·B·H·D·pairs, bwd 2.5 × fwd; "
            "pairs per (batch, head) N(N+1)/2 for full causal, each query's band for a window, N² with an attn_mask"
        )
        notes["accuracy"] = (
            f"variants: max abs diff vs the first of {', '.join(VARIANT_REFERENCES)} that computes the same "
            "case (column reference; none for dropout and sinks); flagged above "
            + ", ".join(f"{k} {v}" for k, v in TOLERANCE.items())
            + " (gradients: tolerance × max(1, max |ref grad|))"
        )
        notes["budget"] = (
            f"peers run until {args.budget_s:g} s into the run (--budget-s), flashtile always"
            if args.budget_s is not None
            else "no time budget"
        )
        del notes["memory"]
    if args.dry_run:
        notes["timing"] = f"dry run: wall clock, median of {DRY_RUN_REPS} calls on the CPU, tiny shapes"
    return {
        **device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "cudnn": _cudnn_version(),
        "flash_attn_4": _version("flash-attn-4"),
        "python": platform.python_version(),
        "commit": args.commit or _git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "total_tokens": TOTAL_TOKENS,
        "hidden": HIDDEN,
        "shapes": args.shapes,
        "dry_run": args.dry_run,
        "notes": notes,
        "providers": {p: PROVIDERS[p].description for p in args.providers},
    }


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type for a comma-separated subset of ``allowed``, in the order given."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(allowed)}; got {text!r}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--help`` works without a GPU."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for attention.{json,md,png}")
    parser.add_argument("--quick", action="store_true", help=f"D in {QUICK_D}, N in {QUICK_N} only")
    parser.add_argument(
        "--shapes",
        choices=("standard", "memory", "all", "variants"),
        default="standard",
        help="all = standard + memory; variants: windows, features and masks (issue 4), on its own",
    )
    parser.add_argument(
        "--providers",
        type=_choices(list(PROVIDERS)),
        default=list(PROVIDERS),
        help=f"comma-separated, default all: {','.join(PROVIDERS)}",
    )
    parser.add_argument("--dtypes", type=_choices(list(DTYPES)), default=["bf16"], help="bf16 (default), fp16")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: git rev-parse HEAD)")
    parser.add_argument(
        "--warmup", type=int, default=None, help=f"do_bench warm-up, ms (default 25; variants {VARIANT_WARMUP_MS})"
    )
    parser.add_argument(
        "--rep", type=int, default=None, help=f"do_bench repetition time, ms (default 100; variants {VARIANT_REP_MS})"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds after which only flashtile rows still run (default: variants {VARIANT_BUDGET_S:g}, else none)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="variants only: the same cases at tiny sizes on the CPU, to check the plumbing (times mean nothing)",
    )
    args = parser.parse_args(argv)
    if args.dry_run and args.shapes != "variants":
        parser.error("--dry-run covers --shapes variants only")
    variants = args.shapes == "variants"
    if args.warmup is None:
        args.warmup = VARIANT_WARMUP_MS if variants else 25
    if args.rep is None:
        args.rep = VARIANT_REP_MS if variants else 100
    if args.budget_s is None and variants:
        args.budget_s = VARIANT_BUDGET_S
    return args


def _speed_cases(args: argparse.Namespace) -> list[Case]:
    """The standard (or ``--quick``) shapes, for every requested dtype, causal and not."""
    dims, lengths = (QUICK_D, QUICK_N) if args.quick else (STANDARD_D, STANDARD_N)
    return [
        Case.standard(dtype, d, n, causal)
        for dtype in args.dtypes
        for d in dims
        for n in lengths
        for causal in (False, True)
    ]


def _summary(rows: Sequence[dict[str, Any]]) -> str:
    """'flashtile 512/430 | sdpa_flash 300/250 | ...': fwd/bwd TFLOP/s, '-' where missing."""
    cells: dict[str, list[str]] = {}
    for row in rows:
        cells.setdefault(row["provider"], []).append("-" if row["tflops"] is None else f"{row['tflops']:.0f}")
    return " | ".join(f"{p} {'/'.join(v)}" for p, v in cells.items())


def _ms_summary(rows: Sequence[dict[str, Any]]) -> str:
    """'flashtile 0.412/1.31 ms | sdpa_flash -/- | ...': fwd/bwd milliseconds, '-' where missing."""
    cells: dict[str, list[str]] = {}
    for row in rows:
        cells.setdefault(row["provider"], []).append("-" if row["ms"] is None else f"{row['ms']:.3g}")
    return " | ".join(f"{p} {'/'.join(v)}" for p, v in cells.items()) + " ms"


def _memory_summary(rows: Sequence[dict[str, Any]]) -> str:
    """'flashtile 70 MiB, sdpa_flash 72 MiB', '-' where missing."""
    return ", ".join(
        f"{r['provider']} " + ("-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f} MiB") for r in rows
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run the requested shapes, write attention.{json,md,png}, print the markdown."""
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(
            "bench_attention.py needs a CUDA GPU (or --shapes variants --dry-run); "
            "`python benchmarks/report.py FILE.json` runs on a CPU."
        )
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run = Run(args)
    providers = [PROVIDERS[p] for p in args.providers]

    if args.shapes == "variants":
        cases = _variant_cases(args.dtypes, DRY_RUN_SIZES if args.dry_run else VARIANT_SIZES)
        for i, case in enumerate(cases, 1):
            first = len(run.variants)
            run.variant_case(case, [PROVIDERS[n] for n in SECTION_PROVIDERS[case.section] if n in args.providers])
            run.save()
            elapsed = time.perf_counter() - start
            print(f"[{i}/{len(cases)} {elapsed:6.0f}s] {case}: {_ms_summary(run.variants[first:])}", flush=True)

    if args.shapes in ("standard", "all"):
        cases = _speed_cases(args)
        for i, case in enumerate(cases, 1):
            first = len(run.rows)
            run.speed_case(case, providers)
            run.save()
            elapsed = time.perf_counter() - start
            print(f"[{i}/{len(cases)} {elapsed:6.0f}s] {case}: {_summary(run.rows[first:])}", flush=True)

    if args.shapes in ("memory", "all"):
        for dtype in args.dtypes:
            for n in MEMORY_N:
                case = Case(dtype, MEMORY_B, n, MEMORY_H, MEMORY_D, causal=True)
                first = len(run.memory)
                for provider in (p for p in providers if p.name in MEMORY_PROVIDERS):
                    run.memory_case(case, provider)
                run.save()
                elapsed = time.perf_counter() - start
                print(f"[memory {elapsed:6.0f}s] {case}: {_memory_summary(run.memory[first:])}", flush=True)

    md_path, png_path = write_reports(run.json_path)
    written = ", ".join(str(p) for p in (run.json_path, md_path, png_path) if p)
    print(f"\nwrote {written} in {time.perf_counter() - start:.0f} s\n", flush=True)
    result = load(run.json_path)
    print(markdown(result, provenance=False), flush=True)  # provenance: in the files
    if run.variants:
        print("\n".join(variant_summary(result)), flush=True)
    if run.fatal:
        sys.exit(run.fatal)


if __name__ == "__main__":
    main()
