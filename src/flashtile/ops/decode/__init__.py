"""Decoding with a KV cache as Triton kernels: append with rotary, split-KV attention (splits merged in-kernel)."""

from flashtile.ops.decode.forward import kvcache_forward

__all__ = ["kvcache_forward"]
