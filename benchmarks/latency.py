"""Small-problem latency (eager and CUDA-graph replay) and first-call compile latency on the GPU.

    PYTHONPATH=src python3 benchmarks/latency.py --out DIR

1. Launch overhead: at N = 512 and 1024 (B*N = 16384, D = 128, bf16, causal and not) the median time
   of flashtile's forward and forward+backward, called eagerly and replayed from a captured CUDA
   graph, next to SDPA flash (FA2) and to flashtile with its Gluon kernels launched through Triton's
   binder on every call ("flashtile-binder", the A/B of ``forward_sm90.launch``). The gap between eager
   and graph is the Python launch path.
   host_us is the Python time per call alone: the calls are queued behind a long GPU sleep, so none
   waits for the GPU; the median of three rounds, the providers' order alternating between rounds (each
   round costs ~1 s of GPU sleep per row).
2. First call of a new shape: in a fresh process with an empty Triton cache (TRITON_CACHE_DIR) the
   first forward+backward pays compilation; a second fresh process with the same cache does not.
   Two shapes: (3, 1000, 12, 96) runs the Triton kernels, (2, 1024, 16, 128) the Gluon forward on sm_90.
   Each first call runs under cProfile (first-call-profile-*.txt) to show where the time goes.
``--host-trace`` instead reports where the host time of eager steps goes, function by function (host-trace.txt).
``--host-overhead`` runs on any machine, no GPU: the host time of eager calls with CPU tensors on a pretended sm_90
GPU whose launches do nothing (``cpu_host_overhead``); it prints a table and writes nothing.
Writes ``latency.jsonl`` (the records of ``flashtile.bench.results``: benchmark ``latency`` with
``config["launch"]`` eager or graph, the host time in the eager record's ``extra``; benchmark ``first-call``)
and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel

import flashtile
from bench_decode import capture
from flashtile.bench import results
from host_overhead import call_means

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


def host_time(fn, calls: int = 50, during: contextlib.AbstractContextManager | None = None) -> float:
    """Median seconds of Python per call of ``fn``, queued behind a GPU sleep long enough that no call waits
    for a result (the timed calls inside ``during`` if given; the warm-up call before it outside). The median,
    not the mean: 60 traced fwd+bwd steps once averaged 18 ms while their traced functions summed to ~1 ms
    (docs/tuning/host-path.md, "Host trace fixed"); the likely cause, a launch that finds the launch queue
    full waiting for the sleep to end, stalls a few calls, not the median."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles
    seconds = []
    with during or contextlib.nullcontext():
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(seconds)


TRACED = (
    ("flashtile._ops", "attention"), ("flashtile.ops.attention.forward", "attention_forward"),
    ("flashtile.ops.attention.backward", "attention_backward"), ("flashtile.ops.attention.backward", "attention_delta"),
    ("flashtile.ops.sm90.forward", "attention_forward_sm90"),
    ("flashtile.ops.sm90.backward", "attention_backward_sm90"),
    ("flashtile.ops.sm90.common", "descriptor"),
    ("flashtile.ops.sm90.forward", "batch_descriptor"), ("flashtile.ops.sm90.common", "launch"),
    ("flashtile.ops.sm90.forward", "qualifies"),
    ("flashtile.ops.sm90.backward", "qualifies"), ("flashtile.ops._launch", "launch"), ("torch", "empty"),
    ("torch", "zeros"),
)  # fmt: skip
"""(module, function) pairs whose inclusive host time ``host_trace`` reports (each also where imported by name)."""


def _timed(totals: collections.Counter, label, fn):
    """``fn`` adding its inclusive seconds to totals[label(args)] per call."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label(args)] += time.perf_counter() - start

    return timed


@contextlib.contextmanager
def _traced(totals: collections.Counter):
    """Inside the block: TRACED's functions (in every flashtile module that binds them), Triton's JIT launch
    (per kernel), its CUDA launcher and the eager autograd Function's forward and backward add their inclusive
    host seconds to ``totals``."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.jit import JITFunction

    from flashtile import _ops

    with contextlib.ExitStack() as stack:
        for module_name, name in TRACED:
            fn = getattr(importlib.import_module(module_name), name)
            label = f"{module_name.rsplit('.', 1)[-1]}.{name}"
            wrapper = _timed(totals, lambda args, label=label: label, fn)
            for module in [m for n, m in sys.modules.items() if n.startswith("flashtile") or n == module_name]:
                if getattr(module, name, None) is fn:
                    stack.enter_context(mock.patch.object(module, name, wrapper))
        stack.enter_context(
            mock.patch.object(JITFunction, "run", _timed(totals, lambda args: f"JITFunction.run {args[0].fn.__name__}",
                                                          JITFunction.run))
        )  # fmt: skip
        stack.enter_context(
            mock.patch.object(CudaLauncher, "__call__", _timed(totals, lambda args: "CudaLauncher.__call__",
                                                                CudaLauncher.__call__))
        )  # fmt: skip
        for attr in ("forward", "backward"):
            fn = getattr(_ops._EagerAttention, attr)
            wrapper = staticmethod(_timed(totals, lambda args, n=f"_EagerAttention.{attr}": n, fn))
            stack.enter_context(mock.patch.object(_ops._EagerAttention, attr, wrapper))
        yield


