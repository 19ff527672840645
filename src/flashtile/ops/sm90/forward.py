"""FlashAttention forward for Hopper (sm_90) in Gluon: warp specialized, FA-3 style.

On an H100/H200 (``flashtile._backend.gluon_refusal``) the forwards that qualify (``qualifies``: causal or a
sliding window, softcap and ALiBi; no dropout, attn_mask, sink or packed batch) run this kernel instead of the
portable Triton one (which every other GPU and the CPU interpreter run): head dim 64, 128 or 256 for q, k and v
(``CONFIGS``), causal (``CAUSAL_MIN_SEQLEN_Q``: every length), with a sliding window (any ``window_size``: LOCAL
below) or neither; softcap (by the SFU's tanh) and ALiBi (not with a window; ``common.capped_scores``,
``common.alibi_bias``: SOFTCAP, ALIBI); bf16/fp16; any seqlen_q
and seqlen_k >= 1; q, k and v in any layout whose last dimension is contiguous and whose other strides are 16-byte
multiples (``common.layout_refusal``): flash_attn's (batch, seqlen, nheads, headdim), q/k/v sliced from a packed
qkv, or torch's (batch, nheads, seqlen, headdim) as ``flashtile.scaled_dot_product_attention`` gets it.
``FLASHTILE_GLUON=0`` turns it off (``flashtile._backend.GLUON``).
Gluon has no CPU interpreter: tests/sm90_compile.py compiles it for sm_90 without a GPU, and the GPU tests run
it against the oracle.

Measured on an H200 (D=128, bf16, TFLOP/s): N=1k
555 / 389 causal against 393 / 316 for the Triton kernel, N=4k 642 / 530 against 536 / 478, N=16k 646 / 586
against 548 / 541 (cuDNN in the same run's table: 565 / 437, 605 / 541, 630 / 577). Those runs read
through 2-D (batch * seqlen, nheads * headdim) descriptors (lengths multiples of 128 only). With the rank-3
ones below: N=1k 553 / 389, N=4k 655 / 537, N=16k
647 / 615; lengths that are not multiples of 128, which took the Triton kernel before, B=4 N=4000 624 / 521
against 543 / 463 and B=8 N=1000 causal 340 against 273.

q, k, v and out are read and written through rank-3 tensor descriptors of the (batch, seqlen, nheads *
headdim) view with [1, rows, headdim] boxes (``batch_descriptor``) where the heads of a token lie side by side
(``rows_view_ok``), else through rank-4 descriptors of the (batch, nheads, seqlen, headdim) view with [1, 1, rows,
headdim] boxes (``common.head_major_descriptor``; out in q's form, v in k's: ``descriptor_of``). The kernel tells the
two apart by the rank of each descriptor's box at compile time (``head_major``, ``_box_at``), so the rank-3 variants
compile to the machine code they had before rank-4 descriptors (tests/sm90_compile.py's digests, Triton 3.7.1). A
tile never crosses a batch entry or a head: the copy engine fills a box's rows past seqlen with zeros on loads and
drops them on stores. Keys past seqlen_k in the last key tile (zeros) get score -inf; query rows past seqlen_q
(zeros) compute rows that the O store drops and the LSE store masks. Outputs: out (B, Sq, H, D) and lse (B, H, Sq)
fp32, natural log; a query row that sees no key (causal, seqlen_q > seqlen_k) gets out 0 and lse -inf, as the Triton
kernel.

Softcap and ALiBi modify each score tile before its mask (``_softmax_step``): softcap * tanh(s * scale / softcap)
in log2 units, and ALiBi's -slope * |i + seqlen_k - seqlen_q - j| (causal: slope * j - slope * (i + seqlen_k -
seqlen_q), a row and a column product, exact where the mask leaves the score; no tile of distances held), the slope
loaded once per work item.

A sliding window (LOCAL; CAUSAL off, a causal window being window_right = 0): each work item visits the key tiles
that hold a key of one of its rows' windows (``_work``: rows m0.. see keys m0 + seqlen_k - seqlen_q - window_left up to
the last row's + window_right), and the tiles that reach past a row's window on either side, or past seqlen_k, are
masked (``_softmax_step``); items are walked as without causal (persistent CTAs where O_TILE), as every item but
the first few visits about the same number of key tiles.

Work items: a NUM_WG * M_WG-row query tile of one head and batch entry, numbered query tiles fastest, then heads, then
batch entries (``_work``; causal: each head's heaviest, last, query tile first). Each CTA walks items t =
program_id, + num_programs, ... (``programs`` picks the count: one per SM at most, persistent, where O has its own
tile (D=64 and 128) without causal, and with causal, CAUSAL_PAIRS and CAUSAL_PERSISTENT (every head dim), CTA p
then walking a head's query tiles in pairs as slots p, p + num_programs, ... (``_pair_slot_item``); one per pair
of query tiles with CAUSAL_PAIRS alone; one per item, as a plain grid, otherwise). Ring positions, barrier
parities and the ping-pong turn carry on from one item to the next, so a persistent CTA's next item starts
loading while it finishes the last one. Per CTA:
  * producer partition, 1 warp: per item the NUM_WG Q tiles (once the consumers are done with the previous
    ones: q_empty), then K and V tiles into a ring of STAGES shared-memory buffers (each a [1, rows, headdim]
    or [1, 1, rows, headdim] box, which ``box_tile`` views as the [rows, headdim] tile wgmma reads); k_ready/v_ready
    (tx-count) barriers signal the consumers, k_empty/v_empty (count NUM_WG, one arrival per consumer warpgroup)
    signal the producer that a slot is free.
  * NUM_WG consumer warpgroups (three at D=64 without causal, two otherwise; the default partition = WG 0, 4-warp
    workers), M_WG query rows each: S = Q K^T (wgmma, A and B from shared memory), online softmax in base 2, O += P V
    (wgmma, P from registers). Iteration i issues S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back, waits only for
    S_i, does softmax_i while P_{i-1} V_{i-1} runs, then waits for it and rescales O. With PINGPONG NUM_WG mbarriers
    hand a "turn" around the warpgroups (WG 0 -> 1 -> .. -> 0): each waits for its turn, issues its two products and
    hands the turn on, so one issues while the others do their softmax (FA-3's warp scheduler barriers).
  * epilogue per item: O / l cast to the input dtype, TMA store from shared memory; lse by masked stores. With
    O_TILE the warpgroup's own O tile (once its previous store has read it), and the Q tile is handed back
    after the item's last S product; without, the (then free) Q tile, handed back once the store has read it.
"""

from __future__ import annotations

import functools
import heapq
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile._backend import Verdict, verdict
from flashtile.ops import _launch
from flashtile.ops._alloc import empty_output
from flashtile.ops._device import on_input_device, sm_count
from flashtile.ops.common.descriptors import Template, per_layout, rebase, template
from flashtile.ops.common.grid import cdiv
from flashtile.ops.common.math import LN2
from flashtile.ops.sm90.common import (
    ScoreMods,
    Window,
    alibi_bias,
    alibi_slope,
    box_buffers,
    box_tile,
    capped_scores,
    dtype_refusal,
    head_dim_refusal,
    head_major,
    head_major_descriptor,
    head_major_form,
    keyed_for,
    launch,
    layout_refusal,
    mma_layout,
    option_refusals,
    partition_barrier,
    shared_layout,
    tma_load,
    tma_store,
    window_args,
    window_of,
    window_refusal,
)
from flashtile.options import AttentionOptions

