"""``StepState``: where the engine is in its training step, in one object.

Every part that must know where the step is asks this object, and the
parts that move the step move it through its transitions: the root's
hooks start and end forwards (``zero3.runtime.root_hooks``), the backward
pass opens and closes the backward (``zero3.training.backward``), the
engine aborts a step that raised (``EngineCore``), the rank watch marks the
ranks broken (``zero3.ranks.rank_watch``). The parameter coordinator asks
whether its fetches are traced, the backward pass whether its epilogue is
queued, compile support whether fetch units may change and whether this
forward learns, the eval meeting whether a step is open, the notice board
where this rank is, and every public call whether it may run.

Note: the states.
    The phase moves IDLE -> FORWARD (a training forward starts) -> BACKWARD
    (the first backward hook of ours fires) -> IDLE (the end-of-backward
    callback ends; ``micro_step`` counts it). Any phase goes to IDLE when a
    forward or backward raises (``abort``). Within a phase, ``forward`` is
    the root forward under way (none, a training one, or an untraced one:
    an eval or no_grad forward, also inside a step, whose fetches are not
    traced), ``learning`` whether it runs eagerly to learn parameter uses
    (``zero3.compile.compiled``), and ``position`` how far the micro-step
    got. ``broken`` is orthogonal: once set, the ranks no longer run
    together and every call refuses (the rank watch's thread may set it at
    any time, so no transition clears it except the ranks' own verdict
    that they are still in step).
"""

from __future__ import annotations

import enum

import attrs

from z3kit_recipes.zero3.step.position import StepPosition


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


class Forward(enum.Enum):
    """The kind of root forward under way (``StepState.forward``)."""

    #: grad enabled and the model in train mode: the forward of a training step
    TRAINING = "training"
    #: an eval or no_grad forward (between steps, or inside one): not traced,
    #: and what it gathered is freed when it ends
    UNTRACED = "untraced"


@attrs.define
class StepState:
    """The step's state and counters (see the module Note on the states)."""

    phase: Phase = Phase.IDLE
    #: the root forward under way, if any (from its pre-forward to its post-forward)
    forward: Forward | None = None
    #: the forward under way runs eagerly to learn which parameters each module uses
    learning: bool = False
    #: training forwards since the step opened (a second one before the backward joins the same step)
    training_forwards: int = 0
    #: why the ranks no longer run together; None while they do
    broken: str | None = None
    #: optimizer steps taken
    global_step: int = 0
    #: backwards completed since initialize
    micro_step: int = 0
    #: ``micro_step`` at the last ``step()`` call
    micro_at_step_call: int = 0
    #: how far this rank got in its micro-step, written by the parts that move it (``zero3.step.position``)
    position: StepPosition = attrs.field(factory=StepPosition)

    # -- what the parts ask --------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """A training step is open (its forward ran, its backward has not ended)."""
        return self.phase is not Phase.IDLE

    @property
    def tracing(self) -> bool:
        """Fetches now are part of the traced training step (not an untraced forward inside it)."""
        return self.phase is not Phase.IDLE and self.forward is not Forward.UNTRACED

    @property
    def busy(self) -> bool:
        """A forward or a backward runs: whole-model operations must wait."""
        return self.forward is not None or self.phase is Phase.BACKWARD

    @property
    def first_forward_of_step(self) -> bool:
        """The training forward under way opened the step (no other forward of it ran before)."""
        return self.forward is Forward.TRAINING and self.training_forwards == 1

    @property
    def backward_since_step_call(self) -> bool:
        return self.micro_step > self.micro_at_step_call

    def rank_position(self) -> tuple[int, int]:
        """(micro-step, position within it): what the notice board compares (``RankWatch.position``)."""
        return self.micro_step, self.position.index(idle=self.phase is Phase.IDLE)

    # -- the transitions -------------------------------------------------------------------------
    def start_forward(self, *, training: bool) -> None:
        """A root forward starts (a training one opens the step next, ``open_step``)."""
        self.forward = Forward.TRAINING if training else Forward.UNTRACED

    def open_step(self) -> None:
        """The training forward under way opens the step, or joins the one open."""
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
        self.training_forwards += 1

    def end_forward(self) -> None:
        """The root forward ended; the step (if one is open) waits for its backward."""
        self.forward, self.learning = None, False

    def start_backward(self) -> bool:
        """The first backward hook of ours fired; False if the backward had started already."""
        if self.phase is Phase.BACKWARD:
            return False
        self.phase = Phase.BACKWARD
        return True

    def close_step(self) -> None:
        """The end-of-backward callback ended (well or not): no step is open."""
        self.phase, self.training_forwards = Phase.IDLE, 0

    def abort(self) -> Phase:
        """A forward or backward raised: no forward runs, no step is open. Returns the phase it was in."""
        was = self.phase
        self.end_forward()
        self.close_step()
        return was
