"""The built-in attention options a flex_attention call's mods amount to, recognised in their traced graphs
(``codegen.trace``), so that BACKEND "AUTO" runs flashtile's own kernels, the path of ``flash_attn_func``, for them.

Recognition reads the graph's structure; it never calls a mod on sample values. With d = q_idx - kv_idx:

- mask_mod: comparisons of d with an integer constant, in any of the forms ``q_idx >= kv_idx``, ``kv_idx <= q_idx``,
  ``q_idx - kv_idx <= W``, ``q_idx - kv_idx < W``, ``W >= q_idx - kv_idx``, ``kv_idx - q_idx >= -W``,
  ``q_idx > kv_idx - 3`` (any ``lt``, ``le``, ``gt``, ``ge`` or ``eq`` between sums and differences of q_idx,
  kv_idx and integer constants that comes down to d against a constant), combined with ``&`` (``bitwise_and``,
  ``logical_and``, ``and_masks``), ``noop_mask``: the set of positions lo <= d <= hi. It runs on the built-in
  kernels when the interval holds the diagonal (lo <= 0 <= hi): causal is [0, inf), a causal sliding window
  ``(q_idx >= kv_idx) & (q_idx - kv_idx <= W)`` is [0, W] (window_size (W, 0); ``< W`` is [0, W - 1]),
  ``noop_mask`` (-inf, inf). FlexAttention's indices are aligned to the top left and flash_attn's window to the
  bottom right: they coincide when seqlen_q == seqlen_k, the only case routed for an interval other than
  (-inf, inf).
- prefix-LM: ``(kv_idx < P) | (q_idx >= kv_idx)`` (``|``, ``logical_or``, ``or_masks``; the bound in any comparison
  form), no ALiBi, seqlen_q == seqlen_k: each query row sees one range of keys, the prefix's rows keys [0, P), the
  others [0, q_idx]; two built-in calls on those rows (``flex.api._builtin``).
- score_mod: the identity; ``cap * torch.tanh(score / cap)`` (either factor order, cap a positive number) ->
  softcap=cap; ``score + slopes[h] * (kv_idx - q_idx)`` or ``score - slopes[h] * (q_idx - kv_idx)`` (either
  operand order of ``+`` and ``*``; slopes a captured float32 (Hq,) tensor on the inputs' device that does not
  require grad) -> alibi_slopes=slopes, and the same with ``+ slopes[h] * (q_idx - kv_idx)`` -> -slopes;
  the softcapped score plus the ALiBi term (flash_attn's order). flash_attn's ALiBi adds
  -slope * |i - j|, which equals the mod's -slope * d only where d >= 0: ALiBi is routed with a mask whose
  interval starts at 0 (causal or causal window).
- the block mask: its lists must say what its mask_mod says (``_agrees``): a skipped block holds no position the
  interval attends, a full block only such positions (create_block_mask's masks for the mod, torch's too, and
  None, every block full, with no mask_mod).

Anything else (another operation, a captured constant, a float bound, another ``|``, a slope tensor that requires grad,
head dims the built-in kernels do not take) runs the generated kernel; document masks (``doc[q_idx] ==
doc[kv_idx]``) too: the varlen kernels computed them slower than the generated kernel does.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch

from flashtile.checks import MAX_HEAD_DIM
from flashtile.flex import codegen
from flashtile.flex.block_mask import FULL, BlockMask, block_kinds, recall, remember
from flashtile.flex.codegen import op_of, output_node, skip_no_ops
from flashtile.flex.mods import MaskMod, ScoreMod, noop_mask

aten = torch.ops.aten
INF = math.inf
_RECOGNISED: dict[tuple, tuple] = {}
_AGREEING: dict[int, tuple] = {}
MAX_RECOGNISED = 256
_CONSTANT_LIMIT = 2**30
"""Integer constants of a mask_mod are taken up to this size (int32 index arithmetic cannot overflow)."""

_FLIPPED = {aten.ge: aten.le, aten.le: aten.ge, aten.gt: aten.lt, aten.lt: aten.gt, aten.eq: aten.eq}
_AND = (aten.bitwise_and, aten.logical_and)
_OR = (aten.bitwise_or, aten.logical_or)


class MaskForm(NamedTuple):
    """What a recognised mask_mod attends: lo <= q_idx - kv_idx <= hi; and where ``prefix`` is not None, every key
    before ``prefix`` too (prefix-LM)."""

    lo: float
    hi: float
    prefix: int | None = None


class Builtin(NamedTuple):
    """How the built-in attention computes a call: ``options`` by name for ``interface.attention``; the prefix's
    length (0 < prefix < seqlen) where every query sees the first ``prefix`` keys and causal keys after them."""

    options: dict
    prefix: int | None = None


def builtin_options(
    query, key, value, score_mod: ScoreMod | None, block_mask: BlockMask, scale: float
) -> Builtin | None:
    """The options of ``interface.attention`` (window_left, window_right, softcap, alibi_slopes) that compute this
    flex_attention call, with the prefix of a prefix-LM mask, or None where it is not one of the recognised patterns
    (module docstring)."""
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    if not (math.isfinite(scale) and 0 < min(head_dim, head_dim_v) and max(head_dim, head_dim_v) <= MAX_HEAD_DIM):
        return None
    if head_dim != head_dim_v and (head_dim % 8 or head_dim_v % 8):  # built-in: multiples of 8, or one padded dim
        return None
    found = _recognised(score_mod, block_mask.mask_mod, query.device)
    if found is None:
        return None
    (lo, hi, prefix), (softcap, alibi) = found
    seqlen = query.shape[2]
    if prefix is not None:  # prefix-LM: the keys before the prefix, then causal
        if (lo, hi) != (0, INF) or seqlen != key.shape[2] or alibi is not None:
            return None
        prefix = min(max(prefix, 0), seqlen)  # every key: no mask; none: causal
        lo, prefix = (-INF, None) if prefix == seqlen else (lo, prefix or None)
    aligned = (lo, hi) == (-INF, INF) or seqlen == key.shape[2]
    if not lo <= 0 <= hi or not aligned:
        return None
    slopes = None
    if alibi is not None:
        tensor, sign = alibi
        if lo != 0 or not _plain_slopes(tensor, query):
            return None
        slopes = tensor if sign < 0 else -tensor
    if not _agrees(block_mask, lo, hi, prefix):
        return None
    options = {
        "window_left": None if hi == INF else int(hi), "window_right": None if lo == -INF else int(-lo),
        "softcap": softcap, "alibi_slopes": slopes,
    }  # fmt: skip
    return Builtin(options, prefix)


def _plain_slopes(slopes: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether a captured slope tensor is what flash_attn takes as alibi_slopes: float32 (Hq,) on the inputs' device,
    not requiring grad (the built-in kernels give slopes no gradient)."""
    return (
        slopes.dtype == torch.float32 and tuple(slopes.shape) == (query.shape[1],) and slopes.device == query.device
        and not slopes.requires_grad
    )  # fmt: skip


