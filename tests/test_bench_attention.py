"""The benchmark's plumbing, on a CPU: ``benchmarks/bench_attention.py --shapes variants --dry-run`` runs every
variants case (windows, features, masks) at tiny sizes through flashtile's CPU path and writes its reports;
the FLOP convention of the variants rows (visible pairs only) is checked by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_attention

        yield bench_attention
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize(
    "causal, window, n, pairs",
    [
        (False, None, 5, 25),
        (True, None, 5, 15),  # 1 + 2 + 3 + 4 + 5
        (True, (2, 0), 5, 12),  # 1 + 2 + 3 + 3 + 3
        (True, (2, 5), 5, 12),  # causal caps the right side at 0, as flash_attn does
        (False, (1, 1), 4, 10),  # 2 + 3 + 3 + 2
    ],
)
def test_variant_flops_count_visible_pairs(bench, causal, window, n, pairs):
    case = bench.VariantCase("window", "window", "bf16", B=2, N=n, H=3, H_k=3, D=8, causal=causal, window=window)
    assert case.pairs == pairs
    assert case.flops("fwd") == 4 * 2 * 3 * 8 * pairs
    assert case.flops("bwd") == 2.5 * case.flops("fwd")


def test_dry_run_needs_variants(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--dry-run"])


def test_variants_dry_run(tmp_path):
    """Every case runs: flashtile's rows all timed and unflagged, every peer row timed or explained."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU path: fast at any size
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    command = [sys.executable, str(BENCHMARKS / "bench_attention.py"), "--shapes", "variants", "--dry-run"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path), "--commit", "test"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    result = json.loads((tmp_path / "attention.json").read_text())
    assert result["header"]["dry_run"] and result["header"]["commit"] == "test"
    rows = result["variants"]
    ours = [r for r in rows if r["provider"] == "flashtile"]
    assert {r["section"] for r in ours} == {"window", "features", "mask"}
    assert {r["variant"] for r in ours if r["section"] == "features"} == set(
        ("baseline", "softcap", "alibi", "sink", "dropout", "deterministic", "gqa")
    )
    assert all(r["ms"] is not None and r["error"] is None and not r["flagged"] for r in ours), ours
    assert all((r["ms"] is None) != (r["error"] is None) for r in rows)
    # the spot check ran where a peer computes the same thing (FA2 for causal and GQA, FlexAttention for windows)
    checked = {(r["variant"], r["reference"]) for r in ours if r["max_abs_diff"] is not None}
    assert {("causal", "sdpa_flash"), ("window", "flex"), ("gqa", "sdpa_flash")} <= checked
    assert any(r["variant"] == "window" and r["provider"] == "sdpa_flash" and "unsupported" in r["error"] for r in rows)
    notes = [r["note"] for r in ours if r["variant"] == "deterministic" and r["pass"] == "bwd"]
    assert notes and all(note.endswith("yes") for note in notes)

    report = (tmp_path / "attention.md").read_text()
    for title in ("Sliding window against full causal", "Feature costs", "SDPA attn_mask"):
        assert title in report
    assert "Summary (flashtile; fwd/bwd):" in done.stdout
