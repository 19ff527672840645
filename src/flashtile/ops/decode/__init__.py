"""Decoding with a KV cache as one Triton kernel: appends the new tokens (keys rotated), attends, merges splits."""

from flashtile.ops.decode.forward import kvcache_forward, prepare

__all__ = ["kvcache_forward", "prepare"]
