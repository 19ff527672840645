"""flashtile.flex_attention against torch.compile'd FlexAttention, on the GPU.

    PYTHONPATH=src python3 benchmarks/bench_flex.py --out DIR [--seqlen 4096] [--batch 4] [--heads 16]
        [--dims 64,128,256] [--mods causal,alibi] [--commit SHA]
    PYTHONPATH=src python3 benchmarks/bench_flex.py --out DIR --dry-run     # tiny, on the CPU, any machine

Rows (bf16, (B, H, N, D) inputs, one row per mod, head dim and pass):
- ``causal``: mask_mod q_idx >= kv_idx;
- ``sliding_window``: causal, and at most 1024 keys back (``--window``);
- ``document``: packed documents of random lengths (mean N / 8, fixed seed), doc[q_idx] == doc[kv_idx];
- ``prefix_lm``: the first N / 4 keys seen by every query, causal after them;
- ``alibi``: score_mod score + slope[h] * (kv_idx - q_idx) (slopes 2^(-8 (h + 1) / H)), causal block mask;
- ``softcap``: score_mod 30 tanh(score / 30), causal block mask.
Each implementation gets its own library's block mask (BLOCK_SIZE 128) built before timing. flashtile runs as
``flashtile`` (``flex_attention`` as called, BACKEND "AUTO": mods it recognises as one of its built-in options run
the built-in kernels) and as ``flashtile_generated`` (BACKEND "TRITON": the kernel generated from the mods, on every
row; in the ``--dry-run`` on the CPU, BACKEND "TORCH", the route AUTO takes there for mods it does not recognise).
Where flash_attn_func's own options compute the same (causal, sliding window, ALiBi, softcap), flashtile's built-in
kernels run it called directly too (``flashtile_builtin``): ``flashtile`` against it is the cost of writing the mask
or score modification as a mod, ``flashtile_generated`` against it that of the generated kernel. Passes: ``fwd`` and
``fwd+bwd`` (the backward's dout is all ones). Timing: ``triton.testing.do_bench`` median (CUDA events);
``--dry-run`` times with the host clock on the CPU (float32, B=1, H=2, N=64, D=16, BLOCK_SIZE 16, window 16),
where torch's FlexAttention runs eagerly and has no backward (its fwd+bwd rows record that as the error).
FLOPs count only the visible (query, key) pairs: 4 * B * H * D * pairs forward, 2.5 times that backward
(fwd+bwd: 3.5 times). Before timing, flashtile's forward outputs are compared with FlexAttention's
(``extra["max_abs_diff"]``; flagged above 0.02).

Writes ``flex.jsonl`` (the records of ``flashtile.bench.results``, benchmark ``flex``, rewritten after every row)
and prints two markdown tables of TFLOP/s with ratios to FlexAttention and to the built-in options: of ``flashtile``,
then of ``flashtile_generated``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import flashtile
from flashtile.bench import results

MODS = ("causal", "sliding_window", "document", "prefix_lm", "alibi", "softcap")
TOLERANCE = 0.02
SOFTCAP = 30.0


BUILTIN_NAME = "flashtile_builtin"
GENERATED_NAME = "flashtile_generated"
GENERATED_BACKEND = {"cuda": "TRITON", "cpu": "TORCH"}  # flex_attention without the built-in kernels, per device
BUILTIN = {  # flash_attn_func's options (with causal=True) that compute the row's mods
    "causal": lambda heads, window, device: {},
    "sliding_window": lambda heads, window, device: {"window_size": (window, 0)},
    "alibi": lambda heads, window, device: {"alibi_slopes": _slopes(heads, device)},
    "softcap": lambda heads, window, device: {"softcap": SOFTCAP},
}


def _slopes(heads: int, device: torch.device) -> torch.Tensor:
    """ALiBi slopes 2^(-8 (h + 1) / H), float32."""
    return torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device) / heads)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _mods(name: str, n: int, heads: int, window: int, device: torch.device):
    """(score_mod, mask_mod) of a row; the tensors they capture are made here, on ``device``."""
    if name == "sliding_window":
        return None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    if name == "document":
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, max(2, n // 4), (n,), generator=generator)
        doc = torch.repeat_interleave(torch.arange(n), lengths)[:n].to(device)
        return None, lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]
    if name == "prefix_lm":
        prefix = n // 4
        return None, lambda b, h, q_idx, kv_idx: (kv_idx < prefix) | (q_idx >= kv_idx)
    if name == "alibi":
        slopes = _slopes(heads, device)
        return (lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)), causal
    if name == "softcap":
        return (lambda score, b, h, q_idx, kv_idx: SOFTCAP * torch.tanh(score / SOFTCAP)), causal
    return None, causal


def _pairs(mask_mod: Callable, n: int, device: torch.device) -> int:
    """Visible (query, key) pairs of one head: mask_mod evaluated by broadcasting, 1024 rows at a time."""
    kv = torch.arange(n, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return sum(
        int(mask_mod(zero, zero, torch.arange(i, min(i + 1024, n), device=device)[:, None], kv).sum())
        for i in range(0, n, 1024)
    )


def _implementations(
    name: str, score_mod, mask_mod, n: int, heads: int, window: int, block: int, device: torch.device
) -> dict[str, Callable]:
    """Per implementation, a function (q, k, v) -> out with its block mask built already: flashtile's flex_attention
    as called and with the generated kernel forced (``GENERATED_NAME``), FlexAttention, and for the rows that
    flash_attn_func's own options express, also that (``BUILTIN_NAME``)."""
    from torch.nn.attention import flex_attention as flex

    ours = flashtile.create_block_mask(mask_mod, None, None, n, n, device=device, BLOCK_SIZE=block)
    theirs = flex.create_block_mask(mask_mod, None, None, n, n, device=device, BLOCK_SIZE=block)
    if device.type == "cpu":  # eager, and on inputs that do not require grad (FlexAttention refuses them there)

        def theirs_fn(q, k, v):
            return flex.flex_attention(q.detach(), k.detach(), v.detach(), score_mod, theirs)
    else:
        # A fresh compile per row: every mod and head dim is a new graph, and after dynamo's recompile limit (8) a
        # compiled function runs eagerly, FlexAttention's slow reference path.
        torch._dynamo.reset()
        compiled = torch.compile(flex.flex_attention, dynamic=False)

        def theirs_fn(q, k, v):
            return compiled(q, k, v, score_mod, theirs)

    generated = {"BACKEND": GENERATED_BACKEND[device.type]}
    impls = {
        "flashtile": lambda q, k, v: flashtile.flex_attention(q, k, v, score_mod, ours),
        GENERATED_NAME: lambda q, k, v: flashtile.flex_attention(q, k, v, score_mod, ours, kernel_options=generated),
        "flex": theirs_fn,
    }
    if name in BUILTIN:
        options = BUILTIN[name](heads, window, device)
        impls[BUILTIN_NAME] = lambda q, k, v: flashtile.flash_attn_func(
            *(x.transpose(1, 2) for x in (q, k, v)), causal=True, **options
        ).transpose(1, 2)
    return impls


