"""Which kernel family runs a call, with the reasons the faster ones do not apply: ``flashtile.explain``, the
dispatcher's choices (``flashtile._backend``), each family's ``qualifies`` and ``flashtile info --explain``. Nothing
here launches a kernel."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import _backend, cli, cpu
from flashtile.ops.sm90 import backward as backward_sm90
from flashtile.ops.sm90 import forward as forward_sm90
from flashtile.options import AttentionOptions

NOT_SM90 = "the device is cpu, not an sm_90 GPU"
NOT_CUDA = "the device is cpu, not a CUDA GPU"


def qkv(seqlen_q=256, seqlen_k=256, nheads=4, nheads_k=4, head_dim=128, dtype=torch.bfloat16):
    q = torch.empty(2, seqlen_q, nheads, head_dim, dtype=dtype)
    k = torch.empty(2, seqlen_k, nheads_k, head_dim, dtype=dtype)
    return q, k, torch.empty_like(k)


@pytest.fixture(params=["cpu", "triton-interpreter"])
def cpu_path(request, monkeypatch):
    """Explain on each path a CPU tensor can take."""
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", request.param == "triton-interpreter")
    return request.param


def test_plain_call_on_cpu(cpu_path):
    """A call the sm_90 kernels would take on an H100 says only that the device is not one."""
    explanation = flashtile.explain(*qkv(), causal=True)
    expected_path = "cpu-torch" if cpu_path == "cpu" else "triton-interpreter"
    for pass_ in (explanation.forward, explanation.backward):
        assert pass_.path == expected_path
        assert pass_.passed_over == (("sm90-gluon", (NOT_SM90,)), ("triton", (NOT_CUDA,)))
    assert str(explanation).splitlines() == [
        f"forward: {expected_path}", f"  not sm90-gluon: {NOT_SM90}", f"  not triton: {NOT_CUDA}",
        f"backward: {expected_path}", f"  not sm90-gluon: {NOT_SM90}", f"  not triton: {NOT_CUDA}",
    ]  # fmt: skip


OPTION_REASONS = {  # flash_attn_func's keywords -> the reason both sm_90 kernels give
    "alibi-window": (dict(window_size=(64, 0), alibi_slopes=torch.ones(4)), "ALiBi with a sliding window"),
    "dropout": (dict(dropout_p=0.1), "dropout"),
    "scale": (dict(softmax_scale=-0.5), "softmax_scale -0.5 (> 0 only)"),
}


@pytest.mark.parametrize("case", OPTION_REASONS.values(), ids=OPTION_REASONS.keys())
def test_options_keep_both_sm90_kernels_off(cpu_path, case):
    kwargs, reason = case
    explanation = flashtile.explain(*qkv(), **kwargs)
    assert explanation.forward.passed_over[0] == ("sm90-gluon", (NOT_SM90, reason))
    assert explanation.backward.passed_over[0] == ("sm90-gluon", (NOT_SM90, reason))


@pytest.mark.parametrize(
    "kwargs",
    [dict(window_size=(64, 0)), dict(window_size=(32, 32)), dict(softcap=30.0), dict(alibi_slopes=torch.ones(4))],
    ids=["causal-window", "window", "softcap", "alibi"],
)
def test_options_both_sm90_kernels_take(cpu_path, kwargs):
    """Sliding windows, softcap and ALiBi at head dim 128: the only reason given is the device."""
    explanation = flashtile.explain(*qkv(), **kwargs)
    for pass_ in (explanation.forward, explanation.backward):
        assert pass_.passed_over[0] == ("sm90-gluon", (NOT_SM90,))


def test_head_dim_64_reasons(cpu_path):
    """At head dim 64 a window keeps the forward kernel off (the Triton forward is faster there), softcap the
    backward (its 128-row tiles)."""
    window = "a sliding window at head dim 64 (the forward takes windows at 128, 256)"
    explanation = flashtile.explain(*qkv(head_dim=64), window_size=(64, 0))
    assert explanation.forward.passed_over[0] == ("sm90-gluon", (NOT_SM90, window))
    assert explanation.backward.passed_over[0] == ("sm90-gluon", (NOT_SM90,))
    explanation = flashtile.explain(*qkv(head_dim=64), softcap=30.0)
    assert explanation.forward.passed_over[0] == ("sm90-gluon", (NOT_SM90,))
    reason = "softcap at head dim 64 (its 128-row query tiles start S^T at -lse)"
    assert explanation.backward.passed_over[0] == ("sm90-gluon", (NOT_SM90, reason))


def test_pass_specific_reasons(cpu_path):
    """A sink keeps only the forward off (the saved lse holds it); deterministic=True only the backward."""
    explanation = flashtile.explain(*qkv(), learnable_sink=torch.zeros(4), deterministic=True)
    assert explanation.forward.passed_over[0] == ("sm90-gluon", (NOT_SM90, "a learnable sink"))
    reason = "deterministic=True (this kernel sums dQ with atomics)"
    assert explanation.backward.passed_over[0] == ("sm90-gluon", (NOT_SM90, reason))


def test_layout_reasons():
    """The kernels' own conditions, each named: dtype, head dims, lengths (backward), layouts, groups."""
    plain = AttentionOptions(0.1, deterministic=False)
    q, k, v = qkv(dtype=torch.float32, head_dim=96)
    assert forward_sm90.qualifies(q, k, v, plain).reasons == (
        "dtype torch.float32 (bf16 or fp16 only)",
        "head dims (96, 96, 96) of q, k, v (one of [64, 128, 256] for all three)",
    )
    q, k, v = qkv(seqlen_q=200, nheads=16, nheads_k=1)
    assert forward_sm90.qualifies(q, k, v, plain)
    causal = AttentionOptions(0.1, None, 0, deterministic=False)
    assert backward_sm90.qualifies(q, k, v, torch.empty_like(q), causal).reasons == (
        "causal with 16 query heads per K/V head (at most 8)",
        "seqlen_q 200, seqlen_k 256 (positive multiples of 128 only)",
    )
    head_dim_strided = torch.empty(2, 256, 128, 4, dtype=torch.bfloat16).transpose(2, 3)
    assert forward_sm90.qualifies(head_dim_strided, *qkv()[1:], plain).reasons == (
        "layouts a tensor descriptor cannot read (q)",
    )
    assert forward_sm90.qualifies(*qkv(), plain, varlen=True).reasons == ("a packed variable-length batch",)


