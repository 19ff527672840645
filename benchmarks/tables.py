"""The tables of docs/performance.md (and the README's), printed as markdown from a results file.

    PYTHONPATH=src python3 benchmarks/tables.py [benchmarks/results/h200.jsonl ...]

Every number in those documents comes from the records of ``flashtile.bench.results`` in the files given (default:
the H200's). A section per benchmark, each run named by its date and commit; within a table the implementations
were measured in the same process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from flashtile.bench import results
from flashtile.bench.results import OURS, Record

DEFAULT = Path(__file__).resolve().parent / "results" / "h200.jsonl"
ATTENTION_PEERS = ("sdpa_flash", "flex", "cudnn", "fa4")


def _runs(records: Sequence[Record], benchmark: str) -> dict[str, list[Record]]:
    """The records of one benchmark by commit, in file order."""
    runs: dict[str, list[Record]] = {}
    for rec in records:
        if rec["benchmark"] == benchmark:
            runs.setdefault(rec["commit"], []).append(rec)
    return runs


def _print(title: str, header: Sequence[str], body: Sequence[Sequence[str]], records: Sequence[Record]) -> None:
    print(f"### {title}\n\n{results.provenance(records)}\n\n{results.markdown(header, body)}")


def attention(records: Sequence[Record]) -> None:
    """TFLOP/s per (D, N, causal, pass) of every run and dtype, with flashtile's ratio to cuDNN and FA4."""
    for commit, run in _runs(records, "attention").items():
        for dtype in dict.fromkeys(r["shape"]["dtype"] for r in run):
            rows = [r for r in run if r["shape"]["dtype"] == dtype]
            measured = {r["implementation"] for r in rows if r["tflops"] is not None}
            peers = [p for p in ATTENTION_PEERS if p in measured]
            ratios = [p for p in ("cudnn", "fa4") if p in measured]
            header, body = results.table(rows, ("D", "N", "causal", "pass"), "tflops", [OURS, *peers], ratios)
            _print(f"Attention, {dtype}, TFLOP/s ({commit})", header, body, rows)


def summary(records: Sequence[Record], commit: str = "fa95de2", dtype: str = "bf16") -> None:
    """The README's short table: D=128 at 4k and 16k, every pass and mask."""
    rows = [r for r in _runs(records, "attention").get(commit, []) if r["shape"]["dtype"] == dtype
            and r["shape"]["D"] == 128 and r["shape"]["N"] in (4096, 16384)]  # fmt: skip
    if not rows:
        return
    header, body = results.table(rows, ("N", "causal", "pass"), "tflops", [OURS, *ATTENTION_PEERS], ("cudnn", "fa4"))
    _print(f"README: {dtype}, D=128, TFLOP/s ({commit})", header, body, rows)


def memory(records: Sequence[Record]) -> None:
    for commit, run in _runs(records, "attention-memory").items():
        header, body = results.table(run, ("dtype", "N"), "memory_mib", ratios_against=["sdpa_flash"])
        _print(f"Peak extra memory of forward+backward, MiB ({commit})", header, body, run)


def variants(records: Sequence[Record]) -> None:
    for commit, run in _runs(records, "attention-variants").items():
        measured = list(dict.fromkeys(r["implementation"] for r in run if r["time_ms"] is not None))
        keys = ("section", "variant", "B", "N", "pass")
        header, body = results.table(run, keys, "time_ms", measured, digits=3)
        _print(f"Variants, ms ({commit})", header, body, run)


def _by(field: str) -> Callable[[Record], str]:
    """A column name from one config field."""
    return lambda rec: str(rec["config"].get(field))


def varlen(records: Sequence[Record]) -> None:
    for commit, run in _runs(records, "varlen").items():
        header, body = results.table(run, ("batch", "causal", "pass"), "time_ms", digits=3, column=_by("layout"))
        _print(f"Packed (varlen) batches, ms ({commit})", header, body, run)


def _decode_column(rec: Record) -> str:
    launch = rec["config"].get("launch")
    return rec["implementation"] + (f" ({launch})" if launch else "")


