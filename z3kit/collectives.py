"""Typed, async-capable collectives over an explicit process group.

Every function takes the process group as an argument and never falls back
to the default group. Reductions are SUM followed by an explicit scale,
because gloo refuses PREMUL_SUM and has had AVG bugs, and HCCL has no AVG.
Only contiguous tensors are accepted: gloo silently gives wrong results for
non-contiguous views. Each call is counted, with its bytes, in an optional
``CollectiveLog`` (``z3kit.collective_log``, re-exported here).
"""

from __future__ import annotations

import numbers
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from z3kit.collective_log import CollectiveKind as CollectiveKind
from z3kit.collective_log import CollectiveLog as CollectiveLog
from z3kit.process_group import waits_on_host

ProcessGroup = dist.ProcessGroup

# torch 2.13 renamed the single-tensor collectives; the old names warn there.
_all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


#: how a caller waits for a collective: called with ``(is_completed, wait)``, it
#: returns once ``wait()`` returned (on a backend whose waits block the host, a
#: runtime polls ``is_completed(timeout_s)`` meanwhile to notice a rank that
#: failed); ``wait()``'s result is passed on
Blocker = Callable[[Callable[[float], bool], Callable[[], Any]], Any]


class Pending:
    """Handle of a collective that may still be running.

    ``wait()`` completes it and then runs the follow-up (the scale of a
    reduction, the copy-out of a gather) exactly once. For a synchronous
    call the work is already done and ``wait`` only runs the follow-up.

    Note: what ``wait`` means depends on the backend.
        On gloo (``waits_on_host``), ``Work.wait()`` blocks the host until
        the collective is done, and a timed wait only raises. On NCCL and
        HCCL, ``Work.wait()`` makes the current stream wait and returns at
        once, and a timed ``Work.wait(timeout)`` would block the host,
        count the timeout from when the work was enqueued and abort the
        communicator when it runs out. So a timeout is passed to gloo
        works only; an accelerator work is only ever polled
        (``is_completed``, which never blocks) or waited on plainly.
    """

    __slots__ = ("_works", "_then", "_done", "waits_on_host")

    def __init__(self, work: Any | None, then: Callable[[], None] | None = None, *, waits_on_host: bool = True) -> None:
        # one work handle, or a list of them (a collective made of several calls)
        self._works: list[Any] = [] if work is None else list(work) if isinstance(work, list) else [work]
        self._then = then
        self._done = False
        #: ``wait()`` blocks the host (gloo); else it orders streams (see the Note)
        self.waits_on_host = waits_on_host

    @property
    def done(self) -> bool:
        return self._done

    def is_completed(self, timeout_s: float = 0.0) -> bool:
        """True once the collective finished on the device, as its works
        report it. ``timeout_s``: on a backend whose waits block the host,
        block up to that long for it first; elsewhere it is ignored, and this
        only polls (see the Note). Having waited says nothing on an
        accelerator, where ``wait()`` returns before the collective ran; on a
        backend whose waits block the host it says all (some of its works,
        torch's emulated reduce-scatter on gloo, never report completion)."""
        if self._done and self.waits_on_host:
            return True
        for work in self._works:
            if work.is_completed():
                continue
            if timeout_s <= 0 or not self.waits_on_host:
                return False
            try:
                work.wait(timedelta(seconds=timeout_s))
            except RuntimeError:
                # not finished in time; or finished with an error, which wait() raises
                return bool(work.is_completed())
        return True

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        self._done = True
        if self._then is not None:
            self._then()


def _check_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (gloo silently corrupts strided views); call .contiguous()")


def _check_pair(out: torch.Tensor, inp: torch.Tensor) -> None:
    _check_tensor("output", out)
    _check_tensor("input", inp)
    if out.dtype != inp.dtype:
        raise TypeError(f"output dtype {out.dtype} differs from input dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"output is on {out.device} but input is on {inp.device}")


def _check_group(group: ProcessGroup | None) -> ProcessGroup:
    if group is None:
        raise ValueError("a process group is required; z3kit never uses the default group implicitly")
    return group


def _check_scale(scale: float, tensor: torch.Tensor) -> None:
    # checked before the collective is issued: a bad scale found only in wait()
    # would leave the summed, unscaled values behind
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale == scale) or scale in (float("inf"), float("-inf")):  # NaN or inf
        raise ValueError(f"scale must be finite, got {scale}")
    if scale != 1.0 and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"scale {scale} needs a floating-point tensor, got {tensor.dtype}")


def _scaler(tensor: torch.Tensor, scale: float) -> Callable[[], None] | None:
    if scale == 1.0:
        return None

    def apply() -> None:
        tensor.mul_(scale)

    return apply


#: per-rank elements from which gloo all-gathers run as broadcasts (see the Note below)
GLOO_BROADCAST_GATHER_MIN_NUMEL = 262_144


