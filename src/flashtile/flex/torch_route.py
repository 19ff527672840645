"""flex_attention in PyTorch operations: the CPU path, and the CUDA path for mods the Triton kernel cannot take.

For each query block of the block mask, an online softmax runs over that block's computed key blocks (partial or
full for some batch entry or head; skipped blocks are never touched), a chunk of at most ``KV_CHUNK`` keys at a
time: scores in float32, score_mod and mask_mod evaluated on the chunk's index tensors (``mods``), mask_mod only
where some block of the chunk is partial. With autograd on, a second pass builds the output so that its gradient
is FlashAttention's (``_query_block``). Each query block runs under ``torch.utils.checkpoint``, so the backward
recomputes its scores instead of keeping them: memory stays linear in the lengths, and autograd reaches q, k, v
and every tensor the mods capture (a bias table that requires grad gets its gradient).

A row that attends to no key gets output 0 and LSE -inf, as FlexAttention gives.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from flashtile.flex.block_mask import FULL, PARTIAL, BlockMask, block_kinds
from flashtile.flex.mods import MaskMod, ScoreMod, apply_score_mod, evaluate_mask, index

KV_CHUNK = 1024
"""The most keys one step of the online softmax takes (whole key blocks; at least one block)."""


def _chunks(blocks: list[int], kv_block: int) -> list[list[int]]:
    """The key blocks in groups of at most KV_CHUNK keys (at least one block each)."""
    per = max(1, KV_CHUNK // kv_block)
    return [blocks[i : i + per] for i in range(0, len(blocks), per)]


def _query_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, blocks: list[int], kinds: torch.Tensor,
    score_mod: ScoreMod | None, mask_mod: MaskMod, scale: float, kv_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Output (B, Hq, M, Ev) in q's dtype, LSE and the largest score after the mods (B, Hq, M) float32 (-inf in a
    row that sees no key; no gradient) of the query rows q (B, Hq, M, E), which start at row ``start``, over the key
    blocks ``blocks`` (kinds: (Bm, Hm, Kb) int8 of this query block).

    Without autograd, one online-softmax pass. With it, a first pass without autograd finds each row's LSE, and a
    second sums P V with P = exp(S - LSE) and the LSE held fixed, its dependence on the scores restored by a term
    Z - Z.detach() (Z = sum P, whose value is 0 and whose gradient is P): autograd then differentiates as
    FlashAttention's backward does, dS = P (dP - delta) with delta = rowsum(dO * O), instead of through the online
    rescaling, whose gradient loses accuracy where P is close to 0 or 1."""
    batch, nheads, rows, _ = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    device = q.device
    b, h, q_idx = index(0, batch, device), index(0, nheads, device), index(start, start + rows, device)
    q32 = q.float().reshape(batch, nheads_k, group * rows, -1)  # the query heads of a kv head side by side
    chunks = [
        (
            torch.cat([index(j * kv_block, min((j + 1) * kv_block, seqlen_k), device) for j in chunk]),
            chunk == list(range(chunk[0], chunk[0] + len(chunk))),
        )  # fmt: skip
        for chunk in _chunks(blocks, kv_block)
    ]

    def scores(cols: torch.Tensor, contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores after the mods, -inf where hidden) [B, Hq, M, n] and V [B, Hk, n, Ev] of the keys ``cols``
        (``contiguous``: consecutive key blocks, read as a slice rather than gathered)."""
        if contiguous:
            start_k = int(cols[0])
            k_c, v_c = k[:, :, start_k : start_k + len(cols)].float(), v[:, :, start_k : start_k + len(cols)].float()
        else:
            k_c, v_c = k.index_select(2, cols).float(), v.index_select(2, cols).float()
        # [B, Hk, G*M, E] @ [B, Hk, E, n] -> [B, Hq, M, n]
        s = (q32 @ k_c.transpose(-2, -1)).reshape(batch, nheads, rows, -1) * scale
        if score_mod is not None:
            s = apply_score_mod(score_mod, s, b, h, q_idx, cols)
        kind = kinds[:, :, (cols // kv_block).long()][:, :, None, :]  # (Bm, Hm, 1, n)
        if (kind == FULL).all():  # nothing hidden in this chunk
            return s, v_c
        attend = kind == FULL
        if (kind == PARTIAL).any():
            attend = attend | ((kind == PARTIAL) & evaluate_mask(mask_mod, b, h, q_idx, cols))
        return torch.where(attend, s, float("-inf")), v_c

    def pv(p: torch.Tensor, v_c: torch.Tensor) -> torch.Tensor:
        # [B, Hk, G*M, n] @ [B, Hk, n, Ev] -> [B, Hq, M, Ev]
        return (p.reshape(batch, nheads_k, group * rows, -1) @ v_c).reshape(batch, nheads, rows, -1)

    differentiable = torch.is_grad_enabled()
    m = torch.full((batch, nheads, rows), float("-inf"), device=device)
    l = torch.zeros((batch, nheads, rows), device=device)  # noqa: E741
    acc = torch.zeros((batch, nheads, rows, v.shape[-1]), device=device)
    with torch.no_grad():
        for cols, contiguous in chunks:
            s, v_c = scores(cols, contiguous)
            m_new = torch.maximum(m, s.amax(-1))
            shift = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: exp gives 0
            p = torch.exp(s - shift[..., None])
            alpha = torch.exp(m - shift)
            l = l * alpha + p.sum(-1)  # noqa: E741
            if not differentiable:
                acc = acc * alpha[..., None] + pv(p, v_c)
            m = m_new
    seen = l > 0
    l_safe = torch.where(seen, l, 1.0)
    lse = torch.where(seen, torch.where(seen, m, 0.0) + torch.log(l_safe), float("-inf"))
    if not differentiable:
        return torch.where(seen[..., None], acc / l_safe[..., None], 0.0).to(q.dtype), lse, m
    shift = torch.where(seen, lse, 0.0)
    z = torch.zeros((batch, nheads, rows), device=device)
    for cols, contiguous in chunks:
        s, v_c = scores(cols, contiguous)
        p = torch.exp(s - shift[..., None])
        z = z + p.sum(-1)
        acc = acc + pv(p, v_c)
    dz = torch.where(seen, z - z.detach(), 0.0)  # 0, with the gradient of the LSE: P
    out = torch.where(seen[..., None], acc * torch.exp(-dz)[..., None], 0.0)
    return out.to(q.dtype), torch.where(seen, lse + dz, float("-inf")), m


class _NoKeySeen(torch.autograd.Function):
    """The output (all 0) of a call in which no query attends to any key, connected to q, k and v so that their
    gradients exist (all 0), as any other call's do."""

    @staticmethod
    def forward(ctx, out, q, k, v):
        ctx.inputs = [(x.shape, x.dtype, x.device) for x in (q, k, v)]
        return out.clone()

    @staticmethod
    def backward(ctx, dout):
        return None, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs)


