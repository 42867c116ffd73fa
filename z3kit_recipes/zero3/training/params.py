"""The parameter lifecycle of the stock runtime: fetch, prefetch, release.

``ParamCoordinator`` answers the module hooks: ``fetch(module)`` at
pre-forward and pre-backward, ``release(module)`` at post-forward and
post-backward. It decides which parameters a module holds and when they may
go. Its parts: the fetch units (``zero3.training.fetch_units``: which
module gathers what), the traced step (``zero3.training.traced_step``: the
trace, the backward schedule, and where the ranks agree), who holds what
(``Holds``, ``zero3.training.holds``, with the Note on holding), the
release rule (a ``ReleasePolicy``), and the gathering itself (issue,
complete on the streams, free, prefetch, accounting: the ``Gatherer``,
``zero3.training.gathers``). Whether a fetch is part of the traced step
is the step state's answer (``StepState.tracing``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from z3kit.hook_context import in_backward
from z3kit.nested import iter_tensors
from z3kit.recorded_step import Phase
from z3kit.schedule_plan import SchedulePlanner
from z3kit.shard import ParamStatus
from z3kit.trace import TraceRecorder, TraceState
from z3kit_recipes.zero3.ranks.agreement import RankAgreement, StepRecord
from z3kit_recipes.zero3.step.state import StepState
from z3kit_recipes.zero3.training.fetch_units import FetchUnits
from z3kit_recipes.zero3.training.gathers import Gatherer
from z3kit_recipes.zero3.training.holds import Holds
from z3kit_recipes.zero3.training.rounds import FetchRounds
from z3kit_recipes.zero3.training.step_plans import StepPlans
from z3kit_recipes.zero3.training.timeline import Timeline, profiled_as
from z3kit_recipes.zero3.training.traced_step import TracedStep


class ParamCoordinator:
    """Which parameters each module holds, and when they are fetched and released."""

    def __init__(
        self,
        gatherer: Gatherer,
        module_params: dict[nn.Module, list[int]],
        *,
        trace: TraceRecorder,
        planner: SchedulePlanner,
        record: StepRecord,
        ranks: RankAgreement,
        timeline: Timeline,
        step: StepState,
        check_every_fetch: bool = False,
        rounds: FetchRounds | None = None,
    ) -> None:
        self.gatherer = gatherer
        self.shards = gatherer.shards
        self.index, self.numels = gatherer.index, gatherer.numels
        self.trace, self.limiter = trace, gatherer.limiter
        self.timeline = timeline
        #: where the step is (is this fetch traced?)
        self.step = step
        #: rank-divergent graphs: every gather is a round (``zero3.training.rounds``); no agreement, trace checks or prefetch
        self.rounds = rounds
        #: where the ranks agree on fetches (also those of eval forwards, ``agree_untraced``)
        self.ranks = ranks
        self.persistent = [planner.is_persistent(n) for n in self.numels]
        self.units = FetchUnits(module_params, self.numels)
        #: the step as the planner sees it, and the plan the hot path executes
        self.plans = StepPlans(planner, self.units, trace, self.persistent, overlap=gatherer.overlap)
        #: the trace, forward log and backward schedule of the step, and the ranks' agreement on them
        self.traced = TracedStep(self.units, trace, ranks, record, step.position,
                                 agreeing=rounds is None, check_every_fetch=check_every_fetch)
        #: which modules and pins hold each parameter (see the Note on holding)
        self.holds = Holds(len(self.shards))

    @property
    def module_params(self) -> dict[nn.Module, list[int]]:
        """Which module fetches which parameters (``FetchUnits``)."""
        return self.units.module_params

    @property
    def root(self) -> nn.Module:
        """The model: the first hooked module."""
        return self.units.root

    def regroup(self, module_params: dict[nn.Module, list[int]]) -> None:
        """Which module fetches which parameters (at initialize, and when
        compiled blocks become fetch units); the trace records afresh, a
        step in progress from its next fetch on."""
        self.units.regroup(module_params)
        self.traced.restart()
        self.plans.units_changed()

    def _note(self, kind: str, module: nn.Module | None, numel: int) -> None:
        if self.timeline.recording:
            name = "<prefetch>" if module is None else self.units.name(module)
            self.timeline.note(kind, name, numel, self.limiter.live_numel)

    # -- the training step ----------------------------------------------------------------
    def begin_step(self) -> None:
        """A training forward starts a traced step."""
        self.traced.begin()
        self.plans.begin()

    def end_step(self) -> None:
        """The step's backward ended: free what it gathered, close the trace's step
        (a recording that completed the trace is planned by ``plan_step``)."""
        self.release_all()
        was_recording = self.trace.state is TraceState.RECORD
        self.traced.end()
        self.plans.end(was_recording=was_recording)

    def plan_step(self) -> None:
        """Plan a newly completed trace now (``PlanError``: the planner's plan is refused)."""
        self.plans.ensure_plan()

    def abort(self, *, ranks_broken: bool) -> None:
        """A forward or backward raised: forget the step and its trace, free what
        was gathered (gathers in flight are abandoned when the ranks no longer
        run together, since they may never finish)."""
        if ranks_broken:
            self.gatherer.abandon_inflight()
        self.ranks.forget()
        self.release_all()
        self.traced.abort()
        self.plans.end(was_recording=False)

    # -- the module lifecycle --------------------------------------------------------
    def fetch(self, module: nn.Module) -> None:
        """Pre-forward: the module's parameters, gathered, held. In a traced
        step the fetch is also an entry of the backward schedule, and unless
        the recorded trace vouches for it, the ranks agree on it first; in an
        eval or no_grad forward they agree on each fetch that gathers
        (``zero3.ranks.fetch_agreement``)."""
        backward = in_backward()
        forward = self.step.tracing and not backward
        if forward:
            self._fetch_entry(module, Phase.FORWARD, self.traced.forward_fetch(module))
            return
        if backward:
            self.traced.backward_fetch(module)
        elif self._gathers(self.module_params[module]):
            self.ranks.agree_untraced((self.units.name(module), self.units.numel(module)))
        self._fetch_off_trace(module, in_step=backward)

    def _gathers(self, pids: list[int]) -> bool:
        """Fetching ``pids`` issues a gather (one is not gathered, nor in flight)."""
        return any(self.shards[p].status is ParamStatus.NOT_AVAILABLE for p in pids)

    def forward_exit(self, module: nn.Module, output: Any) -> None:
        """Post-forward: in a traced step, an output that needs no gradient means
        no backward for this call, on any rank (it leaves the schedule); then
        the module's parameters are released, except those it returns."""
        if in_backward():
            return  # a checkpoint recomputation: backward uses these now; post-backward releases
        single = isinstance(output, torch.Tensor)
        if self.step.tracing:
            needs_grad = output.requires_grad if single else any(t.requires_grad for t in iter_tensors(output))
            self.traced.forward_exit(module, needs_grad=needs_grad)
        if single:
            pid = self.index.get(id(output))
            self.release(module, keep=() if pid is None else (pid,))
        else:
            self.release(module, keep=self.params_in(output))

    def fetch_for_backward(self, module: nn.Module) -> None:
        """Pre-backward: the schedule up to this module (see ``zero3.training.schedule``)."""
        entries = self.traced.scheduled_up_to(module)
        if entries is None:  # passed over as a ghost already (still held), or not scheduled at all
            self.traced.backward_fetch(module)
            self._fetch_off_trace(module, in_step=True)
            return
        for entry in entries:  # a ghost stays held until its own post-backward, or the end of backward
            self.traced.backward_fetch(entry)
            self._fetch_entry(entry, Phase.BACKWARD, self.traced.on_fetch(entry))

    def finish_schedule(self) -> None:
        """End of backward: the schedule's remaining entries, fetched as ghosts
        on every rank (released with everything else right after)."""
        for entry in self.traced.unscheduled():
            self.traced.backward_fetch(entry)
            self._fetch_entry(entry, Phase.BACKWARD, self.traced.on_fetch(entry))

    def _fetch_entry(self, module: nn.Module, phase: Phase, matches: bool) -> None:
        """A fetch that is an entry of the trace (``matches``: the complete trace's next one):
        gathered, held, and the plan's prefetch after it."""
        self._gather_and_hold(module)
        ahead = self.plans.fetched(module, self.trace.cursor - 1, phase)
        if matches and ahead and self.rounds is None:
            prefetched = self.gatherer.prefetch(ahead)
            if prefetched:
                self._note("prefetch", None, prefetched)

    def _fetch_off_trace(self, module: nn.Module, *, in_step: bool) -> None:
        """A fetch outside the trace (an eval forward, a recomputation in backward)."""
        self._gather_and_hold(module)
        if in_step:
            self.plans.fetched_off_trace(module)

    def _gather_and_hold(self, module: nn.Module) -> None:
        pids = self.units.module_params[module]
        live_before = self.limiter.live_numel
        with profiled_as("z3kit.fetch", self.units.name, module):
            self._ensure_gathered(pids)
        self._note("fetch", module, self.limiter.live_numel - live_before)
        self.holds.hold(module, pids)

    def ensure_gathered(self, pids: list[int]) -> None:
        """Make ``pids`` available now, outside any module's fetch (a use
        outside a forward: ``zero3.runtime.between_uses``), as a fetch would."""
        self._ensure_gathered(pids)

    def _ensure_gathered(self, pids: list[int]) -> None:
        if self.rounds is None:
            self.gatherer.ensure_gathered(pids)
        else:
            self.rounds.fetch(pids)

    def finish_rounds(self) -> None:
        """End of a backward or an eval forward: with rank-divergent graphs,
        join rounds until every rank is there (``zero3.training.rounds``)."""
        if self.rounds is not None:
            self.rounds.finish()

    def release(self, module: nn.Module, keep: Collection[int] = ()) -> None:
        """Post-forward / post-backward: let go of the module's parameters and
        free what the plan releases here, or, off the plan, the module's own
        (``keep``: never these, e.g. returned ones; never one that is
        persistent, or that a module in flight or a pin holds)."""
        pids = self.units.module_params[module]
        self.holds.let_go(module, pids)
        planned = self.plans.at_exit(module, self.traced.fetch_index(module), keep) if self.step.tracing else None
        if planned == ():  # the plan releases nothing here
            return
        persistent, shards, held, kept = self.persistent, self.shards, self.holds.held, self.plans.kept
        chosen = [
            p
            for p in (pids if planned is None else planned)
            if not persistent[p]
            and p not in kept
            and shards[p].status is ParamStatus.AVAILABLE
            and not held(p)
            and p not in keep
        ]
        if not chosen:
            return
        with profiled_as("z3kit.release", self.units.name, module):
            freed = self.gatherer.free(chosen)
        self._note("release", module, freed)

    def params_in(self, output: Any) -> set[int]:
        """Managed parameters that appear in a module's output."""
        return {self.index[id(t)] for t in iter_tensors(output) if id(t) in self.index}

    # -- whole-model transitions -----------------------------------------------------------
    def discard(self, pids: Iterable[int]) -> None:
        """Free the gathered copies of ``pids`` (their shards changed); the
        next use gathers them afresh."""
        self.gatherer.free(pids)

    def pin(self, pids: Iterable[int]) -> None:
        """Gather ``pids`` and keep them gathered until ``unpin``: no module
        exit and no ``release_all`` frees them (``gathered_parameters``)."""
        pids = list(pids)
        self.gatherer.ensure_gathered(pids)
        self.holds.pin(pids)

    def stays_gathered(self, pid: int) -> bool:
        """``pid`` stays gathered between forwards: persistent, pinned, or kept across steps by the plan."""
        return self.persistent[pid] or self.holds.pinned(pid) or pid in self.plans.kept

    def unpin(self, pids: Iterable[int]) -> None:
        """Undo one ``pin`` of ``pids``; free those no longer pinned or used."""
        self.discard(p for p in self.holds.unpin(pids) if not self.stays_gathered(p))

    def release_all(self) -> None:
        """Complete gathers in flight and free every parameter that is neither
        persistent, nor pinned, nor kept across steps by the plan (end of
        backward, after an eval forward, after an error)."""
        self.gatherer.wait_inflight()
        self.holds.drop_modules()
        self.gatherer.free(p for p in self.gatherer.gathered() if not self.stays_gathered(p))

    def shards_changed(self, pids: Sequence[int], *, written_later: frozenset[int] = frozenset()) -> None:
        """The shards of ``pids`` changed, between forwards (``EngineCore.shards_changed``
        is the one caller): every copy made from them is stale. Gathers in
        flight are completed and hpZ's slices dropped; gathered copies are
        freed, and those that stay gathered between forwards (persistent
        ones, pinned ones: ``gathered_parameters``, and those the plan keeps
        across steps: ``z3kit.kept_units``) are gathered again,
        in one collective (left in flight with ``overlap_comm``), ready for
        the next forward; persistent ones of ``written_later`` (shards an
        offloaded step is still writing) are left to their next use, whose
        gather waits for their write (``zero3.training.host_step``)."""
        self.gatherer.wait_inflight()
        self.gatherer.shards_updated(pids)
        stale = [p for p in pids if self.shards[p].status is ParamStatus.AVAILABLE]
        self.gatherer.free(stale)
        again = [p for p in stale if (self.persistent[p] and p not in written_later) or self.holds.pinned(p)]
        # the units the plan keeps across steps, gathered or not: the next step starts with them
        again += sorted(self.plans.kept.intersection(pids).difference(written_later, again))
        if again:
            self.gatherer.gather(again, wait=not self.gatherer.overlap or any(self.holds.pinned(p) for p in again))

    # -- parameters used outside their module ----------------------------------------------
    def on_param_use(self, pid: int, user: nn.Module | None) -> None:
        """Parameter ``pid`` is used while ``user`` (the innermost hooked module
        running, if any) runs: where it is not one of ``user``'s, it joins them
        (see ``zero3.training.param_use``)."""
        if user is not None and self.units.is_foreign(user, pid):
            self.traced.used_outside(user, pid, tracing=self.step.tracing)
            self.units.join(user, pid)
            self.holds.joined(user, pid)
            self.plans.units_changed()
        if self.shards[pid].status is not ParamStatus.AVAILABLE:
            if not (self.step.tracing or in_backward()) and self._gathers([pid]):
                self.ranks.agree_untraced((f"parameter #{pid} used in {self.units.name(user)}" if user is not None
                                           else f"parameter #{pid}", self.numels[pid]))
            self._ensure_gathered([pid])
