"""The long-run memory bench (``python -m z3kit_recipes.bench --long-run``): its
plumbing on a few steps, and its figures from samples. No threshold on
memory is asserted here: the bench's figures are in docs/measurements.md."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.dist_pool import PoolSet, WorkerContext
from z3kit_recipes.bench.cli import build_parser, main
from z3kit_recipes.bench.long_run import (
    FLAT_MARGIN_MB, MB, growth_mb_per_1000, long_run_workload, render_long_run, runner_for, sampled_steps, summarize,
)


def _line(start_mb: float, per_step_mb: float, steps: int, every: int) -> list[tuple[int, int]]:
    return [(s, int((start_mb + per_step_mb * s) * MB)) for s in range(0, steps, every)]


def test_growth_is_the_slope_after_the_warmup() -> None:
    # a warm-up jump of 100 MB, then 0.3 MB a step: 300 MB per 1,000 steps
    samples = [(0, int(300 * MB)), (50, int(400 * MB))] + _line(400, 0.3, 2000, 50)[2:]
    assert growth_mb_per_1000(samples, warmup=100) == pytest.approx(300.0, rel=1e-6)
    assert growth_mb_per_1000(_line(330, 0.0, 2000, 50), warmup=300) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="fewer than 2 windows of 5 samples at or after step 1750"):
        growth_mb_per_1000(_line(330, 0.0, 2000, 50), warmup=1750)
    # a flat run sampled on either side of a trim at random: the envelope is flat
    sawtooth = [(s, int((355 if s % 150 == 0 else 400) * MB)) for s in range(0, 2000, 50)]
    assert growth_mb_per_1000(sawtooth, warmup=300) == pytest.approx(0.0, abs=1e-6)


def test_summary_says_whether_z3kit_is_as_flat_as_ddp() -> None:
    ddp = {"status": "ok", "train_s": 1.0, "rss_bytes": [_line(310, 0.001, 2000, 50)] * 2}
    flat = {"status": "ok", "train_s": 1.0, "rss_bytes": [_line(330, 0.002, 2000, 50), _line(330, 0.0, 2000, 50)]}
    growing = {"status": "ok", "train_s": 1.0, "rss_bytes": [_line(330, 0.3, 2000, 50)] * 2}
    within = summarize({"ddp": ddp, "z3kit": flat}, warmup=300)
    assert within["z3kit_flat_as_ddp"] and within["z3kit"]["growth_max"] == pytest.approx(2.0)
    assert within["ddp"]["rss_first_mb"] == [pytest.approx(310.0)] * 2
    beyond = summarize({"ddp": ddp, "z3kit": growing}, warmup=300)
    assert not beyond["z3kit_flat_as_ddp"]
    assert beyond["z3kit"]["growth_max"] > beyond["ddp"]["growth_max"] + FLAT_MARGIN_MB
    assert "z3kit within DDP + 2 MB per 1,000 steps: NO" in render_long_run(beyond, 300)
    failed = summarize({"ddp": ddp, "z3kit": {"status": "error", "note": "rank 1 died"}}, warmup=300)
    assert "z3kit_flat_as_ddp" not in failed and "rank 1 died" in render_long_run(failed, 300)


def test_the_option_and_its_refusals(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--long-run", "--sample-every", "5", "--steps", "40"])
    assert args.long_run and args.sample_every == 5 and args.steps == 40
    # refused before any process starts, naming the options
    with pytest.raises(SystemExit, match=r"0 <= --warmup < --steps \(got 50\)"):
        main(["--long-run", "--steps", "40", "--warmup", "50", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match=r"--world >= 2 \(got 1\)"):
        main(["--long-run", "--world", "1", "--out", str(tmp_path / "r.json")])


def _sampled_worker(ctx: WorkerContext, runtime: str) -> list[tuple[int, int]]:
    wl = long_run_workload()
    return sampled_steps(runner_for(runtime, wl, ctx.group), wl, ctx.rank, steps=21, every=2)


def test_each_runtime_trains_and_samples_every_rank(pools: PoolSet) -> None:
    runs = {rt: {"status": "ok", "train_s": 0.0, "rss_bytes": pools.run(2, _sampled_worker, rt)}
            for rt in ("ddp", "z3kit")}
    for run in runs.values():
        for samples in run["rss_bytes"]:
            assert [s for s, _ in samples] == list(range(0, 21, 2)) and all(b > 100 * MB for _, b in samples)
    summary = summarize(runs, warmup=0)
    assert all(math.isfinite(g) for rt in ("ddp", "z3kit") for g in summary[rt]["growth_mb_per_1000_steps"])
    assert isinstance(summary["z3kit_flat_as_ddp"], bool)
