"""The one place that decides which implementation runs: the path for a device, and the kernel family of each pass.

| input                                                        | path                              |
|--------------------------------------------------------------|-----------------------------------|
| CUDA tensor                                                  | Triton kernels, compiled          |
| CPU tensor and ``TRITON_INTERPRET=1`` set before import      | the same Triton kernels, interpreted |
| CPU tensor otherwise                                         | ``flashtile.cpu``: PyTorch, tiled  |

Nothing else in flashtile reads the environment. Under the interpreter, this module first installs
``flashtile._interpreter``'s fixes (the interpreter computes bf16 products and casts, and reads some masks, unlike a
GPU). It also holds the value-check switch: whether checks that need the *values* of index tensors
(``cache_seqlens``, ``block_table``, ``cu_seqlens``, ...) run (``values_checked``); see docs/validation.md.

Kernel families, fastest first (``forward_choice``, ``backward_choice``, ``decode_choice``):

- ``sm90-gluon``: ``ops.sm90.forward`` / ``ops.sm90.backward``, on an sm_90 GPU (``gluon_refusal``) for the calls
  that module's ``qualifies``;
- ``triton``: ``ops.attention``, compiled, for CUDA tensors;
- ``triton-fp8``: ``ops.fp8``, the forward of float8 inputs (``flashtile.float8``), compiled or interpreted, for the
  calls that module's ``qualifies``; float8 CPU tensors without the interpreter take the CPU path, which dequantizes
  them (no other family computes float8: on CUDA a refusal is an error);
- ``triton-interpreter``: ``ops.attention`` run by the Triton interpreter, for CPU tensors with TRITON_INTERPRET=1;
- ``cpu``: ``flashtile.cpu`` for other CPU tensors, which runs torch's fused kernel (``cpu-torch``) or its tiled
  algorithm (``cpu-tiled``) by ``cpu.torch_kernel_route``, per call (per sequence of a packed batch);
- decode (``flash_attn_with_kvcache``): ``split-kv`` (``ops.decode``, compiled or interpreted) or ``cpu-decode``.

Each condition that fails gives a reason (a ``Verdict``): ``flashtile.explain`` prints them for a call, and
``pass_paths`` gives (path, reason) per pass cheaply (what a profiler labels its records with). Each path module
provides ``attention_forward(q, k, v, options) -> (out, lse)`` and ``attention_backward(dout, q, k, v, out, lse,
options, dlse=None, dmask=None) -> (dq, dk, dv)`` (the sm_90 modules without dmask), and the portable ones
``attention_delta(dout, out, dlse)`` and ``varlen_attention_forward`` / ``varlen_attention_backward`` on packed
(total, nheads, headdim) batches; ``options`` is an ``options.AttentionOptions``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

from flashtile.errors import InputError
from flashtile.float8 import FLOAT8

if TYPE_CHECKING:
    from flashtile.options import AttentionOptions

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
    kind = device.type
    if kind == "cuda":
        return "triton"
    if kind == "cpu":
        return "triton-interpreter" if TRITON_INTERPRET else "cpu"
    raise InputError(
        f"flashtile runs on CUDA and CPU tensors, got a tensor on {device}. Move the inputs with .cuda() or .cpu()."
    )


RECORDING = None
"""The active ``flashtile.profile()`` (a ``flashtile.profiler.Profile``) or None: while set, the modules the dispatcher
hands out (``family_module``, ``path_module``) and the decoding step (``kvcache``) record each pass into it; None
costs one check per pass."""


@functools.cache
def imported(name: str) -> ModuleType:
    """The module ``name``, imported on the first call: for modules a per-call path needs but must not import at
    import time (the CPU path, the kernels' launchers, Gluon only on sm_90 GPUs); an import statement in a function
    runs the import system's lookup on every call (and ``importlib.import_module`` its checks: the module is looked
    up in ``sys.modules`` first)."""
    module = sys.modules.get(name)
    return importlib.import_module(name) if module is None else module


# ---------------------------------------------------------------------------------------------------
# Kernel families: which one runs each pass, and why the faster ones do not


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a kernel family serves a call: yes (no reasons; true), or every reason it does not (false)."""

    reasons: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return not self.reasons

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons) if self.reasons else "qualifies"


YES = Verdict()


def verdict(reasons: Iterable[str | None]) -> Verdict:
    """The Verdict of these conditions: each a reason the family does not apply, or None where it holds."""
    found = tuple(reason for reason in reasons if reason)
    return Verdict(found) if found else YES


