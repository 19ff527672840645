"""Kernel launches on their inputs' GPU."""

from __future__ import annotations

import functools

import torch


def on_input_device(launcher):
    """``launcher`` run with its first argument's CUDA device as the current one when the current is another.

    Triton launches on the current device and its current stream; flash_attn's functions run on their inputs'
    device whatever the current one is (a device guard), and so do these launchers: without the guard, a call
    with tensors on cuda:1 while cuda:0 is current would launch on cuda:0 with cuda:1's pointers."""

    @functools.wraps(launcher)
    def on_device(x: torch.Tensor, *args, **kwargs):
        if x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return launcher(x, *args, **kwargs)
        return launcher(x, *args, **kwargs)

    return on_device
