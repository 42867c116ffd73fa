"""FlatBucket: a preallocated contiguous gradient bucket.

Gradients are copied into slices of one flat buffer so that a single
collective reduces many of them. Two layouts, one per reduction path:

* ``ReduceMode.ALL_REDUCE``: parameter-major. Each gradient takes its padded
  length ``world * shard_numel`` contiguously; after the all-reduce this
  rank's partition is the ``rank``-th chunk of that slice.
* ``ReduceMode.REDUCE_SCATTER``: rank-major. The buffer is viewed as
  ``(world, capacity // world)``; a gradient's padded form, viewed as
  ``(world, shard_numel)``, fills columns ``[col, col + shard_numel)``. Rank
  ``r``'s row is then exactly its partitions back to back, so one
  reduce-scatter leaves every partition of the bucket on its rank. Half the
  traffic of an all-reduce (on gloo too, where ``z3kit.collectives`` runs
  it as an all-to-all).

Padding is zero-filled on every add, so partitions of parameters whose size
is not a multiple of the world size end in zeros.
"""

from __future__ import annotations

import enum

import torch

from z3kit.collectives import Blocker, CollectiveLog, Pending, ProcessGroup, all_reduce, reduce_scatter
from z3kit.streams import CommTicket, StreamPairLike, SyncStreamPair
from z3kit.shard import shard_numel_for
from z3kit.validate import check_int


