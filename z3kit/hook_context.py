"""Where a hook runs: inside a backward pass or not, never inside a compiled
graph, and what runs when the backward pass ends.

``at_backward_end`` is the one adapter over torch's private
``Variable._execution_engine.queue_callback`` (torch has no public
end-of-backward hook; ``tests/test_hook_context.py`` pins what it does):
a runtime queues it from inside a backward hook, and the callback runs
once that backward's graph task is done, every gradient accumulated.
Queued inside a reentrant checkpoint's inner backward, it runs when that
inner backward ends, before the outer one's gradients are in: queue it
from the first hook of the outermost backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_graphs(fn: _F) -> _F:
    """``fn`` always runs eagerly: torch.compile never traces it (a graph break where compiled code calls it)."""
    return cast(_F, torch.compiler.disable(fn, recursive=True))


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass in this thread
    (forwards seen then are activation-checkpoint recomputations)."""
    return bool(torch._C._current_graph_task_id() != -1)


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass under way ends (call it from inside one)."""
    if not in_backward():
        raise RuntimeError("at_backward_end must be called from inside a backward pass (a backward hook)")
    torch.autograd.Variable._execution_engine.queue_callback(callback)


__all__ = ["at_backward_end", "in_backward", "outside_graphs"]
