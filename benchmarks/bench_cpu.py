"""CPU attention speed and memory: flashtile's CPU path against torch's CPU SDPA and plain materialised attention.

    PYTHONPATH=src python benchmarks/bench_cpu.py [--out FILE.jsonl] [--reps 7] [--seqlens 1024,2048,4096]
        [--dtypes bf16,fp32] [--threads N] [--no-memory] [--markdown]

Implementations, all on the same q, k, v, dout (B=1, H=8, D=64, drawn once per shape from N(0, 1) in flash_attn's
(B, N, H, D) layout; torch's functions get transposed views of the same tensors):

- ``flashtile``: ``flashtile.flash_attn_func``; on these shapes ``flashtile.cpu`` runs torch's fused kernel
  (its route rule, ``flashtile.cpu.torch_kernel_route``);
- ``flashtile tiled``: the same call with ``flashtile.cpu.TORCH_KERNEL = False``: flashtile's own tiled path,
  the one that serves what torch's kernel cannot, timed on a shape torch's kernel also serves;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (on a CPU: torch's fused flash kernel);
- ``materialised``: ``softmax(q k^T * scale) v`` written out in the inputs' dtype, the (N, N) matrices held;
- option rows: flashtile with an option, against ``sdpa`` on the same shape without it (causal, like the options):
  ``window_size=(256, 0)`` and ALiBi (torch's kernel block by block, the band and the bias as its mask) and
  ``softcap=30`` (the tiled path).

Passes: ``fwd`` is one forward with the inputs requiring grad (as in training); ``fwd+bwd`` is that forward and
``out.backward(dout)``, gradients reset outside the timed region. Repetitions are interleaved (rep 1 of every
implementation, then rep 2, ...) after one warm-up call each, and the median wall-clock time is reported: the
machine may be shared, and interleaving spreads any disturbance over all implementations alike, so the ratios of
one run mean more than its times. Threads: torch's default, or ``--threads`` (recorded either way). On a machine
whose cores other jobs also use, a run with more than one thread mostly measures waiting: every torch call that
splits its work over threads ends when the last thread ends, and a thread the scheduler has put aside holds the
call up for a time slice, so a path that makes many calls (the tiled path, materialised attention) loses far more
than one fused kernel does; ``--threads 1`` measures what each implementation costs a core. A spot check before
timing: the max |difference| of each implementation's output and gradients from sdpa's (for the option rows,
none: they compute something else).

Memory (``fwd+bwd`` only): each (implementation, shape) runs in a fresh Python process, which makes one warm-up
call on N=256 (so that allocator and thread pools exist), draws the inputs of the measured N, reads its peak resident
set size (``VmHWM`` of /proc/self/status, Linux; not ``ru_maxrss``, which a child starts with its parent's peak),
runs one forward and backward, and reads it again. The
reported figure is the growth of the peak RSS: the extra memory the call needed at its peak beyond the inputs
(q, k, v, dout and everything allocated before), including the outputs and gradients (4 x N x 512 values), memory
freed but kept by the allocator, and page granularity. It is an upper bound on the attention's own working memory.

Output: a rich table (times in ms, ratios = sdpa's time / the implementation's, > 1 is faster than sdpa) and the
records of the one results format (``flashtile.bench.results``) in --out (default
``benchmarks/results/cpu-attention-t<threads>.jsonl``): benchmark ``attention`` (one per implementation, shape and
pass: median ``time_ms``) and ``attention-memory`` (``memory_mib``: the peak RSS growth), ``gpu`` "cpu";
``config`` holds the route (``"tiled"`` for flashtile tiled), the options and the torch threads, ``extra`` the
row's label, every repetition's time, the spot-check difference and the CPU model. ``--markdown`` prints the tables
as markdown (what docs/performance.md holds).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import flashtile
from flashtile import cpu
from flashtile.bench import results

BATCH, NHEADS, HEAD_DIM = 1, 8, 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MIB = 1 << 20
WARMUP_N = 256
ALIBI_SLOPES = 2.0 ** (-8.0 * torch.arange(1, NHEADS + 1) / NHEADS)  # ALiBi's geometric slopes for NHEADS heads


@dataclass(frozen=True)
class Impl:
    """One implementation: ``run(q, k, v, causal, **options) -> out``, all in (B, N, H, D); ``implementation`` and
    ``config`` are its record's fields (``tiled``: flashtile with torch's kernel switched off, for the forward and
    the backward alike)."""

    name: str
    run: Callable[..., torch.Tensor]
    implementation: str = "flashtile"
    tiled: bool = False
    options: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def _flashtile(q, k, v, causal, **options):
    return flashtile.flash_attn_func(q, k, v, causal=causal, **options)


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)


def _materialised(q, k, v, causal):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) * HEAD_DIM**-0.5
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


IMPLS = {
    impl.name: impl
    for impl in (
        Impl("flashtile", _flashtile),
        Impl("flashtile tiled", _flashtile, tiled=True, config={"route": "tiled"}),
        Impl("sdpa", _sdpa, "sdpa"),
        Impl("materialised", _materialised, "materialised"),
        Impl("flashtile window=(256,0)", _flashtile, options={"window_size": (256, 0)},
             config={"window_size": [256, 0]}),
        Impl("flashtile alibi", _flashtile, options={"alibi_slopes": ALIBI_SLOPES}, config={"alibi": "2^(-8h/H)"}),
        Impl("flashtile softcap=30", _flashtile, options={"softcap": 30.0}, config={"softcap": 30.0}),
    )
}  # fmt: skip
MAIN = ("flashtile", "flashtile tiled", "sdpa", "materialised")
OPTION_ROWS = ("flashtile window=(256,0)", "flashtile alibi", "flashtile softcap=30", "sdpa")


def inputs(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(BATCH, n, NHEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(4))
    return tuple(t.requires_grad_() for t in (q, k, v)) + (dout,)


def call(impl: Impl, tensors, causal: bool, backward: bool) -> torch.Tensor:
    """One forward (and backward) of ``impl``; returns out."""
    q, k, v, dout = tensors
    cpu.TORCH_KERNEL = not impl.tiled
    try:
        out = impl.run(q, k, v, causal, **impl.options)
        if backward:
            out.backward(dout)
    finally:
        cpu.TORCH_KERNEL = True
    return out


def timed(impl: Impl, tensors, causal: bool, backward: bool) -> float:
    for t in tensors[:3]:
        t.grad = None
    start = time.perf_counter()
    call(impl, tensors, causal, backward)
    return (time.perf_counter() - start) * 1e3


def spot_check(names, tensors, causal: bool) -> dict[str, float]:
    """Max |difference| of each implementation's out, dq, dk, dv from sdpa's."""
    found = {}
    for name in names:
        for t in tensors[:3]:
            t.grad = None
        out = call(IMPLS[name], tensors, causal, backward=True)
        found[name] = [out.detach().float()] + [t.grad.float() for t in tensors[:3]]
    reference = found["sdpa"]
    return {n: max((a - b).abs().max().item() for a, b in zip(r, reference, strict=True)) for n, r in found.items()}


def _shape(n: int, dtype_name: str, causal: bool) -> dict:
    return {"dtype": dtype_name, "B": BATCH, "N": n, "H": NHEADS, "D": HEAD_DIM, "causal": causal}


def measure_times(group: str, n: int, dtype_name: str, causal: bool, reps: int) -> list[dict]:
    """Interleaved repetitions of every implementation of ``group`` ("main": MAIN, "options": OPTION_ROWS) on one
    shape, both passes -> rows (``records`` makes them records)."""
    names = MAIN if group == "main" else OPTION_ROWS
    tensors = inputs(n, DTYPES[dtype_name])
    diffs = spot_check(names, tensors, causal) if group == "main" else {}
    rows = []
    for pass_name, backward in (("fwd", False), ("fwd+bwd", True)):
        times = {name: [] for name in names}
        for name in names:
            timed(IMPLS[name], tensors, causal, backward)  # warm-up
        for _ in range(reps):
            for name in names:
                times[name].append(timed(IMPLS[name], tensors, causal, backward))
        rows += [{"group": group, "name": name, "shape": _shape(n, dtype_name, causal), "pass": pass_name,
                  "times_ms": times[name], "max_abs_diff": diffs.get(name)} for name in names]  # fmt: skip
    return rows


def memory_child(name: str, n: int, dtype_name: str, causal: bool) -> None:
    """In a fresh process: print the growth of peak RSS during one forward and backward at N = n (module doc)."""
    impl = IMPLS[name]
    call(impl, inputs(WARMUP_N, DTYPES[dtype_name]), causal, backward=True)
    tensors = inputs(n, DTYPES[dtype_name])
    before = peak_rss()
    call(impl, tensors, causal, backward=True)
    print(peak_rss() - before)


def peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM: kept per address space, so not inherited)."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))


def measure_memory(name: str, n: int, dtype_name: str, causal: bool) -> dict:
    command = [sys.executable, __file__, "--threads", str(torch.get_num_threads()), "--memory-child", name, str(n),
               dtype_name, str(int(causal))]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ)
    return {"group": "memory", "name": name, "shape": _shape(n, dtype_name, causal), "pass": "fwd+bwd",
            "memory_mib": int(run.stdout.split()[-1]) / MIB}  # fmt: skip


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def records(env: dict, rows: list[dict]) -> list[results.Record]:
    """Rows of ``measure_times`` and ``measure_memory`` as records of the one results format (module doc)."""
    machine = {"cpu": cpu_model(), "cores": os.cpu_count()}
    found = []
    for row in rows:
        impl = IMPLS[row["name"]]
        config = {**impl.config, "threads": torch.get_num_threads()}
        if row["group"] == "memory":
            extra = {"label": impl.name, "measure": "peak RSS growth", **machine}
            found.append(results.record(env, "attention-memory", impl.implementation, row["shape"], row["pass"],
                                        config=config, memory_mib=row["memory_mib"], extra=extra))  # fmt: skip
            continue
        extra = {"label": impl.name, "group": row["group"], "times_ms": row["times_ms"],
                 "max_abs_diff": row["max_abs_diff"], **machine}  # fmt: skip
        found.append(results.record(env, "attention", impl.implementation, row["shape"], row["pass"], config=config,
                                    time_ms=statistics.median(row["times_ms"]), extra=extra))  # fmt: skip
    return found


def _ratio(group: dict[str, dict], name: str) -> str:
    """sdpa's time over ``name``'s in one group: > 1 means faster than sdpa."""
    if name not in group or "sdpa" not in group:
        return "-"
    return f"{group['sdpa']['time_ms'] / group[name]['time_ms']:.2f}x"


def tables(recs: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, cells) of the time, option and memory tables of this script's records."""
    groups: dict[tuple, dict[str, dict]] = {}
    for rec in recs:
        shape, extra = rec["shape"], rec["extra"]
        kind = "memory" if rec["benchmark"] == "attention-memory" else extra["group"]
        key = (kind, shape["dtype"], shape["N"], shape["causal"], rec["pass"])
        groups.setdefault(key, {})[extra["label"]] = rec
    cells = {"main": [], "options": [], "memory": []}
    for (kind, dtype_name, n, causal, pass_name), group in groups.items():
        names = OPTION_ROWS if kind == "options" else MAIN
        field_name, digits = ("memory_mib", 0) if kind == "memory" else ("time_ms", 1)
        values = [f"{group[x][field_name]:.{digits}f}" if x in group else "-" for x in names]
        ratios = [] if kind == "memory" else [_ratio(group, x) for x in names if x != "sdpa"]
        cells[kind].append([dtype_name, str(n), "yes" if causal else "no", pass_name, *values, *ratios])
    return [
        ("Time (ms, median); ratio = sdpa's time / the implementation's",
         ["dtype", "N", "causal", "pass", *MAIN, "flashtile", "tiled", "materialised"], cells["main"]),
        ("Options torch's kernel lacks, against sdpa on the same shape without them (ms, median)",
         ["dtype", "N", "causal", "pass", *OPTION_ROWS, "window", "alibi", "softcap"], cells["options"]),
        ("Peak RSS growth during one fwd+bwd (MiB)", ["dtype", "N", "causal", "pass", *MAIN], cells["memory"]),
    ]  # fmt: skip


