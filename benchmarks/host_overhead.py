"""Host (Python) time of the attention entry points, up to the kernel launches; any machine, no GPU.

    PYTHONPATH=src python3 benchmarks/host_overhead.py [--out DIR] [--profile CASE]

CPU tensors take the Triton launchers' path (as under ``TRITON_INTERPRET=1``) with every attention kernel
replaced by a no-op, so what is timed is validation, the custom op's dispatch and autograd wrapper, the
launchers' Python (configs, strides, flags) and the output allocations; not Triton's own launch cost
(argument binding, a few µs per launch on the GPU) nor anything on the device. ``--tma`` runs with configs
that ask for tensor descriptors (as the Hopper table does for some passes), so ``tma_ready`` and the
descriptors are counted too. Rows: microseconds per call, min over 7 repetitions of the mean of
``--calls`` calls; B=2, N=32, H=4, D=128, bf16, causal (the size does not change the Python work; small
tensors keep the CPU's allocator and the autograd engine's CPU ops, such as the gradient of an unbind, out
of the numbers). Backward rows call ``torch.autograd.grad`` (no accumulation into ``.grad``). The flex rows
call ``flex_attention`` on (B, H, N, D) views with a causal or a prefix-LM block mask (the first N / 4 keys seen by
every query), mods that run the built-in attention: one call, two for prefix-LM.
``--profile CASE`` prints cProfile's top entries for one row.

    PYTHONPATH=src python3 benchmarks/host_overhead.py --decode-step [--device cuda] [--prompt 1024 2048]

``--decode-step``: the attention of a transformers model's decoding step (``decode_steps``), flashtile's registered
attention function against transformers' "sdpa": on the CPU with the kernels (and torch's SDPA) stubbed, so the
host work alone; with ``--device cuda`` on the real kernels, with the device time and the host synchronisations
per step. ``--profile x`` profiles flashtile's steps.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import json
import platform
import pstats
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import flashtile
from flashtile import _backend
from flashtile.ops.attention import backward, configs, forward

BATCH, SEQLEN, NHEADS, HEAD_DIM = 2, 32, 4, 128
DTYPE = torch.bfloat16


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


ATTENTION_KERNELS = ((forward, "_attention_forward_kernel"), (backward, "_attention_dkdv_kernel"),
                     (backward, "_attention_dq_kernel"), (backward, "_delta_kernel"))  # fmt: skip


@contextlib.contextmanager
def stubbed_launches(tma: bool = False, kernels: tuple[tuple[Any, str], ...] = ATTENTION_KERNELS) -> Iterator[None]:
    """``kernels`` ((module, name) pairs, the attention kernels by default) replaced by no-ops; CPU tensors
    on the Triton launchers' path; ``tma``: configs that ask for tensor descriptors."""
    saved = [getattr(module, name) for module, name in kernels]
    saved_interpret = _backend.TRITON_INTERPRET
    for module, name in kernels:
        setattr(module, name, _NoLaunch())
    _backend.TRITON_INTERPRET = True
    tiles = configs.TileConfig(64, 64, 4, 3, tma=True)
    overrides = configs.override(**dict.fromkeys(configs.PASSES, tiles)) if tma else contextlib.nullcontext()
    try:
        with overrides:
            yield
    finally:
        for (module, name), kernel in zip(kernels, saved, strict=True):
            setattr(module, name, kernel)
        _backend.TRITON_INTERPRET = saved_interpret


