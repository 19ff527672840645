"""Compile every shipped kernel config for sm_90 (the H200) on a machine without a GPU.

The Triton interpreter runs the kernels' arithmetic but never lowers them, so a config that does not fit
in shared memory, a ptxas failure or a register-pressure regression only shows on the GPU. The triton
wheel carries ptxas, and ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` lowers a
kernel for sm_90 on a machine without a GPU. This module compiles:

* the attention kernels for every entry of the Hopper table (``configs._HOPPER``): each pass at each head
  dim bucket, causal and full (``forward_banded_short`` serves only banded launches, so it is compiled
  causal and with a sliding window; ``forward_short`` only launches that are not banded, compiled full),
  with every feature off and with every feature on (softcap, ALiBi, sink, dropout, varlen: those the
  kernel has; the forward also with paged K/V on top), and the delta kernel of the backward;
* the attention and decode kernels for float32 inputs: the configs ``configs.config`` and ``decode.configs.config``
  give them (pointer loads, shallow pipelines), features off and on;
* the decode kernel (split-KV, which also appends the new keys) at each head dim bucket of
  ``decode.configs.config`` (also with a paged cache read through tensor descriptors), and its few-programs
  config of contiguous caches;
* the Gluon forward of ``ops.sm90.forward`` and backward of ``ops.sm90.backward`` (each head dim's config, and the
  forward's D=64 config with two consumer warpgroups, 128-row items, as D=128 has), causal and full; the
  forward with key lengths a multiple of its tiles ("off") and not ("ragged-k": EVEN_K off); the other setting
  of each causal schedule key (the forward's CAUSAL_PAIRS and CAUSAL_PERSISTENT, the backward's KEY_PAIRS) and of
  the backward's DQ_PERMUTED; both reading torch's (B, H, N, D) layout through head-major descriptors
  ("head-major": q, k, v and out, or the backward's q, dout, k, v, dk and dv; "head-major-kv": k and v, and dk and
  dv; "head-major-q": the backward's q and dout).
  Their int parameters are not specialized (``forward_sm90.launch``): one compile serves every length.

Each distinct variant compiles once; variants compile in parallel, one process per CPU. A variant fails
on a ``PTXASError`` (or any other compile error) or when its shared memory exceeds the H200's 227 KiB per
block (``OutOfResources``, which Triton itself raises only when loading onto a GPU).

Usage: ``python tests/sm90_compile.py [--json PATH]`` (TRITON_INTERPRET must be unset: a kernel defined
under the interpreter cannot be compiled). Prints one row per variant (kernel, config, flags, registers,
stack bytes, shared bytes) and exits 1 if any variant failed; ``--json`` writes the rows for
tests/test_sm90_compile.py.

Signatures come from each kernel's parameter list through ``ARGS``, an explicit map per kernel of every
non-constexpr parameter to its type, and, for an optional pointer, the constexpr flag under which the
launcher passes a tensor (otherwise it passes None, which Triton compiles as a constexpr None). A kernel
parameter missing from its map, a mapped name the kernel does not have, or a constexpr the variant does
not set fails loudly: update ``ARGS`` (and the variants below) together with the kernel and its launcher.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("tests/sm90_compile.py: unset TRITON_INTERPRET (kernels defined under the interpreter cannot compile)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from flashtile.ops.attention import backward, forward  # noqa: E402
from flashtile.ops.attention.configs import _HOPPER, ALL_PASSES, FLOAT32, PASSES, with_mask  # noqa: E402
from flashtile.ops.decode import configs as decode_configs  # noqa: E402
from flashtile.ops.decode import split_kv  # noqa: E402
from flashtile.ops.sm90 import backward as backward_sm90  # noqa: E402
from flashtile.ops.sm90 import common as sm90_common  # noqa: E402
from flashtile.ops.sm90 import forward as forward_sm90  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
DATA = "bf16"  # element type of q/k/v/out and their gradients (fp16 lowers the same way)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
TRITON_DEFAULTS = {"num_warps": 4, "num_stages": 3}  # what a launch without num_warps / num_stages gets


@dataclass(frozen=True)
class Ptr:
    """A pointer parameter: element type (``DATA`` for the q/k/v dtype) and the constexpr flag under which
    the launcher passes a tensor (None: always a tensor). ``when`` may be a callable of the constexprs.
    ``tile``: the (rows, cols) constexprs of its block when the variant's TMA makes it a tensor descriptor
    of a (B, S, H, D) tensor (``tiles.tile_sources``)."""

    dtype: str
    when: str | None = None
    tile: tuple[str, str] | None = None


@dataclass(frozen=True)
class Scalar:
    """A scalar parameter: "i32" or "fp32"; ``when`` as for ``Ptr`` (the launcher passes None otherwise);
    ``aligned``: a stride, which the launchers' tensors make a multiple of 16 (Triton specializes on it)."""

    dtype: str
    when: str | None = None
    aligned: bool = False


T = Ptr(DATA)  # a q/k/v-typed tensor
TQ, TK = Ptr(DATA, tile=("BLOCK_M", "BLOCK_D")), Ptr(DATA, tile=("BLOCK_N", "BLOCK_D"))  # descriptors with TMA
TQV, TKV = Ptr(DATA, tile=("BLOCK_M", "BLOCK_DV")), Ptr(DATA, tile=("BLOCK_N", "BLOCK_DV"))
F32 = Ptr("fp32")
INT = Scalar("i32")
ST = Scalar("i32", aligned=True)  # a stride of a q/k/v-typed tensor
FP = Scalar("fp32")
MS = Scalar("i32", "HAS_MASK")  # a stride of SDPA's attn_mask (0 on broadcast dimensions)
# SDPA's attn_mask: uint8 when boolean (MASK_IS_BOOL), else additive in the q/k/v dtype
MASK = Ptr(DATA, "HAS_MASK")
PAGED = lambda c: c["PAGE_SIZE"] > 0  # the launcher passes a block table (paged K/V)