CONFIGS = {
    # 192-row items of three warpgroups, three stages of 128-key tiles: 24 KiB of Q, 96 KiB of K and V, 24 KiB of O
    64: {"M_WG": 64, "NUM_WG": 3, "BLOCK_N": 128, "STAGES": 3, "PINGPONG": True, "O_TILE": True,
         "CAUSAL_PAIRS": True, "CAUSAL_PERSISTENT": True, "CAUSAL_SCHEDULE": True, "CONSUMER_REGS": 160,
         "PRODUCER_REGS": 24},
    128: {"M_WG": 64, "NUM_WG": 2, "BLOCK_N": 128, "STAGES": 2, "PINGPONG": True, "O_TILE": True,
          "CAUSAL_PAIRS": True, "CAUSAL_PERSISTENT": True, "CAUSAL_SCHEDULE": False, "CONSUMER_REGS": 240,
          "PRODUCER_REGS": 24},
    # [64, 256] fp32 output accumulators: 64-key tiles (S and P stay small); Q and two stages of K and V fill
    # 192 KiB, so O leaves through the Q tile
    256: {"M_WG": 64, "NUM_WG": 2, "BLOCK_N": 64, "STAGES": 2, "PINGPONG": True, "O_TILE": False,
          "CAUSAL_PAIRS": True, "CAUSAL_PERSISTENT": True, "CAUSAL_SCHEDULE": False, "CONSUMER_REGS": 240,
          "PRODUCER_REGS": 24},
}  # fmt: skip
"""Per head dim this path serves: query rows per consumer warpgroup, key rows per tile, K/V ring depth,
ping-pong, O through its own shared-memory tile (O_TILE), causal query tiles walked in pairs (CAUSAL_PAIRS,
``_paired_item``), those pairs walked by persistent CTAs (CAUSAL_PERSISTENT, ``_pair_slot_item``), causal items
walked from lists the host deals (CAUSAL_SCHEDULE, ``causal_schedule``; it wins over the other two), registers per
thread of the consumers and the producer (setmaxnreg); a causal launch changes some of them (``config``,
CAUSAL_CHANGES). Short causal launches against the Triton kernel: see CAUSAL_MIN_SEQLEN_Q.

NUM_WG: consumer warpgroups per CTA, 2 (a work item is a 128-row query tile) or 3 (192-row items: FA-3's hdim-64
forward, 192 x 128 tiles; D=64). Triton pads the 1-warp producer to a warpgroup of its own and gives the default
partition (WG 0) what the workers leave of the 65536 registers: 240 per thread with two consumer warpgroups; with
three 160 for WG 1 and 2, 168 for WG 0 and 24 for the producer (168 * 128 + 2 * 160 * 128 + 24 * 128 = 65536).
Three at D=64: a warpgroup's softmax of its [64, 128] scores (8192 exp2, 512 cycles of the SM's MUFU, plus the max,
sum, scale and convert instructions) lasts as long as its two products (~512 tensor cycles) or longer, so with two
warpgroups the tensor pipe idles whenever one softmax outlasts the other's products; with three the other two
warpgroups' products cover it. Predicted +5-15% at N >= 4k; measured on the H200 (bf16, H = 32, B * N = 16k,
TFLOP/s, median of three interleaved rounds, docs/tuning/forward.md, 2026-11-30): N=1k 414.8 -> 416.2 (its 192-row
tiles pad 1024 rows to 1152), 2k 435.7 -> 476.8, 4k 448.2 -> 497.6, 8k 444.0 -> 513.6. Shared memory 147972 bytes;
compiled (tests/sm90_compile.py, Triton 3.6 and 3.7) no spills without causal and with EVEN_K, 8 bytes of stack
with a ragged last key tile (one value stored at an item's start and loaded in its epilogue), none with causal
(which folds the first key tile into the loop, ``_consumer``), which ships from seqlen_q 8k: shorter causal
launches at D=64 take two warpgroups (CAUSAL_CHANGES).

CAUSAL_PAIRS: a causal launch gets one CTA per pair of a head's query tiles, the heaviest with the lightest
(``_paired_item``), so every CTA walks about n_m + 1 key tiles (N=1k: 1024 CTAs of 9 tiles instead of 2048 of 1-8)
and its second item's Q and K/V load while the first finishes (the ring and barrier phases carry on, as in the
persistent launches). Both items read one head's K and V (L2 hits), unlike the global heaviest-first walks that
lost (O_TILE below). On the H200 (bf16, docs/tuning/forward.md) at D=128 it gave +6% at N=1k, +3-8% at 2k and 4k,
0-2% at 8k and 16k. At D=256 a first run-off gave N=1k -7%, but in interleaved rounds the pairs' own three runs
at N=1k spread from 310 to 442 TFLOP/s; the median of three rounds gave N=2k 507.1 -> 543.8, 1k 325.3 -> 394.3.

CAUSAL_PERSISTENT (with causal and CAUSAL_PAIRS): the pairs become slots walked by min(slots, SMs) persistent CTAs,
CTA p taking slots p, p + num_programs, ... (``_pair_slot_item``): neighbouring CTAs still read one head's K and V
at a time, and as every slot is about n_m + 1 key tiles the static walk stays balanced. Why: Nsight Compute at
D=128 causal N=1k (1024 paired CTAs, one per SM at a time: 7.76 waves) had the tensor pipe doing just the expected
work in 271k cycles, where the full kernel's efficiency would take ~201k; each CTA's start (launch, barrier init,
setmaxnreg, its first Q/K/V loads, the pipeline's ramp) is exposed 7.76 times per SM, and a persistent CTA pays it
once, loading each next slot while it finishes the last. Predicted +3-10% at D=128 causal N=1k-4k; measured (H200,
bf16, TFLOP/s, median of three interleaved rounds, 2026-11-30): D=128 N=1k 402.4 -> 444.7, 2k 501.3 -> 532.1, 4k
553.0 -> 566.4, 8k 576.4 -> 592.1, GQA 32/8 at 2k 501.7 -> 535.5; D=256 (with CAUSAL_PAIRS, against neither) N=512
310.7 -> 320.4, 1k 325.3 -> 341.3, 2k 507.1 -> 550.2.

CAUSAL_SCHEDULE (causal): min(items, SMs) persistent CTAs, each walking its own list of items, which the host deals
longest first to the least loaded CTA (``_lpt_schedule``, heads in groups of about one wave) and keeps on the GPU
per shape (``causal_schedule``). Why: a pair slot costs n_m + 1 key tiles, but slots split unevenly over the SMs
(D=64 at 2k: 16 query tiles x 256 heads = 2048 slots over 132 CTAs, 15 or 16 each), and every slot decodes its two
items; greedy dealing of single items evens the loads to within one item (computed makespans: pairs 2-3% above the
greedy deal at two warpgroups, ~10% at three warpgroups and 8k, whose 43 tiles pair oddly). Measured on the H200
(bf16, H = 32, B * N = 16k, forward TFLOP/s, median of rounds; docs/tuning/forward.md, 2026-12-01), list / pair slots:
D=64 2k 392.4 / 380.8 and 392.6 / 379.5, GQA 32/8 2k 394.9 / 385.0, 4k 412.1 / 415.1, 8k 468.9 / 452.7 and 459.8 /
449.3, 16k 480.9 / 476.3 and 484.7 / 479.0; D=128 8k 575.0 / 602.7 and 586.5 / 580.0, 1k 346.8 / 439.1 (noisy),
16k 615.3 / 599.7 and 602.9 / 600.1; D=256 2k 549.4 / 552.4. So lists at D=64 only; D=128 and 256 keep pair slots
until the D=128 1k loss is understood. A launch captured into a CUDA graph before its shape's first eager call
gets no list (no copy to the GPU may run then) and walks pair slots, the same arithmetic per item.

O_TILE: O leaves through a [NUM_WG, M_WG, D] tile of its own, so a CTA that walks several work items loads the next
item's Q while its epilogue stores O; without it O leaves through the Q tile, which goes to the next item once
the store has read it. Launches with O_TILE and without causal are persistent (``programs``). Measured on an
H200 (bf16, D=128, TFLOP/s, one CTA per item -> persistent with the O tile; branch 815003a before the D=256
merge): N=1k 553.8 -> 594.8, N=4k 625 -> 638; causal lost (N=1k 389 -> 369, N=16k 587 -> 565, with all
heads' heaviest tiles first); causal launches are persistent through CAUSAL_PERSISTENT's pair slots instead. At
D=256 the O tile does not fit: Q 64 + O 64 + K/V 128 KiB > the 227 KiB of a CTA. Shared memory (bytes,
tests/sm90_compile.py): D=64 147972 (131544 with two warpgroups), D=128 197016 (164200 before the O tile), D=256
196984; no spills at D=128 and 256 (D=64: NUM_WG above)."""
CAUSAL_CHANGES = {64: {"NUM_WG": 2, "CONSUMER_REGS": 240}}
"""Per head dim, the CONFIGS entries a causal launch shorter than CAUSAL_CHANGES_UNTIL changes (``config``). D=64:
128-row items of two consumer warpgroups, as at D=128, up to seqlen_q 16k; from there the 192-row items of three, as
without causal. H200, bf16, H = 32, B * N = 16k, causal forward TFLOP/s, median of three interleaved rounds, two
warpgroups against three (with the pairs walked persistently): 2026-11-30 N=1k 309.5 / 166.5, 2k 368.6 / 278.4, 4k 408.0
/ 380.1, 16k 436.8 / 467.7; 2026-12-01 2k 381.8 / 279.5, 4k 414.9 / 384.1, 8k 438.4 / 431.3, 16k 441.9 / 461.8. Why
three lost at short lengths, Nsight Compute at N=2k (2026-12-01): 22% more instructions executed, and 21% of the stall
samples wait for instructions (2.8% with two): the causal kernel of three warpgroups was 6,760 SASS instructions
(cuobjdump, Triton 3.7; 3,912 with two, 4,184 for three without causal), the diagonal tile's mask inlined in each
consumer warpgroup's prologue and loop, and the three warpgroups run different copies of it through one instruction
cache. Since 2026-12-01 three causal warpgroups fold the first key tile into the loop (``_consumer``'s FOLD): 4,440
instructions, no stack. 2026-12-01, median of three interleaved rounds (the fold in every config there), two warpgroups
/ three with the fold / three without: 2k 374.0 / 343.6 / 278.7, 4k 403.5 / 408.0 / 389.1, 8k 438.3 / 451.0 /
432.0, so two warpgroups stay below 8k."""
CAUSAL_CHANGES_UNTIL = {64: 8192}
"""Per head dim with CAUSAL_CHANGES, the seqlen_q from which causal launches take CONFIGS as they are (D=64: three
warpgroups from 8k; CAUSAL_CHANGES). 2026-12-01, three warpgroups before the fold against two (median of three rounds):
8k 439.0 / 439.9, 16k 462.7 / 444.9, 32k (B=1) 487.9 / 440.5; then 16k and up took three. 2026-12-01, B*N = 16k up to
16k, B=1 at 32k, H=32, forward TFLOP/s, median of three do_bench runs per process, two processes per tree alternating:
main (two warpgroups at 8k, three without the fold from 16k) / three with the fold: 8k
442.5, 444.8 / 463.9, 461.0; 16k 471.4, 470.6 / 489.3, 485.6; 32k 504.1, 491.6 / 504.2, 507.0."""
CAUSAL_MIN_SEQLEN_Q = {64: 1, 128: 1, 256: 1}
"""Per head dim, the shortest seqlen_q whose causal forwards run here (shorter ones run the Triton kernel): every
length since 2026-12-02. D=64 took the Triton kernel below N=2k from 2026-11-30 (H200, bf16, as in CAUSAL_CHANGES, this
kernel against the Triton one: N=1k 309.5 against 322.0, 2k 368.6 against 348.6). Since then this kernel walks its
causal items in pair slots or lists and its host path keeps a plan per layout; 2026-12-01 (median of three interleaved
rounds) N=1k 327.0 [325.9-327.2] against the Triton kernel's 317.2-341.7 (one kernel's spread over the run's columns);
2026-12-02 (five rounds) N=1k 323.2 [298.5-326.2] against 236.8 [197.3-264.4], N=512 187.9 [136.1-225.2] against 143.4
[134.4-166.7] TFLOP/s: never behind, and far ahead where the host is slow (the Triton route's host path
is the longer one)."""


