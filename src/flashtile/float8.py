"""float8 inputs of the attention forward (FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale``).

q, k and v in ``torch.float8_e4m3fn`` hold quantized values; per (batch entry, KV head) float32 descale factors
give the values they stand for, x * x_descale. Attention is

    out = softmax(softmax_scale * (q * q_descale) @ (k * k_descale)^T) @ (v * v_descale)

in bfloat16 (float8 is an input format: the output and the LSE keep more precision). A query head uses the
factor of its KV head, as FlashAttention-3 does (the factors are (batch, nheads_k)). The checks here run at the
public functions, before anything launches; the call's factors travel as one option, ``AttentionOptions.descale``
(``combined``): (batch, nheads_k, 2) float32 [q_descale * k_descale, v_descale], None for all ones.

Forward only: float8 inputs take no gradient (inference prefill is their use), so a call that would need one is
refused. The options the float8 kernel (``ops.fp8``) computes: causal, sliding windows, any softmax_scale,
MQA/GQA, seqlen_q != seqlen_k, head dims multiples of 8 up to 256 (one for q, k and v). Not: dropout, softcap,
ALiBi, a learnable sink, packed variable-length batches, SDPA's attn_mask.
"""

from __future__ import annotations

import torch

from flashtile.errors import InputError, InputTypeError, UnsupportedDtypeError
from flashtile.options import AttentionOptions

FLOAT8 = (torch.float8_e4m3fn,)
"""The float8 dtypes q, k and v may have (e4m3: 3 mantissa bits, range +-448)."""

OUTPUT_DTYPE = torch.bfloat16
"""The dtype of out for float8 inputs."""

DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of out for inputs of ``dtype``: bfloat16 for float8, the inputs' own otherwise."""
    return OUTPUT_DTYPE if dtype in FLOAT8 else dtype


def is_float8(t: object) -> bool:
    """Whether ``t`` is a tensor of a one-byte float dtype (float8 e4m3 or e5m2: ``check_float8`` tells which)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() == 1


def check_float8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descales: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> bool:
    """Check a call's float8 inputs before their shapes are (``checks.check_qkv``); whether they are float8.

    Raises InputError / InputTypeError for: descale factors with inputs that are not float8; float8 inputs other
    than e4m3 (``torch.float8_e4m3fn``), or not all three of it; a gradient wanted at q, k or v. ``descale_of``
    checks the factors' shapes, ``check_options`` the options."""
    given = [name for name, d in zip(DESCALE_NAMES, descales, strict=True) if d is not None]
    if not any(is_float8(t) for t in (q, k, v)):
        if given:
            raise InputError(
                f"{', '.join(given)} given with inputs of dtype {getattr(q, 'dtype', type(q).__name__)}: descale "
                "factors dequantize float8 inputs only. Pass q, k and v as torch.float8_e4m3fn, or leave the descale "
                "factors out."
            )
        return False
    dtypes = tuple(getattr(t, "dtype", type(t).__name__) for t in (q, k, v))
    if any(d not in FLOAT8 for d in dtypes):
        raise UnsupportedDtypeError(
            f"float8 attention takes q, k and v all in torch.float8_e4m3fn, got {dtypes[0]}, {dtypes[1]}, "
            f"{dtypes[2]}. Quantize e4m3 (x.to(torch.float8_e4m3fn), with a descale factor per (batch, KV head)); "
            "float8_e5m2 (2 mantissa bits, for gradients) is not taken as an attention input."
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise InputError(
            "float8 attention is forward only: q, k or v requires a gradient, and there is no float8 backward "
            "(inference prefill is its use). Call it under torch.no_grad() / torch.inference_mode(), or detach the "
            "inputs; to train, use bfloat16 inputs."
        )
    return True


def descale_of(
    q: torch.Tensor, k: torch.Tensor, descales: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
) -> torch.Tensor | None:
    """The factors of float8 q, k (checked by ``check_float8`` and ``checks.check_qkv``) as the option
    ``AttentionOptions.descale`` (``combined``), after checking each: a float32 (batch, nheads_k) tensor on q's
    device (InputTypeError / InputError otherwise)."""
    batch, nheads_k = q.shape[0], k.shape[2]
    for name, d in zip(DESCALE_NAMES, descales, strict=True):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            got = d.dtype if isinstance(d, torch.Tensor) else type(d).__name__
            raise InputTypeError(
                f"{name} must be a float32 tensor of shape (batch, nheads_k) = ({batch}, {nheads_k}), got {got}. "
                f"Pass torch.tensor(...) of dtype torch.float32 (a scalar factor: torch.full(({batch}, {nheads_k}), "
                "x, dtype=torch.float32))."
            )
        if tuple(d.shape) != (batch, nheads_k):
            raise InputError(
                f"{name} must have shape (batch, nheads_k) = ({batch}, {nheads_k}) (one factor per batch entry and "
                f"KV head, as FlashAttention-3), got {tuple(d.shape)}. Expand a per-tensor factor: "
                f"{name}.expand({batch}, {nheads_k})."
            )
        if d.device != q.device:
            raise InputError(f"{name} must be on q's device {q.device}, got {d.device}.")
    return combined(*descales, batch, nheads_k, q.device)


def combined(
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    batch: int,
    nheads_k: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The factors as the kernels take them: (batch, nheads_k, 2) float32 contiguous, [..., 0] = q_descale *
    k_descale (it multiplies the scores with softmax_scale) and [..., 1] = v_descale (it multiplies out); None
    (all ones) when none is given, a missing one counting as ones."""
    if q_descale is None and k_descale is None and v_descale is None:
        return None
    ones = torch.ones((batch, nheads_k), dtype=torch.float32, device=device)
    q_d, k_d, v_d = (ones if d is None else d for d in (q_descale, k_descale, v_descale))
    return torch.stack((q_d * k_d, v_d.expand(batch, nheads_k)), dim=-1).contiguous()


def dequantized(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float8 (q, k, v) as ``dtype`` values that give the same attention: q as it is, k times q_descale *
    k_descale and v times v_descale (``combined``'s factors, per batch entry and KV head), so that
    q . (k * q_descale * k_descale) = (q * q_descale) . (k * k_descale)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if descale is None:
        return q, k, v
    factors = descale.to(dtype)[:, None, :, None, :]  # (batch, 1, nheads_k, 1, 2) against (batch, seqlen, Hk, D)
    return q, k * factors[..., 0], v * factors[..., 1]


def refusals(options: AttentionOptions) -> tuple[str | None, ...]:
    """The options of a float8 call that the float8 forward does not compute, by their arguments' names (None where
    an option is off): the one list both the face (``check_options``) and the kernel family's ``qualifies`` read."""
    return (
        "dropout_p > 0" if options.dropout_p > 0.0 else None,
        "softcap" if options.softcap != 0.0 else None,
        "alibi_slopes" if options.alibi_slopes is not None else None,
        "learnable_sink" if options.learnable_sink is not None else None,
        "attn_mask" if options.attn_mask is not None else None,
    )


def check_options(options: AttentionOptions) -> None:
    """Raise InputError if a float8 call asks for an option ``refusals`` lists, on every path (the CPU path, which
    dequantizes, could compute them, but a call must not work on one device and fail on another)."""
    refused = [reason for reason in refusals(options) if reason is not None]
    if refused:
        raise InputError(
            f"float8 attention does not compute {', '.join(refused)}: it takes causal, window_size, softmax_scale, "
            "MQA/GQA and any lengths. Leave those options out, or cast the inputs to bfloat16 (after dequantizing)."
        )
