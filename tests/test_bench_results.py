"""The one record format of the benchmarks (``flashtile.bench.results``): every benchmark's records, tables and
plots, on a CPU; and the repository's results file, which the documentation's tables come from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import bench_cpu
import bench_decode  # benchmarks/, on the path from conftest
import bench_ring
import bench_varlen
import latency
import tables
from flashtile import _backend
from flashtile.bench import context, plot, results

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
ENV = {"date": "2026-12-01T00:00:00+00:00", "gpu": "NVIDIA H200", "gpus": 1, "driver": "580", "cuda": "13.0",
       "torch": "2.11.0", "triton": "3.6.0", "cudnn": "9.19.0", "commit": "abc1234", "flashtile": "0.2.0",
       "flash_attn_4": "4.0.0b36"}  # fmt: skip


def _attention(implementation, n, ms, pass_="fwd", flagged=False):
    shape = {"dtype": "bf16", "B": 16384 // n, "N": n, "H": 16, "D": 128, "causal": False}
    rec = results.record(ENV, "attention", implementation, shape, pass_, time_ms=ms, flops=4.0 * 16384 * n * 2048)
    rec["extra"]["flagged"] = flagged
    return rec


def test_record_fields_and_rates():
    rec = results.record(ENV, "decode", "fa4", {"B": 1}, "decode", time_ms=2.0, flops=4e12, nbytes=8e9)
    assert list(rec) == list(results.FIELDS)
    assert rec["version"] == "4.0.0b36" and rec["commit"] == "abc1234" and rec["gpu"] == "NVIDIA H200"
    assert rec["tflops"] == pytest.approx(2000.0) and rec["tbps"] == pytest.approx(4.0)  # 4e12 FLOP, 8 GB in 2 ms
    assert results.record(ENV, "attention", "cudnn", {}, "fwd")["version"] == "2.11.0"
    missing = results.record(ENV, "attention", "flashtile", {}, "fwd", flops=1.0, error="out of memory")
    assert missing["version"] == "0.2.0" and missing["tflops"] is None and missing["error"] == "out of memory"


def test_write_and_load(tmp_path):
    records = [_attention("flashtile", 1024, 0.5), _attention("cudnn", 1024, 0.6)]
    path = tmp_path / "out" / "r.jsonl"
    results.write(path, records)
    assert results.load(path) == records
    assert len(path.read_text().splitlines()) == 2
    with pytest.raises(ValueError):  # NaN is not JSON
        results.write(path, [{**records[0], "time_ms": math.nan}])
    assert results.load(path) == records  # the file before the failed write is intact


def test_table_pivots_implementations_and_ratios():
    records = [_attention("flashtile", 1024, 0.5), _attention("cudnn", 1024, 0.6, flagged=True),
               _attention("flashtile", 2048, 2.0), _attention("cudnn", 2048, None)]  # fmt: skip
    header, body = results.table(records, ("N", "pass"), ratios_against=["cudnn"])
    assert header == ["N", "pass", "flashtile", "cuDNN", "vs cuDNN"]
    ours, theirs = (records[0]["tflops"], records[1]["tflops"])
    assert body[0] == ["1024", "fwd", f"{ours:.0f}", f"{theirs:.0f} (!)", "1.20"]
    assert body[1] == ["2048", "fwd", f"{records[2]['tflops']:.0f}", "-", "-"]
    header, body = results.table(records, ("N",), value="time_ms", ratios_against=["cudnn"], digits=3)
    assert body[0][1:] == ["0.500", "0.600 (!)", "1.20"]  # times: the peer's over flashtile's
    assert "| N | flashtile | cuDNN | vs cuDNN |" in results.markdown(header, body)


def test_decode_records():
    row = dict(
        layout="paged", page_size=256, batch=2, context=4096, nheads_q=32, nheads_kv=8, head_dim=128, num_splits=4,
        graph_us=20.0, kv_tbps=None, pct_of_copy=None, eager_us=300.0, eager_unchecked_us=60.0, sdpa_us=17.0,
        cudnn_us=None, cudnn_variant=None, cudnn_error="refused", gather_us=44.0, speedup=None, vs_cudnn=None,
        max_abs_diff=1e-3, cudnn_max_abs_diff=None, graph_max_abs_diff=0.0, flagged=False, error=None,
    )  # fmt: skip
    records = bench_decode.records(ENV, [row])
    launches = [(r["implementation"], r["config"].get("launch")) for r in records]
    assert launches == [("flashtile", "graph"), ("flashtile", "eager"), ("flashtile", "eager, value checks off"),
                        ("sdpa", None), ("cudnn", None), ("gather", None)]  # fmt: skip
    graph = records[0]
    kv_bytes = 2 * 2 * 4096 * 8 * 128 * 2
    assert graph["time_ms"] == pytest.approx(0.02) and graph["tbps"] == pytest.approx(kv_bytes / 20e-6 / 1e12)
    assert graph["extra"]["num_splits"] == 4 and graph["shape"]["Hq"] == 32
    assert records[4]["error"] == "refused" and records[5]["tbps"] is None and records[1]["tbps"] is None
    failed = bench_decode.records(ENV, [dict(row, error="RuntimeError: out of memory", graph_us=None)])
    assert {r["error"] for r in failed} == {"RuntimeError: out of memory"}


def test_ring_varlen_latency_records():
    header = {**ENV, "settings": {"dtype": "bf16", "batch": 1, "nheads": 16, "head_dim": 128}}
    scaling = {"kind": "scaling", "N": 65536, "N_requested": 65536, "world": 2, "status": "ok",
               "method": "ring_flash_attn_func (zigzag)", "peak_gib_per_gpu": 1.5, "fwd_bwd_ms": 78.9,
               "fwd_bwd_efficiency": 0.906, "fwd_bwd_tokens_per_s": 8.3e5, "fwd_ms": 19.6, "fwd_efficiency": 0.81,
               "fwd_tokens_per_s": 3.3e6}  # fmt: skip
    longest = {"kind": "longest", "N": 8388608, "world": 2, "window": 4096, "status": "out of memory"}
    ring = bench_ring.records(header, [scaling, longest, {"kind": "note", "status": "x"}])
    assert [(r["benchmark"], r["pass"], r["gpus"]) for r in ring] == [("ring", "fwd+bwd", 2), ("ring", "fwd", 2),
                                                                      ("ring-longest", "fwd+bwd", 2)]  # fmt: skip
    assert ring[0]["memory_mib"] == 1536 and ring[0]["extra"]["efficiency"] == 0.906 and ring[1]["memory_mib"] is None
    assert ring[2]["error"] == "out of memory"

    row = {"batch": "16k + 63 x 256", "causal": True, "pass": "fwd", "packed_ms": 3.2, "padded_ms": None,
           "longest_alone_ms": 2.7}  # fmt: skip
    varlen = bench_varlen.records(ENV, [row])
    assert [(r["config"]["layout"], r["time_ms"]) for r in varlen] == [
        ("packed", 3.2), ("padded", None), ("longest sequence alone", 2.7)]  # fmt: skip
    assert varlen[1]["error"].startswith("not timed")

    launch = [{"what": "flashtile-binder fwd+bwd", "N": 512, "causal": False, "eager_ms": 1.2, "graph_ms": 0.8,
               "host_us": 700.0, "host_us_rounds": [700.0]}]  # fmt: skip
    first = [{"what": "empty cache 3,1000,12,96", "first_call_s": 7.6, "process_s": 13.1}]
    lat = latency.records(ENV, launch, first)
    assert [(r["benchmark"], r["config"]) for r in lat] == [
        ("latency", {"launch": "eager", "gluon launch": "Triton's binder"}),
        ("latency", {"launch": "graph", "gluon launch": "Triton's binder"}),
        ("first-call", {"kernel cache": "empty cache"}),
    ]  # fmt: skip
    assert lat[0]["shape"]["B"] == 32 and lat[0]["extra"]["host_us"] == 700.0 and lat[2]["time_ms"] == 7600.0
    assert lat[2]["shape"] == {"dtype": "bf16", "B": 3, "N": 1000, "H": 12, "D": 96, "causal": True}


def test_plots(tmp_path):
    records = [_attention(impl, n, ms) for impl, ms in (("flashtile", 0.5), ("cudnn", 0.6)) for n in (1024, 2048)]
    records += [_attention("flashtile", 1024, 1.0, "bwd")]
    shape = {"dtype": "bf16", "layout": "paged", "B": 1, "context": 4096, "Hq": 32}
    records.append(results.record({**ENV, "commit": None}, "decode", "sdpa", shape, "decode", time_ms=0.02, nbytes=1e8))
    io_shape = {"dtype": "bf16", "B": 1, "N": 1024, "H": 16, "D": 128, "causal": False}
    for pass_, ncu in (("fwd", 2.6e8), ("bwd", None)):  # ncu could not count the backward: its line is missing
        extra = {"model_bytes": 2.7e8, "standard_bytes": 2.4e9, "ncu_bytes": ncu}
        records.append(results.record(ENV, "io", "flashtile", io_shape, pass_, extra=extra))
    written = plot.plot_files(records, tmp_path)
    assert [p.name for p in written] == [
        "nvidia-h200-attention-bf16-abc1234.png",
        "nvidia-h200-decode-paged-2026-12-01.png",
        "nvidia-h200-io-bf16-abc1234.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_repository_results():
    """The results the documentation cites: one schema, every record measured or saying why not, each plot there."""
    records = results.load(RESULTS / "h200.jsonl")
    assert all(list(r) == list(results.FIELDS) for r in records)
    assert all((r["error"] is None) == (r["time_ms"] is not None or r["memory_mib"] is not None) for r in records)
    assert {r["gpu"] for r in records} == {"NVIDIA H200"}
    assert all(r["commit"] and r["date"] and r["torch"] and r["triton"] for r in records)
    plotted = {plot.file_name(r) for r in results.load(*RESULTS.glob("*.jsonl")) if r["benchmark"] in plot.PLOTS}
    for png in RESULTS.glob("*.png"):
        assert png.name in plotted, png.name
    assert json.loads((RESULTS / "h200.jsonl").read_text().splitlines()[0])["benchmark"] == "attention"


def test_cpu_records(monkeypatch):
    """bench_cpu.py on a tiny shape: every row a record of the one format, its tables built from the records."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # CPU tensors take flashtile.cpu, as outside the tests
    monkeypatch.setattr(bench_cpu, "NHEADS", 2)
    monkeypatch.setattr(bench_cpu, "HEAD_DIM", 16)
    rows = bench_cpu.measure_times("main", 40, "fp32", True, reps=1)
    rows.append({"group": "memory", "name": "sdpa", "shape": rows[0]["shape"], "pass": "fwd+bwd", "memory_mib": 1.5})
    recs = bench_cpu.records({**ENV, "gpu": "cpu", "driver": None, "cudnn": None}, rows)
    assert all(list(r) == list(results.FIELDS) for r in recs) and len(recs) == 2 * len(bench_cpu.MAIN) + 1
    tiled = next(r for r in recs if r["config"].get("route") == "tiled" and r["pass"] == "fwd+bwd")
    assert tiled["implementation"] == "flashtile" and tiled["time_ms"] > 0 and tiled["extra"]["max_abs_diff"] < 1e-4
    assert recs[-1]["benchmark"] == "attention-memory" and recs[-1]["memory_mib"] == 1.5
    (title, _, cells), *_ = bench_cpu.tables(recs)
    assert title.startswith("Time") and [row[:4] for row in cells] == [["fp32", "40", "yes", "fwd"],
                                                                       ["fp32", "40", "yes", "fwd+bwd"]]  # fmt: skip


