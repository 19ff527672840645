"""Ring and Ulysses attention (flashtile.distributed) against the oracle on the full sequence, over gloo
processes on CPUs and over NCCL on GPUs.

Starting processes is the expensive part (~2 s per process on a CI machine), so one module fixture
spawns four gloo processes once and runs every case in them: the 4-rank cases on the default group,
the 2-rank cases on two subgroups {0, 1} and {2, 3} (so group ranks differ from global ranks), then the
error cases. Each case shards full-sequence inputs with ``shard``, runs forward and backward, gathers
the results with ``unshard`` and saves them; the tests then hold them to the tolerance rule
(``flashtile.reference.within_tolerance``) against the oracle on the full sequence, here in the test process:
the same rule, on the same full-sequence inputs, that ``flash_attn_func`` is held to.

The gloo children take flashtile's CPU path (fast); one case runs the Triton kernels in the interpreter.
Every case runs the ring in head groups (``ring.MIN_GROUP_ROWS = 1``: as many as nheads_k allows, up to 4),
which only long shards do otherwise. After the cases, the gloo children also profile one ring call's
allocations at W = 4 and W = 2 (``_memory_case``), held to ring.py's memory accounting.
On a machine with two or more GPUs (marked ``gpu``), the same worker runs ``GPU_CASES`` over NCCL, one
process per GPU (at most 4), with compiled kernels, bf16, head dim 128 and thousands of positions per
rank. The planner that cuts ring steps into kernel calls is checked exhaustively without processes.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import made_once
from flashtile import _backend
from flashtile.distributed import (
    group,
    ring,
    ring_flash_attn_func,
    ring_flash_attn_qkvpacked_func,
    shard,
    ulysses_flash_attn_func,
    unshard,
)
from flashtile.distributed.layout import LAYOUTS, segments, shard_tensor
from flashtile.ops import _alloc
from flashtile.reference import visibility_mask
from oracle import check_against_oracle

SPAWN_DEADLINE_S = 240  # the whole spawn; ~20 s on a 2-core CI machine
SHORT_TIMEOUT = timedelta(seconds=2)  # process group timeout in the cases where a peer fails
GPU_WORLD = min(torch.cuda.device_count(), 4)  # NCCL processes, one per GPU
# NVLink multicast stays off on the shared GPU machines (their notes say why); set before NCCL starts.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Case:
    """One ring run: the full sequence is seqlen = shard_len * world tokens long."""

    world: int
    layout: str
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    dtype: torch.dtype = torch.float16
    batch: int = 1
    shard_len: int = 34
    heads: tuple[int, int] = (2, 2)  # (nheads, nheads_k)
    head_dims: tuple[int, int] = (32, 32)  # (headdim, headdim_v)
    dlse: bool = False  # also backpropagate a random gradient at softmax_lse
    packed: bool = False  # ring_flash_attn_qkvpacked_func, without return_attn_probs
    interpreter: bool = False  # the Triton kernels in the interpreter instead of the CPU path
    softcap: float = 0.0
    sink: bool = False  # a learnable_sink, with its gradient
    alibi: bool = False  # alibi_slopes (Ulysses only)
    method: str = "ring"  # or "ulysses" (contiguous layout)
    seed: int = 0

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window != (-1, -1):
            mask += f"-W{self.window[0]}_{self.window[1]}"
        dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        name = f"W{self.world}-{self.layout}-{mask}-{dtype}-S{self.shard_len * self.world}"
        name += f"-H{self.heads[0]}_{self.heads[1]}-D{self.head_dims[0]}_{self.head_dims[1]}"
        name += f"-cap{self.softcap:g}" if self.softcap else ""
        for flag in ("dlse", "packed", "interpreter", "sink", "alibi"):
            name += f"-{flag}" if getattr(self, flag) else ""
        return name if self.method == "ring" else f"{self.method}-{name}"

    @property
    def oracle_options(self) -> dict:
        """The options of this case other than q, k, v, for ring/Ulysses and the oracle alike."""
        sink, slopes = option_tensors(self)
        options = {"causal": self.causal, "window_size": self.window}
        if self.softcap:
            options["softcap"] = self.softcap
        if self.sink:
            options["learnable_sink"] = sink
        if self.alibi:
            options["alibi_slopes"] = slopes
        return options


CASES = [
    # 4 ranks: zigzag shards hold two chunks of 13, contiguous shards one of 25
    Case(4, "zigzag", causal=True, shard_len=26, heads=(4, 2)),
    Case(4, "zigzag", causal=False, shard_len=26, dtype=torch.bfloat16, batch=2),
    Case(4, "contiguous", causal=True, shard_len=25, dtype=torch.bfloat16, heads=(3, 1)),
    Case(4, "contiguous", causal=False, shard_len=25),
    Case(4, "zigzag", window=(17, 5), shard_len=26),
    Case(4, "contiguous", causal=True, window=(30, -1), shard_len=25, dtype=torch.bfloat16),
    # 2 ranks
    *(
        Case(2, layout, causal=causal, dtype=dtype, heads=(4, 2) if causal else (2, 2), seed=seed)
        for seed, (layout, causal, dtype) in enumerate(
            itertools.product(LAYOUTS, (False, True), (torch.float16, torch.bfloat16))
        )
    ),
    Case(2, "zigzag", window=(9, 9), shard_len=40, head_dims=(64, 32)),
    Case(2, "contiguous", window=(-1, 7), shard_len=39, batch=2),
    Case(2, "zigzag", causal=True, dlse=True, heads=(6, 2)),
    Case(2, "contiguous", causal=True, packed=True, dtype=torch.bfloat16),
    # softcap and learnable sinks (4 ranks, then 2)
    Case(4, "zigzag", causal=True, softcap=2.0, sink=True, shard_len=26, heads=(4, 2)),
    Case(4, "contiguous", sink=True, dlse=True, shard_len=25, dtype=torch.bfloat16),
    Case(2, "zigzag", softcap=2.0, dtype=torch.bfloat16, seed=1),
    Case(2, "contiguous", causal=True, softcap=2.0, sink=True, heads=(4, 2), seed=2),
    Case(2, "zigzag", window=(9, 3), sink=True, shard_len=40, seed=3),
    Case(2, "contiguous", window=(5, -1), softcap=1.5, dlse=True, shard_len=39, seed=4),
    Case(2, "zigzag", packed=True, softcap=2.0, sink=True, seed=5),
    # 6 K/V heads in 4 groups of 1 or 2 (uneven), each group's sink and dlse
    Case(4, "zigzag", causal=True, heads=(12, 6), sink=True, dlse=True, dtype=torch.bfloat16, shard_len=26, seed=9),
    # Ulysses: contiguous shards, all_to_all over heads
    Case(4, "contiguous", method="ulysses", causal=True, shard_len=25, heads=(4, 2)),  # K/V heads repeated
    Case(
        4,
        "contiguous",
        method="ulysses",
        heads=(8, 4),
        softcap=2.0,
        alibi=True,
        sink=True,
        dlse=True,
        dtype=torch.bfloat16,
    ),  # fmt: skip
    Case(2, "contiguous", method="ulysses", causal=True, alibi=True, window=(20, -1), heads=(4, 2), seed=6),
    Case(2, "contiguous", method="ulysses", heads=(2, 1), sink=True, softcap=2.0, seed=7),
    Case(2, "contiguous", method="ulysses", heads=(6, 2), batch=2, dtype=torch.bfloat16, seed=8),
    # "No limit" spelled as INT32_MAX or sys.maxsize: the unbounded answer, on both ring layouts and Ulysses.
    Case(2, "zigzag", window=(2**31 - 1, 2**31 - 1), seed=10),
    Case(2, "contiguous", causal=True, window=(9223372036854775807, -1), seed=11),
    Case(2, "contiguous", method="ulysses", window=(-1, 9223372036854775807), heads=(2, 2), seed=12),
]
if _backend.TRITON_INTERPRET:
    CASES.append(Case(2, "zigzag", causal=True, shard_len=48, heads=(2, 1), interpreter=True))
    CASES.append(Case(2, "contiguous", causal=True, shard_len=32, softcap=2.0, sink=True, interpreter=True))
    CASES.append(Case(2, "zigzag", window=(2**31 - 1, 2**31 - 1), shard_len=48, interpreter=True))


def full_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """Fresh random full-sequence q, k, v, dout and dlse (None unless case.dlse), the same in every process."""
    gen = torch.Generator().manual_seed(case.seed)
    seqlen = case.shard_len * case.world
    (nheads, nheads_k), (head_dim, head_dim_v) = case.heads, case.head_dims

    def randn(*shape: int, dtype: torch.dtype = case.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    q = randn(case.batch, seqlen, nheads, head_dim)
    k = randn(case.batch, seqlen, nheads_k, head_dim)
    v = randn(case.batch, seqlen, nheads_k, head_dim_v)
    dout = randn(case.batch, seqlen, nheads, head_dim_v)
    dlse = randn(case.batch, nheads, seqlen, dtype=torch.float32) if case.dlse else None
    return q, k, v, dout, dlse


def option_tensors(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's learnable_sink and alibi_slopes, (nheads,) float32 each, the same in every process.

    The sink is near the rows' log-sum-exp (about log seqlen), so it takes a real share of each softmax,
    and representable in the inputs' dtype, so the oracle in that dtype sees the same sink.
    """
    gen = torch.Generator().manual_seed(1000 + case.seed)
    nheads, seqlen = case.heads[0], case.shard_len * case.world
    sink = (torch.randn(nheads, generator=gen) + math.log(seqlen)).to(case.dtype).float()
    slopes = torch.exp2(-8.0 * torch.arange(1, nheads + 1) / nheads) * 0.5  # ALiBi's geometric slopes, halved
    return sink, slopes


