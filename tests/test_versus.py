"""benchmarks/versus.py's row parsing and per-round ratios (the timing itself needs a GPU)."""

from __future__ import annotations

import argparse

import pytest

import versus  # benchmarks/, on the path from conftest


def test_rows_are_standard_cases():
    case = versus.parse_row("fp16,64,1024,1")
    assert (case.dtype, case.B, case.N, case.H, case.D, case.causal) == ("fp16", 16, 1024, 32, 64, True)
    assert versus.parse_row("bf16,128,2048,0").causal is False
    with pytest.raises(argparse.ArgumentTypeError, match="dtype"):
        versus.parse_row("fp8,128,2048,0")


def test_ratios_pair_each_round_and_skip_rounds_with_an_error_or_a_flag():
    def row(provider, round_, tflops, pass_="fwd", flagged=False):
        return dict(provider=provider, dtype="bf16", D=128, N=2048, causal=False, round=round_, tflops=tflops,
                    flagged=flagged, **{"pass": pass_})  # fmt: skip

    rows = [row("cudnn", 1, 400.0), row("flashtile", 1, 404.0), row("flashtile", 0, 390.0), row("cudnn", 0, 400.0),
            row("flashtile", 2, None), row("cudnn", 2, 400.0), row("flashtile", 0, 500.0, "bwd"),
            row("cudnn", 0, 520.0, "bwd"), row("sdpa_flash", 0, 300.0), row("flashtile", 3, 600.0, flagged=True),
            row("cudnn", 3, 400.0), row("flashtile", 1, 500.0, "bwd"),
            row("cudnn", 1, 510.0, "bwd", flagged=True)]  # fmt: skip
    ratios = versus.round_ratios(rows, "cudnn")
    assert ratios == {("bf16", 128, 2048, False, "fwd"): [390 / 400, 404 / 400],
                      ("bf16", 128, 2048, False, "bwd"): [500 / 520]}  # fmt: skip
