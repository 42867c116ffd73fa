"""The parameter lifecycle of the stock runtime: fetch, prefetch, release.

``ParamCoordinator`` owns every parameter's shard and answers the module
hooks: ``fetch(module)`` at pre-forward and pre-backward, ``release(module)``
at post-forward and post-backward. It composes the primitives: shards and
coalesced gathers (``z3kit.shard``), the trace (``TraceRecorder``), the
release rule (``ReleasePolicy``), the prefetch budget (``PrefetchLimiter``)
and the streams (``StreamPair``).

Note: holding.
    A module holds its parameters from fetch to release; a parameter held
    by any module (a parent and a child that share it, a module whose
    backward is still running) is never released. In forward a module
    holds from pre-forward to post-forward; in backward from its first
    pre-backward to its post-backward. Forwards seen during backward are
    checkpoint recomputations: they fetch, but leave the release to the
    module's post-backward, because backward is about to use what they
    gathered.

Note: parameters used outside their module.
    A module may use a parameter it does not own (``F.linear(x,
    self.embed.weight)`` in a parent, tied weights) or return one of its own
    parameters for another module to use. ``ParamUseMode`` sees every torch
    call during the engine's forward; when a managed parameter shows up in
    a module that does not list it, the parameter is gathered if needed and
    added to that module's list for good, so later fetches (and backward)
    gather it with the module. The changed fetch list invalidates the trace
    once, and the next step records the new one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from z3kit.collectives import CollectiveLog, ProcessGroup
from z3kit.hooks import ModuleHooks, in_backward, iter_tensors
from z3kit.memory import MemoryKind, MemoryLedger
from z3kit.prefetch import PrefetchLimiter
from z3kit.release import ReleasePolicy
from z3kit.shard import GatherHandle, ParamShard, ParamStatus, gather_shards
from z3kit.streams import StreamPairLike
from z3kit.trace import TraceRecorder, TraceState, TraceStep
from z3kit_recipes.zero3.agreement import RankAgreement, StepRecord, Waiter
from z3kit_recipes.zero3.schedule import BackwardSchedule


def profiled(label: str) -> contextlib.AbstractContextManager[Any]:
    """A named range in torch.profiler traces; free when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(label)
    return contextlib.nullcontext()


@attrs.frozen
class TimelineEvent:
    """One point of a step's parameter timeline (``ParamCoordinator.timeline``)."""

    time_s: float
    #: "fetch", "prefetch" or "release"
    kind: str
    module: str
    #: elements the event gathered or released
    numel: int
    #: gathered elements right after the event
    live_numel: int


