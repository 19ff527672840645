"""FlashAttention backward for Hopper (sm_90) in Gluon: warp specialized, FA-3 style, dQ by TMA reduce-adds.

On an H100/H200 (``flashtile._backend.gluon_refusal``) the backwards that qualify (``qualifies``: no
dropout, attn_mask or packed batch; softcap but at head dim 64, ALiBi but with a window; and ``deterministic=False``,
flash_attn's default) run this kernel instead
of the portable Triton ones (ops/attention/backward.py): five matrix products per (query tile, key tile) pair instead of
seven, because dQ is added into an fp32 accumulator with atomic adds (TMA reduce-adds from shared memory,
``CONFIGS``' DQ_TMA, at every head dim; per-thread atomics with it off), in an order that varies from run to run
(``deterministic=True`` keeps the Triton kernels, which are bitwise repeatable). Causal, with a sliding window
(LOCAL: any ``window_size``; each key tile visits the query tiles whose rows' windows hold one of its keys,
``_key_tile``, and the tiles that cross either edge of the window are masked, ``_probs``) or neither; softcap
and ALiBi (``_probs``: P^T from the modified scores; dS^T = P^T (1 - tanh^2) (dP^T - delta) * scale with softcap,
P^T (1 - tanh^2) being what WG 0 hands WG 1 at D=256; causal ALiBi's query part of the bias joins the lse); head
dim
64, 128 or 256 (256: the OUTPUT_SPLIT variant below); MHA, GQA or MQA (nheads a multiple of nheads_k; causal:
at most MAX_CAUSAL_GROUP query heads per K/V head); bf16/fp16; both lengths multiples of 128; q, k, v and dout in
any layout whose last dimension is contiguous and whose other strides are 16-byte multiples
(``common.layout_refusal``): flash_attn's (batch, seqlen, nheads, headdim), q/k/v sliced from a packed qkv, or
torch's (batch, nheads, seqlen, headdim) as ``flashtile.scaled_dot_product_attention`` gets it. Gluon has no CPU
interpreter: tests/sm90_compile.py compiles it for sm_90 without a GPU, and the GPU tests run it against the
oracle.

Measured on an H200 (bf16, TFLOP/s, backward = 2.5 x the forward's FLOP; the prototype of this kernel): D=128 N=16k 437
/ 443 causal against 406 / 388 for the Triton kernels (cuDNN 543 / 527), three stages 446 / 445; D=64 N=16k 394 / 405
against 346 / 296 (cuDNN 451 / 439). GQA (B=4 N=4k causal unless said, against the Triton kernels): D=128 4 and 8 query
heads per K/V head 361 / 347 against 341 / 332, D=64 2 and 8 (B=2 N=8k) 331 / 309 against 271 / 259; at 16 and 32 causal
the Triton kernels were faster (see MAX_CAUSAL_GROUP), without causal this kernel at every group size (415-420 against
404-407).

Math (as the Triton backward): with s = softmax_scale * q k^T, P = exp(s - lse), dP = dO V^T, delta = rowsum(dO * O)
- dlse (``backward.attention_delta``), dS = P * (dP - delta):
    dV = P^T dO,   dK = softmax_scale * dS^T Q,   dQ = softmax_scale * dS K.
softmax_scale is folded into dS (before its cast to the input dtype), so dK and dQ need no final scaling.

Host side (``attention_backward_sm90``): dq_accum (B, Sq, H, D) fp32 zeros (with DQ_TMA also a TMA descriptor of
its 2-D (B * Sq, H * D) view, ``common.descriptor``); the kernel, grid (Sk / BLOCK_N, Hk, B), adds dQ
partials into dq_accum and writes dK and dV (B, Sk, Hk, D); dq = dq_accum cast to the input dtype. The gradients
come in their inputs' layouts where those are dense (``_outputs``; torch.empty_like's, which the op's register_fake
gives too), so that autograd keeps them as a leaf's gradients without a copy.

Layouts. q and dout are read in one form, k and v (and dK and dV written) in another, each through descriptors of
the 2-D (B * N, H * D) rows view with [rows, D] boxes (``common.descriptor``) where every tensor of the form has one
(``common.rows_view_ok``: heads of a token side by side), else through rank-4 descriptors of the (B, H, N, D) view
with [1, 1, rows, D] boxes (``common.head_major_descriptor``: torch's layout). The kernel tells the two apart by
the rank of each descriptor's box at compile time (``common.head_major``, ``_box_at``, ``common.box_tile``), so the
rows views' variants compile to the machine code they had before head-major descriptors (all 21 of
tests/sm90_compile.py, Triton 3.7.1). dq_accum keeps its rows view whatever q's layout: the dQ path (staging tiles,
DQ_PERMUTED's rank-4 view, the reduce-adds) is the same code for every layout, and dq is converted into q's layout
by the one copy that casts it. The 15 head-major variants of tests/sm90_compile.py against their rows views' twins:
the same registers, 0-40 more SASS instructions (of 1,700-3,100), 0-32 bytes more shared memory (231,584 at most,
of 232,448), the same stack or 8 bytes more in three causal ones (tests/test_sm90_compile.py's
HEAD_MAJOR_STACK_GROWTH); causal, 1-4 more local loads and 0-3 more stores per work item, none in a query-tile loop.

Head dims 64 and 128 (the key split, ``_consumer``): one CTA per (BLOCK_N = 128 key rows, K/V head hk, batch
entry), 64 key rows per consumer warpgroup. GQA: the
CTA serves the group = H / Hk query heads h = hk * group + g that read its K/V head, in one flat loop of
n_iters = group * n_tiles iterations over (g, query tile) pairs (``_pair``: iteration i is head g = i //
n_tiles, tile i % n_tiles; n_tiles, the query tiles per head, is the same for every head, causal or not).
Every barrier phase and ring slot below is a function of the flat i alone, so moving from one head to the
next changes nothing in the pipeline; dK and dV simply keep accumulating (that is the sum over the group).
  * producer partition, 1 warp: TMA loads of the CTA's K and V tiles (once, kv_bar), then per iteration
    (BLOCK_M query rows of head g: 64 at D=128, 128 at D=64) Q by TMA into a ring of STAGES buffers (q_ready,
    tx-count) with the rows' lse (base 2) and delta by plain loads into shared memory (stat_ready, same slot),
    and dO by TMA into a ring of DO_STAGES buffers (do_ready; DO_STAGES <= STAGES): slot i % STAGES, parity
    (i // STAGES) & 1 and slot i % DO_STAGES, parity (i // DO_STAGES) & 1. q_empty (count 2, one arrival
    per consumer warpgroup) frees a Q slot (and its lse/delta) once both warpgroups are done with it; with
    DO_STAGES == STAGES (D=64/128) it frees the dO slot of the same index too (one barrier per slot, as
    before DO_STAGES existed), otherwise do_empty (count 2) frees dO slots. Key split: each warpgroup
    releases both slots once its dV and dK products have retired.
  * two consumer warpgroups (the default partition = WG 0, one 4-warp worker = WG 1). Per iteration, all
    products are wgmma with fp32 accumulators:
        S^T  = K_wg Q^T            (smem, smem)          [64 keys, BLOCK_M queries]
        dP^T = V_wg dO^T           (smem, smem)
        P^T  = exp2(S^T * scale * log2 e - lse * log2 e)  (causal mask on tiles crossing the diagonal)
        dS^T = P^T * (dP^T - delta) * scale
        dV_wg += P^T dO            (registers, smem)     [64 keys, D], K-dim BLOCK_M
        dK_wg += dS^T Q            (registers, smem)
    and dS^T goes to a shared buffer [128 keys, BLOCK_M queries] (each warpgroup writes its 64 rows; two
    buffers, used alternately). At BLOCK_M = 128 (STATS_IN_ACC) the row statistics start the accumulators
    (use_acc): S^T's at -lse / (scale * log2 e), dP^T's at -delta, so P^T = exp2(acc * scale * log2 e) and
    dS^T = P^T * acc * scale, the same values up to fp32 rounding. Once both halves are there (ds_ready,
    count 2), dQ partial = dS K (A = the dS^T buffer transposed, from smem; B = K) is added to head g's
    columns of dq_accum; each warpgroup's share is a [64, 64] fp32 product (32 registers), by:
      D=128 (DQ_SPLIT): columns, dQ[:, wg*64 : (wg+1)*64] = dS K[:, those columns];
      D=64, BLOCK_M = 128: rows (``dq_rows``), dQ[wg*64 : (wg+1)*64, :] = dS[those rows] K over all 128 keys
      (A = the buffer's columns wg*64.. transposed); the count-2 ds_ready / ds_free above order it as at D=128;
      D=64, BLOCK_M = 64: turns, warpgroup (i % 2) computes all of it for iteration i (a 32-column slice of K
      would cut the 128-byte swizzle atom, which a wgmma operand can not start inside).
    DQ_TMA (FA-3's dQ path): the warpgroup stores its [64, 64] fp32 partial into its own staging tile in
    shared memory (once its previous reduce has read the tile: tma.store_wait), fences, and one TMA
    reduce-add (cp.reduce.async.bulk.tensor .add.f32, ``async_reduce_add``) adds the tile to dq_accum while
    the warpgroup goes on (ordering: ``_dq_step``; D=256's [64, 128] partials go through the tile in two
    [64, 64] chunks). Without it, each thread adds its fragment with relaxed fp32 atomics (16
    atom.global.add.v2.f32 per thread per iteration at D=128, 32 at D=256).
    ds_free (count 2) tells the warpgroups that a dS buffer has been read, before it is written again.
  * epilogue: dV_wg goes to this warpgroup's rows of the V tile in shared memory (only it reads them);
    dK_wg to its rows of the K tile once both warpgroups have left the loop (kv_done, count 2: the dQ
    products read all of K); then TMA stores, and tma.store_wait(0), which also waits for the last dQ reduces
    to have read their staging tiles (KEY_PAIRS: then an arrival on kv_free, below).
  Shared memory (bytes of the 232,448 of a CTA, tests/sm90_compile.py): D=128 231,488-231,504 (198,704-198,720
  with atomics): Q and dO rings 3 x 16 KiB each, K and V 32 KiB each, two dS^T buffers 2 x 16 KiB, two dQ staging
  tiles 2 x 16 KiB, lse/delta 1.5 KiB; D=64 (BLOCK_M = 128, two stages) 199,168-199,184 (166,384-166,400 with
  atomics): Q and dO rings 2 x 16 KiB each ([128, 64] tiles), K and V 16 KiB each, two dS^T buffers 2 x 32 KiB
  ([128 keys, 128 queries]), two [64, 64] dQ staging tiles 2 x 16 KiB, lse/delta 2 KiB (a third stage would need
  232,960: over by 512; three Q stages and two dO stages fit, 216,656); BLOCK_M = 64 with three stages (main's
  config) 149,568-149,584 (116,784-116,800 with atomics).
  Causal: a key tile visits only the query tiles (of each head) from the one holding row kv_start - (Sk -
  Sq) (clipped at 0); only tiles crossing the diagonal apply the mask. Rows with lse = -inf (they see no
  key) get lse = +inf, so exp2 gives exactly 0 there, not NaN.

Head dim 256 (OUTPUT_SPLIT, ``_consumer_by_output``): dK_wg and dV_wg of the key split would be 2 x [64, 256]
fp32 = 2 x 128 registers per thread, beyond the 240 a consumer gets. Instead one CTA per (BLOCK_N = 64 key rows,
K/V head, batch entry), and both consumer warpgroups see all 64 keys but split the work by output (the
producer, the flat (g, query tile) loop, _probs, _dq_step and the TMA epilogue are shared with the key split):
  * WG 0:  S^T = K Q^T [64 keys, 64 queries] (K-dim 256), P^T = exp2(...) (the causal mask as above), P^T
           (fp32) to p_smem for WG 1, then dV += P^T dO (A from registers) [64 keys, 256], 128 registers;
  * WG 1:  dP^T = V dO^T (in flight together with WG 0's S^T), then with WG 0's P^T:
           dS^T = P^T * (dP^T - delta) * scale, dK += dS^T Q [64 keys, 256], 128 registers, and dS^T (the
           input dtype) to the dS^T buffer [64 keys, 64 queries];
  * both:  dQ[:, WG * 128 : (WG + 1) * 128] = dS K[:, those columns] (_dq_step, as DQ_SPLIT at D=128), added
           to dq_accum. DQ_TMA: through the warpgroup's [64, 64] staging tile in two column chunks, each its
           own [64, 64] product: chunk 0's product, its store into the tile and reduce, then chunk 1's product
           (which runs while the copy engine reads chunk 0), tma.store_wait, its store and reduce; 32 dQ
           registers live instead of 64. Without DQ_TMA: one [64, 128] product and per-thread atomics.
  Per iteration each warpgroup issues 2.5 of the 5 [64 x 64 x 256]-sized products. WG 0's dV product runs
  while WG 1 computes dS^T, but WG 1 waits while WG 0 computes P^T (a bubble the key split does not have:
  there each warpgroup's exponentials overlap the other's products).
  Barriers (besides the shared ones): p_ready / p_free (count 1 each, one P^T buffer: WG 0 writes it once WG 1
  has read the previous one); ds_ready has count 1 here (only WG 1 writes dS^T), ds_free keeps count 2 (both
  dQ products read it); kv_done (count 2): V is read by WG 1's dP^T and K by both dQ products, so dV (WG 0,
  through the V tile) and dK (WG 1, through the K tile) wait for both. Ring slots (FA-3 at hdim 256 too: two
  Q stages, one dO stage; DO_STAGES = 1, STAGES = 2): each warpgroup releases a slot as soon as its last
  reader of it has retired: q_empty (count 2) gets WG 0's arrival once S^T has retired and WG 1's once dK
  += dS^T Q has (in _dq_step); do_empty (count 2) WG 1's once dP^T has retired and WG 0's once dV += P^T dO
  has (in _dq_step). lse/delta ride the Q ring: WG 0 may arrive on q_empty before all its threads have read
  lse, but the slot frees only with WG 1's arrival, which follows (p_ready) every WG 0 thread's P^T and so
  its lse; WG 1 reads delta before its dK. The producer stores lse/delta and arrives on stat_ready before it
  waits for the dO slot (which frees last: after WG 0's dV). With DO_STAGES == STAGES (the A/B against the
  atomics of main, ``DQ_TMA=0,DO_STAGES=2``) one barrier per slot, released by each warpgroup in _dq_step
  (WG 0 once dV has retired, WG 1 once dK has), as before DO_STAGES existed.
  Registers per thread (240 per consumer): the accumulator 128, plus at most (during _dq_step) the dQ chunk
  [64, 64] fp32 32 (atomics: the half [64, 128], 64) and the accumulating product's A operand 16; S^T / dP^T
  / P^T [64, 64] fp32 are 32 each and dead by then. ptxas: no spill (stack 0 in all four variants; 0 / 8
  bytes causal GQA with the atomics and two dO stages). Shared memory: Q ring of STAGES = 2 x 32 KiB, dO
  ring of DO_STAGES = 1 x 32 KiB, K and V 32 KiB each, two dS^T buffers 2 x 8 KiB, P^T 16 KiB, two dQ
  staging tiles 2 x 16 KiB, lse/delta 1 KiB: 230,992-231,008 bytes of the 232,448 (227 KiB) of a CTA
  (tests/sm90_compile.py; 230,944-230,960 with two dO stages and the atomics, 198,208-198,224 with one dO
  stage and the atomics). P^T travels in fp32 so that dS uses the same P as the other head dims (a bf16 P^T
  would save 8 KiB).

Causal key-tile pairs (KEY_PAIRS in ``CONFIGS``, on at every head dim: measured at each). With causal, key tile j visits
only the query tiles from its diagonal on, so the CTAs of a (K/V head, batch entry) have unequal work (N=1k, D=128:
16, 14, ..., 2 query tiles of 64 rows per head). With KEY_PAIRS a causal launch gets one CTA per pair of them
(``programs``: n_n - n_n // 2 CTAs for n_n key tiles): CTA p walks key tile p, the heaviest of its pair, then tile
n_n - 1 - p, the lightest, so at Sq = Sk every CTA walks n_m + BLOCK_N / BLOCK_M query tiles per head (n_m: the
query tiles; N=1k, D=128: 18), half as many CTAs as key tiles; an odd n_n's middle tile has a CTA of its own. The
same trick in the forward (forward.py's CAUSAL_PAIRS) gained +6% at N=1k, +3-8% at 2k and 4k and 0-2% at 8k and
16k on the H200; by analogy the prediction here was +3-8% for causal D=128 and D=64 backwards at N=1k-4k and ~0 at
16k; measured +2-5% at D=128 N=1k-8k, +1% at D=64 and +4-8% at D=256 (``CONFIGS``). GQA: each item walks its key tile
for every query head of the group, as without pairs. The two items run one after the other in the same partitions:
  * producer (``_producer``): per item, once both consumer warpgroups have finished with the K and V tiles
    (kv_free), K and V (kv_bar), then the item's Q / dO / lse / delta loads; the second item's iterations
    continue the flat index (it0 .. it0 + n_iters - 1, it0 = the first item's n_iters; ``_pair`` takes the
    item's own i - it0), so every ring slot and parity stays a function of one running count.
  * consumers: per item dK_wg / dV_wg (D=256: each warpgroup's accumulator) from zero, kv_bar, the same loop and
    epilogue, then (``_item_done``) a partition barrier after the epilogue's tma.store_wait(0), so the TMA
    stores of dK and dV have read the K and V tiles, and one arrival on kv_free.
  Barrier phases with two items (item = 0, 1). Per iteration, with the flat i running on across items and so
  unchanged: q_ready, stat_ready, q_empty (slot i % STAGES, parity (i // STAGES) & 1), do_ready, do_empty (i %
  DO_STAGES), ds_ready, ds_free (buffer i % 2, parity (i // 2) & 1), p_ready / p_free (D=256, parity i & 1) and
  the dQ staging tiles (a store_wait before each reuse). Per item: kv_bar completes once per item (its K and V
  bytes), the consumers wait parity item & 1; kv_done (count 2) completes once per item (each warpgroup
  arrives as it leaves the loop), waited with parity item & 1; kv_free (count 2, allocated only with
  KEY_PAIRS) completes once per item (each warpgroup's arrival after its epilogue), the producer waits parity
  (item & 1) ^ 1 before the item's K and V: item 0 passes on the fresh barrier, item 1 waits for both item-0
  epilogues, and item 1's arrivals complete a phase nobody waits for. No barrier can get two phases ahead of a
  waiter: item 1's K and V (so its kv_bar phase, its loop and its kv_done arrivals) wait for both warpgroups'
  item-0 epilogues.
  Cost: one K and one V tile, so the second item's loads (K and V, and behind them its first Q / dO) start
  only once the first item's dK and dV stores have read the tiles: per pair one epilogue plus one K / V load
  without overlap, as a CTA started for that key tile would pay (without the launch and the prologue). The
  consumers read the flat index opaquely (``_flat_index``, register-pressure notes). tests/sm90_compile.py
  (causal MHA / GQA): stack 24 / 32 bytes at D=128 with Triton 3.6 (16 / 32 with 3.7) against 32 / 32 without
  KEY_PAIRS, D=64 24 / 24 (3.7: 24 / 16) against 24 / 48, D=256 0; per iteration 2 and 2 local loads and stores
  in the two consumers' loops at D=128 (4 and 6 without KEY_PAIRS, MHA) and D=64 (2 and 2); shared memory
  +48 bytes (kv_free): D=128 231,536 / 231,552, D=64 199,216 / 199,232, D=256 231,040 / 231,056.

Register-pressure notes (what keeps D=128 and D=64 from spilling; keep them in mind when editing):
  * LLVM hoists loop-invariant address arithmetic out of the query-tile loop and ptxas then spills it.
    The wgmma descriptors of the K and V tiles are kept in the loop by indexing the (single-slot) K/V
    buffers with an opaque zero from inline asm; lse/delta come from shared memory (no pointer tensors in
    the consumers); dK/dV leave through TMA, not pointer tensors.
  * P^T and dS^T are both computed before the dV and dK products are issued (issuing dV first kept one
    more [64, 64] fp32 tile live).
  * D=64 with BLOCK_M = 128: S^T and dP^T are [64, 128] fp32, 64 registers each, dK_wg and dV_wg 32 each: 192 of
    the 240, and a [128] vector in the query axis of s_layout (lse, delta) is 32 registers per thread (2 per
    8-column group). Loaded beside both products in flight (as at BLOCK_M = 64) they spilled 312-376 bytes
    (~200 local loads and stores per consumer thread in the SASS, most in the loop); starting dP^T's
    accumulator at -delta left 48-64, starting S^T's too (STATS_IN_ACC) 0 without causal and 24 / 48 with
    causal (MHA / GQA): per warpgroup one register spilled around the diagonal tiles' mask (1 local store and
    1 load per diagonal tile, none on the others), the rest outside the loop, and in the GQA producer warp (24
    registers, 8 scalar lse/delta loads at 128 rows) 4 local loads and 1 store per iteration. ptxas issues WG
    0's dP^T only once S^T has retired (WARPGROUP.DEPBAR before it) and computes P^T while dP^T runs; WG 1 keeps
    both in flight. A lse/delta fold needs qk_scale > 0: the caller (the Triton backward) sends other scales to the
    Triton kernels.
  * KEY_PAIRS: the second item's flat index runs from a runtime it0. Read plainly, LLVM strength-reduced the
    ring's shared-memory addresses in it into per-item values held across the query-tile loop, and ptxas
    spilled them (Triton 3.6, D=128: 41 and 34 local loads and stores per iteration); the consumers read i
    through an opaque inline-asm move with i >= 0 assumed (``_flat_index``), which keeps the slot arithmetic
    as with one item.
  * DQ_TMA at D=128: the staging tile's stores keep four per-thread swizzled offsets live through the loop,
    which ptxas partly keeps on the stack (32 bytes against 16 / 24 with atomics; per iteration 0 and 5 local
    loads in the two warpgroups without causal, against 2 and 1). Indexing the staging tile with the opaque
    zero above did not lower it; an unswizzled staging tile (8-way bank conflicts on its stores) gave 16-40
    bytes depending on the variant.

DQ_TMA on the H200 (2026-11-30): the GPU tests pass
(test_gluon_sm90.py, with test_backward_dq_tma_matches_the_atomics), and the backward gains 18-30% at D=128 and
3-10% at D=64 over the atomics (``CONFIGS``); at D=256 (with one dO stage) the GPU tests and a compute-sanitizer
memcheck pass and the backward gains 30-44%.

D=64 at BLOCK_M = 128 (2026-11-30): backward
TFLOP/s, bf16, against BLOCK_M = 64 with three stages (the config before), each tree's default in one call: B=4
N=4k 448 / 403 full / causal against 416 / 367, N=16k 460 / 447 against 441 / 407, GQA 4:1 causal 369 against
353, B=16 N=1k causal 258 against 254 (+2-10%; predicted +5-15%); GPU tests (test_gluon_sm90.py) pass, and a
compute-sanitizer memcheck of the sanitize cases reports 0 errors."""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile._backend import Verdict, imported, verdict
from flashtile.ops import _launch
from flashtile.ops._alloc import empty_output_like
from flashtile.ops._device import on_input_device
from flashtile.ops.common.descriptors import Template, per_layout, rebase, template
from flashtile.ops.common.grid import head_grid
from flashtile.ops.common.math import LOG2E
from flashtile.ops.sm90.common import (
    ScoreMods,
    Window,
    alibi_bias,
    alibi_slope,
    box_buffers,
    box_tile,
    capped_scores,
    descriptor,
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
from flashtile.ops.sm90.forward import ROWS
from flashtile.options import AttentionOptions

CONFIGS = {
    # three stages of Q/dO at D=128: 446 / 445 TFLOP/s at N=16k against 437 / 443 with two (measured with the
    # atomics, 198 KiB of shared memory then); a fourth at D=64 gained nothing with the atomics, and with DQ_TMA
    # went -8% to +6% by row (2026-11-30)
    128: {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 3, "DO_STAGES": 3, "DQ_SPLIT": True, "OUTPUT_SPLIT": False,
          "DQ_TMA": True, "DQ_PERMUTED": True, "KEY_PAIRS": True, "CONSUMER_REGS": 240, "PRODUCER_REGS": 24},
    # FA-3's hdim-64 tiles: 128 query rows x 128 keys, dQ split by rows; two stages fill 199,168 bytes (a third
    # would need 232,960). +2-10% backward over BLOCK_M=64 with three stages (--variant
    # d64-main:BLOCK_M=64,STAGES=3,DO_STAGES=3; four stages gained nothing there): module docstring
    64: {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "DO_STAGES": 2, "DQ_SPLIT": False, "OUTPUT_SPLIT": False,
         "DQ_TMA": True, "DQ_PERMUTED": True, "KEY_PAIRS": True, "CONSUMER_REGS": 240, "PRODUCER_REGS": 24},
    # [64, 256] fp32 dK and dV accumulators: one per warpgroup (OUTPUT_SPLIT) on 64-key CTAs; two Q stages and
    # one dO stage (FA-3's hdim-256 choice) leave room for DQ_TMA's staging tiles: 230,992-231,008 bytes of
    # shared memory. Main's config (two dO stages, atomics: --variant DQ_TMA=0,DO_STAGES=2, the same SASS),
    # H200, B=4 N=4k H=8 bf16: 281 / 271 TFLOP/s full / causal, this one 405 / 355 (N=16k 302 / 308 -> 422 / 407;
    # GQA 4:1 causal 240 -> 317; the Triton kernel 189 / 212)
    256: {"BLOCK_M": 64, "BLOCK_N": 64, "STAGES": 2, "DO_STAGES": 1, "DQ_SPLIT": True, "OUTPUT_SPLIT": True,
          "DQ_TMA": True, "DQ_PERMUTED": False, "KEY_PAIRS": True, "CONSUMER_REGS": 240, "PRODUCER_REGS": 24},
}  # fmt: skip
"""Per head dim: query rows per tile, key rows per CTA, Q (and lse/delta) ring depth, dO ring depth (DO_STAGES, at
most STAGES; equal: one empty barrier per slot frees both rings, otherwise each ring has its own), dQ columns
split between the warpgroups (needs 64-column halves: head dims 128 and 256), the warpgroups split the work by
output (OUTPUT_SPLIT, both see all BLOCK_N keys: head dim 256) rather than by keys (BLOCK_N / 2 each), dQ
partials added by TMA reduces from shared memory rather than by per-thread atomics (DQ_TMA), the staging tile's rows
reordered so that its stores are free of bank conflicts (DQ_PERMUTED, ``dq_staging_block``), causal key tiles
walked in pairs (KEY_PAIRS), registers per thread of consumers / producer. tune_gluon.py's ``--variant
NAME:KEY=VALUE`` sets a key in every entry that has it: DO_STAGES=2 makes D=128 STAGES=3 / DO_STAGES=2 (compiles;
stack at D=128 32-40 bytes with DQ_TMA, 16-32 with the atomics, 72-104 with DO_STAGES=1;
test_backward_key_split_with_a_shallower_do_ring covers it on the GPU, and D=64 with STAGES=3), so time such
variants at D=256 only. BLOCK_M: 128 (D=64's default: 128-query
S^T / dP^T tiles, the statistics in the accumulators, dQ split by rows) or 64 (the warpgroups take turns with
dQ); only D=64 takes 128 (at D=128 dK, dV and a [128, 64] dQ half would not fit in 240 registers), and both
take the same lengths (``qualifies``: multiples of ROWS = 128). The STAGES and DO_STAGES of a D=64 variant also
land on D=128 and D=256 (BLOCK_M=64,STAGES=3,DO_STAGES=3 leaves D=128 as it is): time it at D=64 only.

KEY_PAIRS (every head dim): a causal launch gets one CTA per pair of a (K/V head, batch entry)'s key tiles, the heaviest
and then the lightest (``programs``; module docstring, "Causal key-tile pairs"), as the forward's CAUSAL_PAIRS does with
query tiles; no effect without causal. Predicted +3-8% for causal D=128 and D=64 backwards at N=1k-4k, ~0 at 16k;
measured on the H200 (bf16, B * N = 16k, H = 16 at D=128 / 32 at D=64, backward TFLOP/s, median of three interleaved
rounds, docs/tuning/backward.md, 2026-11-30): D=128 N=1k 313.8 -> 321.2, 2k 395.0 -> 408.0, 4k 448.6 -> 469.5, 8k 483.8
-> 507.6; D=64 1k 263.7 -> 266.6, 2k 344.1 -> 346.0; D=256 (H = 8, 2026-11-30) 1k 263.5 -> 274.7, 2k 309.1 -> 335.1, 4k
351.8 -> 377.2, 8k 383.5 -> 397.1 (no stack either way). The forward's key is CAUSAL_PAIRS, so this one has its own
name: ``--variant unpaired:KEY_PAIRS=0`` switches the backward alone. A persistent walk over the pairs or key tiles
(KEY_PERSISTENT, branch gluon-bwd-persistent) lost 10-22% at causal N=1k-4k and was dropped.

DQ_TMA (FlashAttention-3's dQ path, ``_dq_step``): each warpgroup stages its fp32 dQ partial [BLOCK_M, D / 2]
(DQ_SPLIT) or [BLOCK_M, D], [64, 64] at D=64/128, in a shared-memory tile of its own and adds the tile to
dq_accum with one bulk tensor reduce (``async_reduce_add``: cp.reduce.async.bulk.tensor.2d .add, which Triton
issues as two [64, 32] boxes, one per 128-byte swizzle width, from one elected thread of each of two warps)
instead of each thread issuing 16 atom.global.add.v2.f32 (D=128) per iteration; at D=256 the [64, 128] partial
goes through the [64, 64] tile in two chunks (two reduces per warpgroup and iteration instead of 32 atomics
per thread). 2 x 16 KiB of shared memory: D=128 231,488-231,504 bytes of 232,448 (198,704-198,720 with
atomics), D=64 199,168-199,184 (166,384-166,400; BLOCK_M = 64 with three stages 149,568-149,584 and
116,784-116,800), D=256 230,992-231,008 with one dO stage (the 32 KiB of the second). H200, bf16, B * N = 16k
tokens, D=64 at BLOCK_M = 64, backward TFLOP/s with DQ_TMA
against the atomics in one process (``--variant dq-atomics:DQ_TMA=0``): D=128
N=4k 533 / 459 full / causal against 411 / 387, N=16k 552 / 535 against 432 / 448; D=64 N=4k 421 / 368 against
387 / 358, N=16k 444 / 423 against 403 / 398 (predicted +5-10% at D=128: the atomics cost far more than the
profile's issue-slot share suggested; a reducer warp at D=64 gained less, 414 / 422 full)."""

DQ_TILE_COLS = 64
"""Columns of a DQ_TMA staging tile ([dq_rows, 64] fp32, 16 KiB, one per consumer warpgroup), and of the blocks of
dq_accum's descriptor: a warpgroup's dQ partial of 64 columns (head dims 64 and 128) goes through it at once, one of
128 (head dim 256) in two chunks (``_dq_step``)."""


@gluon.constexpr_function
def dq_rows(block_m, dq_split):
    """Query rows of one warpgroup's dQ partial, and of a DQ_TMA staging tile (the blocks of dq_accum's
    descriptor): BLOCK_M, except in the key split without DQ_SPLIT (D=64) at BLOCK_M = 128, where the two
    warpgroups split the rows (64 each, ``_consumer``); at BLOCK_M = 64 they alternate instead (one computes all
    64 rows)."""
    return block_m // 2 if block_m == 128 and not dq_split else block_m


def dq_staging_block(rows: int, permuted: bool) -> list[int]:
    """The block of dq_accum's descriptor and the shape of a DQ_TMA staging tile, for ``rows`` query rows
    (``dq_rows``) of DQ_TILE_COLS fp32 columns: [rows, DQ_TILE_COLS], or with DQ_PERMUTED [rows // 8, 4, 2,
    DQ_TILE_COLS], the same rows in another order.

    Why reorder: a warp's fragment of a wgmma accumulator holds, per 8-column group, rows l // 4 (and + 8) and
    columns 2 (l % 4) + {0, 1} of lane l, so each 64-bit store writes 8 rows x 32 bytes, one half-warp 4 adjacent
    rows. The tile's 128-byte swizzle puts 16-byte chunk j of staging row s at chunk j ^ (s % 8), so rows s and s ^ 1
    land on the same two chunks: every store is a 2-way bank conflict (ncu at D=128 N=4k, 2026-12-01: 4 wavefronts
    per STS.64 where 2 would do, 67M of the kernel's 400M shared-memory wavefronts). With DQ_PERMUTED, row r = 8 R
    + 4 a + b (a < 2, b < 4) of the partial goes to staging row 8 R + 2 b + a, so a half-warp's rows land on s % 8 =
    0, 2, 4, 6 (or 1, 3, 5, 7): eight distinct chunks, no conflict. The tile's dims are (R, b, a, columns), and
    ``dq_descriptor``'s view of dq_accum has the same dims with their row strides, so the copy engine adds each
    staging row into its own row of dq_accum, which keeps its plain layout.

    Measured on the H200 (bf16, backward TFLOP/s, without -> with, median of three interleaved rounds, tune_gluon.py
    ``--variant plain:DQ_PERMUTED=0``): D=128 N=1k
    423 -> 427 full, 322 -> 322 causal; 4k 521 -> 519, 470 -> 470; 16k 532 -> 553, 523 -> 526; D=64 N=4k 444 -> 450,
    400 -> 405; D=256 N=4k 402 -> 394 (three rounds each, so off there). Predicted +2-4%: the conflicts doubled a
    sixth of the shared-memory wavefronts, but that pipe ran at 75% of its peak, so they were mostly off the
    critical path."""
    return [rows // 8, 4, 2, DQ_TILE_COLS] if permuted else [rows, DQ_TILE_COLS]


@per_layout
def dq_descriptor(dq_accum: torch.Tensor, rows: int, permuted: bool) -> TensorDescriptor:
    """The descriptor of dq_accum (batch, seqlen_q, nheads, head_dim) fp32 (contiguous) through which the DQ_TMA
    reduces add the staging tiles: blocks ``dq_staging_block(rows, permuted)`` of its 2-D (batch * seqlen_q,
    nheads * head_dim) rows view, or with ``permuted`` of the rank-4 view (batch * seqlen_q / 8, 4, 2, nheads *
    head_dim) of the same rows, row 8 R + 4 a + b at index (R, b, a) (seqlen_q is a multiple of 128,
    ``qualifies``)."""
    if not permuted:
        return descriptor(dq_accum, rows, DQ_TILE_COLS)
    batch, seqlen, nheads, head_dim = dq_accum.shape
    block = dq_staging_block(rows, permuted)
    row = dq_accum.stride(1)
    shape, strides = [batch * seqlen // 8, 4, 2, nheads * head_dim], [8 * row, row, 4 * row, 1]
    return TensorDescriptor(dq_accum, shape, strides, block, shared_layout(tuple(block), torch.float32))


# ------------------------------------------------------------------------------------------------ dQ reduce
@builtin
def async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of the shared-memory tile ``src`` (in ``tensor_desc``'s layout) into the global block of
    ``tensor_desc`` at ``coord``: cp.reduce.async.bulk.tensor .add, issued (like a TMA store) by one elected
    thread per box message; each element's add is atomic, relaxed; the tile is read asynchronously, and
    ``tma.store_wait`` waits for that read as for a TMA store (both are bulk async-groups).
    Gluon 3.6 and 3.7 have no wrapper for it (3.9 has ``tma.async_atomic_add``); this is ``tma_store``
    (``common``: the same coordinate conversion in 3.6 to 3.9) on the IR builder's ``create_async_tma_reduce``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# ------------------------------------------------------------------------------------------------ loop
@gluon.jit
def _pair(i, n_tiles, m_start, BLOCK_M: gl.constexpr, GROUPED: gl.constexpr):
    """Iteration i of the CTA's flat loop over (query head of the group, query tile) pairs, n_tiles tiles per
    head: (g, q0), the head's index in the group and the tile's first query row (m_start + t * BLOCK_M).
    Without GROUPED (MHA: one head per group) g is 0 and no integer division is emitted (with it, MHA ran
    2-5% slower on the H200)."""
    if GROUPED:
        g = i // n_tiles
        t = i - g * n_tiles
    else:
        g = 0
        t = i
    return g, m_start + t * BLOCK_M


@gluon.jit
def _flat_index(i):
    """KEY_PAIRS: a consumer's flat iteration index i (in the second work item it runs on from it0, the first
    item's count) through a side-effecting inline-asm move, which LLVM can neither look through nor hoist, with
    i >= 0 assumed (ring slots and parities by masks and shifts, not signed division). Read plainly, i made LLVM
    strength-reduce the ring's shared-memory addresses into per-item values held across the query-tile loop, which
    ptxas spilled: Triton 3.6, D=128, 41 and 34 local loads and stores per iteration in the two consumers' loops
    (stack 184 bytes; GQA 240) with it0 and n_iters assumed non-negative; Triton 3.7, D=64, 11 and 8 without
    (tests/sm90_compile.py's SASS). ptxas sees a plain move."""
    flat = gl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
    gl.assume(flat >= 0)
    return flat


@gluon.jit
def _key_tile(
    n,
    seqlen_q,
    seqlen_k,
    group,
    window_left,
    window_right,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    LOCAL: gl.constexpr,
):
    """Key tile n (of a K/V head and batch entry) as a work item: (kv_start, m_start, n_tiles, n_iters), its
    first key row n * BLOCK_N, the first query row it sees (causal: the start of the query tile holding row
    kv_start - (seqlen_k - seqlen_q), clipped to [0, seqlen_q]; else 0), the query tiles per head from there,
    and its iterations, group * n_tiles (``_pair``). LOCAL: the query tiles holding a row whose window holds one of
    the tile's keys (key j is in the windows of rows j - diag_off - window_right .. j - diag_off + window_left), at
    least one (a key tile no row sees runs one fully masked query tile, whose P is 0)."""
    kv_start = n * BLOCK_N
    diag_off = seqlen_k - seqlen_q
    if LOCAL:
        m_start = (gl.maximum(kv_start - diag_off - window_right, 0) // BLOCK_M) * BLOCK_M
        m_start = gl.minimum(m_start, seqlen_q - BLOCK_M)
        m_end = gl.cdiv(gl.maximum(kv_start + BLOCK_N - diag_off + window_left, 0), BLOCK_M) * BLOCK_M
        n_tiles = gl.maximum(gl.minimum(m_end, seqlen_q) - m_start, BLOCK_M) // BLOCK_M
        return kv_start, m_start, n_tiles, group * n_tiles
    if CAUSAL:
        # the first query row that sees key kv_start is kv_start - diag_off
        m_start = (gl.maximum(kv_start - diag_off, 0) // BLOCK_M) * BLOCK_M
        m_start = gl.minimum(m_start, seqlen_q)
    else:
        m_start = 0
    n_tiles = (seqlen_q - m_start) // BLOCK_M  # query tiles per head
    return kv_start, m_start, n_tiles, group * n_tiles


# ------------------------------------------------------------------------------------------------ layouts
@gluon.jit
def _box_at(desc, row, col):
    """The coordinates of ``desc``'s box whose first row is ``row`` and whose first column in the (batch * seqlen,
    nheads * headdim) rows is ``col`` (head * headdim): [row, col] in a rows view's descriptor (``common.descriptor``),
    (b, head, row, 0) in a head-major one (``common.head_major_descriptor``), where row counts from the head's first
    token (the kernel's row origins, q_row0 and kv_row, leave out the batch entry's b * seqlen there) and b is the
    CTA's batch entry, read here (program_id 2) rather than carried through the loops in a register. The caller
    computes row and col: computed in here, their instructions would sit in an inlined scope of their own, whose
    labels change how ptxas schedules the code around them (the rows views' code is what it was before head-major
    descriptors)."""
    if head_major(desc.block_shape):
        coords = (gl.program_id(2), col // desc.block_shape[3], row, 0)
    else:
        coords = [row, col]
    return coords


# ------------------------------------------------------------------------------------------------ producer
@gluon.jit
def _producer(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    q_ready,
    do_ready,
    stat_ready,
    q_empty,
    do_empty,
    lse_ptr,
    delta_ptr,
    q_row0,
    q_col0,
    m_start,
    n_tiles,
    seqlen_q,
    kv_row,
    kv_col,
    n_iters,
    pairs,
    HEAD_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    DO_STAGES: gl.constexpr,
    GROUPED: gl.constexpr,
):
    """Per work item (a key tile: kv_row, m_start, n_tiles, n_iters), K and V by TMA (kv_bar), then per
    iteration i (``_pair``: query head g of the group, query rows q0..): Q and dO by TMA at row q_row0 + q0 and
    column q_col0 + g * HEAD_D of the (batch * seqlen, nheads * headdim) rows (q_row0: the batch entry's first row,
    0 with head-major descriptors; q_col0: the group's first query head; ``_box_at`` makes them a descriptor's
    coordinates), and the rows' lse (in base 2, +inf where it is -inf) and delta by plain loads into shared
    memory, so that the consumers read them with shared-memory loads (no pointer tensors there). lse_ptr /
    delta_ptr point at the rows of (batch entry, the group's first head); head g's start g * seqlen_q later.
    ``pairs``: None (one item), or (kv_free, n_items, the second item's (kv_row, m_start, n_tiles, kv_start,
    n_iters)) with KEY_PAIRS: the second item's K and V load once both consumer warpgroups have stored the
    first's dK and dV from the K and V tiles (kv_free), and the flat iteration index, so every ring slot and
    parity, carries on from the first item's."""
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    n_items = 1 if pairs is None else pairs[1]
    it0 = 0  # the flat index of the item's first iteration
    for item in range(n_items):
        if pairs is not None:
            mbarrier.wait(pairs[0], (item & 1) ^ 1)  # (the first item passes: a fresh barrier, parity 1)
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, _box_at(k_desc, kv_row, kv_col), kv_bar, k_smem.index(0))
        tma_load(v_desc, _box_at(v_desc, kv_row, kv_col), kv_bar, v_smem.index(0))
        for i in range(it0, it0 + n_iters):
            s = i % STAGES
            # a fresh barrier passes a wait on parity 1, so the first round through the ring does not block
            ph = ((i // STAGES) & 1) ^ 1
            g, q0 = _pair(i - it0, n_tiles, m_start, BLOCK_M, GROUPED)
            row = q_row0 + q0
            col = q_col0 + g * HEAD_D
            # the row statistics are loaded before waiting for the slot, so their latency overlaps the wait
            offs = g * seqlen_q + q0 + gl.arange(0, BLOCK_M, layout=stat_layout)
            lse = gl.load(lse_ptr + offs)
            delta = gl.load(delta_ptr + offs)
            mbarrier.wait(q_empty.index(s), ph)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
            tma_load(q_desc, _box_at(q_desc, row, col), q_ready.index(s), q_smem.index(s))
            sd = i % DO_STAGES
            if DO_STAGES != STAGES:
                # lse/delta ride Q's ring: out before the wait for dO's slot, which frees later (_consumer_by_output)
                _put_stats(lse, delta, lse_smem.index(s), delta_smem.index(s), stat_ready.index(s))
                mbarrier.wait(do_empty.index(sd), ((i // DO_STAGES) & 1) ^ 1)
            mbarrier.expect(do_ready.index(sd), do_desc.block_type.nbytes)
            tma_load(do_desc, _box_at(do_desc, row, col), do_ready.index(sd), do_smem.index(sd))
            if DO_STAGES == STAGES:
                _put_stats(lse, delta, lse_smem.index(s), delta_smem.index(s), stat_ready.index(s))
        if pairs is not None:
            it0 += n_iters
            kv_row, m_start, n_tiles, _, n_iters = pairs[2]


@gluon.jit
def _put_stats(lse, delta, lse_slot, delta_slot, stat_ready):
    """The producer's lse (natural log) and delta of one query tile into their ring slots: lse in base 2, and
    +inf for rows that see no key (lse = -inf), which makes exp2(s - lse) exactly 0 instead of NaN."""
    lse_slot.store(gl.where(lse == float("-inf"), gl.full_like(lse, float("inf")), lse * LOG2E))
    delta_slot.store(delta)
    partition_barrier()  # all 32 lanes have stored before the (single-thread) arrive
    mbarrier.arrive(stat_ready, count=1)


# ------------------------------------------------------------------------------------------------ consumer
@gluon.constexpr_function
def stats_in_acc(block_m):
    """Whether S^T's and dP^T's accumulators start at the row statistics (-lse / qk_scale, -delta: ``_consumer``'s
    STATS_IN_ACC), as 128-query tiles do: the [BLOCK_M] lse and delta slices would take BLOCK_M / 4 registers per
    thread each beside both products. softcap's tanh cannot follow a shifted S^T (``qualifies``)."""
    return block_m > 64


@gluon.jit
def _probs(
    s_acc,
    lse2,
    qk_scale,
    key0,
    q0,
    diag_off,
    left_off,
    softcap,
    slope,
    N_WG: gl.constexpr,
    BLOCK_M: gl.constexpr,
    CAUSAL: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr,
):
    """P^T (fp32, mma layout) of a [N_WG keys, BLOCK_M queries] tile from S^T and the queries' lse in base 2
    (lse2, +inf for rows that see no key, so that exp2 gives 0). Keys key0.., queries q0..; the causal
    mask (key j visible to query i iff j <= i + diag_off) only on tiles that cross the diagonal; with LOCAL (the
    kernel's diag_off then the window's right edge, seqlen_k - seqlen_q + window_right) also the left edge's (j >= i
    + left_off, left_off = seqlen_k - seqlen_q - window_left) on tiles that cross it. With SOFTCAP or ALIBI the
    scores are modified first (``common.capped_scores``, ``common.alibi_bias``; ALiBi's distance from diag_off,
    which is then seqlen_k - seqlen_q: no window). Returns P^T and, for dS^T, P^T times the cap's derivative 1 -
    tanh^2 (P^T itself without SOFTCAP)."""
    s_layout: gl.constexpr = s_acc.type.layout
    gl.static_assert(not (SOFTCAP and lse2 is None), "softcap: S^T without the lse in its accumulator")
    x, t = capped_scores(s_acc, qk_scale, softcap, SOFTCAP)
    if ALIBI:
        queries = (q0 + diag_off) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        keys = key0 + gl.arange(0, N_WG, layout=gl.SliceLayout(1, s_layout))
        if CAUSAL and lse2 is not None:
            # the bias's query part joins the lse (a vector held anyway), its key part is a column: no tile of it
            lse2 = lse2 + queries.to(gl.float32) * slope
            x = x + keys.to(gl.float32)[:, None] * slope
        else:
            x = x + alibi_bias(queries[None, :], keys[:, None], slope, CAUSAL)
    if lse2 is None:  # S^T's accumulator started at -lse / qk_scale (``_consumer``'s STATS_IN_ACC)
        p = gl.exp2(x)
    else:
        p = gl.exp2(x - lse2[None, :])
    if CAUSAL or LOCAL:
        if key0 + N_WG - 1 > q0 + diag_off:
            # (written so that no loop-invariant [BLOCK_M] tensor is formed, which LLVM would hoist out of the
            # loop into registers)
            keys = key0 - diag_off + gl.arange(0, N_WG, layout=gl.SliceLayout(1, s_layout))
            queries = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            keep = keys[:, None] <= queries[None, :]
            p = gl.where(keep, p, gl.zeros_like(p))
    if LOCAL:
        if key0 < q0 + BLOCK_M - 1 + left_off:
            keys = key0 - left_off + gl.arange(0, N_WG, layout=gl.SliceLayout(1, s_layout))
            queries = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            keep = keys[:, None] >= queries[None, :]
            p = gl.where(keep, p, gl.zeros_like(p))
    if SOFTCAP:
        p_grad = p * (1.0 - t * t)
    else:
        p_grad = p
    return p, p_grad


@gluon.jit
def _iteration(
    i,
    it0,
    q_smem,
    do_smem,
    ds_smem,
    k_smem,
    v_smem,
    n_tiles,
    m_start,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    DO_STAGES: gl.constexpr,
    GROUPED: gl.constexpr,
):
    """A consumer's view of iteration i of the CTA's flat count (it0: the work item's first): (s, ph, sd, dph, b,
    bph, g, q0, q_tile, do_tile, ds_buf, k_it, v_it), the Q ring's slot (also lse/delta's) and its barrier
    parity, the dO ring's, the dS^T buffer (two, used alternately) and its parity, the query head of the group
    and first query row (``_pair`` of the item's iteration i - it0), the Q, dO and dS^T tiles, and the K and V
    tiles indexed by an opaque 0 (side-effecting inline asm, so not hoisted): the K/V wgmma descriptors are
    computed in the loop instead of being hoisted out of it into ~48 registers that ptxas would spill."""
    s = i % STAGES
    sd = i % DO_STAGES
    b = i % 2
    g, q0 = _pair(i - it0, n_tiles, m_start, BLOCK_M, GROUPED)
    zero = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
    return (
        s, (i // STAGES) & 1, sd, (i // DO_STAGES) & 1, b, (i // 2) & 1, g, q0,
        box_tile(q_smem, s), box_tile(do_smem, sd), ds_smem.index(b), box_tile(k_smem, zero), box_tile(v_smem, zero),
    )  # fmt: skip


@gluon.jit
def _arrive_each(barriers):
    """One arrival on each barrier of the tuple."""
    for j in gl.static_range(len(barriers)):
        mbarrier.arrive(barriers[j], count=1)


@gluon.jit
def _dq_step(
    pending,
    ds_buf,
    k_cols,
    ds_ready,
    ds_phase,
    empties,
    ds_free,
    dq_dst,
    q0,
    col0,
    BLOCK_M: gl.constexpr,
    DQ_COLS: gl.constexpr,
    DQ_TMA: gl.constexpr,
):
    """Once dS^T is complete in ds_buf [keys, BLOCK_M queries] (ds_ready): dQ[:, col0 : col0 + DQ_COLS] of query
    rows q0.. = dS K[:, cols] (k_cols: those columns of K), added to dq_accum. Also retires this iteration's
    accumulating products (issued before, so they complete first), then arrives once on each barrier of the
    tuple ``empties`` (the ring slots those products were the last to read), and releases the dS buffer once
    the dQ product has read it. ``pending``: those products' wgmma tokens followed by the Q and dO tiles they
    read; returns ``warpgroup_mma_wait``'s tuple of them (the accumulators first).

    ``dq_dst``, where the partial goes (rows q0.. and columns col0.. are counted from its origin):
      * atomics (DQ_TMA off): (dq_ptr, row_stride), dq_ptr at (the batch entry's row 0, the group's first head)
        of rows of row_stride floats; every thread adds its fragment with relaxed fp32 atomics;
      * DQ_TMA: (dq_desc, dq_tile, row0, col_base), dq_accum's ``dq_descriptor`` (blocks of its 2-D (batch *
        seqlen_q, nheads * head_dim) rows, or with DQ_PERMUTED of a rank-4 view of them), this warpgroup's fp32
        staging tile (``dq_staging_block``: [BLOCK_M, DQ_TILE_COLS], or its rows reordered in rank 4), and the
        origin's row and column in dq_accum's rows. The warpgroup writes its fragments into the tile and issues a
        TMA reduce-add of it (``async_reduce_add``: one elected thread in each of two warps, a box of 32 columns
        each). Ordering,
        per warpgroup (the tile is its own): store_wait(0) makes the threads that issued the previous reduce
        wait until the copy engine has read the tile (every thread runs it; bulk groups are per thread), the
        barrier holds the other threads until then; after the stores, fence_async_shared() makes them visible
        to the copy engine (async proxy) and the barrier makes every thread's part land before the issue. The
        reduce runs while the warpgroup goes on with the next iteration; the consumer's final store_wait(0)
        keeps the issuing threads (so the CTA and its shared memory) alive until the last reduce has read the
        tile; its adds complete by the end of the grid, like a TMA store's writes. Nothing in the kernel reads
        dq_accum, and each element's add is atomic and relaxed as with the per-thread atomics: the result
        differs from theirs only in the order of the fp32 sums. A partial wider than the tile (D=256: 128
        columns, tile 64) goes through it in column chunks, each its own product, issued after the previous
        chunk's reduce so that it runs while the copy engine reads that chunk; store_wait(0) before each
        chunk's stores keeps the tile from being overwritten before the previous reduce has read it."""
    if DQ_TMA:
        dq_desc, dq_tile, row0, col_base = dq_dst
        CHUNK: gl.constexpr = dq_tile.shape[-1]
    else:
        CHUNK: gl.constexpr = DQ_COLS
    dq_layout: gl.constexpr = mma_layout(CHUNK)
    mbarrier.wait(ds_ready, ds_phase)
    dq_zero = gl.zeros([BLOCK_M, CHUNK], gl.float32, dq_layout)
    for c in gl.static_range(DQ_COLS // CHUNK):
        k_chunk = k_cols.slice(c * CHUNK, CHUNK, dim=1)
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_chunk, dq_zero, use_acc=False, is_async=True)
        if c == 0:
            done = warpgroup_mma_wait(1, deps=pending)
            _arrive_each(empties)
        dq = warpgroup_mma_wait(0, deps=(dq_tok, ds_buf, k_chunk))[0]
        if c == DQ_COLS // CHUNK - 1:
            mbarrier.arrive(ds_free, count=1)
        if DQ_TMA:
            tma.store_wait(0)  # this warpgroup's previous reduce has read dq_tile (its issuing threads wait)
            partition_barrier()  # ... and the others with it
            col = col_base + col0 + c * CHUNK
            if len(dq_tile.shape) == 4:  # DQ_PERMUTED: rows in the staging order of ``dq_staging_block``
                staged = gl.permute(gl.reshape(dq, [BLOCK_M // 8, 2, 4, CHUNK]), [0, 2, 1, 3])
                coord = [(row0 + q0) // 8, 0, 0, col]
            else:
                staged = dq
                coord = [row0 + q0, col]
            dq_tile.store(staged)
            fence_async_shared()
            partition_barrier()  # every thread has written (and fenced) its part before the (elected-thread) issue
            async_reduce_add(dq_desc, coord, dq_tile)
        else:
            dq_ptr, row_stride = dq_dst
            rows = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            cols = col0 + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
            ptrs = dq_ptr + rows[:, None] * row_stride + cols[None, :]
            gl.atomic_add(ptrs, dq, sem="relaxed")
    return done


@gluon.jit
def _dq_destination(WG: gl.constexpr, dq_ptr, row_stride, dq_tma_args, DQ_TMA: gl.constexpr):
    """``_dq_step``'s dq_dst for consumer warpgroup WG: with DQ_TMA, from the kernel's four trailing consumer
    arguments ``dq_tma_args`` (dq_accum's descriptor, both warpgroups' staging tiles, the origin's coordinates),
    the descriptor, this warpgroup's staging tile and the coordinates; otherwise (dq_ptr, row_stride)."""
    if DQ_TMA:
        dq_desc, dq_smem, dq_row0, dq_col_base = dq_tma_args
        dq_dst = (dq_desc, dq_smem.index(WG), dq_row0, dq_col_base)
    else:
        dq_dst = (dq_ptr, row_stride)
    return dq_dst


@gluon.jit
def _out_rows(boxes, start, n):
    """Rows start.. start + n of the K or V box (buffer 0 of ``boxes``) as (tile, box): the [n, D] tile a
    warpgroup's dK or dV goes into, and the same memory as a box of the descriptor's form that its TMA store reads:
    for a rows view's the tile itself, for a head-major one a [1, 1, n, D] slice of the box (Gluon reshapes no
    slice of shared memory, so the tile cannot be viewed as one)."""
    tile = box_tile(boxes, 0).slice(start, n)
    if len(boxes.shape) > 3:  # [1, 1, 1, rows, D]
        box = boxes.index(0).slice(start, n, dim=2)
    else:
        box = tile
    return tile, box


@gluon.jit
def _write_back(acc, tile, box, desc, coords):
    """acc (fp32 registers) in the input dtype into ``tile`` (shared memory no product reads any more), then a TMA
    store of ``box`` (the tile's memory as a box of ``desc``'s form: ``_out_rows``) at ``coords`` of ``desc``
    (``_box_at``; the caller waits for it with tma.store_wait)."""
    tile.store(acc.to(tile.dtype))
    fence_async_shared()
    partition_barrier()  # every thread of the warpgroup has written (and fenced) its part
    tma_store(desc, coords, box)


@gluon.jit
def _item_done(kv_free):
    """KEY_PAIRS, after a work item's epilogue and its tma.store_wait(0) (the threads that issued this warpgroup's
    TMA stores of dK and dV waited until the copy engine had read the K and V tiles): once every thread of the
    warpgroup is past that wait, its arrival on kv_free (count 2), after which the producer loads the next
    item's K and V into the tiles."""
    partition_barrier()
    mbarrier.arrive(kv_free, count=1)


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    args,
    pairs,
    HEAD_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    N_WG: gl.constexpr,
    STAGES: gl.constexpr,
    DO_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
    DQ_TMA: gl.constexpr,
    GROUPED: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr,
):
    """One consumer warpgroup (WG 0 or 1) of the key split (head dims 64 and 128; OUTPUT_SPLIT off): key rows
    kv_start + WG * N_WG .. + N_WG of the CTA's tile, all
    n_iters (query head, query tile) pairs (``_pair``); accumulates dK_wg and dV_wg over them in registers
    (summed over the group's heads), adds each pair's dQ partial to its head's columns of dq (see _dq_step;
    dq_ptr: the batch entry's row 0, the group's first head), stores dK_wg and dV_wg at the end. ``args``: the
    kernel's consumer_args (its runtime values, the same for both warpgroups), with DQ_TMA followed by dQ's
    descriptor, the two warpgroups' staging tiles and the coordinates of dq_ptr's element in the descriptor.
    ``pairs`` (``_producer``'s): None, or with KEY_PAIRS the second work item, walked the same way after the
    first (dK_wg and dV_wg from zero, kv_bar and kv_done with the item's parity, the flat iteration index
    running on), each item's epilogue ending with an arrival on kv_free (``_item_done``)."""
    (
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        ds_smem,
        lse_smem,
        delta_smem,
        kv_bar,
        q_ready,
        do_ready,
        stat_ready,
        q_empty,
        do_empty,
        ds_ready,
        ds_free,
        kv_done,
        dk_desc,
        dv_desc,
        dq_ptr,
        kv_row,
        kv_col,
        row_stride,
        m_start,
        n_tiles,
        kv_start,
        diag_off,
        left_off,
        n_iters,
        qk_scale,
        sm_scale,
        softcap,
        alibi_ptr,
        alibi_off,
    ) = args[:33]  # the kernel's consumer_args; with DQ_TMA four more follow
    dq_dst = _dq_destination(WG, dq_ptr, row_stride, args[33:], DQ_TMA)
    dtype: gl.constexpr = q_smem.dtype
    DQ_COLS: gl.constexpr = HEAD_D // 2 if DQ_SPLIT else HEAD_D
    gl.static_assert(BLOCK_M == 64 or (BLOCK_M == 128 and not DQ_SPLIT), "128-row tiles at D=64 only (registers)")
    DQ_ROWS: gl.constexpr = dq_rows(BLOCK_M, DQ_SPLIT)
    s_layout: gl.constexpr = mma_layout(BLOCK_M)  # S^T, dP^T: [N_WG keys, BLOCK_M queries]
    kv_layout: gl.constexpr = mma_layout(HEAD_D)  # dK, dV: [N_WG keys, HEAD_D]
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    STATS_IN_ACC: gl.constexpr = stats_in_acc(BLOCK_M)  # (module docstring)
    if STATS_IN_ACC:
        inv_qk_scale = 1.0 / qk_scale

    s_zero = gl.zeros([N_WG, BLOCK_M], gl.float32, s_layout)
    n_items = 1 if pairs is None else pairs[1]
    it0 = 0  # the flat index of the item's first iteration (``_producer``)
    for item in range(n_items):
        key0 = kv_start + WG * N_WG
        dk = gl.zeros([N_WG, HEAD_D], gl.float32, kv_layout)
        dv = gl.zeros([N_WG, HEAD_D], gl.float32, kv_layout)

        mbarrier.wait(kv_bar, item & 1)
        for i in range(it0, it0 + n_iters):
            flat = i if pairs is None else _flat_index(i)
            s, ph, sd, dph, b, bph, g, q0, q_tile, do_tile, ds_buf, k_it, v_it = _iteration(
                flat, it0, q_smem, do_smem, ds_smem, k_smem, v_smem, n_tiles, m_start,
                BLOCK_M, STAGES, DO_STAGES, GROUPED,
            )  # fmt: skip
            dq_col0 = g * HEAD_D
            k_wg = k_it.slice(WG * N_WG, N_WG)
            v_wg = v_it.slice(WG * N_WG, N_WG)

            # ---- S^T and dP^T in flight together; the row statistics come from shared memory (STATS_IN_ACC: first,
            # as the products' initial values S^T = -lse / qk_scale, dP^T = -delta; otherwise meanwhile)
            if STATS_IN_ACC:
                mbarrier.wait(stat_ready.index(s), ph)
                s_init = s_zero - lse_smem.index(s).load(col_s)[None, :] * inv_qk_scale
                dp_init = s_zero - delta_smem.index(s).load(col_s)[None, :]
                lse2 = None
            else:
                s_init = s_zero
                dp_init = s_zero
            mbarrier.wait(q_ready.index(s), ph)
            s_tok = warpgroup_mma(k_wg, q_tile.permute((1, 0)), s_init, use_acc=STATS_IN_ACC, is_async=True)
            mbarrier.wait(do_ready.index(sd), dph)
            dp_tok = warpgroup_mma(v_wg, do_tile.permute((1, 0)), dp_init, use_acc=STATS_IN_ACC, is_async=True)
            if not STATS_IN_ACC:
                mbarrier.wait(stat_ready.index(s), ph)
                lse2 = lse_smem.index(s).load(col_s)
                delta = delta_smem.index(s).load(col_s)

            # ---- P^T and dS^T, then dV += P^T dO and dK += dS^T Q (A from registers)
            s_acc = warpgroup_mma_wait(1, deps=(s_tok,))
            slope = alibi_slope(alibi_ptr, alibi_off, g, ALIBI)
            p, p_grad = _probs(
                s_acc, lse2, qk_scale, key0, q0, diag_off, left_off, softcap, slope, N_WG, BLOCK_M, CAUSAL, LOCAL,
                SOFTCAP, ALIBI,
            )  # fmt: skip
            dp_acc = warpgroup_mma_wait(0, deps=(dp_tok, k_wg, v_wg))[0]
            if not STATS_IN_ACC:
                dp_acc = dp_acc - delta[None, :]
            ds16 = (p_grad * dp_acc * sm_scale).to(dtype)
            dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_tile, dv, is_async=True)
            dk_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_tile, dk, is_async=True)

            # ---- dS^T to shared memory (both warpgroups' halves), then dQ += dS K (A = the dS^T buffer transposed)
            mbarrier.wait(ds_free.index(b), bph ^ 1)  # the dQ product(s) of iteration i - 2 have read ds_buf
            ds_buf.slice(WG * N_WG, N_WG).store(ds16)
            fence_async_shared()
            partition_barrier()  # every thread of this warpgroup has written (and fenced) its part
            mbarrier.arrive(ds_ready.index(b), count=1)
            # this warpgroup's reads of the Q and dO slots are over once dV and dK have retired
            if DO_STAGES == STAGES:
                empties = (q_empty.index(s),)  # one barrier for both rings
            else:
                empties = (q_empty.index(s), do_empty.index(sd))
            if DQ_SPLIT:
                # each warpgroup: columns [WG * D/2, (WG + 1) * D/2) of the dQ partial
                dv, dk = _dq_step(
                    (dv_tok, dk_tok, q_tile, do_tile), ds_buf, k_it.slice(WG * DQ_COLS, DQ_COLS, dim=1),
                    ds_ready.index(b), bph, empties, ds_free.index(b),
                    dq_dst, q0, dq_col0 + WG * DQ_COLS, BLOCK_M, DQ_COLS, DQ_TMA,
                )[:2]  # fmt: skip
            elif DQ_ROWS < BLOCK_M:
                # each warpgroup: query rows [WG * DQ_ROWS, (WG + 1) * DQ_ROWS) of the dQ partial, over all keys
                dv, dk = _dq_step(
                    (dv_tok, dk_tok, q_tile, do_tile), ds_buf.slice(WG * DQ_ROWS, DQ_ROWS, dim=1), k_it,
                    ds_ready.index(b), bph, empties, ds_free.index(b),
                    dq_dst, q0 + WG * DQ_ROWS, dq_col0, DQ_ROWS, DQ_COLS, DQ_TMA,
                )[:2]  # fmt: skip
            elif b == WG:
                # warpgroup (i % 2) computes the whole dQ partial of iteration i
                dv, dk = _dq_step(
                    (dv_tok, dk_tok, q_tile, do_tile), ds_buf, k_it,
                    ds_ready.index(b), bph, empties, ds_free.index(b),
                    dq_dst, q0, dq_col0, BLOCK_M, DQ_COLS, DQ_TMA,
                )[:2]  # fmt: skip
            else:
                dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, q_tile, do_tile))[:2]
                _arrive_each(empties)
                mbarrier.arrive(ds_free.index(b), count=1)  # this warpgroup does not read ds_buf

        # ---- epilogue: dV and dK (softmax_scale is already in dS) in the input dtype, through shared memory and
        # TMA stores. V_wg is read only by this warpgroup, so it can take dV at once; K is read by both
        # warpgroups' dQ products, so dK waits until both have left the loop (kv_done, count 2).
        mbarrier.arrive(kv_done, count=1)
        out_row = kv_row + WG * N_WG  # this warpgroup's rows
        dv_tile, dv_box = _out_rows(v_smem, WG * N_WG, N_WG)
        _write_back(dv, dv_tile, dv_box, dv_desc, _box_at(dv_desc, out_row, kv_col))
        mbarrier.wait(kv_done, item & 1)
        dk_tile, dk_box = _out_rows(k_smem, WG * N_WG, N_WG)
        _write_back(dk, dk_tile, dk_box, dk_desc, _box_at(dk_desc, out_row, kv_col))
        tma.store_wait(0)
        if pairs is not None:
            _item_done(pairs[0])
            it0 += n_iters
            kv_row, m_start, n_tiles, kv_start, n_iters = pairs[2]


@gluon.jit
def _consumer_by_output(
    WG: gl.constexpr,
    args,
    pairs,
    HEAD_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    N_WG: gl.constexpr,
    STAGES: gl.constexpr,
    DO_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
    DQ_TMA: gl.constexpr,
    GROUPED: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr,
):
    """One consumer warpgroup of the OUTPUT_SPLIT kernel (head dim 256): both warpgroups see all N_WG keys of
    the CTA's tile and split the work by output. WG 0: S^T = K Q^T, P^T (to p_smem for WG 1), dV += P^T dO;
    WG 1: dP^T = V dO^T, dS^T = P^T * (dP^T - delta) * scale (to the dS^T buffer), dK += dS^T Q; each then
    dQ[:, WG * D/2 : (WG + 1) * D/2] = dS K (``_dq_step``, DQ_SPLIT must hold). Its accumulator (WG 0: dV,
    WG 1: dK, [N_WG, HEAD_D] fp32) is stored at the end. ``args``: the kernel's consumer_args followed by the
    P^T exchange (p_smem [N_WG, BLOCK_M] fp32, p_ready, p_free), then with DQ_TMA the four values of
    ``_consumer``'s. Q and dO slots: with rings of different depths (DO_STAGES < STAGES) each warpgroup releases
    a slot once its last reader of it has retired: WG 0 Q's after S^T, dO's after dV (in _dq_step); WG 1 dO's
    after dP^T, Q's after dK (in _dq_step); with equal depths one barrier frees both, as in ``_consumer``.
    ``pairs``: as in ``_consumer`` (each item's accumulator from zero)."""
    (
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        ds_smem,
        lse_smem,
        delta_smem,
        kv_bar,
        q_ready,
        do_ready,
        stat_ready,
        q_empty,
        do_empty,
        ds_ready,
        ds_free,
        kv_done,
        dk_desc,
        dv_desc,
        dq_ptr,
        kv_row,
        kv_col,
        row_stride,
        m_start,
        n_tiles,
        kv_start,
        diag_off,
        left_off,
        n_iters,
        qk_scale,
        sm_scale,
        softcap,
        alibi_ptr,
        alibi_off,
        p_smem,
        p_ready,
        p_free,
    ) = args[:36]
    dq_dst = _dq_destination(WG, dq_ptr, row_stride, args[36:], DQ_TMA)
    gl.static_assert(DQ_SPLIT, "each warpgroup computes half of the dQ columns")
    dtype: gl.constexpr = q_smem.dtype
    DQ_COLS: gl.constexpr = HEAD_D // 2
    s_layout: gl.constexpr = mma_layout(BLOCK_M)  # S^T, P^T, dP^T: [N_WG keys, BLOCK_M queries]
    acc_layout: gl.constexpr = mma_layout(HEAD_D)  # dV (WG 0) or dK (WG 1): [N_WG keys, HEAD_D]
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    s_zero = gl.zeros([N_WG, BLOCK_M], gl.float32, s_layout)
    n_items = 1 if pairs is None else pairs[1]
    it0 = 0  # the flat index of the item's first iteration (``_producer``)
    for item in range(n_items):
        acc = gl.zeros([N_WG, HEAD_D], gl.float32, acc_layout)

        mbarrier.wait(kv_bar, item & 1)
        for i in range(it0, it0 + n_iters):
            flat = i if pairs is None else _flat_index(i)
            s, ph, sd, dph, b, bph, g, q0, q_tile, do_tile, ds_buf, k_it, v_it = _iteration(
                flat, it0, q_smem, do_smem, ds_smem, k_smem, v_smem, n_tiles, m_start,
                BLOCK_M, STAGES, DO_STAGES, GROUPED,
            )  # fmt: skip
            if WG == 0:
                # ---- S^T, P^T to WG 1 (once it has read the previous one), then dV += P^T dO (A from registers)
                mbarrier.wait(q_ready.index(s), ph)
                s_tok = warpgroup_mma(k_it, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(stat_ready.index(s), ph)
                lse2 = lse_smem.index(s).load(col_s)
                s_acc = warpgroup_mma_wait(0, deps=(s_tok, k_it))[0]
                if DO_STAGES != STAGES:
                    # S^T, this warpgroup's only reader of Q, has retired (lse's slot frees with WG 1's arrival, which
                    # follows every thread's P^T: module docstring)
                    mbarrier.arrive(q_empty.index(s), count=1)
                slope = alibi_slope(alibi_ptr, alibi_off, g, ALIBI)
                p, p_grad = _probs(
                    s_acc, lse2, qk_scale, kv_start, q0, diag_off, left_off, softcap, slope, N_WG, BLOCK_M, CAUSAL,
                    LOCAL, SOFTCAP, ALIBI,
                )  # fmt: skip
                mbarrier.wait(p_free, (i & 1) ^ 1)
                p_smem.store(p_grad)  # WG 1's dS^T = P^T (1 - tanh^2) (dP^T - delta) * scale
                partition_barrier()  # every thread has written its part before the (single-thread) arrive
                mbarrier.arrive(p_ready, count=1)
                mbarrier.wait(do_ready.index(sd), dph)
                acc_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_tile, acc, is_async=True)
                empty = do_empty.index(sd)  # released once dV has retired (with equal depths: q_empty.index(s))
            else:
                # ---- dP^T, then with WG 0's P^T: dS^T, dK += dS^T Q (A from registers), dS^T to shared memory
                mbarrier.wait(do_ready.index(sd), dph)
                dp_tok = warpgroup_mma(v_it, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(stat_ready.index(s), ph)
                delta = delta_smem.index(s).load(col_s)
                dp_acc = warpgroup_mma_wait(0, deps=(dp_tok, v_it))[0]
                if DO_STAGES != STAGES:
                    # dP^T, this warpgroup's only reader of dO, has retired
                    mbarrier.arrive(do_empty.index(sd), count=1)
                mbarrier.wait(p_ready, i & 1)
                p = p_smem.load(s_layout)
                partition_barrier()  # every thread has read P^T before the (single-thread) arrive
                mbarrier.arrive(p_free, count=1)
                ds16 = (p * (dp_acc - delta[None, :]) * sm_scale).to(dtype)
                mbarrier.wait(q_ready.index(s), ph)
                acc_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_tile, acc, is_async=True)
                mbarrier.wait(ds_free.index(b), bph ^ 1)  # both dQ products of iteration i - 2 have read ds_buf
                ds_buf.store(ds16)
                fence_async_shared()
                partition_barrier()
                mbarrier.arrive(ds_ready.index(b), count=1)
                empty = q_empty.index(s)  # released once dK has retired
            acc = _dq_step(
                (acc_tok, q_tile, do_tile), ds_buf, k_it.slice(WG * DQ_COLS, DQ_COLS, dim=1),
                ds_ready.index(b), bph, (empty,), ds_free.index(b),
                dq_dst, q0, g * HEAD_D + WG * DQ_COLS, BLOCK_M, DQ_COLS, DQ_TMA,
            )[0]  # fmt: skip

        # ---- epilogue: K is read by both warpgroups' dQ products and V by WG 1's dP^T, so both tiles wait until
        # both warpgroups have left the loop (kv_done, count 2); dV goes out through the V tile, dK through K
        mbarrier.arrive(kv_done, count=1)
        mbarrier.wait(kv_done, item & 1)
        if WG == 0:
            _write_back(acc, box_tile(v_smem, 0), v_smem.index(0), dv_desc, _box_at(dv_desc, kv_row, kv_col))
        else:
            _write_back(acc, box_tile(k_smem, 0), k_smem.index(0), dk_desc, _box_at(dk_desc, kv_row, kv_col))
        tma.store_wait(0)
        if pairs is not None:
            _item_done(pairs[0])
            it0 += n_iters
            kv_row, m_start, n_tiles, kv_start, n_iters = pairs[2]


# ------------------------------------------------------------------------------------------------ kernel
@gluon.jit(
    do_not_specialize=["seqlen_q", "seqlen_k", "nheads", "group", "window_left", "window_right", "alibi_stride_b"]
)  # launch
def _attention_backward_sm90_kernel(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    dk_desc,
    dv_desc,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    dq_desc,
    qk_scale,
    sm_scale,
    seqlen_q,
    seqlen_k,
    nheads,
    group,
    window_left,
    window_right,
    softcap,
    alibi_ptr,
    alibi_stride_b,
    HEAD_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    DO_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
    OUTPUT_SPLIT: gl.constexpr,
    DQ_TMA: gl.constexpr,
    DQ_PERMUTED: gl.constexpr,
    KEY_PAIRS: gl.constexpr,
    GROUPED: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    # key rows per consumer warpgroup: half of the tile each (_consumer), or all of it (_consumer_by_output)
    N_WG: gl.constexpr = BLOCK_N if OUTPUT_SPLIT else BLOCK_N // 2
    pid_n = gl.program_id(0)  # the key tile (KEY_PAIRS with causal: the first of the CTA's two, ``programs``)
    hk = gl.program_id(1)  # K/V head; query heads hk * group .. (hk + 1) * group - 1 read it
    b = gl.program_id(2)
    h0 = hk * group
    gl.static_assert(not (CAUSAL and LOCAL), "a window launch runs with CAUSAL off (its window_right is 0)")
    kv_start, m_start, n_tiles, n_iters = _key_tile(
        pid_n, seqlen_q, seqlen_k, group, window_left, window_right, BLOCK_M, BLOCK_N, CAUSAL, LOCAL
    )
    alibi_off = b * alibi_stride_b + h0  # the slope of the batch entry's first head of the group
    diag_off = seqlen_k - seqlen_q
    left_off = diag_off - window_left  # LOCAL: the window's left edge (``_probs``)
    if LOCAL:
        diag_off = diag_off + window_right  # its right edge, where causal has the diagonal

    row_stride = nheads * HEAD_D
    q_col0 = h0 * HEAD_D
    stat_off = (b.to(gl.int64) * nheads + h0) * seqlen_q
    stat_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    dq_off = b.to(gl.int64) * seqlen_q * row_stride + q_col0
    # Q and dO are read in one form, K, V, dK and dV in another: through rows views' descriptors, whose rows of batch
    # entry b start at b * seqlen, or head-major ones, whose boxes name b and the head apart (``_box_at``) and whose
    # rows start at 0 in each head
    Q_HEAD_MAJOR: gl.constexpr = head_major(q_desc.block_shape)
    KV_HEAD_MAJOR: gl.constexpr = head_major(k_desc.block_shape)
    gl.static_assert(head_major(do_desc.block_shape) == Q_HEAD_MAJOR, "dout in q's form")
    gl.static_assert(head_major(v_desc.block_shape) == KV_HEAD_MAJOR, "v in k's form")
    gl.static_assert(head_major(dk_desc.block_shape) == KV_HEAD_MAJOR, "dk in k's form")
    gl.static_assert(head_major(dv_desc.block_shape) == KV_HEAD_MAJOR, "dv in k's form")
    if Q_HEAD_MAJOR:
        q_row0 = 0
    else:
        q_row0 = b * seqlen_q
    if KV_HEAD_MAJOR:
        kv_row0 = 0
    else:
        kv_row0 = b * seqlen_k
    kv_row = kv_row0 + kv_start
    kv_col = hk * HEAD_D

    dtype: gl.constexpr = q_desc.dtype
    # the descriptors' boxes ([rows, HEAD_D], or [1, 1, rows, HEAD_D] head-major), viewed as [rows, HEAD_D] tiles by
    # the consumers (box_tile)
    q_smem = gl.allocate_shared_memory(dtype, box_buffers(STAGES, q_desc.block_shape), q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, box_buffers(DO_STAGES, do_desc.block_shape), do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, box_buffers(1, k_desc.block_shape), k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, box_buffers(1, v_desc.block_shape), v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)

    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    stat_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_done, count=2)  # one arrival per consumer warpgroup
    gl.static_assert(DO_STAGES <= STAGES, "dO's ring is at most as deep as Q's")
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        if s < DO_STAGES:
            mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(stat_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=2)  # one arrival per consumer warpgroup
    if DO_STAGES == STAGES:
        do_empty = q_empty  # one barrier per slot frees Q's and dO's (and lse/delta's)
    else:
        do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(DO_STAGES):
            mbarrier.init(do_empty.index(s), count=2)  # one arrival per consumer warpgroup
    DS_WRITERS: gl.constexpr = 1 if OUTPUT_SPLIT else 2  # warpgroups that write a dS^T buffer
    for j in gl.static_range(2):
        mbarrier.init(ds_ready.index(j), count=DS_WRITERS)
        mbarrier.init(ds_free.index(j), count=2)

    # constexprs travel as separate arguments (inside a tuple they would arrive as tensors); the runtime
    # arguments of both consumer warpgroups as one tuple
    consumer_args = (
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        ds_smem,
        lse_smem,
        delta_smem,
        kv_bar,
        q_ready,
        do_ready,
        stat_ready,
        q_empty,
        do_empty,
        ds_ready,
        ds_free,
        kv_done,
        dk_desc,
        dv_desc,
        dq_ptr + dq_off,
        kv_row,
        kv_col,
        row_stride,
        m_start,
        n_tiles,
        kv_start,
        diag_off,
        left_off,
        n_iters,
        qk_scale,
        sm_scale,
        softcap,
        alibi_ptr,
        alibi_off,
    )
    if CAUSAL and KEY_PAIRS:
        # the CTA's second work item: key tile n_n - 1 - pid_n, the lightest of the pair (``programs``), unless
        # pid_n is an odd n_n's middle tile; its K and V load once both warpgroups have stored pid_n's dK and dV
        # from the K and V tiles (kv_free)
        mirror = seqlen_k // BLOCK_N - 1 - pid_n
        kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_free, count=2)  # one arrival per consumer warpgroup
        start2, m_start2, n_tiles2, n_iters2 = _key_tile(
            mirror, seqlen_q, seqlen_k, group, window_left, window_right, BLOCK_M, BLOCK_N, CAUSAL, LOCAL
        )
        next_item = (kv_row0 + start2, m_start2, n_tiles2, start2, n_iters2)
        pairs = (kv_free, 1 + (mirror > pid_n).to(gl.int32), next_item)
    else:
        pairs: gl.constexpr = None  # one work item per CTA
    if OUTPUT_SPLIT:
        # P^T from WG 0 to WG 1, fp32 (dS is computed from the same P as the Triton kernels), one buffer
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N_WG, BLOCK_M], gl.float32)
        p_smem = gl.allocate_shared_memory(gl.float32, [N_WG, BLOCK_M], p_layout)
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        consumer_args = consumer_args + (p_smem, p_ready, p_free)
    if DQ_TMA:
        # one fp32 staging tile per consumer warpgroup for its dQ partials (_dq_step), in dq_desc's layout; the
        # tile's origin, dq_ptr + dq_off, is at row b * seqlen_q, column q_col0 of dq_accum's rows
        dq_block: gl.constexpr = dq_desc.block_shape  # dq_staging_block(dq_rows(BLOCK_M, DQ_SPLIT), DQ_PERMUTED)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_block, dq_desc.layout)
        consumer_args = consumer_args + (dq_desc, dq_smem, b * seqlen_q, q_col0)
    gl.warp_specialize(
        [
            (
                _consumer_by_output if OUTPUT_SPLIT else _consumer,
                (0, consumer_args, pairs, HEAD_D, BLOCK_M, N_WG, STAGES, DO_STAGES, CAUSAL, DQ_SPLIT, DQ_TMA, GROUPED,
                 LOCAL, SOFTCAP, ALIBI),
            ),
            (
                _consumer_by_output if OUTPUT_SPLIT else _consumer,
                (1, consumer_args, pairs, HEAD_D, BLOCK_M, N_WG, STAGES, DO_STAGES, CAUSAL, DQ_SPLIT, DQ_TMA, GROUPED,
                 LOCAL, SOFTCAP, ALIBI),
            ),
            (
                _producer,
                (
                    q_desc,
                    do_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    lse_smem,
                    delta_smem,
                    kv_bar,
                    q_ready,
                    do_ready,
                    stat_ready,
                    q_empty,
                    do_empty,
                    lse_ptr + stat_off,
                    delta_ptr + stat_off,
                    q_row0,
                    q_col0,
                    m_start,
                    n_tiles,
                    seqlen_q,
                    kv_row,
                    kv_col,
                    n_iters,
                    pairs,
                    HEAD_D,
                    BLOCK_M,
                    STAGES,
                    DO_STAGES,
                    GROUPED,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


MAX_CAUSAL_GROUP = 8
"""Query heads per K/V head up to which a causal backward takes this kernel. One CTA walks its key tile's
query tiles for every head of the group, so with large groups there are few CTAs with long, uneven (causal)
walks; on the H200 (B=4, N=4k, D=128, bf16) the Triton kernels were faster at 16 and 32 query heads per K/V
head (273 / 229 TFLOP/s against 256 / 212), this kernel at 4 and 8 (361 / 347 against 341 / 332) and at
every group size without causal."""


def qualifies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    options: AttentionOptions,
    varlen: bool = False,
) -> Verdict:
    """Whether this kernel computes the backward of attention(q, k, v, options) given dout, on any device (the
    device itself is the dispatcher's, ``_backend.gluon_refusal``): the options of both sm_90 kernels
    (``common.option_refusals``; a learnable sink is fine: the saved lse includes it) and deterministic=False (dQ is
    summed by atomics); bf16/fp16; one head dim in CONFIGS for q, k, v; the query heads a multiple of the K/V heads
    (MHA, GQA, MQA; causal: at most MAX_CAUSAL_GROUP per K/V head); both lengths positive multiples of ROWS; dQ
    offsets within a batch entry below 2**31; layouts its descriptors can read (``common.layout_refusal``; q and dout
    in one form, k and v in another: torch's (batch, nheads, seqlen, headdim) through head-major descriptors).
    softmax_scale > 0 matters here too: D=64's 128-row tiles start S^T's accumulator at -lse / scale (``_consumer``'s
    STATS_IN_ACC)."""
    reasons = [
        *option_refusals(options, varlen),
        "deterministic=True (this kernel sums dQ with atomics)" if options.deterministic else None,
    ]
    if not varlen:
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        group_ok = nheads_k > 0 and nheads % nheads_k == 0
        reasons += (
            dtype_refusal(q),
            head_dim_refusal(q, k, v, CONFIGS),
            window_refusal(options, head_dim, kernel="backward"),
            None if v.shape[2:] == k.shape[2:] else f"v {tuple(v.shape)} with other heads or head dim than k",
            None if group_ok else f"nheads {nheads} not a multiple of nheads_k {nheads_k}",
            f"causal with {nheads // nheads_k} query heads per K/V head (at most {MAX_CAUSAL_GROUP})"
            if group_ok and options.causal and nheads // nheads_k > MAX_CAUSAL_GROUP else None,
            f"softcap at head dim {head_dim} (its {CONFIGS[head_dim]['BLOCK_M']}-row query tiles start S^T at -lse)"
            if options.softcap != 0.0 and head_dim in CONFIGS and stats_in_acc(CONFIGS[head_dim]["BLOCK_M"]) else None,
            None if seqlen_q % ROWS == 0 and seqlen_k % ROWS == 0 and seqlen_k > 0
            else f"seqlen_q {seqlen_q}, seqlen_k {seqlen_k} (positive multiples of {ROWS} only)",
            "dQ offsets past 2**31" if seqlen_q * nheads * head_dim >= 2**31 else None,
            layout_refusal(dict(q=q, dout=dout), dict(k=k, v=v)),
        )  # fmt: skip
    return verdict(reasons)


def programs(n_n: int, cfg: dict, causal: bool) -> int:
    """CTAs per (K/V head, batch entry), the grid's first dimension, for n_n key tiles with config ``cfg``: one
    per key tile, or with causal and KEY_PAIRS one per pair of them, n_n - n_n // 2 (CTA p walks tile p, then
    tile n_n - 1 - p; an odd n_n's middle tile has a CTA of its own)."""
    return n_n - n_n // 2 if causal and cfg["KEY_PAIRS"] else n_n


class BackwardPlan(NamedTuple):
    """What a launch follows from its inputs' layouts (``backward_plan``'s key), kept per key: the grid, the
    descriptor templates of q, dout, k, v, dk, dv and dq_accum (None without DQ_TMA), the kernel's int arguments
    (seqlen_q, seqlen_k, nheads, group, and the window's bounds: ``common.window_args``), the constexprs, and
    ``launch``'s ``keyed``."""

    grid: tuple[int, int, int]
    descriptors: tuple[Template, ...]
    dq_descriptor: Template | None
    ints: tuple[int, int, int, int, int, int]
    constexprs: dict
    keyed: tuple[list, tuple]


_PLANS = _launch.Plans()
"""``backward_plan``'s plans by ``_plan_key``; None for inputs that do not qualify."""


def _plan_key(
    dout, q, k, v, lse, delta, softmax_scale: float, causal: bool, window: Window | None, mods: ScoreMods
) -> tuple:
    """What a plan follows from: the shapes and strides of q, k and v, the strides of dout, lse and delta, the dtypes
    of q and dout (k and v have q's, lse and delta are float32: the callers' contract), the device, causal, the
    window, the score modifications' key (``common.ScoreMods.key``), whether
    softmax_scale is positive, whether every tensor's address is 16-byte aligned, the head dim's CONFIGS entry (read on
    every call, so a changed entry makes new plans) and MAX_CAUSAL_GROUP."""
    cfg = CONFIGS.get(q.shape[3])
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | lse.data_ptr() | delta.data_ptr()) % 16
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.stride(), lse.stride(), delta.stride(),
        q.dtype, dout.dtype, q.device, causal, window, mods.key, softmax_scale > 0, aligned == 0,
        cfg and tuple(cfg.values()), MAX_CAUSAL_GROUP,
    )  # fmt: skip


def backward_plan(
    dout, q, k, v, lse, delta, softmax_scale: float, causal: bool, window: Window | None, mods: ScoreMods
) -> BackwardPlan:
    """The plan of a launch on these tensors (``attention_backward_sm90``'s; they qualify: ``qualifies``): made on
    the first call of a ``_plan_key`` and kept."""
    key = _plan_key(dout, q, k, v, lse, delta, softmax_scale, causal, window, mods)
    return _PLANS.plan(key, _make_plan, dout, q, k, v, lse, delta, causal, window, mods)


def _make_plan(
    dout, q, k, v, lse, delta, causal: bool, window: Window | None, mods: ScoreMods
) -> tuple[BackwardPlan, bool]:
    """``backward_plan``'s plan made anew, and True: keep it. The outputs' descriptor templates come from tensors of
    their layouts on the meta device (no memory, no zero fill: a first call allocates its outputs once). q and dout
    go through descriptors of one form, k, v, dk and dv of another (``common.head_major_form``): rows views'
    (``common.descriptor``) or head-major ones (``common.head_major_descriptor``); dq_accum has rows views. A window
    launch runs with CAUSAL off (its key tiles' query tiles come from the window, ``_key_tile``)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    causal = causal and window is None
    cfg = CONFIGS[head_dim]
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows_out = block_n if cfg["OUTPUT_SPLIT"] else block_n // 2  # the dK / dV rows one warpgroup stores
    dq_accum, dk, dv = _outputs(q, k, v, torch.device("meta"))
    # DQ_TMA off: None, which compiles as a constexpr (the kernel of the atomic path has no descriptor parameter)
    dq_desc = dq_descriptor(dq_accum, dq_rows(block_m, cfg["DQ_SPLIT"]), cfg["DQ_PERMUTED"]) if cfg["DQ_TMA"] else None
    q_form = head_major_descriptor if head_major_form(q, dout) else descriptor
    kv_form = head_major_descriptor if head_major_form(k, v) else descriptor
    descriptors = (
        q_form(q, block_m), q_form(dout, block_m), kv_form(k, block_n), kv_form(v, block_n), kv_form(dk, rows_out),
        kv_form(dv, rows_out),
    )  # fmt: skip
    ints = (seqlen_q, seqlen_k, nheads, nheads // nheads_k, *window_args(window, seqlen_q, seqlen_k))
    args = (*descriptors, lse, delta, dq_accum, dq_desc, 1.0, 1.0, *ints, *mods.args)
    constexprs = dict(
        HEAD_D=head_dim, CAUSAL=causal, GROUPED=nheads != nheads_k, LOCAL=window is not None, **mods.constexprs, **cfg
    )
    keyed = keyed_for(_attention_backward_sm90_kernel, args, constexprs)
    grid = head_grid(programs(seqlen_k // block_n, cfg, causal), batch, nheads_k)
    dq_template = None if dq_desc is None else template(dq_desc)
    return BackwardPlan(grid, tuple(map(template, descriptors)), dq_template, ints, constexprs, keyed), True


def _outputs(q, k, v, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On ``device``: dq_accum (zeros, fp32, q's shape, contiguous: rows views whatever q's layout), dk and dv
    (``empty_output_like``: in k's and v's layouts where those are dense, as torch.empty_like and the op's
    register_fake give them, so that autograd keeps them as a leaf's gradients without a copy; contiguous
    otherwise)."""
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=device)
    return dq_accum, empty_output_like(k, device), empty_output_like(v, device)


def attention_backward_sm90(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window: Window | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Launch the kernel on inputs that qualify (``qualifies``) on an sm_90 GPU (``_backend.gluon_refusal``; the
    dispatcher has checked both) and return the gradients. Per call: the plan of the inputs' layouts
    (``backward_plan``), the outputs, seven descriptors rebased from its templates and one launch past the binder.

    Args:
        dout: (batch, seqlen_q, nheads, headdim), the gradient of out
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), nheads a multiple
            of nheads_k
        lse: (batch, nheads, seqlen_q) float32, contiguous, the forward's (natural log)
        delta: (batch, nheads, seqlen_q) float32, contiguous: rowsum(dout * out) - dlse
        softmax_scale: as given to the forward
        causal: query i sees key j iff j <= i + seqlen_k - seqlen_q
        window: None, or the forward's sliding window (``forward.attention_forward_sm90``), in place of causal
        softcap, alibi_slopes: the forward's (``forward.attention_forward_sm90``)

    Returns:
        dq, dk, dv shaped like q, k, v in their dtype and, where those are dense, their layouts (``_outputs``;
        contiguous otherwise): dq converted from dq_accum in one copy
    """
    mods = ScoreMods.of(softmax_scale, softcap, alibi_slopes)
    plan = backward_plan(dout, q, k, v, lse, delta, softmax_scale, causal, window, mods)
    dq_accum, dk, dv = _outputs(q, k, v, q.device)
    q_desc, dout_desc, k_desc, v_desc, dk_desc, dv_desc = plan.descriptors
    dq_desc = None if plan.dq_descriptor is None else rebase(plan.dq_descriptor, dq_accum)
    args = (
        rebase(q_desc, q), rebase(dout_desc, dout), rebase(k_desc, k), rebase(v_desc, v), rebase(dk_desc, dk),
        rebase(dv_desc, dv), lse, delta, dq_accum, dq_desc, mods.qk_scale, softmax_scale, *plan.ints, *mods.args,
    )  # fmt: skip
    launch(_attention_backward_sm90_kernel, plan.grid, args, plan.constexprs, plan.keyed)
    return empty_output_like(q).copy_(dq_accum), dk, dv


@on_input_device
def attention_backward(dout, q, k, v, out, lse, options: AttentionOptions, dlse: torch.Tensor | None = None):
    """The dispatcher's entry (``_backend.backward_choice``): (dq, dk, dv) as ``ops.attention.attention_backward``
    gives them (same arguments), by this kernel after the Triton delta kernel (rowsum(dout * out) - dlse)."""
    delta = imported("flashtile.ops.attention").attention_delta(dout, out, dlse)
    return attention_backward_sm90(
        dout, q, k, v, lse, delta, options.softmax_scale, causal=options.causal, window=window_of(options),
        softcap=options.softcap, alibi_slopes=options.alibi_slopes,
    )  # fmt: skip
