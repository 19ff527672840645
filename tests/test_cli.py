"""The command line: ``flashtile info``, ``check`` and ``bench``, in-process through ``main`` and as
``python -m flashtile``."""

import math
import re
import subprocess
import sys

import pytest
import torch

import flashtile
from flashtile import _backend, cli
from flashtile.reference import within_tolerance


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for expected in (flashtile.__version__, torch.__version__, "CUDA tensors", "CPU tensors", "sm_90 Gluon kernels"):
        assert expected in out


def test_info_gluon_switched_off(capsys, monkeypatch):
    monkeypatch.setattr(_backend, "GLUON", False)
    assert cli.main(["info"]) == 0
    assert "off (FLASHTILE_GLUON=0)" in capsys.readouterr().out


def test_python_m_flashtile_info():
    result = subprocess.run([sys.executable, "-m", "flashtile", "info"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert flashtile.__version__ in result.stdout
    assert "CPU tensors" in result.stdout


def test_check_quick_cpu(capsys, monkeypatch):
    """The whole check on the CPU path (fast), also where conftest switched the Triton interpreter
    on: the measuring processes start from the environment, so it loses TRITON_INTERPRET too.
    Standard attention is skipped at N=2048 (a 64 MiB score matrix) to test the skip."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cli, "MAX_SCORE_BYTES", 32 * 2**20)
    assert cli.main(["check", "--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert out.count("PASS") == len(cli.CASES) + 1  # one per case, and the verdict
    assert cli.SPEED_SETUPS["cpu"].quick_seqlens == (1024, 2048)
    assert re.search(r"^\s*1024 │.*│ +\d+\.\d ", out, re.MULTILINE)  # flashtile and standard timed
    assert re.search(r"^\s*2048 │[^│]*│ +skipped │", out, re.MULTILINE)
    assert "N=2048: standard attention skipped (would need 0.1 GiB" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_cuda_without_device():
    with pytest.raises(SystemExit) as raised:
        cli.main(["check", "--device", "cuda"])
    assert raised.value.code == 2


@pytest.mark.parametrize(
    ("x", "ok"),
    [
        ([1.0, 2.0, -math.inf], True),  # exact
        ([1.0015, 2.0, -math.inf], True),  # 1.5e-3 <= 2 * 1e-3 + 2 ulps
        ([1.01, 2.0, -math.inf], False),  # over the bound
        ([math.nan, 2.0, -math.inf], False),  # NaN
        ([1.0, 2.0, 0.0], False),  # the infinity is lost
    ],
)
def test_within_tolerance(x, ok):
    ref = torch.tensor([1.0, 2.0, -math.inf])
    base = torch.tensor([1.001, 2.0, -math.inf])
    assert within_tolerance(torch.tensor(x), ref, base, factor=2.0).ok is ok


def test_bench_forwards_arguments(capfd):
    assert cli.main(["bench", "--help"]) == 0
    assert "bench_attention.py" in capfd.readouterr().out


def test_bench_without_repository(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "missing.py")
    assert cli.main(["bench"]) == 1
    assert "benchmarks/" in capsys.readouterr().out
