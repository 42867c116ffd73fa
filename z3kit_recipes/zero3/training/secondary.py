"""hpZ's secondary partitions: backward gathers that stay within a node.

ZeRO++'s hierarchical partitioning (DeepSpeed's ``zero_hpz_partition_size``,
``Zero3Config.hpz_partition_size``) keeps the primary shards, the masters
and the optimizer state over every rank, as flat ZeRO-3 does, and adds a
secondary copy of each parameter sharded within a group of S ranks (one
node): when a training forward has gathered a parameter over every rank,
each rank keeps its 1/S slice of it (``keep``). A backward gather of that
parameter then collects the S slices from the node's ranks instead of the
N shards from every rank (``split``, ``sources``; ``z3kit.shard.gather_shards``
takes them as its inputs), so backward's gathers cross no node boundary.

Note: when a slice is valid.
    From the training forward that gathered the parameter to the next
    change of its shards: an optimizer step, a load, an edit under
    ``gathered_parameters(modifier_rank=...)`` (every one of them ends in
    ``EngineCore.shards_changed``, which calls ``invalidate``). A slice that
    is no longer valid is freed at once: after the optimizer step no
    backward can use it (the next forward keeps a new one), as DeepSpeed
    frees its secondary partitions after the step.
    A parameter backward needs that no training forward gathered since
    (one used in backward only) is gathered over every rank. Every rank
    gathers the same parameters in the same forward (the ranks agree on
    their fetches), so every rank splits a backward gather the same way
    and issues the same collectives; rank-divergent graphs are refused
    with hpZ for that reason (``zero3.ranks.topology``).

Note: what it costs.
    A slice of 1/S of every parameter a training forward gathers, in the
    compute dtype, held from the window's first training forward to its
    optimizer step (``MemoryKind.HPZ_SECONDARY`` in the ledger; its peak in
    ``engine.stats().memory.peak``): about Ψ/S elements per rank for a
    model of Ψ, N/S times what the primary shards take, against the gathers
    it keeps in the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from z3kit.collectives import ProcessGroup
from z3kit.memory import MemoryKind, MemoryLedger, tensor_bytes
from z3kit.shard import ParamShard
from z3kit_recipes.zero3.step.state import Phase, StepState


class SecondaryPartitions:
    """This rank's secondary slices of the parameters, over ``group`` (see the module docstring)."""

    def __init__(self, shards: Sequence[ParamShard], group: ProcessGroup, step: StepState,
                 memory: MemoryLedger) -> None:
        self.shards, self.group, self.step, self.memory = shards, group, step, memory
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        #: the valid slices, by parameter id (a stale one is dropped at once)
        self._slices: dict[int, torch.Tensor] = {}

    def split(self, pids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(gathered over every rank, gathered from the secondary slices): the second only in backward."""
        if self.step.phase is not Phase.BACKWARD:
            return list(pids), []
        return [p for p in pids if p not in self._slices], [p for p in pids if p in self._slices]

    def sources(self, pids: Sequence[int]) -> list[torch.Tensor]:
        """What this rank gives to a gather of ``pids`` from the slices."""
        return [self._slices[p] for p in pids]

    def keep(self, pids: Iterable[int]) -> None:
        """``pids`` were just gathered (installed): keep this rank's slices, in a training forward only."""
        if not (self.step.phase is Phase.FORWARD and self.step.tracing):
            return
        for pid in pids:
            if pid in self._slices:
                continue
            shard = self.shards[pid]
            n = shard.padded_numel // self.size
            kept = self._slices[pid] = shard.full[self.rank * n : (self.rank + 1) * n].clone()
            self.memory.allocate(MemoryKind.HPZ_SECONDARY, tensor_bytes(kept))

    def invalidate(self, pids: Iterable[int]) -> None:
        """The shards of ``pids`` changed: their slices are stale, and freed (see the Note on validity)."""
        for pid in pids:
            kept = self._slices.pop(pid, None)
            if kept is not None:
                self.memory.free(MemoryKind.HPZ_SECONDARY, tensor_bytes(kept))
