"""flashtile against its peers on one GPU: same inputs, same process, forward and backward.

    flashtile bench --out DIR [--quick] [--shapes standard|memory|all|variants] [--providers flashtile,cudnn,...]
        [--dtypes bf16,fp16] [--commit SHA] [--ncu] [--dry-run]

(also ``python -m flashtile.bench.attention``). Writes ``DIR/attention.jsonl`` (the records of
``flashtile.bench.results``, rewritten after every shape, so a stopped run keeps what it measured),
``DIR/attention.md`` (the tables) and a PNG plot per dtype (``flashtile.bench.plot``), and prints the tables.

Shapes, the convention of the field: total tokens B·N = 16384 and hidden H·D = 2048, N in {512, ..., 16384},
D in {64, 128, 256}, causal and not; ``--quick`` keeps D in {64, 128} and N in {1024, 4096, 16384}. q, k, v and
dout are drawn once per shape from N(0, 1) in layout (B, N, H, D); implementations that want (B, H, N, D) get
transposed views of the same tensors, so every implementation reads the same memory.

Peers: ``sdpa_flash`` (PyTorch's SDPA restricted to its FlashAttention-2 backend), ``cudnn`` and
``sdpa_efficient`` (SDPA's cuDNN and memory-efficient backends), ``flex`` (``torch.compile(flex_attention)``,
causal by a block mask) and ``fa4`` (FlashAttention-4, ``flash_attn.cute``, where installed). One that cannot
run a shape (not installed, unsupported, out of memory) is recorded with the reason; nothing is dropped.

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call), median.
- fwd: one forward with the inputs requiring grad (as in training, so the softmax statistics are kept);
- bwd: the backward alone, ``out.backward(dout, retain_graph=True)`` on a graph built once, gradients set to
  None outside the timed region.
FLOPs: fwd 4·B·H·N²·D, halved when causal; bwd 2.5 × fwd (``flashtile.iomodel``).
IO: flashtile's records carry the HBM bytes it moves per pass in ``extra`` (``hbm_bytes``, ``bytes_source``: 'model'
from ``flashtile.iomodel`` for the kernels that ran, or 'ncu' with ``--ncu``: Nsight Compute's DRAM counters) beside
standard attention's (``standard_bytes``, the model with S and P in HBM), and ``tbps`` from them; a table shows both.

Accuracy spot check before timing each shape, against ``sdpa_flash`` on the same inputs: the max abs
difference of the output (fwd) or of dq, dk, dv (bwd); a record is flagged above the dtype's tolerance
(bf16 0.05, fp16 0.01; for gradients times max(1, max |reference|)).

``--shapes memory``: B=1, H=16, D=128, causal, N in {2k, 8k, 32k}, flashtile and sdpa_flash: the peak memory
allocated during one forward+backward beyond what was held before it (inputs, dout and gradients), MiB.

``--shapes variants`` (not part of ``all``), bf16, D=128, H=16, times in ms:
- window: full causal against ``window_size=(1024, 0)`` at N in {4k, 8k, 16k, 32k}, B=1; the windowed time
  should follow the window, not N;
- features: causal at N=4k (B=4) and 16k (B=1): baseline, softcap=30, alibi_slopes, learnable_sink,
  dropout_p=0.1, deterministic=True, GQA with H_k = H/4;
- mask: ``flashtile.scaled_dot_product_attention`` with a boolean or additive ``attn_mask`` of shape
  (B, 1, N, N) or (1, 1, N, N), N=4k, B=4, against SDPA's efficient and cuDNN backends with the same mask.
Peers run where they have the feature. FLOPs count only visible (query, key) pairs. The spot check compares
with the first of sdpa_flash, flex, sdpa_efficient that computes the same thing (none for dropout and sinks);
the deterministic row also checks that two backward passes are bitwise equal. ``--budget-s`` (default 200 s
for variants): once spent, only flashtile still runs.

``--dry-run`` runs the same cases at tiny sizes on the CPU (flashtile's CPU path, SDPA's CPU kernels,
FlexAttention eagerly and forward only): it checks the set-up and the reports; its times mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import iomodel
from flashtile.bench import hbm, plot, results
from flashtile.bench.results import OURS, Record

TOTAL_TOKENS = 16384
HIDDEN = 2048
MEMORY_N = (2048, 8192, 32768)
MEMORY_B, MEMORY_H, MEMORY_D = 1, 16, 128
MEMORY_PROVIDERS = ("flashtile", "sdpa_flash")
REFERENCE = "sdpa_flash"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"bf16": 0.05, "fp16": 0.01}
MIB = 1 << 20
REASON_CHARS = 400
FORWARD_FAILED = "not run: the forward failed"
"""The error of a bwd record whose fwd failed; the fwd record carries the reason."""
EXTRA = "bench"
"""The optional dependencies ``flashtile bench`` needs for its plot: ``pip install 'flashtile[bench]'``."""

Forward = Callable[[], Tensor]
"""An implementation's forward on fixed inputs, returning the output in layout (B, N, H, D)."""
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


