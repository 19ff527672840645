"""Which kernel family runs a call's forward and backward, and why each faster family does not apply.

``flashtile.explain(q, k, v, **options)`` takes ``flash_attn_func``'s arguments and asks the dispatcher
(``flashtile._backend``) what it would run, launching nothing. It works for tensors on any device: the conditions of
the sm_90 Gluon kernels are evaluated in full even where the device is not an sm_90 GPU (which is then one reason
among them). ``flashtile info --explain`` prints the same for a shape given on the command line.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from flashtile import _backend
from flashtile.checks import window_bounds
from flashtile.interface import flash_attn_func, prepared


@dataclass(frozen=True)
class PassExplanation:
    """The family that runs one pass (``path``) and, fastest first, each faster family with the reasons it does not
    apply (``passed_over``)."""

    pass_name: str
    path: str
    passed_over: tuple[tuple[str, tuple[str, ...]], ...]

    def __str__(self) -> str:
        lines = [f"{self.pass_name}: {self.path}"]
        lines += [f"  not {family}: {'; '.join(reasons)}" for family, reasons in self.passed_over]
        return "\n".join(lines)


@dataclass(frozen=True)
class Explanation:
    """``explain``'s answer: the forward's and the backward's ``PassExplanation``."""

    forward: PassExplanation
    backward: PassExplanation

    def __str__(self) -> str:
        return f"{self.forward}\n{self.backward}"


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> Explanation:
    """Which kernel family would run ``flash_attn_func(q, k, v, *args, **kwargs)``'s forward and backward, and why
    each faster one does not apply. Nothing is launched and no randomness is drawn; the inputs are validated as the
    call would validate them (a head dim that is not a multiple of 8 is explained as the padded call it becomes).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); k, v: (batch_size, seqlen_k, nheads_k, headdim[_v]), as
            ``flashtile.flash_attn_func`` takes them: only their shapes, dtypes, devices and layouts matter
        args, kwargs: ``flashtile.flash_attn_func``'s other arguments (dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, learnable_sink, q_descale, k_descale, v_descale);
            deterministic=False, its default, lets the backward take the sm_90 kernel's atomics

    Returns:
        Explanation: ``.forward`` and ``.backward`` (``PassExplanation``: ``path``, ``passed_over``); ``str()``
        gives one line per pass, then one per family passed over with its reasons. Families, fastest first:
        ``sm90-gluon``, ``triton``, then ``triton-interpreter`` or ``cpu-torch`` / ``cpu-tiled``
        (``flashtile._backend``); float8 inputs: ``triton-fp8`` or the CPU path, and no backward ("none").

    Raises:
        the errors ``flashtile.flash_attn_func`` raises for these arguments (flashtile.InputError,
        flashtile.InputTypeError, ...), before anything else
    """
    call = inspect.signature(flash_attn_func).bind(q, k, v, *args, **kwargs)
    call.apply_defaults()
    given = call.arguments
    dropout_p = given["dropout_p"]
    window_left, window_right = window_bounds(given["window_size"], given["causal"])
    q, k, v, options, _ = prepared(
        q, k, v, softmax_scale=given["softmax_scale"], window_left=window_left, window_right=window_right,
        softcap=given["softcap"], alibi_slopes=given["alibi_slopes"], learnable_sink=given["learnable_sink"],
        dropout_p=dropout_p, deterministic=given["deterministic"],
        rng_state=torch.zeros(2, dtype=torch.int64, device=q.device) if dropout_p else None,  # any: nothing runs
        descales=(given["q_descale"], given["k_descale"], given["v_descale"]),
    )  # fmt: skip
    choices = _backend.pass_choices(q, k, v, options, every=True)
    forward, backward = (
        PassExplanation(name, choice.path, tuple((family, v.reasons) for family, v in choice.passed_over))
        for name, choice in choices.items()
    )
    return Explanation(forward, backward)