# kernel name -> {parameter: type} for every non-constexpr parameter, in the order the launcher passes them.
# fmt: off
ARGS: dict[str, dict[str, Ptr | Scalar]] = {
    "_attention_forward_kernel": {  # forward._launch
        "Q": TQ, "K": TK, "V": TKV, "Out": TQV, "Lse": F32,
        "Alibi": Ptr("fp32", "HAS_ALIBI"), "Sink": Ptr("fp32", "HAS_SINK"),
        "CuSeqlensQ": Ptr("i32", "IS_VARLEN"), "CuSeqlensK": Ptr("i32", "IS_VARLEN"), "Rng": Ptr("i64", "HAS_DROPOUT"),
        "Mask": MASK, "BlockTable": Ptr("i32", PAGED),
        "stride_qb": ST, "stride_qm": ST, "stride_qh": ST, "stride_kb": ST, "stride_kn": ST, "stride_kh": ST,
        "stride_vb": ST, "stride_vn": ST, "stride_vh": ST, "stride_ob": ST, "stride_om": ST, "stride_oh": ST,
        "stride_ab": INT, "stride_mb": MS, "stride_mh": MS, "stride_mm": MS, "stride_mn": MS,
        "stride_bt": Scalar("i32", PAGED),
        "nheads": INT, "group": INT, "seqlen_q": INT, "seqlen_k": INT, "num_blocks": Scalar("i32", PAGED),
        "left": INT, "right": INT, "qk_scale": FP, "softcap": FP, "dropout_p": Scalar("fp32", "HAS_DROPOUT"),
    },
    "_delta_kernel": {  # backward.attention_delta
        "Out": T, "DOut": T, "DLse": Ptr("fp32", "HAS_DLSE"), "Delta": F32,
        "stride_ob": ST, "stride_om": ST, "stride_oh": ST, "stride_dob": ST, "stride_dom": ST, "stride_doh": ST,
        "nheads": INT, "seqlen_q": INT,
    },
    "_attention_dkdv_kernel": {  # backward._launch
        "Q": TQ, "K": TK, "V": TKV, "DOut": TQV, "Lse": F32, "Delta": F32, "DK": TK, "DV": TKV,
        "Alibi": Ptr("fp32", "HAS_ALIBI"),
        "CuSeqlensQ": Ptr("i32", "IS_VARLEN"), "CuSeqlensK": Ptr("i32", "IS_VARLEN"), "Rng": Ptr("i64", "HAS_DROPOUT"),
        "Mask": MASK,
        "stride_qb": ST, "stride_qm": ST, "stride_qh": ST, "stride_kb": ST, "stride_kn": ST, "stride_kh": ST,
        "stride_vb": ST, "stride_vn": ST, "stride_vh": ST, "stride_dob": ST, "stride_dom": ST, "stride_doh": ST,
        "stride_dkb": ST, "stride_dkn": ST, "stride_dkh": ST, "stride_dvb": ST, "stride_dvn": ST, "stride_dvh": ST,
        "stride_ab": INT, "stride_mb": MS, "stride_mh": MS, "stride_mm": MS, "stride_mn": MS,
        "nheads": INT, "nheads_k": INT, "group": INT, "seqlen_q": INT, "seqlen_k": INT,
        "left": INT, "right": INT, "qk_scale": FP, "softcap": FP, "softmax_scale": FP,
        "dropout_p": Scalar("fp32", "HAS_DROPOUT"),
    },
    "_attention_dq_kernel": {  # backward._launch
        "Q": TQ, "K": TK, "V": TKV, "DOut": TQV, "Lse": F32, "Delta": F32, "DQ": TQ,
        "DMask": Ptr("fp32", "MASK_NEEDS_GRAD"),
        "Alibi": Ptr("fp32", "HAS_ALIBI"),
        "CuSeqlensQ": Ptr("i32", "IS_VARLEN"), "CuSeqlensK": Ptr("i32", "IS_VARLEN"), "Rng": Ptr("i64", "HAS_DROPOUT"),
        "Mask": MASK,
        "stride_qb": ST, "stride_qm": ST, "stride_qh": ST, "stride_kb": ST, "stride_kn": ST, "stride_kh": ST,
        "stride_vb": ST, "stride_vn": ST, "stride_vh": ST, "stride_dob": ST, "stride_dom": ST, "stride_doh": ST,
        "stride_dqb": ST, "stride_dqm": ST, "stride_dqh": ST,
        "stride_ab": INT, "stride_mb": MS, "stride_mh": MS, "stride_mm": MS, "stride_mn": MS,
        "nheads": INT, "group": INT, "seqlen_q": INT, "seqlen_k": INT, "left": INT, "right": INT,
        "qk_scale": FP, "softcap": FP, "softmax_scale": FP,
        "dropout_p": Scalar("fp32", "HAS_DROPOUT"),
    },
    "_split_kv_kernel": {  # split_kv.decode_attention
        "Q": T, "KCache": T, "VCache": T, "KNew": Ptr(DATA, "HAS_NEW"), "VNew": Ptr(DATA, "HAS_NEW"),
        "Out": T, "Lse": F32,
        # the splits' fp32 partials and ticket counters, when the variant splits the keys
        "OutPart": Ptr("fp32", "IS_SPLIT"), "LsePart": Ptr("fp32", "IS_SPLIT"), "Counters": Ptr("i32", "IS_SPLIT"),
        "CacheSeqlens": Ptr("i32", "HAS_SEQLENS"), "BatchIdx": Ptr("i32", "HAS_BATCH_IDX"),
        "LeftPad": Ptr("i32", "HAS_LEFTPAD"), "BlockTable": Ptr("i32", PAGED),
        "Alibi": Ptr("fp32", "HAS_ALIBI"), "Cos": Ptr(DATA, "ROTARY_DIM"), "Sin": Ptr(DATA, "ROTARY_DIM"),
        "KDesc": Ptr(DATA, "TMA", tile=("BLOCK_N", "BLOCK_D")), "VDesc": Ptr(DATA, "TMA", tile=("BLOCK_N", "BLOCK_DV")),
        "stride_qb": ST, "stride_qm": ST, "stride_qh": ST, "stride_kb": ST, "stride_kn": ST, "stride_kh": ST,
        "stride_vb": ST, "stride_vn": ST, "stride_vh": ST, "stride_knb": ST, "stride_knn": ST, "stride_knh": ST,
        "stride_vnb": ST, "stride_vnn": ST, "stride_vnh": ST, "stride_ob": ST, "stride_om": ST, "stride_oh": ST,
        "stride_lb": INT, "stride_lh": INT, "stride_ps": ST, "stride_ls": INT,
        "stride_bt": INT, "stride_ab": INT, "stride_cos": INT,
        "nheads_k": INT, "seqlen_q": INT, "seqlen_new": INT, "seqlen_cache": INT, "num_splits": INT,
        "seqlen_ro": INT, "num_slots": INT, "left": INT, "right": INT, "qk_scale": FP, "softcap": FP,
    },
}
# fmt: on

