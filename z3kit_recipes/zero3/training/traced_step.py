"""A traced training step: the trace's one driver, and where the ranks agree.

Between a training forward's start and the end of its backward, every
fetch of a unit is an entry of the step's trace (``z3kit.trace``), of its
forward log, and of the backward schedule made from that log
(``zero3.training.schedule``). Where no complete trace vouches for a
forward fetch, the ranks agree on it first (``agree``); where a complete
trace is left (a fetch it does not have, a parameter used outside its
module), the ranks are told (``left_trace``) and the trace records afresh.
This object is the only one that begins, ends, restarts or invalidates the
trace.

With rank-divergent graphs (``zero3.training.rounds``) the ranks' fetches
differ by design: nothing is agreed and no trace is left (``agreeing=False``).
"""

from __future__ import annotations

from torch import nn

from z3kit.hook_context import in_backward
from z3kit.trace import TraceRecorder, TraceState
from z3kit_recipes.zero3.ranks.agreement import RankAgreement, StepRecord
from z3kit_recipes.zero3.step.position import StepPosition
from z3kit_recipes.zero3.training.fetch_units import FetchUnits
from z3kit_recipes.zero3.training.schedule import BackwardSchedule, ForwardLog


class TracedStep:
    """The trace, forward log and backward schedule of the step under way (see the module docstring)."""

    def __init__(
        self,
        units: FetchUnits,
        trace: TraceRecorder,
        ranks: RankAgreement,
        record: StepRecord,
        position: StepPosition,
        *,
        agreeing: bool,
        check_every_fetch: bool,
    ) -> None:
        self.units, self.trace, self.ranks, self.record, self.position = units, trace, ranks, record, position
        self.agreeing = agreeing
        #: debugging: agree on every fetch of a training step, forward and backward
        self.check_every_fetch = check_every_fetch
        self._fetch_index: dict[nn.Module, int] = {}
        self._reset()

    def _reset(self) -> None:
        #: this step's forward fetches, and the backward schedule made from them
        self._forward = ForwardLog()
        self._schedule: BackwardSchedule | None = None
        self.position.forward_fetches, self.position.backward_began = 0, False
        #: whether this step's forward fetches were agreed one by one (no trace vouched for them)
        self._agreed_forward = False
        self._fetches_in_step = 0

    # -- the trace's step -----------------------------------------------------------------------
    def begin(self) -> None:
        """A training forward starts the traced step."""
        self.trace.begin_step()
        self._reset()

    def end(self) -> None:
        """The step's backward ended: the trace's step closes (a first one completes the trace)."""
        self.trace.end_step()
        self._close()

    def abort(self) -> None:
        """The step raised: forgotten, and its trace with it."""
        self.trace.invalidate()
        self.trace.end_step()
        self._close()

    def restart(self) -> None:
        """The units changed: the trace records afresh, a step under way from its next fetch on."""
        self.trace.invalidate()
        if self.trace.in_step:
            self.trace.end_step()
            self.trace.begin_step()

    def _close(self) -> None:
        self._fetch_index.clear()
        self._schedule = None
        self.position.backward_began = False

    # -- fetches --------------------------------------------------------------------------------
    def forward_fetch(self, module: nn.Module) -> bool:
        """A forward fetch of the step: logged, and an entry of the trace
        (``on_fetch``); checked against a complete trace, or agreed where no
        trace vouches for it. True when it matched the complete trace."""
        if not self.agreeing:
            return self.on_fetch(module)
        index = self._forward.fetched(module)
        self.position.forward_fetches = len(self._forward)
        if self.trace.state is not TraceState.COMPLETE or self.check_every_fetch:
            self._agreed_forward = True
            self.ranks.agree(index, (self.units.name(module), self.units.numel(module)))
            return self.on_fetch(module)
        expected = self.trace.next_module()  # read first: a fetch that leaves the trace drops it
        matches = self.on_fetch(module)
        if not matches:
            was = "the end of its forward" if expected is None else self.units.name_of_key(expected)
            self.ranks.left_trace(index, f"fetches {self.units.name(module)!r} where the trace has {was}")
        return matches

    def forward_exit(self, module: nn.Module, *, needs_grad: bool) -> None:
        """A forward call of the step returned; one whose output needs no gradient has no backward."""
        self._forward.finished(module, needs_grad=needs_grad)

    def backward_fetch(self, module: nn.Module) -> None:
        """A fetch in backward (``check_every_fetch``: agreed, numbered after the
        forward's; each right before its gather, so that every rank interleaves
        agreements and gathers alike)."""
        if self.check_every_fetch and self.agreeing:
            self._fetches_in_step += 1
            index = len(self._forward) + self._fetches_in_step
            self.ranks.agree(index, (self.units.name(module), self.units.numel(module)))

    def scheduled_up_to(self, module: nn.Module) -> list[nn.Module] | None:
        """Pre-backward of ``module``: the schedule's entries up to it (None
        when it has none ahead: passed over as a ghost already, or not scheduled)."""
        if self._schedule is None:
            if self._agreed_forward and self.agreeing:  # the forward was agreed fetch by fetch: agree that it is over
                self.ranks.agree(len(self._forward), None)
            self._schedule = self._forward.schedule()
            self.position.backward_began = True
        return self._schedule.advance_to(module)

    def unscheduled(self) -> list[nn.Module]:
        """End of backward: the schedule's entries no pre-backward reached."""
        return [] if self._schedule is None else self._schedule.rest()

    def on_fetch(self, module: nn.Module) -> bool:
        """A fetch that is an entry of the trace: recorded; True when it matches the recorded trace."""
        ids, numels = self.units.fetch_key(module)
        self.record.fetches.append(self.units.records[module])
        matches = self.trace.on_fetch(self.units.keys[module], ids, numels)
        self._fetch_index[module] = self.trace.cursor - 1
        return matches

    def fetch_index(self, module: nn.Module) -> int:
        """Where ``module``'s last fetch of this step is in the trace (-1: none)."""
        return self._fetch_index.get(module, -1)

    def used_outside(self, module: nn.Module, pid: int, *, tracing: bool) -> None:
        """Parameter ``pid`` is used in ``module``, outside its own: a complete
        trace is left (and records afresh), and a forward agrees on it."""
        if not (tracing and self.agreeing):
            return
        numel = self.units.numels[pid]
        what = f"uses parameter #{pid} ({numel:,} elements) in {self.units.name(module)!r}, outside its module"
        index = len(self._forward)
        if self.trace.state is TraceState.COMPLETE:
            self.ranks.left_trace(index, what)
            self.trace.invalidate()
        if not in_backward():
            self._agreed_forward = True
            self.ranks.agree(index, (what, numel))
