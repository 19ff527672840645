"""score_mod and mask_mod translated into Triton source, so the kernel can evaluate them inline.

A mod is traced once on 0-d tensors with ``make_fx`` into a graph of aten operations (the captured tensors appear
in it as constants, the very tensor objects the mod captured), then each node becomes one line of Triton: the
index arguments become the tile's index blocks (q_idx [BLOCK_M, 1], kv_idx [1, BLOCK_N], b and h scalars), so the
line computes the op for the whole tile by broadcasting. The translated subset (``OPS``, docs/flex.md):

- arithmetic: add, sub, mul, div, neg, abs, remainder, floor_divide, minimum, maximum, clamp, pow (scalar exponent);
- math: exp, exp2, log, log2, sqrt, rsqrt, tanh, sigmoid, and their backward ops (tanh_backward, sigmoid_backward);
- comparisons (eq, ne, lt, le, gt, ge), logical and bitwise and/or/not/xor on booleans, where;
- dtype casts (``.to``, ``_to_copy``), constants (Python scalars, 0-d tensors made in the mod);
- reading a captured tensor at index tensors, ``t[h, q_idx, kv_idx]`` or ``doc[q_idx]`` (all dimensions indexed):
  a masked pointer load (indices out of range read 0; negative ones count from the end, as in PyTorch), and a
  captured 0-d tensor used as a value.

Anything else raises ``Unsupported`` (the caller then runs the PyTorch route), as does a mod that reads an index's
value in Python (``if q_idx > 5``, ``int(h)``), which a trace cannot follow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from flashtile.flex.mods import INDEX_DTYPE

aten = torch.ops.aten


class Unsupported(Exception):
    """A mod the Triton translation does not cover; the message says which operation."""


_VALUE_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
                torch.Tensor.__float__, torch.Tensor.tolist}  # fmt: skip


class _TraceMode(TorchFunctionMode):
    """While tracing: ``x[i, j]`` with index tensors becomes ``aten.index`` (a gather the translation reads as a
    load), and reading a tensor's value in Python stops the trace (its branch would be fixed at the traced values)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _VALUE_READS:
            raise Unsupported("the mod reads a tensor's value in Python (control flow on indices)")
        if func is torch.Tensor.__getitem__:
            x, idx = args
            idx = idx if isinstance(idx, tuple) else (idx,)
            if all(isinstance(i, torch.Tensor) for i in idx):
                return aten.index.Tensor(x, list(idx))
        return func(*args, **(kwargs or {}))


def trace(fn: Callable, names: tuple[str, ...]) -> torch.fx.GraphModule:
    """The aten graph of ``fn`` called with 0-d tensors, one per name (float32 for 'score' and 'grad', int32 for the
    indices)."""
    args = [torch.zeros((), dtype=torch.float32 if n in ("score", "grad") else INDEX_DTYPE) for n in names]
    try:
        with _TraceMode():
            return make_fx(fn)(*args)
    except Unsupported:
        raise
    except Exception as error:  # a mod that cannot run on 0-d CPU tensors
        raise Unsupported(f"tracing the mod failed ({type(error).__name__}: {error})") from error


def score_grad_function(score_mod: Callable) -> Callable:
    """(score, b, h, q_idx, kv_idx, grad) -> grad * d score_mod / d score: the chain rule through score_mod."""

    def score_grad(score, b, h, q_idx, kv_idx, grad):
        with torch.enable_grad():
            score = score.detach().requires_grad_()
            (result,) = torch.autograd.grad(score_mod(score, b, h, q_idx, kv_idx), score, grad, allow_unused=True)
        return torch.zeros_like(grad) if result is None else result

    return score_grad


_TL_DTYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}  # fmt: skip

_BINARY = {
    aten.add: "({0} + {1})", aten.sub: "({0} - {1})", aten.mul: "({0} * {1})", aten.div: "({0} / {1})",
    aten.eq: "({0} == {1})", aten.ne: "({0} != {1})", aten.lt: "({0} < {1})", aten.le: "({0} <= {1})",
    aten.gt: "({0} > {1})", aten.ge: "({0} >= {1})", aten.bitwise_and: "({0} & {1})", aten.bitwise_or: "({0} | {1})",
    aten.bitwise_xor: "({0} ^ {1})", aten.logical_and: "(({0} != 0) & ({1} != 0))",
    aten.logical_or: "(({0} != 0) | ({1} != 0))", aten.logical_xor: "(({0} != 0) ^ ({1} != 0))",
    aten.minimum: "tl.minimum({0}, {1})", aten.maximum: "tl.maximum({0}, {1})",
    aten.remainder: "_remainder({0}, {1})", aten.floor_divide: "_floor_divide({0}, {1})",
    aten.tanh_backward: "({0} * (1.0 - {1} * {1}))", aten.sigmoid_backward: "({0} * {1} * (1.0 - {1}))",
}  # fmt: skip

