"""Host memory over a long run: each rank's resident set, step by step, DDP against z3kit.

    python -m z3kit_recipes.bench --long-run [--steps 2000] [--warmup 300] [--world 2]
        [--sample-every 50] [--out runs/bench_long_run.json]

Each runtime trains the main job's default model (``LONG_RUN_MODEL``: the
``small`` GPT of ``z3kit_recipes.train``, batch 16) for ``--steps`` steps on
``--world`` fresh gloo processes, one after the other in the same
invocation, and every rank reads its resident set (``VmRSS``) every
``--sample-every`` steps. The ranks run under glibc's default malloc
settings (no ``MALLOC_*`` variables, unlike the runtime table: see
``rss``), as users run: the question is what the process keeps, not what
its tensors hold.

The figure is the growth after warm-up, in MB per 1,000 steps, per rank;
a runtime's figure is its largest rank's. z3kit holds flat memory when its
figure is at most DDP's plus ``FLAT_MARGIN_MB`` (issue 41).

Note: the envelope, not every sample.
    z3kit gives freed heap back at a step's end once the resident set grew
    past a margin (``z3kit.freed_heap``); a sample taken just after such a
    trim reads 40-50 MB below one taken a step later, when the step's
    working set is resident again. Samples fall on either level at random,
    so a slope through all of them is noise (-7 and +10 MB per 1,000 steps
    on two ranks of the same flat run). The figure is therefore the slope
    of the envelope: the largest sample of each ``WINDOW`` consecutive
    samples (250 steps), which is also what a run must provision. The
    slope through every sample is kept in the report too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist

from z3kit_recipes.bench.rss import read_status_kib
from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG, JSON
from z3kit_recipes.launch import free_port, leave_together
from z3kit_recipes.models import GPTConfig, GPTWorkload, Workload

#: the runtimes compared, DDP (the baseline) first
LONG_RUN_RUNTIMES: Final = ("ddp", "z3kit")
#: the main job's default model (``train``'s "small" preset over a byte vocabulary) and batch
LONG_RUN_MODEL: Final = GPTConfig(vocab_size=256, width=96, n_layer=4, n_head=4, seq_len=64)
LONG_RUN_BATCH: Final = 16
DEFAULT_LONG_STEPS: Final = 2000
DEFAULT_LONG_WARMUP: Final = 300
DEFAULT_SAMPLE_EVERY: Final = 50
#: z3kit's growth may exceed DDP's by this much, in MB per 1,000 steps
FLAT_MARGIN_MB: Final = 2.0
#: distinct batches cycled through (a data loader's epoch; fresh tensors every step all the same)
DATA_CYCLE: Final = 64
MB: Final = 1e6
#: samples per window of the envelope (see the Note)
WINDOW: Final = 5


@attrs.frozen
class LongRunSpec:
    """One runtime's long run, sent to every spawned rank."""

    runtime: str = attrs.field(validator=attrs.validators.in_(LONG_RUN_RUNTIMES))
    world: int
    steps: int
    sample_every: int
    port: int
    out_path: str


def long_run_workload() -> Workload:
    return GPTWorkload(config=LONG_RUN_MODEL, batch_size=LONG_RUN_BATCH)


def runner_for(runtime: str, wl: Workload, group: dist.ProcessGroup) -> Any:
    if runtime == "ddp":
        from z3kit_recipes.bench.runners.torch_native import DDPRunner

        return DDPRunner(wl, group)
    from z3kit_recipes.bench.runners.z3kit_zero3 import Z3kitRunner, shared_config

    return Z3kitRunner(wl, group, shared_config(DEFAULT_ZERO_CONFIG))


def sampled_steps(runner: Any, wl: Workload, rank: int, steps: int, every: int) -> list[tuple[int, int]]:
    """Train ``steps`` steps; the resident set (bytes) after every ``every``-th step and the last."""
    samples: list[tuple[int, int]] = []
    for step in range(steps):
        runner.step(*wl.batch(rank, step % DATA_CYCLE))
        if step % every == 0 or step == steps - 1:
            samples.append((step, read_status_kib("VmRSS") * 1024))
    return samples


