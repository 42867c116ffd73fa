"""RecordedStep: one training step as a planner sees it.

A scheduler plans over the whole step at once (``z3kit.schedule_plan``).
What it plans over is this record of the step the runtime traced: the
fetch units' fetches in order (forward, then backward), the points where a
unit's parameters may be let go (its exits), and every fetch the trace
does not number (a checkpointed block recomputing its forward inside
backward), interleaved as they happened.

Words: a *fetch* is a unit asking for its parameters (pre-forward or
pre-backward); an *exit* is the point after which the unit no longer needs
them (post-forward, post-backward); a unit is *in flight* between its
fetch and its exit. A plan names what to prefetch after each fetch and
what to release at each exit.

Pure data over integer ids and element counts: no tensors, no process
group, no modules. Build one by hand to unit-test a planner
(``RecordedStep.chain``).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence

import attrs

from z3kit.validate import check_ints


class Phase(enum.Enum):
    """Which half of the step a fetch belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"


@attrs.frozen
class UnitFetch:
    """One numbered fetch: the unit (its name and its id within the step, the
    same for every fetch of one unit), the phase, and its parameters."""

    unit: str
    unit_id: int
    phase: Phase
    param_ids: tuple[int, ...]
    numels: tuple[int, ...]


class EventKind(enum.Enum):
    #: a numbered fetch (``fetches[index]``): a plan's prefetch follows it
    FETCH = "fetch"
    #: a fetch the trace does not number (a recomputation in backward): gathers what is missing, holds the unit
    UNNUMBERED = "unnumbered"
    #: a unit's exit (``exits[index]``): a plan's release happens here
    EXIT = "exit"


@attrs.frozen
class UnitExit:
    """One exit: the unit, the numbered fetch it closes (its last; -1: none), its
    parameters, and those its forward returned (``keep``: never released here)."""

    unit: str
    unit_id: int
    fetch: int
    param_ids: tuple[int, ...]
    keep: tuple[int, ...] = ()


@attrs.frozen
class StepEvent:
    """One point of the step: ``kind`` and, for FETCH and EXIT, the index
    into ``fetches`` or ``exits``; for UNNUMBERED, the index into ``unnumbered``."""

    kind: EventKind
    index: int


def _check_events(step: RecordedStep, attribute: object, events: tuple[StepEvent, ...]) -> None:
    counts = {EventKind.FETCH: len(step.fetches), EventKind.EXIT: len(step.exits),
              EventKind.UNNUMBERED: len(step.unnumbered)}
    seen: dict[EventKind, list[int]] = {kind: [] for kind in EventKind}
    for event in events:
        seen[event.kind].append(event.index)
    for kind, indices in seen.items():
        if indices != list(range(counts[kind])):
            raise ValueError(f"the step's {kind.value} events must number 0..{counts[kind] - 1} in order, "
                             f"got {indices[:8]}")


@attrs.frozen
class RecordedStep:
    """A traced training step (see the module docstring). ``numels`` gives
    every parameter's elements by id; ``persistent`` the ids that stay
    gathered for the whole run (a plan never names them);
    ``gathered_at_start`` the ids gathered when a step begins, of them
    ``inflight_at_start`` still in flight (one gather)."""

    fetches: tuple[UnitFetch, ...]
    exits: tuple[UnitExit, ...]
    events: tuple[StepEvent, ...] = attrs.field(validator=_check_events)
    numels: tuple[int, ...]
    persistent: frozenset[int] = frozenset()
    gathered_at_start: frozenset[int] = frozenset()
    inflight_at_start: tuple[int, ...] = ()
    #: the fetches the trace does not number, as (unit, unit id, parameter ids)
    unnumbered: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    _use_index: dict[int, list[int]] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        check_ints("numels", self.numels, at_least=0)
        n = len(self.numels)
        ids = [*self.persistent, *self.gathered_at_start, *self.inflight_at_start]
        ids += [p for f in self.fetches for p in f.param_ids] + [p for e in self.exits for p in e.param_ids]
        for pid in check_ints("parameter ids", ids, at_least=0):
            if pid >= n:
                raise ValueError(f"parameter id {pid} is out of range: the step has {n} parameters")
        for f in self.fetches:
            if tuple(self.numels[p] for p in f.param_ids) != f.numels:
                raise ValueError(f"fetch of {f.unit!r}: sizes {f.numels} differ from its parameters' "
                                 f"{tuple(self.numels[p] for p in f.param_ids)}")
        uses: dict[int, list[int]] = {}
        for i, f in enumerate(self.fetches):
            for pid in f.param_ids:
                uses.setdefault(pid, []).append(i)
        object.__setattr__(self, "_use_index", uses)  # derived once: planners ask it per parameter

    # -- queries a planner uses ------------------------------------------------------------
    def next_use(self, param_id: int, after: int) -> int | None:
        """The first fetch index > ``after`` whose unit needs ``param_id`` (None: no more)."""
        uses = self._use_index.get(param_id, [])
        i = bisect.bisect_right(uses, after)
        return uses[i] if i < len(uses) else None

    def unit_of(self, event: StepEvent) -> tuple[str, int, tuple[int, ...]]:
        """The unit an event is of: its name, its id, and the parameter ids the fetch or exit names."""
        if event.kind is EventKind.FETCH:
            f = self.fetches[event.index]
            return f.unit, f.unit_id, f.param_ids
        if event.kind is EventKind.EXIT:
            e = self.exits[event.index]
            return e.unit, e.unit_id, e.param_ids
        return self.unnumbered[event.index]

    def in_flight_after(self) -> list[dict[str, tuple[int, ...]]]:
        """For each exit, the units still in flight right after it (name ->
        parameter ids): what a release there must leave alone."""
        holders: dict[int, tuple[str, tuple[int, ...]]] = {}
        out: list[dict[str, tuple[int, ...]]] = []
        for event in self.events:
            unit, unit_id, pids = self.unit_of(event)
            if event.kind is EventKind.EXIT:
                holders.pop(unit_id, None)
                out.append(dict(holders.values()))
            else:
                holders.setdefault(unit_id, (unit, pids))
        return out

    # -- hand-built steps -------------------------------------------------------------------
    @classmethod
    def chain(cls, units: Sequence[tuple[str, Sequence[int]]], numels: Sequence[int], *,
              persistent: Sequence[int] = ()) -> RecordedStep:
        """A step through a chain of units: each unit's forward fetch and exit
        in order, then each one's backward fetch and exit in reverse, as a
        stack of layers records it. ``units``: (name, parameter ids) each."""
        fetches: list[UnitFetch] = []
        exits: list[UnitExit] = []
        events: list[StepEvent] = []
        order = [(i, Phase.FORWARD) for i in range(len(units))]
        order += [(i, Phase.BACKWARD) for i in reversed(range(len(units)))]
        for unit_id, phase in order:
            name, pids = units[unit_id]
            ids = tuple(pids)
            events.append(StepEvent(EventKind.FETCH, len(fetches)))
            fetches.append(UnitFetch(name, unit_id, phase, ids, tuple(numels[p] for p in ids)))
            events.append(StepEvent(EventKind.EXIT, len(exits)))
            exits.append(UnitExit(name, unit_id, len(fetches) - 1, ids))
        kept = frozenset(persistent)
        return cls(tuple(fetches), tuple(exits), tuple(events), tuple(numels), kept, kept)
