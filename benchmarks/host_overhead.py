"""Host (Python) time of the attention entry points, up to the kernel launches; any machine, no GPU.

    PYTHONPATH=src python3 benchmarks/host_overhead.py [--out DIR] [--profile CASE]

CPU tensors take the Triton launchers' path (as under ``TRITON_INTERPRET=1``) with every attention kernel
replaced by a no-op, so what is timed is validation, the custom op's dispatch and autograd wrapper, the
launchers' Python (configs, strides, flags) and the output allocations; not Triton's own launch cost
(argument binding, a few µs per launch on the GPU) nor anything on the device. ``--tma`` runs with configs
that ask for tensor descriptors (as the Hopper table does for some passes), so ``tma_ready`` and the
descriptors are counted too. Rows: microseconds per call, min over 7 repetitions of the mean of
``--calls`` calls; B=2, N=32, H=4, D=128, bf16, causal (the size does not change the Python work; small
tensors keep the CPU's allocator and the autograd engine's CPU ops, such as the gradient of an unbind, out
of the numbers). Backward rows call ``torch.autograd.grad`` (no accumulation into ``.grad``).
``--profile CASE`` prints cProfile's top entries for one row.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import platform
import pstats
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import flashtile
from flashtile import _backend
from flashtile.ops.attention import backward, configs, forward

BATCH, SEQLEN, NHEADS, HEAD_DIM = 2, 32, 4, 128
DTYPE = torch.bfloat16


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


ATTENTION_KERNELS = ((forward, "_attention_forward_kernel"), (backward, "_attention_dkdv_kernel"),
                     (backward, "_attention_dq_kernel"), (backward, "_delta_kernel"))  # fmt: skip


@contextlib.contextmanager
def stubbed_launches(tma: bool = False, kernels: tuple[tuple[Any, str], ...] = ATTENTION_KERNELS) -> Iterator[None]:
    """``kernels`` ((module, name) pairs, the attention kernels by default) replaced by no-ops; CPU tensors
    on the Triton launchers' path; ``tma``: configs that ask for tensor descriptors."""
    saved = [getattr(module, name) for module, name in kernels]
    saved_interpret = _backend.TRITON_INTERPRET
    for module, name in kernels:
        setattr(module, name, _NoLaunch())
    _backend.TRITON_INTERPRET = True
    tiles = configs.TileConfig(64, 64, 4, 3, tma=True)
    overrides = configs.override(**dict.fromkeys(configs.PASSES, tiles)) if tma else contextlib.nullcontext()
    try:
        with overrides:
            yield
    finally:
        for (module, name), kernel in zip(kernels, saved, strict=True):
            setattr(module, name, kernel)
        _backend.TRITON_INTERPRET = saved_interpret


def cases() -> dict[str, Callable[[], Any]]:
    """name -> a function making one call (forward, or forward and backward)."""

    def qkv(grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(BATCH, SEQLEN, NHEADS, HEAD_DIM, dtype=DTYPE, requires_grad=grad) for _ in range(3))

    q, k, v = qkv(False)
    qg, kg, vg = qkv(True)
    dout = torch.randn_like(q)
    packed = torch.randn(BATCH, SEQLEN, 3, NHEADS, HEAD_DIM, dtype=DTYPE, requires_grad=True)
    kv = torch.randn(BATCH, SEQLEN, 2, NHEADS, HEAD_DIM, dtype=DTYPE, requires_grad=True)
    cu = torch.arange(0, (BATCH + 1) * SEQLEN, SEQLEN, dtype=torch.int32)
    flat = [t.view(BATCH * SEQLEN, NHEADS, HEAD_DIM) for t in (q, k, v)]
    flat_g = [t.detach().reshape(BATCH * SEQLEN, NHEADS, HEAD_DIM).requires_grad_() for t in (qg, kg, vg)]
    dout_flat = dout.view(BATCH * SEQLEN, NHEADS, HEAD_DIM)
    sq, sk, sv = (t.transpose(1, 2) for t in (qg, kg, vg))
    leaves = [qg, kg, vg, packed, kv, *flat_g]

    def fwd_bwd(call: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            out = call()
            torch.autograd.grad(out, [t for t in leaves if t.grad_fn is None], grad, allow_unused=True)

        return step

    return {
        "fwd": lambda: flashtile.flash_attn_func(q, k, v, causal=True),
        "fwd (requires_grad)": lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True),
        "fwd no_grad (requires_grad)": lambda: _no_grad(flashtile.flash_attn_func, qg, kg, vg, causal=True),
        "fwd+bwd": fwd_bwd(lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True), dout),
        "fwd+bwd return_lse": fwd_bwd(
            lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True, return_attn_probs=True)[0], dout
        ),
        "qkvpacked fwd+bwd": fwd_bwd(lambda: flashtile.flash_attn_qkvpacked_func(packed, causal=True), dout),
        "kvpacked fwd+bwd": fwd_bwd(lambda: flashtile.flash_attn_kvpacked_func(qg, kv, causal=True), dout),
        "sdpa fwd": lambda: flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))),
        "sdpa fwd+bwd": fwd_bwd(
            lambda: flashtile.scaled_dot_product_attention(sq, sk, sv, is_causal=True), dout.transpose(1, 2)
        ),
        "varlen fwd": lambda: flashtile.flash_attn_varlen_func(*flat, cu, cu, SEQLEN, SEQLEN, causal=True),
        "varlen fwd+bwd": fwd_bwd(
            lambda: flashtile.flash_attn_varlen_func(*flat_g, cu, cu, SEQLEN, SEQLEN, causal=True), dout_flat
        ),
    }


def _no_grad(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return fn(*args, **kwargs)


def call_means(fn: Callable[[], Any], calls: int, repeats: int = 7) -> list[float]:
    """Microseconds per call of each of ``repeats`` runs of ``calls`` calls, after a warm-up."""
    for _ in range(min(calls, 200)):
        fn()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return means


def time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call: min over 7 repetitions of the mean of ``calls`` calls, after a warm-up."""
    return min(call_means(fn, calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for host_overhead.json")
    parser.add_argument("--calls", type=int, default=1000, help="calls per repetition")
    parser.add_argument("--tma", action="store_true", help="configs that ask for tensor descriptors")
    parser.add_argument("--profile", metavar="CASE", help="print cProfile's top entries for this case")
    parser.add_argument("--only", metavar="CASE", action="append", help="time only these cases")
    args = parser.parse_args()
    rows = []
    with stubbed_launches(args.tma):
        table = cases()
        if args.profile:
            fn = table[args.profile]
            for _ in range(100):
                fn()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                fn()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
            return
        for name, fn in table.items():
            if args.only and name not in args.only:
                continue
            checks = ("on", "off") if name.startswith("varlen") else ("on",)
            for check in checks:
                # CPU tensors are always value-checked; "off" is what a GPU run with the switch off does
                context = contextlib.nullcontext() if check == "on" else _unchecked()
                with context:
                    us = time_calls(fn, args.calls)
                label = name if len(checks) == 1 else f"{name} (value checks {check})"
                rows.append({"case": label, "us_per_call": round(us, 1)})
                print(f"{label:40s} {us:7.1f} us/call")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        header = {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip(),
            "tma": args.tma,
            "shape": [BATCH, SEQLEN, NHEADS, HEAD_DIM],
        }
        (args.out / "host_overhead.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")


@contextlib.contextmanager
def _unchecked() -> Iterator[None]:
    saved = _backend.values_checked
    _backend.values_checked = lambda device: False
    try:
        yield
    finally:
        _backend.values_checked = saved


if __name__ == "__main__":
    main()
