"""score_mod and mask_mod: evaluating them on index tensors, and the mask_mods that combine others.

A FlexAttention mod is written for one (batch, head, query, key) position, with 0-d tensors as arguments:
``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``. Evaluated
on a tile, they are mapped over the four index dimensions with ``torch.vmap`` (one map per dimension, as
FlexAttention's own eager path does), so any mod written for 0-d tensors works, including ones that index
captured tensors (``bias[h, q_idx, kv_idx]``, ``doc[q_idx] == doc[kv_idx]``) or build constants
(``b.new_ones((), dtype=torch.bool)``). The index tensors are int32 (``torch.int``), as FlexAttention's
kernels pass them; the scores are float32.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from flashtile.errors import InputTypeError

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

INDEX_DTYPE = torch.int32
"""The dtype of the b, h, q_idx and kv_idx tensors a mod receives."""

_INDEX_DIMS = ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None))
"""The vmaps of a mod over (b, h, q_idx, kv_idx), innermost (kv_idx) first: the result has dims (B, H, Q, KV)."""


def _mapped(fn: Callable, score: bool) -> Callable:
    """``fn`` mapped over the 1-D index tensors (b, h, q_idx, kv_idx); with ``score``, also over the matching
    dimension of the (B, H, Q, KV) score tensor that comes first."""
    for dims in _INDEX_DIMS:
        fn = torch.vmap(fn, in_dims=((0,) if score else ()) + dims)
    return fn


def index(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """The index tensor [start, stop) that mods receive (int32)."""
    return torch.arange(start, stop, dtype=INDEX_DTYPE, device=device)


def apply_score_mod(
    score_mod: ScoreMod, scores: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """score_mod at every position of ``scores`` (B, H, Q, KV) float32, whose indices are the 1-D tensors b (B),
    h (H), q_idx (Q) and kv_idx (KV); float32 (B, H, Q, KV)."""
    out = _mapped(score_mod, score=True)(scores, b, h, q_idx, kv_idx)
    return out.to(scores.dtype).expand_as(scores)


def evaluate_mask(mask_mod: MaskMod, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
    """mask_mod at every (b, h, q_idx, kv_idx) of the 1-D index tensors: bool (B, H, Q, KV), True where the key
    is attended."""
    out = _mapped(mask_mod, score=False)(b, h, q_idx, kv_idx)
    return out.to(torch.bool).expand(len(b), len(h), len(q_idx), len(kv_idx))


def noop_mask(batch: torch.Tensor, head: torch.Tensor, token_q: torch.Tensor, token_kv: torch.Tensor) -> torch.Tensor:
    """The mask_mod that hides nothing (FlexAttention's ``noop_mask``): a 0-d True for every batch, head,
    token_q and token_kv (int32 0-d tensors); bool, on the device of ``batch``."""
    return batch.new_ones((), dtype=torch.bool)


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that attends where every one of ``mask_mods`` does (their intersection; with none, every
    position), as FlexAttention's ``and_masks``.

    Raises:
        flashtile.InputTypeError: an argument that is not callable
    """
    return _combined(mask_mods, operator.and_, lambda b: b.new_ones((), dtype=torch.bool))


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that attends where any one of ``mask_mods`` does (their union; with none, no position), as
    FlexAttention's ``or_masks``.

    Raises:
        flashtile.InputTypeError: an argument that is not callable
    """
    return _combined(mask_mods, operator.or_, lambda b: b.new_zeros((), dtype=torch.bool))


def _combined(mask_mods: tuple, combine: Callable, identity: Callable) -> MaskMod:
    """The mask_mod that folds ``mask_mods`` with ``combine`` (an elementwise boolean operator), starting from
    ``identity(b)``: the operator's identity, a 0-d bool tensor on b's device (the result when there are none)."""
    _require_callables(mask_mods)

    def combined(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        result = identity(b)
        for mask_mod in mask_mods:
            result = combine(result, mask_mod(b, h, q_idx, kv_idx))
        return result

    return combined


def _require_callables(mask_mods: tuple) -> None:
    bad = [m for m in mask_mods if not callable(m)]
    if bad:
        raise InputTypeError(f"and_masks and or_masks take mask_mod functions, got {bad!r}: pass functions "
                             "mask_mod(b, h, q_idx, kv_idx) -> bool tensor.")  # fmt: skip
