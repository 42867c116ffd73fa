"""One backward per forward: a second one is refused on its rank before it reaches a collective.

Note: why a second backward is refused.
    The ranks pair their gathers and reductions by order, and each backward
    reduces every parameter's gradient once and ends with the ranks'
    comparison (``zero3.ranks.agreement``). A rank that runs backward again over
    the same forward (through a graph kept with ``retain_graph=True``, or a
    second ``backward`` of the same loss: its first hooks run before
    autograd finds the graph freed) would issue gathers and reductions the
    other ranks do not: gloo aborts ("Received data size doesn't match
    expected size") or the others hang. So the rank refuses it at the
    backward's first hook, before any gather, and posts the failure on the
    notice board (``RankWatch.failed_here``): the others raise ``RankFailed``
    within a fraction of a second.

Note: what counts as a forward and as a backward.
    A forward of the model with grad enabled, through the engine or by
    calling the model itself, allows one backward (a root forward hook
    counts it; the recomputations of activation checkpointing run inside
    backward and do not count); several forwards whose losses are summed
    still take one. A backward
    starts at the first of the engine's hooks that the outermost backward
    reaches (``BackwardPass.queue_epilogue``): the inner backwards that
    reentrant activation checkpointing runs inside it are part of it, not
    a second one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from z3kit.hook_context import in_backward, outside_graphs
from z3kit.hooks import ModuleHooks
from z3kit_recipes.zero3.ranks.agreement import StepRecord
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch

MESSAGE = (
    "backward ran twice after one forward (a second backward through a graph kept with retain_graph=True, or "
    "the losses of one forward backed one at a time); z3kit reduces each parameter's gradient once per forward "
    "and the ranks pair their reductions by order: sum the losses and call backward once, then run the next forward"
)


ENGINE_BACKWARD_MESSAGE = (
    "loss.backward() called directly on an fp16 engine: its loss must be multiplied by the loss scale before "
    "backward, which only the engine can do; call engine.backward(loss) instead (then engine.step())"
)


class BackwardTwice(RuntimeError):
    """A backward with no forward since the last one; refused before any collective."""


class EngineBackwardRequired(RuntimeError):
    """A plain ``loss.backward()`` on an fp16 engine (``zero3.training.loss_scale``); refused before any collective."""


class OneBackwardPerForward:
    """Whether a forward ran since the last backward (see the module Notes)."""

    def __init__(self, watch: RankWatch, hooks: ModuleHooks, record: StepRecord, root: nn.Module, *,
                 engine_backward_required: bool = False) -> None:
        self.watch, self.hooks, self.record = watch, hooks, record
        self._forward_pending = False
        #: fp16: a backward must come through ``engine.backward`` (which sets ``in_engine_backward``)
        self.engine_backward_required = engine_backward_required
        self.in_engine_backward = False

        @outside_graphs
        def forward_starts(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled() and not in_backward():
                self._forward_pending = True  # one backward may follow

        self._handle = root.register_forward_pre_hook(forward_starts)

    def check(self) -> None:
        """Refuse a backward now (``engine.backward``, before it starts)."""
        if not self._forward_pending:
            raise BackwardTwice(MESSAGE)

    def backward_starts(self) -> None:
        """The outermost backward reached its first hook: refuse it, and tell
        the other ranks (a plain ``loss.backward()`` has no engine call around
        it that would), or count it."""
        try:
            self.check()
            if self.engine_backward_required and not self.in_engine_backward:
                raise EngineBackwardRequired(ENGINE_BACKWARD_MESSAGE)
        except (BackwardTwice, EngineBackwardRequired) as exc:
            self.hooks.reset()  # the refused pre-backward had opened its module's call
            self.watch.failed_here("backward", exc, (self.record.gathers, len(self.record.fetches)))
            raise
        self._forward_pending = False
