"""Gradient reductions in flight: issued on the stream pair, landed in issue order.

``ReductionFlights`` is the only code that turns a gradient reduction in
flight into this rank's partitions, as the ``Gatherer`` is for gathers: it
issues a bucket's flush or one gradient's reduction on the reduction stream
pair, keeps at most ``MAX_FLIGHTS`` of them in flight, completes each one
(compute waits on the communication's event) and adds its partitions into
the accumulation window (``zero3.training.grad_window``), in the order they
were issued, and keeps the seconds blocked on them. What to reduce and when
is the ``GradReducer``'s (``zero3.training.grads``).

Note: HSDP's second stage.
    Under HSDP the reductions within the shard group are followed by an
    all-reduce across the replicas, issued right after the first stage
    completes (``zero3.training.replicas``, which says when and why).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import torch

from z3kit.collectives import CollectiveLog, Pending, ProcessGroup, all_reduce, reduce_scatter
from z3kit.flat_bucket import BucketFlush, FlatBucket, ReduceMode
from z3kit.memory import MemoryKind, MemoryLedger, tensor_bytes
from z3kit.shard import ParamShard
from z3kit.streams import CommTicket, StreamPairLike
from z3kit_recipes.zero3.ranks.agreement import Waiter
from z3kit_recipes.zero3.training.grad_window import GradWindow
from z3kit_recipes.zero3.training.replicas import ReplicaStage
from z3kit_recipes.zero3.training.timeline import profiled

#: reductions in flight at once before the oldest is waited for
MAX_FLIGHTS = 2


@attrs.define
class _Flight:
    """A reduction in flight: its handle, and what to land from it."""

    pending: Pending | BucketFlush
    #: an unbucketed reduction's communication (a bucket's is its flush's)
    ticket: CommTicket | None
    #: (pid, this rank's partition) for an unbucketed one; a bucket's come from its flush
    parts: list[tuple[int, torch.Tensor]]
    #: bytes to free from the ledger once landed
    nbytes: int
    #: HSDP: lands in this replica's pending sums, not the window (``zero3.training.replicas``)
    local: bool = False


class ReductionFlights:
    """The reductions of one ``GradReducer`` in flight (see the module docstring)."""

    def __init__(
        self,
        shards: Sequence[ParamShard],
        *,
        rank: int,
        group: ProcessGroup,
        replicas: ReplicaStage | None = None,
        waiter: Waiter,
        streams: StreamPairLike,
        log: CollectiveLog,
        memory: MemoryLedger,
        mode: ReduceMode,
        scale: float,
    ) -> None:
        self.shards, self.rank = shards, rank
        self.group, self.waiter, self.streams, self.log, self.memory = group, waiter, streams, log, memory
        self.mode, self.scale = mode, scale
        #: HSDP: the all-reduce across the replicas (see the Note)
        self.replicas = replicas
        self._flights: list[_Flight] = []
        #: reductions left in flight when the ranks stopped running together (kept alive, never waited on)
        self._abandoned: list[_Flight] = []
        #: seconds spent blocked on reductions
        self.comm_wait_s = 0.0

    @property
    def idle(self) -> bool:
        """Nothing is in flight."""
        return not self._flights

    def issue_bucket(self, bucket: FlatBucket, window: GradWindow) -> None:
        """Flush ``bucket`` (the oldest flight is landed into ``window`` first when ``MAX_FLIGHTS`` are out)."""
        self._make_room(window)
        with profiled("z3kit.reduce_bucket", len(bucket), "grads"):
            flush = bucket.flush(self.group, streams=self.streams, scale=self.scale, async_op=True, log=self.log)
        self._launch(_Flight(flush, None, [], bucket.nbytes), f"{len(bucket)} grads")

    def issue_alone(self, pid: int, grad: torch.Tensor, window: GradWindow) -> None:
        """Reduce one gradient, in place when it needs no padding, else through a
        padded copy (the oldest flight is landed into ``window`` first when
        ``MAX_FLIGHTS`` are out)."""
        self._make_room(window)
        shard = self.shards[pid]
        held = tensor_bytes(grad)
        if grad.numel() == shard.padded_numel and grad.is_contiguous():
            padded = grad.view(-1)
        else:
            padded = grad.new_zeros(shard.padded_numel)
            padded[: grad.numel()].copy_(grad.reshape(-1))
            self.memory.allocate(MemoryKind.GRAD_BUCKETS, tensor_bytes(padded))
            self.memory.free(MemoryKind.GRAD_BUCKETS, held)
            held = tensor_bytes(padded)
        size = shard.shard_numel
        scatter = self.mode is ReduceMode.REDUCE_SCATTER
        # reduce-scatter writes a new output, allocated here on the compute stream that
        # reads it; all-reduce writes the whole padded gradient, this rank's slice of it kept
        out = padded.new_empty(size) if scatter else padded[self.rank * size : (self.rank + 1) * size]
        label = f"{self.mode.value} of gradient #{pid}"
        with self.streams.communicate(reads=[padded], writes=[out if scatter else padded], label=label) as ticket:
            if scatter:
                pending = reduce_scatter(out, padded, self.group, scale=self.scale, async_op=True, log=self.log)
            else:
                pending = all_reduce(padded, self.group, scale=self.scale, async_op=True, log=self.log)
        self._launch(_Flight(pending, ticket, [(pid, out)], held), f"gradient #{pid}")

    def _launch(self, flight: _Flight, what: str) -> None:
        """``flight`` in flight; under HSDP, in the backward that ends the window, its shard
        group's stage completed first and the all-reduce across the replicas in flight instead."""
        if self.replicas is None:
            self._flights.append(flight)
            return
        if not self.replicas.final_micro_step():
            flight.local = True
            self._flights.append(flight)
            return
        start = time.perf_counter()
        try:
            parts = self._complete(flight)
        except BaseException:
            self._abandoned.append(flight)  # the ranks stopped: the collective may still write into its buffers
            raise
        self.comm_wait_s += time.perf_counter() - start
        self.memory.free(MemoryKind.GRAD_BUCKETS, flight.nbytes)
        self._flights.append(_Flight(*self.replicas.launch(parts, what)))

    def _make_room(self, window: GradWindow) -> None:
        if len(self._flights) >= MAX_FLIGHTS:
            self.land(window, oldest_only=True)

    def land(self, window: GradWindow, *, finished_only: bool = False, oldest_only: bool = False) -> None:
        """Land reductions in flight into ``window``, in order: all, those already finished, or the oldest."""
        while self._flights:
            flight = self._flights[0]
            if finished_only and not flight.pending.is_completed():
                return
            self._flights.pop(0)
            start = time.perf_counter()
            parts = self._complete(flight)
            self.comm_wait_s += time.perf_counter() - start
            into = self.replicas.pending if flight.local and self.replicas is not None else window
            for pid, part in parts:
                into.accumulate(pid, part)
            self.memory.free(MemoryKind.GRAD_BUCKETS, flight.nbytes)
            if oldest_only:
                return

    def _complete(self, flight: _Flight) -> list[tuple[int, torch.Tensor]]:
        """Complete ``flight`` on the stream pair (compute waits on its event): its partitions.
        The one place a reduction turns into partitions."""
        pending = flight.pending
        if isinstance(pending, BucketFlush):
            return pending.wait(self.waiter)
        assert flight.ticket is not None
        self.streams.complete(flight.ticket, lambda: self.waiter(pending.is_completed, pending.wait))
        return flight.parts

    def abandon(self) -> None:
        """Forget the reductions in flight without waiting (the ranks no longer
        run together): their buffers stay referenced, since the collective may
        still write into them."""
        self._abandoned += self._flights
        self._flights = []
