"""Markdown table and plot from an attention benchmark's JSON, runnable on a CPU.

    python benchmarks/report.py benchmarks/results/<name>.json [--out DIR]

writes ``<name>.md`` and ``<name>.png`` beside the JSON (or into DIR) and prints the markdown.
The JSON is what ``benchmarks/bench_attention.py`` writes: ``{"header": {...}, "rows": [...],
"memory": [...], "variants": [...]}``; the row fields are documented there. Variants rows (``--shapes
variants``) get their own tables: sliding window against full causal, feature costs, SDPA masks.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

Row = dict[str, Any]

OURS = "flashtile"
"""The provider under test: ratio columns are its TFLOP/s (or MiB) over each peer's."""
PASS_ORDER = {"fwd": 0, "bwd": 1}
MISSING = "—"
FORWARD_FAILED = "not run: the forward failed"
"""The error of a bwd row whose fwd failed; the fwd row carries the reason."""


def load(path: Path) -> dict[str, Any]:
    """Read a benchmark JSON file."""
    with open(path) as f:
        return json.load(f)


def _providers(result: dict[str, Any]) -> list[str]:
    """Providers in the header's order, then any others found in the rows."""
    names = list(result["header"].get("providers", {}))
    for row in result["rows"] + result.get("memory", []) + result.get("variants", []):
        if row["provider"] not in names:
            names.append(row["provider"])
    return names


def _key(row: Row) -> tuple[str, int, int, bool, str]:
    """The table row a result belongs to: (dtype, D, N, causal, pass)."""
    return (row["dtype"], row["D"], row["N"], row["causal"], row["pass"])


def _sort_key(key: tuple[str, int, int, bool, str]) -> tuple[str, int, int, bool, int]:
    dtype, d, n, causal, pass_ = key
    return (dtype, d, n, causal, PASS_ORDER.get(pass_, len(PASS_ORDER)))


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _compact(values: Iterable[Any], key: Callable[[Any], Any] | None = None) -> str:
    """'{64, 128}': the sorted distinct values, for summaries of many rows."""
    return "{" + ", ".join(str(v) for v in sorted(set(values), key=key)) + "}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _short(n: int) -> str:
    """512, 1k, 16k: sequence lengths as axis labels."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def _speed_table(rows: list[Row], providers: list[str]) -> list[str]:
    """TFLOP/s per provider, one line per (D, N, causal, pass, dtype), then flashtile's ratios."""
    by_key: dict[tuple, dict[str, Row]] = defaultdict(dict)
    for row in rows:
        by_key[_key(row)][row["provider"]] = row
    peers = [p for p in providers if p != OURS]
    ratio_cols = [f"ft/{p}" for p in peers] + ["ft/best"] if OURS in providers else []
    header = ["D", "N", "causal", "pass", "dtype", *providers, *ratio_cols]
    body = []
    for key in sorted(by_key, key=_sort_key):
        dtype, d, n, causal, pass_ = key
        cells = by_key[key]
        speeds = {p: cells[p]["tflops"] for p in providers if p in cells and cells[p]["tflops"] is not None}
        line = [str(d), str(n), _yes_no(causal), pass_, dtype]
        for p in providers:
            if p not in speeds:
                line.append(MISSING)
            else:
                line.append(f"{speeds[p]:.0f}" + (" (!)" if cells[p]["flagged"] else ""))
        if ratio_cols:
            ours = speeds.get(OURS)
            peer_speeds = [speeds[p] for p in peers if p in speeds and not cells[p]["flagged"]]
            for p in peers:
                line.append(f"{ours / speeds[p]:.2f}" if ours and p in speeds else MISSING)
            line.append(f"{ours / max(peer_speeds):.2f}" if ours and peer_speeds else MISSING)
        body.append(line)
    return _table(header, body)


