"""The gradient reducer, driven directly: plan, reductions, partitions, windows, clipping.

Each rank hands its gradients over in a different order, and one rank
never gives one of them (a parameter unused there); the reductions run on
real gloo ranks through a ``RecordingStreamPair`` and are counted in a
``CollectiveLog``. Every rank's partitions must be its slice of the mean
gradient, whatever the arrival order, and every rank must issue the same
reductions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from z3kit.collectives import CollectiveLog
from z3kit.flat_bucket import ReduceMode
from z3kit.memory import MemoryKind, MemoryLedger
from z3kit.shard import ParamShard, partition_of
from z3kit.stream_check import RecordingStreamPair
from z3kit_recipes.zero3.training.grads import GradReducer

# 1200 elements needs no padding at world 2 and fills half a bucket: reduced alone (in place)
SHAPES = [(7, 3), (5,), (1,), (1200,), (4, 4), (9,)]
UNUSED_ON_RANK1 = 4  # (4, 4): no gradient on rank 1
NEVER = 5  # (9,): no gradient anywhere


def _grad(rank: int, pid: int, window: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * window + 10 * pid + rank)
    return torch.randn(SHAPES[pid], generator=g)


def _reducer_worker(ctx: WorkerContext, mode: ReduceMode, overlap: bool) -> dict[str, Any]:
    shards = [ParamShard.from_param(torch.nn.Parameter(torch.zeros(s)), ctx.rank, ctx.world) for s in SHAPES]
    log, memory = CollectiveLog(), MemoryLedger()
    pair = RecordingStreamPair(seed=ctx.rank, delay_s=0.001)
    reducer = GradReducer(
        shards, list(range(len(SHAPES))), group=ctx.group, waiter=lambda done, wait: wait(), streams=pair,
        log=log, memory=memory, bucket_size=2400, bucket_dtype=torch.float32, mode=mode, overlap=overlap,
        contiguous=True, scale=1.0 / ctx.world,
    )
    order = [p for p in range(len(SHAPES)) if p != NEVER]
    if ctx.rank == 1:
        order = [p for p in reversed(order) if p != UNUSED_ON_RANK1]
    out: dict[str, Any] = {"plan": reducer.plan.buckets, "alone": reducer.plan.alone}
    with pair.checker.watching():
        for window in (0, 1):
            for pid in order:
                reducer.add(pid, _grad(ctx.rank, pid, window))
            reducer.finish()
            out[f"calls{window}"] = log.total_calls()
            out[f"buckets_after{window}"] = memory.current(MemoryKind.GRAD_BUCKETS)
            reducer.mark_used(p for p in range(len(SHAPES)) if p != NEVER)
            reducer.new_backward()  # the engine's end of backward takes the flags (zero3.training.step_checks)
        grads = reducer.window.optimizer_grads()
        out["grads"] = [None if g is None else g.clone() for g in grads]
        out["partition_bytes"] = memory.current(MemoryKind.GRAD_PARTITIONS)
        out["norm"] = float(reducer.clip_(1.0)[0])
        clipped = [g for g in reducer.window.optimizer_grads() if g is not None]
        out["clipped_norm"] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in clipped)))
        reducer.window.end()
    out["after_window"] = memory.current(MemoryKind.GRAD_PARTITIONS)
    out["tickets"] = (pair.checker.issued, pair.checker.completed)
    return out


def _mean_grad(pid: int, world: int) -> torch.Tensor:
    total = torch.zeros(SHAPES[pid])
    for window in (0, 1):
        for rank in range(world):
            if not (rank == 1 and pid == UNUSED_ON_RANK1):
                total += _grad(rank, pid, window)
    return total / world


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", [ReduceMode.ALL_REDUCE, ReduceMode.REDUCE_SCATTER])
def test_reducer_partitions_are_the_mean_whatever_the_arrival_order(
    pools: PoolSet, mode: ReduceMode, overlap: bool
) -> None:
    world = 2
    outs = pools.run(world, _reducer_worker, mode, overlap)
    plan = outs[0]["plan"]
    # parameters in reverse order; the large one alone; the rest packed into buckets
    assert [pid for bucket in plan for pid in bucket] == [5, 4, 3, 2, 1, 0]
    assert (3,) in plan and outs[0]["alone"][plan.index((3,))] is True
    full_norm = 0.0
    for pid in range(len(SHAPES)):
        if pid != NEVER:
            full_norm += float((_mean_grad(pid, world).double() ** 2).sum())
    full_norm **= 0.5
    for rank, out in enumerate(outs):
        # the same reductions on every rank, one per bucket of the plan and backward
        assert out["calls0"] == len(plan) and out["calls1"] == 2 * len(plan)
        assert out["buckets_after0"] == out["buckets_after1"] == 0
        for pid, got in enumerate(out["grads"]):
            if pid == NEVER:
                assert got is None  # no rank gave it a gradient: none for the optimizer
            else:
                want = partition_of(_mean_grad(pid, world).reshape(-1), rank, world)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert out["partition_bytes"] == 4 * sum(-(-torch.Size(s).numel() // world) for s in SHAPES)
        assert out["norm"] == pytest.approx(full_norm, rel=1e-5)
        assert out["after_window"] == 0
        issued, completed = out["tickets"]
        assert issued == completed == 2 * len(plan)
    # clipped to 1.0: the global norm of every rank's partitions together
    clipped = sum(out["clipped_norm"] ** 2 for out in outs) ** 0.5
    assert clipped == pytest.approx(1.0, rel=1e-4)
