"""The one record format of every flashtile benchmark: JSON lines, one measurement per line.

Every benchmark (``flashtile bench`` and the scripts in the repository's ``benchmarks/``) writes records
with these fields, in this order:

=================  ===================================================================================
``benchmark``      what was measured: ``attention``, ``attention-memory``, ``attention-variants``,
                   ``decode``, ``varlen``, ``ring``, ``latency``, ``first-call``, ``io`` (HBM bytes),
                   ``max-context`` (the longest sequence that fits)
``date``           when the run started, ISO 8601 in UTC
``gpu``            the device's name (``NVIDIA H200``), ``cpu`` for a run on the CPU
``gpus``           how many devices the measurement used
``driver``         NVIDIA driver version; ``cuda``, ``torch``, ``triton``, ``cudnn``: the versions in use
``commit``         flashtile's git commit (``--commit`` sets it where the code is not a git checkout)
``implementation`` ``flashtile`` or a peer: ``sdpa_flash`` (FlashAttention-2 in PyTorch), ``cudnn``,
                   ``sdpa_efficient``, ``sdpa`` (PyTorch's own choice), ``flex`` (FlexAttention),
                   ``fa4`` (FlashAttention-4), ``flashtile_builtin`` (flashtile's own options where the
                   row is written as flex_attention's mods), ...
``version``        that implementation's version (for PyTorch's kernels: torch's)
``shape``          the problem, e.g. ``{"dtype": "bf16", "B": 4, "N": 4096, "H": 16, "D": 128, "causal": true}``
``config``         how it ran beyond the shape (options, launch mode); ``{}`` for the plain case
``pass``           ``fwd``, ``bwd``, ``fwd+bwd`` or ``decode``
``time_ms``        median time in milliseconds
``tflops``         10^12 FLOP/s, where FLOPs are counted (the convention is in each benchmark's help)
``tbps``           bandwidth in TB/s, where bytes are counted
``memory_mib``     peak memory in MiB, where measured
``error``          why there is no measurement (``null`` when there is one)
``extra``          details of one benchmark: accuracy checks, split counts, host time, ...
=================  ===================================================================================

``python -m flashtile.bench.plot FILE.jsonl`` draws every plot from such files; :func:`table` turns records
into the tables of the documentation.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import flashtile

Record = dict[str, Any]

FIELDS = (
    "benchmark", "date", "gpu", "gpus", "driver", "cuda", "torch", "triton", "cudnn", "commit", "implementation",
    "version", "shape", "config", "pass", "time_ms", "tflops", "tbps", "memory_mib", "error", "extra",
)  # fmt: skip
ENVIRONMENT = ("date", "gpu", "gpus", "driver", "cuda", "torch", "triton", "cudnn", "commit")
"""The fields every record of one run shares."""

OURS = "flashtile"
LABELS = {
    "flashtile": "flashtile",
    "sdpa_flash": "FA2 (SDPA flash)",
    "cudnn": "cuDNN",
    "sdpa_efficient": "SDPA efficient",
    "sdpa": "SDPA",
    "flex": "FlexAttention",
    "flashtile_builtin": "flashtile built-in",
    "flashtile_generated": "flashtile generated",
    "fa4": "FA4",
}
"""How tables and plots name each implementation."""


def label(implementation: str) -> str:
    """The display name of an implementation: 'FA2 (SDPA flash)' for 'sdpa_flash'."""
    return LABELS.get(implementation, implementation)


# ----------------------------------------------------------------------------------- environment


def _distribution_version(name: str) -> str | None:
    """An installed distribution's version; None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi`` (a read-only query); None where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def _cudnn_version() -> str | None:
    """'9.19.0' from torch's integer 91900; None without cuDNN."""
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return None if v is None else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def git_commit(path: Path | None = None) -> str | None:
    """The short git commit of the checkout holding ``path`` (default: this file), with '+dirty' when it has
    uncommitted changes; None outside a git checkout (an installed wheel)."""
    where = (path or Path(__file__)).resolve().parent
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=where, capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()  # fmt: skip

        top = Path(git("rev-parse", "--show-toplevel"))
        if not (top / "src" / "flashtile").is_dir():  # some other repository around an installed flashtile
            return None
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device, commit: str | None = None, gpus: int = 1) -> Record:
    """The shared fields of one run's records (date, device, versions and commit), and the versions of flashtile
    and flash-attn-4 that ``implementation_version`` reads."""
    on_gpu = device.type == "cuda"
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "gpus": gpus,
        "driver": _driver_version() if on_gpu else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _distribution_version("triton"),
        "cudnn": _cudnn_version() if on_gpu else None,
        "commit": commit or git_commit(),
        "flashtile": flashtile.__version__,
        "flash_attn_4": _distribution_version("flash-attn-4"),
    }


def implementation_version(implementation: str, env: Record) -> str | None:
    """The version of an implementation in the environment ``env``: flashtile's for flashtile, flash-attn-4's
    for fa4, torch's for PyTorch's kernels (SDPA's backends, FlexAttention, a gather)."""
    if implementation == OURS:
        return env.get("flashtile")
    if implementation == "fa4":
        return env.get("flash_attn_4")
    return env.get("torch")