def test_dispatcher_takes_sm90_where_the_device_is_one(monkeypatch):
    """With the device check saying yes, the forward and backward that qualify take the sm_90 family; on a CPU
    tensor the short answer names the device alone (the hot path does not ask the kernels' conditions)."""
    q, k, v = qkv()
    plain = AttentionOptions(0.1, None, 0, deterministic=False)
    refused = (("sm90-gluon", _backend.Verdict((NOT_SM90,))), ("triton", _backend.Verdict((NOT_CUDA,))))
    assert _backend.forward_choice(q, k, v, plain).passed_over == refused
    monkeypatch.setattr(_backend, "gluon_refusal", lambda device: None)
    assert _backend.pass_paths(q, k, v, plain) == {
        "forward": ("sm90-gluon", "the fastest family for this device"),
        "backward": ("sm90-gluon", "the fastest family for this device"),
    }
    deterministic = AttentionOptions(0.1, None, 0)
    assert _backend.backward_choice(q, k, v, torch.empty_like(q), deterministic).path == _backend.path_name(q.device)


def test_head_major_layouts_take_the_sm90_kernels(monkeypatch):
    """torch's (B, H, N, D) memory, as flashtile's SDPA hands it on: the sm_90 forward and backward read it (head-major
    descriptors), with a dout of either layout; the backward's own conditions still hold (its lengths), and a layout
    no descriptor reads is named."""
    monkeypatch.setattr(_backend, "gluon_refusal", lambda device: None)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv())
    explanation = flashtile.explain(q, k, v, causal=True)  # with a contiguous (B, N, H, D) dout, as autograd gives
    assert explanation.forward.path == "sm90-gluon" and explanation.forward.passed_over == ()
    assert explanation.backward.path == "sm90-gluon" and explanation.backward.passed_over == ()
    causal = AttentionOptions(0.1, None, 0, deterministic=False)
    dout = torch.empty_like(q)  # (B, H, N, D) memory too
    assert _backend.backward_choice(q, k, v, dout, causal).path == "sm90-gluon"
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(seqlen_q=200))
    explanation = flashtile.explain(q, k, v, causal=True)
    assert explanation.forward.path == "sm90-gluon"
    assert explanation.backward.path == _backend.path_name(q.device)
    reason = "seqlen_q 200, seqlen_k 256 (positive multiples of 128 only)"
    assert explanation.backward.passed_over[0] == ("sm90-gluon", (reason,))
    rows_unaligned = torch.empty(2, 4, 200, 132, dtype=torch.bfloat16)[..., :128].transpose(1, 2)  # 264-byte rows
    found = _backend.backward_choice(q, k, v, rows_unaligned, causal, every=True).passed_over[0]
    assert found == ("sm90-gluon", _backend.Verdict((reason, "layouts a tensor descriptor cannot read (dout)")))


