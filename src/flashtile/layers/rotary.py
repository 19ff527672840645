"""Rotary position embedding with flash_attn 2.8's ``flash_attn.layers.rotary`` names, signatures and semantics:
``from flashtile.layers.rotary import apply_rotary_emb, RotaryEmbedding`` works where code imported them from
flash_attn.

The rotation is computed in float32 (float64 for float64 inputs) and rounded once to x's dtype, as flash_attn's
kernel does; it is made of PyTorch operations, so autograd differentiates it (the gradient is the inverse rotation)
and torch.compile traces it. Positions past the tables (seqlen_offsets + index >= seqlen_rotary) are left
unrotated, as in flash_attn.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtile.cpu_decode import rotate

__all__ = [
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
]


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> Tensor:
    """Rotate the first rotary_dim dimensions of x by the angles of its positions.

    Token t of sequence b (at index t of its sequence) is at position seqlen_offsets[b] + t (seqlen_offsets[b]
    is the int itself for an int). With cos[p] = cos(p * theta), sin[p] likewise, the pairs of dimensions
    (f, f + rotary_dim / 2) (GPT-NeoX style; with interleaved=True the pairs (2f, 2f + 1), GPT-J style) become
        (x1 * cos[p, f] - x2 * sin[p, f], x1 * sin[p, f] + x2 * cos[p, f]).
    Dimensions past rotary_dim are unchanged.

    Args:
        x: (batch_size, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens
        cos, sin: (seqlen_rotary, rotary_dim / 2), rotary_dim <= headdim; any floating dtype
        interleaved: rotate pairs (2f, 2f + 1) instead of (f, f + rotary_dim / 2)
        inplace: write the result into x and return x
        seqlen_offsets: int, or (batch_size,) int tensor: the position of each sequence's first token (e.g. the
            length of a KV cache before it)
        cu_seqlens: None, or (batch_size + 1,) int32 cumulative lengths: x packs the sequences one after another
        max_seqlen: int, the longest sequence (with cu_seqlens; checked against seqlen_rotary)

    Returns:
        out: shaped like x, x's dtype (x itself if inplace)
    """
    _check_tables(cos, sin, x)
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(
                f"x must be (batch_size, seqlen, nheads, headdim) without cu_seqlens, got {tuple(x.shape)}."
            )
        batch, seqlen = x.shape[:2]
        offsets = _offsets(seqlen_offsets, batch, x.device)
        positions = (torch.arange(seqlen, device=x.device)[None, :] + offsets[:, None]).flatten()
    else:
        if x.dim() != 3:
            raise ValueError(f"x must be (total_seqlen, nheads, headdim) with cu_seqlens, got {tuple(x.shape)}.")
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor (batch_size + 1,) of cumulative sequence lengths.")
        seqlen = max_seqlen if max_seqlen is not None else x.shape[0]
        offsets = _offsets(seqlen_offsets, cu_seqlens.shape[0] - 1, x.device)
        tokens = torch.arange(x.shape[0], device=x.device)
        sequence = torch.searchsorted(cu_seqlens[1:].to(tokens.dtype), tokens, right=True).clamp(max=len(offsets) - 1)
        positions = tokens - cu_seqlens.to(tokens.dtype)[sequence] + offsets[sequence]
    if seqlen > cos.shape[0]:
        raise ValueError(
            f"cos and sin have {cos.shape[0]} rows (positions) for sequences of {seqlen} tokens: seqlen_rotary must be "
            "at least the sequence length. Build the tables for more positions."
        )
    rows = x.reshape(-1, *x.shape[-2:])
    out = rotate(rows, *_tables_at(cos, sin, positions), torch.arange(rows.shape[0], device=x.device), interleaved)
    out = out.view(x.shape)
    if not inplace:
        return out
    rotary_dim = 2 * cos.shape[1]
    x[..., :rotary_dim].copy_(out[..., :rotary_dim])
    return x


apply_rotary_emb_func = apply_rotary_emb
"""flash_attn's older name of ``apply_rotary_emb``."""


