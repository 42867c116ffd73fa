"""Matrices cut into flat 1/N slices: an owner rank for each, the whole matrix
gathered to its owner, and the owner's result sent back as slices.

A matrix optimizer (Muon's Newton-Schulz, Shampoo's preconditioners) needs a
parameter's whole matrix, but ZeRO-3 keeps each parameter as its flat,
zero-padded 1/N slice (``z3kit.partition``: rank ``r`` holds elements
``[r * s, (r + 1) * s)``, ``s = shard_numel_for(numel, world)``), cut at
arbitrary element boundaries. ``MatrixPlan`` gives each matrix one owner,
balanced by cost over the ranks; ``gather_to_owners`` brings every matrix
whole to its owner from the slices all ranks hold, and
``scatter_from_owners`` sends the owner's result (a matrix of the same
shape) back as each rank's slice. The plan is made from shapes alone, the
same on every rank (no set or hash order), and is tested without a process
group, as are ``pack``/``unpack``, the two halves of each exchange.

Note: one all-to-all each way.
    Each exchange is one ``all_to_all_single`` with uneven splits (gloo,
    NCCL and HCCL all have it): for the gather, rank ``r`` sends to each
    owner ``d`` its slices of the matrices ``d`` owns, back to back, and
    receives from every rank its slice of each matrix it owns; the scatter
    is the same exchange reversed. A rank sends its slice of each matrix
    another rank owns and receives ``N - 1`` slices of each matrix it owns
    (``MatrixPlan.bytes_per_exchange``). Summed over the ranks, each matrix
    crosses once, less its owner's own slice: ``(N - 1) / N`` of its padded
    bytes, ``1/N`` of what an all-gather of the matrices moves (every rank
    receiving every matrix), and ``1/N`` of the gradients' reduce-scatter
    of each step. The padding travels (at most ``N - 1`` elements a
    matrix); the owner drops it and a receiver gets zeros there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import attrs
import torch
import torch.distributed as dist

from z3kit.device import device_type_for_backend
from z3kit.partition import shard_numel_for
from z3kit.validate import check_int, int_validator

ProcessGroup = dist.ProcessGroup


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """The cost of a Newton-Schulz iteration on an ``m x n`` matrix, ``m * n * min(m, n)``
    (the Gram matrix and the products dominate); the numel for another shape."""
    if len(shape) != 2:
        return int(torch.Size(shape).numel())
    m, n = shape
    return m * n * min(m, n)


def assign_owners(costs: Sequence[int], world: int) -> tuple[int, ...]:
    """An owner rank for each cost, balanced: the costliest first, each to the
    rank with the least cost so far (the lowest rank on a tie). The same on
    every rank for the same costs."""
    check_int("world", world, at_least=1)
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return tuple(owners)


def _shapes(value: Iterable[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(check_int("shape", v, at_least=0) for v in shape) for shape in value)


def _owners(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class MatrixPlan:
    """Which rank owns each matrix of ``shapes`` over ``world`` ranks."""

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_shapes)
    world: int = attrs.field(validator=int_validator(at_least=1))
    owners: tuple[int, ...] = attrs.field(converter=_owners)

    def __attrs_post_init__(self) -> None:
        if len(self.owners) != len(self.shapes):
            raise ValueError(
                f"a plan needs one owner per matrix: {len(self.shapes)} matrices, {len(self.owners)} owners")
        bad = [o for o in self.owners if not (isinstance(o, int) and 0 <= o < self.world)]
        if bad:
            raise ValueError(f"owners must be ranks in [0, {self.world}), got {bad}")

    @classmethod
    def balanced(
        cls, shapes: Sequence[Sequence[int]], world: int, cost: Callable[[Sequence[int]], int] | None = None
    ) -> MatrixPlan:
        """Owners balanced by ``cost`` (None: ``newton_schulz_cost``) over ``world`` ranks."""
        measure = newton_schulz_cost if cost is None else cost
        return cls(shapes, world, assign_owners([measure(s) for s in shapes], world))

    def numel(self, i: int) -> int:
        return int(torch.Size(self.shapes[i]).numel())

    def shard_numel(self, i: int) -> int:
        """Elements of matrix ``i`` each rank holds (``z3kit.partition``)."""
        return shard_numel_for(self.numel(i), self.world)

    def owned_by(self, rank: int) -> tuple[int, ...]:
        """The matrices ``rank`` owns, in order."""
        return tuple(i for i, o in enumerate(self.owners) if o == rank)

    def load(self, rank: int) -> int:
        """The Newton-Schulz cost of the matrices ``rank`` owns."""
        return sum(newton_schulz_cost(self.shapes[i]) for i in self.owned_by(rank))

    def bytes_per_exchange(self, rank: int, itemsize: int) -> tuple[int, int]:
        """(bytes ``rank`` sends, bytes it receives) in one gather of ``itemsize``-byte
        elements; a scatter swaps the two (see the Note on one all-to-all)."""
        mine = sum(self.shard_numel(i) for i in self.owned_by(rank))
        sent = sum(self.shard_numel(i) for i, o in enumerate(self.owners) if o != rank)
        return sent * itemsize, mine * (self.world - 1) * itemsize


def pack_for_owners(plan: MatrixPlan, slices: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """This rank's half of a gather: its slices ordered by owner, and how many elements go to each rank."""
    if len(slices) != len(plan.shapes):
        raise ValueError(f"gather needs one slice per matrix: {len(plan.shapes)} matrices, {len(slices)} slices")
    for i, s in enumerate(slices):
        if s.dim() != 1 or s.numel() != plan.shard_numel(i):
            raise ValueError(f"matrix {i} of shape {plan.shapes[i]} has slices of {plan.shard_numel(i)} elements over "
                             f"{plan.world} ranks, got shape {tuple(s.shape)}")
    order = [i for d in range(plan.world) for i in plan.owned_by(d)]
    splits = [sum(plan.shard_numel(i) for i in plan.owned_by(d)) for d in range(plan.world)]
    if not order:
        raise ValueError("a gather needs at least one matrix")
    return torch.cat([slices[i] for i in order]), splits


