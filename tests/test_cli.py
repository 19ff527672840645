"""The command line: ``flashtile info``, ``check`` and ``bench``, in-process through ``main`` and as
``python -m flashtile``."""

import contextlib
import math
import os
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
    timed = r" +\d+\.\d \(\d+\) │"
    # flashtile, torch's SDPA and standard attention timed, then the two ratios
    assert re.search(rf"^\s*1024 │{timed}{timed}{timed} +\d+\.\d\d× │ +\d+\.\d\d×$", out, re.MULTILINE), out
    assert re.search(rf"^\s*2048 │{timed}{timed} +skipped │ +\d+\.\d\d× │ +-$", out, re.MULTILINE), out
    assert "N=2048: standard attention skipped (would need 0.1 GiB" in out


def test_check_names_each_step_while_it_runs(monkeypatch):
    """The progress bar names every correctness case and every timed step before it runs."""
    named = []

    @contextlib.contextmanager
    def progress(console, description, total):
        steps = []
        yield steps.append
        named.append((description, total, steps))

    monkeypatch.setattr(cli, "_progress", progress)
    monkeypatch.setattr(
        cli, "check_case", lambda case, device, seed: {"out": within_tolerance(*[torch.ones(1)] * 3, factor=2.0)}
    )
    monkeypatch.setattr(cli, "_measure", lambda step, seqlen, setup, device: (1.0, 2.0))
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    assert cli.main(["check", "--quick", "--device", "cpu"]) == 0
    (_, cases, case_steps), (_, timings, timing_steps) = named
    assert cases == len(case_steps) == len(cli.CASES)
    assert timings == len(timing_steps) == 2 * len(cli.STEPS)
    assert timing_steps[:3] == ["flashtile N=1024", "torch SDPA N=1024", "standard N=1024"]


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


def test_bench_help(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["bench", "--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashtile bench") and "--dry-run" in out


def test_bench_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    from flashtile.bench import plot

    monkeypatch.setattr(plot, "available", lambda: False)
    assert cli.main(["bench", "--out", str(tmp_path)]) == 1
    assert "pip install 'flashtile[bench]'" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_without_gpu_points_to_the_dry_run(capsys, tmp_path):
    assert cli.main(["bench", "--out", str(tmp_path), "--no-plot"]) == 1
    assert "--dry-run" in capsys.readouterr().out


def test_info_without_triton():
    """The CPU path needs no Triton (it is not installed on macOS or Windows): ``flashtile info`` says so."""
    code = "import sys; sys.modules['triton'] = None; from flashtile import cli; sys.exit(cli.main(['info']))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "not installed" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--ring", "2"], "--ring, --budget-s and --out go with --max-context"),
        (["check", "--budget-s", "60", "--device", "cpu"], "--ring, --budget-s and --out go with --max-context"),
        (["check", "--max-context", "--ring", "0", "--device", "cpu"], "--ring takes a number of GPUs >= 1"),
        (["check", "--max-context", "--budget-s", "0", "--device", "cpu"], "--budget-s seconds > 0"),
    ],
)
def test_max_context_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2 and message in capsys.readouterr().err


def test_max_context_options_on_the_cpu(capsys, tmp_path):
    argv = ["check", "--max-context", "--ring", "2", "--budget-s", "60", "--out", str(tmp_path), "--device", "cpu"]
    assert cli.main(argv) == 1
    assert capsys.readouterr().out.startswith("--max-context needs a CUDA GPU") and not any(tmp_path.iterdir())