def config(head_dim: int, causal: bool, seqlen_q: int) -> dict:
    """The constexprs of a launch's config: ``CONFIGS[head_dim]``, updated by ``CAUSAL_CHANGES`` for causal
    launches with seqlen_q below ``CAUSAL_CHANGES_UNTIL``."""
    if causal and seqlen_q < CAUSAL_CHANGES_UNTIL.get(head_dim, 0):
        return {**CONFIGS[head_dim], **CAUSAL_CHANGES[head_dim]}
    return CONFIGS[head_dim]


ROWS = CONFIGS[128]["NUM_WG"] * CONFIGS[128]["M_WG"]
"""Query rows per CTA (= BLOCK_N); the Gluon backward's lengths must be multiples of this (``descriptor``)."""


# ------------------------------------------------------------------------------------------------ layouts
@gluon.jit
def _box_at(desc, b, head, col, row):
    """The coordinates of ``desc``'s box of rows row.. of batch entry b and head ``head``, whose first column in the
    (batch, seqlen, nheads * headdim) view is ``col`` (head * headdim): (b, row, col) in a rank-3 descriptor, (b,
    head, row, 0) in a head-major one. The caller computes col (dropped as unused where head-major): computed in
    here, its instructions would sit in an inlined scope of their own, whose labels change how ptxas schedules the
    code around them."""
    if head_major(desc.block_shape):
        coords = (b, head, row, 0)
    else:
        coords = (b, row, col)
    return coords


# ------------------------------------------------------------------------------------------------ schedule
@gluon.jit
def _paired_item(t, n_m, n_bh):
    """Work item t of a causal launch with CAUSAL_PAIRS: (bh, m), the batch entry x head and query tile. CTA p
    (t = p, then p + num_programs, ``programs``) walks query tile n_m - 1 - j (the heaviest of its pair) and then
    tile j of the same head, for j < n_m // 2: n_m + 1 key tiles in all (at seqlen_q = seqlen_k) whatever j is,
    one CTA per pair instead of one per tile, and the pair's second tile loads while the first finishes. An odd
    n_m's middle tile has a CTA of its own (p >= n_bh * (n_m // 2)). Pairs need num_programs = n_bh * (n_m -
    n_m // 2) and the kernel's stride walk (any other count still covers every item once); with CAUSAL_PERSISTENT
    persistent CTAs walk these pairs as slots instead (``_pair_slot_item``)."""
    half = n_m // 2
    first = n_bh * (n_m - half)  # = num_programs
    pairs = n_bh * half
    per_head = gl.maximum(half, 1)  # (half = 0: every t is a middle tile below, and no division runs)
    if t < pairs:
        bh = t // per_head
        m = n_m - 1 - (t - bh * per_head)
    elif t < first:
        bh = t - pairs
        m = half
    else:
        bh = (t - first) // per_head
        m = t - first - bh * per_head
    return bh, m


