"""Every shipped kernel config compiles for sm_90 (the H200) and fits, checked on a machine without a GPU.

tests/sm90_compile.py does the work (see its docstring); it runs in a subprocess without TRITON_INTERPRET,
which conftest sets and under which a @triton.jit kernel cannot be compiled for a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from conftest import made_once

SCRIPT = Path(__file__).with_name("sm90_compile.py")

STACK_TRITON = (3, 7)
"""The Triton whose compiles EXPECTED_STACK records (3.7.1). Other versions allocate registers otherwise (of these 62
variants, triton 3.6.0 gives 10 larger stacks and 3.9.0 gives 20), so under them the sizes are not compared; every
shipped config must compile and fit under any version."""
OTHER_TRITON = tuple(int(part) for part in triton.__version__.split(".")[:2]) != STACK_TRITON

# Stack bytes per thread of every variant with its features off, as of STACK_TRITON (cuobjdump -res-usage).
# A larger stack than recorded here means a register-pressure regression (spills) to look at before
# raising the number; equal or smaller passes (lower it when a change shrinks it). A new variant needs
# its entry: run ``python tests/sm90_compile.py`` and copy the stack column.
EXPECTED_STACK = {
    "_attention_forward_kernel forward D64 128x64/w8/s4/tma full off": 0,
    "_attention_forward_kernel forward D64 128x64/w8/s4/tma causal off": 0,
    "_attention_forward_kernel forward D128 128x128/w8/s3/tma full off": 0,
    "_attention_forward_kernel forward D128 128x128/w8/s3/tma causal off": 0,
    "_attention_forward_kernel forward D256 64x64/w4/s3 full off": 136,
    "_attention_forward_kernel forward D256 64x64/w4/s3 causal off": 136,
    "_attention_forward_kernel forward_short D128 128x64/w8/s3 full off": 0,
    "_attention_forward_kernel forward_banded_short D64 64x64/w4/s3/tma causal off": 0,
    "_attention_forward_kernel forward_banded_short D64 64x64/w4/s3/tma window off": 0,
    "_attention_forward_kernel forward_banded_short D128 64x64/w4/s3 causal off": 0,
    "_attention_forward_kernel forward_banded_short D128 64x64/w4/s3 window off": 8,
    "_attention_forward_kernel forward_banded_short D256 64x64/w4/s3 window off": 128,  # 112 before the 3-D grid
    "_attention_dkdv_kernel backward_dkdv D64 32x64/w4/s4/tma full off": 0,
    "_attention_dkdv_kernel backward_dkdv D64 32x64/w4/s4/tma causal off": 0,
    "_attention_dkdv_kernel backward_dkdv D128 64x128/w8/s3 full off": 88,
    "_attention_dkdv_kernel backward_dkdv D128 64x128/w8/s3 causal off": 416,
    "_attention_dkdv_kernel backward_dkdv D256 64x64/w8/s1 full off": 616,
    "_attention_dkdv_kernel backward_dkdv D256 64x64/w8/s1 causal off": 672,
    "_attention_dq_kernel backward_dq D64 64x64/w4/s4/tma full off": 0,
    "_attention_dq_kernel backward_dq D64 64x64/w4/s4/tma causal off": 0,
    "_attention_dq_kernel backward_dq D128 64x64/w4/s3/tma full off": 0,
    "_attention_dq_kernel backward_dq D128 64x64/w4/s3/tma causal off": 0,
    "_attention_dq_kernel backward_dq D256 128x32/w8/s3 full off": 0,
    "_attention_dq_kernel backward_dq D256 128x32/w8/s3 causal off": 0,
    "_delta_kernel delta D64 64/w4/s3 - off": 0,
    "_delta_kernel delta D128 64/w4/s3 - off": 0,
    "_delta_kernel delta D256 64/w4/s3 - off": 0,
    # 16-row tiles: 0 before the column sums by key column (efde7ca, 2026-12-03); now values kept across the
    # loops, stored before them and loaded after (not in a loop)
    "_split_kv_kernel split_kv D64 16x128/w4/s2 - off": 16,
    "_split_kv_kernel split_kv D64 32x128/w4/s2 - off": 0,
    "_split_kv_kernel split_kv D64 64x128/w4/s2 - off": 0,
    "_split_kv_kernel split_kv D128 16x128/w4/s2 - off": 8,  # as D64 16x128
    "_split_kv_kernel split_kv D128 32x128/w4/s2 - off": 0,
    # 96 before the decode loop's instruction trim (2026-12-02)
    "_split_kv_kernel split_kv D128 64x128/w4/s2 - off": 72,
    "_split_kv_kernel split_kv D256 16x64/w8/s2 - off": 0,
    "_split_kv_kernel split_kv D256 32x64/w8/s2 - off": 0,
    "_split_kv_kernel split_kv D256 64x64/w8/s2 - off": 0,
    # the few-programs config, (64, 4, 3) since 2026-12-02 ((128, 8, 3) before: 0, 0, 0, 0, 0, 16)
    "_split_kv_kernel split_kv D64 16x64/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D64 32x64/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D64 64x64/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D128 16x64/w4/s3 - off": 8,  # as D64 16x128
    "_split_kv_kernel split_kv D128 32x64/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D128 64x64/w4/s3 - off": 0,
    # its long-split form, (128, 4, 3) since 0ca7b51 ((64, 4, 4) before)
    "_split_kv_kernel split_kv D64 16x128/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D64 32x128/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D64 64x128/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D128 16x128/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D128 32x128/w4/s3 - off": 0,
    "_split_kv_kernel split_kv D128 64x128/w4/s3 - off": 56,  # stored before the loops, loaded after (as 16-row tiles)
    # D=64: three consumer warpgroups (192-row items, 160 registers). Causal (shipped from seqlen_q 8k; shorter
    # causal launches take two, forward_sm90.CAUSAL_CHANGES): 0 since the first key tile runs in the loop (FOLD in
    # ``_consumer``; 40 before, nine registers stored and reloaded around the separate first tile's mask). With two
    # warpgroups (128x128) 0 / 0.
    "_attention_forward_sm90_kernel forward_sm90 D64 192x128/s3 full off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D64 192x128/s3 causal off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D64 128x128/s3 full off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D64 128x128/s3 causal off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D128 128x128/s2 full off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D128 128x128/s2 causal off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D256 128x64/s2 full off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D256 128x64/s2 causal off": 0,
    # a sliding window (LOCAL: each item's key tiles from the window, both edges masked where a tile crosses them)
    "_attention_forward_sm90_kernel forward_sm90 D128 128x128/s2 window off": 0,
    "_attention_forward_sm90_kernel forward_sm90 D256 128x64/s2 window off": 0,
    # 16 / 24 with the dQ atomics (DQ_TMA off). DQ_TMA's staging-tile stores keep 4 per-thread swizzled offsets
    # (which the dK/dV epilogue uses too) live through the loop; per iteration of the query-tile loop, local
    # loads + stores of the two consumer warpgroups: full 0+0 and 5+1 (2+0 and 1+0 with atomics), causal 2+2 and
    # 3+3 (1+1 and 1+1), reloads of loop invariants (L1 hits)
    "_attention_backward_sm90_kernel backward_sm90 D128 64x128/s3 full off": 32,
    # causal with KEY_PAIRS (MHA, GROUPED off): 32 (16 before DQ_PERMUTED, whose rank-4 reduce coordinates add
    # live values: static LDL/STL 9/9 -> 17/14, with no loss measured at causal N=4k/16k; 32 on Triton 3.6 too),
    # 40 without the pairs
    "_attention_backward_sm90_kernel backward_sm90 D128 64x128/s3 causal off": 32,
    # 128-row query tiles, two stages (BLOCK_M=64,STAGES=3,DO_STAGES=3, main's config before: 0 / 0). Causal: one
    # register spilled around the diagonal tiles' mask (1 local store + 1 load per such tile and warpgroup; none
    # on the other tiles), the rest before or after the loop; GQA causal: 16 with KEY_PAIRS (24 on Triton 3.6), 48
    # without, also a few per iteration in the producer warp (24 registers: its 8 scalar lse/delta loads). Causal
    # 32 with DQ_PERMUTED (24 before; static LDL/STL 11/10 -> 13/12; causal N=4k backward 405 against 400 without)
    "_attention_backward_sm90_kernel backward_sm90 D64 128x128/s2 full off": 0,
    "_attention_backward_sm90_kernel backward_sm90 D64 128x128/s2 causal off": 32,
    # DQ_TMA with one dO stage (/do1); 0 / 0 (8 causal GQA) with two and the atomics (DQ_TMA=0,DO_STAGES=2)
    "_attention_backward_sm90_kernel backward_sm90 D256 64x64/s2/do1 full off": 0,
    "_attention_backward_sm90_kernel backward_sm90 D256 64x64/s2/do1 causal off": 0,
    # a sliding window (LOCAL, no key-tile pairs): the left edge's mask beside the right's, as causal without pairs
    # at D=128 (40); at D=64 48 (causal with pairs 32), on Triton 3.6 too
    "_attention_backward_sm90_kernel backward_sm90 D64 128x128/s2 window off": 48,
    "_attention_backward_sm90_kernel backward_sm90 D128 64x128/s3 window off": 40,
    "_attention_backward_sm90_kernel backward_sm90 D256 64x64/s2/do1 window off": 0,
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Every variant's compile result (tests/sm90_compile.py's rows), compiled once per test run."""

    def compile_all(folder: Path) -> None:
        out = folder / "rows.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # Compiling every variant from an empty cache takes about 9 minutes with triton 3.7.1 and 11 with 3.9.0 on a
        # busy two-core machine (two processes): the limit only stops a compile that hangs.
        # Under another Triton (CI's newest) the stack sizes are not compared: one variant per config is compiled
        # (``sample_variants``), so that every config still meets that compiler.
        sample = ["--sample"] if OTHER_TRITON else []
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--json", str(out), *sample], env=env, capture_output=True, text=True,
            timeout=1200,
        )  # fmt: skip
        if not out.exists():
            output = f"{proc.stdout}\n{proc.stderr}"
            pytest.fail(f"tests/sm90_compile.py wrote no results (exit {proc.returncode}):\n{output}")

    return json.loads((made_once(tmp_path_factory, "sm90", compile_all) / "rows.json").read_text())