KERNELS = {
    k.fn.__name__: k
    for k in (
        forward._attention_forward_kernel,
        backward._delta_kernel,
        backward._attention_dkdv_kernel,
        backward._attention_dq_kernel,
        split_kv._split_kv_kernel,
    )
}
PASS_KERNEL = {
    "forward": "_attention_forward_kernel",
    "forward_short": "_attention_forward_kernel",
    "forward_banded_short": "_attention_forward_kernel",
    "backward_dkdv": "_attention_dkdv_kernel",
    "backward_dq": "_attention_dq_kernel",
}
# The masks a pass serves: the short passes split launches with seqlen_k <= SHORT_SEQLEN by banded or not.
PASS_MASKS = {"forward_banded_short": ("causal", "window"), "forward_short": ("full",)}
# Feature flags switched on together in a "features on" variant, where the kernel has them.
ATTENTION_FEATURES = (
    "HAS_SOFTCAP", "HAS_ALIBI", "HAS_SINK", "IS_VARLEN", "HAS_DROPOUT", "HAS_MASK", "MASK_NEEDS_GRAD",
)  # fmt: skip


@dataclass
class Variant:
    kernel: str
    config: str  # e.g. "forward D128 128x64/w8/s3"
    mask: str  # "full", "causal", "window" or "-"
    flags: str  # "off", or the features switched on
    consts: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    data: str = DATA  # element type of q/k/v (and the cache): DATA, or "fp32" for float32 inputs
    # the Gluon kernels' tensors read through head-major (rank-4) descriptors: "" (none), "q", "kv" or "qkv" (the
    # forward's out in q's form; the backward's dout in q's, dk and dv in k's)
    head_major: str = ""

    @property
    def label(self) -> str:
        label = f"{self.kernel} {self.config} {self.mask} {self.flags}"
        return label if self.data == DATA else f"{label} {self.data}"

    def key(self) -> tuple:
        return (
            self.kernel, tuple(sorted(self.consts.items())), self.num_warps, self.num_stages, self.data, self.head_major
        )  # fmt: skip


def signature(kernel_name: str, consts: dict, data: str = DATA) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource from the kernel's parameter list and ``ARGS``, with ``data``
    as the element type of the q/k/v-typed pointers."""
    fn = KERNELS[kernel_name]
    params = fn.params
    mapping = ARGS[kernel_name]
    names = [p.name for p in params]
    unmapped = [p.name for p in params if not p.is_constexpr and p.name not in mapping]
    stale = [n for n in mapping if n not in names]
    if unmapped or stale:
        raise KeyError(
            f"{kernel_name}: parameters {unmapped} are not mapped in tests/sm90_compile.py ARGS['{kernel_name}'] "
            f"and mapped names {stale} are not parameters; add each new parameter with its type (Ptr for what the "
            f"launcher passes a tensor or None for, Scalar('i32') / Scalar('fp32') otherwise) and remove stale ones"
        )
    missing = [p.name for p in params if p.is_constexpr and p.name not in consts]
    if missing:
        raise KeyError(
            f"{kernel_name}: constexprs {missing} are not set by the variant; add them in tests/sm90_compile.py"
        )
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(params):
        name = p.name
        if p.is_constexpr:
            sig[name], cx[name] = "constexpr", consts[name]
            continue
        spec = mapping[name]
        if isinstance(spec, Ptr) and spec.dtype == DATA:
            spec = Ptr(data, spec.when, spec.tile)
        when = spec.when
        passed = when is None or (when(consts) if callable(when) else bool(consts[when]))
        if not passed:  # the launcher passes None: Triton makes it a constexpr None
            sig[name], cx[name] = "constexpr", None
        elif isinstance(spec, Ptr) and spec.tile and consts.get("TMA"):
            rows, cols = (consts[c] for c in spec.tile)
            sig[name] = f"tensordesc<{spec.dtype}[1,{rows},1,{cols}]>"
        elif isinstance(spec, Ptr):
            sig[name] = "*" + spec.dtype
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        else:
            sig[name] = spec.dtype
            if spec.aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, cx, attrs


def resources(cubin: bytes) -> dict:
    """Registers, stack and local bytes per thread from cuobjdump -res-usage, and "sass": a digest of the machine
    code (cuobjdump -sass), so that two trees can be compared for identical code variant by variant."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cannot read cuobjdump -res-usage output:\n{out}")
    usage = dict(zip(("registers", "stack", "static_shared", "local"), map(int, m.groups()), strict=True))
    code = "\n".join(line for line in sass.splitlines() if line.strip().startswith("/*"))  # instructions only
    return {**usage, "sass": hashlib.sha256(code.encode()).hexdigest()[:16]}


