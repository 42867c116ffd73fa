"""The accelerator double (``tests.accelerator_double``): NCCL's waiting semantics on CPU.

A timed wait is a violation, a plain wait completes with the right data,
``is_completed`` never blocks, an abort unblocks a waiting rank within a
second, the issued order is recorded, a collective inside a ticket may
touch only that ticket's memory, torch's object collectives and
``torch.distributed.checkpoint`` run on it, and host syncs are counted in
backward too. The engine on it: ``test_zero3_accelerator_semantics``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import accelerator_double as double
from tests.accelerator_double import DOUBLE, AcceleratorSemanticsError
from tests.dist_pool import DistPool
from z3kit.stream_check import RecordingStreamPair, StreamOrderChecker


def _group(ctx: Any, **kwargs: Any) -> double.SimGroup:
    return double.new_group(list(range(ctx.world)), **kwargs)


# --------------------------------------------------------------------------- #
# Without processes: registration, the stream_check and device hooks, host syncs
# --------------------------------------------------------------------------- #


def test_registration_is_idempotent_and_maps_to_cpu() -> None:
    from z3kit.device import device_type_for_backend

    double.register()
    double.register()
    assert double.BACKEND in dist.Backend.backend_list
    assert device_type_for_backend(double.BACKEND) == "cpu"


def test_host_syncs_are_counted_with_their_sites_in_backward_too() -> None:
    t = torch.ones(3, requires_grad=True)
    # autograd runs hooks without Python torch-function modes: counted all the same
    def hook(p: torch.Tensor) -> None:
        p.grad.tolist()

    t.register_post_accumulate_grad_hook(hook)
    with DOUBLE.observing() as seen:
        with seen.counting():
            t.sum().item()
            bool(t.sum() > 0)
            (t * 2).sum().backward()
        t.sum().item()  # outside counting: not counted
    assert seen.syncs.calls == ["TensorBase.item", "TensorBase.__bool__", "TensorBase.tolist"]
    assert seen.violations == []
    sites = seen.syncs.sites
    assert all(s.startswith("tests/test_accelerator_semantics.py:") for s in sites), sites
    assert "(hook)" in sites[2]
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # put back


def test_sync_debug_mode_warnings_count_only_synchronizing_calls() -> None:
    from z3kit.host_sync import synchronizing_calls

    # what torch's CUDA sync debug mode warns (the notice first, once per process: seen on an H200)
    seen = [
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations "
        "(Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)",
        "called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp:120.)",
        "some other warning raised inside the block",
        "called a synchronizing CUDA operation\nmore lines",
    ]
    assert synchronizing_calls(seen) == ["called a synchronizing CUDA operation (Triggered internally at "
                                         "c10/cuda/CUDAFunctions.cpp:120.)", "called a synchronizing CUDA operation"]


# --------------------------------------------------------------------------- #
# The double's work handles
# --------------------------------------------------------------------------- #


def run_timed_wait(ctx: Any) -> dict[str, Any]:
    group = _group(ctx)
    with DOUBLE.observing():
        work = dist.all_reduce(torch.ones(3), group=group, async_op=True)
        try:
            work.wait(timedelta(seconds=5))
            caught = ""
        except AcceleratorSemanticsError as e:
            caught = str(e)
        work.wait()  # a plain wait completes it, and keeps the ranks paired
        return {"caught": caught, "violations": list(DOUBLE.violations)}


@pytest.mark.parametrize("world", [1, 2])
def test_a_timed_wait_is_a_violation(pools: Any, world: int) -> None:
    for r in pools.run(world, run_timed_wait):
        assert r["caught"].startswith("all_reduce on z3sim group") and "Work.wait(timeout=5 s)" in r["caught"]
        assert r["violations"] == [r["caught"]]


def run_collectives(ctx: Any) -> dict[str, Any]:
    group, rank, world = _group(ctx), ctx.rank, ctx.world
    with DOUBLE.observing():
        out: dict[str, Any] = {}
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=group)
        out["all_reduce"] = t.tolist()
        gathered = torch.empty(2 * world)
        double.all_gather_single(gathered, torch.full((2,), float(rank)), group=group)
        out["all_gather"] = gathered.tolist()
        part = torch.empty(2)
        double.reduce_scatter_single(part, torch.arange(2.0 * world) * (rank + 1), group=group)
        out["reduce_scatter"] = part.tolist()
        b = torch.full((2,), float(rank))
        work = dist.broadcast(b, group_src=world - 1, group=group, async_op=True)
        work.wait()
        # wait() says nothing about the device: only the lag after the data landed does
        out["completed_after_wait"] = work.is_completed()
        DOUBLE.synchronize()  # tolist() reads outside torch's dispatcher: a stream sync first, as on a GPU
        out["broadcast"] = b.tolist()
        time.sleep(DOUBLE.device_lag_s)
        out["completed_after_lag"] = work.is_completed()
        # the future completes with the collective, with no wait() (DDP's reducer waits so)
        summed = torch.ones(2)
        out["future"] = dist.all_reduce(summed, group=group, async_op=True).get_future().wait()[0].tolist()
        return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_plain_waits_complete_with_the_right_data(pools: Any, world: int) -> None:
    ranks = sum(r + 1 for r in range(world))
    for rank, r in enumerate(pools.run(world, run_collectives)):
        assert r["all_reduce"] == [float(ranks)] * 3
        assert r["all_gather"] == [float(s) for s in range(world) for _ in range(2)]
        assert r["reduce_scatter"] == [float(2 * rank + i) * ranks for i in range(2)]
        assert r["broadcast"] == [float(world - 1)] * 2
        assert r["completed_after_wait"] is False
        assert r["completed_after_lag"] is True
        assert r["future"] == [float(world)] * 2


def run_poll_while_peer_is_late(ctx: Any) -> dict[str, Any]:
    group = _group(ctx)
    if ctx.rank == 1:
        time.sleep(1.0)
    work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    start = time.monotonic()
    polls = [work.is_completed() for _ in range(100)]
    poll_s = time.monotonic() - start
    with DOUBLE.observing():
        work.wait()
        DOUBLE.synchronize()
    time.sleep(DOUBLE.device_lag_s)
    return {"polls": polls, "poll_s": poll_s, "after": work.is_completed()}


def test_is_completed_polls_without_blocking(pools: Any) -> None:
    late = pools.run(2, run_poll_while_peer_is_late)[0]
    assert late["poll_s"] < 0.1, late["poll_s"]  # 100 polls while the peer is a second late
    assert not any(late["polls"])
    assert late["after"] is True


def _all_reduce_with_rank_1_late(ctx: Any, numel: int) -> tuple[torch.Tensor, Any, float]:
    """An all-reduce of ``numel`` elements that rank 1 issues 1 s late, waited on: the
    tensor, the work and when the wait began (call it under ``DOUBLE.observing()``)."""
    group = _group(ctx)
    if ctx.rank == 1:
        time.sleep(1.0)
    t = torch.full((numel,), float(ctx.rank + 1))
    work = dist.all_reduce(t, group=group, async_op=True)
    start = time.monotonic()
    work.wait()
    return t, work, start


def run_wait_while_peer_is_late(ctx: Any) -> dict[str, Any]:
    """Rank 1 issues its side 1 s late: rank 0's ``wait()`` must return at
    once (NCCL's only orders), the work stays uncompleted, and the first
    host operation on the output waits for the data, which is right."""
    out: dict[str, Any] = {}
    with DOUBLE.observing():
        t, work, start = _all_reduce_with_rank_1_late(ctx, 4)
        out["wait_s"] = time.monotonic() - start
        out["completed_after_wait"] = work.is_completed()
        doubled = t * 2  # a host read through torch: waits for the data to land
        out["read_s"] = time.monotonic() - start
        out["value"] = doubled.tolist()
        out["violations"] = list(DOUBLE.violations)
    return out


def test_wait_only_orders_and_the_data_lands_later(pools: Any) -> None:
    early, late = pools.run(2, run_wait_while_peer_is_late, timeout=60)
    assert early["wait_s"] < 0.2, early  # not blocked by the late peer
    assert early["completed_after_wait"] is False, early
    assert early["read_s"] > 0.5, early  # the read waited for the data
    for r in (early, late):
        assert r["value"] == [6.0] * 4, r
        assert r["violations"] == [], r



def run_free_while_peer_is_late(ctx: Any) -> dict[str, Any]:
    """Rank 1 issues its side 1 s late: rank 0 frees the output's storage right
    after ``wait()``. On a device the free is ordered on the compute stream,
    after its wait on the collective; here it must wait for the data to land,
    or the collective would write into freed memory."""
    out: dict[str, Any] = {}
    with DOUBLE.observing():
        t, _, start = _all_reduce_with_rank_1_late(ctx, 4096)
        t.untyped_storage().resize_(0)
        out["free_s"] = time.monotonic() - start
        out["violations"] = list(DOUBLE.violations)
    return out


def test_a_storage_freed_after_wait_waits_for_the_data(pools: Any) -> None:
    early, late = pools.run(2, run_free_while_peer_is_late, timeout=60)
    assert early["free_s"] > 0.5, early  # the free waited for the landing
    assert early["violations"] == [] and late["violations"] == []

def _end(group: Any, how: str) -> None:
    if how == "abort_process_group":
        dist.distributed_c10d._abort_process_group(group)
    elif how == "destroy_process_group":
        dist.destroy_process_group(group)
    else:
        group.abort()


def run_abort_while_waiting(ctx: Any, how: str) -> dict[str, Any]:
    """Rank 0 waits on a collective rank 1 never issues; a thread ends the
    group 0.3 s later ``how`` torch 2.13 lets one (gloo itself would wait for
    its timeout or for the peer's connection to close)."""
    import threading

    group = _group(ctx, timeout=timedelta(seconds=20))
    if ctx.rank != 0:
        # never joins: rank 0 waits until its group is aborted. Every rank ends the group the
        # same way: torch names a new group after how many this process has registered
        _end(group, how)
        return {}
    work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    aborting: list[float] = []

    def abort() -> None:
        time.sleep(0.3)
        aborting.append(time.monotonic())
        _end(group, how)

    threading.Thread(target=abort, daemon=True).start()
    try:
        work.wait()
        caught = ""
    except RuntimeError as e:
        caught = str(e)
    ended = time.monotonic()
    try:
        work.get_future().wait()
        future = ""
    except RuntimeError as e:
        future = str(e)
    seconds = ended - aborting[0]  # from the abort's start to the end of the wait
    try:
        group.allreduce([torch.ones(1)]).wait()
        later = ""
    except RuntimeError as e:
        later = str(e)
    return {"caught": caught, "seconds": seconds, "later": later, "future": future}


@pytest.fixture(scope="module")
def own_pool() -> Iterator[DistPool]:
    """Two ranks of their own: a destroyed group's name comes back for the next
    group made (torch counts the registered ones), so a test that destroys
    groups must not share its processes with tests that make more."""
    pool = DistPool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("how", ["group.abort", "abort_process_group", "destroy_process_group"])
def test_an_abort_unblocks_a_waiting_rank_within_a_second(own_pool: DistPool, how: str) -> None:
    r = own_pool.run(run_abort_while_waiting, how, timeout=30)[0]
    assert "aborted" in r["caught"], r
    assert 0 < r["seconds"] < 1.0, r  # the wait ends with the abort, not with gloo's timeout
    assert "aborted" in r["later"], r
    assert "aborted" in r["future"], r


def run_issue_order(ctx: Any) -> dict[str, Any]:
    group = _group(ctx)
    with DOUBLE.observing():
        dist.all_reduce(torch.ones(5, dtype=torch.float64), group=group)
        double.all_gather_single(torch.empty(3 * ctx.world, dtype=torch.int32), torch.ones(3, dtype=torch.int32), group=group)
        dist.broadcast(torch.ones(2), group_src=0, group=group)
        dist.barrier(group=group)
        return DOUBLE.issued()


@pytest.mark.parametrize("world", [2, 4])
def test_the_issued_order_is_recorded_per_group(pools: Any, world: int) -> None:
    results = pools.run(world, run_issue_order)
    assert all(r == results[0] for r in results)
    (issued,) = results[0].values()
    assert issued == [("all_reduce", 5, "torch.float64"), ("all_gather", 3, "torch.int32"),
                      ("broadcast", 2, "torch.float32"), ("barrier", 0, "")]


def run_tickets(ctx: Any) -> dict[str, Any]:
    group = _group(ctx)
    checker = StreamOrderChecker()
    pair = RecordingStreamPair(checker)
    buf, shard, full, other = torch.zeros(8), torch.ones(3), torch.empty(3 * ctx.world), torch.zeros(4)
    caught = {}
    with DOUBLE.observing(checker):
        # inside: a view of the ticket's buffer, and a gather from its reads into its writes
        with pair.communicate(reads=[buf], writes=[buf], label="bucket") as ticket:
            dist.all_reduce(buf[2:5], group=group)
        pair.complete(ticket, lambda: None)
        with pair.communicate(reads=[shard], writes=[full], label="gather") as ticket:
            double.all_gather_single(full, shard, group=group)
        pair.complete(ticket, lambda: None)
        dist.all_reduce(other, group=group)  # outside every communicate: not checked
        clean = list(DOUBLE.violations)
        for name, reads, writes, issue in [
            ("not in the ticket", [buf], [buf], lambda: dist.all_reduce(other, group=group)),
            ("written, only read", [shard], [full], lambda: double.all_gather_single(full, shard.clone(), group=group)),
            ("writes what it reads", [shard, full], [], lambda: double.all_gather_single(full, shard, group=group)),
        ]:
            with pair.communicate(reads=reads, writes=writes, label=name) as ticket:
                try:
                    issue()
                    caught[name] = ""
                except AcceleratorSemanticsError as e:
                    caught[name] = str(e)
            pair.complete(ticket, lambda: None)
        return {"clean": clean, "caught": caught, "violations": list(DOUBLE.violations)}


@pytest.mark.parametrize("world", [1, 2])
def test_a_collective_inside_a_ticket_uses_only_its_buffers(pools: Any, world: int) -> None:
    for r in pools.run(world, run_tickets):
        assert r["clean"] == []
        for name, message in r["caught"].items():
            assert message.startswith("buffer outside a ticket: "), (name, message)
            assert repr(name) in message
        assert len(r["violations"]) == 3


def run_objects_and_checkpoint(ctx: Any) -> dict[str, Any]:
    import tempfile

    import torch.distributed.checkpoint as dcp

    group, rank, world = _group(ctx), ctx.rank, ctx.world
    with DOUBLE.observing():
        out: dict[str, Any] = {}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, {"rank": rank, "pad": "x" * rank}, group=group)
        out["all_gather_object"] = everyone
        box: list[Any] = [tempfile.mkdtemp(prefix="z3sim-dcp-") if rank == 0 else None]
        dist.broadcast_object_list(box, group_src=0, group=group)
        out["broadcast_object_list"] = box[0]
        at_root: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(("from", rank), at_root, group_dst=0, group=group)
        out["gather_object"] = at_root
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, [f"to {r}" for r in range(world)] if rank == 0 else None, group_src=0, group=group)
        out["scatter_object_list"] = mine[0]
        dist.barrier(group=group)
        state = {f"w{rank}": torch.full((3,), float(rank)), "shared": torch.arange(4.0)}
        dcp.save(state, checkpoint_id=box[0], process_group=group)
        loaded = {f"w{rank}": torch.zeros(3), "shared": torch.zeros(4)}
        dcp.load(loaded, checkpoint_id=box[0], process_group=group)
        out["dcp"] = all(torch.equal(loaded[k], state[k]) for k in state)
        out["violations"] = list(DOUBLE.violations)
        return out


@pytest.mark.parametrize("world", [2, 4])
def test_object_collectives_and_checkpoints_run_on_it(pools: Any, world: int) -> None:
    results = pools.run(world, run_objects_and_checkpoint)
    for rank, r in enumerate(results):
        assert r["all_gather_object"] == [{"rank": s, "pad": "x" * s} for s in range(world)]
        assert r["broadcast_object_list"] == results[0]["broadcast_object_list"]
        assert r["gather_object"] == ([("from", s) for s in range(world)] if rank == 0 else None)
        assert r["scatter_object_list"] == f"to {rank}"
        assert r["dcp"] is True
        assert r["violations"] == []
