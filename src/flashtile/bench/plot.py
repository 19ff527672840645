"""Plots of benchmark records (``flashtile.bench.results``): one PNG per GPU, benchmark, dtype or layout, and run.

    python -m flashtile.bench.plot FILE.jsonl [FILE.jsonl ...] [--out DIR] [--commit SHA]

- ``attention``: TFLOP/s against N, one line per implementation, one panel per (head dim, causal, pass);
  records flagged by their accuracy check are marked with a red x.
- ``decode``: the bytes of K and V a step reads over its time (TB/s) against the context, one line per
  implementation (flashtile replayed from a CUDA graph), one panel per (query heads, batch).
- ``io``: the HBM bytes of a pass against N on a log scale: flashtile's as Nsight Compute counted them and as the
  model of ``flashtile.iomodel`` predicts them, standard attention's by the model; one panel per (head dim, pass).
Files are named ``<gpu>-<benchmark>-<dtype or layout>-<commit or date>.png``. Other benchmarks have tables,
not plots. Needs matplotlib (``pip install 'flashtile[bench]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flashtile.bench import results
from flashtile.bench.results import OURS, Record


def available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def _slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _short(n: int) -> str:
    """16384 -> '16k', 512 -> '512'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _panels(
    records: Sequence[Record],
    rows: Sequence[Any],
    columns: Sequence[Any],
    where: Callable[[Record, Any, Any], bool],
    series: Callable[[Record], str],
    x: Callable[[Record], float],
    y: Callable[[Record], float | None],
    title: Callable[[Any, Any], str],
    xlabel: str,
    ylabel: str,
    suptitle: str,
    path: Path,
    yscale: str = "linear",
) -> None:
    """A grid of line plots: panel (row, column) draws the records ``where`` selects, one line per ``series``
    (``yscale`` "log": a logarithmic y axis)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    names = list(dict.fromkeys(series(r) for r in records))
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    xs = sorted({x(r) for r in records})
    fig = Figure(figsize=(4.2 * len(columns), 3.3 * len(rows) + 0.9), layout="constrained")
    axes = fig.subplots(len(rows), len(columns), squeeze=False, sharex=True)
    flagged_any = False
    for i, row in enumerate(rows):
        for j, column in enumerate(columns):
            ax = axes[i][j]
            for name in names:
                points = sorted(
                    (x(r), y(r), bool(r["extra"].get("flagged")))
                    for r in records
                    if series(r) == name and where(r, row, column) and y(r) is not None
                )
                if not points:
                    continue
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                        color=colors[name], linewidth=2.4 if name.startswith(OURS) else 1.4, label=name)  # fmt: skip
                bad = [p for p in points if p[2]]
                if bad:
                    flagged_any = True
                    ax.plot([p[0] for p in bad], [p[1] for p in bad], "x", color="red", markersize=9)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [_short(int(v)) for v in xs])
            ax.minorticks_off()
            ax.set_title(title(row, column), fontsize=10)
            ax.set_yscale(yscale)
            if yscale == "linear":
                ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if i == len(rows) - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
    legend: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(name, handle)
    if flagged_any:
        legend["accuracy flagged"] = Line2D([], [], linestyle="", marker="x", color="red", markersize=9)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=min(len(legend), 6))
    fig.suptitle(suptitle, fontsize=11)
    fig.savefig(path, dpi=110)


def _environment(records: Sequence[Record]) -> str:
    """'NVIDIA H200, 2026-12-01, torch 2.11.0+cu130, Triton 3.6.0, flashtile fa95de2' of a run's first record."""
    r = records[0]
    return (f"{r['gpu']}, {str(r['date'])[:10]}, torch {r['torch']}, Triton {r['triton']}, "
            f"flashtile {r['commit'] or r['version']}")  # fmt: skip


def plot_attention(records: Sequence[Record], path: Path) -> None:
    """TFLOP/s against N of one run and dtype: a panel per (D, causal, pass), a line per implementation."""
    dims = sorted({r["shape"]["D"] for r in records})
    shape = records[0]["shape"]
    panels = sorted({(r["shape"]["causal"], r["pass"]) for r in records}, key=lambda cp: (cp[0], cp[1] != "fwd"))
    _panels(
        records, dims, panels,
        where=lambda r, d, cp: (r["shape"]["D"], r["shape"]["causal"], r["pass"]) == (d, *cp),
        series=lambda r: results.label(r["implementation"]),
        x=lambda r: r["shape"]["N"], y=lambda r: r["tflops"],
        title=lambda d, cp: f"D={d}, {'causal' if cp[0] else 'full'}, {cp[1]}",
        xlabel="N (sequence length)", ylabel="TFLOP/s",
        suptitle=f"{_environment(records)}; {shape['dtype']}, B·N = {_short(shape['B'] * shape['N'])}, "
        f"H·D = {shape['H'] * shape['D']}",
        path=path,
    )  # fmt: skip


