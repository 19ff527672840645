"""flashtile.profile() and its model (flashtile.iomodel): records per pass, their keys, FLOPs and bytes against
hand computations, and nothing (no record, no event, no synchronisation) outside a profile block."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console

import flashtile
from flashtile import _backend, cli, iomodel, profiler
from flashtile.bench import context, hbm, results

KEYS = {"op", "pass", "path", "reason", "shape", "dtype", "flops", "hbm_bytes", "min_hbm_bytes", "standard_bytes",
        "time_ms", "tflops", "gbps", "fraction_of_peak", "causal", "window", "softcap", "alibi", "sink", "dropout",
        "mask"}  # fmt: skip


def _brute_pairs(sq: int, sk: int, left: int | None, right: int | None) -> int:
    offset = sk - sq
    return sum(
        1
        for i in range(sq)
        for j in range(sk)
        if (left is None or j >= i + offset - left) and (right is None or j <= i + offset + right)
    )


@pytest.mark.parametrize("sq, sk", [(1, 1), (7, 7), (5, 13), (13, 5), (0, 4), (33, 17)])
@pytest.mark.parametrize("window", [(None, None), (None, 0), (3, 0), (2, 5), (0, 0), (None, 2), (4, None), (40, 40)])
def test_visible_pairs_counts_every_pair_the_mask_leaves(sq, sk, window):
    assert iomodel.visible_pairs(sq, sk, *window) == _brute_pairs(sq, sk, *window)


def test_flops_follow_flash_attentions_convention():
    # causal 100 x 100: 5050 visible pairs; 4 * D per pair and head forward, 2.5 x that backward
    assert iomodel.attention_flops(2 * 5050, 4, 32) == 4 * 32 * 5050 * 2 * 4
    assert iomodel.attention_flops(10, 1, 64, pass_="bwd") == 2.5 * 4 * 64 * 10
    assert iomodel.attention_flops(10, 1, 64, 32, pass_="fwd+bwd") == 3.5 * 2 * (64 + 32) * 10
    assert iomodel.convention_flops(2, 4, 100, 32, causal=True) == 0.5 * 4 * 2 * 4 * 100 * 100 * 32
    with pytest.raises(ValueError, match="pass must be one of"):
        iomodel.pass_factor("forward")


# B=1, Sq=Sk=64, H=2 query heads on Hk=1 key/value head (GQA), D=Dv=16, bf16 (2 bytes), no mask
SMALL = iomodel.Problem(1, 64, 64, 2, 1, 16, 16, 2)
Q_BYTES = 64 * 2 * 16 * 2  # q, out, dq, dout: 4096 each
KV_BYTES = 64 * 1 * 32 * 2  # k and v together (and dk, dv): 4096
STATS = 2 * 64 * 4  # one of lse, delta: 512


def test_forward_bytes_by_hand():
    # one kernel: q, k, v read once (the L2 serves the repeated K/V reads of a head's query tiles), out and lse written
    assert SMALL.hbm_bytes("fwd") == Q_BYTES + KV_BYTES + Q_BYTES + STATS
    causal = iomodel.Problem(1, 64, 64, 2, 1, 16, 16, 2, None, 0)
    assert causal.hbm_bytes("fwd") == SMALL.hbm_bytes("fwd")  # every key row is seen by some query
    masked = iomodel.Problem(1, 64, 64, 2, 1, 16, 16, 2, None, None, 1)  # a bool attn_mask, all of it visible
    assert masked.hbm_bytes("fwd") == SMALL.hbm_bytes("fwd") + 2 * 64 * 64


def test_backward_bytes_by_hand():
    delta = 2 * Q_BYTES + STATS  # read out and dout, write delta
    reads = Q_BYTES + KV_BYTES + Q_BYTES + 2 * STATS  # q, k, v, dout, lse, delta: what a backward kernel reads
    # the Triton backward: the dK/dV kernel writes dk, dv; the dQ kernel writes dq
    assert SMALL.hbm_bytes("bwd") == delta + (reads + KV_BYTES) + (reads + Q_BYTES)
    # the Gluon backward: an fp32 accumulator of dq's 64 x 2 x 16 values zeroed, read and written back once by the
    # kernel's adds (besides its reads and dk, dv), read once more and cast to dq
    accumulator = 64 * 2 * 16 * 4
    gluon = delta + accumulator + (reads + 2 * accumulator + KV_BYTES) + (accumulator + Q_BYTES)
    assert SMALL.hbm_bytes("bwd", dq_atomic=True) == gluon
    assert SMALL.hbm_bytes("fwd+bwd") == SMALL.hbm_bytes("fwd") + SMALL.hbm_bytes("bwd")
    with pytest.raises(ValueError, match="pass must be one of fwd, bwd, fwd\\+bwd, got 'backward'"):
        SMALL.hbm_bytes("backward")


def test_compulsory_bytes_by_hand():
    assert SMALL.compulsory_bytes("fwd") == Q_BYTES + KV_BYTES + Q_BYTES + STATS
    # q, k, v, out, dout, lse read; delta written and read; dq, dk, dv written
    assert SMALL.compulsory_bytes("bwd") == 3 * Q_BYTES + KV_BYTES + STATS + 2 * STATS + Q_BYTES + KV_BYTES
    # the forward is one kernel: the model is the floor; the backward's kernels read some tensors more than once
    assert SMALL.compulsory_bytes("fwd") == SMALL.hbm_bytes("fwd")
    assert SMALL.compulsory_bytes("bwd") < SMALL.hbm_bytes("bwd") < SMALL.hbm_bytes("bwd", dq_atomic=True)


MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h100-io.jsonl"
TOLERANCE = 0.10
"""The model's promise (docs/profiling.md): Nsight Compute's DRAM bytes within 10% of it."""
L2_LIMIT = {("fwd", 128, 32768), ("bwd", 64, 32768), ("bwd", 128, 16384), ("bwd", 128, 32768)}
"""(pass, D, N) of the measured rows where a head's working set (16.8 MB or more) outgrows the L2's share of the
heads in flight: the model does not count those re-reads (docs/profiling.md, the limit)."""


def test_model_against_nsight_compute_on_an_h100():
    """The H100 table of docs/profiling.md: the model within TOLERANCE of ncu's DRAM bytes on every row but the
    documented L2 limit, where ncu exceeds it (the limit holds: a better model fails this and moves the docs)."""
    rows = results.load(MEASURED)
    assert len(rows) == 16 and {r["extra"]["path"] for r in rows} == {"sm90-gluon"}
    for rec in rows:
        s, x = rec["shape"], rec["extra"]
        window_right = 0 if s["causal"] else None
        problem = iomodel.Problem(s["B"], s["N"], s["N"], s["H"], s["H"], s["D"], s["D"], 2, None, window_right)
        model = problem.hbm_bytes(rec["pass"], dq_atomic=True)
        assert x["model_bytes"] == model and x["floor_bytes"] == problem.compulsory_bytes(rec["pass"])
        assert x["standard_bytes"] == problem.standard_bytes(rec["pass"])
        ratio = x["ncu_bytes"] / model
        if (rec["pass"], s["D"], s["N"]) in L2_LIMIT:
            assert ratio > 1 + TOLERANCE, (rec["pass"], s, ratio)
        else:
            assert abs(ratio - 1) <= TOLERANCE, (rec["pass"], s, ratio)


def test_standard_and_decode_bytes_by_hand():
    scores = 2 * 64 * 64 * 2  # (B, H, Sq, Sk) in bf16
    assert SMALL.standard_bytes("fwd") == Q_BYTES + KV_BYTES + 4 * scores + Q_BYTES
    assert SMALL.standard_bytes("bwd") == Q_BYTES + Q_BYTES + KV_BYTES + 7 * scores + Q_BYTES + KV_BYTES
    one_token = iomodel.Problem(2, 1, 100, 4, 2, 8, 8, 2)  # two sequences of 100 cached keys, one query each
    new_rows = 2 * 2 * 2 * 16 * 2  # 2 new tokens x batch 2 x 2 heads x (8 + 8) x 2 bytes, read and written
    q_out = 2 * 1 * 4 * 8 * 2
    assert one_token.decode_bytes(2) == q_out + 2 * 100 * 2 * 16 * 2 + 2 * new_rows + q_out + 2 * 4 * 4
    windowed = iomodel.Problem(2, 1, 100, 4, 2, 8, 8, 2, 9, 0)  # the last token sees the 10 newest keys
    assert windowed.decode_bytes(0) == q_out + 2 * 10 * 2 * 16 * 2 + q_out + 2 * 4 * 4


def test_peaks_by_device_name():
    assert profiler.device_peak("NVIDIA H100 80GB HBM3") == (989.0, 3350.0)
    assert profiler.device_peak("NVIDIA H100 PCIe") == (756.0, 2000.0)
    assert profiler.device_peak("NVIDIA H200") == (989.0, 4800.0)
    assert profiler.device_peak("NVIDIA GH200 480GB") == (989.0, 4000.0)  # not the H200's
    assert profiler.device_peak("NVIDIA L40") == (181.0, 864.0)  # not the L4's
    assert profiler.device_peak("NVIDIA A100-SXM4-80GB") == (312.0, 2039.0)
    assert profiler.device_peak("Some Future GPU") is None


def _qkv(b, sq, sk, h, hk, d, dtype=torch.bfloat16, grad=False):
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=grad) for _ in range(2))
    return q, k, v


def test_forward_only_is_one_record_with_every_key(path):
    q, k, v = _qkv(1, 64, 64, 2, 1, 16)
    with flashtile.profile() as prof:
        flashtile.flash_attn_func(q, k, v)
    (rec,) = prof.records
    assert KEYS <= rec.keys()
    # CPU tensors: the interpreter's when it is on (the 'triton' path on a CPU-only machine), else flashtile.cpu
    expected_path = "triton-interpreter" if path == "triton" and _backend.TRITON_INTERPRET else "cpu-torch"
    assert (rec["op"], rec["pass"], rec["path"], rec["dtype"]) == ("attention", "fwd", expected_path, "bf16")
    assert rec["shape"] == {"B": 1, "Sq": 64, "Sk": 64, "H": 2, "Hk": 1, "D": 16, "Dv": 16}
    assert rec["flops"] == 4 * 16 * 64 * 64 * 2
    assert rec["hbm_bytes"] == rec["min_hbm_bytes"] == Q_BYTES + KV_BYTES + Q_BYTES + STATS
    assert rec["standard_bytes"] == SMALL.standard_bytes("fwd")
    assert rec["time_ms"] > 0 and rec["tflops"] > 0 and rec["gbps"] > 0
    assert rec["fraction_of_peak"] is None  # no peak on a CPU
    assert rec["causal"] is False and rec["window"] is None


def test_forward_and_backward_are_two_records(path):
    q, k, v = _qkv(2, 17, 33, 2, 2, 16, grad=True)
    with flashtile.profile() as prof:
        out = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(8, 0))
        out.sum().backward()
    fwd, bwd = prof.records
    assert (fwd["pass"], bwd["pass"]) == ("fwd", "bwd")
    assert fwd["window"] == [8, 0] and not fwd["causal"]
    problem = iomodel.Problem(2, 17, 33, 2, 2, 16, 16, 2, 8, 0)
    assert fwd["flops"] == problem.flops("fwd") and bwd["flops"] == problem.flops("bwd")
    assert bwd["flops"] == 2.5 * fwd["flops"]
    assert bwd["hbm_bytes"] > fwd["hbm_bytes"] and bwd["standard_bytes"] > fwd["standard_bytes"]
    assert (fwd["hbm_bytes"], bwd["hbm_bytes"]) == (problem.hbm_bytes("fwd"), problem.hbm_bytes("bwd"))


def test_varlen_records_count_each_sequence():
    lengths = [5, 20, 1]
    cu = torch.tensor([0, 5, 25, 26], dtype=torch.int32)
    q, k, v = (torch.randn(26, 2, 16, requires_grad=True) for _ in range(3))
    with flashtile.profile() as prof:
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, causal=True).sum().backward()
    fwd, bwd = prof.records
    assert (fwd["op"], fwd["pass"], bwd["op"], bwd["pass"]) == ("varlen_attention", "fwd", "varlen_attention", "bwd")
    assert fwd["shape"]["batch"] == 3 and fwd["dtype"] == "fp32"
    assert fwd["flops"] == sum(4 * 16 * 2 * n * (n + 1) // 2 for n in lengths)


def test_kvcache_records_the_visible_cache(path):
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = torch.randn(2, 100, 2, 8), torch.randn(2, 100, 2, 8)
    k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    seqlens = torch.tensor([10, 50], dtype=torch.int32)
    with flashtile.profile() as prof:
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)
    (rec,) = prof.records
    decode = "cpu-decode" if _backend.path_name(q.device) == "cpu" else "split-kv"
    assert (rec["op"], rec["pass"], rec["path"]) == ("kvcache", "fwd", decode)
    assert rec["shape"]["seqlen_cache"] == 100 and rec["shape"]["seqlen_new"] == 1
    visible = [11, 51]  # the cache lengths after appending one token
    assert rec["flops"] == sum(4 * 8 * 4 * n for n in visible)
    cache_reads = sum(n * 2 * 16 * 4 for n in visible)  # keys x heads_k x (D + Dv) x fp32
    q_out_lse = 2 * (2 * 4 * 8 * 4) + 2 * 4 * 4
    assert rec["hbm_bytes"] == cache_reads + 2 * (2 * 2 * 16 * 4) + q_out_lse


def test_nothing_is_recorded_or_synchronised_outside_a_profile(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: calls.append("Event"))
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # flashtile.cpu: fast
    q, k, v = _qkv(1, 16, 16, 2, 2, 16, grad=True)
    flashtile.flash_attn_func(q, k, v).sum().backward()
    with flashtile.profile() as prof:
        flashtile.flash_attn_func(q, k, v).sum().backward()
    assert _backend.RECORDING is None
    assert not isinstance(_backend.path_module(q.device), profiler._RecordedPath)
    flashtile.flash_attn_func(q, k, v).sum().backward()
    assert len(prof.records) == 2
    assert calls == []  # the CPU path times by the wall clock; off, nothing at all


def test_nested_profiles_record_into_the_innermost(monkeypatch):
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # flashtile.cpu: fast
    q, k, v = _qkv(1, 16, 16, 2, 2, 16)
    with flashtile.profile() as outer:
        with flashtile.profile() as inner:
            flashtile.flash_attn_func(q, k, v)
        assert _backend.RECORDING is outer
        flashtile.flash_attn_func(q, k, v)
    assert (len(outer.records), len(inner.records)) == (1, 1)


class _Event:
    """A CUDA event stand-in that counts synchronisations."""

    synchronized = 0

    def synchronize(self):
        _Event.synchronized += 1

    def elapsed_time(self, end):
        return 2.0


def test_times_are_read_when_the_records_are():
    prof = flashtile.profile()
    record = {"dtype": "bf16"}
    prof._pending.append(
        profiler._Pending(record, lambda: (4e9, 2e6, 1e6, 8e6), torch.device("cpu"), (_Event(), _Event()))
    )
    assert _Event.synchronized == 0
    (rec,) = prof.records
    assert _Event.synchronized == 1
    assert (rec["time_ms"], rec["tflops"], rec["gbps"]) == (2.0, 2.0, 1.0)
    assert prof.records == [rec] and _Event.synchronized == 1  # resolved once


def test_table_and_json(tmp_path, monkeypatch):
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # flashtile.cpu: fast
    q, k, v = _qkv(1, 16, 16, 2, 2, 16, grad=True)
    with flashtile.profile() as prof:
        flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
    console = Console(file=io.StringIO(), width=200)
    prof.table(console)
    text = console.file.getvalue()
    assert "attention fwd" in text and "attention bwd" in text and "total" in text and "causal" in text
    path = tmp_path / "profile.json"
    prof.to_json(path)
    saved = json.loads(path.read_text())
    assert [r["pass"] for r in saved] == ["fwd", "bwd"] and KEYS <= saved[0].keys()


@pytest.mark.gpu
def test_cuda_passes_are_timed_without_synchronising(monkeypatch):
    q, k, v = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flashtile.flash_attn_func(q, k, v).sum().backward()  # compile first
    synchronized = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synchronized.append(a) or real(*a))
    with flashtile.profile() as prof:
        flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
        assert synchronized == [] and len(prof._pending) == 2
    fwd, bwd = prof.records
    assert fwd["path"] in ("triton", "sm90-gluon") and fwd["time_ms"] > 0 and bwd["time_ms"] > 0
    assert fwd["reason"]


def test_longest_fitting_doubles_then_bisects_to_a_multiple():
    probes = []

    def fits(n):
        probes.append(n)
        return n <= 5000

    assert context.longest_fitting(fits, multiple=1024) == (4096, True)
    assert probes == [1024, 2048, 4096, 8192, 6144, 5120]
    assert context.longest_fitting(lambda n: False) == (0, True)


@pytest.mark.parametrize("limit", [1024, 5000, 2**21 + 3 * 1024, 2**21 + 100 * 1024, 2**21 - 5 * 1024])
def test_longest_fitting_from_a_guess_probes_its_neighbourhood(limit):
    """From a start near the limit: the start, then outward in doubling steps, then bisection; any limit is found."""
    probes = []
    found = context.longest_fitting(lambda n: probes.append(n) or n <= limit, start=2**21)
    assert found == (limit // 1024 * 1024, True) and len(probes) == len(set(probes))
    assert probes[0] == 2**21 and len(probes) <= 2 * math.log2(2**21 / 1024) + 2
    probes.clear()
    exact = 2**21  # the guess right: two probes
    assert context.longest_fitting(lambda n: probes.append(n) or n <= exact, start=exact) == (exact, True)
    assert probes == [exact, exact + 1024]


def test_longest_fitting_stops_where_it_may_not_probe():
    probes = []
    found = context.longest_fitting(lambda n: probes.append(n) or n <= 10**6, start=4096, may_probe=lambda n: n < 9000)
    assert found == (4096 + 1024 + 2048, False) and probes == [4096, 5120, 7168]


def test_predict_limit_meets_the_line():
    peaks = {1024: 10 * 2**20 + 1024 * 40960, 2048: 10 * 2**20 + 2048 * 40960}
    capacity = 10 * 2**20 + 100_000 * 40960
    assert context.predict_limit(peaks, capacity) == 100_000 // 1024 * 1024
    assert context.predict_limit({1024: 5}, capacity) is None
    assert context.predict_limit({1024: 5, 2048: 5}, capacity) is None


def _fake_gpu(limit_tokens: int, bytes_per_token: int = 40960, tflop_s: float = 400.0, fixed: int = 2**28):
    """``run(n)`` of a GPU whose memory ends at ``limit_tokens`` (linear memory) and whose time grows with N²."""

    def run(n: int) -> context.Probe:
        seconds = 4 * n * n * 16 * 128 / 2 * 3.5 / (tflop_s * 1e12)
        free = fixed + limit_tokens * bytes_per_token
        if n > limit_tokens:
            return context.Probe(n, False, None, None, seconds / 3, free)
        peak = fixed + n * bytes_per_token
        return context.Probe(n, True, peak, peak, seconds, free)

    return run


class _Clock:
    """A clock that each probe advances by its own seconds and ``overhead`` more (starting processes)."""

    def __init__(self, run, overhead: float = 0.0):
        self.now, self.runs = 0.0, []
        self.inner, self.overhead = run, overhead

    def __call__(self):
        return self.now

    def run(self, n):
        probe = self.inner(n)
        self.runs.append(n)
        self.now += probe.seconds + self.overhead
        return probe


def test_search_calibrates_predicts_then_probes_two_lengths():
    limit = 1_950_000
    clock = _Clock(_fake_gpu(limit))
    found = context.search(clock.run, "flashtile", 80 * 2**30, clock=clock)
    assert found.exact and found.seqlen == limit // 1024 * 1024 == found.predicted
    assert len(clock.runs) == 4 and clock.runs[2:] == [found.seqlen, found.seqlen + 1024]
    assert found.best().seqlen == found.seqlen and found.capacity_bytes == 2**28 + limit * 40960
    assert max(clock.runs[:2]) < limit / 4  # the calibration is cheap: short lengths


def test_search_within_a_budget_gives_a_lower_bound():
    limit = 1_950_000
    clock = _Clock(_fake_gpu(limit))
    full = _fake_gpu(limit)(limit // 1024 * 1024).seconds
    found = context.search(clock.run, "flashtile", 80 * 2**30, budget_s=full / 2, clock=clock)
    assert not found.exact and 0 < found.seqlen < limit and clock.now <= full / 2
    assert found.seqlen > limit / 2  # the budget's worth: about 1/sqrt(2) of the limit
    clock = _Clock(_fake_gpu(limit), overhead=20.0)  # a ring: each probe starts processes
    found = context.search(clock.run, "flashtile", 80 * 2**30, budget_s=full / 2 + 60, clock=clock)
    assert not found.exact and found.seqlen > limit / 2 and clock.now <= full / 2 + 60
    # standard attention: from 1024 up, no calibration
    clock = _Clock(_fake_gpu(20_000))
    found = context.search(clock.run, "standard", 80 * 2**30, clock=clock)
    assert found.seqlen == 19 * 1024 and found.predicted is None and clock.runs[:3] == [1024, 2048, 4096]


def test_max_context_records(tmp_path):
    clock = _Clock(_fake_gpu(1_950_000))
    found = [context.search(clock.run, "flashtile", 80 * 2**30, world=2, clock=clock)]
    env = results.environment(torch.device("cpu"), commit="test")
    path = context.append(tmp_path, context.records(found, env, budget_s=None))
    context.append(tmp_path, context.records(found, env, budget_s=100.0))
    saved = results.load(path)
    assert len(saved) == 2 and all(list(r) == list(results.FIELDS) for r in saved)
    first = saved[0]
    assert first["benchmark"] == "max-context" and first["gpus"] == 2 and first["shape"]["N"] == found[0].seqlen
    assert first["extra"]["exact"] and first["memory_mib"] > 0 and len(first["extra"]["probes"]) == 4
    assert first["config"]["method"] == "ring_flash_attn_func (zigzag)" and saved[1]["extra"]["budget_s"] == 100.0


def _oom_on_rank_one_past(q, k, v, dout, group):
    """A ring step in which, beyond 64 tokens per rank, rank 1 runs out of memory; rank 0 gets through at 128 (as on
    GPUs, where its transfers are queued on its stream and the call returns) and beyond waits for rank 1 forever (as a
    GPU rank whose allocator has to synchronize with a stream that waits for the failed peer)."""
    if q.shape[1] <= 64 or (dist.get_rank(group) == 0 and q.shape[1] > 128):
        context.ring_step(q, k, v, dout, group)
    elif dist.get_rank(group) == 1:
        raise torch.OutOfMemoryError("simulated")


@pytest.mark.slow  # three spawns of two processes
def test_ring_probe_over_gloo_agrees_on_the_verdict(tmp_path, monkeypatch):
    """Two gloo processes run the real ring on CPU tensors; when one rank runs out of memory neither fits, also when
    the other hangs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the children take flashtile's CPU path: fast
    monkeypatch.setattr(context, "RING_OOM_GRACE_S", 3)
    problem = hbm.Problem(batch=1, seqlen=0, nheads=2, head_dim=32, causal=True, dtype="bf16")
    run = context.ring_runner(2, problem, backend="gloo", step=_oom_on_rank_one_past, multiple=32)
    fits, too_long, hung = run(128), run(256), run(512)
    assert fits.fits and fits.seqlen == 128 and fits.seconds > 0 and fits.peak_bytes is None
    assert not hung.fits and hung.seqlen == 512 and hung.seconds < 60
    assert not too_long.fits and too_long.seqlen == 256


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ring_probe_over_nccl():
    """Two NCCL processes, one GPU each, at a short length: the probe fits and reports its memory."""
    run = context.ring_runner(2)
    probe = run(8192)
    assert probe.fits and probe.peak_bytes > 0 and probe.reserved_bytes >= probe.peak_bytes and probe.free_bytes > 0


