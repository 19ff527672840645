"""Attention as Triton kernels: forward, backward, and their tile configs."""

from flashtile.ops.attention.backward import attention_backward, attention_delta
from flashtile.ops.attention.forward import attention_forward

__all__ = ["attention_backward", "attention_delta", "attention_forward"]
