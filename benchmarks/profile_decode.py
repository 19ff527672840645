"""Which GPU kernels one decode step runs, and for how long: flash_attn_with_kvcache (CUDA-graph replay) against
SDPA on the same contiguous cache, under torch.profiler.

    PYTHONPATH=src python3 benchmarks/profile_decode.py [--contexts 1024,4096,16384] [--batch 1] [--nheads-q 32]
        [--paged] [--splits 0,8,16] [--out DIR]

Shapes as bench_decode.py (Hkv 8, D 128, bf16, one new token appended at context - 1). Per row and provider:
every kernel of the step with its mean device time (µs per step), the step's summed kernel time, and the
wall time of the profiled loop per step (host launch + GPU, no L2 flush): bench_decode's do_bench times
include launch gaps when the GPU waits on the host, which this separates from kernel time. ``--splits``: the
graph replay once per num_splits value (0: the heuristic's choice), "flashtile-graph-sN".
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench_decode import HEAD_DIM, Caches, capture
from flashtile.kvcache import flash_attn_with_kvcache

STEPS = 50


def kernel_times(fn, steps: int = STEPS) -> tuple[dict[str, float], float]:
    """({kernel name: mean device µs per step}, wall µs per step) of ``steps`` calls of ``fn`` after a warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e6 / steps
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time / steps
    return dict(totals), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--nheads-q", type=int, default=32)
    parser.add_argument("--paged", action="store_true")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--splits", default="0", help="num_splits values of the graph replays (0: the heuristic)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for context in map(int, args.contexts.split(",")):
        caches = Caches(args.batch, context, args.page_size)
        q = torch.randn(args.batch, 1, args.nheads_q, HEAD_DIM, device="cuda", dtype=caches.k.dtype)
        k_cache, v_cache = (caches.k_paged, caches.v_paged) if args.paged else (caches.k, caches.v)
        table = caches.block_table if args.paged else None

        def step(q=q, k_cache=k_cache, v_cache=v_cache, caches=caches, table=table, num_splits=0):
            return flash_attn_with_kvcache(
                q, k_cache, v_cache, caches.k_new, caches.v_new, cache_seqlens=caches.seqlens, block_table=table,
                causal=True, num_splits=num_splits,
            )  # fmt: skip

        graphs = {
            f"flashtile-graph-s{n}": capture(partial(step, num_splits=n))[0] for n in map(int, args.splits.split(","))
        }
        q_sdpa, k_sdpa, v_sdpa = q.transpose(1, 2), caches.k.transpose(1, 2), caches.v.transpose(1, 2)
        providers = {
            **{name: graph.replay for name, graph in graphs.items()},
            "flashtile-eager": step,
            "sdpa": lambda q=q_sdpa, k=k_sdpa, v=v_sdpa: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        }
        for name, fn in providers.items():
            kernels, wall = kernel_times(fn)
            row = dict(context=context, batch=args.batch, nheads_q=args.nheads_q, paged=args.paged, provider=name,
                       kernels=kernels, kernel_us=sum(kernels.values()), wall_us=wall)  # fmt: skip
            rows.append(row)
            print(f"B={args.batch} ctx={context:6d} Hq={args.nheads_q} paged={int(args.paged)} {name:16s} "
                  f"kernels {row['kernel_us']:7.1f} µs/step, wall {wall:7.1f} µs/step", flush=True)  # fmt: skip
            for kernel, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"    {us:7.2f}  {kernel}")
        del graphs
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile-decode.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