# ----------------------------------------------------------------------------------------------
# What the child processes run


def _run_case(case: Case, group: dist.ProcessGroup, results_dir: Path, device: torch.device) -> None:
    """Shard, run forward and backward on this rank's shard, unshard; group rank 0 saves the results."""
    if device.type == "cpu":
        _backend.TRITON_INTERPRET = case.interpreter
        assert _backend.path_name(device) == ("triton-interpreter" if case.interpreter else "cpu")
    q, k, v, dout, dlse = (None if t is None else t.to(device) for t in full_inputs(case))
    options = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in case.oracle_options.items()}
    options["group"] = group
    if "learnable_sink" in options:
        sink = options["learnable_sink"] = options["learnable_sink"].clone().requires_grad_()  # a replicated leaf
    if case.method == "ring":
        options["layout"] = case.layout
        func = ring_flash_attn_func
    else:
        assert case.layout == "contiguous"
        func = ulysses_flash_attn_func
    if case.packed:
        qkv = shard(torch.stack([q, k, v], dim=2), group, layout=case.layout).requires_grad_()
        out = ring_flash_attn_qkvpacked_func(qkv, **options)
        lse = None
        out.backward(shard(dout, group, layout=case.layout))
        grads = qkv.grad.unbind(2)
    else:
        leaves = [shard(t, group, layout=case.layout).requires_grad_() for t in (q, k, v)]
        out, lse, probs = func(*leaves, return_attn_probs=True, **options)
        assert probs is None
        outputs, grad_outputs = [out], [shard(dout, group, layout=case.layout)]
        if dlse is not None:
            outputs.append(lse)
            grad_outputs.append(shard(dlse, group, layout=case.layout, dim=2))
        torch.autograd.backward(outputs, grad_outputs)
        grads = [t.grad for t in leaves]
    results = {
        name: unshard(x, group, layout=case.layout).cpu()
        for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True)
    }
    if lse is not None:
        results["lse"] = unshard(lse, group, layout=case.layout, dim=2).cpu()
    if case.sink:  # each rank's share of the gradient; their sum is the full-sequence gradient
        shares = [torch.empty_like(sink.grad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shares, sink.grad, group=group)
        results["dsink_shares"] = torch.stack(shares).cpu()
        dsink = sink.grad.clone()
        dist.all_reduce(dsink, group=group)  # what the optimizer's gradient all-reduce does
        results["dsink"] = dsink.cpu()
    if dist.get_rank(group) == 0:
        torch.save(results, results_dir / f"{case.name}.pt")


def _record(path: Path, action) -> None:
    """Run ``action`` and save how it ended: the error's type and message (or None), and the time taken."""
    start = time.monotonic()
    try:
        action()
        outcome = {"error": None, "message": ""}
    except Exception as err:  # the outcome is the test's subject
        outcome = {"error": type(err).__name__, "message": str(err)}
    outcome["seconds"] = time.monotonic() - start
    torch.save(outcome, path)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _shard_qkv(seqlen: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, seqlen, 2, 32).half() for _ in range(3))