def _recognised(score_mod: ScoreMod | None, mask_mod: MaskMod | None, device: torch.device) -> tuple | None:
    """(``MaskForm``, (softcap, (slopes, sign) or None)) of the mods, or None; kept per what the mods read
    (``codegen.key``), as the kernels' translations are."""
    cache_key = (codegen.key(score_mod), codegen.key(mask_mod), device)
    if cache_key not in _RECOGNISED:
        if len(_RECOGNISED) >= MAX_RECOGNISED:
            _RECOGNISED.clear()
        try:
            form = mask_form(codegen.trace(mask_mod or noop_mask, ("b", "h", "q_idx", "kv_idx"), device))
            score = (0.0, None)
            if score_mod is not None:
                score = score_options(codegen.trace(score_mod, ("score", "b", "h", "q_idx", "kv_idx"), device))
        except codegen.Unsupported:
            form = score = None
        _RECOGNISED[cache_key] = (form, score)
    form, score = _RECOGNISED[cache_key]
    return None if form is None or score is None else (form, score)


def _linear(node, q_idx, kv_idx) -> tuple[int, int, int] | None:
    """(a, b, c) with ``node`` = a * q_idx + b * kv_idx + c, for sums, differences and negations of the indices and
    integer constants; None for anything else."""
    node = skip_no_ops(node)
    if isinstance(node, int) and not isinstance(node, bool):
        return (0, 0, node) if abs(node) < _CONSTANT_LIMIT else None
    if node is q_idx or node is kv_idx:
        return (1, 0, 0) if node is q_idx else (0, 1, 0)
    op = op_of(node)
    if op is aten.neg and len(node.args) == 1:
        inner = _linear(node.args[0], q_idx, kv_idx)
        return None if inner is None else tuple(-x for x in inner)
    if op in (aten.add, aten.sub) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        left, right = (_linear(arg, q_idx, kv_idx) for arg in node.args)
        if left is None or right is None:
            return None
        combine = operator.add if op is aten.add else operator.sub
        return tuple(combine(x, y) for x, y in zip(left, right, strict=True))
    return None