def rank_main(rank: int, spec: LongRunSpec) -> None:
    """A spawned rank: train ``spec.steps`` steps, sampling the resident set; rank 0 writes them all."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(spec.world), LOCAL_WORLD_SIZE=str(spec.world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    group = dist.group.WORLD
    assert group is not None
    wl = long_run_workload()
    runner = runner_for(spec.runtime, wl, group)
    t0 = time.perf_counter()
    samples = sampled_steps(runner, wl, rank, spec.steps, spec.sample_every)
    seconds = time.perf_counter() - t0
    everyone: list[Any] = [None] * spec.world
    dist.all_gather_object(everyone, samples, group=group)
    if rank == 0:
        Path(spec.out_path).write_text(json.dumps({"status": "ok", "rss_bytes": everyone, "train_s": seconds}))
    leave_together()


def _slope_mb_per_1000(points: list[tuple[float, float]]) -> float:
    mean_s = sum(s for s, _ in points) / len(points)
    mean_b = sum(b for _, b in points) / len(points)
    spread = sum((s - mean_s) ** 2 for s, _ in points)
    return 1000.0 * sum((s - mean_s) * (b - mean_b) for s, b in points) / spread


def growth_mb_per_1000(samples: list[tuple[int, int]], warmup: int, window: int = WINDOW) -> float:
    """The growth of the resident set's envelope after ``warmup``, in MB per
    1,000 steps: the least-squares slope of the largest sample (bytes) of
    each ``window`` consecutive samples from step ``warmup`` on (a partial
    last window left out), against the window's mean step. See the Note."""
    kept = [(float(s), b / MB) for s, b in samples if s >= warmup]
    windows = [kept[i:i + window] for i in range(0, len(kept) - window + 1, window)]
    if len(windows) < 2:
        raise ValueError(f"fewer than 2 windows of {window} samples at or after step {warmup} ({len(kept)} "
                         "samples): run more steps than the warm-up, or sample more often")
    return _slope_mb_per_1000([(sum(s for s, _ in w) / len(w), max(b for _, b in w)) for w in windows])


def all_samples_slope(samples: list[tuple[int, int]], warmup: int) -> float:
    """The least-squares slope of every sample from ``warmup`` on (MB per 1,000 steps), for the record."""
    kept = [(float(s), b / MB) for s, b in samples if s >= warmup]
    return _slope_mb_per_1000(kept) if len(kept) > 1 else float("nan")


def summarize(runs: dict[str, JSON], warmup: int) -> JSON:
    """Each runtime's growth per rank and its largest, and whether z3kit's is flat as DDP's."""
    out: JSON = {}
    for runtime, run in runs.items():
        if run.get("status") != "ok":
            out[runtime] = {"status": run.get("status", "error"), "note": run.get("note", "")}
            continue
        per_rank = [growth_mb_per_1000([tuple(s) for s in rank], warmup) for rank in run["rss_bytes"]]
        every_sample = [all_samples_slope([tuple(s) for s in rank], warmup) for rank in run["rss_bytes"]]
        first = [rank[0][1] / MB for rank in run["rss_bytes"]]
        last = [rank[-1][1] / MB for rank in run["rss_bytes"]]
        out[runtime] = {"status": "ok", "growth_mb_per_1000_steps": per_rank, "growth_max": max(per_rank),
                        "all_samples_slope_mb_per_1000_steps": every_sample,
                        "rss_first_mb": first, "rss_last_mb": last, "train_s": run["train_s"]}
    ddp, z3 = out.get("ddp", {}), out.get("z3kit", {})
    if ddp.get("status") == "ok" and z3.get("status") == "ok":
        out["z3kit_flat_as_ddp"] = z3["growth_max"] <= ddp["growth_max"] + FLAT_MARGIN_MB
    return out


