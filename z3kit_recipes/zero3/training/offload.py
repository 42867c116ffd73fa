"""The optimizer step on the host: ``OffloadedStep`` (``Zero3Config.offload_optimizer``).

Note: where each buffer lives.
    The layout gives every trainable parameter a master shard of its own
    (``ShardLayout.host_masters``): those of the offloaded parameters in
    host memory, pinned where there is an accelerator, the others (a
    ``ratio`` under 1) on the device. The user's optimizer is built on them
    as on any masters, so its state follows each master: Adam's moments of
    a host master are host tensors, and the step over them runs on the host.

Note: the gradients stream to the host as they land.
    In the backward that ends an accumulation window, each host master's
    reduced partition is copied into a host buffer of its own as soon as
    its reduction lands (``GradWindow.on_landed``; on an accelerator
    ``non_blocking`` on a side stream that waits for the landing), so the
    copies overlap the rest of the backward. A partition that changes
    later, or landed in an earlier micro-step (a resumed window), is copied
    at the step. The copies are of the raw partitions: the loss scale and
    the clip are applied on the device for the norm and the overflow check,
    and to the host copies by the same multiplication on the host.

Note: the host step runs behind the next forward.
    ``engine.step()`` steps the device masters, runs the optimizer's step
    hooks once, and starts the host masters' step on a thread of its own
    (``zero3.training.host_step``), chunk by chunk in the order the next
    forward gathers them, and returns without waiting for any chunk (the
    persistent parameters it writes are gathered again by that forward,
    not by the step); each gather waits only for its own chunk's
    write-back. The thread steps a stand-in of the optimizer that holds the
    hyperparameters as they were at ``engine.step()``
    (``zero3.training.chunked_optimizer``), so an LR schedule stepped right
    after it changes the next step, as without offload. Optimizers that
    cannot be stepped in chunks, or ``OffloadConfig(overlap=False)``, step
    the host masters on the main thread inside ``engine.step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from z3kit.memory import MemoryKind, storage_bytes
from z3kit_recipes.zero3.training.chunked_optimizer import ChunkedStep, supports
from z3kit_recipes.zero3.training.host_step import HostStep, cut
from z3kit_recipes.zero3.training.layout import ShardLayout
from z3kit_recipes.zero3.training.optim_step import OptimizerStep

_Triple = tuple[nn.Parameter, torch.Tensor, torch.Tensor]


class OffloadedStep(OptimizerStep):
    """``OptimizerStep`` whose offloaded masters step on the host (see the Notes)."""

    def __init__(self, *args: Any, layout: ShardLayout, overlap: bool, final_landing: Callable[[], bool],
                 gather_order: Callable[[], Sequence[int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = layout
        self.device = layout.flat.device
        self._module: Any = None if self.device.type == "cpu" else torch.get_device_module(self.device)
        self._side: Any = None if self._module is None else self._module.Stream(device=self.device)
        #: the host master's gradient buffer, by parameter id
        self._host_grads: dict[int, torch.Tensor] = {}
        #: host masters whose device partition changed since its last copy to the host
        self._dirty: set[int] = set()
        self._streaming = False  # copies were issued in the current window
        self.overlap = overlap and supports(self.optimizer)
        self.final_landing, self.gather_order = final_landing, gather_order
        self.host_step = HostStep(self.device)
        self.host_step.on_settled = super()._measure_if_grown
        self.reducer.window.on_landed = self._landed
        # whoever reads or loads the optimizer's state first waits for a step still running
        self.optimizer.register_state_dict_pre_hook(lambda _: self.settle())
        self.optimizer.register_load_state_dict_pre_hook(lambda _, __: self.settle())

    def host_masters(self) -> list[nn.Parameter]:
        host = self.layout.offloaded
        return [m for pid, m in self.layout.master_of().items() if pid in host]

    def settle(self) -> None:
        self.host_step.settle()

    def written_later(self) -> frozenset[int]:
        return self.host_step.writes()

    def _measure_if_grown(self) -> None:
        if not self.host_step.running:  # else the thread is creating the state: measured once it settles
            super()._measure_if_grown()

    # -- the gradients to the host ------------------------------------------------------------
    def _buffer(self, pid: int) -> torch.Tensor:
        buffer = self._host_grads.get(pid)
        if buffer is None:
            numel = self.shards[pid].shard_numel
            buffer = torch.empty(numel, dtype=torch.float32, pin_memory=self.layout.pin and self._module is not None)
            self._host_grads[pid] = buffer
            self.memory.set(MemoryKind.HOST_GRAD_PARTITIONS, storage_bytes(self._host_grads.values()))
        return buffer

    def _landed(self, pid: int, partition: torch.Tensor) -> None:
        if pid not in self.layout.offloaded:
            return
        if self.final_landing():
            self._copy(pid, partition)
        else:
            self._dirty.add(pid)

    def _copy(self, pid: int, partition: torch.Tensor) -> None:
        if not self._streaming:  # the first copy of a window: the last host step may still read the buffers
            self.host_step.settle()
            self._streaming = True
        buffer = self._buffer(pid).view_as(partition)
        self._dirty.discard(pid)
        if self._module is None:
            buffer.copy_(partition)
            return
        self._side.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(self._side):
            buffer.copy_(partition, non_blocking=True)
        partition.record_stream(self._side)  # the window may be dropped before the copy ran

    def _before_scaling(self) -> None:
        window = self.reducer.window.grads()
        for pid in sorted(self._dirty):
            if pid in window:
                self._copy(pid, window[pid])
        self._dirty.clear()
        self._streaming = False
        if self._module is not None:  # scaling in place waits for the copies of the raw partitions
            self._module.current_stream(self.device).wait_stream(self._side)

    # -- the step ---------------------------------------------------------------------------------
    def _step(self, grads: list[torch.Tensor | None], factor: float | torch.Tensor | None) -> None:
        host = self.layout.offloaded
        on_host: dict[int, _Triple] = {}
        for pid, master, grad in zip(self.trainable, self.masters, grads):
            master.grad = None if pid in host else grad
            if pid in host and grad is not None:
                on_host[pid] = (master, self._buffer(pid).view_as(master), self.shards[pid].shard)
        # after the copies (the compute stream waited for them) and the factor: what the host thread waits for
        ready = None if self._module is None else self._module.current_stream(self.device).record_event()
        if not (self.overlap and on_host):
            self._step_here(on_host, ready, factor)
            return
        self.optimizer.step()  # the device masters, and the step hooks, once (host masters have no .grad)
        self._device_write_back(host)
        stand_in = ChunkedStep(self.optimizer, [master for master, _, _ in on_host.values()])
        first = dict.fromkeys(p for p in self.gather_order() if p in on_host)  # a parameter may come twice
        order = [*first, *sorted(p for p in on_host if p not in first)]
        numels = {pid: self.shards[pid].shard_numel for pid in on_host}
        self.host_step.launch(stand_in, cut(order, numels), on_host, grads_ready=ready, factor=factor)

    def _step_here(self, on_host: dict[int, _Triple], ready: Any, factor: float | torch.Tensor | None) -> None:
        """The whole step on this thread (see the last Note)."""
        if ready is not None:
            ready.synchronize()  # the host step reads the buffers
        host_factor = factor.to("cpu") if isinstance(factor, torch.Tensor) else factor
        for master, grad, _ in on_host.values():
            if host_factor is not None:
                grad.mul_(host_factor)
            master.grad = grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self._device_write_back(self.layout.offloaded)
        for master, _, shard in on_host.values():
            shard.copy_(master.detach(), non_blocking=self._module is not None)
        if self._module is not None:
            # the host masters are written again at the next step (or by a load): the copies out of them must be done
            self._module.current_stream(self.device).synchronize()

    def _device_write_back(self, host: frozenset[int]) -> None:
        if self.masters_are_shards:
            return
        for pid, master in zip(self.trainable, self.masters):
            if pid not in host:
                self.shards[pid].shard.copy_(master.detach())

    def measure_state(self) -> None:
        """The optimizer's state in the ledger, the host masters' apart."""
        self._state_entries = len(self.optimizer.state)
        host = {id(m) for m in self.host_masters()}

        def tensors(on_host: bool) -> list[torch.Tensor]:
            return [t for m, s in self.optimizer.state.items() if (id(m) in host) == on_host
                    for t in s.values() if isinstance(t, torch.Tensor)]

        self.memory.set(MemoryKind.OPTIMIZER_STATE, storage_bytes(tensors(False)))
        self.memory.set(MemoryKind.HOST_OPTIMIZER_STATE, storage_bytes(tensors(True)))

