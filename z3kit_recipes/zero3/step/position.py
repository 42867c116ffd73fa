"""Where this rank is in its micro-step, as the notice board compares it.

A rank that leaves the run the others follow (a fetch the recorded trace
does not have, an unfreeze, an eval forward of its own) posts where it did
(``RankWatch.left_trace``); a rank that reads the notice raises when it is
already past that point (``RankWatch.position``). ``StepPosition`` is that
point: the parts that move it write it (the parameter coordinator its
forward fetches and the start of backward, the eval meeting its eval
forwards), and the step state reads it with the phase
(``StepState.rank_position``). It is made before all of them, so the
watch they all wait through reads an object that exists.
"""

from __future__ import annotations

import attrs

#: eval forward #n of a micro-step sits at position EVAL_BASE + n: after a
#: rank that is between steps (IDLE_POSITION), before any training fetch (>= 0)
EVAL_BASE = -(1 << 30)
IDLE_POSITION = -(1 << 40)
#: past every forward fetch: the step's backward began
IN_BACKWARD = 1 << 40


@attrs.define
class StepPosition:
    """This rank's point in its micro-step (see the module docstring)."""

    #: the eval forward under way (``zero3.ranks.uneven``): its position; None: none is
    eval_forward: int | None = None
    #: forward fetches of the training step so far (``ParamCoordinator``)
    forward_fetches: int = 0
    #: the step's backward began (its backward schedule was made)
    backward_began: bool = False

    def index(self, *, idle: bool) -> int:
        """The position within the micro-step (``idle``: no training step is open)."""
        if self.eval_forward is not None:
            return self.eval_forward
        if idle:
            return IDLE_POSITION
        return IN_BACKWARD if self.backward_began else self.forward_fetches
