"""``python -m z3kit_recipes.bench --mesh RxS``: flat ZeRO-3, HSDP, hpZ and
FSDP2-HSDP on R "nodes" of S gloo ranks, compared by what crosses nodes.

Each layout runs in its own freshly spawned R*S ranks (``mesh_rank``) with
``LOCAL_WORLD_SIZE=S``; the report holds, per layout, inter- and
intra-node bytes received per rank and step (z3kit's ``engine.stats().link_bytes``;
FSDP2's counted from the c10d operators it dispatches, ``link_count``, under
the same direct-exchange model of ``z3kit.links``), step time, peak and
resident memory, and the resident bytes the runtime holds against the
analytic bound (``mesh_spec.resident_bound_bytes``). Then the issue's
targets are checked (``mesh_checks``). A layout this torch cannot run
(FSDP2's HSDP on gloo before gloo took ``ReduceOp.AVG``) is reported as
unavailable, with why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Final

import torch

from z3kit_recipes.bench.mesh_checks import check_targets, render_checks
from z3kit_recipes.bench.mesh_spec import (
    LAYOUT_DESCRIPTIONS, LAYOUTS, MESH_ZERO_CONFIG, LayoutName, MeshRunSpec, MeshShape, resident_bound_bytes,
)
from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG, JSON
from z3kit_recipes.launch import free_port

#: measured and warm-up steps per layout unless asked (4+ ranks share the cores: keep it short)
MESH_STEPS: Final = 5
MESH_WARMUP: Final = 2
#: ledger over bound above this is flagged (the issue's 1.1x)
BOUND_TOLERANCE: Final = 1.1


def _spawn_layouts(shape: MeshShape, layouts: tuple[LayoutName, ...], *, workload: str, steps: int, warmup: int,
                   threads: int, zero: JSON, pycache_dir: str) -> JSON:
    from z3kit_recipes.bench.mesh_rank import mesh_worker
    from z3kit_recipes.bench.spawn import spawn_ranks

    fd, out_path = tempfile.mkstemp(prefix="z3bench-mesh-", suffix=".json")
    os.close(fd)
    spec = MeshRunSpec(mesh=shape, layouts=layouts, workload=workload, steps=steps, warmup=warmup,
                       threads=threads, zero=zero, pycache_dir=pycache_dir, port=free_port(), out_path=out_path)
    return spawn_ranks(mesh_worker, spec, nprocs=shape.world, threads=threads, out_path=out_path)


def run_mesh(shape: MeshShape, *, workload: str, steps: int = MESH_STEPS, warmup: int = MESH_WARMUP,
             threads: int = 1, zero: JSON = MESH_ZERO_CONFIG, pycache_dir: str = "", layouts: Sequence[LayoutName] = LAYOUTS,
             fresh_processes: bool = True) -> JSON:
    """Every layout at ``shape``; the report. ``fresh_processes=False`` runs them all in
    one spawn, in turn (faster to start; each layout's memory is still taken above its
    own baseline, but a layout can inherit the heap its predecessor left)."""
    batches = [(layout,) for layout in layouts] if fresh_processes else [tuple(layouts)]
    results: dict[str, JSON] = {}
    load = os.getloadavg()[0]
    t_all = time.perf_counter()
    for batch in batches:
        print(f"[mesh {shape}, {workload}] {', '.join(batch)} ...", flush=True)
        out = _spawn_layouts(shape, batch, workload=workload, steps=steps, warmup=warmup, threads=threads,
                             zero=zero, pycache_dir=pycache_dir)
        if out["status"] != "ok":
            print(f"    failed after {out['wall_s']:.1f} s: {out['note']}", flush=True)
            results.update({layout: {"status": "error", "note": out["note"], "error": out.get("error")}
                            for layout in batch})
            continue
        print(f"    done in {out['wall_s']:.1f} s", flush=True)
        for layout, result in out["layouts"].items():
            results[layout] = {**result, "wall_s": out["wall_s"] if fresh_processes else None}
    for layout in layouts:
        result = results.get(layout, {"status": "not run"})
        if result["status"] == "ok":
            bound = resident_bound_bytes(layout, result["total_params"], shape)
            result["resident_bound_bytes"] = bound
            result["ledger_over_bound"] = result["ledger_resident_bytes"] / bound
    report: JSON = {
        "meta": {"mesh": str(shape), "replicas": shape.replicas, "shard_size": shape.shard_size,
                 "world": shape.world, "workload": workload, "steps": steps, "warmup": warmup,
                 "threads_per_rank": threads, "fresh_processes_per_layout": fresh_processes,
                 "zero_optimization": zero, "torch": torch.__version__, "python": sys.version.split()[0],
                 "cpu_count": os.cpu_count(), "dtype": "float32", "optimizer": "torch.optim.Adam",
                 "layouts": {layout: LAYOUT_DESCRIPTIONS[layout] for layout in layouts},
                 "bytes": "received by one rank per optimizer step, mean over ranks, direct-exchange "
                          "model of z3kit.links; nodes of S ranks (LOCAL_WORLD_SIZE=S)",
                 "loadavg_1min_start": load},
        "layouts": {layout: results[layout] for layout in layouts if layout in results},
    }
    report["checks"] = check_targets(report, shape, tolerance=BOUND_TOLERANCE)
    report["meta"]["total_wall_s"] = time.perf_counter() - t_all
    report["meta"]["loadavg_1min_end"] = os.getloadavg()[0]
    return report


def _size(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _vs(x: float, base: float | None) -> str:
    return "n/a" if not base else f"{x / base:.2f}x"


def render_mesh_table(report: JSON) -> str:
    """The Markdown table of ``report`` and its checks."""
    meta = report["meta"]
    flat = report["layouts"].get("flat", {})
    flat_ok = flat.get("status") == "ok"
    base_inter = flat["inter_node_bytes_per_step"] if flat_ok else None
    base_time = flat["median_s"] if flat_ok else None
    lines = [
        f"mesh {meta['mesh']} ({meta['replicas']} nodes x {meta['shard_size']} ranks, gloo), workload "
        f"{meta['workload']}, {meta['steps']} measured steps after {meta['warmup']}; bytes received per rank "
        "and step; memory per rank (max over ranks) above its baseline",
        "",
        "| layout | inter-node/step | vs flat | intra-node/step | s/step | vs flat | peak RSS | resident RSS "
        "| resident (ledger) | bound | ledger/bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for layout, r in report["layouts"].items():
        if r["status"] != "ok":
            lines.append(f"| {layout} | {r['status']}: {r['note']} |" + " |" * 10)
            continue
        inter = r["inter_node_bytes_per_step"]
        analytic = "" if r["link_method"].startswith("engine") else " (counted)"
        flag = " (> 1.1x)" if r["ledger_over_bound"] > BOUND_TOLERANCE else ""
        lines.append(
            f"| {layout} | {_size(inter)}{analytic} | {_vs(inter, base_inter)} | {_size(r['intra_node_bytes_per_step'])} "
            f"| {r['median_s']:.3f} | {_vs(r['median_s'], base_time)} | {_size(r['memory']['train_peak'])} "
            f"| {_size(r['memory']['resident_after_step'])} | {_size(r['ledger_resident_bytes'])} "
            f"| {_size(r['resident_bound_bytes'])} | {r['ledger_over_bound']:.3f}{flag} |"
        )
    return "\n".join([*lines, "", *render_checks(report["checks"])])


def main_mesh(args: argparse.Namespace) -> int:
    """``--mesh RxS`` from the bench's parsed command line: run, write ``--out``, print."""
    steps = MESH_STEPS if args.steps is None else args.steps
    warmup = MESH_WARMUP if args.warmup is None else args.warmup
    if steps < 1 or warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    zero = MESH_ZERO_CONFIG if args.zero_config is DEFAULT_ZERO_CONFIG else args.zero_config  # not given
    report = run_mesh(args.mesh, workload="gpt" if args.workload == "all" else args.workload, steps=steps,
                      warmup=warmup, threads=args.threads or 1, zero=zero, pycache_dir=args.pycache_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print()
    print(render_mesh_table(report))
    print(f"total {report['meta']['total_wall_s']:.1f} s; 1-min load average {report['meta']['loadavg_1min_start']:.1f} "
          f"at the start, {report['meta']['loadavg_1min_end']:.1f} at the end; report written to {args.out}")
    return 0
