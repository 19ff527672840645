"""Context parallelism: tokens/s and scaling efficiency of ring attention on W GPUs, and the longest
sequence that fits, against flash_attn_func on one GPU.

    PYTHONPATH=src python3 benchmarks/bench_ring.py --out DIR [--time-budget S] [--max-world W]
        [--seqlens 32768,65536,...] [--warmup 2] [--iters 5] [--layout zigzag] [--commit SHA]
    PYTHONPATH=src python3 benchmarks/bench_ring.py --out DIR --cpu   # smoke run: gloo, CPU path, tiny N

It starts its own processes, one per GPU (torch.multiprocessing spawn, NCCL, rendezvous through a
file:// in a temporary folder), with NVLink multicast off (NCCL_NVLS_ENABLE=0 and friends, set before
anything starts).

Shapes: batch 1, nheads = nheads_k = 16, headdim 128, bf16, causal; the whole sequence N in {32k, 64k,
128k, 256k}. Each rank draws its own q, k, v and dout of (1, N / W, 16, 128) from N(0, 1) on its GPU.
W = 1 is ``flashtile.flash_attn_func`` on one GPU over the whole sequence; W = 2 .. device_count is
``ring_flash_attn_func(layout="zigzag")`` on ranks 0 .. W - 1, one GPU each (the other ranks wait).
Where 2W does not divide N (W = 3, say), N is rounded down to a multiple of 2W (the row's N says so).

Timing: per iteration, a barrier (an all_reduce over the W ranks and a device synchronize), then CUDA
events around one call on every rank; the iteration's time is the max over the ranks; reported is the
median over --iters iterations after --warmup (the first compiles the kernels). fwd+bwd: forward, then
``out.backward(dout)``, gradients set to None outside the timed region; fwd: the forward alone, inputs
requiring grad (as in training).
Throughput: tokens of the whole sequence per second, all W GPUs together (N / time).
Efficiency: T1 / (W * TW): for the same N, W GPUs ideally take T1 / W; 1.0 is perfect scaling (where N
is rounded down, T1 is scaled by (N_W / N)^2, causal attention costing N^2).
Peak memory: torch.cuda.max_memory_allocated during the fwd+bwd iterations (inputs and gradients
included), max over the ranks, in GiB per GPU.

Longest sequence (fwd+bwd), for W = 1 and every W: N doubles from 64k until a rank raises
torch.cuda.OutOfMemoryError (memory is freed and that W stops) or the next trial would end past the time
budget; then each W that ran out of memory tries 1.5 times its longest N that fit, once. One call per N,
causal with a sliding window of --longest-window keys (4096; 0 for plain causal): the buffers are those
of plain causal attention (q, k, v, out, LSE, gradients, the ring's K/V and dK/dV buffers; nothing
depends on the mask but the kernels' temporaries, which are linear in N either way), but the compute is
linear in N, so the search reaches the memory limit in seconds, where plain causal at millions of tokens
takes minutes a call. The ring's per-step gradient temporaries are smaller with a narrow window (blocks
outside the band are skipped), so its result is optimistic, by an estimated ~10% at most (not measured);
the table also gives the longest N predicted from the plain-causal peak memory per token of the scaling
runs. Every rank reports whether it ran out of memory before any rank waits on the GPU, so an
out-of-memory on one rank cannot leave the others waiting forever; if a rank's GPU stream still waits for a
peer that failed, the run stops there (what was measured is kept).

--time-budget S: nothing starts that is predicted to end more than S seconds after the start
(predictions from the previous N: x4 for plain causal, x2 in the windowed search, x2.25 and x1.5 for the
1.5x trial); the rows skipped say so. Outputs in --out: ``ring.jsonl`` (the records of
``flashtile.bench.results``, rewritten after every row, so a stopped run keeps what it measured) and ``ring.md``
(the tables, printed at the end).
"""

from __future__ import annotations

import os

# NVLink multicast off before torch, NCCL or NVSHMEM can start: on a shared host it can take GPUs out of service.
# The worker processes inherit these, and set them again.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import datetime, timedelta, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import triton  # noqa: E402