def test_every_shipped_config_compiles_for_sm90(rows):
    failed = [f"{r['label']}:\n  {r['error']}" for r in rows if "error" in r]
    assert not failed, f"{len(failed)} of {len(rows)} kernel variants failed for sm_90:\n" + "\n".join(failed)


@pytest.mark.skipif(OTHER_TRITON, reason=f"stack sizes are recorded as triton 3.7 compiles, not {triton.__version__}")
def test_stack_frames_do_not_grow(rows):
    # float32 variants ("... fp32") spill by design (configs.FLOAT32): they are checked to compile and fit only
    off = {r["label"]: r for r in rows if r["flags"] == "off" and "error" not in r and not r["label"].endswith(" fp32")}
    unrecorded = sorted(set(off) - set(EXPECTED_STACK))
    assert not unrecorded, f"no recorded stack size for {unrecorded}: add them to EXPECTED_STACK"
    grown = [
        f"{label}: stack {r['stack']} B > {EXPECTED_STACK[label]} B recorded (registers {r['registers']})"
        for label, r in off.items()
        if r["stack"] > EXPECTED_STACK[label]
    ]
    assert not grown, "stack frames grew (register spills?):\n" + "\n".join(grown)


HEAD_MAJOR_STACK_GROWTH = {
    "_attention_backward_sm90_kernel backward_sm90 D128 64x128/s3 causal head-major": 8,
    "_attention_backward_sm90_kernel backward_sm90 D128 64x128/s3 causal head-major-kv": 8,
    "_attention_backward_sm90_kernel backward_sm90 D64 128x128/s2 causal head-major,gqa": 8,
}
"""Head-major variants whose stack exceeds their twin's, by how many bytes (STACK_TRITON). The Gluon backward's causal
walks (KEY_PAIRS): head-major rows start at 0 in each head, so the dK/dV store's row equals the causal mask's first
key, one value that the first consumer warpgroup now keeps across the work item's loop; in the SASS 2-4 more local
loads and 1-3 more stores per work item, before and after its query-tile loop, whose own local loads and stores are
the twin's."""


@pytest.mark.skipif(OTHER_TRITON, reason=f"stack sizes are recorded as triton 3.7 compiles, not {triton.__version__}")
def test_head_major_spills_no_more_than_rows_views(rows):
    # the Gluon kernels reading torch's (B, H, N, D) layout through rank-4 descriptors: the stack of the variant of
    # their config, mask, key tiles and grouping with rows views' descriptors (the forward: 0 everywhere but D64
    # 192x128 with a ragged last key tile, 8), or HEAD_MAJOR_STACK_GROWTH more
    by_label = {r["label"]: r for r in rows if "error" not in r}
    pairs = [(r, by_label.get(r["twin"])) for r in by_label.values() if r.get("twin")]
    assert pairs or OTHER_TRITON, "no head-major variants compiled"
    grown = [
        f"{r['label']}: stack {r['stack']} B > {twin['stack'] if twin else '(not compiled)'} of {r['twin']}"
        for r, twin in pairs
        if twin is None or r["stack"] > twin["stack"] + HEAD_MAJOR_STACK_GROWTH.get(r["label"], 0)
    ]
    assert not grown, "head-major variants spill more than their rows views' twins:\n" + "\n".join(grown)