GLUON_FORWARD = forward_sm90._attention_forward_sm90_kernel.fn.__name__
GLUON_BACKWARD = backward_sm90._attention_backward_sm90_kernel.fn.__name__


def gluon_source(kernel_name: str, consts: dict, head_major: str = ""):
    """What triton.compile takes for a Gluon kernel (a GluonASTSource: Gluon kernels need their own source
    class) with the descriptors and pointers its launcher passes: those of ``head_major``'s tensors ("q", "kv" or
    "qkv"; the forward's out in q's form, the backward's dout in q's, dk and dv in k's) rank-4 head-major
    descriptors (``sm90_common.head_major_descriptor``), the others the forward's rank-3 and the backward's 2-D
    ones."""
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = {**OPTIONS_OFF, **consts}
    head_dim = consts["HEAD_D"]

    def descriptor(*block: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """A descriptor with this block: [rows, head_dim] (2-D rows view), [1, rows, head_dim] (rank 3) or [1, 1,
        rows, head_dim] (rank 4, head-major) of the q/k/v dtype, or of float32 (the backward's dq_accum)."""
        layout = sm90_common.shared_layout(block, dtype)
        element = "fp32" if dtype == torch.float32 else DATA
        return f"tensordesc<{element}[{','.join(map(str, block))}],{layout!r}>"

    if kernel_name == GLUON_FORWARD:
        kernel, rows_q, rows_k = forward_sm90._attention_forward_sm90_kernel, consts["M_WG"], consts["BLOCK_N"]
        q_box = (1, 1, rows_q, head_dim) if head_major == "qkv" else (1, rows_q, head_dim)
        kv_box = (1, 1, rows_k, head_dim) if head_major else (1, rows_k, head_dim)
        sig = {"q_desc": descriptor(*q_box), "k_desc": descriptor(*kv_box), "v_desc": descriptor(*kv_box),
               "o_desc": descriptor(*q_box),
               "lse_ptr": "*fp32", "qk_scale": "fp32", "seqlen_q": "i32", "seqlen_k": "i32", "batch": "i32",
               "nheads": "i32", "group": "i32", "window_left": "i32", "window_right": "i32", "softcap": "fp32",
               "alibi_stride_b": "i32"}  # fmt: skip
        if consts["CAUSAL"] and consts["CAUSAL_SCHEDULE"]:  # the launcher's causal_schedule
            sig["schedule"] = "*i32"
        else:  # the launcher passes None: a constexpr
            consts = dict(consts, schedule=None)
    else:
        kernel, rows_q, rows_k = backward_sm90._attention_backward_sm90_kernel, consts["BLOCK_M"], consts["BLOCK_N"]
        rows_out = rows_k if consts["OUTPUT_SPLIT"] else rows_k // 2  # dK / dV rows per warpgroup
        q_lead = (1, 1) if "q" in head_major else ()  # a head-major descriptor's [1, 1, rows, D] boxes
        kv_lead = (1, 1) if "kv" in head_major else ()
        sig = {"q_desc": descriptor(*q_lead, rows_q, head_dim), "do_desc": descriptor(*q_lead, rows_q, head_dim),
               "k_desc": descriptor(*kv_lead, rows_k, head_dim), "v_desc": descriptor(*kv_lead, rows_k, head_dim),
               "dk_desc": descriptor(*kv_lead, rows_out, head_dim),
               "dv_desc": descriptor(*kv_lead, rows_out, head_dim),
               "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_ptr": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32",
               "seqlen_q": "i32", "seqlen_k": "i32", "nheads": "i32", "group": "i32", "window_left": "i32",
               "window_right": "i32", "softcap": "fp32", "alibi_stride_b": "i32"}  # fmt: skip
        if consts["DQ_TMA"]:  # dq_accum's descriptor, fp32 blocks of a staging tile's shape
            rows_dq = backward_sm90.dq_rows(rows_q, consts["DQ_SPLIT"])  # one warpgroup's dQ partial
            block = backward_sm90.dq_staging_block(rows_dq, consts["DQ_PERMUTED"])
            sig["dq_desc"] = descriptor(*block, dtype=torch.float32)
        else:  # the launcher passes None: a constexpr
            consts = dict(consts, dq_desc=None)
    if consts["ALIBI"]:  # the slopes, fp32
        sig["alibi_ptr"] = "*fp32"
    else:  # the launcher passes None: a constexpr
        consts = dict(consts, alibi_ptr=None)
    sig.update(dict.fromkeys(consts, "constexpr"))
    pointers = [name for name, kind in sig.items() if kind in ("*fp32", "*i32")]  # torch allocations: 16-byte aligned
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    return GluonASTSource(kernel, sig, consts, attrs)


OPTIONS_OFF = {"LOCAL": False, "SOFTCAP": False, "ALIBI": False}
"""The Gluon kernels' option constexprs, off unless a variant sets them."""


def gluon_variants() -> list[Variant]:
    variants = []
    d64_causal = forward_sm90.config(64, causal=True, seqlen_q=2048)  # 128-row items (CAUSAL_CHANGES)
    for head_dim, cfg in [*forward_sm90.CONFIGS.items(), (64, d64_causal)]:
        name = f"forward_sm90 D{head_dim} {cfg['NUM_WG'] * cfg['M_WG']}x{cfg['BLOCK_N']}/s{cfg['STAGES']}"
        for mask in ("full", "causal"):
            for flags, even_k in (("off", True), ("ragged-k", False)):
                consts = dict(cfg, HEAD_D=head_dim, CAUSAL=mask == "causal", EVEN_K=even_k)
                variants.append(Variant(GLUON_FORWARD, name, mask, flags, consts))
        # a sliding window (CAUSAL off, LOCAL on; the head dims that take windows, sm90_common.WINDOW_HEAD_DIMS), with
        # a ragged last key tile or not, and head-major
        windows = head_dim in sm90_common.WINDOW_HEAD_DIMS["forward"]
        for flags, even_k, head_major in (("off", True, ""), ("ragged-k", False, ""), ("head-major", True, "qkv")):
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=False, EVEN_K=even_k, LOCAL=True)
            variants += [Variant(GLUON_FORWARD, name, "window", flags, consts, head_major=head_major)] * windows
        # score modifications: softcap, ALiBi, both (with a ragged last key tile: the bounds check too)
        for mask, flags, mods in (
            ("causal", "softcap", dict(SOFTCAP=True)), ("causal", "alibi", dict(ALIBI=True)),
            ("full", "alibi,ragged-k", dict(ALIBI=True)), ("full", "softcap,alibi", dict(SOFTCAP=True, ALIBI=True)),
            *[("window", "softcap", dict(SOFTCAP=True))] * windows,
        ):  # fmt: skip
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=mask == "causal", EVEN_K="ragged-k" not in flags,
                          LOCAL=mask == "window", **mods)  # fmt: skip
            variants.append(Variant(GLUON_FORWARD, name, mask, flags, consts))
        # the other setting of CAUSAL_PAIRS (causal query tiles walked in pairs, ``_paired_item``)
        pairs_only = dict(cfg, HEAD_D=head_dim, CAUSAL=True, EVEN_K=True, CAUSAL_SCHEDULE=False)  # lists win in _walk
        flipped = dict(pairs_only, CAUSAL_PAIRS=not cfg["CAUSAL_PAIRS"])
        variants.append(Variant(GLUON_FORWARD, name, "causal", "unpaired" if cfg["CAUSAL_PAIRS"] else "pairs", flipped))
        # causal pairs with the other setting of CAUSAL_PERSISTENT (a persistent walk over pair slots or not)
        walk = dict(pairs_only, CAUSAL_PAIRS=True)
        persistent = cfg["CAUSAL_PAIRS"] and cfg["CAUSAL_PERSISTENT"]
        walk["CAUSAL_PERSISTENT"] = not persistent
        variants.append(Variant(GLUON_FORWARD, name, "causal", "pairs" if persistent else "persistent", walk))
        # the other setting of CAUSAL_SCHEDULE (a persistent walk over a host-made list of items, ``causal_schedule``)
        listed = dict(cfg, HEAD_D=head_dim, CAUSAL=True, EVEN_K=True, CAUSAL_SCHEDULE=not cfg["CAUSAL_SCHEDULE"])
        variants.append(
            Variant(GLUON_FORWARD, name, "causal", "pair-slots" if cfg["CAUSAL_SCHEDULE"] else "listed", listed)
        )
        # torch's (B, H, N, D) layout: q, k, v (and out) through head-major descriptors, and k, v alone (a cache's);
        # each row names the rank-3 variant it compares with (``head_major_twin``)
        for mask, flags, even_k, head_major in (
            ("full", "head-major", True, "qkv"), ("causal", "head-major", True, "qkv"),
            ("full", "head-major,ragged-k", False, "qkv"), ("causal", "head-major-kv", True, "kv"),
        ):  # fmt: skip
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=mask == "causal", EVEN_K=even_k)
            variants.append(Variant(GLUON_FORWARD, name, mask, flags, consts, head_major=head_major))
    for head_dim, cfg in backward_sm90.CONFIGS.items():
        stages = f"s{cfg['STAGES']}" + (f"/do{cfg['DO_STAGES']}" if cfg["DO_STAGES"] != cfg["STAGES"] else "")
        name = f"backward_sm90 D{head_dim} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}/{stages}"
        for mask, (flags, grouped) in itertools.product(("full", "causal"), (("off", False), ("gqa", True))):
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=mask == "causal", GROUPED=grouped)
            variants.append(Variant(GLUON_BACKWARD, name, mask, flags, consts))
        # a sliding window (CAUSAL off, LOCAL on; sm90_common.WINDOW_HEAD_DIMS), MHA and GQA, and head-major
        windows = head_dim in sm90_common.WINDOW_HEAD_DIMS["backward"]
        for flags, grouped, head_major in (("off", False, ""), ("gqa", True, ""), ("head-major", False, "qkv")):
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=False, GROUPED=grouped, LOCAL=True)
            variants += [Variant(GLUON_BACKWARD, name, "window", flags, consts, head_major=head_major)] * windows
        # score modifications: ALiBi at every head dim (MHA and GQA), softcap where S^T starts at zero
        # (``backward_sm90.stats_in_acc`` off: ``backward_sm90.qualifies``), both
        mods = [("causal", "alibi", False, dict(ALIBI=True)), ("full", "alibi,gqa", True, dict(ALIBI=True))]
        if not backward_sm90.stats_in_acc(cfg["BLOCK_M"]):
            mods += [("causal", "softcap", False, dict(SOFTCAP=True)), ("window", "softcap", False, dict(SOFTCAP=True)),
                     ("causal", "softcap,alibi,gqa", True, dict(SOFTCAP=True, ALIBI=True))]  # fmt: skip
        for mask, flags, grouped, on in mods:
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=mask == "causal", GROUPED=grouped, LOCAL=mask == "window", **on)
            variants.append(Variant(GLUON_BACKWARD, name, mask, flags, consts))
        # the other setting of KEY_PAIRS (causal key tiles walked in pairs, ``backward_sm90.programs``)
        paired = "unpaired" if cfg["KEY_PAIRS"] else "pairs"
        for flags, grouped in ((paired, False), (f"{paired},gqa", True)):
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=True, GROUPED=grouped, KEY_PAIRS=not cfg["KEY_PAIRS"])
            variants.append(Variant(GLUON_BACKWARD, name, "causal", flags, consts))
        # the other setting of DQ_PERMUTED (the dQ staging tile's row order, ``backward_sm90.dq_staging_block``)
        consts = dict(cfg, HEAD_D=head_dim, CAUSAL=False, GROUPED=False, DQ_PERMUTED=not cfg["DQ_PERMUTED"])
        flags = "plain-dq" if cfg["DQ_PERMUTED"] else "permuted-dq"
        variants.append(Variant(GLUON_BACKWARD, name, "full", flags, consts))
        # torch's (B, H, N, D) layout: q, dout, k, v (and dk, dv) through head-major descriptors, k and v alone (a
        # cache's), and q and dout alone; dq_accum keeps its rows views
        for mask, flags, grouped, head_major in (
            ("full", "head-major", False, "qkv"), ("causal", "head-major", False, "qkv"),
            ("causal", "head-major,gqa", True, "qkv"), ("causal", "head-major-kv", False, "kv"),
            ("full", "head-major-q,gqa", True, "q"),
        ):  # fmt: skip
            consts = dict(cfg, HEAD_D=head_dim, CAUSAL=mask == "causal", GROUPED=grouped)
            variants.append(Variant(GLUON_BACKWARD, name, mask, flags, consts, head_major=head_major))
    return variants


