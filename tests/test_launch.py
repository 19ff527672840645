"""Direct launches of the Triton kernels (``flashtile.ops._launch``), on the CPU.

``specialization_key`` must never give two argument lists that Triton specializes differently the same key: the
keys of many argument lists (each argument of real attention and decode launches varied: tensors aligned or not and
of other dtypes, ints that are 1, multiples of 16, others, beyond 32 and 64 bits, None, floats, descriptors of other
blocks) are compared with the specialization of Triton's own binder (``create_function_from_signature``, the installed
Triton: run this file with Triton 3.6 and 3.7). ``launch`` binds a key's first launch only.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor

import flashtile
from flashtile import _backend
from flashtile.ops import _launch
from flashtile.ops.attention import backward, configs, forward
from flashtile.ops.decode import split_kv
from flashtile.ops.sm90 import common as sm90_common
from flashtile.options import AttentionOptions, CacheOptions

INTS = (1, 0, 16, 17, 32, 48, 2, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 16,
        2**32, 2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16)  # fmt: skip


def _tensors(like: torch.Tensor) -> list[torch.Tensor]:
    """``like``'s dtype and others, 16-byte aligned or not."""
    out = []
    for dtype in (like.dtype, torch.float32, torch.float16, torch.int32):
        base = torch.empty(64, dtype=dtype)
        out += [base, base[1:], base[16 // base.element_size() :]]
    return out


def _alternatives(a) -> list:
    """Values to put where a launch passed ``a``: others of its kind, and a few of other kinds."""
    if isinstance(a, TensorDescriptor):
        x = torch.empty(2, 64, 2, 64, dtype=a.base.dtype)
        blocks = ([1, 64, 1, 64], [1, 32, 1, 64], [1, 64, 1, 32], list(a.block_shape))
        descs = [TensorDescriptor(x, list(x.shape), list(x.stride()), b) for b in blocks]
        y = x.float()
        descs.append(TensorDescriptor(y, list(y.shape), list(y.stride()), list(a.block_shape)))
        return [*descs, TensorDescriptor(x, list(x.shape), list(x.stride()), list(a.block_shape), padding="nan")]
    if isinstance(a, torch.Tensor):
        return [*_tensors(a), None]
    if type(a) is float:
        return [0.5, 1.0, -3.0, 1, 16, True]
    return [*INTS, None, 0.5, True, False, torch.empty(64)]


def _recorded_launches(monkeypatch, *modules) -> list[tuple]:
    """A list that the ``launch`` calls of ``modules`` fill with (kernel, grid, args, constexprs, options) instead of
    launching anything (``keyed``, a decode plan's, is left out)."""
    calls = []

    def record(kernel, grid, args, constexprs, keyed=None, **options):
        calls.append((kernel, grid, args, constexprs, options))

    for module in modules:
        monkeypatch.setattr(module, "launch", record)
    return calls


def _captured_launches(monkeypatch) -> list[tuple]:
    """(kernel, grid, args, constexprs, options) of the forward's, the delta's and the backward's launches of a
    causal GQA call with tensor descriptors (forward and dQ) and without (dK/dV), on CPU tensors."""
    calls = _recorded_launches(monkeypatch, forward, backward)
    q, k, v, dout = (torch.randn(2, 40, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2, 4))
    tma = configs.TileConfig(64, 64, 4, 3, tma=True)
    with configs.override(forward_banded_short=tma, backward_dq=tma, backward_dkdv=configs.TileConfig(32, 64, 4, 2)):
        options = AttentionOptions(0.125, None, 0)
        out, lse = forward.attention_forward(q, k, v, options)
        backward.attention_backward(dout, q, k, v, out, lse, options, dlse=torch.zeros_like(lse))
    assert [call[0] for call in calls] == [forward._attention_forward_kernel, backward._delta_kernel,
                                           backward._attention_dkdv_kernel, backward._attention_dq_kernel]  # fmt: skip
    assert any(isinstance(a, TensorDescriptor) for a in calls[0][2])
    return calls


def _decode_steps(monkeypatch) -> None:
    """Two decode steps on CPU tensors (GQA, 2 query tokens), on the Triton launchers' path as under
    TRITON_INTERPRET=1 (on a GPU machine too, where CPU tensors otherwise take the PyTorch path): one on a paged
    cache with a new token, rotary, ALiBi slopes per batch entry, softcap, a window and 2 splits, so that every
    pointer but cache_batch_idx and cache_leftpad is a tensor; one on a contiguous cache with those two and no new
    token."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", True)
    q = torch.randn(2, 2, 4, 64, dtype=torch.bfloat16)
    k_pages, v_pages = (torch.randn(8, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = torch.rand(64, 16), torch.rand(64, 16)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    seqlens = torch.tensor([40, 17], dtype=torch.int32)
    flashtile.flash_attn_with_kvcache(
        q, k_pages, v_pages, k_new, v_new, cos, sin, seqlens, block_table=table, causal=True, window_size=(24, -1),
        softcap=30.0, alibi_slopes=torch.rand(2, 4), num_splits=2,
    )  # fmt: skip
    k_cache, v_cache = (torch.randn(3, 48, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    batch_idx, leftpad = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                                      cache_leftpad=leftpad)  # fmt: skip


def _jit(kernel) -> JITFunction:
    """A compiled-path JITFunction of ``kernel`` (the tests run the interpreter's)."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _keys_checked(launches: list[tuple]) -> int:
    """Over single-argument and pairwise variations of ``launches`` (and of their constexprs and options), equal keys
    always come with equal specializations and options from Triton's binder for sm_90; returns how many keys."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    checked = 0
    for kernel, _, args, constexprs, options in launches:
        jit = _jit(kernel)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        seen: dict[tuple, tuple] = {}

        def check(args, constexprs, options, jit=jit, binder=binder, seen=seen):
            tail = [constexprs[name] for name in jit.arg_names[len(args) :]]
            key = _launch.specialization_key(jit.fn.__name__, args, tail, options)  # hash(jit) would compile it
            _, specialization, bound_options = binder(*args, **constexprs, **options)
            assert seen.setdefault(key, (specialization, bound_options)) == (specialization, bound_options), key

        variants = [(i, alt) for i, a in enumerate(args) for alt in _alternatives(a)]
        for i, alt in variants:
            check((*args[:i], alt, *args[i + 1 :]), constexprs, options)
        for (i, a), (j, b) in itertools.islice(itertools.combinations(variants, 2), 0, None, 97):
            if i != j:
                varied = list(args)
                varied[i], varied[j] = a, b
                check(tuple(varied), constexprs, options)
        name = next(iter(constexprs))
        for value in (16, 32, 64, 1):
            check(args, {**constexprs, name: value}, options)
        for warps in (2, 4, 8):
            check(args, constexprs, {**options, "num_warps": warps})
        checked += len(seen)
    return checked


def test_specialization_key_separates_what_triton_specializes_apart(monkeypatch):
    """``_keys_checked`` over four real attention launches (forward, delta, dK/dV, dQ)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _keys_checked(_captured_launches(monkeypatch)) > 1000


def test_decode_launch_keys_separate_what_triton_specializes_apart(monkeypatch):
    """``_keys_checked`` over the split-KV kernel's launches of ``_decode_steps``: the decode step's 54 arguments
    (tensors, None, ints, the two floats) are keyed as Triton specializes them."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launches = _recorded_launches(monkeypatch, split_kv)
    _decode_steps(monkeypatch)
    assert [launch[0] for launch in launches] == [split_kv._split_kv_kernel] * 2
    paged, contiguous = (launch[2][:17] for launch in launches)  # the pointers: Q .. Sin
    assert [i for i, a in enumerate(paged) if a is None] == [11, 12]  # cache_batch_idx, cache_leftpad
    assert contiguous[11] is not None and contiguous[12] is not None
    assert _keys_checked(launches) > 1000


def test_decode_steps_of_one_shape_bind_once(monkeypatch, runs):
    """A decode step binds through JITFunction.run on its shapes' first launch only: the next steps, every tensor a
    new one of the same shape, hand the compiled kernel their arguments directly (with the launch keys their plans
    keep, made afresh for this kernel)."""
    monkeypatch.setattr(split_kv, "_split_kv_kernel", _jit(split_kv._split_kv_kernel))
    monkeypatch.setattr(split_kv, "_PLANS", _launch.Plans())
    _decode_steps(monkeypatch)
    _decode_steps(monkeypatch)
    assert [call[0] for call in runs] == ["run", "run", "direct", "direct"]
    assert len(split_kv._PLANS) == 2 and all(plan.keyed is not None for plan in split_kv._PLANS.values())


def test_decode_plans_follow_layouts(monkeypatch):
    """``split_kv.decode_attention`` keeps a plan per input layout (``_plan_key``): a step on new tensors of one
    layout reuses its plan (grid, int arguments, constexprs, launch key, the config and split count: one
    ``configs.config_and_splits`` per plan) with its own tensors, outputs, partials and scale; a paged cache, a
    window and another requested split count make new plans, and so does a changed config once the plans are
    cleared (as tests and tuning scripts that change it do); a q at an address that is not 16-byte aligned is planned
    on each call (its launch key says so) and never kept."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(split_kv, "_split_kv_kernel", _jit(split_kv._split_kv_kernel))
    monkeypatch.setattr(split_kv, "_PLANS", _launch.Plans())
    launches = []

    def record(kernel, grid, args, constexprs, keyed, **options):
        launches.append((grid, args, constexprs, keyed))

    monkeypatch.setattr(split_kv, "launch", record)
    decided = []
    config_and_splits = split_kv.configs.config_and_splits
    monkeypatch.setattr(split_kv.configs, "config_and_splits", lambda *a: decided.append(a) or config_and_splits(*a))

    def step(num_splits=2, window=(None, None), paged=False, offset=0, scale=0.125):
        """A decode step (B=2, one token, Hq 4, Hkv 2, D 64, 128 cache positions, one new token, appended first:
        ``split_kv.appends_first``); its inputs."""
        q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
        if offset:
            q = torch.empty(q.numel() + offset, dtype=q.dtype)[offset:].view(q.shape)
        slots, rows = (16, 16) if paged else (2, 128)
        k_cache, v_cache = (torch.randn(slots, rows, 2, 64, dtype=torch.bfloat16) for _ in range(2))
        table = torch.arange(16, dtype=torch.int32).view(2, 8) if paged else None
        k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.bfloat16) for _ in range(2))
        seqlens = torch.tensor([40, 17], dtype=torch.int32)
        options = AttentionOptions(softmax_scale=scale, window_left=window[0], window_right=window[1])
        cache = CacheOptions(cache_seqlens=seqlens, block_table=table, num_splits=num_splits)
        split_kv.decode_attention(q, k_cache, v_cache, k_new, v_new, options, cache)
        return q, k_cache, v_cache, k_new, v_new

    first = step()
    second = step(scale=0.5)
    assert len(split_kv._PLANS) == 1 and len(launches) == 2 and len(decided) == 1
    (grid, args, constexprs, keyed), (grid2, args2, constexprs2, keyed2) = launches
    assert grid2 == grid == (4, 2, 1) and constexprs2 is constexprs and keyed2 is keyed and args2[17:-2] == args[17:-2]
    assert keyed[0] == _launch.constexpr_tail(split_kv._split_kv_kernel, args, constexprs)
    assert all(a is b for a, b in zip((*args[:5], *args2[:5]), (*first, *second), strict=True))  # its own inputs
    assert all(args2[i] is not args[i] for i in (5, 6, 7, 8))  # outputs and partials of its own
    assert args2[9] is split_kv._counters[torch.device("cpu")]
    assert (args[-2], args2[-2], args2[-1]) == (0.125 * split_kv.LOG2E.value, 0.5 * split_kv.LOG2E.value, 0.0)
    step(paged=True)
    assert len(split_kv._PLANS) == 2 and launches[-1][2]["PAGE_SIZE"] == 16
    step(window=(8, 0))
    assert len(split_kv._PLANS) == 3 and launches[-1][2]["MASK_LEFT"] and launches[-1][1][-4:-2] == (8, 0)
    step(num_splits=3)
    assert len(split_kv._PLANS) == 4 and launches[-1][0] == (4, 3, 1)
    assert len(decided) == 4
    monkeypatch.setattr(split_kv.configs, "INTERPRETER", split_kv.configs.DecodeConfig(16, 4, 1))
    split_kv._PLANS.clear()
    step()
    assert len(split_kv._PLANS) == 1 and launches[-1][2]["BLOCK_N"] == 16
    aligned_key = launches[-1][3][1]
    q_at = len(aligned_key) - len(launches[-1][1])  # the first argument's place in the launch key
    for _ in range(2):
        q = step(offset=1)[0]
        assert q.data_ptr() % 16 != 0 and len(split_kv._PLANS) == 1
        assert launches[-1][3][1] == (*aligned_key[:q_at], (torch.bfloat16, False), *aligned_key[q_at + 1 :])
    assert launches[-1][3] is not launches[-2][3]


def test_specialization_key_refuses_unknown_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(TypeError, match="no specialization key"):
        _launch.specialization_key("kernel", ("a string",), [], {})


def _kernel(X, Y, n, m, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    """A kernel signature for ``launch``'s tests (never compiled)."""


class _Compiled:
    """Stands in for Triton's CompiledKernel: records ``compiled.run`` (Triton's launcher: grid, stream, function,
    packed metadata, launch metadata, the two hooks, then the kernel's arguments) as ("direct", grid, args) and
    ``compiled[grid](*args)`` as ("hooked", grid, args)."""

    function, packed_metadata = "function", "packed metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, metadata, enter, exit_hook, *args):
        assert (stream, function, packed_metadata, metadata, enter, exit_hook) == (
            "stream 0", "function", "packed metadata", None, None, None
        )  # fmt: skip
        self.calls.append(("direct", (grid_x, grid_y, grid_z), args))

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("hooked", grid, args))


class _Driver:
    """Triton's active driver as ``run_compiled`` asks it: device 0, its stream."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> str:
        return f"stream {device}"


@pytest.fixture
def runs(monkeypatch) -> list[tuple]:
    """Launches recorded in order: ("run", grid, args, kwargs) through JITFunction.run (returning a ``_Compiled``),
    ("direct", grid, args) past it; device 0 current, ``_launch._COMPILED`` empty."""
    calls = []

    def run(self, *args, grid, warmup, **kwargs):
        calls.append(("run", grid, args, kwargs))
        return _Compiled(calls)

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_COMPILED", {})
    monkeypatch.setattr(_launch.driver, "_active", _Driver())
    return calls


def test_launch_binds_a_keys_first_launch_only(monkeypatch, runs):
    """The first launch of a key goes through JITFunction.run (arguments, constexprs and options as given), later
    ones hand the compiled kernel its arguments with the constexprs in parameter order; a new key (here an int that
    changed, a tensor of other alignment) binds again; at MAX_KEYS the cache starts over."""
    calls = runs
    kernel = JITFunction(_kernel)
    out = torch.empty(64)
    args = (out, None, 7, 8)
    constexprs = {"FLAG": False, "BLOCK": 16}  # not in parameter order
    tail = [16, False]
    _launch.launch(kernel, (1, 2, 3), args, constexprs, num_warps=4)
    _launch.launch(kernel, (4, 2, 3), args, constexprs, num_warps=4)
    assert calls == [("run", (1, 2, 3), args, {**constexprs, "num_warps": 4}), ("direct", (4, 2, 3), (*args, *tail))]
    for changed in ((*args[:-1], 16), (out[1:], *args[1:])):
        _launch.launch(kernel, (1, 1, 1), changed, constexprs, num_warps=4)
        assert calls[-1][0] == "run"
    assert len(_launch._COMPILED) == 3
    monkeypatch.setattr(_launch, "MAX_KEYS", 3)
    _launch.launch(kernel, (1, 1, 1), (*args[:-1], 32), constexprs, num_warps=4)
    assert calls[-1][0] == "run" and len(_launch._COMPILED) == 1


def test_direct_launches_call_registered_launch_hooks(monkeypatch, runs):
    """While a launch hook is registered with Triton (a profiler's, e.g. proton), launches past the binder go through
    ``compiled[grid]``, which hands the hooks their metadata; with none registered, to the launcher directly."""
    from triton import knobs

    kernel = JITFunction(_kernel)
    args = (torch.empty(64), None, 7, 8)
    constexprs = {"FLAG": False, "BLOCK": 16}
    for _ in range(2):
        _launch.launch(kernel, (1, 1, 1), args, constexprs)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch.launch(kernel, (1, 1, 1), args, constexprs)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    _launch.launch(kernel, (1, 1, 1), args, constexprs)
    assert [call[0] for call in runs] == ["run", "direct", "hooked", "direct"]


def test_gluon_launch_keys_ints_by_width(runs):
    """``sm90.common.launch``: the first launch of a ``launch_key`` goes through JITFunction.run with 4 warps; the
    next ones hand the kept compiled kernel every argument in parameter order, constexprs after the runtime ones,
    whatever the order of the constexprs dict, for other int values (not specialized) and floats too; another
    constexpr value is another key."""
    kernel = JITFunction(_kernel, do_not_specialize=["n", "m"])
    out = torch.empty(64)
    sm90_common.launch(kernel, (1, 2, 3), (out, None, 5, 0.5), {"FLAG": True, "BLOCK": 7})
    sm90_common.launch(kernel, (4, 2, 3), (out, None, 6, 0.25), {"FLAG": True, "BLOCK": 7})
    sm90_common.launch(kernel, (4, 2, 3), (out, None, 6, 0.25), {"FLAG": False, "BLOCK": 7})
    assert runs == [
        ("run", (1, 2, 3), (out, None, 5, 0.5), {"FLAG": True, "BLOCK": 7, "num_warps": 4}),
        ("direct", (4, 2, 3), (out, None, 6, 0.25, 7, True)),
        ("run", (4, 2, 3), (out, None, 6, 0.25), {"FLAG": False, "BLOCK": 7, "num_warps": 4}),
    ]


def test_launch_calls_other_kernels_as_they_are():
    """The interpreter's kernels (TRITON_INTERPRET=1) and stand-ins are launched with kernel[grid](...)."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    _launch.launch(Kernel(), (1, 1, 1), (3, None), {"X": 1}, num_warps=8)
    assert calls == [((1, 1, 1), (3, None), {"X": 1, "num_warps": 8})]