class _NoBackward(torch.autograd.Function):
    """Passes a forward-only result through and raises if a backward reaches it."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, anchor: Tensor) -> Tensor:
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        raise NotImplementedError("FlexAttention has no backward on the CPU (the dry run checks its forward only)")


def _flex_forward(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Forward:
    """FlexAttention on (B, H, N, D) views of (B, N, H, D) inputs: compiled on a GPU; eager and forward only on
    the CPU, where FlexAttention has no backward."""
    from torch.nn.attention.flex_attention import flex_attention

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if q.device.type == "cpu":
        qd, kd, vd = (x.detach() for x in (qt, kt, vt))
        return lambda: _NoBackward.apply(flex_attention(qd, kd, vd, **options), q).transpose(1, 2)
    flex = _compiled_flex_attention()
    return lambda: flex(qt, kt, vt, **options).transpose(1, 2)


def _build_flex(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Forward:
    block_mask = _causal_block_mask(q.shape[1], q.device) if causal else None
    return _flex_forward(q, k, v, block_mask=block_mask)


def _build_fa4(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Forward:
    from flash_attn.cute import flash_attn_func

    def forward() -> Tensor:
        result = flash_attn_func(q, k, v, causal=causal)
        return result[0] if isinstance(result, tuple) else result

    return forward


# ---------------------------------------------------------------- providers for the variants


class Unsupported(Exception):
    """The provider has no such feature: its records carry the reason and nothing runs."""


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
    "deterministic": "no deterministic= switch (timed for flashtile only)",
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


def _variant_flex(case: VariantCase, t: VariantInputs) -> Forward:
    """FlexAttention: a block mask for causal and windows, a score_mod for softcap and ALiBi, enable_gqa."""
    _refuse(case, "FlexAttention", {"window", "softcap", "alibi", "gqa"})
    device = t.q.device
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
    return _flex_forward(t.q, t.k, t.v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


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
    build: Builder
    variant: VariantBuilder
    """The same implementation for ``--shapes variants``."""


_SDPA_FEATURES = {"dropout", "gqa", "mask"}
PROVIDERS = {
    p.name: p
    for p in (
        Provider("flashtile", _build_flashtile, _variant_flashtile),
        Provider(
            "sdpa_flash",
            _sdpa_builder(SDPBackend.FLASH_ATTENTION),
            _sdpa_variant(SDPBackend.FLASH_ATTENTION, "SDPA's flash backend (FA2)", {"dropout", "gqa"}),
        ),
        Provider(
            "cudnn",
            _sdpa_builder(SDPBackend.CUDNN_ATTENTION),
            _sdpa_variant(SDPBackend.CUDNN_ATTENTION, "SDPA's cuDNN backend", _SDPA_FEATURES),
        ),
        Provider(
            "sdpa_efficient",
            _sdpa_builder(SDPBackend.EFFICIENT_ATTENTION),
            _sdpa_variant(SDPBackend.EFFICIENT_ATTENTION, "SDPA's efficient backend", _SDPA_FEATURES),
        ),
        Provider("flex", _build_flex, _variant_flex),
        Provider("fa4", _build_fa4, _variant_fa4),
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


# ---------------------------------------------------------------- shapes


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
    def standard(cls, dtype: str, d: int, n: int, causal: bool, total_tokens: int = TOTAL_TOKENS) -> Case:
        """B·N = ``total_tokens`` and H·D = HIDDEN (at most: H is at least 1)."""
        return cls(dtype, max(1, total_tokens // n), n, max(1, HIDDEN // d), d, causal)

    def flops(self, pass_: str) -> float:
        """4·B·H·N²·D for the forward, halved when causal; 2.5 × that for the backward
        (``flashtile.iomodel.convention_flops``)."""
        return iomodel.convention_flops(self.B, self.H, self.N, self.D, self.causal, pass_)

    def __str__(self) -> str:
        """'bf16 D=128 N=4096 B=4 H=16 causal'."""
        return f"{self.dtype} D={self.D} N={self.N} B={self.B} H={self.H}{' causal' if self.causal else ''}"

    def inputs(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Fresh q, k, v (leaves requiring grad) and dout, all (B, N, H, D), from N(0, 1)."""
        shape, dtype = (self.B, self.N, self.H, self.D), DTYPES[self.dtype]
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        return q, k, v, torch.randn(shape, device=device, dtype=dtype)


