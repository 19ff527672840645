"""Attention speed and memory: flashtile against its peers, same inputs, same process, one GPU.

    PYTHONPATH=src python3 benchmarks/bench_attention.py --out DIR [--quick] [--shapes standard|memory|all]
        [--providers flashtile,sdpa_flash,...] [--dtypes bf16,fp16] [--commit SHA]

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

Outputs in --out: ``attention.json`` (header + rows, rewritten after every shape so a killed
run keeps what it measured), ``attention.md`` and ``attention.png`` (from ``report.py``).
The markdown tables are printed last, without the provenance bullets (those are in the files).
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

from report import FORWARD_FAILED, load, markdown, write_reports

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


@dataclass(frozen=True)
class Provider:
    """An attention implementation under test."""

    name: str
    description: str
    build: Builder


PROVIDERS = {
    p.name: p
    for p in (
        Provider("flashtile", "flashtile.flash_attn_func, layout (B, N, H, D)", _build_flashtile),
        Provider(
            "sdpa_flash",
            "SDPA, SDPBackend.FLASH_ATTENTION (FlashAttention-2); the accuracy reference",
            _sdpa_builder(SDPBackend.FLASH_ATTENTION),
        ),
        Provider("cudnn", "SDPA, SDPBackend.CUDNN_ATTENTION", _sdpa_builder(SDPBackend.CUDNN_ATTENTION)),
        Provider(
            "sdpa_efficient",
            "SDPA, SDPBackend.EFFICIENT_ATTENTION",
            _sdpa_builder(SDPBackend.EFFICIENT_ATTENTION),
        ),
        Provider(
            "flex",
            "torch.compile(flex_attention, dynamic=False), causal via create_block_mask",
            _build_flex,
        ),
        Provider("fa4", "flash-attn-4, flash_attn.cute.flash_attn_func (CuTe DSL)", _build_fa4),
    )
}


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
        self.json_path: Path = args.out / "attention.json"
        self.header = _header(args)
        self.rows: list[dict[str, Any]] = []
        self.memory: list[dict[str, Any]] = []
        self.fatal: str | None = None

    def save(self) -> None:
        """Rewrite the JSON (atomically, so an interrupted run leaves a readable file)."""
        data = {"header": self.header, "rows": self.rows, "memory": self.memory}
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.json_path)

    def _bench(self, fn: Callable[[], Any], grad_to_none: list[Tensor] | None = None) -> float:
        """Median milliseconds of ``fn`` by do_bench."""
        ms = do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, grad_to_none=grad_to_none, return_mode="median")
        return float(ms)

    def _after_failure(self, provider: str, case: Case, reason: str) -> None:
        """After a failure, stop running anything if the CUDA context went down with it."""
        if _cuda_broken():
            self.fatal = f"not run: the CUDA context broke when {provider} failed on {case}: {reason}"

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
            self._measure(provider, case, (q, k, v, dout), reference, fwd_row, bwd_row)
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
        provider: Provider,
        case: Case,
        tensors: tuple[Tensor, Tensor, Tensor, Tensor],
        reference: tuple[Tensor, tuple[Tensor, ...]] | None,
        fwd_row: dict[str, Any],
        bwd_row: dict[str, Any],
    ) -> None:
        """Fill the fwd and bwd rows of one provider on one shape."""
        q, k, v, dout = tensors
        tol = TOLERANCE[case.dtype]
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # SDPA says in warnings why a backend cannot run
                forward = provider.build(q, k, v, case.causal)
                out = forward()  # compiles or JITs where the provider does
            if reference is not None:
                diff = _max_abs_diff([out], [reference[0]])
                fwd_row["max_abs_diff"] = diff if math.isfinite(diff) else None
                fwd_row["flagged"] = not diff <= tol
            ms = self._bench(forward)
            fwd_row.update(ms=ms, tflops=case.flops("fwd") / ms * 1e-9)
        except Exception as exc:
            fwd_row["error"] = _describe(exc, caught)
            bwd_row["error"] = FORWARD_FAILED
            self._after_failure(provider.name, case, fwd_row["error"])
            return
        try:
            out.backward(dout, retain_graph=True)
            if reference is not None:
                diff = _max_abs_diff([q.grad, k.grad, v.grad], reference[1])
                scale = max(1.0, max(g.abs().max().item() for g in reference[1]))
                bwd_row["max_abs_diff"] = diff if math.isfinite(diff) else None
                bwd_row["flagged"] = not diff <= tol * scale
            ms = self._bench(lambda: out.backward(dout, retain_graph=True), grad_to_none=[q, k, v])
            bwd_row.update(ms=ms, tflops=case.flops("bwd") / ms * 1e-9)
        except Exception as exc:
            bwd_row["error"] = _describe(exc)
            self._after_failure(provider.name, case, bwd_row["error"])

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
            self._after_failure(provider.name, case, row["error"])
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
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "driver": _driver_version(),
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
        "notes": {
            "timing": f"triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms, "
            "L2 flushed); fwd with inputs requiring grad; bwd = out.backward(dout, retain_graph=True) "
            "alone, grads set to None outside the timed region",
            "flops": "fwd 4·B·H·N²·D, halved when causal; bwd 2.5 × fwd",
            "accuracy": f"max abs diff vs {REFERENCE} on the same inputs; flagged above "
            + ", ".join(f"{k} {v}" for k, v in TOLERANCE.items())
            + " (gradients: tolerance × max(1, max |ref grad|))",
            "memory": "peak allocated during one fwd+bwd minus memory held before it, "
            "q, k, v, dout and their grads counted as held before",
        },
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
    parser.add_argument("--shapes", choices=("standard", "memory", "all"), default="standard")
    parser.add_argument(
        "--providers",
        type=_choices(list(PROVIDERS)),
        default=list(PROVIDERS),
        help=f"comma-separated, default all: {','.join(PROVIDERS)}",
    )
    parser.add_argument("--dtypes", type=_choices(list(DTYPES)), default=["bf16"], help="bf16 (default), fp16")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms (default 25)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms (default 100)")
    return parser.parse_args(argv)


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


def _memory_summary(rows: Sequence[dict[str, Any]]) -> str:
    """'flashtile 70 MiB, sdpa_flash 72 MiB', '-' where missing."""
    return ", ".join(
        f"{r['provider']} " + ("-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f} MiB") for r in rows
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run the requested shapes, write attention.{json,md,png}, print the markdown."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU; `python benchmarks/report.py FILE.json` runs on a CPU.")
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    providers = [PROVIDERS[p] for p in args.providers]
    start = time.perf_counter()

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
    print(markdown(load(run.json_path), provenance=False), flush=True)  # provenance: in the files
    if run.fatal:
        sys.exit(run.fatal)


if __name__ == "__main__":
    main()
