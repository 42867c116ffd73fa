"""RecordingStreamPair: the stream-order rules it checks, and that it catches their breach."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from tests.errors import error_of
from z3kit.flat_bucket import FlatBucket
from z3kit.shard import ParamShard, gather_shards
from z3kit.stream_check import RecordingStreamPair, StreamOrderChecker, StreamOrderError


def _issue(pair: RecordingStreamPair, reads: list[torch.Tensor], writes: list[torch.Tensor], label: str) -> Any:
    with pair.communicate(reads=reads, writes=writes, label=label) as ticket:
        for w in writes:
            w.fill_(7.0)  # the "collective": on the comm side, never checked
    return ticket


def test_compute_may_not_touch_what_a_communication_writes_before_completing_it() -> None:
    pair = RecordingStreamPair()
    src, out = torch.ones(8), torch.zeros(8)
    ticket = _issue(pair, [src], [out], "gather")
    with pair.checker.watching():
        assert float(src.sum()) == 8.0  # reading what the communication only reads is fine
        view = out[2:4]  # a view reads nothing
        with pytest.raises(StreamOrderError, match=r"compute ran aten\.\w+.* communication #1 \('gather'\) writes"):
            view.sum()
        pair.complete(ticket, lambda: None)
        assert float(out.sum()) == 56.0
    assert pair.checker.events == [("issue", 1, "gather"), ("complete", 1, "gather")]


def test_compute_may_not_overwrite_what_a_communication_still_reads() -> None:
    pair = RecordingStreamPair()
    src, out = torch.ones(8), torch.zeros(8)
    ticket = _issue(pair, [src], [out], "reduce")
    with pair.checker.watching():
        with pytest.raises(StreamOrderError, match="writing memory that communication #1 .* still reads"):
            src[:3].mul_(2.0)
        torch.zeros(3).add_(src[:3])  # reading it into other memory is fine
        pair.complete(ticket, lambda: None)
        src.mul_(2.0)
    assert pair.checker.checked_ops >= 2


def test_a_communication_may_not_reuse_memory_another_one_still_uses() -> None:
    checker = StreamOrderChecker()
    gathers, reductions = RecordingStreamPair(checker), RecordingStreamPair(checker)
    buf = torch.zeros(16)
    first = _issue(gathers, [torch.ones(4)], [buf[:8]], "first")
    with pytest.raises(StreamOrderError, match="'second' writes memory that communication #1 \\('first'\\) still uses"):
        _issue(reductions, [torch.ones(4)], [buf[4:12]], "second")
    _issue(reductions, [torch.ones(4)], [buf[8:]], "disjoint")  # other memory of the same storage is fine
    with pytest.raises(StreamOrderError, match="complete of a ticket .* this pair did not issue"):
        reductions.complete(first, lambda: None)
    gathers.complete(first, lambda: None)
    assert checker.inflight() == ["disjoint"] and checker.issued == 2 and checker.completed == 1


def test_delays_are_refused_when_negative() -> None:
    assert error_of(RecordingStreamPair, delay_s=-1.0) == "ValueError: delay_s must be >= 0, got -1.0"


def _order_error(fn: Any) -> str:
    try:
        fn()
    except StreamOrderError as e:
        return f"StreamOrderError: {e}"
    return "no error"


def _catches_early_use_worker(ctx: WorkerContext) -> dict[str, str]:
    out = {}
    pair = RecordingStreamPair(delay_s=0.001, seed=ctx.rank)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    shards = [ParamShard.from_param(p, ctx.rank, ctx.world) for p in params]
    with pair.checker.watching():
        # one parameter is gathered straight into its full buffer
        handle = gather_shards(shards[:1], ctx.group, streams=pair, async_op=True)
        out["early"] = _order_error(lambda: shards[0].full.sum())
        handle.wait()
        out["after"] = f"{float(params[0].sum()):.4f}"
        # several: into a staging buffer that compute never sees, copied out on completion
        shards[0].release()
        gather_shards(shards, ctx.group, streams=pair, async_op=True).wait()
        out["coalesced"] = f"{float(params[0].sum()):.4f} {float(params[1].sum()):.4f}"

        bucket = FlatBucket(8 * ctx.world, rank=ctx.rank, world=ctx.world)
        bucket.add(0, torch.full((6,), float(ctx.rank + 1)))
        flush = bucket.flush(ctx.group, streams=pair, async_op=True)
        out["bucket_early"] = _order_error(lambda: bucket.buffer.sum())
        out["parts"] = repr([p.tolist() for _, p in flush.wait()])
    return out


def test_gathers_and_bucket_flushes_are_caught_when_used_before_their_wait(pools: PoolSet) -> None:
    torch.manual_seed(0)
    expected = f"{float(torch.randn(5, 3).sum()):.4f}"
    second = f"{float(torch.randn(4).sum()):.4f}"
    for out in pools.run(2, _catches_early_use_worker):
        assert out["early"].startswith("StreamOrderError: compute ran aten.sum")
        assert "all_gather 1 param(s), 15 elements" in out["early"]
        assert out["after"] == expected
        assert out["coalesced"] == f"{expected} {second}"
        assert out["bucket_early"].startswith("StreamOrderError: compute ran aten.sum")
    parts = [out["parts"] for out in pools.run(2, _catches_early_use_worker)]
    assert parts == ["[[3.0, 3.0, 3.0]]", "[[3.0, 3.0, 3.0]]"]


def test_open_tickets_are_those_inside_communicate() -> None:
    """A process-group double checks a collective issued inside ``communicate``
    against the ticket open there (``tests.accelerator_double``)."""
    checker = StreamOrderChecker()
    pair = RecordingStreamPair(checker)
    a, b = torch.zeros(4), torch.zeros(4)
    assert checker.open_tickets == []
    with pair.communicate(reads=[a], writes=[b], label="outer") as ticket:
        assert checker.open_tickets == [ticket]
    assert checker.open_tickets == []
    with pytest.raises(ValueError), pair.communicate(reads=[a], writes=[b]):
        raise ValueError("left by an exception")
    assert checker.open_tickets == []
