"""The ``z3sim`` process group and its work handles (see ``tests.accelerator_double``).

A Python ``torch.distributed.ProcessGroup`` (the way torch's own tests
write one: ``test_c10d_pypg.py``, ``multi_threaded_pg.py``) that issues
every collective on an inner gloo group over the same store, and hands back
``SimWork`` handles that wait like ``ProcessGroupNCCL``'s.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from z3kit.stream_check import _span

if TYPE_CHECKING:
    from tests.accelerator_double import Double

BACKEND = "z3sim"
#: how long after a collective finished a poll first sees it done (the device runs behind the host)
DEVICE_LAG_S = 0.5
_TORCH = str(Path(torch.__file__).parent)


def _where(depth: int = 3) -> str:
    """The first ``depth`` frames of the caller outside torch and this file: where a rule was broken."""
    frame, out = sys._getframe(1), []
    while frame is not None and len(out) < depth:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != __file__:
            path = Path(name)
            out.append(f"{path.parent.name}/{path.name}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back  # type: ignore[assignment]
    return " <- ".join(out)


def _merged(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The memory of ``tensors``, as sorted, disjoint address ranges."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(s for s in map(_span, tensors) if s is not None):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _inside_any(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether ``span`` overlaps any of ``spans``."""
    return any(span[0] < e and s < span[1] for s, e in spans)


