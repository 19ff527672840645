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
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["mode"] == "check" and rows[0]["max_abs_logit_diff_vs_sdpa"] < 1e-4
    cases = {(r["mode"], r["batch"], r["impl"]) for r in rows[1:]}
    for impl in ("tile_attention", "sdpa"):
        for batch in ("dense", "padded", "packed"):
            assert ("train", batch, impl) in cases
        assert ("generate", "left-padded", impl) in cases
    assert all(r["tokens_per_s"] > 0 and r["tokens"] <= r["slots"] for r in rows[1:] if r["mode"] == "train")