def _failures(rows: list[Row], noun: str, where: Callable[[list[Row]], str] | None = None) -> list[str]:
    """One bullet per (provider, reason): how many rows (``noun``) it cost and which shapes (``where`` of
    the failed rows; by default their D, N and, for timed rows, causal and pass).

    bwd rows skipped because their fwd failed are counted in one closing line, not listed.
    """
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    skipped = 0
    for row in rows:
        if row["error"] == FORWARD_FAILED:
            skipped += 1
        elif row["error"] is not None:
            groups[(row["provider"], row["error"])].append(row)
    lines = []
    for (provider, reason), failed in sorted(groups.items()):
        lines.append(f"- **{provider}**, {_plural(len(failed), noun)} ({(where or _shapes)(failed)}): {reason}")
    if skipped:
        lines.append(f"- {_plural(skipped, 'bwd row')} not run because the fwd failed (reasons above).")
    return lines


def _shapes(failed: list[Row]) -> str:
    """The D, N (and causal, pass for timed rows) of failed rows of the standard table."""
    where = f"D {_compact(r['D'] for r in failed)}, N {_compact(r['N'] for r in failed)}"
    if "pass" in failed[0]:
        causal = _compact(_yes_no(r["causal"]) for r in failed)
        where += f", causal {causal}, pass {_compact((r['pass'] for r in failed), key=PASS_ORDER.get)}"
    return where


def _variant_shapes(failed: list[Row]) -> str:
    """The variants, N and passes of failed rows of the variants table."""
    labels = ", ".join(dict.fromkeys(r["label"] for r in failed))
    passes = _compact((r["pass"] for r in failed), key=PASS_ORDER.get)
    return f"{labels}; N {_compact(r['N'] for r in failed)}; pass {passes}"


def _accuracy(rows: list[Row], providers: list[str]) -> list[str]:
    """Worst max abs difference from the accuracy reference (sdpa_flash), per provider and pass."""
    body = []
    for provider in providers:
        for pass_ in PASS_ORDER:
            checked = [
                r for r in rows if r["provider"] == provider and r["pass"] == pass_ and r["max_abs_diff"] is not None
            ]
            flagged = [r for r in rows if r["provider"] == provider and r["pass"] == pass_ and r["flagged"]]
            if not checked and not flagged:
                continue
            worst = max(checked, key=lambda r: r["max_abs_diff"]) if checked else None
            at = (
                f"D={worst['D']} N={worst['N']} causal={_yes_no(worst['causal'])} {worst['dtype']}"
                if worst
                else MISSING
            )
            value = f"{worst['max_abs_diff']:.2e}" if worst else MISSING
            body.append([provider, pass_, value, at, str(len(flagged))])
    if not body:
        return []
    return _table(["provider", "pass", "worst max abs diff", "at", "rows flagged (!)"], body)


def _memory_table(rows: list[Row], providers: list[str]) -> list[str]:
    """Peak extra MiB per provider, one line per (N, dtype)."""
    by_key: dict[tuple[str, int], dict[str, Row]] = defaultdict(dict)
    for row in rows:
        by_key[(row["dtype"], row["N"])][row["provider"]] = row
    present = [p for p in providers if any(r["provider"] == p for r in rows)]
    peers = [p for p in present if p != OURS]
    ratio_cols = [f"ft/{p}" for p in peers] if OURS in present else []
    first = rows[0]
    header = ["N", "dtype", *present, *ratio_cols]
    body = []
    for dtype, n in sorted(by_key):
        cells = by_key[(dtype, n)]
        mib = {p: cells[p]["peak_extra_mib"] for p in present if p in cells}
        line = [str(n), dtype] + [f"{mib[p]:.0f}" if mib.get(p) is not None else MISSING for p in present]
        ours = mib.get(OURS)
        for p in peers:
            line.append(f"{ours / mib[p]:.2f}" if ours is not None and mib.get(p) else MISSING)
        body.append(line)
    title = (
        f"Peak extra memory of forward+backward, MiB (B={first['B']}, H={first['H']}, "
        f"D={first['D']}, causal={_yes_no(first['causal'])})"
    )
    return [title, "", *_table(header, body)]


# ---------------------------------------------------------------- variants (--shapes variants)