def _inside(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    span = _span(t)
    return span is None or any(s <= span[0] and span[1] <= e for s, e in spans)


class Landing:
    """When one collective's data landed on this rank, and whether it failed:
    the device's side of a ``SimWork``, holding no tensor (what a watcher or
    an event may keep without keeping memory alive)."""

    __slots__ = ("label", "at", "error", "_event")

    def __init__(self, label: str) -> None:
        self.label = label
        #: when the data landed (gloo finished writing it), None until then
        self.at: float | None = None
        self.error: BaseException | None = None
        self._event = threading.Event()

    def land(self, error: BaseException | None = None) -> None:
        if self.at is None:
            self.error, self.at = error, time.monotonic()
            self._event.set()

    @property
    def landed(self) -> bool:
        return self.at is not None

    def query(self, lag_s: float) -> bool:
        """Completed as the device would report it: landed ``lag_s`` ago (never blocks)."""
        return self.at is not None and time.monotonic() - self.at >= lag_s

    def block(self, bound_s: float) -> None:
        """Block the host until the data landed (a stream sync); raise its error, or after ``bound_s``."""
        if not self._event.wait(bound_s):
            from tests.accelerator_double import AcceleratorSemanticsError

            raise AcceleratorSemanticsError(
                f"the host waited {bound_s:g} s for the data of {self.label}, which never landed, and nothing "
                "noticed (no watcher named the stalled collective, no abort ended the wait)")
        if self.error is not None:
            raise RuntimeError(str(self.error))


class SimWork(dist.Work):
    """One collective's handle, with ``ProcessGroupNCCL``'s wait semantics (module docstring)."""

    def __init__(self, group: SimGroup, kind: str, inner: Any, result: Any, writes: list[torch.Tensor]) -> None:
        super().__init__()
        self._group, self.kind, self._inner, self._result = weakref.ref(group), kind, inner, result
        self._lock = threading.Lock()
        self.landing = Landing(f"{kind} on {group.describe()}")
        #: the memory the collective writes, as address ranges: what a host read must wait for
        self.spans = _merged(writes)
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        # watched from a thread of its own, not a future callback: torch runs those under the
        # issuing thread's dispatch modes, and the landing gate must not hold up the landing itself
        threading.Thread(target=self._watch, name="z3sim-work", daemon=True).start()

    @property
    def _finished_at(self) -> float | None:
        return self.landing.at

    def _watch(self) -> None:
        try:
            self._inner.wait()
            self._on_done(None)
        except Exception as e:  # noqa: BLE001 - any failure lands as the collective's error
            self._on_done(None, e)

    def _on_done(self, future: Any, error: BaseException | None = None) -> None:
        self.landing.land(error)
        # the future completes with the collective: DDP-style callers wait on it without wait()
        self._settle(error)

    def _settle(self, error: BaseException | None) -> None:
        with self._lock:  # the collective's end and an abort race to settle it
            if self._future.done():
                return
            if error is None:
                self._future.set_result(self._result)
            else:
                self._future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Order "the current stream" after the collective and return at once,
        as NCCL does: the data lands later, when gloo has moved it, and a host
        read of it waits then (``tests.accelerator_double``'s landing gate).
        A timed wait is a violation. Called from torch's own code (the object
        collectives, whose next step is a host copy that syncs), it blocks."""
        group = self._group()
        if timeout is not None and timeout > timedelta(0) and group is not None:
            group.double.violation(
                f"{self.kind} on {group.describe()}: Work.wait(timeout={timeout.total_seconds():g} s) at {_where()} "
                "blocks the host on an accelerator (and aborts the communicator on timeout); complete it with a "
                "plain wait()"
            )
        if group is not None and group.aborted and not self.landing.landed:
            raise RuntimeError(f"{self.kind}: {group.describe()} was aborted before the collective was waited for")
        if self.landing.landed and self.landing.error is not None:
            raise RuntimeError(str(self.landing.error))
        double = group.double if group is not None else None
        if double is None or not double.gating() or sys._getframe(1).f_code.co_filename.startswith(_TORCH):
            self.landing.block(double.host_bound_s if double is not None else 60.0)
            return True
        double.ordered(self)
        return True

    def is_completed(self) -> bool:
        """Never blocks; true once the data landed ``Double.device_lag_s`` ago, waited for or not."""
        group = self._group()
        return self.landing.query(group.double.device_lag_s if group is not None else DEVICE_LAG_S)

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def _interrupt(self) -> None:
        if not self.landing.landed:
            self.landing.land(RuntimeError(f"{self.kind}: the process group was aborted"))
            self._settle(RuntimeError(f"{self.kind}: the process group was aborted"))


class Completion:
    """An event's ``query()`` over some collectives' ``Landing`` s (``SimGroup.device_completion``)."""

    def __init__(self, landings: list[Landing], double: Double) -> None:
        self._landings, self._double = landings, double

    def query(self) -> bool:
        lag = self._double.device_lag_s
        self._landings = [x for x in self._landings if not x.query(lag)]
        return not self._landings

    def describe(self) -> str:
        """The oldest collective not yet finished (or "")."""
        return self._landings[0].label if self._landings else ""


def _given(opts: Any) -> tuple[Any, ...]:
    """A collective's options as arguments: none where the caller gave none."""
    return () if opts is None else (opts,)


class SimGroup(dist.ProcessGroup):
    """A ``z3sim`` group: the collectives z3kit, torch's object collectives and
    DCP use, issued on an inner gloo group and recorded (module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, double: Double) -> None:
        super().__init__(rank, size)
        # torch names a group after how many are registered, so a name comes back once one is
        # destroyed; the inner gloo group's keys are kept apart by how often the name was used
        generation = (store.add("z3sim/created", 1) - 1) // size
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"z3sim-gloo/{generation}/", store), rank, size, timeout)
        self.double = double
        #: (kind, elements, dtype) of every collective issued, in order
        self.issued: list[tuple[str, int, str]] = []
        self.aborted = False
        self._pending: list[SimWork] = []
        self._name = self._desc = ""
        double.groups.append(self)

    def getBackendName(self) -> str:
        return BACKEND

    # a Python group keeps its own name (the C++ default asks a registered backend, and there is none)
    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def describe(self) -> str:
        try:
            ranks = dist.get_process_group_ranks(self)
        except (ValueError, RuntimeError, KeyError):  # not (or no longer) registered with torch
            ranks = []
        return f"{BACKEND} group {self._name[:8]} over ranks {ranks} (rank {self.rank()})"

    # -- the collectives -------------------------------------------------------------------
    def _issue(
        self, kind: str, each: list[torch.Tensor], reads: list[torch.Tensor], writes: list[torch.Tensor],
        start: Any, result: Any,
    ) -> SimWork:
        """``each``: the tensors whose size is the same on every rank (what one rank sends or gets)."""
        if self.aborted:
            raise RuntimeError(f"{kind} issued on {self.describe()}, which was aborted")
        self.issued.append((kind, sum(t.numel() for t in each), str(each[0].dtype) if each else ""))
        self._check_tickets(kind, reads, writes)
        work = SimWork(self, kind, start(), result, writes)
        self._pending = [w for w in self._pending if not w.landing.landed] + [work]
        return work

    def forget_landed(self) -> None:
        """Let go of the works whose data landed (the double holds nothing the caller dropped)."""
        self._pending = [w for w in self._pending if not w.landing.landed]

    def device_completion(self) -> Completion:
        """What a watcher may hold to see the collectives issued on this group so
        far finish on "the device": their ``Landing`` s, no tensor (the double's
        stand-in for an event recorded on the communication stream)."""
        return Completion([w.landing for w in self._pending if not w.landing.landed], self.double)

    def _check_tickets(self, kind: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        tickets = [t for c in self.double.checkers for t in c.open_tickets]
        if not tickets:
            return  # issued outside every communicate: not this rule's business
        used = _merged([x for t in tickets for x in t.reads + t.writes])
        written = _merged([x for t in tickets for x in t.writes])
        for what, tensors, allowed in (("reads", reads, used), ("writes", writes, written)):
            for t in tensors:
                if not _inside(t, allowed):
                    self.double.violation(
                        f"buffer outside a ticket: {kind} on {self.describe()} at {_where()} {what} a tensor of "
                        f"{t.numel()} {t.dtype} elements (shape {tuple(t.shape)}) that is not in the {what} of the open "
                        f"ticket(s) {[tk.label for tk in tickets]}: on an accelerator the communication stream may "
                        "use it while compute does"
                    )

    # each: _issue(kind, tensors of one rank's size, what it reads, what it writes, start on gloo, result)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        opts = opts or dist.AllreduceOptions()
        return self._issue("all_reduce", tensors, tensors, tensors, lambda: self._gloo.allreduce(tensors, opts), tensors)

    # all-gathers: without options, gloo's own defaults (torch < 2.13 has no dist.AllgatherOptions)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        start = lambda: self._gloo._allgather_base(output, input, *_given(opts))  # noqa: E731
        return self._issue("all_gather", [input], [input], [output], start, output)

    _allgather_base = all_gather_single  # the name torch < 2.13 calls

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        start = lambda: self._gloo.allgather(outputs, inputs, *_given(opts))  # noqa: E731
        return self._issue("all_gather_list", inputs, inputs, [t for ts in outputs for t in ts], start, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        opts = opts or dist.ReduceScatterOptions()
        start = lambda: self._gloo._reduce_scatter_base(output, input, opts)  # noqa: E731
        return self._issue("reduce_scatter", [output], [input], [output], start, output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> SimWork:
        opts = opts or dist.ReduceScatterOptions()
        start = lambda: self._gloo.reduce_scatter(outputs, inputs, opts)  # noqa: E731
        return self._issue("reduce_scatter_list", outputs, [t for ts in inputs for t in ts], outputs, start, outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        opts = opts or dist.BroadcastOptions()
        written = [] if opts.rootRank == self.rank() else tensors
        return self._issue("broadcast", tensors, tensors, written, lambda: self._gloo.broadcast(tensors, opts), tensors)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        opts = opts or dist.GatherOptions()
        start = lambda: self._gloo.gather(outputs, inputs, opts)  # noqa: E731
        return self._issue("gather", inputs, inputs, [t for ts in outputs for t in ts], start, outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> SimWork:
        opts = opts or dist.ScatterOptions()
        start = lambda: self._gloo.scatter(outputs, inputs, opts)  # noqa: E731
        return self._issue("scatter", outputs, [t for ts in inputs for t in ts], outputs, start, outputs)

    def barrier(self, opts: Any = None) -> SimWork:
        return self._issue("barrier", [], [], [], lambda: self._gloo.barrier(dist.BarrierOptions()), None)

    # -- ending -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Like aborting an NCCL communicator: every pending and later wait raises at once.
        (gloo's own abort does not unblock a wait, see the module docstring, so the double
        stops waiting on gloo instead; the inner gloo work is left to its peers or timeout.)"""
        self.aborted = True
        for work in self._pending:
            work._interrupt()

    def shutdown(self) -> None:
        self.abort()
