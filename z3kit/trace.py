"""TraceRecorder: the order in which modules fetch their parameters.

ZeRO-3 prefetch needs to know which parameters come next. The first
training step records the order of module fetches (pre-forward and
pre-backward, in the order they happen); on completion the trace is frozen
and every later training step is checked against it, fetch by fetch. A
fetch that differs from the trace, or a training step with another number
of fetches, invalidates it: the next training step records afresh, so a
graph that branches differently costs one step without prefetch rather than
a wrong prefetch.

Words: a *step* is always a training step (forward and backward, from
``begin_step`` to ``end_step``); a *fetch* is one module asking for its
parameters (``TraceFetch``); the *cursor* is the index of the next fetch in
the current training step.

Pure bookkeeping over integer ids and element counts: no tensors, no
process group, no modules.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence

import attrs

from z3kit.validate import check_int, check_ints


class TraceState(enum.Enum):
    """What the recorder holds."""

    #: No usable trace; the next ``begin_step`` starts recording.
    INVALID = "invalid"
    #: Recording the current training step's fetches.
    RECORD = "record"
    #: Frozen trace; each fetch is validated against it.
    COMPLETE = "complete"


@attrs.frozen
class TraceFetch:
    """One fetch: a module and the parameters it needs (ids and sizes)."""

    module_id: int
    param_ids: tuple[int, ...]
    numels: tuple[int, ...]


def _check_fetch(module_id: object, param_ids: Sequence[object], numels: Sequence[object]) -> None:
    """Reject a malformed fetch before it reaches the trace: a bad entry in
    a recording would otherwise surface only as wrong distances later."""
    check_int("module_id", module_id)
    if len(param_ids) != len(numels):
        raise ValueError(f"{len(param_ids)} parameter ids but {len(numels)} sizes")
    check_ints("parameter ids", param_ids)
    if len(set(param_ids)) != len(param_ids):
        # A repeated id would count its elements twice in reuse distances.
        raise ValueError(f"duplicate parameter ids in one fetch: {list(param_ids)}")
    check_ints("numels", numels, at_least=0)


class TraceRecorder:
    """INVALID -> RECORD -> COMPLETE state machine over module fetches."""

    def __init__(self) -> None:
        self.state = TraceState.INVALID
        self.invalidations = 0
        self._fetches: list[TraceFetch] = []
        self._cursor = 0
        self._in_step = False
        # derived on completion
        self._uses: dict[int, list[int]] = {}
        self._cum_numel: list[int] = [0]
        self._frozen: tuple[TraceFetch, ...] = ()

    # -- lifecycle ---------------------------------------------------------
    def begin_step(self) -> None:
        """Start of a training step (forward and backward)."""
        if self._in_step:
            return
        self._in_step = True
        self._cursor = 0
        if self.state is TraceState.INVALID:
            self.state = TraceState.RECORD
            self._fetches = []

    def end_step(self) -> None:
        """End of a training step: freeze a recording, or check a complete trace's length."""
        if not self._in_step:
            return
        self._in_step = False
        if self.state is TraceState.RECORD:
            if self._fetches:
                self._freeze()
            else:
                self.state = TraceState.INVALID
        elif self.state is TraceState.COMPLETE and self._cursor != len(self._fetches):
            self.invalidate()

    def invalidate(self) -> None:
        """Drop the trace; the next training step records a new one."""
        if self.state is TraceState.COMPLETE:
            self.invalidations += 1
        self.state = TraceState.INVALID
        self._fetches = []
        self._uses = {}
        self._cum_numel = [0]

    @property
    def in_step(self) -> bool:
        """Whether a training step is open (``begin_step`` without its ``end_step``)."""
        return self._in_step

    # -- per fetch ---------------------------------------------------------
    def on_fetch(self, module_id: int, param_ids: Sequence[int], numels: Sequence[int]) -> bool:
        """Note a module fetch; returns True when it matches a complete trace
        (so prefetch may follow it). Records it while recording."""
        if self._in_step and self.state is TraceState.COMPLETE and self._cursor < len(self._fetches):
            ahead = self._fetches[self._cursor]
            # Sizes are part of the match: reuse distances and prefetch sizes
            # are read off the frozen sizes. A fetch equal to a recorded (hence
            # already validated) fetch needs no checks: this is the steady path.
            if (
                ahead.module_id == module_id
                and ahead.param_ids == tuple(param_ids)
                and ahead.numels == tuple(numels)
            ):
                self._cursor += 1
                return True
        _check_fetch(module_id, param_ids, numels)
        if not self._in_step:
            return False
        self._cursor += 1
        if self.state is TraceState.RECORD:
            self._fetches.append(TraceFetch(module_id, tuple(param_ids), tuple(numels)))
            return False
        if self.state is TraceState.COMPLETE:
            # the fast path above did not match: the training step departs from the trace
            self.invalidate()
        return False

    def next_module(self) -> int | None:
        """The module id the complete trace expects next, None past its end."""
        if self.state is not TraceState.COMPLETE or self._cursor >= len(self._fetches):
            return None
        return self._fetches[self._cursor].module_id

    @property
    def cursor(self) -> int:
        """Index of the next fetch within the current training step."""
        return self._cursor

    # -- derived views of a complete trace -----------------------------------
    @property
    def fetches(self) -> tuple[TraceFetch, ...]:
        """The frozen trace's fetches, in order (while recording: those recorded so far)."""
        if self.state is TraceState.COMPLETE:
            return self._frozen
        return tuple(self._fetches)

    def _freeze(self) -> None:
        self.state = TraceState.COMPLETE
        self._frozen = tuple(self._fetches)
        self._uses = {}
        cum = [0]
        for i, fetch in enumerate(self._fetches):
            for pid in fetch.param_ids:
                self._uses.setdefault(pid, []).append(i)
            cum.append(cum[-1] + sum(fetch.numels))
        self._cum_numel = cum

    def param_order(self) -> list[int]:
        """Parameter ids in order of first use in the trace."""
        seen: dict[int, None] = {}
        for fetch in self._fetches:
            for pid in fetch.param_ids:
                seen.setdefault(pid, None)
        return list(seen)

    def last_use(self) -> dict[int, int]:
        """Each parameter's last fetch index in the trace."""
        return {pid: uses[-1] for pid, uses in self._uses.items()}

    def next_use(self, param_id: int, after: int) -> int | None:
        """First fetch index > ``after`` that uses ``param_id``, or None."""
        uses = self._uses.get(param_id)
        if not uses:
            return None
        i = bisect.bisect_right(uses, after)
        return uses[i] if i < len(uses) else None

    def reuse_distance(self, param_id: int, at: int) -> int | None:
        """Elements fetched by the fetches strictly between fetch ``at`` and the
        next use of ``param_id``; None when the trace does not use it again.
        ``at=-1`` means before the first fetch (as for ``next_use``)."""
        # Below -1 the cumulative sizes would be indexed from the end and give
        # a wrong (even negative) distance instead of an error.
        check_int("at (a fetch index)", at, at_least=-1)
        nxt = self.next_use(param_id, at)
        if nxt is None:
            return None
        return self._cum_numel[nxt] - self._cum_numel[at + 1]
