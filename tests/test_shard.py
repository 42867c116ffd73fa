"""Parameter shards: layout, status transitions, gather/release on real gloo groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from tests.errors import error_of
from z3kit.collectives import CollectiveKind, CollectiveLog
from z3kit.shard import GatherHandle, ParamShard, ParamStatus, gather_shards, partition_of, shard_numel_for

WORLDS = [1, 2, 4]
# numel 21 (not divisible by 2 or 4), 3 and 1 (smaller than world 4), 16 (divisible), 5
SHAPES = [(7, 3), (3,), (1,), (4, 4), (5, 1)]


def _param(i: int, shape: tuple[int, ...]) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(77 + i)
    return torch.nn.Parameter(torch.randn(shape, generator=g))


# --- layout, no process group ---------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "world", "expected"), [(21, 1, 21), (21, 2, 11), (21, 4, 6), (16, 4, 4), (3, 4, 1), (1, 4, 1), (0, 2, 1)]
)
def test_shard_numel_for(numel: int, world: int, expected: int) -> None:
    assert shard_numel_for(numel, world) == expected


@pytest.mark.parametrize(("numel", "world"), [(21, 4), (3, 4), (16, 4), (5, 2), (1, 1)])
def test_partitions_tile_the_padded_flat_tensor(numel: int, world: int) -> None:
    flat = torch.arange(1, numel + 1, dtype=torch.float32)
    parts = [partition_of(flat, r, world) for r in range(world)]
    size = shard_numel_for(numel, world)
    assert all(p.shape == (size,) and p.is_contiguous() for p in parts)
    joined = torch.cat(parts)
    assert torch.equal(joined[:numel], flat)
    assert not joined[numel:].any(), "padding must be zeros"
    parts[0].fill_(-1)
    assert flat[0] == 1, "a partition is a copy, not a view"


def test_partition_of_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="needs a flat tensor"):
        partition_of(torch.ones(2, 2), 0, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        partition_of(torch.ones(4), 2, 2)
    with pytest.raises(ValueError, match="world size must be >= 1"):
        shard_numel_for(4, 0)


def test_from_param_shards_and_releases_locally() -> None:
    p = _param(0, (7, 3))
    full = p.detach().clone()
    shard = ParamShard.from_param(p, rank=3, world=4)
    assert shard.status is ParamStatus.NOT_AVAILABLE
    assert p.data.numel() == 0 and p.shape == (0,)
    assert shard.shape == (7, 3) and shard.numel == 21 and shard.shard_numel == 6 and shard.padded_numel == 24
    assert torch.equal(shard.shard, partition_of(full.reshape(-1), 3, 4))
    # install from a locally assembled padded buffer, then release again
    padded = torch.cat([partition_of(full.reshape(-1), r, 4) for r in range(4)])
    with pytest.raises(ValueError, match="materialize"):
        shard.install()  # nothing to read yet
    shard.materialize().copy_(padded)
    shard.install()
    assert shard.status.name == "AVAILABLE" and torch.equal(p.data, full)
    view = p.data.t()  # what autograd saves for F.linear on a CPU: a view of the data
    shard.release()
    assert shard.status is ParamStatus.NOT_AVAILABLE and p.data.numel() == 0
    # the memory is gone even though a view of it is still referenced ...
    assert view.untyped_storage().nbytes() == 0 and shard.full.untyped_storage().nbytes() == 0
    # ... and the view reads the values again once they are gathered back
    shard.materialize().copy_(padded)
    shard.install()
    assert torch.equal(view, full.t())
    shard.release()
    shard.release()  # releasing a released parameter is harmless
    # load_full overwrites the shard
    shard.load_full(full * 2)
    assert torch.equal(shard.shard, partition_of(full.reshape(-1) * 2, 3, 4))
    # a lower-precision shard
    q = _param(1, (5,))
    half = ParamShard.from_param(q, rank=0, world=2, dtype=torch.bfloat16)
    assert half.shard.dtype == torch.bfloat16


def test_from_param_into_one_flat_buffer_gathers_without_concatenation() -> None:
    """``out=``: shards live back to back in one buffer (a unit of a runtime);
    a coalesced gather then reads that buffer as one view, no concatenation."""
    params = [_param(i, shape) for i, shape in enumerate([(7, 3), (3,), (5, 1)])]
    fulls = [p.detach().clone() for p in params]
    world, rank = 4, 1
    sizes = [shard_numel_for(p.numel(), world) for p in params]
    flat = torch.full((sum(sizes),), float("nan"))
    shards = [ParamShard.from_param(p, rank, world, out=v) for p, v in zip(params, flat.split(sizes))]
    for s, full in zip(shards, fulls):
        assert s.shard.data_ptr() >= flat.data_ptr() and s.status is ParamStatus.NOT_AVAILABLE
        assert torch.equal(s.shard, partition_of(full.reshape(-1), rank, world))
    assert not flat.isnan().any(), "every element, padding included, was written"
    from z3kit.shard import _adjacent_view

    view = _adjacent_view([s.shard for s in shards])
    assert view is not None and view.data_ptr() == flat.data_ptr() and view.numel() == flat.numel()
    with pytest.raises(ValueError, match="elements"):
        ParamShard.from_param(_param(5, (7, 3)), rank, world, out=torch.empty(5))
    with pytest.raises(ValueError, match="contiguous flat"):
        ParamShard.from_param(_param(5, (7, 3)), rank, world, out=torch.empty(12)[::2])
    with pytest.raises(TypeError, match="dtype"):
        ParamShard.from_param(_param(5, (7, 3)), rank, world, torch.float64, out=torch.empty(6))


def test_param_shard_rejects_bad_inputs() -> None:
    with pytest.raises(TypeError, match="expected a torch.nn.Parameter, got Tensor"):
        ParamShard.from_param(torch.ones(3), rank=0, world=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        ParamShard.from_param(_param(0, (3,)), rank=2, world=2)
    shard = ParamShard.from_param(_param(0, (7, 3)), rank=0, world=2)
    with pytest.raises(ValueError, match="install before materialize"):
        shard.install()
    with pytest.raises(ValueError, match="load_full needs 21 elements, got 22"):
        shard.load_full(torch.zeros(22))
    with pytest.raises(ValueError, match="gather_shards needs at least one shard"):
        gather_shards([], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a process group is required"):
        gather_shards([shard], None)  # type: ignore[arg-type]
    assert shard.status is ParamStatus.NOT_AVAILABLE, "a refused gather leaves the status alone"
    with pytest.raises(ValueError, match="the same shard more than once"):
        gather_shards([shard, shard], None)  # type: ignore[arg-type]
    other_world = ParamShard.from_param(_param(1, (3,)), rank=0, world=4)
    with pytest.raises(ValueError, match="one rank and world size"):
        gather_shards([shard, other_world], None)  # type: ignore[arg-type]
    other_dtype = ParamShard.from_param(_param(2, (3,)), rank=0, world=2, dtype=torch.float64)
    with pytest.raises(TypeError, match="one dtype and device"):
        gather_shards([shard, other_dtype], None)  # type: ignore[arg-type]


# --- on gloo ranks -------------------------------------------------------------------


def _gather_worker(ctx: WorkerContext) -> dict[str, Any]:
    rank, world, group = ctx.rank, ctx.world, ctx.group
    params = [_param(i, s) for i, s in enumerate(SHAPES)]
    originals = [p.detach().clone() for p in params]
    shards = [ParamShard.from_param(p, rank, world) for p in params]
    out: dict[str, Any] = {"released_numels": [p.data.numel() for p in params]}
    log = CollectiveLog()

    # one at a time, synchronous
    equal = []
    for s, orig in zip(shards, originals):
        h = gather_shards([s], group, log=log)
        assert isinstance(h, GatherHandle) and h.done
        equal.append(s.status is ParamStatus.AVAILABLE and torch.equal(s.param.data, orig))
        s.release()
    out["single_equal"] = equal
    out["single_calls"] = log.calls[CollectiveKind.ALL_GATHER]

    # bad transition: gathering an AVAILABLE parameter
    gather_shards([shards[0]], group)
    out["gather_available"] = error_of(gather_shards, [shards[0]], group)
    out["gather_mixed"] = error_of(gather_shards, [shards[1], shards[0]], group)
    out["status_after_refusal"] = shards[1].status
    shards[0].release()

    # asynchronous, coalesced: INFLIGHT with empty data until wait
    log.reset()
    h = gather_shards(shards, group, async_op=True, log=log)
    out["async_done_before"] = h.done
    out["inflight"] = [s.status for s in shards]
    out["inflight_numels"] = [s.param.data.numel() for s in shards]
    out["gather_inflight"] = error_of(gather_shards, [shards[2]], group)
    out["release_inflight"] = error_of(shards[2].release)
    h.wait()
    h.wait()
    out["async_done_after"] = h.done
    out["coalesced_status"] = [s.status for s in shards]
    out["coalesced_equal"] = [torch.equal(s.param.data, o) for s, o in zip(shards, originals)]
    out["coalesced_log"] = log.snapshot()["all_gather"]
    out["coalesced_numel"] = h.numel
    # each parameter owns its storage: releasing one frees it alone
    ptrs = {s.param.data.untyped_storage().data_ptr() for s in shards}
    out["distinct_storages"] = len(ptrs)
    # one rank: the parameter is its shard, and a release leaves the shard's values in place
    out["views_shard"] = [s.param.data.data_ptr() == s.shard.data_ptr() for s in shards]
    for s in shards:
        s.release()

    # synchronous coalesced gather of a subset
    log.reset()
    gather_shards(shards[1:4], group, log=log)
    out["subset_equal"] = [torch.equal(s.param.data, o) for s, o in zip(shards[1:4], originals[1:4])]
    out["subset_calls"] = log.total_calls()
    for s in shards[1:4]:
        s.release()

    # a wrong-world shard reaches the collective's size check
    wrong = ParamShard.from_param(_param(9, (6,)), 0, world + 1)
    out["wrong_world"] = error_of(gather_shards, [wrong], group)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_gather_release_on_gloo(pools: PoolSet, world: int) -> None:
    n = len(SHAPES)
    for out in pools.run(world, _gather_worker):
        assert out["released_numels"] == [0] * n
        assert out["single_equal"] == [True] * n
        # one rank: the shard is the full parameter (the Note at world 1): no collective, no copy
        assert out["single_calls"] == (0 if world == 1 else n)
        assert out["views_shard"] == [world == 1] * n
        assert out["gather_available"].startswith("ValueError: cannot gather a parameter whose status is AVAILABLE")
        assert "status is AVAILABLE" in out["gather_mixed"]
        assert out["status_after_refusal"] is ParamStatus.NOT_AVAILABLE
        assert out["async_done_before"] is False
        assert out["inflight"] == [ParamStatus.INFLIGHT] * n
        assert out["inflight_numels"] == [0] * n
        assert out["gather_inflight"].startswith("ValueError: cannot gather a parameter whose status is INFLIGHT")
        assert out["release_inflight"].startswith("ValueError: cannot release a parameter whose gather is in flight")
        assert out["async_done_after"] is True
        assert out["coalesced_status"] == [ParamStatus.AVAILABLE] * n
        assert out["coalesced_equal"] == [True] * n
        shard_bytes = sum(shard_numel_for(torch.Size(s).numel(), world) for s in SHAPES) * 4
        assert out["coalesced_log"] == ({"calls": 0, "bytes": 0} if world == 1 else {"calls": 1, "bytes": shard_bytes})
        assert out["coalesced_numel"] == sum(torch.Size(s).numel() for s in SHAPES)
        assert out["distinct_storages"] == n
        assert out["subset_equal"] == [True] * 3 and out["subset_calls"] == (0 if world == 1 else 1)
        assert out["wrong_world"].startswith("ValueError: all_gather output has")


def _autograd_worker(ctx: WorkerContext, coalesced: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    lin = torch.nn.Linear(5, 3)
    ref = torch.nn.Linear(5, 3)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(ctx.rank))
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)

    shards = [ParamShard.from_param(p, ctx.rank, ctx.world) for p in lin.parameters()]  # weight, bias
    groups = [shards] if coalesced else [[s] for s in shards]

    def gather() -> None:
        for g in groups:
            gather_shards(g, ctx.group)

    gather()
    y = lin(x)  # forward with the gathered weight
    for s in shards:
        s.release()  # post-forward: only shards resident
    assert lin.weight.data.numel() == 0
    loss = (y * torch.arange(3.0)).sum()
    gather()  # pre-backward
    loss.backward()
    for s in shards:
        s.release()
    # second step through the same parameters: gradients accumulate as usual
    gather()
    (lin(x).square()).sum().backward()

    ((ref(x_ref) * torch.arange(3.0)).sum()).backward()
    (ref(x_ref).square()).sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None and x.grad is not None
    assert ref.weight.grad is not None and ref.bias.grad is not None and x_ref.grad is not None
    return {
        "w": lin.weight.grad,
        "w_ref": ref.weight.grad,
        "b": lin.bias.grad,
        "b_ref": ref.bias.grad,
        "x": x.grad,
        "x_ref": x_ref.grad,
        "y": y.detach(),
        "y_ref": ref(x_ref).detach(),
    }


@pytest.mark.parametrize("coalesced", [False, True], ids=["single", "coalesced"])
@pytest.mark.parametrize("world", [2, 4])
def test_autograd_survives_release_and_regather(pools: PoolSet, world: int, coalesced: bool) -> None:
    for out in pools.run(world, _autograd_worker, coalesced):
        for name in ("w", "b", "x", "y"):
            assert torch.equal(out[name], out[f"{name}_ref"]), name


def test_autograd_survives_release_and_regather_world_1(pools: PoolSet) -> None:
    (out,) = pools.run(1, _autograd_worker, True)
    for name in ("w", "b", "x", "y"):
        assert torch.equal(out[name], out[f"{name}_ref"]), name