SM90_GLUON = "sm90-gluon"
TRITON = "triton"
TRITON_FP8 = "triton-fp8"
NO_BACKWARD = "none"
FAMILY_MODULES = {
    (TRITON_FP8, "forward"): "flashtile.ops.fp8",
    (SM90_GLUON, "forward"): "flashtile.ops.sm90.forward",
    (SM90_GLUON, "backward"): "flashtile.ops.sm90.backward",
    (TRITON, "forward"): "flashtile.ops.attention",
    (TRITON, "backward"): "flashtile.ops.attention",
    ("triton-interpreter", "forward"): "flashtile.ops.attention",
    ("triton-interpreter", "backward"): "flashtile.ops.attention",
    ("cpu", "forward"): "flashtile.cpu",
    ("cpu", "backward"): "flashtile.cpu",
}
"""The module that runs each (family, pass): its ``attention_forward`` / ``attention_backward``."""


class Choice(NamedTuple):
    """The kernel family that runs a pass (``path``: a key of FAMILY_MODULES' families), and each faster family
    that does not apply with its Verdict (``passed_over``, fastest first)."""

    path: str
    passed_over: tuple[tuple[str, Verdict], ...]

    @property
    def reason(self) -> str:
        """Why this family runs: why each faster one does not apply."""
        if not self.passed_over:
            return "the fastest family for this device"
        return "; ".join(f"not {family}: {v.reason}" for family, v in self.passed_over)


def gluon_refusal(device: torch.device) -> str | None:
    """Why calls on ``device`` cannot take the sm_90 Gluon kernels (``ops.sm90``), or None where they may: switched
    on (``GLUON``) and an sm_90 GPU. Asked before anything of ``ops.sm90`` is imported, so other devices never import
    Gluon."""
    if not GLUON:
        return "switched off (FLASHTILE_GLUON=0)"
    if device.type != "cuda":
        return f"the device is {device.type}, not an sm_90 GPU"
    major, minor = imported("flashtile.ops.common.grid").compute_capability(device.index)
    if (major, minor) != (9, 0):
        return f"the GPU is sm_{major}{minor}, not sm_90"
    return None


def _choice(device: torch.device, sm90: Verdict) -> Choice:
    """The family of a pass on ``device`` given the sm_90 family's verdict: sm_90 if it qualifies, else the device's
    path, after the compiled Triton kernels on a CPU tensor."""
    if sm90:
        return Choice(SM90_GLUON, ())
    path = path_name(device)
    passed = ((SM90_GLUON, sm90),)
    if path != TRITON:
        passed += ((TRITON, Verdict((f"the device is {device.type}, not a CUDA GPU",))),)
    return Choice(path, passed)


def _sm90_verdict(pass_name: str, device: torch.device, every: bool, *args, **kwargs) -> Verdict:
    """The sm_90 family's verdict: the device's (``gluon_refusal``), then its module's ``qualifies(*args, **kwargs)``
    (with ``every``, even where the device refuses: every condition's reason)."""
    refusal = gluon_refusal(device)
    if refusal is not None and not every:
        return Verdict((refusal,))
    found = imported(FAMILY_MODULES[SM90_GLUON, pass_name]).qualifies(*args, **kwargs)
    return verdict((refusal, *found.reasons)) if refusal is not None else found


def forward_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, *,
                   varlen: bool = False, every: bool = False) -> Choice:  # fmt: skip
    """The family that runs the forward of attention(q, k, v, options) (packed q, k, v if ``varlen``). every: give
    every reason of the sm_90 family (for ``flashtile.explain``), not only the device's where that refuses."""
    if q.dtype in FLOAT8:
        return _float8_choice(q, k, v, options, varlen)
    sm90 = _sm90_verdict("forward", q.device, every, q, k, v, options, varlen=varlen)
    return _choice(q.device, sm90)


def _float8_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions,
                   varlen: bool) -> Choice:  # fmt: skip
    """The family of a float8 forward: the CPU path (which dequantizes) for CPU tensors without the interpreter,
    else ``ops.fp8`` where its ``qualifies``; raises InputError with its reasons where it does not."""
    if path_name(q.device) == "cpu":
        return Choice("cpu", ((TRITON_FP8, Verdict((f"the device is {q.device.type}, not a CUDA GPU",))),))
    found = imported(FAMILY_MODULES[TRITON_FP8, "forward"]).qualifies(q, k, v, options, varlen=varlen)
    if not found:
        raise InputError(
            f"float8 attention cannot run this call on {q.device}: {found.reason}. Dequantize the inputs to "
            "bfloat16 (x.to(torch.bfloat16) * x_descale) and call with those."
        )
    return Choice(TRITON_FP8, ())