def flex_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None, block_mask: BlockMask,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out (B, Hq, L, Ev) in q's dtype, lse (B, Hq, L) float32, each row's largest score after the mods (B, Hq, L)
    float32, -inf where it sees no key, without a gradient) for q (B, Hq, L, E), k (B, Hk, S, E), v (B, Hk, S, Ev)
    with Hq a multiple of Hk, and a block mask of shape (1 or B, 1 or Hq, L, S) (checked by the caller)."""
    batch, nheads, seqlen_q, _ = q.shape
    q_block, kv_block = block_mask.BLOCK_SIZE
    kinds = block_kinds(block_mask)  # (Bm, Hm, Qb, Kb)
    computed = kinds.amax((0, 1)).bool().cpu()  # (Qb, Kb): blocks some batch entry or head computes
    checkpointed = torch.is_grad_enabled()
    outs, lses, maxes = [], [], []
    for r in range(-(-seqlen_q // q_block)):
        start, stop = r * q_block, min((r + 1) * q_block, seqlen_q)
        blocks = computed[r].nonzero().flatten().tolist()
        if not blocks:  # no key attended: output 0, LSE -inf
            outs.append(q.new_zeros((batch, nheads, stop - start, v.shape[-1])))
            lses.append(torch.full((batch, nheads, stop - start), float("-inf"), device=q.device))
            maxes.append(lses[-1])
            continue
        args = (q[:, :, start:stop], k, v, start, blocks, kinds[:, :, r], score_mod, block_mask.mask_mod, scale,
                kv_block)  # fmt: skip
        run = checkpoint(_query_block, *args, use_reentrant=False) if checkpointed else _query_block(*args)
        for results, result in zip((outs, lses, maxes), run, strict=True):
            results.append(result)
    out = torch.cat(outs, 2) if outs else q.new_zeros((batch, nheads, 0, v.shape[-1]))
    empty = q.new_zeros((batch, nheads, 0), dtype=torch.float32)
    lse, row_max = (torch.cat(x, 2) if x else empty for x in (lses, maxes))
    if checkpointed and not out.requires_grad and any(x.requires_grad for x in (q, k, v)):
        out = _NoKeySeen.apply(out, q, k, v)
    return out, lse, row_max