def host_trace(out: Path, steps: int = 20) -> None:
    """Where the host time of eager steps goes: inclusive µs per step of each traced function (``_traced``),
    the steps queued behind a GPU sleep so that none waits for the GPU, at B=32, N=512, H=16, causal, bf16:
    head dim 128 with the Gluon kernels on sm_90 and with the Triton ones, head dim 96 (Triton). Forward
    alone and forward + backward (out.backward, gradients accumulating). Writes host-trace.txt."""
    from flashtile import _backend

    lines = []
    for head_dim, gluon in ((128, True), (128, False), (96, True)):
        q, k, v, dout = (torch.randn(32, 512, 16, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for name, run in (("fwd", _forward), ("fwd+bwd", _forward_backward)):
            totals: collections.Counter = collections.Counter()
            with mock.patch.object(_backend, "GLUON", gluon):
                fn = functools.partial(run, _flashtile, q, k, v, dout, True)
                seconds = host_time(fn, calls=steps, during=_traced(totals))
            lines.append(f"== D={head_dim} gluon={gluon} {name}: {seconds * 1e6:.0f} us per step (traced, median)")
            lines += [f"   {sec / steps * 1e6:8.1f} us  {label}" for label, sec in totals.most_common()]
            print(lines[-len(totals) - 1], flush=True)
    (out / "host-trace.txt").write_text("\n".join(lines) + "\n")


@contextlib.contextmanager
def _binder_launches() -> Iterator[None]:
    """The Gluon kernels launched through Triton's binder on every call inside the block (the A/B of
    ``sm90.common.launch``)."""
    from flashtile.ops.sm90 import backward as backward_sm90
    from flashtile.ops.sm90 import forward as forward_sm90
    from flashtile.ops.sm90.common import launch_through_binder

    with (
        mock.patch.object(forward_sm90, "launch", launch_through_binder),
        mock.patch.object(backward_sm90, "launch", launch_through_binder),
    ):
        yield


PROVIDERS = (
    ("flashtile", _flashtile, contextlib.nullcontext),
    ("flashtile-binder", _flashtile, _binder_launches),
    ("fa2", _sdpa_flash, contextlib.nullcontext),
)
"""(row name, attention function, context of its calls) of ``launch_overhead``."""


def launch_overhead(rounds: int = 3) -> list[dict]:
    """Rows of eager / graph / host time per (N, causal, provider, pass); "flashtile-binder" is flashtile with the
    Gluon kernels launched through Triton's binder each call (on sm_90: the direct launches' A/B). host_us is the
    median over ``rounds`` host_time medians taken with the providers in alternating order (forward, then
    backward through PROVIDERS), so a drift of the host over the run does not favour the provider timed first;
    host_us_rounds keeps every round's value."""
    rows = []
    for seqlen in (512, 1024):
        batch, nheads, head_dim = 16384 // seqlen, 16, 128
        q, k, v, dout = (
            torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        passes = (("fwd", _forward), ("fwd+bwd", _forward_backward))
        for causal, (pass_name, run) in itertools.product((False, True), passes):
            calls = {name: functools.partial(run, attention, q, k, v, dout, causal) for name, attention, _ in PROVIDERS}
            host = {name: [] for name in calls}
            for round_index in range(rounds):
                for name, _, during in PROVIDERS if round_index % 2 == 0 else PROVIDERS[::-1]:
                    with during():
                        host[name].append(host_time(calls[name]) * 1e6)
            for name, _, during in PROVIDERS:
                with during():
                    eager = triton.testing.do_bench(calls[name], return_mode="median")
                    graph = triton.testing.do_bench(capture(calls[name])[0].replay, return_mode="median")
                rows.append({"what": f"{name} {pass_name}", "N": seqlen, "causal": causal, "eager_ms": eager,
                             "graph_ms": graph, "host_us": statistics.median(host[name]),
                             "host_us_rounds": host[name]})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
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


class _NoKernel:
    """A compiled kernel that launches nothing (``pretend_sm90``): ``kernel[grid](*args)`` runs the Python of
    Triton's ``CompiledKernel.__getitem__`` (stream, launch metadata), and ``run``, the C launcher, is a no-op."""

    name = "no_kernel"
    function = packed_metadata = src = None
    __getitem__ = CompiledKernel.__getitem__
    launch_metadata = CompiledKernel.launch_metadata

    def _init_handles(self) -> None:
        pass

    @staticmethod
    def run(*args) -> None:
        pass


class _Sm90Driver:
    """Triton's active driver on a pretended sm_90 GPU: device 0, stream 0."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


def _no_compile(kernel, key, signature, device, constexprs, options, attrs, warmup):
    """``JITFunction._do_compile`` that keeps a ``_NoKernel`` under ``key`` after computing the kernel's source
    hash (which records the globals that ``JITFunction.run`` checks on every call, as after a real compile)."""
    kernel.cache_key  # noqa: B018 (the property records kernel.used_global_vals)
    compiled = kernel.device_caches[device][0][key] = _NoKernel()
    return compiled


@contextlib.contextmanager
def pretend_sm90() -> Iterator[None]:
    """Inside the block, CPU tensors take the launchers' path of an sm_90 GPU with 132 SMs (the Gluon kernels where
    they qualify, the Hopper tile configs otherwise), and every kernel launch runs Triton's Python (binding,
    specialization, cache lookup, the direct launches of ``ops._launch.launch``) but no compiler and no launcher.
    The attention kernels' caches, the direct launches' (``ops._launch._COMPILED``) and the Gluon kernels' plans
    (``forward_sm90._PLANS``, ``backward_sm90._PLANS``) are set aside and restored afterwards."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from flashtile import _backend
    from flashtile.ops import _launch
    from flashtile.ops.attention import backward, configs, forward
    from flashtile.ops.sm90 import backward as backward_sm90
    from flashtile.ops.sm90 import forward as forward_sm90

    cuda = torch.device("cuda", 0)
    kernels = (forward._attention_forward_kernel, backward._attention_dkdv_kernel, backward._attention_dq_kernel,
               backward._delta_kernel, forward_sm90._attention_forward_sm90_kernel,
               backward_sm90._attention_backward_sm90_kernel)  # fmt: skip
    real_config = configs.config

    def hopper_config(pass_name, device, *args):
        return real_config(pass_name, cuda, *args)

    def gluon_refusal(device):
        return None if _backend.GLUON else "switched off (FLASHTILE_GLUON=0)"

    saved_driver = driver._active  # None on a machine without a GPU: Triton picks a driver on first use
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_backend, "TRITON_INTERPRET", True))  # the launchers' path
        stack.enter_context(mock.patch.object(configs, "compute_capability", lambda index: (9, 0)))
        stack.enter_context(mock.patch.object(_backend, "gluon_refusal", gluon_refusal))
        for module in (forward, backward):
            stack.enter_context(mock.patch.object(module, "config", hopper_config))
        stack.enter_context(mock.patch.object(forward_sm90, "sm_count", lambda device: 132))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        stack.enter_context(mock.patch.object(JITFunction, "_do_compile", _no_compile))
        stack.enter_context(mock.patch.dict(_launch._COMPILED, clear=True))
        stack.enter_context(mock.patch.dict(forward_sm90._PLANS, clear=True))
        stack.enter_context(mock.patch.dict(backward_sm90._PLANS, clear=True))
        for kernel in kernels:
            if isinstance(kernel, JITFunction):  # not the interpreter's, nor a stand-in
                caches = collections.defaultdict(kernel.create_binder)
                stack.enter_context(mock.patch.object(kernel, "device_caches", caches))
        driver.set_active(_Sm90Driver())
        stack.callback(driver.set_active, saved_driver)
        yield


