"""Attention as Triton kernels: forward, backward, and their tile configs."""

from flashtile.ops.attention.backward import attention_backward, attention_delta, varlen_attention_backward
from flashtile.ops.attention.forward import attention_forward, varlen_attention_forward

__all__ = [
    "attention_backward",
    "attention_delta",
    "attention_forward",
    "varlen_attention_backward",
    "varlen_attention_forward",
]
