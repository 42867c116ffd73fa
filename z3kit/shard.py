"""Parameter shards: each parameter's flat, padded 1/N slice on this rank.

A parameter of ``numel`` elements is flattened, padded with zeros to
``world * shard_numel`` where ``shard_numel = ceil(numel / world)``, and rank
``r`` keeps elements ``[r * shard_numel, (r + 1) * shard_numel)``. A parameter
smaller than the world size still gets one element per rank (the rest pad).

Gather and release swap ``param.data`` between the full tensor and an empty
one. Autograd is unaffected: it records the parameter object, not its
storage, so a saved parameter seen again in backward reads whatever data is
installed then, which the pre-backward gather makes the full values again.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs
import torch

from z3kit.collectives import CollectiveLog, Pending, ProcessGroup, all_gather


class ParamStatus(enum.Enum):
    """Where a parameter's full values are."""

    #: Only the shard is resident; ``param.data`` is an empty tensor.
    NOT_AVAILABLE = "not_available"
    #: A gather was issued and not yet waited on; ``param.data`` is still empty.
    INFLIGHT = "inflight"
    #: ``param.data`` holds the full parameter.
    AVAILABLE = "available"


def shard_numel_for(numel: int, world: int) -> int:
    """Elements per rank of a parameter of ``numel`` elements (at least 1)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return max(1, math.ceil(numel / world))


def partition_of(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s padded slice of a flat tensor, as a new contiguous tensor."""
    if flat.dim() != 1:
        raise ValueError(f"partition_of needs a flat tensor, got shape {tuple(flat.shape)}")
    out = flat.new_empty(shard_numel_for(flat.numel(), world))
    fill_partition(out, flat, rank, world)
    return out


