"""The GPU a launch runs on: its inputs' device, and that device's size."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def on_input_device(launcher):
    """``launcher`` run with its first argument's CUDA device as the current one when the current is another.

    Triton launches on the current device and its current stream; flash_attn's functions run on their inputs'
    device whatever the current one is (a device guard), and so do these launchers: without the guard, a call
    with tensors on cuda:1 while cuda:0 is current would launch on cuda:0 with cuda:1's pointers."""

    @functools.wraps(launcher)
    def on_device(x: torch.Tensor, *args, **kwargs):
        device = x.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return launcher(x, *args, **kwargs)
        return launcher(x, *args, **kwargs)

    return on_device
