"""A Hugging Face transformers model on flashtile against the same model on "sdpa" (and "flash_attention_2" where
flash_attn is installed), in one run on one GPU.

    PYTHONPATH=src python3 benchmarks/bench_transformers.py [--quick] [--out FILE]
    PYTHONPATH=src python3 benchmarks/bench_transformers.py --dry-run   # the plumbing, tiny sizes, on the CPU
    PYTHONPATH=src python3 benchmarks/bench_transformers.py --generate-only --seqlens 4096 8192   # decoding only

The model: a Llama-style ~1.1B-parameter decoder from a config (TinyLlama's shape: hidden 2048, 22 layers, 32 query
and 4 key/value heads of 64, vocab 32000), random weights, bf16. Measured for each attention implementation:

- training step (forward + backward of the language-model loss), tokens per second counting real tokens only, on
  - dense: full rows (batch x seqlen = 16k tokens, at least one row);
  - padded: at least 2 rows with lengths uniform in [seqlen / 2, seqlen], right-padded, a 2-D attention_mask (SDPA
    gets a dense (batch, 1, seqlen, seqlen) mask from transformers; flashtile unpads into the varlen kernels);
  - packed: one row of seqlen tokens holding sequences of random lengths, position_ids restarting at each
    (padding-free training, as DataCollatorWithFlattening makes it);
- generation: greedy decoding of new tokens after left-padded prompts of seqlen / 4 tokens (DynamicCache), decode
  tokens per second = batch x (new tokens - 1) / (time of generate(new) - time of generate(1)).

Before timing, the script checks flashtile's logits against SDPA's on a padded batch (max difference printed).
Each row is one JSON line on stdout: implementation, mode, batch kind, seqlen, tokens, milliseconds, tokens/s, peak
memory; an "error" key where a case could not run (e.g. out of memory). --out appends them as records of the one
results format (``flashtile.bench.results``, benchmark "transformers": pass "fwd+bwd" for a training step, "decode"
for generation; tokens/s and the batch's padding in "extra"). A summary table of flashtile's speed-ups over SDPA
ends the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import transformers

import flashtile.integrations.transformers as fth
from flashtile.bench import results

TOKENS_PER_STEP = 16384
DEVICE = "cuda"
CONFIG = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-5, pad_token_id=0,
)  # fmt: skip


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def training_batch(
    kind: str, seqlen: int, vocab: int, step_tokens: int, generator: torch.Generator
) -> tuple[dict, int]:
    """Inputs of one training step (input_ids, labels, attention_mask or position_ids) and its real token count."""

    def tokens(*shape):
        return torch.randint(3, vocab, shape, generator=generator).to(DEVICE)

    if kind == "packed":
        lengths = []
        while sum(lengths) < seqlen:
            lengths.append(min(int(torch.randint(seqlen // 16, seqlen // 2, (1,), generator=generator)),
                               seqlen - sum(lengths)))  # fmt: skip
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
        ids = tokens(1, seqlen)
        labels = ids.clone()
        labels[0, torch.tensor([0, *lengths[:-1]]).cumsum(0).to(DEVICE)] = -100  # no prediction across sequences
        return dict(input_ids=ids, labels=labels, position_ids=positions, use_cache=False), seqlen
    rows = max(1 if kind == "dense" else 2, step_tokens // seqlen)
    ids = tokens(rows, seqlen)
    if kind == "dense":
        return dict(input_ids=ids, labels=ids, use_cache=False), rows * seqlen
    lengths = torch.randint(seqlen // 2, seqlen + 1, (rows,), generator=generator)
    lengths[0] = seqlen
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long().to(DEVICE)
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False), int(lengths.sum())


def check(model: torch.nn.Module, name: str, seqlen: int) -> float:
    """Max |logits| difference between flashtile and SDPA on a small padded batch (valid positions)."""
    ids = torch.randint(3, model.config.vocab_size, (3, seqlen), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, : seqlen // 3] = 0
    mask[1, seqlen * 5 // 6 :] = 0
    logits = {}
    for implementation in (name, "sdpa"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids, attention_mask=mask).logits.float()[mask.bool()]
    return (logits[name] - logits["sdpa"]).abs().max().item()


def main(argv: list[str] | None = None) -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, seqlen 4096 only, few repeats")
    parser.add_argument("--dry-run", action="store_true", help="a 2-layer toy model at seqlen 64 on the CPU")
    parser.add_argument("--seqlens", type=int, nargs="*", default=None, help="default 4096 8192 16384")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per row (default 64)")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file too")
    parser.add_argument("--generate-only", action="store_true", help="generation rows only (no training steps)")
    args = parser.parse_args(argv)

    name = fth.register()
    implementations = [name, "sdpa"]
    if importlib.util.find_spec("flash_attn") is not None and not args.dry_run:
        implementations.append("flash_attention_2")
    config, dtype = CONFIG, torch.bfloat16
    seqlens = args.seqlens or ([4096] if args.quick else [4096, 8192, 16384])
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    warmup, repeats = (0, 1) if args.dry_run else (1, 2) if args.quick else (2, 5)
    step_tokens = TOKENS_PER_STEP
    if args.quick:
        config = dict(CONFIG, num_hidden_layers=4)
    if args.dry_run:
        DEVICE, dtype, seqlens, new_tokens, step_tokens = "cpu", torch.float32, [64], 4, 128
        config = dict(CONFIG, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(DEVICE, dtype)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "none (dry run)"
    common = dict(
        bench="transformers", gpu=gpu, torch=torch.__version__,
        transformers=transformers.__version__, layers=config["num_hidden_layers"],
        dtype={torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype],
        params_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
    )  # fmt: skip
    rows = []

    env = results.environment(torch.device(DEVICE))

    def emit(row: dict) -> None:
        row = {**common, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None and "impl" in row:
            with args.out.open("a") as f:
                f.write(json.dumps(as_record(env, row), allow_nan=False) + "\n")

    common["max_abs_logit_diff_vs_sdpa"] = check(model, name, min(300, seqlens[0]))
    emit(dict(mode="check"))
    for seqlen in seqlens:
        for kind in () if args.generate_only else ("dense", "padded", "packed"):
            generator = torch.Generator().manual_seed(seqlen)
            inputs, real = training_batch(kind, seqlen, config["vocab_size"], step_tokens, generator)
            for implementation in implementations:
                row = dict(impl=implementation, mode="train", batch=kind, seqlen=seqlen, tokens=real,
                           slots=inputs["input_ids"].numel())  # fmt: skip
                model.set_attn_implementation(implementation)
                model.train()

                emit(dict(row, **measure(partial(training_step, model, inputs), real, warmup, repeats)))
        emit_generation(model, implementations, seqlen, new_tokens, emit, warmup, repeats)
    summary(rows, name)


IMPLEMENTATIONS = {"sdpa": "sdpa", "flash_attention_2": "fa2"}
"""Record names of transformers' own implementations; flashtile's registered name is recorded as "flashtile"."""


def as_record(env: dict, row: dict) -> dict:
    """One printed row as a record of ``flashtile.bench.results``."""
    shape = {"model": f"llama-{row['params_b']}b", "layers": row["layers"], "dtype": row["dtype"],
             "batch": row["batch"], "N": row["seqlen"]}  # fmt: skip
    keys = ("tokens", "slots", "tokens_per_s", "new_tokens", "prefill_ms", "max_abs_logit_diff_vs_sdpa")
    extra = {key: row[key] for key in keys if key in row}
    extra["transformers"] = row["transformers"]
    if "slots" in row:
        extra["padding"] = round(1 - row["tokens"] / row["slots"], 4)
    memory = row.get("peak_gb")
    return results.record(
        env, "transformers", IMPLEMENTATIONS.get(row["impl"], "flashtile"), shape,
        "fwd+bwd" if row["mode"] == "train" else "decode", time_ms=row.get("ms"),
        memory_mib=None if memory is None else memory * 1024, error=row.get("error"), extra=extra,
    )  # fmt: skip


def training_step(model: torch.nn.Module, inputs: dict) -> None:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()


def measure(fn, tokens: int, warmup: int, repeats: int) -> dict:
    """Time ``fn``: ms, tokens/s and (on the GPU) peak memory, or an error for a case that runs out of memory."""
    on_gpu = DEVICE == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        seconds = timed(fn, warmup, repeats)
    except torch.cuda.OutOfMemoryError:
        return dict(error="out of memory")
    result = dict(ms=round(seconds * 1e3, 3), tokens_per_s=round(tokens / seconds, 1))
    if on_gpu:
        result["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def emit_generation(model, implementations, seqlen: int, new_tokens: int, emit, warmup: int, repeats: int) -> None:
    """Greedy decoding after left-padded prompts of seqlen / 4 tokens, 8 rows."""
    prompt = seqlen // 4
    ids = torch.randint(3, model.config.vocab_size, (8, prompt), device=DEVICE)
    mask = torch.ones_like(ids)
    for row in range(1, 8):
        mask[row, : row * prompt // 16] = 0
    model.eval()
    for implementation in implementations:
        model.set_attn_implementation(implementation)

        def generate(count: int):
            def run():
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=count, min_new_tokens=count,
                                   do_sample=False, pad_token_id=0)  # fmt: skip

            return run

        row = dict(impl=implementation, mode="generate", batch="left-padded", seqlen=prompt, new_tokens=new_tokens)
        prefill = measure(generate(1), 8, max(warmup, 1), repeats)
        full = measure(generate(new_tokens), 8 * new_tokens, max(warmup, 1), repeats)
        if "error" in prefill or "error" in full:
            emit(dict(row, error=prefill.get("error") or full.get("error")))
            continue
        decode_s = (full["ms"] - prefill["ms"]) / 1e3
        row.update(ms=full["ms"], prefill_ms=prefill["ms"], peak_gb=full.get("peak_gb"))
        if decode_s <= 0:  # timing noise larger than the decoding (tiny dry-run models)
            emit(dict(row, error="decoding took less than the timing noise"))
            continue
        emit(dict(row, tokens_per_s=round(8 * (new_tokens - 1) / decode_s, 1)))


def summary(rows: list[dict], name: str) -> None:
    """flashtile's tokens/s over SDPA's for each measured case, as a markdown table; "padding" is the share of a
    padded batch's slots that are padding (what unpadding saves against SDPA's dense mask)."""
    speed = {(r["mode"], r["batch"], r["seqlen"], r["impl"]): r for r in rows if "impl" in r}
    print(
        "\n| mode | batch | seqlen | padding | flashtile tok/s | sdpa tok/s | speed-up |\n|---|---|---|---|---|---|---|"
    )
    for mode, batch, seqlen, impl in speed:
        if impl != name:
            continue
        ours = speed[(mode, batch, seqlen, name)].get("tokens_per_s")
        theirs = speed.get((mode, batch, seqlen, "sdpa"), {}).get("tokens_per_s")
        row = speed[(mode, batch, seqlen, name)]
        padding = f"{1 - row['tokens'] / row['slots']:.0%}" if "slots" in row else "-"
        ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
        print(f"| {mode} | {batch} | {seqlen} | {padding} | {ours} | {theirs} | {ratio} |")


if __name__ == "__main__":
    main()
