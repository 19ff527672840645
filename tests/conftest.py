"""Test set-up: which device runs, the Triton interpreter on CPU-only machines, and poisoned outputs.

Without CUDA the Triton kernels run in the Triton interpreter, which must be switched on before any
kernel module is imported, so it happens here first (flashtile then mends the interpreter's bf16 and
masks itself: ``flashtile._interpreter``).
"""

import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashtile  # noqa: E402, F401
from flashtile import _backend  # noqa: E402
from flashtile.ops import _alloc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the benchmarks' helpers
from bench_decode import capture  # noqa: E402, F401  (a CUDA-graph capture, for the tests too)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def seeded(request):
    """Every test draws the same random inputs whatever ran before it: torch's generators are seeded from
    the test's id, so a failure reproduces alone and a new test elsewhere cannot change another's data."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every kernel output starts as NaN, so an element a kernel does not write fails the test."""
    _alloc.POISON_OUTPUTS = True
    yield
    _alloc.POISON_OUTPUTS = False


@pytest.fixture(params=["triton", "cpu"] if DEVICE == "cpu" else ["triton"])
def path(request, monkeypatch):
    """Run a test through each implementation reachable on this machine, by the public API.

    On a CPU-only machine 'triton' is the Triton interpreter and 'cpu' is ``flashtile.cpu``.
    """
    if request.param == "cpu":
        monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    return request.param


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name``, filled by ``make(folder)`` once per test run: pytest-xdist's workers share it (the first
    to ask makes it under a file lock, the others wait for it), so an expensive module fixture runs once however
    the module's tests are spread over the workers. A ``make`` that raises leaves it to the next one to ask."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder, above the workers'
    folder, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            make(folder)
            done.touch()
    return folder


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): a worker per CPU core, at most 16, since on a GPU machine every worker
    holds its own CUDA context and compiled kernels on the same device."""
    return min(os.cpu_count() or 1, 16)


def pytest_configure(config):
    """Each pytest-xdist worker takes its share of the CPU cores for torch's own threads, so the workers do not
    oversubscribe them (the Triton interpreter is single-threaded; torch's CPU kernels are not)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
