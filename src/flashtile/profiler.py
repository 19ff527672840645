"""``flashtile.profile()``: every flashtile kernel pass inside a ``with`` block, timed and set against its model.

Recording hooks in where the passes are launched: the modules the dispatcher hands out (``_backend.family_module``
and ``path_module``: the forwards and, through autograd, the backwards of ``flash_attn_func`` and friends, the varlen
functions, SDPA and ring attention's steps) and the decode path of ``flash_attn_with_kvcache``
(``_ops._decode``) hand their functions to the active ``Profile`` while ``_backend.RECORDING`` is set;
outside a ``profile()`` block it is None, and those checks of it are all that recording costs: no hooks, no events,
no synchronisation. Each record's path and reason are the dispatcher's (``_backend.Choice``).

Per pass: CUDA events on the tensors' stream around it (read when the records are: no synchronisation per call), or
the wall time on the CPU; FLOPs and HBM bytes from ``flashtile.iomodel`` for the kernels that run, and the bytes
standard attention would move on the same problem. Index tensors whose values the model needs (cu_seqlens,
cache_seqlens) are copied to the host without blocking and read with the times.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from flashtile import _backend, iomodel

PASS_FUNCTIONS = {
    "attention_forward": ("attention", "fwd"),
    "attention_backward": ("attention", "bwd"),
    "varlen_attention_forward": ("varlen_attention", "fwd"),
    "varlen_attention_backward": ("varlen_attention", "bwd"),
}
"""The functions of an attention path module that are kernel passes: name -> (op, pass)."""
PASS_NAMES = {"fwd": "forward", "bwd": "backward"}
"""The dispatcher's name of each pass."""