# ----------------------------------------------------------------------------------- records


def record(
    env: Record,
    benchmark: str,
    implementation: str,
    shape: dict[str, Any],
    pass_: str,
    *,
    config: dict[str, Any] | None = None,
    time_ms: float | None = None,
    flops: float | None = None,
    nbytes: float | None = None,
    memory_mib: float | None = None,
    error: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Record:
    """One record, every field present: TFLOP/s from ``flops`` and TB/s from ``nbytes`` when a time is given."""
    measured = time_ms is not None and time_ms > 0
    values = {
        **{name: env.get(name) for name in ENVIRONMENT},
        "benchmark": benchmark,
        "implementation": implementation,
        "version": implementation_version(implementation, env),
        "shape": shape,
        "config": config or {},
        "pass": pass_,
        "time_ms": time_ms,
        "tflops": flops / time_ms * 1e-9 if measured and flops is not None else None,
        "tbps": nbytes / time_ms * 1e-9 if measured and nbytes is not None else None,
        "memory_mib": memory_mib,
        "error": error,
        "extra": extra or {},
    }
    return {name: values[name] for name in FIELDS}


def write(path: Path, records: Iterable[Record]) -> None:
    """(Re)write ``path`` as JSON lines, atomically: a run stopped midway leaves a readable file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
    os.replace(tmp, path)


def load(*paths: Path) -> list[Record]:
    """Every record of the JSON-lines files ``paths``, in order."""
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


# ----------------------------------------------------------------------------------- tables


def _cell(value: Any) -> str:
    """A key's value in a table: 'yes'/'no' for flags, '1024, 0' for pairs, the value otherwise."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return "-" if value is None else str(value)


def _number(value: float | None, digits: int) -> str:
    """'512' (digits 0) or '0.139' (digits 3); '-' where missing."""
    return "-" if value is None else f"{value:.{digits}f}"


def table(
    records: Sequence[Record],
    keys: Sequence[str],
    value: str = "tflops",
    implementations: Sequence[str] | None = None,
    ratios_against: Sequence[str] = (),
    digits: int = 0,
    column: Callable[[Record], str] | None = None,
) -> tuple[list[str], list[list[str]]]:
    """Records pivoted to one row per problem and one column per implementation.

    ``keys`` name the columns that identify a row: fields of ``shape`` or ``config``, or ``pass``. ``value`` is the
    field shown (``tflops``, ``time_ms``, ``tbps``, ``memory_mib``); ``ratios_against`` adds a column 'vs X' of
    flashtile's TFLOP/s over X's (or X's time over flashtile's for times and memory). ``column`` names a record's
    column (default: its implementation); ``implementations`` picks and orders the columns. A record flagged by its
    accuracy check (``extra["flagged"]``) is marked '(!)'. Returns (header, rows) of strings.
    """
    column = column or (lambda rec: rec["implementation"])
    implementations = list(implementations or dict.fromkeys(column(r) for r in records))
    cells: dict[tuple, dict[str, Record]] = {}
    for rec in records:
        fields = {**rec["shape"], **rec["config"], "pass": rec["pass"]}
        row = tuple(_cell(fields.get(k)) for k in keys)
        cells.setdefault(row, {})[column(rec)] = rec
    higher_is_better = value in ("tflops", "tbps")
    header = [*keys, *(label(i) for i in implementations), *(f"vs {label(p)}" for p in ratios_against)]
    body = []
    for row, found in cells.items():
        line = list(row)
        for impl in implementations:
            rec = found.get(impl)
            shown = _number(rec and rec[value], digits)
            line.append(shown + (" (!)" if rec and rec["extra"].get("flagged") else ""))
        ours = found.get(OURS, {}).get(value)
        for peer in ratios_against:
            theirs = found.get(peer, {}).get(value)
            ratio = None
            if ours and theirs:
                ratio = ours / theirs if higher_is_better else theirs / ours
            line.append(_number(ratio, 2))
        body.append(line)
    return header, body


def markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def provenance(records: Sequence[Record]) -> str:
    """One line per distinct environment: 'NVIDIA H200, 2026-12-01, driver ..., torch ..., commit ...' (runs of one
    day and commit on the same versions share a line)."""
    seen = dict.fromkeys(
        tuple((name, rec.get(name)) for name in ("gpu", "gpus", "date", "driver", "torch", "triton", "cudnn", "commit"))
        for rec in records
    )
    lines = []
    for env in seen:
        e = dict(env)
        gpus = f"{e['gpus']}× " if (e["gpus"] or 1) > 1 else ""
        parts = [f"{gpus}{e['gpu']}", str(e["date"])[:10]]
        parts += [f"{name} {e[name]}" for name in ("driver", "torch", "triton", "cudnn") if e[name]]
        parts.append(f"flashtile commit {e['commit']}")
        lines.append(", ".join(parts))
    return "\n".join(dict.fromkeys(lines))
