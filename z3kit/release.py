"""ReleasePolicy: which of an exiting module's gathered parameters to free.

Policies are plain objects over parameter ids and sizes; they see the
trace through ``TraceRecorder``'s read-only queries and never touch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from z3kit.trace import TraceRecorder, TraceState
from z3kit.validate import check_int, check_ints, int_validator


@runtime_checkable
class ReleasePolicy(Protocol):
    """Decides releases at module exit (post-forward and post-backward)."""

    def is_persistent(self, numel: int) -> bool:
        """True for parameters that stay gathered for the whole run."""
        ...

    def to_release(
        self,
        fetch: int,
        params: Sequence[tuple[int, int]],
        trace: TraceRecorder,
        live_numel: int,
    ) -> list[int]:
        """Ids among ``params`` ((id, numel) of the exiting module's gathered,
        non-persistent parameters) to release now. ``fetch`` is the index in
        the trace of the exiting module's fetch (-1: before the first fetch);
        ``live_numel`` the gathered elements, these parameters included."""
        ...


@attrs.frozen
class StockReleasePolicy:
    """DeepSpeed's rule: keep a parameter whose next use in the frozen trace
    comes after fewer than ``max_reuse_distance`` fetched elements
    (``TraceRecorder.reuse_distance``; tied weights, a layer used again
    soon), as long as the live total stays within ``max_live_parameters``;
    never release parameters smaller than ``param_persistence_threshold``.
    Without a complete trace, release all non-persistent ones."""

    max_reuse_distance: int = attrs.field(default=1_000_000_000, validator=int_validator(at_least=0))
    param_persistence_threshold: int = attrs.field(default=100_000, validator=int_validator(at_least=0))
    max_live_parameters: int = attrs.field(default=1_000_000_000, validator=int_validator(at_least=0))

    def is_persistent(self, numel: int) -> bool:
        return numel < self.param_persistence_threshold

    def to_release(
        self,
        fetch: int,
        params: Sequence[tuple[int, int]],
        trace: TraceRecorder,
        live_numel: int,
    ) -> list[int]:
        _check_release_args(fetch, params, live_numel)
        # Persistent parameters stay gathered for the whole run; the caller
        # should not pass them, but if it does they must not be freed here.
        candidates = [(pid, numel) for pid, numel in params if not self.is_persistent(numel)]
        if trace.state is not TraceState.COMPLETE:
            return [pid for pid, _ in candidates]
        # Note: the reuse window is strict, as in DeepSpeed's
        # ``__params_to_release`` (it stops scanning once the elements passed
        # reach the limit), so ``max_reuse_distance=0`` keeps nothing for
        # reuse; with ``<=`` no setting could turn reuse-keeping off.
        release: set[int] = set()
        reused: list[tuple[int, int]] = []
        for pid, numel in candidates:
            distance = trace.reuse_distance(pid, fetch)
            if distance is not None and distance < self.max_reuse_distance:
                reused.append((pid, numel))
            else:
                release.add(pid)
                live_numel -= numel
        # Note: the live bound is applied after the parameters that go anyway
        # are subtracted, so whether a reused parameter is kept does not
        # depend on where it sits in ``params``; reused ones are dropped in
        # order until the rest fit.
        for pid, numel in reused:
            if live_numel <= self.max_live_parameters:
                break
            release.add(pid)
            live_numel -= numel
        return [pid for pid, _ in candidates if pid in release]


def _check_release_args(fetch: object, params: Sequence[tuple[object, object]], live_numel: object) -> None:
    """Reject inputs that would make the live-bound arithmetic meaningless."""
    # -1 is "before the first fetch" (TraceRecorder.reuse_distance): what a
    # caller that has no fetch index for the module passes.
    check_int("fetch", fetch, at_least=-1)
    live = check_int("live_numel", live_numel)
    check_ints("parameter ids", (pid for pid, _ in params))
    total = sum(check_ints("parameter numels", (numel for _, numel in params), at_least=0))
    # The exiting module's parameters are gathered, so they are part of the
    # live total; less than them means the caller counts live elements wrong.
    if live < total:
        raise ValueError(f"live_numel {live_numel} is less than the {total} elements of params")


@attrs.frozen
class ImmediateReleasePolicy:
    """Release every parameter as soon as its module exits; nothing persists."""

    def is_persistent(self, numel: int) -> bool:
        return False

    def to_release(
        self,
        fetch: int,
        params: Sequence[tuple[int, int]],
        trace: TraceRecorder,
        live_numel: int,
    ) -> list[int]:
        return [pid for pid, _ in params]
