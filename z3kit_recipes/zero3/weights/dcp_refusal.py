"""``engine.optimizer`` handed to DCP's state-dict calls: refused, naming
``engine.dcp_view()``, with the optimizer left as it was.

``get_state_dict(model, engine.optimizer)`` cannot work: DCP pairs the
optimizer's parameters with the model's by identity, and ``engine.optimizer``
steps the fp32 master shards (``zero3.weights.dcp_state``'s Note). Left
alone, torch fails with ``KeyError: 0``, and before that, on an optimizer
that has not stepped yet, its ``_init_optim_state`` has made the state with
a step of zero gradients at learning rate 0: Adam's step count would then
be one ahead for the rest of the run.

This module is the one place that recognises DCP's calls on
``engine.optimizer``, by the module of the caller
(``torch.distributed.checkpoint.state_dict``, the nearest caller outside
torch's own frames), through the optimizer's public hooks; ``tests/test_zero3_dcp_state.py`` pins it.

Note: nothing changed.
    DCP's zero step is let through (the masters are kept first), and the
    state it made is dropped again, with the masters put back, where DCP
    next calls the optimizer (``state_dict``, which is then refused; or
    ``load_state_dict``), or, where torch fails in between
    (``set_state_dict``'s ``KeyError``), before the next real step. A
    ``load_state_dict`` of the user's after it makes that state theirs.
    The hook on every step costs two truth tests once the optimizer has
    state.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_DCP_MODULE = "torch.distributed.checkpoint.state_dict"
REFUSAL = ("DCP's state-dict calls were given engine.optimizer, which steps this rank's fp32 master shards, not the "
           "model's parameters, so DCP cannot name its state; nothing was changed. Hand them "
           "`model, optimizer = engine.dcp_view()` (get_state_dict(model, optimizer), set_state_dict(...)), or use "
           "engine.save_checkpoint(path) / engine.load_checkpoint(path)")


def _called_by_dcp() -> bool:
    """Whether the optimizer's nearest caller outside torch's own frames (its
    hook runner, decorators) is DCP's state-dict module: z3kit's own view
    (``zero3.weights.dcp_optimizer``) calls ``engine.optimizer`` under DCP too."""
    frame = inspect.currentframe()
    frame = None if frame is None else frame.f_back  # the hook
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == _DCP_MODULE:
            return True
        if module != __name__ and not module.startswith("torch."):
            return False
        frame = frame.f_back
    return False


class DcpRefusal:
    """The hooks on ``engine.optimizer`` (see the module Note)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        #: the masters' values before DCP's zero step, while the state it made is held
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_state_dict_pre_hook(self._before_state_dict)
        optimizer.register_load_state_dict_pre_hook(self._before_load)
        optimizer.register_load_state_dict_post_hook(self._after_load)

    def _forget(self) -> None:
        """Drop the state DCP's zero step made, and put the masters back."""
        kept, self._kept = self._kept, []
        self.optimizer.state.clear()  # it was empty before that step
        with torch.no_grad():
            for master, values in kept:
                master.copy_(values)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._kept:
            self._forget()  # a step after DCP's zero step: that state was never the run's
        if not optimizer.state and _called_by_dcp():
            self._kept = [(p, p.detach().clone()) for g in optimizer.param_groups for p in g["params"]]

    def _before_state_dict(self, optimizer: torch.optim.Optimizer) -> None:
        if _called_by_dcp():
            if self._kept:
                self._forget()
            raise RuntimeError(REFUSAL)

    def _before_load(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        if _called_by_dcp():
            if self._kept:
                self._forget()
            raise RuntimeError(REFUSAL)

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        self._kept = []  # the user's own load: the state is theirs now
