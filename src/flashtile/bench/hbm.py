"""HBM bytes of one attention problem: flashtile's against standard attention's, from the model or from Nsight Compute.

``model_bytes`` runs flashtile's forward and backward once inside ``flashtile.profile()`` and returns what its model
(``flashtile.iomodel``, for the kernels that ran) says each pass moves, beside standard attention's bytes for the
same problem. ``ncu_bytes`` measures instead: it runs one pass in a child process under Nsight Compute
(``ncu`` on PATH) with the DRAM counters ``dram__bytes_read.sum`` and ``dram__bytes_write.sum``, summed over every
kernel the pass launches. The child warms up (compiles) first, then brackets the measured pass with
``torch.cuda.profiler.start()`` / ``stop()``, which ``ncu --profile-from-start off`` honours, as
benchmarks/ncu_attention.py runs a warm-up launch before the profiled one. ncu flushes the caches before each kernel
(its default ``--cache-control all``), so a kernel's K/V re-reads that the L2 would catch in a hot loop are counted
only as far as one kernel's own L2 reuse does not serve them.

    python -m flashtile.bench.hbm --impl flashtile --pass bwd --batch 1 --seqlen 4096 --nheads 16 --head-dim 128

runs one such child pass on its own (without ncu it just runs).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import flashtile
from flashtile.reference import attention_reference

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
IMPLEMENTATIONS = ("flashtile", "standard")
PASSES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NCU_TIMEOUT_S = 600
WARMUP = 2


class NcuUnavailable(RuntimeError):
    """Nsight Compute could not measure: not installed, no permission for the GPU's counters, or the run failed."""


@dataclass(frozen=True)
class Problem:
    """q (batch, seqlen, nheads, head_dim), k and v (batch, seqlen, nheads_k, head_dim), in ``dtype``."""

    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool = False
    dtype: str = "bf16"
    nheads_k: int | None = None

    def inputs(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """Fresh q, k, v (leaves requiring grad) and dout from N(0, 1)."""
        generator = torch.Generator(device=device).manual_seed(0)
        heads_k = self.nheads_k or self.nheads

        def draw(heads: int, grad: bool) -> torch.Tensor:
            shape = (self.batch, self.seqlen, heads, self.head_dim)
            x = torch.randn(shape, generator=generator, device=device, dtype=DTYPES[self.dtype])
            return x.requires_grad_(grad)

        return draw(self.nheads, True), draw(heads_k, True), draw(heads_k, True), draw(self.nheads, False)

    def arguments(self) -> list[str]:
        """The child's command-line arguments for this problem."""
        found = ["--batch", str(self.batch), "--seqlen", str(self.seqlen), "--nheads", str(self.nheads),
                 "--head-dim", str(self.head_dim), "--dtype", self.dtype]  # fmt: skip
        if self.nheads_k:
            found += ["--nheads-k", str(self.nheads_k)]
        return found + (["--causal"] if self.causal else [])


def forward(impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The output of ``impl``: flashtile, or standard attention (the score matrix materialised in the inputs'
    dtype, ``flashtile.reference.attention_reference``)."""
    if impl == "flashtile":
        return flashtile.flash_attn_func(q, k, v, causal=causal)
    return attention_reference(q, k, v, causal=causal)[0]


def model_bytes(problem: Problem, device: torch.device | str) -> dict[str, dict[str, object]]:
    """Per pass ('fwd', 'bwd'): the model's ``hbm_bytes`` of flashtile and its floor ``min_hbm_bytes``,
    ``standard_bytes`` and the ``path`` that ran, from one forward and backward of flashtile inside
    ``flashtile.profile()`` on ``device``."""
    q, k, v, dout = problem.inputs(device)
    with flashtile.profile() as prof:
        forward("flashtile", q, k, v, problem.causal).backward(dout)
    keys = ("hbm_bytes", "min_hbm_bytes", "standard_bytes", "path")
    return {rec["pass"]: {key: rec[key] for key in keys} for rec in prof.records}


def ncu_available() -> bool:
    """Whether Nsight Compute's command line (``ncu``) is on PATH."""
    return shutil.which("ncu") is not None


def parse_ncu_csv(text: str) -> float:
    """The sum of ``METRICS`` over every kernel in ncu's ``--csv --print-units base`` output (bytes)."""
    lines = text[text.find('"ID"') :] if '"ID"' in text else ""
    total, found = 0.0, False
    for row in csv.DictReader(io.StringIO(lines)):
        if row.get("Metric Name") in METRICS:
            total += float(row["Metric Value"].replace(",", ""))
            found = True
    if not found:
        raise NcuUnavailable("ncu reported no DRAM counters: " + " | ".join(text.strip().splitlines()[-5:]))
    return total


def ncu_bytes(problem: Problem, impl: str, pass_: str, timeout_s: float = NCU_TIMEOUT_S) -> float:
    """DRAM bytes read + written by one ``pass_`` of ``impl`` on ``problem``, measured by Nsight Compute in a child
    process; raises NcuUnavailable (with ncu's own words) when it cannot measure."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise NcuUnavailable("ncu (Nsight Compute) is not on PATH")
    options = ["--profile-from-start", "off", "--metrics", ",".join(METRICS), "--csv", "--print-units", "base"]
    child = [sys.executable, "-m", "flashtile.bench.hbm", "--impl", impl, "--pass", pass_, *problem.arguments()]
    here = str(Path(flashtile.__file__).resolve().parents[1])  # the child imports this flashtile
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([ncu, *options, *child], capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NcuUnavailable(f"ncu did not run: {exc}") from exc
    if done.returncode != 0:
        raise NcuUnavailable(f"ncu exited with {done.returncode}: " + " | ".join((done.stdout + done.stderr).strip()
                                                                                  .splitlines()[-5:]))  # fmt: skip
    return parse_ncu_csv(done.stdout)


def run_pass(problem: Problem, impl: str, pass_: str, device: torch.device | str = "cuda") -> None:
    """One ``pass_`` of ``impl`` on ``problem`` after WARMUP unmeasured ones, bracketed by the CUDA profiler's start
    and stop (what ncu measures); on the CPU just the passes."""
    q, k, v, dout = problem.inputs(device)
    cuda = torch.device(device).type == "cuda"
    for measured in [False] * WARMUP + [True]:
        for x in (q, k, v):
            x.grad = None
        out = forward(impl, q, k, v, problem.causal) if pass_ == "bwd" else None  # built outside: not measured
        if cuda:
            torch.cuda.synchronize()
            if measured:
                torch.cuda.profiler.start()
        if pass_ == "bwd":
            out.backward(dout)
        else:
            out = forward(impl, q, k, v, problem.causal)
            if pass_ == "fwd+bwd":
                out.backward(dout)
        if cuda:
            torch.cuda.synchronize()
            if measured:
                torch.cuda.profiler.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """The child of ``ncu_bytes``: one pass of one implementation, for ncu to measure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, default="flashtile")
    parser.add_argument("--pass", dest="pass_", choices=PASSES, default="fwd")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--nheads-k", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    problem = Problem(args.batch, args.seqlen, args.nheads, args.head_dim, args.causal, args.dtype, args.nheads_k)
    run_pass(problem, args.impl, args.pass_, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
