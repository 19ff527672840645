"""The float8 forward against flashtile's bf16 forward on the GPU at hand: accuracy, speed, and a config sweep.

    PYTHONPATH=src python3 benchmarks/fp8_forward.py --out DIR [--sweep] [--quick] [--warm I/N]

- Accuracy: at B=1, H=4 (2 KV heads), N=4096, head dims 128 and 256, full and causal, inputs quantized to e4m3 with
  a per-tensor factor each (``quantized``), the float64 oracle on the dequantized inputs against (a) the float8
  forward and (b) the bf16 forward on the same values (e4m3 values are exact in bf16; the factors go into
  softmax_scale and the output, so both compute the same attention): max |out - ref|, and the mean.
- Speed: head dims 128 and 256, N 4k/8k/16k, causal and not, B*N = 32k tokens, H = 16: median ms (do_bench) of
  ``flash_attn_func`` on float8 inputs (with descale factors; V's transpose included) and on bf16 inputs (whichever
  kernel the dispatcher picks: the Gluon kernel on sm_90), TFLOP/s = 4 B H N^2 D / time (halved for causal), their
  ratio, and V's transpose alone (``ops.fp8.transpose``): its time, its GB/s (V read once and written once), and
  the time of torch's copy of the permuted view into the same layout, for comparison.
- ``--sweep``: each of ``CANDIDATES`` at N=8k, full and causal, head dims 128 and 256.
- ``--warm I/N``: compile only (see --help); run N of these side by side first, then the timed run finds every
  kernel compiled.

Writes DIR/fp8_forward.json (the rows, the GPU, versions and commit) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import flashtile
from flashtile import _backend
from flashtile.ops.attention import configs
from flashtile.ops.attention.configs import TileConfig
from flashtile.ops.fp8.transpose import transposed_values
from flashtile.reference import attention_reference

E4M3 = torch.float8_e4m3fn
TOKENS = 32 * 1024
NHEADS = 16


def quantized(shape: tuple[int, ...], device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Normal values quantized to e4m3 with one factor (amax / 448) for the tensor: (x e4m3, factor float32 ())."""
    x = torch.randn(shape, device=device)
    factor = (x.abs().max() / 448.0).float()
    return (x / factor).to(E4M3), factor


def flops(batch: int, seqlen: int, head_dim: int, causal: bool) -> float:
    return 4.0 * batch * NHEADS * seqlen * seqlen * head_dim / (2.0 if causal else 1.0)


def fp8_inputs(batch: int, seqlen: int, nheads: int, nheads_k: int, head_dim: int):
    """float8 q, k, v and their (batch, nheads_k) descale factors (each a per-tensor factor, expanded)."""
    tensors, factors = [], []
    for heads in (nheads, nheads_k, nheads_k):
        x, f = quantized((batch, seqlen, heads, head_dim))
        tensors.append(x)
        factors.append(f.expand(batch, nheads_k))
    return tensors, factors


def accuracy(head_dim: int, causal: bool, warm: bool, seqlen: int = 4096) -> dict:
    (q8, k8, v8), (q_d, k_d, v_d) = fp8_inputs(1, seqlen, 4, 2, head_dim)
    scale = head_dim**-0.5
    with torch.no_grad():
        out8 = flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=q_d, k_descale=k_d, v_descale=v_d)
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q8, k8, v8))  # exact: e4m3 values are bf16 values
        qk, vs = (q_d[0, 0] * k_d[0, 0]).item(), v_d[0, 0].item()
        outb = flashtile.flash_attn_func(qb, kb, vb, causal=causal, softmax_scale=scale * qk).double() * vs
        if warm:
            return {}
        q, k, v = q8.double() * q_d[0, 0].double(), k8.double() * k_d[0, 0].double(), v8.double() * v_d[0, 0].double()
        ref, _ = attention_reference(q, k, v, scale, causal)
    row = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "ref_max": ref.abs().max().item()}
    for name, out in (("fp8", out8), ("bf16", outb)):
        diff = (out.double() - ref).abs()
        row[f"{name}_max_err"], row[f"{name}_mean_err"] = diff.max().item(), diff.mean().item()
    return row


def timed(fn, rep: int, warm: bool) -> float:
    """Median ms of ``fn`` (do_bench), or one call and NaN when ``warm`` (compiles only)."""
    if warm:
        fn()
        torch.cuda.synchronize()
        return float("nan")
    return do_bench(fn, rep=rep, return_mode="median")


