"""ReleasePolicy: which of an exiting module's gathered parameters to free.

Policies are plain objects over parameter ids and sizes; they see the
trace through ``TraceRecorder``'s read-only queries and never touch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from z3kit.trace import TraceRecorder, TraceState


@runtime_checkable
class ReleasePolicy(Protocol):
    """Decides releases at module exit (post-forward and post-backward)."""

    def is_persistent(self, numel: int) -> bool:
        """True for parameters that stay gathered for the whole run."""
        ...

    def to_release(
        self,
        step: int,
        params: Sequence[tuple[int, int]],
        trace: TraceRecorder,
        live_numel: int,
    ) -> list[int]:
        """Ids among ``params`` ((id, numel) of the exiting module's gathered,
        non-persistent parameters) to release now. ``step`` is the exiting
        module's fetch index in the trace; ``live_numel`` the gathered elements."""
        ...


def _nonnegative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class StockReleasePolicy:
    """DeepSpeed's rule: keep a parameter whose next use in the frozen trace
    is within ``max_reuse_distance`` elements of fetching (tied weights, a
    layer used again soon), as long as the live total stays within
    ``max_live_parameters``; never release parameters smaller than
    ``param_persistence_threshold``. Without a complete trace, release all."""

    max_reuse_distance: int = attrs.field(default=1_000_000_000, validator=_nonnegative)
    param_persistence_threshold: int = attrs.field(default=100_000, validator=_nonnegative)
    max_live_parameters: int = attrs.field(default=1_000_000_000, validator=_nonnegative)

    def is_persistent(self, numel: int) -> bool:
        return numel < self.param_persistence_threshold

    def to_release(
        self,
        step: int,
        params: Sequence[tuple[int, int]],
        trace: TraceRecorder,
        live_numel: int,
    ) -> list[int]:
        if trace.state is not TraceState.COMPLETE:
            return [pid for pid, _ in params]
        released: list[int] = []
        for pid, numel in params:
            distance = trace.reuse_distance(pid, step)
            keep = (
                distance is not None
                and distance <= self.max_reuse_distance
                and live_numel <= self.max_live_parameters
            )
            if not keep:
                released.append(pid)
                live_numel -= numel
        return released


@attrs.frozen
class ImmediateReleasePolicy:
    """Release every parameter as soon as its module exits; nothing persists."""

    def is_persistent(self, numel: int) -> bool:
        return False

    def to_release(
        self,
        step: int,
        params: Sequence[tuple[int, int]],
        trace: TraceRecorder,
        live_numel: int,
    ) -> list[int]:
        return [pid for pid, _ in params]