SECTIONS = {
    "window": "Sliding window against full causal",
    "features": "Feature costs",
    "mask": "SDPA attn_mask against torch's SDPA with the same mask",
}
BASELINES = {"window": "causal", "features": "baseline"}
"""The variant each row of a section is divided by (same N, dtype and pass)."""


def _ms(value: float | None) -> str:
    return MISSING if value is None else f"{value:.3g}"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}" if num is not None and den else MISSING


def _section_note(section: str, rows: list[Row]) -> str:
    """What a section's table holds and how to read it."""
    first = rows[0]
    shape = f"{first['dtype']}, D={first['D']}, H={first['H']}"
    flops = "TFLOP/s count only the visible (query, key) pairs: fwd 4·B·H·D·pairs, bwd 2.5 × fwd"
    peers = "`ft/x`: x's time over flashtile's (above 1: flashtile is faster)"
    if section == "window":
        window = next((r["window"] for r in rows if r["window"]), None)
        return (
            f"{shape}, B={first['B']} at every N, causal; "
            f"`window {tuple(window) if window else ''}`: flash_attn's window_size with causal=True, query i sees "
            f"keys i−{window[0] if window else 'left'} … i. ms: median. {flops}; full causal has N(N+1)/2 pairs "
            "(the standard table counts N²/2). "
            "`keys/q`: visible keys per query on average; `ms/1k q`: flashtile's ms per 1024 query tokens (flat in N "
            "when the cost follows the window); `÷ causal`: time over full causal at the same N (peers: in "
            f"brackets, over their own causal time); {peers}."
        )
    if section == "features":
        return (
            f"{shape}, causal, B·N = {first['B'] * first['N']}. ms: median. {flops}, N(N+1)/2 of them (GQA: "
            "counted over the query heads). "
            "`÷ base`: time over the baseline row at the same N (peers: in brackets, over their own baseline); "
            f"{peers}. Peers run the features they have; `{MISSING}` rows are listed below with the reason."
        )
    return (
        f"{shape}, non-causal; a boolean mask (True = attend, ~70% True) or an additive one (N(0, 1) in the "
        "inputs' dtype, no gradient) of the shape given, the same tensor for flashtile "
        "(flashtile.scaled_dot_product_attention) and torch's SDPA. ms: median. TFLOP/s over all N² pairs. "
        f"{peers}."
    )


def _variant_table(section: str, rows: list[Row], providers: list[str]) -> list[str]:
    """One line per (dtype, N, variant, pass): flashtile's ms, TFLOP/s and ratio to the section's baseline,
    then each peer's ms (and its own ratio), then flashtile's speed over each peer's."""
    order = {label: i for i, label in enumerate(dict.fromkeys(r["label"] for r in rows))}
    cells: dict[tuple, dict[str, Row]] = defaultdict(dict)
    for row in rows:
        cells[(row["dtype"], row["N"], row["label"], row["pass"])][row["provider"]] = row
    base_variant = BASELINES.get(section)
    base_label = {r["variant"]: r["label"] for r in rows}.get(base_variant or "")
    peers = [p for p in dict.fromkeys(r["provider"] for r in rows) if p != OURS]  # the order they ran in
    base_col = {"window": "÷ causal", "features": "÷ base"}.get(section)
    header = ["N", "B", "variant", "pass"] + (["keys/q"] if section == "window" else [])
    header += [f"{OURS} ms"] + (["ms/1k q"] if section == "window" else []) + ["TFLOP/s"]
    header += ([base_col] if base_col else []) + [f"{p} ms" for p in peers] + [f"ft/{p}" for p in peers]
    body = []
    for key in sorted(cells, key=lambda k: (k[0], k[1], order[k[2]], PASS_ORDER.get(k[3], 9))):
        dtype, n, label, pass_ = key
        here = cells[key]
        base = cells.get((dtype, n, base_label, pass_), {}) if base_label else {}

        def ms(provider: str, rows_: dict[str, Row] = here) -> float | None:
            row = rows_.get(provider)
            return None if row is None else row["ms"]

        any_row = next(iter(here.values()))
        ours = here.get(OURS)
        flag = " (!)" if ours is not None and ours["flagged"] else ""
        line = [str(n), str(any_row["B"]), label, pass_]
        if section == "window":
            line.append(f"{any_row['pairs'] / n:.0f}")
        line.append(_ms(ms(OURS)) + (flag if ms(OURS) is not None else ""))
        if section == "window":
            line.append(MISSING if ms(OURS) is None else f"{ms(OURS) / (any_row['B'] * n / 1024):.3g}")
        line.append(MISSING if ours is None or ours["tflops"] is None else f"{ours['tflops']:.0f}")
        if base_col:
            line.append(_ratio(ms(OURS), ms(OURS, base)))
        for p in peers:
            cell = _ms(ms(p))
            if cell != MISSING and here[p]["flagged"]:
                cell += " (!)"
            if cell != MISSING and base_col and base_label != label and ms(p, base) is not None:
                cell += f" ({_ratio(ms(p), ms(p, base))})"
            line.append(cell)
        line += [_ratio(ms(p), ms(OURS)) for p in peers]
        body.append(line)
    return _table(header, body)


