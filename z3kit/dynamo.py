"""The private torch names that compile support needs, in one place.

torch has public APIs for most of what a runtime does around
``torch.compile`` (``torch.compiler.disable``, ``set_stance``,
``is_compiling``; a ``TorchFunctionMode`` is entered and left through its
context-manager methods), and none for these:

- whether a module was compiled (``module.compile()`` sets
  ``_compiled_call_impl``; ``torch.compile(module)`` returns an
  ``OptimizedModule``);
- when dynamo finished compiling a frame, and whether it was a
  recompilation: ``torch._dynamo.callback``'s end callbacks, whose form
  changed (torch 2.8 and later pass ``CallbackArgs``, 2.7 nothing), read
  together with ``torch._guards.CompileContext``'s structured compile id
  (``frame_compile_id`` is 0 for a frame's first compile);
- how many graphs and graph breaks dynamo has made in this process
  (``torch._dynamo.utils.counters``);
- which function mode is on top of the stack
  (``torch.overrides._get_current_function_mode``).

Each is wrapped here, and ``tests/test_dynamo_adapter.py`` pins what each
returns on the installed torch, so that a torch release that changes one
fails there, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.callback as dynamo_callback
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch._guards import CompileContext

#: None before torch 2.8 (its end callbacks take no argument)
_TRIGGER: Any = getattr(dynamo_callback, "CallbackTrigger", None)


def is_compiled(module: nn.Module) -> bool:
    """``module.compile()`` was called on it, or it is ``torch.compile(m)``'s
    wrapper. (Cheap: a runtime may ask it of every module at every forward.)"""
    return getattr(module, "_compiled_call_impl", None) is not None or isinstance(module, OptimizedModule)


def is_compile_wrapper(module: nn.Module) -> bool:
    """``module`` is the wrapper ``torch.compile(m)`` returns (which runs
    ``m``'s hooks before its compiled forward), not a module compiled in place."""
    return isinstance(module, OptimizedModule)


def on_frame_compiled(callback: Callable[[int], None]) -> Callable[[], None]:
    """Call ``callback(frame_compile_id)`` each time dynamo ends compiling a
    frame: 0 for the frame's first compilation, 1, 2, ... for each
    recompilation after a guard failed. Not for a backward compiled lazily
    later, nor for autotuning. Returns the function that unregisters it (a
    no-op once ``torch._dynamo.reset`` cleared every callback)."""
    handler: Any = dynamo_callback.callback_handler  # its callback type depends on the torch version

    def report() -> None:
        compile_id = CompileContext.current_compile_id()
        if compile_id is not None and compile_id.frame_compile_id is not None:
            callback(int(compile_id.frame_compile_id))

    end: Callable[..., None]
    if _TRIGGER is not None:
        dynamo = _TRIGGER.DYNAMO

        def end(args: Any) -> None:
            if args.callback_trigger is dynamo:
                report()

    else:

        def end() -> None:
            report()

    handler.register_end_callback(end)

    def remove() -> None:
        try:
            handler.remove_end_callback(end)
        except ValueError:  # already cleared (torch._dynamo.reset clears every callback)
            pass

    return remove


def compile_totals() -> tuple[int, int]:
    """(graphs compiled, graph breaks met) by dynamo in this process so far."""
    counters = torch._dynamo.utils.counters
    return int(counters["stats"]["unique_graphs"]), int(counters["graph_break"].total())


def current_function_mode() -> Any:
    """The ``TorchFunctionMode`` on top of this thread's stack, or None."""
    return torch.overrides._get_current_function_mode()


__all__ = ["compile_totals", "current_function_mode", "is_compile_wrapper", "is_compiled", "on_frame_compiled"]
