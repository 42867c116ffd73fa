"""Timing section of ``bench.gpu``: z3kit's step time against FSDP2's (and
DeepSpeed ZeRO-3's at world 2 and more), through the bench's runners.

Every runtime trains the same model on the same batches with
``torch.optim.Adam`` in fp32 (the runners' setting), z3kit and DeepSpeed
with the bench's shared ZeRO-3 settings, FSDP2 with ``fully_shard`` on
every block and the root. A step is timed from before zero-grad to after
the optimizer step has finished on the device (the ranks meet at a barrier
outside the timed region); a step's time is the slowest rank's; a
runtime's figure is the median of ``timing_steps`` steps after ``warmup``.
The ratios are z3kit's median over the other's (below 1: z3kit faster).
"""

from __future__ import annotations

import statistics
import time
from typing import Final

import attrs

from z3kit_recipes.bench.gpu_rank import MODELS, RankContext, Section, error_result
from z3kit_recipes.bench.runners import Runner, unavailable_reason
from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG, JSON
from z3kit_recipes.models import Workload


#: z3kit with the optimizer state and masters on the host (``Zero3Config.offload_optimizer``): with the
#: bench's Adam (the same math as ``z3kit``), and with torch's fused Adam, whose CPU kernel the host step wants
OFFLOADED: Final = ("z3kit_offload", "z3kit_offload_fused")
#: z3kit with Muon on the hidden matrices and Adam on the rest (``runners.z3kit_zero3.muon_and_adam``),
#: at world 1: Muon's step against Adam's (Newton-Schulz in bf16 on the device)
MUON: Final = "z3kit_muon"
#: the runtimes whose ratio is to plain ``z3kit`` (the same runtime, another optimizer or where it steps)
AGAINST_Z3KIT: Final = (*OFFLOADED, MUON)


def runtimes(world: int) -> tuple[str, ...]:
    """The runtimes timed at ``world``; DeepSpeed last (see ``gpu_rank.sections``)."""
    return ("z3kit", *OFFLOADED, MUON, "fsdp2") if world == 1 else ("z3kit", *OFFLOADED, "fsdp2", "deepspeed")


def _runner(ctx: RankContext, wl: Workload, runtime: str) -> Runner:
    if runtime == "z3kit" or runtime in AGAINST_Z3KIT:
        from z3kit_recipes.bench.runners import adam, fused_adam
        from z3kit_recipes.bench.runners.z3kit_zero3 import Z3kitRunner, muon_and_adam
        from z3kit_recipes.zero3.config.offload import OffloadConfig

        offload = OffloadConfig() if runtime in OFFLOADED else None
        optimizer = fused_adam if runtime == "z3kit_offload_fused" else muon_and_adam if runtime == MUON else adam
        return Z3kitRunner(wl, ctx.group, attrs.evolve(ctx.config("fp32"), offload_optimizer=offload),
                           optimizer=optimizer)
    if runtime == "fsdp2":
        from z3kit_recipes.bench.runners.torch_native import FSDP2Runner

        return FSDP2Runner(wl, ctx.group, reshard_after_forward=True)
    from z3kit_recipes.bench.runners.deepspeed_zero3 import DeepSpeedRunner

    return DeepSpeedRunner(wl, ctx.world, DEFAULT_ZERO_CONFIG)


def time_runtime(ctx: RankContext, wl: Workload, runtime: str) -> JSON:
    runner = _runner(ctx, wl, runtime)
    times: list[float] = []
    losses = []
    for step in range(ctx.sizes.warmup + ctx.sizes.timing_steps):
        x, y = wl.batch(ctx.rank, step)
        ctx.barrier()
        ctx.synchronize()
        t0 = time.perf_counter()
        loss = runner.step(x, y)
        ctx.synchronize()
        dt = time.perf_counter() - t0
        if step >= ctx.sizes.warmup:
            times.append(dt)
        losses.append(loss)
    return {"status": "ok", "step_times_s": times, "losses": [float(v) for v in losses]}


def run(ctx: RankContext) -> JSON:
    cases: JSON = {model: {} for model in MODELS}
    for runtime in runtimes(ctx.world):  # runtime by runtime, so that DeepSpeed comes after every other
        why = unavailable_reason("deepspeed") if runtime == "deepspeed" else ""
        for model in MODELS:
            if why:
                cases[model][runtime] = {"status": "skipped", "reason": why}
                continue
            try:
                cases[model][runtime] = time_runtime(ctx, ctx.workload(model), runtime)
            except Exception as exc:  # noqa: BLE001 - reported, and the next runtime runs
                cases[model][runtime] = error_result(exc)
            ctx.free()
    # a runtime that failed is reported in its own entry: the others' timings stay
    return {model: {"status": "ok", **case} for model, case in cases.items()}


def _merge_runtime(per_rank: list[JSON]) -> JSON:
    first = per_rank[0]
    for rank, r in enumerate(per_rank):
        if r["status"] != "ok":
            return {**r, "rank": rank}
    steps = min(len(r["step_times_s"]) for r in per_rank)
    slowest = [max(r["step_times_s"][i] for r in per_rank) for i in range(steps)]
    return {"status": "ok", "median_s": statistics.median(slowest), "min_s": min(slowest),
            "step_times_s": slowest, "losses_rank0": first["losses"]}


def merge(per_rank: list[JSON]) -> JSON:
    merged: JSON = {name: _merge_runtime([r[name] for r in per_rank])
                    for name in per_rank[0] if name != "status"}
    z3 = merged.get("z3kit", {})
    merged["ratios"] = {
        f"z3kit/{other}": (z3["median_s"] / merged[other]["median_s"]
                           if z3.get("status") == "ok" and merged[other]["status"] == "ok" else None)
        for other in merged if other not in ("z3kit", *AGAINST_Z3KIT, "ratios")
    }
    # the offload cliff (a step with the optimizer on the host over one without), and Muon's step over Adam's
    for name in AGAINST_Z3KIT:
        other = merged.get(name)
        if other is not None:
            merged["ratios"][f"{name}/z3kit"] = (
                other["median_s"] / z3["median_s"] if z3.get("status") == "ok" and other.get("status") == "ok"
                else None)
    return merged


def summarize(cases: JSON, ctx: RankContext) -> JSON:
    failed = [f"{model}/{name}" for model, case in cases.items() if case["status"] == "ok"
              for name, r in case.items() if isinstance(r, dict) and r.get("status") == "error"]
    return {
        **({"status": "error", "error": f"runtimes that raised: {', '.join(failed)}"} if failed else {}),
        "meaningful": ctx.meaningful,
        "note": "" if ctx.meaningful else "CPU dry run: tiny models on shared cores; not meaningful",
        "dtype": "fp32",
        "warmup_steps": ctx.sizes.warmup,
        "timed_steps": ctx.sizes.timing_steps,
        "runtimes": list(runtimes(ctx.world)),
    }


TIMING: Final = Section("timing", run, merge, summarize)

__all__ = ["TIMING", "runtimes"]