def backward_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, options: AttentionOptions,
                    *, varlen: bool = False, every: bool = False) -> Choice:  # fmt: skip
    """The family that runs the backward (``forward_choice``'s, with the gradient ``dout`` of out); for float8 inputs
    NO_BACKWARD (their face refuses gradients: ``float8.check_float8``)."""
    if q.dtype in FLOAT8:
        return Choice(NO_BACKWARD, ((TRITON_FP8, Verdict(("float8 inputs have no backward (forward only)",))),))
    sm90 = _sm90_verdict("backward", q.device, every, q, k, v, dout, options, varlen=varlen)
    return _choice(q.device, sm90)


def family_module(choice: Choice, pass_name: str) -> ModuleType:
    """The module that runs ``pass_name`` ('forward' or 'backward') for ``choice`` (inside ``flashtile.profile()``,
    with its passes recorded under ``choice``)."""
    module = imported(FAMILY_MODULES[choice.path, pass_name])
    return module if RECORDING is None else RECORDING.attention_path(module, choice)


def path_module(device: torch.device) -> ModuleType:
    """The portable path's module for ``device`` (``ops.attention`` or ``cpu``): the varlen passes and the delta
    (inside ``flashtile.profile()``, with its passes recorded)."""
    module = imported(FAMILY_MODULES[path_name(device), "forward"])
    return module if RECORDING is None else RECORDING.attention_path(module)


def decode_choice(device: torch.device) -> Choice:
    """The family of ``flash_attn_with_kvcache``: the split-KV Triton kernel (``ops.decode``, compiled or
    interpreted) or the CPU path's (``cpu_decode``)."""
    return _CPU_DECODE if path_name(device) == "cpu" else _SPLIT_KV


_SPLIT_KV = Choice("split-kv", ())
_CPU_DECODE = Choice("cpu-decode", (("split-kv", Verdict(("the device is cpu, not a CUDA GPU",))),))


DECODE_MODULES = {"split-kv": "flashtile.ops.decode", "cpu-decode": "flashtile.cpu_decode"}


def resolved(choice: Choice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions,
             varlen: bool = False) -> Choice:  # fmt: skip
    """``choice`` with the CPU path resolved to its route: 'cpu-torch' (torch's fused kernel) or 'cpu-tiled', by
    ``cpu.torch_kernel_route`` (a call with no gradient at the LSE or the mask). A packed batch stays 'cpu': it takes
    the route per sequence."""
    if choice.path != "cpu" or varlen:
        return choice
    route, found = imported("flashtile.cpu").torch_kernel_route(q, k, v, options)
    if route is not None:
        return Choice("cpu-torch", choice.passed_over)
    return Choice("cpu-tiled", (*choice.passed_over, ("cpu-torch", found)))


def pass_paths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, *,
               dout: torch.Tensor | None = None, varlen: bool = False) -> dict[str, tuple[str, str]]:  # fmt: skip
    """(path, reason) of the forward and the backward of attention(q, k, v, options), as the dispatcher decides them
    (``forward_choice``, ``backward_choice``; the CPU path's route by ``resolved``): what a profiler labels each pass
    with. dout: the gradient of out (default: a contiguous one, as autograd gives). Launches nothing."""
    choices = pass_choices(q, k, v, options, dout=dout, varlen=varlen)
    return {pass_name: (choice.path, choice.reason) for pass_name, choice in choices.items()}


def pass_choices(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, *, dout: torch.Tensor | None = None,
    varlen: bool = False, every: bool = False,
) -> dict[str, Choice]:  # fmt: skip
    """``pass_paths``' Choices: {'forward': ..., 'backward': ...} (every: every reason of the sm_90 family)."""
    if dout is None:
        dout = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device="meta")
    forward = forward_choice(q, k, v, options, varlen=varlen, every=every)
    backward = backward_choice(q, k, v, dout, options, varlen=varlen, every=every)
    return {name: resolved(choice, q, k, v, options, varlen) for name, choice in (("forward", forward),
                                                                                  ("backward", backward))}  # fmt: skip