def _gather_by_broadcasts(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, world: int, async_op: bool, log: CollectiveLog | None
) -> list[Any]:
    """Note: gloo all-gather as broadcasts.
    gloo's all-gather moves large tensors two to three times slower than
    one broadcast from each rank into its chunk of the output (measured
    here, fp32, loopback: 3.7M elements per rank took 35 ms against 15 ms at
    world 2, 166 ms against 57 ms at world 4). Below a quarter million
    elements per rank the count of calls (about 0.4 ms each) matters more,
    and the single all-gather is kept. Each broadcast is logged as such."""
    rank = dist.get_rank(group)
    n = input.numel()
    chunks = output.view(world, n)
    chunks[rank].copy_(input)
    works = []
    for src in range(world):
        if log is not None:
            log.record(CollectiveKind.BROADCAST, n * input.element_size(), group, src)
        works.append(dist.broadcast(chunks[src], group_src=src, group=group, async_op=async_op))
    return works


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    async_op: bool = False,
    log: CollectiveLog | None = None,
) -> Pending:
    """Gather every rank's ``input`` into ``output`` (rank-major, ``world * input.numel()``)."""
    group = _check_group(group)
    _check_pair(output, input)
    world = dist.get_world_size(group)
    if output.numel() != world * input.numel():
        raise ValueError(
            f"all_gather output has {output.numel()} elements; expected world_size ({world}) x "
            f"input ({input.numel()}) = {world * input.numel()}"
        )
    if world > 1 and input.numel() >= GLOO_BROADCAST_GATHER_MIN_NUMEL and dist.get_backend(group) == "gloo":
        work: Any = _gather_by_broadcasts(output, input, group, world, async_op, log)
    else:
        if log is not None:
            log.record(CollectiveKind.ALL_GATHER, input.numel() * input.element_size(), group)
        work = _all_gather_single(output, input, group=group, async_op=async_op)
    pending = Pending(work if async_op else None, waits_on_host=waits_on_host(group))
    if not async_op:
        pending.wait()  # like the reductions: a synchronous call returns a done handle
    return pending


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    scale: float = 1.0,
    async_op: bool = False,
    log: CollectiveLog | None = None,
) -> Pending:
    """Sum ``input`` (rank-major chunks of ``output``'s size) over ranks; this
    rank's chunk lands in ``output``, then is multiplied by ``scale``."""
    group = _check_group(group)
    _check_pair(output, input)
    _check_scale(scale, output)
    world = dist.get_world_size(group)
    if input.numel() != world * output.numel():
        raise ValueError(
            f"reduce_scatter input has {input.numel()} elements; expected world_size ({world}) x "
            f"output ({output.numel()}) = {world * output.numel()}"
        )
    if log is not None:
        log.record(CollectiveKind.REDUCE_SCATTER, input.numel() * input.element_size(), group)
    then: Callable[[], None] | None
    if world > 1 and dist.get_backend(group) == "gloo":
        work, then = _reduce_scatter_by_all_to_all(output, input, group, world, scale, async_op)
    else:
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        then = _scaler(output, scale)
    pending = Pending(work if async_op else None, then, waits_on_host=waits_on_host(group))
    if not async_op:
        pending.wait()
    return pending


def _reduce_scatter_by_all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, world: int, scale: float, async_op: bool
) -> tuple[Any, Callable[[], None]]:
    """Note: gloo reduce-scatter as an all-to-all.
    gloo has no reduce-scatter of its own: torch emulates it, slower than an
    all-reduce of the whole input (measured here, fp32, 2 ranks: 12.8 ms
    against 9.2 ms for 2M elements). An all-to-all sends each rank its chunk
    of every rank's input, half the bytes of an all-reduce at world 2, and
    this rank sums the chunks it received into ``output`` (4.9 ms for the
    same 2M). The chunks land in a buffer of the input's size, held until
    the sum. The sum adds the ranks' chunks in rank order, so every rank
    gets the same bits, as from a reduce-scatter. The log counts it as the
    reduce-scatter it is: each rank receives one chunk from each peer."""
    received = torch.empty_like(input)
    work = dist.all_to_all_single(received, input, group=group, async_op=async_op)

    def land() -> None:
        torch.sum(received.view(world, -1), dim=0, out=output)
        if scale != 1.0:
            output.mul_(scale)

    return work, land


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    *,
    scale: float = 1.0,
    async_op: bool = False,
    log: CollectiveLog | None = None,
) -> Pending:
    """Sum ``tensor`` in place over ranks, then multiply it by ``scale``."""
    group = _check_group(group)
    _check_tensor("tensor", tensor)
    _check_scale(scale, tensor)
    if log is not None:
        log.record(CollectiveKind.ALL_REDUCE, tensor.numel() * tensor.element_size(), group)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    pending = Pending(work if async_op else None, _scaler(tensor, scale), waits_on_host=waits_on_host(group))
    if not async_op:
        pending.wait()
    return pending


def broadcast(
    tensor: torch.Tensor,
    src_rank: int,
    group: ProcessGroup | None,
    *,
    async_op: bool = False,
    log: CollectiveLog | None = None,
) -> Pending:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank."""
    group = _check_group(group)
    _check_tensor("tensor", tensor)
    world = dist.get_world_size(group)
    if not 0 <= src_rank < world:
        raise ValueError(f"src_rank must be in [0, {world}), got {src_rank}")
    if log is not None:
        log.record(CollectiveKind.BROADCAST, tensor.numel() * tensor.element_size(), group, src_rank)
    work = dist.broadcast(tensor, group_src=src_rank, group=group, async_op=async_op)
    return Pending(work if async_op else None, None, waits_on_host=waits_on_host(group))


def failed_ranks(ok: bool, group: ProcessGroup | None, device: torch.device | str = "cpu") -> list[int]:
    """Ranks of ``group`` whose ``ok`` is False, the same list on every rank.

    Every rank must call it: it is how ranks agree that a step which can
    fail on one of them (a user callback, a file read) succeeded everywhere
    before any of them goes on to a collective the failed one will not join.
    ``device`` is where the process group's backend takes tensors."""
    group = _check_group(group)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    flags = flag.new_empty(dist.get_world_size(group))
    _all_gather_single(flags, flag, group=group)
    return [rank for rank, value in enumerate(flags.tolist()) if value == 0]
