"""The training loop of one rank: learning-rate schedule, micro-steps,
optimizer steps, the progress bar, and the per-step engine figures."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from z3kit_recipes import zero3
from z3kit_recipes.train.corpus import sample_batch
from z3kit_recipes.train.extras import optional_module
from z3kit_recipes.train.profile import profile_window, start_profiler, stop_profiler
from z3kit_recipes.train.spec import RunSpec


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps (at most 20), then cosine
    decay to a tenth of ``peak``."""
    warmup = min(20, max(1, steps // 20))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@attrs.define
class Tally:
    """Per-step engine figures, accumulated on one rank.

    Step time and communication wait leave out the first step (it records
    the engine's trace) and the profiled ones (the profiler slows them).
    """

    wait_s: float = 0.0
    step_s: float = 0.0
    counted: int = 0
    #: high-water of gathered parameter elements over every step
    peak_live: int = 0
    #: wall time of each counted step, the engine's part and ours
    step_times: list[float] = attrs.field(factory=list)

    def add(self, stats: zero3.Zero3Stats, *, wall_s: float, counted: bool) -> None:
        self.peak_live = max(self.peak_live, stats.peak_live_numel)
        if counted:
            self.wait_s += stats.comm_wait_s
            self.step_s += stats.step_time_s
            self.counted += 1
            self.step_times.append(wall_s)


@attrs.frozen
class LoopResult:
    """What the training loop leaves behind on a rank."""

    #: mean loss over the micro-steps of each optimizer step
    losses: list[float]
    lrs: list[float]
    tally: Tally
    train_s: float
    #: the profiled steps ``[first, end)``; ``(-1, -1)`` without ``--profile``
    profile_window: tuple[int, int]


def train_steps(
    engine: zero3.Zero3Engine, data: torch.Tensor, spec: RunSpec, rank: int, world: int, out: Path
) -> LoopResult:
    """``spec.steps`` optimizer steps of ``gradient_accumulation_steps``
    micro-batches each, with the progress bar (rank 0), the timeline
    capture of the last step and ``--profile``."""
    device = engine.device
    gas = spec.micro_steps
    tokens_per_step = spec.tokens_per_step(world)
    tqdm_module = optional_module("tqdm", "the progress bar")
    bar: Any = tqdm_module.tqdm(
        total=spec.steps, unit="step", disable=rank != 0, dynamic_ncols=True, mininterval=0.5, file=sys.stderr
    )
    # profiled: the forward and backward of steps [profile_at, profile_end) (see profile_window)
    profile_at, profile_end = profile_window(spec.steps) if spec.profile else (-1, -1)
    capture_at = spec.steps - 2  # capture_timeline() before this step() records the next step
    profiler: torch.profiler.profile | None = None
    losses: list[float] = []
    lrs: list[float] = []
    tally = Tally()
    train_start = time.perf_counter()
    ema: float | None = None
    try:
        for step in range(spec.steps):
            t0 = time.perf_counter()
            step_lr = lr_at(step, spec.steps, spec.lr)
            for group in engine.optimizer.param_groups:
                group["lr"] = step_lr
            total = 0.0
            for micro in range(gas):
                x, y = sample_batch(
                    data, spec.batch_size, spec.model.seq_len, seed=spec.seed, rank=rank, step=step * gas + micro
                )
                logits = engine(x.to(device, non_blocking=True))
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1))
                engine.backward(loss)
                total += float(loss.detach())
            if step == capture_at:
                engine.capture_timeline()
            if step + 1 == profile_at:
                profiler = start_profiler(device)
            elif profiler is not None and step + 1 == profile_end:
                stop_profiler(profiler, out / f"trace_rank{rank}.json")
                profiler = None
            engine.step()
            losses.append(total / gas)
            lrs.append(step_lr)
            profiled = profile_at <= step < profile_end
            tally.add(engine.stats(), wall_s=time.perf_counter() - t0, counted=step > 0 and not profiled)
            ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
            elapsed = time.perf_counter() - train_start
            bar.set_postfix_str(f"loss {ema:.3f}, {tokens_per_step * (step + 1) / elapsed:,.0f} tok/s", refresh=False)
            bar.update(1)
    finally:
        if profiler is not None:
            profiler.stop()
        bar.close()
    return LoopResult(losses, lrs, tally, time.perf_counter() - train_start, (profile_at, profile_end))