@gluon.jit
def _pair_slot_item(k, n_m, n_bh):
    """Item k (0, 1, ...) of this CTA in a causal launch with CAUSAL_PAIRS and CAUSAL_PERSISTENT: (bh, m), the
    batch entry x head and query tile. The n_bh * (n_m - n_m // 2) slots are ``_paired_item``'s CTAs: slot
    u < n_bh * half (half = n_m // 2) the pair (bh, j) = (u // half, u % half), query tile n_m - 1 - j then j; an
    odd n_m's middle tiles after them, slot n_bh * half + bh the tile half of bh. CTA p walks slots p, p +
    num_programs, ...: its pair slots first (two items each), then its middle slots (one each); any number of
    programs covers every slot once (``_pair_slot_item_count`` counts a CTA's items)."""
    cta = gl.program_id(0)
    n_ctas = gl.num_programs(0)
    half = n_m // 2
    pairs = n_bh * half
    own_pairs = gl.cdiv(pairs - cta, n_ctas)  # slots cta, cta + n_ctas, ... below pairs (cta < n_ctas: >= 0)
    if k < 2 * own_pairs:
        slot = cta + (k // 2) * n_ctas
        bh = slot // half  # half >= 1: with half = 0 there are no pair slots
        j = slot - bh * half
        if k % 2 == 0:
            m = n_m - 1 - j
        else:
            m = j
    else:
        bh = cta + (k - own_pairs) * n_ctas - pairs
        m = half
    return bh, m


@gluon.jit
def _pair_slot_item_count(n_m, n_items):
    """How many items this CTA walks with CAUSAL_PERSISTENT (``_pair_slot_item``): two per pair slot p, p +
    num_programs, ... below n_bh * (n_m // 2), then one per middle slot below n_bh * (n_m - n_m // 2)."""
    cta = gl.program_id(0)
    n_ctas = gl.num_programs(0)
    half = n_m // 2
    n_bh = n_items // n_m
    return gl.cdiv(n_bh * half - cta, n_ctas) + gl.cdiv(n_bh * (n_m - half) - cta, n_ctas)


@gluon.jit
def _walk(
    n_m,
    n_items,
    schedule,
    CAUSAL: gl.constexpr,
    CAUSAL_PAIRS: gl.constexpr,
    CAUSAL_PERSISTENT: gl.constexpr,
    CAUSAL_SCHEDULE: gl.constexpr,
):
    """(start, stop, step) of this CTA's loop over t, the work items it passes to ``_work``: with causal and
    CAUSAL_SCHEDULE the positions of its items in ``schedule`` (``causal_schedule``); with causal, CAUSAL_PAIRS
    and CAUSAL_PERSISTENT its own items 0, 1, ... (``_pair_slot_item_count``); otherwise items program_id, +
    num_programs, ... below n_items."""
    if CAUSAL and CAUSAL_SCHEDULE:
        cta = gl.program_id(0)
        start, stop, step = gl.load(schedule + cta), gl.load(schedule + cta + 1), 1
    elif CAUSAL and CAUSAL_PAIRS and CAUSAL_PERSISTENT:
        start, stop, step = 0, _pair_slot_item_count(n_m, n_items), 1
    else:
        start, stop, step = gl.program_id(0), n_items, gl.num_programs(0)
    return start, stop, step


@gluon.jit
def _work(
    t,
    n_m,
    n_items,
    nheads,
    seqlen_q,
    seqlen_k,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    schedule,
    window_left,
    window_right,
    CAUSAL: gl.constexpr,
    CAUSAL_PAIRS: gl.constexpr,
    CAUSAL_PERSISTENT: gl.constexpr,
    CAUSAL_SCHEDULE: gl.constexpr,
    LOCAL: gl.constexpr,
):
    """Work item t of n_items: (b, h, m0, first, n_blocks), the batch entry, query head, first query row, and the
    first key tile and number of key tiles to visit (first is 0 but with LOCAL, whose tiles are those holding a
    key of some row's window: rows m0.. see keys from m0 + seqlen_k - seqlen_q - window_left up to the last
    row's + window_right). Query tiles vary fastest, then heads, then batch entries, as the blocks of a (query
    tiles, heads, batch) grid: CTAs side by side read the same head's K and V (L2 hits). Causal: each head's
    heaviest (last) query tile first, so the long walks start first and the short ones fill in at the end; with
    CAUSAL_PAIRS the heaviest and lightest tiles of a head go to one CTA (``_paired_item``), and with
    CAUSAL_PERSISTENT too t is the CTA's own item number (0, 1, ...) in its walk over pair slots
    (``_pair_slot_item``); with CAUSAL_SCHEDULE t is a position in ``schedule`` (``_walk``), whose entry there is the
    item bh * n_m + m."""
    if CAUSAL and CAUSAL_SCHEDULE:
        item = gl.load(schedule + gl.num_programs(0) + 1 + t)
        bh = item // n_m
        m = item - bh * n_m
    elif CAUSAL and CAUSAL_PAIRS and CAUSAL_PERSISTENT:
        bh, m = _pair_slot_item(t, n_m, n_items // n_m)
    elif CAUSAL and CAUSAL_PAIRS:
        bh, m = _paired_item(t, n_m, n_items // n_m)
    else:
        bh = t // n_m
        m = t - bh * n_m
        if CAUSAL:
            m = n_m - 1 - m
    b = bh // nheads
    h = bh - b * nheads
    m0 = m * BLOCK_M
    if LOCAL:
        diag_off = seqlen_k - seqlen_q
        kv_lo = gl.maximum(m0 + diag_off - window_left, 0)  # < seqlen_k: m0 < seqlen_q, window_left >= 0
        kv_end = gl.minimum(m0 + BLOCK_M + diag_off + window_right, seqlen_k)
        first = kv_lo // BLOCK_N
        # a tile that sees no key still runs one (fully masked) block
        n_blocks = gl.maximum(gl.cdiv(kv_end, BLOCK_N) - first, 1)
    else:
        if CAUSAL:
            kv_end = gl.minimum(seqlen_k, m0 + BLOCK_M + seqlen_k - seqlen_q)
            kv_end = gl.maximum(kv_end, 1)  # a tile that sees no key still runs one (fully masked) block
        else:
            kv_end = seqlen_k
        first = 0
        n_blocks = gl.cdiv(kv_end, BLOCK_N)
    return b, h, m0, first, n_blocks


# ------------------------------------------------------------------------------------------------ producer
@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_bar,
    q_empty,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    n_m,
    n_items,
    nheads,
    group,
    seqlen_q,
    seqlen_k,
    schedule,
    window_left,
    window_right,
    HEAD_D: gl.constexpr,
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    CAUSAL_PAIRS: gl.constexpr,
    CAUSAL_PERSISTENT: gl.constexpr,
    CAUSAL_SCHEDULE: gl.constexpr,
    LOCAL: gl.constexpr,
):
    """Per work item of this CTA (``_work``): the NUM_WG Q tiles ([M_WG, HEAD_D] each), once the consumers are
    done with the previous ones (q_empty), then the K and V tiles through the ring; the ring position (it) runs
    on across items, so the next item's first tiles load while the consumers finish the last one."""
    # Coordinates (``_box_at``) are (batch entry, row, column) of the (batch, seqlen, nheads * headdim) view or
    # (batch entry, head, row, 0) of the (batch, nheads, seqlen, headdim) view. A box that reaches past seqlen (or
    # lies wholly past it) is zero-filled there and still completes its full byte count on the barrier, so the
    # expected bytes are always the box's.
    NUM_WG: gl.constexpr = q_smem.shape[0]  # one Q tile per consumer warpgroup
    it = 0
    item = 0
    start, stop, step = _walk(n_m, n_items, schedule, CAUSAL, CAUSAL_PAIRS, CAUSAL_PERSISTENT, CAUSAL_SCHEDULE)
    for t in range(start, stop, step):
        b, h, m0, first, n_blocks = _work(
            t, n_m, n_items, nheads, seqlen_q, seqlen_k, NUM_WG * M_WG, BLOCK_N, schedule, window_left, window_right,
            CAUSAL, CAUSAL_PAIRS, CAUSAL_PERSISTENT, CAUSAL_SCHEDULE, LOCAL,
        )  # fmt: skip
        kv_head = h // group
        kv_col = kv_head * HEAD_D
        for w in gl.static_range(NUM_WG):
            # a fresh barrier passes a wait on parity 1, so the first item (and the first round through the
            # ring below) does not block
            mbarrier.wait(q_empty.index(w), (item & 1) ^ 1)
            mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
            tma_load(q_desc, _box_at(q_desc, b, h, h * HEAD_D, m0 + w * M_WG), q_bar.index(w), q_smem.index(w))
        for i in range(n_blocks):
            s = it % STAGES
            ph = ((it // STAGES) & 1) ^ 1
            row = (first + i) * BLOCK_N
            mbarrier.wait(k_empty.index(s), ph)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma_load(k_desc, _box_at(k_desc, b, kv_head, kv_col, row), k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), ph)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma_load(v_desc, _box_at(v_desc, b, kv_head, kv_col, row), v_ready.index(s), v_smem.index(s))
            it += 1
        item += 1


# ------------------------------------------------------------------------------------------------ consumer
@gluon.jit
def _softmax_step(
    s_acc,
    m_i,
    l_i,
    qk_scale,
    kv_start,
    q_pos0,
    diag_off,
    seqlen_k,
    window_left,
    window_right,
    softcap,
    slope,
    M_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    EVEN_K: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr,
):
    """One online-softmax step on the raw scores tile s_acc [M_WG, BLOCK_N] (fp32, mma layout) of keys
    kv_start.. and query rows q_pos0.. . m_i is kept in scaled log2 units (max of s * softmax_scale *
    log2(e)). With SOFTCAP or ALIBI the scores are modified first (``common.capped_scores``,
    ``common.alibi_bias``), then masked.
    Returns p (fp32), alpha, m_new, l_new."""
    s_layout: gl.constexpr = s_acc.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    if SOFTCAP or ALIBI:
        s_acc, _ = capped_scores(s_acc, qk_scale, softcap, SOFTCAP)
        if ALIBI:
            queries = (q_pos0 + diag_off) + gl.arange(0, M_WG, layout=gl.SliceLayout(1, s_layout))
            keys = kv_start + gl.arange(0, BLOCK_N, layout=col_layout)
            s_acc = s_acc + alibi_bias(queries[:, None], keys[None, :], slope, CAUSAL)
        qk_scale = 1.0  # s_acc is in log2 units now
    if LOCAL:
        # Query row r sees keys r + diag_off - window_left .. r + diag_off + window_right below seqlen_k. Only tiles
        # that reach past the last row's first key, the first row's last key or seqlen_k need the mask.
        last_key = gl.minimum(q_pos0 + diag_off + window_right, seqlen_k - 1)
        if (kv_start < q_pos0 + M_WG - 1 + diag_off - window_left) | (kv_start + BLOCK_N - 1 > last_key):
            rows = q_pos0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, s_layout))
            cols = kv_start + gl.arange(0, BLOCK_N, layout=col_layout)
            offset = cols[None, :] - rows[:, None]
            keep = (offset >= diag_off - window_left) & (offset <= diag_off + window_right)
            keep = keep & (cols[None, :] < seqlen_k)
            s_acc = gl.where(keep, s_acc, gl.full(s_acc.shape, float("-inf"), gl.float32, s_layout))
    elif CAUSAL:
        # Only tiles that cross the diagonal of this warpgroup's rows need the mask. It also hides the keys
        # past seqlen_k from every query row below seqlen_q (cols <= row + seqlen_k - seqlen_q < seqlen_k),
        # and a tile with such keys crosses the diagonal of any warpgroup that has such a row.
        if kv_start + BLOCK_N > q_pos0 + diag_off + 1:
            rows = q_pos0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, s_layout))
            cols = kv_start + gl.arange(0, BLOCK_N, layout=col_layout)
            keep = cols[None, :] <= (rows + diag_off)[:, None]
            s_acc = gl.where(keep, s_acc, gl.full(s_acc.shape, float("-inf"), gl.float32, s_layout))
    elif not EVEN_K:
        # (EVEN_K, seqlen_k a multiple of BLOCK_N, compiles this out: aligned full forwards ran ~3% slower on
        # the H200 with the check)
        if kv_start + BLOCK_N > seqlen_k:
            # the last tile: its keys past seqlen_k are zeros
            cols = kv_start + gl.arange(0, BLOCK_N, layout=col_layout)
            keep = cols[None, :] < seqlen_k
            s_acc = gl.where(keep, s_acc, gl.full(s_acc.shape, float("-inf"), gl.float32, s_layout))
    m_new = gl.maximum(m_i, gl.max(s_acc, 1) * qk_scale)
    if CAUSAL or LOCAL:
        # rows that have seen no key yet (causal: only when seqlen_q > seqlen_k): keep exp2 finite
        m_use = gl.where(m_new == float("-inf"), gl.zeros_like(m_new), m_new)
    else:
        m_use = m_new
    p = gl.exp2(s_acc * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    args,
    M_WG: gl.constexpr,
    HEAD_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    EVEN_K: gl.constexpr,
    PINGPONG: gl.constexpr,
    O_TILE: gl.constexpr,
    CAUSAL_PAIRS: gl.constexpr,
    CAUSAL_PERSISTENT: gl.constexpr,
    CAUSAL_SCHEDULE: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr,
):
    """Consumer warpgroup WG (0 .. NUM_WG - 1): rows WG * M_WG.. of each work item's query tile (``_work``); the
    ring position (it), the item count and the ping-pong parity run on across items as the producer's do.
    ``args``: the kernel's consumer_args (its runtime values, the same for every warpgroup)."""
    (
        o_desc,
        q_smem,
        o_smem,
        k_smem,
        v_smem,
        q_bar,
        q_empty,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        turn,
        lse_ptr,
        n_m,
        n_items,
        nheads,
        seqlen_q,
        seqlen_k,
        qk_scale,
        schedule,
        window_left,
        window_right,
        softcap,
        alibi_ptr,
        alibi_stride_b,
    ) = args
    dtype: gl.constexpr = q_smem.dtype
    NUM_WG: gl.constexpr = q_smem.shape[0]  # one Q tile per consumer warpgroup
    # Three causal warpgroups fold the first key tile into the loop (one copy of the masked softmax step per
    # warpgroup instead of two): their kernel outgrew the instruction cache (CAUSAL_CHANGES).
    FOLD: gl.constexpr = CAUSAL and NUM_WG == 3
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_tile = box_tile(q_smem, WG)
    o_tile = box_tile(o_smem, WG)  # the Q tile itself without O_TILE
    my_turn = turn.index(WG)
    next_turn = turn.index((WG + 1) % NUM_WG)
    # WG 0 starts with the turn (parity 1 on a fresh barrier passes), WG w > 0 waits for WG w - 1's first hand-off
    turn_ph = 1 if WG == 0 else 0
    s_zero = gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout)
    diag_off = seqlen_k - seqlen_q

    it = 0
    item = 0
    start, stop, step = _walk(n_m, n_items, schedule, CAUSAL, CAUSAL_PAIRS, CAUSAL_PERSISTENT, CAUSAL_SCHEDULE)
    for t in range(start, stop, step):
        b, h, m0, first, n_blocks = _work(
            t, n_m, n_items, nheads, seqlen_q, seqlen_k, NUM_WG * M_WG, BLOCK_N, schedule, window_left, window_right,
            CAUSAL, CAUSAL_PAIRS, CAUSAL_PERSISTENT, CAUSAL_SCHEDULE, LOCAL,
        )  # fmt: skip
        q_pos0 = m0 + WG * M_WG
        kv_first = first * BLOCK_N
        slope = alibi_slope(alibi_ptr, b * alibi_stride_b, h, ALIBI)
        acc = gl.zeros([M_WG, HEAD_D], gl.float32, o_layout)
        m_i = gl.full([M_WG], float("-inf"), gl.float32, row_s)
        l_i = gl.full([M_WG], 0.0, gl.float32, row_s)

        mbarrier.wait(q_bar.index(WG), item & 1)

        if FOLD:
            # no prologue: the loop starts at the first key tile, adding P_{-1} = 0 times V_0 there
            p_op = gl.zeros([M_WG, BLOCK_N], dtype, p_layout)
        else:
            # ---- prologue: S_0 and softmax_0
            s0 = it % STAGES
            mbarrier.wait(k_ready.index(s0), (it // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(my_turn, turn_ph)
                turn_ph ^= 1
            k_tile = box_tile(k_smem, s0)
            s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(next_turn, count=1)
            s_acc, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_tile, k_tile))
            mbarrier.arrive(k_empty.index(s0), count=1)
            p, alpha, m_i, l_i = _softmax_step(
                s_acc, m_i, l_i, qk_scale, kv_first, q_pos0, diag_off, seqlen_k, window_left, window_right, softcap,
                slope, M_WG, BLOCK_N, CAUSAL, EVEN_K, LOCAL, SOFTCAP, ALIBI,
            )  # fmt: skip
            p_op = gl.convert_layout(p.to(dtype), p_layout)

        # ---- steady state: S_i = Q K_i^T and O += P_{i-1} V_{i-1} in flight together
        for i in range(0 if FOLD else 1, n_blocks):
            j = it + i
            s = j % STAGES
            ph = (j // STAGES) & 1
            jp = j - 1
            if FOLD:
                jp = gl.maximum(jp, it)  # V_0 at i = 0 (P_{-1} is zeros)
            sp = jp % STAGES
            php = (jp // STAGES) & 1
            mbarrier.wait(k_ready.index(s), ph)
            if PINGPONG:
                mbarrier.wait(my_turn, turn_ph)
                turn_ph ^= 1
            k_tile = box_tile(k_smem, s)
            s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(sp), php)
            v_tile = box_tile(v_smem, sp)
            acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(next_turn, count=1)
            # wgmma groups retire in order: <= 1 outstanding means S_i is done
            s_acc, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_tile, k_tile))
            mbarrier.arrive(k_empty.index(s), count=1)
            p, alpha, m_i, l_i = _softmax_step(
                s_acc, m_i, l_i, qk_scale, kv_first + i * BLOCK_N, q_pos0, diag_off, seqlen_k, window_left,
                window_right, softcap, slope, M_WG, BLOCK_N, CAUSAL, EVEN_K, LOCAL, SOFTCAP, ALIBI,
            )  # fmt: skip
            acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, v_tile))
            if FOLD:
                mbarrier.arrive(v_empty.index(sp), count=1, pred=i > 0)  # V_0 is released after its real product
            else:
                mbarrier.arrive(v_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        if O_TILE:
            # every S product of this item is done: the producer may load the next item's Q tile
            mbarrier.arrive(q_empty.index(WG), count=1)

        # ---- epilogue: O += P_{n-1} V_{n-1}
        jl = it + n_blocks - 1
        sl = jl % STAGES
        mbarrier.wait(v_ready.index(sl), (jl // STAGES) & 1)
        v_tile = box_tile(v_smem, sl)
        acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, v_tile))
        mbarrier.arrive(v_empty.index(sl), count=1)

        # ---- normalize, store O through shared memory (rows past seqlen_q are dropped), store lse
        l_safe = gl.where(l_i == 0.0, gl.full_like(l_i, 1.0), l_i)
        o = acc / gl.convert_layout(l_safe, row_o)[:, None]
        if O_TILE:
            # the previous item's store has read the O tile (the issuing thread waits, the barrier holds the
            # others)
            tma.store_wait(0)
            partition_barrier()
        o_tile.store(o.to(dtype))
        fence_async_shared()
        tma_store(o_desc, _box_at(o_desc, b, h, h * HEAD_D, q_pos0), o_smem.index(WG))

        lse = (m_i + gl.log2(l_i)) * LN2  # l_i == 0 (no key seen) gives -inf
        rows = q_pos0 + gl.arange(0, M_WG, layout=row_s)
        gl.store(lse_ptr + (b * nheads + h).to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
        if not O_TILE:
            # O went out through the Q tile: the next item's Q may load into it once the store has read it
            tma.store_wait(0)
            partition_barrier()
            mbarrier.arrive(q_empty.index(WG), count=1)
        it += n_blocks
        item += 1
    tma.store_wait(0)


# ------------------------------------------------------------------------------------------------ kernel
@gluon.jit(
    do_not_specialize=[
        "seqlen_q",
        "seqlen_k",
        "batch",
        "nheads",
        "group",
        "window_left",
        "window_right",
        "alibi_stride_b",
    ]
)  # ``launch``
def _attention_forward_sm90_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    lse_ptr,
    qk_scale,
    seqlen_q,
    seqlen_k,
    batch,
    nheads,
    group,
    schedule,
    window_left,
    window_right,
    softcap,
    alibi_ptr,
    alibi_stride_b,
    HEAD_D: gl.constexpr,
    M_WG: gl.constexpr,
    NUM_WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    EVEN_K: gl.constexpr,
    PINGPONG: gl.constexpr,
    O_TILE: gl.constexpr,
    CAUSAL_PAIRS: gl.constexpr,
    CAUSAL_PERSISTENT: gl.constexpr,
    CAUSAL_SCHEDULE: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    gl.static_assert(not (CAUSAL and LOCAL), "a window launch runs with CAUSAL off (its window_right is 0)")
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3, "two or three consumer warpgroups (the partitions below)")
    n_m = gl.cdiv(seqlen_q, NUM_WG * M_WG)
    n_items = n_m * batch * nheads

    dtype: gl.constexpr = q_desc.dtype
    # O leaves in q's form (through the Q tile without O_TILE), V loads in K's (at K's coordinates)
    gl.static_assert(head_major(o_desc.block_shape) == head_major(q_desc.block_shape), "out in q's form")
    gl.static_assert(head_major(v_desc.block_shape) == head_major(k_desc.block_shape), "v in k's form")
    # the descriptors' boxes ([1, rows, HEAD_D], or [1, 1, rows, HEAD_D] head-major), viewed as [rows, HEAD_D]
    # tiles by the consumers (box_tile)
    q_smem = gl.allocate_shared_memory(dtype, box_buffers(NUM_WG, q_desc.block_shape), q_desc.layout)
    if O_TILE:
        o_smem = gl.allocate_shared_memory(dtype, box_buffers(NUM_WG, o_desc.block_shape), o_desc.layout)
    else:
        o_smem = q_smem
    k_smem = gl.allocate_shared_memory(dtype, box_buffers(STAGES, k_desc.block_shape), k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, box_buffers(STAGES, v_desc.block_shape), v_desc.layout)

    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_WG):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=NUM_WG)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(s), count=NUM_WG)

    # constexprs travel as separate arguments (inside a tuple they would arrive as tensors); the runtime
    # arguments of every consumer warpgroup as one tuple
    consumer_args = (
        o_desc,
        q_smem,
        o_smem,
        k_smem,
        v_smem,
        q_bar,
        q_empty,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        turn,
        lse_ptr,
        n_m,
        n_items,
        nheads,
        seqlen_q,
        seqlen_k,
        qk_scale,
        schedule,
        window_left,
        window_right,
        softcap,
        alibi_ptr,
        alibi_stride_b,
    )
    # Consumer warpgroup 0 is the default partition; the workers are consumer warpgroup 1, the 1-warp producer and,
    # with NUM_WG = 3, consumer warpgroup 2, which the slices drop at NUM_WG = 2 (after the producer, so that the
    # two-warpgroup kernel keeps its partitions; tuple + would unwrap the constexpr arguments into ints).
    gl.warp_specialize(
        [
            (
                _consumer,
                (0, consumer_args, M_WG, HEAD_D, BLOCK_N, STAGES, CAUSAL, EVEN_K, PINGPONG, O_TILE, CAUSAL_PAIRS,
                 CAUSAL_PERSISTENT, CAUSAL_SCHEDULE, LOCAL, SOFTCAP, ALIBI),
            ),
            (
                _consumer,
                (1, consumer_args, M_WG, HEAD_D, BLOCK_N, STAGES, CAUSAL, EVEN_K, PINGPONG, O_TILE, CAUSAL_PAIRS,
                 CAUSAL_PERSISTENT, CAUSAL_SCHEDULE, LOCAL, SOFTCAP, ALIBI),
            ),
            (
                _producer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bar,
                    q_empty,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    n_m,
                    n_items,
                    nheads,
                    group,
                    seqlen_q,
                    seqlen_k,
                    schedule,
                    window_left,
                    window_right,
                    HEAD_D,
                    M_WG,
                    BLOCK_N,
                    STAGES,
                    CAUSAL,
                    CAUSAL_PAIRS,
                    CAUSAL_PERSISTENT,
                    CAUSAL_SCHEDULE,
                    LOCAL,
                ),
            ),
            (
                _consumer,
                (2, consumer_args, M_WG, HEAD_D, BLOCK_N, STAGES, CAUSAL, EVEN_K, PINGPONG, O_TILE, CAUSAL_PAIRS,
                 CAUSAL_PERSISTENT, CAUSAL_SCHEDULE, LOCAL, SOFTCAP, ALIBI),
            ),
        ][: NUM_WG + 1],
        [4, 1, 4][:NUM_WG],
        [CONSUMER_REGS, PRODUCER_REGS, CONSUMER_REGS][:NUM_WG],
    )  # fmt: skip


