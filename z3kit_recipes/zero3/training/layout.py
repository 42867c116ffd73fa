"""The shard layout of one model: every parameter's 1/N slice as a view of
one flat buffer, the fp32 master shards, and how rank 0's values get there.

Note: one flat buffer.
    All shards are views of one flat buffer, in parameter order: a
    coalesced gather of neighbouring parameters then reads its input in
    place instead of concatenating it (see ``z3kit.shard.gather_shards``).
    In fp32 runs the shard is the master itself: the optimizer updates it in
    place. Other compute dtypes get fp32 master shards of their own, filled
    from the full fp32 values (not from the rounded shard). With the
    optimizer offloaded (``host_masters``) every master is a tensor of its
    own, fp32, those of ``host_masters`` in host memory (pinned where
    ``pin``), whatever the compute dtype (``zero3.training.offload``).

Note: what initialize holds at once.
    The layout is allocated empty first and the optimizer is built on it,
    so that a failing optimizer factory leaves the model untouched. Then
    rank 0's values arrive one parameter at a time (small ones a chunk of
    ``CHUNK_NUMEL`` elements at a time): a large parameter is broadcast in
    place, each rank fills its shard from it and releases the full tensor
    at once. The model's own storage shrinks as the shards fill, smallest
    parameters first, so the large shards are written when most of the
    model is already gone: a rank holds little more than the model as it
    was given (on a CPU, where the untouched part of the empty flat buffer
    costs nothing; an accelerator's allocator counts the shard buffer, 1/N,
    at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

from z3kit.collectives import CollectiveLog, ProcessGroup, all_gather, broadcast
from z3kit.memory import MemoryKind, MemoryLedger, storage_bytes
from z3kit.shard import ParamShard, fill_partition, shard_numel_for

#: parameters smaller than this are broadcast together, through one buffer of at most this many elements
CHUNK_NUMEL = 1 << 20


@attrs.define(eq=False)
class ShardLayout:
    """This rank's shards of every parameter, and the optimizer's master shards."""

    shards: list[ParamShard]
    #: the buffer every shard is a view of
    flat: torch.Tensor
    #: ids of the parameters that require grad, in parameter order
    trainable: list[int]
    #: the optimizer's parameters, one per trainable parameter
    masters: list[nn.Parameter]
    _masters: dict[int, nn.Parameter] = attrs.field(init=False)
    #: parameters whose masters live on the host (None: no offload, every master on the shards' device)
    host_masters: frozenset[int] | None = None
    #: the host masters are in pinned memory
    pin: bool = False

    def __attrs_post_init__(self) -> None:
        self._masters = dict(zip(self.trainable, self.masters))

    @property
    def masters_are_shards(self) -> bool:
        return self.flat.dtype == torch.float32 and self.host_masters is None

    @property
    def offloaded(self) -> frozenset[int]:
        """Parameters whose masters live on the host (empty: no offload)."""
        return self.host_masters or frozenset()

    def master_device(self, pid: int) -> torch.device:
        """Where ``pid``'s master lives: the host when it is offloaded, else with the shards."""
        return torch.device("cpu") if pid in self.offloaded else self.flat.device

    def count_masters(self, memory: MemoryLedger) -> None:
        """The separate masters in ``memory``, by where they live (none when the masters are the shards)."""
        if self.masters_are_shards:
            return
        host, by_pid = self.offloaded, self.master_of()
        memory.set(MemoryKind.FP32_MASTERS, storage_bytes(m for pid, m in by_pid.items() if pid not in host))
        memory.set(MemoryKind.HOST_FP32_MASTERS, storage_bytes(m for pid, m in by_pid.items() if pid in host))

    def _new_master(self, pid: int, values: torch.Tensor | None) -> nn.Parameter:
        """A separate fp32 master for ``pid`` where it lives: ``values`` copied, or empty."""
        device = self.master_device(pid)
        out = torch.empty(self.shards[pid].shard_numel, dtype=torch.float32, device=device,
                          pin_memory=self.pin and device != self.flat.device)
        if values is not None:
            out.copy_(values)
        return nn.Parameter(out)

    @classmethod
    def allocate(
        cls,
        params: Sequence[nn.Parameter],
        *,
        rank: int,
        world: int,
        dtype: torch.dtype,
        device: torch.device,
        trainable: bool = True,
        host_masters: frozenset[int] | None = None,
        pin: bool = False,
    ) -> ShardLayout:
        """Empty shards (and masters) for ``params``; the parameters keep their
        values. ``trainable=False``: no masters at all (an inference-only engine).
        ``host_masters``: the offloaded parameters (see the Note)."""
        sizes = [shard_numel_for(p.numel(), world) for p in params]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        shards = [
            ParamShard(p, p.shape, p.numel(), rank, world, view) for p, view in zip(params, flat.split(sizes))
        ]
        trainable_ids = [pid for pid, p in enumerate(params) if p.requires_grad] if trainable else []
        layout = cls(shards, flat, trainable_ids, [], host_masters, pin)
        if layout.masters_are_shards:
            masters = [nn.Parameter(shards[pid].shard) for pid in trainable_ids]
        else:
            masters = [layout._new_master(pid, None) for pid in trainable_ids]
        layout.add_trainable(trainable_ids, masters)
        return layout

    def new_masters(self, pids: Sequence[int]) -> list[nn.Parameter]:
        """Master shards for ``pids``, not trainable yet, made from their shards
        (the shard itself in fp32 runs; else its values widened to fp32)."""
        if self.masters_are_shards:
            return [nn.Parameter(self.shards[pid].shard) for pid in pids]
        return [self._new_master(pid, self.shards[pid].shard.detach()) for pid in pids]

    def add_trainable(self, pids: Sequence[int], masters: Sequence[nn.Parameter]) -> None:
        """``pids`` train from now on with ``masters`` (from ``new_masters``):
        inserted in parameter order, in place, so that every holder of
        ``trainable`` and ``masters`` sees the same lists."""
        self._masters.update(zip(pids, masters))
        order = sorted(self._masters)
        self.trainable[:] = order
        self.masters[:] = [self._masters[pid] for pid in order]

    def master_of(self) -> dict[int, nn.Parameter]:
        """Master shard by parameter id (trainable parameters only)."""
        return dict(self._masters)

    def fill_from_rank0(self, pids: Sequence[int], group: ProcessGroup, log: CollectiveLog) -> None:
        """The shards (and masters) of ``pids`` from rank 0's full values,
        releasing each parameter's full tensor as soon as its shard is
        filled (see the Note on what initialize holds at once)."""
        for chunk in _chunks([self.shards[p] for p in pids]):
            pids_of_chunk = [pids[i] for i in chunk]
            # no name holds the values: they are freed as soon as fill returns
            params = [self.shards[p].param for p in pids_of_chunk]
            self.fill(pids_of_chunk, _rank0_values(params, self.flat.device, group, log))

    def fill(self, pids: Sequence[int], fulls: Sequence[torch.Tensor]) -> None:
        """Fill the shards (and masters) of ``pids`` from flat full values, then release them."""
        masters = {} if self.masters_are_shards else self._masters
        for pid, full in zip(pids, fulls):
            shard = self.shards[pid]
            fill_partition(shard.shard, full, shard.rank, shard.world)
            master = masters.get(pid)
            if master is not None:
                fill_partition(master.data, full, shard.rank, shard.world)
            shard.release()

    def fill_local(self, pid: int, local: torch.Tensor, *, keep_rounded: bool = False) -> None:
        """This rank's slice of a parameter's flat values (``shard_numel`` or
        fewer elements; the padding becomes zeros) into its shard and master.

        ``keep_rounded``: a separate fp32 master keeps each element whose
        value rounds to the one given (``local`` in the compute dtype, as
        ``model.state_dict()`` gives it), so that a state dict's round trip
        changes nothing in any dtype; any other value is written whole."""
        shard = self.shards[pid]
        n = local.numel()
        master = self._masters.get(pid) if not self.masters_are_shards else None
        if master is not None:
            kept = master.data[:n]
            given = local.to(kept.device)
            if keep_rounded and local.dtype != kept.dtype:
                given = torch.where(kept.to(local.dtype).eq(given), kept, given.to(kept.dtype))
            kept.copy_(given)
            master.data[n:].zero_()
        shard.shard.data[:n].copy_(local)
        shard.shard.data[n:].zero_()

    def local_range(self, pid: int) -> tuple[int, int]:
        """``[start, stop)`` of the flattened parameter that this rank's shard holds (empty past its end)."""
        shard = self.shards[pid]
        start = min(shard.rank * shard.shard_numel, shard.numel)
        return start, min(start + shard.shard_numel, shard.numel)

    def gather_full(self, pid: int, group: ProcessGroup, log: CollectiveLog) -> torch.Tensor:
        """The parameter's full flat values on every rank (collective), from
        its fp32 master when it has one, else from its shard."""
        source = self._masters.get(pid, self.shards[pid].shard) if not self.masters_are_shards else self.shards[pid].shard
        source = source.detach().to(self.flat.device)  # a host master goes through the device
        out = source.new_empty(source.numel() * self.shards[pid].world)
        all_gather(out, source, group, log=log)
        return out[: self.shards[pid].numel]


