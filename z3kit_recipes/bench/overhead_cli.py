"""``python -m z3kit_recipes.bench --overhead``: the overhead bench's settings, its one spawned
process, its table. The measuring is ``bench.overhead``'s.

A freshly spawned process per runtime (world 1, gloo, one intra-op thread)
measures, for each depth N, ``TinyWorkload`` models of N blocks
``Linear(64, 64)`` + ``Tanh`` (batch 8) and the slope over N; then the
bench GPT and a small Hugging Face Llama (``OVERHEAD_LLAMA``), the runtime
against plain torch in the same process.

Note: a process per runtime.
    A runtime may change torch for the whole process it runs in. Building
    a DeepSpeed ZeRO-3 engine replaces ``torch.nn.functional.linear`` and
    ``torch.Tensor.__torch_function__`` and leaves them replaced: plain
    torch's step on the tiny model of 96 blocks went from 8.1 to 12.5 ms
    of CPU time in the same process afterwards, and every runtime measured
    after it was slowed alike. So each runtime runs in a process of its
    own, paired with plain torch there (``merge_processes``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist

from z3kit_recipes.bench.overhead import (
    OVERHEAD_DESCRIPTIONS, OVERHEAD_RUNTIMES, OverheadRuntime, measure_model, merge_processes, unit_slopes,
)
from z3kit_recipes.bench.runners import unavailable_reason
from z3kit_recipes.bench.spec import JSON, RuntimeName
from z3kit_recipes.launch import free_port
from z3kit_recipes.models import LLAMA_CONFIG, GPTConfig, GPTWorkload, LlamaWorkload, TinyWorkload, Workload

#: the Llama of the overhead bench: the bench Llama's layout (8 decoder layers, grouped-query
#: attention), narrowed to the bench GPT's size so that a CPU step is host work more than arithmetic
OVERHEAD_LLAMA: Final[dict[str, Any]] = {
    **LLAMA_CONFIG, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}
DEFAULT_DEPTHS: Final = (32, 96, 256)
#: the tiny model's blocks: Linear(64, 64) + Tanh, on a batch of 8
TINY_WIDTH: Final = 64
TINY_BATCH: Final = 8


@attrs.frozen
class OverheadSettings:
    """What one overhead run measures (pickled to its process)."""

    runtimes: tuple[OverheadRuntime, ...]
    depths: tuple[int, ...] = DEFAULT_DEPTHS
    steps: int = 5
    repeats: int = 5
    warmup: int = 2
    #: the bench GPT's shape, or None to leave the GPT out
    gpt: GPTConfig | None = attrs.field(factory=GPTConfig)
    #: ``LlamaConfig`` arguments, or None to leave the Llama out
    llama: dict[str, Any] | None = attrs.field(factory=lambda: dict(OVERHEAD_LLAMA), hash=False)


def run_overhead(settings: OverheadSettings, group: dist.ProcessGroup) -> JSON:
    """Every model of ``settings`` on ``group`` (one rank): the cases, and the slope per block."""
    def measured(label: str, wl: Workload) -> JSON:
        t0 = time.perf_counter()
        case = measure_model(wl, settings.runtimes, group, steps=settings.steps, repeats=settings.repeats,
                             warmup=settings.warmup)
        print(f"  {label}: measured in {time.perf_counter() - t0:.0f} s", flush=True)
        return case

    tiny = [measured(f"tiny, {n} blocks", TinyWorkload(depth=n, width=TINY_WIDTH, batch_size=TINY_BATCH))
            for n in settings.depths]
    for n, case in zip(settings.depths, tiny):
        case["depth"] = n
    out: JSON = {"tiny": tiny, "per_block": unit_slopes(tiny, settings.depths)}
    if settings.gpt is not None:
        out["gpt"] = measured("bench GPT", GPTWorkload(config=settings.gpt))
    if settings.llama is not None:
        out["llama"] = measured("HF Llama", LlamaWorkload(config=settings.llama))
    return out


@attrs.frozen
class _ProcessSpec:
    settings: OverheadSettings
    port: int
    out_path: str


def _process_main(rank: int, spec: _ProcessSpec) -> None:
    """The spawned process: a gloo group of one, one thread, every measurement; JSON to ``out_path``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    torch.set_num_threads(1)  # steadier than a pool of threads on cores other jobs share
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    group = dist.group.WORLD
    assert group is not None
    Path(spec.out_path).write_text(json.dumps(run_overhead(spec.settings, group)))


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def render(report: JSON, kind: str = "cpu_s") -> str:
    """The table: us per block per step, overhead on the GPT and the Llama, units, by ``kind``."""
    res = report["results"]
    label = "process CPU time" if kind == "cpu_s" else "wall time"
    n_max = res["tiny"][-1]["depth"]
    models = [m for m in ("gpt", "llama") if m in res]
    head = ["runtime", "us per block per step", *(f"overhead {m} ms (x plain)" for m in models),
            f"units (tiny N={n_max}{''.join(' / ' + m for m in models)})"]
    rows = [head, ["---"] * len(head)]
    plain = ["plain torch", f"{res['per_block']['plain'][kind] * 1e6:.0f} (its own cost)"]
    plain += [f"{_ms(res[m]['runtimes']['plain'][kind])} ms a step" for m in models] + ["0"]
    rows.append(plain)
    for rt in report["runtimes"]:
        row = [rt, f"{res['per_block'][rt][kind] * 1e6:.0f}"]
        for m in models:
            fig = res[m]["runtimes"]
            plain_here = fig[rt].get("plain_" + kind, fig["plain"][kind])  # the plain torch it was paired with
            row.append(f"{_ms(fig[rt]['overhead_' + kind])} ({fig[rt][kind] / plain_here:.2f}x)")
        row.append(" / ".join(str(c["runtimes"][rt]["units"]) for c in [res["tiny"][-1], *(res[m] for m in models)]))
        rows.append(row)
    lines = [f"by {label}:"] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def add_overhead_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overhead", action="store_true",
                   help="instead of the runtime table: host overhead per step over plain torch at world 1 "
                        "(bench.overhead; --workload tiny: the slope only; --steps: steps per chunk)")
    p.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)),
                   help="--overhead: the tiny models' block counts for the slope (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="--overhead: alternated chunks per runtime (default 5)")
    p.add_argument("--overhead-runtimes", default="all",
                   help="--overhead: comma list of " + ",".join(OVERHEAD_RUNTIMES) + ", or all (default)")


