"""The schedule plan the stock runtime executes, and the record it is made from.

While the trace records a step, this records the step as a planner sees it
(``z3kit.recorded_step``): each numbered fetch, each fetch off the trace (a
recomputation in backward), each exit, in order. When the recording
completes the trace, the planner plans it once (``z3kit.schedule_plan``),
and the plan is checked: a bad one is refused with ``PlanError`` at the end
of that backward, and at every step after, until the trace records afresh.
Every later step that follows the trace executes the plan: after fetch
``i`` it prefetches ``plan.prefetch[i]``; at its ``k``-th exit it releases
``plan.release[k]``. Before a plan exists, off the trace, or at an exit
that is not the recorded one, the fallback applies: no prefetch, and the
exiting unit's parameters released.

The record assumes what a step after an optimizer step starts with: the
persistent parameters gathered (in flight with ``overlap_comm``); a plan
that keeps units gathered across steps (``z3kit.kept_units``) adds theirs,
and ``kept`` tells the runtime which ids those are while the plan is in force.

Pure bookkeeping over module objects and ids.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import nn

from z3kit.recorded_step import EventKind, Phase, RecordedStep, StepEvent, UnitExit, UnitFetch
from z3kit.schedule_plan import PlanSummary, SchedulePlan, SchedulePlanner, check_plan
from z3kit.trace import TraceRecorder, TraceState
from z3kit_recipes.zero3.training.fetch_units import FetchUnits


class StepPlans:
    """Records the traced step, plans it, and answers the hot path from the plan."""

    def __init__(self, planner: SchedulePlanner, units: FetchUnits, trace: TraceRecorder,
                 persistent: Sequence[bool], *, overlap: bool) -> None:
        self.planner, self.units, self.trace, self.overlap = planner, units, trace, overlap
        #: how messages and ``stats()`` name the planner
        self.planner_name = type(planner).__name__
        if type(planner).__repr__ is not object.__repr__ and len(repr(planner)) <= 120:  # not one with an address
            self.planner_name = repr(planner)
        self.persistent = frozenset(p for p, kept in enumerate(persistent) if kept)
        #: the step the plan was made from, the plan, and what the check found (None: not yet)
        self.recorded: RecordedStep | None = None
        self.plan: SchedulePlan | None = None
        self.summary: PlanSummary | None = None
        self._exit_units: tuple[int, ...] = ()
        self._exits = 0
        self._clear()

    def _clear(self) -> None:
        self._fetches: list[UnitFetch] = []
        self._exits_seen: list[UnitExit] = []
        self._unnumbered: list[tuple[str, int, tuple[int, ...]]] = []
        self._events: list[StepEvent] = []
        self._partial = False

    @property
    def _recording(self) -> bool:
        return self.trace.in_step and self.trace.state is TraceState.RECORD

    # -- the step ------------------------------------------------------------------------------
    def begin(self) -> None:
        """A traced step begins (after the trace's ``begin_step``)."""
        self._exits = 0
        self._clear()
        self.ensure_plan()

    def units_changed(self) -> None:
        """A unit's parameters changed (units regrouped, a parameter joined a
        unit) in the middle of a step: this step's record is not whole, and
        the plan made for the old units is void."""
        self._clear()
        self._partial = True
        self.plan = self.recorded = self.summary = None

    def end(self, *, was_recording: bool) -> None:
        """The step ended (after the trace's ``end_step``): a recording that completed the trace is kept to plan."""
        if was_recording and not self._partial and self.trace.state is TraceState.COMPLETE:
            self.recorded = RecordedStep(
                tuple(self._fetches), tuple(self._exits_seen), tuple(self._events), tuple(self.units.numels),
                persistent=self.persistent,
                # after an optimizer step the persistent parameters are gathered again, in flight with overlap
                gathered_at_start=self.persistent,
                inflight_at_start=tuple(sorted(self.persistent)) if self.overlap else (),
                unnumbered=tuple(self._unnumbered),
            )
            self.plan = self.summary = None
        elif self.trace.state is not TraceState.COMPLETE:
            self.plan = self.recorded = self.summary = None
        self._clear()

    def ensure_plan(self) -> None:
        """Plan the recorded step if that is not done yet (``PlanError``: the plan is refused)."""
        if self.recorded is None or self.plan is not None or self.trace.state is not TraceState.COMPLETE:
            return
        plan = self.planner.plan(self.recorded)
        self.summary = check_plan(plan, self.recorded, self.planner_name)
        self.plan = plan
        self._exit_units = tuple(e.unit_id for e in self.recorded.exits)

    @property
    def kept(self) -> frozenset[int]:
        """The ids the plan in force keeps gathered across steps (none without a plan)."""
        return self.summary.kept if self.plan is not None and self.summary is not None else frozenset()

    def describe(self) -> str:
        """The plan as text (``SchedulePlan.describe``), or why there is none."""
        if self.plan is None or self.recorded is None:
            return (f"no plan yet ({self.planner_name}): the first training step records the trace it is made from, "
                    "and a step that leaves the trace records it again")
        return f"planner {self.planner_name}\n{self.plan.describe(self.recorded)}"

    # -- the hot path ----------------------------------------------------------------------------
    def fetched(self, module: nn.Module, index: int, phase: Phase) -> tuple[int, ...]:
        """Numbered fetch ``index`` of ``module`` matched the trace (or was
        recorded): what the plan prefetches after it."""
        if self._recording:
            self._events.append(StepEvent(EventKind.FETCH, len(self._fetches)))
            ids, numels = self.units.fetch_key(module)
            self._fetches.append(UnitFetch(self.units.name(module), self.units.keys[module], phase, ids, numels))
            return ()
        plan = self.plan
        return plan.prefetch[index] if plan is not None and index < len(plan.prefetch) else ()

    def fetched_off_trace(self, module: nn.Module) -> None:
        """``module`` fetched inside the step without a number in the trace (a recomputation)."""
        if self._recording:
            self._events.append(StepEvent(EventKind.UNNUMBERED, len(self._unnumbered)))
            self._unnumbered.append((self.units.name(module), self.units.keys[module],
                                     tuple(self.units.module_params[module])))

    def at_exit(self, module: nn.Module, fetch: int, keep: Collection[int]) -> tuple[int, ...] | None:
        """``module`` exits in the step: what the plan releases here (None: the fallback applies)."""
        k = self._exits
        self._exits = k + 1
        if self._recording:
            self._events.append(StepEvent(EventKind.EXIT, len(self._exits_seen)))
            self._exits_seen.append(UnitExit(self.units.name(module), self.units.keys[module], fetch,
                                             tuple(self.units.module_params[module]), tuple(keep)))
            return None
        plan = self.plan
        if plan is None or self.trace.state is not TraceState.COMPLETE or k >= len(plan.release):
            return None
        if self._exit_units[k] != self.units.keys.get(module):  # not the recorded exit: off the plan from here on
            self._exits = len(plan.release)
            return None
        return plan.release[k]


