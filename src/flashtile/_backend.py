"""The one place that decides which implementation runs.

| input                                                        | path                              |
|--------------------------------------------------------------|-----------------------------------|
| CUDA tensor                                                  | Triton kernels, compiled          |
| CPU tensor and ``TRITON_INTERPRET=1`` set before import      | the same Triton kernels, interpreted |
| CPU tensor otherwise                                         | ``flashtile.cpu``: PyTorch, tiled  |

Nothing else in flashtile reads the environment. Each path module provides
``attention_forward(q, k, v, softmax_scale, window_left, window_right, alibi_slopes, softcap,
learnable_sink, dropout_p, rng_state) -> (out, lse)``, ``attention_backward(dout, q, k, v, out, lse,
softmax_scale, window_left, window_right, dlse, alibi_slopes, softcap, learnable_sink, dropout_p,
rng_state) -> (dq, dk, dv)``,
``attention_delta(dout, out, dlse) -> delta``, and ``varlen_attention_forward`` /
``varlen_attention_backward``: the same on packed (total, nheads, headdim) batches with cu_seqlens.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def path_name(device: torch.device) -> str:
    """'triton' (compiled), 'triton-interpreter' or 'cpu' for tensors on ``device``."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton-interpreter" if TRITON_INTERPRET else "cpu"
    raise ValueError(
        f"flashtile runs on CUDA and CPU tensors, got a tensor on {device}. Move the inputs with .cuda() or .cpu()."
    )


def attention_path(device: torch.device) -> ModuleType:
    """The module that implements attention for tensors on ``device``."""
    if path_name(device) == "cpu":
        from flashtile import cpu

        return cpu
    from flashtile.ops import attention

    return attention
