"""Padding helpers with the semantics of flash_attn 2.x's ``flash_attn.bert_padding``.

``unpad_input`` turns a padded batch (batch, seqlen, ...) and its attention mask into the packed
(total_nnz, ...) layout of the varlen functions, with the ``cu_seqlens`` and ``max_seqlen`` they take;
``pad_input`` puts packed rows (e.g. the varlen output) back into a zero-padded batch.
``index_first_axis`` / ``index_put_first_axis`` are the row gather and scatter under both (code that unpads
q, k and v with one mask's indices, as Hugging Face's attention layers do, calls them directly).

Both are differentiable in the tensor they move (the gradient of a gather is a scatter and back),
work for any trailing dims and any dtype, on CPU and CUDA, with no Python loop over the batch.
``unpad_input`` synchronises with the device exactly where flash_attn does: ``torch.nonzero`` (the
number of valid tokens sizes its output) and ``max_seqlen_in_batch`` (a Python int).
"""

from __future__ import annotations

import torch

from flashtile.errors import InputError, InputTypeError

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]

INDEX_DTYPE = torch.int64
"""dtype of ``indices``: positions in the flattened (batch * seqlen) order, as ``torch.nonzero`` gives."""
SEQLEN_DTYPE = torch.int32
"""dtype of ``cu_seqlens`` and ``seqused``, as the varlen kernels take them."""


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of ``input``: flash_attn.bert_padding's gather.

    Args:
        input: (num_rows, ...), any dtype, any trailing dims
        indices: (n,), int64, distinct row numbers in [0, num_rows) (``unpad_input``'s indices)

    Raises:
        flashtile.InputTypeError (a TypeError): an argument that is not a tensor (or an int where one is expected)
        flashtile.InputError (a ValueError and a RuntimeError): shapes or devices that do not fit together, or
            indices outside the rows they index.

    Returns:
        (n, ...) = input[indices]; differentiable: the gradient is scattered back into those rows (each written
        once, as the indices are distinct), and its own gradient gathers again, so double backward works.
    """
    _check_indices(indices, input, "input")
    return _gather_rows(input, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero (first_axis_dim, ...) tensor with rows ``indices`` set to ``values``: flash_attn.bert_padding's
    scatter, the inverse of ``index_first_axis``.

    Args:
        values: (n, ...), any dtype, any trailing dims
        indices: (n,), int64, distinct row numbers in [0, first_axis_dim)
        first_axis_dim: int, rows of the result

    Raises:
        flashtile.InputTypeError (a TypeError): an argument that is not a tensor (or an int where one is expected)
        flashtile.InputError (a ValueError and a RuntimeError): shapes or devices that do not fit together, or
            indices outside the rows they index.

    Returns:
        (first_axis_dim, ...), zeros but for rows ``indices``; differentiable in ``values`` (its gradient is
        the output's gradient at ``indices``).
    """
    _check_indices(indices, values, "values", first_axis_dim)
    return _scatter_rows(values, indices, first_axis_dim)


def _check_indices(indices: object, rows: object, rows_name: str, num_rows: int | None = None, hint: str = "") -> None:
    """Clear errors for the ``indices`` of a gather from ``rows`` (num_rows None) or of a scatter of ``rows``
    into num_rows rows; ``rows_name``: the caller's name for ``rows``; ``hint`` ends the message of an index out
    of range. Index values are checked for CPU tensors only (on CUDA that would synchronise with the device; an
    index out of range fails inside the gather or scatter there)."""
    if not isinstance(rows, torch.Tensor):
        raise InputTypeError(f"{rows_name} must be a torch.Tensor, got {type(rows).__name__}.")
    if rows.dim() < 1:
        raise InputError(f"{rows_name} must be (n, ...) with at least 1 dim, got a 0-d tensor.")
    if not isinstance(indices, torch.Tensor):
        raise InputTypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}.")
    if indices.dim() != 1 or indices.dtype != INDEX_DTYPE:
        raise InputError(
            f"indices must be a 1-D int64 tensor, got shape {tuple(indices.shape)} and dtype {indices.dtype}. "
            "Pass the indices returned by unpad_input (or indices.flatten().long())."
        )
    if indices.device != rows.device:
        raise InputError(f"indices is on {indices.device} but {rows_name} is on {rows.device}; move one.")
    if num_rows is None:
        num_rows = rows.shape[0]
    elif indices.shape[0] != rows.shape[0]:
        raise InputError(
            f"indices has {indices.shape[0]} entries but {rows_name} has {rows.shape[0]} rows (shape "
            f"{tuple(rows.shape)}); they must match: one position per packed row."
        )
    if not torch.compiler.is_compiling() and indices.device.type == "cpu" and indices.numel() > 0:
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= num_rows:
            raise InputError(f"indices must lie in [0, {num_rows}), got values in [{low}, {high}].{hint}")