HOST_OVERHEAD_SHAPE = (2, 128, 2)
"""(batch, seqlen, nheads) of ``cpu_host_overhead``'s calls, bf16: the Python work is that of any size that takes the
same kernels (B=16 N=1024 H=16 adds ~20 µs per forward of the CPU allocator mapping its 64 MiB outputs, and the
backward's zero fill of a 128 MiB dq_accum and its conversion, GPU kernels elsewhere, take milliseconds)."""


def _fwd(q, k, v, dout):
    return flashtile.flash_attn_func(q, k, v, causal=True)


def _fwd_bwd(q, k, v, dout):
    torch.autograd.grad(_fwd(q, k, v, dout), (q, k, v), dout)


def cpu_host_overhead(repeats: int = 7, calls: int = 200, shape: tuple[int, int, int] = HOST_OVERHEAD_SHAPE) -> list:
    """Rows (what, µs per call) of the host time of eager causal calls on a pretended sm_90 GPU (``pretend_sm90``):
    forward (q, k, v requiring grad) and forward + backward (``torch.autograd.grad`` with a given dout, nothing
    accumulated) at head dim 128 (the Gluon forward and backward) and with ``FLASHTILE_GLUON=0`` (the Triton kernels
    and the delta kernel). Each row: the median over ``repeats`` of the mean of ``calls`` calls, after a warm-up."""
    from flashtile import _backend

    batch, seqlen, nheads = shape
    rows = []
    for head_dim, gluon, label in ((128, True, "D=128 gluon"), (128, False, "D=128 FLASHTILE_GLUON=0")):
        q, k, v, dout = (torch.empty(batch, seqlen, nheads, head_dim, dtype=torch.bfloat16) for _ in range(4))
        tensors = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout)
        with pretend_sm90(), mock.patch.object(_backend, "GLUON", gluon):
            for name, step in (("fwd", _fwd), ("fwd+bwd", _fwd_bwd)):
                means = call_means(functools.partial(step, *tensors), calls, repeats)
                rows.append({"what": f"{label} {name}", "us": statistics.median(means), "us_repeats": means})
    return rows


