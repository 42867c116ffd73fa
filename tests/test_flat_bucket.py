"""FlatBucket: a bucket's reduced partitions equal the partitions of the summed
full gradients, bit for bit, in both reduction modes, on real gloo groups.

Gradients are multiples of 1/64 in a small range, so fp32 sums are exact in
any order; the scale then rounds once, as ``sum * scale`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from tests.errors import error_of
from z3kit.collectives import CollectiveLog
from z3kit.flat_bucket import FlatBucket, ReduceMode
from z3kit.shard import partition_of, shard_numel_for

WORLDS = [1, 2, 4]
MODES = [ReduceMode.ALL_REDUCE, ReduceMode.REDUCE_SCATTER]
# numels 21, 1, 13, 4, 30, 6: mostly not divisible by 2 or 4, some smaller than 4
GRAD_SHAPES = [(7, 3), (1,), (13,), (2, 2), (5, 6), (6,)]
SCALE = 1 / 6


def _grad(rank: int, key: int, round_: int) -> torch.Tensor:
    shape = GRAD_SHAPES[key % len(GRAD_SHAPES)]
    g = torch.Generator().manual_seed(10_000 * round_ + 100 * key + rank)
    return (torch.randint(-2048, 2048, shape, generator=g).to(torch.float32) / 64).contiguous()


def _expected(world: int, rank: int, key: int, round_: int, scale: float) -> torch.Tensor:
    total = sum(_grad(r, key, round_) for r in range(world))
    assert isinstance(total, torch.Tensor)
    reduced = total * scale if scale != 1.0 else total
    return partition_of(reduced.reshape(-1), rank, world)


def _padded_total(world: int, keys: list[int]) -> int:
    return sum(shard_numel_for(torch.Size(GRAD_SHAPES[k % len(GRAD_SHAPES)]).numel(), world) * world for k in keys)


def _bucket_worker(ctx: WorkerContext, mode: ReduceMode, async_op: bool) -> dict[str, Any]:
    rank, world, group = ctx.rank, ctx.world, ctx.group
    keys = list(range(len(GRAD_SHAPES)))
    out: dict[str, Any] = {}
    log = CollectiveLog()

    # round 0: capacity exactly the padded sizes (a full bucket), scale applied
    exact = _padded_total(world, keys)
    bucket = FlatBucket(exact, rank=rank, world=world, mode=mode)
    for k in keys:
        assert not bucket.would_overflow(_grad(rank, k, 0).numel())
        bucket.add(k, _grad(rank, k, 0))
    out["full_used"] = (bucket.used, bucket.capacity, len(bucket))
    out["overflow_when_full"] = bucket.would_overflow(1)
    out["add_when_full"] = error_of(bucket.add, 99, torch.zeros(1))
    flush = bucket.flush(group, scale=SCALE, async_op=async_op, log=log)
    out["empty_after_flush"] = (bucket.is_empty(), bucket.used)
    out["add_in_flight"] = error_of(bucket.add, 0, _grad(rank, 0, 0))
    out["flush_in_flight"] = error_of(bucket.flush, group)
    out["round0"] = [(k, p.clone()) for k, p in flush.wait()]

    # round 1: the same bucket reused, sub-batches flushed whenever the next would overflow
    # (a partial fill in REDUCE_SCATTER mode compacts the rows); no scale
    bucket = FlatBucket(exact // 2 + 3 * world, rank=rank, world=world, mode=mode)
    rounds: list[tuple[int, torch.Tensor]] = []
    flushes = 0
    for k in keys + keys:  # twelve gradients through one bucket
        grad = _grad(rank, k, 1)
        if bucket.would_overflow(grad.numel()):
            rounds += [(kk, p.clone()) for kk, p in bucket.flush(group, async_op=async_op, log=log).wait()]
            flushes += 1
        bucket.add(k, grad)
    rounds += [(kk, p.clone()) for kk, p in bucket.flush(group, async_op=async_op, log=log).wait()]
    flushes += 1
    out["round1"] = rounds
    out["round1_flushes"] = flushes

    # round 2: a nearly empty large bucket (one small gradient): the partial path
    bucket = FlatBucket(64 * world + 1, rank=rank, world=world, mode=mode)
    bucket.add(3, _grad(rank, 3, 2))
    out["round2"] = [(k, p.clone()) for k, p in bucket.flush(group, scale=SCALE, async_op=async_op, log=log).wait()]
    out["round2_capacity"] = bucket.capacity

    # a stale flush handle waited on again must not unlock a newer flush in flight
    bucket.add(1, _grad(rank, 1, 2))
    old = bucket.flush(group, async_op=True)
    old.wait()
    bucket.add(1, _grad(rank, 1, 2))
    new = bucket.flush(group, async_op=True)
    old.wait()
    out["add_after_stale_wait"] = error_of(bucket.add, 1, _grad(rank, 1, 2))
    new.wait()

    out["log"] = log.snapshot()
    return out


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("world", WORLDS)
def test_bucket_partitions_equal_partitions_of_summed_grads(
    pools: PoolSet, world: int, mode: ReduceMode, async_op: bool
) -> None:
    keys = list(range(len(GRAD_SHAPES)))
    exact = _padded_total(world, keys)
    for rank, out in enumerate(pools.run(world, _bucket_worker, mode, async_op)):
        assert out["full_used"] == (exact, exact, len(keys))
        assert out["overflow_when_full"] is True
        assert out["add_when_full"].startswith("ValueError: gradient of 1 elements")
        assert out["empty_after_flush"] == (True, 0)
        assert out["add_in_flight"].startswith("ValueError: bucket is being reduced")
        assert out["flush_in_flight"].startswith("ValueError: bucket is already being reduced")

        assert [k for k, _ in out["round0"]] == keys
        for k, part in out["round0"]:
            assert torch.equal(part, _expected(world, rank, k, 0, SCALE)), ("round0", k)

        assert [k for k, _ in out["round1"]] == keys + keys
        assert out["round1_flushes"] >= 3, "the reused bucket should have flushed several times"
        for k, part in out["round1"]:
            assert torch.equal(part, _expected(world, rank, k, 1, 1.0)), ("round1", k)

        (k, part), = out["round2"]
        assert k == 3 and torch.equal(part, _expected(world, rank, 3, 2, SCALE))
        assert out["round2_capacity"] == (64 * world if world > 1 else 65)  # rounded down to a multiple of world

        assert out["add_after_stale_wait"].startswith("ValueError: bucket is being reduced")

        kind = mode.value
        other = "all_reduce" if mode is ReduceMode.REDUCE_SCATTER else "reduce_scatter"
        assert out["log"][kind]["calls"] == 1 + out["round1_flushes"] + 1
        assert out["log"][other]["calls"] == 0 and out["log"]["all_gather"]["calls"] == 0


def test_bucket_bookkeeping_and_bad_inputs() -> None:
    b = FlatBucket(10, rank=1, world=4)
    assert b.capacity == 8 and b.used == 0 and b.is_empty() and len(b) == 0
    assert b.padded_numel(5) == 8 and b.padded_numel(1) == 4 and b.padded_numel(0) == 4
    assert not b.would_overflow(8) and b.would_overflow(9)
    b.add(0, torch.ones(3))
    assert b.used == 4 and len(b) == 1 and not b.is_empty()
    assert not b.would_overflow(4) and b.would_overflow(5)
    with pytest.raises(ValueError, match=r"gradient of 5 elements \(padded 8\) overflows the bucket: 4 of 8"):
        b.add(1, torch.ones(5))
    with pytest.raises(TypeError, match="gradient dtype torch.float64 differs from the bucket's torch.float32"):
        b.add(1, torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="gradient dtype torch.bfloat16 differs"):
        b.add(1, torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gradient is on meta but the bucket is on cpu"):
        b.add(1, torch.ones(2, device="meta"))
    assert b.used == 4 and len(b) == 1, "refused adds leave the bucket alone"

    empty = FlatBucket(8, rank=0, world=2, mode=ReduceMode.REDUCE_SCATTER)
    with pytest.raises(ValueError, match="flush of an empty bucket"):
        empty.flush(None)  # type: ignore[arg-type]  # refused before the group is used

    with pytest.raises(TypeError, match="capacity must be an int, got float"):
        FlatBucket(8.0, rank=0, world=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="capacity must be an int, got bool"):
        FlatBucket(True, rank=0, world=1)
    with pytest.raises(ValueError, match="capacity must be at least the world size"):
        FlatBucket(3, rank=0, world=4)
    with pytest.raises(ValueError, match="need 0 <= rank < world"):
        FlatBucket(8, rank=4, world=4)
    with pytest.raises(ValueError, match="need 0 <= rank < world"):
        FlatBucket(8, rank=0, world=0)
    with pytest.raises(TypeError, match="floating-point values, got torch.int32"):
        FlatBucket(8, rank=0, world=1, dtype=torch.int32)
    with pytest.raises(TypeError, match="mode must be a ReduceMode"):
        FlatBucket(8, rank=0, world=1, mode="all_reduce")  # type: ignore[arg-type]


def test_bucket_flush_with_no_group_raises_and_keeps_bucket_usable() -> None:
    b = FlatBucket(8, rank=0, world=2)
    b.add(0, torch.ones(3))
    with pytest.raises(ValueError, match="a process group is required"):
        b.flush(None)  # type: ignore[arg-type]
    # the refused flush did not leave the bucket marked in flight, nor lose the gradient
    assert len(b) == 1 and b.used == 4
    b.add(1, torch.ones(2))
    assert len(b) == 2


def _reserved_worker(ctx: WorkerContext, mode: ReduceMode) -> dict[str, Any]:
    """Slices reserved up front, gradients added in a rank-dependent order, one left missing on rank 0."""
    keys = [0, 1, 2, 3]
    bucket = FlatBucket(_padded_total(ctx.world, keys), rank=ctx.rank, world=ctx.world, mode=mode)
    for key in keys:
        bucket.reserve(key, _grad(0, key, 0).numel())
    order = keys[::-1] if ctx.rank % 2 else keys
    skipped = 2 if ctx.rank == 0 else None
    for key in order:
        if key != skipped:
            bucket.add(key, _grad(ctx.rank, key, 0))
    missing, full = bucket.missing(), bucket.is_full()
    bucket.zero_missing()
    parts = dict(bucket.flush(ctx.group, scale=SCALE).wait())
    return {"missing": missing, "full_before": full, "full_after": bucket.is_full() and not bucket.missing(),
            "parts": parts}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 3])
def test_reserved_slices_give_one_layout_whatever_the_order_and_zeros_where_missing(
    pools: PoolSet, world: int, mode: ReduceMode
) -> None:
    for rank, out in enumerate(pools.run(world, _reserved_worker, mode)):
        assert out["missing"] == ([2] if rank == 0 else []) and out["full_before"] == (rank != 0)
        assert out["full_after"]
        for key, part in out["parts"].items():
            full = sum(_grad(r, key, 0).reshape(-1) for r in range(world) if not (r == 0 and key == 2))
            want = partition_of(full * SCALE, rank, world)
            torch.testing.assert_close(part, want, rtol=0, atol=1e-6)
