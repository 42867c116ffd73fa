"""``python -m z3kit_recipes.bench --mesh RxS``: its option, its bounds, and one
short real run of every layout on 2 "nodes" of 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from z3kit.shard import shard_numel_for
from z3kit_recipes.bench.cli import build_parser
from z3kit_recipes.bench.link_count import tensor_bytes
from z3kit_recipes.bench.mesh import render_mesh_table, run_mesh
from z3kit_recipes.bench.mesh_spec import (
    MeshShape, hsdp_inter_node_bound_bytes, resident_bound_bytes,
)
from z3kit_recipes.models import make_workload


@pytest.mark.parametrize(("text", "replicas", "shard"), [("2x2", 2, 2), ("2x4", 2, 4), ("1x3", 1, 3)])
def test_mesh_option_reads_nodes_by_ranks_per_node(text: str, replicas: int, shard: int) -> None:
    shape = build_parser().parse_args(["--mesh", text]).mesh
    assert shape == MeshShape(replicas, shard)
    assert shape.world == replicas * shard and str(shape) == text


@pytest.mark.parametrize("text", ["2x", "0x4", "4x0", "3", "x2", "2x2x2", "2*2", "-1x2", ""])
def test_mesh_option_refuses_other_forms(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--mesh"):
        MeshShape.parse(text)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--mesh", text])
    assert "--mesh" in capsys.readouterr().err


def test_bounds_per_layout() -> None:
    shape = MeshShape(2, 4)
    psi = 8_000
    assert resident_bound_bytes("flat", psi, shape) == 12 * psi / 8  # fp32 shard (= master) + Adam's 2 moments
    assert resident_bound_bytes("hsdp", psi, shape) == resident_bound_bytes("fsdp2-hsdp", psi, shape) == 12 * psi / 4
    assert resident_bound_bytes("hpz", psi, shape) == 12 * psi / 8  # its secondary slices are freed by the step
    assert hsdp_inter_node_bound_bytes(psi, shape) == 2 * 4 * psi / 4
    assert tensor_bytes([torch.zeros(3), [torch.zeros(2, dtype=torch.float64)], 7]) == 12 + 16


def test_every_layout_at_2x2_on_the_tiny_model() -> None:
    shape = MeshShape(2, 2)
    report = run_mesh(shape, workload="tiny", steps=1, warmup=1, fresh_processes=False)
    layouts = report["layouts"]
    parity = report["checks"]["loss_max_abs_diff_vs_flat"]
    assert list(layouts) == ["flat", "hsdp", "hpz", "fsdp2-hsdp"]
    flat, hsdp, hpz, fsdp2 = layouts["flat"], layouts["hsdp"], layouts["hpz"], layouts["fsdp2-hsdp"]
    # FSDP2's HSDP needs gloo's ReduceOp.AVG, which torch 2.7's lacks: then its row says so
    fsdp2_runs = fsdp2["status"] != "unavailable"
    if not fsdp2_runs:
        assert "ReduceOp.AVG" in fsdp2["note"] and "unavailable: FSDP2's HSDP" in render_mesh_table(report)
    for r in (flat, hsdp, hpz, *([fsdp2] if fsdp2_runs else [])):
        assert r["status"] == "ok", r.get("error")
        assert len(r["losses"]) == 3  # warm-up, measured, counted
    assert parity["hsdp"] <= 1e-6 and parity["hpz"] == 0.0
    assert not fsdp2_runs or parity["fsdp2-hsdp"] <= 1e-5

    # across nodes, HSDP sends only the all-reduce of each rank's 1/S gradient partition over the
    # R replicas: 2 (R - 1) / R of it under the direct-exchange model, all of it at R = 2
    model = make_workload("tiny").build_model()
    partition_bytes = 4 * sum(shard_numel_for(p.numel(), shape.shard_size) for p in model.parameters())
    assert hsdp["inter_node_bytes_per_step"] == partition_bytes
    assert hsdp["inter_node_bytes_per_step"] < flat["inter_node_bytes_per_step"]
    assert report["checks"]["hsdp_inter_node"]["status"] == "ok"
    # FSDP2's HSDP, counted from its c10d calls, moves the same (the tiny model needs no padding)
    if fsdp2_runs:
        assert fsdp2["link_method"].startswith("LinkCounter")
        assert fsdp2["inter_node_bytes_per_step"] == partition_bytes
    # the c10d count sees every collective the engine logs, plus the ranks' small agreement gathers
    for r in (flat, hsdp):
        counted, engine = r["counted"]["inter_node_bytes"], r["counted"]["engine_same_step"]["inter_node"]
        assert engine <= counted <= 1.01 * engine
    # flat regathers in backward (parameters are released after forward); hpZ moves those gathers
    # into the node and the rest is flat's: what the engine logs is flat's less the parameters'
    # backward gathers (the c10d count adds agreement gathers the engine does not log)
    hpz_check = report["checks"]["hpz_inter_node"]
    flat_backward = hpz_check["flat_backward_gather_inter_node_bytes"]
    assert flat_backward > 0
    assert hpz_check["status"] == "ok"
    left = hpz_check["backward_gather_inter_node_bytes"]  # the agreement gathers, in flat's too
    assert left < 0.01 * flat_backward
    assert hpz["inter_node_bytes_per_step"] == flat["inter_node_bytes_per_step"] - (flat_backward - left)

    # what each runtime holds between steps is its shard and Adam's moments: the analytic bound
    for name, check in report["checks"]["resident_vs_bound"].items():
        assert 1.0 <= check["ledger_over_bound"] <= 1.1, name
    assert flat["ledger_resident_bytes"] < hsdp["ledger_resident_bytes"]


def test_table_shows_a_layout_that_could_not_run_and_checks_what_ran() -> None:
    shape = MeshShape(2, 2)
    flat: dict[str, Any] = {
        "status": "ok", "layout": "flat", "total_params": 1000, "median_s": 0.5, "losses": [1.0, 0.9],
        "inter_node_bytes_per_step": 4000.0, "intra_node_bytes_per_step": 2000.0, "link_method": "engine.stats()",
        "counted": {"inter_node_bytes": 4100.0, "intra_node_bytes": 2000.0, "backward_gather_inter_node_bytes": 1100.0,
                    "engine_same_step": {"inter_node": 4000.0, "intra_node": 2000.0}},
        "memory": {"init_peak": 1, "train_peak": 2, "resident_after_step": 1},
        "ledger_resident_bytes": 3030, "resident_bound_bytes": 3000.0, "ledger_over_bound": 1.01,
    }
    report: dict[str, Any] = {
        "meta": {"mesh": "2x2", "replicas": 2, "shard_size": 2, "workload": "tiny", "steps": 1, "warmup": 0},
        "layouts": {"flat": flat, "hsdp": {"status": "error", "note": "boom"},
                    "hpz": {"status": "unavailable", "note": "not here"}},
    }
    from z3kit_recipes.bench.mesh_checks import check_targets

    report["checks"] = check_targets(report, shape, tolerance=1.1)
    assert report["checks"]["hsdp_inter_node"] == {"status": "not run"}
    hpz = report["checks"]["hpz_inter_node"]
    assert hpz["status"] == "unavailable: not here"
    assert hpz["expected_inter_node_bytes_less_backward_gathers"] == 4100.0 - 1100.0
    assert report["checks"]["resident_vs_bound"]["flat"]["status"] == "ok"
    table = render_mesh_table(report)
    assert "| hpz | unavailable: not here |" in table and "| hsdp | error: boom |" in table
    assert "| flat | 3.91 KiB | 1.00x |" in table