def add_long_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long-run", action="store_true",
                   help="instead of the runtime table: each rank's resident set over a long run, DDP against "
                        f"z3kit (bench.long_run; --steps: default {DEFAULT_LONG_STEPS}, --warmup: steps left out "
                        f"of the growth, default {DEFAULT_LONG_WARMUP}; --world: the first size)")
    p.add_argument("--sample-every", type=int, default=DEFAULT_SAMPLE_EVERY,
                   help="--long-run: steps between resident-set samples (default %(default)s)")


def main_long_run(args: argparse.Namespace) -> int:
    """``--long-run``: both runtimes in turn, the report to ``--out``, a table printed."""
    from z3kit_recipes.bench.spawn import spawn_ranks

    steps = DEFAULT_LONG_STEPS if args.steps is None else args.steps
    warmup = DEFAULT_LONG_WARMUP if args.warmup is None else args.warmup
    world = args.world[0]
    if steps < 2 or not 0 <= warmup < steps or args.sample_every < 1 or world < 2:
        raise SystemExit(f"--long-run needs --steps >= 2 (got {steps}), 0 <= --warmup < --steps (got {warmup}), "
                         f"--sample-every >= 1 (got {args.sample_every}) and --world >= 2 (got {world})")
    out: Path = Path("runs/bench_long_run.json") if args.out == Path("runs/bench.json") else args.out
    load = os.getloadavg()[0]
    print(f"long-run bench: {', '.join(LONG_RUN_RUNTIMES)}, {steps} steps at world {world}, resident set every "
          f"{args.sample_every} steps; 1-min load average {load:.1f} on {os.cpu_count()} cores", flush=True)
    runs: dict[str, JSON] = {}
    for runtime in LONG_RUN_RUNTIMES:
        fd, tmp = tempfile.mkstemp(prefix="z3bench-long-", suffix=".json")
        os.close(fd)
        spec = LongRunSpec(runtime, world, steps, args.sample_every, free_port(), tmp)
        # glibc's own malloc settings: what users run (see the module docstring)
        runs[runtime] = spawn_ranks(rank_main, spec, nprocs=world, threads=1, out_path=tmp, for_rss=False)
        print(f"  {runtime}: {runs[runtime].get('status')} in {runs[runtime]['wall_s']:.0f} s", flush=True)
    summary = summarize(runs, warmup)
    report: JSON = {
        "meta": {"command": " ".join(["python -m z3kit_recipes.bench", *sys.argv[1:]]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                 "cpu_count": os.cpu_count(), "world": world, "steps": steps, "warmup": warmup,
                 "sample_every": args.sample_every, "model": repr(LONG_RUN_MODEL), "batch": LONG_RUN_BATCH,
                 "zero_optimization": DEFAULT_ZERO_CONFIG, "loadavg_1min_start": load,
                 "loadavg_1min_end": os.getloadavg()[0]},
        "summary": summary,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(render_long_run(summary, warmup))
    print(f"report written to {out}")
    return 0 if all(r.get("status") == "ok" for r in runs.values()) else 1


def render_long_run(summary: JSON, warmup: int) -> str:
    lines = [f"{'runtime':8} {'RSS first -> last (MB), per rank':40} growth after step {warmup} (MB / 1,000 steps)"]
    for runtime in LONG_RUN_RUNTIMES:
        row = summary.get(runtime, {})
        if row.get("status") != "ok":
            lines.append(f"{runtime:8} {row.get('status')}: {row.get('note', '')}")
            continue
        rss = ", ".join(f"{a:.0f} -> {b:.0f}" for a, b in zip(row["rss_first_mb"], row["rss_last_mb"], strict=True))
        growth = ", ".join(f"{g:+.1f}" for g in row["growth_mb_per_1000_steps"])
        lines.append(f"{runtime:8} {rss:40} {growth} (largest {row['growth_max']:+.1f})")
    if "z3kit_flat_as_ddp" in summary:
        lines.append(f"z3kit within DDP + {FLAT_MARGIN_MB:.0f} MB per 1,000 steps: "
                     f"{'yes' if summary['z3kit_flat_as_ddp'] else 'NO'}")
    return "\n".join(lines)
