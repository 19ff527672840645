"""What ring and Ulysses attention share: the process-group wrapper (``Ring``: neighbours, point-to-point
passes, all_gather, all_to_all, timeout errors), the device checks, and the check that every rank of the group
passed valid inputs with the same shapes and options (``agreed_options``: ``signature_of``, ``check_across_ranks``)."""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flashtile.checks import SUPPORTED_DTYPES, check_options, check_qkv, check_softmax_scale, window_size_of
from flashtile.distributed.layout import LAYOUTS
from flashtile.errors import InputTypeError, require
from flashtile.options import AttentionOptions, scale_or_default


class Ring:
    """This rank's place in ``group``: it sends to the next rank and receives from the previous one.
    ``caller`` names the public function in error messages."""

    def __init__(self, group: dist.ProcessGroup | None, caller: str = "ring_flash_attn_func") -> None:
        self.caller = caller
        require(
            dist.is_available() and dist.is_initialized(),
            "torch.distributed is not initialised: call torch.distributed.init_process_group first.",
            RuntimeError,
        )
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        require(self.rank >= 0, "This process is not a member of the given process group.")
        self.size = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.backend = str(dist.get_backend(self.group))

    @property
    def needs_cuda(self) -> bool:
        """Whether the group's backend only moves CUDA tensors (NCCL without a CPU backend beside it)."""
        return backend_needs_cuda(self.backend)

    def collective_device(self, device: torch.device) -> torch.device:
        """Where this rank's small collectives (the input check) run: ``device``, unless the backend cannot
        reach it (a CPU tensor on an NCCL group); then the current CUDA device, so that a rank with inputs
        on the wrong device can still take part in the check and make every rank raise."""
        return (
            torch.device("cuda", torch.cuda.current_device()) if self.needs_cuda and device.type != "cuda" else device
        )

    def pass_on(self, *tensors: Tensor) -> Incoming:
        """Start sending the contiguous ``tensors`` to the next rank and receiving the previous rank's
        tensors of the same shapes into new buffers (one ``batch_isend_irecv``); returns at once. With one
        rank, the incoming tensors are ``tensors`` themselves.

        Until ``wait()`` on the result: ``tensors`` must not be written (NCCL reads them on its own stream)
        and the received tensors must not be read."""
        if self.size == 1:
            return Incoming(self, [], list(tensors))
        assert all(x.is_contiguous() for x in tensors), "point-to-point buffers must be contiguous"
        incoming = [torch.empty_like(x) for x in tensors]
        ops = [dist.P2POp(dist.isend, x, self.next, self.group) for x in tensors]
        ops += [dist.P2POp(dist.irecv, x, self.prev, self.group) for x in incoming]
        return Incoming(self, dist.batch_isend_irecv(ops), incoming)

    def all_gather(self, x: Tensor) -> list[Tensor]:
        """Every rank's ``x``, in group rank order."""
        gathered = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(gathered, x, group=self.group)
        except RuntimeError as err:
            raise self.timeout_error("comparing the inputs of the ranks") from err
        return gathered

    def all_to_all(self, x: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:
        """Cut ``x`` into ``size`` equal pieces along ``scatter_dim`` and send piece i to group rank i; return
        the pieces received, concatenated along ``gather_dim`` in group rank order. With one rank, ``x``."""
        if self.size == 1:
            return x
        parts = x.unflatten(scatter_dim, (self.size, -1)).movedim(scatter_dim, 0).contiguous()
        received = torch.empty_like(parts)
        try:
            dist.all_to_all_single(received, parts, group=self.group)
        except RuntimeError as err:
            raise self.timeout_error("exchanging sequence and head shards (all_to_all)") from err
        return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)

    def timeout_error(self, doing: str) -> RuntimeError:
        return RuntimeError(
            f"{self.caller} on rank {self.rank} of {self.size}: {doing} failed or timed out. Another rank of "
            f"the group failed, exited, or did not call {self.caller} (every rank must call it, and "
            "its backward) within the process group's timeout, set by "
            "torch.distributed.init_process_group(timeout=...). The cause is on the other rank."
        )


def backend_needs_cuda(backend: str) -> bool:
    """Whether a process group with ``dist.get_backend`` name ``backend`` only moves CUDA tensors: "nccl",
    but not "gloo", nor a mixed "cpu:gloo,cuda:nccl"."""
    name = backend.lower()
    return "nccl" in name and "gloo" not in name and "cpu:" not in name


def check_device(q: Tensor, ring: Ring) -> None:
    """Raise ValueError unless the group's backend can move tensors of q's device."""
    require(
        q.device.type == "cuda" or not ring.needs_cuda,
        f"{ring.caller}: the process group's backend is {ring.backend!r}, which moves CUDA tensors only, but q is "
        f"on {q.device}. Move q, k and v to this rank's GPU (torch.cuda.set_device(local_rank) and "
        "tensor.cuda()), or use a gloo group for CPU tensors.",
    )


