"""``flashtile bench`` (``flashtile.bench.attention``) on a CPU: ``--dry-run`` runs every case at tiny sizes through
flashtile's CPU path and SDPA's CPU kernels, and writes the records, the tables and the plot; the FLOP
convention of the variants rows (visible pairs only) is checked by hand."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashtile.bench import attention, results

ROOT = Path(__file__).resolve().parents[1]


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
def test_variant_flops_count_visible_pairs(causal, window, n, pairs):
    case = attention.VariantCase("window", "window", "bf16", B=2, N=n, H=3, H_k=3, D=8, causal=causal, window=window)
    assert case.pairs == pairs
    assert case.flops("fwd") == 4 * 2 * 3 * 8 * pairs
    assert case.flops("bwd") == 2.5 * case.flops("fwd")


def _dry_run(out: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m flashtile.bench.attention --dry-run`` in a fresh process on the CPU path (fast at any size)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "flashtile.bench.attention", "--dry-run", "--out", str(out), "--commit", "test"]
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def test_standard_and_memory_dry_run(tmp_path):
    """Every standard case runs for every implementation asked for: measured, or the reason it is not; records
    in the one schema; the table, the markdown and the plot written."""
    done = _dry_run(tmp_path, "--shapes", "all", "--providers", "flashtile,sdpa_flash,cudnn")
    records = results.load(tmp_path / "attention.jsonl")
    assert all(list(r) == list(results.FIELDS) for r in records)
    assert {r["commit"] for r in records} == {"test"} and {r["gpu"] for r in records} == {"cpu"}
    speed = [r for r in records if r["benchmark"] == "attention"]
    cases = attention.speed_cases(["bf16"], attention.DRY_RUN_STANDARD)
    assert len(speed) == len(cases) * 3 * 2  # implementations x passes
    ours = [r for r in speed if r["implementation"] == "flashtile"]
    assert all(r["time_ms"] > 0 and r["tflops"] > 0 and r["error"] is None for r in ours), ours
    assert all(r["extra"]["max_abs_diff"] is not None and not r["extra"]["flagged"] for r in ours), ours
    assert all((r["time_ms"] is None) != (r["error"] is None) for r in records)
    assert {r["error"] is not None for r in speed if r["implementation"] == "cudnn"} == {True}
    memory = [r for r in records if r["benchmark"] == "attention-memory"]
    assert {r["implementation"] for r in memory} == {"flashtile", "sdpa_flash"}
    assert all(r["error"] == "not measured: GPU memory only" for r in memory)

    report = (tmp_path / "attention.md").read_text()
    assert "Dry run on the CPU" in report and "| D | N | causal | pass | flashtile | FA2 (SDPA flash) |" in report
    assert "cuDNN (" in report  # why cuDNN has no numbers
    assert (tmp_path / "cpu-attention-bf16-test.png").stat().st_size > 10_000
    assert "vs FA2 (SDPA flash)" in done.stdout and "cpu-attention-bf16-test.png" in done.stdout


def test_variants_dry_run(tmp_path):
    """Every variants case runs: flashtile's records all timed and unflagged, every peer's timed or explained."""
    _dry_run(tmp_path, "--shapes", "variants", "--no-plot")
    records = results.load(tmp_path / "attention.jsonl")
    assert {r["benchmark"] for r in records} == {"attention-variants"}
    ours = [r for r in records if r["implementation"] == "flashtile"]
    assert {r["config"]["section"] for r in ours} == {"window", "features", "mask"}
    features = {r["config"]["variant"] for r in ours if r["config"]["section"] == "features"}
    assert len(features) == len(attention.FEATURES)
    assert all(r["time_ms"] is not None and r["error"] is None and not r["extra"].get("flagged") for r in ours), ours
    assert all((r["time_ms"] is None) != (r["error"] is None) for r in records)
    # the spot check ran where a peer computes the same thing (FA2 for causal and GQA, FlexAttention for windows)
    checked = {  # a difference of 0.0 counts: the CPU path runs torch's own kernel where it can
        (r["config"]["variant"], r["extra"]["reference"]) for r in ours if r["extra"].get("max_abs_diff") is not None
    }
    assert {("causal", "sdpa_flash"), ("window (16, 0)", "flex"), ("GQA H_k=1", "sdpa_flash")} <= checked
    window_fa2 = [
        r for r in records if r["config"]["variant"].startswith("window") and r["implementation"] == "sdpa_flash"
    ]
    assert window_fa2 and all("unsupported" in r["error"] for r in window_fa2)
    repeatable = [r["extra"].get("bitwise_repeatable") for r in ours if r["config"]["variant"] == "deterministic=True"]
    assert repeatable == [None, True] * len(attention.DRY_RUN_VARIANTS.feature_n)  # fwd, bwd per length
    report = (tmp_path / "attention.md").read_text()
    assert "| section | variant | N | pass | flashtile |" in report
    assert not list(tmp_path.glob("*.png"))
