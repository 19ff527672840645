"""Attention on float8 inputs: the forward's Triton kernel, its configs and the family's ``qualifies``."""

from flashtile.ops.fp8.forward import attention_forward, qualifies

__all__ = ["attention_forward", "qualifies"]
