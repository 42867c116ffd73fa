"""The stock planner: DeepSpeed's schedule, planned by replaying the step.

``PolicyPlanner`` turns a ``ReleasePolicy`` and a ``PrefetchLimiter`` into
a plan (``z3kit.schedule_plan``) by replaying the recorded step the way a
runtime that asked them module by module would run it: a demand fetch
gathers what its unit misses and completes the gathers its unit waits on;
after each numbered fetch, one prefetch gathers the parameters of the
fetches ahead that are not gathered, within the limiter's ``budget()``;
at each exit, the policy picks which of the unit's gathered parameters to
release, seeing the live elements. ``StockPlanner`` is that replay with
DeepSpeed's rules (``StockReleasePolicy``: reuse distance, live cap,
persistence; the stock limiter: prefetch bucket, live cap, gathers in
flight); its fields are the config's knobs.

Note: the prefetch frontier.
    Prefetch walks the trace from the fetch after the current one and
    remembers how far it looked (the frontier), so the next prefetch starts
    there; everything before it is gathered or in flight. Releasing a
    parameter whose next use lies before the frontier moves the frontier
    back to that use, since prefetch has to look there again.

Pure bookkeeping over integer ids: no tensors, no process group.
"""

from __future__ import annotations

import attrs

from z3kit.prefetch import PrefetchLimiter
from z3kit.recorded_step import EventKind, RecordedStep
from z3kit.release import ReleasePolicy, StockReleasePolicy
from z3kit.schedule_plan import SchedulePlan
from z3kit.trace import TraceRecorder
from z3kit.validate import int_validator

_GONE, _COMING, _HERE = 0, 1, 2  # a parameter's state: not gathered, in flight, gathered


@attrs.frozen
class PolicyPlanner:
    """A plan from a release policy and a prefetch limiter (see the module docstring).
    ``overlap``: prefetches stay in flight until their unit needs them (else
    they complete at once, as the runtime's ``overlap_comm=False`` does)."""

    release_policy: ReleasePolicy
    limiter: PrefetchLimiter
    overlap: bool = True

    def is_persistent(self, numel: int) -> bool:
        return self.release_policy.is_persistent(numel)

    def plan(self, step: RecordedStep) -> SchedulePlan:
        # The replay runs the limiter's counters through the step; the runtime counts live
        # elements on the same object, so they are put back as they were afterwards.
        limiter = self.limiter
        saved = limiter.live_numel, limiter.inflight, limiter.high_water
        try:
            return _Replay(self, step).run()
        finally:
            limiter.live_numel, limiter.inflight, limiter.high_water = saved