def unpack_at_owner(plan: MatrixPlan, rank: int, received: torch.Tensor) -> dict[int, torch.Tensor]:
    """The owner's half of a gather: ``received`` (every rank's slices of the matrices
    ``rank`` owns, rank after rank) as whole matrices in their shapes."""
    mine = plan.owned_by(rank)
    per_rank = received.view(plan.world, -1) if mine else received.view(plan.world, 0)
    out: dict[int, torch.Tensor] = {}
    at = 0
    for i in mine:
        s = plan.shard_numel(i)
        out[i] = per_rank[:, at:at + s].reshape(-1)[:plan.numel(i)].view(plan.shapes[i])
        at += s
    return out


def pack_at_owner(
    plan: MatrixPlan, rank: int, results: Mapping[int, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """The owner's half of a scatter: each rank's slice of every result ``rank`` owns,
    rank after rank (in ``dtype``, padded with zeros), and how many elements go to each rank."""
    mine = plan.owned_by(rank)
    if sorted(results) != list(mine):
        raise ValueError(f"rank {rank} owns matrices {list(mine)}, got results for {sorted(results)}")
    rows: list[torch.Tensor] = []
    for i in mine:
        flat = results[i].reshape(-1)
        if tuple(results[i].shape) != plan.shapes[i]:
            raise ValueError(f"matrix {i}'s result has shape {tuple(results[i].shape)}, expected {plan.shapes[i]}")
        padded = torch.zeros(plan.world * plan.shard_numel(i), dtype=dtype, device=device)
        padded[:flat.numel()].copy_(flat)
        rows.append(padded.view(plan.world, -1))
    per_rank = sum(plan.shard_numel(i) for i in mine)
    buffer = torch.cat(rows, dim=1).reshape(-1) if rows else torch.empty(0, dtype=dtype, device=device)
    return buffer, [per_rank] * plan.world


def unpack_slices(plan: MatrixPlan, received: torch.Tensor) -> list[torch.Tensor]:
    """A receiver's half of a scatter: ``received`` (each owner's slices for this
    rank, owner after owner) as one slice per matrix, views of it."""
    out: list[torch.Tensor | None] = [None] * len(plan.shapes)
    at = 0
    for d in range(plan.world):
        for i in plan.owned_by(d):
            out[i] = received[at:at + plan.shard_numel(i)]
            at += plan.shard_numel(i)
    return [t for t in out if t is not None]


def _exchange(buffer: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
    out = buffer.new_empty(sum(receive))
    dist.all_to_all_single(out, buffer.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


def gather_to_owners(plan: MatrixPlan, slices: Sequence[torch.Tensor], group: ProcessGroup) -> dict[int, torch.Tensor]:
    """Every matrix whole at its owner (collective over ``group``, one all-to-all):
    ``slices`` are this rank's slice of each matrix (one dtype); the result maps each
    matrix this rank owns to its values, in its shape."""
    rank = _rank_in(plan, group)
    buffer, send = pack_for_owners(plan, slices)
    if plan.world == 1:
        return unpack_at_owner(plan, rank, buffer)
    mine = sum(plan.shard_numel(i) for i in plan.owned_by(rank))
    return unpack_at_owner(plan, rank, _exchange(buffer, send, [mine] * plan.world, group))


def scatter_from_owners(
    plan: MatrixPlan, results: Mapping[int, torch.Tensor], group: ProcessGroup, dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Each owner's results back as slices (collective over ``group``, one all-to-all):
    ``results`` maps each matrix this rank owns to a tensor of its shape; the
    result is this rank's slice of every matrix (``dtype`` on ``device``, every
    rank's alike; zeros in the padding)."""
    rank = _rank_in(plan, group)
    buffer, send = pack_at_owner(plan, rank, results, dtype, device)
    if plan.world == 1:
        return unpack_slices(plan, buffer)
    receive = [sum(plan.shard_numel(i) for i in plan.owned_by(d)) for d in range(plan.world)]
    return unpack_slices(plan, _exchange(buffer, send, receive, group))


def _rank_in(plan: MatrixPlan, group: ProcessGroup) -> int:
    world = dist.get_world_size(group)
    if world != plan.world:
        raise ValueError(f"the plan is for {plan.world} ranks, the group has {world}")
    return dist.get_rank(group)


def map_on_owners(
    plan: MatrixPlan, slices: Sequence[torch.Tensor], group: ProcessGroup,
    compute: Callable[[int, torch.Tensor], torch.Tensor], dtype: torch.dtype,
) -> list[torch.Tensor]:
    """``compute(i, matrix)`` once per matrix, on its owner, from the whole matrix
    gathered from ``slices``; this rank's slice of every result (``dtype``, on the
    slices' device). Collective over ``group``: two all-to-alls."""
    whole = gather_to_owners(plan, slices, group)
    results = {i: compute(i, m) for i, m in whole.items()}
    return scatter_from_owners(plan, results, group, dtype, slices[0].device)


class ShardedParams(Protocol):
    """Where each flat shard comes from: its parameter's name and shape, and the
    group it is cut over (the stock runtime's ``MasterShards`` is one)."""

    @property
    def group(self) -> ProcessGroup:
        """The process group the shards are cut over (rank ``r`` holds slice ``r``)."""

    def full_shape(self, shard: torch.Tensor) -> torch.Size:
        """The shape of the parameter ``shard`` is a slice of."""

    def name_of(self, shard: torch.Tensor) -> str:
        """The parameter's name in the model."""


def check_matrix_shard(shards: ShardedParams, shard: torch.Tensor, optimizer: str, instead: str) -> None:
    """Refuse, naming the parameter, a shard ``optimizer`` cannot step as a matrix:
    not 2-D (``instead`` says what to do), not the flat 1/N slice of its
    parameter, or on a device the group does not carry."""
    shape, name = shards.full_shape(shard), shards.name_of(shard)
    if len(shape) != 2:
        raise ValueError(f"parameter {name!r} of shape {tuple(shape)} is in a {optimizer} group, but {optimizer} "
                         f"steps 2-D matrices only; {instead}")
    world = dist.get_world_size(shards.group)
    device_type = device_type_for_backend(str(dist.get_backend(shards.group)))
    if shard.device.type != device_type:
        raise ValueError(
            f"parameter {name!r}'s shard is on {shard.device}, but {optimizer} gathers it over a "
            f"{dist.get_backend(shards.group)} group, which carries {device_type} tensors (an offloaded "
            f"optimizer's host masters?); {optimizer}'s matrices move between ranks each step, so "
            "offload_optimizer is refused with it off the CPU")
    if shard.dim() != 1 or shard.numel() != shard_numel_for(shape.numel(), world):
        raise ValueError(f"parameter {name!r}: {optimizer} needs its flat 1/{world} shard "
                         f"({shard_numel_for(shape.numel(), world)} elements), got shape {tuple(shard.shape)}")
