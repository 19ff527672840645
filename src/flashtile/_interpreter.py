"""Fixes to the Triton interpreter (``TRITON_INTERPRET=1``) so that flashtile's kernels compute there what they
compute on a GPU.

``flashtile._backend`` calls ``apply`` once, where it reads ``TRITON_INTERPRET``, before any kernel is defined or
runs; a second call changes nothing. The interpreter runs a kernel's operations on numpy arrays, one program after
another, and four of its operations differ from a GPU's (triton 3.7.1 and 3.9.0 alike):

* **bf16 ``tl.dot``.** numpy has no bfloat16, so the interpreter holds bf16 values as their raw 16 bits, and its
  ``tl.dot`` multiplies those integers: a bf16 attention's output is off by ~1e9. Fixed: bf16 operands are widened
  to fp32 before the product. That is exact (a bf16 value is an fp32 with the low 16 bits zero) and is what a
  tensor core computes: exact products, summed in the fp32 accumulator.
* **fp32 -> bf16 casts** drop the low 16 bits (round toward zero), where GPUs round to nearest even; outputs
  rounded to bf16 would err up to twice as much as on a GPU. Fixed: rounded to nearest even, by torch's cast.
* **fp32 -> float8 e4m3 casts** (``create_fp_to_fp``) do not round to nearest (a value of 12.1 came out 8 where a
  GPU gives 12). Fixed: rounded to nearest even, by torch's cast. (float8 ``tl.dot`` is exact: the interpreter
  widens the operands to fp16, which holds every e4m3 value.)
* **Masks of loads, stores and atomics.** A comparison of scalars (``split < num_splits``) combined into a block mask
  reaches the load as int32 zeros and ones (the scalar comparison's handle keeps its operands' int32 type, and
  broadcasting it to a block converts its data to that type); triton 3.7 reads those as true and false, triton
  3.9 refuses them (``ValueError: mask has unsupported dtype``).
  Fixed: every mask is read as bool, as the GPU's one-bit mask is.

The fixes replace methods of the interpreter's ``InterpreterBuilder`` (``create_dot``, ``cast_impl``,
``create_fp_to_fp``, ``create_masked_load``, ``create_masked_store``, ``create_atomic_rmw``). Where a future
interpreter lacks the first two as they are known here, bf16 would come out wrong, so ``check_launch`` refuses
launches with bf16 tensors instead (``BF16_REFUSED`` says why); float16 and float32 need neither fix.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

BF16_REFUSED: str | None = None
"""Why bf16 cannot run in this interpreter (its internals are not the ones the fixes replace), or None."""

_APPLIED = "_flashtile_fixes_applied"  # marks the patched InterpreterBuilder class


def _params(method) -> list[str]:
    """The parameter names of ``method`` after ``self``."""
    return list(inspect.signature(method).parameters)[1:]


def _with_bool_mask(method, as_bool):
    """``method`` with its argument ``mask`` (by position or by name) passed through ``as_bool``."""
    index = _params(method).index("mask")

    def fixed(self, *args, **kwargs):
        if "mask" in kwargs:
            kwargs["mask"] = as_bool(kwargs["mask"])
        elif len(args) > index:
            args = (*args[:index], as_bool(args[index]), *args[index + 1 :])
        return method(self, *args, **kwargs)

    return fixed


def apply() -> None:
    """Install the fixes in the Triton interpreter (this module's docstring says which and why); idempotent.

    Sets ``BF16_REFUSED`` where the bf16 fixes cannot be installed."""
    global BF16_REFUSED
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError as error:  # the interpreter's module moved: fp16 runs or fails on its own
        BF16_REFUSED = f"triton.runtime.interpreter could not be imported ({error})"
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None:
        BF16_REFUSED = f"triton {triton.__version__}'s interpreter has no InterpreterBuilder or TensorHandle"
        return
    if getattr(builder, _APPLIED, False):
        return
    setattr(builder, _APPLIED, True)

    def as_bool(mask):
        if isinstance(mask, np.ndarray):  # tensor-descriptor loads pass a plain array
            return mask if mask.dtype == np.bool_ else mask.astype(np.bool_)
        if mask is None or mask.data.dtype == np.bool_:
            return mask
        return handle(mask.data.astype(np.bool_), tl.int1)

    for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw"):
        method = getattr(builder, name, None)
        if method is not None and "mask" in _params(method):
            setattr(builder, name, _with_bool_mask(method, as_bool))

    dot, cast = getattr(builder, "create_dot", None), getattr(builder, "cast_impl", None)
    if dot is None or cast is None or _params(dot)[:2] != ["a", "b"] or _params(cast) != ["src", "dst_type"]:
        BF16_REFUSED = (
            f"triton {triton.__version__}'s interpreter does not have the create_dot(a, b, ...) and "
            "cast_impl(src, dst_type) that flashtile's bf16 fixes replace"
        )
        return

    def widened(x):
        """A bf16 operand as fp32 (its 16 bits become an fp32's high half), others as they are."""
        if x.dtype.scalar != tl.bfloat16:
            return x
        return handle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, *args, **kwargs):
        return dot(self, widened(a), widened(b), *args, **kwargs)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.array(src.data, dtype=np.float32))
            return handle(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl  # create_fp_trunc and the other casts call self.cast_impl

    fp_to_fp = getattr(builder, "create_fp_to_fp", None)
    if fp_to_fp is not None and _params(fp_to_fp)[:2] == ["src", "dst_type"]:

        def create_fp_to_fp(self, src, dst_type, *args, **kwargs):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
                values = torch.from_numpy(np.array(src.data, dtype=np.float32))
                return handle(values.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)
            return fp_to_fp(self, src, dst_type, *args, **kwargs)

        builder.create_fp_to_fp = create_fp_to_fp


def check_launch(args) -> None:
    """Raise NotImplementedError if bf16 cannot run in this interpreter (``BF16_REFUSED``) and an argument of an
    interpreted launch is a bf16 tensor (or a tensor descriptor of one)."""
    if BF16_REFUSED is None:
        return
    for a in args:
        tensor = a if isinstance(a, torch.Tensor) else getattr(a, "base", None)  # a TensorDescriptor's base
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16:
            raise NotImplementedError(
                f"bfloat16 inputs cannot run in the Triton interpreter (TRITON_INTERPRET=1) here: {BF16_REFUSED}, "
                "so its bf16 products would be wrong. Use float16 inputs, unset TRITON_INTERPRET (flashtile's CPU "
                "path computes bf16), or install triton 3.7.1 or 3.9.0."
            )