def decode(records: Sequence[Record]) -> None:
    """µs per step of flashtile (graph replay and eager), SDPA, cuDNN (and the page gather), by layout."""
    for commit, run in _runs(records, "decode").items():
        for layout in ("contiguous", "paged"):
            rows = [r for r in run if r["shape"]["layout"] == layout]
            columns = ["flashtile (graph)", "flashtile (eager, value checks off)", "sdpa", "cudnn"]
            columns += ["gather"] if layout == "paged" else []
            us = [dict(r, time_ms=r["time_ms"] and r["time_ms"] * 1e3) for r in rows]
            header, body = results.table(
                us, ("B", "context", "Hq"), "time_ms", columns, digits=1, column=_decode_column
            )
            graph = {(r["shape"]["B"], r["shape"]["context"], r["shape"]["Hq"]): r for r in rows
                     if _decode_column(r) == "flashtile (graph)"}  # fmt: skip
            peers = {(r["shape"]["B"], r["shape"]["context"], r["shape"]["Hq"], r["implementation"]): r["time_ms"]
                     for r in rows if r["implementation"] in ("sdpa", "cudnn", "gather")}  # fmt: skip
            header += ["TB/s", "vs SDPA" + (" + gather" if layout == "paged" else ""), "vs cuDNN"]
            for line in body:
                key = (int(line[0]), int(line[1]), int(line[2]))
                ours = graph[key]["time_ms"]
                sdpa = peers.get((*key, "sdpa"))
                sdpa = sdpa and sdpa + (peers.get((*key, "gather")) or 0.0)
                cudnn = peers.get((*key, "cudnn"))
                line += [f"{graph[key]['tbps']:.2f}", f"{sdpa / ours:.2f}" if sdpa else "-",
                         f"{cudnn / ours:.2f}" if cudnn else "-"]  # fmt: skip
            _print(f"Decode, {layout} cache, µs per step ({commit})", header, body, rows)


def latency(records: Sequence[Record]) -> None:
    """Eager and graph-replay times of flashtile and FA2 at small sizes, with the host time of an eager call."""
    for commit, run in _runs(records, "latency").items():
        run = [r for r in run if "gluon launch" not in r["config"]]  # the A/B of the direct launches: see the log

        def column(rec: Record) -> str:
            return f"{results.label(rec['implementation'])} {rec['config']['launch']}"

        header, body = results.table(run, ("N", "causal", "pass"), "time_ms", digits=3, column=column)
        host = {}
        for rec in run:
            if rec["config"]["launch"] == "eager":
                key = (str(rec["shape"]["N"]), "yes" if rec["shape"]["causal"] else "no", rec["pass"])
                host.setdefault(key, {})[rec["implementation"]] = rec["extra"]["host_us"]
        header += ["host µs flashtile", "host µs FA2"]
        for line in body:
            line += [f"{host[tuple(line[:3])][name]:.0f}" for name in (OURS, "sdpa_flash")]
        _print(f"Small problems, ms ({commit})", header, body, run)
    for commit, run in _runs(records, "first-call").items():
        header, body = results.table(run, ("B", "N", "H", "D"), "time_ms", digits=0, column=_by("kernel cache"))
        _print(f"First forward+backward of a new shape, ms ({commit})", header, body, run)


