"""Where the engine is in training: its phase, and its step counters."""

from __future__ import annotations

import enum

import attrs

from z3kit_recipes.zero3.ranks.position import StepPosition


class Phase(enum.Enum):
    """What the engine is doing between two public calls."""

    #: No training step is open: no forward or backward runs, and only
    #: persistent or pinned parameters are gathered. Eval and no_grad
    #: forwards run here and leave it so.
    IDLE = "idle"
    #: A training forward ran (or runs): fetches are traced and agreed,
    #: and parameters the trace says are reused soon may stay gathered
    #: until the backward that follows.
    FORWARD = "forward"
    #: A backward runs: its end-of-backward callback is queued, and
    #: checkpoints, loads and ``gathered_parameters`` are refused.
    BACKWARD = "backward"


@attrs.define
class TrainingState:
    """The engine's phase and step counters, shared by the parts that move them."""

    phase: Phase = Phase.IDLE
    #: optimizer steps taken
    global_step: int = 0
    #: backwards completed since initialize
    micro_step: int = 0
    #: ``micro_step`` at the last ``step()`` call
    micro_at_step_call: int = 0
    #: where in its micro-step this rank is, as written by the parts that move it (``zero3.ranks.position``)
    position: StepPosition = attrs.field(factory=StepPosition)

    @property
    def backward_since_step_call(self) -> bool:
        return self.micro_step > self.micro_at_step_call

    def rank_position(self) -> tuple[int, int]:
        """(micro-step, position within it): what the notice board compares (``RankWatch.position``)."""
        return self.micro_step, self.position.index(idle=self.phase is Phase.IDLE)
