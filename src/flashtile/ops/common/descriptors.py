"""Tensor descriptors: whether tensors can be read through them (``tma_ready``), the Triton kernels' descriptor of
a (batch, seqlen, nheads, d) tensor (``tile_descriptor``), and descriptors whose constructor checks run once per
layout (``per_layout``).

Triton's and Gluon's ``TensorDescriptor`` check their fields in ``__post_init__`` (rank, 16-byte aligned base and
strides, power-of-2 block, positive shape; Gluon's also the shared layout's element width and swizzle): three
quarters of the 2 µs a Gluon descriptor costs on the development CPU, paid by each of the 4 descriptors of a Gluon
forward and the 7 of a Gluon backward on every call. None of those checks reads more of the base tensor than its
dtype and whether its address is 16-byte aligned, so ``per_layout`` builds and checks a descriptor once per key of
exactly what its fields follow from, and later descriptors of the key from the checked one's fields with the new base.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_LAYOUTS = 256
"""Keys kept before ``_CHECKED`` starts over (shapes are keyed by value, so each new shape adds some)."""

Template = tuple[type, dict]
"""A descriptor's class and fields, its base left out (``template``)."""

_CHECKED: dict[tuple, Template] = {}
"""A checked descriptor's template by ``per_layout``'s key."""


def template(descriptor: object) -> Template:
    """``descriptor``'s class and fields with its base left out, for ``rebase``: holds no tensor."""
    return type(descriptor), {**vars(descriptor), "base": None}


def rebase(made: Template, x: torch.Tensor) -> object:
    """A descriptor with the template's fields and base ``x``, past the constructor's checks: ``x`` must have the
    dtype, alignment, shape and strides of the tensor the template's descriptor was built on."""
    cls, fields = made
    descriptor = object.__new__(cls)
    descriptor.__dict__.update(fields, base=x)
    return descriptor


def per_layout(build: Callable[..., object]) -> Callable[..., object]:
    """``build(x, *params)``, a TensorDescriptor (Triton's or Gluon's) of base ``x`` whose other fields follow from
    x's shape, strides and dtype and from ``params`` (hashable) alone, built and checked by its constructor on the
    first call of a key (build, x's dtype, whether x's address is 16-byte aligned, x's shape and strides, params),
    raising as the constructor does; later calls of the key copy that descriptor's fields with base ``x``. The
    lists in the fields are shared between the descriptors of a key: the launchers only read them."""

    @functools.wraps(build)
    def cached(x: torch.Tensor, *params):
        key = (build, x.dtype, x.data_ptr() % 16 == 0, x.shape, x.stride(), *params)
        checked = _CHECKED.get(key)
        if checked is None:
            made = build(x, *params)
            if len(_CHECKED) >= MAX_LAYOUTS:
                _CHECKED.clear()
            _CHECKED[key] = template(made)
            return made
        return rebase(checked, x)

    return cached


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine can read these (batch, seqlen, heads, d) tensors through tensor descriptors:
    4-D, last dimension contiguous, the start address and every other stride 16-byte aligned, and no
    dimension longer than 1 broadcast (stride 0, as an expanded dout). A fresh contiguous output of such a
    shape always is (head dims are multiples of 8), so the launchers ask about their inputs only."""
    for x in tensors:
        if x.dim() != 4:
            return False
        batch, seqlen, nheads, _ = x.shape
        s_b, s_s, s_h, s_d = x.stride()
        size = x.element_size()  # unrolled over the dimensions: this runs for every input of every launch
        if s_d != 1 or x.data_ptr() % 16 or s_b * size % 16 or s_s * size % 16 or s_h * size % 16:
            return False
        if (s_b == 0 and batch > 1) or (s_s == 0 and seqlen > 1) or (s_h == 0 and nheads > 1):
            return False
    return True


@per_layout
def tile_descriptor(x: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """A tensor descriptor of (batch, seqlen, nheads, d) ``x`` with [1, rows, 1, cols] blocks."""
    return TensorDescriptor(x, shape=list(x.shape), strides=list(x.stride()), block_shape=[1, rows, 1, cols])
