"""flashtile against one peer on chosen rows of the standard table, in interleaved rounds: a tie or a loss?

    PYTHONPATH=src python3 benchmarks/versus.py --row bf16,128,2048,0 [--row ...] [--peer cudnn] [--rounds 5]
        [--out DIR]

The standard table times each provider once per row, one after the other, so a row within a few percent of a peer
says little: the peers move by as much between runs (cuDNN's D=128 N=2k backward read 482 and 517 TFLOP/s in two
runs on 2026-11-30 and 2026-12-01). This times the rows named by ``--row DTYPE,D,N,CAUSAL`` (the standard shapes,
B·N = 16384 and H·D = 2048) with ``flashtile bench``'s own protocol (``Run.speed_case``: same inputs, accuracy
check, do_bench median, fwd and bwd), ``--rounds`` times, flashtile first in even rounds and the peer first in odd
ones, the inputs drawn again each round (same seed, new memory). Prints and writes (``--out``: versus.json) per row
and pass the ratio flashtile / peer of each round and their median, which is the number to read against 1.0.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from flashtile.bench.attention import DTYPES, PROVIDERS, Case, Run, parse_args

OURS = "flashtile"


def parse_row(text: str) -> Case:
    """'bf16,128,2048,0' -> the standard case of that dtype, head dim, length and causal flag (0/1)."""
    dtype, head_dim, seqlen, causal = text.split(",")
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"--row: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return Case.standard(dtype, int(head_dim), int(seqlen), causal == "1")


def round_ratios(rows: list[dict[str, Any]], peer: str) -> dict[tuple, list[float]]:
    """Per (dtype, D, N, causal, pass), flashtile's TFLOP/s over the peer's, one ratio per round in round order.

    ``rows``: flat speed rows (dtype, D, N, causal, pass, provider, tflops, flagged), each with a "round"; a round
    where either side has no time (an error) or was flagged (its output or gradients off the reference's beyond
    tolerance) gives no ratio."""
    times: dict[tuple, dict[str, float | None]] = {}
    for row in rows:
        key = (row["dtype"], row["D"], row["N"], row["causal"], row["pass"], row["round"])
        times.setdefault(key, {})[row["provider"]] = None if row["flagged"] else row["tflops"]
    ratios: dict[tuple, list[float]] = {}
    for key in sorted(times, key=lambda k: k[-1]):
        ours, theirs = times[key].get(OURS), times[key].get(peer)
        if ours and theirs:
            ratios.setdefault(key[:-1], []).append(ours / theirs)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", action="append", required=True, type=parse_row, help="DTYPE,D,N,CAUSAL (0/1)")
    parser.add_argument("--peer", choices=[p for p in PROVIDERS if p != OURS], default="cudnn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    run = Run(parse_args(["--out", str(args.out or Path("."))]))  # the standard table's settings (do_bench, L2)
    rows = []
    for r in range(args.rounds):
        order = [OURS, args.peer] if r % 2 == 0 else [args.peer, OURS]
        for case in args.row:
            for rec in run.speed_case(case, [PROVIDERS[name] for name in order]):
                flags = {"provider": rec["implementation"], "tflops": rec["tflops"], "pass": rec["pass"]}
                rows.append({**rec["shape"], **flags, "flagged": bool(rec["extra"].get("flagged")), "round": r})
    ratios = round_ratios(rows, args.peer)
    for (dtype, head_dim, seqlen, causal, pass_), values in ratios.items():
        print(f"{dtype} D={head_dim} N={seqlen} causal={int(causal)} {pass_}: flashtile / {args.peer} median "
              f"{statistics.median(values):.3f}  rounds {' '.join(f'{x:.3f}' for x in values)}")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = [dict(zip(("dtype", "D", "N", "causal", "pass"), key, strict=True), ratios=values,
                        median=statistics.median(values)) for key, values in ratios.items()]  # fmt: skip
        (args.out / "versus.json").write_text(json.dumps({"peer": args.peer, "rows": rows, "ratios": summary}))


if __name__ == "__main__":
    main()
