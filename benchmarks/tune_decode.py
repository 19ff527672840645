"""Sweep the decode kernel's tile config and split count on the GPU at hand; the winners go into
src/flashtile/ops/decode/configs.py.

    PYTHONPATH=src python3 benchmarks/tune_decode.py --out DIR [--rows 1x131072,16x65536,...]
        [--configs 64.4.3,128.4.2] [--splits 0,1,2,3,4] [--page-size 256] [--host] [--tag NAME]

Shapes as benchmarks/bench_decode.py: Hkv 8, Hq 32, D 128, bf16, one new token per sequence appended at
context - 1, causal; contiguous and paged (pages in random order). Every time is the median of CUDA-graph
replays (``triton.testing.do_bench``) of one ``flash_attn_with_kvcache`` step, in µs.

1. Every (block_n, num_warps, num_stages[, programs_per_sm]) of --configs, swapped in for the launches' config
   (``fixed``), at every split count of --splits (0 = the heuristic's choice for that config), per row and layout:
   the JSON keeps the whole grid, so a split heuristic can be judged on it afterwards.
2. Small steps: graph µs of the attention alone (no new k/v, so no append kernel) at the heuristic's
   split count and at one split, with the table's config: what each launch costs.
3. ``--host``: Python time per eager call with value checks off (wall clock over --host-calls calls, no
   sync inside), and cProfile's top entries of those calls, at the first row.

Writes ``tune-decode-<tag>.json`` and prints the best (config, split count) per row.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import json
import pstats
import time
from pathlib import Path
from unittest import mock

import torch
from triton.testing import do_bench

from bench_decode import Caches, capture
from flashtile import _backend, flash_attn_with_kvcache
from flashtile.ops.decode import configs, split_kv
from flashtile.ops.decode.configs import DecodeConfig

NHEADS_Q = 32
DEFAULT_CONFIGS = ",".join(f"{n}.{w}.{s}" for n, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4)))


def parse_config(text: str) -> DecodeConfig:
    """``block_n.num_warps.num_stages[.programs_per_sm]`` as a DecodeConfig."""
    return DecodeConfig(*(int(x) for x in text.split(".")))


def fixed(cfg: DecodeConfig):
    """A stand-in for ``configs.config_and_splits`` that always takes ``cfg``, with ``configs.num_splits``' count
    for it (no switch to another config)."""

    def config_and_splits(requested, device, head_dim, programs, paged, seqlen_cache, element_size=2):
        return cfg, configs.num_splits(requested, device, programs, seqlen_cache, cfg)

    return config_and_splits


def swapped(cfg: DecodeConfig) -> contextlib.AbstractContextManager:
    """Inside it, every decode launch takes ``cfg`` (``fixed``), with the launch plans kept before set aside (they hold
    the configs they were made with) and restored afterwards."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(configs, "config_and_splits", fixed(cfg)))
    stack.enter_context(mock.patch.dict(split_kv._PLANS, clear=True))
    return stack


def graph_us(step) -> float:
    """Median µs of a CUDA-graph replay of ``step``."""
    graph, _ = capture(step)
    return 1000.0 * float(do_bench(graph.replay, warmup=10, rep=40, return_mode="median"))


def stepper(caches: Caches, q: torch.Tensor, paged: bool, num_splits: int, append: bool = True):
    k_cache, v_cache = (caches.k_paged, caches.v_paged) if paged else (caches.k, caches.v)
    new = (caches.k_new, caches.v_new) if append else (None, None)

    def step() -> torch.Tensor:
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, *new, cache_seqlens=caches.seqlens,
            block_table=caches.block_table if paged else None, causal=True, num_splits=num_splits,
        )  # fmt: skip

    return step


def host_profile(caches: Caches, q: torch.Tensor, calls: int) -> dict:
    """µs of Python per eager call (checks off), and cProfile's top entries."""
    result = {}
    for layout in ("contiguous", "paged"):
        step = stepper(caches, q, layout == "paged", 0)
        with _backend.check_values(False):
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                step()
            host = (time.perf_counter() - start) / calls * 1e6
            torch.cuda.synchronize()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(calls):
                step()
            profile.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        result[layout] = {"host_us_per_call": host, "profile": text.getvalue()}
        print(f"host {layout}: {host:.1f} us per eager call (checks off)\n{text.getvalue()}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1x1024,1x4096,1x131072,4x16384,16x16384,16x65536,64x16384,64x65536")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="block_n.num_warps.num_stages, comma-separated")
    parser.add_argument("--splits", default="0,1,2,3,4,6,8,16,32")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--host", action="store_true", help="profile the eager call's Python at the first row")
    parser.add_argument("--host-calls", type=int, default=300)
    parser.add_argument("--tag", default="sweep")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [tuple(int(x) for x in r.split("x")) for r in args.rows.split(",")]
    candidates = [parse_config(c) for c in args.configs.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    table = configs.config(torch.device("cuda"), 128)
    results: dict = {"table_config": list(table.__dict__.values()), "rows": [], "device": torch.cuda.get_device_name()}
    path = args.out / f"tune-decode-{args.tag}.json"
    for batch, context in rows:
        caches = Caches(batch, context, args.page_size)
        q = torch.randn(batch, 1, NHEADS_Q, 128, device="cuda", dtype=caches.k.dtype)
        for paged in (False, True):
            row = {"batch": batch, "context": context, "layout": "paged" if paged else "contiguous", "grid": {}}
            for cfg in candidates:
                with swapped(cfg):
                    for s in splits:
                        row["grid"][f"{cfg.block_n}.{cfg.num_warps}.{cfg.num_stages}/{s}"] = graph_us(
                            stepper(caches, q, paged, s)
                        )
            row["table"] = graph_us(stepper(caches, q, paged, 0))
            row["attention_only"] = {s: graph_us(stepper(caches, q, paged, s, append=False)) for s in (0, 1)}
            best = min(row["grid"], key=row["grid"].get)
            print(
                f"B={batch} ctx={context} {row['layout']}: table {row['table']:.1f} us; best {best} "
                f"{row['grid'][best]:.1f} ({row['grid'][best] / row['table']:.2f}x); attention alone "
                f"{row['attention_only'][0]:.1f} (1 split {row['attention_only'][1]:.1f})",
                flush=True,
            )
            results["rows"].append(row)
            path.write_text(json.dumps(results, indent=1))  # after every row: a run cut short keeps its rows
        if args.host and (batch, context) == rows[0]:
            results["host"] = host_profile(caches, q, args.host_calls)
            path.write_text(json.dumps(results, indent=1))
        del caches, q
        torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