def _time_ms(fn: Callable[[], Any], device: torch.device, grads: list[torch.Tensor]) -> float:
    """Median time of fn: triton's do_bench on a GPU, the host clock (one run after one warm-up) on the CPU."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, grad_to_none=grads, return_mode="median")
    fn()
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def _measure(impl: Callable, q, k, v, backward: bool, device: torch.device) -> float:
    def run():
        out = impl(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))

    return _time_ms(run, device, [q, k, v])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--mods", default=",".join(MODS))
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (checks the script runs)")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: from git)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    n, batch, heads, window, block = args.seqlen, args.batch, args.heads, args.window, 128
    dims = [int(d) for d in args.dims.split(",")]
    dtype = torch.bfloat16
    if args.dry_run:
        n, batch, heads, window, block, dims, dtype = 64, 1, 2, 16, 16, [16], torch.float32
    env = results.environment(device, args.commit)
    args.out.mkdir(parents=True, exist_ok=True)
    records: list[results.Record] = []
    for name in args.mods.split(","):
        score_mod, mask_mod = _mods(name, n, heads, window, device)
        impls = _implementations(name, score_mod, mask_mod, n, heads, window, block, device)
        pairs = _pairs(mask_mod, n, device)
        for dim in dims:
            q, k, v = (torch.randn(batch, heads, n, dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))  # fmt: skip
            shape = {"dtype": str(dtype).removeprefix("torch."), "B": batch, "N": n, "H": heads, "D": dim, "mod": name}
            with torch.no_grad():
                outs = {who: impl(q, k, v) for who, impl in impls.items()}
            diffs = {who: (out.float() - outs["flex"].float()).abs().max().item() for who, out in outs.items()}
            for backward in (False, True):
                pass_ = "fwd+bwd" if backward else "fwd"
                flops = 4 * batch * heads * dim * pairs * (3.5 if backward else 1.0)
                for who, impl in impls.items():
                    ms, error = None, None
                    if backward and who == "flex" and device.type == "cpu":
                        error = "FlexAttention has no backward on the CPU"
                    else:
                        try:
                            ms = _measure(impl, q, k, v, backward, device)
                        except Exception as exc:  # a failed row is recorded, the others still run
                            error = f"{type(exc).__name__}: {exc}"[:500]
                    diff = diffs[who]
                    extra = {"max_abs_diff": diff, "flagged": diff > TOLERANCE} if who != "flex" else {}
                    records.append(results.record(env, "flex", who, shape, pass_, config={"window": window},
                                                  time_ms=ms, flops=flops, error=error, extra=extra))  # fmt: skip
                    print(f"{name} D={dim} {pass_} {who}: {error or f'{ms:.3f} ms'}", flush=True)
                results.write(args.out / "flex.jsonl", records)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ours = [r for r in records if r["implementation"] != GENERATED_NAME]
    # the generated kernel's table: its records in flashtile's column, which the ratios read
    generated = [{**r, "implementation": results.OURS} if r["implementation"] == GENERATED_NAME else r
                 for r in records if r["implementation"] != results.OURS]  # fmt: skip
    without = f"without the built-in kernels (BACKEND {GENERATED_BACKEND[device.type]})"
    for title, rows in (("flex_attention (AUTO)", ours), (without, generated)):
        header, body = results.table(
            rows, ["mod", "D", "pass"], value="tflops", ratios_against=["flex", BUILTIN_NAME], digits=1
        )
        print(f"\nflashtile: {title}\n" + results.markdown(header, body))


if __name__ == "__main__":
    main()
