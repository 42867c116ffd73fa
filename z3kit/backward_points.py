"""The backward points of a hooked call: where its pre- and post-backward fire.

``ModuleHooks`` (``z3kit.hooks``) hangs them on each call's autograd graph:
a ``BackwardEntry`` as a pre-hook on the node that made each output (or,
for an output without one, through ``PreBackward``), and ``PostBackward``,
a pass-through ``torch.autograd.Function``, on the inputs. What they fire is
a ``BackwardPoints``: the hooks' own pre- and post-backward of a call.

Note: why pre-backward is a node pre-hook.
    A pass-through ``autograd.Function`` on the outputs did the same job
    for ~14 us per call (the Python ``apply``, a ``ctx``, a detached alias
    per output, and a Python backward), a node pre-hook for ~3 us; and the
    module's outputs stay the tensors it returned. An output with no node
    (a leaf that requires grad, returned as is) has no node to hook: it
    passes through ``PreBackward``, a Function, instead.

Note: why the Functions return detached tensors.
    A custom Function returning an input as-is makes it a view, on which
    autograd forbids in-place ops (an ``nn.ReLU(inplace=True)`` on a hooked
    module's input). A detached alias is an ordinary output that shares the
    version counter, so a bad in-place op is still caught.

Note: unused outputs.
    A Function's backward gets ``None``, not zeros, for a wrapped tensor that
    received no gradient (``set_materialize_grads(False)``) and passes it on
    as ``None``. Materialized zeros would flow into the branch that produced
    the unused tensor, so a parameter used only there (or an input that the
    module ignores) would get a zero ``.grad`` where it should have none,
    which optimizers treat differently (weight decay, momentum).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from z3kit.hook_context import backward_pass_id
from z3kit.host_work import HostWork
from z3kit.nested import iter_tensors, map_tensors


def _needs_point(t: torch.Tensor) -> bool:
    """``t`` gets backward points: it requires grad and is no ``nn.Parameter`` (a consumer sees
    a parameter itself)."""
    # ``type(t) is torch.Tensor`` first: nn.Parameter's isinstance check runs
    # Python code, and plain tensors are the common case
    return t.requires_grad and (type(t) is torch.Tensor or not isinstance(t, nn.Parameter))


def needing_points(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` (a tensor, or any nesting of containers) that get backward
    points, each once however often ``obj`` holds it."""
    if isinstance(obj, torch.Tensor):  # the common case, without the walk
        return [obj] if _needs_point(obj) else []
    return list({id(t): t for t in iter_tensors(obj) if _needs_point(t)}.values())


@attrs.frozen
class BackwardPoints:
    """What a call's backward points fire: its pre-backward (``opened``), its post-backward
    (``closed``), and the count of hook calls."""

    opened: Callable[[Any], None]
    closed: Callable[[Any], None]
    work: HostWork


class BackwardEntry:
    """A call's way into backward: fires its pre-backward (after the
    post-backward of the chained calls it ``closes``: ``z3kit.hooks``' Note
    on chains) the first time any of its output nodes runs in a backward
    pass. Called as a node pre-hook (with the node's output gradients, left
    as they are) and from ``PreBackward`` (for outputs without a node)."""

    __slots__ = ("points", "call", "closes", "_pass")

    def __init__(self, points: BackwardPoints, call: object) -> None:
        self.points, self.call = points, call
        #: later calls whose post-backward this entry also fires
        self.closes: list[object] = []
        self._pass = -1  # the backward pass that last fired it

    def __call__(self, *grads: Any) -> None:
        points = self.points
        points.work.hooks += 1
        now = backward_pass_id()
        if now == self._pass:  # another output node of the same call, in the same pass
            return None
        self._pass = now
        for later in reversed(self.closes):  # the innermost, latest call first
            points.closed(later)
        points.opened(self.call)
        return None


class PreBackward(torch.autograd.Function):
    """Outputs without an autograd node of their own pass through it: its backward is their
    pre-hook (see the Note on why pre-backward is a node pre-hook)."""

    @staticmethod
    def forward(ctx: Any, entry: BackwardEntry, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.entry = entry
        ctx.set_materialize_grads(False)  # see the Note on unused outputs
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.entry()
        return (None, *grads)


class PostBackward(torch.autograd.Function):
    """A call's inputs pass through it: its backward runs once all of their gradients are
    computed, and fires the call's post-backward."""

    @staticmethod
    def forward(ctx: Any, points: BackwardPoints, call: object, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.points, ctx.call = points, call
        ctx.set_materialize_grads(False)  # see the Note on unused outputs
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.points.work.hooks += 1
        ctx.points.closed(ctx.call)
        return (None, None, *grads)


def through(work: HostWork, fn: type[torch.autograd.Function], *args: Any) -> tuple[torch.Tensor, ...]:
    """The tensors among ``args`` (after the Function's own arguments) passed through one ``fn`` node."""
    work.functions += 1
    wrapped: tuple[torch.Tensor, ...] = fn.apply(*args)
    return wrapped


def replaced(obj: Any, targets: list[torch.Tensor], wrapped: tuple[torch.Tensor, ...]) -> Any:
    """``obj`` with each of ``targets`` replaced by its counterpart in ``wrapped``."""
    by_id = {id(t): w for t, w in zip(targets, wrapped)}
    return map_tensors(lambda t: by_id.get(id(t), t), obj)