#: the runtime table's name of each overhead runtime, whose availability it shares
_BENCH_NAME: Final[dict[OverheadRuntime, RuntimeName]] = {
    "ddp": "ddp", "fsdp2-block": "fsdp2", "fsdp2-module": "fsdp2", "deepspeed": "deepspeed", "z3kit": "z3kit",
    "z3kit-per-module": "z3kit", "z3kit-leaf": "z3kit", "fsdp_blocks": "fsdp_blocks",
}


def _settings(args: argparse.Namespace) -> OverheadSettings:
    wanted = list(OVERHEAD_RUNTIMES) if args.overhead_runtimes == "all" else args.overhead_runtimes.split(",")
    unknown = [w for w in wanted if w not in OVERHEAD_RUNTIMES]
    depths = tuple(int(d) for d in args.depths.split(","))
    if unknown or len(set(depths)) < 2 or min(depths) < 1 or args.repeats < 1:
        raise SystemExit(f"--overhead-runtimes from {', '.join(OVERHEAD_RUNTIMES)} (unknown: {unknown}); --depths "
                         f"at least two distinct values >= 1 (got {depths}); --repeats >= 1 (got {args.repeats})")
    runtimes: list[OverheadRuntime] = []
    for rt in OVERHEAD_RUNTIMES:
        if rt in wanted:
            why = unavailable_reason(_BENCH_NAME[rt])
            if why:
                print(f"note: skipping {rt}: {why}", flush=True)
            else:
                runtimes.append(rt)
    return OverheadSettings(
        runtimes=tuple(runtimes), depths=depths, steps=args.steps or 5, repeats=args.repeats,
        warmup=2 if args.warmup is None else args.warmup,
        gpt=GPTConfig() if args.workload in ("all", "gpt") else None,
        llama=dict(OVERHEAD_LLAMA) if args.workload in ("all", "llama") else None,
    )


def main_overhead(args: argparse.Namespace) -> int:
    """``--overhead``: run in one spawned process, write ``--out``, print the tables."""
    from z3kit_recipes.bench.spawn import spawn_ranks

    settings = _settings(args)
    out: Path = Path("runs/bench_overhead.json") if args.out == Path("runs/bench.json") else args.out
    fd, tmp = tempfile.mkstemp(prefix="z3bench-overhead-", suffix=".json")
    os.close(fd)
    load = os.getloadavg()[0]
    print(f"overhead bench: {', '.join(settings.runtimes)} against plain torch; depths {settings.depths}; "
          f"1-min load average {load:.1f} on {os.cpu_count()} cores", flush=True)
    t0 = time.perf_counter()
    runs = []
    for rt in settings.runtimes:  # see the Note on a process per runtime
        run = spawn_ranks(_process_main, _ProcessSpec(attrs.evolve(settings, runtimes=(rt,)), free_port(), tmp),
                          nprocs=1, threads=1, out_path=tmp,
                          for_rss=False)  # a timing: glibc's own allocator, as users run (see spawn_ranks)
        if "tiny" not in run:
            print(f"the overhead run of {rt} failed after {run['wall_s']:.0f} s: {run.get('note')}", file=sys.stderr)
            return 1
        print(f"  {rt}: done", flush=True)
        runs.append(run)
    result = merge_processes(runs, settings.depths)
    report: JSON = {
        "meta": {"command": " ".join(["python -m z3kit_recipes.bench", *sys.argv[1:]]), "torch": torch.__version__,
                 "cpu_count": os.cpu_count(), "threads": 1, "world": 1, "optimizer": "torch.optim.Adam(foreach=True)",
                 "loadavg_1min_start": load, "loadavg_1min_end": os.getloadavg()[0],
                 "wall_s": time.perf_counter() - t0, "settings": attrs.asdict(settings),
                 "tiny_model": f"TinyWorkload(depth=N, width={TINY_WIDTH}, batch_size={TINY_BATCH})"},
        "runtimes": list(settings.runtimes),
        "descriptions": {rt: OVERHEAD_DESCRIPTIONS[rt] for rt in settings.runtimes},
        "results": result,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report, "cpu_s") + "\n\n" + render(report, "wall_s") + "\n")
    for rt, text in report["descriptions"].items():
        print(f"{rt}: {text}")
    meta = report["meta"]
    print(f"total {meta['wall_s']:.0f} s; 1-min load average {meta['loadavg_1min_start']:.1f} at the start, "
          f"{meta['loadavg_1min_end']:.1f} at the end; report written to {out}")
    return 0