def test_repository_cpu_results():
    """The CPU results docs/performance.md cites: the one schema, every record measured, on the CPU."""
    for path in sorted(RESULTS.glob("cpu-attention-t*.jsonl")):
        records = results.load(path)
        assert records and all(list(r) == list(results.FIELDS) for r in records)
        assert all(r["gpu"] == "cpu" and r["commit"] and (r["time_ms"] or r["memory_mib"]) for r in records)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.gpu
def test_environment_on_gpu():
    env = results.environment(torch.device("cuda"))
    assert env["gpu"] == torch.cuda.get_device_name() and env["cudnn"]


def test_io_table_in_the_docs_is_the_results_file(capsys):
    """docs/performance.md's HBM table is what benchmarks/tables.py prints from h100-io.jsonl (bold aside)."""
    tables.io(results.load(RESULTS / "h100-io.jsonl"))
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    docs = (RESULTS.parents[1] / "docs" / "performance.md").read_text().replace("**", "").splitlines()
    assert len(printed) == 2 + 16 and all(line in docs for line in printed)


def test_max_context_table(capsys):
    """benchmarks/tables.py's table of max-context records: a lower bound says so."""
    probes = [context.Probe(n, n <= 2048, n * 2**20 if n <= 2048 else None, None, 1.5, 2**30)
              for n in (1024, 2048, 3072)]  # fmt: skip
    found = [context.Search("flashtile", 2, 2**30, 2048, False, 3072, probes)]
    tables.max_context(context.records(found, ENV, budget_s=60.0))
    out = capsys.readouterr().out
    row = ("| 2 | flashtile, ring_flash_attn_func (zigzag) | 2048 (lower bound: time budget) | 2.0 | 1.5 | 3072 | 1.0 "
           "| 3 |")  # fmt: skip
    assert row in out, out
