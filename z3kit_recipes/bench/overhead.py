"""Host overhead per step: what a runtime adds to plain torch on one process.

Every runtime and plain torch train the same model on the same batches, at
world 1 on CPU (a gloo group of one), with the same optimizer (``Adam``,
``foreach=True``, as on CUDA). They are stepped in one process in
alternating chunks, plain torch before each runtime (plain, A, plain, B,
... repeated), and a runtime's overhead is the median over the repeats of
its chunk's median step time minus the plain chunk's just before it: a
machine that other jobs share slows both halves of a pair alike. The
command runs each runtime in a process of its own (``bench.overhead_cli``,
the Note on a process per runtime) and merges the processes' figures
(``merge_processes``).

Both process CPU time (``time.process_time``: every thread of the process)
and wall time are measured per step. On ``TinyWorkload`` models of N blocks
(``Linear`` + ``Tanh``), the least-squares slope of the overhead over N is
the runtime's cost per hooked unit per step (``slope``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Final, Literal

import attrs
import torch
import torch.distributed as dist
from torch import nn

from z3kit_recipes.bench.runners import engine_step, foreach_adam
from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG, JSON
from z3kit_recipes.models import Workload

OverheadRuntime = Literal[
    "ddp", "fsdp2-block", "fsdp2-module", "deepspeed", "z3kit", "z3kit-per-module", "z3kit-leaf", "fsdp_blocks"
]
OVERHEAD_RUNTIMES: Final[tuple[OverheadRuntime, ...]] = (
    "ddp", "fsdp2-block", "fsdp2-module", "deepspeed", "z3kit", "z3kit-per-module", "z3kit-leaf", "fsdp_blocks",
)
#: what each runtime is, and what its unit count counts (the report's legend)
OVERHEAD_DESCRIPTIONS: Final[dict[OverheadRuntime, str]] = {
    "ddp": "DistributedDataParallel (no units: gradient hooks only)",
    "fsdp2-block": "FSDP2, fully_shard per block and the root (units: fully_shard groups)",
    "fsdp2-module": "FSDP2, fully_shard per module owning parameters and the root (units: fully_shard groups; "
                    "a module whose parameter another module shares stays in the root's group)",
    "deepspeed": "DeepSpeed ZeRO-3, the bench's zero_optimization section (units: modules owning parameters, "
                 "counted from the model: DeepSpeed fetches per module)",
    "z3kit": "z3kit zero3, defaults (fetch_units='auto'; units: engine.stats().fetch_units)",
    "z3kit-per-module": "z3kit zero3, fetch_units=(): a fetch per module owning parameters "
                        "(units: engine.stats().fetch_units)",
    "z3kit-leaf": "z3kit zero3, the workload's blocks as leaf_modules (units: engine.stats().fetch_units)",
    "fsdp_blocks": "z3kit fsdp_blocks by the workload's blocks (units: engine.units, the blocks and the root)",
}


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs`` (at least two distinct xs)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a slope needs at least two distinct x values and one y per x; got xs={list(xs)}, "
                         f"{len(ys)} ys")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def owning_modules(model: nn.Module) -> list[nn.Module]:
    """Modules with parameters of their own, the root included."""
    return [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]


def per_module_units(model: nn.Module) -> list[nn.Module]:
    """FSDP2-per-module's groups below the root: every module owning parameters but the root,
    children before parents (``fully_shard`` goes bottom-up). A module holding a parameter that
    another module also holds (a tied lm head) is left to the root: one parameter cannot be in
    two groups."""
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    owning = [m for m in owning_modules(model) if m is not model]
    unshared = [m for m in owning if all(holders[id(p)] == 1 for p in m.parameters(recurse=False))]
    return unshared[::-1]


@attrs.frozen
class Built:
    """One runtime around one model: its step, and the units it hooks with what counted them."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    units: int


def build(runtime: OverheadRuntime | Literal["plain"], wl: Workload, group: dist.ProcessGroup) -> Built:
    """``runtime`` around a fresh model of ``wl`` on ``group`` (one rank), with ``foreach_adam``."""
    from z3kit_recipes.bench.runners import torch_native

    if runtime == "plain":
        return Built(torch_native.PlainRunner(wl, optimizer=foreach_adam).step, 0)
    if runtime == "ddp":
        return Built(torch_native.DDPRunner(wl, group, optimizer=foreach_adam).step, 0)
    if runtime in ("fsdp2-block", "fsdp2-module"):
        fsdp = torch_native.FSDP2Runner(
            wl, group, reshard_after_forward=True, optimizer=foreach_adam,
            shard_units=per_module_units if runtime == "fsdp2-module" else None,
        )
        return Built(fsdp.step, fsdp.units)
    if runtime == "deepspeed":
        from z3kit_recipes.bench.runners.deepspeed_zero3 import DeepSpeedRunner

        ds = DeepSpeedRunner(wl, 1, DEFAULT_ZERO_CONFIG, foreach=True)
        return Built(ds.step, len(owning_modules(ds.engine.module)))
    if runtime == "fsdp_blocks":
        from z3kit_recipes.bench.runners.fsdp_blocks import FsdpBlocksRunner

        blocks = FsdpBlocksRunner(wl, group, optimizer=foreach_adam)
        return Built(blocks.step, blocks.units)
    from z3kit_recipes.bench.runners.z3kit_zero3 import Z3kitRunner, shared_config

    z3 = Z3kitRunner(wl, group, shared_config(DEFAULT_ZERO_CONFIG), optimizer=foreach_adam,
                     leaf_blocks=runtime == "z3kit-leaf", fetch_units=() if runtime == "z3kit-per-module" else "auto")
    engine = z3.engine
    return Built(lambda x, y: engine_step(engine, wl, x, y), engine.stats().fetch_units)