def _variant_accuracy(rows: list[Row], providers: list[str]) -> list[str]:
    """Worst max abs difference from each case's reference, per provider and pass; the notes (repeatability)."""
    body = []
    for provider in providers:
        for pass_ in PASS_ORDER:
            mine = [r for r in rows if r["provider"] == provider and r["pass"] == pass_]
            checked = [r for r in mine if r["max_abs_diff"] is not None]
            flagged = [r for r in mine if r["flagged"]]
            if not checked:
                continue
            worst = max(checked, key=lambda r: r["max_abs_diff"])
            at = f"N={worst['N']} {worst['label']} {worst['dtype']} (vs {worst['reference']})"
            body.append([provider, pass_, f"{worst['max_abs_diff']:.2e}", at, str(len(checked)), str(len(flagged))])
    lines = []
    if body:
        header = ["provider", "pass", "worst max abs diff", "at", "rows checked", "rows flagged (!)"]
        lines += ["", "Accuracy against each case's reference (max abs difference):", "", *_table(header, body)]
    notes = [r for r in rows if r.get("note")]
    if notes:
        lines += [""] + [f"- {r['provider']}, N={r['N']} {r['label']} {r['pass']}: {r['note']}" for r in notes]
    return lines


def _variants_markdown(rows: list[Row], providers: list[str]) -> list[str]:
    lines = ["", "## Variants: windows, features, masks"]
    for section, title in SECTIONS.items():
        mine = [r for r in rows if r["section"] == section]
        if mine:
            lines += [
                "",
                f"### {title}",
                "",
                _section_note(section, mine),
                "",
                *_variant_table(section, mine, providers),
            ]
    lines += _variant_accuracy(rows, providers)
    failures = _failures(rows, "row", _variant_shapes)
    if failures:
        lines += ["", "Not run, unsupported or failed:", "", *failures]
    return lines


