"""The gradient path of the stock runtime: bucket, reduce, accumulate.

``GradReducer`` receives each parameter's full gradient as it becomes
ready (from a grad-ready hook, or a leaf unit's callback), copies it into a
``FlatBucket``, reduces full buckets (sum, scaled to the data-parallel and
micro-step mean), and copies or adds every rank-local partition into the
``GradPartitionBuffer`` that the optimizer reads. With ``overlap_comm`` two
buckets alternate: one fills while the other's reduction is in flight.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from z3kit.collectives import CollectiveLog, Pending, ProcessGroup, all_reduce, reduce_scatter
from z3kit.flat_bucket import BucketFlush, FlatBucket, ReduceMode
from z3kit.grad_partition import GradPartitionBuffer
from z3kit.memory import MemoryKind, MemoryLedger, tensor_bytes
from z3kit.shard import ParamShard
from z3kit.streams import StreamPairLike
from z3kit_recipes.zero3.budget import transient_cap
from z3kit_recipes.zero3.params import profiled


class GradReducer:
    """Per-rank gradient partitions of the trainable parameters.

    Note: large gradients.
        A gradient that needs no padding and would take half a bucket or
        more is reduced in place, in the tensor autograd produced, instead
        of being copied into a bucket: the copy would double the largest
        gradients (an embedding, an LM head) at the very start of backward,
        where everything gathered for forward is still held. It lands as
        soon as its collective is done (checked at every later hand-over).

    Note: what exists when.
        Buckets are allocated when a backward hands over its first gradient
        and dropped once its reductions have landed, at the end of that
        backward: between backwards a rank holds none. The partitions are
        allocated when the first reduced gradient of an accumulation window
        lands and dropped by ``end_window`` after the optimizer step (or a
        ``zero_grad``). Both are counted in the ``MemoryLedger``.
    """

    def __init__(
        self,
        shards: Sequence[ParamShard],
        trainable: Sequence[int],
        *,
        group: ProcessGroup,
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
        self.shards = shards
        self.group, self.streams, self.log, self.memory = group, streams, log, memory
        self.mode, self.overlap, self.scale = mode, overlap, scale
        first = shards[trainable[0]]
        self.rank, self.world, self.device = first.rank, first.world, first.shard.device
        #: partition slot of each trainable parameter id
        self.slot = {pid: i for i, pid in enumerate(trainable)}
        self._partition_numels = [shards[p].shard_numel for p in trainable]
        #: this window's partitions; None between an optimizer step and the first landing after it
        self.partitions: GradPartitionBuffer | None = None
        total = sum(shards[p].padded_numel for p in trainable)
        # no bucket is larger than what the whole model can fill, nor than a transient buffer may be
        capacity = min(bucket_size, total, transient_cap(total, self.world))
        #: elements of one bucket (0: every gradient is reduced on its own)
        self.bucket_capacity = capacity - capacity % self.world if contiguous and capacity >= self.world else 0
        self._bucket_count = 2 if overlap else 1
        self.buckets: list[FlatBucket | None] = [None] * self._bucket_count
        self.bucket_dtype = bucket_dtype
        self._current = 0
        #: seconds spent blocked on reductions
        self.comm_wait_s = 0.0
        self._flights: dict[int, BucketFlush] = {}  # bucket index -> its reduction in flight
        # unbucketed reductions in flight: (pid, this rank's partition, reduced input kept alive, handle)
        self._alone: list[tuple[int, torch.Tensor, torch.Tensor, Pending]] = []

    # -- adding ------------------------------------------------------------------
    def add(self, pid: int, grad: torch.Tensor) -> None:
        """Take parameter ``pid``'s full gradient. The reducer may reduce
        ``grad`` itself in place: the caller drops its own reference and
        does not use it afterwards."""
        if grad.dtype != self.bucket_dtype:
            grad = grad.to(self.bucket_dtype)
        self._land_alone(finished_only=True)
        padded = self.shards[pid].padded_numel
        if padded > self.bucket_capacity or (padded == grad.numel() and 2 * padded >= self.bucket_capacity):
            self._reduce_alone(pid, grad)
            return
        bucket = self._bucket(self._current)
        if bucket.would_overflow(grad.numel()):
            self._flush_current()
            bucket = self._bucket(self._current)
        bucket.add(pid, grad)

    def _bucket(self, index: int) -> FlatBucket:
        bucket = self.buckets[index]
        if bucket is None:
            bucket = FlatBucket(
                self.bucket_capacity,
                rank=self.rank,
                world=self.world,
                dtype=self.bucket_dtype,
                device=self.device,
                mode=self.mode,
            )
            self.buckets[index] = bucket
            self.memory.allocate(MemoryKind.GRAD_BUCKETS, bucket.nbytes)
        return bucket

    def _drop_buckets(self) -> None:
        for bucket in self.buckets:
            if bucket is not None:
                self.memory.free(MemoryKind.GRAD_BUCKETS, bucket.nbytes)
        self.buckets = [None] * self._bucket_count
        self._current = 0

    def _reduce_alone(self, pid: int, grad: torch.Tensor) -> None:
        """A gradient larger than a bucket, or one that would fill half of
        it and needs no padding, gets a collective of its own (see the Note
        on large gradients); the previous one lands first, so at most one is
        held at a time."""
        self._land_alone()
        shard = self.shards[pid]
        if grad.numel() == shard.padded_numel and grad.is_contiguous():
            padded = grad.view(-1)
        else:
            padded = grad.new_zeros(shard.padded_numel)
            padded[: grad.numel()].copy_(grad.reshape(-1))
        with self.streams.on_comm():
            if self.mode is ReduceMode.REDUCE_SCATTER:
                out = padded.new_empty(shard.shard_numel)
                pending = reduce_scatter(
                    out, padded, self.group, scale=self.scale, async_op=self.overlap, log=self.log
                )
            else:
                pending = all_reduce(padded, self.group, scale=self.scale, async_op=self.overlap, log=self.log)
                size = shard.shard_numel
                out = padded[self.rank * size : (self.rank + 1) * size]
        self.streams.hold_until_comm_done(padded)
        self.memory.allocate(MemoryKind.GRAD_BUCKETS, tensor_bytes(padded))
        self._alone.append((pid, out, padded, pending))

    def _flush_current(self) -> None:
        index = self._current
        bucket = self.buckets[index]
        if bucket is None or bucket.is_empty():
            return
        with profiled(f"z3kit.reduce_bucket {len(bucket)} grads"), self.streams.on_comm():
            self._flights[index] = bucket.flush(self.group, scale=self.scale, async_op=self.overlap, log=self.log)
        self.streams.hold_until_comm_done(bucket.buffer)
        self._current = (index + 1) % len(self.buckets)
        # the next bucket may still be reducing: finish it before it takes gradients
        self._land(self._current)

    def _land(self, index: int) -> None:
        flight = self._flights.pop(index, None)
        if flight is None:
            return
        start = time.perf_counter()
        parts = flight.wait()
        self.streams.compute_wait_comm()
        self.comm_wait_s += time.perf_counter() - start
        partitions = self.window()
        for pid, part in parts:
            partitions.accumulate(self.slot[pid], part)

    def window(self) -> GradPartitionBuffer:
        """This window's partitions, allocated at its first landing."""
        if self.partitions is None:
            self.partitions = GradPartitionBuffer(self._partition_numels, dtype=torch.float32, device=self.device)
            self.memory.allocate(MemoryKind.GRAD_PARTITIONS, tensor_bytes(self.partitions.buffer))
        return self.partitions

    def finish(self) -> None:
        """End of backward: reduce what is left, land every partition, drop the buckets."""
        self._flush_current()
        for index in list(self._flights):
            self._land(index)
        self._land_alone()
        self._drop_buckets()

    def _land_alone(self, finished_only: bool = False) -> None:
        """Land the unbucketed reductions in flight (with ``finished_only``,
        those that completed already, without waiting)."""
        waiting = []
        for flight in self._alone:
            pid, out, padded, pending = flight
            if finished_only and not pending.is_completed():
                waiting.append(flight)
                continue
            start = time.perf_counter()
            pending.wait()
            self.streams.compute_wait_comm()
            self.comm_wait_s += time.perf_counter() - start
            self.window().accumulate(self.slot[pid], out)
            self.memory.free(MemoryKind.GRAD_BUCKETS, tensor_bytes(padded))
        self._alone = waiting

    # -- optimizer side ---------------------------------------------------------------
    def optimizer_grads(self) -> list[torch.Tensor | None]:
        """Each trainable parameter's accumulated partition, None where it got no gradient this window."""
        if self.partitions is None:
            return [None] * len(self._partition_numels)
        return self.partitions.optimizer_grads()

    def end_window(self) -> None:
        """The optimizer consumed the window (or it was discarded): drop the partitions."""
        if self.partitions is not None:
            self.memory.free(MemoryKind.GRAD_PARTITIONS, tensor_bytes(self.partitions.buffer))
            self.partitions = None

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the partitions so the global gradient norm is at most
        ``max_norm``; returns the norm before clipping."""
        local = self.partitions.squared_norm() if self.partitions is not None else torch.zeros((), device=self.device)
        squared = local.reshape(1).to(torch.float32)
        all_reduce(squared, self.group, log=self.log)
        norm = squared.sqrt()[0]
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0 and self.partitions is not None:
            self.partitions.scale_(coef)
        return norm
