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


def _inside(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    span = _span(t)
    return span is None or any(s <= span[0] and span[1] <= e for s, e in spans)


class SimWork(dist.Work):
    """One collective's handle, with ``ProcessGroupNCCL``'s wait semantics (module docstring)."""

    def __init__(self, group: SimGroup, kind: str, inner: Any, result: Any) -> None:
        super().__init__()
        self._group, self.kind, self._inner, self._result = weakref.ref(group), kind, inner, result
        self._event, self._lock = threading.Event(), threading.Lock()
        self._finished_at: float | None = None
        self._waited = False
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        try:
            inner.get_future().add_done_callback(self._on_done)
        except RuntimeError:  # gloo's emulated reduce-scatter has no future: watch it from a thread
            threading.Thread(target=self._watch, name="z3sim-work", daemon=True).start()

    def _watch(self) -> None:
        try:
            self._inner.wait()
            self._on_done(None)
        except RuntimeError as e:  # wait() raises it again to the caller
            self._on_done(None, e)

    def _on_done(self, future: Any, error: BaseException | None = None) -> None:
        if future is not None:
            try:
                future.value()
            except RuntimeError as e:
                error = e
        self._finished_at = time.monotonic()
        self._event.set()
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
        """Complete the collective (on CPU the stream is the host); a timed wait is a violation."""
        group = self._group()
        if timeout is not None and timeout > timedelta(0) and group is not None:
            group.double.violation(
                f"{self.kind} on {group.describe()}: Work.wait(timeout={timeout.total_seconds():g} s) at {_where()} "
                "blocks the host on an accelerator (and aborts the communicator on timeout); complete it with a "
                "plain wait()"
            )
        self._event.wait()  # not strict: recorded, and completed like a plain wait
        if group is not None and group.aborted and not self._waited:
            # like a work of an aborted communicator, even where gloo finished it meanwhile
            raise RuntimeError(f"{self.kind}: {group.describe()} was aborted before the collective was waited for")
        self._inner.wait()  # done: raises the collective's own error, if any
        self._waited = True
        return True

    def is_completed(self) -> bool:
        """Never blocks; true once waited for, or finished ``DEVICE_LAG_S`` ago."""
        done = self._finished_at
        return self._waited or (done is not None and time.monotonic() - done >= DEVICE_LAG_S)

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def _interrupt(self) -> None:
        if self._finished_at is None:
            self._event.set()
            self._settle(RuntimeError(f"{self.kind}: the process group was aborted"))


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
        work = SimWork(self, kind, start(), result)
        self._pending = [w for w in self._pending if w._finished_at is None] + [work]
        return work

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