def head_major_twin(v: Variant) -> str | None:
    """The label of the variant with rows views' descriptors (the forward's rank-3, the backward's 2-D) that a
    head-major Gluon variant compiles the same config, mask, key tiles and grouping as ("... causal head-major" ->
    "... causal off"), None for other variants: its row's "twin", whose stack tests/test_sm90_compile.py compares."""
    if not v.head_major:
        return None
    kept = [f for f in v.flags.split(",") if f not in ("head-major", "head-major-kv", "head-major-q")]
    return Variant(v.kernel, v.config, v.mask, ",".join(kept) or "off").label


def compile_variant(v: Variant) -> dict:
    """Compile one variant; the row for the table, with "error" set when it failed."""
    row = {"kernel": v.kernel, "config": v.config, "mask": v.mask, "flags": v.flags, "label": v.label}
    if v.head_major:
        row["twin"] = head_major_twin(v)
    start = time.perf_counter()
    try:
        if v.kernel in (GLUON_FORWARD, GLUON_BACKWARD):
            source = gluon_source(v.kernel, v.consts, v.head_major)
        else:
            source = ASTSource(KERNELS[v.kernel], *signature(v.kernel, v.consts, v.data))
        compiled = triton.compile(
            source,
            target=TARGET,
            options={"num_warps": v.num_warps, "num_stages": v.num_stages},
        )
        shared = compiled.metadata.shared
        if shared > MAX_SHARED:
            raise OutOfResources(shared, MAX_SHARED, "shared memory")
        row.update(resources(compiled.asm["cubin"]), shared=shared)
    except Exception as e:  # noqa: BLE001 - every failure is reported, named by its variant
        row["error"] = f"{type(e).__name__}: {str(e).strip()[-2000:]}"
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def cfg_name(pass_name: str, head_dim: int, cfg) -> str:
    """E.g. "forward D128 128x64/w8/s4/tma" (/tma: the config loads through tensor descriptors, except in a
    variable-length variant)."""
    tma = "/tma" if cfg.tma else ""
    return f"{pass_name} D{head_dim} {cfg.block_m}x{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}{tma}"


