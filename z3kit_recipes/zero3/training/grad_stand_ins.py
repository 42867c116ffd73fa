"""What ``param.grad`` of a trainable parameter holds between backward and step.

The engine hands every gradient to its reducer as it becomes ready and sets
``param.grad`` back to None: the accumulated gradient lives as this rank's
1/N partition (``zero3.training.grad_window``). A ``param.grad`` left at
None would tell a user's ``torch.nn.utils.clip_grad_norm_`` that there is
nothing to clip (it returns 0 and clips nothing), and a gradient logger
that every norm is 0. So after each backward that left the window open,
every trainable parameter's ``.grad`` is a ``Withheld`` stand-in
(``z3kit.withheld``), which raises on any read, naming what computes the
right global answer (``engine.clip_grad_norm_``, ``gradient_clipping``).
They are taken away before anything could accumulate into them: at the
start of the next training forward or backward, and when the window ends
(the optimizer step, or ``zero_grad`` discarding it).

A stand-in that the user's code took away first (``model.zero_grad()``,
``optimizer.zero_grad()``, ``param.grad = None``) means what it means under
DDP: that parameter's gradient so far is gone. ``take_cleared`` names those
parameters, and the engine drops their partitions from the window
(``zero3.training.backward``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from z3kit.withheld import Withheld, withheld_like


def _reason(name: str, world: int) -> str:
    return (
        f"the gradient of {name!r} is sharded: between backward and step each rank holds its 1/{world} "
        "partition of the accumulated sum, not a full .grad. Clip with engine.clip_grad_norm_(max_norm) (or "
        "Zero3Config(gradient_clipping=...) / the JSON's gradient_clipping), which clips by the global norm as "
        "DDP's torch.nn.utils.clip_grad_norm_ does and returns it; engine.last_grad_norm is the last step's norm. "
        "To discard the gradients, set them to None (model.zero_grad() or optimizer.zero_grad(), whose default "
        "set_to_none=True does), as under DDP"
    )


class GradStandIns:
    """``Withheld`` stand-ins in the trainable parameters' ``.grad`` (see the module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], trainable: Sequence[int],
                 world: int) -> None:
        #: every managed parameter, by id; ``trainable`` is the layout's live list (unfreezing extends it)
        self.params, self.names, self.trainable, self.world = params, names, trainable, world
        self.shown = False
        #: the parameters ``show`` put a stand-in on
        self._placed: list[int] = []
        #: each parameter's stand-in, made once for the shape it has between uses
        self._made: dict[int, tuple[torch.Size, Withheld]] = {}

    def show(self) -> None:
        """After a backward: a stand-in in each trainable parameter's empty ``.grad``."""
        for pid in self.trainable:
            param = self.params[pid]
            if param.grad is None:
                shape, stand_in = self._made.get(pid, (None, None))
                if stand_in is None or shape != param.shape:
                    stand_in = withheld_like(param, _reason(self.names[pid], self.world))
                    self._made[pid] = param.shape, stand_in
                param.grad = stand_in
                self._placed.append(pid)
        self.shown = True

    def take_cleared(self) -> list[int]:
        """The parameters whose stand-in the user's code set to None since ``show``
        (see the module docstring), each named once."""
        if not self.shown:
            return []
        params = self.params
        cleared = [pid for pid in self._placed if params[pid].grad is None]
        if cleared:
            self._placed = [pid for pid in self._placed if params[pid].grad is not None]
        return cleared

    def clear(self) -> None:
        """Before anything accumulates into ``.grad`` again, or when the window ends."""
        if not self.shown:
            return
        for pid in self.trainable:
            param = self.params[pid]
            if isinstance(param.grad, Withheld):
                param.grad = None
        self._placed = []
        self.shown = False