PEAKS = (
    ("GH200", 989.0, 4000.0),
    ("H200 NVL", 836.0, 4800.0),
    ("H200", 989.0, 4800.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100", 989.0, 3350.0),
    ("B200", 2250.0, 8000.0),
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100 80GB PCIe", 312.0, 1935.0),
    ("A100-SXM4-40GB", 312.0, 1555.0),
    ("A100-PCIE-40GB", 312.0, 1555.0),
    ("L40S", 362.0, 864.0),
    ("L40", 181.0, 864.0),
    ("L4", 121.0, 300.0),
    ("A10G", 70.0, 600.0),
    ("A10", 125.0, 600.0),
)
"""(part of the device name, dense bf16/fp16 tensor-core TFLOP/s, HBM GB/s) from the vendors' data sheets, the
first match wins (so more specific names come first). fraction_of_peak is None on a GPU not listed, for float32
and on the CPU."""

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@functools.cache
def device_peak(name: str) -> tuple[float, float] | None:
    """(peak dense bf16/fp16 TFLOP/s, peak HBM GB/s) of the GPU called ``name`` (``torch.cuda.get_device_name``), or
    None where ``PEAKS`` does not know it."""
    for part, tflops, gbps in PEAKS:
        if part in name:
            return tflops, gbps
    return None


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` copied to the host in stream order without blocking (pinned memory): read after the pass's end event."""
    if t is None:
        return None
    return t.to("cpu", non_blocking=True) if t.device.type == "cuda" else t.clone()


# ------------------------------------------------------------------------------------------ which kernels run


def _kernel_path(op: str, pass_: str, a: dict[str, Any], choice: _backend.Choice | None) -> tuple[str, str]:
    """(path, reason) of this pass: the dispatcher's ``choice`` (``flashtile._backend``: the family that runs and why
    each faster one does not apply), the CPU path resolved to its route (torch's fused kernel or the tiled one);
    where the module was handed out without one (a packed batch's passes), the dispatcher's answer for them."""
    if op == "kvcache":
        return choice.path, choice.reason
    q, k, v, options = a["q"], a["k"], a["v"], a["options"]
    if choice is None:
        return _backend.pass_paths(q, k, v, options, dout=a.get("dout"), varlen=True)[PASS_NAMES[pass_]]
    resolved = _backend.resolved(choice, q, k, v, options, varlen=op == "varlen_attention")
    return resolved.path, resolved.reason


# -------------------------------------------------------------------------------------------------- records


def _problem(a: dict[str, Any], batch: int, seqlen_q: int, seqlen_k: int) -> iomodel.Problem:
    q, k, v, mask = a["q"], a["k"], a["v"], a.get("attn_mask")
    return iomodel.Problem(
        batch, seqlen_q, seqlen_k, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], q.element_size(),
        a["window_left"], a["window_right"], 0 if mask is None else mask.element_size(),
    )  # fmt: skip


def _options(a: dict[str, Any]) -> dict[str, Any]:
    """The options a record lists: causal, window, softcap, alibi, sink, dropout, mask, deterministic, paged."""
    left, right = a["window_left"], a["window_right"]
    mask = a.get("attn_mask")
    return {
        "causal": left is None and right == 0,
        "window": None if left is None and right in (None, 0) else [left, right],
        "softcap": a.get("softcap", 0.0),
        "alibi": a.get("alibi_slopes") is not None,
        "sink": a.get("learnable_sink") is not None,
        "dropout": a.get("dropout_p", 0.0),
        "mask": None if mask is None else DTYPE_NAMES.get(mask.dtype, str(mask.dtype).removeprefix("torch.")),
        "deterministic": a.get("deterministic"),
        "paged": a.get("block_table") is not None,
    }


Model = Callable[[], tuple[float, float, float, float]]
"""Computes (flops, hbm_bytes, min_hbm_bytes, standard_bytes) of a pass once its host copies are readable."""


def _attention_model(op: str, pass_: str, a: dict[str, Any], dq_atomic: bool) -> tuple[dict[str, Any], Model]:
    """The record's shape and the model of one attention pass (dense or packed); ``dq_atomic``: the backward that
    runs is the sm_90 Gluon kernel's (dQ through an fp32 accumulator)."""
    q, k, v = a["q"], a["k"], a["v"]
    heads = {"H": q.shape[-2], "Hk": k.shape[-2], "D": q.shape[-1], "Dv": v.shape[-1]}
    if op == "attention":
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        shape = {"B": batch, "Sq": seqlen_q, "Sk": seqlen_k, **heads}
        problems = [_problem(a, batch, seqlen_q, seqlen_k)]

        def sequences() -> list[iomodel.Problem]:
            return problems

    else:
        cu_q, cu_k = _host(a["cu_seqlens_q"]), _host(a["cu_seqlens_k"])
        shape = {"batch": a["cu_seqlens_q"].shape[0] - 1, "total_q": q.shape[0], "total_k": k.shape[0],
                 "max_seqlen_q": a["max_seqlen_q"], "max_seqlen_k": a["max_seqlen_k"], **heads}  # fmt: skip
        if a.get("block_table") is not None:  # k and v are pages: (num_blocks, page_block_size, Hk, D)
            shape.update(total_k=None, num_blocks=k.shape[0], page_block_size=k.shape[1])

        def sequences() -> list[iomodel.Problem]:
            lengths_q, lengths_k = cu_q.diff().tolist(), cu_k.diff().tolist()
            return [_problem(a, 1, sq, sk) for sq, sk in zip(lengths_q, lengths_k, strict=True)]

    def model() -> tuple[float, float, float, float]:
        found = sequences()
        flops = iomodel.total(found, "flops", pass_)
        moved = iomodel.total(found, "hbm_bytes", pass_, dq_atomic)
        floor = iomodel.total(found, "compulsory_bytes", pass_)
        return flops, moved, floor, iomodel.total(found, "standard_bytes", pass_)

    return shape, model


def _decode_model(a: dict[str, Any]) -> tuple[dict[str, Any], Model]:
    """The record's shape and the model of one decoding step with a KV cache."""
    q, k_cache, v_cache, k, table = a["q"], a["k_cache"], a["v_cache"], a["k"], a["block_table"]
    batch, seqlen_q = q.shape[0], q.shape[1]
    seqlen_cache = k_cache.shape[1] * (1 if table is None else table.shape[1])
    seqlen_new = 0 if k is None else k.shape[1]
    shape = {"B": batch, "Sq": seqlen_q, "seqlen_cache": seqlen_cache, "seqlen_new": seqlen_new,
             "H": q.shape[2], "Hk": k_cache.shape[2], "D": q.shape[3], "Dv": v_cache.shape[3]}  # fmt: skip
    cache_seqlens, leftpad = _host(a["cache_seqlens"]), _host(a["cache_leftpad"])
    one = iomodel.Problem(1, seqlen_q, seqlen_cache, shape["H"], shape["Hk"], shape["D"], shape["Dv"], q.element_size(),
                          a["window_left"], a["window_right"])  # fmt: skip

    def model() -> tuple[float, float, float, float]:
        lengths = [seqlen_cache] * batch if cache_seqlens is None else [n + seqlen_new for n in cache_seqlens.tolist()]
        if leftpad is not None:
            lengths = [n - pad for n, pad in zip(lengths, leftpad.tolist(), strict=True)]
        found = [dataclasses.replace(one, seqlen_k=n) for n in lengths]
        moved = iomodel.total(found, "decode_bytes", seqlen_new)  # each byte once: the floor too
        return iomodel.total(found, "flops", "fwd"), moved, moved, iomodel.total(found, "standard_bytes", "fwd")

    return shape, model


@dataclasses.dataclass
class _Pending:
    """A pass recorded but not yet read: its record without the measured values, its timing and its model."""

    record: dict[str, Any]
    model: Model
    device: torch.device
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    wall_ms: float | None = None

    def resolve(self) -> dict[str, Any]:
        """The finished record: waits for the pass's end event (CUDA), computes the model and the rates."""
        ms = self.wall_ms
        if self.events is not None:
            start, end = self.events
            end.synchronize()
            ms = start.elapsed_time(end)
        flops, moved, floor, standard = self.model()
        rec = self.record
        rec.update(flops=flops, hbm_bytes=moved, min_hbm_bytes=floor, standard_bytes=standard, time_ms=ms)
        measured = ms is not None and ms > 0
        rec["tflops"] = flops / ms * 1e-9 if measured else None
        rec["gbps"] = moved / ms * 1e-6 if measured else None
        peak = device_peak(_device_name(self.device)) if self.device.type == "cuda" else None
        rec["fraction_of_peak"] = rec["bound"] = None
        if peak is not None and measured and rec["dtype"] in ("bf16", "fp16"):
            compute, memory = rec["tflops"] / peak[0], rec["gbps"] / peak[1]
            rec["fraction_of_peak"] = max(compute, memory)
            rec["bound"] = "compute" if compute >= memory else "memory"
        return rec


class Profile:
    """What ``flashtile.profile()`` returns: the records of the flashtile passes run inside its ``with`` block (their
    keys: ``profile``'s docstring). Reading ``records`` waits for the passes recorded so far to finish."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._done: list[dict[str, Any]] = []
        self._outer: Profile | None = None

    def __enter__(self) -> Profile:
        self._outer = _backend.RECORDING
        _backend.RECORDING = self
        return self

    def __exit__(self, *exc: object) -> None:
        _backend.RECORDING = self._outer
        self._resolve()

    # ----------------------------------------------------------------------------------- recording

    def attention_path(self, module: ModuleType, choice: _backend.Choice | None = None) -> _RecordedPath:
        """``module`` (the module of a kernel family: ``flashtile.cpu``, ``flashtile.ops.attention``,
        ``flashtile.ops.sm90.*``) with its passes recorded into this profile under the dispatcher's ``choice``."""
        return _RecordedPath(self, module, choice)

    def decode(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], choice: _backend.Choice) -> Callable:
        """``fn`` (a ``kvcache_forward`` implementation) with each call recorded into this profile."""
        return functools.partial(self.run, "kvcache", "fwd", fn, choice)

    def run(
        self, op: str, pass_: str, fn: Callable[..., Any], choice: _backend.Choice | None, *args: Any, **kwargs: Any
    ) -> Any:
        """Call ``fn(*args, **kwargs)``, one pass of ``op`` run by the family ``choice``, and record it: its timing
        now, its model later."""
        bound = _signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        # the fields of the pass's options (and of a packed batch's packing, a decoding call's cache) by name
        for name in ("options", "packing", "cache"):
            if name in a:
                a = {**a, **{f.name: getattr(a[name], f.name) for f in dataclasses.fields(a[name])}}
        device = a["q"].device
        path, reason = _kernel_path(op, pass_, a, choice)
        if op == "kvcache":
            shape, model = _decode_model(a)
        else:
            shape, model = _attention_model(op, pass_, a, dq_atomic=path == _backend.SM90_GLUON)
        record = {"op": op, "pass": pass_, "path": path, "reason": reason, "shape": shape,
                  "dtype": DTYPE_NAMES.get(a["q"].dtype, str(a["q"].dtype)), "device": str(device),
                  **_options(a)}  # fmt: skip
        pending = _Pending(record, model, device)
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            result = fn(*args, **kwargs)
            end.record(stream)
            pending.events = (start, end)
        elif device.type == "cuda":  # capturing a CUDA graph: events would time the capture, not a replay
            result = fn(*args, **kwargs)
        else:
            begin = time.perf_counter()
            result = fn(*args, **kwargs)
            pending.wall_ms = (time.perf_counter() - begin) * 1e3
        self._pending.append(pending)
        return result

    # ------------------------------------------------------------------------------------- reading

    def _resolve(self) -> None:
        self._done += [p.resolve() for p in self._pending]
        self._pending.clear()

    @property
    def records(self) -> list[dict[str, Any]]:
        """One dict per pass recorded so far (see the class's docstring for the keys)."""
        self._resolve()
        return self._done

    def table(self, console: Any = None) -> None:
        """Print the records as a rich table (to ``console``, a ``rich.console.Console``; default: a new one on
        stdout): one row per pass and a total, then each distinct reason for the paths taken."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        records = self.records
        table = Table(title="flashtile.profile(): bytes from the model (flashtile.iomodel)", show_edge=False,
                      pad_edge=False)  # fmt: skip
        for name in ("pass", "path", "shape", "GFLOP", "MB (standard)", "ms", "TFLOP/s", "GB/s", "of peak"):
            table.add_column(name, justify="left" if name in ("pass", "path", "shape") else "right")
        for rec in records:
            table.add_row(
                f"{rec['op']} {rec['pass']}", rec["path"], _shape_text(rec), f"{rec['flops'] / 1e9:.3g}",
                _megabytes(rec["hbm_bytes"], rec["standard_bytes"]), _number(rec["time_ms"], 3),
                _number(rec["tflops"], 1), _number(rec["gbps"], 0), _percent(rec["fraction_of_peak"]),
            )  # fmt: skip
        if records:
            times = [r["time_ms"] for r in records]
            table.add_section()
            table.add_row(
                "total", "", "", f"{sum(r['flops'] for r in records) / 1e9:.3g}",
                _megabytes(sum(r["hbm_bytes"] for r in records), sum(r["standard_bytes"] for r in records)),
                _number(None if None in times else sum(times), 3), "", "", "",
            )  # fmt: skip
        console.print(table)
        for reason in dict.fromkeys(f"{r['path']}: {r['reason']}" for r in records):
            console.print(reason, markup=False, highlight=False)

    def to_json(self, path: str | Path) -> None:
        """Write the records to ``path`` as a JSON list (one object per pass, the keys of ``records``)."""
        Path(path).write_text(json.dumps(self.records, indent=1, allow_nan=False) + "\n")


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _megabytes(moved: float, standard: float) -> str:
    """'1.42 (3.9)': MB flashtile moves, and standard attention would."""
    return f"{moved / 1e6:.3g} ({standard / 1e6:.3g})"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _shape_text(rec: dict[str, Any]) -> str:
    """'bf16 B2 Sq128 Sk128 H4:2 D64' and the options that are on ('causal', 'window', 'mask', ...)."""
    s = rec["shape"]
    heads = f"H{s['H']}" + (f":{s['Hk']}" if s["Hk"] != s["H"] else "") + f" D{s['D']}"
    if rec["op"] == "attention":
        text = f"B{s['B']} Sq{s['Sq']} Sk{s['Sk']} {heads}"
    elif rec["op"] == "varlen_attention":
        text = f"{s['batch']} seqs, {s['total_q']}/{s['total_k']} tokens {heads}"
    else:
        text = f"B{s['B']} Sq{s['Sq']} cache{s['seqlen_cache']} {heads}"
    flags = [name for name in ("causal", "alibi", "sink", "paged") if rec[name]]
    flags += [f"{name}={rec[name]}" for name in ("window", "mask") if rec[name]]
    flags += [f"{name}={rec[name]:g}" for name in ("softcap", "dropout") if rec[name]]
    return " ".join([rec["dtype"], text, *flags])


class _RecordedPath:
    """An attention path module whose kernel passes (``PASS_FUNCTIONS``) record into a profile."""

    def __init__(self, profile: Profile, module: ModuleType, choice: _backend.Choice | None) -> None:
        self._profile = profile
        self._module = module
        self._choice = choice

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._module, name)
        if name not in PASS_FUNCTIONS:
            return fn
        return functools.partial(self._profile.run, *PASS_FUNCTIONS[name], fn, self._choice)


def profile() -> Profile:
    """Record every flashtile kernel pass run inside a ``with`` block: its path, FLOPs, HBM bytes and time::

        with flashtile.profile() as prof:
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            out.backward(dout)
        prof.table()                 # one row per pass: path, shape, GFLOP, MB moved vs standard, ms, TFLOP/s
        prof.records[0]["hbm_bytes"]
        prof.to_json("profile.json")

    Recorded: the forwards of ``flash_attn_func`` and its packed and varlen forms, SDPA and ring attention's steps,
    their backwards when autograd runs them inside the block, and ``flash_attn_with_kvcache``, also under
    torch.compile (the passes are custom ops). Times come from CUDA events around each pass, read when ``records``
    (or ``table``, ``to_json``, the block's end) asks, so the passes run without synchronisation; on the CPU they
    are wall times. Bytes and FLOPs are ``flashtile.iomodel``'s model of the kernels that run, not a
    measurement (docs/profiling.md says what it assumes).

    Each record is a dict: ``op`` ('attention', 'varlen_attention', 'kvcache'), ``pass`` ('fwd', 'bwd'), ``path``
    ('sm90-gluon', 'triton', 'triton-interpreter', 'cpu-torch', 'cpu-tiled', 'cpu' for packed batches,
    'split-kv', 'cpu-decode'), ``reason`` (why that path, and why a faster one did not
    run), ``shape`` (dict: B, Sq, Sk, H, Hk, D, Dv, or the packed or cache sizes), ``dtype`` ('bf16', 'fp16',
    'fp32'), ``device``, ``flops`` (float: 4 * D per visible (query, key) pair and head forward, 2.5 x that
    backward), ``hbm_bytes`` (float: the model, K/V reuse through the L2), ``min_hbm_bytes`` (each tensor once),
    ``standard_bytes`` (standard attention's, S and P in HBM), ``time_ms`` (float, or None inside a CUDA graph
    capture), ``tflops``, ``gbps``, ``fraction_of_peak`` and ``bound`` (of the GPU's dense bf16/fp16 TFLOP/s or HBM
    GB/s, whichever is nearer, 'compute' or 'memory'; None for float32, the CPU or a GPU not in
    ``flashtile.profiler.PEAKS``), and the options ``causal``, ``window``, ``softcap``, ``alibi``, ``sink``,
    ``dropout``, ``mask``, ``deterministic``, ``paged``.

    Outside the block recording costs one check of a module variable per pass. The block holds for the whole
    process, not one thread; nested blocks record into the innermost. Raises nothing itself; errors of the calls
    inside propagate (a failed pass is not recorded).

    Returns:
        a ``Profile`` (the ``with`` target) with ``records`` (list of dicts, in launch order),
        ``table(console=None)`` (prints a rich table to ``console`` or stdout) and ``to_json(path)`` (writes the
        records as a JSON list)
    """
    return Profile()