class _Replay:
    """One pass over the step's events, as the runtime would take it."""

    def __init__(self, planner: PolicyPlanner, step: RecordedStep) -> None:
        self.policy, self.overlap, self.step = planner.release_policy, planner.overlap, step
        self.limiter = planner.limiter
        self.limiter.live_numel = sum(step.numels[p] for p in step.gathered_at_start | set(step.inflight_at_start))
        self.limiter.inflight = 1 if step.inflight_at_start else 0
        self.state = [_GONE] * len(step.numels)
        for p in step.gathered_at_start:
            self.state[p] = _HERE
        #: gathers in flight: one list of ids each, and which one each id waits on
        self.gathers: dict[int, list[int]] = {}
        self.waits_on: dict[int, int] = {}
        self.issued = 0
        if step.inflight_at_start:
            self._issue(list(step.inflight_at_start), count=False)
        self.trace = TraceRecorder()
        self.trace.begin_step()
        for f in step.fetches:
            self.trace.on_fetch(f.unit_id, f.param_ids, f.numels)
        self.trace.end_step()
        self.holders: dict[int, int] = {}  # unit id -> holding (a unit holds once until its exit)
        self.users = [0] * len(step.numels)
        self.frontier = 0
        self.cursor = 0

    def run(self) -> SchedulePlan:
        prefetch: list[tuple[int, ...]] = []
        release: list[tuple[int, ...]] = []
        for event in self.step.events:
            if event.kind is EventKind.FETCH:
                f = self.step.fetches[event.index]
                self.cursor = event.index + 1
                self._fetch(f.unit_id, f.param_ids)
                prefetch.append(self._prefetch())
            elif event.kind is EventKind.UNNUMBERED:
                _, unit_id, pids = self.step.unit_of(event)
                self._fetch(unit_id, pids)
                self.frontier = 0  # the runtime looks afresh after a fetch off the trace
            else:
                release.append(self._exit(event.index))
        name = type(self.policy).__name__
        return SchedulePlan.of(prefetch, release, planner=f"PolicyPlanner({name})")

    # -- gathers ------------------------------------------------------------------------------
    def _issue(self, pids: list[int], *, count: bool = True) -> None:
        if count:
            self.limiter.on_gather(sum(self.step.numels[p] for p in pids))
        key = self.issued = self.issued + 1
        self.gathers[key] = pids
        for p in pids:
            self.state[p] = _COMING
            self.waits_on[p] = key

    def _complete(self, key: int) -> None:
        for p in self.gathers.pop(key):
            self.state[p] = _HERE
            self.waits_on.pop(p, None)
        self.limiter.on_gather_done()

    def _fetch(self, unit_id: int, pids: tuple[int, ...]) -> None:
        missing = [p for p in pids if self.state[p] == _GONE]
        coming = [p for p in pids if self.state[p] == _COMING]
        if missing:
            self._issue(missing)
            self._complete(self.waits_on[missing[0]])
        for p in coming:
            key = self.waits_on.get(p)
            if key is not None:
                self._complete(key)
        if unit_id not in self.holders:
            self.holders[unit_id] = 1
            for p in pids:
                self.users[p] += 1

    def _prefetch(self) -> tuple[int, ...]:
        fetches, numels = self.step.fetches, self.step.numels
        i = max(self.cursor, self.frontier)
        if i >= len(fetches):
            return ()
        budget = self.limiter.budget()
        if budget <= 0:
            return ()
        picked: dict[int, None] = {}  # ordered, and a set
        total, full = 0, False
        while i < len(fetches) and not full:
            for p in fetches[i].param_ids:
                if p in picked or self.state[p] != _GONE:
                    continue
                if total + numels[p] > budget:
                    full = True
                    break
                picked[p] = None
                total += numels[p]
            else:
                i += 1
        self.frontier = i
        if picked:
            self._issue(list(picked))
            if not self.overlap:
                self._complete(self.issued)
        return tuple(picked)

    # -- releases -----------------------------------------------------------------------------
    def _exit(self, index: int) -> tuple[int, ...]:
        e = self.step.exits[index]
        if self.holders.pop(e.unit_id, None) is not None:
            for p in e.param_ids:
                self.users[p] -= 1
        candidates = [(p, self.step.numels[p]) for p in e.param_ids
                      if p not in self.step.persistent and self.state[p] == _HERE and not self.users[p]
                      and p not in e.keep]
        if not candidates:
            return ()
        chosen = self.policy.to_release(e.fetch, candidates, self.trace, self.limiter.live_numel)
        freed: list[int] = []
        for p in chosen:
            if self.state[p] != _HERE:
                continue
            self.state[p] = _GONE
            freed.append(p)
            if self.frontier > self.cursor:  # see the Note on the prefetch frontier
                nxt = self.step.next_use(p, self.cursor - 1)
                if nxt is not None and nxt < self.frontier:
                    self.frontier = nxt
        self.limiter.on_release(sum(self.step.numels[p] for p in freed))
        return tuple(freed)


@attrs.frozen
class StockPlanner:
    """DeepSpeed ZeRO-3's schedule (see the module docstring); the fields are
    ``Zero3Config``'s knobs of the same names (``max_inflight``:
    ``max_inflight_gathers``; ``overlap``: ``overlap_comm``)."""

    max_live_parameters: int = attrs.field(default=1_000_000_000, validator=int_validator(at_least=0))
    max_reuse_distance: int = attrs.field(default=1_000_000_000, validator=int_validator(at_least=0))
    param_persistence_threshold: int = attrs.field(default=100_000, validator=int_validator(at_least=0))
    prefetch_bucket_size: int = attrs.field(default=50_000_000, validator=int_validator(at_least=0))
    max_inflight: int = attrs.field(default=2, validator=int_validator(at_least=1))
    overlap: bool = True

    def policies(self) -> PolicyPlanner:
        """The release policy and limiter these knobs make."""
        return PolicyPlanner(
            StockReleasePolicy(self.max_reuse_distance, self.param_persistence_threshold, self.max_live_parameters),
            PrefetchLimiter(self.max_live_parameters, self.prefetch_bucket_size, self.max_inflight),
            self.overlap,
        )

    def is_persistent(self, numel: int) -> bool:
        return numel < self.param_persistence_threshold

    def plan(self, step: RecordedStep) -> SchedulePlan:
        plan = self.policies().plan(step)
        return attrs.evolve(plan, planner="StockPlanner")
