"""The benchmark command ``python -m z3kit_recipes.bench``: its memory probe,
its report and plot, and one short end-to-end run on 2 spawned gloo ranks."""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from z3kit_recipes.bench import report as bench_report
from z3kit_recipes.bench.cli import build_parser
from z3kit_recipes.bench.rss import GLIBC_MALLOC_ENV, ResidentSetProbe, clear_refs_writable, malloc_returns_freed_memory

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- #
# Memory probe
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.skipif(not clear_refs_writable(), reason="/proc/self/clear_refs is not writable")
def test_resident_set_probe_sees_a_64mib_tensor_and_resets_its_peak() -> None:
    probe = ResidentSetProbe()
    assert probe.can_reset
    gc.collect()
    before = probe.current()
    probe.reset_peak()
    t = torch.empty(64 * MiB, dtype=torch.uint8)
    t.fill_(1)  # touch every page: only touched pages are resident
    assert probe.peak() - before > 48 * MiB
    assert probe.current() - before > 48 * MiB
    del t
    gc.collect()
    # A 64 MiB block is mmap-ed by glibc whatever the thresholds, so freeing it unmaps it.
    assert probe.current() - before < 16 * MiB
    probe.reset_peak()
    assert probe.peak() - before < 16 * MiB


def test_malloc_settings_are_set_for_children_and_restored() -> None:
    saved = {k: os.environ.get(k) for k in GLIBC_MALLOC_ENV}
    with malloc_returns_freed_memory():
        assert all(os.environ[k] == v for k, v in GLIBC_MALLOC_ENV.items())
    assert {k: os.environ.get(k) for k in GLIBC_MALLOC_ENV} == saved


# --------------------------------------------------------------------------- #
# Options
# --------------------------------------------------------------------------- #