def fill_partition(out: torch.Tensor, flat: torch.Tensor, rank: int, world: int) -> None:
    """Write rank ``rank``'s padded slice of ``flat`` into ``out`` (converting
    to ``out``'s dtype and device on the way; the padding becomes zeros)."""
    if flat.dim() != 1:
        raise ValueError(f"fill_partition needs a flat tensor, got shape {tuple(flat.shape)}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    size = shard_numel_for(flat.numel(), world)
    if out.numel() != size:
        raise ValueError(f"rank {rank}'s slice of {flat.numel()} elements over {world} ranks has {size}, got {out.numel()}")
    start = rank * size
    stop = min(start + size, flat.numel())
    taken = max(0, stop - start)
    if taken:
        out[:taken].copy_(flat[start:stop])
    if taken < size:
        out[taken:].zero_()


@attrs.define(eq=False)
class ParamShard:
    """One parameter's shard, status and gathered storage on this rank."""

    param: torch.nn.Parameter
    shape: torch.Size
    numel: int
    rank: int
    world: int
    #: this rank's flat padded slice, ``shard_numel`` elements.
    shard: torch.Tensor
    status: ParamStatus = ParamStatus.NOT_AVAILABLE
    _empty: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._empty = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    @property
    def padded_numel(self) -> int:
        return self.shard.numel() * self.world

    @classmethod
    def from_param(
        cls, param: torch.nn.Parameter, rank: int, world: int, dtype: torch.dtype | None = None
    ) -> ParamShard:
        """Shard ``param`` (whose data must be full) and release it."""
        if not isinstance(param, torch.nn.Parameter):
            raise TypeError(f"expected a torch.nn.Parameter, got {type(param).__name__}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        full = param.detach().reshape(-1)
        if dtype is not None:
            full = full.to(dtype)
        shard = cls(param, param.shape, param.numel(), rank, world, partition_of(full, rank, world))
        shard.release()
        return shard

    def install(self, full_flat: torch.Tensor) -> None:
        """Make ``param.data`` the full parameter, read from a flat padded buffer."""
        if full_flat.numel() < self.numel:
            raise ValueError(f"install needs at least {self.numel} elements, got {full_flat.numel()}")
        self.param.data = full_flat[: self.numel].view(self.shape)
        self.status = ParamStatus.AVAILABLE

    def release(self) -> None:
        """Drop the full values; only the shard stays resident.

        Releasing a parameter whose gather is in flight is refused: the
        gather's ``wait()`` would install it again behind the caller's back.
        """
        if self.status is ParamStatus.INFLIGHT:
            raise ValueError("cannot release a parameter whose gather is in flight (status INFLIGHT); wait on it first")
        self.param.data = self._empty
        self.status = ParamStatus.NOT_AVAILABLE

    def load_full(self, full: torch.Tensor) -> None:
        """Overwrite this rank's shard from full values (after a broadcast, say)."""
        if full.numel() != self.numel:
            raise ValueError(f"load_full needs {self.numel} elements, got {full.numel()}")
        fill_partition(self.shard, full.detach().reshape(-1), self.rank, self.world)


class GatherHandle:
    """A (possibly in-flight) gather of one or more shards.

    ``wait()`` completes the collective, copies each parameter out of the
    coalesced buffer when there are several, installs them and marks them
    AVAILABLE.
    """

    __slots__ = ("shards", "numel", "_pending")

    def __init__(self, shards: Sequence[ParamShard], numel: int, pending: Pending) -> None:
        self.shards = tuple(shards)
        self.numel = numel
        self._pending = pending

    @property
    def done(self) -> bool:
        return self._pending.done

    def wait(self) -> None:
        self._pending.wait()


def _adjacent_view(shards: Sequence[ParamShard]) -> torch.Tensor | None:
    """One flat view over the shards when they lie back to back, in order, in
    one storage (a runtime that allocates its shards from one buffer gets
    coalesced gathers without a concatenation copy); None otherwise."""
    first = shards[0].shard
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for s in shards:
        t = s.shard
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset or not t.is_contiguous():
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def gather_shards(
    shards: Sequence[ParamShard],
    group: ProcessGroup,
    *,
    async_op: bool = False,
    log: CollectiveLog | None = None,
) -> GatherHandle:
    """All-gather several parameters in one collective.

    One parameter gathers straight into its own padded buffer: the rank-major
    output *is* the padded flat parameter. Several are concatenated into one
    input; the output, viewed as (world, sum of shard sizes), is then copied
    out per parameter on ``wait``.
    """
    if not shards:
        raise ValueError("gather_shards needs at least one shard")
    for s in shards:
        if s.status is not ParamStatus.NOT_AVAILABLE:
            raise ValueError(f"cannot gather a parameter whose status is {s.status.name}; release it first")
    if len({id(s) for s in shards}) != len(shards):
        raise ValueError("gather_shards got the same shard more than once")
    first = shards[0]
    for s in shards[1:]:
        if s.shard.dtype != first.shard.dtype or s.shard.device != first.shard.device:
            raise TypeError("coalesced gather needs shards of one dtype and device")
        if s.world != first.world or s.rank != first.rank:
            raise ValueError(
                f"coalesced gather needs shards of one rank and world size, got rank {s.rank} of {s.world} "
                f"and rank {first.rank} of {first.world}"
            )
    world = first.world
    total = sum(s.numel for s in shards)
    if len(shards) == 1:
        out = first.shard.new_empty(first.padded_numel)
        pending = all_gather(out, first.shard, group, async_op=async_op, log=log)

        def install() -> None:
            pending.wait()
            first.install(out)

    else:
        flat_in = _adjacent_view(shards)
        if flat_in is None:
            flat_in = torch.cat([s.shard for s in shards])
        out = flat_in.new_empty(world * flat_in.numel())
        pending = all_gather(out, flat_in, group, async_op=async_op, log=log)

        def install() -> None:
            pending.wait()
            # Each parameter gets storage of its own, so that releasing one frees
            # its memory; one split-copy kernel fills them all from the
            # (world, sum of shard sizes) rank-major output.
            sizes = [s.shard_numel for s in shards]
            fulls = [out.new_empty(world * n) for n in sizes]
            torch.split_with_sizes_copy(
                out.view(world, -1), sizes, dim=1, out=[f.view(world, n) for f, n in zip(fulls, sizes)]
            )
            for s, full in zip(shards, fulls):
                s.install(full)

    for s in shards:
        s.status = ParamStatus.INFLIGHT
    handle = GatherHandle(shards, total, Pending(None, install))
    if not async_op:
        handle.wait()
    return handle