@dataclass(frozen=True)
class StandardSizes:
    """The lengths and head dims of the standard table (B·N = total_tokens, H·D = HIDDEN)."""

    lengths: tuple[int, ...]
    head_dims: tuple[int, ...]
    total_tokens: int = TOTAL_TOKENS


STANDARD = StandardSizes((512, 1024, 2048, 4096, 8192, 16384), (64, 128, 256))
QUICK = StandardSizes((1024, 4096, 16384), (64, 128))
DRY_RUN_STANDARD = StandardSizes((64, 128), (64, 128), total_tokens=256)


@dataclass(frozen=True)
class VariantSizes:
    """The shapes of ``--shapes variants``; ``--dry-run`` swaps in tiny ones for the CPU."""

    head_dim: int
    nheads: int
    window: tuple[int, int]
    """flash_attn's window_size of the windowed rows (with causal=True)."""
    headline_n: int
    """The sequence length of the main comparison (window against full causal), run first."""
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
DRY_RUN_VARIANTS = VariantSizes(
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
        left, right = (None if w < 0 else w for w in self.window) if self.window is not None else (None, None)
        if self.causal:
            right = 0 if right is None else min(right, 0)
        return iomodel.visible_pairs(self.N, self.N, left, right)

    def flops(self, pass_: str) -> float:
        """4·B·H·D·pairs forward, 2.5 × that backward: only visible pairs count (``flashtile.iomodel``)."""
        return iomodel.attention_flops(self.B * self.pairs, self.H, self.D, pass_=pass_)

    def __str__(self) -> str:
        """'features softcap=30 bf16 D=128 N=4096 B=4 H=16'."""
        return f"{self.section} {self.label} {self.dtype} D={self.D} N={self.N} B={self.B} H={self.H}"

    def shape(self) -> dict[str, Any]:
        """The record's shape: dtype, B, N, H, H_k, D, causal."""
        return {"dtype": self.dtype, "B": self.B, "N": self.N, "H": self.H, "H_k": self.H_k, "D": self.D,
                "causal": self.causal}  # fmt: skip

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


def variant_cases(dtypes: Sequence[str], sizes: VariantSizes) -> list[VariantCase]:
    """Every variants case, most important first (after --budget-s only flashtile runs): window against full
    causal at the main length; the window at the other lengths; features; masks; full causal at the other
    lengths last (context for the window's flat cost, and the peers' causal rows cost compilations)."""
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


def speed_cases(dtypes: Sequence[str], sizes: StandardSizes) -> list[Case]:
    """The standard shapes for every dtype, causal and not."""
    return [
        Case.standard(dtype, d, n, causal, sizes.total_tokens)
        for dtype in dtypes
        for d in sizes.head_dims
        for n in sizes.lengths
        for causal in (False, True)
    ]


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
    """Measures cases into records, rewrites the JSON-lines file after every case, remembers fatal errors."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.path: Path = args.out / "attention.jsonl"
        self.env = results.environment(self.device, args.commit)
        self.records: list[Record] = []
        self.fatal: str | None = None
        self.peers_until = math.inf if args.budget_s is None else time.perf_counter() + args.budget_s

    def save(self) -> None:
        """Rewrite the JSON-lines file with every record so far."""
        results.write(self.path, self.records)

    def _new(
        self, benchmark: str, provider: str, shape: dict[str, Any], pass_: str, config: dict[str, Any] | None = None
    ) -> Record:
        """A record without a measurement yet, appended to the run's records."""
        rec = results.record(self.env, benchmark, provider, shape, pass_, config=config)
        if self.device.type == "cpu":
            rec["extra"]["dry_run"] = True
        self.records.append(rec)
        return rec

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
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, grad_to_none=grad_to_none, return_mode="median")
        return float(ms)

    def _after_failure(self, where: str, reason: str) -> None:
        """After a failure, stop running anything if the CUDA context went down with it."""
        if self.device.type == "cuda" and _cuda_broken():
            self.fatal = f"not run: the CUDA context broke when {where} failed: {reason}"

    def _budget_spent(self) -> bool:
        return time.perf_counter() > self.peers_until

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------ speed

    def speed_case(self, case: Case, providers: Sequence[Provider]) -> list[Record]:
        """Check and time every provider on one shape, fwd and bwd; the records added."""
        first = len(self.records)
        torch.manual_seed(0)
        q, k, v, dout = case.inputs(self.device)
        reference = self._reference(case, q, k, v, dout)
        for provider in providers:
            shape = asdict(case)
            fwd, bwd = (self._new("attention", provider.name, shape, p) for p in ("fwd", "bwd"))
            if self.fatal:
                fwd["error"] = bwd["error"] = self.fatal
                continue
            self._measure(
                functools.partial(provider.build, q, k, v, case.causal), case.flops, [q, k, v], dout, reference,
                TOLERANCE[case.dtype], fwd, bwd, f"{provider.name} on {case}",
            )  # fmt: skip
            for x in (q, k, v):
                x.grad = None
            if provider.name == OURS and fwd["error"] is None:
                self._io(case, fwd, bwd)
            self._empty_cache()
        return self.records[first:]

    def _io(self, case: Case, fwd: Record, bwd: Record) -> None:
        """Add to flashtile's records the HBM bytes it moves (``flashtile.bench.hbm``: the model, or Nsight Compute
        with --ncu) and standard attention's (the model), in ``extra``, and the bandwidth (``tbps``)."""
        problem = hbm.Problem(case.B, case.N, case.H, case.D, case.causal, case.dtype)
        try:
            model = hbm.model_bytes(problem, self.device)
        except Exception as exc:  # the timing stands; the reason goes with it
            fwd["extra"]["io_error"] = bwd["extra"]["io_error"] = _describe(exc)
            return
        for rec in (fwd, bwd):
            found = model[rec["pass"]]
            moved, source = found["hbm_bytes"], "model"
            if self.args.ncu:
                try:
                    moved, source = hbm.ncu_bytes(problem, OURS, rec["pass"]), "ncu"
                except hbm.NcuUnavailable as exc:
                    rec["extra"]["io_error"] = str(exc)[:REASON_CHARS]
            rec["extra"].update(hbm_bytes=moved, bytes_source=source, standard_bytes=found["standard_bytes"],
                                path=found["path"])  # fmt: skip
            if rec["time_ms"]:
                rec["tbps"] = moved / rec["time_ms"] * 1e-9

    def _reference(
        self, case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        """sdpa_flash's output and (dq, dk, dv) on these inputs; None if it fails (its own records say why)."""
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
        fwd: Record,
        bwd: Record,
        where: str,
    ) -> Forward | None:
        """Fill the fwd and bwd records of one provider on one shape; the forward it built, None if it failed.

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
                fwd["extra"].update(max_abs_diff=diff if math.isfinite(diff) else None, flagged=not diff <= tol)
            ms = self._bench(forward)
            fwd.update(time_ms=ms, tflops=flops("fwd") / ms * 1e-9)
        except Unsupported as exc:
            fwd["error"] = bwd["error"] = f"unsupported: {exc}"
            return None
        except Exception as exc:
            fwd["error"] = _describe(exc, caught)
            bwd["error"] = FORWARD_FAILED
            self._after_failure(where, fwd["error"])
            return None
        try:
            out.backward(dout, retain_graph=True)
            if reference is not None and reference[1] is not None:
                diff = _max_abs_diff([x.grad for x in leaves[:3]], reference[1])
                scale = max(1.0, max(g.abs().max().item() for g in reference[1]))
                bwd["extra"].update(max_abs_diff=diff if math.isfinite(diff) else None, flagged=not diff <= tol * scale)
            ms = self._bench(lambda: out.backward(dout, retain_graph=True), grad_to_none=list(leaves))
            bwd.update(time_ms=ms, tflops=flops("bwd") / ms * 1e-9)
        except Exception as exc:
            bwd["error"] = _describe(exc)
            self._after_failure(where, bwd["error"])
        return forward

    # ------------------------------------------------------------ variants

    def variant_case(self, case: VariantCase, providers: Sequence[Provider]) -> list[Record]:
        """Check and time every provider that has the case's features, fwd and bwd; the records added.

        After the time budget only flashtile runs; the peers' records say why they are empty.
        """
        first = len(self.records)
        t = case.inputs(self.device)
        forwards: dict[str, Forward] = {}
        reference_name, reference = self._variant_reference(case, t, providers, forwards)
        config = {"section": case.section, "variant": case.label}
        for provider in providers:
            fwd, bwd = (self._new("attention-variants", provider.name, case.shape(), p, config) for p in ("fwd", "bwd"))
            for rec in (fwd, bwd):
                rec["extra"].update(pairs=case.pairs, reference=reference_name)
            if self.fatal:
                fwd["error"] = bwd["error"] = self.fatal
                continue
            if provider.name != OURS and self._budget_spent():
                fwd["error"] = bwd["error"] = (
                    f"not run: the time budget (--budget-s {self.args.budget_s:g}) was spent; "
                    "only flashtile ran after it"
                )
                continue
            built = forwards.get(provider.name)
            forward = self._measure(
                (lambda built=built, provider=provider: built or provider.variant(case, t)), case.flops, t.leaves,
                t.dout, reference, TOLERANCE[case.dtype], fwd, bwd, f"{provider.name} on {case}",
            )  # fmt: skip
            if case.deterministic and provider.name == OURS and forward is not None and bwd["error"] is None:
                bwd["extra"]["bitwise_repeatable"] = self._repeatable(forward, t)
            for x in t.leaves:
                x.grad = None
            self._empty_cache()
        return self.records[first:]

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
                continue  # Unsupported, or a failure its own records will carry
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
    def _repeatable(forward: Forward, t: VariantInputs) -> bool:
        """Whether two backward passes of one forward give bitwise equal gradients."""
        out = forward()
        first = torch.autograd.grad(out, t.leaves, t.dout, retain_graph=True)
        second = torch.autograd.grad(out, t.leaves, t.dout)
        return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    # ------------------------------------------------------------ memory

    def memory_case(self, case: Case, provider: Provider) -> list[Record]:
        """Peak extra memory of one forward+backward (after a warm-up call), in MiB; the record added."""
        rec = self._new("attention-memory", provider.name, asdict(case), "fwd+bwd")
        if self.fatal:
            rec["error"] = self.fatal
            return [rec]
        if self.device.type != "cuda":
            rec["error"] = "not measured: GPU memory only"
            return [rec]
        try:
            torch.manual_seed(0)
            q, k, v, dout = case.inputs(self.device)
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
            rec["memory_mib"] = (torch.cuda.max_memory_allocated() - before - grad_bytes) / MIB
        except Exception as exc:
            rec["error"] = _describe(exc)
            self._after_failure(f"{provider.name} on {case}", rec["error"])
        finally:
            self._empty_cache()
        return [rec]


# ---------------------------------------------------------------- reports


def tables(records: Sequence[Record]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table the records make: speed per dtype, memory, variants. Implementations
    without a single measurement in a table are left out of it (their reasons are listed by ``_errors``)."""
    dry_run = any(r["extra"].get("dry_run") for r in records)
    sections = [
        ("attention", ("D", "N", "causal", "pass"), "time_ms" if dry_run else "tflops"),
        ("attention-memory", ("dtype", "N"), "memory_mib"),
        ("attention-variants", ("section", "variant", "N", "pass"), "time_ms"),
    ]
    found = []
    for benchmark, keys, value in sections:
        chosen = [r for r in records if r["benchmark"] == benchmark]
        splits = dict.fromkeys(r["shape"]["dtype"] for r in chosen) if benchmark == "attention" else [None]
        for dtype in splits:
            rows = [r for r in chosen if dtype is None or r["shape"]["dtype"] == dtype]
            measured = list(dict.fromkeys(r["implementation"] for r in rows if r[value] is not None))
            if not measured:
                continue
            peers = [p for p in measured if p != OURS]
            digits = 3 if value == "time_ms" else 0
            header, body = results.table(rows, keys, value, measured, ratios_against=peers, digits=digits)
            found.append((TITLES[benchmark].format(dtype=dtype, unit=UNITS[value]), header, body))
    io_table = _io_table(records)
    return found if io_table is None else [*found, io_table]