def test_options_accept_the_new_runtimes_worlds_and_budgets() -> None:
    args = build_parser().parse_args(
        ["--runtimes", "ddp,fsdp2-noreshard,z3kit-budget", "--world", "2,4", "--budget", "0.25",
         "--workload", "llama"]
    )
    assert args.runtimes == ["ddp", "fsdp2-noreshard", "z3kit-budget"]
    assert args.world == [2, 4]
    assert args.budget == 0.25 and isinstance(args.budget, float)
    assert build_parser().parse_args(["--budget", "1048576"]).budget == 1048576
    for bad in (["--runtimes", "fsdp3"], ["--budget", "1.5"], ["--budget", "0"], ["--world", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_compile_option_names_the_scope_and_backend() -> None:
    parse = build_parser().parse_args
    assert parse([]).compile == ""
    assert parse(["--compile"]).compile == "block"
    args = parse(["--compile", "model", "--compile-backend", "aot_eager"])
    assert (args.compile, args.compile_backend) == ("model", "aot_eager")
    with pytest.raises(SystemExit):
        parse(["--compile", "layers"])


def test_compile_spec_compiles_the_workloads_blocks_or_the_model() -> None:
    from z3kit_recipes.bench.runners import CompileSpec
    from z3kit_recipes.models import TinyWorkload
    from z3kit.dynamo import is_compiled

    wl = TinyWorkload(depth=3, width=4)
    model = wl.build_model()
    CompileSpec("block", "eager").apply(wl, model)
    blocks = set(wl.blocks(model))
    assert len(blocks) == 3
    assert all(is_compiled(m) == (m in blocks) for m in model.modules())
    whole = wl.build_model()
    CompileSpec("model", "eager").apply(wl, whole)
    assert is_compiled(whole) and not any(is_compiled(b) for b in wl.blocks(whole))


def test_budget_config_drops_the_knobs_the_budget_derives() -> None:
    from z3kit_recipes.bench.runners.z3kit_zero3 import budget_config, shared_config
    from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG
    from z3kit_recipes.zero3 import Zero3Config

    zero = {**DEFAULT_ZERO_CONFIG, "stage3_max_live_parameters": 3_000_000}
    config = budget_config(zero, 0.125)
    assert config.memory_budget == 0.125
    assert config.reduce_bucket_size == Zero3Config().reduce_bucket_size
    assert config.max_live_parameters == Zero3Config().max_live_parameters
    assert config.param_persistence_threshold == shared_config(zero).param_persistence_threshold == 0


# --------------------------------------------------------------------------- #
# Report and plot from a synthetic report
# --------------------------------------------------------------------------- #

_MODEL = 1000


def _run(median: float, init: float, train: float, resident: float, losses: list[float]) -> dict[str, object]:
    memory: dict[str, object] = {"model_fp32_bytes": 4 * _MODEL}
    for phase, x in (("baseline", 100.0), ("init_peak", init), ("resident_after_init", init),
                     ("train_peak", train), ("resident_after_step", resident)):
        memory[f"{phase}_bytes"] = int(x * 4 * _MODEL)
        memory[f"{phase}_x_model"] = x
    return {"status": "ok", "threads": 1, "median_s": median, "min_s": median * 0.9, "losses": losses,
            "total_params": _MODEL, "memory": memory, "peak_live_params": _MODEL,
            "collectives_per_step": {"all_reduce": 1}}


def _synthetic_report() -> dict[str, object]:
    z3 = _run(0.2, 1.5, 3.0, 2.0, [1.0, 0.9])
    z3["engine_stats"] = {"memory_plan": {"describe": "memory budget 500 B: max_live_parameters=93"}}
    case = {
        "workload": "tiny", "world": 2, "steps": 2, "warmup": 0, "threads": 1, "total_params": _MODEL,
        "runtimes": {
            "ddp": _run(0.1, 1.0, 4.0, 3.0, [1.0, 0.9]),
            "z3kit-budget": z3,
            "deepspeed": {"status": "error", "note": "RuntimeError: boom"},
            "fsdp2": {"status": "skipped", "note": "not installed"},
        },
    }
    return {"meta": {}, "cases": [case]}


def test_report_compares_with_ddp_and_shows_failed_runs() -> None:
    report = _synthetic_report()
    case = report["cases"][0]  # type: ignore[index]
    bench_report.compare_to_ddp(case)
    z3 = case["runtimes"]["z3kit-budget"]
    assert z3["ratio_vs_ddp"] == pytest.approx(2.0)
    assert z3["memory"]["train_peak_vs_ddp"] == pytest.approx(0.75)
    assert z3["memory"]["resident_after_step_vs_ddp"] == pytest.approx(2 / 3)
    assert z3["loss_max_abs_diff_vs_ddp"] == 0.0
    text = bench_report.render_table(report)
    for column in ("init", "train", "resid.", "train/DDP", "resid/DDP", "vs DDP"):
        assert column in text
    z3_row = next(line for line in text.splitlines() if line.startswith("z3kit-budget"))
    assert "2.00x" in z3_row and "0.75x" in z3_row and "0.67x" in z3_row and "3.00" in z3_row
    assert "deepspeed       error: RuntimeError: boom" in text
    assert "fsdp2           skipped: not installed" in text
    assert "memory budget 500 B" in text


def test_report_shows_muon_bytes_and_time_beside_adams() -> None:
    report = _synthetic_report()
    runtimes = report["cases"][0]["runtimes"]  # type: ignore[index]
    mib = 1 << 20
    runtimes["z3kit"] = {**_run(0.2, 1.5, 3.0, 2.0, [1.0, 0.9]),
                         "engine_stats": {"collectives": {"all_gather": {"calls": 2, "bytes": 3 * mib}}, "muon": None}}
    runtimes["z3kit-muon"] = {**_run(0.3, 1.5, 3.0, 2.0, [1.0, 0.8]), "engine_stats": {
        "collectives": {"all_gather": {"calls": 2, "bytes": 3 * mib}},
        "muon": {"optimizer_of": {"a": "muon", "b": "muon", "c": "adamw"}, "owner_of": {"a": 0, "b": 1},
                 "bytes_sent": mib // 2, "bytes_received": mib, "seconds": 0.0125, "steps": 2}}}
    text = bench_report.render_table(report)
    assert "z3kit-muon: Muon on 2 matrices, Adam on 1 parameters; Muon's last step on rank 0: 12.5 ms, " \
        "sent 0.50 MiB, received 1.00 MiB" in text
    assert "z3kit 3.00, z3kit-muon 3.00 + 0.50 (Muon)" in text


def test_report_shows_compile_figures() -> None:
    report = _synthetic_report()
    report["meta"] = {"compile": "block", "compile_backend": "inductor"}
    case = report["cases"][0]  # type: ignore[index]
    for r in case["runtimes"].values():
        if r["status"] == "ok":
            r["warmup_times_s"] = [2.0, 1.5]
    case["runtimes"]["z3kit-budget"]["engine_stats"]["compile"] = {
        "units": ["blocks.0", "blocks.1"], "whole_model": False, "eager_forwards": 1,
        "last_step": {"graphs": 0, "recompiles": 0, "graph_breaks": 0},
        "total": {"graphs": 2, "recompiles": 1, "graph_breaks": 0},
    }
    text = bench_report.render_table(report)
    assert "compiled: block (inductor); warm-up steps' seconds (compiling included): ddp 3.5, z3kit-budget 3.5" in text
    assert "z3kit-budget: 2 compiled blocks gathered as units; 1 eager forward(s); graphs compiled 2" in text
    assert "last step: 0 new graphs, 0 recompiles" in text


def test_plot_writes_one_png_per_case(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from z3kit_recipes.bench.plot import write_plots

    report = _synthetic_report()
    second = copy.deepcopy(report["cases"][0])  # type: ignore[index]
    second["world"] = 4
    report["cases"].append(second)  # type: ignore[attr-defined]
    paths = write_plots(report, tmp_path / "bench.json")
    assert [p.name for p in paths] == ["bench-tiny-world2.png", "bench-tiny-world4.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- #
# End to end
# --------------------------------------------------------------------------- #


def test_tiny_end_to_end_ddp_and_z3kit(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "z3kit_recipes.bench", "--workload", "tiny", "--world", "2",
           "--runtimes", "ddp,z3kit,fsdp_blocks", "--warmup", "0", "--steps", "2", "--probe-steps", "1",
           "--threads", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    ddp, z3 = case["runtimes"]["ddp"], case["runtimes"]["z3kit"]
    assert ddp["status"] == "ok" and z3["status"] == "ok", (ddp.get("note"), z3.get("note"))
    assert len(z3["losses"]) == len(ddp["losses"]) == 2
    assert z3["loss_max_abs_diff_vs_ddp"] <= 1e-5
    for r in (ddp, z3):
        mem = r["memory"]
        assert mem["model_fp32_bytes"] == 4 * r["total_params"] > 0
        for phase in ("baseline", "init_peak", "train_peak", "resident_after_step"):
            assert mem[f"{phase}_bytes"] > 0 and mem[f"{phase}_x_model"] > 0
        assert len(mem["per_rank"]) == 2
    engine_memory = z3["engine_stats"]["memory"]
    assert engine_memory["peak_total_bytes"] > 0 and "param_shards" in engine_memory["current_bytes"]
    assert "train/DDP" in proc.stdout
    blocks = case["runtimes"]["fsdp_blocks"]
    assert blocks["status"] == "ok", blocks.get("note")
    assert len(blocks["losses"]) == 2 and blocks["loss_max_abs_diff_vs_ddp"] <= 1e-5
    # the gradients went through per-block reduce-scatters, by its own log
    assert blocks["engine_collectives_per_step"]["reduce_scatter"] > 0
