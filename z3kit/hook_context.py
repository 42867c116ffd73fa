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

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch._C._dynamo.eval_frame as _eval_frame

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_graphs(fn: _F) -> _F:
    """``fn`` always runs eagerly: torch.compile never traces it (a graph break
    where compiled code calls it), nor compiles what it calls.

    Note: the cost of staying outside graphs.
        ``torch.compiler.disable(fn, recursive=True)`` swaps dynamo's frame
        callback out and back in around every call, about 5 us per call
        whether or not anything is compiled: per hooked module and step,
        twice. The wrapper made here calls ``fn`` straight when no dynamo
        callback is installed (no compiled code runs in this thread, so
        nothing can trace ``fn`` or compile a frame it calls), and the
        disabled ``fn`` otherwise. The wrapper's own frame is one dynamo
        skips (``torch._dynamo.skip``: never compiled, and a compiled caller
        breaks its graph at it, as at a disabled function). The private
        frame-callback query and ``skip`` are pinned by ``tests/test_hook_context.py``.
    """
    disabled = torch.compiler.disable(fn, recursive=True)
    callback = _eval_frame.get_eval_frame_callback

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        if callback() is None:
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    from torch._dynamo.decorators import skip  # after torch.compiler.disable, which imported dynamo

    skipped = skip(eager)
    skipped._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]  # what it calls is not compiled either
    return cast(_F, skipped)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass in this thread
    (forwards seen then are activation-checkpoint recomputations)."""
    return bool(torch._C._current_graph_task_id() != -1)


def backward_pass_id() -> int:
    """The backward pass running in this thread, as a number no other pass of
    this process shares (a reentrant checkpoint's inner backward is a pass of
    its own); -1 outside a backward pass."""
    task: int = torch._C._current_graph_task_id()
    return task


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass under way ends (call it from inside one)."""
    if not in_backward():
        raise RuntimeError("at_backward_end must be called from inside a backward pass (a backward hook)")
    torch.autograd.Variable._execution_engine.queue_callback(callback)


__all__ = ["at_backward_end", "backward_pass_id", "in_backward", "outside_graphs"]
