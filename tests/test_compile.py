"""The custom ops: torch.library's opcheck, and torch.compile(fullgraph=True) without graph breaks."""

from __future__ import annotations

import pytest
import torch

import flashtile
from test_attention import make_inputs


def test_opcheck(path):
    q, k, v, _ = make_inputs(1, 33, 40, 2, 1, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashtile.attention_forward.default, (q, k, v, 0.2, None, 0))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(path, backend):
    q, k, v, dout = make_inputs(2, 45, 45, 2, 2, 32, dtype=torch.bfloat16)

    def attention_block(q, k, v):
        return flashtile.flash_attn_func(q * 1.5, k, v, causal=True).float().square()

    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True, backend=backend)
    results = []
    for fn in (attention_block, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout.float())
        results.append([out, *(t.grad for t in leaves)])
    for eager, traced in zip(*results, strict=True):
        assert torch.equal(eager, traced)
