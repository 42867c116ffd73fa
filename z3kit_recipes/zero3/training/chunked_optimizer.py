"""Stepping a part of an optimizer's parameters, with its hyperparameters as they were.

``ChunkedStep`` lets the offloaded optimizer step run behind the next
forward (``zero3.training.host_step``), one chunk of masters at a time,
while the training loop goes on changing the real optimizer: an LR
schedule (the engine's, Trainer's, a user's warmup) writes ``param_groups``
right after ``engine.step()`` returns, and a loop may call
``optimizer.zero_grad()`` before the next forward. Both would race a step
that reads them. So a chunk is stepped by a stand-in of the optimizer that
shares its per-parameter state (the same dicts: the moments the step
writes are the optimizer's) but holds its own copy of the hyperparameters,
taken when ``engine.step()`` ran, and its own aliases of the masters (the
same storage; ``.grad`` set on the alias, never on the master).

Note: which optimizers.
    Stepping in chunks equals one step only when the optimizer's update of
    a parameter depends on that parameter's gradient and state alone and
    nothing counts ``step()`` calls: true of torch's own per-parameter
    optimizers (``PER_PARAMETER``), checked by exact class since a subclass
    may add global logic. Any other optimizer steps in one piece, on the
    main thread (``supports``).

Note: the one private detail.
    The stand-in must run the class's update without the step hooks, which
    already ran once on the real optimizer (``host_step``): torch wraps each
    optimizer class's ``step`` once, marking it ``hooked``, with a
    ``functools.wraps`` wrapper that runs the hooks, so the update is one
    ``__wrapped__`` down. ``unhooked_step`` is the only reader of that, and
    ``tests/test_zero3_offload_overlap.py`` pins it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

#: torch optimizers whose update of a parameter reads only that parameter's gradient and state
PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.ASGD,
    torch.optim.Rprop,
)


def unhooked_step(cls: type[torch.optim.Optimizer]) -> Callable[..., Any] | None:
    """``cls.step`` without torch's hook wrapper (None: not wrapped as expected; see the Note)."""
    step = cls.step
    if not getattr(step, "hooked", False):
        return None
    inner = getattr(step, "__wrapped__", None)
    return inner if callable(inner) else None


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may be stepped in chunks behind the next forward (see the Notes)."""
    return type(optimizer) in PER_PARAMETER and unhooked_step(type(optimizer)) is not None


class ChunkedStep:
    """One optimizer step of ``optimizer``'s masters, in chunks (see the module docstring).

    Built on the main thread when ``engine.step()`` runs; ``step`` is then
    called from the host-step thread, once per chunk.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Sequence[nn.Parameter]) -> None:
        update = unhooked_step(type(optimizer))
        if update is None or type(optimizer) not in PER_PARAMETER:
            raise TypeError(f"{type(optimizer).__name__} cannot be stepped in chunks (see chunked_optimizer.supports)")
        self._update = update
        self._type = type(optimizer)
        self._attributes = dict(vars(optimizer))
        #: hyperparameters of each group as they are now (tensors copied: a schedule may write them in place)
        self._groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
        self._group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        # the state dicts are made here, on the main thread, so that the step's thread never inserts into
        # the optimizer's own mapping (which the main thread may read meanwhile)
        self._state = {id(m): optimizer.state[m] for m in masters}

    def step(self, pairs: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Step each master of ``pairs`` by its gradient (a host tensor)."""
        by_group: dict[int, list[torch.Tensor]] = {}
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for master, grad in pairs:
            alias = master.detach()  # the master's storage; its .grad is the stand-in's alone
            alias.grad = grad
            by_group.setdefault(self._group_of[id(master)], []).append(alias)
            state[alias] = self._state[id(master)]
        stand_in = object.__new__(self._type)
        vars(stand_in).update(self._attributes)
        stand_in.param_groups = [dict(self._groups[i], params=params) for i, params in sorted(by_group.items())]
        stand_in.state = state  # type: ignore[assignment]
        self._update(stand_in)