def ring(records: Sequence[Record]) -> None:
    for commit, run in _runs(records, "ring").items():
        header = ["N", "GPUs", "fwd+bwd ms", "fwd+bwd efficiency", "fwd ms", "fwd efficiency", "peak GiB per GPU"]
        body = []
        rows: dict[tuple[int, int], dict[str, Record]] = {}
        for rec in run:
            rows.setdefault((rec["shape"]["N"], rec["gpus"]), {})[rec["pass"]] = rec
        for (n, gpus), passes in rows.items():
            both, fwd = passes["fwd+bwd"], passes["fwd"]

            def efficiency(rec: Record) -> str:
                value = rec["extra"].get("efficiency")
                return "-" if value is None else f"{value:.2f}"

            body.append([str(n), str(gpus), f"{both['time_ms']:.1f}", efficiency(both), f"{fwd['time_ms']:.1f}",
                         efficiency(fwd), f"{both['memory_mib'] / 1024:.2f}"])  # fmt: skip
        _print(f"Ring attention ({commit})", header, body, run)
    for commit, run in _runs(records, "ring-longest").items():
        header = ["GPUs", "longest N that fit", "peak GiB per GPU there", "first N that did not fit"]
        body = []
        for gpus in sorted({r["gpus"] for r in run}):
            fit = [r for r in run if r["gpus"] == gpus and r["error"] is None]
            failed = [r for r in run if r["gpus"] == gpus and r["error"] is not None]
            best = max(fit, key=lambda r: r["shape"]["N"])
            body.append([str(gpus), str(best["shape"]["N"]), f"{best['memory_mib'] / 1024:.1f}",
                         str(min(r["shape"]["N"] for r in failed)) if failed else "-"])  # fmt: skip
        _print(f"Longest sequence, forward+backward, causal with a 4096-key window ({commit})", header, body, run)


def io(records: Sequence[Record]) -> None:
    """HBM bytes per pass: the floor and the model's against Nsight Compute's count, and standard attention's (model)
    over flashtile's measured bytes; MB = 10^6 bytes."""
    for commit, run in _runs(records, "io").items():
        header = ["D", "N", "B", "pass", "floor MB", "model MB", "ncu MB", "ncu / model", "standard MB",
                  "standard / ncu"]  # fmt: skip
        body = []
        for rec in sorted(run, key=lambda r: (r["shape"]["D"], r["shape"]["N"], r["pass"] != "fwd")):
            e, shape = rec["extra"], rec["shape"]
            ncu = e.get("ncu_bytes")
            ratio = None if ncu is None else e["standard_bytes"] / ncu
            body.append([str(shape["D"]), str(shape["N"]), str(shape["B"]), rec["pass"],
                         f"{e['floor_bytes'] / 1e6:.1f}", f"{e['model_bytes'] / 1e6:.1f}",
                         "-" if ncu is None else f"{ncu / 1e6:.1f}",
                         "-" if ncu is None else f"{ncu / e['model_bytes']:.2f}", f"{e['standard_bytes'] / 1e6:.1f}",
                         "-" if ratio is None else f"{ratio:.0f}×" if ratio >= 100 else f"{ratio:.2g}×"])  # fmt: skip
        _print(f"HBM bytes per pass, model and Nsight Compute ({commit})", header, body, run)


def max_context(records: Sequence[Record]) -> None:
    """The longest sequence whose forward+backward fits, per implementation and number of GPUs."""
    for commit, run in _runs(records, "max-context").items():
        header = ["GPUs", "implementation", "longest N", "peak GiB per GPU", "fwd+bwd s", "predicted N",
                  "free GiB per GPU", "probes"]  # fmt: skip
        body = []
        for rec in run:
            e = rec["extra"]
            bound = "" if e["exact"] else " (lower bound: time budget)"
            free = e.get("free_mib")
            name = results.label(rec["implementation"]) + (f", {rec['config']['method']}" if rec["gpus"] > 1 else "")
            body.append([str(rec["gpus"]), name, f"{rec['shape']['N']}{bound}",
                         "-" if rec["memory_mib"] is None else f"{rec['memory_mib'] / 1024:.1f}",
                         "-" if rec["time_ms"] is None else f"{rec['time_ms'] / 1e3:.1f}", str(e["predicted_N"] or "-"),
                         "-" if free is None else f"{free / 1024:.1f}", str(len(e["probes"]))])  # fmt: skip
        _print(f"Longest sequence, forward+backward, causal ({commit})", header, body, run)


def main(argv: Sequence[str]) -> None:
    records = results.load(*(Path(arg) for arg in argv)) if argv else results.load(DEFAULT)
    for section in (summary, attention, memory, variants, varlen, decode, latency, ring, io, max_context):
        section(records)


if __name__ == "__main__":
    main(sys.argv[1:])