def _mismatch_cases(rank: int, group: dist.ProcessGroup, out_dir: Path) -> None:
    """Ranks 0 and 1: inputs that differ across ranks, or that one rank rejects, fail on both ranks."""
    lengths = {0: 8, 1: 10}[rank]
    _record(out_dir / f"lengths-{rank}.pt", lambda: ring_flash_attn_func(*_shard_qkv(lengths), group=group))
    causal = rank == 0
    _record(out_dir / f"options-{rank}.pt", lambda: ring_flash_attn_func(*_shard_qkv(8), causal=causal, group=group))
    odd = {0: 8, 1: 9}[rank]  # a zigzag shard holds two equal chunks
    _record(out_dir / f"odd-{rank}.pt", lambda: ring_flash_attn_func(*_shard_qkv(odd), causal=True, group=group))
    sink = torch.zeros(2) if rank == 0 else None
    _record(out_dir / f"sink-{rank}.pt", lambda: ring_flash_attn_func(*_shard_qkv(8), group=group, learnable_sink=sink))
    _record(out_dir / f"ulysses-lengths-{rank}.pt", lambda: ulysses_flash_attn_func(*_shard_qkv(lengths), group=group))
    three_heads = [torch.randn(1, 8, 3, 32).half() for _ in range(3)]
    _record(out_dir / f"ulysses-heads-{rank}.pt", lambda: ulysses_flash_attn_func(*three_heads, group=group))