def cases() -> dict[str, Callable[[], Any]]:
    """name -> a function making one call (forward, or forward and backward)."""

    def qkv(grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(BATCH, SEQLEN, NHEADS, HEAD_DIM, dtype=DTYPE, requires_grad=grad) for _ in range(3))

    q, k, v = qkv(False)
    qg, kg, vg = qkv(True)
    dout = torch.randn_like(q)
    packed = torch.randn(BATCH, SEQLEN, 3, NHEADS, HEAD_DIM, dtype=DTYPE, requires_grad=True)
    kv = torch.randn(BATCH, SEQLEN, 2, NHEADS, HEAD_DIM, dtype=DTYPE, requires_grad=True)
    cu = torch.arange(0, (BATCH + 1) * SEQLEN, SEQLEN, dtype=torch.int32)
    flat = [t.view(BATCH * SEQLEN, NHEADS, HEAD_DIM) for t in (q, k, v)]
    flat_g = [t.detach().reshape(BATCH * SEQLEN, NHEADS, HEAD_DIM).requires_grad_() for t in (qg, kg, vg)]
    dout_flat = dout.view(BATCH * SEQLEN, NHEADS, HEAD_DIM)
    sq, sk, sv = (t.transpose(1, 2) for t in (qg, kg, vg))
    leaves = [qg, kg, vg, packed, kv, *flat_g]
    prefix = SEQLEN // 4
    causal_mask, prefix_mask = (
        flashtile.create_block_mask(mask_mod, None, None, SEQLEN, SEQLEN, device="cpu", BLOCK_SIZE=16)
        for mask_mod in (
            lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
            lambda b, h, q_idx, kv_idx: (kv_idx < prefix) | (q_idx >= kv_idx),
        )
    )

    def fwd_bwd(call: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            out = call()
            torch.autograd.grad(out, [t for t in leaves if t.grad_fn is None], grad, allow_unused=True)

        return step

    return {
        "fwd": lambda: flashtile.flash_attn_func(q, k, v, causal=True),
        "fwd (requires_grad)": lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True),
        "fwd no_grad (requires_grad)": lambda: _no_grad(flashtile.flash_attn_func, qg, kg, vg, causal=True),
        "fwd+bwd": fwd_bwd(lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True), dout),
        "fwd+bwd return_lse": fwd_bwd(
            lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True, return_attn_probs=True)[0], dout
        ),
        "qkvpacked fwd+bwd": fwd_bwd(lambda: flashtile.flash_attn_qkvpacked_func(packed, causal=True), dout),
        "kvpacked fwd+bwd": fwd_bwd(lambda: flashtile.flash_attn_kvpacked_func(qg, kv, causal=True), dout),
        "sdpa fwd": lambda: flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))),
        "sdpa fwd+bwd": fwd_bwd(
            lambda: flashtile.scaled_dot_product_attention(sq, sk, sv, is_causal=True), dout.transpose(1, 2)
        ),
        "flex causal fwd+bwd": fwd_bwd(
            lambda: flashtile.flex_attention(sq, sk, sv, block_mask=causal_mask), dout.transpose(1, 2)
        ),
        "flex prefix-LM fwd+bwd": fwd_bwd(
            lambda: flashtile.flex_attention(sq, sk, sv, block_mask=prefix_mask), dout.transpose(1, 2)
        ),
        "varlen fwd": lambda: flashtile.flash_attn_varlen_func(*flat, cu, cu, SEQLEN, SEQLEN, causal=True),
        "varlen fwd+bwd": fwd_bwd(
            lambda: flashtile.flash_attn_varlen_func(*flat_g, cu, cu, SEQLEN, SEQLEN, causal=True), dout_flat
        ),
    }


