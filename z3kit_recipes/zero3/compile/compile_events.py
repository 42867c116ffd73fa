"""Dynamo's compile-end events, the one place that touches ``torch._dynamo.callback``.

torch has no public API for them, and the private one changed form: torch
2.8 and later call an end callback with ``CallbackArgs`` (what triggered the
compile, and its compile id), torch 2.7 with no argument, and only around
dynamo's own frame compiles, where ``torch._guards.CompileContext`` holds the
compile id.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch._dynamo.callback as dynamo_callback
from torch._guards import CompileContext

#: None before torch 2.8 (its end callbacks take no argument)
_TRIGGER: Any = getattr(dynamo_callback, "CallbackTrigger", None)


def on_dynamo_compile_end(callback: Callable[[str], None]) -> Callable[[], None]:
    """Call ``callback(compile_id)`` (``"frame/compile"``, as dynamo prints
    it) when dynamo ends compiling a frame; not for a backward compiled lazily
    later, nor for autotuning. Returns the function that unregisters it (a
    no-op once ``torch._dynamo.reset`` cleared every callback)."""
    handler: Any = dynamo_callback.callback_handler  # its callback type depends on the torch version
    end: Callable[..., None]
    if _TRIGGER is not None:
        dynamo = _TRIGGER.DYNAMO

        def end(args: Any) -> None:
            if args.callback_trigger is dynamo:
                callback(str(args.compile_id))

    else:

        def end() -> None:
            compile_id = CompileContext.current_compile_id()
            callback("" if compile_id is None else str(compile_id))

    handler.register_end_callback(end)

    def remove() -> None:
        try:
            handler.remove_end_callback(end)
        except ValueError:  # already cleared (torch._dynamo.reset clears every callback)
            pass

    return remove
