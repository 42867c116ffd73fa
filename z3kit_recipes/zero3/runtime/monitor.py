"""StepMonitor: rank 0 writes the loss and learning rate of each optimizer step, as DeepSpeed's monitors do.

DeepSpeed's engine writes, after each optimizer step (and its scheduler's
step), ``Train/Samples/lr`` and, in fp16, ``Train/Samples/loss_scale``,
against the number of samples trained so far, to every enabled monitor;
its pipeline engine adds ``Train/Samples/train_loss``. Here the same names,
the loss being the mean of the losses given to ``engine.backward`` since
the last step (a step whose losses went through ``loss.backward()``
writes none: the engine never saw them). The samples are the optimizer
steps times ``micro_batch_size`` x ``gradient_accumulation_steps`` x the
ranks; where the config does not say the micro batch, the x-axis is the
optimizer step and the names say ``Train/Steps/``.

The layouts are DeepSpeed's (``deepspeed/monitor``): TensorBoard, a
``torch.utils.tensorboard.SummaryWriter`` on ``output_path/job_name``,
flushed after each step; CSV, one file per name in that folder
(``Train_Samples_lr.csv``), appended, with a ``step,<last part of the name>``
header when a run first writes it. Only rank 0 writes. Reading the loss
waits for the device once per step, on rank 0, only when a monitor is on.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from z3kit_recipes.zero3.config.monitor import MonitorConfig


class _Writer(Protocol):
    def write(self, events: Sequence[tuple[str, float, int]]) -> None: ...


class _TensorBoard:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (MonitorConfig checks)

        os.makedirs(log_dir, exist_ok=True)
        self.writer: Any = SummaryWriter(log_dir=log_dir)

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()


class _Csv:
    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.started: set[str] = set()  # the files this run has written a header into

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            file_name = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, file_name + ".csv"), "a", newline="", encoding="utf-8") as f:
                out = csv.writer(f)
                if file_name not in self.started:
                    self.started.add(file_name)
                    out.writerow(["step", name.split("/")[-1]])
                out.writerow([x, value])


class StepMonitor:
    """The enabled monitors of rank 0 (see the module docstring)."""

    def __init__(self, monitors: Sequence[MonitorConfig], samples_per_step: int | None) -> None:
        self.writers: list[_Writer] = [
            _TensorBoard(m.log_dir) if m.kind == "tensorboard" else _Csv(m.log_dir) for m in monitors]
        self.samples_per_step = samples_per_step
        self.prefix = "Train/Samples/" if samples_per_step is not None else "Train/Steps/"
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0

    @classmethod
    def open(cls, monitors: Sequence[MonitorConfig], rank: int, samples_per_step: int | None) -> StepMonitor | None:
        """Rank 0's monitors; None on the other ranks, or when no monitor is enabled."""
        return cls(monitors, samples_per_step) if monitors and rank == 0 else None

    def loss(self, loss: torch.Tensor) -> None:
        """A micro-step's loss (kept on its device: no wait here)."""
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._losses += 1

    def step(self, global_step: int, lr: float | None, loss_scale: float | None) -> None:
        """Write the numbers of the optimizer step just taken (``global_step`` steps so far)."""
        x = global_step if self.samples_per_step is None else global_step * self.samples_per_step
        events: list[tuple[str, float, int]] = []
        if self._loss_sum is not None:
            events.append((self.prefix + "train_loss", float(self._loss_sum.item()) / self._losses, x))
        if lr is not None:
            events.append((self.prefix + "lr", float(lr), x))
        if loss_scale is not None:
            events.append((self.prefix + "loss_scale", float(loss_scale), x))
        self._loss_sum, self._losses = None, 0
        for writer in self.writers:
            writer.write(events)