def _io_table(records: Sequence[Record]) -> tuple[str, list[str], list[list[str]]] | None:
    """(title, header, rows) of the HBM bytes flashtile moves against standard attention's, per shape and pass, from
    flashtile's records (``Run._io``); None without any."""
    rows = [r for r in records if r["benchmark"] == "attention" and "hbm_bytes" in r["extra"]]
    if not rows:
        return None
    header = ["dtype", "D", "N", "causal", "pass", "flashtile MB", "source", "standard MB", "standard / flashtile"]
    body = []
    for rec in rows:
        s, x = rec["shape"], rec["extra"]
        body.append([s["dtype"], str(s["D"]), str(s["N"]), "yes" if s["causal"] else "no", rec["pass"],
                     f"{x['hbm_bytes'] / 1e6:.1f}", x["bytes_source"], f"{x['standard_bytes'] / 1e6:.1f}",
                     f"{x['standard_bytes'] / x['hbm_bytes']:.1f}×"])  # fmt: skip
    title = ("HBM bytes moved, flashtile (model: flashtile.iomodel; ncu: Nsight Compute's DRAM counters) against "
             "standard attention's (S and P in HBM, model)")  # fmt: skip
    return title, header, body


TITLES = {
    "attention": "{dtype}, {unit}, B·N = 16384, H·D = 2048 (a dry run: tiny sizes); vs X: flashtile's speed over X's",
    "attention-memory": f"Peak extra memory of forward+backward, {{unit}} (B={MEMORY_B}, H={MEMORY_H}, D={MEMORY_D}, "
    "causal); vs X: X's over flashtile's",
    "attention-variants": "Variants, {unit}, D=128, H=16 (a dry run: tiny sizes); vs X: X's time over flashtile's",
}
UNITS = {"tflops": "TFLOP/s", "time_ms": "ms", "memory_mib": "MiB"}