def test_max_context_says_it_needs_a_gpu(capsys):
    assert cli.main(["check", "--max-context", "--device", "cpu"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("--max-context needs a CUDA GPU")
    assert "longest sequence (B=1, H=16, D=128, bf16, causal" in out


@pytest.mark.gpu
def test_max_context_on_a_gpu(capsys, monkeypatch):
    """With a 1 GiB cap (the allocator's fraction of the card): flashtile fits far longer than standard attention."""
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(2**30 / total)
    try:
        assert cli.main(["check", "--max-context"]) == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    out = capsys.readouterr().out
    found = dict(re.findall(r"^\s*(flashtile|standard)\s+│\s+(\d+)", out, re.MULTILINE))
    assert int(found["flashtile"]) % 1024 == 0 and int(found["flashtile"]) > 4 * int(found["standard"]) > 0, out


def test_ncu_io_script_help_and_dry_run(tmp_path, capsys, monkeypatch):
    import ncu_io  # benchmarks/, on the path by conftest

    with pytest.raises(SystemExit) as raised:
        ncu_io.main(["--help"])
    assert raised.value.code == 0 and "dram__bytes_read.sum" in capsys.readouterr().out
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # flashtile.cpu: fast at any size
    assert ncu_io.main(["--out", str(tmp_path), "--dry-run", "--commit", "test"]) == 0
    records = results.load(tmp_path / "ncu_io.jsonl")
    assert len(records) == 2 * 2 * 2 and all(list(r) == list(results.FIELDS) for r in records)
    assert {r["benchmark"] for r in records} == {"io"} and {r["pass"] for r in records} == {"fwd", "bwd"}
    assert all(r["extra"]["model_bytes"] > 0 and r["extra"]["ncu_bytes"] is None and r["error"] for r in records)
    assert "| D | N | causal | pass | path | floor MB | model MB | ncu MB |" in (tmp_path / "ncu_io.md").read_text()


def test_parse_ncu_csv():
    text = ('==PROF== Connected\n"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","fwd","dram__bytes_read.sum","byte","1,024"\n"0","fwd","dram__bytes_write.sum","byte","512"\n'
            '"1","bwd","dram__bytes_read.sum","byte","100"\n')  # fmt: skip
    assert hbm.parse_ncu_csv(text) == 1024 + 512 + 100
    with pytest.raises(hbm.NcuUnavailable, match="ERR_NVGPUCTRPERM"):
        hbm.parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM - no permission to access NVIDIA GPU Performance Counters\n")


def test_compiled_calls_are_recorded(monkeypatch):
    """Under torch.compile the passes are custom ops whose implementations run at run time: recorded as in eager."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # flashtile.cpu: fast
    q, k, v = _qkv(1, 16, 16, 2, 2, 16, grad=True)
    step = torch.compile(lambda *qkv: flashtile.flash_attn_func(*qkv, causal=True), backend="eager", fullgraph=True)
    with flashtile.profile() as prof:
        step(q, k, v).sum().backward()
    assert [(r["op"], r["pass"]) for r in prof.records] == [("attention", "fwd"), ("attention", "bwd")]


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_records_carry_the_dispatchers_choice(monkeypatch, softcap):
    """Each record's path is what the dispatcher runs (``flashtile.explain`` asks it too): on the CPU path torch's
    fused kernel, or the tiled route where an option (softcap) keeps that kernel out; its reason names the faster
    families passed over."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)  # flashtile.cpu
    q, k, v = _qkv(1, 16, 16, 2, 2, 16, grad=True)
    with flashtile.profile() as prof:
        flashtile.flash_attn_func(q, k, v, causal=True, softcap=softcap).sum().backward()
    expected = flashtile.explain(q, k, v, causal=True, softcap=softcap)
    paths = [r["path"] for r in prof.records]
    assert paths == [expected.forward.path, expected.backward.path]
    assert paths == (["cpu-tiled", "cpu-tiled"] if softcap else ["cpu-torch", "cpu-torch"])
    assert all("not sm90-gluon" in r["reason"] for r in prof.records)
