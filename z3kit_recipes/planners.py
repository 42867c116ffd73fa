"""Three small schedule planners, each a ``z3kit.schedule_plan.SchedulePlanner``.

They are examples to copy from as much as tools: each plans a recorded
step (``z3kit.recorded_step``) in a few lines, and the runtime checks the
plan before it runs it. Pass one as ``zero3.initialize(..., planner=...)``.

- ``KeepLastUnits(k)``: the parameters of the ``k`` units that exited last
  stay gathered, so a unit used again soon (the last blocks of forward, the
  first of backward) is not gathered twice.
- ``PrefetchAhead(n)``: after each fetch, gather the next ``n`` units'
  parameters in one collective.
- ``MemoryBudget(limit)``: prefetch as far ahead as keeps at most ``limit``
  elements gathered; the plan is refused if a unit alone needs more.
- ``KeepUnitsGathered(names)``: the named fetch units (the embedding, the
  last blocks) stay gathered across steps, gathered again once right after
  each optimizer step instead of at each of their fetches
  (``z3kit.kept_units``); ``stats().plan_saved_gathers`` counts the saving.

Each releases a unit's own parameters at its exit where it releases at all
(``own_releases``), and treats parameters under ``persistence_threshold``
elements as persistent (gathered once, for the whole run).
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from z3kit.kept_units import unit_params
from z3kit.recorded_step import EventKind, RecordedStep
from z3kit.schedule_plan import Ids, SchedulePlan, own_releases
from z3kit.validate import int_validator


@attrs.frozen
class KeepLastUnits:
    """Keep the last ``k`` exited units' parameters gathered; nothing is prefetched."""

    k: int = attrs.field(validator=int_validator(at_least=0))
    persistence_threshold: int = attrs.field(default=0, validator=int_validator(at_least=0))

    def is_persistent(self, numel: int) -> bool:
        return numel < self.persistence_threshold

    def plan(self, step: RecordedStep) -> SchedulePlan:
        in_flight = step.in_flight_after()
        window: OrderedDict[int, Ids] = OrderedDict()  # unit id -> what it may release, least recent first
        release: list[Ids] = []
        for k, (e, own) in enumerate(zip(step.exits, own_releases(step))):
            if own or e.unit_id in window:  # a unit with nothing to release takes no place
                window[e.unit_id] = tuple(dict.fromkeys((*window.pop(e.unit_id, ()), *own)))
            out: dict[int, None] = {}
            while len(window) > self.k:
                out.update(dict.fromkeys(window.popitem(last=False)[1]))
            busy = {p for ids in window.values() for p in ids} | set(e.keep)
            busy.update(p for ids in in_flight[k].values() for p in ids)
            release.append(tuple(p for p in out if p not in busy))
        return SchedulePlan.of([()] * len(step.fetches), release, planner=repr(self))


@attrs.frozen
class PrefetchAhead:
    """After each fetch, prefetch the parameters of the next ``n`` fetches."""

    n: int = attrs.field(validator=int_validator(at_least=0))
    persistence_threshold: int = attrs.field(default=0, validator=int_validator(at_least=0))

    def is_persistent(self, numel: int) -> bool:
        return numel < self.persistence_threshold

    def plan(self, step: RecordedStep) -> SchedulePlan:
        fetches = step.fetches
        prefetch = [
            tuple(dict.fromkeys(p for f in fetches[i + 1 : i + 1 + self.n] for p in f.param_ids
                                if p not in step.persistent))
            for i in range(len(fetches))
        ]
        return SchedulePlan.of(prefetch, own_releases(step), planner=repr(self))


@attrs.frozen
class MemoryBudget:
    """Prefetch as far ahead as keeps at most ``limit`` elements gathered (the plan's ``live_limit``)."""

    limit: int = attrs.field(validator=int_validator(at_least=0))
    persistence_threshold: int = attrs.field(default=0, validator=int_validator(at_least=0))

    def is_persistent(self, numel: int) -> bool:
        return numel < self.persistence_threshold

    def plan(self, step: RecordedStep) -> SchedulePlan:
        numels = step.numels
        release = own_releases(step)
        live = set(step.gathered_at_start) | set(step.inflight_at_start)
        live_numel = sum(numels[p] for p in live)
        prefetch: list[Ids] = []
        for event in step.events:
            if event.kind is EventKind.EXIT:
                gone = live.intersection(release[event.index])
                live -= gone
                live_numel -= sum(numels[p] for p in gone)
                continue
            for p in set(step.unit_of(event)[2]) - live:
                live.add(p)
                live_numel += numels[p]
            if event.kind is EventKind.FETCH:
                ahead = self._ahead(step, event.index, live, self.limit - live_numel)
                live.update(ahead)
                live_numel += sum(numels[p] for p in ahead)
                prefetch.append(ahead)
        return SchedulePlan.of(prefetch, release, live_limit=self.limit, planner=repr(self))

    @staticmethod
    def _ahead(step: RecordedStep, index: int, live: set[int], room: int) -> Ids:
        """The parameters of the fetches after ``index``, in order, while they fit in ``room``."""
        picked: dict[int, None] = {}
        for f in step.fetches[index + 1 :]:
            for p in f.param_ids:
                if p in live or p in picked or p in step.persistent:
                    continue
                if step.numels[p] > room:
                    return tuple(picked)
                picked[p] = None
                room -= step.numels[p]
        return tuple(picked)


def _unit_names(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    if not all(isinstance(n, str) and n for n in value):
        raise TypeError(f"{attribute.name} must be fetch-unit names (non-empty strings), got {value!r}")


def _names(value: object) -> tuple[object, ...]:
    if isinstance(value, str):  # one name, not its characters
        raise TypeError(f"names must be a sequence of fetch-unit names, got the string {value!r}: use ({value!r},)")
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@attrs.frozen
class KeepUnitsGathered:
    """Keep the fetch units ``names`` gathered across steps; release the
    others' parameters at their exits; prefetch nothing. A name also covers
    the units under it (``"blocks.3"``: ``blocks.3`` and ``blocks.3.attn``);
    one that matches no unit is refused when the plan is checked."""

    names: tuple[str, ...] = attrs.field(converter=_names, validator=_unit_names)
    persistence_threshold: int = attrs.field(default=0, validator=int_validator(at_least=0))

    def is_persistent(self, numel: int) -> bool:
        return numel < self.persistence_threshold

    def plan(self, step: RecordedStep) -> SchedulePlan:
        units = unit_params(step)
        keep: list[str] = []
        for name in self.names:
            under = [u for u in units if u == name or u.startswith(name + ".")]
            keep += under or [name]  # no such unit: check_plan names it
        keep = list(dict.fromkeys(keep))
        kept = {p for u in keep for p in units.get(u, ())}
        release = [tuple(p for p in ids if p not in kept) for ids in own_releases(step)]
        return SchedulePlan.of([()] * len(step.fetches), release, planner=repr(self), keep_units=keep)
