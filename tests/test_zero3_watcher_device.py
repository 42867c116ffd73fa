"""The watcher sees the device, holds no buffer, and its thread cannot die unnoticed.

On an accelerator ``Work.wait()`` returns before the collective ran. These
run on the CPU double of one (``tests.accelerator_double``), whose
``wait()`` only orders and whose data lands later, so that each fault shows
here as it would on NCCL:

- a handle that says "completed" because it was waited for hides a stalled
  collective from the watcher (the stall tests, and the first test here);
- a watcher that keeps the waited handles keeps their buffers alive;
- a watcher thread that died leaves failure detection off, silently.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import accelerator_double as double
from tests.accelerator_double import DOUBLE
from tests.zero3_models import MLP, vec_batch
from z3kit.collectives import all_gather


def _group(ctx: Any) -> double.SimGroup:
    return double.new_group(list(range(ctx.world)))


def run_waited_is_not_completed(ctx: Any) -> dict[str, Any]:
    group = _group(ctx)
    with DOUBLE.observing():
        out = torch.empty(2 * ctx.world)
        pending = all_gather(out, torch.full((2,), float(ctx.rank)), group, async_op=True)
        pending.wait()
        right_after = pending.is_completed()
        DOUBLE.synchronize()
        time.sleep(DOUBLE.device_lag_s + 0.1)
        later = pending.is_completed()
        return {"right_after": right_after, "later": later, "values": out.tolist()}


def test_a_waited_collective_is_completed_only_when_the_device_says_so(pools: Any) -> None:
    for r in pools.run(2, run_waited_is_not_completed):
        assert r["right_after"] is False, r  # on main: True, from the flag set by wait()
        assert r["later"] is True, r
        assert r["values"] == [0.0, 0.0, 1.0, 1.0], r


def run_watcher_holds_no_buffer(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes.zero3.ranks.rank_watch import RankWatch
    from z3kit_recipes.zero3.ranks.watcher import start_watcher
    from z3kit_recipes.zero3.step.state import StepState

    group = _group(ctx)
    with DOUBLE.observing():
        watch = RankWatch(group, timeout_s=30.0, step=StepState())
        start_watcher(watch)
        assert watch.watcher is not None
        out = torch.empty(1000 * ctx.world)
        pending = all_gather(out, torch.full((1000,), float(ctx.rank)), group, async_op=True)
        watch.wait(pending.is_completed, pending.wait)
        total = float(out.sum())  # the data landed: the host read it
        followed = watch.watcher.in_flight()  # still followed: the device lag has not passed
        DOUBLE.synchronize()  # the double (the "device") lets go of what landed
        freed = weakref.ref(out)
        del out, pending
        gc.collect()
        alive = freed() is not None
        deadline = time.monotonic() + 5.0
        while watch.watcher.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.watcher.stop()
        return {"followed": followed, "alive": alive, "total": total, "left": watch.watcher.in_flight()}


def test_the_watcher_holds_no_buffer_of_what_it_follows(pools: Any) -> None:
    for r in pools.run(2, run_watcher_holds_no_buffer):
        assert r["total"] == 1000.0, r
        assert r["followed"] == 1, r
        assert r["alive"] is False, r  # on main: the followed closure kept the gather's output alive
        assert r["left"] == 0, r  # and it saw the collective finish on the device


def test_a_followed_collective_lets_go_of_the_handle_once_settled() -> None:
    """On an accelerator the watcher polls the work while the caller waits,
    then the event recorded after the wait: the handle goes with the swap."""
    from z3kit.peer_watch import Followed

    class Handle:
        def __init__(self) -> None:
            self.buffer = torch.empty(10)

        def is_completed(self) -> bool:
            return False

    class Event:
        def query(self) -> bool:
            return True

    handle = Handle()
    ref = weakref.ref(handle.buffer)
    followed = Followed(handle.is_completed, "a gather")
    assert followed.query() is False
    del handle
    assert ref() is not None  # polled through the handle while the caller waits
    followed.settle(Event())
    gc.collect()
    assert ref() is None
    assert followed.query() is True


class _Stall(torch.autograd.Function):
    """Identity; its backward sleeps ``seconds`` (a rank that stops issuing mid-backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class StallingMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = MLP(), MLP(width=7, depth=1)
        self.stall_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = _Stall.apply(h, self.stall_s) if self.stall_s else h
        return self.second(torch.nn.functional.pad(h, (0, 2)))


def run_stall_mid_backward(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    group = _group(ctx)
    out: dict[str, Any] = {"caught": "", "seconds": 0.0, "later": ""}
    with DOUBLE.observing():
        torch.manual_seed(1)
        b = vec_batch(ctx.rank, 0, 0, 0)
        config = zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=2.0)
        model = StallingMLP()
        engine = zero3.initialize(model, torch.optim.Adam, config, group)
        engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
        engine.step()
        if ctx.rank == 1:
            model.stall_s = 8.0
        start = time.monotonic()
        try:
            engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
            engine.step()
        except Exception as e:  # noqa: BLE001 - what each rank sees is the result
            out["caught"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
        if ctx.rank == 1 and not out["caught"]:
            try:
                engine(b["x"])
            except Exception as e:  # noqa: BLE001
                out["later"] = f"{type(e).__name__}: {e}"
        out["violations"] = list(DOUBLE.violations)
    return out


def test_a_rank_that_stops_issuing_mid_backward_is_named_with_the_collective(pools: Any) -> None:
    waiting, stuck = pools.run(2, run_stall_mid_backward, timeout=120)
    caught = waiting["caught"]
    assert caught.startswith("RankFailed") and "has not finished after" in caught, waiting
    assert "on z3sim group" in caught, waiting  # the collective it is stuck in, by kind and group
    # the stalled peer, by rank: its watcher answers for it while its main thread is busy elsewhere
    assert "rank 1: waiting: stopped on rank 1" in caught, waiting
    assert waiting["seconds"] < 8, waiting  # 2 s of collective_timeout_s, then up to 3 s for answers
    assert (stuck["caught"] or stuck["later"]).startswith("RankFailed"), stuck
    assert not waiting["violations"] and not stuck["violations"]


def run_watcher_dies(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3
    from z3kit_recipes.zero3.ranks.watcher import EngineWatcher

    group = _group(ctx)
    out: dict[str, Any] = {"caught": ""}
    original = EngineWatcher.on_notices

    def dies(self: EngineWatcher, notices: list[Any]) -> bool:
        raise RuntimeError("injected into the watcher thread")

    with DOUBLE.observing():
        torch.manual_seed(1)
        b = vec_batch(ctx.rank, 0, 0, 0)
        config = zero3.Zero3Config(param_persistence_threshold=0, collective_timeout_s=5.0)
        if ctx.rank == 1:
            EngineWatcher.on_notices = dies  # type: ignore[method-assign]
        try:
            engine = zero3.initialize(MLP(), torch.optim.Adam, config, group)
        finally:
            EngineWatcher.on_notices = original  # type: ignore[method-assign]
        time.sleep(0.5)  # the thread's first tick
        try:
            engine.backward(F.mse_loss(engine(b["x"]), b["y"]))
            engine.step()
        except Exception as e:  # noqa: BLE001 - what each rank sees is the result
            out["caught"] = f"{type(e).__name__}: {e}"
    return out


def test_a_dead_watcher_thread_is_an_error_on_every_rank(pools: Any) -> None:
    healthy, dead = pools.run(2, run_watcher_dies, timeout=90)
    assert dead["caught"].startswith("RankFailed"), dead
    assert "watcher thread died with RuntimeError: injected into the watcher thread" in dead["caught"], dead
    assert healthy["caught"].startswith("RankFailed") and "watcher thread died" in healthy["caught"], healthy
