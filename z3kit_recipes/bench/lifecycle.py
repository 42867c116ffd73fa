"""Peak memory of the weights' life cycle: build, load, save, resume, export.

    python -m z3kit_recipes.bench.lifecycle [--workload llama] [--world 4] [--out runs/lifecycle.json]

Each rank measures, with the bench's memory probe (process RSS with glibc
returning freed memory, or the allocator's peak on an accelerator), the
peak of each phase above what it held when the phase began, in units of
the model's fp32 size, next to the bound the phase is meant to keep:

- init (built whole): the model built normally, then ``initialize``;
  bound: the model itself.
- init (meta): built on the meta device, ``initialize`` materializes it
  module by module; bound: the shards plus the largest module.
- load_pretrained: a Hugging Face checkpoint into the shards; bound: one
  tensor (a rank reads only its slice of each).
- save_checkpoint / load_checkpoint: the training state (after one step,
  so with Adam's moments); bound: one bounded buffer.
- save_pretrained: the full model exported; bound: one parameter gathered.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from z3kit_recipes.bench.measure import WORKLOAD_MODULES, warm_up
from z3kit_recipes.bench.rss import malloc_returns_freed_memory, memory_probe
from z3kit_recipes.launch import free_port, leave_together
from z3kit_recipes.models import make_workload

_spawn: Callable[..., Any] = getattr(torch.multiprocessing, "spawn")


def _phase(probe: Any, group: Any, fn: Callable[[], Any]) -> tuple[Any, int, float]:
    """(fn's result, its peak above the start in bytes, seconds), every rank together."""
    gc.collect()
    dist.barrier(group=group)
    start = probe.current()
    probe.reset_peak()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    dist.barrier(group=group)
    return out, probe.peak() - start, seconds


def _rank(rank: int, world: int, port: int, workload: str, folder: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from z3kit_recipes import zero3

    wl = make_workload(workload)
    # imports and first-use allocations happen before any measurement
    warm_up(WORKLOAD_MODULES.get(workload, ()))
    wl.build_model()
    gc.collect()
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    group = dist.group.WORLD
    probe = memory_probe(torch.device("cpu"))
    make_opt: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.Adam(p, lr=1e-4)
    cfg = zero3.Zero3Config(param_persistence_threshold=0)
    phases: dict[str, dict[str, float]] = {}

    def record(name: str, peak: int, seconds: float, bound: int) -> None:
        phases[name] = {"peak_bytes": peak, "bound_bytes": bound, "seconds": seconds}

    def build_and_init() -> Any:
        return zero3.initialize(wl.build_model(), make_opt, cfg, group)

    engine, peak, s = _phase(probe, group, build_and_init)
    numel = engine.stats().model_numel
    unit = 4 * numel
    shards = engine.stats().memory.current["param_shards"]
    largest_module = 4 * engine.stats().largest_fetch_numel
    largest_tensor = 4 * max(sh.numel for sh in engine.shards)
    record("init (built whole)", peak, s, unit)
    del engine
    gc.collect()

    def meta_init() -> Any:
        with torch.device("meta"):
            model = wl.build_model()
        return zero3.initialize(model, make_opt, cfg, group, param_init_fn=getattr(model, "_init_weights", None))

    engine, peak, s = _phase(probe, group, meta_init)
    record("init (meta)", peak, s, shards + largest_module)
    x, y = wl.batch(rank, 0)
    engine.backward(wl.loss(engine(x), y))
    engine.step()
    root = Path(folder)
    _, peak, s = _phase(probe, group, lambda: engine.save_pretrained(root / "hf"))
    record("save_pretrained", peak, s, largest_tensor)
    _, peak, s = _phase(probe, group, lambda: engine.save_checkpoint(root / "ckpt"))
    record("save_checkpoint", peak, s, largest_tensor)
    _, peak, s = _phase(probe, group, lambda: engine.load_pretrained(root / "hf"))
    record("load_pretrained", peak, s, largest_tensor)
    _, peak, s = _phase(probe, group, lambda: engine.load_checkpoint(root / "ckpt"))
    record("load_checkpoint", peak, s, largest_tensor)

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, phases, group=group)
    if rank == 0:
        report = {
            "workload": workload, "world": world, "params": numel, "unit_bytes": unit,
            "phases": {name: {"peak_units": max(r[name]["peak_bytes"] for r in everyone) / unit,
                              "bound_units": everyone[0][name]["bound_bytes"] / unit,
                              "seconds": max(r[name]["seconds"] for r in everyone)} for name in phases},
        }
        Path(result).write_text(json.dumps(report, indent=2))
    leave_together()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m z3kit_recipes.bench.lifecycle", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="llama", choices=["tiny", "gpt", "llama"])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("runs/lifecycle.json"))
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="z3kit-lifecycle-") as folder, malloc_returns_freed_memory():
        _spawn(_rank, args=(args.world, free_port(), args.workload, folder, str(args.out)), nprocs=args.world, join=True)
    report = json.loads(args.out.read_text())
    print(f"{report['workload']}, {report['world']} ranks, {report['params']:,} parameters; peak above the phase's "
          "start, max over ranks, in units of the model's fp32 size")
    print(f"{'phase':<20} {'peak':>7} {'bound':>7} {'seconds':>8}")
    for name, ph in report["phases"].items():
        print(f"{name:<20} {ph['peak_units']:>7.3f} {ph['bound_units']:>7.3f} {ph['seconds']:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
