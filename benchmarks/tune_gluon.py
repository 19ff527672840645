"""Config variants of the sm_90 Gluon kernels (ops/sm90/forward.py, backward.py) on a Hopper GPU.

    PYTHONPATH=src python3 benchmarks/tune_gluon.py [--variant NAME:KEY=VALUE,...] [--shape B,Sq,Sk,H,Hk,D,causal]
        [--rounds R] [--out DIR]

Times flashtile's forward and backward (TFLOP/s, do_bench median; backward 2.5 x the forward's FLOP, both halved
when causal), bf16, at each ``--shape`` or by default at D = 64 / 128 (H = 32 / 16), N = 1k / 4k / 16k with B =
16384 / N, causal and not (``DEFAULT_SHAPES``): the shipped configs ("default"), each ``--variant`` (its
KEY=VALUE pairs replace entries of every ``forward_sm90.CONFIGS`` and ``backward_sm90.CONFIGS`` entry that has
the key; with FORWARD_D=D / BACKWARD_D=D of that head dim's forward / backward config alone), and the Triton
kernels (``flashtile._backend.GLUON`` off). Beside each time: the max abs difference of that run's out, dq, dk,
dv from the shipped config's (bf16 rounding and the atomic dQ's order make it nonzero). Example:

    --variant fwd-3-stages:STAGES=3 --variant no-pingpong:PINGPONG=0 --variant bwd-2-stages:STAGES=2
    --variant gluon-causal:GLUON_CAUSAL_D=64  (D=64 causal forwards on the Gluon kernel at every length)
    --variant d64-causal-3wg:FORWARD_D=64,NUM_WG=3,CONSUMER_REGS=160  (D=64 causal forwards with three warpgroups:
        FORWARD_D's keys reach its CAUSAL_CHANGES too)
    --variant d64-2wg:FORWARD_D=64,NUM_WG=2,CONSUMER_REGS=240  (the D=64 forward with two consumer warpgroups,
        as before 39629e4; without FORWARD_D the register split would change every config, the backward's too)
    --variant d256-unpaired:BACKWARD_D=256,KEY_PAIRS=0  (the D=256 backward without causal key pairs, alone)

A key in both modules' configs changes both kernels; the causal pairs have a name per kernel (forward
CAUSAL_PAIRS, backward KEY_PAIRS), so ``--variant unpaired:KEY_PAIRS=0`` changes the backward alone.

The backward takes lengths that are multiples of ``forward_sm90.ROWS`` (128, fixed at import); its BLOCK_M, 128
at D=64 and 64 elsewhere, may be either value with that rule (``--variant d64-main:BLOCK_M=64,STAGES=3,DO_STAGES=3``
is main's D=64 backward before the 128-row tiles: the same SASS; STAGES / DO_STAGES also change the D=256
backward, so time such variants at D=64 only). Other tile heights and widths (M_WG, BLOCK_N) also change which
lengths the backward accepts: vary them only with lengths they divide (the forward takes any length).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
from triton.testing import do_bench

import flashtile
from flashtile import _backend
from flashtile.bench.attention import DTYPES
from flashtile.ops.sm90 import backward as backward_sm90
from flashtile.ops.sm90 import forward as forward_sm90

CAUSAL_HEAD_DIM = "GLUON_CAUSAL_D"
"""A variant key that is no CONFIGS entry: GLUON_CAUSAL_D=64 sets ``forward_sm90.CAUSAL_MIN_SEQLEN_Q[64]`` to 1
inside the variant, so its causal forwards of every length run the Gluon kernel instead of the Triton one."""
FORWARD_HEAD_DIM = "FORWARD_D"
"""A variant key that is no CONFIGS entry: FORWARD_D=64 applies the variant's keys to ``forward_sm90.CONFIGS[64]`` (and
its ``CAUSAL_CHANGES``) only, not to the other head dims nor to ``backward_sm90.CONFIGS`` (whose CONSUMER_REGS /
PRODUCER_REGS a D=64 forward's register split would otherwise change)."""
BACKWARD_HEAD_DIM = "BACKWARD_D"
"""The same for ``backward_sm90.CONFIGS``: BACKWARD_D=256 applies the variant's keys to the D=256 backward alone
(with FORWARD_D too, to both named configs)."""


def picked_configs(changes: dict[str, int]) -> tuple[dict, ...]:
    """The config dicts a variant's ``changes`` apply to: those FORWARD_D / BACKWARD_D name, or every forward and
    backward config when neither is given; a forward config's ``CAUSAL_CHANGES`` with it (whose keys win in
    causal launches)."""
    forward_dims = [changes[FORWARD_HEAD_DIM]] if FORWARD_HEAD_DIM in changes else []
    backward_dims = [changes[BACKWARD_HEAD_DIM]] if BACKWARD_HEAD_DIM in changes else []
    if not forward_dims and not backward_dims:
        forward_dims, backward_dims = list(forward_sm90.CONFIGS), list(backward_sm90.CONFIGS)
    causal = [forward_sm90.CAUSAL_CHANGES[d] for d in forward_dims if d in forward_sm90.CAUSAL_CHANGES]
    return (
        *[forward_sm90.CONFIGS[d] for d in forward_dims],
        *causal,
        *[backward_sm90.CONFIGS[d] for d in backward_dims],
    )


@contextlib.contextmanager
def configured(changes: dict[str, int]) -> Iterator[None]:
    """The Gluon kernels' configs with ``changes`` applied (to each of ``picked_configs`` that has the key) inside
    the block."""
    configs = picked_configs(changes)
    with contextlib.ExitStack() as stack:
        for cfg in configs:
            stack.enter_context(mock.patch.dict(cfg, {k: v for k, v in changes.items() if k in cfg}))
        if CAUSAL_HEAD_DIM in changes:
            stack.enter_context(mock.patch.dict(forward_sm90.CAUSAL_MIN_SEQLEN_Q, {changes[CAUSAL_HEAD_DIM]: 1}))
        yield


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    name, _, pairs = text.partition(":")
    return name, {k: int(v) for k, v in (p.split("=") for p in pairs.split(",") if p)}


def measure(q, k, v, dout, causal: bool) -> tuple[float, float, list[torch.Tensor]]:
    """(forward ms, backward ms, [out, dq, dk, dv])."""
    for t in (q, k, v):
        t.grad = None
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    out.backward(dout, retain_graph=True)  # the timed backward below runs through the same graph again
    results = [out.detach(), q.grad, k.grad, v.grad]
    fwd = do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal), return_mode="median")

    def backward():
        for t in (q, k, v):
            t.grad = None
        out.backward(dout, retain_graph=True)

    return fwd, do_bench(backward, return_mode="median"), results


