"""One accumulation window's gradient partitions, from the first landing to the optimizer step.

``GradWindow`` holds this rank's fp32 partitions of the trainable
parameters (a ``GradPartitionBuffer``, allocated at the window's first
landing and dropped by ``end`` after the optimizer step or a ``zero_grad``),
and which parameters some rank gave a gradient in the window: the rest have
none for the optimizer, as after ``zero_grad(set_to_none=True)``. The
``GradReducer`` lands reductions into it; the optimizer step, checkpoints
and clipping read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from z3kit.grad_partition import GradPartitionBuffer
from z3kit.memory import MemoryKind, MemoryLedger, tensor_bytes


class GradWindow:
    """The window's partitions of the trainable parameters, in slot order."""

    def __init__(self, slot: Mapping[int, int], partition_numels: Sequence[int], *, device: torch.device,
                 memory: MemoryLedger, number: int = 0) -> None:
        #: how many windows ended before this one (a step check names the window it belongs to)
        self.number = number
        #: partition slot of each trainable parameter id
        self.slot = slot
        self._numels = list(partition_numels)
        self.device, self.memory = device, memory
        #: None between an optimizer step and the first landing after it
        self.partitions: GradPartitionBuffer | None = None
        self._used: set[int] = set()
        #: told each landing: the parameter and its accumulated partition (offload streams it to the host)
        self.on_landed: Callable[[int, torch.Tensor], None] | None = None

    @property
    def is_open(self) -> bool:
        """Some gradient has landed since the last optimizer step."""
        return self.partitions is not None

    def accumulate(self, pid: int, partition: torch.Tensor) -> None:
        """Copy or add ``pid``'s reduced partition (the buffer is allocated at the first landing)."""
        if self.partitions is None:
            self.partitions = GradPartitionBuffer(self._numels, dtype=torch.float32, device=self.device)
            self.memory.allocate(MemoryKind.GRAD_PARTITIONS, tensor_bytes(self.partitions.buffer))
        self.partitions.accumulate(self.slot[pid], partition)
        if self.on_landed is not None:
            self.on_landed(pid, self.partitions.views[self.slot[pid]])

    def buffer(self) -> torch.Tensor | None:
        """Every partition, in one flat tensor (None: the window is not open)."""
        return None if self.partitions is None else self.partitions.buffer

    def withdraw(self, pid: int) -> torch.Tensor | None:
        """``pid``'s sum so far, which the next landing replaces (``GradPartitionBuffer.withdraw``)."""
        return None if self.partitions is None else self.partitions.withdraw(self.slot[pid])

    def withdraw_all(self) -> dict[int, torch.Tensor]:
        """Every parameter's sum so far, by id, each withdrawn (``withdraw``)."""
        out = {pid: self.withdraw(pid) for pid in self.slot}
        return {pid: view for pid, view in out.items() if view is not None}

    def mark_used(self, pids: Iterable[int]) -> None:
        """These parameters got a gradient on some rank (agreed across ranks)."""
        self._used.update(pids)

    def optimizer_grads(self) -> list[torch.Tensor | None]:
        """Each trainable parameter's accumulated partition, None where no rank
        gave it a gradient this window."""
        if self.partitions is None:
            return [None] * len(self._numels)
        views = self.partitions.optimizer_grads()
        return [v if pid in self._used else None for pid, v in zip(self.slot, views)]

    def grads(self) -> dict[int, torch.Tensor]:
        """The partitions of the parameters that have a gradient, by id."""
        return {pid: g for pid, g in zip(self.slot, self.optimizer_grads()) if g is not None}

    def restore(self, grads: Mapping[int, torch.Tensor]) -> None:
        """Replace the window by ``grads`` (partitions by parameter id; a resume)."""
        self.end()
        for pid, grad in grads.items():
            self.accumulate(pid, grad)
        self._used = set(grads)

    def end(self) -> None:
        """The optimizer consumed the window (or it was discarded): drop the partitions."""
        if self.partitions is not None:
            self.memory.free(MemoryKind.GRAD_PARTITIONS, tensor_bytes(self.partitions.buffer))
            self.partitions = None
        self._used = set()
        self.number += 1

    def squared_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's partitions (zero for an empty window)."""
        return self.partitions.squared_norm() if self.partitions is not None else torch.zeros((), device=self.device)

    def scale_(self, factor: float | torch.Tensor) -> None:
        if self.partitions is not None:
            self.partitions.scale_(factor)
