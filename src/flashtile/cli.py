"""The ``flashtile`` command line (also ``python -m flashtile``).

    flashtile info                               versions, device, which path runs, tile configs
    flashtile info --explain [--batch B --seqlen-q N --seqlen-k N --heads H --kv-heads H --head-dim D
                   --dtype bf16|fp16|fp32 --causal --window L R --softcap X --dropout P --alibi --sink
                   --deterministic --device cuda|cpu]
                                                 which kernel runs the forward and the backward of
                                                 that call, and why each faster one does not
    flashtile check [--device cuda|cpu] [--quick] [--no-ncu]
                                                 verify flashtile against the exact oracle on this
                                                 machine, then time it and measure its memory and
                                                 HBM bytes next to standard attention; exit code 1
                                                 on a failure
    flashtile check --max-context [--ring G] [--budget-s S] [--out DIR]
                                                 the longest sequence whose forward+backward fits in
                                                 this GPU's memory, flashtile's and standard attention's,
                                                 or flashtile's on a ring of G GPUs
    flashtile bench [ARGS...]                    flashtile against its peers on a GPU
                                                 (``flashtile.bench.attention``; try --help)

``check`` applies flashtile's tolerance rule (``flashtile.reference.within_tolerance``: the error against
the exact oracle within a small factor of the error the oracle itself makes in fp16/bf16) to out,
softmax_lse, dq, dk and dv for a handful of cases, then times forward+backward of flashtile, of torch's
``scaled_dot_product_attention`` (whichever kernel torch picks) and of standard attention
(``attention_reference`` in the inputs' dtype: the score matrix materialised, as a plain PyTorch
implementation does) at a few sequence lengths, with a progress bar while it works, and gives the HBM bytes
each moves (``flashtile.bench.hbm``: Nsight Compute's DRAM counters where ``ncu`` is on PATH and can read them on a
GPU, else the model of ``flashtile.iomodel``, labelled as such).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import flashtile
from flashtile import _backend
from flashtile.bench import context as longest
from flashtile.bench import hbm, results
from flashtile.reference import (
    GRADIENT_FACTOR,
    OUTPUT_FACTOR,
    RESULT_NAMES,
    ToleranceResult,
    attention_reference,
    reference_results,
    within_tolerance,
)

if TYPE_CHECKING:
    from flashtile.ops.attention.configs import TileConfig

PATH_DESCRIPTIONS = {
    "triton": "Triton kernels, compiled",
    "triton-interpreter": "Triton kernels run by the Triton interpreter, TRITON_INTERPRET=1",
    "cpu": "flashtile.cpu: the tiled algorithm in PyTorch",
}
MAX_SCORE_BYTES = 4 * 2**30  # standard attention is skipped when its score matrix alone is larger


# ----------------------------------------------------------------------------------------- info


def _table(title: str, show_header: bool = True) -> Table:
    """A rich table in the one style of this module: no outer frame, so it fits 80 columns."""
    return Table(title=title, show_header=show_header, show_edge=False, pad_edge=False)


def _device_description() -> str:
    """'NVIDIA H200, compute capability 9.0', or 'no CUDA device'."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()}, compute capability {major}.{minor}"


def _path_description(device: torch.device) -> str:
    """The path flashtile takes for tensors on ``device``, e.g. 'cpu (flashtile.cpu: ...)'."""
    name = _backend.path_name(device)
    return f"{name} ({PATH_DESCRIPTIONS[name]})"


def _gluon_description() -> str:
    """Whether the sm_90 Gluon kernels are switched on, and whether this machine's GPU would run them."""
    state = "on" if _backend.GLUON else "off (FLASHTILE_GLUON=0)"
    here = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return f"{state}; {'this GPU is sm_90' if here else 'they run on sm_90 GPUs only'}"


def _triton_version() -> str:
    """Triton's version, or why there is none (the CPU path does not need it)."""
    try:
        import triton
    except ImportError:
        return "not installed (the CPU path does not need it; CUDA tensors do)"
    return triton.__version__


