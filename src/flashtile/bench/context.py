"""The longest sequence whose forward+backward fits in GPU memory: flashtile on one GPU or on a ring of G GPUs
(``flashtile.distributed.ring_flash_attn_func``, each rank holding N / G of q, k and v), standard attention on one.

    flashtile check --max-context [--ring G] [--budget-s S] [--out DIR]

The problem is MAX_CONTEXT (B=1, H=16, D=128, bf16, causal); N is a multiple of 1024. A probe runs one forward and
backward at one length, inputs and gradients included, and says whether it fitted (no rank ran out of memory), its
peak memory and its time. Near flashtile's limit a probe takes minutes (causal work grows with N²), so the search
spends as few of them there as it can:

1. **calibrate**: two probes at 1/16 and 1/8 of a first estimate of the limit (``ESTIMATE_TENSORS`` tensors of the
   size of q per token) give the line of the peak memory (flashtile's memory is linear in N) and the time's scale;
2. **predict**: the length where that line meets the GPU's free memory;
3. **search** from there (``longest_fitting``): the predicted length, then the next multiple up while it fits or down
   while it does not, in steps that double, then bisection: two probes where the line is right.

Standard attention's memory grows with N² (the score matrix) and its limit is short: it searches from 1024 up, each
probe a fraction of a second.

With a budget of S seconds no probe starts that is predicted (from the longest probe timed so far, time ∝ N²) to end
after S, and the first probe near the limit is shortened to what the budget affords; the result is then the longest
length that fitted, a lower bound, and says so.

On a ring each probe runs in G fresh processes (NCCL, one GPU each, NVLink multicast off): a rank that runs out of
memory in the middle of the ring leaves its peers' GPU streams waiting for transfers that never come, which no later
collective gets past. After its call, before waiting on its GPU, every rank tells the others over gloo whether it ran
out of memory, so all of them reach the same verdict and leave.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.bench import hbm, results

MAX_CONTEXT = hbm.Problem(batch=1, seqlen=0, nheads=16, head_dim=128, causal=True, dtype="bf16")
"""The problem ``--max-context`` grows: B=1, H=16, D=128, bf16, causal; seqlen is what it finds."""
MULTIPLE = 1024
ESTIMATE_TENSORS = 10  # q, k, v, dout, out, dq, dk, dv and dq's fp32 accumulator (two): per token, per rank
CALIBRATION = (16, 8)  # the calibration probes: the first estimate of the limit over these
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RING_LAYOUT = "zigzag"
RING_GRACE_S = 300  # how much longer than predicted a ring probe may take (start, compiles) before it is stopped
RING_OOM_GRACE_S = 60  # after a rank ran out of memory: how long its peers may take to agree before they are stopped
RESULTS_FILE = "max-context.jsonl"


# ----------------------------------------------------------------------------------------- the search


def longest_fitting(
    fits: Callable[[int], bool],
    multiple: int = MULTIPLE,
    start: int | None = None,
    may_probe: Callable[[int], bool] | None = None,
) -> tuple[int, bool]:
    """(the largest multiple of ``multiple`` for which ``fits`` holds, whether the search finished), assuming ``fits``
    holds up to some length and fails beyond. The first probe is ``start`` (default ``multiple``); then up while it
    fits or down while it does not, in steps of ``multiple`` that double each time, then bisection between the
    longest length that fitted and the shortest that did not. From ``multiple`` that is doubling then bisecting;
    from a good guess, the guess and its neighbour. ``may_probe(n)`` False stops the search before probing ``n``:
    the length returned then fitted but may not be the largest (0: none fitted)."""
    lo, hi, step = 0, None, multiple
    n = max(multiple, (start or multiple) // multiple * multiple)
    while hi is None or hi - lo > multiple:
        if may_probe is not None and not may_probe(n):
            return lo, False
        if fits(n):
            lo = n
        else:
            hi = n
        if hi is None:
            n = lo + step
        elif lo == 0:
            n = max(multiple, hi - step)
        else:
            n = (lo + hi) // (2 * multiple) * multiple
        step *= 2
    return lo, True


def predict_limit(peaks: dict[int, int], capacity: int, multiple: int = MULTIPLE) -> int | None:
    """The longest multiple of ``multiple`` at which the line through the two longest (length, peak bytes) of
    ``peaks`` stays within ``capacity`` bytes; None with fewer than two points or a line that does not grow."""
    if len(peaks) < 2:
        return None
    (n1, p1), (n2, p2) = sorted(peaks.items())[-2:]
    per_token = (p2 - p1) / (n2 - n1)
    if per_token <= 0:
        return None
    return int((capacity - p1) / per_token + n1) // multiple * multiple


@dataclass(frozen=True)
class Probe:
    """One forward+backward at ``seqlen`` (the whole sequence): whether it fitted on every rank, the most memory a
    rank allocated (``peak_bytes``, inputs and gradients included) and reserved from the GPU (``reserved_bytes``:
    what has to fit in its free memory), both None where it did not fit or on a CPU, its time, and the free memory of
    the tightest GPU before the call (None on a CPU)."""

    seqlen: int
    fits: bool
    peak_bytes: int | None
    reserved_bytes: int | None
    seconds: float
    free_bytes: int | None = None


@dataclass
class Search:
    """The result for one implementation on ``world`` GPUs: ``seqlen`` fitted and is the longest that does when
    ``exact``, a lower bound otherwise (the budget stopped the search); ``predicted``: the calibration's limit;
    ``capacity_bytes``: the free memory of the tightest GPU, as its probes found it."""

    implementation: str
    world: int
    capacity_bytes: int | None = None
    seqlen: int = 0
    exact: bool = True
    predicted: int | None = None
    probes: list[Probe] = field(default_factory=list)

    def best(self) -> Probe | None:
        """The probe at ``seqlen``; None when nothing fitted."""
        return next((p for p in self.probes if p.fits and p.seqlen == self.seqlen), None)


def search(
    run: Callable[[int], Probe],
    implementation: str,
    memory: int,
    world: int = 1,
    budget_s: float | None = None,
    problem: hbm.Problem = MAX_CONTEXT,
    multiple: int = MULTIPLE,
    clock: Callable[[], float] = time.monotonic,
) -> Search:
    """The longest length whose forward+backward fits, by the probe plan of this module: ``run(n)`` probes the whole
    sequence length ``n`` on ``world`` ranks whose GPUs have ``memory`` bytes each (the first estimate; the
    prediction uses the free memory the probes find); flashtile's search starts from the calibrated prediction,
    standard attention's from ``multiple``."""
    began = clock()
    found = Search(implementation, world)
    done: dict[int, Probe] = {}
    overhead = 0.0  # the most a probe took beyond its forward+backward (starting processes, inputs)

    def fits(n: int) -> bool:
        nonlocal overhead
        if n not in done:
            started = clock()
            done[n] = run(n)
            found.probes.append(done[n])
            overhead = max(overhead, clock() - started - done[n].seconds)
        return done[n].fits

    def longest() -> Probe | None:
        return max((p for p in done.values() if p.fits), key=lambda p: p.seqlen, default=None)

    def seconds(n: int) -> float:
        timed = longest()
        return overhead + (0.0 if timed is None else timed.seconds * (n / timed.seqlen) ** 2)

    def affordable(n: int) -> bool:
        return budget_s is None or clock() - began + seconds(n) <= budget_s

    start = None
    if implementation == "flashtile":
        per_token = ESTIMATE_TENSORS * problem.nheads * problem.head_dim * hbm.DTYPES[problem.dtype].itemsize
        estimate = memory // per_token * world
        for divisor in CALIBRATION:
            n = max(multiple, estimate // divisor // multiple * multiple)
            if affordable(n):
                fits(n)
        reserved = {p.seqlen: p.reserved_bytes for p in done.values() if p.fits and p.reserved_bytes}
        free = min((p.free_bytes for p in done.values() if p.free_bytes), default=memory)
        found.predicted = start = predict_limit(reserved, free, multiple)
        if start is not None and budget_s is not None and not affordable(start):
            timed, left = longest(), budget_s - (clock() - began) - overhead
            start = int(timed.seqlen * math.sqrt(max(left, 0.0) / timed.seconds)) // multiple * multiple
    _, found.exact = longest_fitting(fits, multiple, start, affordable)
    found.seqlen = max((p.seqlen for p in found.probes if p.fits), default=0)
    found.capacity_bytes = min((p.free_bytes for p in found.probes if p.free_bytes), default=None)
    return found


# ----------------------------------------------------------------------------------------- one GPU


def probe_here(impl: str, seqlen: int, problem: hbm.Problem = MAX_CONTEXT) -> Probe:
    """One forward+backward of ``impl`` (``flashtile.bench.hbm.forward``) at ``seqlen`` on this process's GPU."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
    start = time.perf_counter()
    try:
        q, k, v, dout = dataclasses.replace(problem, seqlen=seqlen).inputs("cuda")
        hbm.forward(impl, q, k, v, problem.causal).backward(dout)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peaks = torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved()
        return Probe(seqlen, True, *peaks, seconds, free)
    except RuntimeError as exc:  # torch.OutOfMemoryError, or a library's own allocation failure (cuBLAS)
        if isinstance(exc, torch.OutOfMemoryError) or "ALLOC_FAILED" in str(exc):
            return Probe(seqlen, False, None, None, time.perf_counter() - start, free)
        raise
    finally:
        q = k = v = dout = None
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- a ring


def ring_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, group: dist.ProcessGroup) -> None:
    """One causal forward+backward of ring attention over ``group`` on this rank's shards."""
    from flashtile.distributed import ring_flash_attn_func

    ring_flash_attn_func(q, k, v, causal=True, group=group, layout=RING_LAYOUT).backward(dout)


@dataclass(frozen=True)
class RingJob:
    """One ring probe: ``world`` processes over ``backend`` (``nccl``: one GPU each; ``gloo``: CPU tensors), each
    running ``step`` on its (batch, seqlen / world, nheads, head_dim) shards of ``problem`` at ``seqlen``, after a
    warm-up at ``warmup`` tokens; rank 0 writes the shared Probe to ``folder``/probe.json."""

    world: int
    seqlen: int
    warmup: int
    backend: str
    folder: str
    problem: hbm.Problem = MAX_CONTEXT
    step: Callable[..., None] = ring_step


def _rank_call(job: RingJob, seqlen: int, group: dist.ProcessGroup, votes: dist.ProcessGroup, device: torch.device):
    """This rank's part of one call at ``seqlen``, then the vote: (every rank fitted, this rank's peak allocated and
    reserved bytes, seconds, free bytes before the call), None for the memory where some rank did not fit or on a
    CPU."""
    cuda = device.type == "cuda"
    free = None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
    dist.barrier(group=votes)
    start = time.perf_counter()
    shard = dataclasses.replace(job.problem, seqlen=seqlen // job.world)
    try:
        job.step(*shard.inputs(device), group=group)
        ok = True
    except torch.OutOfMemoryError:
        ok = False
        (Path(job.folder) / f"out-of-memory-{dist.get_rank()}").touch()  # for the parent, should a peer hang
    vote = torch.tensor([int(ok)])
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=votes)  # before anyone waits on a GPU
    if not vote.item():
        return False, None, None, time.perf_counter() - start, free
    if cuda:
        torch.cuda.synchronize()
        peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        return True, *peaks, time.perf_counter() - start, free
    return True, None, None, time.perf_counter() - start, free


def _ring_worker(rank: int, job: RingJob) -> None:
    """Rank ``rank`` of a ring probe: the warm-up and the probe; rank 0 writes the verdict."""
    os.environ.update(MULTICAST_OFF)
    cuda = job.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        job.backend, init_method=f"file://{Path(job.folder) / 'rendezvous'}", rank=rank, world_size=job.world,
        timeout=timedelta(hours=1), device_id=device if cuda else None,
    )  # fmt: skip
    votes = dist.new_group(backend="gloo")
    for seqlen in (job.warmup, job.seqlen):
        ok, *numbers = _rank_call(job, seqlen, dist.group.WORLD, votes, device)
        if not ok:
            break
    gathered: list[Any] = [None] * job.world
    dist.all_gather_object(gathered, numbers, group=votes)
    if rank == 0:
        peak, reserved, seconds = (max(g[i] for g in gathered) if ok and cuda or i == 2 else None for i in range(3))
        free = min(g[3] for g in gathered) if cuda else None
        probe = Probe(job.seqlen, ok, peak, reserved, seconds, free)
        (Path(job.folder) / "probe.json").write_text(json.dumps(dataclasses.asdict(probe)))
    if ok:
        dist.destroy_process_group()
    else:  # a peer's GPU stream may wait for transfers that never come: leave without tearing the group down
        os._exit(0)


