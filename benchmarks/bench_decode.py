"""Decoding speed: flashtile.flash_attn_with_kvcache against SDPA and cuDNN on a gathered cache, one GPU.

    PYTHONPATH=src python3 benchmarks/bench_decode.py --out DIR [--quick] [--batches 1,16] [--contexts 4096,65536]
        [--page-size 256] [--commit SHA]
    PYTHONPATH=src python3 benchmarks/bench_decode.py --out DIR --host-overhead   # any machine, no GPU

One decode step per row: q (B, 1, Hq, D), one new key/value per sequence appended at position
context - 1 of a cache of ``context`` positions, attention over all of them. Hkv = 8, D = 128, bf16;
B in {1, 4, 16, 64}, context in {1k, 4k, 16k, 64k, 128k}, Hq in {32, 64}; contiguous cache and
paged cache (``--page-size``, pages in random order). ``--quick``: B in {1, 16}, context in {4k, 64k};
``--batches`` / ``--contexts`` (comma-separated) pick the rows to run and override both.

Measured, ``triton.testing.do_bench`` median with L2 flushed:
- ``graph_us``: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table), num_splits=0
  (the heuristic; ``num_splits`` records its choice), captured once in a CUDA graph and replayed: how
  serving stacks run decode steps, with no Python per step (value checks are skipped under capture).
  ``kv_tbps``, ``pct_of_copy`` and the speedups are computed from this time;
- ``eager_us``: the same call from Python with the default value checks (one device-to-host copy of the
  index tensors per call), and ``eager_unchecked_us`` inside ``check_values(False)``: what a Python loop
  pays on top of the kernels;
- ``sdpa_us``: F.scaled_dot_product_attention(q, K, V, enable_gqa=True) (torch's choice of backend) with
  K, V the contiguous (B, Hkv, context, D) cache, i.e. attention alone on an already gathered cache;
- ``cudnn_us``: the same under ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, with enable_gqa=True or, if
  cuDNN refuses it, with K and V repeated to Hq heads (``cudnn_variant`` says which); when cuDNN refuses
  both, ``cudnn_us`` is None and ``cudnn_error`` says why (markdown: 'missing');
- ``gather_us`` (paged rows): gathering the pages into that contiguous cache, which SDPA needs first.
``kv_tbps`` = bytes of K and V read (B * context * Hkv * D * 2 * 2) / graph_us, and ``pct_of_copy`` its
share of the H200's measured copy bandwidth, 4.24 TB/s (the aim: >= 80% at long contexts).
``speedup`` = (sdpa_us + gather_us) / graph_us; ``vs_cudnn`` = cudnn_us / graph_us, attention alone
(no gather credit on paged rows). The step time is the per-token latency of
every sequence in the batch. Before timing, flashtile's output is compared with SDPA's and cuDNN's on
the same cache, and the graph replay's with the eager call's (``max_abs_diff``, ``cudnn_max_abs_diff``,
``graph_max_abs_diff``; a row is flagged above 0.02).

``--host-overhead`` (any machine): the Python time of one call up to the kernel launches, with CPU
tensors and the launches replaced by no-ops, value checks on and off; on CUDA the checks also cost the
device-to-host copy, which this does not see. Writes ``host.json``.

Writes ``decode.jsonl`` (the records of ``flashtile.bench.results``, rewritten after every row: one per
implementation and launch mode) and ``decode.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashtile import _backend
from flashtile.bench import results
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.ops.decode import configs
from host_overhead import stubbed_launches, time_calls  # benchmarks/, beside this script

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


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _bench(fn: Callable[[], Any], args: argparse.Namespace) -> float:
    """Median microseconds of ``fn``."""
    return 1000.0 * float(do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))


def _chosen_splits(batch: int, nheads_q: int, context: int, paged: bool) -> int:
    """The split count num_splits=0 picks for this row."""
    group = nheads_q // NHEADS_KV
    programs = batch * NHEADS_KV * triton.cdiv(group, configs.block_m(group))
    return configs.config_and_splits(0, torch.device("cuda", 0), HEAD_DIM, programs, paged, context)[1]


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


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` captured in a CUDA graph (after a warm-up on a side stream), and the graph's output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def cudnn_peer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[Callable[[], torch.Tensor] | None, str | None, str | None]:
    """(call, variant, error): cuDNN through SDPA on q (B, Hq, 1, D), k, v (B, Hkv, L, D); enable_gqa, or
    K and V repeated to Hq heads if cuDNN refuses GQA; call None and the reasons if it refuses both."""
    errors = []

    def gqa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:
        gqa()
        return gqa, "enable_gqa", None
    except Exception as exc:  # recorded; the repeated variant is tried next
        errors.append(f"enable_gqa: {_error(exc)}")
    try:
        group = q.shape[1] // k.shape[1]
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def repeated() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k_rep, v_rep)

        repeated()
        return repeated, "repeated", None
    except Exception as exc:  # recorded in the row: the column says 'missing', never dropped
        errors.append(f"repeated K/V: {_error(exc)}")
        torch.cuda.empty_cache()
    return None, None, "; ".join(errors)


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

    def step_unchecked() -> torch.Tensor:
        with _backend.check_values(False):
            return step()

    out = step()  # appends the new token at context - 1: every call below sees the same cache
    k_sdpa, v_sdpa = caches.gather() if paged else (caches.k.transpose(1, 2), caches.v.transpose(1, 2))
    q_sdpa = q.transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).abs().max().item()

    row["max_abs_diff"] = diff(out, sdpa().transpose(1, 2))
    cudnn, row["cudnn_variant"], row["cudnn_error"] = cudnn_peer(q_sdpa.contiguous(), k_sdpa, v_sdpa)
    if cudnn is not None:
        row["cudnn_max_abs_diff"] = diff(out, cudnn().transpose(1, 2))
    graph, graph_out = capture(step)
    graph.replay()
    row["graph_max_abs_diff"] = diff(out, graph_out)
    row["flagged"] = not all(
        d <= TOLERANCE for d in (row["max_abs_diff"], row["graph_max_abs_diff"], row["cudnn_max_abs_diff"] or 0.0)
    )

    row["graph_us"] = _bench(graph.replay, args)
    row["eager_us"] = _bench(step, args)
    row["eager_unchecked_us"] = _bench(step_unchecked, args)
    del graph, graph_out
    row["sdpa_us"] = _bench(sdpa, args)
    if cudnn is not None:
        row["cudnn_us"] = _bench(cudnn, args)
    del cudnn
    if paged:
        del k_sdpa, v_sdpa
        row["gather_us"] = _bench(caches.gather, args)
    kv_bytes = 2 * batch * context * NHEADS_KV * HEAD_DIM * DTYPE.itemsize
    row["kv_tbps"] = kv_bytes / row["graph_us"] * 1e-6
    row["pct_of_copy"] = 100.0 * row["kv_tbps"] / COPY_TBPS
    row["speedup"] = (row["sdpa_us"] + (row["gather_us"] or 0.0)) / row["graph_us"]
    if row["cudnn_us"] is not None:
        row["vs_cudnn"] = row["cudnn_us"] / row["graph_us"]


def _header(args: argparse.Namespace) -> dict[str, Any]:
    """The run's environment (``flashtile.bench.results.environment``) and the copy bandwidth of the GPU."""
    return {**results.environment(torch.device("cuda"), args.commit), "copy_tbps": COPY_TBPS}


