"""Decoding speed: flashtile.flash_attn_with_kvcache against SDPA on a gathered cache, one GPU.

    PYTHONPATH=src python3 benchmarks/bench_decode.py --out DIR [--quick] [--page-size 256] [--commit SHA]

One decode step per row: q (B, 1, Hq, D), one new key/value per sequence appended at position
context - 1 of a cache of ``context`` positions, attention over all of them. Hkv = 8, D = 128, bf16;
B in {1, 4, 16, 64}, context in {1k, 4k, 16k, 64k, 128k}, Hq in {32, 64}; contiguous cache and
paged cache (``--page-size``, pages in random order). ``--quick``: B in {1, 16}, context in {4k, 64k}.

Measured, ``triton.testing.do_bench`` median with L2 flushed:
- ``flashtile_us``: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table),
  num_splits=0 (the heuristic; ``num_splits`` records its choice);
- ``sdpa_us``: F.scaled_dot_product_attention(q, K, V, enable_gqa=True) with K, V the contiguous
  (B, Hkv, context, D) cache, i.e. attention alone on an already gathered cache;
- ``gather_us`` (paged rows): gathering the pages into that contiguous cache, which SDPA needs first.
``kv_tbps`` = bytes of K and V read (B * context * Hkv * D * 2 * 2) / flashtile time, and
``pct_of_copy`` its share of the H200's measured copy bandwidth, 4.24 TB/s (goal: >= 80% at long
contexts). ``speedup`` = (sdpa_us + gather_us) / flashtile_us. The step time is the per-token latency
of every sequence in the batch. Before timing, flashtile's output is compared with SDPA's on the same
cache (``max_abs_diff``, flagged above 0.02).

Writes ``decode.json`` (header + rows, rewritten after every row) and ``decode.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.ops.decode import configs

COPY_TBPS = 4.24  # measured device-to-device copy bandwidth of the H200, TB/s
BATCHES = (1, 4, 16, 64)
CONTEXTS = (1024, 4096, 16384, 65536, 131072)
QUICK_BATCHES = (1, 16)
QUICK_CONTEXTS = (4096, 65536)
NHEADS_Q = (32, 64)
NHEADS_KV = 8
HEAD_DIM = 128
DTYPE = torch.bfloat16
TOLERANCE = 0.02


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _bench(fn: Callable[[], Any], args: argparse.Namespace) -> float:
    """Median microseconds of ``fn``."""
    return 1000.0 * float(do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))


def _chosen_splits(batch: int, nheads_q: int, context: int) -> int:
    """The split count num_splits=0 picks for this row."""
    group = nheads_q // NHEADS_KV
    programs = batch * NHEADS_KV * triton.cdiv(group, configs.block_m(group))
    block_n = configs.config(torch.device("cuda"), HEAD_DIM).block_n
    return configs.num_splits(0, torch.device("cuda", 0), programs, context, block_n)


class Caches:
    """One (batch, context) cache, contiguous and paged with the same content."""

    def __init__(self, batch: int, context: int, page_size: int) -> None:
        shape = (batch, context, NHEADS_KV, HEAD_DIM)
        self.k = torch.randn(shape, device="cuda", dtype=DTYPE)
        self.v = torch.randn(shape, device="cuda", dtype=DTYPE)
        blocks = context // page_size
        order = torch.randperm(batch * blocks, device="cuda")
        self.block_table = order.view(batch, blocks).to(torch.int32)
        pages = (batch * blocks, page_size, NHEADS_KV, HEAD_DIM)
        self.k_paged = torch.empty(pages, device="cuda", dtype=DTYPE)
        self.v_paged = torch.empty(pages, device="cuda", dtype=DTYPE)
        self.k_paged[order] = self.k.view(-1, page_size, NHEADS_KV, HEAD_DIM)
        self.v_paged[order] = self.v.view(-1, page_size, NHEADS_KV, HEAD_DIM)
        self.seqlens = torch.full((batch,), context - 1, device="cuda", dtype=torch.int32)
        self.k_new = torch.randn(batch, 1, NHEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.v_new = torch.randn(batch, 1, NHEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged cache as contiguous (B, Hkv, context, D) tensors, as SDPA needs them."""
        batch = self.block_table.shape[0]
        k = self.k_paged[self.block_table].view(batch, -1, NHEADS_KV, HEAD_DIM).transpose(1, 2).contiguous()
        v = self.v_paged[self.block_table].view(batch, -1, NHEADS_KV, HEAD_DIM).transpose(1, 2).contiguous()
        return k, v