def speed(head_dim: int, seqlen: int, causal: bool, rep: int, warm: bool) -> dict:
    batch = TOKENS // seqlen
    (q8, k8, v8), (q_d, k_d, v_d) = fp8_inputs(batch, seqlen, NHEADS, NHEADS, head_dim)
    qb, kb, vb = (torch.randn(batch, seqlen, NHEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        ms8 = timed(lambda: flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=q_d, k_descale=k_d,
                                                      v_descale=v_d), rep, warm)  # fmt: skip
        msb = timed(lambda: flashtile.flash_attn_func(qb, kb, vb, causal=causal), rep, warm)
        ms_vt = timed(lambda: transposed_values(v8), rep, warm)
        vt = transposed_values(v8)
        ms_copy = timed(lambda: vt.copy_(v8.permute(0, 2, 3, 1)), rep, warm)
    work = flops(batch, seqlen, head_dim, causal)
    options = flashtile.interface.prepared(qb, kb, vb, window_right=0 if causal else None)[3]
    return {
        "head_dim": head_dim, "seqlen": seqlen, "batch": batch, "causal": causal, "fp8_ms": ms8, "bf16_ms": msb,
        "fp8_tflops": work / ms8 * 1e-9, "bf16_tflops": work / msb * 1e-9, "speedup": msb / ms8,
        "v_transpose_ms": ms_vt, "v_transpose_gbps": 2 * v8.numel() / ms_vt * 1e-6, "v_torch_copy_ms": ms_copy,
        "bf16_path": _backend.forward_choice(qb, kb, vb, options).path,
    }  # fmt: skip


CANDIDATES = [
    TileConfig(*c)
    for c in [(128, 64, 4, 3, True), (128, 64, 8, 3, True), (128, 128, 8, 2, True), (128, 128, 8, 3, True),
              (128, 64, 8, 4, True), (128, 64, 8, 2, True), (64, 128, 4, 3, True), (128, 128, 8, 3, False)]
]  # fmt: skip
"""The configs ``--sweep`` tries (``configs.override(fp8_forward=...)``): (block_m, block_n, num_warps, num_stages,
tma)."""


def sweep_one(head_dim: int, causal: bool, cfg: TileConfig, rep: int, warm: bool) -> dict:
    seqlen = SWEEP_SEQLEN
    batch = TOKENS // seqlen
    (q8, k8, v8), (q_d, k_d, v_d) = fp8_inputs(batch, seqlen, NHEADS, NHEADS, head_dim)
    row = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "config": repr(cfg)}
    try:
        with configs.override(fp8_forward=cfg), torch.no_grad():
            ms = timed(lambda: flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=q_d, k_descale=k_d,
                                                         v_descale=v_d), rep, warm)  # fmt: skip
        row.update(ms=ms, tflops=flops(batch, seqlen, head_dim, causal) / ms * 1e-9)
    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is reported
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


SWEEP_SEQLEN = 8192


def jobs(quick: bool, sweep: bool) -> list[tuple]:
    """Every measurement as (part, arguments), in the order they run."""
    found = [("accuracy", (d, c)) for d in (128, 256) for c in (False, True)]
    seqlens = (4096, 16384) if quick else (4096, 8192, 16384)
    found += [("speed", (d, n, c)) for d in (128, 256) for n in seqlens for c in (False, True)]
    if sweep:
        found += [("sweep", (d, c, cfg)) for d in (128, 256) for c in (False, True) for cfg in CANDIDATES]
    return found


def environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit or None, "time": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="also time every candidate config")
    parser.add_argument("--quick", action="store_true", help="N = 4k and 16k only, shorter timings")
    parser.add_argument(
        "--warm", metavar="I/N", default=None,
        help="compile only: run the I-th of N shares of the measurements once each, untimed (Triton's cache keeps the "
        "kernels; N processes side by side compile in parallel before one timed run)",
    )  # fmt: skip
    args = parser.parse_args()
    rep = 40 if args.quick else 100
    todo = jobs(args.quick, args.sweep)
    warm = args.warm is not None
    if warm:
        index, count = map(int, args.warm.split("/"))
        todo = todo[index::count]
    result = {"environment": environment(), "accuracy": [], "speed": [], "sweep": []}
    if not warm:
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(result["environment"]))
    run = {"accuracy": lambda *a: accuracy(*a, warm), "speed": lambda *a: speed(*a, rep, warm),
           "sweep": lambda *a: sweep_one(*a, rep, warm)}  # fmt: skip
    for part, arguments in todo:
        row = run[part](*arguments)
        if warm:
            continue
        result[part].append(row)
        if part == "speed":
            if len(result["speed"]) == 1:
                print(f"{'D':>4} {'N':>6} {'causal':>6} {'fp8 TF/s':>9} {'bf16 TF/s':>9} {'ratio':>6} {'V^T ms':>7} "
                      f"{'V^T GB/s':>8} {'copy ms':>7}  bf16 path")  # fmt: skip
            print(f"{row['head_dim']:>4} {row['seqlen']:>6} {row['causal']!s:>6} {row['fp8_tflops']:>9.1f} "
                  f"{row['bf16_tflops']:>9.1f} {row['speedup']:>6.2f} {row['v_transpose_ms']:>7.3f} "
                  f"{row['v_transpose_gbps']:>8.0f} {row['v_torch_copy_ms']:>7.3f}  {row['bf16_path']}",
                  flush=True)  # fmt: skip
        else:
            print(json.dumps(row), flush=True)
        (args.out / "fp8_forward.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