def _failing_peer_cases(rank: int, groups: list[dist.ProcessGroup], out_dir: Path) -> None:
    """Ranks 2 and 3, on groups with a short timeout: a peer that never calls, and one that fails mid-ring."""
    never, mid_ring = groups
    if rank == 2:
        _record(out_dir / "never-2.pt", lambda: ring_flash_attn_func(*_shard_qkv(8), group=never))
    else:
        _wait_for(out_dir / "never-2.pt")  # alive but not calling until rank 2 has given up

    def forward_backward() -> None:
        leaves = [t.requires_grad_() for t in _shard_qkv(8)]
        ring_flash_attn_func(*leaves, causal=True, group=mid_ring).sum().backward()

    if rank == 3:  # fails in its first merge, after it has sent its K/V shard

        def fail(*args) -> None:
            raise RuntimeError("injected failure")

        merge, ring._merge = ring._merge, fail
        _record(out_dir / "mid-3.pt", forward_backward)
        ring._merge = merge
        _wait_for(out_dir / "mid-2.pt")
    else:
        _record(out_dir / "mid-2.pt", forward_backward)


def _nccl_device_cases(rank: int, group: dist.ProcessGroup, out_dir: Path) -> None:
    """NCCL only: a rank whose inputs are on the CPU makes every rank raise (instead of a hang or an NCCL
    error), and the ring computes on the inputs' GPU when another GPU is current."""
    on_cpu = rank == 0
    qkv = [t if on_cpu else t.cuda() for t in _shard_qkv(8)]
    _record(out_dir / f"cpu-on-nccl-{rank}.pt", lambda: ring_flash_attn_func(*qkv, group=group))

    gen = torch.Generator().manual_seed(rank)
    leaves = [torch.randn(1, 256, 4, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]

    def forward_backward() -> list[torch.Tensor]:
        inputs = [t.detach().requires_grad_() for t in leaves]
        out = ring_flash_attn_func(*inputs, causal=True, group=group)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in inputs)]

    expected = forward_backward()
    other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
    with torch.cuda.device(other):  # the current GPU is not the inputs' one
        got = forward_backward()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    torch.save({"same": same, "other": other}, out_dir / f"other-device-{rank}.pt")


MEMORY_SHAPE = (256, 4, 64)  # (shard_len, nheads = nheads_k, headdim) of the memory runs: bf16, zigzag, causal