def variant_summary(result: dict[str, Any]) -> list[str]:
    """A dozen lines for a terminal: flashtile's window/causal ratios and flat cost, feature ratios, masks."""
    rows = result.get("variants", [])
    ours = {(r["section"], r["dtype"], r["N"], r["label"], r["pass"]): r["ms"] for r in rows if r["provider"] == OURS}
    peer = {(r["provider"], r["dtype"], r["N"], r["label"], r["pass"]): r["ms"] for r in rows if r["provider"] != OURS}

    def pair(section: str, dtype: str, n: int, label: str) -> tuple[float | None, float | None]:
        return ours.get((section, dtype, n, label, "fwd")), ours.get((section, dtype, n, label, "bwd"))

    def fb(values: tuple[float | None, float | None]) -> str:
        return "/".join(_ms(v) for v in values)

    lines = ["", "Summary (flashtile; fwd/bwd):"]
    for dtype in sorted({r["dtype"] for r in rows}):
        window = [r for r in rows if r["section"] == "window" and r["dtype"] == dtype]
        labels = {r["variant"]: r["label"] for r in window}
        for n in sorted({r["N"] for r in window}):
            causal, win = (
                pair("window", dtype, n, labels.get("causal", "")),
                pair("window", dtype, n, labels.get("window", "")),
            )
            b = next(r["B"] for r in window if r["N"] == n)
            per_1k = "/".join(MISSING if v is None else f"{v / (b * n / 1024):.3g}" for v in win)
            ratio = "/".join(_ratio(w, c) for w, c in zip(win, causal, strict=True))
            lines.append(
                f"  {dtype} N={n}: causal {fb(causal)} ms, {labels.get('window')} {fb(win)} ms "
                f"(÷ causal {ratio}; ms per 1k queries {per_1k})"
            )
        features = [r for r in rows if r["section"] == "features" and r["dtype"] == dtype]
        for n in sorted({r["N"] for r in features}):
            labels_n = list(dict.fromkeys(r["label"] for r in features if r["N"] == n))
            base = next((r["label"] for r in features if r["variant"] == "baseline"), "")
            b_ms = pair("features", dtype, n, base)
            cells = [
                f"{label.replace(' (H,)', '')} "
                + "/".join(_ratio(v, bv) for v, bv in zip(pair("features", dtype, n, label), b_ms, strict=True))
                for label in labels_n
                if label != base
            ]
            lines.append(f"  {dtype} N={n} ÷ baseline ({fb(b_ms)} ms): " + " | ".join(cells))
        masks = [r for r in rows if r["section"] == "mask" and r["dtype"] == dtype]
        for n in sorted({r["N"] for r in masks}):
            cells = []
            for label in dict.fromkeys(r["label"] for r in masks if r["N"] == n):
                mine = pair("mask", dtype, n, label)
                eff = tuple(peer.get(("sdpa_efficient", dtype, n, label, p)) for p in PASS_ORDER)
                speed = "/".join(_ratio(e, m) for e, m in zip(eff, mine, strict=True))
                cells.append(f"{label} {fb(mine)} ms (ft/sdpa_efficient {speed})")
            lines.append(f"  {dtype} N={n} masks: " + " | ".join(cells))
    failed = sum(1 for r in rows if r["provider"] == OURS and r["error"] is not None)
    flagged = sum(1 for r in rows if r["flagged"])
    lines.append(f"  flashtile rows without a time: {failed}; rows flagged (!) for accuracy: {flagged}")
    return lines


def _provenance(head: dict[str, Any]) -> list[str]:
    """Bullets: GPU and versions, commit and date, command, method notes, provider legend."""
    lines = [
        f"- GPU: {head.get('gpu')} (driver {head.get('driver')}); torch {head.get('torch')} "
        f"(CUDA {head.get('cuda')}), triton {head.get('triton')}, cuDNN {head.get('cudnn')}, "
        f"flash-attn-4 {head.get('flash_attn_4') or 'not installed'}",
        f"- flashtile commit: {head.get('commit')}; date: {head.get('date')}",
        f"- command: `{head.get('command')}`",
    ]
    lines += [f"- {name}: {text}" for name, text in head.get("notes", {}).items()]
    lines += [f"- `{name}`: {text}" for name, text in head.get("providers", {}).items()]
    return lines + [""]


