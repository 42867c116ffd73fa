"""Gathers of the stock runtime: issued, in flight, installed, freed.

``Gatherer`` is the only code that turns a gather in flight into available
parameters: it issues coalesced gathers on the gather stream pair, completes
them (compute waits on the communication's event, the parameters are
installed), frees gathered copies, and keeps the accounting (the
``PrefetchLimiter``'s live elements, the ``MemoryLedger``, the seconds
blocked). What to prefetch and when is the plan's
(``zero3.training.step_plans``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from z3kit.collectives import CollectiveLog, ProcessGroup, all_gather
from z3kit.memory import MemoryKind, MemoryLedger
from z3kit.prefetch import PrefetchLimiter
from z3kit.shard import GatherHandle, ParamShard, ParamStatus, gather_shards
from z3kit.streams import StreamPairLike
from z3kit_recipes.zero3.ranks.agreement import StepRecord, Waiter
from z3kit_recipes.zero3.training.secondary import SecondaryPartitions
from z3kit_recipes.zero3.training.timeline import profiled


class Gatherer:
    """Owner of every gather of one model's shards (see the module docstring)."""

    def __init__(
        self,
        shards: Sequence[ParamShard],
        *,
        group: ProcessGroup,
        streams: StreamPairLike,
        limiter: PrefetchLimiter,
        log: CollectiveLog,
        memory: MemoryLedger,
        record: StepRecord,
        waiter: Waiter,
        overlap: bool,
        before_gather: Callable[[Sequence[int]], None] | None = None,
        secondary: SecondaryPartitions | None = None,
    ) -> None:
        self.shards = list(shards)
        self.group, self.streams, self.log, self.memory = group, streams, log, memory
        self.limiter, self.record, self.waiter = limiter, record, waiter
        #: prefetches are left in flight (else waited on at once)
        self.overlap = overlap
        self.index = {id(s.param): pid for pid, s in enumerate(self.shards)}
        self.numels = [s.numel for s in self.shards]
        self._element_size = self.shards[0].shard.element_size()
        #: bytes of each parameter's gathered storage (its padded full size; none at world 1)
        self._gathered_bytes = [s.gathered_bytes for s in self.shards]
        self._handles: dict[int, GatherHandle] = {}
        #: gathers left in flight when the ranks stopped running together (kept alive, never waited on)
        self._abandoned: list[GatherHandle] = []
        #: seconds spent blocked on gathers (demand gathers and waits on prefetches)
        self.comm_wait_s = 0.0
        #: called with the parameters of each gather before it is issued (offload: their update must be written)
        self.before_gather = before_gather
        #: hpZ: backward gathers from slices within the node (``zero3.training.secondary``); None: off
        self.secondary = secondary

    # -- issue and complete --------------------------------------------------------------
    def gather(self, pids: list[int], *, wait: bool) -> None:
        """One collective for ``pids`` (all NOT_AVAILABLE); completed now with ``wait``. Under
        hpZ, two in backward: over every rank, and from the slices within the node."""
        if self.before_gather is not None:
            self.before_gather(pids)
        if self.secondary is None:
            self._gather(pids, wait, None)
            return
        everywhere, in_node = self.secondary.split(pids)
        if everywhere:
            self._gather(everywhere, wait, None)
        if in_node:
            self._gather(in_node, wait, self.secondary)

    def _gather(self, pids: list[int], wait: bool, secondary: SecondaryPartitions | None) -> None:
        self.limiter.on_gather(sum(self.numels[p] for p in pids))
        shards = [self.shards[p] for p in pids]
        if secondary is None:
            handle = gather_shards(shards, self.group, streams=self.streams, async_op=True, log=self.log)
        else:
            handle = gather_shards(shards, secondary.group, streams=self.streams, async_op=True, log=self.log,
                                   sources=secondary.sources(pids))
        self.record.gathers += 1
        # one parameter is gathered into its own buffer; several into an output
        # buffer that completion copies out of (both exist for a moment) and frees
        staging = handle.staging_numel * self._element_size
        self.memory.allocate(MemoryKind.GATHERED_PARAMS, staging or self._gathered_bytes[pids[0]])
        for p in pids:
            self._handles[p] = handle
        if wait:
            self._complete(handle)

    def _complete(self, handle: GatherHandle) -> None:
        start = time.perf_counter()
        handle.wait(self.waiter)  # compute waits on the gather's event; the parameters are installed
        self.comm_wait_s += time.perf_counter() - start
        for s in handle.shards:
            self._handles.pop(self.index[id(s.param)], None)
        pids = [self.index[id(s.param)] for s in handle.shards]
        if handle.staging_numel:
            self.memory.allocate(MemoryKind.GATHERED_PARAMS, sum(self._gathered_bytes[p] for p in pids))
            self.memory.free(MemoryKind.GATHERED_PARAMS, handle.staging_numel * self._element_size)
        if self.secondary is not None:
            self.secondary.keep(pids)
        self.limiter.on_gather_done()

    def shards_updated(self, pids: Iterable[int]) -> None:
        """The shards of ``pids`` changed (``EngineCore.shards_changed``): hpZ's slices of them are stale."""
        if self.secondary is not None:
            self.secondary.invalidate(pids)

    def ensure_gathered(self, pids: Iterable[int]) -> None:
        """Make ``pids`` AVAILABLE now: gather the missing ones in one
        collective and complete those in flight."""
        missing, inflight = [], []
        for p in pids:
            status = self.shards[p].status
            if status is ParamStatus.NOT_AVAILABLE:
                missing.append(p)
            elif status is ParamStatus.INFLIGHT:
                inflight.append(p)
        if missing:
            self.gather(missing, wait=True)
        for p in inflight:
            handle = self._handles.get(p)
            if handle is not None:
                self._complete(handle)

    def gather_union(self, pids: list[int], install: set[int]) -> None:
        """One collective over ``pids``, the same list on every rank
        (``zero3.training.rounds``): each rank contributes its shards, installs those
        of ``install`` (NOT_AVAILABLE here) and discards the rest, whatever
        their status here. Completed now, on the compute stream: the rounds
        wait for their agreement anyway, so there is nothing to overlap."""
        if self.before_gather is not None:
            self.before_gather(pids)
        shards = [self.shards[p] for p in pids]
        world = shards[0].world
        mine = torch.cat([s.shard for s in shards])
        out = mine.new_empty(world * mine.numel())
        staging = out.numel() * self._element_size
        self.memory.allocate(MemoryKind.GATHERED_PARAMS, staging)
        installed = [p for p in pids if p in install]
        self.limiter.on_gather(sum(self.numels[p] for p in installed))
        pending = all_gather(out, mine, self.group, async_op=True, log=self.log)
        self.record.gathers += 1
        start = time.perf_counter()
        self.waiter(pending.is_completed, pending.wait)
        self.comm_wait_s += time.perf_counter() - start
        rows, offset = out.view(world, -1), 0
        for p, shard in zip(pids, shards):
            if p in install:
                shard.materialize().view(world, -1).copy_(rows[:, offset : offset + shard.shard_numel])
                shard.install()
                self.memory.allocate(MemoryKind.GATHERED_PARAMS, self._gathered_bytes[p])
            offset += shard.shard_numel
        self.memory.free(MemoryKind.GATHERED_PARAMS, staging)
        self.limiter.on_gather_done()

    def wait_inflight(self) -> None:
        """Complete every gather in flight; nothing is released."""
        for handle in list({id(h): h for h in self._handles.values()}.values()):
            self._complete(handle)

    def abandon_inflight(self) -> None:
        """Forget the gathers in flight without waiting (the ranks no longer
        run together, so they may never finish). Their tickets keep the
        buffers referenced, since the collective may still write into them;
        the parameters count as not gathered."""
        for handle in {id(h): h for h in self._handles.values()}.values():
            self._abandoned.append(handle)
            for s in handle.shards:
                s.status = ParamStatus.NOT_AVAILABLE
        self._handles.clear()

    def staging_numel(self) -> int:
        """Elements of the coalesced gathers' output buffers in flight."""
        return sum({id(h): h.staging_numel for h in self._handles.values()}.values())

    def gathered(self) -> list[int]:
        return [p for p, s in enumerate(self.shards) if s.status is ParamStatus.AVAILABLE]

    # -- free ---------------------------------------------------------------------------
    def free(self, pids: Iterable[int]) -> int:
        """Release those of ``pids`` that are gathered; returns their elements."""
        numel = nbytes = 0
        for pid in pids:
            shard = self.shards[pid]
            if shard.status is not ParamStatus.AVAILABLE:
                continue
            shard.release()
            numel += self.numels[pid]
            nbytes += self._gathered_bytes[pid]
        if numel or nbytes:
            self.limiter.on_release(numel)
            self.memory.free(MemoryKind.GATHERED_PARAMS, nbytes)
        return numel

    # -- prefetch -------------------------------------------------------------------------
    def prefetch(self, pids: Sequence[int]) -> int:
        """Gather, in one collective, those of ``pids`` not gathered or in flight
        (the plan's prefetch after a fetch); returns their elements."""
        shards = self.shards
        picked = [p for p in pids if shards[p].status is ParamStatus.NOT_AVAILABLE]
        if not picked:
            return 0
        with profiled("z3kit.prefetch", len(picked), "params"):
            self.gather(picked, wait=not self.overlap)
        return sum(self.numels[p] for p in picked)