def attention_variants() -> list[Variant]:
    variants = []
    assert set(_HOPPER) == set(ALL_PASSES), f"Hopper table passes {sorted(_HOPPER)} != {ALL_PASSES}"
    for pass_name in PASSES:
        kname = PASS_KERNEL[pass_name]
        constexprs = {p.name for p in KERNELS[kname].params if p.is_constexpr}
        masks = PASS_MASKS.get(pass_name, ("full", "causal"))
        for head_dim, cfg in _HOPPER[pass_name]:
            for mask in masks:
                base = {
                    "HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "BLOCK_D": head_dim, "BLOCK_DV": head_dim,
                    "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                    "MASK_LEFT": mask == "window", "MASK_RIGHT": mask != "full", "HEAVY_FIRST": mask != "full",
                    "MASK_IS_BOOL": False,  # an additive attn_mask when HAS_MASK is on
                    "PAGE_SIZE": 0,
                }  # fmt: skip
                features = [f for f in ATTENTION_FEATURES if f in constexprs]
                # Features off, every feature on, and with TMA also every feature but varlen (which reads
                # through pointers: the launchers never combine IS_VARLEN with TMA).
                feature_sets = [(), features]
                if cfg.tma and "TMA" in constexprs:
                    feature_sets.append([f for f in features if f != "IS_VARLEN"])
                if "PAGE_SIZE" in constexprs and mask == masks[0]:  # every feature on with paged K/V (pages
                    feature_sets.append([*features, "IS_PAGED"])  # of 256), once per config: loads, not masks
                for on_set in feature_sets:
                    consts = {k: val for k, val in base.items() if k in constexprs}
                    consts.update({f: f in on_set for f in features})
                    if "IS_PAGED" in on_set:
                        consts["PAGE_SIZE"] = 256
                    if "TMA" in constexprs:
                        consts["TMA"] = cfg.tma and not consts.get("IS_VARLEN")
                    flags = ",".join(f.split("_", 1)[1].lower() for f in on_set) or "off"
                    launch = with_mask(cfg, head_dim) if consts.get("HAS_MASK") else cfg  # as the launchers do
                    variants.append(
                        Variant(kname, cfg_name(pass_name, head_dim, launch), mask, flags, consts, launch.num_warps,
                                launch.num_stages)
                    )  # fmt: skip
    # Float32 inputs: ``configs.FLOAT32`` for every pass, pointer loads, features off and every feature on.
    for pass_name in PASSES:
        kname = PASS_KERNEL[pass_name]
        constexprs = {p.name for p in KERNELS[kname].params if p.is_constexpr}
        features = [f for f in ATTENTION_FEATURES if f in constexprs]
        for head_dim, cfg in ((64, FLOAT32), (128, FLOAT32), (256, FLOAT32)):
            for mask in PASS_MASKS.get(pass_name, ("full", "causal")):
                for on_set in ((), features):
                    consts = {
                        "HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "BLOCK_D": head_dim, "BLOCK_DV": head_dim,
                        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "MASK_LEFT": mask == "window",
                        "MASK_RIGHT": mask != "full", "HEAVY_FIRST": mask != "full", "MASK_IS_BOOL": False,
                        "PAGE_SIZE": 0, "TMA": False,
                    }  # fmt: skip
                    consts = {k: val for k, val in consts.items() if k in constexprs}
                    consts.update({f: f in on_set for f in features})
                    flags = ",".join(f.split("_", 1)[1].lower() for f in on_set) or "off"
                    launch = with_mask(cfg, head_dim) if consts.get("HAS_MASK") else cfg
                    variants.append(
                        Variant(kname, cfg_name(pass_name, head_dim, launch), mask, flags, consts, launch.num_warps,
                                launch.num_stages, data="fp32")
                    )  # fmt: skip
    # The delta kernel of the backward: 64 rows, Triton's default warps and stages, per value head dim.
    for head_dim in sorted({d for name in PASSES for d, _ in _HOPPER[name]}):
        for on in (False, True):
            consts = {"HEAD_DIM_V": head_dim, "BLOCK_DV": head_dim, "BLOCK_M": 64, "HAS_DLSE": on}
            variants.append(Variant("_delta_kernel", f"delta D{head_dim} 64/w4/s3", "-", "dlse" if on else "off",
                                    consts, **TRITON_DEFAULTS))  # fmt: skip
    return variants