def _chunks(shards: Sequence[ParamShard]) -> list[list[int]]:
    """Positions in ``shards``: large parameters alone, runs of small ones of one dtype
    up to ``CHUNK_NUMEL`` elements together; the smallest chunks first, so
    that the largest shards are written when most full tensors are gone."""
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for pid, s in enumerate(shards):
        if s.numel >= CHUNK_NUMEL:
            chunks.append([pid])
            continue
        if current and (size + s.numel > CHUNK_NUMEL or s.param.dtype != shards[current[0]].param.dtype):
            chunks.append(current)
            current, size = [], 0
        current.append(pid)
        size += s.numel
    if current:
        chunks.append(current)
    return sorted(chunks, key=lambda pids: sum(shards[p].numel for p in pids))


def _rank0_values(
    params: Sequence[nn.Parameter], device: torch.device, group: ProcessGroup, log: CollectiveLog
) -> list[torch.Tensor]:
    """Rank 0's values of ``params``, flat, on ``device``. A single
    contiguous parameter already on ``device`` is broadcast in place (its
    full tensor is released right after); others go through one buffer."""
    world = torch.distributed.get_world_size(group)
    if len(params) == 1:
        flat = params[0].detach().reshape(-1).to(device)  # a view where it can be, else a copy
        buffers = [flat]
    else:
        flat = torch.cat([p.detach().reshape(-1).to(device) for p in params])
        buffers = list(flat.split([p.numel() for p in params]))
    if world > 1:
        broadcast(flat, 0, group, log=log)
    return buffers
