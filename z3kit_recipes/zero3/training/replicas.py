"""HSDP's second reduction stage: the all-reduce across the replicas, once per window.

Under HSDP (``zero3.ranks.topology``) a gradient is reduced within the
shard group first (``zero3.training.reductions``), which leaves each
replica with its own share of the sum. ``ReplicaStage`` adds the shares
across the replicate group, the only traffic that crosses nodes.

Note: once per accumulation window.
    All-reduce is linear, so the replicas' shares need adding only once per
    window. In a backward that does not end the window
    (``final_micro_step``), the reduced partitions land in ``pending``, this
    replica's own sum, instead of the window. In the backward that ends it,
    each reduction is all-reduced across the replicas as it is issued, with
    the parameter's pending sum added in the first time it comes
    (``GradWindow.withdraw``: the second arrival of a parameter in one
    backward, a late gradient, is all-reduced alone), and lands in the
    window. So the window only ever holds sums over every rank, and what is
    pending when the window's sum is read (a step that did not follow the
    window's last backward, a checkpoint) is all-reduced then (``flush``, a
    collective of every rank). With one micro-step per window this is one
    all-reduce per reduction, as DDP's.

Note: when it is issued.
    Right after the shard group's stage completed, at issue time, never at
    landing: landing depends on timing, and two ranks that issued one
    group's collective before another group's in different orders could
    wait on each other for ever (on NCCL, where one stream serializes
    both). Completing the first stage is a stream wait on accelerators and
    blocks the host on gloo, so there only this stage overlaps compute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from z3kit.collectives import CollectiveLog, Pending, ProcessGroup, all_reduce
from z3kit.memory import MemoryKind, MemoryLedger, tensor_bytes
from z3kit.streams import CommTicket, StreamPairLike
from z3kit_recipes.zero3.ranks.agreement import Waiter
from z3kit_recipes.zero3.training.grad_window import GradWindow


class ReplicaStage:
    """The all-reduce across the replicas of one ``GradReducer`` (see the Notes)."""

    def __init__(self, group: ProcessGroup, *, streams: StreamPairLike, log: CollectiveLog, memory: MemoryLedger,
                 waiter: Waiter, device: torch.device, final_micro_step: Callable[[], bool]) -> None:
        self.group, self.streams, self.log, self.memory, self.waiter = group, streams, log, memory, waiter
        self.device = device
        #: whether the backward under way ends the accumulation window
        self.final_micro_step = final_micro_step
        #: this replica's own sums of the window's backwards so far (see the Note)
        self.pending = GradWindow({}, [], device=device, memory=memory)

    def replan(self, slot: Mapping[int, int], partition_numels: Sequence[int]) -> None:
        """The reducer's slots changed (between windows)."""
        self.pending = GradWindow(slot, partition_numels, device=self.device, memory=self.memory)

    def launch(self, parts: Sequence[tuple[int, torch.Tensor]],
               what: str) -> tuple[Pending, CommTicket, list[tuple[int, torch.Tensor]], int]:
        """All-reduce ``parts`` (reduced partitions, each with its pending sum added
        the first time) through one contiguous buffer: the pending collective,
        its ticket, what to land, and the bytes held."""
        pieces = []
        for pid, part in parts:
            earlier = self.pending.withdraw(pid)
            pieces.append(part.reshape(-1) if earlier is None else part.reshape(-1) + earlier)
        flat = torch.cat(pieces)  # contiguous: gloo misreads views
        self.memory.allocate(MemoryKind.GRAD_BUCKETS, tensor_bytes(flat))
        with self.streams.communicate(reads=[flat], writes=[flat], label=f"all_reduce across replicas of {what}") as ticket:
            # already scaled to the mean over every rank: a plain sum here
            pending = all_reduce(flat, self.group, async_op=True, log=self.log)
        landing = list(zip([pid for pid, _ in parts], flat.split([part.numel() for _, part in parts])))
        return pending, ticket, landing, tensor_bytes(flat)

    def flush(self, window: GradWindow) -> None:
        """Add what is still pending, summed over the replicas, into ``window``
        (collective over the replicas; every rank holds the same pending parameters)."""
        buffer = self.pending.buffer()
        if buffer is None:
            return
        left = self.pending.withdraw_all()
        if left:
            done = all_reduce(buffer, self.group, async_op=True, log=self.log)
            self.waiter(done.is_completed, done.wait)
            for pid, summed in left.items():
                window.accumulate(pid, summed)
        self.pending.end()