def _memory_case(group: dist.ProcessGroup, out_dir: Path) -> None:
    """Profile one forward and one backward of ring attention on this rank (CPU path) and save every rank's
    peak allocation, in T per local token (T = one bf16 (1, shard_len, nheads, headdim) tensor), counting
    what exists before each as it does in training: q, k, v and dout before the forward (4T), and out too
    before the backward (5T). The first global rank of the group saves them for the group."""
    _backend.TRITON_INTERPRET = False  # the CPU path, whichever path the last case took
    shard_len, nheads, head_dim = MEMORY_SHAPE
    gen = torch.Generator().manual_seed(dist.get_rank())
    q, k, v, dout = (torch.randn(1, shard_len, nheads, head_dim, generator=gen).bfloat16() for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ring_flash_attn_func(*leaves, causal=True, group=group).backward(dout)  # once before: first-call caches
    for t in leaves:
        t.grad = None
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as forward:
        out = ring_flash_attn_func(*leaves, causal=True, group=group)
    with torch.profiler.profile(activities=cpu, profile_memory=True) as backward:
        out.backward(dout)
    unit = q.numel() * q.element_size()
    mine = {}
    for name, prof, before in (("fwd", forward, 4), ("bwd", backward, 5)):
        peak, live = _peak_allocation(prof)
        mine[name] = (before + peak / unit, [(round(nbytes / unit, 3), op) for nbytes, op in live])
    peaks = [None] * dist.get_world_size(group)
    dist.all_gather_object(peaks, mine, group=group)
    if dist.get_rank() == dist.get_global_rank(group, 0):
        torch.save(peaks, out_dir / f"memory-W{len(peaks)}-{dist.get_rank()}.pt")


def _peak_allocation(prof: torch.profiler.profile) -> tuple[int, list[tuple[int, str]]]:
    """The highest net CPU allocation in a profile (bytes, from its start) and what was alive then (bytes,
    the operator that made it), as a GPU's allocator would count it: what an operator allocates and frees
    itself is left out (a CPU kernel's fp32 copy of a bf16 input, the CPU attention path's fp32 tiles; a
    CUDA kernel reads mixed dtypes in place), and what it keeps counts from the operator's end."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int, str]] = []  # (time ns, bytes: + allocated / - freed, address, operator)

    def walk(event, op, temporaries: dict | None) -> None:
        if op is None and event.name.startswith(("aten::", "flashtile::")):
            op, temporaries = event, {}
        if event.tag == _EventType.Allocation:
            size, address = event.extra_fields.alloc_size, event.extra_fields.ptr
            if op is None:
                events.append((event.start_time_ns, size, address, event.parent.name if event.parent else "-"))
            elif size > 0:
                temporaries[address] = (op.end_time_ns, size, address, op.name)
            elif temporaries.pop(address, None) is None:  # not op's own: freed at op's end
                events.append((op.end_time_ns, size, address, op.name))
        for child in sorted(event.children, key=lambda e: e.start_time_ns):
            walk(child, op, temporaries)
        if event is op:
            events.extend(temporaries.values())  # what op allocated and kept

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None, None)
    events.sort(key=lambda e: e[0])  # stable: the order within an operator stays
    total = peak = 0
    live: dict[int, tuple[int, str]] = {}
    at_peak: list[tuple[int, str]] = []
    for _, size, address, op in events:
        total += size
        if size > 0:
            live[address] = (size, op)
        else:
            live.pop(address, None)
        if total > peak:
            peak, at_peak = total, sorted(live.values(), reverse=True)
    return peak, at_peak


def _worker(rank: int, world: int, tmp: str, cases: list[Case], backend: str) -> None:
    """Rank ``rank`` of ``world`` processes over ``backend``: every case, the memory runs (gloo), then the
    error cases.

    "gloo": CPU tensors, one thread per process; "nccl": one GPU per process (cuda:rank), compiled kernels.
    A case of ``world`` ranks runs on the default group; the cases of fewer ranks W (W divides world) run
    on the subgroups of W consecutive ranks, each subgroup taking its share of them. Then the error
    cases: over gloo, cases that need 4 ranks (inputs that differ across ranks, peers that fail); over
    NCCL, inputs on the wrong device.
    """
    _alloc.POISON_OUTPUTS = True  # outputs start as NaN, as in the parent's tests
    ring.MIN_GROUP_ROWS = 1  # small shards too run in head groups (as many as MAX_HEAD_GROUPS and nheads_k allow)
    tmp_path = Path(tmp)
    if backend == "nccl":
        os.environ.update(MULTICAST_OFF)
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=f"file://{tmp_path / 'init'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60 if backend == "gloo" else SPAWN_DEADLINE_S),  # NCCL: room for compiles
        device_id=device if backend == "nccl" else None,
    )
    error_cases = backend == "gloo"
    sizes = sorted({case.world for case in cases} - {world} | ({2} if error_cases else set()))
    subgroups: dict[int, list[dist.ProcessGroup]] = {}
    for size in sizes:  # every rank takes part in creating each group, in the same order
        assert world % size == 0, (world, size)
        subgroups[size] = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
    short = [dist.new_group([2, 3], timeout=SHORT_TIMEOUT) for _ in range(2)] if error_cases else []
    for case in cases:
        if case.world == world:
            _run_case(case, dist.group.WORLD, tmp_path, device)
    for size, groups in subgroups.items():
        mine = rank // size
        for case in [c for c in cases if c.world == size][mine :: len(groups)]:
            _run_case(case, groups[mine], tmp_path, device)
    if error_cases:
        _memory_case(dist.group.WORLD, tmp_path)
        _memory_case(subgroups[2][rank // 2], tmp_path)
    if backend == "nccl":
        _nccl_device_cases(rank, dist.group.WORLD, tmp_path)
    elif rank < 2:
        _mismatch_cases(rank, subgroups[2][0], tmp_path)
    else:
        _failing_peer_cases(rank, short, tmp_path)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(nprocs: int, tmp: Path, cases: list[Case], backend: str) -> None:
    """Run ``_worker(rank, nprocs, tmp, cases, backend)`` in ``nprocs`` fresh processes; fail the test if
    one raises (with its traceback) or if they are not done within SPAWN_DEADLINE_S."""
    context = mp.start_processes(_worker, args=(nprocs, str(tmp), cases, backend), nprocs=nprocs, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ring processes did not finish within {SPAWN_DEADLINE_S} s")


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory) -> Path:
    """Run every case in one spawn of 4 gloo processes (once per test run); returns the folder holding their
    results."""
    return made_once(tmp_path_factory, "ring", lambda folder: _spawn(4, folder, CASES, "gloo"))


def _outcome(ring_runs: Path, name: str) -> dict:
    return torch.load(ring_runs / f"{name}.pt")


# ----------------------------------------------------------------------------------------------
# The tests


def _check_case(case: Case, runs: Path, device: str) -> None:
    """Hold one case's gathered results to the tolerance rule against the oracle on the full sequence."""
    q, k, v, dout, dlse = (None if t is None else t.to(device) for t in full_inputs(case))
    results = {name: x.to(device) for name, x in torch.load(runs / f"{case.name}.pt").items()}
    expected = {"out", "dq", "dk", "dv"} | (set() if case.packed else {"lse"})
    expected |= {"dsink", "dsink_shares"} if case.sink else set()
    assert set(results) == expected
    shares = results.pop("dsink_shares", None)
    options = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in case.oracle_options.items()}
    check_against_oracle(results, q, k, v, dout, dlse=dlse, **options)
    if shares is not None:
        # Not all-reduced inside: each rank holds its own share (rows for the ring, heads for Ulysses).
        torch.testing.assert_close(shares.sum(0), results["dsink"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(shares[0], shares[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ring_matches_full_sequence_attention(ring_runs, case):
    _check_case(case, ring_runs, "cpu")


def gpu_cases(world: int) -> list[Case]:
    """The NCCL cases on ``world`` GPUs: bf16 (and one fp16), head dim 128, 1023 to 2050 positions per
    rank (some not a multiple of any tile), ring zigzag and contiguous, causal or not, windows, GQA,
    softcap and sinks, Ulysses with GQA heads split or repeated; nheads are multiples of ``world``."""
    big = {"dtype": torch.bfloat16, "head_dims": (128, 128)}
    return [
        Case(world, "zigzag", causal=True, shard_len=2048, heads=(8, 2), **big),
        Case(world, "contiguous", causal=True, shard_len=2048, heads=(8, 2), seed=1, **big),
        Case(world, "zigzag", shard_len=2048, heads=(8, 8), dlse=True, seed=2, **big),
        Case(world, "contiguous", shard_len=1023, heads=(8, 2), batch=2, seed=3, **big),
        Case(world, "zigzag", window=(1500, 300), shard_len=2050, heads=(8, 2), seed=4, **big),  # chunks of 1025
        Case(world, "zigzag", causal=True, softcap=30.0, sink=True, shard_len=1024, heads=(8, 2), seed=5, **big),
        Case(world, "zigzag", causal=True, packed=True, shard_len=1024, heads=(8, 8), seed=6, **big),
        Case(world, "zigzag", causal=True, shard_len=2048, heads=(8, 2), head_dims=(64, 64), seed=7),  # fp16
        Case(world, "contiguous", method="ulysses", causal=True, shard_len=1024, heads=(4 * world, world), seed=8,
             **big),
        Case(world, "contiguous", method="ulysses", causal=True, alibi=True, sink=True, shard_len=1024,
             heads=(4 * world, 1), seed=9, **big),  # the one key/value head repeated for every rank
    ]  # fmt: skip


GPU_CASES = gpu_cases(max(GPU_WORLD, 2))
needs_gpus = pytest.mark.skipif(
    GPU_WORLD < 2, reason=f"needs 2 CUDA devices for NCCL, this machine has {torch.cuda.device_count()}"
)


@pytest.fixture(scope="module")
def nccl_runs(tmp_path_factory) -> Path:
    """Run every GPU case in one spawn of GPU_WORLD NCCL processes (once per test run); returns the folder of their
    results."""

    def spawn(folder: Path) -> None:
        with pytest.MonkeyPatch.context() as patch:  # the children inherit the environment
            for name, value in MULTICAST_OFF.items():
                patch.setenv(name, value)
            _spawn(GPU_WORLD, folder, GPU_CASES, "nccl")

    return made_once(tmp_path_factory, "ring-nccl", spawn)


@pytest.mark.gpu
@needs_gpus
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_nccl_matches_full_sequence_attention(nccl_runs, case):
    """Compiled kernels over NCCL, one GPU per rank, against the oracle on the full sequence (on a GPU)."""
    _check_case(case, nccl_runs, "cuda")


@pytest.mark.gpu
@needs_gpus
def test_nccl_inputs_on_the_cpu_fail_on_every_rank(nccl_runs):
    own = _outcome(nccl_runs, "cpu-on-nccl-0")
    assert own["error"] == "InputError" and "moves CUDA tensors only" in own["message"], own
    for rank in range(1, GPU_WORLD):
        other = _outcome(nccl_runs, f"cpu-on-nccl-{rank}")
        assert other["error"] == "InputError" and "Rank(s) [0] of the group rejected" in other["message"], other


@pytest.mark.gpu
@needs_gpus
def test_nccl_ring_runs_on_the_inputs_gpu_whatever_gpu_is_current(nccl_runs):
    for rank in range(GPU_WORLD):
        outcome = _outcome(nccl_runs, f"other-device-{rank}")
        assert outcome["same"], outcome


# The peaks of ring.py's "Head groups and memory" table for MEMORY_SHAPE (4 head groups) in T per local token, and the
# slack the accounting leaves out: LSE-sized fp32 terms, (B, H, S) each, 2 / headdim T.
MEMORY_PEAKS = {(2, "fwd"): 6.75, (2, "bwd"): 10.75, (4, "fwd"): 6.75, (4, "bwd"): 12.625}
MEMORY_SLACK = 0.2


@pytest.mark.parametrize(("world", "rank0"), [(2, 0), (2, 2), (4, 0)])
def test_ring_memory_per_local_token_matches_the_accounting(ring_runs, world, rank0):
    """The highest peak allocation over the ranks in a forward and in a backward (profiled on the CPU path,
    counted as a GPU allocator counts it) is the documented accounting's, within LSE-sized terms: q, k, v,
    dout (and out) + the gradients + the ring's buffers over 4 head groups (21-23T before head groups)."""
    peaks = torch.load(ring_runs / f"memory-W{world}-{rank0}.pt")
    for name in ("fwd", "bwd"):
        rank = max(range(world), key=lambda r: peaks[r][name][0])
        peak, live = peaks[rank][name]
        expected = MEMORY_PEAKS[world, name]
        assert expected <= peak <= expected + MEMORY_SLACK, (
            f"W={world} {name}: peak {peak:.3f}T (rank {rank}), expected {expected}T; alive at the peak "
            f"(T, operator): {live}"
        )


def test_head_groups():
    assert ring.head_groups(1, 1 << 15, 16, 16) == [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]
    assert ring.head_groups(1, 1 << 14, 16, 16) == [slice(0, 8), slice(8, 16)]  # fewer: each keeps 2^17 rows
    assert ring.head_groups(1, 1 << 12, 16, 16) == [slice(0, 16)]
    assert ring.head_groups(1, 1 << 20, 32, 1) == [slice(0, 1)]  # one K/V head: one group
    assert ring.head_groups(2, 1 << 20, 12, 6) == [slice(0, 1), slice(1, 3), slice(3, 4), slice(4, 6)]


def test_shapes_that_differ_across_ranks_fail_on_every_rank(ring_runs):
    for rank in (0, 1):
        outcome = _outcome(ring_runs, f"lengths-{rank}")
        assert outcome["error"] == "InputError", outcome
        assert "seqlen per rank: rank 0: 8, rank 1: 10" in outcome["message"]


def test_options_that_differ_across_ranks_fail_on_every_rank(ring_runs):
    for rank in (0, 1):
        outcome = _outcome(ring_runs, f"options-{rank}")
        assert outcome["error"] == "InputError", outcome
        assert "window right (-1: unbounded, causal: 0): rank 0: 0, rank 1: -1" in outcome["message"]


def test_a_sink_on_some_ranks_only_fails_on_every_rank(ring_runs):
    for rank in (0, 1):
        outcome = _outcome(ring_runs, f"sink-{rank}")
        assert outcome["error"] == "InputError", outcome
        assert "learnable_sink (1: given): rank 0: 1, rank 1: 0" in outcome["message"]


def test_ulysses_checks_its_inputs_on_every_rank(ring_runs):
    for rank in (0, 1):
        outcome = _outcome(ring_runs, f"ulysses-lengths-{rank}")
        assert outcome["error"] == "InputError", outcome
        assert outcome["message"].startswith("ulysses_flash_attn_func needs the same shapes"), outcome
        assert "seqlen per rank: rank 0: 8, rank 1: 10" in outcome["message"]
        outcome = _outcome(ring_runs, f"ulysses-heads-{rank}")
        assert outcome["error"] == "InputError", outcome
        assert "nheads (3) must be divisible by 2" in outcome["message"], outcome


def test_a_shard_one_rank_rejects_fails_on_every_rank(ring_runs):
    """A zigzag shard of odd length (a sequence that does not divide into 2 * world chunks)."""
    own, other = _outcome(ring_runs, "odd-1"), _outcome(ring_runs, "odd-0")
    assert own["error"] == "InputError" and "must be even, got 9" in own["message"], own
    assert other["error"] == "InputError" and "Rank(s) [1] of the group rejected" in other["message"], other


def test_a_peer_that_never_calls_fails_within_the_timeout(ring_runs):
    outcome = _outcome(ring_runs, "never-2")
    assert outcome["error"] == "RuntimeError", outcome
    assert "init_process_group(timeout=...)" in outcome["message"]
    assert SHORT_TIMEOUT.total_seconds() <= outcome["seconds"] < 5 * SHORT_TIMEOUT.total_seconds()


def test_a_peer_that_fails_mid_ring_fails_the_others_within_the_timeout(ring_runs):
    failing, waiting = _outcome(ring_runs, "mid-3"), _outcome(ring_runs, "mid-2")
    assert failing["error"] == "RuntimeError" and failing["message"] == "injected failure", failing
    assert waiting["error"] == "RuntimeError" and "passing shards on" in waiting["message"], waiting
    assert waiting["seconds"] < 5 * SHORT_TIMEOUT.total_seconds()


def _kernel_mask(n_q: int, n_k: int, left: int | None, right: int | None) -> torch.Tensor:
    """The kernels' band, bottom-right aligned: row i sees column j iff i + d - left <= j <= i + d + right."""
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    d = n_k - n_q
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if left is not None:
        visible &= j >= i + d - left
    if right is not None:
        visible &= j <= i + d + right
    return visible


BANDS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (2, 5), (-1, 4), (7, -1), (0, -1), (11, 2), (40, 40)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_covers_the_global_mask_exactly_once(layout, world):
    """For every rank and every K/V shard it holds, the plan's calls together see exactly the key
    positions the global mask shows, each once."""
    for chunk in (1, 2, 5):
        shard_len = chunk * (2 if layout == "zigzag" else 1)
        seqlen = shard_len * world
        position = torch.arange(seqlen)
        for band in BANDS:
            left, right = (None if w < 0 else w for w in band)
            full = visibility_mask(seqlen, seqlen, window_size=band).int()
            for rank in range(world):
                rows = shard_tensor(position, rank, world, layout, dim=0)
                for source in range(world):
                    cols = shard_tensor(position, source, world, layout, dim=0)
                    seen = torch.zeros(shard_len, shard_len, dtype=torch.int)
                    mine, theirs = segments(rank, world, layout, shard_len), segments(source, world, layout, shard_len)
                    for b in ring.plan_step(mine, theirs, left, right):
                        seen[b.q0 : b.q1, b.k0 : b.k1] += _kernel_mask(b.q1 - b.q0, b.k1 - b.k0, b.left, b.right)
                    assert torch.equal(seen, full[rows][:, cols]), (band, rank, source)


def test_zigzag_causal_plan_is_one_balanced_call_per_step():
    """zigzag + causal: step 0 is one causal call over the shard; every other step one unmasked call of
    half the queries or half the keys, so every rank computes the same area."""
    world, chunk = 4, 16
    shard_len = 2 * chunk
    for rank in range(world):
        mine = segments(rank, world, "zigzag", shard_len)
        assert ring.plan_step(mine, mine, None, 0) == [ring.Block(0, shard_len, 0, shard_len, None, 0)]
        for step in range(1, world):
            source = (rank - step) % world
            (block,) = ring.plan_step(mine, segments(source, world, "zigzag", shard_len), None, 0)
            assert block.unmasked
            assert (block.q1 - block.q0) * (block.k1 - block.k0) == shard_len * chunk


def test_shard_layouts():
    position = torch.arange(16)
    assert shard_tensor(position, 1, 4, "zigzag", dim=0).tolist() == [2, 3, 12, 13]
    assert shard_tensor(position, 3, 4, "zigzag", dim=0).tolist() == [6, 7, 8, 9]
    assert shard_tensor(position, 1, 4, "contiguous", dim=0).tolist() == [4, 5, 6, 7]


def test_shard_needs_a_sequence_that_divides():
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        shard_tensor(torch.zeros(1, 12, 2, 8), 0, 4, "zigzag")


def test_options_without_an_implementation_raise():
    q = torch.randn(1, 8, 2, 32).half()
    slopes = torch.ones(2)
    with pytest.raises(
        NotImplementedError, match="ALiBi is not implemented in ring attention.*ulysses_flash_attn_func"
    ):
        ring_flash_attn_func(q, q, q, alibi_slopes=slopes)
    with pytest.raises(NotImplementedError, match="dropout"):
        ulysses_flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout"):
        ring_flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_flash_attn_func(q, q, q, layout="striped")


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.randn(1, 8, 2, 32).half()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attn_func(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ulysses_flash_attn_func(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        unshard(q)


def test_which_backends_need_cuda_tensors():
    assert group.backend_needs_cuda("nccl")
    assert not group.backend_needs_cuda("gloo")
    assert not group.backend_needs_cuda("cpu:gloo,cuda:nccl")  # CPU tensors go through gloo
    assert not group.backend_needs_cuda("undefined")


def test_cpu_inputs_on_an_nccl_group_are_rejected_before_any_transfer():
    class NcclRing:  # what check_device reads of a Ring over NCCL
        caller, backend, needs_cuda = "ring_flash_attn_func", "nccl", True

        def collective_device(self, device):
            return group.Ring.collective_device(self, device)

    q = torch.randn(1, 8, 2, 32).half()
    with pytest.raises(ValueError, match="'nccl', which moves CUDA tensors only, but q is on cpu"):
        group.check_device(q, NcclRing())
    assert NcclRing().collective_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    gloo = NcclRing()
    gloo.backend, gloo.needs_cuda = "gloo", False
    group.check_device(q, gloo)
    assert gloo.collective_device(q.device) == q.device
    assert isinstance(group.on_device(q), type(group.on_device(None)))  # no device switch for CPU tensors
