"""Programmable attention with FlexAttention's API: ``flex_attention``, ``create_block_mask``, ``create_mask``,
``BlockMask`` and the mask combinators. Each file has one role: ``api`` (the function and its checks),
``block_mask`` (the block table and the dense mask), ``mods`` (evaluating score_mod and mask_mod on index tensors),
``torch_route`` (the PyTorch implementation), ``codegen`` (mods translated into Triton source), ``kernel`` (the
Triton kernels and their launcher) and ``patterns`` (mods recognised as flashtile's built-in options, which then run
the built-in attention)."""

from flashtile.flex.api import AuxOutput, AuxRequest, FlexKernelOptions, flex_attention
from flashtile.flex.block_mask import BlockMask, create_block_mask, create_mask
from flashtile.flex.mods import and_masks, noop_mask, or_masks

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "FlexKernelOptions",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
]