def records(env: dict, launch: list[dict], first: list[dict]) -> list[results.Record]:
    """``launch_overhead``'s and ``first_call``'s rows as records."""
    found = []
    names = {"flashtile": ("flashtile", {}), "flashtile-binder": ("flashtile", {"gluon launch": "Triton's binder"}),
             "fa2": ("sdpa_flash", {})}  # fmt: skip
    for row in launch:
        name, pass_ = row["what"].split()
        implementation, config = names[name]
        batch = 16384 // row["N"]
        shape = {"dtype": "bf16", "B": batch, "N": row["N"], "H": 16, "D": 128, "causal": row["causal"]}
        for launch_mode in ("eager", "graph"):
            extra = (
                {"host_us": row["host_us"], "host_us_rounds": row["host_us_rounds"]} if launch_mode == "eager" else {}
            )
            found.append(results.record(env, "latency", implementation, shape, pass_,
                                        config={"launch": launch_mode, **config},
                                        time_ms=row[f"{launch_mode}_ms"], extra=extra))  # fmt: skip
    for row in first:
        cache, shape_text = row["what"].rsplit(" ", 1)
        b, n, h, d = (int(x) for x in shape_text.split(","))
        shape = {"dtype": "bf16", "B": b, "N": n, "H": h, "D": d, "causal": True}
        seconds = row.get("first_call_s")
        found.append(results.record(env, "first-call", "flashtile", shape, "fwd+bwd", config={"kernel cache": cache},
                                    time_ms=None if seconds is None else seconds * 1e3, error=row.get("error"),
                                    extra={"process_s": row["process_s"]} if "process_s" in row else {}))  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for the results (all modes but --host-overhead)")
    parser.add_argument("--host-trace", action="store_true", help="only trace the host path (host-trace.txt)")
    parser.add_argument("--host-overhead", action="store_true", help="host time on the CPU, launches stubbed")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: from git)")
    args = parser.parse_args()
    if args.host_overhead:
        for row in cpu_host_overhead():
            repeats = ", ".join(f"{us:.1f}" for us in row["us_repeats"])
            print(f"{row['us']:8.1f} us  {row['what']}  (repeats: {repeats})")
        return
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.host_trace:
        host_trace(args.out)
        return
    env = results.environment(torch.device("cuda"), args.commit)
    first = first_call(args.out)
    launch = launch_overhead()
    results.write(args.out / "latency.jsonl", records(env, launch, first))
    print("\n| what | N | causal | eager ms | graph ms | host µs |\n|---|---|---|---|---|---|")
    for row in launch:
        print(
            f"| {row['what']} | {row['N']} | {row['causal']} | {row['eager_ms']:.3f} | {row['graph_ms']:.3f} "
            f"| {row['host_us']:.0f} |"
        )
    for row in first:
        print(row)


if __name__ == "__main__":
    main()
