"""Test set-up: which device runs, the Triton interpreter on CPU-only machines, and poisoned outputs.

Without CUDA the Triton kernels run in the Triton interpreter, which must be switched on before any
kernel module is imported, so it happens here first. Two of the interpreter's gaps are mended for the
tests: its bf16 ``tl.dot`` multiplies raw bit patterns, and its fp32 -> bf16 cast
truncates where GPUs round to nearest even. Both patches make the interpreter do what the GPU does.
"""

import os
import sys
import zlib
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import flashtile  # noqa: E402, F401
from flashtile import _backend  # noqa: E402
from flashtile.ops import _alloc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the benchmarks' helpers
from bench_decode import capture  # noqa: E402, F401  (a CUDA-graph capture, for the tests too)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _patch_interpreter_bf16() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def bf16_to_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, bf16_to_fp32(a), bf16_to_fp32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl  # create_fp_trunc and friends call self.cast_impl


if _backend.TRITON_INTERPRET:
    _patch_interpreter_bf16()


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


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