def parse_shape(text: str) -> tuple[int, int, int, int, int, int, bool]:
    """ "B,Sq,Sk,H,Hk,D,causal" (causal 0 or 1)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal = map(int, text.split(","))
    return batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, bool(causal)


DEFAULT_SHAPES = [
    (16384 // n, n, n, nheads, nheads, head_dim, causal)
    for head_dim, nheads in ((128, 16), (64, 32))
    for n in (1024, 4096, 16384)
    for causal in (False, True)
]
"""B * N = 16384 tokens, hidden 2048, MHA: the quick table's shapes."""


def shape_rows(
    shape: tuple[int, int, int, int, int, int, bool], variants, dtype: torch.dtype = torch.bfloat16, rounds: int = 1
) -> list[dict]:
    """One row per variant and round (and the Triton kernels, in the first round) at ``shape`` (B, Sq, Sk, H, Hk,
    D, causal) in ``dtype``; FLOP 4 * B * H * Sq * Sk * D, halved when causal. The rounds interleave the
    variants (A, B, .., A, B, ..), so a drift of the GPU's clocks spreads over all of them; with more than one
    round a summary line per variant gives the median TFLOP/s and the range."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal = shape
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(batch, seqlen_k, nheads_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        for _ in range(2)
    )
    dout = torch.randn_like(q)
    flops = 4 * batch * nheads * seqlen_q * seqlen_k * head_dim / (2 if causal else 1)
    rows, reference = [], None
    runs = [(0, name, changes) for name, changes in [*variants, ("triton", None)]]
    runs += [(r, name, changes) for r in range(1, rounds) for name, changes in variants]
    for round_, name, changes in runs:
        switch = mock.patch.object(_backend, "GLUON", False) if changes is None else contextlib.nullcontext()
        with configured(changes or {}), switch:
            fwd, bwd, results = measure(q, k, v, dout, causal)
        reference = reference or results
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results, reference, strict=True))
        rows.append(dict(shape=shape, dtype=str(dtype), variant=name, round=round_, changes=changes, fwd_ms=fwd,
                         bwd_ms=bwd, fwd_tflops=flops / fwd * 1e-9, bwd_tflops=2.5 * flops / bwd * 1e-9,
                         max_abs_diff=diff))  # fmt: skip
        print(
            f"B={batch} Sq={seqlen_q:5d} Sk={seqlen_k:5d} H={nheads}/{nheads_k} D={head_dim:3d} causal={int(causal)} "
            f"{dtype} "
            f"{name:>14}: fwd {rows[-1]['fwd_tflops']:6.1f} bwd {rows[-1]['bwd_tflops']:6.1f} TFLOP/s  "
            f"(max diff vs default {diff:.2e})",
            flush=True,
        )
    if rounds > 1:
        for name, _ in variants:
            mine = [row for row in rows if row["variant"] == name]
            summary = [
                f"{key[:3]} {statistics.median(row[key] for row in mine):6.1f} "
                f"[{min(row[key] for row in mine):5.1f}-{max(row[key] for row in mine):5.1f}]"
                for key in ("fwd_tflops", "bwd_tflops")
            ]
            print(f"  median of {len(mine)} B={batch} Sq={seqlen_q} Sk={seqlen_k} H={nheads}/{nheads_k} D={head_dim} "
                  f"causal={int(causal)} {name:>14}: {'  '.join(summary)}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], type=parse_variant)
    parser.add_argument("--shape", action="append", type=parse_shape, help="B,Sq,Sk,H,Hk,D,causal (repeatable)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--rounds", type=int, default=1, help="times each variant runs, interleaved (median)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = [("default", {}), *args.variant]
    dtype = DTYPES[args.dtype]
    rows = [row for shape in args.shape or DEFAULT_SHAPES for row in shape_rows(shape, variants, dtype, args.rounds)]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune-gluon.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