def _comparison(node, q_idx, kv_idx) -> tuple[float, float] | None:
    """The interval [lo, hi] of d = q_idx - kv_idx where a comparison node holds, or None."""
    op = op_of(node)
    if op not in _FLIPPED or len(node.args) != 2:
        return None
    left, right = (_linear(arg, q_idx, kv_idx) for arg in node.args)
    if left is None or right is None:
        return None
    a, b, c = (x - y for x, y in zip(left, right, strict=True))  # a q + b kv + c  op  0
    if abs(a) != 1 or b != -a:
        return None
    if a == -1:  # -d + c op 0  <=>  d flipped-op c
        op, bound = _FLIPPED[op], c
    else:  # d + c op 0  <=>  d op -c
        bound = -c
    return {
        aten.ge: (bound, INF), aten.gt: (bound + 1, INF), aten.le: (-INF, bound), aten.lt: (-INF, bound - 1),
        aten.eq: (bound, bound),
    }[op]  # fmt: skip


def mask_form(gm: torch.fx.GraphModule) -> MaskForm | None:
    """What the traced mask_mod attends: lo <= q_idx - kv_idx <= hi (bounds integers or -inf / inf), or every key
    before a bound (``kv_idx < P``) joined by ``|`` to that; None where its graph is not of the recognised forms
    (module docstring)."""
    _, _, q_idx, kv_idx = [n for n in gm.graph.nodes if n.op == "placeholder"]
    alternatives = _terms(output_node(gm), _OR, aten.new_zeros)
    if len(alternatives) == 1:
        return _conjunction(alternatives[0], q_idx, kv_idx)
    if len(alternatives) != 2:
        return None
    bounds = [_key_prefix(term, q_idx, kv_idx) for term in alternatives]
    if bounds.count(None) != 1:  # one key prefix, one other term
        return None
    other = bounds.index(None)
    form = _conjunction(alternatives[other], q_idx, kv_idx)
    return None if form is None else form._replace(prefix=bounds[1 - other])


def _conjunction(node, q_idx, kv_idx) -> MaskForm | None:
    """``mask_form`` of ``node``, a conjunction of intervals."""
    lo, hi = -INF, INF
    for term in _terms(node, _AND, aten.new_ones):
        interval = _comparison(term, q_idx, kv_idx)
        if interval is None:
            return None
        lo, hi = max(lo, interval[0]), min(hi, interval[1])
    return MaskForm(lo, hi)


def _terms(node, combine: tuple, identity) -> list:
    """The terms ``node`` joins with ``combine`` (``_AND``: ``&``, ``logical_and``, ``and_masks``; ``_OR``), past
    ``NO_OPS``, without the operation's identity (``identity``: ``new_ones`` or ``new_zeros``, a 0-d bool constant,
    where and_masks and or_masks start)."""
    node = skip_no_ops(node)
    if op_of(node) in combine and len(node.args) == 2:
        return [term for arg in node.args for term in _terms(arg, combine, identity)]
    constant = op_of(node) is identity and list(node.args[1]) == [] and node.kwargs.get("dtype") == torch.bool
    return [] if constant else [node]


def _key_prefix(node, q_idx, kv_idx) -> int | None:
    """P of a comparison that holds exactly where kv_idx < P (``kv_idx < P``, ``kv_idx <= P - 1``, ``P > kv_idx``,
    ...), or None."""
    op = op_of(node)
    if op not in _FLIPPED or op is aten.eq or len(node.args) != 2:
        return None
    left, right = (_linear(arg, q_idx, kv_idx) for arg in node.args)
    if left is None or right is None:
        return None
    a, b, c = (x - y for x, y in zip(left, right, strict=True))  # a q + b kv + c  op  0
    if a != 0 or abs(b) != 1:
        return None
    if b == -1:  # -kv + c op 0  <=>  kv flipped-op c
        op, bound = _FLIPPED[op], c
    else:  # kv + c op 0  <=>  kv op -c
        bound = -c
    return {aten.lt: bound, aten.le: bound + 1}.get(op)