def apply_rotary_emb_qkv_(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos_k: Tensor | None = None,
    sin_k: Tensor | None = None,
    interleaved: bool = False,
    seqlen_offsets: int | Tensor = 0,
    num_heads_q: int | None = None,
) -> Tensor:
    """``apply_rotary_emb`` in place on the queries and keys of a packed qkv (the values are untouched).

    Args:
        qkv: (batch_size, seqlen, 3, nheads, headdim), or (batch_size, seqlen, num_heads_q + 2 * num_heads_k,
            headdim) for MQA / GQA (then num_heads_q is required)
        cos, sin: (seqlen_rotary, rotary_dim / 2), for q (and for k when cos_k / sin_k are None)
        cos_k, sin_k: optional tables for k (XPos scales q and k differently)
        interleaved, seqlen_offsets: as ``apply_rotary_emb``
        num_heads_q: the number of query heads of a 4-D qkv

    Returns:
        qkv, rotated in place
    """
    if qkv.dim() == 5 and qkv.shape[2] == 3:
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    elif qkv.dim() == 4 and num_heads_q is not None and (qkv.shape[2] - num_heads_q) % 2 == 0 < num_heads_q:
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + num_heads_k]
    else:
        raise ValueError(
            f"qkv must be (batch_size, seqlen, 3, nheads, headdim), or (batch_size, seqlen, num_heads_q + 2 * "
            f"num_heads_k, headdim) with num_heads_q given; got shape {tuple(qkv.shape)} and num_heads_q={num_heads_q}."
        )
    apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    cos_k, sin_k = (cos, sin) if cos_k is None and sin_k is None else (cos_k, sin_k)
    apply_rotary_emb(k, cos_k, sin_k, interleaved, True, seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(
    kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, seqlen_offsets: int | Tensor = 0
) -> Tensor:
    """``apply_rotary_emb`` in place on the keys of a packed kv (batch_size, seqlen, 2, nheads, headdim); returns kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch_size, seqlen, 2, nheads, headdim), got shape {tuple(kv.shape)}.")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding (RoFormer) as flash_attn's module: cos/sin tables of positions times
    ``base ** (-2f / dim)``, cached and grown on demand, applied in place to qkv or to q and kv.

    With ``scale_base`` (XPos, Sun et al. 2022) queries are scaled by ``scale ** ((p - seqlen // 2) / scale_base)``
    and keys by its inverse, ``scale = (2f + 0.4 dim) / (1.4 dim)``.

    Args:
        dim: rotary_dim, the number of rotated dimensions of each head (even)
        base: the frequency base
        interleaved: rotate pairs (2f, 2f + 1) instead of (f, f + dim / 2)
        scale_base: None, or XPos's scale base (e.g. 512)
        device: where the buffers are made
    """

    def __init__(
        self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None, device=None
    ):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
            raise ValueError(f"dim must be a positive even int (the rotated dimensions of a head), got {dim!r}.")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._inverse_frequencies(device), persistent=False)
        self.register_buffer("scale", None if scale_base is None else self._xpos_scale(device), persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inverse_frequencies(self, device=None) -> Tensor:
        return self.base ** -(torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _xpos_scale(self, device=None) -> Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        """(Re)build the tables for positions [0, seqlen) when they are shorter, elsewhere, of another dtype, or
        inference tensors while training. Angles in float32 whatever the module's dtype (positions are large)."""
        cached = self._cos_cached
        if (
            cached is not None and seqlen <= self._seq_len_cached and cached.device == device and cached.dtype == dtype
            and not (self.training and cached.is_inference())
        ):  # fmt: skip
            return
        self._seq_len_cached = seqlen
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inverse_frequencies(device)
        angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq.to(device))
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._xpos_scale(self.scale.device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=device) - seqlen // 2) / self.scale_base
        scale = scale.to(device) ** power[:, None]
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(
        self,
        qkv: Tensor,
        kv: Tensor | None = None,
        seqlen_offset: int | Tensor = 0,
        max_seqlen: int | None = None,
        num_heads_q: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Rotate in place.

        Args:
            qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)
                with num_heads_q; with kv given, just q (batch, seqlen, nheads, headdim)
            kv: None, or (batch, seqlen, 2, nheads_k, headdim)
            seqlen_offset: int, or (batch,) tensor: the position of each sequence's first token; with a tensor pass
                max_seqlen, the number of positions the tables must cover
            max_seqlen: int or None (above)
            num_heads_q: the query heads of a 4-D qkv

        Returns:
            qkv, or (q, kv) when kv is given, rotated in place
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("seqlen_offset is a tensor: pass max_seqlen, the number of positions to cover.")
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv, self._cos_cached, self._sin_cached, cos_k, sin_k, self.interleaved, seqlen_offset, num_heads_q
            )
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True, seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, self.interleaved, seqlen_offset)


def _check_tables(cos: object, sin: object, x: object) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}.")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating (seqlen_rotary, rotary_dim / 2) tensor, got {_described(t)}.")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}.")
    if not 0 < 2 * cos.shape[1] <= x.shape[-1]:
        raise ValueError(
            f"rotary_dim (2 x cos.shape[1] = {2 * cos.shape[1]}) must lie in [2, headdim = {x.shape[-1]}]."
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos and sin must be on x's device ({x.device}), got {cos.device} and {sin.device}.")


def _described(t: object) -> str:
    return f"shape {tuple(t.shape)}, {t.dtype}" if isinstance(t, Tensor) else type(t).__name__


def _offsets(seqlen_offsets: int | Tensor, batch: int, device: torch.device) -> Tensor:
    """seqlen_offsets as a (batch,) int64 tensor on ``device``."""
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.is_floating_point():
            raise ValueError(
                f"seqlen_offsets must be an int or an integer tensor of shape (batch_size,) = ({batch},), got "
                f"{_described(seqlen_offsets)}."
            )
        return seqlen_offsets.to(device=device, dtype=torch.int64).clamp(min=0)
    if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int) or seqlen_offsets < 0:
        raise ValueError(f"seqlen_offsets must be an int >= 0 or a (batch_size,) tensor, got {seqlen_offsets!r}.")
    return torch.full((batch,), seqlen_offsets, dtype=torch.int64, device=device)


def _tables_at(cos: Tensor, sin: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of cos and sin at ``positions``; past the tables' end cos = 1 and sin = 0 (no rotation)."""
    inside = (positions < cos.shape[0])[:, None]
    rows = positions.clamp(max=cos.shape[0] - 1)
    return torch.where(inside, cos[rows], 1.0), torch.where(inside, sin[rows], 0.0)