def _errors(records: Sequence[Record]) -> list[str]:
    """One line per distinct reason a record has no measurement, with how many records it covers."""
    reasons: dict[tuple[str, str], int] = {}
    for rec in records:
        if rec["error"] and rec["error"] != FORWARD_FAILED:
            key = (rec["implementation"], rec["error"])
            reasons[key] = reasons.get(key, 0) + 1
    return [f"- {results.label(impl)} ({count}×): {error}" for (impl, error), count in reasons.items()]


def markdown(records: Sequence[Record]) -> str:
    """The run's tables as markdown, with its provenance and the reasons for missing numbers."""
    lines = ["# Attention benchmark", "", results.provenance(records), ""]
    if any(r["extra"].get("dry_run") for r in records):
        lines += ["**Dry run on the CPU at tiny sizes: it checks the set-up; the times mean nothing.**", ""]
    for title, header, body in tables(records):
        lines += [title, "", results.markdown(header, body)]
    errors = _errors(records)
    if errors:
        lines += ["Missing numbers:", "", *errors, ""]
    return "\n".join(lines)


def print_tables(console: Console, records: Sequence[Record]) -> None:
    """The run's tables as rich tables."""
    for title, header, body in tables(records):
        table = Table(title=title, show_edge=False, pad_edge=False)
        for name in header:
            table.add_column(name, justify="left" if name in ("section", "variant", "pass") else "right")
        for row in body:
            table.add_row(*row)
        console.print(table)
    for line in _errors(records):
        console.print(line, markup=False, highlight=False)


