"""Benchmark: step time and per-rank memory of DDP, FSDP2, DeepSpeed ZeRO-3 and z3kit zero3.

    python -m z3kit_recipes.bench [--workload tiny|gpt|llama|all] [--world N[,N...]]
        [--steps N] [--warmup N]
        [--runtimes ddp,fsdp2,fsdp2-noreshard,deepspeed,z3kit,z3kit-budget,z3kit-divergent,fsdp_blocks,z3kit-muon]
        [--budget FRACTION|BYTES] [--threads auto|N] [--trial-steps N] [--probe-steps N]
        [--tie-mode hf|functional] [--zero-config JSON] [--pycache-dir DIR]
        [--out bench.json] [--plot]
    python -m z3kit_recipes.bench --mesh RxS [--workload tiny|gpt|llama] [--steps N] [--warmup N]
    python -m z3kit_recipes.bench --long-run [--steps 2000] [--warmup 300] [--sample-every 50]

Every runtime trains the same workload (:mod:`z3kit_recipes.models`): the same
seeded initial weights on every rank, the same per-rank data (seeded by rank
and step), Adam (lr 1e-3) in fp32, on ``--world`` local CPU processes over
gloo, each run in freshly spawned processes. Step time and memory are
measured in the same run, memory the same way for every runtime (see
``measure`` and ``rss``); the report compares each runtime with DDP.

Threads: with ``--threads auto`` (default), DDP first runs a short trial
(``--trial-steps``) at each candidate number of intra-op threads per rank
(1, cores // world, cores; a candidate 3x slower than the best so far is
stopped early), then the full measurement at the fastest; every other
runtime of that workload uses the same number. On 2 cores with 2 ranks, 1
thread per rank wins by far: 2 threads per rank oversubscribe the cores.

Spawned ranks cache bytecode under ``--pycache-dir`` (see
``z3kit_recipes.launch.use_bytecode_cache``), so that the heavy lazy imports
are compiled once rather than in every rank of every run when
``PYTHONDONTWRITEBYTECODE`` is set. DeepSpeed (and, for ``llama``,
transformers) are optional: skipped with a note when not importable.

Modules: ``cli`` (options, run driver), ``spawn`` (one run's processes),
``measure`` (what a rank does and measures), ``rss`` (memory probe),
``collectives`` (profiler count of collectives), ``runners`` (one module
per runtime family), ``report`` (comparison with DDP, table), ``plot``.
``--mesh RxS`` (flat ZeRO-3, HSDP, hpZ and FSDP2-HSDP on R "nodes" of S
ranks, by bytes crossing nodes): ``mesh`` (driver, table), ``mesh_spec``
(mesh, layouts, bounds), ``mesh_rank`` (what a rank does), ``mesh_checks``
(the targets), ``link_count`` (bytes per link from the c10d operators).
``--long-run`` (each rank's resident set over a long run, DDP against z3kit,
under glibc's default malloc settings): ``long_run``.
"""

from z3kit_recipes.bench.cli import build_parser, main, run
from z3kit_recipes.bench.report import render_table

__all__ = ["build_parser", "main", "render_table", "run"]
