"""Packed (varlen) batches against padded ones, on the GPU.

    PYTHONPATH=src python3 benchmarks/bench_varlen.py --out DIR

Rows (bf16, H=16, D=128, causal and not, forward and forward+backward):
- one 16k sequence next to 63 sequences of 256 tokens: ``flash_attn_varlen_func`` on the packed tokens
  against the time of the 16k sequence alone (the packed batch should cost about what its tokens cost;
  the (64, 16384) padded batch would cost ~64x the 16k sequence, ~7 s a forward, so it is not timed);
- 64 sequences of uniform random length in [1, 4096]: packed against padded to the longest.
Timing: ``triton.testing.do_bench`` median; the backward's dout is all ones. Writes ``varlen.jsonl`` (the
records of ``flashtile.bench.results``: per row the packed batch, the padded batch and the longest sequence
alone, ``config["layout"]`` saying which) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import triton

import flashtile
from flashtile.bench import results

NHEADS, HEAD_DIM = 16, 128
MAX_PADDED = 64 * 4096  # tokens of the largest padded batch timed


def _time(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def _packed(lengths: list[int], causal: bool, backward: bool) -> float:
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, NHEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        for _ in range(3)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    longest = max(lengths)

    def run():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
        if backward:
            out.backward(torch.ones_like(out))

    return _time(run)


def _padded(batch: int, seqlen: int, causal: bool, backward: bool) -> float:
    q, k, v = (
        torch.randn(batch, seqlen, NHEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        for _ in range(3)
    )

    def run():
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        if backward:
            out.backward(torch.ones_like(out))

    return _time(run)


def records(env: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[results.Record]:
    """The rows as records: the packed batch, the padded batch (where timed) and the longest sequence alone."""
    found = []
    for r in rows:
        shape = {"dtype": "bf16", "batch": r["batch"], "H": NHEADS, "D": HEAD_DIM, "causal": r["causal"]}
        for config, key in (
            ("packed", "packed_ms"),
            ("padded", "padded_ms"),
            ("longest sequence alone", "longest_alone_ms"),
        ):
            ms = r[key]
            error = None if ms is not None else "not timed: the padded batch is too large"
            found.append(results.record(env, "varlen", "flashtile", shape, r["pass"], config={"layout": config},
                                        time_ms=ms, error=error))  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: from git)")
    args = parser.parse_args()
    env = results.environment(torch.device("cuda"), args.commit)
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "16k + 63 x 256": [16384] + [256] * 63,
        "64 x U[1, 4096]": torch.randint(1, 4097, (64,), generator=generator).tolist(),
    }
    rows = []
    for (name, lengths), causal, backward in (
        (item, c, b) for item in shapes.items() for c in (False, True) for b in (False, True)
    ):
        row = {"batch": name, "causal": causal, "pass": "fwd+bwd" if backward else "fwd"}
        row["packed_ms"] = _packed(lengths, causal, backward)
        padded_tokens = len(lengths) * max(lengths)
        row["padded_ms"] = (
            _padded(len(lengths), max(lengths), causal, backward) if padded_tokens <= MAX_PADDED else None
        )
        row["longest_alone_ms"] = _packed([max(lengths)], causal, backward)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
        results.write(args.out / "varlen.jsonl", records(env, rows))
    print("\n| batch | causal | pass | packed ms | padded ms | longest alone ms |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['causal']} | {r['pass']} | {r['packed_ms']:.3f} | "
            f"{'-' if r['padded_ms'] is None else format(r['padded_ms'], '.3f')} "
            f"| {r['longest_alone_ms']:.3f} |"
        )


if __name__ == "__main__":
    main()
