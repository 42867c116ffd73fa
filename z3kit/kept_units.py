"""Units a plan keeps gathered across steps, and the all-gathers that saves.

A plan (``z3kit.schedule_plan.SchedulePlan``) may name fetch units in
``keep_units``: their parameters are not freed at the end of a step, so
the next step starts with them gathered and its fetches of them gather
nothing. They cannot stay as they are, though: the optimizer step writes
new values into their shards, so the runtime gathers them again right
after it, in one collective with the persistent parameters (which are
refreshed the same way), and a kept copy is never stale.

``kept_ids`` resolves the names against a recorded step (a unit's
parameters as its fetches name them; persistent ones are kept anyway and
left out); ``gathers_per_step`` counts the gathers a step makes under a
plan, one per fetch that misses a parameter and one per prefetch that
brings one, so that ``saved_gathers`` can say what keeping saves: the
gathers of the same plan with the kept parameters freed at their units'
exits and at the end of the step, less those with them kept, less the
refresh after the optimizer step when there is no persistent one to share
it with.

Pure bookkeeping over integer ids: no tensors, no process group.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from z3kit.recorded_step import EventKind, RecordedStep


def unit_params(step: RecordedStep) -> dict[str, set[int]]:
    """Each unit's name and the parameter ids its fetches and exits name in ``step``."""
    units: dict[str, set[int]] = {}
    for event in step.events:
        name, _, pids = step.unit_of(event)
        units.setdefault(name, set()).update(pids)
    return units


def kept_ids(names: Sequence[object], step: RecordedStep, who: str) -> frozenset[int]:
    """The parameter ids of the units ``names`` (persistent ones left out);
    ``ValueError`` naming ``who`` for a name that is no unit of ``step``."""
    units = unit_params(step)
    kept: set[int] = set()
    for name in names:
        if not isinstance(name, str) or name not in units:
            shown = ", ".join(repr(u) for u in list(units)[:12]) + (" ..." if len(units) > 12 else "")
            raise ValueError(f"{who} keeps unit {name!r} gathered across steps, but the step has no unit of that "
                             f"name (its units: {shown})")
        kept |= units[name]
    return frozenset(kept - step.persistent)


def gathers_per_step(
    step: RecordedStep,
    prefetch: Sequence[Collection[int]],
    release: Sequence[Collection[int]],
    start: Collection[int],
    also_released: Mapping[int, Collection[int]] | None = None,
) -> int:
    """The gathers a step makes that starts with ``start`` gathered, with
    the ``prefetch`` after each fetch and the ``release`` (and
    ``also_released``, by exit) at each exit."""
    live = set(start)
    more = also_released or {}
    gathers = 0
    for event in step.events:
        if event.kind is EventKind.EXIT:
            live.difference_update(release[event.index], more.get(event.index, ()))
            continue
        needed = set(step.unit_of(event)[2])
        if needed - live:
            gathers += 1
            live |= needed
        if event.kind is EventKind.FETCH:
            ahead = set(prefetch[event.index]) - live
            if ahead:
                gathers += 1
                live |= ahead
    return gathers


def saved_gathers(
    step: RecordedStep,
    prefetch: Sequence[Collection[int]],
    release: Sequence[Collection[int]],
    own: Sequence[Collection[int]],
    kept: frozenset[int],
) -> int:
    """The gathers per step that keeping ``kept`` saves under this plan
    (``own``: each exit's own releases, where the kept ones would go)."""
    if not kept:
        return 0
    start = set(step.gathered_at_start) | set(step.inflight_at_start)
    freed = {k: kept.intersection(ids) for k, ids in enumerate(own)}
    without = gathers_per_step(step, prefetch, release, start, freed)
    with_kept = gathers_per_step(step, prefetch, release, start | kept)
    refresh = 0 if step.persistent else 1  # after the optimizer step; shared with the persistent ones' if any
    return without - with_kept - refresh
