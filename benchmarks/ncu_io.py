"""flashtile's HBM bytes, the model (flashtile.iomodel) against Nsight Compute's DRAM counters, forward and backward.

    PYTHONPATH=src python3 benchmarks/ncu_io.py --out DIR [--lengths 1024,...,32768] [--head-dims 64,128] [--causal]
    PYTHONPATH=src python3 benchmarks/ncu_io.py --out DIR --dry-run      # tiny sizes on the CPU, the model only

bf16, the standard table's shapes (B * N = 16384 tokens, at least one sequence; H * D = 2048). Per shape and pass,
the model's bytes come from one forward and backward inside ``flashtile.profile()``
(``flashtile.bench.hbm.model_bytes``: the model of the kernels that ran), and ncu's from one child process per pass
under ``ncu --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum``
(``flashtile.bench.hbm.ncu_bytes``: warm-up passes first, then the measured one between
``torch.cuda.profiler.start()`` and ``stop()``), summed over the pass's kernels. ``--causal`` adds the causal rows.
Standard attention's bytes (S and P in HBM) are the model's.

Writes ``DIR/ncu_io.jsonl`` (``flashtile.bench.results`` records, benchmark ``io``: ``extra`` holds
``model_bytes``, ``floor_bytes``, ``ncu_bytes``, ``ncu_over_model``, ``standard_bytes`` and the ``path``; ``tbps``
stays empty, nothing is timed) and ``DIR/ncu_io.md`` (the table for docs/profiling.md, with standard / ncu; floor:
each tensor once, ``flashtile.iomodel``'s ``compulsory_bytes``). Each ncu run takes ~10-30 s (a fresh process;
kernels compile once, into Triton's cache): the default 6 lengths x 2 head dims x 2 passes take ~5-10 minutes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flashtile.bench import hbm, results

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (64, 128)
TOTAL_TOKENS, HIDDEN = 16384, 2048
DRY_RUN = {"lengths": (64, 128), "head_dims": (16, 32), "total_tokens": 128, "hidden": 64}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for ncu_io.jsonl and ncu_io.md")
    parser.add_argument("--lengths", type=_ints, default=LENGTHS, help="comma-separated N (default 1024..32768)")
    parser.add_argument("--head-dims", type=_ints, default=HEAD_DIMS, help="comma-separated D (default 64,128)")
    parser.add_argument("--causal", action="store_true", help="also the causal rows")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: from git)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: the model only, no ncu")
    return parser.parse_args(argv)


def measure(problem: hbm.Problem, device: torch.device, env: results.Record, use_ncu: bool) -> list[results.Record]:
    """The fwd and bwd records of one problem: the model's bytes, and ncu's where ``use_ncu``."""
    shape = {"dtype": problem.dtype, "B": problem.batch, "N": problem.seqlen, "H": problem.nheads,
             "D": problem.head_dim, "causal": problem.causal}  # fmt: skip
    model = hbm.model_bytes(problem, device)
    found = []
    for pass_ in ("fwd", "bwd"):
        found_model = model[pass_]
        extra = {"model_bytes": found_model["hbm_bytes"], "floor_bytes": found_model["min_hbm_bytes"],
                 "standard_bytes": found_model["standard_bytes"], "path": found_model["path"], "ncu_bytes": None,
                 "ncu_over_model": None}  # fmt: skip
        error = None if use_ncu else "not measured: a dry run on the CPU (ncu counts GPU memory)"
        if use_ncu:
            try:
                extra["ncu_bytes"] = hbm.ncu_bytes(problem, "flashtile", pass_)
                extra["ncu_over_model"] = extra["ncu_bytes"] / extra["model_bytes"]
            except hbm.NcuUnavailable as exc:
                error = str(exc)
        found.append(results.record(env, "io", results.OURS, shape, pass_, error=error, extra=extra))
    return found


def markdown(records: list[results.Record]) -> str:
    """The table: per shape and pass, the floor's, the model's and ncu's MB, ncu over the model, standard attention's
    MB and its ratio to ncu's (what flashtile saves)."""
    header = ["D", "N", "causal", "pass", "path", "floor MB", "model MB", "ncu MB", "ncu / model", "standard MB",
              "standard / ncu"]  # fmt: skip
    body = []
    for rec in records:
        s, x = rec["shape"], rec["extra"]
        measured = x["ncu_bytes"] is not None
        ncu = f"{x['ncu_bytes'] / 1e6:.1f}" if measured else "-"
        ratio = "-" if x["ncu_over_model"] is None else f"{x['ncu_over_model']:.2f}"
        saved = f"{x['standard_bytes'] / x['ncu_bytes']:.1f}×" if measured else "-"
        body.append([str(s["D"]), str(s["N"]), "yes" if s["causal"] else "no", rec["pass"], x["path"],
                     f"{x['floor_bytes'] / 1e6:.1f}", f"{x['model_bytes'] / 1e6:.1f}", ncu, ratio,
                     f"{x['standard_bytes'] / 1e6:.1f}", saved])  # fmt: skip
    errors = dict.fromkeys(rec["error"] for rec in records if rec["error"])
    lines = ["# HBM bytes: the model against Nsight Compute", "", results.provenance(records), "",
             results.markdown(header, body)]  # fmt: skip
    return "\n".join(lines + [f"- {e}" for e in errors]) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("ncu_io.py needs a CUDA GPU; --dry-run runs the model alone at tiny sizes on the CPU.")
        return 1
    if not args.dry_run and not hbm.ncu_available():
        print("ncu (Nsight Compute) is not on PATH: install it or add it, e.g. /usr/local/cuda/bin.")
        return 1
    device = torch.device("cpu" if args.dry_run else "cuda")
    sizes = DRY_RUN if args.dry_run else {"lengths": args.lengths, "head_dims": args.head_dims,
                                          "total_tokens": TOTAL_TOKENS, "hidden": HIDDEN}  # fmt: skip
    env = results.environment(device, args.commit)
    records: list[results.Record] = []
    for causal in (False, True) if args.causal else (False,):
        for head_dim in sizes["head_dims"]:
            for seqlen in sizes["lengths"]:
                batch, nheads = max(1, sizes["total_tokens"] // seqlen), max(1, sizes["hidden"] // head_dim)
                problem = hbm.Problem(batch, seqlen, nheads, head_dim, causal)
                records += measure(problem, device, env, use_ncu=not args.dry_run)
                results.write(args.out / "ncu_io.jsonl", records)
                last = records[-2:]
                print(f"D={head_dim} N={seqlen} causal={causal}: " + ", ".join(
                    f"{r['pass']} model {r['extra']['model_bytes'] / 1e6:.1f} MB ncu "
                    f"{'-' if r['extra']['ncu_bytes'] is None else round(r['extra']['ncu_bytes'] / 1e6, 1)} MB"
                    for r in last), flush=True)  # fmt: skip
    (args.out / "ncu_io.md").write_text(markdown(records))
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