def markdown(result: dict[str, Any], provenance: bool = True) -> str:
    """The report as markdown: provenance (unless left out), speed table, accuracy, failures, memory,
    variants."""
    providers = _providers(result)
    rows, memory, variants = result["rows"], result.get("memory", []), result.get("variants", [])
    lines = ["# Attention benchmark", ""]
    if result["header"].get("dry_run"):
        lines += ["**Dry run on the CPU at tiny sizes: it checks the plumbing; the times mean nothing.**", ""]
    if provenance:
        lines += _provenance(result["header"])
    if rows:
        lines += [
            "TFLOP/s, median. `(!)`: output or gradients differ from the reference beyond tolerance;",
            f"`{MISSING}`: missing (reasons below); `ft/x`: flashtile's TFLOP/s over x's;",
            "`ft/best`: over the fastest unflagged peer on that row.",
            "",
            *_speed_table(rows, providers),
        ]
        accuracy = _accuracy(rows, providers)
        if accuracy:
            lines += ["", "Accuracy against the reference (max abs difference):", "", *accuracy]
    failures = _failures(rows, "speed row") + _failures(memory, "memory row")
    if failures:
        lines += ["", "Missing or failed:", "", *failures]
    if memory:
        lines += ["", *_memory_table(memory, providers)]
    if variants:
        lines += _variants_markdown(variants, providers)
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """TFLOP/s against N, one line per provider (and dtype), one panel per (D, causal, pass).

    Flagged points are drawn with an 'x'. Returns False (and writes nothing) when the result has
    no speed rows, e.g. a memory-only run.
    """
    rows = [r for r in result["rows"] if r["tflops"] is not None]
    if not rows:
        return False
    providers = _providers(result)
    dims = sorted({r["D"] for r in rows})
    panels = sorted({(r["causal"], r["pass"]) for r in rows}, key=lambda cp: (cp[0], PASS_ORDER[cp[1]]))
    dtypes = sorted({r["dtype"] for r in rows})
    lengths = sorted({r["N"] for r in rows})
    styles = dict(zip(dtypes, ["-", "--", ":"], strict=False))
    colors = {p: f"C{i}" for i, p in enumerate(providers)}

    fig = Figure(figsize=(4.2 * len(panels), 3.3 * len(dims) + 0.8), layout="constrained")
    axes = fig.subplots(len(dims), len(panels), squeeze=False, sharex=True)
    for i, d in enumerate(dims):
        for j, (causal, pass_) in enumerate(panels):
            ax = axes[i][j]
            for provider in providers:
                for dtype in dtypes:
                    pts = sorted(
                        (r["N"], r["tflops"], r["flagged"])
                        for r in rows
                        if (r["provider"], r["dtype"], r["D"], r["causal"], r["pass"])
                        == (provider, dtype, d, causal, pass_)
                    )
                    if not pts:
                        continue
                    label = provider if len(dtypes) == 1 else f"{provider} {dtype}"
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        styles[dtype],
                        marker="o",
                        markersize=3,
                        color=colors[provider],
                        linewidth=2.4 if provider == OURS else 1.4,
                        label=label,
                    )
                    bad = [p for p in pts if p[2]]
                    if bad:
                        ax.plot([p[0] for p in bad], [p[1] for p in bad], "x", color="red", markersize=9)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [_short(n) for n in lengths])
            ax.minorticks_off()
            ax.set_title(f"D={d}, causal={_yes_no(causal)}, {pass_}", fontsize=10)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if i == len(dims) - 1:
                ax.set_xlabel("N (sequence length)")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
    legend: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    if any(r["flagged"] for r in rows):
        legend["accuracy flagged"] = Line2D([], [], linestyle="", marker="x", color="red", markersize=9)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=min(len(legend), 6))
    head = result["header"]
    fig.suptitle(
        f"{head.get('gpu')}, torch {head.get('torch')}, flashtile {str(head.get('commit'))[:12]}, "
        f"B·N={head.get('total_tokens')}, hidden {head.get('hidden')}",
        fontsize=11,
    )
    fig.savefig(path, dpi=110)
    return True


def write_reports(json_path: Path, out_dir: Path | None = None) -> tuple[Path, Path | None]:
    """Write ``<stem>.md`` and ``<stem>.png`` for ``json_path`` and return their paths.

    The png path is None when there was nothing to plot.
    """
    result = load(json_path)
    out_dir = json_path.parent if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path = out_dir / f"{json_path.stem}.md"
    png_path = out_dir / f"{json_path.stem}.png"
    md_path.write_text(markdown(result))
    return md_path, (png_path if plot(result, png_path) else None)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: regenerate the markdown and the png from a benchmark JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a JSON file written by bench_attention.py")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: beside the JSON)")
    args = parser.parse_args(argv)
    md_path, png_path = write_reports(args.json, args.out)
    print(md_path.read_text())
    print(f"wrote {md_path}" + (f" and {png_path}" if png_path else ""))


if __name__ == "__main__":
    main()
