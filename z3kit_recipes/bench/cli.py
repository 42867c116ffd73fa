"""Command line and run driver of ``python -m z3kit_recipes.bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from z3kit_recipes.bench.long_run import add_long_run_options
from z3kit_recipes.bench.mesh_spec import MeshShape
from z3kit_recipes.bench.overhead_cli import add_overhead_options
from z3kit_recipes.bench.report import compare_to_ddp, render_table
from z3kit_recipes.bench.runners import unavailable_reason
from z3kit_recipes.bench.spec import (
    COMPILE_SCOPES, DEFAULT_BUDGET, DEFAULT_RUNTIMES, DEFAULT_STEPS, DEFAULT_WARMUP, DEFAULT_WORKLOADS,
    DEFAULT_ZERO_CONFIG, JSON, LR,
    MIN_COMPILE_WARMUP, RUNTIME_DESCRIPTIONS, RUNTIMES, RuntimeName,
)
from z3kit_recipes.launch import PYCACHE_DIR, use_bytecode_cache
from z3kit_recipes.models import TIE_MODES, WORKLOAD_NAMES


def thread_candidates(world: int, cores: int) -> tuple[int, ...]:
    """Threads per rank worth trying: 1, an even split of the cores, all cores."""
    return tuple(sorted({1, max(1, cores // world), max(1, cores)}))


def _parse_runtimes(text: str) -> list[RuntimeName]:
    if text == "all":
        return list(RUNTIMES)
    by_name: dict[str, RuntimeName] = {name: name for name in RUNTIMES}
    out: list[RuntimeName] = []
    for part in text.split(","):
        name = by_name.get(part.strip())
        if name is None:
            raise argparse.ArgumentTypeError(f"unknown runtime {part.strip()!r}; choose from {', '.join(RUNTIMES)}")
        out.append(name)
    return out


def _parse_threads(text: str) -> int | None:
    if text == "auto":
        return None
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("--threads must be 'auto' or >= 1")
    return n


def _parse_worlds(text: str) -> list[int]:
    try:
        worlds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world is a comma list of ints, got {text!r}") from None
    if any(w < 1 for w in worlds):
        raise argparse.ArgumentTypeError("--world sizes must be >= 1")
    return worlds


def _parse_mesh(text: str) -> MeshShape:
    try:
        return MeshShape.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_budget(text: str) -> int | float:
    """Bytes (an int) or a fraction of the model in (0, 1] (a float), checked as z3kit checks it."""
    try:
        budget: int | float = int(text)
    except ValueError:
        try:
            budget = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--budget is bytes or a fraction, got {text!r}") from None
    from z3kit_recipes.zero3 import Zero3Config

    try:
        Zero3Config(memory_budget=budget)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return budget


def _parse_zero_config(text: str) -> JSON:
    try:
        zero = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--zero-config is not JSON: {exc}") from None
    if not isinstance(zero, dict) or zero.get("stage", 3) != 3:
        raise argparse.ArgumentTypeError("--zero-config is a JSON object for ZeRO stage 3")
    zero = {"stage": 3, **zero}
    try:  # refuse what z3kit would refuse, before any process starts
        from z3kit_recipes.zero3 import Zero3Config

        Zero3Config.from_deepspeed({"zero_optimization": zero})
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return zero


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m z3kit_recipes.bench",
        description="Step time and per-rank memory of DDP, FSDP2, DeepSpeed ZeRO-3 and z3kit zero3 "
                    "on CPU/gloo.",
        epilog="runtimes: " + "; ".join(f"{k}: {v}" for k, v in RUNTIME_DESCRIPTIONS.items()),
    )
    p.add_argument("--workload", choices=[*WORKLOAD_NAMES, "all"], default="all",
                   help=f"'all' is {', '.join(DEFAULT_WORKLOADS)} (llama only when asked: it is slow)")
    p.add_argument("--world", type=_parse_worlds, default=[2],
                   help="ranks (local CPU processes, gloo); a comma list runs each size in turn")
    p.add_argument("--steps", type=int, default=None, help=f"measured steps (default {DEFAULT_STEPS})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed warm-up steps first (default {DEFAULT_WARMUP})")
    p.add_argument("--probe-steps", type=int, default=2,
                   help="untimed instrumented steps after the measured ones (collectives, peaks)")
    p.add_argument("--runtimes", type=_parse_runtimes, default=list(DEFAULT_RUNTIMES),
                   help="comma list of " + ",".join(RUNTIMES)
                   + ", or all (default: all available but z3kit-divergent and z3kit-muon)")
    p.add_argument("--threads", type=_parse_threads, default=None,
                   help="intra-op threads per rank, or 'auto' (default): fastest for DDP")
    p.add_argument("--tie-mode", choices=TIE_MODES, default="hf",
                   help="GPT's tied embedding: hf (lm_head module) or functional (F.linear)")
    p.add_argument("--trial-steps", type=int, default=8,
                   help="timed steps of each DDP thread-count trial under --threads auto")
    p.add_argument("--pycache-dir", default=PYCACHE_DIR,
                   help="bytecode cache (sys.pycache_prefix) for the spawned ranks' lazy imports "
                        "(default %(default)s); '' to leave the interpreter's setting alone")
    p.add_argument("--zero-config", type=_parse_zero_config, default=DEFAULT_ZERO_CONFIG,
                   help="JSON of the zero_optimization section given to DeepSpeed and z3kit alike "
                        f"(default: {json.dumps(DEFAULT_ZERO_CONFIG)}; '{{\"stage\": 3}}' for DeepSpeed's defaults)")
    p.add_argument("--budget", type=_parse_budget, default=DEFAULT_BUDGET,
                   help="z3kit-budget's memory_budget: a fraction in (0, 1] of the model, or bytes "
                        "as an int (default %(default)s)")
    p.add_argument("--compile", nargs="?", const="block", default="", choices=COMPILE_SCOPES,
                   help="torch.compile the same modules for every runtime: each of the workload's blocks "
                        "(block.compile(), the default) or the whole model (model.compile()); warm-up is "
                        f"at least {MIN_COMPILE_WARMUP} steps")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend under --compile (default %(default)s; aot_eager compiles faster)")
    p.add_argument("--mesh", type=_parse_mesh, default=None, metavar="RxS",
                   help="instead of the runtime table: flat ZeRO-3, HSDP, hpZ and FSDP2-HSDP on R nodes of S "
                        "gloo ranks (LOCAL_WORLD_SIZE=S), by bytes crossing nodes, step time and memory "
                        "(--workload: default gpt; --threads: default 1; --world and --runtimes are ignored)")
    add_overhead_options(p)
    add_long_run_options(p)
    p.add_argument("--out", "--json", type=Path, default=Path("runs/bench.json"),
                   help="JSON report path (--overhead: default runs/bench_overhead.json)")
    p.add_argument("--plot", action="store_true",
                   help="also write, next to --out, a PNG of step time against train peak memory "
                        "per (workload, world) (needs matplotlib)")
    return p


def _workload_note(name: str) -> str:
    """Why a workload cannot run here, or ""."""
    if name == "llama":
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            return f"transformers not importable ({exc}); pip install 'z3kit[cli]'"
    return ""


def _launch(label: str, spec_args: dict[str, Any]) -> JSON:
    """One run in fresh processes, with a line before and one after it."""
    from z3kit_recipes.bench.spawn import launch

    print(f"{label} ...", flush=True)
    result = launch(spec_args)
    if result["status"] != "ok":
        print(f"    failed after {result['wall_s']:.1f} s: {result['note']}", flush=True)
    elif "median_s" not in result:  # thread calibration
        print(f"    done in {result['wall_s']:.1f} s: median s/step by threads/rank "
              f"{result['threads_trials_median_s']} -> {result['threads']}", flush=True)
    else:
        print(f"    done in {result['wall_s']:.1f} s (setup {result['build_s']:.1f} s): "
              f"median {result['median_s']:.4f} s/step at {result['threads']} thread(s)/rank; "
              f"train peak {result['memory']['train_peak_x_model']:.2f}x model fp32", flush=True)
        plan = (result.get("engine_stats") or {}).get("memory_plan")
        if plan is not None:
            print(f"    {plan['describe']}", flush=True)
    return result


def _run_case(args: argparse.Namespace, wl_name: str, world: int, requested: list[RuntimeName],
              unavailable: dict[RuntimeName, str]) -> JSON:
    """Every requested runtime on one workload at one world size, DDP first."""
    steps = args.steps if args.steps is not None else DEFAULT_STEPS[wl_name]
    warmup = args.warmup if args.warmup is not None else DEFAULT_WARMUP[wl_name]
    if steps < 1 or warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.compile:
        warmup = max(warmup, MIN_COMPILE_WARMUP)
    common: dict[str, Any] = dict(
        workload=wl_name, tie_mode=args.tie_mode, world=world, steps=steps, warmup=warmup,
        probe_steps=max(1, args.probe_steps), trial_steps=min(steps, args.trial_steps),
        pycache_dir=args.pycache_dir, zero=args.zero_config, budget=args.budget,
        compile=args.compile, compile_backend=args.compile_backend,
    )
    case: JSON = {"workload": wl_name, "world": world, "steps": steps, "warmup": warmup, "runtimes": {}}
    prefix = f"[{wl_name}, world {world}]"

    cands = (args.threads,) if args.threads is not None else thread_candidates(world, os.cpu_count() or 1)
    threads = cands[0]
    if len(cands) > 1:
        label = f"{prefix} ddp: threads/rank calibration ({', '.join(map(str, cands))})"
        calibration = _launch(label, dict(common, runtime="ddp", threads=cands))
        if calibration["status"] == "ok":
            threads = calibration["threads"]
            case["ddp_threads_calibration"] = calibration["threads_trials_median_s"]
            case["ddp_threads_stopped_early"] = calibration["threads_trials_stopped_early"]
            case["ddp_threads_trial_steps"] = calibration["threads_trial_steps"]
    case["threads"] = threads

    for rt in requested:
        if unavailable[rt]:
            case["runtimes"][rt] = {"status": "skipped", "note": unavailable[rt]}
            continue
        case["runtimes"][rt] = _launch(f"{prefix} {rt} (threads/rank: {threads})",
                                       dict(common, runtime=rt, threads=(threads,)))
    ok = [r for r in case["runtimes"].values() if r["status"] == "ok"]
    if ok:
        case["total_params"] = ok[0]["total_params"]
    compare_to_ddp(case)
    return case


def run(args: argparse.Namespace) -> JSON:
    """Every (workload, world) case; the report."""
    cores = os.cpu_count() or 1
    # DDP first: the baseline of every ratio (and the thread choice) needs it
    requested: list[RuntimeName] = list(dict.fromkeys(["ddp", *args.runtimes]))
    unavailable = {rt: unavailable_reason(rt) for rt in requested}
    for rt in requested:
        if unavailable[rt]:
            print(f"note: skipping {rt}: {unavailable[rt]}", flush=True)
    workloads = list(DEFAULT_WORKLOADS) if args.workload == "all" else [args.workload]
    ds_version = version("deepspeed") if "deepspeed" in requested and not unavailable["deepspeed"] else None
    report: JSON = {
        "meta": {
            "worlds": args.world, "cpu_count": cores, "torch": torch.__version__, "deepspeed": ds_version,
            "python": sys.version.split()[0], "lr": LR, "dtype": "float32", "tie_mode": args.tie_mode,
            "probe_steps": args.probe_steps, "zero_optimization": args.zero_config,
            "memory_budget": args.budget, "runtimes": {rt: RUNTIME_DESCRIPTIONS[rt] for rt in requested},
            "compile": args.compile or None, "compile_backend": args.compile_backend if args.compile else None,
        },
        "cases": [],
        "skipped_workloads": {},
    }
    if ds_version:
        from z3kit_recipes.bench.runners.deepspeed_zero3 import deepspeed_config

        report["meta"]["deepspeed_config"] = deepspeed_config(0, 0, args.zero_config)
    load = os.getloadavg()[0]
    report["meta"]["loadavg_1min_start"] = load
    if load > 0.5:
        print(f"note: 1-min load average is {load:.1f} on {cores} cores before the first run; "
              "other processes compete for the CPUs and the timings will show it", flush=True)
    t_all = time.perf_counter()
    for wl_name in workloads:
        note = _workload_note(wl_name)
        if note:
            print(f"note: skipping workload {wl_name}: {note}", flush=True)
            report["skipped_workloads"][wl_name] = note
            continue
        for world in args.world:
            report["cases"].append(_run_case(args, wl_name, world, requested, unavailable))
    report["meta"]["total_wall_s"] = time.perf_counter() - t_all
    report["meta"]["loadavg_1min_end"] = os.getloadavg()[0]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    use_bytecode_cache(args.pycache_dir)
    if args.overhead:  # host overhead per step over plain torch, in place of the runtime table
        from z3kit_recipes.bench.overhead_cli import main_overhead

        return main_overhead(args)
    if args.long_run:  # each rank's resident set over a long run, in place of the runtime table
        from z3kit_recipes.bench.long_run import main_long_run

        return main_long_run(args)
    if args.mesh is not None:  # the layouts' comparison in place of the runtime table
        from z3kit_recipes.bench.mesh import main_mesh

        return main_mesh(args)
    report = run(args)
    print()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(render_table(report))
    for name, note in report["skipped_workloads"].items():
        print(f"workload {name} skipped: {note}")
    if args.plot:
        from z3kit_recipes.bench.plot import write_plots

        for path in write_plots(report, args.out):
            print(f"plot written to {path}")
    meta = report["meta"]
    print(
        f"total {meta['total_wall_s']:.1f} s; 1-min load average {meta['loadavg_1min_start']:.1f} "
        f"at the start, {meta['loadavg_1min_end']:.1f} at the end; report written to {args.out}"
    )
    return 0

