"""TraceRecorder: the order in which modules fetch their parameters.

ZeRO-3 prefetch needs to know which parameters come next. The first step
records the order of module fetches (pre-forward and pre-backward, in the
order they happen); on completion the trace is frozen and every later step
is checked against it, fetch by fetch. A fetch that differs from the trace,
or a step of another length, invalidates it: the next step records afresh,
so a graph that branches differently costs one step without prefetch rather
than a wrong prefetch.

Pure bookkeeping over integer ids and element counts: no tensors, no
process group, no modules.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence

import attrs


class TraceState(enum.Enum):
    """What the recorder holds."""

    #: No usable trace; the next ``begin_step`` starts recording.
    INVALID = "invalid"
    #: Recording the current step's fetches.
    RECORD = "record"
    #: Frozen trace; each fetch is validated against it.
    COMPLETE = "complete"


@attrs.frozen
class TraceStep:
    """One fetch: a module and the parameters it needs (ids and sizes)."""

    module_id: int
    param_ids: tuple[int, ...]
    numels: tuple[int, ...]


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a size or an id is a caller's mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fetch(module_id: object, param_ids: Sequence[object], numels: Sequence[object]) -> None:
    """Reject a malformed fetch before it reaches the trace: a bad entry in
    a recording would otherwise surface only as wrong distances later."""
    if not _is_int(module_id):
        raise TypeError(f"module_id must be an int, got {type(module_id).__name__}")
    if len(param_ids) != len(numels):
        raise ValueError(f"{len(param_ids)} parameter ids but {len(numels)} sizes")
    for pid in param_ids:
        if not _is_int(pid):
            raise TypeError(f"parameter ids must be ints, got {type(pid).__name__}")
    if len(set(param_ids)) != len(param_ids):
        # A repeated id would count its elements twice in reuse distances.
        raise ValueError(f"duplicate parameter ids in one fetch: {list(param_ids)}")
    for numel in numels:
        if isinstance(numel, bool) or not isinstance(numel, int):
            raise TypeError(f"numels must be ints, got {type(numel).__name__}")
        if numel < 0:
            raise ValueError(f"numels must be >= 0, got {numel}")


class TraceRecorder:
    """INVALID -> RECORD -> COMPLETE state machine over module fetches."""

    def __init__(self) -> None:
        self.state = TraceState.INVALID
        self.invalidations = 0
        self._steps: list[TraceStep] = []
        self._cursor = 0
        self._in_step = False
        # derived on completion
        self._uses: dict[int, list[int]] = {}
        self._cum_numel: list[int] = [0]
        self._frozen: tuple[TraceStep, ...] = ()

    # -- lifecycle ---------------------------------------------------------
    def begin_step(self) -> None:
        """Start of a training step (forward and backward)."""
        if self._in_step:
            return
        self._in_step = True
        self._cursor = 0
        if self.state is TraceState.INVALID:
            self.state = TraceState.RECORD
            self._steps = []

    def end_step(self) -> None:
        """End of a step: freeze a recording, or check a complete trace's length."""
        if not self._in_step:
            return
        self._in_step = False
        if self.state is TraceState.RECORD:
            if self._steps:
                self._freeze()
            else:
                self.state = TraceState.INVALID
        elif self.state is TraceState.COMPLETE and self._cursor != len(self._steps):
            self.invalidate()

    def invalidate(self) -> None:
        """Drop the trace; the next step records a new one."""
        if self.state is TraceState.COMPLETE:
            self.invalidations += 1
        self.state = TraceState.INVALID
        self._steps = []
        self._uses = {}
        self._cum_numel = [0]

    @property
    def in_step(self) -> bool:
        return self._in_step

    # -- per fetch ---------------------------------------------------------
    def on_fetch(self, module_id: int, param_ids: Sequence[int], numels: Sequence[int]) -> bool:
        """Note a module fetch; returns True when it matches a complete trace
        (so prefetch may follow it). Records it while recording."""
        if self._in_step and self.state is TraceState.COMPLETE and self._cursor < len(self._steps):
            ahead = self._steps[self._cursor]
            # Sizes are part of the match: reuse distances and prefetch sizes
            # are read off the frozen sizes. A fetch equal to a recorded (hence
            # already validated) step needs no checks: this is the steady path.
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
            self._steps.append(TraceStep(module_id, tuple(param_ids), tuple(numels)))
            return False
        if self.state is TraceState.COMPLETE:
            # the fast path above did not match: the step departs from the trace
            self.invalidate()
        return False

    def expects(self, module_id: int, param_ids: Sequence[int], numels: Sequence[int]) -> bool:
        """Whether this fetch would match a complete trace (the trace is left alone)."""
        if self.state is not TraceState.COMPLETE or not self._in_step or self._cursor >= len(self._steps):
            return False
        ahead = self._steps[self._cursor]
        return ahead.module_id == module_id and ahead.param_ids == tuple(param_ids) and ahead.numels == tuple(numels)

    def next_module(self) -> int | None:
        """The module id the complete trace expects next, None past its end."""
        if self.state is not TraceState.COMPLETE or self._cursor >= len(self._steps):
            return None
        return self._steps[self._cursor].module_id

    @property
    def step(self) -> int:
        """Index of the next fetch within the current step."""
        return self._cursor

    # -- derived views of a complete trace -----------------------------------
    @property
    def steps(self) -> tuple[TraceStep, ...]:
        if self.state is TraceState.COMPLETE:
            return self._frozen
        return tuple(self._steps)

    def _freeze(self) -> None:
        self.state = TraceState.COMPLETE
        self._frozen = tuple(self._steps)
        self._uses = {}
        cum = [0]
        for i, st in enumerate(self._steps):
            for pid in st.param_ids:
                self._uses.setdefault(pid, []).append(i)
            cum.append(cum[-1] + sum(st.numels))
        self._cum_numel = cum

    def param_order(self) -> list[int]:
        """Parameter ids in order of first use in the trace."""
        seen: dict[int, None] = {}
        for st in self._steps:
            for pid in st.param_ids:
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
        """Elements fetched by the steps strictly between ``at`` and the next use
        of ``param_id``; None when it is not used again in this step.
        ``at=-1`` means before the first fetch (as for ``next_use``)."""
        # Below -1 the cumulative sizes would be indexed from the end and give
        # a wrong (even negative) distance instead of an error.
        if isinstance(at, bool) or not isinstance(at, int):
            raise TypeError(f"at must be an int fetch index, got {type(at).__name__}")
        if at < -1:
            raise ValueError(f"at must be a fetch index >= -1, got {at}")
        nxt = self.next_use(param_id, at)
        if nxt is None:
            return None
        return self._cum_numel[nxt] - self._cum_numel[at + 1]
