"""flashtile as a Hugging Face transformers ``attn_implementation`` (``flashtile.integrations.transformers``).

Tiny models built from configs with random weights (nothing is downloaded), one per family whose attention has
something of its own: Llama (GQA, a head dim of 20 that flashtile pads), Mistral (sliding window), Qwen2
(alternating sliding and full layers), Qwen3 (head dim 24), Gemma 2 (softcapping, query_pre_attn_scalar,
alternating windows), gpt-oss (learnable sinks), BERT and ModernBERT (bidirectional; ModernBERT alternates local
and global layers). Each is compared with the model's own "eager" attention, transformers' naive attention and so
the oracle, and with its "sdpa" where the model has one, by DESIGN's tolerance rule at model level: with
ref = eager and base = sdpa (the error another exact fp32 attention makes), flashtile's logits and gradients must
lie within F * max|base - ref| + a floor of a few float32 ulps at the values' scale.

They run float32 on the CPU path (``flashtile.cpu``), the dtype and path models get on a CPU; one case runs the
Triton kernels in the interpreter, and the GPU cases (bf16) run where CUDA is.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile  # noqa: E402
import flashtile.cpu_decode  # noqa: E402
import flashtile.integrations.transformers as fth  # noqa: E402
from flashtile import _backend  # noqa: E402
from flashtile.reference import GRADIENT_FACTOR, OUTPUT_FACTOR  # noqa: E402

NAME = fth.register()
DEVICE = "cpu"
"""The float32 cases run on the CPU wherever the tests run (the GPU case moves its model and inputs itself)."""


@pytest.fixture(autouse=True)
def cpu_path(request, monkeypatch):
    """CPU tensors take ``flashtile.cpu`` (as outside the tests), except in tests marked ``interpreter``."""
    if "interpreter" not in request.keywords:
        monkeypatch.setattr(_backend, "TRITON_INTERPRET", False)


@dataclass
class Family:
    name: str
    config: str
    model: str
    options: dict = field(default_factory=dict)
    references: tuple[str, ...] = ("sdpa", "eager")
    decoder: bool = True


COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip
FAMILIES = [
    Family("llama", "LlamaConfig", "LlamaForCausalLM", dict(head_dim=20)),
    Family("mistral", "MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    Family(
        "qwen2",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    ),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, num_key_value_heads=1)),
    Family(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=5,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
        ),
        references=("eager",),  # its SDPA cannot softcap (refused, or ignored by older transformers)
    ),
    Family(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        references=("eager",),  # no SDPA (sinks)
    ),
    Family(
        "bert",
        "BertConfig",
        "BertForMaskedLM",
        dict(num_key_value_heads=None, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        decoder=False,
    ),
    Family(
        "modernbert",
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        dict(
            num_key_value_heads=None,
            global_attn_every_n_layers=2,
            local_attention=6,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        decoder=False,
    ),
]
DECODERS = [family for family in FAMILIES if family.decoder]


def build(family: Family, **overrides) -> torch.nn.Module:
    options = {key: value for key, value in {**COMMON, **family.options, **overrides}.items() if value is not None}
    config = getattr(transformers, family.config)(**options)
    torch.manual_seed(0)
    return getattr(transformers, family.model)(config).to(DEVICE).eval()


def padded_batch(batch: int = 3, seqlen: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and an attention_mask with a left-padded row, a right-padded row and a full one."""
    ids = torch.randint(3, 128, (batch, seqlen), device=DEVICE)
    mask = torch.ones(batch, seqlen, dtype=torch.long, device=DEVICE)
    mask[0, :5] = 0
    mask[1, 9:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (3, 9), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def assert_rule(what: str, x: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None, factor: float) -> None:
    """max|x - ref| <= factor * max|base - ref| + floor, the floor 16 ulps of x's dtype at ref's scale."""
    x, ref = x.double(), ref.double()
    error = (x - ref).abs().max().item()
    base_error = 0.0 if base is None else (base.double() - ref).abs().max().item()
    floor = 16 * torch.finfo(x.dtype if x.is_floating_point() else torch.float32).eps * ref.abs().max().item()
    floor = max(floor, 16 * torch.finfo(torch.float32).eps * ref.abs().max().item())
    assert error <= factor * base_error + floor, f"{what}: error {error:.3g}, base {base_error:.3g}, floor {floor:.3g}"


def run(model: torch.nn.Module, implementation: str, **inputs) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_padded_logits(family):
    model = build(family)
    ids, mask = padded_batch()
    valid = mask.bool()
    results = {impl: run(model, impl, input_ids=ids, attention_mask=mask)[valid] for impl in (NAME, *family.references)}
    base = results.get("sdpa")
    assert_rule(f"{family.name} logits", results[NAME], results["eager"], base, OUTPUT_FACTOR)


def labels_of(ids: torch.Tensor, mask: torch.Tensor, decoder: bool) -> torch.Tensor:
    """The tokens as labels, -100 (ignored) at padding and, for a causal LM (which predicts token t at position
    t - 1), where position t - 1 is padding: the outputs at padding positions are no one's (SDPA's are arbitrary)."""
    labels = ids.masked_fill(mask == 0, -100)
    if decoder:
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return labels


def training_step(model: torch.nn.Module, implementation: str, family: Family, ids, mask) -> tuple[torch.Tensor, dict]:
    model.set_attn_implementation(implementation)
    model.train()
    model.zero_grad()
    labels = labels_of(ids, mask, family.decoder)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_training_step(family):
    model = build(family)
    ids, mask = padded_batch()
    steps = {impl: training_step(model, impl, family, ids, mask) for impl in (NAME, *family.references)}
    loss, grads = steps[NAME]
    ref_loss, ref_grads = steps["eager"]
    base_loss, base_grads = steps.get("sdpa", (None, {}))
    assert_rule(f"{family.name} loss", loss, ref_loss, base_loss, OUTPUT_FACTOR)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_rule(f"{family.name} grad {name}", grad, ref_grads[name], base_grads.get(name), GRADIENT_FACTOR)


def generate(model: torch.nn.Module, implementation: str, ids, mask, **options) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **options
    )