import flashtile  # noqa: E402
from flashtile import flash_attn_func  # noqa: E402
from flashtile.bench import results  # noqa: E402
from flashtile.distributed import ring_flash_attn_func  # noqa: E402

GIB = 1 << 30
SEQLENS = (32768, 65536, 131072, 262144)
BATCH, NHEADS, HEAD_DIM, DTYPE = 1, 16, 128, "bf16"
LONGEST_START, LONGEST_WINDOW, LONGEST_CAP = 65536, 4096, 1 << 26
EFFICIENCY_GOAL, GOAL_FROM_N = 0.85, 65536  # the aim: >= 85% at N >= 64k
# --cpu: the same logic on flashtile's CPU path over gloo, shapes small enough for seconds.
CPU_SEQLENS, CPU_NHEADS, CPU_HEAD_DIM = (256, 512), 2, 32
CPU_LONGEST_START, CPU_LONGEST_WINDOW, CPU_CAPACITY_TOKENS = 128, 64, 1536  # W = 1, 2 fit 1.5x their last doubling
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STATUS_TIMEOUT_S = 300  # how long a rank waits for the others' word after a call (includes kernel compiles)
STUCK_POLL_S = 10  # after a peer's out-of-memory: how long to wait for this rank's stream before calling it stuck


@dataclass(frozen=True)
class Settings:
    """What every process needs; picklable (spawn)."""

    out: str
    cpu: bool
    world: int  # processes = the largest W
    seqlens: tuple[int, ...]
    nheads: int
    head_dim: int
    dtype: str
    layout: str
    warmup: int
    iters: int
    deadline: float  # time.time() past which nothing may be predicted to end
    longest: bool
    longest_start: int
    longest_window: int  # 0: plain causal
    cpu_capacity_tokens: int  # --cpu only: a rank "runs out of memory" past this many tokens
    rendezvous: str
    header: dict[str, Any] = field(default_factory=dict)


class _Stuck(Exception):
    """A peer ran out of memory mid-ring and this rank's GPU stream may wait for it forever."""


# ---------------------------------------------------------------------------------------------------
# One measured configuration, on the ranks that take part


