"""The optimizer step on the host: ``OffloadedStep`` (``Zero3Config.offload_optimizer``).

Note: where each buffer lives.
    The layout gives every trainable parameter a master shard of its own
    (``ShardLayout.host_masters``): those of the offloaded parameters in
    host memory, pinned where there is an accelerator, the others (a
    ``ratio`` under 1) on the device. The user's optimizer is built on them
    as on any masters, so its state follows each master: Adam's moments of
    a host master are host tensors, and the step over them runs on the host.

Note: one step.
    Clipping runs on the device partitions as without offload. Then each
    host master's gradient partition is copied into a host buffer of its
    own (pinned; on an accelerator, ``non_blocking`` on a side stream that
    first waits for the backward's work, the host waiting once, on an event
    recorded after the last copy), the optimizer steps, and each updated
    master is copied back into its compute-dtype shard (``non_blocking``
    from pinned memory on the compute stream, so any later gather reads the
    new values). On CPU the same copies run between separate tensors.

Note: what overlaps and what does not (yet).
    The gradient copies overlap one another and the write-backs are queued
    without the host waiting per tensor; the host then waits once for them
    (``_write_back``), so that no host tensor is written while a copy from
    it may still run. The host step itself does not yet overlap the next
    forward: ``engine.step()`` returns when the masters are updated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from z3kit.memory import MemoryKind, storage_bytes
from z3kit_recipes.zero3.training.layout import ShardLayout
from z3kit_recipes.zero3.training.optim_step import OptimizerStep


class OffloadedStep(OptimizerStep):
    """``OptimizerStep`` whose offloaded masters step on the host (see the Notes)."""

    def __init__(self, *args: Any, layout: ShardLayout, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = layout
        self.device = layout.flat.device
        self._module: Any = None if self.device.type == "cpu" else torch.get_device_module(self.device)
        self._side: Any = None if self._module is None else self._module.Stream(device=self.device)
        #: a host buffer for each host master's gradient, by the master's identity
        self._host_grads: dict[int, torch.Tensor] = {}

    def host_masters(self) -> list[nn.Parameter]:
        host = self.layout.host_masters or frozenset()
        return [m for pid, m in self.layout.master_of().items() if pid in host]

    def _buffer(self, master: nn.Parameter) -> torch.Tensor:
        buffer = self._host_grads.get(id(master))
        if buffer is None:
            buffer = torch.empty(master.shape, dtype=torch.float32, pin_memory=self.layout.pin and self._module is not None)
            self._host_grads[id(master)] = buffer
            self.memory.set(MemoryKind.HOST_GRAD_PARTITIONS, storage_bytes(self._host_grads.values()))
        return buffer

    def _attach_grads(self, grads: list[torch.Tensor | None]) -> None:
        host = {id(m) for m in self.host_masters()}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for master, grad in zip(self.masters, grads):
            if grad is None or id(master) not in host:
                master.grad = grad
                continue
            buffer = self._buffer(master)
            copies.append((buffer, grad))
            master.grad = buffer
        if self._module is None:
            for buffer, grad in copies:
                buffer.copy_(grad)
            return
        self._side.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(self._side):
            for buffer, grad in copies:
                buffer.copy_(grad, non_blocking=True)
            event = self._side.record_event()
        event.synchronize()  # the host step reads the buffers

    def _write_back(self) -> None:
        host = {id(m) for m in self.host_masters()}
        for pid, master in zip(self.trainable, self.masters):
            self.shards[pid].shard.copy_(master.detach(), non_blocking=id(master) in host and self._module is not None)
        if self._module is not None:
            # the host masters are written again at the next step (or by a load): the copies out of them must be done
            self._module.current_stream(self.device).synchronize()

    def measure_state(self) -> None:
        """The optimizer's state in the ledger, the host masters' apart."""
        self._state_entries = len(self.optimizer.state)
        host = {id(m) for m in self.host_masters()}

        def tensors(on_host: bool) -> list[torch.Tensor]:
            return [t for m, s in self.optimizer.state.items() if (id(m) in host) == on_host
                    for t in s.values() if isinstance(t, torch.Tensor)]

        self.memory.set(MemoryKind.OPTIMIZER_STATE, storage_bytes(tensors(False)))
        self.memory.set(MemoryKind.HOST_OPTIMIZER_STATE, storage_bytes(tensors(True)))


def measure_masters(layout: ShardLayout) -> tuple[int, int]:
    """Bytes of the separate masters on the device and on the host."""
    host = layout.host_masters or frozenset()
    by_pid = layout.master_of()
    return (storage_bytes(m for pid, m in by_pid.items() if pid not in host),
            storage_bytes(m for pid, m in by_pid.items() if pid in host))
