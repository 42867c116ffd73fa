"""The parameter coordinator and its Gatherer, driven directly (no engine, no hooks).

A three-layer model is sharded over real gloo ranks; the test calls the
hook entry points itself (fetch, forward_exit, fetch_for_backward,
release) in the order a training step would, with every gather on a
``RecordingStreamPair`` and counted in a ``CollectiveLog``; the rank
agreement is a recording stand-in for ``zero3.ranks.fetch_agreement.FetchAgreement`` (a
protocol the coordinator only calls).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.dist_pool import PoolSet, WorkerContext
from z3kit.collectives import CollectiveKind, CollectiveLog
from z3kit.memory import MemoryKind, MemoryLedger
from z3kit.policy_planner import PolicyPlanner
from z3kit.prefetch import PrefetchLimiter
from z3kit.release import StockReleasePolicy
from z3kit.shard import ParamShard, ParamStatus
from z3kit.stream_check import RecordingStreamPair
from z3kit.trace import TraceRecorder, TraceState
from z3kit_recipes.zero3.ranks.agreement import StepRecord
from z3kit_recipes.zero3.step.state import StepState
from z3kit_recipes.zero3.training.gathers import Gatherer
from z3kit_recipes.zero3.training.hook_plan import fetch_groups
from z3kit_recipes.zero3.training.params import ParamCoordinator
from z3kit_recipes.zero3.training.timeline import Timeline


class RecordingAgreement:
    def __init__(self) -> None:
        self.agreed: list[tuple[int, Any]] = []
        self.left: list[tuple[int, str]] = []

    def agree(self, index: int, fetch: tuple[str, int] | None) -> None:
        self.agreed.append((index, fetch))

    def left_trace(self, index: int, what: str) -> None:
        self.left.append((index, what))

    def agree_untraced(self, fetch: tuple[str, int]) -> None:
        self.agreed.append((-1, fetch))

    def forget(self) -> None:
        pass


def _build(ctx: WorkerContext, *, overlap: bool = True, budget: int = 10_000, reuse: int = 10**9) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4), nn.Linear(4, 3))
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    shards = [ParamShard.from_param(p, ctx.rank, ctx.world) for p in params]
    log, memory, record = CollectiveLog(), MemoryLedger(), StepRecord()
    trace, limiter = TraceRecorder(), PrefetchLimiter(prefetch_bucket_size=budget)
    pair = RecordingStreamPair(seed=ctx.rank, delay_s=0.001)
    gatherer = Gatherer(
        shards, group=ctx.group, streams=pair, limiter=limiter, log=log, memory=memory,
        record=record, waiter=lambda done, wait: wait(), overlap=overlap,
    )
    agreement = RecordingAgreement()
    coordinator = ParamCoordinator(
        gatherer, fetch_groups(model, params, []), trace=trace,
        planner=PolicyPlanner(StockReleasePolicy(param_persistence_threshold=0, max_reuse_distance=reuse), limiter, overlap),
        record=record, ranks=agreement, timeline=Timeline(), step=StepState(),
    )
    return dict(model=model, reference=reference, shards=shards, log=log, memory=memory, pair=pair,
                coordinator=coordinator, agreement=agreement, trace=trace, limiter=limiter)


def _begin(c: ParamCoordinator) -> None:
    """A training forward starts, as the root's pre-forward starts it: the step state, then the traced step."""
    c.step.start_forward(training=True)
    c.begin_step()
    c.step.open_step()


def _abort(c: ParamCoordinator) -> None:
    """The step raised, as the engine aborts it."""
    c.abort(ranks_broken=False)
    c.step.abort()


def _step(c: ParamCoordinator, layers: list[nn.Module]) -> list[list[str]]:
    """One traced step: forward fetch/exit per layer, then backward in reverse; the status after each fetch."""
    seen = []
    _begin(c)
    for layer in layers:
        c.fetch(layer)
        seen.append([s.status.name for s in c.shards])
        c.forward_exit(layer, torch.ones(1, requires_grad=True))
    c.step.end_forward()
    c.step.start_backward()
    for layer in reversed(layers):
        c.fetch_for_backward(layer)
        c.release(layer)
    c.finish_schedule()
    c.end_step()
    c.step.close_step()
    return seen


