"""Eager calls past the custom ops' dispatch (``flashtile._ops.attention`` / ``varlen_attention``).

Plain eager calls run the ops' implementations directly (``_EagerAttention`` when a gradient is wanted);
anything that traces or intercepts goes through the custom ops. Both routes must give the same bits.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import flashtile
from conftest import capture
from flashtile import _ops
from test_attention import DEVICE, make_inputs


def _run(fn, leaves, dout, dlse=None):
    """fn(*leaves) -> (out, lse); returns out, lse and the gradients of every leaf that requires grad."""
    out, lse = fn(*leaves)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse).sum()
    wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    return [out, lse, *torch.autograd.grad(loss, wanted)]


def _fresh(t):
    """A new leaf like t (a Parameter stays a Parameter)."""
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(t.detach().clone())
    return t.detach().clone().requires_grad_(t.requires_grad)


def _both_routes(fn, leaves, dout, dlse=None, monkeypatch=None):
    """Results of the eager route and of the custom-op route (``_eager`` forced off) on fresh leaves."""
    results = []
    for eager in (True, False):
        fresh = [_fresh(t) for t in leaves]
        with monkeypatch.context() as patch:
            if not eager:
                patch.setattr(_ops, "_eager", lambda tensors: False)
            results.append(_run(fn, fresh, dout, dlse))
    return results


def _assert_same(results):
    for eager, op in zip(*results, strict=True):
        assert torch.equal(eager, op)


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_dlse", [False, True], ids=["out", "out+lse"])
def test_eager_route_matches_custom_op(path, monkeypatch, with_dlse):
    q, k, v, dout = make_inputs(2, 17, 33, 4, 2, 32, dtype=torch.bfloat16)
    sink = torch.nn.Parameter(torch.randn(4, device=DEVICE))  # a Parameter still takes the eager route
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), sink]
    dlse = torch.randn(2, 4, 17, device=DEVICE) if with_dlse else None

    def fn(q, k, v, sink):
        out, lse, _ = flashtile.flash_attn_func(
            q, k, v, causal=True, softcap=5.0, return_attn_probs=True, learnable_sink=sink
        )
        return out, lse

    _assert_same(_both_routes(fn, leaves, dout, dlse, monkeypatch))


def test_eager_route_matches_custom_op_masked(path, monkeypatch):
    q, k, v, dout = make_inputs(1, 16, 24, 2, 2, 16, dtype=torch.float16)
    mask = torch.randn(1, 2, 16, 24, device=DEVICE, dtype=torch.float16).requires_grad_()

    def fn(q, k, v, mask):
        out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return out.transpose(1, 2), out.new_zeros(())

    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask]
    _assert_same(_both_routes(fn, leaves, dout, None, monkeypatch))


def test_eager_route_matches_custom_op_varlen(path, monkeypatch):
    q, k, v, dout = make_inputs(1, 40, 40, 2, 1, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 13, 13, 40], dtype=torch.int32, device=DEVICE)
    sink = torch.randn(2, device=DEVICE, requires_grad=True)

    def fn(q, k, v, sink):
        out, lse, _ = flashtile.flash_attn_varlen_func(
            q, k, v, cu, cu, 27, 27, causal=True, return_attn_probs=True, learnable_sink=sink
        )
        return out, lse

    leaves = [t[0].requires_grad_() for t in (q, k, v)] + [sink]
    _assert_same(_both_routes(fn, leaves, dout[0], torch.randn(2, 40, device=DEVICE), monkeypatch))


def test_routes_taken(monkeypatch):
    """Plain calls skip the custom op; a torch function mode (or tracing) goes through it."""
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 16)
    calls = []
    op = _ops.attention_forward
    monkeypatch.setattr(_ops, "attention_forward", lambda *args: calls.append(1) or op(*args))
    flashtile.flash_attn_func(q, k, v)
    with torch.no_grad():
        flashtile.flash_attn_func(q.requires_grad_(), k, v)
    out = flashtile.flash_attn_func(q, k, v)
    assert not calls and out.grad_fn is not None and type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    with _PassThrough():
        flashtile.flash_attn_func(q, k, v)
    assert calls == [1]


def test_unused_lse_gets_no_gradient_tensor(monkeypatch):
    """The backward gets dlse = None when only out is used (no zero tensor filled per backward)."""
    q, k, v, dout = make_inputs(1, 8, 8, 2, 2, 16)
    seen = []
    backward = _ops._DIRECT.attention_backward

    def spy(*args):
        seen.append(args[6])  # dlse
        return backward(*args)

    monkeypatch.setattr(_ops._DIRECT, "attention_backward", spy)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    flashtile.flash_attn_func(*leaves).backward(dout)
    assert seen == [None]


@pytest.mark.gpu
def test_cuda_graph_capture_of_forward_and_backward():
    q, k, v, dout = make_inputs(2, 128, 128, 4, 2, 64, dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        out = flashtile.flash_attn_func(*leaves, causal=True, deterministic=True)  # replay and eager: same bits
        out.backward(dout)
        return out

    expected = step().detach().clone()
    grads = [t.grad.clone() for t in leaves]
    graph, out = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    for t, grad in zip(leaves, grads, strict=True):
        assert torch.equal(t.grad, grad)


def test_latency_host_tracer_records_and_restores():
    """benchmarks/latency.py's host tracer: inside the block the traced functions add their inclusive time
    (on any device: here the public path's entry and the eager Function); after it, every patched name is the
    original again."""
    import collections

    import latency

    entry, forward = _ops.attention, _ops._EagerAttention.forward
    totals = collections.Counter()
    q, k, v = (torch.randn(1, 40, 2, 16, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(3))
    with latency._traced(totals):
        assert _ops.attention is not entry
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert totals["_ops.attention"] > 0 and totals["_EagerAttention.forward"] > 0
    assert totals["_ops.attention"] >= totals["_EagerAttention.forward"]  # inclusive: the entry calls the Function
    assert _ops.attention is entry and _ops._EagerAttention.forward is forward
    assert torch.empty is latency.torch.empty and "timed" not in torch.empty.__qualname__


def test_latency_binder_launches_swap_both_gluon_launchers():
    """latency.py's A/B of the direct launches: inside the block the Gluon forward and backward launch through
    the kernel's binder (kernel[grid](..., num_warps=4)) on every call; after it, ``launch`` is back."""
    import latency
    from flashtile.ops.sm90 import backward as backward_sm90
    from flashtile.ops.sm90 import forward as forward_sm90

    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    launch = forward_sm90.launch
    with latency._binder_launches():
        forward_sm90.launch(Kernel(), (1, 1, 1), (3,), {"X": 1})
        backward_sm90.launch(Kernel(), (2, 1, 1), (4,), {"X": 2})
    assert calls == [((1, 1, 1), (3,), {"X": 1, "num_warps": 4}), ((2, 1, 1), (4,), {"X": 2, "num_warps": 4})]
    assert forward_sm90.launch is launch and backward_sm90.launch is launch


def test_latency_cpu_host_overhead_runs_and_restores(monkeypatch):
    """latency.py --host-overhead on the CPU: six rows of µs per call; afterwards the direct launches' caches, the
    kernels' own caches and Triton's driver are as before. (The tests run the Triton kernels in the interpreter,
    so they are stand-ins here; the Gluon kernels are compiled-path kernels whose compiles do nothing.)"""
    from triton.runtime.driver import driver

    import host_overhead
    import latency
    from flashtile.ops import _launch
    from flashtile.ops.attention import backward, forward
    from flashtile.ops.sm90 import forward as forward_sm90

    for module, name in host_overhead.ATTENTION_KERNELS:
        monkeypatch.setattr(module, name, host_overhead._NoLaunch())
    kernel = forward_sm90._attention_forward_sm90_kernel
    before = (dict(_launch._COMPILED), kernel.device_caches, driver._active)
    rows = latency.cpu_host_overhead(repeats=2, calls=3, shape=(1, 128, 2))
    assert [row["what"] for row in rows] == [
        f"{label} {name}" for label in ("D=128 gluon", "D=128 FLASHTILE_GLUON=0")
        for name in ("fwd", "fwd+bwd")
    ]  # fmt: skip
    assert all(row["us"] > 0 for row in rows)
    assert (dict(_launch._COMPILED), kernel.device_caches, driver._active) == before
    assert forward._attention_forward_kernel is not backward._delta_kernel


def test_host_overhead_flex_rows(tmp_path):
    """host_overhead.py's flex rows (flex_attention with a causal and a prefix-LM block mask, the built-in attention
    behind them) run with the kernels stubbed and write their rows; the kernels are put back afterwards."""
    import json

    import host_overhead

    kernels = [getattr(module, name) for module, name in host_overhead.ATTENTION_KERNELS]
    cases = ["flex causal fwd+bwd", "flex prefix-LM fwd+bwd"]
    host_overhead.main(["--calls", "2", "--out", str(tmp_path), *(arg for case in cases for arg in ("--only", case))])
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert [row["case"] for row in rows] == cases and all(row["us_per_call"] > 0 for row in rows)
    assert [getattr(module, name) for module, name in host_overhead.ATTENTION_KERNELS] == kernels


def _fields(descriptor) -> dict:
    return {name: value for name, value in vars(descriptor).items() if name != "base"}


def test_per_layout_descriptors_follow_their_tensor(monkeypatch):
    """``ops.common.descriptors.per_layout``: every descriptor after a key's first has its own tensor as base and the
    fields a fresh construction gives, across tensors of another address, strides, dtype or shape; a misaligned
    base raises on every call, as the constructor does; at MAX_LAYOUTS the cache starts over."""
    from flashtile.ops.common import descriptors
    from flashtile.ops.sm90 import common as sm90_common
    from flashtile.ops.sm90 import forward as forward_sm90

    monkeypatch.setattr(descriptors, "_CHECKED", {})
    wide = torch.empty(2, 64, 4, 192, dtype=torch.bfloat16)
    tensors = [
        torch.empty(2, 64, 4, 128, dtype=torch.bfloat16),
        torch.empty(2, 64, 4, 128, dtype=torch.bfloat16),  # another address
        wide[..., :128],  # other strides
        torch.empty(2, 64, 4, 128, dtype=torch.float16),  # another dtype
        torch.empty(1, 64, 4, 128, dtype=torch.bfloat16),  # another shape
        torch.empty(2, 64, 4, 128, dtype=torch.float32),
        torch.empty(2, 4, 64, 128, dtype=torch.bfloat16).transpose(1, 2),  # torch's (B, H, N, D) memory
    ]
    builders = [(sm90_common.descriptor, (64,)), (sm90_common.descriptor, (64, 32)),
                (forward_sm90.batch_descriptor, (64,)), (forward_sm90.head_major_descriptor, (64,)),
                (descriptors.tile_descriptor, (64, 128))]  # fmt: skip
    for build, params in builders:
        for x in tensors * 2:
            if x.dtype == torch.float32 and build is not sm90_common.descriptor:
                continue
            made = build(x, *params)
            assert made.base is x
            assert type(made) is type(expected := build.__wrapped__(x, *params))
            assert _fields(made) == _fields(expected)
    misaligned = torch.empty(2 * 64 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 4, 128)
    for _ in range(2):
        with pytest.raises(AssertionError, match="16-byte aligned"):
            sm90_common.descriptor(misaligned, 64)
    monkeypatch.setattr(descriptors, "MAX_LAYOUTS", 2)
    for seqlen in (16, 32, 48, 16):  # new keys, then a key dropped when the cache started over
        x = torch.empty(1, seqlen, 4, 128, dtype=torch.bfloat16)
        assert _fields(forward_sm90.batch_descriptor(x, 64)) == _fields(
            forward_sm90.batch_descriptor.__wrapped__(x, 64)
        )
        assert 1 <= len(descriptors._CHECKED) <= 2


def test_tma_ready_matches_its_definition():
    """``descriptors.tma_ready`` (unrolled for speed) against its docstring, dimension by dimension, over layouts that
    fail each condition: 3-D, strided last dimension, misaligned start, a stride of odd bytes, broadcast
    dimensions of size 1 and longer, and several tensors at once."""
    from flashtile.ops.common.descriptors import tma_ready

    def ready(x):
        if x.dim() != 4 or x.stride(3) != 1 or x.data_ptr() % 16:
            return False
        return all(
            stride * x.element_size() % 16 == 0 and not (stride == 0 and size > 1)
            for size, stride in zip(x.shape[:3], x.stride()[:3], strict=True)
        )

    base = torch.empty(2, 8, 4, 64, dtype=torch.bfloat16)
    row = torch.empty(1, 1, 1, 64, dtype=torch.float16)
    layouts = [
        base, base[0], base[..., ::2], base.flatten()[1:].view(-1)[: 2 * 8 * 4 * 56].view(2, 8, 4, 56),
        torch.empty(2, 8, 4, 68, dtype=torch.bfloat16)[..., :64], torch.empty(2, 8, 4, 72, dtype=torch.bfloat16),
        row.expand(2, 8, 4, 64), row.expand(1, 8, 1, 64), row.expand(1, 1, 1, 64), base[:, :, :1].expand(2, 8, 4, 64),
        base.transpose(1, 2), torch.empty(2, 8, 4, 64, dtype=torch.float32)[:, 1:],
    ]  # fmt: skip
    answers = [ready(x) for x in layouts]
    assert True in answers and False in answers
    for x, answer in zip(layouts, answers, strict=True):
        assert tma_ready(x) == answer
        assert tma_ready(base, x) == answer and tma_ready(x, base) == answer