@pytest.mark.parametrize("family", DECODERS, ids=lambda f: f.name)
def test_generate(family, monkeypatch):
    model = build(family)
    ids, mask = left_padded_prompts()
    expected = generate(model, family.references[0], ids, mask)
    decodes = spy_decodes(monkeypatch)
    assert torch.equal(generate(model, NAME, ids, mask), expected)
    sinks = family.name == "gpt_oss"  # flash_attn_with_kvcache has no learnable sink: the general kernels decode
    assert (decodes.calls == 0) == sinks


def spy(monkeypatch, function: str, module=flashtile, counted=None):
    """Count the calls of a public flashtile function (the integration calls them through the module), or of
    ``module``'s ``function``; into ``counted``'s ``calls`` where given (one count for several functions)."""
    original = getattr(module, function)
    counter = counted or SimpleNamespace(calls=0)

    def counting(*args, **kwargs):
        counter.calls += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function, counting)
    return counter


def spy_decodes(monkeypatch):
    """Count the calls that reach a decoding kernel, where ``flash_attn_with_kvcache``, the decoders
    (``flashtile.kvcache.Decoder``) that the integration makes per decoding step and their launches prepared per
    layout all meet: the CPU path's ``kvcache_forward`` and the Triton launcher's ``split_kv._run``."""
    from flashtile.ops.decode import split_kv

    counted = spy(monkeypatch, "kvcache_forward", flashtile.cpu_decode)
    return spy(monkeypatch, "_run", split_kv, counted)


DECODING_MASKS = {
    "left-padded": ((0, 2, 5), None, True),
    "no-padding": ((0, 0, 0), None, True),
    "a-hole": ((0, 2, 0), (2, 4), False),
}
"""name -> (leading padding of each row, (row, position) of a key missing inside a row or None, whether the step
takes flash_attn_with_kvcache)."""