def measure(caches: Caches, layout: str, nheads_q: int, args: argparse.Namespace, row: dict[str, Any]) -> None:
    """Fill ``row`` with the times of one layout and head count."""
    batch, context = caches.k.shape[:2]
    q = torch.randn(batch, 1, nheads_q, HEAD_DIM, device="cuda", dtype=DTYPE)
    paged = layout == "paged"
    k_cache, v_cache = (caches.k_paged, caches.v_paged) if paged else (caches.k, caches.v)

    def step() -> torch.Tensor:
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, caches.k_new, caches.v_new, cache_seqlens=caches.seqlens,
            block_table=caches.block_table if paged else None, causal=True,
        )  # fmt: skip

    out = step()  # appends the new token at context - 1: SDPA below sees the same cache
    k_sdpa, v_sdpa = caches.gather() if paged else (caches.k.transpose(1, 2), caches.v.transpose(1, 2))
    q_sdpa = q.transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True)

    diff = (out.float() - sdpa().transpose(1, 2).float()).abs().max().item()
    row.update(max_abs_diff=diff, flagged=not diff <= TOLERANCE)
    row["flashtile_us"] = _bench(step, args)
    row["sdpa_us"] = _bench(sdpa, args)
    if paged:
        del k_sdpa, v_sdpa
        row["gather_us"] = _bench(caches.gather, args)
    kv_bytes = 2 * batch * context * NHEADS_KV * HEAD_DIM * DTYPE.itemsize
    row["kv_tbps"] = kv_bytes / row["flashtile_us"] * 1e-6
    row["pct_of_copy"] = 100.0 * row["kv_tbps"] / COPY_TBPS
    row["speedup"] = (row["sdpa_us"] + (row["gather_us"] or 0.0)) / row["flashtile_us"]


def _header(args: argparse.Namespace) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": args.commit or _git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "copy_tbps": COPY_TBPS,
        "notes": __doc__.split("Measured,")[1].split("Writes")[0].strip(),
    }


def markdown(data: dict[str, Any]) -> str:
    """The rows as one markdown table, provenance first."""
    h = data["header"]
    lines = [
        f"# flash_attn_with_kvcache decode step, {h['gpu']}",
        "",
        f"- torch {h['torch']}, Triton {h['triton']}, commit {h['commit']}, {h['date']}",
        f"- Hkv {NHEADS_KV}, D {HEAD_DIM}, bf16, one new token per sequence; copy bandwidth {h['copy_tbps']} TB/s",
        "",
        "| layout | B | context | Hq | splits | flashtile µs | KV TB/s | % of copy | SDPA µs | gather µs "
        "| speedup | max diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in data["rows"]:
        if r["error"]:
            lines.append(f"| {r['layout']} | {r['batch']} | {r['context']} | {r['nheads_q']} | | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['layout']} | {r['batch']} | {r['context']} | {r['nheads_q']} | {r['num_splits']} "
            f"| {fmt(r['flashtile_us'], '.1f')} | {fmt(r['kv_tbps'], '.2f')} | {fmt(r['pct_of_copy'], '.0f')} "
            f"| {fmt(r['sdpa_us'], '.1f')} | {fmt(r['gather_us'], '.1f')} | {fmt(r['speedup'], '.2f')} "
            f"| {fmt(r['max_abs_diff'], '.1e')}{' FLAGGED' if r['flagged'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for decode.{json,md}")
    parser.add_argument("--quick", action="store_true", help=f"B in {QUICK_BATCHES}, context in {QUICK_CONTEXTS}")
    parser.add_argument("--page-size", type=int, default=256, help="paged cache page size (default 256)")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default 10)")
    parser.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms (default 50)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU.")
    args.out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"header": _header(args), "rows": []}
    json_path = args.out / "decode.json"
    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
    start = time.perf_counter()
    for batch in batches:
        for context in contexts:
            try:
                caches = Caches(batch, context, args.page_size)
            except torch.cuda.OutOfMemoryError as exc:
                caches, reason = None, f"cache allocation: {' '.join(str(exc).split())[:200]}"
            for layout in ("contiguous", "paged"):
                for nheads_q in NHEADS_Q:
                    row: dict[str, Any] = dict(
                        layout=layout, page_size=args.page_size if layout == "paged" else None, batch=batch,
                        context=context, nheads_q=nheads_q, nheads_kv=NHEADS_KV, head_dim=HEAD_DIM,
                        num_splits=_chosen_splits(batch, nheads_q, context), flashtile_us=None, kv_tbps=None,
                        pct_of_copy=None, sdpa_us=None, gather_us=None, speedup=None, max_abs_diff=None,
                        flagged=False, error=None,
                    )  # fmt: skip
                    data["rows"].append(row)
                    try:
                        if caches is None:
                            raise RuntimeError(reason)
                        measure(caches, layout, nheads_q, args, row)
                    except Exception as exc:  # recorded in the row; the run goes on
                        row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                    torch.cuda.empty_cache()
                    tmp = json_path.with_suffix(".json.tmp")
                    tmp.write_text(json.dumps(data, indent=1) + "\n")
                    os.replace(tmp, json_path)
                    result = row["error"] or (
                        f"flashtile {row['flashtile_us']:.1f} us, {row['pct_of_copy']:.0f}% of copy, "
                        f"{row['speedup']:.2f}x SDPA"
                    )
                    elapsed = time.perf_counter() - start
                    print(
                        f"[{elapsed:5.0f}s] {layout:10s} B={batch:<3d} ctx={context:<6d} Hq={nheads_q}: {result}",
                        flush=True,
                    )
            del caches
            torch.cuda.empty_cache()
    md = markdown(data)
    (args.out / "decode.md").write_text(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
