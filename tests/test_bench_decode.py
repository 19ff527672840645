"""benchmarks/bench_decode.py on a machine without a GPU: arguments, the markdown report, --host-overhead."""

from __future__ import annotations

import json

import pytest

import bench_decode  # benchmarks/, on the path from conftest


def test_arguments():
    args = bench_decode.parse_args(["--out", "x", "--batches", "1,16", "--contexts", "4096"])
    assert args.batches == (1, 16) and args.contexts == (4096,)
    args = bench_decode.parse_args(["--out", "x", "--quick"])
    assert (args.batches, args.contexts) == (bench_decode.QUICK_BATCHES, bench_decode.QUICK_CONTEXTS)
    args = bench_decode.parse_args(["--out", "x", "--quick", "--contexts", "1024"])
    assert (args.batches, args.contexts) == (bench_decode.QUICK_BATCHES, (1024,))


@pytest.mark.parametrize(
    "argv", [["--batches", "1,x"], ["--contexts", "0"], ["--contexts", "1000"], ["--page-size", "24"]]
)
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--out", "x", *argv])


def _row(**changes):
    row = dict(
        layout="paged", page_size=256, batch=1, context=4096, nheads_q=32, nheads_kv=8, head_dim=128, num_splits=16,
        graph_us=20.0, kv_tbps=0.4, pct_of_copy=10.0, eager_us=300.0, eager_unchecked_us=60.0, sdpa_us=17.0,
        cudnn_us=15.0, cudnn_variant="enable_gqa", cudnn_error=None, gather_us=44.0, speedup=3.0, vs_cudnn=0.75,
        max_abs_diff=1e-3, cudnn_max_abs_diff=1e-3, graph_max_abs_diff=0.0, flagged=False, error=None,
    )  # fmt: skip
    row.update(changes)
    return row


def test_markdown_reports_missing_cudnn_and_errors():
    header = dict(gpu="GPU", torch="t", triton="tr", cudnn=91900, commit="abc", date="d", copy_tbps=4.24)
    rows = [
        _row(),
        _row(cudnn_us=None, cudnn_variant=None, vs_cudnn=None, cudnn_max_abs_diff=None, cudnn_error="refused"),
        _row(error="RuntimeError: out of memory"),
    ]
    md = bench_decode.markdown({"header": header, "rows": rows})
    table = [line for line in md.splitlines() if line.startswith("| paged |")]
    assert "| 20.0 | 0.40 | 10 | 300.0 | 60.0 | 17.0 | 15.0 | 44.0 | 3.00 | 0.75 |" in table[0]
    assert "| missing |" in table[1]
    assert "error: RuntimeError" in table[2]
    assert "- paged B=1 ctx=4096 Hq=32: refused" in md


def test_no_gpu_message(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_decode.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_decode.main(["--out", str(tmp_path)])


def test_host_overhead(tmp_path):
    """The Python path before the launches, with the launches stubbed out (and put back afterwards)."""
    from flashtile.ops.decode import split_kv

    kernel = split_kv._split_kv_kernel
    bench_decode.main(["--out", str(tmp_path), "--host-overhead", "--host-calls", "3"])
    data = json.loads((tmp_path / "host.json").read_text())
    assert len(data["rows"]) == 2 * len(bench_decode.HOST_ROWS)
    assert all(row["us_per_call"] > 0 for row in data["rows"])
    assert split_kv._split_kv_kernel is kernel