_UNARY = {
    aten.neg: "(-{0})", aten.abs: "tl.abs({0})", aten.exp: "tl.exp({0})", aten.exp2: "tl.math.exp2({0})",
    aten.log: "tl.log({0})", aten.log2: "tl.math.log2({0})", aten.sqrt: "tl.sqrt({0})",
    aten.rsqrt: "tl.math.rsqrt({0})",
    aten.tanh: "tanh({0})", aten.sigmoid: "(1.0 / (1.0 + tl.exp(-{0})))", aten.logical_not: "({0} == 0)",
    aten.bitwise_not: "_bitwise_not({0})", aten.detach: "{0}", aten.clone: "{0}", aten.alias: "{0}",
    aten.lift_fresh_copy: "{0}", aten.lift_fresh: "{0}",
}  # fmt: skip

OPS = sorted({str(op) for op in (*_BINARY, *_UNARY)} | {"aten.where", "aten.clamp", "aten.pow", "aten.index",
              "aten._to_copy", "aten.scalar_tensor", "aten.full", "aten.new_ones", "aten.new_zeros",
              "aten.ones_like", "aten.zeros_like"})  # fmt: skip
"""The aten operations the translation covers."""

HELPERS = """
@triton.jit
def _remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _floor_divide(a, b):
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def _bitwise_not(x):
    if x.dtype == tl.int1:
        return x == 0
    return ~x
"""
"""Triton functions the translated lines call where PyTorch's semantics differ from Triton's operators (the sign
of a remainder, floor division, ``~`` on booleans)."""