# ---------------------------------------------------------------- command line


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type for a comma-separated subset of ``allowed``, in the order given."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(allowed)}; got {text!r}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The command line; ``--help`` works without a GPU."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for attention.jsonl, .md and the plots")
    parser.add_argument("--quick", action="store_true", help=f"D in {QUICK.head_dims}, N in {QUICK.lengths} only")
    parser.add_argument(
        "--shapes",
        choices=("standard", "memory", "all", "variants"),
        default="standard",
        help="all = standard + memory; variants: windows, features and masks, on its own",
    )
    parser.add_argument(
        "--providers",
        type=_choices(list(PROVIDERS)),
        default=list(PROVIDERS),
        help=f"comma-separated, default all: {','.join(PROVIDERS)}",
    )
    parser.add_argument("--dtypes", type=_choices(list(DTYPES)), default=["bf16"], help="bf16 (default), fp16")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: from git, if a checkout)")
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
        help=f"seconds after which only flashtile still runs (default: variants {VARIANT_BUDGET_S:g}, else none)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on the CPU, to check the set-up (times mean nothing)"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument(
        "--ncu",
        action="store_true",
        help="measure flashtile's HBM bytes with Nsight Compute (ncu on PATH; two child runs per shape) instead of "
        "the model",
    )
    args = parser.parse_args(argv)
    variants = args.shapes == "variants"
    if args.warmup is None:
        args.warmup = VARIANT_WARMUP_MS if variants else 25
    if args.rep is None:
        args.rep = VARIANT_REP_MS if variants else 100
    if args.budget_s is None and variants:
        args.budget_s = VARIANT_BUDGET_S
    return args


