"""Collectives on real gloo groups, compared bit for bit with plain torch.

Inputs are multiples of 1/64 in a small range, so every fp32 sum is exact
whatever order gloo adds in; a scale then rounds once, exactly as
``sum * scale`` does in the reference.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from z3kit.collectives import (
    CollectiveKind,
    CollectiveLog,
    Pending,
    all_gather,
    all_reduce,
    broadcast,
    reduce_scatter,
)

WORLDS = [1, 2, 4]
SCALE = 1 / 3  # not a power of two: the result rounds, identically in the reference


def _values(rank: int, numel: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-4096, 4096, (numel,), generator=g).to(torch.float32) / 64


def _collectives_worker(ctx: WorkerContext, async_op: bool) -> dict[str, Any]:
    world, rank = ctx.world, ctx.rank
    log = CollectiveLog()
    out: dict[str, Any] = {}

    # all-gather: 5 elements per rank
    inp = _values(rank, 5, salt=1)
    gathered = torch.full((5 * world,), float("nan"))
    p = all_gather(gathered, inp, ctx.group, async_op=async_op, log=log)
    out["ag_done_before_wait"] = p.done
    p.wait()
    out["all_gather"] = gathered

    # reduce-scatter: 7 elements per rank's chunk, with and without scale
    inp = _values(rank, 7 * world, salt=2)
    rs = torch.empty(7)
    rs_scaled = torch.empty(7)
    p1 = reduce_scatter(rs, inp, ctx.group, async_op=async_op, log=log)
    p2 = reduce_scatter(rs_scaled, inp, ctx.group, scale=SCALE, async_op=async_op, log=log)
    out["rs_done_before_wait"] = p1.done
    p1.wait()
    p2.wait()
    p2.wait()  # waiting twice must not scale twice
    assert p2.is_completed()
    out["reduce_scatter"], out["reduce_scatter_scaled"] = rs, rs_scaled

    # all-reduce in place, 11 elements (odd, not divisible by any world)
    ar = _values(rank, 11, salt=3)
    ar_scaled = ar.clone()
    p3 = all_reduce(ar, ctx.group, async_op=async_op, log=log)
    p4 = all_reduce(ar_scaled, ctx.group, scale=SCALE, async_op=async_op, log=log)
    out["ar_done_before_wait"] = p3.done
    for p in (p3, p4, p4):
        p.wait()
    out["all_reduce"], out["all_reduce_scaled"] = ar, ar_scaled

    # a contiguous view with a storage offset (how buckets pass their used region)
    big = torch.zeros(20)
    big[3:14] = _values(rank, 11, salt=3)
    all_reduce(big[3:14], ctx.group, async_op=async_op, log=log).wait()
    out["all_reduce_view"] = big

    # broadcast from the last rank
    b = _values(rank, 6, salt=4)
    broadcast(b, world - 1, ctx.group, log=log)
    out["broadcast"] = b

    out["log"] = log.snapshot()
    out["total_calls"] = log.total_calls()
    log.reset()
    out["log_after_reset"] = log.total_calls(), sum(log.bytes.values())
    return out


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world", WORLDS)
def test_collectives_match_plain_torch(pools: PoolSet, world: int, async_op: bool) -> None:
    results = pools.run(world, _collectives_worker, async_op)
    ag_ref = torch.cat([_values(r, 5, salt=1) for r in range(world)])
    rs_total = sum(_values(r, 7 * world, salt=2) for r in range(world))
    ar_total = sum(_values(r, 11, salt=3) for r in range(world))
    assert isinstance(rs_total, torch.Tensor) and isinstance(ar_total, torch.Tensor)
    for rank, out in enumerate(results):
        assert torch.equal(out["all_gather"], ag_ref)
        chunk = rs_total[7 * rank : 7 * (rank + 1)]
        assert torch.equal(out["reduce_scatter"], chunk)
        assert torch.equal(out["reduce_scatter_scaled"], chunk * SCALE)
        assert torch.equal(out["all_reduce"], ar_total)
        assert torch.equal(out["all_reduce_scaled"], ar_total * SCALE)
        assert torch.equal(out["all_reduce_view"][3:14], ar_total)
        assert not out["all_reduce_view"][:3].any() and not out["all_reduce_view"][14:].any()
        assert torch.equal(out["broadcast"], _values(world - 1, 6, salt=4))
        # a synchronous call hands back a handle that is already done
        for key in ("ag_done_before_wait", "rs_done_before_wait", "ar_done_before_wait"):
            assert out[key] is (not async_op), key
        assert out["log"] == {
            "all_gather": {"calls": 1, "bytes": 5 * 4},
            "reduce_scatter": {"calls": 2, "bytes": 2 * 7 * world * 4},
            "all_reduce": {"calls": 3, "bytes": 3 * 11 * 4},
            "broadcast": {"calls": 1, "bytes": 6 * 4},
        }
        assert out["total_calls"] == 7
        assert out["log_after_reset"] == (0, 0)


def _try(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _bad_input_worker(ctx: WorkerContext) -> dict[str, Any]:
    world, g = ctx.world, ctx.group
    log = CollectiveLog()
    strided = torch.zeros(4 * world, 2)[:, 0]  # non-contiguous, right size
    out: dict[str, Any] = {
        "ag_no_group": _try(all_gather, torch.empty(3 * world), torch.ones(3), None, log=log),
        "rs_no_group": _try(reduce_scatter, torch.empty(3), torch.ones(3 * world), None, log=log),
        "ar_no_group": _try(all_reduce, torch.ones(3), None, log=log),
        "bc_no_group": _try(broadcast, torch.ones(3), 0, None, log=log),
        "ag_strided_in": _try(all_gather, torch.empty(4 * world * world), strided, g, log=log),
        "ag_strided_out": _try(all_gather, strided, torch.ones(4), g, log=log),
        "rs_strided_in": _try(reduce_scatter, torch.empty(4), strided, g, log=log),
        "ar_strided": _try(all_reduce, strided, g, log=log),
        "bc_strided": _try(broadcast, strided, 0, g, log=log),
        "ag_size": _try(all_gather, torch.empty(3 * world + 1), torch.ones(3), g, log=log),
        "rs_size": _try(reduce_scatter, torch.empty(3), torch.ones(3 * world + 1), g, log=log),
        "ag_dtype": _try(all_gather, torch.empty(3 * world, dtype=torch.float64), torch.ones(3), g, log=log),
        "rs_dtype": _try(reduce_scatter, torch.empty(3, dtype=torch.bfloat16), torch.ones(3 * world), g, log=log),
        "ag_device": _try(all_gather, torch.empty(3 * world, device="meta"), torch.ones(3), g, log=log),
        "ag_not_tensor": _try(all_gather, torch.empty(3 * world), [1.0, 2.0, 3.0], g, log=log),
        "ar_not_tensor": _try(all_reduce, 3.0, g, log=log),
        "ar_nan_scale": _try(all_reduce, torch.ones(3), g, scale=math.nan, log=log),
        "rs_inf_scale": _try(reduce_scatter, torch.empty(3), torch.ones(3 * world), g, scale=math.inf, log=log),
        "ar_str_scale": _try(all_reduce, torch.ones(3), g, scale="0.5", log=log),
        "ar_int_tensor_scale": _try(all_reduce, torch.ones(3, dtype=torch.int64), g, scale=0.5, log=log),
        "bc_src": _try(broadcast, torch.ones(3), world, g, log=log),
        "bc_src_neg": _try(broadcast, torch.ones(3), -1, g, log=log),
    }
    # nothing was issued, so nothing was counted; and the group still works
    out["calls_after_errors"] = log.total_calls()
    t = torch.ones(2, dtype=torch.int64)
    all_reduce(t, g, log=log)  # integer sum with no scale is fine
    out["int_sum"] = t
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_collectives_reject_bad_inputs(pools: PoolSet, world: int) -> None:
    out = pools.run(world, _bad_input_worker)[0]
    expected = {
        "ag_no_group": ("ValueError", "a process group is required"),
        "rs_no_group": ("ValueError", "a process group is required"),
        "ar_no_group": ("ValueError", "a process group is required"),
        "bc_no_group": ("ValueError", "a process group is required"),
        "ag_strided_in": ("ValueError", "input must be contiguous"),
        "ag_strided_out": ("ValueError", "output must be contiguous"),
        "rs_strided_in": ("ValueError", "input must be contiguous"),
        "ar_strided": ("ValueError", "tensor must be contiguous"),
        "bc_strided": ("ValueError", "tensor must be contiguous"),
        "ag_size": ("ValueError", "all_gather output has"),
        "rs_size": ("ValueError", "reduce_scatter input has"),
        "ag_dtype": ("TypeError", "output dtype torch.float64 differs from input dtype torch.float32"),
        "rs_dtype": ("TypeError", "output dtype torch.bfloat16 differs"),
        "ag_device": ("ValueError", "output is on meta but input is on cpu"),
        "ag_not_tensor": ("TypeError", "input must be a torch.Tensor, got list"),
        "ar_not_tensor": ("TypeError", "tensor must be a torch.Tensor, got float"),
        "ar_nan_scale": ("ValueError", "scale must be finite"),
        "rs_inf_scale": ("ValueError", "scale must be finite"),
        "ar_str_scale": ("TypeError", "scale must be a real number"),
        "ar_int_tensor_scale": ("TypeError", "needs a floating-point tensor"),
        "bc_src": ("ValueError", "src_rank must be in"),
        "bc_src_neg": ("ValueError", "src_rank must be in"),
    }
    for key, (exc, fragment) in expected.items():
        got_exc, message = out[key]
        assert got_exc == exc and fragment in message, (key, out[key])
    assert out["calls_after_errors"] == 0
    assert torch.equal(out["int_sum"], torch.full((2,), world, dtype=torch.int64))


def test_pending_runs_follow_up_once_without_work() -> None:
    calls: list[int] = []
    p = Pending(None, lambda: calls.append(1))
    assert not p.done and p.is_completed()
    p.wait()
    p.wait()
    assert p.done and calls == [1]


def test_collective_log_counts_per_kind() -> None:
    log = CollectiveLog()
    log.record(CollectiveKind.ALL_GATHER, 10)
    log.record(CollectiveKind.ALL_GATHER, 6)
    log.record(CollectiveKind.REDUCE_SCATTER, 4)
    assert log.calls[CollectiveKind.ALL_GATHER] == 2 and log.bytes[CollectiveKind.ALL_GATHER] == 16
    assert log.total_calls() == 3
    snap = log.snapshot()
    assert snap["reduce_scatter"] == {"calls": 1, "bytes": 4}
    assert snap["all_reduce"] == {"calls": 0, "bytes": 0}
    log.record(CollectiveKind.ALL_REDUCE, 1)
    assert snap["all_reduce"] == {"calls": 0, "bytes": 0}, "a snapshot is a copy"
    # two logs never share counters
    assert CollectiveLog().total_calls() == 0


def _large_gather_worker(ctx: WorkerContext, async_op: bool) -> dict[str, Any]:
    from z3kit.collectives import GLOO_BROADCAST_GATHER_MIN_NUMEL

    n = GLOO_BROADCAST_GATHER_MIN_NUMEL + 3  # large enough for the broadcast path on gloo
    log = CollectiveLog()
    inp = _values(ctx.rank, n, salt=7)
    out = torch.empty(ctx.world * n)
    pending = all_gather(out, inp, ctx.group, async_op=async_op, log=log)
    pending.wait()
    expected = torch.cat([_values(r, n, salt=7) for r in range(ctx.world)])
    return {"equal": torch.equal(out, expected), "done": pending.done, "log": log.snapshot()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("async_op", [False, True])
def test_large_gloo_gather_runs_as_broadcasts(pools: PoolSet, world: int, async_op: bool) -> None:
    for r in pools.run(world, _large_gather_worker, async_op):
        assert r["equal"] and r["done"]
        # one broadcast from every rank, each logged as what it is
        assert r["log"]["broadcast"]["calls"] == world
        assert r["log"]["all_gather"]["calls"] == 0


def _late_gather(ctx: WorkerContext) -> dict[str, Any]:
    import time

    from z3kit.collectives import all_gather

    if ctx.rank == 1:
        time.sleep(0.5)  # rank 0's first looks find the gather unfinished
    out = torch.empty(ctx.world)
    pending = all_gather(out, torch.tensor([float(ctx.rank)]), ctx.group, async_op=True)
    looks = 0
    while not pending.is_completed(timeout_s=0.05):
        looks += 1
    pending.wait()
    return {"looks": looks, "out": out.tolist()}


def test_pending_is_completed_waits_up_to_its_timeout(pools: PoolSet) -> None:
    early, late = pools.run(2, _late_gather)
    assert early["out"] == late["out"] == [0.0, 1.0]
    # rank 0 looked again and again while rank 1 slept (0.5 s in slices of 0.05 s), without losing the gather
    assert 2 <= early["looks"] <= 20 and late["looks"] <= 2  # blocked in slices, not spinning
