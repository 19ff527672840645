"""The tolerance rule of shared DESIGN.md, and the oracle results to apply it to.

For an output or gradient X that flashtile computes in dtype t:
  ref  = the oracle on the inputs upcast (float64 on a CPU, float32 on a GPU), cast back to t
  base = the oracle computed entirely in t: the error a plain implementation makes
  pass when max|X - ref| <= F * max|base - ref| + floor, F = 2 for outputs and 3 for gradients,
  floor = 2 ulps of t at the largest |ref| (at 1.0 where ref is all zero).
"""

from __future__ import annotations

import torch

from flashtile.reference import attention_reference

OUTPUT_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
NAMES = ("out", "lse", "dq", "dk", "dv")


def assert_within_rule(name: str, x: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> None:
    """Assert the tolerance rule for X (in the dtype of ``ref``) against ref and base."""
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)}, expected {tuple(ref.shape)}"
    assert x.dtype == ref.dtype, f"{name}: dtype {x.dtype}, expected {ref.dtype}"
    eps = torch.finfo(ref.dtype).eps
    x, ref, base = x.double(), ref.double(), base.double()
    assert not torch.isnan(x).any(), f"{name}: {int(torch.isnan(x).sum())} NaN elements (unwritten or wrong)"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(x), finite) and torch.equal(x[~finite], ref[~finite]), (
        f"{name}: its infinities differ from the oracle's"
    )
    x, ref, base = x[finite], ref[finite], base[finite]
    if ref.numel() == 0:
        return
    factor = OUTPUT_FACTOR if name in ("out", "lse") else GRADIENT_FACTOR
    error = (x - ref).abs().max().item()
    base_error = (base - ref).abs().max().item()
    # A gradient that is exactly 0 (one visible key: P = 1, dS = 0) has no scale of its own: use 1.
    floor = 2 * eps * (ref.abs().max().item() or 1.0)
    assert error <= factor * base_error + floor, (
        f"{name}: max error {error:.3e} > {factor} x plain low-precision error {base_error:.3e} + floor {floor:.1e}"
    )


def oracle(q, k, v, dout, precise: torch.dtype, dlse=None, **mask_args) -> dict[str, torch.Tensor]:
    """Oracle out, lse and gradients of (out * dout).sum() (+ (lse * dlse).sum() if dlse is given)
    for q, k, v, computed in ``precise`` and cast back: out and gradients to q's dtype, lse to float32."""
    leaves = [t.detach().to(precise).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, **mask_args)
    loss = (out * dout.to(precise)).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(lse == float("-inf"), 0.0) * dlse.to(precise)).sum()
    loss.backward()
    grads = [t.grad.to(q.dtype) for t in leaves]
    return dict(zip(NAMES, [out.detach().to(q.dtype), lse.detach().float(), *grads], strict=True))


def check_against_oracle(results: dict[str, torch.Tensor], q, k, v, dout, dlse=None, **mask_args) -> None:
    """Apply the rule to every entry of ``results`` (named as in NAMES)."""
    precise = torch.float64 if q.device.type == "cpu" else torch.float32
    ref = oracle(q, k, v, dout, precise, dlse, **mask_args)
    base = oracle(q, k, v, dout, q.dtype, dlse, **mask_args)
    for name, x in results.items():
        assert_within_rule(name, x, ref[name], base[name])
