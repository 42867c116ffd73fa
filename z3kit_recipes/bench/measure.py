"""One run on one rank: build the runtime, time its steps, measure its memory.

Per rank and step:

- step time: wall time of one optimizer step (zero-grad, forward, loss,
  backward, optimizer step), ranks aligned by a barrier outside the timed
  region; a step's time is the slowest rank's.
- memory (``z3kit_recipes.bench.rss``), the same probe for every runtime,
  all relative to the rank's baseline (taken after a barrier and
  ``gc.collect()``, once the process group exists and the runtime's lazy
  imports are done, so that imports are not charged to a runtime):

  * init peak: the peak while the model is built and wrapped (sharded,
    optimizer created);
  * train peak: the peak over every training step (warm-up included),
    read after the last one (outside the timed region);
  * resident after step: held after the last step, after ``gc.collect()``.

- after the timed steps, ``probe_steps`` extra steps (not timed) are run
  instrumented: collectives per step (``z3kit_recipes.bench.collectives``)
  and the peak of live gathered parameters (each runner's own method).
- loss: every step's loss averaged over ranks, so runs can be checked against
  DDP (same weights, data and optimizer: the curves should agree to
  round-off).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

from z3kit_recipes.bench.collectives import METHOD as COLLECTIVES_METHOD
from z3kit_recipes.bench.collectives import profiled_collectives
from z3kit_recipes.bench.rss import MemoryProbe, memory_probe
from z3kit_recipes.bench.runners import RUNTIME_MODULES, Runner, build_runner
from z3kit_recipes.bench.spec import JSON, RunSpec
from z3kit_recipes.launch import leave_together, use_bytecode_cache
from z3kit_recipes.models import Workload, make_workload

#: where the benchmark's models live: it runs on CPU over gloo. The memory
#: probe follows the device (``memory_probe``), so a device port changes only this.
DEVICE: Final = torch.device("cpu")

#: modules a workload's model imports when first built (and not before)
WORKLOAD_MODULES: Final[dict[str, tuple[str, ...]]] = {
    "llama": ("transformers.models.llama.modeling_llama",),
}

#: modules torch.compile imports at its first compilation, by backend (``--compile``)
COMPILE_MODULES: Final[dict[str, tuple[str, ...]]] = {
    "inductor": ("torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx"),
    "aot_eager": ("torch._dynamo", "torch._functorch.aot_autograd"),
}

#: per-rank memory figures, bytes above the baseline
MEMORY_PHASES: Final = ("init_peak", "resident_after_init", "train_peak", "resident_after_step")


def import_lazy_modules(spec: RunSpec) -> None:
    """Import what the run would import lazily, before any baseline is taken.

    The first ``torch.optim`` constructor alone imports torch._dynamo and
    sympy (about 70 MiB resident); DeepSpeed, transformers and, under
    ``--compile``, torch.compile's backend add more.
    That is the cost of importing code, the same whatever the model, and
    would otherwise land in whichever phase happens to import first.
    """
    warm_up((*RUNTIME_MODULES[spec.runtime], *WORKLOAD_MODULES.get(spec.workload, ()),
             *(COMPILE_MODULES.get(spec.compile_backend, COMPILE_MODULES["aot_eager"]) if spec.compile else ())))


def warm_up(modules: Iterable[str]) -> None:
    """Import ``modules`` and take one throwaway optimizer step (see ``import_lazy_modules``)."""
    for name in modules:
        importlib.import_module(name)
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.zeros(1)
    torch.optim.Adam([param]).step()


def train_steps(runner: Runner, wl: Workload, rank: int, group: dist.ProcessGroup, *, steps: int, warmup: int,
                give_up_s: float | None = None,
                after_timed_step: Callable[[], None] | None = None) -> tuple[list[float], list[float], bool, list[float]]:
    """``(timed step seconds, every step's loss, gave up, warm-up step seconds)``;
    ``after_timed_step`` reads the runner after each timed step (outside the timing)."""
    times: list[float] = []
    warm: list[float] = []
    losses: list[float] = []
    for step in range(warmup + steps):
        x, y = wl.batch(rank, step)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        loss = runner.step(x, y)
        dt = time.perf_counter() - t0
        losses.append(float(loss.item()))
        (times if step >= warmup else warm).append(dt)
        if step >= warmup and after_timed_step is not None:
            after_timed_step()
        if give_up_s is not None and step > 0:
            slowest = torch.tensor([dt])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            if float(slowest) > give_up_s:
                return [dt], losses, True, warm
    return times, losses, False, warm


def _probe_steps(runner: Runner, wl: Workload, rank: int, group: dist.ProcessGroup,
                 first_step: int, probe_steps: int) -> list[dict[str, int]]:
    """Untimed instrumented steps: collectives per step; peaks of live parameters."""
    collectives: list[dict[str, int]] = []
    runner.start_probe()
    try:
        for i in range(probe_steps):
            x, y = wl.batch(rank, first_step + i)
            dist.barrier(group=group)
            collectives.append(profiled_collectives(lambda: runner.step(x, y), runner.synchronize))
    finally:
        runner.stop_probe()
    return collectives


def _memory_summary(per_rank: list[dict[str, int]], total_params: int, method: str) -> JSON:
    """Max over ranks of each phase, in bytes and in units of the model's fp32 size."""
    model_bytes = 4 * total_params
    out: JSON = {"method": method, "model_fp32_bytes": model_bytes, "per_rank": per_rank}
    for phase in ("baseline", *MEMORY_PHASES):
        worst = max(r[phase] for r in per_rank)
        out[f"{phase}_bytes"] = worst
        out[f"{phase}_x_model"] = worst / model_bytes
    return out


def measure(spec: RunSpec, rank: int, group: dist.ProcessGroup, probe: MemoryProbe, *,
            threads: int, steps: int, warmup: int, probe_steps: int,
            give_up_s: float | None = None) -> JSON:
    """Build, time ``steps`` steps after ``warmup``, probe; the summary on every rank.

    With ``give_up_s`` (thread trials), the run stops as soon as a step after
    the first takes longer than that on some rank; the slow step is then the
    only one timed, and ``gave_up`` is set.
    """
    torch.set_num_threads(threads)
    wl = make_workload(spec.workload, tie_mode=spec.tie_mode)
    dist.barrier(group=group)
    gc.collect()
    baseline = probe.current()

    probe.reset_peak()
    t_build = time.perf_counter()
    runner = build_runner(spec, wl, group)
    build_s = time.perf_counter() - t_build
    memory = {"baseline": baseline, "init_peak": probe.peak() - baseline}
    gc.collect()
    memory["resident_after_init"] = probe.current() - baseline

    probe.reset_peak()
    times, losses, gave_up, warm = train_steps(runner, wl, rank, group, steps=steps, warmup=warmup, give_up_s=give_up_s)
    memory["train_peak"] = probe.peak() - baseline
    gc.collect()
    memory["resident_after_step"] = probe.current() - baseline
    engine = runner.engine_report()  # of the last training step, as the memory figures

    collectives = _probe_steps(runner, wl, rank, group, warmup + steps, probe_steps)
    # of the last probe step, as the profiler's count it is shown next to
    engine_collectives = runner.engine_collectives()
    local: JSON = {"times": times, "warm": warm, "losses": losses, "collectives": collectives,
                   "peak": runner.peak_live_params(), "build_s": build_s, "memory": memory,
                   "engine": engine}
    gathered: list[Any] = [None] * spec.world
    dist.all_gather_object(gathered, local, group=group)

    timed = min(len(r["times"]) for r in gathered)
    step_times = [max(r["times"][i] for r in gathered) for i in range(timed)]
    peaks = [r["peak"] for r in gathered]
    per_step = collectives[-1] if collectives else None
    result: JSON = {
        "status": "ok",
        "threads": threads,
        "steps": timed,
        "warmup": warmup,
        "gave_up": gave_up,
        "median_s": statistics.median(step_times),
        "mean_s": statistics.fmean(step_times),
        "min_s": min(step_times),
        "max_s": max(step_times),
        "step_times_s": step_times,
        # under --compile: the time compiling takes (slowest rank per step)
        "warmup_times_s": [max(r["warm"][i] for r in gathered) for i in range(min(len(r["warm"]) for r in gathered))],
        "losses": [statistics.fmean(r["losses"][i] for r in gathered) for i in range(len(losses))],
        "build_s": max(r["build_s"] for r in gathered),
        "total_params": runner.total_params,
        "memory": _memory_summary([r["memory"] for r in gathered], runner.total_params, probe.method),
        "peak_live_params": None if any(p is None for p in peaks) else max(peaks),
        "peak_live_params_per_rank": peaks,
        "peak_live_params_method": runner.peak_method,
        "collectives_per_step": per_step,
        "collectives_same_every_step_and_rank": all(c == per_step for r in gathered for c in r["collectives"]),
        "collectives_method": COLLECTIVES_METHOD,
    }
    if engine is not None:
        result["engine_stats"] = engine
        result["engine_memory_per_rank"] = [r["engine"]["memory"] for r in gathered]
    if engine_collectives is not None:
        result["engine_collectives_per_step"] = engine_collectives
    return result


def calibrate_threads(spec: RunSpec, rank: int, group: dist.ProcessGroup, probe: MemoryProbe) -> JSON:
    """Short trials at each of ``spec.threads``; the fastest, and every trial's median."""
    trials: dict[str, float] = {}
    stopped: list[int] = []
    for t in spec.threads:
        # A candidate 3x slower than the best so far is dropped early.
        limit = 3 * min(trials.values()) if trials else None
        trial = measure(spec, rank, group, probe, threads=t, steps=spec.trial_steps,
                        warmup=min(spec.warmup, 2), probe_steps=0, give_up_s=limit)
        trials[str(t)] = trial["median_s"]
        if trial["gave_up"]:
            stopped.append(t)
    return {"status": "ok", "threads": int(min(trials, key=lambda k: trials[k])),
            "threads_trials_median_s": trials, "threads_trial_steps": spec.trial_steps,
            "threads_trials_stopped_early": stopped}


def worker(rank: int, spec: RunSpec) -> None:
    """Entry point of a spawned rank: one run (or thread calibration, with more
    than one candidate); rank 0 writes the result to ``spec.out_path``."""
    use_bytecode_cache(spec.pycache_dir)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world),
        LOCAL_WORLD_SIZE=str(spec.world),
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # FSDP2 and DeepSpeed call the collectives torch 2.13 renamed; not ours to fix.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    torch.set_num_threads(spec.threads[0])
    import_lazy_modules(spec)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        assert group is not None
        probe = memory_probe(DEVICE)
        if len(spec.threads) > 1:
            result = calibrate_threads(spec, rank, group, probe)
        else:
            result = measure(spec, rank, group, probe, threads=spec.threads[0], steps=spec.steps,
                             warmup=spec.warmup, probe_steps=spec.probe_steps)
        if rank == 0:
            Path(spec.out_path).write_text(json.dumps(result))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_together()