def qualifies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, varlen: bool = False
) -> Verdict:
    """Whether this kernel computes attention(q, k, v, options), on any device (the device itself is the
    dispatcher's, ``_backend.gluon_refusal``): the options of both sm_90 kernels (``common.option_refusals``) and no
    learnable sink; bf16/fp16, one head dim of CONFIGS for q, k and v (with causal, seqlen_q from
    CAUSAL_MIN_SEQLEN_Q), any lengths but neither q nor k empty (a descriptor's dimensions are positive; no key would
    leave out and lse to fill), and layouts its tensor descriptors can read (``common.layout_refusal``; q and out in
    one form, k and v in another)."""
    reasons = [*option_refusals(options, varlen), "a learnable sink" if options.learnable_sink is not None else None]
    if not varlen:
        head_dim = q.shape[3]
        reasons.append(window_refusal(options, head_dim, kernel="forward"))
        causal_min = CAUSAL_MIN_SEQLEN_Q.get(head_dim, q.shape[1] + 1) if options.causal else 0
        reasons += (
            dtype_refusal(q),
            head_dim_refusal(q, k, v, CONFIGS),
            f"causal with seqlen_q {q.shape[1]} < {causal_min}" if q.shape[1] < causal_min else None,
            "an empty q or k" if q.numel() == 0 or k.numel() == 0 else None,
            layout_refusal(dict(q=q), dict(k=k, v=v)),
        )
    return verdict(reasons)


