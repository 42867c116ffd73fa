"""The worker pool itself: results by rank, failures surfaced, recovery."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import PoolSet, RankFailure, WorkerContext


def _sum_ranks(ctx: WorkerContext) -> float:
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=ctx.group)
    return float(t.item())


def _fail_on_rank_one(ctx: WorkerContext) -> int:
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    return ctx.rank


@pytest.mark.parametrize("world", [1, 2, 4])
def test_results_come_back_by_rank(pools: PoolSet, world: int) -> None:
    assert pools.run(world, _sum_ranks) == [float(sum(range(world)))] * world


def test_failure_names_rank_and_pool_recovers(pools: PoolSet) -> None:
    with pytest.raises(RankFailure, match="boom on rank 1"):
        pools.run(2, _fail_on_rank_one)
    assert pools.run(2, _sum_ranks) == [1.0, 1.0]
