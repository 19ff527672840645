"""The transformers benchmark's plumbing, on a CPU: ``benchmarks/bench_transformers.py --dry-run`` runs every case
(training on dense, padded and packed batches; generation) for a toy model through flashtile's CPU path and SDPA,
and writes one JSON line per case."""

import json
from pathlib import Path

import pytest

from flashtile import _backend

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_dry_run_writes_every_case(tmp_path, monkeypatch):
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # flashtile.cpu, as outside the tests
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_transformers

    out = tmp_path / "rows.jsonl"
    bench_transformers.main(["--dry-run", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["benchmark"] for r in records} == {"transformers"}
    assert all(r["extra"]["max_abs_logit_diff_vs_sdpa"] < 1e-4 for r in records)
    cases = {(r["pass"], r["shape"]["batch"], r["implementation"]) for r in records}
    for impl in ("flashtile", "sdpa"):
        for batch in ("dense", "padded", "packed"):
            assert ("fwd+bwd", batch, impl) in cases
        assert ("decode", "left-padded", impl) in cases
    training = [r for r in records if r["pass"] == "fwd+bwd"]
    assert all(r["extra"]["tokens_per_s"] > 0 and r["extra"]["tokens"] <= r["extra"]["slots"] for r in training)


def test_decode_step_host_time(tmp_path, monkeypatch):
    """``host_overhead.py --decode-step`` on the CPU: a row per implementation, the stubs put back afterwards."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import torch

    import host_overhead
    from flashtile.ops.decode import split_kv

    kernel, sdpa = split_kv._split_kv_kernel, torch.nn.functional.scaled_dot_product_attention
    host_overhead.main(["--decode-step", "--steps", "2", "--prompt", "16", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "decode_step.json").read_text())["rows"]
    assert [row["impl"] for row in rows] == ["tile_attention", "sdpa"]
    assert all(row["per_layer_us"] > 0 for row in rows)
    assert split_kv._split_kv_kernel is kernel and torch.nn.functional.scaled_dot_product_attention is sdpa
