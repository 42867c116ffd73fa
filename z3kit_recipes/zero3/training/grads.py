"""The gradient path of the stock runtime: bucket, reduce, accumulate.

``GradReducer`` receives each parameter's full gradient as it becomes
ready (from a grad-ready hook, or a leaf unit's callback), copies it into a
``FlatBucket``, reduces full buckets (sum, scaled to the data-parallel and
micro-step mean), and copies or adds every rank-local partition into the
window's partitions that the optimizer reads (``zero3.training.grad_window``).
Issuing and landing the reductions is its ``ReductionFlights``'
(``zero3.training.reductions``): what to reduce, and when, is decided here.

Note: the same reductions on every rank.
    Which gradients share a bucket, and in which order the buckets are
    reduced, is a ``ReductionPlan`` fixed at initialize (parameters in
    reverse order, as they usually finish in backward), the same on every
    rank, and never the order in which gradients happen to arrive. A bucket
    is reduced once all of its gradients are in and every bucket before it
    was reduced; at the end of backward the gradients that never came (a
    parameter unused on this rank, an expert without tokens, a branch whose
    output did not reach this rank's loss) are zeros. So every rank issues
    the same collectives, in the same order, whatever its graph did. The
    reductions share the gathers' communicator, so a bucket is issued
    before the end of backward only when it will be at the same point on
    every rank: when each of its parameters is ``reliable`` (see the Note
    in ``zero3.training.step_checks``). Which parameters got a gradient on
    some rank is agreed at the end of backward (``zero3.ranks.agreement``):
    one that got none anywhere has none for the optimizer, as after
    ``zero_grad(set_to_none=True)``.

Note: a gradient that arrives twice.
    A parameter used in two segments of reentrant activation checkpointing
    (ALBERT's shared layer under Hugging Face gradient checkpointing) gets
    one gradient per segment in one backward: each segment's recomputation
    runs an inner backward of its own. Every arrival counts: a second one
    is added into the parameter's slot while its reduction is not issued;
    once it is, the arrival is kept aside (``late``) and reduced after the
    ranks have agreed at the end of backward which parameters any rank holds
    such a gradient for, in parameter order, zeros where a rank holds none.
    Reduction is linear, so the sum of the two reductions is the reduction
    of the summed gradient.

Note: large gradients.
    A gradient that needs no padding and would take half a bucket or more
    is reduced in place, in the tensor autograd produced, instead of being
    copied into a bucket: the copy would double the largest gradients (an
    embedding, an LM head) at the start of backward, where everything
    gathered for forward is still held.

Note: what exists when.
    Buckets are allocated when their first gradient arrives and dropped once
    their reduction has landed; between backwards a rank holds none. The
    partitions are allocated at the first landing of an accumulation window
    and dropped by ``window.end`` after the optimizer step (or a ``zero_grad``);
    ``discard`` drops some of them. Both are counted in the ``MemoryLedger``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from z3kit.collectives import CollectiveLog, ProcessGroup, all_reduce
from z3kit.flat_bucket import FlatBucket, ReduceMode
from z3kit.grad_partition import clip_coefficient
from z3kit.memory import MemoryKind, MemoryLedger, tensor_bytes
from z3kit.shard import ParamShard
from z3kit.streams import StreamPairLike
from z3kit_recipes.zero3.config.budget import transient_cap
from z3kit_recipes.zero3.ranks.agreement import Waiter
from z3kit_recipes.zero3.training.grad_window import GradWindow
from z3kit_recipes.zero3.training.reduction_plan import ReductionPlan
from z3kit_recipes.zero3.training.reductions import ReductionFlights
from z3kit_recipes.zero3.training.replicas import ReplicaStage


class GradReducer:
    """Per-rank gradient partitions of the trainable parameters (see the Notes)."""

    def __init__(
        self,
        shards: Sequence[ParamShard],
        trainable: Sequence[int],
        *,
        group: ProcessGroup,
        replicate: ProcessGroup | None = None,
        final_micro_step: Callable[[], bool] = lambda: True,
        waiter: Waiter,
        streams: StreamPairLike,
        log: CollectiveLog,
        memory: MemoryLedger,
        bucket_size: int,
        bucket_dtype: torch.dtype,
        mode: ReduceMode,
        overlap: bool,
        contiguous: bool,
        scale: float,
    ) -> None:
        self.shards, self.group, self.streams, self.log, self.memory = shards, group, streams, log, memory
        self.waiter, self.mode, self.overlap, self.scale = waiter, mode, overlap, scale
        first = shards[trainable[0]]
        self.rank, self.world, self.device = first.rank, first.world, first.shard.device
        self.bucket_dtype, self._bucket_size, self._contiguous = bucket_dtype, bucket_size, contiguous
        #: parameters whose gradient arrived on this rank in this backward
        self.arrived: set[int] = set()
        #: ... or that a leaf unit said had none: handed over during backward, not filled in at its end
        self.handed: set[int] = set()
        #: parameters whose buckets may be issued as soon as they are full (None: any; see the Note)
        self.reliable: set[int] | None = set()
        self._early: list[bool] = []  # per bucket of the plan: all of its parameters reliable
        #: second arrivals after their reduction was issued, summed, by id (see the Note)
        self.late: dict[int, torch.Tensor] = {}
        self._buckets: dict[int, FlatBucket] = {}
        self._waiting: dict[int, torch.Tensor] = {}  # unbucketed gradients not reduced yet, by plan index
        self._next = 0  # plan index of the next reduction to issue
        #: HSDP: the all-reduce across the replicas, once per window (``zero3.training.replicas``)
        self.replicas = None if replicate is None else ReplicaStage(
            replicate, streams=streams, log=log, memory=memory, waiter=waiter, device=self.device,
            final_micro_step=final_micro_step)
        #: the reductions issued and not landed yet (``zero3.training.reductions``)
        self.flights = ReductionFlights(
            shards, rank=self.rank, group=group, replicas=self.replicas, waiter=waiter, streams=streams, log=log,
            memory=memory, mode=mode, scale=scale,
        )
        self.window = GradWindow({}, [], device=self.device, memory=memory)  # made for ``trainable`` by replan
        self.replan(trainable)

    def replan(self, trainable: Sequence[int]) -> None:
        """Partition slots and the reduction plan for ``trainable`` (at
        initialize, and when parameters are unfrozen between windows)."""
        if self.window_open or self._buckets or self._waiting or not self.flights.idle:
            raise RuntimeError("the reduction plan changes only between accumulation windows")
        shards = self.shards
        #: partition slot of each trainable parameter id
        self.slot = {pid: i for i, pid in enumerate(trainable)}
        #: this accumulation window's partitions (``zero3.training.grad_window``)
        listener = self.window.on_landed
        self.window = GradWindow(self.slot, [shards[p].shard_numel for p in trainable], device=self.device,
                                 memory=self.memory, number=self.window.number)
        self.window.on_landed = listener
        if self.replicas is not None:
            self.replicas.replan(self.slot, [shards[p].shard_numel for p in trainable])
        self._numels = {pid: shards[pid].numel for pid in trainable}
        self._padded = {pid: shards[pid].padded_numel for pid in trainable}
        total = sum(self._padded.values())
        # no bucket is larger than what the whole model can fill, nor than a transient buffer may be
        capacity = min(self._bucket_size, total, transient_cap(total, self.world))
        #: elements of one bucket at most (0: every gradient is reduced on its own)
        self.bucket_capacity = capacity - capacity % self.world if self._contiguous and capacity >= self.world else 0
        self.plan = ReductionPlan.make(list(reversed(trainable)), self._numels, self._padded, self.bucket_capacity)
        self.reliability_changed()

    @property
    def comm_wait_s(self) -> float:
        """Seconds spent blocked on reductions."""
        return self.flights.comm_wait_s

    def reliability_changed(self) -> None:
        """``reliable`` changed: which buckets may go before the end of backward."""
        reliable = self.reliable
        self._early = [reliable is None or all(p in reliable for p in pids) for pids in self.plan.buckets]

    def new_backward(self) -> None:
        """The flags of a backward were taken (``zero3.training.step_checks``): the next one starts afresh."""
        self.arrived.clear()
        self.handed.clear()

    # -- adding ------------------------------------------------------------------
    def add(self, pid: int, grad: torch.Tensor) -> None:
        """Take parameter ``pid``'s full gradient. The reducer may reduce
        ``grad`` itself in place: the caller drops its own reference and
        does not use it afterwards."""
        if grad.dtype != self.bucket_dtype:
            grad = grad.to(self.bucket_dtype)
        if pid in self.arrived:
            self._add_again(pid, grad)
            return
        self.arrived.add(pid)
        self.handed.add(pid)
        self.flights.land(self.window, finished_only=True)
        index = self.plan.bucket_of[pid]
        if self.plan.alone[index]:
            self._waiting[index] = grad
            self.memory.allocate(MemoryKind.GRAD_BUCKETS, tensor_bytes(grad))
        else:
            self._bucket(index).add(pid, grad)
        self._issue_ready()

    def skip(self, pid: int) -> None:
        """Parameter ``pid`` gets no gradient on this rank in this backward (an
        expert without tokens): zeros take its place in the reduction, and it
        does not count as arrived."""
        index = self.plan.bucket_of[pid]
        if pid in self.arrived or index < self._next:
            return
        self.handed.add(pid)
        if self.plan.alone[index]:
            self._waiting[index] = self._zeros(self._padded[pid])
        else:
            self._bucket(index).skip(pid)
        self._issue_ready()

    def _zeros(self, numel: int) -> torch.Tensor:
        """A gradient of zeros where a rank has none, counted as a bucket."""
        zeros = torch.zeros(numel, dtype=self.bucket_dtype, device=self.device)
        self.memory.allocate(MemoryKind.GRAD_BUCKETS, tensor_bytes(zeros))
        return zeros

    def _add_again(self, pid: int, grad: torch.Tensor) -> None:
        """A second gradient of ``pid`` in this backward (see the Note)."""
        index = self.plan.bucket_of[pid]
        if index < self._next:  # its reduction is issued: keep it for reduce_late
            held = self.late.get(pid)
            if held is None:
                self.late[pid] = grad.detach().clone(memory_format=torch.contiguous_format)
                self.memory.allocate(MemoryKind.GRAD_BUCKETS, tensor_bytes(self.late[pid]))
            else:
                held.add_(grad)
        elif self.plan.alone[index]:
            self._waiting[index].add_(grad.reshape(self._waiting[index].shape))
        else:
            self._buckets[index].accumulate(pid, grad)

    def reduce_late(self, pids: Sequence[int]) -> None:
        """Reduce the late gradients of ``pids`` (agreed across ranks: every
        rank passes the same list; zeros where this rank holds none) into
        the window's partitions."""
        for pid in sorted(pids):
            grad = self.late.pop(pid, None)
            if grad is None:
                grad = self._zeros(self._numels[pid])
            self.flights.issue_alone(pid, grad, self.window)
        self.flights.land(self.window)
        if self.late:  # the agreed list always holds this rank's own: a gradient must never be dropped
            raise RuntimeError(f"late gradients of parameters {sorted(self.late)} were not in the agreed list {list(pids)}")

    def _bucket(self, index: int) -> FlatBucket:
        bucket = self._buckets.get(index)
        if bucket is None:
            pids = self.plan.buckets[index]
            bucket = FlatBucket(
                sum(self._padded[p] for p in pids),
                rank=self.rank,
                world=self.world,
                dtype=self.bucket_dtype,
                device=self.device,
                mode=self.mode,
            )
            for p in pids:  # one layout on every rank, whatever the arrival order
                bucket.reserve(p, self._numels[p])
            self._buckets[index] = bucket
            self.memory.allocate(MemoryKind.GRAD_BUCKETS, bucket.nbytes)
        return bucket

    def _ready(self, index: int, *, finishing: bool = False) -> bool:
        if not (finishing or self._early[index]):
            return False
        if self.plan.alone[index]:
            return index in self._waiting
        bucket = self._buckets.get(index)
        return bucket is not None and bucket.is_full()

    def _issue_ready(self, *, finishing: bool = False) -> None:
        while self._next < len(self.plan.buckets) and self._ready(self._next, finishing=finishing):
            self._issue(self._next)
            self._next += 1

    def _issue(self, index: int) -> None:
        if self.plan.alone[index]:
            self.flights.issue_alone(self.plan.buckets[index][0], self._waiting.pop(index), self.window)
        else:
            self.flights.issue_bucket(self._buckets.pop(index), self.window)
        if not self.overlap:
            self.flights.land(self.window)  # issued asynchronously all the same, so that the wait is a watched one

    def finish(self) -> None:
        """End of backward: zeros for the gradients that never came, every
        remaining reduction issued in plan order, every partition landed."""
        for index in range(self._next, len(self.plan.buckets)):
            if self.plan.alone[index]:
                if index not in self._waiting:
                    self._waiting[index] = self._zeros(self._padded[self.plan.buckets[index][0]])
            else:
                self._bucket(index).zero_missing()
        self._issue_ready(finishing=True)
        self.flights.land(self.window)
        self._next = 0

    def abort_backward(self, *, ranks_in_step: bool) -> None:
        """A backward raised: forget its gradients and drop the window (its
        sums are partial, as after ``zero_grad``). Reductions already issued
        are landed when every rank failed at the same point (they issued the
        same ones), else abandoned: their buffers stay referenced, since the
        collective may still write into them."""
        if ranks_in_step:
            self.flights.land(self.window)
        else:
            self.flights.abandon()
        for held in (*self._waiting.values(), *self.late.values()):
            self.memory.free(MemoryKind.GRAD_BUCKETS, tensor_bytes(held))
        for bucket in self._buckets.values():
            self.memory.free(MemoryKind.GRAD_BUCKETS, bucket.nbytes)
        self._buckets, self._waiting, self.late, self.arrived, self.handed = {}, {}, {}, set(), set()
        self._next = 0
        self.end_window()

    @property
    def window_open(self) -> bool:
        """Some gradient has landed since the last optimizer step (in the window, or pending under HSDP)."""
        return self.window.is_open or (self.replicas is not None and self.replicas.pending.is_open)

    def end_window(self) -> None:
        """The optimizer consumed the window, or it was discarded (``zero_grad``, a failed backward)."""
        self.window.end()
        if self.replicas is not None:
            self.replicas.pending.end()

    def discard(self, pids: Sequence[int]) -> None:
        """Drop these parameters' sums so far (their ``.grad`` was set to None, ``zero3.training.grad_stand_ins``)."""
        for window in (self.window,) if self.replicas is None else (self.window, self.replicas.pending):
            for pid in pids:
                window.withdraw(pid)

    def flush_replicas(self) -> None:
        """HSDP: make the window hold sums over every rank before it is read (a step, a save;
        collective; see ``zero3.training.replicas``)."""
        if self.replicas is not None:
            self.replicas.flush(self.window)

    def mark_used(self, pids: Iterable[int]) -> None:
        """These parameters got a gradient on some rank in a backward of this window (agreed across ranks)."""
        self.window.mark_used(pids)

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of the window's gradient over every rank, on the device
        (collective, over the shard group only: HSDP's replicas hold the same
        partitions once flushed, ``zero3.ranks.topology``)."""
        squared = self.window.squared_norm().reshape(1).to(torch.float32)
        pending = all_reduce(squared, self.group, async_op=True, log=self.log)
        self.waiter(pending.is_completed, pending.wait)
        return squared.sqrt()[0]

    def clip_(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale the partitions so the global gradient norm is at most
        ``max_norm``; returns the norm before clipping and the factor applied.
        All on the device (``z3kit.grad_partition.clip_coefficient``)."""
        norm = self.global_norm()
        factor = clip_coefficient(norm, max_norm)
        self.window.scale_(factor)
        return norm, factor