def probe_ring(job: RingJob, timeout_s: float) -> Probe:
    """Run ``job`` in ``job.world`` fresh processes; its Probe. A rank that runs out of memory says so in a file
    first: if its peers do not agree within RING_OOM_GRACE_S (one of them may wait for its GPU, which waits for the
    rank that failed), they are stopped and the probe did not fit. Raises RuntimeError when the processes do not
    finish within ``timeout_s`` without running out of memory (they are stopped), or when a rank fails otherwise."""
    started = time.monotonic()
    context = mp.start_processes(_ring_worker, args=(job,), nprocs=job.world, join=False, start_method="spawn")
    deadline = started + timeout_s
    folder = Path(job.folder)
    while not context.join(timeout=2):
        if any(folder.glob("out-of-memory-*")):
            deadline = min(deadline, time.monotonic() + RING_OOM_GRACE_S)
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            if any(folder.glob("out-of-memory-*")):
                return Probe(job.seqlen, False, None, None, time.monotonic() - started)
            raise RuntimeError(f"the ring probe at N={job.seqlen} did not finish within {timeout_s:.0f} s")
    return Probe(**json.loads((folder / "probe.json").read_text()))


def ring_runner(
    world: int, problem: hbm.Problem = MAX_CONTEXT, backend: str = "nccl", step=ring_step, multiple: int = MULTIPLE
):
    """``run(n)`` for ``search``: each call one ring probe at n in fresh processes (after a warm-up at ``world`` ×
    ``multiple`` tokens), timed out RING_GRACE_S after the time predicted from the previous probes."""
    seconds: dict[int, float] = {}

    def run(seqlen: int) -> Probe:
        longest = max(seconds, default=None)
        predicted = 0.0 if longest is None else seconds[longest] * (seqlen / longest) ** 2
        with tempfile.TemporaryDirectory(prefix="flashtile-ring-") as folder:
            job = RingJob(world, seqlen, world * multiple, backend, folder, problem, step)
            probe = probe_ring(job, predicted + RING_GRACE_S)
        if probe.fits:
            seconds[seqlen] = probe.seconds
        return probe

    return run