def _decode_series(r: Record) -> str:
    """'flashtile (graph)', 'cuDNN', ...: the implementation, with flashtile's launch mode."""
    launch = r["config"].get("launch")
    return results.label(r["implementation"]) + (f" ({launch})" if launch else "")


def plot_decode(records: Sequence[Record], path: Path) -> None:
    """The rate at which a decode step reads the cache (bytes of K and V over the step's time) against the context,
    for one run and layout: a panel per (Hq, B)."""
    shown = [r for r in records if r["config"].get("launch") in (None, "graph")]
    heads = sorted({r["shape"]["Hq"] for r in shown})
    batches = sorted({r["shape"]["B"] for r in shown})
    _panels(
        shown, heads, batches,
        where=lambda r, hq, b: (r["shape"]["Hq"], r["shape"]["B"]) == (hq, b),
        series=_decode_series,
        x=lambda r: r["shape"]["context"], y=lambda r: r["tbps"],
        title=lambda hq, b: f"Hq={hq}, B={b}",
        xlabel="context (keys in the cache)", ylabel="K and V read, TB/s",
        suptitle=f"{_environment(shown)}; decode, {shown[0]['shape']['layout']} cache",
        path=path,
    )  # fmt: skip


IO_SERIES = {
    "flashtile (Nsight Compute)": "ncu_bytes",
    "flashtile (model)": "model_bytes",
    "standard attention (model)": "standard_bytes",
}
"""The lines of the ``io`` plot: name -> the field of a record's ``extra`` it draws."""


def plot_io(records: Sequence[Record], path: Path) -> None:
    """HBM bytes of one pass against N (log scale) for one run and dtype: a panel per (D, pass), a line each for
    flashtile as measured by Nsight Compute and as modelled, and for standard attention as modelled."""
    lines = [
        {**r, "series": name, "bytes": r["extra"].get(key), "extra": {}}
        for r in records
        for name, key in IO_SERIES.items()
    ]
    dims = sorted({r["shape"]["D"] for r in records})
    passes = sorted({r["pass"] for r in records}, key=lambda p: p != "fwd")
    by_n = sorted({r["shape"]["N"]: r["shape"]["B"] for r in records}.items())
    batches = f"B = {', '.join(str(b) for _, b in by_n)} at N = {', '.join(_short(n) for n, _ in by_n)}"
    shape = records[0]["shape"]
    _panels(
        lines, dims, passes,
        where=lambda r, d, p: (r["shape"]["D"], r["pass"]) == (d, p),
        series=lambda r: r["series"],
        x=lambda r: r["shape"]["N"], y=lambda r: r["bytes"],
        title=lambda d, p: f"D={d}, {'causal' if shape['causal'] else 'full'}, {p}",
        xlabel="N (sequence length)", ylabel="HBM bytes (read + written)",
        suptitle=f"{_environment(records)}\n{shape['dtype']}, H·D = {shape['H'] * shape['D']}, {batches}",
        path=path, yscale="log",
    )  # fmt: skip


PLOTS = {
    "attention": ("dtype", plot_attention, lambda r: r["time_ms"]),
    "decode": ("layout", plot_decode, lambda r: r["time_ms"]),
    "io": ("dtype", plot_io, lambda r: r["extra"].get("ncu_bytes")),
}
"""benchmark -> (the shape field that splits it into files, the plot, the measurement without which a record has
nothing to plot)."""


def file_name(rec: Record) -> str:
    """The name of the plot that draws ``rec`` (of a benchmark in PLOTS): 'nvidia-h200-attention-bf16-fa95de2.png'."""
    run = rec["commit"] or str(rec["date"])[:10]
    return f"{_slug(rec['gpu'])}-{rec['benchmark']}-{rec['shape'][PLOTS[rec['benchmark']][0]]}-{_slug(run)}.png"


def plot_files(records: Sequence[Record], out: Path) -> list[Path]:
    """Write every plot the records make into the folder ``out``; the paths written."""
    groups: dict[str, list[Record]] = {}
    for rec in records:
        if rec["benchmark"] in PLOTS:
            groups.setdefault(file_name(rec), []).append(rec)
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for name, group in groups.items():
        benchmark = group[0]["benchmark"]
        if not any(PLOTS[benchmark][2](r) is not None for r in group):
            continue
        PLOTS[benchmark][1](group, out / name)
        written.append(out / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: plot JSON-lines files; the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m flashtile.bench.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", type=Path, nargs="+", help="JSON-lines files of benchmark records")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: beside the first file)")
    parser.add_argument("--commit", default=None, help="plot only the records of this commit")
    args = parser.parse_args(argv)
    if not available():
        print("The plots need matplotlib: pip install 'flashtile[bench]'", file=sys.stderr)
        return 1
    records = results.load(*args.files)
    if args.commit:
        records = [r for r in records if r["commit"] == args.commit]
    for path in plot_files(records, args.out or args.files[0].parent):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
