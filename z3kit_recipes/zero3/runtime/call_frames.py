"""The frames of the root's calls: which call of the model a hook runs in, and whether it still runs.

The root's hooks tell a nested call of the model from an outer one, and a
forward whose post-forward never ran from one still under way, by the frame
of ``nn.Module.__call__`` they were called from (see the Notes in
``zero3.runtime.root_hooks``): frames are kept, not counted.
"""

from __future__ import annotations

import inspect
from types import FrameType

from torch import nn

#: the code of ``nn.Module.__call__``: the frame of a call of the root runs it
_CALL_CODE = nn.Module.__call__.__code__


def call_frame() -> FrameType | None:
    """The frame of the root's ``nn.Module.__call__`` that the running hook was called from."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code is not _CALL_CODE:
        frame = frame.f_back
    return frame


def on_stack(frame: FrameType | None) -> bool:
    """Whether ``frame`` is still running in this thread (None, a call whose frame was not found: assumed so)."""
    if frame is None:
        return True
    here = inspect.currentframe()
    while here is not None:
        if here is frame:
            return True
        here = here.f_back
    return False