# ----------------------------------------------------------------------------------------- records


def records(found: list[Search], env: results.Record, budget_s: float | None, problem: hbm.Problem = MAX_CONTEXT):
    """One record per search, benchmark ``max-context``: shape N the longest length that fitted, ``memory_mib`` the
    peak a rank allocated there, ``gpus`` the ring's size; ``extra``: ``exact`` (False: a lower bound), the
    prediction, the free memory and every probe."""
    found_records = []
    for s in found:
        best = s.best()
        shape = {"dtype": problem.dtype, "B": problem.batch, "N": s.seqlen, "H": problem.nheads,
                 "D": problem.head_dim, "causal": problem.causal}  # fmt: skip
        method = "flash_attn_func" if s.world == 1 else f"ring_flash_attn_func ({RING_LAYOUT})"
        if s.implementation == "standard":
            method = "standard attention (score matrix in HBM)"
        extra = {
            "exact": s.exact,
            "predicted_N": s.predicted,
            "free_mib": s.capacity_bytes and s.capacity_bytes / 2**20,
            "budget_s": budget_s,
            "probes": [dataclasses.asdict(p) for p in s.probes],
        }
        found_records.append(results.record(
            {**env, "gpus": s.world}, "max-context", s.implementation, shape, "fwd+bwd", config={"method": method},
            time_ms=best.seconds * 1e3 if best else None, memory_mib=best.peak_bytes / 2**20 if best else None,
            error=None if best else "nothing fitted", extra=extra,
        ))  # fmt: skip
    return found_records


def append(folder: Path, new: list[results.Record]) -> Path:
    """Add ``new`` to ``folder``/max-context.jsonl (one file for the runs on one GPU and on rings); its path."""
    path = folder / RESULTS_FILE
    results.write(path, [*(results.load(path) if path.exists() else []), *new])
    return path
