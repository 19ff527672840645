"""Forward + backward cases for ``compute-sanitizer --tool memcheck`` (gpu_session.sh's ``sanitize`` step): each
path's edges on the GPU it runs on, small enough for the sanitizer's slowdown.

    PYTHONPATH=src compute-sanitizer --tool memcheck python3 benchmarks/sanitize_cases.py

On sm_90 the cases cover the Gluon forward at D=64, 128 and 256 with odd lengths and Sq != Sk, the persistent
forward with several work items per CTA (B=2 N=1024 without causal: 256 items at H=16, 384 192-row items at D=64
H=32; causal B=2 N=2048 H=16: 256 pair slots; D=64 causal from N=2048, B=2 N=2100 GQA 16:4: 288 pair slots; D=64
causal from N=8192 with three warpgroups and the first key tile folded into the loop, B=1 N=8200 GQA 2:1), the
Gluon backward with GQA at D=64, 128 and 256 (causal: key tiles in pairs), and the Triton kernels (odd lengths, a
decode query of one row)."""

import torch

import flashtile

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


def main() -> None:
    torch.manual_seed(0)
    for q_shape, kv_shape, causal in CASES:
        q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        flashtile.flash_attn_func(q, k, v, causal=causal).sum().backward()
    torch.cuda.synchronize()
    print(f"sanitized {len(CASES)} fwd+bwd cases")


if __name__ == "__main__":
    main()
