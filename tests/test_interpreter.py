"""flashtile's own fixes to the Triton interpreter (``flashtile._interpreter``), as a user's script meets them.

These run in fresh processes with ``TRITON_INTERPRET=1`` that import flashtile alone, without this folder's
conftest.py, so that the library's fixes are what is tested, not the test set-up's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashtile
from flashtile import _backend, _interpreter

BF16_SCRIPT = """
import json, sys, torch, flashtile
from flashtile import _backend
from flashtile.reference import GRADIENT_FACTOR, OUTPUT_FACTOR, reference_results, within_tolerance

assert _backend.path_name(torch.device("cpu")) == "triton-interpreter"
gen = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, n, 2, 64, generator=gen).bfloat16() for n in (45, 77, 77, 45))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
out, lse, _ = flashtile.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
out.backward(dout)
got = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
ref = reference_results(q, k, v, dout, torch.float64, causal=True)
base = reference_results(q, k, v, dout, torch.bfloat16, causal=True)
results = {}
for name, x in got.items():
    factor = OUTPUT_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR
    r = within_tolerance(x, ref[name], base[name], factor)
    results[name] = {"ok": r.ok, "error": r.error, "bound": r.bound}
# Two equal keys: the output is the mean of two values, exact in fp32, so only its rounding to bf16 can differ
# from the oracle's (rounded to nearest even, as on a GPU).
k_same = torch.randn(1, 1, 2, 64, generator=gen).bfloat16().repeat(1, 2, 1, 1)
v_two, q_any = (torch.randn(1, n, 2, 64, generator=gen).bfloat16() for n in (2, 3))
mean = flashtile.flash_attn_func(q_any, k_same, v_two)
rounded = v_two.double().mean(dim=1, keepdim=True).expand_as(mean).bfloat16()
results["rounding"] = {"ok": torch.equal(mean, rounded), "differ": int((mean != rounded).sum())}
json.dump(results, sys.stdout)
"""

REFUSAL_SCRIPT = """
import torch
from triton.runtime import interpreter

dot = interpreter.InterpreterBuilder.create_dot

def create_dot(self, lhs, rhs, *args):  # the same dot under other parameter names
    return dot(self, lhs, rhs, *args)

interpreter.InterpreterBuilder.create_dot = create_dot
import flashtile
from flashtile import _interpreter

assert _interpreter.BF16_REFUSED, "bf16 not refused"
q = torch.randn(1, 17, 1, 16).half()
assert not flashtile.flash_attn_func(q, q, q).isnan().any()  # float16 needs no fix and still runs
try:
    flashtile.flash_attn_func(q.bfloat16(), q.bfloat16(), q.bfloat16())
except NotImplementedError as error:
    print(error)
"""


def run_alone(script: str) -> subprocess.CompletedProcess:
    """``script`` run by this Python with TRITON_INTERPRET=1, importing the flashtile under test."""
    src = str(Path(flashtile.__file__).parents[1])  # the folder that holds the flashtile package
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def test_bf16_attention_in_the_interpreter_without_test_setup():
    """bf16 forward and backward (causal, Sq = 45 != Sk = 77) in the interpreter meet the tolerance rule with
    only the library's fixes (without them the errors are ~1e9: raw bit patterns multiplied), and outputs are
    rounded to bf16 as on a GPU, to nearest even (the interpreter's own cast truncates: the rule, which allows
    twice a plain bf16 error, would not see that)."""
    results = json.loads(run_alone(BF16_SCRIPT).stdout)
    failed = {name: r for name, r in results.items() if not r["ok"]}
    assert not failed, f"outside the tolerance rule: {failed}"


def test_bf16_refused_where_the_interpreter_cannot_be_fixed():
    """An interpreter whose internals differ from those the fixes replace refuses bf16 with a clear error
    before the launch, rather than computing garbage, and still runs float16."""
    message = run_alone(REFUSAL_SCRIPT).stdout
    assert "bfloat16 inputs cannot run in the Triton interpreter" in message
    assert "Use float16 inputs" in message


@pytest.mark.skipif(not _backend.TRITON_INTERPRET, reason="the fixes are installed under TRITON_INTERPRET=1 only")
def test_fixes_install_once():
    """A second ``apply`` leaves the installed fixes as they are (no fix wrapped around itself)."""
    from triton.runtime.interpreter import InterpreterBuilder

    names = ("create_dot", "cast_impl", "create_masked_load", "create_masked_store")
    before = [getattr(InterpreterBuilder, name) for name in names]
    _interpreter.apply()
    assert [getattr(InterpreterBuilder, name) for name in names] == before
    assert _interpreter.BF16_REFUSED is None