class Captured:
    """The tensors the mods read, each once (by identity), and the kernel parameters that pass them: a pointer
    C<i>, then per dimension d its size C<i>_n<d> and stride C<i>_s<d>. Translated sources name them all with the
    token ``CAPTURED`` (``, CAPTURED`` in a signature or a call), replaced by ``params()`` once every mod is
    translated."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def name(self, tensor: torch.Tensor) -> str:
        for i, t in enumerate(self.tensors):
            if t is tensor:
                return f"C{i}"
        self.tensors.append(tensor)
        return f"C{len(self.tensors) - 1}"

    def params(self) -> str:
        """', C0, C0_n0, C0_s0, ...' for the kernel's and the mods' signatures ('' without captured tensors)."""
        names = []
        for i, t in enumerate(self.tensors):
            names += [f"C{i}"] + [f"C{i}_{kind}{d}" for d in range(t.dim()) for kind in ("n", "s")]
        return "".join(f", {n}" for n in names)

    def args(self) -> list:
        """The launch arguments matching ``params``."""
        found = []
        for t in self.tensors:
            found.append(t)
            for d in range(t.dim()):
                found += [t.shape[d], t.stride(d)]
        return found


def _overload_packet(target) -> object:
    return getattr(target, "overloadpacket", target)


def _literal(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else f'float("{value}")'
    if isinstance(value, int):
        return str(value)
    raise Unsupported(f"a constant of type {type(value).__name__}")


def translate(gm: torch.fx.GraphModule, fn_name: str, names: tuple[str, ...], captured: Captured, result: str) -> str:
    """The source of ``@triton.jit def fn_name(<names><captured params>)`` computing the graph ``gm`` on blocks;
    ``result`` casts what it returns: 'score' to float32, 'mask' to a boolean."""
    lines = ["@triton.jit", f"def {fn_name}({', '.join(names)}, CAPTURED):"]
    values: dict[str, str] = {}
    tensors: dict[str, tuple[str, torch.Tensor]] = {}  # captured tensors by node: pointer parameter, tensor
    zero_dim: dict[str, str] = {}  # a captured 0-d tensor used as a value: its load
    placeholders = iter(names)

    def ref(arg) -> str:
        if isinstance(arg, torch.fx.Node):
            if arg.name in zero_dim:
                return zero_dim[arg.name]
            if arg.name not in values:
                raise Unsupported(f"a captured tensor used as a whole ({arg.name}); index it with the mod's indices")
            return values[arg.name]
        return _literal(arg)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            values[node.name] = next(placeholders)
            continue
        if node.op == "get_attr":
            tensor = getattr(gm, node.target)
            if not isinstance(tensor, torch.Tensor):
                raise Unsupported(f"a captured object of type {type(tensor).__name__}")
            if tensor.requires_grad:
                raise Unsupported("a captured tensor requires grad (its gradient comes from the PyTorch route)")
            pointer = captured.name(tensor)
            if tensor.dim() == 0:
                zero_dim[node.name] = f"tl.load({pointer})"
            tensors[node.name] = pointer, tensor
            continue
        if node.op == "output":
            (out,) = node.args
            value = ref(out[0] if isinstance(out, (tuple, list)) else out)
            returned = f"tl.cast({value}, tl.float32)" if result == "score" else f"({value}) != 0"
            lines.append(f"    return {returned}")
            continue
        if node.op != "call_function":
            raise Unsupported(f"graph node {node.op}")
        if _overload_packet(node.target) is aten.index and node.args[0].name in tensors:
            expression = _load(*tensors[node.args[0].name], node.args[1], ref)
        else:
            expression = _expression(node, ref)
        lines.append(f"    v_{node.name} = {expression}")  # prefixed: a node named 'tanh' must not hide tanh()
        values[node.name] = f"v_{node.name}"
    return "\n".join(lines) + "\n"


def _expression(node: torch.fx.Node, ref) -> str:
    """The Triton expression of one call_function node."""
    op, args, kwargs = _overload_packet(node.target), node.args, node.kwargs
    if op in _BINARY and len(args) == 2:
        return _BINARY[op].format(ref(args[0]), ref(args[1]))
    if op in _UNARY and len(args) == 1:
        return _UNARY[op].format(ref(args[0]))
    if op is aten.where and len(args) == 3:
        return f"tl.where({ref(args[0])} != 0, {ref(args[1])}, {ref(args[2])})"
    if op is aten.clamp:
        x = ref(args[0])
        low = args[1] if len(args) > 1 else kwargs.get("min")
        high = args[2] if len(args) > 2 else kwargs.get("max")
        if low is not None:
            x = f"tl.maximum({x}, {ref(low)})"
        if high is not None:
            x = f"tl.minimum({x}, {ref(high)})"
        return x
    if op is aten.pow and isinstance(args[1], (int, float)) and not isinstance(args[0], (int, float)):
        if args[1] == 2:
            return f"({ref(args[0])} * {ref(args[0])})"
        return f"tl.math.exp2({_literal(float(args[1]))} * tl.math.log2({ref(args[0])}))"
    if op is aten._to_copy and set(kwargs) <= {"dtype", "device", "layout"}:
        dtype = kwargs.get("dtype")
        return ref(args[0]) if dtype is None else f"tl.cast({ref(args[0])}, {_tl_dtype(dtype)})"
    if op in (aten.scalar_tensor, aten.full, aten.new_ones, aten.new_zeros, aten.ones_like, aten.zeros_like):
        return _constant(op, args, kwargs)
    raise Unsupported(f"the operation {node.target} (outside the translated subset)")


def _tl_dtype(dtype: torch.dtype) -> str:
    if dtype not in _TL_DTYPES:
        raise Unsupported(f"a cast to {dtype}")
    return _TL_DTYPES[dtype]


def _constant(op, args, kwargs) -> str:
    """A 0-d constant made in the mod: a Python literal cast to its dtype."""
    if op is aten.scalar_tensor:
        value = args[0]
    elif op is aten.full:
        if list(args[0]) != []:
            raise Unsupported("aten.full of a shape other than ()")
        value = args[1]
    else:
        if op in (aten.new_ones, aten.new_zeros) and list(args[1]) != []:
            raise Unsupported(f"{op} of a shape other than ()")
        value = 1 if op in (aten.new_ones, aten.ones_like) else 0
    dtype = kwargs.get("dtype")
    if dtype is None:
        return _literal(value)
    return f"tl.full([], {_literal(value)}, {_tl_dtype(dtype)})"


def _load(pointer: str, tensor: torch.Tensor, indices, ref) -> str:
    """A masked load of captured ``tensor`` (parameter ``pointer``) at the index expressions (all dimensions
    indexed)."""
    if len(indices) != tensor.dim() or any(i is None for i in indices):
        raise Unsupported("a captured tensor indexed in some but not all dimensions (the result must be 0-d)")
    offsets, in_range = [], []
    for d, index in enumerate(indices):
        i = f"tl.cast({ref(index)}, tl.int64)"
        i = f"tl.where({i} < 0, {i} + {pointer}_n{d}, {i})"  # negative indices count from the end
        offsets.append(f"({i}) * {pointer}_s{d}")
        in_range.append(f"(({i}) >= 0) & (({i}) < {pointer}_n{d})")
    return f"tl.load({pointer} + {' + '.join(offsets)}, mask={' & '.join(in_range)}, other=0)"
