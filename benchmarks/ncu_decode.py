"""One decode step for Nsight Compute (gpu_session.sh's ``ncudecode`` step): the first launch compiles, the second
is the one ncu profiles (``-s 1 -c 1`` with the kernel-name filter ``_split_kv_kernel``).

    PYTHONPATH=src ncu --set full -k regex:_split_kv_kernel -s 1 -c 1 -o REPORT \\
        python3 benchmarks/ncu_decode.py [--batch 1] [--context 1024] [--num-splits 0] [--paged]

Shapes as bench_decode.py (its first NHEADS_Q): Hkv 8, Hq 32, D 128, bf16, one new token appended at context - 1,
causal."""

import argparse

import torch

from bench_decode import HEAD_DIM, NHEADS_Q, Caches  # benchmarks/, beside this script
from flashtile import flash_attn_with_kvcache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--num-splits", type=int, default=0)
    parser.add_argument("--paged", action="store_true")
    args = parser.parse_args()
    caches = Caches(args.batch, args.context, page_size=256)
    q = torch.randn(args.batch, 1, NHEADS_Q[0], HEAD_DIM, device="cuda", dtype=caches.k.dtype)
    k_cache, v_cache = (caches.k_paged, caches.v_paged) if args.paged else (caches.k, caches.v)
    for _ in range(2):
        flash_attn_with_kvcache(
            q, k_cache, v_cache, caches.k_new, caches.v_new, cache_seqlens=caches.seqlens,
            block_table=caches.block_table if args.paged else None, causal=True, num_splits=args.num_splits,
        )  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
