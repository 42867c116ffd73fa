"""The report: each run compared with DDP, and the on-screen table.

A report is JSON: ``meta`` and a list of ``cases``, one per (workload,
world), each with its runs by runtime name (``"status"``: ok, error or
skipped).
"""

from __future__ import annotations

import math
from typing import Final

from z3kit_recipes.bench.spec import JSON

MiB: Final = 1 << 20
#: memory phases compared with DDP (see ``z3kit_recipes.bench.measure``)
COMPARED_PHASES: Final = ("init_peak", "train_peak", "resident_after_step")
_SHORT_KINDS: Final = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


def compare_to_ddp(case: JSON) -> None:
    """Add to every successful run its ratios to DDP's: step time, memory, loss difference."""
    base = case["runtimes"].get("ddp")
    if base is None or base["status"] != "ok":
        return
    for r in case["runtimes"].values():
        if r["status"] != "ok":
            continue
        r["ratio_vs_ddp"] = r["median_s"] / base["median_s"]
        for phase in COMPARED_PHASES:
            ours, theirs = r["memory"][f"{phase}_bytes"], base["memory"][f"{phase}_bytes"]
            r["memory"][f"{phase}_vs_ddp"] = ours / theirs if theirs > 0 else None
        diffs = [abs(a - b) for a, b in zip(r["losses"], base["losses"])]
        r["loss_max_abs_diff_vs_ddp"] = max(diffs) if diffs else None
        if any(math.isnan(v) for v in r["losses"]):
            r["loss_max_abs_diff_vs_ddp"] = float("nan")