CPU_ROUTE = {  # AttentionOptions keywords -> the reason the tiled route runs, or None: torch's kernel
    "plain": (dict(), None),
    "softcap": (dict(softcap=1.0), "softcap"),
    "alibi": (dict(alibi_slopes=torch.ones(4)), None),  # a bias mask per block of rows, through torch's kernel
    "alibi-mask": (dict(alibi_slopes=torch.ones(4), attn_mask=torch.zeros(1, 1, 256, 256, dtype=torch.bfloat16)),
                   "a window other than causal, or ALiBi, with an attn_mask"),
    "dropout": (dict(dropout_p=0.1), "dropout"),
    "zero-scale": (dict(softmax_scale=0.0), "softmax_scale 0 (torch's kernel scales the masked -inf scores)"),
    "mask-window": (dict(window_left=3, window_right=0, attn_mask=torch.zeros(1, 1, 256, 256, dtype=torch.bfloat16)),
                    "a window other than causal, or ALiBi, with an attn_mask"),
}  # fmt: skip


@pytest.mark.parametrize("case", CPU_ROUTE.values(), ids=CPU_ROUTE.keys())
def test_cpu_route_reasons(monkeypatch, case):
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    kwargs, reason = case
    options = AttentionOptions(**{"softmax_scale": 0.1, **kwargs})
    route, verdict = cpu.torch_kernel_route(*qkv(), options)
    assert (route is None) == (reason is not None) and verdict.reasons == (() if reason is None else (reason,))
    path, why = _backend.pass_paths(*qkv(), options)["forward"]
    assert path == ("cpu-torch" if reason is None else "cpu-tiled")
    assert why.endswith(f"not cpu-torch: {reason}" if reason else f"not triton: {NOT_CUDA}")


def test_decode_choice(monkeypatch):
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    assert _backend.decode_choice(torch.device("cpu")).path == "cpu-decode"
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", True)
    assert _backend.decode_choice(torch.device("cpu")).path == "split-kv"


def test_explain_validates_like_the_call():
    with pytest.raises(flashtile.InputError):
        flashtile.explain(*qkv(head_dim=512))


def test_cli_explain(capsys, monkeypatch):
    monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)
    args = ["info", "--explain", "--batch", "1", "--seqlen-q", "100", "--seqlen-k", "300", "--heads", "8", "--kv-heads",
            "2", "--head-dim", "64", "--dtype", "fp16", "--causal", "--softcap", "5", "--device", "cpu"]  # fmt: skip
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "flash_attn_func on q (1, 100, 8, 64), k and v (1, 300, 2, 64), fp16, cpu",
        "forward: cpu-tiled", f"  not sm90-gluon: {NOT_SM90}", f"  not triton: {NOT_CUDA}",
        "  not cpu-torch: softcap",
        "backward: cpu-tiled",
        f"  not sm90-gluon: {NOT_SM90}; softcap at head dim 64 (its 128-row query tiles start S^T at -lse); seqlen_q"
        " 100, seqlen_k 300 (positive multiples of 128 only)",
        f"  not triton: {NOT_CUDA}", "  not cpu-torch: softcap",
    ]  # fmt: skip