def _format_config(cfg: TileConfig) -> str:
    """'128×64 w8 s3': block_m × block_n, warps, pipeline stages."""
    return f"{cfg.block_m}×{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def explain_call(console: Console, args: argparse.Namespace, device: torch.device) -> int:
    """``flashtile info --explain``: ``flashtile.explain`` of a flash_attn_func call of the shape and options in
    ``args`` on ``device`` (empty tensors: nothing runs)."""
    dtype = DTYPES[args.dtype]
    seqlen_k = args.seqlen_q if args.seqlen_k is None else args.seqlen_k
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    q = torch.empty(args.batch, args.seqlen_q, args.heads, args.head_dim, dtype=dtype, device=device)
    k, v = (torch.empty(args.batch, seqlen_k, kv_heads, args.head_dim, dtype=dtype, device=device)
            for _ in range(2))  # fmt: skip
    extras = {}
    if args.alibi:
        extras["alibi_slopes"] = torch.ones(args.heads, device=device)
    if args.sink:
        extras["learnable_sink"] = torch.zeros(args.heads, device=device)
    explanation = flashtile.explain(
        q, k, v, args.dropout, args.softmax_scale, args.causal, tuple(args.window), args.softcap,
        deterministic=args.deterministic, **extras,
    )  # fmt: skip
    console.print(
        f"flash_attn_func on q {tuple(q.shape)}, k and v {tuple(k.shape)}, {args.dtype}, {device.type}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(str(explanation), highlight=False, markup=False, soft_wrap=True)
    return 0


def info(console: Console) -> int:
    """Print versions, the device, the path each device's tensors take and the GPU tile configs."""
    table = _table("flashtile info", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in (
        ("flashtile", flashtile.__version__),
        ("torch", torch.__version__),
        ("triton", _triton_version()),
        ("python", platform.python_version()),
        ("device", _device_description()),
        ("CUDA tensors", _path_description(torch.device("cuda"))),
        ("CPU tensors", _path_description(torch.device("cpu"))),
        ("sm_90 Gluon kernels", _gluon_description()),
    ):
        table.add_row(name, value)
    console.print(table)

    if not torch.cuda.is_available():
        console.print("Tile configs: chosen per GPU generation and head dim; no CUDA device here.")
        return 0
    try:
        from flashtile.ops.attention import configs  # imports Triton
    except ImportError:
        console.print("Tile configs: Triton is not installed, so CUDA tensors cannot run (pip install triton).")
        return 0

    device = torch.device("cuda")
    tiles = _table(f"Tile configs on {torch.cuda.get_device_name()}")
    tiles.add_column("head dim", justify="right")
    for pass_name in configs.PASSES:
        tiles.add_column(pass_name)
    for head_dim in (64, 128, 256):
        cells = (_format_config(configs.config(p, device, head_dim, head_dim)) for p in configs.PASSES)
        tiles.add_row(str(head_dim), *cells)
    console.print(tiles)
    console.print("block_m×block_n: query rows × key rows of a tile; w: warps; s: pipeline stages.")
    return 0


# ---------------------------------------------------------------------------------------- check


@dataclass(frozen=True)
class Case:
    """One correctness case (batch CASE_BATCH).

    Shown as e.g. 'bf16 causal 131×77 H8:2 D128': seqlen_q × seqlen_k, nheads : nheads_k, head dim.
    """

    dtype: torch.dtype
    causal: bool
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int

    def __str__(self) -> str:
        dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        mask = "causal" if self.causal else "full"
        shape = f"{self.seqlen_q}×{self.seqlen_k} H{self.nheads}:{self.nheads_k} D{self.head_dim}"
        return f"{dtype} {mask} {shape}"


CASES = (
    Case(torch.float16, False, 128, 128, 4, 4, 64),
    Case(torch.bfloat16, True, 128, 128, 4, 4, 64),
    Case(torch.bfloat16, True, 256, 256, 8, 2, 64),  # grouped-query attention
    Case(torch.float16, False, 77, 131, 4, 4, 128),  # Sq < Sk, lengths no tile divides
    Case(torch.bfloat16, True, 131, 77, 4, 4, 128),  # Sq > Sk: the first rows see no key
    Case(torch.float16, True, 77, 131, 6, 2, 128),
    Case(torch.bfloat16, False, 131, 131, 4, 1, 64),  # multi-query attention
    Case(torch.float16, True, 1, 131, 4, 4, 128),  # one query row (decoding)
)
CASE_BATCH = 2


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, generator: torch.Generator):
    """N(0, 1) in ``dtype`` on ``device``, drawn on the CPU so every device sees the same numbers."""
    return torch.randn(shape, generator=generator, dtype=dtype).to(device)


def check_case(case: Case, device: torch.device, seed: int) -> dict[str, ToleranceResult]:
    """flashtile's forward and backward on one case, each result checked against the oracle."""
    generator = torch.Generator().manual_seed(seed)
    q = _random((CASE_BATCH, case.seqlen_q, case.nheads, case.head_dim), case.dtype, device, generator)
    k, v = (
        _random((CASE_BATCH, case.seqlen_k, case.nheads_k, case.head_dim), case.dtype, device, generator)
        for _ in range(2)
    )
    dout = _random(q.shape, case.dtype, device, generator)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_func(*leaves, causal=case.causal, return_attn_probs=True)
    out.backward(dout)
    results = dict(zip(RESULT_NAMES, [out.detach(), lse, *(t.grad for t in leaves)], strict=True))

    precise = torch.float64 if device.type == "cpu" else torch.float32
    ref = reference_results(q, k, v, dout, precise, causal=case.causal)
    base = reference_results(q, k, v, dout, case.dtype, causal=case.causal)
    return {
        name: within_tolerance(x, ref[name], base[name], OUTPUT_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR)
        for name, x in results.items()
    }


def _closeness(result: ToleranceResult) -> float:
    """How near its bound a result is: 0 exact, 1 at the bound, infinite if it fails."""
    if not result.ok:
        return float("inf")
    return result.error / result.bound if result.bound else 0.0


@contextmanager
def _progress(console: Console, description: str, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar of ``total`` steps, cleared when done; yields ``step(what)``: name the step about to run
    (the first call starts the bar, each later one counts the step before it as done)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        started = False

        def step(what: str) -> None:
            nonlocal started
            progress.update(task, description=f"{description}: {what}", advance=1 if started else 0)
            started = True

        yield step


def check_correctness(console: Console, device: torch.device) -> bool:
    """Run every case and print one row each, for the tensor closest to (or furthest over) its bound."""
    table = _table(f"Correctness against the exact oracle, batch {CASE_BATCH}")
    for column in ("case", "worst", "max error", "plain error", "ratio", "result"):
        table.add_column(column, justify="left" if column in ("case", "worst") else "right")
    passed = True
    with _progress(console, "correctness", len(CASES)) as step:
        for seed, case in enumerate(CASES):
            step(str(case))
            results = check_case(case, device, seed)
            name, worst = max(results.items(), key=lambda item: _closeness(item[1]))
            ok = all(r.ok for r in results.values())
            passed &= ok
            ratio = f"{worst.error / worst.base_error:.2g}" if worst.base_error else "-"
            table.add_row(
                str(case), name, f"{worst.error:.2e}", f"{worst.base_error:.2e}", ratio,
                "[green]PASS[/]" if ok else "[bold red]FAIL[/]",
            )  # fmt: skip
    console.print(table)
    precise = "float64" if device.type == "cpu" else "float32"
    console.print(
        f"max error: of flashtile against the oracle in {precise}; plain error: of the oracle computed in "
        "fp16/bf16 itself. worst: the one of out, lse, dq, dk, dv nearest its bound. Pass when max error <= "
        f"{OUTPUT_FACTOR:g} (out, lse) or {GRADIENT_FACTOR:g} (gradients) × plain error + 2 ulps.\n"
    )
    return passed


@dataclass(frozen=True)
class SpeedSetup:
    """The sizes timed on one kind of device: B=1, bf16, no mask."""

    seqlens: tuple[int, ...]
    quick_seqlens: tuple[int, ...]
    nheads: int
    head_dim: int
    reps: int


SPEED_SETUPS = {
    "cuda": SpeedSetup((1024, 4096, 16384), (1024, 4096), nheads=16, head_dim=128, reps=10),
    "cpu": SpeedSetup((1024, 2048, 4096), (1024, 2048), nheads=8, head_dim=64, reps=3),
}
SPEED_DTYPE = torch.bfloat16
CUDA_WARMUP = 3  # runs before anything is measured on a GPU (the first one compiles the kernels)
WARMUP_SEQLEN = 256  # CPU: a small run first, so loading code does not count as memory


def _speed_inputs(seqlen: int, setup: SpeedSetup, device: torch.device) -> list[torch.Tensor]:
    """q, k, v and dout of shape (1, seqlen, nheads, head_dim), bf16, on ``device``."""
    generator = torch.Generator().manual_seed(0)
    return [_random((1, seqlen, setup.nheads, setup.head_dim), SPEED_DTYPE, device, generator) for _ in range(4)]


Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def flashtile_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
    """One forward+backward of flashtile."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    flashtile.flash_attn_func(q, k, v).backward(dout)


def sdpa_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
    """One forward+backward of torch's scaled_dot_product_attention, whichever kernel torch picks for it."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out.transpose(1, 2).backward(dout)


def standard_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
    """One forward+backward of standard attention: the score matrix materialised, in the inputs' dtype."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    attention_reference(q, k, v)[0].backward(dout)


STEPS = {"flashtile": flashtile_step, "torch SDPA": sdpa_step, "standard": standard_step}
"""What ``check`` times, by the name its table gives each: flashtile first, the others compared with it."""


def measure_cuda(step: Step, seqlen: int, setup: SpeedSetup) -> tuple[float, float]:
    """(median ms by CUDA events, peak MiB allocated beyond the inputs) of ``step`` after warm-up."""
    inputs = _speed_inputs(seqlen, setup, torch.device("cuda"))
    for _ in range(CUDA_WARMUP):
        step(*inputs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(setup.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(*inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), peak / 2**20


def measure_cpu(step: Step, seqlen: int, setup: SpeedSetup) -> tuple[float, float]:
    """(median ms by perf_counter, peak RSS growth in MiB) of ``step``; run in a fresh process.

    A small warm-up first loads the code the step runs; the measured run then doubles as the
    warm-up of the timed ones.
    """
    import resource  # POSIX only, like the forkserver this runs under

    step(*_speed_inputs(WARMUP_SEQLEN, setup, torch.device("cpu")))
    inputs = _speed_inputs(seqlen, setup, torch.device("cpu"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(*inputs)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    times = []
    for _ in range(setup.reps):
        start = time.perf_counter()
        step(*inputs)
        times.append(time.perf_counter() - start)
    rss_unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return statistics.median(times) * 1e3, growth * rss_unit / 2**20


def _send_result(connection, function: Callable, args: tuple) -> None:
    """The target of ``in_fresh_process``'s child: run, and send the result back."""
    connection.send(function(*args))


def in_fresh_process(function: Callable, *args):
    """``function(*args)`` in a new process forked from a clean server, so that neither memory this
    process already holds nor its OpenMP threads (which do not survive a plain fork) get in the way."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_send_result, args=(sender, function, args))
    process.start()
    sender.close()
    try:
        result = receiver.recv()
    except EOFError:  # it ended without sending: the error, if any, is printed above
        result = None
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"the measuring process ended with exit code {process.exitcode}")
    return result


def _measure(step: Step, seqlen: int, setup: SpeedSetup, device: torch.device) -> tuple[float, float]:
    """(ms, MiB) of ``step`` on ``device``: in this process on CUDA, in a fresh one on the CPU."""
    if device.type == "cuda":
        return measure_cuda(step, seqlen, setup)
    return in_fresh_process(measure_cpu, step, seqlen, setup)


def check_speed(console: Console, device: torch.device, quick: bool, ncu: bool = True) -> None:
    """Time forward+backward and measure the peak extra memory of flashtile, torch's SDPA and standard attention,
    then give the HBM bytes each moves (``check_io``; ``ncu`` False: the model only)."""
    setup = SPEED_SETUPS[device.type]
    if _backend.path_name(device) == "triton-interpreter":
        console.print("Speed and memory: skipped, the Triton interpreter is for tests; unset TRITON_INTERPRET.")
        return
    seqlens = setup.quick_seqlens if quick else setup.seqlens
    others = [name for name in STEPS if name != "flashtile"]
    table = _table(f"Forward+backward, B=1 H={setup.nheads} D={setup.head_dim} bf16, no mask: ms (MiB)")
    table.add_column("N", justify="right")
    for name in STEPS:
        table.add_column(name, justify="right")
    for name in others:
        table.add_column(f"vs {name}", justify="right")
    skipped, timed_standard = [], []
    with _progress(console, "timing", len(seqlens) * len(STEPS)) as step:
        for seqlen in seqlens:
            measured: dict[str, tuple[float, float] | None] = {}
            for name, function in STEPS.items():
                step(f"{name} N={seqlen}")
                score_bytes = setup.nheads * seqlen * seqlen * SPEED_DTYPE.itemsize
                if name == "standard" and score_bytes > MAX_SCORE_BYTES:
                    gib = score_bytes / 2**30
                    skipped.append(f"N={seqlen}: standard attention skipped (would need {gib:.1f} GiB for its score "
                                   "matrix).")  # fmt: skip
                    measured[name] = None
                    continue
                measured[name] = _measure(function, seqlen, setup, device)
            if measured["standard"] is not None:
                timed_standard.append(seqlen)
            ours_ms = measured["flashtile"][0]
            cells = ["skipped" if m is None else f"{m[0]:.1f} ({m[1]:.0f})" for m in map(measured.get, STEPS)]
            ratios = [f"{measured[name][0] / ours_ms:.2f}×" if measured[name] else "-" for name in others]
            table.add_row(str(seqlen), *cells, *ratios)
    console.print(table)
    for line in skipped:
        console.print(line)
    ratio = "vs X: X's time over flashtile's (above 1: flashtile is faster)"
    if device.type == "cuda":
        console.print(
            f"Time: median of {setup.reps} runs by CUDA events after {CUDA_WARMUP} warm-up runs; {ratio}. Memory "
            "(MiB): torch.cuda.max_memory_allocated during one run minus what was allocated before it (the inputs)."
        )
    else:
        console.print(
            f"Time: median of {setup.reps} runs by time.perf_counter; {ratio}. Memory (MiB): growth of the peak "
            "resident set size (ru_maxrss) of a fresh process during one run, after a small warm-up; inputs not "
            "counted. Each size and implementation runs in its own process."
        )
    console.print()
    check_io(console, device, seqlens, timed_standard, ncu)


def io_claim(
    seqlen: int, setup: SpeedSetup, device: torch.device, standard: bool, ncu: bool = True
) -> tuple[float, float, str, str]:
    """(flashtile's bytes, standard attention's bytes, source of flashtile's, source of standard's) moved in HBM by
    one forward+backward of ``check_speed``'s problem at ``seqlen``: measured by Nsight Compute on a GPU where it can
    and ``ncu`` allows (standard attention only where ``standard``: it was timed), else the model."""
    problem = hbm.Problem(1, seqlen, setup.nheads, setup.head_dim, dtype="bf16")
    model = hbm.model_bytes(problem, device)
    ours = sum(rec["hbm_bytes"] for rec in model.values())
    theirs = sum(rec["standard_bytes"] for rec in model.values())
    found = [ours, theirs, "model", "model"]
    if ncu and device.type == "cuda" and hbm.ncu_available():
        with contextlib.suppress(hbm.NcuUnavailable):  # the model stands where ncu cannot count
            found[0], found[2] = hbm.ncu_bytes(problem, "flashtile", "fwd+bwd"), "ncu"
            if standard:
                found[1], found[3] = hbm.ncu_bytes(problem, "standard", "fwd+bwd"), "ncu"
    return found[0], found[1], found[2], found[3]


def check_io(
    console: Console, device: torch.device, seqlens: Sequence[int], standard: Sequence[int], ncu: bool = True
) -> None:
    """Print the HBM bytes one forward+backward moves, flashtile's against standard attention's, per length
    (``standard``: the lengths at which standard attention was timed, measured there where ncu can; ``ncu`` False:
    the model only)."""
    setup = SPEED_SETUPS[device.type]
    memory = "HBM" if device.type == "cuda" else "Memory"
    table = _table(f"{memory} bytes of forward+backward, B=1 H={setup.nheads} D={setup.head_dim} bf16: MB")
    for column in ("N", "flashtile", "standard", "standard / flashtile"):
        table.add_column(column, justify="right")
    for seqlen in seqlens:
        ours, theirs, our_source, their_source = io_claim(seqlen, setup, device, seqlen in standard, ncu)
        table.add_row(
            str(seqlen), f"{ours / 1e6:.1f} ({our_source})", f"{theirs / 1e6:.1f} ({their_source})",
            f"{theirs / ours:.1f}×",
        )  # fmt: skip
    console.print(table)
    console.print(
        "model: flashtile.iomodel (flashtile: each tensor once per kernel, repeated K/V reads served by the L2; "
        "standard: S and P written and read in HBM); ncu: Nsight Compute's DRAM counters "
        "(dram__bytes_read.sum + dram__bytes_write.sum over the pass's kernels).\n"
    )


def max_context(
    console: Console, device: torch.device, ring: int = 1, budget_s: float | None = None, out: Path | None = None
) -> int:
    """``flashtile check --max-context``: the longest MAX_CONTEXT sequence (a multiple of 1024) whose forward+backward
    fits in GPU memory (``flashtile.bench.context``), flashtile's and standard attention's on one GPU, or flashtile's
    on a ring of ``ring`` GPUs; within ``budget_s`` seconds per implementation where given (the result is then a lower
    bound); records appended to ``out``/max-context.jsonl. 1 without a GPU."""
    problem = longest.MAX_CONTEXT
    shape = (f"B={problem.batch}, H={problem.nheads}, D={problem.head_dim}, {problem.dtype}, causal, "
             "forward+backward with inputs and gradients")  # fmt: skip
    if device.type != "cuda":
        console.print(
            f"--max-context needs a CUDA GPU: it finds the longest sequence ({shape}) whose forward and backward fit "
            "in the GPU's memory, by running them at growing lengths. This machine runs flashtile on its CPU, whose "
            "memory is the host's: flashtile's grows linearly with the length and standard attention's "
            "quadratically (the score matrix), which `flashtile check` shows at a few lengths.",
            markup=False, highlight=False,
        )  # fmt: skip
        return 1
    env = results.environment(device, gpus=ring)
    total = torch.cuda.get_device_properties(device).total_memory  # no CUDA context here: a ring's rank 0 shares GPU 0
    where = f"{ring}× " if ring > 1 else ""
    console.print(f"{where}{_device_description()}, {total / 2**30:.1f} GiB; {shape}")

    def run(impl: str) -> Callable[[int], longest.Probe]:
        """A probe of ``impl`` that says what it found."""
        if ring > 1:
            measure = longest.ring_runner(ring)
        else:
            longest.probe_here(impl, longest.MULTIPLE)  # the first call compiles the kernels: not timed
            measure = functools.partial(longest.probe_here, impl)

        def probe(seqlen: int) -> longest.Probe:
            console.print(f"{impl}: N={seqlen} ...", end=" ", highlight=False)
            found = measure(seqlen)
            peak = "out of memory" if not found.fits else f"{found.peak_bytes / 2**30:.2f} GiB per GPU"
            console.print(f"{peak}, {found.seconds:.1f} s", highlight=False)
            return found

        return probe

    implementations = ("flashtile",) if ring > 1 else hbm.IMPLEMENTATIONS
    found = [longest.search(run(impl), impl, total, ring, budget_s) for impl in implementations]
    title = "Longest sequence that fits" + (f", ring of {ring} GPUs (N: the whole sequence)" if ring > 1 else "")
    table = _table(title)
    for column in ("implementation", "N", "peak GiB per GPU", "fwd+bwd s", "predicted N", "probes"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    for s in found:
        best = s.best()
        table.add_row(
            s.implementation, f"{s.seqlen}" + ("" if s.exact else " (lower bound)"),
            "-" if best is None else f"{best.peak_bytes / 2**30:.1f}", "-" if best is None else f"{best.seconds:.1f}",
            "-" if s.predicted is None else str(s.predicted), str(len(s.probes)),
        )  # fmt: skip
    console.print(table)
    if not all(s.exact for s in found):
        console.print(f"lower bound: the budget ({budget_s:g} s) ended the search; that length fitted, a longer one "
                      "may too.")  # fmt: skip
    if len(found) == 2 and found[1].seqlen:
        console.print(f"flashtile fits {found[0].seqlen / found[1].seqlen:.1f}× the context of standard attention.")
    if out is not None:
        console.print(f"wrote {longest.append(out, longest.records(found, env, budget_s))}", highlight=False)
    return 0


def check(console: Console, device: torch.device, quick: bool, ncu: bool = True) -> int:
    """``flashtile check``: 0 when every correctness case passes, 1 otherwise (``ncu``: as ``check_speed``)."""
    where = _device_description() if device.type == "cuda" else f"the CPU ({torch.get_num_threads()} threads)"
    console.print(f"flashtile {flashtile.__version__} check on {where}\npath: {_path_description(device)}\n")
    start = time.perf_counter()
    passed = check_correctness(console, device)
    check_speed(console, device, quick, ncu)
    verdict = "[green]all cases PASS[/]" if passed else "[bold red]FAIL: see the table above[/]"
    console.print(f"{verdict} ({time.perf_counter() - start:.0f} s)")
    return 0 if passed else 1


# ---------------------------------------------------------------------------------------- bench


def bench(args: Sequence[str]) -> int:
    """``flashtile bench ARGS``: ``flashtile.bench.attention`` with ``args``; its exit code."""
    from flashtile.bench import attention

    return attention.main(args, prog="flashtile bench")


# ----------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtile", description="flashtile: exact FlashAttention for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{info,check,bench}")
    info_parser = commands.add_parser("info", help="versions, device, which path runs, tile configs")
    info_parser.add_argument(
        "--explain", action="store_true", help="which kernel runs a call of the shape and options below, and why"
    )
    call = info_parser.add_argument_group("the call --explain explains (flash_attn_func's arguments)")
    for name, default in (("batch", 2), ("seqlen-q", 1024), ("seqlen-k", None), ("heads", 16), ("kv-heads", None),
                          ("head-dim", 128)):  # fmt: skip
        shown = {"seqlen-k": "seqlen-q", "kv-heads": "heads"}.get(name, default)
        call.add_argument(f"--{name}", type=int, default=default, help=f"default {shown}")
    call.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    call.add_argument("--causal", action="store_true")
    call.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"), help="window_size")
    call.add_argument("--softcap", type=float, default=0.0)
    call.add_argument("--dropout", type=float, default=0.0, help="dropout_p")
    call.add_argument("--softmax-scale", type=float, default=None, help="default 1 / sqrt(head dim)")
    call.add_argument("--alibi", action="store_true", help="with ALiBi slopes")
    call.add_argument("--sink", action="store_true", help="with a learnable sink")
    call.add_argument("--deterministic", action="store_true")
    call.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available, else cpu")
    check_parser = commands.add_parser(
        "check", help="verify flashtile against the exact oracle, then time it next to torch's SDPA and plain attention"
    )
    check_parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available, else cpu"
    )
    check_parser.add_argument("--quick", action="store_true", help="fewer sequence lengths for the timing")
    check_parser.add_argument(
        "--no-ncu",
        action="store_true",
        help="HBM bytes from the model even where Nsight Compute (ncu) could count them",
    )
    check_parser.add_argument(
        "--max-context",
        action="store_true",
        help="instead: the longest sequence whose forward+backward fits in GPU memory (B=1, H=16, D=128, bf16, "
        "causal), flashtile's and standard attention's (a CUDA GPU; minutes on a large one)",
    )
    check_parser.add_argument(
        "--ring", type=int, default=1, metavar="G",
        help="with --max-context: flashtile's ring attention over G GPUs of this machine, each holding N/G tokens",
    )  # fmt: skip
    check_parser.add_argument(
        "--budget-s", type=float, default=None, metavar="S",
        help="with --max-context: start no probe predicted to end after S seconds (per implementation); the result "
        "is then a lower bound",
    )  # fmt: skip
    check_parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="with --max-context: append the results to DIR/max-context.jsonl (flashtile.bench.results records)",
    )  # fmt: skip
    commands.add_parser(
        "bench", add_help=False, help="flashtile against its peers on a GPU (arguments are passed on; try --help)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashtile`` and ``python -m flashtile``; returns the exit code."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    console = Console()
    if args.command == "bench":
        return bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "info" and not args.explain:
        return info(console)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here; use --device cpu")
    if args.command == "info":
        return explain_call(console, args, device)
    if not args.max_context and (args.ring != 1 or args.budget_s is not None or args.out is not None):
        parser.error("--ring, --budget-s and --out go with --max-context")
    if args.ring < 1 or (args.budget_s is not None and args.budget_s <= 0):
        parser.error(f"--ring takes a number of GPUs >= 1 (got {args.ring}) and --budget-s seconds > 0")
    if device.type == "cuda" and args.ring > torch.cuda.device_count():
        parser.error(f"--ring {args.ring}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if args.max_context:
        return max_context(console, device, args.ring, args.budget_s, args.out)
    return check(console, device, args.quick, ncu=not args.no_ncu)
