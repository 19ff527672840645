"""Ring attention: exact attention over one sequence split across the ranks of a process group.

Every rank holds a shard of the sequence (see ``layout``): its queries Q_r, keys K_r and values V_r,
(batch, seqlen / W, heads, headdim) each, W ranks in the group. The result on rank r is its shard of
``flash_attn_func`` on the whole sequence, forward and backward; nothing of size seqlen^2 is stored.

Forward
-------
The K/V shards travel around the ring: in step t = 0 .. W-1, rank r holds the K/V shard of rank
s = (r - t) mod W. While it computes attention of its queries against that shard, it already sends the
shard on to rank r + 1 and receives the next one from rank r - 1 (``batch_isend_irecv``), so the
transfer hides behind the compute once a step's compute outlasts a shard's transfer::

    step 0: rank r computes Q_r K_r^T        and passes K_r/V_r on     (r -> r+1)
    step 1: rank r computes Q_r K_(r-1)^T    and passes K_(r-1)/V_(r-1) on
    ...     W steps, W - 1 transfers

Each step gives a partial result over a subset of the keys: an output O_t normalised over those keys
and its log-sum-exp L_t. Two partials merge exactly, in fp32, by their LSEs::

    L = log(exp(L_a) + exp(L_b)),    O = exp(L_a - L) * O_a + exp(L_b - L) * O_b

A row that saw no key in a step has L_t = -inf and O_t = 0; it gets weight 0 (and a row that has seen
no key at all keeps L = -inf and O = 0 rather than NaN).

Backward
--------
With the global (merged) O and LSE saved, each step's gradient is local to its block of keys:
P_ij = exp(s_ij - LSE_i) with the global LSE_i, and Delta_i = rowsum(dO_i * O_i) with the global O_i,
which is exactly what ``flashtile::attention_backward`` computes when given the global ``out`` and
``lse``. dQ_r sums over the steps on rank r, in fp32. dK_s and dV_s sum over every rank's queries, so
they travel with K_s/V_s, one step behind: an fp32 accumulator for shard s starts on rank s + 1 with its
blocks of step 1, each next rank adds its blocks and passes it on, and after the last step it hops home
to rank s, which adds its own blocks of step 0 (kept in the inputs' dtype meanwhile): W - 1 hops. The
accumulator that arrives during a step is only waited for after that step's compute, so its transfer
overlaps too; the hop home does not (the pass has no compute left to hide it behind).

Head groups and memory
----------------------
Heads are independent, so the ring runs once per group of K/V heads (with their query heads), the groups
one after the other (``head_groups``: up to MAX_HEAD_GROUPS = 4 groups, but none of fewer than
MIN_GROUP_ROWS query rows, so that every kernel call still fills a GPU; short shards take one). A pass's
buffers are then its group's share, while the inputs, outputs and gradients are whole; every element's
arithmetic is the same. Peak allocation per rank, in T = one (B, S, H, D) tensor in the inputs' dtype
(S local tokens; with Hk = H and Dv = D, as below, every input, output and gradient is 1T, an fp32
accumulator 2T), G groups, zigzag causal (an off-diagonal step's block has half the queries or half the
keys), counted as ``torch.cuda.max_memory_allocated`` counts it in training, that is with q, k, v and
dout allocated before the forward and out before the backward:

=====================  ==============================================================  ============
pass                   alive at the peak                                               G = 4
=====================  ==============================================================  ============
forward                q, k, v, dout 4 + out 1; per group: fp32 out 2 + K/V in hand    6.75T
                       (at step 0 the group's copy for sending) 2 + K/V being
                       received 2 + a block's output 1: 5 + 7/G
backward, W = 2        q, k, v, dout, out 5 + dq, dk, dv 3; per group, at the hop      10.75T
                       home: own blocks dk, dv 2 + fp32 accumulator sent 4 and
                       received 4 + dq 1: 8 + 11/G
backward, W >= 3       8; per group, in a middle step: fp32 dq 2 + K/V in hand 2 and   12.63T
                       being received 2 + own blocks 2 + accumulators sent 4 and
                       received 4 + the step's dq, dk, dv blocks 2.5: 8 + 18.5/G
=====================  ==============================================================  ============

One group (G = 1) allocates neither the whole outputs ahead nor a K/V copy: forward 9T (W = 2) or 10.5T,
backward 16T (W = 2) or 23.5T. Besides: LSE-sized fp32 terms ((B, H, S), 2/D T each). One GPU running
``flash_attn_func`` on its whole sequence holds 8T (q, k, v, dout, out, dq, dk, dv), so W ranks hold
8 W / peak times its tokens: predicted 1.5x at W = 2, 2.5x at W = 4. Measured on two H200s (29c8725,
bench_ring.py, H = 16, D = 128: T = 4 KiB per token): peak 0.84 / 1.35 / 2.69 / 5.38 GiB per GPU at
N = 32k / 64k / 128k / 256k, i.e. 43.1 KiB = 10.8T per local token at W = 2 (10.75T above); the longest
search fit 4194304 tokens at W = 2 (88.1 GiB) and not 8388608 (the 1.5x try between was not run), so the
1.5x is not measured yet; W = 1 fit 4194304 too (128.5 GiB), not 6291456. Before the head groups (ccb3103), measured as
``tests/test_distributed.py`` measures (CPU path, gloo, T per local token): forward 13.2T (q, k, v, dout
4 + fp32 out 2 + K/V packed into one copy 2 + receive buffer 2 + block output 1 + the merge's fp32
product 2), backward 23T at W = 2 and 25T at W = 4 (5 + fp32 dq 2 + K/V in hand 2 (and being received
2) + three fp32 dK/dV accumulators 12: sent, received, and the next receive buffer, allocated while the
previous transfer's works still held the sent one + one step's dk, dv blocks a loop variable kept 2);
the H200 measured 21T at W = 2 (84.1 KiB per local token).
What groups cost: G times as many kernel calls and transfers, each 1/G the size.

Masks and layouts
-----------------
Under causal or sliding-window masks, whether query position p sees key position p' depends on the
global positions: p - left <= p' <= p + right. Each step is cut into blocks (query segment, key
segment) of contiguous positions; a block the mask hides completely is skipped, a block it shows
completely runs without a mask, and a block the band cuts runs with the band re-expressed in the
kernel's bottom-right terms (``_block_band``). Neighbouring unmasked blocks merge into one call. With
``layout="zigzag"`` and causal attention every off-diagonal step is then one unmasked call of half the
shard's queries (or keys) and the diagonal step one causal call, the same work on every rank.

Score modifications and sinks
-----------------------------
``softcap`` changes each score by itself, whatever its position, so every block call takes it as is
(forward and backward). A ``learnable_sink`` is one more logit per row with no value: it joins the
softmax once, not once per step, so the kernel calls run without it and it is merged into the global
result after the ring (a partial with LSE = sink and output 0). The backward needs nothing more: P from
the global LSE (which includes the sink) is already right, and the sink's gradient on this rank is
-sum_i exp(sink - LSE_i) * Delta_i over this rank's rows, not all-reduced (see ``ring_flash_attn_func``).
ALiBi is not supported: its bias -slope * |p - p'| needs the global offset q_seg.start - k_seg.start of
each block, while the kernels take the bias's diagonal from the block's shape (Lk - Lq), the same one
as the mask's; see ``_ALIBI_NOT_IMPLEMENTED``.

Devices and streams (NCCL)
--------------------------
Every rank computes on the device of its q (the ring runs under ``torch.cuda.device(q.device)``, so
the kernels and NCCL use that GPU whatever the current device was), and the group's backend must
reach that device: a group that only speaks NCCL needs CUDA tensors (checked on every rank, with
the same all_gather as the shapes). NCCL runs the transfers on its own stream, ordered after the work
already queued on the current stream when ``pass_on`` is called; ``Incoming.wait`` makes the current
stream wait for them. So a buffer handed to ``pass_on`` is never written afterwards (an accumulator is
added to after it arrives and before it is passed on, never after), a received buffer is read only after
``wait``, and every transfer is waited for before its buffers are dropped (the process group keeps them
alive until then, so the caching allocator cannot hand their memory to a later kernel while NCCL still
uses it); ``wait`` lets go of them at once, so that a transfer's buffers are freed before the next one's
are allocated.

Failure
-------
Before the ring starts, every rank's shapes and options are compared with one all_gather of a dozen
integers (on GPUs the host waits for it): a rank whose inputs are invalid raises its own error and the
others raise too, instead of waiting for it.
A rank that dies or never calls leaves its peers blocked in a transfer until the process group's
timeout (``torch.distributed.init_process_group(timeout=...)``; gloo's default is 30 minutes, NCCL's
watchdog aborts after its timeout): then they raise a RuntimeError that says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from flashtile import _ops
from flashtile.checks import NO_WINDOW, check_unimplemented, window_bounds
from flashtile.distributed.group import Incoming, Ring, Setup, agreed_options, on_device
from flashtile.distributed.layout import Segment, check_layout, segments
from flashtile.errors import require
from flashtile.interface import unpacked
from flashtile.ops._alloc import empty_output
from flashtile.options import AttentionOptions


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step: rows [q0, q1) of the local queries against rows [k0, k1) of the
    K/V shard in hand, with the band (left, right) in the kernel's bottom-right terms; None is unbounded."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int | None
    right: int | None

    @property
    def unmasked(self) -> bool:
        return self.left is None and self.right is None

    def options(self, setup: Setup) -> AttentionOptions:
        """The call's options with this block's band in place of the global window."""
        return replace(setup.options, window_left=self.left, window_right=self.right)


def _block_band(
    q_seg: Segment, k_seg: Segment, left: int | None, right: int | None
) -> tuple[int | None, int | None] | None:
    """The global band on one (query segment, key segment) block as the kernel's (left, right), or None
    if the block shows no key to any row.

    Globally seqlen_q = seqlen_k, so query position p sees key position p' when p - left <= p' <= p + right.
    With p = q_seg.start + i and p' = k_seg.start + j, row i of the block sees the columns
    i + lo <= j <= i + hi, where delta = q_seg.start - k_seg.start, lo = delta - left, hi = delta + right.
    The kernel's band is i + d - wl <= j <= i + d + wr with d = Lk - Lq, so wl = d - lo and wr = hi - d.
    A side that cuts no row of the block becomes None (no mask on that side).
    """
    n_q, n_k = q_seg.length, k_seg.length
    delta = q_seg.start - k_seg.start
    lo = None if left is None else delta - left
    hi = None if right is None else delta + right
    first_row = 0 if hi is None else max(0, -hi)  # rows before it end before column 0
    last_row = n_q - 1 if lo is None else min(n_q - 1, n_k - 1 - lo)  # rows after it start past the last column
    if first_row > last_row:
        return None
    d = n_k - n_q
    window_left = None if lo is None or lo + n_q - 1 <= 0 else d - lo  # the last row still sees column 0
    window_right = None if hi is None or hi >= n_k - 1 else hi - d  # row 0 already sees the last column
    return window_left, window_right


def plan_step(
    q_segments: tuple[Segment, ...], k_segments: tuple[Segment, ...], left: int | None, right: int | None
) -> list[Block]:
    """The attention calls that one ring step needs: queries held as ``q_segments`` against the K/V
    shard held as ``k_segments``, under the global band (left, right) (None: unbounded; causal is (None, 0)).

    Blocks the band hides are left out; unmasked blocks next to each other in the shard merge into one.
    Causal attention compares positions only by their order, which a shard keeps: on the step where the
    queries and keys are the same positions, the shard's own causal mask is the global one (one call
    where zigzag's two segments would need three).
    """
    if left is None and right == 0 and q_segments == k_segments:
        n = sum(s.length for s in q_segments)
        return [Block(0, n, 0, n, None, 0)]
    rows: list[list[Block]] = []
    for q_seg in q_segments:
        row: list[Block] = []
        for k_seg in k_segments:
            band = _block_band(q_seg, k_seg, left, right)
            if band is None:
                continue
            block = Block(q_seg.offset, q_seg.offset + q_seg.length, k_seg.offset, k_seg.offset + k_seg.length, *band)
            if row and row[-1].unmasked and block.unmasked and row[-1].k1 == block.k0:
                block = replace(row.pop(), k1=block.k1)
            row.append(block)
        if not row:
            continue
        if rows and _stackable(rows[-1], row):
            row = [replace(upper, q1=lower.q1) for upper, lower in zip(rows.pop(), row, strict=True)]
        rows.append(row)
    return [block for row in rows for block in row]


def _stackable(upper: list[Block], lower: list[Block]) -> bool:
    """Whether two rows of blocks form one: adjacent query rows, unmasked, against the same key ranges."""
    return len(upper) == len(lower) and all(
        a.unmasked and b.unmasked and a.q1 == b.q0 and (a.k0, a.k1) == (b.k0, b.k1)
        for a, b in zip(upper, lower, strict=True)
    )


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a partial result over more keys into the running one, in place.

    out: (batch, rows, nheads, headdim_v) fp32, lse: (batch, nheads, rows) fp32 (views of the running
    result); block_out, block_lse: the same shapes, block_out in the inputs' dtype (read as it is: no fp32
    copy of it on a GPU).
    """
    new_lse = torch.logaddexp(lse, block_lse)
    shift = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # no key seen yet: weights exp(-inf) = 0
    old_weight = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)  # (batch, rows, nheads, 1)
    new_weight = torch.exp(block_lse - shift).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_weight).addcmul_(block_out, new_weight)
    lse.copy_(new_lse)


