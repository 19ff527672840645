"""Forward + backward cases for ``compute-sanitizer --tool memcheck`` (gpu_run.sh's ``sanitize`` step): each
path's edges on the GPU it runs on, small enough for the sanitizer's slowdown.

    PYTHONPATH=src compute-sanitizer --tool memcheck python3 benchmarks/sanitize_cases.py

On sm_90 the cases cover the Gluon forward at D=64, 128 and 256 with odd lengths and Sq != Sk, the persistent
forward with several work items per CTA (B=2 N=1024 without causal: 256 items at H=16, 384 192-row items at D=64
H=32; causal B=2 N=2048 H=16: 256 pair slots; D=64 causal from N=2048, B=2 N=2100 GQA 16:4: 288 pair slots; D=64
causal from N=8192 with three warpgroups and the first key tile folded into the loop, B=1 N=8200 GQA 2:1), the
Gluon backward with GQA at D=64, 128 and 256 (causal: key tiles in pairs), and the Triton kernels (odd lengths, a
decode query of one row). Then decode steps (``flash_attn_with_kvcache``, Hkv 8, Hq 32, D 128, bf16): a contiguous
cache at an odd length with the heuristic's splits and with 4, a paged cache of 16-row pages with 5 query tokens and a
left pad, a paged cache of 256-row pages eager (pointer loads) and replayed from a CUDA graph (on sm_90, tensor
descriptors: ``split_kv.use_tma``), with the last sequence's pages at the end of the cache, and one-split steps."""

import torch

import flashtile
from bench_decode import capture

CASES = [
    ((2, 300, 4, 64), (2, 211, 4, 64), True),
    ((2, 300, 4, 256), (2, 211, 4, 256), True),
    ((1, 200, 4, 256), (1, 333, 4, 256), False),
    ((2, 1024, 16, 128), (2, 1024, 16, 128), True),
    ((2, 1000, 16, 128), (2, 1000, 4, 128), False),
    ((2, 1024, 16, 128), (2, 1024, 16, 128), False),
    ((2, 2048, 16, 128), (2, 2048, 16, 128), True),
    ((2, 256, 8, 128), (2, 384, 2, 128), True),
    ((2, 256, 8, 64), (2, 128, 4, 64), False),
    ((2, 1024, 32, 64), (2, 1024, 32, 64), False),
    ((2, 1024, 32, 64), (2, 1024, 8, 64), True),
    ((2, 2100, 16, 64), (2, 2100, 4, 64), True),
    ((1, 8200, 2, 64), (1, 8200, 1, 64), True),
    ((1, 256, 4, 256), (1, 384, 2, 256), True),
    ((1, 17, 4, 128), (1, 1, 4, 128), False),
]
"""(q shape, k / v shape, causal), flash_attn layout, bf16."""

DECODE_CASES = [
    dict(batch=2, context=3001, page_size=0, seqlen_q=1, num_splits=0, leftpad=False, graph=False),
    dict(batch=2, context=3001, page_size=0, seqlen_q=1, num_splits=4, leftpad=False, graph=False),
    dict(batch=3, context=2048, page_size=16, seqlen_q=5, num_splits=0, leftpad=True, graph=False),
    dict(batch=2, context=4096, page_size=256, seqlen_q=1, num_splits=0, leftpad=False, graph=False),
    dict(batch=2, context=4096, page_size=256, seqlen_q=1, num_splits=0, leftpad=False, graph=True),
    dict(batch=2, context=3001, page_size=0, seqlen_q=17, num_splits=4, leftpad=False, graph=False),
    dict(batch=16, context=1024, page_size=0, seqlen_q=1, num_splits=1, leftpad=False, graph=True),
    dict(batch=2, context=3008, page_size=16, seqlen_q=1, num_splits=1, leftpad=True, graph=False),
]
"""One decode step each: a new token appended at context - 1 of every sequence, causal. The last makes two query
tiles (17 tokens x 4 heads), so its new token is read from k, v in a split of its own (``split_kv.NEW_SPLIT``); the
others append it first (``split_kv.appends_first``), the last two at one split in the first iteration of the key loop
(``append_late``: a contiguous B=16 1k step replayed from a CUDA graph, a paged one with a left pad whose new key lies
in the masked tail)."""


def decode_step(batch, context, page_size, seqlen_q, num_splits, leftpad, graph) -> None:
    """One step of a DECODE_CASES entry; ``graph``: captured in a CUDA graph and replayed."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    slots, rows = (batch * context // page_size, page_size) if page_size else (batch, context)
    k_cache, v_cache = (torch.randn(slots, rows, 8, 128, **bf16) for _ in range(2))
    block_table = None
    if page_size:
        block_table = torch.arange(slots, device="cuda", dtype=torch.int32).view(batch, context // page_size)
    q = torch.randn(batch, seqlen_q, 32, 128, **bf16)
    k, v = (torch.randn(batch, 1, 8, 128, **bf16) for _ in range(2))
    seqlens = torch.full((batch,), context - 1, device="cuda", dtype=torch.int32)
    pads = torch.arange(batch, device="cuda", dtype=torch.int32) * 37 if leftpad else None

    def step() -> torch.Tensor:
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                 cache_leftpad=pads, block_table=block_table, causal=True,
                                                 num_splits=num_splits)  # fmt: skip

    if graph:
        capture(step)[0].replay()
    else:
        step()


def main() -> None:
    torch.manual_seed(0)
    for q_shape, kv_shape, causal in CASES:
        q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        flashtile.flash_attn_func(q, k, v, causal=causal).sum().backward()
    for case in DECODE_CASES:
        decode_step(**case)
    torch.cuda.synchronize()
    print(f"sanitized {len(CASES)} fwd+bwd cases and {len(DECODE_CASES)} decode steps")


if __name__ == "__main__":
    main()