@per_layout
def batch_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A rank-3 tensor descriptor of the (batch, seqlen, nheads * headdim) view of ``x`` (``rows_view_ok``) with
    [1, rows, headdim] boxes: the copy engine zero-fills a box's rows past seqlen on loads and drops them on
    stores, so any seqlen works."""
    batch, seqlen, nheads, head_dim = x.shape
    layout = shared_layout((1, rows, head_dim), x.dtype)
    # seqlen * stride(1) is stride(0) when batch > 1 (rows_view_ok), and 16-byte aligned when batch == 1 too
    strides = [seqlen * x.stride(1), x.stride(1), 1]
    return TensorDescriptor(x, [batch, seqlen, nheads * head_dim], strides, [1, rows, head_dim], layout)


def descriptor_of(*tensors: torch.Tensor):
    """The descriptor maker of tensors read in one form (q and out; k and v): ``batch_descriptor`` where each has
    rows views, else ``head_major_descriptor`` (``common.head_major_form``)."""
    return head_major_descriptor if head_major_form(*tensors) else batch_descriptor


def programs(n_m: int, n_bh: int, cfg: dict, causal: bool, device: torch.device) -> int:
    """CTAs to launch for n_m query tiles x n_bh heads and batch entries with config ``cfg``: at most one per SM
    (persistent, each walking several items) where O has its own tile (O_TILE) and the launch is not causal;
    with causal and CAUSAL_PAIRS one per pair of query tiles (``_paired_item``), or with CAUSAL_PERSISTENT too
    min(pair slots, SMs), each walking several slots (``_pair_slot_item``; n_bh * ceil(n_m / 2) slots, an odd
    n_m's middle tile one of its own); else one per item (each CTA's loop runs once; the hardware starts them in
    ``_work``'s order). The kernel is correct with any count from 1 to n_m * n_bh; CONFIGS says why this one."""
    if causal and cfg["CAUSAL_SCHEDULE"]:
        return min(n_m * n_bh, sm_count(device))
    if causal and cfg["CAUSAL_PAIRS"]:
        slots = n_bh * (n_m - n_m // 2)
        return min(slots, sm_count(device)) if cfg["CAUSAL_PERSISTENT"] else slots
    if cfg["O_TILE"] and not causal:
        return min(n_m * n_bh, sm_count(device))
    return n_m * n_bh


SCHEDULE_ITEM_COST = 1
"""A work item's fixed cost in key tiles (its Q load, the pipeline's ramp, the epilogue) in ``_lpt_schedule``'s
balance."""


@functools.lru_cache(maxsize=256)
def _lpt_schedule(
    n_m: int, n_bh: int, n_ctas: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int
) -> tuple[int, ...]:
    """A causal launch's items (bh * n_m + m) dealt to n_ctas persistent CTAs, longest first to the least loaded
    CTA (greedy longest-processing-time), as (n_ctas + 1) offsets then the items: CTA p walks items offsets[p] ..
    offsets[p + 1] - 1 in that order. Items go in groups of about n_ctas (n_ctas // n_m heads at a time, each
    group's query tiles heaviest first), so the CTAs at work at one time read few heads' K and V (L2 hits), and
    the last group's light tiles even out the CTAs' loads at the end. Cost of an item: its key tiles (``_work``)
    plus SCHEDULE_ITEM_COST."""
    diag = seqlen_k - seqlen_q
    cost = [max(cdiv(min(seqlen_k, (m + 1) * block_m + diag), block_n), 1) + SCHEDULE_ITEM_COST for m in range(n_m)]
    group = max(1, n_ctas // n_m)
    loads = [(0, p) for p in range(n_ctas)]
    walks: list[list[int]] = [[] for _ in range(n_ctas)]
    for first in range(0, n_bh, group):
        for m in reversed(range(n_m)):
            for bh in range(first, min(first + group, n_bh)):
                load, p = heapq.heappop(loads)
                walks[p].append(bh * n_m + m)
                heapq.heappush(loads, (load + cost[m], p))
    offsets = [0]
    for walk in walks:
        offsets.append(offsets[-1] + len(walk))
    return (*offsets, *(item for walk in walks for item in walk))


_SCHEDULES: dict[tuple, torch.Tensor] = {}
"""``causal_schedule``'s tensors by their key; kept for good, as a captured CUDA graph may read any of them."""


def causal_schedule(
    n_m: int, n_bh: int, n_ctas: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, device: torch.device
) -> torch.Tensor | None:
    """``_lpt_schedule`` as an int32 tensor on ``device``, made on the first launch of its key; None when that
    launch is being captured into a CUDA graph (no copy to the GPU can run then): the caller walks pairs."""
    key = (n_m, n_bh, n_ctas, seqlen_q, seqlen_k, block_m, block_n, device)
    schedule = _SCHEDULES.get(key)
    if schedule is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        schedule = torch.tensor(_lpt_schedule(*key[:-1]), dtype=torch.int32, device=device)
        _SCHEDULES[key] = schedule
    return schedule


class ForwardPlan(NamedTuple):
    """What a launch follows from its inputs' layouts (``forward_plan``'s key), kept per key: the grid, the descriptor
    templates of q, k, v and out (``descriptors.template``), the kernel's int arguments (seqlen_q, seqlen_k, batch,
    nheads, group), the causal schedule or None, the window's bounds (``common.window_args``), the constexprs, and
    ``launch``'s ``keyed`` (their values in parameter order and the arguments' ``launch_key``)."""

    grid: tuple[int, int, int]
    descriptors: tuple[Template, Template, Template, Template]
    ints: tuple[int, int, int, int, int]
    schedule: torch.Tensor | None
    window: tuple[int, int]
    constexprs: dict
    keyed: tuple[list, tuple]


_PLANS = _launch.Plans()
"""``forward_plan``'s plans by ``_plan_key``; None for inputs that do not qualify."""


def _plan_key(q, k, v, out, lse, causal: bool, window: Window | None, mods: ScoreMods) -> tuple:
    """What a plan follows from: the shapes and strides of q, k and v, the strides of out and lse, the dtypes of q
    and out (k and v have q's, lse is float32: the callers' contract), the device, causal, the window, the score
    modifications' key (``common.ScoreMods.key``), whether every tensor's
    address is 16-byte aligned, the device's SM count, and the head dim's config (``config``, read on every call, so a
    changed CONFIGS entry makes new plans) and CAUSAL_MIN_SEQLEN_Q."""
    head_dim = q.shape[3]
    cfg = CONFIGS.get(head_dim) and tuple(config(head_dim, causal and window is None, q.shape[1]).values())
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | lse.data_ptr()) % 16 == 0
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(), lse.stride(), q.dtype, out.dtype,
        q.device, sm_count(q.device), causal, window, mods.key, aligned, cfg, CAUSAL_MIN_SEQLEN_Q.get(head_dim),
    )  # fmt: skip


def forward_plan(q, k, v, out, lse, causal: bool, window: Window | None, mods: ScoreMods) -> ForwardPlan:
    """The plan of a launch on these tensors (``attention_forward_sm90``'s; they qualify: ``qualifies``): made on the
    first call of a ``_plan_key`` and kept, except a causal launch's made while its schedule's first use is being
    captured into a CUDA graph (``causal_schedule``: that launch walks pair slots)."""
    key = _plan_key(q, k, v, out, lse, causal, window, mods)
    return _PLANS.plan(key, _make_plan, q, k, v, out, lse, causal, window, mods)


def _make_plan(q, k, v, out, lse, causal: bool, window: Window | None, mods: ScoreMods) -> tuple[ForwardPlan, bool]:
    """``forward_plan``'s plan made anew, and whether to keep it. A window launch runs with CAUSAL off (its items'
    key tiles come from the window, ``_work``) and walks its items as a launch without causal does."""
    batch, seqlen_q, nheads, head_dim = q.shape
    bounds = window_args(window, seqlen_q, k.shape[1])
    causal = causal and window is None
    cfg = config(head_dim, causal, seqlen_q)
    m_wg, block_n = cfg["M_WG"], cfg["BLOCK_N"]
    block_m = cfg["NUM_WG"] * m_wg
    n_m = cdiv(seqlen_q, block_m)
    schedule = None
    capturing = False
    if causal and cfg["CAUSAL_SCHEDULE"]:
        n_ctas = programs(n_m, batch * nheads, cfg, causal, q.device)
        schedule = causal_schedule(n_m, batch * nheads, n_ctas, seqlen_q, k.shape[1], block_m, block_n, q.device)
        capturing = schedule is None
        if capturing:
            cfg = {**cfg, "CAUSAL_SCHEDULE": False}
    # out (contiguous: rows views) leaves in q's form and v loads in k's (the kernel's coordinates)
    q_form, kv_form = descriptor_of(q), descriptor_of(k, v)
    descriptors = (q_form(q, m_wg), kv_form(k, block_n), kv_form(v, block_n), q_form(out, m_wg))
    ints = (seqlen_q, k.shape[1], batch, nheads, nheads // k.shape[2])
    args = (*descriptors, lse, 1.0, *ints, schedule, *bounds, *mods.args)
    constexprs = dict(
        HEAD_D=head_dim, CAUSAL=causal, EVEN_K=k.shape[1] % block_n == 0, LOCAL=window is not None, **mods.constexprs,
        **cfg,
    )  # fmt: skip
    keyed = keyed_for(_attention_forward_sm90_kernel, args, constexprs)
    grid = (programs(n_m, batch * nheads, cfg, causal, q.device), 1, 1)
    plan = ForwardPlan(grid, tuple(map(template, descriptors)), ints, schedule, bounds, constexprs, keyed)
    return plan, not capturing


def attention_forward_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window: Window | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Launch the kernel on inputs that qualify (``qualifies``) on an sm_90 GPU (``_backend.gluon_refusal``): the
    dispatcher has checked both. Per call: the plan of the inputs' layouts (``forward_plan``), four descriptors
    rebased from its templates and one launch past the binder with its kept key.

    Args:
        q: (batch, seqlen_q, nheads, D); k, v: (batch, seqlen_k, nheads_k, D), D in CONFIGS, nheads a multiple
            of nheads_k; any layouts ``qualifies`` accepts
        out: (batch, seqlen_q, nheads, D) in q's dtype, contiguous; written
        lse: (batch, nheads, seqlen_q) float32, contiguous; written (natural log)
        softmax_scale: multiplies q @ k^T before the softmax
        causal: query i sees key j iff j <= i + seqlen_k - seqlen_q
        window: None, or flash_attn's (window_left, window_right) as ``AttentionOptions`` holds them (None for an
            unbounded side; a causal window has window_right 0): query i sees key j iff i + seqlen_k - seqlen_q -
            window_left <= j <= i + seqlen_k - seqlen_q + window_right; it takes the place of causal
        softcap: > 0 caps the scaled scores at softcap * tanh(score / softcap); 0.0: off
        alibi_slopes: None, or (nheads,) or (batch, nheads) float32 slopes of flash_attn's ALiBi bias
            (-slope * |i + seqlen_k - seqlen_q - j|), each row's heads contiguous; not with a window
    """
    mods = ScoreMods.of(softmax_scale, softcap, alibi_slopes)
    plan = forward_plan(q, k, v, out, lse, causal, window, mods)
    q_desc, k_desc, v_desc, out_desc = plan.descriptors
    args = (
        rebase(q_desc, q), rebase(k_desc, k), rebase(v_desc, v), rebase(out_desc, out), lse,
        mods.qk_scale, *plan.ints, plan.schedule, *plan.window, *mods.args,
    )  # fmt: skip
    launch(_attention_forward_sm90_kernel, plan.grid, args, plan.constexprs, plan.keyed)


@on_input_device
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatcher's entry (``_backend.forward_choice``): (out, lse) as ``ops.attention.attention_forward``
    gives them, computed by this kernel; options: causal (window_right 0), a sliding window (``options.local``) or
    neither, softcap and ALiBi."""
    batch, seqlen_q, nheads, _ = q.shape
    out = empty_output((batch, seqlen_q, nheads, v.shape[3]), q.dtype, q.device)
    lse = empty_output((batch, nheads, seqlen_q), torch.float32, q.device)
    attention_forward_sm90(
        q, k, v, out, lse, options.softmax_scale, causal=options.causal, window=window_of(options),
        softcap=options.softcap,
        alibi_slopes=options.alibi_slopes,
    )  # fmt: skip
    return out, lse
