"""The Triton path of flex_attention: a kernel module per set of mods, its launchers and the autograd Function.

``kernels_for(score_mod, mask_mod, device)`` translates the mods (``codegen``, traced on ``device``), fills the
template (``template.py``) with them, writes the source to a cache file named by its hash (``@triton.jit`` reads a
function's source from its file) and imports it; modules are kept per source, and translations per mod (keyed by
what the mod reads, ``codegen.key``: a global, closure variable or attribute rebound to another tensor or number is
traced again).
``unsupported`` says why a call cannot run here (the caller then takes the PyTorch route).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

import torch

from flashtile.flex import codegen
from flashtile.flex.block_mask import BlockMask, tiles
from flashtile.flex.mods import MaskMod, ScoreMod, noop_mask
from flashtile.ops._alloc import empty_output
from flashtile.ops._launch import launch
from flashtile.ops.attention.backward import attention_delta
from flashtile.ops.attention.configs import TileConfig, config
from flashtile.ops.common.grid import cdiv, head_grid, padded_head_dim

TEMPLATE = Path(__file__).with_name("template.py")
MAX_HEAD_DIM = 256
MIN_TILE = 16
"""The smallest tile side tl.dot takes: block sizes must be multiples of a power of two at least this large."""
_MODULES: dict[str, types.ModuleType] = {}
_TRANSLATIONS: dict[tuple, tuple[types.ModuleType, codegen.Captured] | str] = {}
MAX_TRANSLATIONS = 256


def _identity(score, b, h, q_idx, kv_idx):
    return score


def _cache_dir() -> Path:
    """Where generated kernel sources are written: flashtile-flex under the system's temporary directory."""
    path = Path(tempfile.gettempdir()) / "flashtile-flex"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _import(source: str) -> types.ModuleType:
    """The module of ``source``, written to the cache directory and imported (once per source)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    if digest not in _MODULES:
        path = _cache_dir() / f"flex_{digest}.py"
        if not path.exists() or path.read_text() != source:
            tmp = path.with_suffix(f".{id(source)}.tmp")
            tmp.write_text(source)
            tmp.replace(path)
        name = f"flashtile_flex_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _MODULES[digest] = module
    return _MODULES[digest]


def kernels_for(
    score_mod: ScoreMod | None, mask_mod: MaskMod | None, device: torch.device
) -> tuple[types.ModuleType, codegen.Captured]:
    """(kernel module, captured tensors) for these mods; ``codegen.Unsupported`` if they fall outside the subset."""
    score_mod, mask_mod = score_mod or _identity, mask_mod or noop_mask
    key = (codegen.key(score_mod), codegen.key(mask_mod), device)  # rebound tensors, numbers, functions: traced again
    found = _TRANSLATIONS.get(key)
    if isinstance(found, str):
        raise codegen.Unsupported(found)
    if found is not None:
        return found
    try:
        captured = codegen.Captured()
        names = ("score", "b", "h", "q_idx", "kv_idx")
        leaves: list[torch.Tensor] = []
        joint = codegen.trace(codegen.score_grad_function(score_mod, leaves), (*names, "grad"), device, leaves)
        traced = codegen.trace(score_mod, names, device)
        parts = [
            codegen.translate(traced, "score_mod", names, captured, "score"),
            codegen.translate(codegen.trace(mask_mod, names[1:], device), "mask_mod", names[1:], captured, "mask"),
            codegen.translate(joint, "score_grad", (*names, "grad"), captured, "grad"),
        ]
    except codegen.Unsupported as error:
        found = str(error)
    else:
        identity = f"SCORE_MOD_IS_IDENTITY = {codegen.returns_score(traced)}\n"
        source = "\n\n".join([TEMPLATE.read_text(), codegen.HELPERS, *parts, identity])
        found = _import(source.replace(", CAPTURED", captured.params())), captured
    if len(_TRANSLATIONS) >= MAX_TRANSLATIONS:
        _TRANSLATIONS.clear()
    _TRANSLATIONS[key] = found
    return kernels_for(score_mod, mask_mod, device)


def _config(pass_name: str, q: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> TileConfig:
    """The tile config of ``pass_name`` (``configs``) with its tiles shrunk, where needed, to the largest power of
    two dividing the block mask's (query, key) block sizes, so that a tile never straddles two sparse blocks."""
    cfg = config(pass_name, q.device, q.shape[-1], v.shape[-1])
    sizes = block_mask.BLOCK_SIZE
    block_m, block_n = (min(tile, size & -size) for tile, size in zip((cfg.block_m, cfg.block_n), sizes, strict=True))
    return dataclasses.replace(cfg, block_m=block_m, block_n=block_n)