def _merge_sink(out: Tensor, lse: Tensor, sink: Tensor) -> None:
    """Fold a learnable sink (H,) into the merged result over all keys, in place: the sink is one more
    logit of every row with no value, so LSE' = log(exp(LSE) + exp(sink)) and O' = exp(LSE - LSE') * O
    (a row that saw no key gets LSE' = sink and keeps O' = 0).

    out: (batch, rows, nheads, headdim_v) fp32, lse: (batch, nheads, rows) fp32.
    """
    sink_lse = sink.float()[None, :, None].expand_as(lse)
    new_lse = torch.logaddexp(lse, sink_lse)
    shift = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # a sink of -inf and no key: weight 0
    out.mul_(torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1))
    lse.copy_(new_lse)


MAX_HEAD_GROUPS = 4  # the ring runs once per group of heads: its buffers are 1 / groups of a whole pass's
MIN_GROUP_ROWS = 1 << 17  # batch * seqlen * nheads of one group at least: each kernel call still fills the GPU


def head_groups(batch: int, shard_len: int, nheads: int, nheads_k: int) -> list[slice]:
    """The K/V heads of each pass of the ring, in order: up to MAX_HEAD_GROUPS near-equal groups, fewer
    where a group would hold fewer than MIN_GROUP_ROWS query rows (batch * seqlen * its query heads), one
    for a short shard. The groups run one after the other, each a whole ring (``_ring_forward``)."""
    count = max(1, min(MAX_HEAD_GROUPS, nheads_k, batch * shard_len * nheads // MIN_GROUP_ROWS))
    return [slice(nheads_k * i // count, nheads_k * (i + 1) // count) for i in range(count)]


def _query_heads(kv_heads: slice, group: int) -> slice:
    """The query heads that attend to ``kv_heads`` (``group`` query heads per K/V head)."""
    return slice(kv_heads.start * group, kv_heads.stop * group)


def _blocks(setup: Setup, source: int, shard_len: int) -> list[Block]:
    """The calls of the step in which this rank holds the K/V shard of group rank ``source``."""
    ring = setup.ring
    return plan_step(
        segments(ring.rank, ring.size, setup.layout, shard_len),
        segments(source, ring.size, setup.layout, shard_len),
        setup.options.window_left,
        setup.options.window_right,
    )


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, sink: Tensor | None, setup: Setup) -> tuple[Tensor, Tensor]:
    """q (B, S, H, D), k (B, S, Hk, D), v (B, S, Hk, Dv): this rank's shards, sink (H,) fp32 or None ->
    out (B, S, H, Dv) in q's dtype, lse (B, H, S) fp32, this rank's rows of the full-sequence attention.

    One pass of the ring per group of heads (``head_groups``)."""
    batch, shard_len, nheads, nheads_k = *q.shape[:3], k.shape[2]
    groups = head_groups(batch, shard_len, nheads, nheads_k)
    lse = torch.empty((batch, nheads, shard_len), dtype=torch.float32, device=q.device)
    if len(groups) == 1:
        return _forward_pass(q, k, v, lse, sink, setup), lse
    out = empty_output((batch, shard_len, nheads, v.shape[3]), q.dtype, q.device)
    for kv_heads in groups:
        heads = _query_heads(kv_heads, nheads // nheads_k)
        out[:, :, heads] = _forward_pass(
            q[:, :, heads], k[:, :, kv_heads], v[:, :, kv_heads], lse[:, heads], None if sink is None else sink[heads],
            setup,
        )  # fmt: skip
    return out, lse


def _forward_pass(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, sink: Tensor | None, setup: Setup) -> Tensor:
    """One pass of the ring: attention of q over every rank's k, v, in q's dtype; its LSE goes into ``lse``.

    The sink joins each row's softmax once, after the ring: it is one more partial result with LSE = sink
    and output 0 (the kernel calls run without it; their blocks only hold keys)."""
    ring = setup.ring
    shard_len = q.shape[1]
    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=torch.float32, device=q.device)
    lse.fill_(float("-inf"))
    k_s, v_s = setup.sendable(k, v)
    for step in range(ring.size):
        incoming = ring.pass_on(k_s, v_s) if step + 1 < ring.size else None
        for b in _blocks(setup, (ring.rank - step) % ring.size, shard_len):
            block_out, block_lse = _ops.attention(
                q[:, b.q0 : b.q1], k_s[:, b.k0 : b.k1], v_s[:, b.k0 : b.k1], b.options(setup)
            )
            _merge(out[:, b.q0 : b.q1], lse[:, :, b.q0 : b.q1], block_out, block_lse)
            del block_out, block_lse
        del k_s, v_s  # this step's K/V: freed once sent (``wait``), so the ring holds two shards, not three
        if incoming is not None:
            k_s, v_s = incoming.wait()
    if sink is not None:
        _merge_sink(out, lse, sink)
    return out.to(q.dtype)


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, setup: Setup
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of this rank's shards, shaped and typed like (q, k, v).

    dout: (B, S, H, Dv), out and lse: this rank's rows of the global result (``_ring_forward``),
    dlse: (B, H, S) fp32 gradient at lse, or None. One pass of the ring per group of heads.
    """
    batch, shard_len, nheads, nheads_k = *q.shape[:3], k.shape[2]
    groups = head_groups(batch, shard_len, nheads, nheads_k)
    if len(groups) == 1:
        return _backward_pass(dout, q, k, v, out, lse, dlse, setup)
    grads = [empty_output(x.shape, x.dtype, x.device) for x in (q, k, v)]
    for kv_heads in groups:
        heads = _query_heads(kv_heads, nheads // nheads_k)
        parts = _backward_pass(
            dout[:, :, heads], q[:, :, heads], k[:, :, kv_heads], v[:, :, kv_heads], out[:, :, heads],
            lse[:, heads], None if dlse is None else dlse[:, heads], setup,
        )  # fmt: skip
        for i, grad_heads in enumerate((heads, kv_heads, kv_heads)):
            grads[i][:, :, grad_heads] = parts[i]
        del parts  # copied (and no loop variable keeps one of them)
    return tuple(grads)


def _backward_pass(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, setup: Setup
) -> tuple[Tensor, Tensor, Tensor]:
    """One pass of the ring backward: dq, dk, dv of this rank's q, k, v, in their dtypes.

    The fp32 dK/dV accumulator of shard s starts at rank s + 1 (step 1), gathers each rank's blocks on
    its way round and arrives home after the last step, where rank s adds its own blocks (step 0, kept
    in the inputs' dtype meanwhile)."""
    ring = setup.ring
    shard_len = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_s, v_s = setup.sendable(k, v)
    dkv_incoming: Incoming | None = None  # the accumulator of the shard this rank holds next
    for step in range(ring.size):
        kv_incoming = ring.pass_on(k_s, v_s) if step + 1 < ring.size else None
        blocks = []  # (block, dk_b, dv_b) of this step, for the accumulator of this K/V shard
        for b in _blocks(setup, (ring.rank - step) % ring.size, shard_len):
            dq_b, dk_b, dv_b = _ops.attention_gradients(
                dout[:, b.q0 : b.q1],
                q[:, b.q0 : b.q1],
                k_s[:, b.k0 : b.k1],
                v_s[:, b.k0 : b.k1],
                out[:, b.q0 : b.q1],
                lse[:, :, b.q0 : b.q1].contiguous(),
                None if dlse is None else dlse[:, :, b.q0 : b.q1].contiguous(),
                b.options(setup),
            )
            dq[:, b.q0 : b.q1] += dq_b
            blocks.append((b, dk_b, dv_b))
            del dq_b, dk_b, dv_b
        del k_s, v_s
        if step == ring.size - 1:
            dq = dq.to(q.dtype)  # complete: the fp32 one is gone before the accumulator's hop home
        if step == 0:
            own = blocks  # this rank's own blocks, until its shard's accumulator comes home
        else:
            # the accumulator of this K/V shard: a new one at step 1, else the one that came during the step
            # (waiting for it also frees the one this rank sent a step ago)
            dkv = _zeros_fp32(k, v) if dkv_incoming is None else dkv_incoming.wait()
            _add_key_grads(dkv, blocks)
            del blocks
            dkv_incoming = ring.pass_on(*dkv)  # after the last step, this is the hop home
            del dkv  # never written again: the transfer holds it until dkv_incoming.wait()
        if kv_incoming is not None:
            k_s, v_s = kv_incoming.wait()
    dkv = _zeros_fp32(k, v) if dkv_incoming is None else dkv_incoming.wait()  # None: one rank
    _add_key_grads(dkv, own)
    del own
    return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _zeros_fp32(*tensors: Tensor) -> list[Tensor]:
    """fp32 zeros shaped like each of ``tensors``: new accumulators."""
    return [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in tensors]


def _add_key_grads(dkv: list[Tensor], blocks: list[tuple[Block, Tensor, Tensor]]) -> None:
    """Add each block's (dk_b, dv_b) to its keys' rows of the fp32 accumulators dkv = [dk, dv], in place."""
    dk, dv = dkv
    for b, dk_b, dv_b in blocks:
        dk[:, b.k0 : b.k1] += dk_b
        dv[:, b.k0 : b.k1] += dv_b


class _RingFlashAttention(torch.autograd.Function):
    """Autograd for ring attention: the backward is a collective over the group, like the forward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sink: Tensor | None, setup: Setup) -> tuple[Tensor, Tensor]:
        out, lse = _ring_forward(q, k, v, sink, setup)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.setup = setup
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q = ctx.saved_tensors[0]
        with on_device(q):
            return _RingFlashAttention._backward(ctx, dout, dlse)

    @staticmethod
    def _backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, dlse, ctx.setup)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            # This rank's rows only: the gradient of this rank's loss (see ring_flash_attn_func).
            dsink = _ops.attention_sink_backward(dout, out, lse, dlse, sink)
        return dq, dk, dv, dsink, None


def _check_layout_shard(q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    """Raise ValueError unless q's shard can be split as ``layout`` says (zigzag: two equal chunks)."""
    require(
        layout != "zigzag" or q.shape[1] % 2 == 0,
        f"A layout='zigzag' shard holds two equal chunks, so its length must be even, got {q.shape[1]}. "
        "Shard the full sequence with flashtile.distributed.shard (it must be a multiple of 2 * world_size).",
    )


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "zigzag",
    learnable_sink: Tensor | None = None,
):
    """``flash_attn_func`` over a sequence split across the ranks of ``group`` (context parallelism).

    A collective: every rank of ``group`` calls it with its own shard of q, k and v (and, when training,
    backpropagates through the result). Each rank gets its shard of exactly what ``flash_attn_func``
    gives on the whole sequence, forward and backward. Shard a full tensor with
    ``flashtile.distributed.shard`` and gather results with ``unshard``, using the same ``layout``.

    The masks are those of ``flash_attn_func`` on the full sequence of length N = world_size * seqlen
    (seqlen_q = seqlen_k = N): with ``causal``, global query position p sees keys p' <= p; with
    ``window_size=(left, right)``, keys p - left <= p' <= p + right (-1: unbounded side). Use
    layout="zigzag" with causal masks: every rank then does the same work ("contiguous" leaves the last
    rank with W times the work of the first).

    Args:
        q: (batch_size, seqlen, nheads, headdim), float16, bfloat16 or float32: this rank's shard of the queries
        k: (batch_size, seqlen, nheads_k, headdim): this rank's shard of the keys; nheads % nheads_k == 0
        v: (batch_size, seqlen, nheads_k, headdim_v); headdim and headdim_v multiples of 8, at most 256
        dropout_p, alibi_slopes: must be 0.0 and None (not implemented; NotImplementedError). ALiBi needs
            the kernels to take the bias's diagonal apart from the mask's (see ``_ALIBI_NOT_IMPLEMENTED``);
            ``flashtile.distributed.ulysses_flash_attn_func`` supports it.
        softmax_scale: scaling of q @ k^T before the softmax; default 1 / sqrt(headdim)
        causal: causal mask over the global positions
        window_size: (left, right) sliding window over the global positions, -1 for an unbounded side
        softcap: > 0 caps the scaled scores at softcap * tanh(score / softcap), as in flash_attn_func
        deterministic: accepted, as in flash_attn_func; the ring adds partial results in a fixed order
        return_attn_probs: also return softmax_lse (the third element is None, as in flash_attn_func)
        group: the process group the sequence is split over; None is the default group
        layout: how the sequence is split: "zigzag" (rank r holds chunks r and 2W-1-r of 2W equal chunks;
            seqlen must be even) or "contiguous" (rank r holds chunk r of W)
        learnable_sink: keyword only, (nheads,) float32 on q's device, the same on every rank (a replicated
            parameter): one logit per query head that joins every row's softmax denominator, as in
            flash_attn_func. Differentiable, with the convention of data parallelism: the gradient each
            rank gets is that of ITS OWN loss (the rows it holds), not all-reduced here. The gradient of
            the full-sequence loss is the sum over the group, which the usual gradient all-reduce of
            replicated parameters over the context-parallel group provides (or
            ``dist.all_reduce(sink.grad, group=group)``); the gradients of the weights that produce q, k
            and v follow the same convention, each rank holding the part that flows through its tokens.

    Returns:
        out: (batch_size, seqlen, nheads, headdim_v), this rank's rows of the full-sequence output
        if return_attn_probs: (out, softmax_lse, None) with softmax_lse (batch_size, nheads, seqlen) float32

    Raises:
        ValueError / TypeError on every rank when any rank's inputs are invalid or the ranks' shapes,
        dtypes or options differ; RuntimeError when another rank fails or does not call within the
        process group's timeout.
    """
    check_unimplemented(dropout_p)
    if alibi_slopes is not None:
        raise NotImplementedError(_ALIBI_NOT_IMPLEMENTED)
    check_layout(layout)
    left, right = window_bounds(window_size, causal)
    ring = Ring(group)
    with on_device(q):
        options = agreed_options(
            ring, q, k, v, partial(_check_layout_shard, layout=layout), layout, softmax_scale=softmax_scale,
            window_left=left, window_right=right, softcap=softcap, alibi_slopes=None, learnable_sink=learnable_sink,
        )  # fmt: skip
        # the sink joins the global result after the ring (``_merge_sink``), not the block calls
        setup = Setup(ring, layout, replace(options, learnable_sink=None))
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out, lse = _RingFlashAttention.apply(q, k, v, options.learnable_sink, setup)
    return (out, lse, None) if return_attn_probs else out


_ALIBI_NOT_IMPLEMENTED = (
    "alibi_slopes: ALiBi is not implemented in ring attention yet. Its bias -slope * |p - p'| uses global "
    "positions, but the attention kernels take the bias's diagonal from the block's own shape "
    "(seqlen_k - seqlen_q, the causal mask's diagonal), which differs from the global offset of a "
    "(query chunk, key chunk) pair of the ring; the kernels need an argument that sets the bias's diagonal "
    "apart from the mask's. Use flashtile.distributed.ulysses_flash_attn_func (it supports ALiBi), or "
    "flash_attn_func on one device."
)


def ring_flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "zigzag",
    learnable_sink: Tensor | None = None,
):
    """``ring_flash_attn_func`` on a packed qkv shard; gradients flow back into ``qkv``.

    Args:
        qkv: (batch_size, seqlen, 3, nheads, headdim), this rank's shard
        the rest: as ``ring_flash_attn_func``

    Raises:
        flashtile.InputError: qkv not (batch_size, seqlen, 3, nheads, headdim); the rest as
            ``ring_flash_attn_func``.

    Returns:
        out: (batch_size, seqlen, nheads, headdim), or (out, softmax_lse, None) if return_attn_probs
    """
    q, k, v = unpacked(qkv, "qkv", ("batch_size", "seqlen", 3, "nheads", "headdim"))
    return ring_flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, group, layout=layout, learnable_sink=learnable_sink,
    )  # fmt: skip
