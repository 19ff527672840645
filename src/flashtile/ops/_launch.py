"""Launches of the Triton kernels past Triton's per-call binding.

``kernel[grid](*args, **constexprs)`` goes through ``JITFunction.run``, which on every call binds the arguments,
specializes each one (``native_specialize_impl``: a tensor's dtype and 16-byte alignment; an int's width, whether
it is 1 and whether it is a multiple of 16; a descriptor's dtype and block), builds the cache key from that and the
options, and checks the kernel's globals: 17 of the 60 µs of a D=64 causal forward's host time on the CPU
(``benchmarks/latency.py --host-overhead``), against 1.6 µs for launching the compiled kernel directly. ``launch``
sends the first launch of a ``specialization_key`` through ``JITFunction.run`` (compiling, or loading from Triton's
cache) and keeps the compiled kernel it returns; later launches with that key hand the compiled kernel the same
arguments directly: to Triton's launcher (``compiled.run``) on the current stream while no launch hook is registered
(``run_compiled``), else through ``compiled[grid](*args)``, which also calls the hooks.

The key is finer than Triton's specialization, never coarser: every int by value (Triton looks at its class), so
arguments with equal keys specialize equally (tests/test_launch.py compares keys with the binder's specialization on
Triton 3.6 and 3.7). The Gluon kernels come through ``launch_keyed`` with a coarser key
(``sm90.common.launch_key``: their ints are not specialized, so one compile, and one entry here, serves every
length). The decode launcher keeps ``keyed_for``'s constexpr tail and key per input layout (``split_kv.DecodePlan``)
and hands them to ``launch``. What the direct launches skip: the check that the kernel's globals kept their values
since it compiled, ``JITFunction``'s pre-run hooks, and options read from the environment (``TRITON_DEBUG``) changing
after a key's first launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile import _interpreter

MAX_KEYS = 1024
"""Keys kept before ``_COMPILED`` starts over (ints are keyed by value, so each new shape adds one): a key then
launches through the binder once more, which finds its kernel in Triton's own cache."""

_COMPILED: dict[tuple, tuple[JITFunction, object]] = {}
"""The kernels ``launch`` has seen and their compiled kernels, by their key (``specialization_key`` or the one
``launch`` was given). A key names its kernel by ``id``: hashing a JITFunction runs its ``cache_key`` property under a
lock (~6k instructions per lookup on the development CPU, as much as the rest of a Gluon launch's lookup); the entry
holds the kernel itself, so its id is not reused while the key is kept."""


def _arg_key(a) -> object:
    """The key of a launch argument other than an int or None (``specialization_key``)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, TensorDescriptor):
        return a.base.dtype, tuple(a.block_shape), a.padding
    if type(a) in (float, bool):  # a float compiles as fp32 and a bool as u1 whatever the value
        return type(a)
    raise TypeError(f"no specialization key for a launch argument of type {type(a).__name__}")


def specialization_key(kernel: JITFunction, args: tuple, constexprs: list, options: dict) -> tuple:
    """A key that determines what Triton compiles ``kernel`` for: the kernel (its ``id``, ``_COMPILED``), the current
    device, the options (num_warps, num_stages), the constexprs in parameter order, then per argument its int value,
    None, a tensor's dtype and 16-byte alignment, a descriptor's dtype, block and padding, or the type of a float or
    bool."""
    return (
        id(kernel), torch.cuda.current_device(), *options.items(), *constexprs,
        *[a if type(a) is int or a is None else _arg_key(a) for a in args],
    )  # fmt: skip


def _hooks_idle() -> bool:
    """Whether no launch hook is registered with Triton (``knobs.runtime.launch_enter_hook`` and ``_exit_hook``, each
    a chain of hooks; a hook that is not a chain counts as registered)."""
    enter, exit_hook = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return not getattr(enter, "calls", True) and not getattr(exit_hook, "calls", True)


def run_compiled(compiled, grid: tuple[int, int, int], args: list | tuple) -> None:
    """``compiled[grid](*args)`` for a compiled kernel on the current device and stream. ``compiled[grid]`` makes a
    closure, and its call the launch metadata that Triton's launcher hands the launch hooks (a dict of the kernel's
    name, function and stream) and then calls the hook chains, empty or not: 1.5-2 µs per launch on the development
    CPU. While no hook is registered (``_hooks_idle``) this calls the launcher (``compiled.run``, whose arguments
    Triton 3.6 and 3.7 share: grid, stream, function, packed metadata, launch metadata and the two hooks, the
    kernel's arguments) directly, with no metadata and no hooks; else through ``compiled[grid]``."""
    if not _hooks_idle():
        compiled[grid](*args)
        return
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)