@attrs.frozen
class Timing:
    """Median seconds per step of one chunk, by process CPU time and by wall time."""

    cpu_s: float
    wall_s: float


Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def run_chunk(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batches: Batches) -> Timing:
    """One step per batch; the median step time. The garbage of the chunk before is collected first."""
    gc.collect()
    cpu: list[float] = []
    wall: list[float] = []
    for x, y in batches:
        c0, w0 = time.process_time(), time.perf_counter()
        step(x, y)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return Timing(statistics.median(cpu), statistics.median(wall))


def paired_overheads(
    plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    runtimes: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
    batches: Batches, *, repeats: int, warmup: int,
) -> JSON:
    """Plain and each runtime stepped in alternating chunks (plain, A, plain, B, ...) ``repeats`` times.

    Returns ``{"plain": {...}, name: {...}}``: each with ``cpu_s``/``wall_s`` (the median over its
    chunks of the chunk's median step) and, for a runtime, ``plain_cpu_s``/``plain_wall_s`` (the
    same of the plain chunks paired with it) and ``overhead_cpu_s``/``overhead_wall_s`` (the median
    over the repeats of its chunk minus the plain chunk before it).
    """
    if repeats < 1 or warmup < 0 or not batches:
        raise ValueError(f"repeats must be >= 1, warmup >= 0 and batches non-empty; got {repeats}, {warmup}, "
                         f"{len(batches)}")
    for step in (plain, *runtimes.values()):
        for _ in range(warmup):
            step(*batches[0])
    plain_chunks: list[Timing] = []
    chunks: dict[str, list[tuple[Timing, Timing]]] = {name: [] for name in runtimes}
    for _ in range(repeats):
        for name, step in runtimes.items():
            base = run_chunk(plain, batches)
            plain_chunks.append(base)
            chunks[name].append((base, run_chunk(step, batches)))
    out: JSON = {"plain": {"cpu_s": statistics.median(t.cpu_s for t in plain_chunks),
                           "wall_s": statistics.median(t.wall_s for t in plain_chunks)}}
    for name, pairs in chunks.items():
        out[name] = {
            "cpu_s": statistics.median(t.cpu_s for _, t in pairs),
            "wall_s": statistics.median(t.wall_s for _, t in pairs),
            "plain_cpu_s": statistics.median(b.cpu_s for b, _ in pairs),
            "plain_wall_s": statistics.median(b.wall_s for b, _ in pairs),
            "overhead_cpu_s": statistics.median(t.cpu_s - b.cpu_s for b, t in pairs),
            "overhead_wall_s": statistics.median(t.wall_s - b.wall_s for b, t in pairs),
        }
    return out


def measure_model(
    wl: Workload, runtimes: Sequence[OverheadRuntime], group: dist.ProcessGroup, *, steps: int, repeats: int,
    warmup: int,
) -> JSON:
    """Every runtime on ``wl`` against plain torch, paired; each runtime's figures and units."""
    batches = [wl.batch(0, i) for i in range(steps)]
    plain = build("plain", wl, group)
    built = {rt: build(rt, wl, group) for rt in runtimes}
    timings = paired_overheads(plain.step, {rt: b.step for rt, b in built.items()}, batches,
                               repeats=repeats, warmup=warmup)
    for rt, b in built.items():
        timings[rt]["units"] = b.units
    params = sum(p.numel() for p in wl.build_model().parameters())
    return {"workload": wl.name, "params": params, "steps_per_chunk": steps, "repeats": repeats,
            "warmup": warmup, "runtimes": timings}


def unit_slopes(cases: Sequence[JSON], depths: Sequence[int]) -> JSON:
    """Seconds per block per step: plain torch's own cost (``plain``) and each runtime's overhead
    over plain torch, as the slope over the depths of the cases measured at them."""
    out: JSON = {"plain": {"cpu_s": slope(depths, [c["runtimes"]["plain"]["cpu_s"] for c in cases]),
                           "wall_s": slope(depths, [c["runtimes"]["plain"]["wall_s"] for c in cases])}}
    for rt in cases[0]["runtimes"]:
        if rt != "plain":
            out[rt] = {kind: slope(depths, [c["runtimes"][rt][f"overhead_{kind}"] for c in cases])
                       for kind in ("cpu_s", "wall_s")}
    return out


def merge_processes(runs: Sequence[JSON], depths: Sequence[int]) -> JSON:
    """The results of several processes, each of which measured its own runtimes against its own
    plain torch (``bench.overhead_cli``), as one: every runtime's figures as measured beside its
    own plain torch, plain torch's as the median over the processes, and the slopes over ``depths``."""
    if not runs:
        raise ValueError("merge_processes needs at least one run")

    def merged(cases: Sequence[JSON]) -> JSON:
        plains = [c["runtimes"]["plain"] for c in cases]
        figures: JSON = {"plain": {kind: statistics.median(p[kind] for p in plains) for kind in ("cpu_s", "wall_s")}}
        for case in cases:
            figures.update((rt, fig) for rt, fig in case["runtimes"].items() if rt != "plain")
        return {**cases[0], "runtimes": figures}

    tiny = [merged([run["tiny"][i] for run in runs]) for i in range(len(runs[0]["tiny"]))]
    out: JSON = {"tiny": tiny, "per_block": unit_slopes(tiny, depths)}
    for model in ("gpt", "llama"):
        if model in runs[0]:
            out[model] = merged([run[model] for run in runs])
    return out
