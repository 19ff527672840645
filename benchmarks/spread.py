"""Does a short causal forward's speed follow where its inputs lie in memory, or the host?

    PYTHONPATH=src python3 benchmarks/spread.py [--copies 6] [--dtype bf16|fp16] [--grad] [--out DIR]

A short causal forward (D=256 N=512, D=64 N=1k) was seen to keep one speed within a process and change it from
one process to the next (~200 against ~320 TFLOP/s), while D=128 N=1k stayed put. This times, in one process,
several copies of the same inputs (each a fresh allocation, kept alive, so each lies on other memory), each copy
three times (do_bench median, L2 flushed), beside the host time of one call (``latency.host_time``: queued behind a
GPU sleep, so no call waits for the GPU). Speeds that follow the copy point at placement (L2 slices, pages); speeds
that stay per process and track the host time point at the launch path. Run it in several fresh processes to see
both. On the H200 (2026-11-30, d36b862; docs/tuning/host-path.md) every slow sample sat beside a host-time spike,
whatever the copy. ``--grad``: the inputs require grad, as in the standard table's forward rows
(``flashtile bench``), so the forward goes through the autograd Function's path; ``--dtype fp16`` for its fp16 rows.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from triton.testing import do_bench

import flashtile
from flashtile.bench.attention import DTYPES
from latency import host_time

SHAPES = [(32, 512, 8, 256), (16, 1024, 32, 64), (16, 1024, 16, 128)]
"""(batch, seqlen, heads, head dim), causal: the two that spread and one that did not."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=6)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--grad", action="store_true", help="inputs that require grad (the table's forward rows)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows, kept = [], []
    for batch, seqlen, nheads, head_dim in SHAPES:
        flops = 4 * batch * nheads * seqlen * seqlen * head_dim / 2
        for copy in range(args.copies):
            q, k, v = (
                torch.randn(
                    batch, seqlen, nheads, head_dim, device="cuda", dtype=DTYPES[args.dtype], requires_grad=args.grad
                )
                for _ in range(3)
            )
            kept.append((q, k, v))

            def forward(q=q, k=k, v=v):
                return flashtile.flash_attn_func(q, k, v, causal=True)

            out = forward()
            tflops = [flops / do_bench(forward, return_mode="median") * 1e-9 for _ in range(3)]
            offsets = {name: t.data_ptr() % 2**21 for name, t in (("q", q), ("k", k), ("v", v), ("out", out))}
            row = dict(shape=(batch, seqlen, nheads, head_dim), dtype=args.dtype, grad=args.grad, copy=copy,
                       tflops=tflops, host_us=host_time(forward, calls=30) * 1e6, offsets_2mib=offsets)  # fmt: skip
            rows.append(row)
            print(f"B={batch} N={seqlen} H={nheads} D={head_dim} copy {copy}: TFLOP/s "
                  f"{' '.join(f'{x:.0f}' for x in tflops)}  host {row['host_us']:.0f} us  "
                  f"ptr % 2 MiB {row['offsets_2mib']}", flush=True)  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"spread-{os.getpid()}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
