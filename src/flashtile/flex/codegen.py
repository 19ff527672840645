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

Captured tensors that require grad get their gradients from the dQ kernel: the chain rule through score_mod gives
the gradient at every read ``t[i, j]`` (``score_grad_function``), which is added atomically into a float32 buffer
at the same indices (``_accumulate``); such a tensor must only be read at indices (one used whole, a 0-d one
included, is outside the subset). Anything else raises ``Unsupported`` (the caller then runs the PyTorch route), as
does a mod that reads an index's value in Python (``if q_idx > 5``, ``int(h)``), which a trace cannot follow.
``key`` says what a trace of a mod depends on: translations and recognised patterns are kept by it.
"""

from __future__ import annotations

import functools
import inspect
import types
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
    load), and reading a tensor's value in Python stops the trace (its branch would be fixed at the traced values).
    With ``leaves`` (a list), a read of a captured tensor that requires grad comes from ``x.detach()`` and is made a
    leaf of its own, appended to ``leaves``: the gradient at that read is what the backward scatters into x's."""

    def __init__(self, leaves: list | None = None) -> None:
        super().__init__()
        self.leaves = leaves

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _VALUE_READS:
            raise Unsupported("the mod reads a tensor's value in Python (control flow on indices)")
        if func is torch.Tensor.__getitem__:
            x, idx = args
            idx = idx if isinstance(idx, tuple) else (idx,)
            if all(isinstance(i, torch.Tensor) for i in idx):
                if self.leaves is not None and x.requires_grad and x.grad_fn is None:
                    leaf = aten.index.Tensor(x.detach(), list(idx)).requires_grad_()
                    self.leaves.append(leaf)
                    return leaf
                return aten.index.Tensor(x, list(idx))
        return func(*args, **(kwargs or {}))


def trace(
    fn: Callable, names: tuple[str, ...], device: torch.device, leaves: list | None = None
) -> torch.fx.GraphModule:
    """The aten graph of ``fn`` called with 0-d tensors on ``device`` (the inputs'), one per name (float32 for
    'score' and 'grad', int32 for the indices); ``leaves``: as ``_TraceMode``'s."""
    args = [torch.zeros((), dtype=torch.float32 if n in ("score", "grad") else INDEX_DTYPE, device=device)
            for n in names]  # fmt: skip
    try:
        with _TraceMode(leaves):
            return make_fx(fn)(*args)
    except Unsupported:
        raise
    except Exception as error:  # a mod that cannot run on 0-d CPU tensors
        raise Unsupported(f"tracing the mod failed ({type(error).__name__}: {error})") from error


