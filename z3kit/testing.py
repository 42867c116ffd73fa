"""Hand-built recorded steps, to test planners without a process group.

``RecordedStep.chain`` (``z3kit.recorded_step``) gives a stack of units; the
builders here add what a chain does not have: ``StepBuilder`` writes a step
fetch by fetch and exit by exit (a unit in flight around others, a
parameter two units share, what a forward returns), and
``root_around_blocks`` is such a step, a root that owns a tied embedding
and head in flight around its blocks. Shipped with the package so that a
planner's own tests can use them (``docs/schedulers.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

from z3kit.recorded_step import EventKind, Phase, RecordedStep, StepEvent, UnitExit, UnitFetch

__all__ = ["StepBuilder", "root_around_blocks"]


class StepBuilder:
    """Write a step fetch by fetch and exit by exit, as the hooks would see it."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = tuple(numels)
        self.fetches: list[UnitFetch] = []
        self.exits: list[UnitExit] = []
        self.events: list[StepEvent] = []
        self._ids: dict[str, int] = {}
        self._last: dict[str, int] = {}

    def fetch(self, unit: str, pids: Sequence[int], phase: Phase = Phase.FORWARD) -> StepBuilder:
        """``unit`` is fetched (``phase``) and needs ``pids``."""
        unit_id = self._ids.setdefault(unit, len(self._ids))
        self._last[unit] = len(self.fetches)
        self.events.append(StepEvent(EventKind.FETCH, len(self.fetches)))
        self.fetches.append(UnitFetch(unit, unit_id, phase, tuple(pids), tuple(self.numels[p] for p in pids)))
        return self

    def exit(self, unit: str, pids: Sequence[int], keep: Sequence[int] = ()) -> StepBuilder:
        """``unit`` exits, closing its last fetch; ``keep``: the ids its forward returned."""
        self.events.append(StepEvent(EventKind.EXIT, len(self.exits)))
        self.exits.append(UnitExit(unit, self._ids[unit], self._last[unit], tuple(pids), tuple(keep)))
        return self

    def build(self, persistent: Sequence[int] = ()) -> RecordedStep:
        """The step written so far; ``persistent``: ids gathered for the whole run (and at the start)."""
        kept = frozenset(persistent)
        return RecordedStep(tuple(self.fetches), tuple(self.exits), tuple(self.events), self.numels, kept, kept)


def root_around_blocks(blocks: int = 3, width: int = 100) -> RecordedStep:
    """A root unit (parameter 0: a tied embedding and head) in flight around
    ``blocks`` block units of two parameters each, forward then backward."""
    numels = [width * 4] + [width] * (2 * blocks)
    ids = [(1 + 2 * b, 2 + 2 * b) for b in range(blocks)]
    step = StepBuilder(numels).fetch("<root>", [0])
    for b in range(blocks):
        step.fetch(f"blocks.{b}", ids[b]).exit(f"blocks.{b}", ids[b])
    step.exit("<root>", [0]).fetch("<root>", [0], Phase.BACKWARD)
    for b in reversed(range(blocks)):
        step.fetch(f"blocks.{b}", ids[b], Phase.BACKWARD).exit(f"blocks.{b}", ids[b])
    return step.exit("<root>", [0]).build()