def _no_grad(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return fn(*args, **kwargs)


def call_means(fn: Callable[[], Any], calls: int, repeats: int = 7) -> list[float]:
    """Microseconds per call of each of ``repeats`` runs of ``calls`` calls, after a warm-up."""
    for _ in range(min(calls, 200)):
        fn()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return means


def time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call: min over 7 repetitions of the mean of ``calls`` calls, after a warm-up."""
    return min(call_means(fn, calls))


# ---------------------------------------------------------------------------------------------------------------
# One decoding step of a transformers model, attention only (``--decode-step``)

STEP_BATCH, STEP_HEADS, STEP_KV_HEADS, STEP_HEAD_DIM, STEP_LAYERS = 8, 32, 4, 64, 22
"""bench_transformers.py's generation: 8 left-padded rows, the Llama-style 1.1B model's heads and layers."""


class _Layer(torch.nn.Module):
    """What an attention function reads of a transformers attention layer."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx, self.is_causal, self.num_key_value_groups = index, True, STEP_HEADS // STEP_KV_HEADS


def _stubbed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's SDPA with no arithmetic: the output allocation only."""
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@contextlib.contextmanager
def stubbed_decode() -> Iterator[None]:
    """CPU tensors on the Triton decode launcher with its kernel (and the attention kernels, for the general path)
    a no-op, value checks off as on a GPU under the integration, torch's SDPA a no-op."""
    from flashtile.ops.decode import split_kv

    saved_checks, saved_sdpa = _backend.values_checked, torch.nn.functional.scaled_dot_product_attention
    _backend.values_checked = lambda device: False
    torch.nn.functional.scaled_dot_product_attention = _stubbed_sdpa
    try:
        with stubbed_launches(kernels=(*ATTENTION_KERNELS, (split_kv, "_split_kv_kernel"))):
            yield
    finally:
        _backend.values_checked, torch.nn.functional.scaled_dot_product_attention = saved_checks, saved_sdpa


def decode_steps(implementation: str, device: str, prompt: int, steps: int, dtype: torch.dtype) -> dict:
    """Time ``steps`` greedy-decoding steps' attention as a transformers model makes it: per step the mask function
    (``create_causal_mask`` over a left-padded 2-D mask and a DynamicCache) once, then each layer's attention
    function on its cache's keys and values (B, Hk, S, D) and a query (B, H, 1, D) transposed from the projection's
    layout. The cache grows by one token per step (its update is not timed: it is the model's, whatever the
    attention). Returns per-step medians in µs (robust to a busy machine): ``mask_us``, ``attention_us`` (all
    layers), ``per_layer_us`` (both over the layers); with CUDA also ``device_us`` (mean kernel time per step from
    torch.profiler, the cache appends included) and ``syncs_per_step`` (host synchronisations, from torch.cuda's
    sync debug mode). With CUDA the host times are those of queueing the work, except where a synchronisation waits
    for the kernels queued before it (the mask function's, which ``mask_us`` then includes)."""
    import transformers
    from transformers import masking_utils

    config = transformers.LlamaConfig(
        hidden_size=STEP_HEADS * STEP_HEAD_DIM, num_attention_heads=STEP_HEADS, num_key_value_heads=STEP_KV_HEADS,
        num_hidden_layers=STEP_LAYERS, vocab_size=128,
    )  # fmt: skip
    config._attn_implementation = implementation
    attend = transformers.AttentionInterface._global_mapping[implementation]
    layers = [_Layer(i) for i in range(STEP_LAYERS)]
    generator = torch.Generator().manual_seed(0)

    def states(heads: int, length: int) -> torch.Tensor:
        x = torch.randn(STEP_BATCH, length, heads, STEP_HEAD_DIM, generator=generator, dtype=torch.float32)
        return x.to(device, dtype).transpose(1, 2)  # the projections' (B, S, H, D) seen as (B, H, S, D)

    padding = torch.ones(STEP_BATCH, prompt, dtype=torch.long, device=device)
    for row in range(1, STEP_BATCH):
        padding[row, : row * prompt // 16] = 0
    cache = transformers.DynamicCache(config=config)
    for layer in range(STEP_LAYERS):
        cache.update(states(STEP_KV_HEADS, prompt), states(STEP_KV_HEADS, prompt), layer)
    new_k, new_v, query = states(STEP_KV_HEADS, 1), states(STEP_KV_HEADS, 1), states(STEP_HEADS, 1)
    embeds = torch.empty(STEP_BATCH, 1, config.hidden_size, dtype=dtype, device=device)
    ones = torch.ones(STEP_BATCH, 1, dtype=torch.long, device=device)
    on_gpu = device == "cuda"
    times = {"mask_us": [], "attention_us": []}

    def step(mask_2d: torch.Tensor) -> torch.Tensor:
        mask_2d = torch.cat([mask_2d, ones], dim=-1)
        position = torch.full((STEP_BATCH, 1), mask_2d.shape[1] - 1, device=device)
        start = time.perf_counter()
        seen = masking_utils.create_causal_mask(config, embeds, mask_2d, cache, position)
        middle = time.perf_counter()
        for layer in range(STEP_LAYERS):
            cache.update(new_k, new_v, layer)
        times["mask_us"].append((middle - start) * 1e6)
        middle = time.perf_counter()
        for layer in range(STEP_LAYERS):
            key, value = cache.layers[layer].keys, cache.layers[layer].values
            attend(layers[layer], query, key, value, seen, dropout=0.0, scaling=STEP_HEAD_DIM**-0.5,
                   position_ids=position)  # fmt: skip
        end = time.perf_counter()
        times["attention_us"].append((end - middle) * 1e6)
        return mask_2d

    def run(count: int) -> None:
        mask_2d = padding
        for _ in range(count):
            mask_2d = step(mask_2d)
        cache.crop(-count)

    with torch.no_grad():
        run(min(steps, 8))  # warm-up: compiles, plans
        if on_gpu:
            torch.cuda.synchronize()
        for kept in times.values():
            kept.clear()
        run(steps)
        row = {key: round(statistics.median(kept), 1) for key, kept in times.items()}
        row["per_layer_us"] = round((row["mask_us"] + row["attention_us"]) / STEP_LAYERS, 1)
        if on_gpu:
            row.update(_device_profile(run, steps))
    return row


def _device_profile(run: Callable[[int], None], steps: int) -> dict:
    """The device time of ``steps`` steps' kernels (torch.profiler) and the host synchronisations per step."""
    import warnings

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(steps)
        torch.cuda.synchronize()
    device_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return {"device_us": round(device_us / steps, 1), "syncs_per_step": round(syncs / steps, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for host_overhead.json")
    parser.add_argument("--calls", type=int, default=1000, help="calls per repetition")
    parser.add_argument("--tma", action="store_true", help="configs that ask for tensor descriptors")
    parser.add_argument("--profile", metavar="CASE", help="print cProfile's top entries for this case")
    parser.add_argument("--only", metavar="CASE", action="append", help="time only these cases")
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="a transformers model's decoding step: flashtile's attention function against sdpa's",
    )
    parser.add_argument("--device", default="cpu", help="--decode-step: cpu (kernels stubbed) or cuda (real kernels)")
    parser.add_argument("--prompt", type=int, nargs="+", default=[256], help="--decode-step: prompt tokens per row")
    parser.add_argument("--steps", type=int, default=64, help="--decode-step: steps timed")
    args = parser.parse_args(argv)
    if args.decode_step:
        decode_step_table(args)
        return
    rows = []
    with stubbed_launches(args.tma):
        table = cases()
        if args.profile:
            fn = table[args.profile]
            for _ in range(100):
                fn()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                fn()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
            return
        for name, fn in table.items():
            if args.only and name not in args.only:
                continue
            checks = ("on", "off") if name.startswith("varlen") else ("on",)
            for check in checks:
                # CPU tensors are always value-checked; "off" is what a GPU run with the switch off does
                context = contextlib.nullcontext() if check == "on" else _unchecked()
                with context:
                    us = time_calls(fn, args.calls)
                label = name if len(checks) == 1 else f"{name} (value checks {check})"
                rows.append({"case": label, "us_per_call": round(us, 1)})
                print(f"{label:40s} {us:7.1f} us/call")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        header = {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "commit": _commit(),
            "tma": args.tma,
            "shape": [BATCH, SEQLEN, NHEADS, HEAD_DIM],
        }
        (args.out / "host_overhead.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")


def decode_step_table(args: argparse.Namespace) -> None:
    """``--decode-step``: one row per implementation (flashtile's registered name, "sdpa"); ``--profile`` with any
    case name profiles flashtile's steps instead."""
    import flashtile.integrations.transformers as fth

    name = fth.register()
    stubbed = args.device == "cpu"
    rows = []
    with stubbed_decode() if stubbed else contextlib.nullcontext():
        if args.profile:
            decode_steps(name, args.device, args.prompt[0], 8, DTYPE)
            profile = cProfile.Profile()
            profile.enable()
            decode_steps(name, args.device, args.prompt[0], args.steps, DTYPE)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(40)
            return
        for prompt, implementation in itertools.product(args.prompt, (name, "sdpa")):
            row = {
                "impl": implementation,
                "device": args.device,
                "kernels": "stubbed" if stubbed else "real",
                "prompt": prompt,
                **decode_steps(implementation, args.device, prompt, args.steps, DTYPE),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        header = {"torch": torch.__version__, "commit": _commit(), "shape": [STEP_BATCH, STEP_HEADS, STEP_KV_HEADS,
                  STEP_HEAD_DIM, STEP_LAYERS]}  # fmt: skip
        (args.out / "decode_step.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")


def _commit() -> str:
    git = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()


@contextlib.contextmanager
def _unchecked() -> Iterator[None]:
    saved = _backend.values_checked
    _backend.values_checked = lambda device: False
    try:
        yield
    finally:
        _backend.values_checked = saved


if __name__ == "__main__":
    main()
