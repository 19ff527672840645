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

Timing interleaves the implementations: after warm-up calls of each, every round times each implementation once in
turn (the order reversed every other round), so that a drift of the machine's speed weighs on all of them alike;
a row reports the median over the rounds and the slowest and fastest round's tokens/s, and the summary the range
of the per-round ratios to SDPA. Before timing, the script checks flashtile's logits against SDPA's on a padded
batch (max difference printed).
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


def seconds(fn) -> float:
    """Wall-clock seconds of one call of ``fn``, the device idle before and after."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def interleaved(cases: dict, warmup: int, rounds: int) -> tuple[dict, dict]:
    """(results, peaks): per case name, the list of what ``cases[name]()`` returned in each of ``rounds`` rounds
    (every case called once per round, in turn, the order reversed every other round) after ``warmup`` calls of
    each, or "out of memory" for a case that ran out of GPU memory (left out of the later rounds); and on the GPU
    each case's peak memory in GiB."""
    results, peaks = {name: [] for name in cases}, {}
    for index in range(-1, rounds):  # -1: the warm-up calls
        live = [name for name in cases if not isinstance(results[name], str)]
        for name in live if index % 2 else live[::-1]:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                if index < 0:
                    for _ in range(warmup):
                        cases[name]()
                else:
                    results[name].append(cases[name]())
            except torch.cuda.OutOfMemoryError:
                results[name] = "out of memory"
                continue
            if DEVICE == "cuda":
                peaks[name] = max(peaks.get(name, 0.0), round(torch.cuda.max_memory_allocated() / 2**30, 2))
    return results, peaks


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
    parser.add_argument("--commit", default=None, help="flashtile's commit, where the code is not a git checkout")
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

    env = results.environment(torch.device(DEVICE), args.commit)

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
            measured, peaks = interleaved({implementation: partial(training_step, model, implementation, inputs)
                                           for implementation in implementations}, warmup, repeats)  # fmt: skip
            for implementation in implementations:
                row = dict(impl=implementation, mode="train", batch=kind, seqlen=seqlen, tokens=real,
                           slots=inputs["input_ids"].numel(), peak_gb=peaks.get(implementation))  # fmt: skip
                emit(dict(row, **rates(measured[implementation], real)))
        emit_generation(model, implementations, seqlen, new_tokens, emit, warmup, repeats)
    summary(rows, name)


IMPLEMENTATIONS = {"sdpa": "sdpa", "flash_attention_2": "fa2"}
"""Record names of transformers' own implementations; flashtile's registered name is recorded as "flashtile"."""


def as_record(env: dict, row: dict) -> dict:
    """One printed row as a record of ``flashtile.bench.results``."""
    shape = {"model": f"llama-{row['params_b']}b", "layers": row["layers"], "dtype": row["dtype"],
             "batch": row["batch"], "N": row["seqlen"]}  # fmt: skip
    keys = ("tokens", "slots", "tokens_per_s", "tokens_per_s_range", "rounds", "new_tokens", "prefill_ms",
            "max_abs_logit_diff_vs_sdpa")  # fmt: skip
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


def training_step(model: torch.nn.Module, implementation: str, inputs: dict) -> float:
    """Seconds of one training step of ``model`` on ``implementation``."""
    model.set_attn_implementation(implementation)
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()

    return seconds(step)


def rates(times: list[float] | str, tokens: int) -> dict:
    """A row's timing fields from ``interleaved``'s seconds per round: ms and tokens/s (medians), the slowest and
    fastest round's tokens/s ("tokens_per_s_range") and every round's ("rounds"); or the error."""
    if isinstance(times, str):
        return dict(error=times)
    per_round = [round(tokens / t, 1) for t in times]
    median = statistics.median(times)
    return dict(ms=round(median * 1e3, 3), tokens_per_s=round(tokens / median, 1),
                tokens_per_s_range=[min(per_round), max(per_round)], rounds=per_round)  # fmt: skip


def emit_generation(model, implementations, seqlen: int, new_tokens: int, emit, warmup: int, repeats: int) -> None:
    """Greedy decoding after left-padded prompts of seqlen / 4 tokens, 8 rows: per round and implementation,
    generate(1) then generate(new_tokens); decode tokens/s from their difference."""
    prompt = seqlen // 4
    ids = torch.randint(3, model.config.vocab_size, (8, prompt), device=DEVICE)
    mask = torch.ones_like(ids)
    for row in range(1, 8):
        mask[row, : row * prompt // 16] = 0
    model.eval()

    def generate(implementation: str) -> tuple[float, float]:
        """Seconds of generate(1) and of generate(new_tokens)."""
        model.set_attn_implementation(implementation)

        def run(count: int):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=count, min_new_tokens=count,
                               do_sample=False, pad_token_id=0)  # fmt: skip

        return seconds(partial(run, 1)), seconds(partial(run, new_tokens))

    measured, peaks = interleaved({impl: partial(generate, impl) for impl in implementations}, max(warmup, 1), repeats)
    for implementation in implementations:
        row = dict(impl=implementation, mode="generate", batch="left-padded", seqlen=prompt, new_tokens=new_tokens,
                   peak_gb=peaks.get(implementation))  # fmt: skip
        pairs = measured[implementation]
        if isinstance(pairs, str):
            emit(dict(row, error=pairs))
            continue
        decoding = [full - prefill for prefill, full in pairs]
        if min(decoding) <= 0:  # timing noise larger than the decoding (tiny dry-run models)
            emit(dict(row, error="decoding took less than the timing noise"))
            continue
        timing = rates(decoding, 8 * (new_tokens - 1))
        timing.update(ms=round(statistics.median(full for _, full in pairs) * 1e3, 3),
                      prefill_ms=round(statistics.median(prefill for prefill, _ in pairs) * 1e3, 3))  # fmt: skip
        emit(dict(row, **timing))


def summary(rows: list[dict], name: str) -> None:
    """flashtile's tokens/s over SDPA's for each measured case, as a markdown table: the ratio of the medians and
    the range of the ratios round by round; "padding" is the share of a padded batch's slots that are padding (what
    unpadding saves against SDPA's dense mask)."""
    speed = {(r["mode"], r["batch"], r["seqlen"], r["impl"]): r for r in rows if "impl" in r}
    print(
        "\n| mode | batch | seqlen | padding | flashtile tok/s | sdpa tok/s | speed-up | per round |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for mode, batch, seqlen, impl in speed:
        if impl != name:
            continue
        row, other = speed[(mode, batch, seqlen, name)], speed.get((mode, batch, seqlen, "sdpa"), {})
        ours, theirs = row.get("tokens_per_s"), other.get("tokens_per_s")
        padding = f"{1 - row['tokens'] / row['slots']:.0%}" if "slots" in row else "-"
        ratio = per_round = "-"
        if ours and theirs:
            ratio = f"{ours / theirs:.2f}x"
            paired = [a / b for a, b in zip(row["rounds"], other["rounds"], strict=True)]
            per_round = f"{min(paired):.2f}-{max(paired):.2f}"
        print(f"| {mode} | {batch} | {seqlen} | {padding} | {ours} | {theirs} | {ratio} | {per_round} |")


if __name__ == "__main__":
    main()
