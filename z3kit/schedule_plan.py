"""SchedulePlan: what a step prefetches and releases, planned once and checked.

A ``SchedulePlanner`` sees a whole recorded step (``z3kit.recorded_step``)
and returns a plan: for each numbered fetch, the parameters to prefetch
right after it (one gather), and for each exit, the parameters to release
there. The runtime executes the plan on every later step that follows the
same trace, with no policy call per module; before a trace exists, and off
it, it falls back to the simplest schedule: no prefetch, and a unit's own
parameters released at its exit.

A plan may also keep named units gathered across steps (``keep_units``,
``z3kit.kept_units``).

``check_plan`` refuses, before the plan is used, one that names a bad id
or a unit the step does not have, releases a persistent parameter, one
that the exiting unit returned, one that a unit in flight needs, or one
it keeps, or whose live elements exceed its ``live_limit``; the message
names the planner, the unit and the id. A prefetch of a parameter already
gathered, or a release of one that is not, does nothing.

Pure bookkeeping over integer ids: no tensors, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from z3kit.kept_units import kept_ids, saved_gathers, unit_params
from z3kit.recorded_step import EventKind, RecordedStep
from z3kit.validate import is_int

Ids = tuple[int, ...]


@attrs.frozen
class SchedulePlan:
    """``prefetch[i]``: ids gathered after fetch ``i``; ``release[k]``: ids
    released at exit ``k``; ``live_limit``: the most elements the plan may
    keep gathered (None: no limit of its own). ``planner`` names who made it.
    ``keep_units``: fetch units (by name) whose parameters stay gathered
    across steps, gathered again right after each optimizer step
    (``z3kit.kept_units``); a plan never releases them."""

    prefetch: tuple[Ids, ...]
    release: tuple[Ids, ...]
    live_limit: int | None = None
    planner: str = ""
    keep_units: tuple[str, ...] = ()

    @classmethod
    def of(cls, prefetch: Sequence[Sequence[int]], release: Sequence[Sequence[int]], *,
           live_limit: int | None = None, planner: str = "", keep_units: Sequence[str] = ()) -> SchedulePlan:
        """A plan from lists (each made a tuple)."""
        return cls(tuple(tuple(ids) for ids in prefetch), tuple(tuple(ids) for ids in release), live_limit, planner,
                   tuple(keep_units))

    def describe(self, step: RecordedStep) -> str:
        """The plan as text, one line per fetch and exit, to print or diff:
        which unit holds what, when, and the live elements after each line."""
        units = unit_params(step)
        kept = {p for name in self.keep_units for p in units.get(name, ())} - step.persistent
        live = set(step.gathered_at_start) | set(step.inflight_at_start) | kept
        lines = []
        if kept:
            lines.append(f"kept gathered across steps: {', '.join(self.keep_units)} ({_ids(sorted(kept))}), "
                         f"{sum(step.numels[p] for p in kept):,} elements")
        for event in step.events:
            if event.kind is EventKind.FETCH:
                f = step.fetches[event.index]
                live |= set(f.param_ids)
                what = f"fetch {event.index:>3} {f.phase.value:<8} {f.unit}"
                if event.index < len(self.prefetch) and self.prefetch[event.index]:
                    live |= set(self.prefetch[event.index])
                    what += f"  prefetch {_ids(self.prefetch[event.index])}"
            elif event.kind is EventKind.UNNUMBERED:
                unit, _, pids = step.unit_of(event)
                live |= set(pids)
                what = f"fetch   - recompute {unit}"
            else:
                e = step.exits[event.index]
                released = self.release[event.index] if event.index < len(self.release) else ()
                live -= set(released)
                what = f"exit  {event.index:>3} {e.unit}" + (f"  release {_ids(released)}" if released else "")
            lines.append(f"{what}  | live {sum(step.numels[p] for p in live):,}")
        return "\n".join(lines)


def _ids(ids: Sequence[int]) -> str:
    return "#" + ",#".join(str(p) for p in ids)


@runtime_checkable
class SchedulePlanner(Protocol):
    """Plans a step's prefetches and releases (see the module docstring)."""

    def is_persistent(self, numel: int) -> bool:
        """True for parameters that stay gathered for the whole run (asked once per parameter, at initialize)."""
        ...

    def plan(self, step: RecordedStep) -> SchedulePlan:
        """The plan for every step that follows ``step``'s trace."""
        ...