class ReduceMode(enum.Enum):
    """How a bucket is reduced."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"


class BucketFlush:
    """An issued bucket reduction. ``wait()`` completes it on its stream pair
    and returns ``[(key, partition)]``.

    The partitions are views into the bucket's buffers: consume them (copy
    or add them elsewhere) before the bucket takes new gradients.
    """

    __slots__ = ("_pending", "_parts", "_bucket", "_streams", "ticket")

    def __init__(
        self,
        bucket: FlatBucket,
        pending: Pending,
        parts: list[tuple[int, torch.Tensor]],
        streams: StreamPairLike,
        ticket: CommTicket,
    ) -> None:
        self._bucket = bucket
        self._pending = pending
        self._parts = parts
        self._streams = streams
        #: the communication: the bucket's buffers and, once waited on, its event
        self.ticket = ticket

    def is_completed(self, timeout_s: float = 0.0) -> bool:
        """True once the reduction finished on the device; see ``Pending.is_completed``
        (a completed ticket only says that compute was ordered after it)."""
        return self._pending.is_completed(timeout_s)

    def wait(self, block: Blocker | None = None) -> list[tuple[int, torch.Tensor]]:
        finish = self._pending.wait
        self._streams.complete(self.ticket, finish if block is None else lambda: block(self.is_completed, finish))
        self._bucket.landed(self)
        return self._parts


class FlatBucket:
    """``capacity`` elements of gradient storage reduced by one collective."""

    def __init__(
        self,
        capacity: int,
        *,
        rank: int,
        world: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        mode: ReduceMode = ReduceMode.ALL_REDUCE,
    ) -> None:
        check_int("capacity", capacity)
        if not isinstance(mode, ReduceMode):
            raise TypeError(f"mode must be a ReduceMode, got {mode!r}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
        if capacity < world:
            raise ValueError(f"capacity must be at least the world size ({world}), got {capacity}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"gradient buckets hold floating-point values, got {dtype}")
        self.rank, self.world, self.mode = rank, world, mode
        self.capacity = capacity - capacity % world
        self.buffer = torch.empty(self.capacity, dtype=dtype, device=device)
        self._out = (
            torch.empty(self.capacity // world, dtype=dtype, device=device)
            if mode is ReduceMode.REDUCE_SCATTER
            else None
        )
        self._used = 0  # elements (all-reduce) or columns x world (reduce-scatter)
        self._entries: list[tuple[int, int, int]] = []  # (key, offset or column, shard_numel)
        self._pending: dict[int, int] = {}  # reserved key -> its entry, until added
        self._in_flight: BucketFlush | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this bucket holds (its buffer, and the reduce-scatter output)."""
        out = 0 if self._out is None else self._out.numel() * self._out.element_size()
        return self.buffer.numel() * self.buffer.element_size() + out

    @property
    def used(self) -> int:
        """Elements of the buffer taken so far."""
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def is_empty(self) -> bool:
        return not self._entries

    def padded_numel(self, numel: int) -> int:
        return shard_numel_for(numel, self.world) * self.world

    def would_overflow(self, numel: int) -> bool:
        """True if a gradient of ``numel`` elements does not fit in what is left."""
        return self._used + self.padded_numel(numel) > self.capacity

    def reserve(self, key: int, numel: int) -> None:
        """Take the next slice for a gradient of ``numel`` elements that ``add``
        will fill later, in whatever order gradients arrive: a bucket whose
        slices are all reserved up front has the same layout on every rank."""
        self._take(key, numel)
        self._pending[key] = len(self._entries) - 1

    def add(self, key: int, grad: torch.Tensor) -> None:
        """Copy ``grad`` into its reserved slice, or the next one; raises if it would overflow."""
        if self._in_flight is not None:
            raise ValueError("bucket is being reduced; wait on its flush before adding gradients")
        if grad.dtype != self.buffer.dtype:
            raise TypeError(f"gradient dtype {grad.dtype} differs from the bucket's {self.buffer.dtype}")
        if grad.device != self.buffer.device:
            raise ValueError(f"gradient is on {grad.device} but the bucket is on {self.buffer.device}")
        index = self._pending.pop(key, None)
        if index is None:
            self._take(key, grad.numel())
            index = len(self._entries) - 1
        elif shard_numel_for(grad.numel(), self.world) != self._entries[index][2]:
            raise ValueError(f"gradient {key} has {grad.numel()} elements; its reserved slice is for another size")
        self._write(index, grad.reshape(-1))

    def accumulate(self, key: int, grad: torch.Tensor) -> None:
        """Add ``grad`` into the slice that ``add`` already filled for ``key``:
        a second gradient of one parameter in one backward (a parameter shared
        by two reentrant checkpoint segments) counts as a sum, never a copy."""
        if self._in_flight is not None:
            raise ValueError("bucket is being reduced; wait on its flush before adding gradients")
        index = next((i for i, entry in enumerate(self._entries) if entry[0] == key and i not in self._pending.values()), None)
        if index is None:
            raise ValueError(f"gradient {key} has no filled slice in this bucket to add to; add() it first")
        if grad.dtype != self.buffer.dtype or shard_numel_for(grad.numel(), self.world) != self._entries[index][2]:
            raise ValueError(f"gradient {key} ({grad.numel()} elements, {grad.dtype}) does not match its slice")
        self._write(index, grad.reshape(-1), add=True)

    def skip(self, key: int) -> None:
        """Zeros in ``key``'s reserved slice: it gets no gradient on this rank
        (an expert without tokens) but is reduced with the rest. A key that is
        not waiting for its gradient (already added) is left as it is."""
        index = self._pending.pop(key, None)
        if index is not None:
            _, where, shard = self._entries[index]
            self._region(where, shard).zero_()

    def missing(self) -> list[int]:
        """Keys reserved and not added yet."""
        return list(self._pending)

    def is_full(self) -> bool:
        """Every reserved slice got its gradient (``missing()`` is empty)."""
        return not self._pending

    def zero_missing(self) -> None:
        """Zeros in every reserved slice that got no gradient (a parameter
        unused on this rank): the bucket can be reduced with the rest."""
        for index in self._pending.values():
            _, where, shard = self._entries[index]
            self._region(where, shard).zero_()
        self._pending.clear()

    def _take(self, key: int, numel: int) -> None:
        if self._in_flight is not None:
            raise ValueError("bucket is being reduced; wait on its flush before adding gradients")
        if self.would_overflow(numel):
            raise ValueError(
                f"gradient of {numel} elements (padded {self.padded_numel(numel)}) overflows the bucket: "
                f"{self.capacity - self._used} of {self.capacity} elements left; flush first"
            )
        shard = shard_numel_for(numel, self.world)
        where = self._used if self.mode is ReduceMode.ALL_REDUCE else self._used // self.world
        self._entries.append((key, where, shard))
        self._used += shard * self.world

    def _region(self, where: int, shard: int) -> torch.Tensor:
        """The slice of entry at ``where`` (offset or column): flat, or (world, shard)."""
        if self.mode is ReduceMode.ALL_REDUCE:
            return self.buffer[where : where + shard * self.world]
        return self.buffer.view(self.world, -1)[:, where : where + shard]

    def _write(self, index: int, flat: torch.Tensor, *, add: bool = False) -> None:
        _, where, shard = self._entries[index]
        numel = flat.numel()
        if self.mode is ReduceMode.ALL_REDUCE:
            target, source = self.buffer[where : where + numel], flat
        else:
            padded = flat if numel == shard * self.world else torch.cat([flat, flat.new_zeros(shard * self.world - numel)])
            target, source = self._region(where, shard), padded.view(self.world, shard)
        if add:
            target.add_(source)
            return
        target.copy_(source)
        if self.mode is ReduceMode.ALL_REDUCE and numel != shard * self.world:
            self.buffer[where + numel : where + shard * self.world].zero_()

    def landed(self, flush: BucketFlush) -> None:
        """``flush`` was waited on: the bucket takes gradients again (a stale
        flush waited on again does not unlock a newer one still in flight)."""
        if self._in_flight is flush:
            self._in_flight = None

    def flush(
        self,
        group: ProcessGroup,
        *,
        streams: StreamPairLike | None = None,
        scale: float = 1.0,
        async_op: bool = False,
        log: CollectiveLog | None = None,
    ) -> BucketFlush:
        """Reduce (sum, then ``scale``) everything added so far, on
        ``streams``'s communication stream (default: inline, for CPU); this
        rank's partitions come back from ``wait()``. The bucket is empty afterwards."""
        if self._in_flight is not None:
            raise ValueError("bucket is already being reduced; wait on the previous flush")
        if not self._entries:
            raise ValueError("flush of an empty bucket")
        if self._pending:
            raise ValueError(f"reserved gradients {sorted(self._pending)} were not added; add them or zero_missing() first")
        if streams is None:
            streams = SyncStreamPair(self.buffer.device)
        used, entries = self._used, self._entries
        label = f"{self.mode.value} of a bucket of {len(entries)} gradient(s)"
        parts: list[tuple[int, torch.Tensor]]
        if self.mode is ReduceMode.ALL_REDUCE:
            region = self.buffer[:used]
            with streams.communicate(reads=[region], writes=[region], label=label) as ticket:
                pending = all_reduce(region, group, scale=scale, async_op=True, log=log)
            parts = [
                (key, self.buffer[off + self.rank * shard : off + (self.rank + 1) * shard])
                for key, off, shard in entries
            ]
        else:
            assert self._out is not None
            columns = used // self.world
            rows = self.buffer.view(self.world, -1)
            out = self._out[:columns]
            with streams.communicate(reads=[self.buffer[:used]], writes=[out], label=label) as ticket:
                # a partly filled bucket's rows are not adjacent; compact them first
                source = self.buffer[:used] if columns == rows.shape[1] else rows[:, :columns].contiguous().view(-1)
                ticket.hold(reads=[source])
                pending = reduce_scatter(out, source, group, scale=scale, async_op=True, log=log)
            parts = [(key, out[col : col + shard]) for key, col, shard in entries]
        self._entries, self._used = [], 0
        flush = BucketFlush(self, pending, parts, streams, ticket)
        self._in_flight = flush
        if not async_op:  # done now; the bucket stays locked until wait() hands the partitions over
            streams.complete(ticket, pending.wait)
        return flush