class _Clock:
    """CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def start(self) -> None:
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        """Mark the end (the GPU may still be working)."""
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def finished_within(self, seconds: float) -> bool:
        """Whether the GPU reaches the end mark within ``seconds``, without blocking past them."""
        if not self.cuda:
            return True
        deadline = time.monotonic() + seconds
        while not self.end.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def elapsed_ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


class _Runner:
    """One process of the benchmark: rank ``rank`` of ``settings.world``."""

    def __init__(self, rank: int, device: torch.device, s: Settings, timeout: timedelta) -> None:
        self.rank, self.device, self.s = rank, device, s
        self.cuda = device.type == "cuda"
        self.dtype = DTYPES[s.dtype]
        # Decisions and results travel over gloo (CPU): they never queue behind GPU work.
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout)
        self.groups: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}  # W -> (compute, status)
        for w in range(2, s.world + 1):  # every rank creates every group, in the same order
            ranks = list(range(w))
            compute = dist.group.WORLD if w == s.world else dist.new_group(ranks)
            status = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=STATUS_TIMEOUT_S))
            self.groups[w] = (compute, status)
        self.zero = torch.zeros(1, device=device)
        self.rows: list[dict[str, Any]] = []  # rank 0's record
        if rank == 0 and self.cuda:  # here, not in the parent: a CUDA context there would take GPU 0's memory
            s.header.update(_device_info())

    # -- coordination (every rank calls these, in the same order)

    def decide(self, proposal: tuple[bool, str]) -> tuple[bool, str]:
        """Rank 0's (run, reason), on every rank."""
        box = [proposal if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.s.world
        dist.all_gather_object(gathered, obj, group=self.ctrl)
        return gathered

    def all_ok(self, ok: bool, w: int) -> bool:
        """Whether every one of the W ranks is ok (before any of them waits on its GPU)."""
        if w == 1:
            return ok
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.groups[w][1])
        return bool(flag.item())

    def barrier(self, w: int) -> None:
        if w > 1:
            if self.cuda:
                dist.all_reduce(self.zero, group=self.groups[w][0])
            else:
                dist.barrier(group=self.groups[w][0])
        if self.cuda:
            torch.cuda.synchronize()

    # -- one configuration

    def inputs(self, w: int, n: int) -> tuple[torch.Tensor, ...]:
        """This rank's q, k, v (leaves requiring grad) and dout, (BATCH, n / w, nheads, head_dim)."""
        shape = (BATCH, n // w, self.s.nheads, self.s.head_dim)
        gen = torch.Generator(self.device).manual_seed(1000 * w + self.rank)
        q, k, v, dout = (torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype) for _ in range(4))
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout

    def call(self, w: int, n: int, tensors: tuple[torch.Tensor, ...], backward: bool, window: int) -> None:
        q, k, v, dout = tensors
        if self.s.cpu and n // w > self.s.cpu_capacity_tokens:  # the smoke run's stand-in for a full GPU
            raise torch.cuda.OutOfMemoryError(f"simulated (--cpu): {n // w} tokens per rank")
        window_size = (window - 1, 0) if window else (-1, -1)
        if w == 1:
            out = flash_attn_func(q, k, v, causal=True, window_size=window_size)
        else:
            out = ring_flash_attn_func(
                q, k, v, causal=True, window_size=window_size, group=self.groups[w][0], layout=self.s.layout
            )
        if backward:
            out.backward(dout)

    def trial(self, w: int, n: int, passes: Sequence[str], warmup: int, iters: int, window: int = 0) -> dict:
        """Run ``passes`` ("fwd_bwd", "fwd") on this rank (one of ranks 0 .. w-1). Returns this rank's
        {"status": "ok" | "oom" | "stuck", "ms": {pass: [ms per timed iteration]}, "peak_bytes", "seconds"}."""
        start = time.monotonic()
        result: dict[str, Any] = {"status": "ok", "ms": {p: [] for p in passes}, "peak_bytes": None}
        tensors: tuple[torch.Tensor, ...] = ()
        clock = _Clock(self.cuda)
        try:
            ok = True
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                tensors = self.inputs(w, n)
            except torch.cuda.OutOfMemoryError:
                ok = False
            if not self.all_ok(ok, w):
                result["status"] = "oom"
                return result
            for name in passes:
                for i in range(warmup + iters):
                    for t in tensors[:3]:
                        t.grad = None
                    self.barrier(w)
                    clock.start()
                    try:
                        self.call(w, n, tensors, name == "fwd_bwd", window)
                        ok = True
                    except torch.cuda.OutOfMemoryError:
                        ok = False
                    clock.stop()
                    if not self.all_ok(ok, w):
                        # A peer (or this rank) ran out of memory. If this rank got through, its stream may
                        # wait for the transfers of the peer that did not.
                        stuck = ok and not clock.finished_within(STUCK_POLL_S)
                        result["status"] = "stuck" if stuck else "oom"
                        return result
                    ms = clock.elapsed_ms()
                    if i >= warmup:
                        result["ms"][name].append(ms)
                if name == "fwd_bwd" and self.cuda:
                    result["peak_bytes"] = torch.cuda.max_memory_allocated()
            return result
        finally:
            result["seconds"] = time.monotonic() - start
            del tensors
            if result["status"] != "stuck":
                gc.collect()
                if self.cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()

    def run_everywhere(self, w: int, n: int, *args, **kwargs) -> list[dict | None]:
        """``trial`` on ranks 0 .. w-1, every rank's result (None for the others) on every rank."""
        mine = self.trial(w, n, *args, **kwargs) if self.rank < w else None
        results = self.gather(mine)
        if any(r is not None and r["status"] == "stuck" for r in results):
            raise _Stuck
        return results

    # -- the benchmark

    def rounded(self, n: int, w: int) -> int:
        """The largest length <= n that ``w`` ranks split into equal shards under the layout."""
        chunks = 1 if w == 1 else (2 * w if self.s.layout == "zigzag" else w)
        return n - n % chunks

    def left_s(self) -> float:
        return self.s.deadline - time.time()

    def scaling(self) -> None:
        worlds = [1, *range(2, self.s.world + 1)]
        spent: dict[tuple[int, int], float] = {}  # (N, W) -> seconds the trial took
        for n_req in self.s.seqlens:
            for w in worlds:
                n = self.rounded(n_req, w)
                run, reason = self.decide(self._scaling_proposal(n_req, w, spent))
                if not run:
                    self.record({"kind": "scaling", "N": n, "N_requested": n_req, "world": w, "status": reason})
                    continue
                results = self.run_everywhere(w, n, ("fwd_bwd", "fwd"), self.s.warmup, self.s.iters)
                spent[n_req, w] = max(r["seconds"] for r in results if r is not None)
                self.record(self._scaling_row(n_req, n, w, results))

    def _scaling_proposal(self, n_req: int, w: int, spent: dict[tuple[int, int], float]) -> tuple[bool, str]:
        """Rank 0: run this (N, W) unless it is predicted to end past the deadline."""
        if self.rank != 0:
            return True, ""
        smaller = [(n, s) for (n, ww), s in spent.items() if ww == w and n < n_req]
        if smaller:
            n, seconds = max(smaller)
            predicted = seconds * (n_req / n) ** 2
        elif (n_req, 1) in spent:
            predicted = spent[n_req, 1] / w
        else:
            predicted = 0.0
        if predicted > self.left_s():
            return False, f"skipped: time budget (predicted {predicted:.0f} s, {max(self.left_s(), 0):.0f} s left)"
        return True, ""

    def _scaling_row(self, n_req: int, n: int, w: int, results: list[dict | None]) -> dict[str, Any]:
        ran = [r for r in results if r is not None]
        row: dict[str, Any] = {
            "kind": "scaling",
            "N": n,
            "N_requested": n_req,
            "world": w,
            "method": "flash_attn_func" if w == 1 else f"ring_flash_attn_func ({self.s.layout})",
            "status": "ok" if all(r["status"] == "ok" for r in ran) else "out of memory",
            "seconds": max(r["seconds"] for r in ran),
        }
        if row["status"] != "ok":
            return row
        peaks = [r["peak_bytes"] for r in ran if r["peak_bytes"] is not None]
        row["peak_gib_per_gpu"] = max(peaks) / GIB if peaks else None
        for name in ("fwd_bwd", "fwd"):
            per_iter = [max(times) for times in zip(*(r["ms"][name] for r in ran), strict=True)]  # max over ranks
            ms = statistics.median(per_iter)
            row[f"{name}_ms"] = ms
            row[f"{name}_per_rank_ms"] = [statistics.median(r["ms"][name]) for r in ran]
            row[f"{name}_tokens_per_s"] = BATCH * n / (ms / 1e3)
            base = self._base_ms(n_req, name)
            row[f"{name}_efficiency"] = None if base is None else base * (n / n_req) ** 2 / (w * ms)
        return row

    def _base_ms(self, n_req: int, name: str) -> float | None:
        """T1: flash_attn_func on one GPU at ``n_req`` (rank 0's record)."""
        for row in self.rows:
            if row["kind"] == "scaling" and row["world"] == 1 and row["N"] == n_req and row["status"] == "ok":
                return row[f"{name}_ms"]
        return None

    def longest(self) -> None:
        """Double N per W until out of memory or out of time; then, for each W that ran out of memory, one
        try at 1.5 times the longest N that fit (between the two, where a doubling cannot tell W apart)."""
        window = self.s.longest_window
        growth = 2 if window else 4  # how a call's time grows when N doubles
        worlds = [1, *range(2, self.s.world + 1)]
        last_s: dict[int, float] = {}
        stopped: dict[int, str] = {}
        fit: dict[int, tuple[int, float]] = {}  # per W: the longest requested N that fit, its call's seconds
        n_req = self.s.longest_start
        while len(stopped) < len(worlds) and n_req <= LONGEST_CAP:
            for w in worlds:
                if w not in stopped:
                    status = self._longest_trial(w, n_req, last_s.get(w, 0.0) * growth, last_s)
                    if status == "fits":
                        fit[w] = (n_req, last_s[w])
                    else:
                        stopped[w] = status
            n_req *= 2
        for w in worlds:
            if stopped.get(w) == "out of memory" and w in fit:
                n_fit, seconds = fit[w]
                self._longest_trial(w, n_fit * 3 // 2, seconds * 1.5 ** math.log2(growth), last_s)

    def _longest_trial(self, w: int, n_req: int, predicted: float, last_s: dict[int, float]) -> str:
        """One fwd+bwd at N = n_req (rounded for W) unless it is predicted to take more than the time left;
        records the row and returns its status: "fits", "out of memory" or "not run: ..." (the same on every
        rank). ``last_s[w]`` becomes the call's seconds."""
        window = self.s.longest_window
        n = self.rounded(n_req, w)
        proposal = (True, "")
        if self.rank == 0 and (predicted > self.left_s() or self.left_s() <= 0):
            proposal = (False, f"time budget (predicted {predicted:.0f} s, {max(self.left_s(), 0):.0f} s left)")
        run, reason = self.decide(proposal)
        row: dict[str, Any] = {"kind": "longest", "N": n, "world": w, "window": window or None}
        if not run:
            self.record({**row, "status": f"not run: {reason}"})
            return f"not run: {reason}"
        results = self.run_everywhere(w, n, ("fwd_bwd",), 0, 1, window=window)
        ran = [r for r in results if r is not None]
        last_s[w] = max(r["seconds"] for r in ran)
        peaks = [r["peak_bytes"] for r in ran if r["peak_bytes"] is not None]
        fits = all(r["status"] == "ok" for r in ran)
        row |= {
            "status": "fits" if fits else "out of memory",
            "seconds": last_s[w],
            "oom_ranks": [rank for rank, r in enumerate(ran) if r["status"] != "ok"],
            "peak_gib_per_gpu": max(peaks) / GIB if peaks else None,
        }
        self.record(row)
        return row["status"]

    # -- output (rank 0)

    def record(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.rows.append(row)
        print(_row_line(row), flush=True)
        write_outputs(Path(self.s.out), self.s.header, self.rows)


def _row_line(row: dict[str, Any]) -> str:
    what = f"{row['kind']:8s} N={row['N']:>8d} W={row['world']}"
    if row["kind"] == "scaling" and row["status"] == "ok":
        return (
            f"{what}  fwd+bwd {row['fwd_bwd_ms']:9.2f} ms  eff {_fmt(row['fwd_bwd_efficiency'], '.3f')}  "
            f"fwd {row['fwd_ms']:9.2f} ms  eff {_fmt(row['fwd_efficiency'], '.3f')}  "
            f"peak {_fmt(row.get('peak_gib_per_gpu'), '.1f')} GiB"
        )
    if row["kind"] == "longest" and "seconds" in row:
        return f"{what}  {row['status']}  {row['seconds']:.1f} s  peak {_fmt(row.get('peak_gib_per_gpu'), '.1f')} GiB"
    return f"{what}  {row['status']}"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _worker(rank: int, s: Settings) -> None:
    os.environ.update(MULTICAST_OFF)
    if s.cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.world))
        device, backend = torch.device("cpu"), "gloo"
    else:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=max(600.0, s.deadline - time.time() + 300))  # room for compiles and long calls
    dist.init_process_group(
        backend,
        init_method=s.rendezvous,
        rank=rank,
        world_size=s.world,
        timeout=timeout,
        device_id=None if s.cpu else device,
    )
    runner = _Runner(rank, device, s, timeout)
    try:
        runner.scaling()
        if s.longest:
            runner.longest()
    except _Stuck:
        # A rank's stream waits for a peer that failed: no collective can finish any more. Rank 0 has
        # written everything measured; leave without tearing the process group down.
        if rank == 0:
            runner.record({"kind": "note", "N": 0, "world": 0, "status": "stopped: a rank ran out of memory "
                           "mid-ring and a peer's GPU stream was left waiting; the run ended there"})  # fmt: skip
        sys.stdout.flush()
        os._exit(0)
    dist.barrier(group=runner.ctrl)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Output


