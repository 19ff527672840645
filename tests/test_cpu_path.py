"""What is particular to the CPU path (flashtile.cpu); its numerics run in every test of
test_attention.py through the ``path`` fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile import cpu
from flashtile.options import AttentionOptions

MEMORY_SCRIPT = """
import sys, torch
from flashtile import cpu
from flashtile.options import AttentionOptions

def peak_rss():  # VmHWM: this address space's peak, where ru_maxrss would start at the parent's (pytest's) peak
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))

cpu.TORCH_KERNEL = sys.argv[1] != "tiled"
options = AttentionOptions(0.125, *((1000, 0) if sys.argv[1] == "band" else (None, None)))
S = 8192
q, k, v, dout = (torch.randn(1, S, 1, 64).half() for _ in range(4))
small = [x[:, :600] for x in (q, k, v, dout)]  # warm up the allocator and matmul buffers
out, lse = cpu.attention_forward(*small[:3], options)
cpu.attention_backward(small[3], *small[:3], out, lse, options)
before = peak_rss()
out, lse = cpu.attention_forward(q, k, v, options)
cpu.attention_backward(dout, q, k, v, out, lse, options)
print(peak_rss() - before)
"""


@pytest.mark.parametrize("route", ["torch", "band", "tiled"])
def test_memory_is_linear_in_seqlen(route):
    """Sq = Sk = 8192: one float32 (Sq, Sk) matrix is 256 MiB; forward + backward must grow the peak RSS of a
    fresh process by far less, on each route: torch's kernel in one call, torch's kernel block by block under a
    window of 1000 keys, the tiled path (tiles of 128 x 512 need 1 MiB; with 8192 x 8192 tiles the same script
    grew by 543 MiB)."""
    src = str(Path(cpu.__file__).parents[1])  # the folder that holds the flashtile package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, route], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    growth = int(run.stdout.split()[-1])
    assert growth < 64 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB"


def test_inputs_are_not_modified():
    """Tiles are views of the inputs and the path works in place on its own buffers only."""
    q, k, v, dout = (torch.randn(2, 300, 4, 40).bfloat16() for _ in range(4))
    before = [x.clone() for x in (q, k, v, dout)]
    options = AttentionOptions(0.2, None, 0)
    out, lse = cpu.attention_forward(q, k, v, options)
    cpu.attention_backward(dout, q, k, v, out, lse, options)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, dout), strict=True))


@pytest.mark.parametrize("on", [False, True], ids=["default", "BF16_PRODUCTS"])
def test_bf16_products_setting_is_scoped(monkeypatch, on):
    """oneDNN's bf16 mode for float32 products is process-wide: the tiled path turns it on for a bf16 call only with
    cpu.BF16_PRODUCTS, and restores it after."""
    setting = getattr(torch.backends.mkldnn, "matmul", None)
    if not hasattr(setting, "fp32_precision"):
        pytest.skip("this torch has no oneDNN float32-precision setting")
    monkeypatch.setattr(cpu, "BF16_PRODUCTS", on)
    seen = []
    tiled = cpu._tiled_forward
    monkeypatch.setattr(cpu, "_tiled_forward", lambda *a: seen.append(setting.fp32_precision) or tiled(*a))
    before = setting.fp32_precision
    q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.bfloat16) for _ in range(3))
    cpu.attention_forward(q, k, v, AttentionOptions(softmax_scale=32**-0.5, softcap=5.0))
    assert seen == ["bf16" if on else before]
    assert setting.fp32_precision == before
