"""The training loop of one rank: learning-rate schedule, micro-steps,
optimizer steps, the progress bar, and the per-step engine figures."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from z3kit_recipes import zero3
from z3kit_recipes.train.corpus import sample_batch
from z3kit_recipes.train.defaults import warmup_steps
from z3kit_recipes.train.extras import optional_module
from z3kit_recipes.train.profile import profile_window, start_profiler, stop_profiler
from z3kit_recipes.train.spec import RunSpec


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps (at most 20), then cosine
    decay to a tenth of ``peak``."""
    warmup = warmup_steps(steps)
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
    check_s: float = 0.0
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
            self.check_s += stats.rank_check_s
            self.step_s += stats.step_time_s
            self.counted += 1
            self.step_times.append(wall_s)


@attrs.frozen
class LoopStart:
    """Where the loop begins: at step 0, or where a resumed run left off."""

    step: int = 0
    #: this rank's losses and the learning rates of the steps before ``step``
    losses: tuple[float, ...] = ()
    lrs: tuple[float, ...] = ()
    #: the steps that the LR schedule spans (None: ``spec.steps``; a resumed run keeps the saved run's)
    schedule_steps: int | None = None


#: asked before each step, on every rank (collective): whether the run should stop there
StopCheck = Callable[[], bool]

#: called after each optimizer step with (steps done, this rank's losses, the learning rates so
#: far) on every rank (it may be collective); what it returns, rank 0 prints
AfterStep = Callable[[int, list[float], list[float]], str | None]


@attrs.frozen
class LoopResult:
    """What the training loop leaves behind on a rank."""

    #: mean loss over the micro-steps of each optimizer step, from step 0 (a resumed run's
    #: first ``first_step`` come from its checkpoint)
    losses: list[float]
    lrs: list[float]
    tally: Tally
    #: wall time of the steps, checkpoints saved between them left out
    train_s: float
    #: the profiled steps ``[first, end)``; ``(-1, -1)`` without ``--profile``
    profile_window: tuple[int, int]
    #: the step this process started at (0, or the resumed checkpoint's)
    first_step: int = 0
    #: the run stopped before ``spec.steps`` (Ctrl-C; ``StopCheck``), after ``len(losses)`` steps
    interrupted: bool = False


def train_steps(
    engine: zero3.Zero3Engine,
    data: torch.Tensor,
    spec: RunSpec,
    rank: int,
    world: int,
    out: Path,
    start: LoopStart = LoopStart(),
    after_step: AfterStep | None = None,
    stop: StopCheck | None = None,
) -> LoopResult:
    """Optimizer steps ``start.step`` to ``spec.steps - 1`` of
    ``gradient_accumulation_steps`` micro-batches each, with the progress
    bar (rank 0), the timeline capture of the last step, ``--profile`` and
    ``after_step`` (checkpoints) after each step; the loop ends early when
    ``stop`` says so before a step."""
    device = engine.device
    gas = spec.micro_steps
    tokens_per_step = spec.tokens_per_step(world)
    schedule_steps = spec.steps if start.schedule_steps is None else start.schedule_steps
    tqdm_module = optional_module("tqdm", "the progress bar")
    # Note: why the bar gets a thread lock.
    #     tqdm's default write lock holds a multiprocessing RLock: a named POSIX
    #     semaphore, registered with the launcher's resource tracker and
    #     unlinked only by a finalizer at interpreter exit. A spawned rank ends
    #     in os._exit (launch.leave_together: torch 2.13's gloo teardown aborts
    #     now and then), which skips that finalizer, so every run ended with
    #     "resource_tracker: There appear to be N leaked semaphore objects".
    #     Each rank draws only its own bar (rank 0's shows): a thread lock is
    #     all it needs, and nothing is left to leak.
    tqdm_module.tqdm.set_lock(threading.RLock())
    bar: Any = tqdm_module.tqdm(
        total=spec.steps, initial=start.step, unit="step", disable=rank != 0, dynamic_ncols=True, mininterval=0.5,
        file=sys.stderr,
    )  # fmt: skip
    # profiled: the forward and backward of steps [profile_at, profile_end) (see profile_window),
    # past the first step of this process (it records the engine's trace)
    profile_at, profile_end = profile_window(spec.steps) if spec.profile else (-1, -1)
    profile_at = max(profile_at, start.step + 1) if profile_at >= 0 else -1
    if profile_at >= profile_end:
        profile_at, profile_end = -1, -1
    capture_at = spec.steps - 2  # capture_timeline() before this step() records the next step
    profiler: torch.profiler.profile | None = None
    losses: list[float] = list(start.losses)
    lrs: list[float] = list(start.lrs)
    tally = Tally()
    train_start = time.perf_counter()
    after_s = 0.0  # spent in after_step
    ema: float | None = None
    interrupted = False
    try:
        for step in range(start.step, spec.steps):
            if stop is not None and stop():
                interrupted = True
                break
            t0 = time.perf_counter()
            groups = engine.require_optimizer("training").param_groups
            if engine.lr_scheduler is None:
                step_lr = lr_at(step, schedule_steps, spec.lr)
                for group in groups:
                    group["lr"] = step_lr
            else:  # the --config JSON's scheduler set it, after the last step
                step_lr = float(groups[0]["lr"])
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
                engine.synchronize()  # nothing of the engine's in flight when the profiler stops (its docstring)
                stop_profiler(profiler, out / f"trace_rank{rank}.json")
                profiler = None
            engine.step()
            losses.append(total / gas)
            lrs.append(step_lr)
            profiled = profile_at <= step < profile_end
            first = step == start.step
            tally.add(engine.stats(), wall_s=time.perf_counter() - t0, counted=not first and not profiled)
            ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
            elapsed = time.perf_counter() - train_start - after_s
            done = step + 1 - start.step
            bar.set_postfix_str(f"loss {ema:.3f}, {tokens_per_step * done / elapsed:,.0f} tok/s", refresh=False)
            bar.update(1)
            if after_step is not None:
                t_after = time.perf_counter()
                said = after_step(step + 1, losses, lrs)
                if said is not None and rank == 0:
                    bar.write(said, file=sys.stdout)
                after_s += time.perf_counter() - t_after
    finally:
        if profiler is not None:
            profiler.stop()
        bar.close()
    window = (profile_at, profile_end)
    return LoopResult(losses, lrs, tally, time.perf_counter() - train_start - after_s, window, start.step,
                      interrupted)
