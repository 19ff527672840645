"""Small-problem latency (eager and CUDA-graph replay) and first-call compile latency on the GPU.

    PYTHONPATH=src python3 benchmarks/latency.py --out DIR

1. Launch overhead: at N = 512 and 1024 (B*N = 16384, D = 128, bf16, causal and not) the median time
   of flashtile's forward and forward+backward, called eagerly and replayed from a captured CUDA
   graph, next to SDPA flash (FA2). The gap between eager and graph is the Python launch path.
   host_us is the Python time per call alone: the calls are queued behind a long GPU sleep, so none
   waits for the GPU.
2. First call of a new shape: in a fresh process with an empty Triton cache (TRITON_CACHE_DIR) the
   first forward+backward pays compilation; a second fresh process with the same cache does not.
   Two shapes: (3, 1000, 12, 96) runs the Triton kernels, (2, 1024, 16, 128) the Gluon forward on sm_90.
   Each first call runs under cProfile (first-call-profile-*.txt) to show where the time goes.
``--host-profile`` instead profiles the host path of eager forward + backward steps (host-profile-*.txt).
Writes ``latency.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import itertools
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from bench_decode import capture

FIRST_CALL = """
import cProfile, pstats, sys, time, torch, flashtile
shape = [int(n) for n in sys.argv[1].split(",")]
q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()
profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
torch.cuda.synchronize()
profile.disable()
elapsed = time.perf_counter() - start
pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
print(elapsed)
"""


def _sdpa_flash(q, k, v, causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)


def _flashtile(q, k, v, causal):
    return flashtile.flash_attn_func(q, k, v, causal=causal)


def _forward(attention, q, k, v, dout, causal):
    attention(q, k, v, causal)


def _forward_backward(attention, q, k, v, dout, causal):
    attention(q, k, v, causal).backward(dout)


def host_time(fn, calls: int = 50, profile: cProfile.Profile | None = None) -> float:
    """Seconds of Python per call of ``fn``, queued behind a GPU sleep long enough that no call waits
    (under ``profile`` if given)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles
    start = time.perf_counter()
    with profile or contextlib.nullcontext():
        for _ in range(calls):
            fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


def host_profile(out: Path) -> None:
    """cProfile (by own time) of eager forward + backward steps queued behind a GPU sleep, at B=32, N=512,
    H=16, causal, bf16: head dim 128 (the Gluon kernels on sm_90) and 96 (the Triton kernels)."""
    for head_dim in (128, 96):
        q, k, v, dout = (torch.randn(32, 512, 16, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        profile = cProfile.Profile()
        seconds = host_time(functools.partial(_forward_backward, _flashtile, q, k, v, dout, True), profile=profile)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(45)
        header = f"{seconds * 1e6:.0f} us of host time per step (profiled)\n"
        (out / f"host-profile-D{head_dim}.txt").write_text(header + text.getvalue())
        print(f"D={head_dim}: {seconds * 1e6:.0f} us of host time per forward + backward step (profiled)", flush=True)


def launch_overhead() -> list[dict]:
    rows = []
    for seqlen in (512, 1024):
        batch, nheads, head_dim = 16384 // seqlen, 16, 128
        q, k, v, dout = (
            torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for causal, (name, attention), (pass_name, run) in itertools.product(
            (False, True),
            (("flashtile", _flashtile), ("fa2", _sdpa_flash)),
            (("fwd", _forward), ("fwd+bwd", _forward_backward)),
        ):
            fn = functools.partial(run, attention, q, k, v, dout, causal)
            eager = triton.testing.do_bench(fn, return_mode="median")
            graph = triton.testing.do_bench(capture(fn)[0].replay, return_mode="median")
            row = {"what": f"{name} {pass_name}", "N": seqlen, "causal": causal, "eager_ms": eager, "graph_ms": graph,
                   "host_us": host_time(fn) * 1e6}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def first_call(out: Path) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        for shape, attempt in itertools.product(("3,1000,12,96", "2,1024,16,128"), ("empty cache", "warm cache")):
            start = time.perf_counter()
            argv = [sys.executable, "-c", FIRST_CALL, shape]
            run = subprocess.run(argv, env=env, capture_output=True, text=True)
            process_s = time.perf_counter() - start
            what = f"{attempt} {shape}"
            if run.returncode != 0:
                rows.append({"what": what, "error": run.stderr[-500:]})
            else:
                rows.append({"what": what, "first_call_s": float(run.stdout.split()[-1]), "process_s": process_s})
                name = f"first-call-profile-{attempt.replace(' ', '-')}-{shape.replace(',', 'x')}.txt"
                (out / name).write_text(run.stderr)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--host-profile", action="store_true", help="only profile the host path (host-profile-*.txt)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.host_profile:
        host_profile(args.out)
        return
    result = {"gpu": torch.cuda.get_device_name(), "first_call": first_call(args.out), "launch": launch_overhead()}
    (args.out / "latency.json").write_text(json.dumps(result, indent=1))
    print("\n| what | N | causal | eager ms | graph ms | host µs |\n|---|---|---|---|---|---|")
    for row in result["launch"]:
        print(
            f"| {row['what']} | {row['N']} | {row['causal']} | {row['eager_ms']:.3f} | {row['graph_ms']:.3f} "
            f"| {row['host_us']:.0f} |"
        )
    for row in result["first_call"]:
        print(row)


if __name__ == "__main__":
    main()