class ParamCoordinator:
    """Gathers and releases the shards of one model's parameters."""

    def __init__(
        self,
        shards: Sequence[ParamShard],
        module_params: dict[nn.Module, list[int]],
        *,
        group: ProcessGroup,
        streams: StreamPairLike,
        trace: TraceRecorder,
        policy: ReleasePolicy,
        limiter: PrefetchLimiter,
        log: CollectiveLog,
        memory: MemoryLedger,
        record: StepRecord,
        waiter: Waiter,
        ranks: RankAgreement,
        overlap: bool,
        check_every_fetch: bool = False,
    ) -> None:
        self.shards = list(shards)
        self.memory = memory
        self.record = record
        #: completes a collective: ``waiter(done, wait)`` (the engine watches the ranks' notice board meanwhile)
        self.waiter = waiter
        #: where the ranks agree on fetches no trace vouches for
        self.ranks = ranks
        #: gathers left in flight when the ranks stopped running together (kept alive, never waited on)
        self._abandoned: list[GatherHandle] = []
        #: debugging: agree on every fetch of a training step, forward and backward
        self.check_every_fetch = check_every_fetch
        self._fetches_in_step = 0
        self._element_size = self.shards[0].shard.element_size()
        #: bytes of each parameter's gathered storage (its padded full size)
        self._gathered_bytes = [s.padded_numel * self._element_size for s in self.shards]
        self.index = {id(s.param): pid for pid, s in enumerate(self.shards)}
        self.numels = [s.numel for s in self.shards]
        self.persistent = [policy.is_persistent(n) for n in self.numels]
        self.module_params = module_params
        self.module_keys = {m: key for key, m in enumerate(module_params)}
        #: what each module's fetch looks like to the trace: (ids, sizes)
        self._fetch_key = {m: self._key_of(pids) for m, pids in module_params.items()}
        self.group, self.streams, self.log = group, streams, log
        self.trace, self.policy, self.limiter = trace, policy, limiter
        self.overlap = overlap
        #: whether fetches are part of a traced training step
        self.tracing = False
        self._handles: dict[int, GatherHandle] = {}
        self._users = [0] * len(self.shards)
        #: parameters pinned by ``pin`` (gathered_parameters), with their pin counts
        self._pins: dict[int, int] = {}
        self._holders: set[nn.Module] = set()
        self._fetch_step: dict[nn.Module, int] = {}
        #: this step's forward fetches (traced), which of them had no backward, the calls still open,
        #: and the order in which they finished (an outer module finishes after those inside it)
        self._forward: list[nn.Module] = []
        self._no_backward: set[int] = set()
        self._finished: list[int] = []
        self._forward_open: dict[nn.Module, list[int]] = {}
        self._schedule: BackwardSchedule | None = None
        #: whether this step's forward fetches were agreed one by one (no trace vouched for them)
        self._agreed_forward = False
        self._steps: tuple[TraceStep, ...] | None = None  # frozen trace, cached while it matches
        #: trace index up to which prefetch has looked; everything before it is
        #: gathered or in flight (a release moves it back, see ``_free``)
        self._frontier = 0
        self.names = {m: name or "<root>" for name, m in _named(module_params)}
        #: seconds spent blocked on gathers (demand gathers and waits on prefetches)
        self.comm_wait_s = 0.0
        #: when a list, every fetch, prefetch and release is appended to it
        self.timeline: list[TimelineEvent] | None = None

    def _note(self, kind: str, module: nn.Module | None, numel: int) -> None:
        if self.timeline is not None:
            name = "<prefetch>" if module is None else self.names.get(module, type(module).__name__)
            self.timeline.append(
                TimelineEvent(time.perf_counter(), kind, name, numel, self.limiter.live_numel)
            )

    def _key_of(self, pids: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(pids), tuple(self.numels[p] for p in pids)

    # -- gathering --------------------------------------------------------------
    def _gather(self, pids: list[int], *, async_op: bool) -> GatherHandle:
        numel = sum(self.numels[p] for p in pids)
        self.limiter.on_gather(numel)
        handle = gather_shards([self.shards[p] for p in pids], self.group, streams=self.streams, async_op=True, log=self.log)
        self.record.gathers += 1
        # every parameter's own buffer, and while in flight the coalesced output that wait() copies out of
        staging = handle.staging_numel * self._element_size
        self.memory.allocate(MemoryKind.GATHERED_PARAMS, staging + sum(self._gathered_bytes[p] for p in pids))
        for p in pids:
            self._handles[p] = handle
        if not async_op:
            self._wait(pids[0])
        return handle

    def _wait(self, pid: int) -> None:
        """The one place a gather turns into available parameters: complete it
        on the stream pair (compute waits on its event) and install them."""
        handle = self._handles[pid]
        start = time.perf_counter()
        handle.wait(self.waiter)
        self.comm_wait_s += time.perf_counter() - start
        for s in handle.shards:
            self._handles.pop(self.index[id(s.param)], None)
        if handle.staging_numel:
            self.memory.free(MemoryKind.GATHERED_PARAMS, handle.staging_numel * self._element_size)
        self.limiter.on_gather_done()

    def ensure_gathered(self, pids: Iterable[int]) -> None:
        """Make ``pids`` AVAILABLE now: gather the missing ones in one
        collective and wait for those in flight."""
        missing, inflight = [], []
        for p in pids:
            status = self.shards[p].status
            if status is ParamStatus.NOT_AVAILABLE:
                missing.append(p)
            elif status is ParamStatus.INFLIGHT:
                inflight.append(p)
        if missing:
            self._gather(missing, async_op=False)
        for p in inflight:
            if self.shards[p].status is ParamStatus.INFLIGHT:
                self._wait(p)

    # -- the module lifecycle --------------------------------------------------------
    def fetch(self, module: nn.Module) -> None:
        """Pre-forward: the module's parameters, gathered, held. In a traced
        step the fetch is also an entry of the backward schedule, and unless
        the recorded trace vouches for it, the ranks agree on it first."""
        forward = self.tracing and not in_backward()
        if forward:
            index = len(self._forward)
            self._forward_open.setdefault(module, []).append(index)
            self._forward.append(module)
            if self.trace.state is TraceState.COMPLETE and not self.check_every_fetch:
                if not self.trace.expects(self.module_keys[module], *self._fetch_key[module]):
                    expected = self.trace.next_module()
                    was = "the end of its forward" if expected is None else self._name_of_key(expected)
                    self.ranks.left_trace(index, f"fetches {self.names[module]!r} where the trace has {was}")
            if self.trace.state is not TraceState.COMPLETE or self.check_every_fetch:
                self._agreed_forward = True
                self.ranks.agree(index, (self.names[module], sum(self._fetch_key[module][1])))
        elif self.check_every_fetch and in_backward():
            self._agree_in_backward(module)
        self._fetch_entry(module, traced=forward)

    def _agree_in_backward(self, module: nn.Module) -> None:
        """``check_every_fetch``: backward fetches are agreed on too, numbered after the forward's."""
        self._fetches_in_step += 1
        self.ranks.agree(len(self._forward) + self._fetches_in_step, (self.names[module], sum(self._fetch_key[module][1])))

    def forward_done(self, module: nn.Module, output_needs_grad: bool) -> None:
        """Post-forward of a traced fetch: an output that needs no gradient
        means no backward for this call, on any rank (it leaves the schedule)."""
        calls = self._forward_open.get(module)
        if calls:
            index = calls.pop()
            self._finished.append(index)
            if not output_needs_grad:
                self._no_backward.add(index)

    def fetch_for_backward(self, module: nn.Module) -> None:
        """Pre-backward: the schedule up to this module (see ``zero3.schedule``)."""
        if self._schedule is None:
            if self._agreed_forward:  # the forward was agreed fetch by fetch: agree that it is over
                self.ranks.agree(len(self._forward), None)
            # backward meets modules in the reverse of the order their forwards
            # finished: an outer module's output gradient comes before its inner ones'
            finished = set(self._finished)
            order = [i for i in range(len(self._forward)) if i not in finished] + self._finished
            self._schedule = BackwardSchedule([self._forward[i] for i in order if i not in self._no_backward])
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
            self._fetch_step[module] = self.trace.step - 1
        live_before = self.limiter.live_numel
        with profiled(f"z3kit.fetch {self.names[module]}"):
            self.ensure_gathered(pids)
        self._note("fetch", module, self.limiter.live_numel - live_before)
        if module not in self._holders:
            self._holders.add(module)
            for p in pids:
                self._users[p] += 1
        if matches:
            self._prefetch()
        else:
            self._steps = None

    def release(self, module: nn.Module, keep: Iterable[int] = ()) -> None:
        """Post-forward / post-backward: let go of the module's parameters;
        the policy picks which to free (``keep``: never these, e.g. returned ones)."""
        pids = self.module_params[module]
        if module in self._holders:
            self._holders.discard(module)
            for p in pids:
                self._users[p] -= 1
        kept = set(keep)
        candidates = [
            (p, self.numels[p])
            for p in pids
            if self._users[p] == 0
            and not self.persistent[p]
            and p not in kept
            and self.shards[p].status is ParamStatus.AVAILABLE
        ]
        if not candidates:
            return
        if self.tracing:
            chosen = self.policy.to_release(
                self._fetch_step.get(module, -1), candidates, self.trace, self.limiter.live_numel
            )
        else:  # outside a traced step (eval, no_grad) nothing is coming back soon
            chosen = [p for p, _ in candidates]
        with profiled(f"z3kit.release {self.names[module]}"):
            self._free(chosen)
        self._note("release", module, sum(self.numels[p] for p in chosen))

    def discard(self, pids: Iterable[int]) -> None:
        """Free the gathered copies of ``pids`` (their shards changed); the
        next use gathers them afresh."""
        self._free(pids)

    def _free(self, pids: Iterable[int]) -> None:
        """Release those of ``pids`` that are gathered."""
        numel = nbytes = 0
        look_back = self._steps is not None and self._frontier > self.trace.step
        for pid in pids:
            shard = self.shards[pid]
            if shard.status is not ParamStatus.AVAILABLE:
                continue
            shard.release()
            numel += self.numels[pid]
            nbytes += self._gathered_bytes[pid]
            if look_back:
                # prefetch looked past this parameter's next use while it was
                # gathered: that use needs it again, so look there again
                nxt = self.trace.next_use(pid, self.trace.step - 1)
                if nxt is not None and nxt < self._frontier:
                    self._frontier = nxt
        if numel or nbytes:
            self.limiter.on_release(numel)
            self.memory.free(MemoryKind.GATHERED_PARAMS, nbytes)

    def params_in(self, output: Any) -> set[int]:
        """Managed parameters that appear in a module's output."""
        return {self.index[id(t)] for t in iter_tensors(output) if id(t) in self.index}

    # -- prefetch ------------------------------------------------------------------------
    def _prefetch(self) -> None:
        """Gather, in one collective, what the trace needs next, within budget."""
        budget = self.limiter.budget()
        if budget <= 0:
            return
        if self._steps is None:
            self._steps = self.trace.steps
            self._frontier = 0
        steps = self._steps
        i = max(self.trace.step, self._frontier)
        picked: list[int] = []
        seen: set[int] = set()
        total = 0
        full = False
        while i < len(steps) and not full:
            for p in steps[i].param_ids:
                if p in seen or self.shards[p].status is not ParamStatus.NOT_AVAILABLE:
                    continue
                if total + self.numels[p] > budget:
                    full = True
                    break
                picked.append(p)
                seen.add(p)
                total += self.numels[p]
            else:
                i += 1
        self._frontier = i
        if picked:
            with profiled(f"z3kit.prefetch {len(picked)} params"):
                self._gather(picked, async_op=self.overlap)
            self._note("prefetch", None, total)

    # -- whole-model transitions -----------------------------------------------------------
    def pin(self, pids: Iterable[int]) -> None:
        """Keep ``pids`` gathered until ``unpin``: no module exit and no
        ``release_all`` frees them (``gathered_parameters``)."""
        for p in pids:
            self._pins[p] = self._pins.get(p, 0) + 1
            self._users[p] += 1

    def unpin(self, pids: Iterable[int]) -> None:
        """Undo one ``pin`` of ``pids``; free those no longer pinned or used."""
        freed = []
        for p in pids:
            left = self._pins[p] - 1
            if left:
                self._pins[p] = left
            else:
                del self._pins[p]
            self._users[p] -= 1
            if self._users[p] == 0 and not self.persistent[p]:
                freed.append(p)
        self.discard(freed)

    def wait_inflight(self) -> None:
        """Wait for every gather in flight; nothing is released."""
        for p in list(self._handles):
            if p in self._handles:
                self._wait(p)

    def abandon_inflight(self) -> None:
        """Forget the gathers in flight without waiting (the ranks no longer
        run together, so they may never finish). Their buffers stay
        referenced, since the collective may still write into them; the
        parameters count as not gathered."""
        for handle in {id(h): h for h in self._handles.values()}.values():
            self._abandoned.append(handle)
            for s in handle.shards:
                s.status = ParamStatus.NOT_AVAILABLE
        self._handles.clear()

    def release_all(self) -> None:
        """Wait for gathers in flight and free every parameter that is neither
        persistent nor pinned (end of backward, after an eval forward, after an error)."""
        self.wait_inflight()
        self._holders.clear()
        self._users = [0] * len(self.shards)
        for p, count in self._pins.items():
            self._users[p] = count
        self._free(p for p in self._gathered_set() if not self.persistent[p] and p not in self._pins)
        self._steps = None
        self._frontier = 0

    def _gathered_set(self) -> list[int]:
        return [p for p, s in enumerate(self.shards) if s.status is ParamStatus.AVAILABLE]

    def refresh_persistent(self) -> None:
        """After an optimizer step the shards changed: drop stale gathered
        copies of persistent parameters and re-gather them in one collective
        (asynchronously with ``overlap_comm``), ready for the next forward."""
        stale = [p for p in self._gathered_set() if self.persistent[p]]
        self._free(stale)
        if stale:
            self._gather(stale, async_op=self.overlap)

    def start_step(self) -> None:
        self.trace.begin_step()
        self._frontier = 0
        self._forward, self._forward_open, self._no_backward, self._finished = [], {}, set(), []
        self._fetches_in_step = 0
        self._schedule, self._agreed_forward = None, False

    def end_step(self) -> None:
        self.trace.end_step()
        self._steps = None
        self._fetch_step.clear()
        self._schedule = None

    def _name_of_key(self, key: int) -> str:
        return repr(self.names[list(self.module_params)[key]])

    def position(self) -> int:
        """Forward fetches done in this step; a large number once backward began."""
        return len(self._forward) if self._schedule is None else 1 << 40

    def staging_numel(self) -> int:
        """Elements of the coalesced gathers' output buffers in flight."""
        return sum({id(h): h.staging_numel for h in self._handles.values()}.values())

    # -- parameters used outside their module ----------------------------------------------
    def on_param_use(self, pid: int, hooks: ModuleHooks) -> None:
        user = hooks.active[-1] if hooks.active else None
        if user is not None and user in self.module_params and pid not in self.module_params[user]:
            what = f"uses parameter #{pid} ({self.numels[pid]:,} elements) in {self.names[user]!r}, outside its module"
            index = len(self._forward)
            if self.tracing and self.trace.state is TraceState.COMPLETE:
                self.ranks.left_trace(index, what)
                self.trace.invalidate()
            if self.tracing and not in_backward():
                self._agreed_forward = True
                self.ranks.agree(index, (what, self.numels[pid]))
            self.module_params[user].append(pid)
            self._fetch_key[user] = self._key_of(self.module_params[user])
            if user in self._holders:
                self._users[pid] += 1
        if self.shards[pid].status is not ParamStatus.AVAILABLE:
            self.ensure_gathered([pid])


def _named(module_params: dict[nn.Module, list[int]]) -> list[tuple[str, nn.Module]]:
    """Qualified names of the hooked modules (the first module is the root)."""
    modules = list(module_params)
    if not modules:
        return []
    names = {m: n for n, m in modules[0].named_modules()}
    return [(names.get(m, type(m).__name__), m) for m in modules]


#: reads whose answer does not depend on a parameter being gathered: not a use
_METADATA_READS = frozenset(
    getattr(torch.Tensor, name).__get__
    for name in ("dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "is_cuda", "grad")
)


class ParamUseMode(TorchFunctionMode):
    """Sees the parameters passed to every torch call in the engine's forward
    (see the Note on parameters used outside their module). Reading a
    parameter's dtype or device is not a use of it."""

    def __init__(self, coordinator: ParamCoordinator, hooks: ModuleHooks) -> None:
        super().__init__()
        self.coordinator, self.hooks = coordinator, hooks

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_READS:
            return func(*args, **kwargs)
        index = self.coordinator.index
        for arg in (*args, *kwargs.values()):
            pid = index.get(id(arg))
            if pid is not None:
                self.coordinator.on_param_use(pid, self.hooks)
            elif type(arg) is list or type(arg) is tuple:
                for item in arg:
                    pid = index.get(id(item))
                    if pid is not None:
                        self.coordinator.on_param_use(pid, self.hooks)
        return func(*args, **kwargs)
