"""GPU check: the first command to run on a machine with a GPU.

    python -m z3kit_recipes.bench.gpu [--world N] [--out runs/gpu_check.json]
    python -m z3kit_recipes.bench.gpu --dry-run [--world 2]

On one GPU per rank (nccl), for the bench's GPT and a Hugging Face Llama
built from a config, in fp32 and bf16 compute:

1. parity: the stock engine (``zero3.initialize``) against plain
   single-device training of the same model on the same data
   (``bench.gpu_parity``): each step's relative loss difference and the
   parameters after the last step, pass or fail against a tolerance;
2. host syncs per training step in the engine's forward, backward and step
   (``z3kit.host_sync.HostSyncCounter``; expected 0), and which calls
   synchronized (``bench.gpu_probes``);
3. memory per phase (forward, backward, step): the allocator's peak next to
   what the engine's ``MemoryLedger`` held of each kind (``bench.gpu_probes``);
4. at world 1, a Llama of about 1.1B parameters in bf16, sequence 2048
   (``bench.gpu_large``): tokens/s and MFU of plain torch, FSDP2 and z3kit,
   and whether the host stays ahead of the device;
5. step time of z3kit against FSDP2 (``fully_shard``), as a ratio, in fp32
   (``bench.gpu_timing``); at world 1 also Muon (``z3kit.sharded_muon``)
   against Adam;
6. with 2 or more GPUs, all of it again at world 2, timed against DeepSpeed
   ZeRO-3 too when it is importable; otherwise the report says why not.

Each world runs in freshly spawned processes (``bench.gpu_rank``); a section
that raises is reported and the next one runs. The report is printed and
written as JSON (``--out``). The exit status is 1 if a parity check failed,
a section raised or a world did not finish, else 0.

``--dry-run`` runs the same on CPU over gloo with tiny models and few steps,
so that CI keeps the command working; timing and memory figures are then
reported but not meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import torch

from z3kit_recipes.bench.gpu_large import LARGE_LLAMA
from z3kit_recipes.bench.gpu_rank import CheckSpec, Sizes, rank_main
from z3kit_recipes.bench.gpu_report import failures, render
from z3kit_recipes.bench.rss import malloc_returns_freed_memory
from z3kit_recipes.bench.spec import JSON
from z3kit_recipes.launch import PYCACHE_DIR, environment, free_port, use_bytecode_cache
from z3kit_recipes.models import LLAMA_CONFIG, GPTConfig

# torch's stubs leave spawn untyped; bind it once with the type used here.
_spawn: Callable[..., Any] = getattr(torch.multiprocessing, "spawn")

#: on a GPU: the bench's own workloads (GPT 4096 vocab, width 256, 8 blocks; Llama 75.5M)
GPU_SIZES: Final = Sizes(gpt=GPTConfig(), gpt_batch=4, llama=dict(LLAMA_CONFIG), llama_batch=4, llama_seq=64,
                         parity_steps=10, warmup=3, sync_steps=5, timing_steps=20,
                         large=dict(LARGE_LLAMA), large_batch=8, large_seq=2048)
#: a dry run: models of a few thousand parameters, a handful of steps
DRY_RUN_SIZES: Final = Sizes(
    gpt=GPTConfig(vocab_size=128, width=32, n_layer=2, n_head=2, seq_len=16), gpt_batch=2,
    llama={**LLAMA_CONFIG, "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32},
    llama_batch=2, llama_seq=16, parity_steps=3, warmup=1, sync_steps=2, timing_steps=3,
    large={**LARGE_LLAMA, "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32},
    large_batch=2, large_seq=16,
)
#: seconds a world may take before its ranks are killed (a hang must not outlive the check)
DEFAULT_TIME_LIMIT_S: Final = {"cuda": 480.0, "cpu": 240.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m z3kit_recipes.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU and gloo, tiny models, few steps (for CI)")
    p.add_argument("--world", type=int, default=None,
                   help="run this world size only (default: 1, then 2 when there are 2 or more GPUs)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default runs/gpu_check.json, runs/gpu_check_dry_run.json with --dry-run)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds per world before its ranks are killed (default 480 on GPU, 240 dry run)")
    return p


def launch(spec_args: dict[str, Any], limit_s: float) -> JSON:
    """One world in freshly spawned ranks; its result, or why there is none."""
    fd, out_path = tempfile.mkstemp(prefix="z3kit-gpu-check-", suffix=".json")
    os.close(fd)
    spec = CheckSpec(port=free_port(), out_path=out_path, **spec_args)
    t0 = time.perf_counter()
    try:
        with environment({"OMP_NUM_THREADS": str(spec.threads)}), malloc_returns_freed_memory():
            ctx = _spawn(rank_main, args=(spec,), nprocs=spec.world, join=False)
            deadline = time.monotonic() + limit_s
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        if proc.is_alive():
                            proc.kill()
                    raise TimeoutError(f"world {spec.world} did not finish within {limit_s:.0f} s: its ranks were killed")
        result: JSON = json.loads(Path(out_path).read_text())
    except Exception as exc:  # noqa: BLE001 - one world failing must not lose the other's report
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        result = {"status": "error", "error": lines[-1] if lines else repr(exc), "detail": str(exc)[-4000:]}
    finally:
        Path(out_path).unlink(missing_ok=True)
    result["wall_s"] = time.perf_counter() - t0
    return result


def plan_worlds(dry_run: bool, world: int | None, gpus: int) -> dict[int, str]:
    """World size -> "" to run it, or why it is skipped."""
    if world is not None:
        if world < 1:
            raise SystemExit(f"--world must be at least 1, got {world}")
        plan = {w: f"--world {world}: world {world} only" for w in (1, 2) if w != world}
        if not dry_run and gpus < world:
            plan[world] = f"{gpus} CUDA device(s): world {world} needs one GPU per rank"
        else:
            plan[world] = ""
        return plan
    if dry_run:
        return {1: "", 2: "the dry run runs world 1 unless --world 2 is given"}
    return {1: "", 2: "" if gpus >= 2 else f"{gpus} CUDA device: world 2 needs 2 GPUs, one per rank"}


def main(argv: Sequence[str] | None = None) -> int:
    use_bytecode_cache()
    args = build_parser().parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: the GPU check needs one (run with --dry-run to check the command on CPU)",
              file=sys.stderr)
        return 2
    device_type = "cpu" if args.dry_run else "cuda"
    gpus = 0 if args.dry_run else torch.cuda.device_count()
    out: Path = args.out or Path("runs/gpu_check_dry_run.json" if args.dry_run else "runs/gpu_check.json")
    limit = args.time_limit or DEFAULT_TIME_LIMIT_S[device_type]
    # one intra-op thread per rank in a dry run: the tiny models gain nothing from more, and
    # OpenMP threads spinning on cores that other jobs share make a step take seconds
    cores = 1 if args.dry_run else os.cpu_count() or 1
    t0 = time.perf_counter()
    report: JSON = {
        "command": " ".join(["python -m z3kit_recipes.bench.gpu", *(argv if argv is not None else sys.argv[1:])]),
        "dry_run": args.dry_run,
        "device": "CPU (dry run, gloo)" if args.dry_run else f"{gpus} x {torch.cuda.get_device_name(0)} (nccl)",
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "meaningful_timing_and_memory": not args.dry_run,
        "worlds": {},
    }
    for world, skip in sorted(plan_worlds(args.dry_run, args.world, gpus).items()):
        if skip:
            report["worlds"][str(world)] = {"status": "skipped", "reason": skip}
            continue
        sizes = DRY_RUN_SIZES if args.dry_run else GPU_SIZES
        report["worlds"][str(world)] = launch(
            {"world": world, "device_type": device_type, "sizes": sizes, "threads": max(1, cores // world),
             "timeout_s": limit, "pycache_dir": PYCACHE_DIR}, limit)
    report["wall_s"] = time.perf_counter() - t0
    report["failures"] = failures(report)
    report["exit_code"] = 1 if report["failures"] else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"report: {out}")
    return int(report["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