def decode_variants() -> list[Variant]:
    variants = []
    head_dims = (64, 128, 256)  # the buckets of decode.configs.config: <= 128 and > 128 (64 adds a smaller tile)
    block_ms = sorted({decode_configs.block_m(rows) for rows in (1, 32, 10**6)})  # 16 .. MAX_BLOCK_M
    for head_dim in head_dims:
        cfg = decode_configs.config(_CUDA, head_dim)
        dims = {"HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "BLOCK_D": head_dim, "BLOCK_DV": head_dim}
        # GROUP 4: bench_decode's 32 query heads over 8 kv heads
        off = {"GROUP": 4, "PAGE_SIZE": 0, "INT64_OFFSETS": False, "HAS_SEQLENS": False, "HAS_BATCH_IDX": False,
               "HAS_LEFTPAD": False, "MASK_LEFT": False, "MASK_RIGHT": False, "HAS_SOFTCAP": False, "HAS_ALIBI": False,
               "ROTARY_DIM": 0, "ROTARY_INTERLEAVED": False, "ROTARY_PER_TOKEN": False, "HAS_NEW": False,
               "IS_SPLIT": False, "NEW_SPLIT": False, "APPEND_FIRST": False, "LATE_APPEND": False, "TMA": False,
               "CHUNK": 1, "ROW_STRIDE_K": 0, "ROW_STRIDE_V": 0}  # fmt: skip
        # everything on that a launch can combine (cache_batch_idx excludes a paged cache), writing fp32 splits
        paged = dict(off, PAGE_SIZE=256, HAS_SEQLENS=True, HAS_LEFTPAD=True, MASK_LEFT=True, MASK_RIGHT=True,
                     HAS_SOFTCAP=True, HAS_ALIBI=True, ROTARY_DIM=head_dim, ROTARY_INTERLEAVED=True,
                     ROTARY_PER_TOKEN=True, HAS_NEW=True, IS_SPLIT=True, NEW_SPLIT=True, CHUNK=0)  # fmt: skip
        batch_idx = dict(off, HAS_SEQLENS=True, HAS_BATCH_IDX=True, MASK_RIGHT=True, ROTARY_DIM=head_dim // 2,
                         HAS_NEW=True)  # fmt: skip
        # a bench_decode.py step: one new token, appended first, split; and its paged cache read through tensor
        # descriptors
        step = dict(off, HAS_SEQLENS=True, MASK_RIGHT=True, HAS_NEW=True, IS_SPLIT=True, APPEND_FIRST=True, CHUNK=0)
        tma = dict(step, PAGE_SIZE=256, TMA=True)
        # the step at one split, which appends its new token in the loop's first iteration (``append_late``)
        late = dict(step, IS_SPLIT=False, LATE_APPEND=True, CHUNK=1)
        # the few-programs configs (contiguous caches only, head dims <= 128)
        fews = (decode_configs.CUDA_FEW_PROGRAMS, decode_configs.CUDA_FEW_PROGRAMS_LONG) if head_dim <= 128 else ()
        for bm in block_ms:
            name = f"split_kv D{head_dim} {bm}x{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"
            for flags, consts in (("off", off), ("paged,seqlens,leftpad,window,softcap,alibi,rotary,new,split", paged),
                                  ("seqlens,batch_idx,causal,rotary_half,new", batch_idx),
                                  ("seqlens,causal,new-first,split", step), ("seqlens,causal,new-late", late),
                                  ("paged,seqlens,causal,new-first,split,tma", tma)):  # fmt: skip
                variants.append(Variant("_split_kv_kernel", name, "-", flags,
                                        dict(dims, BLOCK_M=bm, BLOCK_N=cfg.block_n, **widest_merge(consts, bm)),
                                        cfg.num_warps, cfg.num_stages))  # fmt: skip
            fp32 = decode_configs.config(_CUDA, head_dim, element_size=4)
            name = f"split_kv D{head_dim} {bm}x{fp32.block_n}/w{fp32.num_warps}/s{fp32.num_stages}"
            for flags, consts in (("off", off), ("paged,seqlens,leftpad,window,softcap,alibi,rotary,new,split", paged)):
                variants.append(Variant("_split_kv_kernel", name, "-", flags,
                                        dict(dims, BLOCK_M=bm, BLOCK_N=fp32.block_n, **widest_merge(consts, bm)),
                                        fp32.num_warps, fp32.num_stages, data="fp32"))  # fmt: skip
            for few in fews:
                name = f"split_kv D{head_dim} {bm}x{few.block_n}/w{few.num_warps}/s{few.num_stages}"
                row_stride = 8 * head_dim if few.fixed_row_strides else 0  # 8 kv heads, compiled in or not
                for flags, consts in (
                    ("off", off),
                    ("seqlens,causal,new-first,split", step),
                    ("seqlens,causal,new-late", late),
                ):
                    consts = dict(consts, ROW_STRIDE_K=row_stride, ROW_STRIDE_V=row_stride)
                    variants.append(Variant("_split_kv_kernel", name, "-", flags,
                                            dict(dims, BLOCK_M=bm, BLOCK_N=few.block_n, **widest_merge(consts, bm)),
                                            few.num_warps, few.num_stages))  # fmt: skip
    return variants


def widest_merge(consts: dict, block_m: int) -> dict:
    """``consts`` with a split variant's CHUNK (0 there) set to the widest merge step ``split_kv.merge_chunk`` gives
    ``block_m`` rows: the most registers the merge can take."""
    if consts["CHUNK"]:
        return consts
    return dict(consts, CHUNK=split_kv.merge_chunk(block_m, split_kv.configs.MAX_SPLITS))


class _CudaDevice:
    """Stands in for a CUDA torch.device in decode.configs.config, which only reads ``type``."""

    type = "cuda"


_CUDA = _CudaDevice()


def all_variants() -> list[Variant]:
    """Every variant, each distinct compile once (the first label that asks for it)."""
    seen, out = set(), []
    for v in attention_variants() + decode_variants() + gluon_variants():
        if v.key() not in seen:
            seen.add(v.key())
            out.append(v)
    return out


def sample_variants() -> list[Variant]:
    """One variant per kernel, config and element type: the one with the most features on (the most code), ahead
    of the rest. What CI compiles under a Triton other than the one the stack sizes were recorded with: every config
    still meets the compiler, at about a third of the full set's compile time."""
    widest: dict[tuple, Variant] = {}
    for v in all_variants():
        slot = (v.kernel, v.config, v.data)
        features = 0 if v.flags == "off" else len(v.flags.split(","))
        if slot not in widest or features > (0 if widest[slot].flags == "off" else len(widest[slot].flags.split(","))):
            widest[slot] = v
    return list(widest.values())


def run(jobs: int | None = None, sample: bool = False) -> list[dict]:
    variants = sample_variants() if sample else all_variants()
    jobs = jobs or os.cpu_count() or 1
    # Heaviest first, so the long compiles do not end up last on one worker.
    order = sorted(range(len(variants)), key=lambda i: -variants[i].consts.get("HEAD_DIM", 0))
    with ProcessPoolExecutor(jobs) as pool:
        rows = dict(zip(order, pool.map(compile_variant, [variants[i] for i in order]), strict=True))
    return [rows[i] for i in range(len(variants))]


def table(rows: list[dict]) -> str:
    head = (
        f"{'kernel':26s} {'config':34s} {'mask':6s} {'flags':56s} {'regs':>4s} {'stack':>5s} {'shared':>6s} {'s':>5s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            res = f"{'FAILED':>18s}"
        else:
            res = f"{r['registers']:4d} {r['stack']:5d} {r['shared']:6d}"
        lines.append(f"{r['kernel']:26s} {r['config']:34s} {r['mask']:6s} {r['flags']:56s} {res} {r['seconds']:5.1f}")
    for r in rows:
        if "error" in r:
            lines.append(f"\nFAILED {r['label']}:\n{r['error']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    parser.add_argument("--sample", action="store_true", help="one variant per kernel config (``sample_variants``)")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = run(args.jobs, sample=args.sample)
    print(table(rows))
    failed = sum("error" in r for r in rows)
    print(f"\n{len(rows)} variants, {failed} failed, {time.perf_counter() - start:.1f} s (triton {triton.__version__})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