def records(header: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[results.Record]:
    """The rows as records: per row flashtile replayed from a CUDA graph, eager, eager with value checks off, SDPA,
    cuDNN, and the page gather of paged rows; the bandwidth (K and V bytes over the time) of the graph replay and
    the peers."""
    found = []
    for r in rows:
        shape = {"dtype": "bf16", "layout": r["layout"], "page_size": r["page_size"], "B": r["batch"],
                 "context": r["context"], "Hq": r["nheads_q"], "Hkv": r["nheads_kv"], "D": r["head_dim"]}  # fmt: skip
        kv_bytes = 2 * r["batch"] * r["context"] * r["nheads_kv"] * r["head_dim"] * DTYPE.itemsize
        checks = {"max_abs_diff": r["max_abs_diff"], "graph_max_abs_diff": r["graph_max_abs_diff"],
                  "flagged": r["flagged"]}  # fmt: skip
        measured = [
            ("flashtile", {"launch": "graph"}, r["graph_us"], {"num_splits": r["num_splits"], **checks}),
            ("flashtile", {"launch": "eager"}, r["eager_us"], {"num_splits": r["num_splits"]}),
            ("flashtile", {"launch": "eager, value checks off"}, r["eager_unchecked_us"], {}),
            ("sdpa", {}, r["sdpa_us"], {}),
            ("cudnn", {}, r["cudnn_us"], {"variant": r["cudnn_variant"], "max_abs_diff": r["cudnn_max_abs_diff"]}),
        ]
        if r["layout"] == "paged":
            measured.append(("gather", {}, r["gather_us"], {}))
        for implementation, config, us, extra in measured:
            error = r["error"] or (r["cudnn_error"] if implementation == "cudnn" and us is None else None)
            reads_cache = implementation != "gather" and config.get("launch", "graph") == "graph"
            found.append(results.record(
                header, "decode", implementation, shape, "decode", config=config,
                time_ms=None if us is None else us / 1e3, nbytes=kv_bytes if reads_cache else None,
                error=error or (None if us is not None else "not measured"), extra=extra,
            ))  # fmt: skip
    return found


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def markdown(data: dict[str, Any]) -> str:
    """The rows as one markdown table, provenance first."""
    h = data["header"]
    lines = [
        f"# flash_attn_with_kvcache decode step, {h['gpu']}",
        "",
        f"- torch {h['torch']}, Triton {h['triton']}, cuDNN {h.get('cudnn')}, commit {h['commit']}, {h['date']}",
        f"- Hkv {NHEADS_KV}, D {HEAD_DIM}, bf16, one new token per sequence; copy bandwidth {h['copy_tbps']} TB/s",
        "- flashtile: CUDA-graph replay (bandwidth, % of copy and speedups from it); eager with value checks on "
        "and off. Peers: eager, attention alone on a contiguous cache (SDPA + gather µs for paged rows).",
        "",
        "| layout | B | context | Hq | splits | graph µs | KV TB/s | % of copy | eager µs | eager unchecked µs "
        "| SDPA µs | cuDNN µs | gather µs | vs SDPA (+gather) | vs cuDNN | max diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        head = f"| {r['layout']} | {r['batch']} | {r['context']} | {r['nheads_q']} | {r['num_splits']} "
        if r["error"]:
            lines.append(head + f"| error: {r['error']} |")
            continue
        cudnn = _fmt(r["cudnn_us"], ".1f", "missing") + (" (K/V repeated)" if r["cudnn_variant"] == "repeated" else "")
        diffs = [r["max_abs_diff"], r["graph_max_abs_diff"], r["cudnn_max_abs_diff"]]
        lines.append(
            head + f"| {_fmt(r['graph_us'], '.1f')} | {_fmt(r['kv_tbps'], '.2f')} | {_fmt(r['pct_of_copy'], '.0f')} "
            f"| {_fmt(r['eager_us'], '.1f')} | {_fmt(r['eager_unchecked_us'], '.1f')} | {_fmt(r['sdpa_us'], '.1f')} "
            f"| {cudnn} | {_fmt(r['gather_us'], '.1f')} | {_fmt(r['speedup'], '.2f')} | {_fmt(r['vs_cudnn'], '.2f')} "
            f"| {_fmt(max(d for d in diffs if d is not None), '.1e')}{' FLAGGED' if r['flagged'] else ''} |"
        )
    missing = [r for r in data["rows"] if not r["error"] and r["cudnn_error"]]
    if missing:
        lines += ["", "cuDNN missing or repeated K/V:"]
        lines += [
            f"- {r['layout']} B={r['batch']} ctx={r['context']} Hq={r['nheads_q']}: {r['cudnn_error']}" for r in missing
        ]
    return "\n".join(lines) + "\n"


# --host-overhead ----------------------------------------------------------------------------------------

HOST_ROWS = ((1, 4096, "contiguous"), (1, 4096, "paged"), (64, 16384, "paged"))


def host_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Microseconds of Python per flash_attn_with_kvcache call up to the kernel launches (CPU tensors)."""
    from flashtile.ops.decode import split_kv

    rows = []
    with stubbed_launches(kernels=((split_kv, "_split_kv_kernel"),)):
        for batch, context, layout in HOST_ROWS:
            page = args.page_size
            # The caches' contents are never read (no kernel runs): empty tensors, never touched.
            if layout == "paged":
                blocks = context // page
                k_cache = torch.empty(batch * blocks, page, NHEADS_KV, HEAD_DIM, dtype=DTYPE)
                table = torch.randperm(batch * blocks).view(batch, blocks).to(torch.int32)
            else:
                k_cache, table = torch.empty(batch, context, NHEADS_KV, HEAD_DIM, dtype=DTYPE), None
            v_cache = torch.empty_like(k_cache)
            q = torch.randn(batch, 1, NHEADS_Q[0], HEAD_DIM, dtype=DTYPE)
            k_new = torch.randn(batch, 1, NHEADS_KV, HEAD_DIM, dtype=DTYPE)
            v_new = torch.randn_like(k_new)
            seqlens = torch.full((batch,), context - 1, dtype=torch.int32)

            def step(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new, seqlens=seqlens, table=table):
                flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                        causal=True)  # fmt: skip

            for checks in ("on", "off"):
                unchecked = contextlib.nullcontext()
                if checks == "off":  # CPU tensors are always checked: pretend to be a GPU with the switch off
                    unchecked = mock.patch.object(_backend, "values_checked", lambda device: False)
                with unchecked:
                    us = time_calls(step, args.host_calls)
                rows.append(dict(batch=batch, context=context, layout=layout, checks=checks, us_per_call=us))
                print(f"B={batch:<3d} ctx={context:<6d} {layout:10s} value checks {checks:3s}: {us:6.1f} us/call")
    return {
        "header": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "commit": args.commit or results.git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "notes": "min over 7 repetitions of the mean of --host-calls calls; Hq 32, Hkv 8, D 128, bf16; "
            "kernel launches replaced by no-ops; CPU tensors",
        },
        "rows": rows,
    }


# --------------------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for decode.{jsonl,md} (or host.json)")
    parser.add_argument("--quick", action="store_true", help=f"B in {QUICK_BATCHES}, context in {QUICK_CONTEXTS}")
    parser.add_argument("--batches", type=_ints, default=None, help=f"comma-separated batch sizes (default {BATCHES})")
    parser.add_argument(
        "--contexts", type=_ints, default=None, help=f"comma-separated context lengths (default {CONTEXTS})"
    )
    parser.add_argument("--page-size", type=int, default=256, help="paged cache page size (default 256)")
    parser.add_argument("--commit", default=None, help="flashtile commit to record (default: from git)")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default 10)")
    parser.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms (default 50)")
    parser.add_argument(
        "--host-overhead", action="store_true", help="time the Python path before the launches (no GPU needed)"
    )
    parser.add_argument("--host-calls", type=int, default=2000, help="calls per repetition of --host-overhead")
    args = parser.parse_args(argv)
    if args.page_size <= 0 or args.page_size % 16:
        parser.error(f"--page-size must be a positive multiple of 16, got {args.page_size}")
    contexts = args.contexts or (QUICK_CONTEXTS if args.quick else CONTEXTS)
    bad = [c for c in contexts if c % args.page_size]
    if bad:
        parser.error(f"contexts must be multiples of --page-size {args.page_size} (the paged rows), got {bad}")
    args.batches = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    args.contexts = contexts
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.host_overhead:
        (args.out / "host.json").write_text(json.dumps(host_overhead(args), indent=1) + "\n")
        return
    if not torch.cuda.is_available():
        sys.exit(
            "bench_decode.py needs a CUDA GPU (torch.cuda.is_available() is False here). "
            "--host-overhead measures the Python path on any machine."
        )
    data: dict[str, Any] = {"header": _header(args), "rows": []}
    jsonl_path = args.out / "decode.jsonl"
    start = time.perf_counter()
    for batch in args.batches:
        for context in args.contexts:
            try:
                caches = Caches(batch, context, args.page_size)
            except torch.cuda.OutOfMemoryError as exc:
                caches, reason = None, f"cache allocation: {_error(exc)}"
            for layout in ("contiguous", "paged"):
                for nheads_q in NHEADS_Q:
                    row: dict[str, Any] = dict(
                        layout=layout, page_size=args.page_size if layout == "paged" else None, batch=batch,
                        context=context, nheads_q=nheads_q, nheads_kv=NHEADS_KV, head_dim=HEAD_DIM,
                        num_splits=_chosen_splits(batch, nheads_q, context, layout == "paged"), graph_us=None,
                        kv_tbps=None, pct_of_copy=None, eager_us=None, eager_unchecked_us=None, sdpa_us=None,
                        cudnn_us=None, cudnn_variant=None, cudnn_error=None, gather_us=None, speedup=None,
                        vs_cudnn=None, max_abs_diff=None, cudnn_max_abs_diff=None, graph_max_abs_diff=None,
                        flagged=False, error=None,
                    )  # fmt: skip
                    data["rows"].append(row)
                    try:
                        if caches is None:
                            raise RuntimeError(reason)
                        measure(caches, layout, nheads_q, args, row)
                    except Exception as exc:  # recorded in the row; the run goes on
                        row["error"] = _error(exc)
                    torch.cuda.empty_cache()
                    results.write(jsonl_path, records(data["header"], data["rows"]))
                    result = row["error"] or (
                        f"graph {row['graph_us']:.1f} us ({row['pct_of_copy']:.0f}% of copy), eager "
                        f"{row['eager_us']:.1f}/{row['eager_unchecked_us']:.1f} us, {row['speedup']:.2f}x SDPA, "
                        f"cuDNN {_fmt(row['vs_cudnn'], '.2f', 'missing')}x"
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
