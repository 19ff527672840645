"""Output allocation for every launcher.

Tests set ``POISON_OUTPUTS = True`` so outputs start as NaN (or -1 for integers): an element a
kernel forgets to write then fails the comparison instead of passing by luck.
"""

import torch

POISON_OUTPUTS = False


def empty_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, or a NaN-filled tensor while ``POISON_OUTPUTS`` is set."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def empty_output_like(x: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``torch.empty_like(x)`` (on ``device``, x's by default): x's strides where x is dense and non-overlapping,
    contiguous otherwise; NaN-filled while ``POISON_OUTPUTS`` is set."""
    if POISON_OUTPUTS:
        return torch.full_like(x, float("nan") if x.dtype.is_floating_point else -1, device=device)
    return torch.empty_like(x, device=device)
