"""Constants and math of the Triton kernels of every operation (attention forward and backward, decode)."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MINUS_TWO_LOG2E = tl.constexpr(-2.8853900817779268)


IEEE = tl.constexpr("ieee")
"""``tl.dot``'s input_precision for float32 tiles (float32 inputs): IEEE float32 products. Triton's default for
float32 operands is TF32 (10-bit mantissas), which would give float32 inputs bf16-like errors. Each product
writes ``input_precision=IEEE if x.dtype == tl.float32 else None``, decided at compile time: 16-bit tiles
compile exactly as a plain ``tl.dot`` (the same machine code; a helper function around ``tl.dot`` changed the
instruction order)."""


@triton.jit
def tanh(x):
    """tanh from exp2 (the interpreter has no libdevice): with e = exp(-2|x|) in (0, 1] nothing
    overflows for any x, tanh(|x|) = (1 - e) / (1 + e), and the sign is restored at the end."""
    e = tl.math.exp2(tl.abs(x) * MINUS_TWO_LOG2E)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)