def launch(kernel, grid: tuple[int, int, int], args: tuple, constexprs: dict, keyed=None, **options) -> None:
    """``kernel[grid](*args, **constexprs, **options)`` on the current device and stream: ``args`` are the kernel's
    leading parameters in order, ``constexprs`` name all the rest, ``options`` are Triton's (num_warps, num_stages).
    Through ``JITFunction.run`` on the first launch of a ``specialization_key``, directly after it (``launch_keyed``).
    ``keyed``: ``keyed_for(kernel, args, constexprs, options)``, kept by a caller for arguments it knows to key alike
    (``split_kv.DecodePlan``); computed here when None. A kernel that is not a compiled ``JITFunction`` (the
    interpreter's, under TRITON_INTERPRET=1, or a stand-in) is called as it is, whatever ``keyed`` holds, once
    ``_interpreter.check_launch`` has let its arguments through."""
    if not isinstance(kernel, JITFunction):
        _interpreter.check_launch(args)
        kernel[grid](*args, **constexprs, **options)
        return
    launch_keyed(kernel, grid, args, constexprs, *(keyed or keyed_for(kernel, args, constexprs, options)), options)


def keyed_for(kernel, args: tuple, constexprs: dict, options: dict) -> tuple[list, tuple] | None:
    """``launch``'s ``keyed`` for these arguments: the constexprs' values in parameter order (``constexpr_tail``) and
    the ``specialization_key``; None for a kernel that ``launch`` calls as it is (not a compiled ``JITFunction``)."""
    if not isinstance(kernel, JITFunction):
        return None
    tail = constexpr_tail(kernel, args, constexprs)
    return tail, specialization_key(kernel, args, tail, options)


def constexpr_tail(kernel: JITFunction, args: tuple, constexprs: dict) -> list:
    """The values of ``constexprs`` in the order of the kernel's parameters after ``args``."""
    return [constexprs[name] for name in kernel.arg_names[len(args) :]]


def launch_keyed(
    kernel: JITFunction, grid: tuple[int, int, int], args: tuple, constexprs: dict, tail: list, launch_key: tuple,
    options: dict,
) -> None:  # fmt: skip
    """``launch`` past its key: ``tail`` is ``constexpr_tail(kernel, args, constexprs)`` and ``launch_key`` the key of
    these arguments, both computed by the caller (which may keep them for arguments it knows to key alike)."""
    entry = _COMPILED.get(launch_key)
    if entry is None:
        if len(_COMPILED) >= MAX_KEYS:
            _COMPILED.clear()
        _COMPILED[launch_key] = kernel, kernel[grid](*args, **constexprs, **options)
        return
    run_compiled(entry[1], grid, (*args, *tail))


MAX_PLANS = 256
"""Plans a ``Plans`` keeps before it starts over (a new shape adds one)."""

_UNPLANNED = object()


class Plans(dict):
    """A launcher's plans by key: what its launches follow from their inputs' layouts (grid, descriptor templates,
    constexprs, the launch key), made on a key's first call and kept (at most MAX_PLANS), so that later calls of
    the key build nothing but their descriptors and arguments."""

    def plan(self, key: tuple, make: Callable[..., tuple[object, bool]], *args) -> object:
        """The plan kept under ``key``, else ``make(*args)``'s (plan, keep), kept if keep."""
        plan = self.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            plan, keep = make(*args)
            if keep:
                if len(self) >= MAX_PLANS:
                    self.clear()
                self[key] = plan
        return plan