def own_releases(step: RecordedStep) -> list[Ids]:
    """At each exit, the exiting unit's own parameters that may go: not
    persistent, not returned by its forward, not needed by a unit still in
    flight. The fallback's releases, and a start for a planner's."""
    out: list[Ids] = []
    for e, in_flight in zip(step.exits, step.in_flight_after()):
        busy = {p for ids in in_flight.values() for p in ids}
        out.append(tuple(p for p in e.param_ids if p not in step.persistent and p not in e.keep and p not in busy))
    return out


class PlanError(ValueError):
    """A planner's plan was refused (``check_plan``)."""


@attrs.frozen
class PlanSummary:
    """What a checked plan does: its peak of live elements, its prefetch
    gathers, the ids it keeps gathered across steps, their elements, and
    the gathers per step that keeping them saves (``z3kit.kept_units``)."""

    peak_live_numel: int
    prefetches: int
    kept: frozenset[int] = frozenset()
    kept_numel: int = 0
    saved_gathers: int = 0


def check_plan(plan: object, step: RecordedStep, planner: str) -> PlanSummary:
    """Refuse a plan that could not run as planned (see the module docstring);
    otherwise say what it does."""
    who = f"planner {planner}"
    if not isinstance(plan, SchedulePlan):
        raise PlanError(f"{who} returned {type(plan).__name__}, not a SchedulePlan")
    if len(plan.prefetch) != len(step.fetches) or len(plan.release) != len(step.exits):
        raise PlanError(f"{who}: a plan needs one prefetch entry per fetch ({len(step.fetches)}) and one release "
                        f"entry per exit ({len(step.exits)}), got {len(plan.prefetch)} and {len(plan.release)}")
    n = len(step.numels)

    def valid(pid: object, where: str) -> int:
        if not is_int(pid) or not 0 <= pid < n:
            raise PlanError(f"{who} names parameter id {pid!r} at {where}, which is no parameter of the model "
                            f"(ids are 0 to {n - 1})")
        if pid in step.persistent:
            raise PlanError(f"{who} names persistent parameter #{pid} at {where}: persistent parameters stay "
                            "gathered for the whole run and are never planned")
        return pid

    try:
        kept = kept_ids(plan.keep_units, step, who)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    in_flight = step.in_flight_after()
    live = set(step.gathered_at_start) | set(step.inflight_at_start) | kept
    peak = live_numel = sum(step.numels[p] for p in live)
    prefetches = 0
    for event in step.events:
        if event.kind is EventKind.EXIT:
            e = step.exits[event.index]
            where = f"the exit of {e.unit!r} (exit {event.index})"
            for pid in plan.release[event.index]:
                valid(pid, where)
                if pid in e.keep:
                    raise PlanError(f"{who} releases parameter #{pid} at {where}, but the unit's forward returned it")
                if pid in kept:
                    raise PlanError(f"{who} releases parameter #{pid} at {where}, but keeps it gathered across steps "
                                    f"(keep_units {list(plan.keep_units)})")
                holders = [unit for unit, pids in in_flight[event.index].items() if pid in pids]
                if holders:
                    raise PlanError(f"{who} releases parameter #{pid} at {where}, while {holders[0]!r}, in flight, "
                                    "still needs it")
                if pid in live:
                    live.discard(pid)
                    live_numel -= step.numels[pid]
            continue
        if event.kind is EventKind.FETCH:
            f = step.fetches[event.index]
            needed = [*f.param_ids]
            ahead = [valid(pid, f"fetch {event.index} ({f.unit!r})") for pid in plan.prefetch[event.index]]
            prefetches += bool(set(ahead) - live - set(needed))
            needed += ahead
        else:
            needed = list(step.unit_of(event)[2])
        for pid in needed:
            if pid not in live:
                live.add(pid)
                live_numel += step.numels[pid]
        peak = max(peak, live_numel)
        if plan.live_limit is not None and live_numel > plan.live_limit:
            at = step.unit_of(event)[0]
            raise PlanError(f"{who} keeps {live_numel:,} elements gathered at the fetch of {at!r}, over its "
                            f"live limit of {plan.live_limit:,}")
    saved = saved_gathers(step, plan.prefetch, plan.release, own_releases(step), kept)
    return PlanSummary(peak, prefetches, kept, sum(step.numels[p] for p in kept), saved)