def markdown(recs: list[dict]) -> str:
    lines = []
    for title, columns, cells in tables(recs):
        if cells:
            lines += [f"**{title}**", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(row) + " |" for row in cells] + [""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per implementation and pass")
    parser.add_argument("--seqlens", default="1024,2048,4096")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        name, n, dtype_name, causal = args.memory_child
        memory_child(name, int(n), dtype_name, causal == "1")
        return
    env = results.environment(torch.device("cpu"))
    out = args.out or Path(__file__).parent / "results" / f"cpu-attention-t{torch.get_num_threads()}.jsonl"
    seqlens = [int(x) for x in args.seqlens.split(",")]
    dtypes = args.dtypes.split(",")
    rows = []
    for dtype_name in dtypes:
        for n in seqlens:
            for causal in (False, True):
                rows += measure_times("main", n, dtype_name, causal, args.reps)
            rows += measure_times("options", n, dtype_name, True, args.reps)
    if not args.no_memory:
        rows += [measure_memory(name, n, d, False) for d in dtypes for n in seqlens for name in MAIN]
    recs = records(env, rows)
    results.write(out, recs)
    console = Console()
    console.print(f"{env['date']}  {cpu_model()}  {torch.get_num_threads()} threads  torch {env['torch']}  "
                  f"commit {env['commit']}")  # fmt: skip
    for title, columns, cells in tables(recs):
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="right")
        for row in cells:
            table.add_row(*row)
        console.print(table)
    console.print(f"wrote {out}")
    if args.markdown:
        print(markdown(recs))


if __name__ == "__main__":
    main()