def _int(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _collectives(c: dict[str, int] | None) -> str:
    if c is None:
        return "n/a"
    if not c:
        return "0"
    return f"{sum(c.values())} (" + " ".join(f"{_SHORT_KINDS.get(k, k)}:{v}" for k, v in c.items()) + ")"


_HEADER: Final = (
    f"{'runtime':<15} {'thr':>3} {'median s':>8} {'min s':>8} {'vs DDP':>7} "
    f"{'init':>6} {'train':>6} {'resid.':>6} {'train MiB':>9} {'train/DDP':>9} {'resid/DDP':>9} "
    f"{'live params':>11} {'max|dloss|':>10}  collectives/step"
)


def _row(name: str, r: JSON) -> str:
    if r["status"] != "ok":
        return f"{name:<15} {r['status']}: {r.get('note', '')}"
    mem = r["memory"]
    dloss = r.get("loss_max_abs_diff_vs_ddp")
    coll = r.get("engine_collectives_per_step", r.get("collectives_per_step"))
    coll_txt = _collectives(coll)
    if "engine_collectives_per_step" in r and coll != r.get("collectives_per_step"):
        coll_txt += f" [profiler: {_collectives(r.get('collectives_per_step'))}]"
    return (
        f"{name:<15} {r['threads']:>3} {r['median_s']:>8.4f} {r['min_s']:>8.4f} {_ratio(r.get('ratio_vs_ddp')):>7} "
        f"{mem['init_peak_x_model']:>6.2f} {mem['train_peak_x_model']:>6.2f} "
        f"{mem['resident_after_step_x_model']:>6.2f} {mem['train_peak_bytes'] / MiB:>9.1f} "
        f"{_ratio(mem.get('train_peak_vs_ddp')):>9} {_ratio(mem.get('resident_after_step_vs_ddp')):>9} "
        f"{_int(r.get('peak_live_params')):>11} {'n/a' if dloss is None else f'{dloss:.2e}':>10}  {coll_txt}"
    )


def _compile_lines(case: JSON, meta: JSON) -> list[str]:
    """Under ``--compile``: each runtime's warm-up (compiling) time, and z3kit's own compile figures."""
    if not meta.get("compile"):
        return []
    warm = ", ".join(
        f"{name} {sum(r['warmup_times_s']):.1f}"
        for name, r in case["runtimes"].items() if r["status"] == "ok" and r.get("warmup_times_s")
    )
    lines = [f"  compiled: {meta['compile']} ({meta.get('compile_backend')}); warm-up steps' seconds "
             f"(compiling included): {warm}"]
    for name, r in case["runtimes"].items():
        figures = (r.get("engine_stats") or {}).get("compile") if r["status"] == "ok" else None
        if figures is not None:
            last, total = figures["last_step"], figures["total"]
            lines.append(
                f"  {name}: {len(figures['units'])} compiled blocks gathered as units"
                f"{', whole model compiled' if figures['whole_model'] else ''}; {figures['eager_forwards']} eager "
                f"forward(s); graphs compiled {total['graphs']}, graph breaks {total['graph_breaks']}; "
                f"last step: {last['graphs']} new graphs, {last['recompiles']} recompiles"
            )
    return lines


def _muon_lines(case: JSON) -> list[str]:
    """With z3kit-muon: its Muon figures, and every z3kit runtime's bytes per step (the engine log's
    collectives, plus Muon's two all-to-alls), side by side."""
    ok = {name: r for name, r in case["runtimes"].items() if r["status"] == "ok" and r.get("engine_stats")}
    muon = (ok.get("z3kit-muon") or {}).get("engine_stats", {}).get("muon")
    if muon is None:
        return []
    kinds = list(muon["optimizer_of"].values())
    lines = [f"  z3kit-muon: Muon on {kinds.count('muon')} matrices, Adam on {kinds.count('adamw')} parameters; "
             f"Muon's last step on rank 0: {1000 * muon['seconds']:.1f} ms, sent {muon['bytes_sent'] / MiB:.2f} MiB, "
             f"received {muon['bytes_received'] / MiB:.2f} MiB"]
    sizes = []
    for name, r in ok.items():
        stats = r["engine_stats"]
        engine = sum(c.get("bytes", 0) for c in stats.get("collectives", {}).values()) / MiB
        extra = stats.get("muon") or {}
        sizes.append(f"{name} {engine:.2f}" + (f" + {extra['bytes_sent'] / MiB:.2f} (Muon)" if extra else ""))
    lines.append(f"  bytes per step, MiB (rank 0; the engine log's collectives, plus Muon's sent): {', '.join(sizes)}")
    return lines


def _case_title(case: JSON) -> str:
    params = case.get("total_params")
    size = "" if params is None else f": {params:,} parameters, {4 * params / MiB:.1f} MiB in fp32"
    return f"{case['workload']}, world {case['world']}{size} ({case['steps']} steps after {case['warmup']} warm-up)"


def _calibration(case: JSON) -> str | None:
    cal = case.get("ddp_threads_calibration")
    if not cal:
        return None
    stopped = case.get("ddp_threads_stopped_early", [])
    trials = ", ".join(f"{t}: {s:.4f}" + (" (stopped: >3x slower)" if int(t) in stopped else "")
                       for t, s in cal.items())
    steps = case.get("ddp_threads_trial_steps")
    return f"  DDP threads/rank calibration (median s/step): {trials} ({steps} steps each) " \
           f"-> {case['threads']} for every runtime"


LEGEND: Final = (
    "median s: slowest rank per step, median over the measured steps (warm-up excluded);",
    "  min s: the fastest such step (less sensitive to other load on the machine).",
    "init / train / resid.: memory per rank above its baseline (max over ranks), in units of",
    "  the model's fp32 size (4 bytes x parameters): peak while building and wrapping; peak over",
    "  the training steps; held after the last step. CPU: process resident set (VmRSS/VmHWM)",
    "  with glibc returning freed memory; train MiB: the train peak in MiB.",
    "live params: peak gathered parameter elements on a rank; DDP: its full replica;",
    "  FSDP2/DeepSpeed: sampled at every gather (JSON: *_method); z3kit: engine.stats().",
    "collectives/step: z3kit from its engine log; others: c10d ops seen by torch.profiler",
    "  (AG all-gather, RS reduce-scatter, AR all-reduce, BC broadcast).",
    "max|dloss|: largest difference from DDP's rank-averaged loss over all steps.",
)


def render_table(report: JSON) -> str:
    """The on-screen table for a finished report: one block per (workload, world)."""
    lines: list[str] = []
    for case in report["cases"]:
        lines += [_case_title(case), _HEADER, "-" * len(_HEADER)]
        lines += [_row(name, r) for name, r in case["runtimes"].items()]
        for name, r in case["runtimes"].items():
            plan = (r.get("engine_stats") or {}).get("memory_plan") if r["status"] == "ok" else None
            if plan is not None:
                lines.append(f"  {name}: {plan['describe']}")
        calibration = _calibration(case)
        if calibration is not None:
            lines.append(calibration)
        lines += _compile_lines(case, report.get("meta", {}))
        lines += _muon_lines(case)
        lines.append("")
    lines += LEGEND
    return "\n".join(lines)
