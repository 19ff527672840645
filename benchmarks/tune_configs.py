"""Sweep tile configs per pass and head dim on the GPU at hand; the winners go into configs.py.

    PYTHONPATH=src python3 benchmarks/tune_configs.py --out DIR [--head-dims 64,128,256] [--seqlens 8192]
        [--causal false,true] [--passes forward,backward_dkdv,backward_dq] [--tag NAME]

Each pass ('forward', 'backward_dkdv', 'backward_dq'; flex_attention's 'flex_forward', 'flex_backward_dq',
'flex_backward_dkdv', with a causal block mask when causal) is timed with one candidate config swapped in
(``configs.override``) and the others at their table value, at B*N = 16384 tokens, H = 2048 / D,
bf16. Writes
``tune-<tag>.json`` and prints the best config per (head dim, seqlen, causal, pass).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton

import flashtile
from flashtile.ops.attention import attention_backward, attention_forward
from flashtile.ops.attention.configs import TileConfig, override
from flashtile.options import AttentionOptions, default_scale

CANDIDATES = {  # (block_m, block_n, num_warps, num_stages[, tma])
    "forward": [
        TileConfig(*c)
        for c in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3, True),
                  (128, 64, 8, 4, True), (128, 64, 8, 5, True), (128, 128, 8, 3, True), (128, 64, 4, 3, True),
                  (64, 64, 4, 3, True)]
    ],
    "backward_dkdv": [
        TileConfig(*c)
        for c in [(32, 128, 4, 4), (64, 128, 8, 3), (32, 64, 4, 4, True), (64, 128, 8, 3, True),
                  (32, 64, 4, 3, True), (64, 64, 4, 3, True), (32, 128, 4, 4, True), (64, 64, 8, 2, True)]
    ],
    "backward_dq": [
        TileConfig(*c)
        for c in [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3, True), (128, 64, 8, 4, True),
                  (128, 32, 8, 3, True), (64, 64, 4, 3, True), (64, 64, 4, 4, True), (128, 128, 8, 2, True)]
    ],
    "flex_forward": [
        TileConfig(*c)
        for c in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3),
                  (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2)]
    ],
    "flex_backward_dq": [
        TileConfig(*c)
        for c in [(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                  (128, 32, 8, 3), (64, 32, 4, 3), (32, 32, 4, 1)]
    ],
    "flex_backward_dkdv": [
        TileConfig(*c)
        for c in [(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3),
                  (32, 64, 4, 3), (32, 128, 4, 3), (32, 32, 4, 1)]
    ],
}  # fmt: skip
CANDIDATES["forward_short"] = CANDIDATES["forward_banded_short"] = CANDIDATES["forward"]


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def time_pass(pass_name: str, inputs: dict, causal: bool) -> float:
    """Median ms of the launch that contains ``pass_name`` (the backward times both of its kernels)."""
    q, k, v, dout = inputs["q"], inputs["k"], inputs["v"], inputs["dout"]
    if pass_name.startswith("flex"):
        return time_flex_pass(pass_name, *(x.transpose(1, 2) for x in (q, k, v, dout)), causal)
    options = AttentionOptions(default_scale(q.shape[-1]), None, 0 if causal else None)
    if pass_name.startswith("forward"):
        return triton.testing.do_bench(lambda: attention_forward(q, k, v, options), return_mode="median")
    out, lse = attention_forward(q, k, v, options)
    return triton.testing.do_bench(lambda: attention_backward(dout, q, k, v, out, lse, options), return_mode="median")


def time_flex_pass(pass_name: str, q, k, v, dout, causal: bool) -> float:
    """Median ms of flashtile.flex_attention's forward, or of its backward (both kernels), on (B, H, N, D) inputs
    with a causal block mask (BLOCK_SIZE 128) or none."""
    block_mask = None
    if causal:
        block_mask = flashtile.create_block_mask(causal_mask, None, None, q.shape[2], k.shape[2], device=q.device)
    if pass_name == "flex_forward":
        return triton.testing.do_bench(
            lambda: flashtile.flex_attention(q, k, v, block_mask=block_mask), return_mode="median"
        )
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = flashtile.flex_attention(q, k, v, block_mask=block_mask)
    return triton.testing.do_bench(
        lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), return_mode="median"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="8192")
    parser.add_argument("--passes", default="forward,backward_dkdv,backward_dq")
    parser.add_argument("--causal", default="false", help="comma list of false/true")
    parser.add_argument("--tag", default="sweep")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    causal_values = [c.strip().lower() == "true" for c in args.causal.split(",")]
    for head_dim, seqlen in itertools.product(
        (int(d) for d in args.head_dims.split(",")), (int(n) for n in args.seqlens.split(","))
    ):
        nheads, batch = 2048 // head_dim, 16384 // seqlen
        shape = (batch, seqlen, nheads, head_dim)
        inputs = {n: torch.randn(shape, device="cuda", dtype=torch.bfloat16) for n in ("q", "k", "v", "dout")}
        for causal, pass_name in itertools.product(causal_values, args.passes.split(",")):
            flops = 4 * batch * nheads * seqlen**2 * head_dim / (2 if causal else 1)
            flops *= 1.0 if "forward" in pass_name else 2.5
            for cfg in CANDIDATES[pass_name]:
                row = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "pass": pass_name}
                row["config"] = cfg.__dict__
                try:
                    with override(**{pass_name: cfg}):
                        ms = time_pass(pass_name, inputs, causal)
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as error:  # a config that does not fit is a result, not a crash
                    row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    (args.out / f"tune-{args.tag}.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.tag}: best per (head_dim, seqlen, causal, pass):")
    for key, group in itertools.groupby(rows, key=lambda r: (r["head_dim"], r["seqlen"], r["causal"], r["pass"])):
        timed = [r for r in group if "ms" in r]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            print(key, best["config"], f"{best['tflops']:.0f} TFLOP/s ({best['ms']:.3f} ms)")


if __name__ == "__main__":
    main()