def unsupported(query, key, value, score_mod: ScoreMod | None, block_mask: BlockMask) -> str | None:
    """Why the Triton kernel cannot run this call (None if it can): head dims over MAX_HEAD_DIM, block sizes the
    tiles cannot divide, mods outside the translated subset (``codegen``), captured tensors on another device."""
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM}"
    if min(size & -size for size in block_mask.BLOCK_SIZE) < MIN_TILE:
        return f"BLOCK_SIZE {block_mask.BLOCK_SIZE}: the kernel needs block sizes that are multiples of 16"
    if block_mask.q_num_blocks is None and torch.is_grad_enabled():
        return "a block mask without its q_* lists (the backward pass needs them)"
    try:
        _, captured = kernels_for(score_mod, block_mask.mask_mod, query.device)
    except codegen.Unsupported as error:
        return str(error)
    if any(t.device != query.device for t in captured.tensors):
        return "a captured tensor on another device than the inputs"
    return None


def _lists(block_mask: BlockMask, side: str) -> tuple[list[torch.Tensor], list[int], bool]:
    """The (num, indices, full num, full indices) int32 tensors of the block mask's kv or q side, their
    (num b, num h, indices b, indices h, indices row) strides with broadcast dimensions at 0, and whether there are
    full blocks."""
    num, idx = getattr(block_mask, f"{side}_num_blocks"), getattr(block_mask, f"{side}_indices")
    full_num, full_idx = getattr(block_mask, f"full_{side}_num_blocks"), getattr(block_mask, f"full_{side}_indices")
    has_full = full_num is not None
    num, idx = num.to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()
    full_num = full_num.to(torch.int32).contiguous() if has_full else num
    full_idx = full_idx.to(torch.int32).contiguous() if has_full else idx
    if has_full and full_idx.shape != idx.shape:  # the kernels share one set of strides
        width = max(idx.shape[-1], full_idx.shape[-1])
        idx, full_idx = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (idx, full_idx))
    broadcast = [0 if num.shape[d] == 1 else 1 for d in (0, 1)]
    strides = [num.stride(0) * broadcast[0], num.stride(1) * broadcast[1], idx.stride(0) * broadcast[0],
               idx.stride(1) * broadcast[1], idx.stride(2)]  # fmt: skip
    return [num, idx, full_num, full_idx], strides, has_full


def _launch(
    kernel, programs: int, heads: int, args: tuple, q, v, block_mask: BlockMask, cfg: TileConfig, has_full: bool,
    fold_scale: bool, **flags: bool,
) -> None:  # fmt: skip
    """``kernel`` over (``programs`` tiles, ``heads``, batch) with ``cfg``'s tiles, warps and stages; ``flags``: the
    kernel's own constexprs (EVEN_M or EVEN_N, ``_even``; the forward's OUTPUT_MAX)."""
    constexprs = {
        "HEAD_DIM": q.shape[-1], "HEAD_DIM_V": v.shape[-1], "BLOCK_D": padded_head_dim(q.shape[-1]),
        "BLOCK_DV": padded_head_dim(v.shape[-1]), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "SPARSE_Q": block_mask.BLOCK_SIZE[0], "SPARSE_KV": block_mask.BLOCK_SIZE[1], "HAS_FULL": has_full,
        "FOLD_SCALE": fold_scale, **flags,
    }  # fmt: skip
    launch(kernel, head_grid(programs, q.shape[0], heads), args, constexprs, num_warps=cfg.num_warps,
           num_stages=cfg.num_stages)  # fmt: skip


def _even(seqlen: int, block_size: int) -> bool:
    """Whether ``seqlen`` is a multiple of the block mask's block size on its side: every tile of every listed block
    then lies inside the sequence, and the kernels load and score those tiles without bounds checks (EVEN_M,
    EVEN_N). The block table lists only blocks inside the lengths (``BlockMask.kv_blocks``)."""
    return seqlen % block_size == 0


def _fold_scale(module, scale: float) -> bool:
    """The kernels' FOLD_SCALE: score_mod is the identity and the scale positive, so the scale joins log2(e) in the
    factor applied to the raw products inside exp2 (a positive factor keeps the row max and the -inf of hidden
    positions)."""
    return module.SCORE_MOD_IS_IDENTITY and scale > 0


def _strides(*tensors: torch.Tensor) -> list[int]:
    """(batch, head, row) strides of (B, H, N, D) tensors, in order."""
    return [s for t in tensors for s in (t.stride(0), t.stride(1), t.stride(2))]