class _Same:
    """An object compared by identity (a tensor's ``==`` compares values), kept alive by the key holding it so that
    its id is not reused while the key exists."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _referred(fn) -> list:
    """What ``fn`` reads besides its arguments: its closure cells and the globals it names; for a bound method or a
    callable object also the object's attributes (and the values of dict attributes: a module's parameters and
    buffers); for a functools.partial its function and bound arguments."""
    if isinstance(fn, functools.partial):
        return [fn.func, *fn.args, *fn.keywords.values()]
    owner = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, types.FunctionType) and callable(fn):  # a callable object
        owner, func = fn, getattr(type(fn).__call__, "__func__", type(fn).__call__)
    values = []
    code = getattr(func, "__code__", None)
    if code is not None:
        for cell in func.__closure__ or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        values += [func.__globals__[n] for n in code.co_names if n in func.__globals__]
    if owner is not None and hasattr(owner, "__dict__"):
        attrs = list(vars(owner).values())
        values += attrs + [v for d in attrs if isinstance(d, dict) for v in d.values()]
    return values


def key(value, depth: int = 0) -> object:
    """What a translation depends on in ``value``: a tensor by identity (with its requires_grad), a Python scalar by
    value (a trace writes it into the graph as a constant), containers and functions by what they hold and read
    (``_referred``; callable objects only as the mod itself, at depth 0), anything else by identity."""
    if isinstance(value, torch.Tensor):
        return _Same(value), value.requires_grad
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value), value
    if depth > 4:
        return _Same(value)
    if isinstance(value, (tuple, list)):
        return tuple(key(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return tuple((str(k), key(v, depth + 1)) for k, v in value.items())
    function = isinstance(value, (types.FunctionType, types.MethodType, functools.partial))
    if function or (depth == 0 and callable(value) and not isinstance(value, type)):
        return _Same(value), *(key(v, depth + 1) for v in _referred(value))
    return _Same(value)


def score_grad_function(score_mod: Callable, leaves: list) -> Callable:
    """(score, b, h, q_idx, kv_idx, grad) -> (grad * d score_mod / d score, then grad * d score_mod / d r for each
    read r of a captured tensor that requires grad, in the order of ``leaves``): the chain rule through score_mod.
    Trace it with ``trace(..., leaves=leaves)``."""

    def score_grad(score, b, h, q_idx, kv_idx, grad):
        leaves.clear()
        with torch.enable_grad():
            score = score.detach().requires_grad_()
            out = score_mod(score, b, h, q_idx, kv_idx)
            found = torch.autograd.grad(out, [score, *leaves], grad, allow_unused=True)
        return tuple(torch.zeros_like(grad) if g is None else g for g in found)

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
    C<i>, then per dimension d its size C<i>_n<d> and stride C<i>_s<d>; for a tensor that requires grad, also its
    gradient buffer G<i> (float32) and the buffer's strides G<i>_s<d>. Translated sources name them all with the
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

    @property
    def needing_grad(self) -> list[torch.Tensor]:
        """The captured tensors that require grad, in order."""
        return [t for t in self.tensors if t.requires_grad]

    def params(self) -> str:
        """', C0, C0_n0, C0_s0, ...' for the kernel's and the mods' signatures ('' without captured tensors)."""
        names = []
        for i, t in enumerate(self.tensors):
            names += [f"C{i}"] + [f"C{i}_{kind}{d}" for d in range(t.dim()) for kind in ("n", "s")]
            if t.requires_grad:
                names += [f"G{i}"] + [f"G{i}_s{d}" for d in range(t.dim())]
        return "".join(f", {n}" for n in names)

    def args(self, grads: list[torch.Tensor] | None = None) -> list:
        """The launch arguments matching ``params``: ``grads`` are the gradient buffers of ``needing_grad`` (None
        outside the backward, where each tensor stands in for its buffer, which is then not written)."""
        found = []
        grads = iter(grads or [t for t in self.tensors if t.requires_grad])
        for t in self.tensors:
            found.append(t)
            for d in range(t.dim()):
                found += [t.shape[d], t.stride(d)]
            if t.requires_grad:
                g = next(grads)
                found += [g, *(g.stride(d) for d in range(t.dim()))]
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
    ``result`` says what it returns: 'score' (cast to float32), 'mask' (a boolean), or 'grad' for the graph of
    ``score_grad_function``: it returns the score's gradient and, under its constexpr parameter ACCUMULATE, adds the
    gradient at each read of a captured tensor that requires grad into that tensor's buffer (``_accumulate``)."""
    extra = ", ACCUMULATE: tl.constexpr" if result == "grad" else ""
    lines = ["@triton.jit", f"def {fn_name}({', '.join(names)}, CAPTURED{extra}):"]
    reads: list[tuple[torch.fx.Node, str, torch.Tensor]] = []  # reads of tensors that require grad
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
            if (
                result == "grad"
                and tensor.requires_grad
                and any(_overload_packet(user.target) is not aten.detach for user in node.users)
            ):
                raise Unsupported("a captured tensor that requires grad is used other than read at indices")
            pointer = captured.name(tensor)
            if tensor.dim() == 0:
                zero_dim[node.name] = f"tl.load({pointer})"
            tensors[node.name] = pointer, tensor
            continue
        if node.op == "output":
            (out,) = node.args
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if result == "grad":
                if len(outs) != len(reads) + 1:
                    raise Unsupported("reads of captured tensors that require grad the trace could not follow")
                lines += _accumulate(reads, outs[1:], ref, values)
            value = ref(outs[0])
            returned = f"({value}) != 0" if result == "mask" else f"tl.cast({value}, tl.float32)"
            lines.append(f"    return {returned}")
            continue
        if node.op != "call_function":
            raise Unsupported(f"graph node {node.op}")
        op = _overload_packet(node.target)
        if op in (aten.detach, aten.alias) and node.args[0].name in tensors:  # the same tensor: its reads are leaves
            tensors[node.name] = tensors[node.args[0].name]
            if tensors[node.name][1].dim() == 0:
                zero_dim[node.name] = zero_dim[node.args[0].name]
            continue
        if op is aten.index and node.args[0].name in tensors:
            pointer, tensor = tensors[node.args[0].name]
            expression = _load(pointer, tensor, node.args[1], ref)
            if result == "grad" and tensor.requires_grad:
                reads.append((node, pointer, tensor))
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


