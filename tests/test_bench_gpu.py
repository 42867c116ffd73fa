"""``python -m z3kit_recipes.bench.gpu --dry-run``: the GPU check on CPU over
gloo, at world 1 and 2, end to end in a subprocess; its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"parity", "host_syncs", "memory", "large", "timing"}
CASES = {f"{model}/{dtype}" for model in ("gpt", "llama") for dtype in ("fp32", "bf16")}


@pytest.mark.parametrize("world", [1, 2])
def test_dry_run_reports_every_section(tmp_path: Path, world: int) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "-m", "z3kit_recipes.bench.gpu", "--dry-run", "--world", str(world), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["meaningful_timing_and_memory"] is False
    assert report["failures"] == [] and report["exit_code"] == 0
    other = report["worlds"][str(3 - world)]
    assert other["status"] == "skipped" and other["reason"]
    result = report["worlds"][str(world)]
    assert result["status"] == "ok" and result["world"] == world and result["backend"] == "gloo"
    sections = result["sections"]
    assert set(sections) == SECTIONS
    assert all(s["status"] == "ok" for s in sections.values()), {k: s.get("error") for k, s in sections.items()}

    parity = sections["parity"]
    assert parity["passed"] is True and set(parity["cases"]) == CASES
    for case in parity["cases"].values():
        assert case["passed"] is True and case["steps"] > 0
        assert case["max_loss_rel_diff"] <= case["tolerance"]["loss_rel"]
        assert case["param_diff_rel_to_update"] <= case["tolerance"]["param_rel"]
        assert case["update_norm"] > 0  # the reference trained, so the comparison means something

    syncs = sections["host_syncs"]
    # an int, whatever its value: the syncs are being removed elsewhere
    assert isinstance(syncs["syncs_per_step"], int) and syncs["expected"] == 0
    assert set(syncs["cases"]) == CASES
    for case in syncs["cases"].values():
        assert isinstance(case["syncs_per_step"], int)
        assert len(case["per_step_per_rank"]) == world
        assert set(case["calls_rank0"]) == {"forward", "backward", "step"}

    memory = sections["memory"]
    assert memory["meaningful"] is False and set(memory["cases"]) == CASES
    for case in memory["cases"].values():
        assert set(case["phases"]) == {"forward", "backward", "step"}
        for phase in case["phases"].values():
            assert phase["allocator_peak_bytes"] > 0 and phase["ledger_peak_total_bytes"] > 0
            assert phase["ledger_peak_bytes"]["param_shards"] > 0

    large = sections["large"]
    if world == 1:  # plain torch, FSDP2 and z3kit on the large section's Llama (a tiny one here), bf16
        assert large["meaningful"] is False and large["dtype"] == "bf16" and large["params"] > 0
        assert large["tokens_per_step"] == large["batch"] * large["seq"] and large["peak_bf16_flops"] is None
        assert set(large["cases"]) == {"plain", "fsdp2", "z3kit"}
        for case in large["cases"].values():
            assert case["status"] == "ok" and case["host_s"] > 0 and case["device_s"] >= case["host_s"]
            assert case["tokens_per_s"] > 0 and case["mfu"] is None and case["host_ahead"] is None
        assert large["cases"]["plain"]["tokens_per_s_x_plain"] == 1.0
    else:
        assert large["cases"] == {} and "world 1 only" in large["note"]

    timing = sections["timing"]
    assert timing["meaningful"] is False
    expected = {"z3kit/fsdp2", "z3kit_offload/z3kit", "z3kit_offload_fused/z3kit"} | (
        {"z3kit_muon/z3kit"} if world == 1 else {"z3kit/deepspeed"})
    for model in ("gpt", "llama"):
        case = timing["cases"][model]
        assert set(case["ratios"]) == expected
        assert case["ratios"]["z3kit/fsdp2"] > 0 and case["ratios"]["z3kit_offload/z3kit"] > 0
        # the optimizer on the host changes where the step runs, not what it computes
        assert case["z3kit_offload"]["losses_rank0"] == case["z3kit"]["losses_rank0"]
        if world == 1:  # Muon trains too, and not as Adam does
            assert case["ratios"]["z3kit_muon/z3kit"] > 0
            assert case["z3kit_muon"]["losses_rank0"][1:] != case["z3kit"]["losses_rank0"][1:]
        assert case["z3kit"]["median_s"] > 0 and case["fsdp2"]["median_s"] > 0
        if case["ratios"].get("z3kit/deepspeed") is None and world > 1:
            assert case["deepspeed"]["status"] == "skipped"  # only when DeepSpeed is not importable

    assert "result: PASS" in proc.stdout and "NOT meaningful" in proc.stdout


def test_large_llama_is_about_1b_and_the_peak_is_looked_up_by_device_name() -> None:
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from z3kit_recipes.bench.gpu_large import LARGE_LLAMA, peak_flops

    with torch.device("meta"):  # shapes only: nothing allocated
        model = LlamaForCausalLM(LlamaConfig(**LARGE_LLAMA))
    assert sum(p.numel() for p in model.parameters()) == 1_104_218_112
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("CPU") is None
