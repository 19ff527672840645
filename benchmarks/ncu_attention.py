"""One attention forward or backward for Nsight Compute (gpu_run.sh's ``ncufwd`` / ``ncubwd`` steps): the
first launch compiles, the second is the one ncu profiles (``-s 1 -c 1`` with a kernel-name filter).

    PYTHONPATH=src ncu --set full -k regex:_attention_backward_sm90 -s 1 -c 1 -o REPORT \\
        python3 benchmarks/ncu_attention.py [--pass backward] [--causal] [--head-dim 128] [--seqlen 4096]

bf16, flash_attn layout (B, N, H, D) with B * N = 16384 tokens and H * D = 2048 (the standard table's shapes).
``--pass forward`` runs forwards only (no autograd graph), ``backward`` (the default) forward + backward.
``--variant KEY=VALUE,...`` changes the Gluon kernels' configs as a tune_gluon.py variant does (e.g.
``FORWARD_D=64,NUM_WG=3,CONSUMER_REGS=160``)."""

import argparse

import torch

import flashtile
from tune_gluon import configured, parse_variant  # benchmarks/, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pass", dest="pass_name", choices=("forward", "backward"), default="backward")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--variant", type=lambda text: parse_variant(":" + text)[1], default={})
    args = parser.parse_args()
    shape = (16384 // args.seqlen, args.seqlen, 2048 // args.head_dim, args.head_dim)
    backward = args.pass_name == "backward"
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(3))
    with configured(args.variant):
        for _ in range(2):
            out = flashtile.flash_attn_func(q, k, v, causal=args.causal)
            if backward:
                out.backward(torch.ones_like(out))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