def _offsets(pointer: str, tensor: torch.Tensor, indices, ref, strides: str) -> tuple[str, str]:
    """(offset, in-range mask) of ``tensor`` (parameter ``pointer``) at the index expressions, all dimensions
    indexed; ``strides`` names the stride parameters (``C<i>_s`` or a gradient buffer's ``G<i>_s``)."""
    if len(indices) != tensor.dim() or any(i is None for i in indices):
        raise Unsupported("a captured tensor indexed in some but not all dimensions (the result must be 0-d)")
    offsets, in_range = [], []
    for d, index in enumerate(indices):
        i = f"tl.cast({ref(index)}, tl.int64)"
        i = f"tl.where({i} < 0, {i} + {pointer}_n{d}, {i})"  # negative indices count from the end
        offsets.append(f"({i}) * {strides}{d}")
        in_range.append(f"(({i}) >= 0) & (({i}) < {pointer}_n{d})")
    return " + ".join(offsets) or "0", " & ".join(in_range) or "True"


def _load(pointer: str, tensor: torch.Tensor, indices, ref) -> str:
    """A masked load of captured ``tensor`` (parameter ``pointer``) at the index expressions."""
    offset, in_range = _offsets(pointer, tensor, indices, ref, f"{pointer}_s")
    return f"tl.load({pointer} + {offset}, mask={in_range}, other=0)"


def _depends_on(node: torch.fx.Node, values: dict[str, str]) -> set[str]:
    """The arguments (score, b, h, q_idx, kv_idx, grad) a node's value depends on (``values`` names the graph's
    placeholders by them)."""
    found, todo, seen = set(), [node], set()
    while todo:
        n = todo.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "placeholder":
            found.add(values[n.name])
        todo += n.all_input_nodes
    return found


NO_OPS = (aten.detach, aten.alias, aten.clone, aten.lift_fresh_copy, aten.lift_fresh)
"""Operations that return their argument's value (a traced mod may hold them around anything)."""


def op_of(node) -> object:
    """The overload packet a graph node calls (``aten.add`` for ``aten.add.Tensor``); None for a constant argument."""
    return _overload_packet(node.target) if isinstance(node, torch.fx.Node) else None


def skip_no_ops(node):
    """``node``, or what it passes on through ``NO_OPS``."""
    while op_of(node) in NO_OPS:
        node = node.args[0]
    return node


def output_node(gm: torch.fx.GraphModule):
    """What a traced mod returns (its first output), past ``NO_OPS``."""
    (out,) = list(gm.graph.nodes)[-1].args
    return skip_no_ops(out[0] if isinstance(out, (tuple, list)) else out)


def returns_score(gm: torch.fx.GraphModule) -> bool:
    """Whether the traced score_mod returns its score argument unchanged (through no-ops only): the kernels then
    fold the scale into exp2's argument and skip the chain rule (``template``'s FOLD_SCALE)."""
    return output_node(gm) is next(iter(gm.graph.nodes))


def _accumulate(reads, grads, ref, values: dict[str, str]) -> list[str]:
    """Lines that add, under ACCUMULATE, the gradient at each read (``grads``, [BLOCK_M, BLOCK_N] blocks) into the
    gradient buffer of the tensor read, at the read's indices: summed first over the tile dimensions the indices do
    not depend on (a per-head slope gets one atomic add per tile, not one per position)."""
    lines = ["    if ACCUMULATE:"]
    for (node, pointer, tensor), grad in zip(reads, grads, strict=True):
        indices = node.args[1]
        depends = set().union(*(_depends_on(i, values) for i in indices if isinstance(i, torch.fx.Node)))
        offset, in_range = _offsets(pointer, tensor, indices, ref, f"G{pointer[1:]}_s")
        value = f"{ref(grad)} + tl.zeros_like(grad)"  # [BLOCK_M, BLOCK_N]
        if "q_idx" not in depends and "kv_idx" not in depends:
            value = f"tl.sum(tl.sum({value}, 1), 0)"
        elif "kv_idx" not in depends:
            value = f"tl.sum({value}, 1, keep_dims=True)"
        elif "q_idx" not in depends:
            value = f"tl.sum({value}, 0, keep_dims=True)"
        lines.append(f"        tl.atomic_add(G{pointer[1:]} + {offset}, {value}, mask={in_range})")
    return lines if reads else []
