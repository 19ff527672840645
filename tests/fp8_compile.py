"""Compile the float8 forward (``ops.fp8.forward``) and its V transpose (``ops.fp8.transpose``) for sm_90 on a
machine without a GPU.

As tests/sm90_compile.py does for the other kernels: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))`` lowers the kernel with the wheel's ptxas, which fails on what the interpreter cannot see (a float8 product
Hopper's wgmma cannot take, a config that does not fit in shared memory). Compiled: each shipped config (pass
``fp8_forward`` of ``ops.attention.configs``) at its largest head dim and at one below it, full, causal and with a
sliding window, with and without descale factors, through tensor descriptors and through pointer loads; the
transpose's one config at head dims 32 to 256 (a contiguous v, whose strides Triton sees as multiples of 16).

Usage: ``python tests/fp8_compile.py`` (TRITON_INTERPRET unset). Prints one JSON row per variant (kernel, label,
shared bytes, registers and stack bytes per thread; the forward's number of float8 wgmma instructions, the
transpose's global loads and stores narrower than 16 bytes; error) and exits 1 if any failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("tests/fp8_compile.py: unset TRITON_INTERPRET (kernels defined under the interpreter cannot compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashtile.ops.attention.configs import _HOPPER, TileConfig  # noqa: E402
from flashtile.ops.common.grid import padded_head_dim  # noqa: E402
from flashtile.ops.fp8 import forward, transpose  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_compile import resources  # noqa: E402  (registers, stack bytes, machine-code digest)

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
SCALARS = ("nheads", "nheads_k", "seqlen_q", "seqlen_k", "left", "right")


def signature(cfg: TileConfig, head_dim: int, mask: str, descale: bool) -> tuple[dict, dict]:
    """(signature, constexprs) of one variant; mask: "full", "causal" or "window"."""
    block_d, block_dv = forward.block_widths(head_dim, head_dim)
    tma = cfg.tma
    sig = {
        "Q": f"tensordesc<fp8e4nv[1,{cfg.block_m},1,{block_d}]>" if tma else "*fp8e4nv",
        "K": f"tensordesc<fp8e4nv[1,{cfg.block_n},1,{block_d}]>" if tma else "*fp8e4nv",
        "VT": f"tensordesc<fp8e4nv[1,1,{block_dv},{cfg.block_n}]>" if tma else "*fp8e4nv",
        "Out": f"tensordesc<bf16[1,{cfg.block_m},1,{block_dv}]>" if tma else "*bf16",
        "Lse": "*fp32",
        "Descale": "*fp32" if descale else "constexpr",
        "qk_scale": "fp32",
    }
    consts = {} if descale else {"Descale": None}
    for p in forward._fp8_forward_kernel.params:
        if p.name.startswith("stride_") or p.name in SCALARS:
            sig[p.name] = "i32"
    consts.update(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, MASK_LEFT=mask == "window", MASK_RIGHT=mask != "full", HAS_DESCALE=descale, TMA=tma,
    )  # fmt: skip
    for name in consts:
        sig.setdefault(name, "constexpr")
    order = [p.name for p in forward._fp8_forward_kernel.params]
    return {name: sig[name] for name in order}, consts


def compile_one(cfg: TileConfig, head_dim: int, mask: str, descale: bool) -> dict:
    load = "tma" if cfg.tma else "ptr"
    label = f"D{head_dim} {cfg.block_m}x{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}/{load} {mask}"
    row = {"kernel": "forward", "label": label + (" descale" if descale else "")}
    try:
        sig, consts = signature(cfg, head_dim, mask, descale)
        compiled = triton.compile(
            ASTSource(forward._fp8_forward_kernel, sig, consts),
            target=TARGET,
            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
        )
        shared = compiled.metadata.shared
        row.update(resources(compiled.asm["cubin"]), shared=shared)
        ptx = compiled.asm["ptx"]
        # both products on float8 wgmma: S = Q K^T and O += P V (each unrolled into several instructions)
        row["fp8_wgmma"] = sum(".e4m3.e4m3" in line and "wgmma.mma_async" in line for line in ptx.splitlines())
        if shared > MAX_SHARED:
            row["error"] = f"shared memory {shared} > {MAX_SHARED}"
    except Exception as e:  # noqa: BLE001 - every failure is reported, named by its variant
        row["error"] = f"{type(e).__name__}: {str(e).strip()[-1500:]}"
    return row


TRANSPOSE_HEAD_DIMS = (32, 96, 128, 256)
"""Head dims of the transpose's variants: the smallest tile, a padded one (96 in a 128-wide tile), the largest."""
GLOBAL_ACCESS = re.compile(r"\b(?:ld|st)\.global\.[\w.]+")
VECTOR_16 = (".v4.b32", ".v4.u32", ".v2.b64", ".v2.u64")


def compile_transpose(head_dim_v: int) -> dict:
    """The transpose kernel for a contiguous v of head dim ``head_dim_v``: its pointers and strides 16-byte aligned
    (as Triton specializes them: a multiple of 16 is marked divisible by 16), nheads_k and seqlen_k any. Both sides
    must move 16-byte vectors: "narrow_global" counts the global loads and stores that do not."""
    kernel = transpose._transpose_values_kernel
    row = {"kernel": "transpose", "label": f"transpose D{head_dim_v} {transpose.BLOCK_N}/w{transpose.NUM_WARPS}"}
    try:
        sig, attrs = {}, {}
        for i, p in enumerate(kernel.params):
            if p.is_constexpr:
                sig[p.name] = "constexpr"
                continue
            sig[p.name] = "*fp8e4nv" if p.name in ("V", "VT") else "i32"
            if p.name not in ("nheads_k", "seqlen_k"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        consts = dict(HEAD_DIM_V=head_dim_v, BLOCK_N=transpose.BLOCK_N, BLOCK_DV=padded_head_dim(head_dim_v))
        compiled = triton.compile(
            ASTSource(kernel, sig, consts, attrs), target=TARGET, options={"num_warps": transpose.NUM_WARPS}
        )
        accesses = GLOBAL_ACCESS.findall(compiled.asm["ptx"])
        row.update(resources(compiled.asm["cubin"]), shared=compiled.metadata.shared)
        row["narrow_global"] = sum(not a.endswith(VECTOR_16) for a in accesses)
        if not accesses:
            row["error"] = "no global loads or stores found in the PTX"
    except Exception as e:  # noqa: BLE001 - every failure is reported, named by its variant
        row["error"] = f"{type(e).__name__}: {str(e).strip()[-1500:]}"
    return row


def variants() -> list[tuple]:
    found = []
    for largest, cfg in _HOPPER["fp8_forward"]:
        for head_dim in sorted({largest, largest - 24}):  # the bucket's top and a padded head dim inside it
            for mask in ("full", "causal", "window"):
                found.append((cfg, head_dim, mask, mask == "causal"))
            if cfg.tma:  # the pointer loads a layout without tensor descriptors takes
                found.append((dataclasses.replace(cfg, tma=False), head_dim, "causal", True))
    return found


def main() -> int:
    rows = [compile_one(*v) for v in variants()] + [compile_transpose(d) for d in TRANSPOSE_HEAD_DIMS]
    for row in rows:
        print(json.dumps(row))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
