"""Parameter shards: each parameter's flat, padded 1/N slice on this rank.

A parameter of ``numel`` elements is flattened, padded with zeros to
``world * shard_numel`` where ``shard_numel = ceil(numel / world)``, and rank
``r`` keeps elements ``[r * shard_numel, (r + 1) * shard_numel)``. A parameter
smaller than the world size still gets one element per rank (the rest pad).

Note: gathered storage is resized as well as swapped.
    Each parameter gathers into one padded full buffer of its own
    (``ParamShard.full``), for the whole run. Gather gives that buffer's
    storage its bytes back and fills them, then points ``param.data`` at
    it; release points ``param.data`` at an empty tensor (so a released
    parameter is safe to print or inspect) and frees the buffer's storage
    (``resize_(0)``). Swapping alone would free nothing whenever autograd
    saved a view of the parameter's data rather than the parameter itself
    (``F.linear`` saves ``weight.t()`` on a CPU): the view would keep the
    old storage alive until backward. With one storage per parameter, saved
    views see it shrink and grow and read the re-gathered values in
    backward. Writes go through ``full``, whose version counter is not the
    parameter's, so autograd's check of saved tensors is not tripped by a
    gather. FSDP2 frees its unsharded parameters the same way.

Note: at world 1 the shard is the full parameter.
    With one rank the padded shard holds every element, so ``full`` is the
    shard itself (``aliased``): a gather runs no collective and copies
    nothing, it only points ``param.data`` at the shard; a release frees
    nothing. The parameter's values then live once, not twice.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from z3kit.collectives import Blocker, CollectiveLog, Pending, ProcessGroup, all_gather
from z3kit.partition import fill_partition as fill_partition
from z3kit.partition import partition_of as partition_of
from z3kit.partition import shard_numel_for as shard_numel_for
from z3kit.streams import CommTicket, StreamPairLike, SyncStreamPair


class ParamStatus(enum.Enum):
    """Where a parameter's full values are."""

    #: Only the shard is resident; ``param.data`` is an empty tensor.
    NOT_AVAILABLE = "not_available"
    #: A gather was issued and not yet waited on; ``param.data`` is still empty.
    INFLIGHT = "inflight"
    #: ``param.data`` holds the full parameter.
    AVAILABLE = "available"


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
    #: the padded full buffer ``param.data`` views while gathered; its storage
    #: holds no bytes while the parameter is released
    full: torch.Tensor = attrs.field(init=False)
    #: one rank: ``full`` is the shard (see the Note at world 1)
    aliased: bool = attrs.field(init=False)
    _empty: torch.Tensor = attrs.field(init=False)
    #: ``full``'s first ``numel`` elements in the parameter's shape, what ``param.data`` is while
    #: gathered: made once (a view made per install cost ~2.4 us), while ``full`` has its bytes
    _full_view: torch.Tensor = attrs.field(init=False)
    #: what the modules hold while the parameter is released (see ``show_between_uses``); None: ``param``
    between_uses: torch.nn.Parameter | None = attrs.field(init=False, default=None)
    #: where modules register the parameter: (module, name), tied names each
    registrations: tuple[tuple[torch.nn.Module, str], ...] = attrs.field(init=False, default=())

    def __attrs_post_init__(self) -> None:
        self.aliased = self.world == 1
        if self.aliased:
            self.full = self.shard
        else:
            self.full = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        self._full_view = self.full[: self.numel].view(self.shape)
        if not self.aliased:
            _free_storage(self.full)
        self._empty = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)

    @property
    def gathered_bytes(self) -> int:
        """Bytes a gather of this parameter holds beyond its shard (0 at world 1)."""
        return 0 if self.aliased else self.padded_numel * self.shard.element_size()

    def held_numel(self) -> int:
        """Elements of gathered storage this parameter holds right now (0 at world 1)."""
        return 0 if self.aliased else self.full.untyped_storage().nbytes() // self.full.element_size()

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    @property
    def padded_numel(self) -> int:
        return self.shard.numel() * self.world

    @classmethod
    def from_param(
        cls,
        param: torch.nn.Parameter,
        rank: int,
        world: int,
        dtype: torch.dtype | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> ParamShard:
        """Shard ``param`` (whose data must be full) and release it.

        ``out``: where the shard lives, a contiguous flat tensor of
        ``shard_numel_for(param.numel(), world)`` elements (default: a new
        one). A runtime that hands each parameter of a unit a slice of one
        flat buffer, back to back, gets coalesced gathers without a
        concatenation copy (``gather_shards`` sees the shards are adjacent)."""
        if not isinstance(param, torch.nn.Parameter):
            raise TypeError(f"expected a torch.nn.Parameter, got {type(param).__name__}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        full = param.detach().reshape(-1)
        if dtype is not None:
            full = full.to(dtype)
        if out is None:
            out = partition_of(full, rank, world)
        else:
            if not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous():
                raise ValueError("out must be a contiguous flat tensor")
            if dtype is not None and out.dtype != dtype:
                raise TypeError(f"out has dtype {out.dtype}, but dtype {dtype} was asked for")
            fill_partition(out, full, rank, world)  # checks out's size
        shard = cls(param, param.shape, param.numel(), rank, world, out)
        shard.release()
        return shard

    def materialize(self) -> torch.Tensor:
        """Give ``full`` its bytes back (contents undefined) and return it, for a gather to fill."""
        if self.aliased:
            return self.full
        storage = self.full.untyped_storage()
        nbytes = self.padded_numel * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self.full

    def install(self) -> None:
        """``full`` holds the gathered values: ``param.data`` views it, AVAILABLE."""
        if not self.aliased and self.full.untyped_storage().nbytes() == 0:
            raise ValueError("install before materialize: the full buffer has no storage to read")
        self.param.data = self._full_view
        self.status = ParamStatus.AVAILABLE
        if self.between_uses is not None:
            for module, name in self.registrations:
                module._parameters[name] = self.param

    def release(self) -> None:
        """Drop the full values; only the shard stays resident.

        Releasing a parameter whose gather is in flight is refused: the
        gather's ``wait()`` would install it again behind the caller's back.
        """
        if self.status is ParamStatus.INFLIGHT:
            raise ValueError("cannot release a parameter whose gather is in flight (status INFLIGHT); wait on it first")
        self.param.data = self._empty
        if not self.aliased:
            _free_storage(self.full)
        self.status = ParamStatus.NOT_AVAILABLE
        if self.between_uses is not None:
            for module, name in self.registrations:
                module._parameters[name] = self.between_uses

    def show_between_uses(self, between_uses: torch.nn.Parameter, registrations: Sequence[tuple[torch.nn.Module, str]]) -> None:
        """From now on the modules in ``registrations`` hold ``between_uses``
        while the parameter is released (a tensor of its logical shape that
        holds the shard: ``z3kit.sharded_param``), and ``param`` while it is
        gathered, as FSDP2 swaps its sharded and unsharded parameters."""
        self.between_uses, self.registrations = between_uses, tuple(registrations)
        held: torch.nn.Parameter = self.param if self.status is ParamStatus.AVAILABLE else between_uses
        for module, name in self.registrations:
            module._parameters[name] = held

    def load_full(self, full: torch.Tensor) -> None:
        """Overwrite this rank's shard from full values (after a broadcast, say)."""
        if full.numel() != self.numel:
            raise ValueError(f"load_full needs {self.numel} elements, got {full.numel()}")
        fill_partition(self.shard, full.detach().reshape(-1), self.rank, self.world)


class GatherHandle:
    """A gather of one or more shards, in flight until ``wait``.

    ``wait()`` completes it on its stream pair: blocks until the collective
    is done (through ``block``, when given), copies each parameter out of
    the coalesced buffer when there are several, makes compute wait on the
    communication's event, and installs the parameters (AVAILABLE).
    """

    __slots__ = ("shards", "numel", "ticket", "_streams", "_finish", "_collective")

    def __init__(
        self,
        shards: Sequence[ParamShard],
        numel: int,
        streams: StreamPairLike,
        ticket: CommTicket,
        finish: Callable[[], None],
        collective: Pending,
    ) -> None:
        self.shards = tuple(shards)
        self.numel = numel
        #: the communication: its buffers and, once waited on, its event
        self.ticket = ticket
        self._streams = streams
        #: waits for the collective and copies out (on the comm stream)
        self._finish = finish
        self._collective = collective

    @property
    def done(self) -> bool:
        return self.ticket.completed

    def is_completed(self, timeout_s: float = 0.0) -> bool:
        """True once the collective finished on the device; see ``Pending.is_completed``
        (a completed ticket only says that compute was ordered after it)."""
        return self._collective.is_completed(timeout_s)

    @property
    def staging_numel(self) -> int:
        """Elements of the coalesced output buffer this gather holds until
        ``wait`` copies it out (0 for one parameter, gathered in place)."""
        if len(self.shards) == 1 or self.shards[0].aliased:
            return 0
        return sum(s.padded_numel for s in self.shards)

    def wait(self, block: Blocker | None = None) -> None:
        if self.ticket.completed:
            return
        if len(self.shards) > 1:
            # the full buffers get their bytes only now, on the compute stream,
            # so that a coalesced gather in flight holds its output buffer alone
            for s in self.shards:
                s.materialize()
        finish = self._finish
        self._streams.complete(self.ticket, finish if block is None else lambda: block(self.is_completed, finish))
        for s in self.shards:
            s.install()


def _free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def _adjacent_view(inputs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over the inputs when they lie back to back, in order, in
    one storage (a runtime that allocates its shards from one buffer gets
    coalesced gathers without a concatenation copy); None otherwise."""
    first = inputs[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in inputs:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset or not t.is_contiguous():
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def gather_shards(
    shards: Sequence[ParamShard],
    group: ProcessGroup,
    *,
    streams: StreamPairLike | None = None,
    async_op: bool = False,
    log: CollectiveLog | None = None,
    sources: Sequence[torch.Tensor] | None = None,
) -> GatherHandle:
    """All-gather several parameters in one collective, on ``streams``'s
    communication stream (default: inline, for CPU).

    One parameter gathers straight into its own padded buffer: the rank-major
    output *is* the padded flat parameter. Several are concatenated into one
    input; the output, viewed as (world, sum of shard sizes), is then copied
    out per parameter on ``wait``. Full buffers get their bytes on the
    compute stream (see the Note in ``z3kit.streams``): one parameter's
    here, several parameters' in ``wait``, just before the copy-out.
    ``sources``: what this rank gives instead of its shards, one per
    parameter: its slice of the padded full parameter over ``group``'s ranks
    in group-rank order (a secondary partition within a node, hpZ).
    """
    if not shards:
        raise ValueError("gather_shards needs at least one shard")
    for s in shards:
        if s.status is not ParamStatus.NOT_AVAILABLE:
            raise ValueError(f"cannot gather a parameter whose status is {s.status.name}; release it first")
    if len({id(s) for s in shards}) != len(shards):
        raise ValueError("gather_shards got the same shard more than once")
    first = shards[0]
    inputs = [s.shard for s in shards] if sources is None else list(sources)
    world = first.world if sources is None else dist.get_world_size(group)
    if len(inputs) != len(shards):
        raise ValueError(f"{len(inputs)} sources for {len(shards)} shards")
    for s, source in zip(shards, inputs):
        if sources is not None and source.numel() * world != s.padded_numel:
            raise ValueError(f"each source must be 1/{world} of its parameter's padded {s.padded_numel} elements")
        if source.dtype != inputs[0].dtype or source.device != inputs[0].device:
            raise TypeError("coalesced gather needs shards of one dtype and device")
        if sources is None and (s.world != first.world or s.rank != first.rank):
            raise ValueError(
                f"coalesced gather needs shards of one rank and world size, got rank {s.rank} of {s.world} "
                f"and rank {first.rank} of {first.world}"
            )
    if streams is None:
        streams = SyncStreamPair(first.shard.device)
    total = sum(s.numel for s in shards)
    label = f"all_gather {len(shards)} param(s), {total} elements"
    finish: Callable[[], None]
    if first.aliased and sources is None:
        # one rank: the shards are the full parameters; nothing to communicate or copy
        with streams.communicate(reads=[], writes=[], label=label) as ticket:
            pending = Pending(None)
        finish = pending.wait
    elif len(shards) == 1:
        # the rank-major output of one parameter is its padded full buffer
        full = first.materialize()
        with streams.communicate(reads=[inputs[0]], writes=[full], label=label) as ticket:
            pending = all_gather(full, inputs[0], group, async_op=True, log=log)
        finish = pending.wait
    else:
        with streams.communicate(reads=inputs, writes=[], label=label) as ticket:
            flat_in = _adjacent_view(inputs)
            if flat_in is None:
                flat_in = torch.cat(inputs)
            out = flat_in.new_empty(world * flat_in.numel())
            ticket.hold(reads=[flat_in], writes=[out])
            pending = all_gather(out, flat_in, group, async_op=True, log=log)

        def finish() -> None:
            pending.wait()
            # one split-copy kernel fills every parameter's own full buffer
            # from the (world, sum of shard sizes) rank-major output
            sizes = [t.numel() for t in inputs]
            views = [s.full.view(world, n) for s, n in zip(shards, sizes)]
            torch.split_with_sizes_copy(out.view(world, -1), sizes, dim=1, out=views)

    for s in shards:
        s.status = ParamStatus.INFLIGHT
    handle = GatherHandle(shards, total, streams, ticket, finish, pending)
    if not async_op:
        handle.wait()
    return handle