def _forward(q, k, v, module, captured, block_mask: BlockMask, scale: float, output_max: bool):
    """(out, lse, the rows' largest scores: (B, H, L) float32 with ``output_max``, else None)."""
    batch, nheads, seqlen_q, _ = q.shape
    out = empty_output((batch, nheads, seqlen_q, v.shape[-1]), q.dtype, q.device)
    lse = empty_output((batch, nheads, seqlen_q), torch.float32, q.device)
    row_max = empty_output((batch, nheads, seqlen_q), torch.float32, q.device) if output_max else None
    lists, list_strides, has_full = _lists(block_mask, "kv")
    cfg = _config("flex_forward", q, v, block_mask)
    args = (q, k, v, out, lse, row_max, *lists, *_strides(q, k, v, out), *list_strides, nheads,
            nheads // k.shape[1], seqlen_q, k.shape[2], scale, *captured.args())  # fmt: skip
    _launch(module.flex_forward, cdiv(seqlen_q, cfg.block_m), nheads, args, q, v, block_mask, cfg, has_full,
            _fold_scale(module, scale), EVEN_N=_even(k.shape[2], block_mask.BLOCK_SIZE[1]),
            OUTPUT_MAX=output_max)  # fmt: skip
    return out, lse, row_max


def _backward(dout, q, k, v, out, lse, dlse, module, captured, block_mask: BlockMask, scale: float):
    """(dq, dk, dv, gradients of the captured tensors that require grad, in their dtypes)."""
    _, nheads, seqlen_q, _ = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    # the built-in backward's delta kernel, which reads (B, N, H, D) strides: given the transposed views
    delta = attention_delta(dout.transpose(1, 2), out.transpose(1, 2), None if dlse is None else dlse.contiguous())
    dq = empty_output(q.shape, q.dtype, q.device)
    dk = empty_output(k.shape, k.dtype, k.device)
    dv = empty_output(v.shape, v.dtype, v.device)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in captured.needing_grad]
    common = (nheads, nheads // nheads_k, seqlen_q, seqlen_k, scale, *captured.args(grads))
    kv_lists, kv_strides, has_full = _lists(block_mask, "kv")
    cfg = _config("flex_backward_dq", q, v, block_mask)
    args = (q, k, v, dout, lse, delta, dq, *kv_lists, *_strides(q, k, v, dout, dq), *kv_strides, *common)
    fold_scale = _fold_scale(module, scale)
    _launch(module.flex_backward_dq, cdiv(seqlen_q, cfg.block_m), nheads, args, q, v, block_mask, cfg, has_full,
            fold_scale, EVEN_N=_even(seqlen_k, block_mask.BLOCK_SIZE[1]))  # fmt: skip
    q_lists, q_strides, has_full = _lists(block_mask, "q")
    cfg = _config("flex_backward_dkdv", q, v, block_mask)
    args = (q, k, v, dout, lse, delta, dk, dv, *q_lists, *_strides(q, k, v, dout, dk, dv), *q_strides, *common)
    _launch(module.flex_backward_dkdv, cdiv(seqlen_k, cfg.block_n), nheads_k, args, q, v, block_mask, cfg, has_full,
            fold_scale, EVEN_M=_even(seqlen_q, block_mask.BLOCK_SIZE[0]))  # fmt: skip
    return dq, dk, dv, [g.to(t.dtype) for g, t in zip(grads, captured.needing_grad, strict=True)]


class _FlexFunction(torch.autograd.Function):
    """out, lse, row max = flex attention of q, k, v (B, H, N, D) with the translated mods (the row max only with
    ``output_max``, and without a gradient); gradients for q, k, v and for the captured tensors that require grad
    (passed last, so that autograd hands them theirs)."""

    @staticmethod
    def forward(ctx, q, k, v, module, captured, block_mask, scale, output_max, *needing_grad):
        out, lse, row_max = _forward(q, k, v, module, captured, block_mask, scale, output_max)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.module, ctx.captured, ctx.block_mask, ctx.scale = module, captured, block_mask, scale
        if row_max is not None:
            ctx.mark_non_differentiable(row_max)
        return out, lse, row_max

    @staticmethod
    def backward(ctx, dout, dlse, _):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, grads = _backward(
            dout, q, k, v, out, lse, dlse, ctx.module, ctx.captured, ctx.block_mask, ctx.scale
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, *grads


def flex_attention_triton(
    q, k, v, score_mod: ScoreMod | None, block_mask: BlockMask, scale: float, output_max: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(out, lse, the rows' largest scores after the mods where ``output_max``, else None) by the Triton kernels,
    for a call ``unsupported`` lets through; they walk the mask's finer table where ``create_block_mask`` kept one
    (``block_mask.tiles``)."""
    module, captured = kernels_for(score_mod, block_mask.mask_mod, q.device)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _FlexFunction.apply(q, k, v, module, captured, tiles(block_mask), scale, output_max, *captured.needing_grad)