def _gather_rows(rows: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """rows (n, ...) -> rows[indices] (len(indices), ...), unchecked (``index_first_axis`` checks); the gradient
    is scattered back, not accumulated."""
    return _GatherRows.apply(rows, indices)


def _scatter_rows(values: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """values (len(indices), ...) -> out (num_rows, ...), zeros except out[indices] = values, unchecked."""
    return _ScatterRows.apply(values, indices, num_rows)


class _GatherRows(torch.autograd.Function):
    # The indices are distinct (they come from torch.nonzero), so the backward writes each gradient row
    # once: a plain scatter, cheaper than the accumulating index_put that autograd would use for x[i].
    # Each backward calls the other Function, so double backward works too.

    @staticmethod
    def forward(rows: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return rows.index_select(0, indices)

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, indices = inputs
        ctx.save_for_backward(indices)
        ctx.num_rows = rows.shape[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return _scatter_rows(grad, indices, ctx.num_rows), None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(values: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
        # out of place: under torch 2.11's torch.compile with dynamic shapes the in-place form returned zeros
        return values.new_zeros((num_rows, *values.shape[1:])).index_copy(0, indices, values)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, indices, _ = inputs
        ctx.save_for_backward(indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return _gather_rows(grad, indices), None, None


def _check_mask(name: str, mask: object, hidden_states: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor of shape (batch, seqlen), got {type(mask).__name__}.")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise InputError(
            f"{name} must be 2-D (batch, seqlen) matching hidden_states' first two dims "
            f"{tuple(hidden_states.shape[:2])}, got shape {tuple(mask.shape)}. "
            "hidden_states is (batch, seqlen, ...) with the sequence in dim 1."
        )
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise InputTypeError(
            f"{name} must be bool or an integer dtype (1 = valid token, 0 = padding), got {mask.dtype}. "
            f"For a 0/1 float mask pass {name}.bool(); for an additive mask (0 = keep, -inf = drop) pass "
            f"{name} == 0."
        )
    if mask.device != hidden_states.device:
        raise InputError(f"{name} is on {mask.device} but hidden_states is on {hidden_states.device}; move one.")


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Remove the padding from a batch: keep the tokens selected by ``attention_mask`` (+ ``unused_mask``).

    A token is selected when ``attention_mask`` or ``unused_mask`` is nonzero there. The selected tokens
    are kept in their flattened (batch * seqlen) order, so sequence b occupies rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]`` of the result. ``unused_mask`` marks tokens that are allocated
    but unused: they are kept (and counted in ``cu_seqlens`` and ``max_seqlen_in_batch``) but not in
    ``seqused``, the count of ``attention_mask`` tokens alone. FlashAttention-3's varlen functions take
    ``seqused_q``/``seqused_k`` to use only the first ``seqused[b]`` tokens of each sequence, so put the
    unused tokens of a row after its valid ones (``attention_mask`` wins where both are set).

    Args:
        hidden_states: (batch, seqlen, ...), any dtype, any trailing dims (none included)
        attention_mask: (batch, seqlen), bool or integer, nonzero (1) = valid token, 0 = padding
        unused_mask: optional (batch, seqlen), bool or integer, nonzero (1) = allocated but unused token

    Raises:
        flashtile.InputTypeError (a TypeError): an argument that is not a tensor (or an int where one is expected)
        flashtile.InputError (a ValueError and a RuntimeError): shapes or devices that do not fit together, or
            indices outside the rows they index.

    Returns:
        hidden_states: (total_nnz, ...), the selected tokens, total_nnz = number of selected tokens;
            differentiable: its gradient flows back into the selected rows of the input
        indices: (total_nnz,), int64, positions of the selected tokens in the flattened (batch * seqlen)
            input; pass them to ``pad_input``
        cu_seqlens: (batch + 1,), int32, cumulative selected lengths starting at 0 (``cu_seqlens_q`` or
            ``cu_seqlens_k`` of the varlen functions)
        max_seqlen_in_batch: int, the longest selected length (0 for an empty batch)
        seqused: (batch,), int32, the number of ``attention_mask`` tokens of each sequence (equal to the
            lengths in ``cu_seqlens`` when ``unused_mask`` is None)

    Example:
        >>> x = torch.arange(8.0).reshape(2, 4, 1)  # (batch=2, seqlen=4, 1)
        >>> mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
        >>> x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
        >>> x_unpad.flatten().tolist(), indices.tolist(), cu_seqlens.tolist(), max_seqlen, seqused.tolist()
        ([0.0, 1.0, 2.0, 5.0, 6.0], [0, 1, 2, 5, 6], [0, 3, 5], 3, [3, 2])
        >>> pad_input(x_unpad, indices, 2, 4).flatten().tolist()
        [0.0, 1.0, 2.0, 0.0, 0.0, 5.0, 6.0, 0.0]

    flash_attn counts ``attention_mask + unused_mask`` with ``sum``; here a token counts once wherever
    either mask is nonzero, so ``cu_seqlens[-1] == len(indices)`` also for integer masks holding values
    other than 0 and 1 or overlapping each other (for 0/1 masks that do not overlap, the results are
    identical).
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise InputTypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}.")
    if hidden_states.dim() < 2:
        raise InputError(
            f"hidden_states must be (batch, seqlen, ...) with at least 2 dims, got shape {tuple(hidden_states.shape)}."
        )
    _check_mask("attention_mask", attention_mask, hidden_states)
    used = attention_mask != 0
    if unused_mask is None:
        selected = used
    else:
        _check_mask("unused_mask", unused_mask, hidden_states)
        selected = used | (unused_mask != 0)

    batch, seqlen = selected.shape
    seqlens = selected.sum(dim=-1, dtype=SEQLEN_DTYPE)
    seqused = seqlens if unused_mask is None else used.sum(dim=-1, dtype=SEQLEN_DTYPE)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=SEQLEN_DTYPE), (1, 0))
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()  # host sync (output size)
    max_seqlen_in_batch = int(seqlens.max().item()) if batch > 0 else 0  # host sync, as flash_attn
    torch._check(max_seqlen_in_batch >= 0)  # a length, so torch.compile can trace on (capture_scalar_outputs)
    rows = hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:])
    return _gather_rows(rows, indices), indices, cu_seqlens, max_seqlen_in_batch, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Put packed tokens back into a zero-padded batch: the inverse of ``unpad_input``.

    Args:
        hidden_states: (total_nnz, ...), any dtype, any trailing dims (none included), e.g. the output
            of a varlen function on tokens unpadded by ``unpad_input``
        indices: (total_nnz,), int64, distinct positions in the flattened (batch * seqlen) output, each
            in [0, batch * seqlen): the ``indices`` returned by ``unpad_input``
        batch: int, batch size of the padded output
        seqlen: int, sequence length of the padded output

    Raises:
        flashtile.InputTypeError (a TypeError): an argument that is not a tensor (or an int where one is expected)
        flashtile.InputError (a ValueError and a RuntimeError): shapes or devices that do not fit together, or
            indices outside the rows they index.

    Returns:
        hidden_states: (batch, seqlen, ...), row ``indices[i]`` of the flattened output is
            ``hidden_states[i]``, every other row is zero; differentiable: the gradient of the input is
            the output's gradient at ``indices``

    Example:
        >>> x_unpad = torch.tensor([[1.0], [2.0], [3.0]])  # (total_nnz=3, 1)
        >>> pad_input(x_unpad, torch.tensor([0, 4, 5]), batch=2, seqlen=3).squeeze(-1).tolist()
        [[1.0, 0.0, 0.0], [0.0, 2.0, 3.0]]

    Index values are checked for CPU tensors only (on CUDA that would synchronise with the device); an
    index out of range on CUDA fails inside the scatter. Repeated indices give an unspecified winner.
    """
    for name, value in (("batch", batch), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            raise InputTypeError(f"{name} must be an int, got {type(value).__name__}.")
        if value < 0:
            raise InputError(f"{name} must be >= 0, got {value}.")
    num_rows = batch * seqlen
    hint = " Check batch and seqlen: they must be those of the tensor given to unpad_input."
    _check_indices(indices, hidden_states, "hidden_states", num_rows, hint)
    out = _scatter_rows(hidden_states, indices, num_rows)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
