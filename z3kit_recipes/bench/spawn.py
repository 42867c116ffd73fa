"""Start one run: ``world`` fresh rank processes, their result back as JSON.

Each (workload, runtime, world) run gets its own freshly spawned process
group (``torch.multiprocessing.spawn``), so no runtime leaves hooks, patches,
warmed caches or heap behind for the next one. The ranks unpickle
``z3kit_recipes.bench.measure.worker`` from its module, never from
``__main__``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from z3kit_recipes.bench.measure import worker
from z3kit_recipes.bench.rss import malloc_returns_freed_memory
from z3kit_recipes.bench.spec import JSON, RunSpec
from z3kit_recipes.launch import free_port

# torch's stubs leave spawn untyped; bind it once with the type used here.
_spawn: Callable[..., Any] = getattr(mp, "spawn")


@contextlib.contextmanager
def _omp_threads(threads: int) -> Iterator[None]:
    """``OMP_NUM_THREADS`` for the spawned ranks, restored afterwards."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def launch(spec_args: dict[str, Any]) -> JSON:
    """Spawn the ranks of one run; its result, or an error result (``status``, ``note``)."""
    fd, out_path = tempfile.mkstemp(prefix="z3bench-", suffix=".json")
    os.close(fd)
    spec = RunSpec(port=free_port(), out_path=out_path, **spec_args)
    return spawn_ranks(worker, spec, nprocs=spec.world, threads=spec.threads[0], out_path=out_path)


def spawn_ranks(rank_main: Callable[[int, Any], None], spec: Any, *, nprocs: int, threads: int,
                out_path: str, for_rss: bool = True) -> JSON:
    """``rank_main(rank, spec)`` on ``nprocs`` fresh processes, ``threads`` intra-op threads
    each and, ``for_rss``, glibc returning freed memory (so that the resident set is
    what is held; every large allocation is then a fresh mapping, whose page faults
    a timing would count); the JSON that rank 0 wrote to ``out_path`` (removed
    after), or an error result (``status``, ``note``). ``wall_s`` is added."""
    t0 = time.perf_counter()
    try:
        with _omp_threads(threads), malloc_returns_freed_memory() if for_rss else contextlib.nullcontext():
            _spawn(rank_main, args=(spec,), nprocs=nprocs, join=True)
        result: JSON = json.loads(Path(out_path).read_text())
    except Exception as exc:  # noqa: BLE001 - one runtime failing must not stop the rest
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        result = {"status": "error", "note": lines[-1] if lines else repr(exc), "error": str(exc)}
    finally:
        Path(out_path).unlink(missing_ok=True)
    result["wall_s"] = time.perf_counter() - t0
    return result