def _lifecycle_worker(ctx: WorkerContext) -> dict[str, Any]:
    b = _build(ctx)
    c, log, agreement = b["coordinator"], b["log"], b["agreement"]
    layers = list(b["model"])
    out: dict[str, Any] = {}
    with b["pair"].checker.watching():
        _begin(c)
        c.fetch(layers[0])
        # gathered, with the values the model was built with
        out["first_values"] = all(
            torch.equal(p, b["reference"][f"0.{n}"]) for n, p in layers[0].named_parameters()
        )
        c.forward_exit(layers[0], torch.ones(1, requires_grad=True))
        out["after_exit"] = [s.status.name for s in c.shards]
        _abort(c)  # a step cut short records no trace
        log.reset()
        agreement.agreed.clear()
        out["record_step"] = _step(c, layers)  # the trace is recorded here
        out["record_gathers"] = log.calls[CollectiveKind.ALL_GATHER]
        out["record_agreed"] = [i for i, _ in agreement.agreed]
        out["trace"] = b["trace"].state.name
        log.reset()
        agreement.agreed.clear()
        out["complete_step"] = _step(c, layers)  # prefetch from the frozen trace
        out["complete_gathers"] = log.calls[CollectiveKind.ALL_GATHER]
        out["complete_agreed"] = list(agreement.agreed)
        # a step that departs from the trace is reported as such
        _begin(c)
        c.fetch(layers[2])
        out["left"] = agreement.left
        _abort(c)
        out["after_abort"] = (b["trace"].state.name, [s.status.name for s in c.shards])
        # pins survive release_all
        c.pin([0, 1])
        c.release_all()
        out["pinned"] = [s.status.name for s in c.shards]
        c.unpin([0, 1])
        out["unpinned"] = [s.status.name for s in c.shards]
    out["live"] = b["limiter"].live_numel
    out["gathered_bytes"] = b["memory"].current(MemoryKind.GATHERED_PARAMS)
    out["tickets"] = (b["pair"].checker.issued, b["pair"].checker.completed)
    return out


def test_coordinator_fetches_releases_traces_and_prefetches(pools: PoolSet) -> None:
    A, N = ParamStatus.AVAILABLE.name, ParamStatus.NOT_AVAILABLE.name
    I = ParamStatus.INFLIGHT.name  # noqa: E741
    for out in pools.run(2, _lifecycle_worker):
        assert out["first_values"] is True
        assert out["after_exit"] == [N] * 6  # released on exit (nothing is persistent)
        # recording: each forward fetch gathers its own layer, agreed fetch by fetch, and
        # the forward's end is agreed at the first backward fetch
        assert out["record_step"] == [[A, A, N, N, N, N], [N, N, A, A, N, N], [N, N, N, N, A, A]]
        assert out["record_agreed"] == [0, 1, 2, 3]
        assert out["trace"] == TraceState.COMPLETE.name
        # complete trace: the first fetch prefetches what follows; nothing is agreed
        assert out["complete_step"][0] == [A, A, I, I, I, I]
        # the trace says layer 0 is used again in backward (within max_reuse_distance): kept
        assert out["complete_step"][1] == [A, A, A, A, A, A]
        assert out["complete_gathers"] < out["record_gathers"] == 6
        assert out["complete_agreed"] == []
        assert out["left"] == [(0, "fetches '2' where the trace has '0'")]
        assert out["after_abort"] == (TraceState.INVALID.name, [N] * 6)
        assert out["pinned"] == [A, A, N, N, N, N] and out["unpinned"] == [N] * 6
        assert out["live"] == 0 and out["gathered_bytes"] == 0
        issued, completed = out["tickets"]
        assert issued == completed > 0  # every gather was completed by the Gatherer


def _no_overlap_worker(ctx: WorkerContext) -> tuple[list[list[str]], int]:
    b = _build(ctx, overlap=False, budget=0, reuse=0)
    layers = list(b["model"])
    with b["pair"].checker.watching():
        _step(b["coordinator"], layers)
        seen = _step(b["coordinator"], layers)
    return seen, b["pair"].checker.checked_ops


def test_without_overlap_or_budget_nothing_is_left_in_flight(pools: PoolSet) -> None:
    A, N = ParamStatus.AVAILABLE.name, ParamStatus.NOT_AVAILABLE.name
    for seen, checked in pools.run(2, _no_overlap_worker):
        assert seen == [[A, A, N, N, N, N], [N, N, A, A, N, N], [N, N, N, N, A, A]]
        assert checked == 0  # no compute ran while a gather was in flight
