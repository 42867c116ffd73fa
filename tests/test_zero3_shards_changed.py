"""Every path that changes the shards reaches ``EngineCore.shards_changed``,
which drops every cache derived from them: hpZ's secondary slices, the
gathered copies of persistent (and pinned) parameters, the gathers in flight.

The reference of each path is flat ZeRO-3 with nothing persistent: every
gather there reads the shards as they are. hpZ's backward gathers read the
slices its forward kept, and persistent parameters stay gathered from step
to step, so a cache left stale by a path makes those runs differ from the
reference. Without a stale cache they are bitwise equal to it (a slice is an
exact copy of part of the gathered parameter; ``test_zero3_hpz``). 4 gloo
ranks as 2 "nodes" of 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from tests.two_nodes import two_node_engine
from tests.zero3_models import WORKLOADS
from z3kit_recipes.zero3.config.offload import OffloadConfig

#: nothing persistent, nothing held from forward to backward: every gather reads the shards
FLAT = dict(param_persistence_threshold=0, max_reuse_distance=0, gradient_accumulation_steps=2)
VARIANTS = {
    "flat": FLAT,
    "hpz": dict(FLAT, hpz_partition_size=2),
    # every parameter persistent: gathered once, kept from step to step
    "persistent": dict(FLAT, param_persistence_threshold=10**6),
    "hpz_persistent": dict(FLAT, hpz_partition_size=2, param_persistence_threshold=10**6),
    # the host step writes the shards behind the next forward
    "hpz_offload": dict(FLAT, hpz_partition_size=2, offload_optimizer=OffloadConfig()),
}


def _engine(ctx: WorkerContext, workload: str, config: dict[str, Any]) -> Any:
    return two_node_engine(ctx, workload, config, lr=3e-2)


def _micro(ctx: WorkerContext, engine: Any, workload: str, step: int, m: int) -> float:
    w = WORKLOADS[workload]
    loss = w.loss(engine, w.batch(ctx.rank, step, m, 0), step)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _edit(ctx: WorkerContext, engine: Any) -> None:
    """Rank 0 changes every weight inside ``gathered_parameters(modifier_rank=0)``."""
    with engine.gathered_parameters(modifier_rank=0) as params:
        if ctx.rank == 0:
            with torch.no_grad():
                for p in params:
                    p.mul_(-1.5).add_(0.25)


def _path(ctx: WorkerContext, path: str, root: str) -> dict[str, dict[str, Any]]:
    """Each variant through ``path`` inside an accumulation window: its losses and final parameters."""
    out = {}
    for variant, config in VARIANTS.items():
        workload = "frozen" if path == "unfreeze" else "mlp"
        engine = _engine(ctx, workload, config)
        if path == "load_pretrained":
            engine.save_pretrained(f"{root}/{variant}")  # the initial weights
        elif path == "load_checkpoint":
            engine.save_checkpoint(f"{root}/{variant}")  # the initial weights, optimizer state and counters
        losses = [_micro(ctx, engine, workload, 0, 0), _micro(ctx, engine, workload, 0, 1),
                  _micro(ctx, engine, workload, 1, 0)]
        # inside the window of step 1: its first micro-step kept hpZ's slices of the weights before the change
        if path == "modifier_rank":
            before = engine.full_state_dict()
            _edit(ctx, engine)
            after = engine.full_state_dict()
            assert all(torch.equal(after[k], before[k] * -1.5 + 0.25) for k in before)  # every rank has rank 0's edit
        elif path == "load_pretrained":
            engine.load_pretrained(f"{root}/{variant}")
        elif path == "load_checkpoint":
            engine.load_checkpoint(f"{root}/{variant}")
        losses.append(_micro(ctx, engine, workload, 1, 1))
        if path == "unfreeze":  # between steps: the next window trains the first layer too
            engine.module.mlp.layers[0].requires_grad_(True)
        losses += [_micro(ctx, engine, workload, step, m) for step in (2, 3) for m in (0, 1)]
        out[variant] = dict(losses=losses, params=engine.full_state_dict())
    return out


def _assert_as_flat(runs: list[dict[str, dict[str, Any]]]) -> None:
    for rank_runs in runs:
        flat = rank_runs["flat"]
        for variant, run in rank_runs.items():
            assert run["losses"] == flat["losses"], variant
            for name, value in flat["params"].items():
                assert torch.equal(run["params"][name], value), (variant, name)


def test_gathered_parameters_modifier_rank_inside_a_window_reaches_every_cache(pools: PoolSet, tmp_path: Path) -> None:
    _assert_as_flat(pools.run(4, _path, "modifier_rank", str(tmp_path)))


def test_load_pretrained_inside_a_window_reaches_every_cache(pools: PoolSet, tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    _assert_as_flat(pools.run(4, _path, "load_pretrained", str(tmp_path)))


def test_load_checkpoint_inside_a_window_reaches_every_cache(pools: PoolSet, tmp_path: Path) -> None:
    _assert_as_flat(pools.run(4, _path, "load_checkpoint", str(tmp_path)))


def test_optimizer_steps_and_the_host_step_reach_every_cache(pools: PoolSet, tmp_path: Path) -> None:
    _assert_as_flat(pools.run(4, _path, "none", str(tmp_path)))


def test_unfreezing_then_stepping_reaches_every_cache(pools: PoolSet, tmp_path: Path) -> None:
    _assert_as_flat(pools.run(4, _path, "unfreeze", str(tmp_path)))


def _slices_memory(ctx: WorkerContext) -> list[tuple[int, int]]:
    """hpZ's slices (now, peak) in ``stats()``: after each backward, and after each step."""
    engine = _engine(ctx, "mlp", VARIANTS["hpz"])
    padded = sum(s.padded_numel * s.shard.element_size() for s in engine.shards)
    out = [(padded, 0)]
    for step in range(2):
        for m in range(2):
            w = WORKLOADS["mlp"]
            engine.backward(w.loss(engine, w.batch(ctx.rank, step, m, 0), step))
            memory = engine.stats().memory
            out.append((memory.current["hpz_secondary"], memory.peak["hpz_secondary"]))
            engine.step()
        memory = engine.stats().memory
        out.append((memory.current["hpz_secondary"], memory.peak["hpz_secondary"]))
    with pytest.raises(ValueError, match=r"shards_changed takes parameter ids in \[0, 6\), got \[6\]"):
        engine.shards_changed([6])
    return out


def test_hpz_slices_are_freed_by_the_optimizer_step_and_their_peak_is_reported(pools: PoolSet) -> None:
    for (padded, _), *figures in pools.run(4, _slices_memory):
        half = padded // 2  # a slice of 1/2 of every parameter (every one gathered in a training forward)
        # kept from the first forward of a window through its backwards; freed by the step, the peak stays
        assert figures == [(half, half), (half, half), (0, half)] * 2