def _summary(records: Sequence[Record]) -> str:
    """'flashtile 512/430 | sdpa_flash 300/- | ...': TFLOP/s (or ms, or MiB) per provider and pass."""
    cells: dict[str, list[str]] = {}
    for rec in records:
        if rec["memory_mib"] is not None or rec["benchmark"] == "attention-memory":
            value = "-" if rec["memory_mib"] is None else f"{rec['memory_mib']:.0f} MiB"
        elif rec["benchmark"] == "attention-variants":
            value = "-" if rec["time_ms"] is None else f"{rec['time_ms']:.3g} ms"
        else:
            value = "-" if rec["tflops"] is None else f"{rec['tflops']:.0f}"
        cells.setdefault(rec["implementation"], []).append(value)
    return " | ".join(f"{p} {'/'.join(v)}" for p, v in cells.items())


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the requested shapes, write attention.{jsonl,md,png}, print the tables; the exit code."""
    args = parse_args(argv, prog)
    console = Console()
    if not args.no_plot and not plot.available():
        console.print(
            "The plot needs matplotlib, which is not installed: install the benchmark extra with "
            f"pip install 'flashtile[{EXTRA}]', or pass --no-plot.",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip
        return 1
    if not args.dry_run and not torch.cuda.is_available():
        console.print("The benchmark needs a CUDA GPU; --dry-run runs tiny sizes on the CPU to check the set-up.")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    providers = [PROVIDERS[p] for p in args.providers]

    work: list[tuple[str, Callable[[], list[Record]]]] = []
    if args.shapes == "variants":
        for case in variant_cases(args.dtypes, DRY_RUN_VARIANTS if args.dry_run else VARIANT_SIZES):
            section = [PROVIDERS[n] for n in SECTION_PROVIDERS[case.section] if n in args.providers]
            work.append((str(case), functools.partial(run.variant_case, case, section)))
    if args.shapes in ("standard", "all"):
        sizes = DRY_RUN_STANDARD if args.dry_run else (QUICK if args.quick else STANDARD)
        for case in speed_cases(args.dtypes, sizes):
            work.append((str(case), functools.partial(run.speed_case, case, providers)))
    if args.shapes in ("memory", "all"):
        lengths = DRY_RUN_STANDARD.lengths if args.dry_run else MEMORY_N
        for dtype in args.dtypes:
            for n in lengths:
                case = Case(dtype, MEMORY_B, n, MEMORY_H, MEMORY_D, causal=True)
                for provider in (p for p in providers if p.name in MEMORY_PROVIDERS):
                    work.append((f"memory {case} {provider.name}", functools.partial(run.memory_case, case, provider)))

    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("attention benchmark", total=len(work))
        for description, measure in work:
            progress.update(task, description=description)
            added = measure()
            run.save()
            progress.console.print(f"{description}: {_summary(added)}", markup=False, highlight=False)
            progress.advance(task)

    md_path = args.out / "attention.md"
    md_path.write_text(markdown(run.records))
    written = [run.path, md_path]
    if not args.no_plot:
        written += plot.plot_files(run.records, args.out)
    print_tables(console, run.records)
    elapsed = time.perf_counter() - start
    console.print(f"wrote {', '.join(str(p) for p in written)} in {elapsed:.0f} s", soft_wrap=True, highlight=False)
    if run.fatal:
        console.print(run.fatal, markup=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m flashtile.bench.attention"))