def records(header: dict[str, Any], rows: list[dict[str, Any]]) -> list[results.Record]:
    """The rows as records: per scaling row fwd+bwd (with the peak memory) and fwd, benchmark ``ring``; per
    longest-sequence trial its peak memory, or why there is none, benchmark ``ring-longest``."""
    settings = header.get("settings", {})
    found = []
    for row in rows:
        if row["kind"] not in ("scaling", "longest"):
            continue
        env = {**header, "gpus": row["world"]}
        shape = {"dtype": settings.get("dtype"), "B": settings.get("batch"), "N": row["N"],
                 "H": settings.get("nheads"), "D": settings.get("head_dim"), "causal": True}  # fmt: skip
        method = row.get("method") or ("flash_attn_func" if row["world"] == 1 else "ring_flash_attn_func")
        if row["kind"] == "longest":
            ok = row["status"] == "fits"
            peak = row.get("peak_gib_per_gpu")
            found.append(results.record(
                env, "ring-longest", "flashtile", shape, "fwd+bwd", config={"method": method, "window": row["window"]},
                memory_mib=peak * 1024 if ok and peak is not None else None, error=None if ok else row["status"],
            ))  # fmt: skip
            continue
        ok = row["status"] == "ok"
        for name, pass_ in (("fwd_bwd", "fwd+bwd"), ("fwd", "fwd")):
            peak = row.get("peak_gib_per_gpu") if pass_ == "fwd+bwd" else None
            extra = {"efficiency": row.get(f"{name}_efficiency"), "tokens_per_s": row.get(f"{name}_tokens_per_s"),
                     "N_requested": row["N_requested"]}  # fmt: skip
            found.append(results.record(
                env, "ring", "flashtile", shape, pass_, config={"method": method}, time_ms=row.get(f"{name}_ms"),
                memory_mib=None if peak is None else peak * 1024, error=None if ok else row["status"],
                extra=extra if ok else {},
            ))  # fmt: skip
    return found