@pytest.mark.parametrize("case", DECODING_MASKS)
def test_decoding_step(monkeypatch, case):
    """One query per row against a DynamicCache-shaped cache, as every layer of a decoding step reads it: the cache
    lengths derived from the mask once per forward serve every layer; a row whose keys are not one run takes the
    varlen kernels; every row equals SDPA's (float64 the reference, float32 the base)."""
    from oracle import assert_within_rule

    pads, hole, kvcache = DECODING_MASKS[case]
    batch, heads, heads_k, head_dim, length = 3, 4, 2, 16, 9
    decodes = spy_decodes(monkeypatch)
    padding = torch.ones(batch, length, dtype=torch.bool)
    for row, pad in enumerate(pads):
        padding[row, :pad] = False
    if hole is not None:
        padding[hole] = False
    layer = torch.nn.Module()
    layer.is_causal = True
    for _ in range(2):  # two forwards, each with its mask, of two layers
        q = torch.randn(batch, 1, heads, head_dim).transpose(1, 2)  # the projection's layout, transposed
        k, v = (torch.randn(batch, heads_k, length, head_dim) for _ in range(2))
        seen = fth.mask(batch, 1, length, length - 1, 0, attention_mask=padding)
        for _ in range(2):
            out, _ = fth.attention_forward(layer, q, k, v, seen, scaling=0.3)
            ref, base = (
                torch.nn.functional.scaled_dot_product_attention(
                    q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=padding[:, None, None], scale=0.3, enable_gqa=True
                ).transpose(1, 2).float()
                for dtype in (torch.float64, torch.float32)
            )  # fmt: skip
            assert_within_rule("out", out, ref, base)
        padding = padding.roll(1, 0)  # another mask in the next forward
    assert (decodes.calls == 4) == kvcache