def on_device(x: object) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(x.device)`` for a CUDA tensor ``x``: the kernels and NCCL then use x's GPU even
    when another one is current. A no-op for anything else."""
    if isinstance(x, Tensor) and x.device.type == "cuda":
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


class Incoming:
    """A transfer in flight; ``wait()`` returns the received tensors."""

    def __init__(self, ring: Ring, works: list[dist.Work], buffers: list[Tensor]) -> None:
        self.ring, self.works, self.buffers = ring, works, buffers

    def wait(self) -> list[Tensor]:
        """The received tensors, once the transfers both ways are done. Lets go of everything it held (the
        works hold the sent tensors too), so that a sent tensor is freed as soon as its caller drops it."""
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as err:
            ring = self.ring
            raise ring.timeout_error(
                f"passing shards on from rank {(ring.rank - 1) % ring.size} through rank {ring.rank} "
                f"to rank {(ring.rank + 1) % ring.size}"
            ) from err
        buffers, self.works, self.buffers = self.buffers, [], []
        return buffers


@dataclass(frozen=True)
class Setup:
    """What every step needs besides the tensors: the group, the layout of the shards and the call's options
    (the window over the global positions)."""

    ring: Ring
    layout: str
    options: AttentionOptions

    def sendable(self, *tensors: Tensor) -> list[Tensor]:
        """``tensors`` as they can go into ``pass_on``: contiguous (a copy of a head group's view) when the
        ring has more than one rank."""
        return [x if self.ring.size == 1 or x.is_contiguous() else x.contiguous() for x in tensors]


SIGNATURE = (
    "batch",
    "seqlen per rank",
    "nheads",
    "nheads_k",
    "headdim",
    "headdim_v",
    "dtype",
    "window left (-1: unbounded)",
    "window right (-1: unbounded, causal: 0)",
    "layout",
    "softmax_scale",
    "softcap",
    "learnable_sink (1: given)",
    "alibi_slopes (1: given)",
)


_SHOW = {
    "dtype": lambda code: str(SUPPORTED_DTYPES[code]),
    "layout": lambda code: repr(LAYOUTS[code]),
    "softmax_scale": lambda bits: repr(_float_of(bits)),
    "softcap": lambda bits: repr(_float_of(bits)),
}


def _bits_of(x: float) -> int:
    """A float as an int64 with the same bits, to compare it exactly across ranks."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float_of(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def signature_of(q: Tensor, k: Tensor, v: Tensor, layout: str, options: AttentionOptions) -> tuple[int, ...]:
    """The ints of ``SIGNATURE`` for this rank's call; every rank of the group must agree on them."""
    return (
        *q.shape,
        k.shape[2],
        v.shape[3],
        SUPPORTED_DTYPES.index(q.dtype),
        *window_size_of(options.window_left, options.window_right),
        LAYOUTS.index(layout),
        _bits_of(options.softmax_scale),
        _bits_of(options.softcap),
        int(options.learnable_sink is not None),
        int(options.alibi_slopes is not None),
    )


def check_across_ranks(ring: Ring, device: torch.device, signature: tuple[int, ...] | None) -> None:
    """Raise on every rank unless every rank passed valid inputs (``signature`` not None) with one signature."""
    mine = [0] * len(SIGNATURE) if signature is None else list(signature)
    mine_t = torch.tensor([int(signature is not None), *mine], dtype=torch.int64, device=device)
    table = torch.stack(ring.all_gather(mine_t)).tolist()  # one row per rank
    if signature is None:
        return  # the caller raises its own error
    rejected = [rank for rank, row in enumerate(table) if not row[0]]
    require(
        not rejected,
        f"Rank(s) {rejected} of the group rejected their inputs to {ring.caller} (their error says why); "
        "no rank started the ring.",
    )
    lines = []
    for i, name in enumerate(SIGNATURE, start=1):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            show = _SHOW.get(name, str)
            lines.append(f"  {name}: " + ", ".join(f"rank {r}: {show(x)}" for r, x in enumerate(values)))
    require(
        not lines,
        f"{ring.caller} needs the same shapes and options on every rank of the group; they differ:\n"
        + "\n".join(lines),
    )


def check_sequence_shards(q: Tensor, k: Tensor, v: Tensor, caller: str) -> None:
    """Raise TypeError/ValueError unless q, k, v are valid shards of one sequence: ``check_qkv``'s inputs, at least
    one position, and q's shard as long as k's (the sequence is split the same way for both)."""
    check_qkv(q, k, v)
    require(q.shape[1] > 0, f"The shards must hold at least one position, got q {tuple(q.shape)}.")
    require(
        q.shape[1] == k.shape[1],
        f"{caller} splits one sequence across ranks, so the q and k/v shards must have the same length, "
        f"got q {tuple(q.shape)} and k {tuple(k.shape)}.",
    )


def agreed_options(
    comm: Ring,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    check_shard,
    layout: str,
    *,
    softmax_scale: float | None,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    alibi_slopes: Tensor | None,
    learnable_sink: Tensor | None,
) -> AttentionOptions:
    """The options of a distributed call, once every rank of the group has checked its inputs and they agree.

    Checks this rank's q, k, v (``check_sequence_shards``, then ``check_shard(q, k, v)``: the function's own shard
    rules), that the group's backend reaches q's device, the score modifications and sink (``check_options``) and
    softmax_scale; then compares every rank's shapes and options (``check_across_ranks``). A rank whose inputs are
    invalid raises its own error, and every other rank raises too, instead of waiting for it. (window_left,
    window_right) are over the global positions; softmax_scale None is the default (``scale_or_default``)."""
    device = comm.collective_device(q.device if isinstance(q, Tensor) else torch.device("cpu"))
    try:
        require(isinstance(q, Tensor), f"q must be a torch.Tensor, got {type(q).__name__}", InputTypeError)
        check_sequence_shards(q, k, v, comm.caller)
        check_shard(q, k, v)
        check_device(q, comm)
        softcap, alibi_slopes, learnable_sink = check_options(q, softcap, alibi_slopes, learnable_sink)
        check_softmax_scale(softmax_scale)
    except (TypeError, ValueError):
        check_across_ranks(comm, device, None)
        raise
    options = AttentionOptions(
        softmax_scale=scale_or_default(softmax_scale, q.shape[-1]), window_left=window_left, window_right=window_right,
        alibi_slopes=alibi_slopes, softcap=softcap, learnable_sink=learnable_sink,
    )  # fmt: skip
    check_across_ranks(comm, device, signature_of(q, k, v, layout, options))
    return options
