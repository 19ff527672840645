"""One decode step for Nsight Compute (gpu_run.sh's ``ncudecode`` step): the first launches compile and warm up,
the last one runs between cudaProfilerStart and cudaProfilerStop.

    PYTHONPATH=src ncu --set full -k regex:_split_kv_kernel -s 1 -c 1 -o REPORT \\
        python3 benchmarks/ncu_decode.py [--batch 1] [--context 1024] [--num-splits 0] [--paged] [--config 64.4.3]
    PYTHONPATH=src ncu --set full --profile-from-start off -o REPORT python3 benchmarks/ncu_decode.py --sdpa ...

Shapes as bench_decode.py (its first NHEADS_Q): Hkv 8, Hq 32, D 128, bf16, one new token appended at context - 1,
causal. ``--config block_n.num_warps.num_stages`` swaps in a tile config as tune_decode.py does
(``tune_decode.swapped``); ``--sdpa`` runs the peer instead: F.scaled_dot_product_attention on the contiguous cache
(attention alone, torch's choice of backend: cuDNN's kernel on the H200 with torch 2.11), whose kernel name the
profiled range finds."""

import argparse
import contextlib

import torch
import torch.nn.functional as F

from bench_decode import HEAD_DIM, NHEADS_Q, Caches  # benchmarks/, beside this script
from flashtile import _backend, flash_attn_with_kvcache
from tune_decode import parse_config, swapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--num-splits", type=int, default=0)
    parser.add_argument("--paged", action="store_true")
    parser.add_argument("--config", default=None, help="block_n.num_warps.num_stages[.programs_per_sm]")
    parser.add_argument("--sdpa", action="store_true", help="profile SDPA on the contiguous cache instead")
    args = parser.parse_args()
    caches = Caches(args.batch, args.context, page_size=256)
    q = torch.randn(args.batch, 1, NHEADS_Q[0], HEAD_DIM, device="cuda", dtype=caches.k.dtype)
    k_cache, v_cache = (caches.k_paged, caches.v_paged) if args.paged else (caches.k, caches.v)

    def step():
        if args.sdpa:
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), caches.k.transpose(1, 2), caches.v.transpose(1, 2), enable_gqa=True
            )
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, caches.k_new, caches.v_new, cache_seqlens=caches.seqlens,
            block_table=caches.block_table if args.paged else None, causal=True, num_splits=args.num_splits,
        )  # fmt: skip

    swap = contextlib.nullcontext()
    if args.config:
        swap = swapped(parse_config(args.config))
    with swap, _backend.check_values(False):
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
