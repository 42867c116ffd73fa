"""``StepState``: the one owner of where the engine is in its step.

First its transitions on their own; then an engine at world 1, watched from
inside its forward and backward, to check that the parts move the state as
its Note on the states says, and consult it (an eval forward inside a step
is not traced; a refused call names the forward or backward it is in).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from z3kit_recipes import zero3
from z3kit_recipes.zero3.step.state import Forward, Phase, StepState

#: every parameter gathered and released (none persistent)
SHARDED = zero3.Zero3Config(param_persistence_threshold=0)


def test_transitions_of_a_step() -> None:
    s = StepState()
    assert (s.phase, s.forward, s.in_step, s.tracing, s.busy) == (Phase.IDLE, None, False, False, False)
    s.start_forward(training=True)
    assert s.busy and not s.in_step  # the step opens once the forward's own checks passed
    s.open_step()
    assert (s.phase, s.first_forward_of_step, s.tracing) == (Phase.FORWARD, True, True)
    s.end_forward()
    assert (s.phase, s.busy, s.tracing) == (Phase.FORWARD, False, True)
    s.start_forward(training=False)  # an eval forward inside the step: not traced
    assert (s.forward, s.tracing, s.in_step) == (Forward.UNTRACED, False, True)
    s.end_forward()
    assert s.tracing
    assert s.start_backward() is True and s.start_backward() is False  # once per backward
    assert (s.phase, s.busy) == (Phase.BACKWARD, True)
    s.close_step()
    assert (s.phase, s.in_step, s.training_forwards) == (Phase.IDLE, False, 0)


def test_a_second_training_forward_joins_the_open_step() -> None:
    s = StepState()
    for _ in range(2):
        s.start_forward(training=True)
        s.open_step()
        first = s.first_forward_of_step
        s.end_forward()
    assert (s.phase, s.training_forwards, first) == (Phase.FORWARD, 2, False)


def test_abort_returns_the_phase_it_left_and_keeps_broken() -> None:
    s = StepState()
    s.start_forward(training=True)
    s.open_step()
    s.learning = True
    s.start_backward()
    s.broken = "rank 1 failed"
    assert s.abort() is Phase.BACKWARD
    assert (s.phase, s.forward, s.learning, s.training_forwards) == (Phase.IDLE, None, False, 0)
    assert s.broken == "rank 1 failed"  # only the ranks' own verdict clears it
    assert s.abort() is Phase.IDLE


class _Probe(nn.Module):
    """Records the engine's step state from inside the model's forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.seen: list[tuple[str, Phase, Forward | None, bool]] = []
        self.state: StepState | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.state is not None
        self.seen.append(("forward", self.state.phase, self.state.forward, self.state.tracing))
        h = self.inner(x)
        if h.requires_grad:
            h.register_hook(self._in_backward)
        return self.head(h)

    def _in_backward(self, grad: torch.Tensor) -> None:
        assert self.state is not None
        self.seen.append(("backward", self.state.phase, self.state.forward, self.state.tracing))


def _engine_worker(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Probe()
    engine = zero3.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), SHARDED, fresh_group(ctx))
    model.state = engine.step_state
    x = torch.randn(3, 4)
    loss = engine(x).sum()
    after_forward = engine.phase
    with torch.no_grad():
        engine(x)  # an eval forward inside the open step
    refused = ""
    try:
        with engine.gathered_parameters():
            pass
    except RuntimeError as exc:
        refused = str(exc)
    engine.backward(loss)
    engine.step()
    return dict(seen=[(w, p.name, None if f is None else f.name, t) for w, p, f, t in model.seen],
                after_forward=after_forward.name, after_step=engine.phase.name, refused=refused)


def test_the_engine_moves_and_consults_its_step_state(pools: PoolSet) -> None:
    (out,) = pools.run(1, _engine_worker)
    assert out["seen"] == [
        ("forward", "FORWARD", "TRAINING", True),  # the training forward opened the step
        ("forward", "FORWARD", "UNTRACED", False),  # the eval forward inside it is not traced
        ("backward", "BACKWARD", None, True),
    ]
    assert out["after_forward"] == "FORWARD" and out["after_step"] == "IDLE"
    assert out["refused"] == ""  # between forward and backward, whole-model calls may run


@pytest.mark.parametrize("world", [2])
def test_step_state_is_idle_on_every_rank_after_a_failed_forward(pools: PoolSet, world: int) -> None:
    for out in pools.run(world, _failing_forward_worker):
        assert out == {"phase": "IDLE", "forward": None, "broken": None, "trained": True}


def _failing_forward_worker(ctx: WorkerContext) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine = zero3.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), SHARDED, fresh_group(ctx))
    try:
        engine(torch.randn(3, 5))  # the wrong width on every rank: every rank fails at the same point
    except RuntimeError:
        pass
    state = engine.step_state
    out: dict[str, Any] = dict(phase=state.phase.name, forward=state.forward, broken=state.broken)
    engine.backward(engine(torch.randn(3, 4)).sum())
    out["trained"] = engine.step()
    return out
