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
So is its master shard's, the optimizer's parameter: ``engine.optimizer``'s
gradients are as absent there (the step gives them their partitions).
They are taken away before anything could accumulate into them: at the
start of the next training forward or backward, and when the window ends
(the optimizer step, or ``zero_grad`` discarding it).

A stand-in that the user's code took away first (``model.zero_grad()``,
``engine.optimizer.zero_grad()``, ``param.grad = None``) means what it means under
DDP: that parameter's gradient so far is gone. ``take_cleared`` names those
parameters, and the engine drops their partitions from the window
(``zero3.training.backward``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from z3kit.withheld import Withheld, withheld_like


#: what a master's stand-in adds: torch.amp.GradScaler's unscale_ and step read the optimizer's gradients
_FP16_ROUTE = (
    ". For fp16 loss scaling (the torch.amp.GradScaler recipe: scale, unscale_, step, update), use the engine's "
    "own: Zero3Config(compute_dtype=\"fp16\") (or the DeepSpeed JSON's fp16 section) and engine.backward(loss), "
    "engine.step(): it scales the loss, unscales the gradients, skips a step whose gradients overflowed and "
    "adjusts the scale, as GradScaler does; clip there with gradient_clipping"
)


def _reason(name: str, world: int, master: bool = False) -> str:
    return (
        f"the gradient of {name!r} is sharded: between backward and step each rank holds its 1/{world} "
        "partition of the accumulated sum, not a full .grad. Clip with engine.clip_grad_norm_(max_norm) (or "
        "Zero3Config(gradient_clipping=...) / the JSON's gradient_clipping), which clips by the global norm as "
        "DDP's torch.nn.utils.clip_grad_norm_ does and returns it; engine.last_grad_norm is the last step's norm. "
        "To discard the gradients, set them to None (model.zero_grad() or optimizer.zero_grad(), whose default "
        "set_to_none=True does), as under DDP" + (_FP16_ROUTE if master else "")
    )


class GradStandIns:
    """``Withheld`` stand-ins in the trainable parameters' ``.grad`` and their
    masters' (see the module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], trainable: Sequence[int],
                 masters: Sequence[nn.Parameter], world: int) -> None:
        #: every managed parameter, by id; ``trainable`` and ``masters`` (the optimizer's, one per trainable
        #: parameter) are the layout's live lists (unfreezing extends them)
        self.params, self.names, self.trainable, self.masters = params, names, trainable, masters
        self.world = world
        self.shown = False
        #: the parameters ``show`` put a stand-in on, and the tensors whose ``.grad`` it went into
        self._placed: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        #: each stand-in, by parameter id and whether it is the master's, made once for the shape it is for
        self._made: dict[tuple[int, bool], tuple[torch.Size, Withheld]] = {}

    def show(self) -> None:
        """After a backward: a stand-in in each trainable parameter's empty ``.grad``, and its master's."""
        for pid, master in zip(self.trainable, self.masters):
            holders = tuple(t for t in (self.params[pid], master) if t.grad is None)
            for holder in holders:
                key = pid, holder is master
                shape, stand_in = self._made.get(key, (None, None))
                if stand_in is None or shape != holder.shape:
                    stand_in = withheld_like(holder, _reason(self.names[pid], self.world, holder is master))
                    self._made[key] = holder.shape, stand_in
                holder.grad = stand_in
            if holders:
                self._placed.append((pid, holders))
        self.shown = True

    def take_cleared(self) -> list[int]:
        """The parameters one of whose stand-ins the user's code set to None since
        ``show`` (see the module docstring), each named once."""
        if not self.shown:
            return []
        cleared: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        kept: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        for pid, holders in self._placed:
            (cleared if any(t.grad is None for t in holders) else kept).append((pid, holders))
        if cleared:
            self._placed = kept
        return [pid for pid, _ in cleared]

    def clear(self) -> None:
        """Before anything accumulates into ``.grad`` again, or when the window ends."""
        if not self.shown:
            return
        for pid, master in zip(self.trainable, self.masters):
            for holder in (self.params[pid], master):
                if isinstance(holder.grad, Withheld):
                    holder.grad = None
        self._placed = []
        self.shown = False