def write_outputs(out: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Write ring.jsonl and ring.md to ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    results.write(out / "ring.jsonl", records(header, rows))
    text = markdown(header, rows)
    (out / "ring.md").write_text(text)
    return text


def markdown(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    settings = header.get("settings", {})
    lines = [
        f"# Ring attention scaling: {header.get('world')} processes, {header.get('gpu')}",
        "",
        f"- commit {header.get('commit')}, {header.get('date')}; torch {header.get('torch')}, triton "
        f"{header.get('triton')}, NCCL {header.get('nccl')}",
        f"- B={settings.get('batch')}, H=Hk={settings.get('nheads')}, D={settings.get('head_dim')}, "
        f"{settings.get('dtype')}, causal; W=1: flash_attn_func, W>=2: ring_flash_attn_func "
        f"(layout={settings.get('layout')}), one GPU per rank",
        f"- times: median over {settings.get('iters')} iterations (after {settings.get('warmup')}) of the max over "
        "ranks; tokens/s of the whole sequence; efficiency = T1 / (W * TW)",
        "",
        "| N | W | fwd+bwd ms | fwd+bwd tokens/s | fwd+bwd eff. | fwd ms | fwd tokens/s | fwd eff. | peak GiB/GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    scaling = [r for r in rows if r["kind"] == "scaling"]
    for r in scaling:
        if r["status"] != "ok":
            lines.append(f"| {r['N']} | {r['world']} | {r['status']} | | | | | | |")
            continue
        lines.append(
            f"| {r['N']} | {r['world']} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tokens_per_s']:.4g} | "
            f"{_fmt(r['fwd_bwd_efficiency'], '.3f')} | {r['fwd_ms']:.2f} | {r['fwd_tokens_per_s']:.4g} | "
            f"{_fmt(r['fwd_efficiency'], '.3f')} | {_fmt(r.get('peak_gib_per_gpu'), '.2f')} |"
        )
    goal = [
        r["fwd_bwd_efficiency"]
        for r in scaling
        if r["status"] == "ok" and r["world"] > 1 and r["N"] >= GOAL_FROM_N and r["fwd_bwd_efficiency"] is not None
    ]
    if goal:
        met = "met" if min(goal) >= EFFICIENCY_GOAL else "NOT met"
        lines += [
            "",
            f"Aim: fwd+bwd efficiency >= {EFFICIENCY_GOAL:.0%} at N >= {GOAL_FROM_N // 1024}k: {met} "
            f"(lowest {min(goal):.3f}).",
        ]
    longest = [r for r in rows if r["kind"] == "longest"]
    if longest:
        window = settings.get("longest_window")
        mask = f"causal, window {window} keys" if window else "causal"
        capacity = header.get("gpu_memory_gib")
        lines += [
            "",
            f"## Longest sequence, fwd+bwd ({mask}), N doubling from {settings.get('longest_start')}, then 1.5x "
            "the longest that fit",
            "",
            "| W | longest N that fit | peak GiB/GPU there | stopped at | why | predicted longest from causal "
            "memory/token |",
            "|---|---|---|---|---|---|",
        ]
        for w in sorted({r["world"] for r in longest}):
            mine = [r for r in longest if r["world"] == w]
            fits = [r for r in mine if r["status"] == "fits"]
            best = max(fits, key=lambda r: r["N"]) if fits else None
            failed = [r for r in mine if r["status"] == "out of memory"]
            stop = min(failed, key=lambda r: r["N"]) if failed else mine[-1]  # the shortest N that did not fit
            why = stop["status"] if stop["status"] != "fits" else "cap"
            lines.append(
                f"| {w} | {best['N'] if best else '-'} | {_fmt(best and best.get('peak_gib_per_gpu'), '.1f')} | "
                f"{stop['N'] if stop is not best else '-'} | {why} | {_predicted_longest(scaling, w, capacity)} |"
            )
        lines += [
            "",
            f"GPU memory {_fmt(capacity, '.1f')} GiB each. The prediction: the largest N of the scaling table at "
            "this W (plain causal) times GPU memory / its peak (memory is linear in N).",
        ]
    notes = [r for r in rows if r["kind"] == "note"]
    lines += ["", *(f"Note: {r['status']}" for r in notes)] if notes else []
    return "\n".join(lines) + "\n"


def _predicted_longest(scaling: list[dict[str, Any]], w: int, capacity: float | None) -> str:
    measured = [r for r in scaling if r["world"] == w and r["status"] == "ok" and r.get("peak_gib_per_gpu")]
    if not measured or not capacity:
        return "-"
    r = max(measured, key=lambda r: r["N"])
    limit = r["N"] * capacity / r["peak_gib_per_gpu"]
    per_token = r["peak_gib_per_gpu"] * GIB / (r["N"] / w) / 1024
    return f"{limit / 1024:.0f}k ({per_token:.1f} KiB per token per GPU at N={r['N']})"


# ---------------------------------------------------------------------------------------------------
# Header and command line


def _commit(given: str | None) -> str | None:
    """--commit, else benchmarks/.commit (written where the tree is copied without .git), else git."""
    if given:
        return given
    marker = Path(__file__).resolve().parent / ".commit"
    if marker.exists():
        return marker.read_text().strip() or None
    return results.git_commit()


def _device_info() -> dict[str, Any]:
    """The GPU's name and memory and NCCL's version, read in rank 0's process."""
    try:
        version = torch.cuda.nccl.version()  # a tuple (2, 27, 3); an int in old torch
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except (AttributeError, RuntimeError):
        nccl = None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": props.name, "gpu_memory_gib": props.total_memory / GIB, "nccl": nccl}


def _header(args: argparse.Namespace, settings: dict[str, Any], world: int) -> dict[str, Any]:
    """Provenance; rank 0 adds the GPU's name and memory and NCCL's version (``_device_info``)."""
    return {
        "gpu": "cpu" if args.cpu else None,  # a --cpu smoke run: its times mean nothing
        "device_count": 0 if args.cpu else torch.cuda.device_count(),
        "world": world,
        "gpu_memory_gib": None,
        "nccl": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "flashtile": flashtile.__version__,
        "commit": _commit(args.commit),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "environment": {name: os.environ.get(name) for name in MULTICAST_OFF},
        "settings": settings,
        "notes": {
            "timing": "per iteration: barrier (all_reduce + synchronize), CUDA events around one call on every "
            "rank, max over ranks; median over iterations after warmup",
            "efficiency": "T1 / (W * TW), T1 = flash_attn_func on one GPU at the same N",
            "longest": "one fwd+bwd per N, N doubling; causal with a sliding window (same buffers as plain causal, "
            "linear compute) unless longest_window is 0",
        },
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for ring.jsonl and ring.md")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds; nothing starts that would end later")
    parser.add_argument("--max-world", type=int, default=None, help="largest W (default: every GPU; --cpu: 2)")
    parser.add_argument("--seqlens", type=_ints, default=None, help="N of the scaling table, comma-separated")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per (N, W) and pass")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per (N, W) and pass")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--no-longest", dest="longest", action="store_false", help="skip the longest-sequence search")
    parser.add_argument("--longest-start", type=int, default=None, help="first N of the search (default 65536)")
    parser.add_argument(
        "--longest-window",
        type=int,
        default=None,
        help=f"window of the search in keys, 0: plain causal ({LONGEST_WINDOW})",
    )
    parser.add_argument("--commit", default=None, help="commit to record (default: benchmarks/.commit, else git)")
    parser.add_argument("--cpu", action="store_true", help="smoke run: gloo processes, CPU path, tiny shapes")
    args = parser.parse_args(argv)
    if args.time_budget <= 0 or args.warmup < 0 or args.iters < 1:
        parser.error("--time-budget must be > 0, --warmup >= 0 and --iters >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    start = time.time()
    args = parse_args(argv)
    if args.cpu:
        os.environ.pop("TRITON_INTERPRET", None)  # the CPU path, not the interpreter: seconds, not minutes
        available = args.max_world or 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu for the smoke run", file=sys.stderr)
            return 2
        available = torch.cuda.device_count()
    world = max(1, min(available, args.max_world or available))
    if not args.cpu and world < 2:
        print(f"only {world} GPU: the table has W=1 alone", file=sys.stderr)
    settings = {
        "batch": BATCH,
        "nheads": CPU_NHEADS if args.cpu else NHEADS,
        "head_dim": CPU_HEAD_DIM if args.cpu else HEAD_DIM,
        "dtype": DTYPE,
        "layout": args.layout,
        "seqlens": list(args.seqlens or (CPU_SEQLENS if args.cpu else SEQLENS)),
        "warmup": args.warmup,
        "iters": args.iters,
        "time_budget_s": args.time_budget,
        "longest": args.longest,
        "longest_start": args.longest_start or (CPU_LONGEST_START if args.cpu else LONGEST_START),
        "longest_window": (CPU_LONGEST_WINDOW if args.cpu else LONGEST_WINDOW)
        if args.longest_window is None
        else args.longest_window,
    }
    with tempfile.TemporaryDirectory(prefix="bench_ring_") as tmp:
        s = Settings(
            out=str(args.out),
            cpu=args.cpu,
            world=world,
            seqlens=tuple(settings["seqlens"]),
            nheads=settings["nheads"],
            head_dim=settings["head_dim"],
            dtype=DTYPE,
            layout=args.layout,
            warmup=args.warmup,
            iters=args.iters,
            deadline=start + args.time_budget,
            longest=args.longest,
            longest_start=settings["longest_start"],
            longest_window=settings["longest_window"],
            cpu_capacity_tokens=CPU_CAPACITY_TOKENS,
            rendezvous=f"file://{Path(tmp) / 'rendezvous'}",
            header=_header(args, settings, world),
        )
        write_outputs(args.out, s.header, [])
        mp.start_processes(_worker, args=(s,), nprocs=world, join=True)
    print()
    print((args.out / "ring.md").read_text())
    print(f"wrote {args.out / 'ring.jsonl'} and ring.md in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
