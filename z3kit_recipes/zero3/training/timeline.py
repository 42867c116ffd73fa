"""The parameter timeline of one optimizer step, and profiler labels.

``engine.capture_timeline()`` arms a ``Timeline``; from the next optimizer
step to the one after it, the parameter coordinator notes every fetch,
prefetch and release into it (``train`` plots it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch


_NOTHING = contextlib.nullcontext()
_T = TypeVar("_T")


def profiled(*label: object) -> contextlib.AbstractContextManager[Any]:
    """A range in torch.profiler traces named by ``label``'s parts joined by
    spaces; free when no profiler runs (the name is not even made)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(" ".join(str(part) for part in label))
    return _NOTHING


def profiled_as(kind: str, name: Callable[[_T], str], subject: _T) -> contextlib.AbstractContextManager[Any]:
    """``profiled(kind, name(subject))``, with ``name`` called only while a profiler runs (the hot
    path names a unit twice a step per unit: nothing it does when no one reads it)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(f"{kind} {name(subject)}")
    return _NOTHING


@attrs.frozen
class TimelineEvent:
    """One point of a step's parameter timeline."""

    time_s: float
    #: "fetch", "prefetch" or "release"
    kind: str
    module: str
    #: elements the event gathered or released
    numel: int
    #: gathered elements right after the event
    live_numel: int


class Timeline:
    """Armed by ``arm()``: records the optimizer step after the next ``step_boundary()``."""

    def __init__(self) -> None:
        self._armed = False
        self._recording: list[TimelineEvent] | None = None
        #: the last step recorded
        self.last: list[TimelineEvent] = []

    @property
    def recording(self) -> bool:
        return self._recording is not None

    def arm(self) -> None:
        self._armed = True

    def note(self, kind: str, module: str, numel: int, live_numel: int) -> None:
        if self._recording is not None:
            self._recording.append(TimelineEvent(time.perf_counter(), kind, module, numel, live_numel))

    def step_boundary(self) -> None:
        if self._recording is not None:
            self.last, self._recording = self._recording, None
        if self._armed:
            self._armed, self._recording = False, []
