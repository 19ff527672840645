"""The one place that decides which implementation runs.

| input                                                        | path                              |
|--------------------------------------------------------------|-----------------------------------|
| CUDA tensor                                                  | Triton kernels, compiled          |
| CPU tensor and ``TRITON_INTERPRET=1`` set before import      | the same Triton kernels, interpreted |
| CPU tensor otherwise                                         | ``flashtile.cpu``: PyTorch, tiled  |

Nothing else in flashtile reads the environment. Under the interpreter, this module first installs
``flashtile._interpreter``'s fixes (the interpreter computes bf16 products and casts, and reads some masks, unlike a
GPU). On a Hopper GPU (sm_90) the forwards and backwards that qualify run Gluon kernels instead of the Triton ones
(``ops.sm90.forward``, ``ops.sm90.backward``; ``FLASHTILE_GLUON=0`` turns them off). It also holds the
value-check switch: whether checks that need the *values* of index tensors (``cache_seqlens``, ``block_table``,
``cu_seqlens``, ...) run (``values_checked``); see docs/validation.md. Each path module provides
``attention_forward(q, k, v, softmax_scale, window_left, window_right, alibi_slopes, softcap,
learnable_sink, dropout_p, rng_state) -> (out, lse)``, ``attention_backward(dout, q, k, v, out, lse,
softmax_scale, window_left, window_right, dlse, alibi_slopes, softcap, learnable_sink, dropout_p,
rng_state) -> (dq, dk, dv)``,
``attention_delta(dout, out, dlse) -> delta``, and ``varlen_attention_forward`` /
``varlen_attention_backward``: the same on packed (total, nheads, headdim) batches with cu_seqlens (the
forward also takes a trailing ``block_table``: paged keys and values).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from flashtile.errors import InputError

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if TRITON_INTERPRET:  # before any kernel runs: the interpreter computes bf16 and some masks unlike a GPU
    from flashtile import _interpreter

    _interpreter.apply()


def _env_flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise InputError(f"{name} must be 0 or 1, got {value!r}.")
    return value == "1"


GLUON = _env_flag("FLASHTILE_GLUON", "1")
"""Whether the calls that qualify run the Gluon kernels on sm_90 (``ops.sm90.forward``,
``ops.sm90.backward``): ``FLASHTILE_GLUON=0`` keeps every launch on the portable Triton kernels."""

CHECK_VALUES = _env_flag("FLASHTILE_CHECK_VALUES", "1")
"""The process-wide default of the value checks on CUDA tensors: ``FLASHTILE_CHECK_VALUES=0`` turns them off."""

_check_values: contextvars.ContextVar[bool | None] = contextvars.ContextVar("flashtile_check_values", default=None)


@contextlib.contextmanager
def check_values(enabled: bool) -> Iterator[None]:
    """Turn the checks of index *values* on CUDA tensors on (``enabled`` true) or off (false) inside a ``with``
    block (or a function, as a decorator); the default comes from ``FLASHTILE_CHECK_VALUES`` (1: on).

    These checks copy the index tensors to the host, a synchronisation that drains the GPU's queue, on
    every call; a serving loop that builds its indices itself turns them off::

        with flashtile.check_values(False):
            out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table)

    Shape, dtype and device checks always run, CPU tensors are always checked (no synchronisation), and
    with the checks off bad values give wrong numbers, never an illegal memory access (docs/validation.md).
    The setting is a ``contextvars.ContextVar``: it holds for this thread (and asyncio task) only.
    """
    token = _check_values.set(bool(enabled))
    try:
        yield
    finally:
        _check_values.reset(token)


def values_checked(device: torch.device) -> bool:
    """Whether checks of index values run now for tensors on ``device``: always on the CPU, never while
    torch.compile traces (there are no values), and on CUDA unless switched off (``check_values``,
    ``FLASHTILE_CHECK_VALUES``) or the current stream is capturing a CUDA graph (a sync would break it)."""
    if torch.compiler.is_compiling():  # first: dynamo must not trace the capture query below
        return False
    if device.type != "cuda":
        return True
    enabled = _check_values.get()
    if not (CHECK_VALUES if enabled is None else enabled):
        return False
    return not torch.cuda.is_current_stream_capturing()


def path_name(device: torch.device) -> str:
    """'triton' (compiled), 'triton-interpreter' or 'cpu' for tensors on ``device``."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton-interpreter" if TRITON_INTERPRET else "cpu"
    raise InputError(
        f"flashtile runs on CUDA and CPU tensors, got a tensor on {device}. Move the inputs with .cuda() or .cpu()."
    )


RECORDING = None
"""The active ``flashtile.profile()`` (a ``flashtile.profiler.Profile``) or None: while set, the attention passes
(``attention_path``) and decoding steps (``kvcache``) record into it; None costs one check per pass."""


def attention_path(device: torch.device) -> ModuleType:
    """The module that implements attention for tensors on ``device`` (inside ``flashtile.profile()``, that module
    with its passes recorded)."""
    path = imported("flashtile.cpu" if path_name(device) == "cpu" else "flashtile.ops.attention")
    return path if RECORDING is None else RECORDING.attention_path(path)


@functools.cache
def imported(name: str) -> ModuleType:
    """The module ``name``, imported on the first call: for modules a per-call path needs but must not import at
    import time (the CPU path, the kernels' launchers, Gluon only on sm_90 GPUs); an import statement in a function
    runs the import system's lookup on every call."""
    return importlib.import_module(name)