def score_options(gm: torch.fx.GraphModule) -> tuple[float, tuple[torch.Tensor, int] | None] | None:
    """(softcap, alibi) of a traced score_mod: softcap 0.0 or the cap of ``cap * tanh(score / cap)``; alibi None or
    (slopes, sign) for a term ``sign * slopes[h] * (q_idx - kv_idx)`` added to the (softcapped) score; None where the
    graph is not of the recognised forms (module docstring)."""
    score, _, h, q_idx, kv_idx = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def alibi_term(node, sign: int):
        """(slopes, sign * the term's sign) of ``slopes[h] * (±d)`` in either order, or None."""
        node = skip_no_ops(node)
        if op_of(node) is not aten.mul or len(node.args) != 2:
            return None
        for read, distance in (node.args, node.args[::-1]):
            read, form = skip_no_ops(read), _linear(distance, q_idx, kv_idx)
            distance_only = form is not None and form[2] == 0 and abs(form[0]) == 1 and form[1] == -form[0]
            if op_of(read) is not aten.index or not distance_only:
                continue
            tensor, indices = read.args
            if tensor.op == "get_attr" and len(indices) == 1 and skip_no_ops(indices[0]) is h:
                slopes = getattr(gm, tensor.target)
                if isinstance(slopes, torch.Tensor) and slopes.dim() == 1:
                    return slopes, sign * form[0]
        return None

    def softcap_of(node) -> float | None:
        """cap of ``cap * tanh(score / cap)`` in either order, or None."""
        if op_of(node) is not aten.mul or len(node.args) != 2:
            return None
        for tanh, cap in (node.args, node.args[::-1]):
            tanh = skip_no_ops(tanh)
            if not isinstance(cap, (int, float)) or isinstance(cap, bool) or op_of(tanh) is not aten.tanh:
                continue
            divided = skip_no_ops(tanh.args[0])
            if (
                op_of(divided) is aten.div and not divided.kwargs and skip_no_ops(divided.args[0]) is score
                and divided.args[1] == cap and math.isfinite(cap) and cap > 0
            ):  # fmt: skip
                return float(cap)
        return None

    out = output_node(gm)
    alibi = None
    if op_of(out) in (aten.add, aten.sub) and len(out.args) == 2 and out.kwargs.get("alpha", 1) == 1:
        sign = 1 if op_of(out) is aten.add else -1
        orders = [(out.args[0], out.args[1])] + ([(out.args[1], out.args[0])] if sign == 1 else [])
        for capped, term in orders:
            alibi = alibi_term(term, sign)
            if alibi is not None:
                out = skip_no_ops(capped)
                break
    if out is score:
        return 0.0, alibi
    cap = softcap_of(out)
    return None if cap is None else (cap, alibi)


def _attends(
    block_mask: BlockMask, lo: float, hi: float, prefix: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(some, every): bool (Qb, Kb) on the host, whether some / every position of each block within the lengths is
    attended: lo <= q_idx - kv_idx <= hi (over a block's rectangle d takes every value between its least and
    greatest), or, with a ``prefix`` (only with the causal interval [0, inf)), kv_idx < prefix: every row of a block
    attends its keys before the prefix, so the block has some where its first key is one of them and all where its
    keys are all either before the prefix or at most its first row."""
    (q_len, kv_len), (q_block, kv_block) = block_mask.seq_lengths, block_mask.BLOCK_SIZE
    rows, cols = torch.arange(0, q_len, q_block), torch.arange(0, kv_len, kv_block)
    last_row, last_col = (rows + q_block).clamp(max=q_len) - 1, (cols + kv_block).clamp(max=kv_len) - 1
    least, greatest = rows[:, None] - last_col[None, :], last_row[:, None] - cols[None, :]
    some, every = (greatest >= lo) & (least <= hi), (least >= lo) & (greatest <= hi)
    if prefix is not None:
        some, every = some | (cols < prefix), every | (last_col < prefix)
    return some, every


def _agrees(block_mask: BlockMask, lo: float, hi: float, prefix: int | None) -> bool:
    """Whether the block mask's lists compute what its mask_mod (the interval [lo, hi] of q_idx - kv_idx, or the
    keys before ``prefix``: ``_attends``) says: no skipped block holds a position it attends, and every position of
    a full block within the lengths is attended (partial blocks evaluate the mask_mod). Checked once per mask's lists
    (a host synchronisation on CUDA) and again after they change (``block_mask.remember``)."""
    found = recall(_AGREEING, block_mask)
    if found is not None and found[0] == (lo, hi, prefix):
        return found[1]
    kinds = block_kinds(block_mask)[..., : block_mask.q_blocks, :]  # lists may hold rows past the lengths
    some, every = (x.to(kinds.device) for x in _attends(block_mask, lo, hi, prefix))
    agrees = not bool((((kinds == 0) & some) | ((kinds == FULL) & ~every)).any())
    remember(_AGREEING, block_mask, ((lo, hi, prefix), agrees))
    return agrees
