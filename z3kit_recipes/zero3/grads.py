"""The gradient path of the stock runtime: bucket, reduce, accumulate.

``GradReducer`` receives each parameter's full gradient as it becomes
ready (from a grad-ready hook, or a leaf unit's callback), copies it into a
``FlatBucket``, reduces full buckets (sum, scaled to the data-parallel and
micro-step mean), and copies or adds every rank-local partition into the
``GradPartitionBuffer`` that the optimizer reads. With ``overlap_comm`` two
buckets alternate: one fills while the other's reduction is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import time

import torch

from z3kit.collectives import CollectiveLog, Pending, ProcessGroup, all_reduce, reduce_scatter
from z3kit.flat_bucket import BucketFlush, FlatBucket, ReduceMode
from z3kit.grad_partition import GradPartitionBuffer
from z3kit.shard import ParamShard
from z3kit.streams import StreamPairLike
from z3kit_recipes.zero3.params import profiled


class GradReducer:
    """Per-rank gradient partitions of the trainable parameters."""

    def __init__(
        self,
        shards: Sequence[ParamShard],
        trainable: Sequence[int],
        *,
        group: ProcessGroup,
        streams: StreamPairLike,
        log: CollectiveLog,
        bucket_size: int,
        bucket_dtype: torch.dtype,
        mode: ReduceMode,
        overlap: bool,
        contiguous: bool,
        scale: float,
    ) -> None:
        self.shards = shards
        self.group, self.streams, self.log = group, streams, log
        self.mode, self.overlap, self.scale = mode, overlap, scale
        first = shards[trainable[0]]
        self.rank, self.world, self.device = first.rank, first.world, first.shard.device
        #: partition slot of each trainable parameter id
        self.slot = {pid: i for i, pid in enumerate(trainable)}
        self.partitions = GradPartitionBuffer(
            [shards[p].shard_numel for p in trainable], dtype=torch.float32, device=self.device
        )
        padded_total = sum(shards[p].padded_numel for p in trainable)
        # no bucket is larger than what the whole model can fill
        capacity = min(bucket_size, padded_total)
        self.buckets: list[FlatBucket] = []
        if contiguous and capacity >= self.world:
            count = 2 if overlap else 1
            self.buckets = [
                FlatBucket(capacity, rank=self.rank, world=self.world, dtype=bucket_dtype, device=self.device, mode=mode)
                for _ in range(count)
            ]
        self.bucket_dtype = bucket_dtype
        self._current = 0
        #: seconds spent blocked on reductions
        self.comm_wait_s = 0.0
        self._flights: dict[int, BucketFlush] = {}  # bucket index -> its reduction in flight
        # unbucketed reductions in flight: (pid, this rank's partition, padded input kept alive, handle)
        self._alone: list[tuple[int, torch.Tensor, torch.Tensor, Pending]] = []

    # -- adding ------------------------------------------------------------------
    def add(self, pid: int, grad: torch.Tensor) -> None:
        """Take parameter ``pid``'s full gradient (the caller may drop it afterwards)."""
        if grad.dtype != self.bucket_dtype:
            grad = grad.to(self.bucket_dtype)
        padded = self.shards[pid].padded_numel
        if not self.buckets or padded > self.buckets[0].capacity:
            self._reduce_alone(pid, grad)
            return
        bucket = self.buckets[self._current]
        if bucket.would_overflow(grad.numel()):
            self._flush_current()
            bucket = self.buckets[self._current]
        bucket.add(pid, grad)

    def _reduce_alone(self, pid: int, grad: torch.Tensor) -> None:
        """A gradient larger than a bucket (or with contiguous_gradients off)
        gets a collective of its own on a padded copy."""
        shard = self.shards[pid]
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
        self._alone.append((pid, out, padded, pending))

    def _flush_current(self) -> None:
        index = self._current
        bucket = self.buckets[index]
        if bucket.is_empty():
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
        for pid, part in parts:
            self.partitions.accumulate(self.slot[pid], part)

    def finish(self) -> None:
        """End of backward: reduce what is left and land every partition."""
        if self.buckets:
            self._flush_current()
            for index in list(self._flights):
                self._land(index)
        for pid, out, _padded, pending in self._alone:
            start = time.perf_counter()
            pending.wait()
            self.streams.compute_wait_comm()
            self.comm_wait_s += time.perf_counter() - start
            self.partitions.accumulate(self.slot[pid], out)
        self._alone.clear()

    # -- optimizer side ---------------------------------------------------------------
    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the partitions so the global gradient norm is at most
        ``max_norm``; returns the norm before clipping."""
        squared = self.partitions.squared_norm().reshape(1).to(torch.float32)
        all_reduce(squared, self.group, log=self.log)
        norm = squared.sqrt()[0]
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            self.partitions.scale_(coef)
        return norm
