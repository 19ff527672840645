"""The project's tolerance rule as test assertions (the rule itself lives in
``flashtile.reference.within_tolerance``, shared with ``flashtile check``).

For an output or gradient X that flashtile computes in dtype t:
  ref  = the oracle on the inputs upcast (float64 on a CPU, float32 on a GPU), cast back to t
  base = the oracle computed entirely in t: the error a plain implementation makes
  pass when max|X - ref| <= F * max|base - ref| + floor, F = 2 for outputs and 3 for gradients,
  floor = 2 ulps of t at the largest |ref| (at 1.0 where ref is all zero).
"""

from __future__ import annotations

import torch

from flashtile.reference import GRADIENT_FACTOR, OUTPUT_FACTOR, reference_results, within_tolerance


def assert_within_rule(name: str, x: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> None:
    """Assert the tolerance rule for X (in the dtype of ``ref``) against ref and base."""
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)}, expected {tuple(ref.shape)}"
    assert x.dtype == ref.dtype, f"{name}: dtype {x.dtype}, expected {ref.dtype}"
    assert not torch.isnan(x).any(), f"{name}: {int(torch.isnan(x).sum())} NaN elements (unwritten or wrong)"
    factor = OUTPUT_FACTOR if name in ("out", "lse", "max_scores") else GRADIENT_FACTOR
    result = within_tolerance(x, ref, base, factor)
    assert result.ok, (
        f"{name}: max error {result.error:.3e} > bound {result.bound:.3e} "
        f"({factor} x plain low-precision error {result.base_error:.3e} + 2 ulps), or infinities differ"
    )


def check_against_oracle(results: dict[str, torch.Tensor], q, k, v, dout, dlse=None, **options) -> None:
    """Apply the rule to every entry of ``results`` (named as in flashtile.reference.RESULT_NAMES, plus
    "dsink" with a learnable_sink). ``options`` go to the oracle: softmax_scale, causal, window_size,
    mask, softcap, alibi_slopes, learnable_sink."""
    precise = torch.float64 if q.device.type == "cpu" or q.dtype == torch.float32 else torch.float32
    ref = reference_results(q, k, v, dout, precise, dlse, **options)
    base = reference_results(q, k, v, dout, q.dtype, dlse, **options)
    for name, x in results.items():
        assert_within_rule(name, x, ref[name], base[name])