@pytest.mark.gpu
def test_decoding_layers_do_not_synchronize():
    """On the GPU a decoding step's layers add no host synchronisation to the mask function's one (the cache lengths
    are made once per forward, without host-to-device copies, and their values are not checked again): neither the
    step's first layer, which makes the step's decoder and checks its layout (here a step's mask made anew with the
    same lengths), nor a layer of another layout (other KV heads), nor the layers after them."""
    batch, length = 3, 40
    padding = torch.ones(batch, length, dtype=torch.bool, device="cuda")
    padding[1, :7] = False
    q = torch.randn(batch, 1, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(batch, 2, length, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k4, v4 = (torch.randn(batch, 4, length, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    layer = torch.nn.Module()
    layer.is_causal = True
    seen = fth.mask(batch, 1, length, length - 1, 0, attention_mask=padding)
    for keys, values in ((k, v), (k4, v4)):
        fth.attention_forward(layer, q, keys, values, seen)  # compiles
    torch.cuda.synchronize()
    step = seen._replace(memo={"decode": seen.memo["decode"]})  # the next step's mask, before any layer ran
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for keys, values in ((k, v), (k4, v4)):
                fth.attention_forward(layer, q, keys, values, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("batch_kind", ["padded", "packed"])
def test_training_layers_do_not_synchronize(batch_kind):
    """On the GPU the layers of a training step on a padded or packed batch add no host synchronisation, forward or
    backward, once the forward's first layer has unpadded the mask or read the packed boundaries (one sync each, as
    flash_attn's own integration)."""
    batch, length, heads, heads_k = 2, 96, 8, 2
    layer = torch.nn.Module()
    layer.is_causal = True
    if batch_kind == "padded":
        padding = torch.ones(batch, length, dtype=torch.bool, device="cuda")
        padding[1, 70:] = False
        seen = fth.mask(batch, length, length, 0, 0, attention_mask=padding)
    else:
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate((40, 1, 55))])[None].to("cuda")
        seen = fth.Visibility(None, 0, None, 0, ids, (1, 1, length, length), {})
        batch = 1

    def layer_step() -> None:
        q, k, v = (torch.randn(batch, h, length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (heads, heads_k, heads_k))  # fmt: skip
        out, _ = fth.attention_forward(layer, q, k, v, seen)
        out.sum().backward()

    layer_step()  # the first layer: compiles, unpads or reads the boundaries
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            layer_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_padding_takes_the_varlen_kernels(monkeypatch):
    """A padded batch is unpadded into the varlen kernels (no dense mask); an unpadded one takes flash_attn_func."""
    model = build(FAMILIES[0])
    calls = {name: spy(monkeypatch, name) for name in ("flash_attn_varlen_func", "flash_attn_func")}
    dense = spy(monkeypatch, "scaled_dot_product_attention")
    ids, mask = padded_batch()
    run(model, NAME, input_ids=ids, attention_mask=mask)
    assert calls["flash_attn_varlen_func"].calls == 2 and calls["flash_attn_func"].calls == 0
    run(model, NAME, input_ids=ids, attention_mask=torch.ones_like(mask))
    assert calls["flash_attn_func"].calls == 2 and dense.calls == 0


@pytest.mark.parametrize("family", [FAMILIES[0], FAMILIES[1]], ids=lambda f: f.name)
def test_packed_sequences(family, monkeypatch):
    """Padding-free training: sequences packed in one row, position_ids restarting at each; the same logits as
    SDPA's packed mask, as each sequence alone, and with DataCollatorWithFlattening's cu_seq_lens keywords."""
    model = build(family)
    lengths = [6, 1, 9]
    sequences = [torch.randint(3, 128, (n,), device=DEVICE) for n in lengths]
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    varlen = spy(monkeypatch, "flash_attn_varlen_func")
    packed = run(model, NAME, input_ids=ids, position_ids=positions, use_cache=False)[0]
    assert varlen.calls == 2
    alone = torch.cat([run(model, "eager", input_ids=s[None])[0] for s in sequences])
    sdpa = run(model, "sdpa", input_ids=ids, position_ids=positions, use_cache=False)[0]
    assert_rule("packed logits", packed, alone, sdpa, OUTPUT_FACTOR)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": s.tolist()} for s in sequences])
    keywords = {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    keywords.pop("labels")
    from_collator = run(model, NAME, use_cache=False, **keywords)[0]
    assert_rule("packed logits (cu_seq_lens)", from_collator, alone, sdpa, OUTPUT_FACTOR)


@pytest.mark.parametrize("family", [FAMILIES[1], FAMILIES[4]], ids=lambda f: f.name)
def test_static_cache(family):
    """generate() with a static cache (sliding-window layers included): transformers builds the masks before each
    forward and hands them in; the tokens are those of the reference implementation with the default cache."""
    model = build(family)
    ids, mask = left_padded_prompts()
    expected = generate(model, family.references[0], ids, mask)
    assert torch.equal(generate(model, NAME, ids, mask, cache_implementation="static"), expected)


def test_static_cache_with_torch_compile():
    """The same with the forward compiled as one graph (fullgraph=True): no graph break in flashtile's attention."""
    from transformers.generation import CompileConfig

    model = build(FAMILIES[0])
    ids, mask = left_padded_prompts()
    expected = generate(model, "sdpa", ids, mask)
    torch._dynamo.reset()
    compiled = CompileConfig(backend="eager", fullgraph=True)
    compiled._compile_all_devices = True  # transformers compiles generate's forward on accelerators only, otherwise
    got = generate(model, NAME, ids, mask, cache_implementation="static", compile_config=compiled)
    assert torch.equal(got, expected)


def test_dropout_in_training():
    """Attention dropout applies in training only: an eval forward equals eager's, a training forward differs, the
    same seed gives the same loss and every gradient is finite."""
    model = build(FAMILIES[0], attention_dropout=0.4)
    ids, mask = padded_batch()
    labels = labels_of(ids, mask, decoder=True)
    model.set_attn_implementation(NAME)
    eval_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    model.set_attn_implementation("eager")
    assert_rule("eval loss", eval_loss, model(input_ids=ids, attention_mask=mask, labels=labels).loss, None, 1)
    model.set_attn_implementation(NAME)
    model.train()
    losses = []
    for _ in range(2):
        torch.manual_seed(1)
        losses.append(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert losses[0].item() == losses[1].item() != eval_loss.item()
    losses[0].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_four_dimensional_masks():
    """A 4-D mask given by the caller goes through flashtile's SDPA-style attn_mask, as SDPA reads it; with softcap
    (which those kernels lack) it is refused with the way out."""
    model = build(FAMILIES[0])
    ids, mask = padded_batch()
    seqlen = ids.shape[1]
    visible = torch.ones(seqlen, seqlen, device=DEVICE).tril().bool() & mask.bool()[:, None, None, :]
    visible |= torch.eye(seqlen, dtype=torch.bool, device=DEVICE)  # padding rows see themselves
    additive = torch.zeros(visible.shape, device=DEVICE).masked_fill(~visible, torch.finfo(torch.float32).min)
    for given in (visible, additive):
        results = {impl: run(model, impl, input_ids=ids, attention_mask=given) for impl in (NAME, "sdpa", "eager")}
        assert_rule("4-D mask logits", results[NAME], results["eager"], results["sdpa"], OUTPUT_FACTOR)
    gemma = build(FAMILIES[4])
    with pytest.raises(NotImplementedError, match="softcapping"):
        run(gemma, NAME, input_ids=ids, attention_mask=additive)


def test_patterns_beyond_the_kernels_options_use_the_exact_mask():
    """A model's own mask function (here an or_mask_function making the first 3 tokens see each other) is not one
    the kernels' options express: the mask function returns transformers' boolean mask, read as SDPA reads it."""
    from transformers import masking_utils

    model = build(FAMILIES[0])
    ids, mask = padded_batch()
    embeds = model.get_input_embeddings()(ids)
    prefix = lambda batch_idx, head_idx, q_idx, kv_idx: (q_idx < 3) & (kv_idx < 3)

    def attend(implementation):
        model.config._attn_implementation = implementation
        built = masking_utils.create_causal_mask(
            model.config, embeds, mask, None, position_ids=torch.arange(ids.shape[1])[None], or_mask_function=prefix
        )
        q = torch.randn(3, 4, ids.shape[1], 20, device=DEVICE)
        k, v = torch.randn(2, 3, 2, ids.shape[1], 20, device=DEVICE).unbind(0)
        layer = model.model.layers[0].self_attn
        forward = fth.attention_forward if implementation == NAME else transformers.AttentionInterface()["sdpa"]
        return built, forward(layer, q, k, v, built, scaling=0.25)[0]

    torch.manual_seed(1)
    built, out = attend(NAME)
    assert isinstance(built, torch.Tensor) and built.dtype == torch.bool and built.shape == (3, 1, 13, 13)
    torch.manual_seed(1)
    sdpa_mask, sdpa_out = attend("sdpa")
    assert torch.equal(built, sdpa_mask)
    valid = mask.bool()
    assert_rule("prefix-pattern attention", out[valid], sdpa_out[valid], None, 1)


def test_register():
    assert NAME == fth.DEFAULT_NAME == "tile_attention"
    assert transformers.AttentionInterface()[NAME] is fth.attention_forward
    assert transformers.AttentionMaskInterface()[NAME] is fth.mask
    assert fth.register(name="my_tiles") == "my_tiles"
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**COMMON), attn_implementation="my_tiles"
    )
    assert model.config._attn_implementation == "my_tiles"
    with pytest.raises(TypeError, match="non-empty str"):
        fth.register(name="")


@pytest.fixture
def unregister():
    """Names a test registers straight with transformers, removed afterwards."""
    names = []
    yield names
    for name in names:
        transformers.AttentionInterface._global_mapping.pop(name, None)
        transformers.AttentionMaskInterface._global_mapping.pop(name, None)


def test_a_name_with_flash_cannot_build_a_model(unregister):
    """The trap: transformers 5 takes any implementation name containing "flash" for a hub kernel, so a model
    registered as "flashtile" cannot be built. register() refuses such names and its default has no "flash"."""
    with pytest.raises(ValueError, match="hub kernel"):
        fth.register(name="flashtile")
    unregister.append("flashtile")
    transformers.AttentionInterface.register("flashtile", fth.attention_forward)
    transformers.AttentionMaskInterface.register("flashtile", fth.mask)
    with pytest.raises(Exception):  # noqa: B017  (transformers' error differs across versions)
        transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**COMMON), attn_implementation="flashtile"
        )


def test_attention_without_its_mask_function_drops_the_padding(unregister):
    """The other trap: registered without a mask function, the attention gets no mask from transformers and
    silently ignores the padding (left-padded rows come out wrong); register() registers both."""
    unregister.append("tiles_without_mask")
    transformers.AttentionInterface.register("tiles_without_mask", fth.attention_forward)
    model = build(FAMILIES[0])
    ids, mask = padded_batch()
    valid = mask.bool()
    expected = run(model, "sdpa", input_ids=ids, attention_mask=mask)[valid]
    wrong = run(model, "tiles_without_mask", input_ids=ids, attention_mask=mask)[valid]
    assert (wrong - expected).abs().max() > 0.1
    assert_rule("logits", run(model, NAME, input_ids=ids, attention_mask=mask)[valid], expected, None, 1)


def test_clear_errors():
    model = build(FAMILIES[0])
    layer = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 20, device=DEVICE)
    k = v = torch.randn(1, 2, 5, 20, device=DEVICE)
    with pytest.raises(NotImplementedError, match="position bias"):
        fth.attention_forward(layer, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(NotImplementedError, match="continuous batching"):
        fth.attention_forward(layer, q, k, v, None, cache=object())
    with pytest.raises(TypeError, match="register"):
        fth.attention_forward(layer, q, k, v, "causal")
    with pytest.raises(ValueError, match="4-D mask"):
        fth.attention_forward(layer, q, k, v, torch.ones(1, 5, dtype=torch.bool))
    with pytest.warns(UserWarning, match="eager"):
        fth.attention_forward(layer, q, k, v, None, output_attentions=True)


def test_importing_flashtile_does_not_import_transformers():
    code = "import sys, flashtile, flashtile.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.interpreter
def test_triton_kernels_in_the_interpreter():
    """The Triton kernels (interpreted on a CPU) behind a padded forward and a few decoding steps."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs on CPU-only machines")
    model = build(FAMILIES[0], num_hidden_layers=1)
    ids, mask = padded_batch(batch=2, seqlen=7)
    valid = mask.bool()
    logits = {impl: run(model, impl, input_ids=ids, attention_mask=mask)[valid] for impl in (NAME, "sdpa", "eager")}
    assert_rule("interpreter logits", logits[NAME], logits["eager"], logits["sdpa"], OUTPUT_FACTOR)
    ids, mask = left_padded_prompts()
    model.set_attn_implementation("sdpa")
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    model.set_attn_implementation(NAME)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("family", [FAMILIES[0], FAMILIES[4]], ids=lambda f: f.name)
def test_bf16_on_the_gpu(family):
    """bf16 on the GPU: the padded logits, and the logits of a prefill and decoding steps on fixed tokens, against
    the float32 model (ref) as close as the reference implementation in bf16 (base) gets."""
    model = build(family).cuda()
    reference = family.references[0]
    ids, mask = (t.cuda() for t in padded_batch(batch=4, seqlen=301))
    valid = mask.bool()
    ref = run(model, reference, input_ids=ids, attention_mask=mask)[valid].float()
    model.to(torch.bfloat16)
    base = run(model, reference, input_ids=ids, attention_mask=mask)[valid].float()
    got = run(model, NAME, input_ids=ids, attention_mask=mask)[valid].float()
    assert_rule("bf16 logits", got, ref, base, OUTPUT_FACTOR)
    prompt, prompt_mask = (t.cuda() for t in left_padded_prompts())
    steps = torch.randint(3, 128, (prompt.shape[0], 6), device="cuda")
    decoded = {}
    for dtype, impl in ((torch.float32, reference), (torch.bfloat16, reference), (torch.bfloat16, NAME)):
        model.to(dtype).set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            outputs = [model(input_ids=prompt, attention_mask=prompt_mask, past_key_values=cache).logits[:, -1]]
            seen = prompt_mask
            for t in range(steps.shape[1]):
                seen = torch.cat([seen, torch.ones_like(seen[:, :1])], 1)
                outputs.append(
                    model(input_ids=steps[:, t : t + 1], attention_mask=seen, past_key_values=cache).logits[:, -1]
                )
        decoded[(dtype, impl)] = torch.stack(outputs).float()
    assert_rule(
        "bf16 decoding logits", decoded[(torch.bfloat16, NAME)], decoded[(torch.float32, reference)],
        decoded[(torch.bfloat16, reference)], OUTPUT_FACTOR,
    )  # fmt: skip
