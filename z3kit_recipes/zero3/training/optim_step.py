"""The optimizer step of the stock runtime: clip, step, write back.

The reducer's gradient partitions become the fp32 master shards' ``.grad``
(views, no copy), the user's optimizer steps on the masters, and the masters
are cast back into the compute-dtype shards when those are separate. Then the
window's partitions are dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from z3kit.memory import MemoryKind, MemoryLedger, storage_bytes
from z3kit.shard import ParamShard
from z3kit.withheld import Withheld
from z3kit_recipes.zero3.training.grads import GradReducer
from z3kit_recipes.zero3.training.loss_scale import LossScaler


class OptimizerStep:
    """One optimizer over this rank's master shards."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        reducer: GradReducer,
        shards: list[ParamShard],
        trainable: list[int],
        masters: list[nn.Parameter],
        *,
        masters_are_shards: bool,
        clip: float,
        memory: MemoryLedger,
        scaler: LossScaler | None = None,
    ) -> None:
        self.optimizer, self.reducer = optimizer, reducer
        self.shards, self.trainable, self.masters = shards, trainable, masters
        self.masters_are_shards, self.clip, self.memory = masters_are_shards, clip, memory
        #: the global gradient norm before the last clip, on the device (read by ``last_grad_norm``)
        self._last_norm: torch.Tensor | None = None
        self._state_entries = 0
        #: fp16: the loss scale, which unscales, checks for overflow and may skip the step
        self.scaler = scaler
        #: ``engine.clip_grad_norm_``'s limit for the window's step (0: none asked)
        self.requested_clip = 0.0
        optimizer.register_step_pre_hook(self._refuse_direct_step)

    def _refuse_direct_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        """Refuse the user's own ``engine.optimizer.step()`` between backward and
        ``engine.step()``, before it changes anything: the masters' ``.grad`` are
        stand-ins then (``zero3.training.grad_stand_ins``), and stepping them
        would fail half-way, after the optimizer's step counts moved."""
        if any(isinstance(m.grad, Withheld) for m in self.masters):
            raise RuntimeError(
                "engine.optimizer.step() was called directly: its gradients are this rank's partitions, "
                "which engine.step() hands it (averaged, clipped and unscaled) at each accumulation boundary. "
                "Call engine.step() instead; nothing was changed"
            )

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before the last clip (None: no clipping).
        Reading it waits for the device; the step itself never does."""
        return None if self._last_norm is None else float(self._last_norm)

    def run(self) -> bool:
        """Clip, step, write back; False: skipped for an fp16 overflow (``zero3.training.loss_scale``)."""
        self.settle()
        self.reducer.flush_replicas()
        self._before_scaling()
        factor: float | torch.Tensor | None = None
        clip = min((c for c in (self.clip, self.requested_clip) if c > 0), default=0.0)  # both limits hold
        self.requested_clip = 0.0
        if self.scaler is not None:
            finite, self._last_norm, factor = self.scaler.unscale_and_check(self.reducer, clip)
            self.scaler.update(overflow=not finite)
            if not finite:
                self.reducer.end_window()
                return False
        elif clip > 0:
            self._last_norm, factor = self.reducer.clip_(clip)
        self._step(self.reducer.window.optimizer_grads(), factor)
        self.reducer.end_window()
        self._measure_if_grown()
        return True

    def request_clip(self, max_norm: float) -> torch.Tensor:
        """``engine.clip_grad_norm_``: the window's global gradient norm now
        (unscaled; collective, on the device) and ``max_norm`` for the
        window's step, which clips in place of the user (the step alone sees
        every form the window takes: offloaded copies, the fp16 scale)."""
        self.settle()
        self.reducer.flush_replicas()
        norm = self.reducer.global_norm()
        if self.scaler is not None:
            norm = norm / self.scaler.scale
        self.requested_clip = max_norm if self.requested_clip <= 0 else min(self.requested_clip, max_norm)
        return norm

    def _measure_if_grown(self) -> None:
        if len(self.optimizer.state) != self._state_entries:
            # optimizers create a parameter's state at its first step and keep
            # its size after that: measure only when new entries appear
            self.measure_state()

    def settle(self) -> None:
        """Wait for a step still running (``zero3.training.offload`` steps behind the next forward)."""

    def written_later(self) -> frozenset[int]:
        """Parameters whose shards the last step writes after it returned (offload: behind the next forward)."""
        return frozenset()

    def _before_scaling(self) -> None:
        """Before the window is unscaled or clipped in place (offload copies it to the host first)."""

    def _step(self, grads: list[torch.Tensor | None], factor: float | torch.Tensor | None) -> None:
        """The optimizer's step on the window's partitions, which ``factor`` already scaled (None: not scaled)."""
        for master, grad in zip(self.masters, grads):
            master.grad = grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        if not self.masters_are_shards:
            for pid, master in zip(self.trainable, self.masters):
                self.shards[pid].shard.copy_(master.detach())

    def measure_state(self) -> None:
        """Count the optimizer's state in the memory ledger (after a load, say)."""
        self._state_entries = len(self.optimizer.state)
        self.memory.set(
            MemoryKind.OPTIMIZER_STATE,
            storage_bytes(t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)),
        )
