"""The parameter lifecycle of the stock runtime: fetch, prefetch, release.

``ParamCoordinator`` answers the module hooks: ``fetch(module)`` at
pre-forward and pre-backward, ``release(module)`` at post-forward and
post-backward. It decides which parameters a module holds and when they may
go, keeps the trace (``TraceRecorder``), asks the ranks to agree where no
trace vouches for a fetch, and orders backward fetches (``zero3.training.schedule``);
the release rule is a ``ReleasePolicy``, who holds what is kept in ``Holds``
(``zero3.training.holds``, with the Note on holding). Gathering itself
(issue, complete on the streams, free, prefetch, accounting) is the
``Gatherer``'s (``zero3.training.gathers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from z3kit.hooks import in_backward
from z3kit.nested import iter_tensors
from z3kit.release import ReleasePolicy
from z3kit.shard import ParamStatus
from z3kit.trace import TraceRecorder, TraceState
from z3kit_recipes.zero3.ranks.agreement import RankAgreement, StepRecord
from z3kit_recipes.zero3.ranks.position import StepPosition
from z3kit_recipes.zero3.training.gathers import Gatherer
from z3kit_recipes.zero3.training.holds import Holds
from z3kit_recipes.zero3.training.rounds import FetchRounds
from z3kit_recipes.zero3.training.schedule import BackwardSchedule, ForwardLog
from z3kit_recipes.zero3.training.timeline import Timeline, profiled


class ParamCoordinator:
    """Which parameters each module holds, and when they are fetched and released."""

    def __init__(
        self,
        gatherer: Gatherer,
        module_params: dict[nn.Module, list[int]],
        *,
        trace: TraceRecorder,
        policy: ReleasePolicy,
        record: StepRecord,
        ranks: RankAgreement,
        timeline: Timeline,
        check_every_fetch: bool = False,
        rounds: FetchRounds | None = None,
        position: StepPosition | None = None,
    ) -> None:
        self.gatherer = gatherer
        self.shards = gatherer.shards
        self.index, self.numels = gatherer.index, gatherer.numels
        self.trace, self.policy, self.limiter = trace, policy, gatherer.limiter
        self.record, self.timeline = record, timeline
        #: where the ranks agree on fetches no trace vouches for
        self.ranks = ranks
        #: debugging: agree on every fetch of a training step, forward and backward
        self.check_every_fetch = check_every_fetch
        #: rank-divergent graphs: every gather is a round (``zero3.training.rounds``); no agreement, trace checks or prefetch
        self.rounds = rounds
        #: where this rank is in its step, for the notice board: the forward fetches, and whether backward began
        self.position = StepPosition() if position is None else position
        self.persistent = [policy.is_persistent(n) for n in self.numels]
        self.regroup(module_params)
        self._tracing = False
        #: which modules and pins hold each parameter (see the Note on holding)
        self.holds = Holds(len(self.shards))
        self._fetch_index: dict[nn.Module, int] = {}
        self._start_forward()

    def _start_forward(self) -> None:
        #: this step's traced forward fetches, and the backward schedule made from them
        self._forward = ForwardLog()
        self._schedule: BackwardSchedule | None = None
        self.position.forward_fetches, self.position.backward_began = 0, False
        #: whether this step's forward fetches were agreed one by one (no trace vouched for them)
        self._agreed_forward = False
        self._fetches_in_step = 0

    def regroup(self, module_params: dict[nn.Module, list[int]]) -> None:
        """Which module fetches which parameters (at initialize, and when
        compiled blocks become fetch units); the trace records afresh, a
        step in progress from its next fetch on."""
        self.module_params = module_params
        self.module_keys = {m: key for key, m in enumerate(module_params)}
        #: what each module's fetch looks like to the trace: (ids, sizes)
        self._fetch_key = {m: self._key_of(pids) for m, pids in module_params.items()}
        self.names = {m: name or "<root>" for name, m in _named(module_params)}
        self.gatherer.forget_trace()
        trace = self.trace
        trace.invalidate()
        if trace.in_step:
            trace.end_step()
            trace.begin_step()

    def _key_of(self, pids: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(pids), tuple(self.numels[p] for p in pids)

    def _note(self, kind: str, module: nn.Module | None, numel: int) -> None:
        if self.timeline.recording:
            name = "<prefetch>" if module is None else self.names.get(module, type(module).__name__)
            self.timeline.note(kind, name, numel, self.limiter.live_numel)

    # -- the training step ----------------------------------------------------------------
    @property
    def tracing(self) -> bool:
        """Whether fetches are part of a traced training step (``begin_step`` to ``end_step``)."""
        return self._tracing

    def begin_step(self) -> None:
        """A training forward starts a traced step."""
        self.trace.begin_step()
        self.gatherer.forget_trace()
        self._start_forward()
        self._tracing = True

    def end_step(self) -> None:
        """The step's backward ended: free what it gathered, close the trace's step."""
        self.release_all()
        self.trace.end_step()
        self._close_step()

    def abort(self, *, ranks_broken: bool) -> None:
        """A forward or backward raised: forget the step and its trace, free what
        was gathered (gathers in flight are abandoned when the ranks no longer
        run together, since they may never finish)."""
        if ranks_broken:
            self.gatherer.abandon_inflight()
        self.release_all()
        self.trace.invalidate()
        self.trace.end_step()
        self._close_step()

    def _close_step(self) -> None:
        self._fetch_index.clear()
        self._schedule = None
        self.position.backward_began = False
        self._tracing = False

    @contextlib.contextmanager
    def untraced(self) -> Iterator[None]:
        """An eval or no_grad forward, maybe inside a training step: not traced."""
        was, self._tracing = self._tracing, False
        try:
            yield
        finally:
            self._tracing = was

    # -- the module lifecycle --------------------------------------------------------
    def fetch(self, module: nn.Module) -> None:
        """Pre-forward: the module's parameters, gathered, held. In a traced
        step the fetch is also an entry of the backward schedule, and unless
        the recorded trace vouches for it, the ranks agree on it first."""
        forward = self._tracing and not in_backward()
        if forward and self.rounds is None:
            index = self._forward.fetched(module)
            self.position.forward_fetches = len(self._forward)
            if self.trace.state is TraceState.COMPLETE and not self.check_every_fetch:
                if not self.trace.expects(self.module_keys[module], *self._fetch_key[module]):
                    expected = self.trace.next_module()
                    was = "the end of its forward" if expected is None else self._name_of_key(expected)
                    self.ranks.left_trace(index, f"fetches {self.names[module]!r} where the trace has {was}")
            if self.trace.state is not TraceState.COMPLETE or self.check_every_fetch:
                self._agreed_forward = True
                self.ranks.agree(index, (self.names[module], sum(self._fetch_key[module][1])))
        elif self.check_every_fetch and in_backward() and self.rounds is None:
            self._agree_in_backward(module)
        self._fetch_entry(module, traced=forward)

    def _agree_in_backward(self, module: nn.Module) -> None:
        """``check_every_fetch``: backward fetches are agreed on too, numbered after the forward's."""
        self._fetches_in_step += 1
        self.ranks.agree(len(self._forward) + self._fetches_in_step, (self.names[module], sum(self._fetch_key[module][1])))

    def forward_exit(self, module: nn.Module, output: Any) -> None:
        """Post-forward: in a traced step, an output that needs no gradient means
        no backward for this call, on any rank (it leaves the schedule); then
        the module's parameters are released, except those it returns."""
        if in_backward():
            return  # a checkpoint recomputation: backward uses these now; post-backward releases
        if self._tracing:
            needs_grad = (output.requires_grad if isinstance(output, torch.Tensor)
                          else any(t.requires_grad for t in iter_tensors(output)))
            self._forward.finished(module, needs_grad=needs_grad)
        self.release(module, keep=self.params_in(output))

    def fetch_for_backward(self, module: nn.Module) -> None:
        """Pre-backward: the schedule up to this module (see ``zero3.training.schedule``)."""
        if self._schedule is None:
            if self._agreed_forward and self.rounds is None:  # the forward was agreed fetch by fetch: agree that it is over
                self.ranks.agree(len(self._forward), None)
            self._schedule = self._forward.schedule()
            self.position.backward_began = True
        entries = self._schedule.advance_to(module)
        if entries is None:  # passed over as a ghost already (still held), or not scheduled at all
            if self.check_every_fetch:
                self._agree_in_backward(module)
            self._fetch_entry(module, traced=False)
            return
        for entry in entries:  # a ghost stays held until its own post-backward, or the end of backward
            if self.check_every_fetch:
                self._agree_in_backward(entry)
            self._fetch_entry(entry, traced=True)

    def finish_schedule(self) -> None:
        """End of backward: the schedule's remaining entries, fetched as ghosts
        on every rank (released with everything else right after)."""
        if self._schedule is not None:
            for entry in self._schedule.rest():
                if self.check_every_fetch:
                    self._agree_in_backward(entry)
                self._fetch_entry(entry, traced=True)

    def _fetch_entry(self, module: nn.Module, *, traced: bool) -> None:
        pids = self.module_params[module]
        matches = False
        if traced:
            ids, numels = self._fetch_key[module]
            self.record.fetches.append((self.names[module], sum(numels)))
            matches = self.trace.on_fetch(self.module_keys[module], ids, numels)
            self._fetch_index[module] = self.trace.cursor - 1
        live_before = self.limiter.live_numel
        with profiled(f"z3kit.fetch {self.names[module]}"):
            self._ensure_gathered(pids)
        self._note("fetch", module, self.limiter.live_numel - live_before)
        self.holds.hold(module, pids)
        if matches and self.rounds is None:
            prefetched = self.gatherer.prefetch()
            if prefetched:
                self._note("prefetch", None, prefetched)
        else:
            self.gatherer.forget_trace()

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

    def release(self, module: nn.Module, keep: Iterable[int] = ()) -> None:
        """Post-forward / post-backward: let go of the module's parameters;
        the policy picks which to free (``keep``: never these, e.g. returned ones)."""
        pids = self.module_params[module]
        self.holds.let_go(module, pids)
        kept = set(keep)
        candidates = [
            (p, self.numels[p])
            for p in pids
            if not self.holds.held(p)
            and not self.persistent[p]
            and p not in kept
            and self.shards[p].status is ParamStatus.AVAILABLE
        ]
        if not candidates:
            return
        if self._tracing:
            chosen = self.policy.to_release(
                self._fetch_index.get(module, -1), candidates, self.trace, self.limiter.live_numel
            )
        else:  # outside a traced step (eval, no_grad) nothing is coming back soon
            chosen = [p for p, _ in candidates]
        with profiled(f"z3kit.release {self.names[module]}"):
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

    def unpin(self, pids: Iterable[int]) -> None:
        """Undo one ``pin`` of ``pids``; free those no longer pinned or used."""
        self.discard(p for p in self.holds.unpin(pids) if not self.persistent[p])

    def release_all(self) -> None:
        """Complete gathers in flight and free every parameter that is neither
        persistent nor pinned (end of backward, after an eval forward, after an error)."""
        self.gatherer.wait_inflight()
        self.holds.drop_modules()
        self.gatherer.free(p for p in self.gatherer.gathered() if not self.persistent[p] and not self.holds.pinned(p))
        self.gatherer.forget_trace()

    def refresh_persistent(self) -> None:
        """After an optimizer step the shards changed: drop stale gathered
        copies of persistent parameters and re-gather them in one collective
        (left in flight with ``overlap_comm``), ready for the next forward."""
        stale = [p for p in self.gatherer.gathered() if self.persistent[p]]
        self.gatherer.free(stale)
        if stale:
            self.gatherer.gather(stale, wait=not self.gatherer.overlap)

    def _name_of_key(self, key: int) -> str:
        return repr(self.names[list(self.module_params)[key]])

    @property
    def root(self) -> nn.Module:
        """The model: the first hooked module."""
        return next(iter(self.module_params))

    # -- parameters used outside their module ----------------------------------------------
    def on_param_use(self, pid: int, user: nn.Module | None) -> None:
        """Parameter ``pid`` is used while ``user`` (the innermost hooked module
        running, if any) runs: where it is not one of ``user``'s, it joins them
        (see ``zero3.training.param_use``)."""
        if user is not None and user in self.module_params and pid not in self.module_params[user]:
            what = f"uses parameter #{pid} ({self.numels[pid]:,} elements) in {self.names[user]!r}, outside its module"
            index = len(self._forward)
            if self._tracing and self.trace.state is TraceState.COMPLETE and self.rounds is None:
                self.ranks.left_trace(index, what)
                self.trace.invalidate()
            if self._tracing and not in_backward() and self.rounds is None:
                self._agreed_forward = True
                self.ranks.agree(index, (what, self.numels[pid]))
            self.module_params[user].append(pid)
            self._fetch_key[user] = self._key_of(self.module_params[user])
            self.holds.joined(user, pid)
        if self.shards[pid].status is not ParamStatus.AVAILABLE:
            self._ensure_gathered([pid])


def _named(module_params: dict[nn.Module, list[int]]) -> list[tuple[str, nn.Module]]:
    """Qualified names of the hooked modules (the first module is the root)."""
    modules = list(module_params)
    if not modules:
        return []
    names = {m: n for n, m in modules[0].named_modules()}
    return [(names.get(m, type(m).__name__), m) for m in modules]
