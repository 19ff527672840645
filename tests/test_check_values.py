"""The value-check switch (``flashtile._backend.values_checked``, ``check_values``, FLASHTILE_CHECK_VALUES).

Checks of index *values* cost a device-to-host copy on CUDA, so they can be switched off there; CPU
tensors are always checked. With the checks off, bad values must give wrong numbers, never an illegal
memory access: the decode kernels clamp every index into the cache. On a CPU-only machine that is
tested by telling flashtile that values are not checked (as on a GPU with the switch off) and running
the Triton kernels in the interpreter, which reads raw memory as a GPU does (a wild index would read or
write far outside the tensors); on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import DEVICE, capture
from flashtile import _backend
from flashtile.interface import flash_attn_varlen_func
from flashtile.kvcache import flash_attn_with_kvcache
from test_kvcache import Case, check, make_inputs

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture
def not_capturing(monkeypatch):
    """A CUDA device that is not capturing a graph, on any machine; records the capture queries."""
    calls = []

    def capturing():
        calls.append(1)
        return False

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    return calls


# The switch -------------------------------------------------------------------------------------------


def test_default_on(not_capturing):
    assert _backend.CHECK_VALUES  # the test run does not set FLASHTILE_CHECK_VALUES=0
    assert _backend.values_checked(CUDA) and _backend.values_checked(CPU)


def test_context_manager(not_capturing):
    with _backend.check_values(False):
        assert not _backend.values_checked(CUDA)
        assert _backend.values_checked(CPU), "CPU tensors are always checked"
        with _backend.check_values(True):
            assert _backend.values_checked(CUDA)
        assert not _backend.values_checked(CUDA)
    assert _backend.values_checked(CUDA)


def test_decorator(not_capturing):
    @_backend.check_values(False)
    def step():
        return _backend.values_checked(CUDA)

    assert step() is False and _backend.values_checked(CUDA)


def test_environment_default(monkeypatch, not_capturing):
    """FLASHTILE_CHECK_VALUES=0 (read at import into CHECK_VALUES) turns them off; check_values(True) wins."""
    monkeypatch.setattr(_backend, "CHECK_VALUES", False)
    assert not _backend.values_checked(CUDA) and _backend.values_checked(CPU)
    with _backend.check_values(True):
        assert _backend.values_checked(CUDA)


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), (" 1 ", True)])
def test_environment_parsing(monkeypatch, value, expected):
    monkeypatch.setenv("FLASHTILE_CHECK_VALUES", value)
    assert _backend._env_flag("FLASHTILE_CHECK_VALUES", "1") is expected


def test_environment_parsing_refuses_other_values(monkeypatch):
    monkeypatch.setenv("FLASHTILE_CHECK_VALUES", "false")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        _backend._env_flag("FLASHTILE_CHECK_VALUES", "1")


def test_capture_skips_checks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not _backend.values_checked(CUDA)


def test_capture_query_only_when_needed(not_capturing):
    """The capture query is a call into the CUDA runtime: not made for CPU tensors or with the switch off."""
    _backend.values_checked(CPU)
    with _backend.check_values(False):
        _backend.values_checked(CUDA)
    assert not not_capturing
    _backend.values_checked(CUDA)
    assert len(not_capturing) == 1


def test_compile_never_traces_the_capture_query(monkeypatch):
    """torch 2.11 on CUDA failed with 'torch.* op returned non-Tensor' when dynamo traced the capture query
    under fullgraph=True: torch.compiler.is_compiling() must be asked first."""

    def capturing():
        raise AssertionError("the capture query was traced")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)

    def fn(x):
        return x + 1 if _backend.values_checked(CUDA) else x - 1

    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(torch.ones(3)), torch.zeros(3))


def test_thread_local(not_capturing):
    """check_values(False) in one thread leaves the others checking."""
    inside, done = threading.Event(), threading.Event()
    seen = []

    def switched_off():
        with _backend.check_values(False):
            seen.append(("off", _backend.values_checked(CUDA)))
            inside.set()
            done.wait(5)

    thread = threading.Thread(target=switched_off)
    thread.start()
    assert inside.wait(5)
    seen.append(("main", _backend.values_checked(CUDA)))
    done.set()
    thread.join()
    assert sorted(seen) == [("main", True), ("off", False)]


# flash_attn_with_kvcache ------------------------------------------------------------------------------

WILD = 2**30  # far outside every tensor: an unclamped index would read or write gigabytes away


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _contiguous(**overrides):
    case = Case(**{**dict(batch=2, seqlen_q=2, seqlen_new=2, seqlen_cache=64, cache_seqlens=(10, 20)), **overrides})
    return case, make_inputs(case)


def _paged(**overrides):
    return _contiguous(page_size=16, **overrides)


# name: (inputs, the changed arguments); every case is rejected when values are checked
BAD_VALUES = {
    "seqlens-huge": (_paged, lambda x: {"cache_seqlens": _i32(WILD, 3)}),
    "seqlens-negative": (_paged, lambda x: {"cache_seqlens": _i32(-WILD, 3)}),
    "seqlens-contiguous": (_contiguous, lambda x: {"cache_seqlens": _i32(3, WILD)}),
    "block-table-huge": (_paged, lambda x: {"block_table": x.block_table.masked_fill(x.block_table >= 0, WILD)}),
    "block-table-negative": (_paged, lambda x: {"block_table": torch.full_like(x.block_table, -WILD)}),
    "batch-idx": (lambda: _contiguous(batch_idx=True), lambda x: {"cache_batch_idx": _i32(WILD, -WILD)}),
    "leftpad": (lambda: _paged(leftpad=True), lambda x: {"cache_leftpad": _i32(-WILD, WILD)}),
    "rotary-past-table": (
        lambda: _contiguous(rotary_dim=32, seqlen_q=5),
        lambda x: {"cache_seqlens": _i32(62, 62)},  # q rotated at 62..66, the tables hold 64 rows
    ),
    "everything": (
        lambda: _paged(leftpad=True, rotary_dim=32),
        lambda x: {
            "cache_seqlens": _i32(WILD, -WILD),
            "cache_leftpad": _i32(WILD, -WILD),
            "block_table": torch.full_like(x.block_table, WILD),
        },
    ),
}


def _run(case_and_inputs, changes, num_splits=1):
    case, x = case_and_inputs()
    k_cache, v_cache = x.k_cache.clone(), x.v_cache.clone()
    kwargs = dict(
        k=x.k, v=x.v, rotary_cos=x.rotary_cos, rotary_sin=x.rotary_sin, cache_seqlens=x.cache_seqlens,
        cache_batch_idx=x.cache_batch_idx, cache_leftpad=x.cache_leftpad, block_table=x.block_table,
        causal=True, num_splits=num_splits, return_softmax_lse=True,
    )  # fmt: skip
    kwargs.update(changes(x))
    out, lse = flash_attn_with_kvcache(x.q, k_cache, v_cache, **kwargs)
    return out, lse, k_cache, v_cache


@pytest.mark.parametrize("case", BAD_VALUES, ids=BAD_VALUES.keys())
def test_bad_values_are_rejected_when_checked(case):
    with pytest.raises(ValueError):
        _run(*BAD_VALUES[case])


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors")
@pytest.mark.parametrize("case", BAD_VALUES, ids=BAD_VALUES.keys())
def test_cpu_tensors_are_checked_when_switched_off(path, case):
    with _backend.check_values(False), pytest.raises(ValueError):
        _run(*BAD_VALUES[case])


@pytest.fixture
def unchecked(monkeypatch):
    """Values are not checked (as on a GPU with check_values(False)); the kernels run (interpreter or GPU)."""
    monkeypatch.setattr(_backend, "values_checked", lambda device: False)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", BAD_VALUES, ids=BAD_VALUES.keys())
def test_bad_values_unchecked_stay_inside(unchecked, case, num_splits):
    """Unchecked bad values: the kernels finish, write every output element (outputs start as NaN) and
    keep every access inside the tensors (the interpreter dereferences raw addresses like a GPU)."""
    out, lse, k_cache, v_cache = _run(*BAD_VALUES[case], num_splits=num_splits)
    assert torch.isfinite(out).all()
    assert not torch.isnan(lse).any()
    assert torch.isfinite(k_cache).all() and torch.isfinite(v_cache).all()


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda n: f"splits{n}")
def test_good_values_unchecked_unchanged(unchecked, num_splits):
    """The clamps change nothing for valid values: unchecked, out, lse and the cache match the oracle.
    (The kernels clamp whether or not the host checked, so comparing against a checked run could not fail.)"""
    check(
        Case(batch=2, seqlen_q=2, seqlen_new=2, seqlen_cache=64, cache_seqlens=(10, 20), page_size=16, leftpad=True,
             rotary_dim=32, causal=True, num_splits=num_splits)
    )  # fmt: skip


# flash_attn_varlen_func -------------------------------------------------------------------------------


def _varlen(cu_q, cu_k):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 32, generator=gen).half().to(DEVICE)
    k = torch.randn(10, 2, 32, generator=gen).half().to(DEVICE)
    return flash_attn_varlen_func(q, k, k, _i32(*cu_q), _i32(*cu_k), 8, 8)


VARLEN_BAD = {
    "end-past-total": ((0, 4, 12), (0, 5, WILD)),
    "negative": ((0, -WILD, 12), (0, 5, 10)),
    "decreasing": ((0, 8, 4), (0, 5, 10)),
}


@pytest.mark.parametrize("case", VARLEN_BAD, ids=VARLEN_BAD.keys())
def test_varlen_bad_values_rejected(case):
    with pytest.raises(ValueError):
        _varlen(*VARLEN_BAD[case])


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors")
def test_varlen_cpu_tensors_are_checked_when_switched_off(path):
    with _backend.check_values(False), pytest.raises(ValueError):
        _varlen(*VARLEN_BAD["end-past-total"])


@pytest.mark.parametrize("case", VARLEN_BAD, ids=VARLEN_BAD.keys())
def test_varlen_bad_values_unchecked_stay_inside(unchecked, case):
    """Unchecked bad cu_seqlens are clamped into the packed tensors: the kernels finish."""
    out = _varlen(*VARLEN_BAD[case])
    assert out.shape == (12, 2, 32)


# On a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_graph_capture_and_replay(paged):
    """A decode step captured in a CUDA graph (value checks skipped: a sync would break the capture) replays
    to the eager result; the indices are read on the device at replay, so new values need no recapture."""
    case, x = (_paged if paged else _contiguous)()
    k_cache, v_cache = x.k_cache.clone(), x.v_cache.clone()
    seqlens = x.cache_seqlens.clone()

    def step():
        return flash_attn_with_kvcache(x.q, k_cache, v_cache, x.k, x.v, cache_seqlens=seqlens,
                                       block_table=x.block_table, causal=True)  # fmt: skip

    expected = step()
    graph, out = capture(step)
    graph.replay()
    assert torch.equal(out, expected)
    seqlens.sub_(1)  # the same step one position earlier, without recapturing
    moved = step()
    graph.replay()
    assert torch.equal(out, moved)


@pytest.mark.gpu
def test_checks_off_means_no_sync():
    """With check_values(False) a decode step never synchronises with the GPU (torch's sync debug mode
    raises on any synchronising call); with the checks on it does, once."""
    case, x = _paged()
    _run(lambda: (case, x), lambda x: {})  # compiles the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with _backend.check_values(False):
            _run(lambda: (case, x), lambda x: {})
        with pytest.raises(RuntimeError, match="synchroniz"):
            _run(lambda: (case, x), lambda x: {})
    finally:
        torch.cuda.set_sync_debug_mode("default")
