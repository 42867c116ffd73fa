"""A CPU process group with NCCL's waiting semantics: accelerator-only faults, caught on CPU.

gloo and NCCL differ exactly where a runtime waits (DESIGN.md, "Waiting on
a collective: gloo is not NCCL"): gloo's ``Work.wait()`` blocks the host,
NCCL's only orders the current stream; NCCL's ``Work.wait(timeout)`` blocks
the host and aborts the communicator on timeout. A runtime tested on gloo
alone can poll, block and time out in its hot path without any test
noticing. The ``z3sim`` backend registered here moves data through a real
gloo group, but its work handles (``tests.sim_group``) wait like NCCL's:

- ``wait()``: only orders, and returns at once, waited for or not, peers
  there or not: the data lands later, when gloo has moved it (gloo's own
  threads play the device). A host operation that touches memory of a
  collective waited for but not landed blocks until it lands (the landing
  gate, a dispatch mode ``observing`` installs: on a GPU compute would wait
  on the device, and a host sync would block); once the group is aborted it
  raises ``RuntimeError`` there, as an aborted communicator does. Reads that
  do not go through torch's dispatcher (``tolist()``, ``numpy()``) need a
  ``DOUBLE.synchronize()`` first, as they need a stream sync on a GPU.
  torch's own object collectives wait inside torch and read at once (with a
  syncing host copy on a GPU): those waits block;
- ``wait(timeout)``: a violation (it blocks the host on an accelerator);
- ``is_completed()``: never blocks, and sees a collective done only once its
  data landed ``DOUBLE.device_lag_s`` ago (the test sets it; ``DEVICE_LAG_S``
  by default), whether it was waited for or not: the device runs behind the
  host, and ``wait()`` says nothing about it. A group's
  ``device_completion()`` is the stand-in for an event recorded on the
  communication stream: ``query()`` over what was issued so far, holding no
  tensor.

Each group records what it issued, in order (kind, elements of one rank,
dtype), and a collective issued inside ``RecordingStreamPair.communicate``
may touch only the memory of the tickets open there (reads inside their
reads or writes, writes inside their writes). Violations are recorded and
raised as ``AcceleratorSemanticsError``; ``strict=False`` records only, so
that one run lists them all. Host syncs are counted by
``tests.sync_sites.SyncSites``, backward included.

Usage, on every rank (the default group is gloo)::

    group = new_group(list(range(world)))        # dist.new_group(..., backend=BACKEND) works too
    checker = StreamOrderChecker()
    with DOUBLE.observing(checker) as seen:
        engine = zero3.initialize(model, factory, config, group,
                                  stream_pairs=lambda d: RecordingStreamPair(checker, device=d))
        with seen.counting():                    # host syncs of these calls only
            engine.backward(loss_fn(engine(x)))
    seen.violations, seen.syncs.count, DOUBLE.issued()

Aborting: ``group.abort()``, which recent torch also calls from
``torch.distributed.distributed_c10d._abort_process_group(group)`` (and
``shutdown()`` from ``destroy_process_group(group)``): so on 2.13, not on
2.6, whose ``ProcessGroup`` has no ``abort`` and whose
``_abort_process_group`` aborts only an NCCL backend (a no-op elsewhere). gloo's own abort does not unblock a wait (measured, torch 2.13:
the wait ends only when the peer's connection closes), so the double stops
waiting on gloo instead. End a group the same way on every rank, and not in
processes shared with other tests: torch names a new group after how many
groups are registered, so a destroyed group's name comes back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.sim_group import BACKEND, DEVICE_LAG_S, SimGroup, SimWork, _inside_any
from z3kit.stream_check import _span
from tests.sync_sites import SyncSites
from z3kit.stream_check import StreamOrderChecker

#: the single-tensor collectives under their torch 2.13 names, on any torch from the floor up
all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["BACKEND", "DEVICE_LAG_S", "DOUBLE", "AcceleratorSemanticsError", "Double", "Observed", "SimGroup",
           "SimWork", "all_gather_single", "new_group", "reduce_scatter_single", "register"]


class AcceleratorSemanticsError(AssertionError):
    """The runtime did something that works on gloo but not on an accelerator backend."""


class Double:
    """This process's state of the double: its groups, the checkers whose open
    tickets bound what a collective may touch, and the violations found."""

    def __init__(self) -> None:
        self.groups: list[SimGroup] = []
        self.checkers: list[StreamOrderChecker] = []
        self.violations: list[str] = []
        #: raise violations (False: record them and go on, a timed wait completing like a plain
        #: one, so that one run lists every fault)
        self.strict = True
        #: how long after its data landed a collective is seen completed (``is_completed``, events)
        self.device_lag_s = DEVICE_LAG_S
        #: how long a host read waits for data that does not land before it fails the test
        self.host_bound_s = 30.0
        #: collectives waited for whose data has not landed: what host reads must wait for
        self._unlanded: list[SimWork] = []
        self._lock = threading.Lock()
        self._gates = threading.local()

    def gating(self) -> bool:
        """Whether the calling thread runs under the landing gate (inside ``observing``)."""
        return bool(getattr(self._gates, "depth", 0))

    def ordered(self, work: SimWork) -> None:
        """``work`` was waited for: host reads of its memory wait until it lands."""
        with self._lock:
            self._unlanded = [w for w in self._unlanded if not w.landing.landed] + [work]

    def land_before(self, tensors: Sequence[Any]) -> None:
        """Block until every waited collective that writes memory of ``tensors`` landed."""
        if not self._unlanded:
            return
        self.land_spans([s for s in (_span(t) for t in tensors) if s is not None])

    def land_spans(self, spans: Sequence[tuple[int, int]]) -> None:
        """Block until every waited collective that writes memory of ``spans`` (address ranges) landed."""
        with self._lock:
            self._unlanded = [w for w in self._unlanded if not w.landing.landed]
            pending = list(self._unlanded)
        for work in pending:
            if any(_inside_any(span, work.spans) for span in spans):
                work.landing.block(self.host_bound_s)

    def synchronize(self) -> None:
        """A stream sync: block until every collective waited for landed (or raise its error)."""
        with self._lock:
            pending, self._unlanded = list(self._unlanded), []
        for work in pending:
            work.landing.block(self.host_bound_s)
        for group in self.groups:
            group.forget_landed()

    def violation(self, message: str) -> None:
        self.violations.append(message)
        if self.strict:
            raise AcceleratorSemanticsError(message)

    def issued(self) -> dict[str, list[tuple[str, int, str]]]:
        """Per group that issued any (its name, the same on every rank of it), what this rank issued, in order."""
        return {g.group_name: list(g.issued) for g in self.groups if g.issued}

    @contextlib.contextmanager
    def observing(self, *checkers: StreamOrderChecker, strict: bool = True) -> Iterator[Observed]:
        """Start afresh (no violations, empty issued records) and check
        collectives against the open tickets of ``checkers`` until the block
        ends; ``strict=False`` records violations without raising them. Host
        syncs are counted inside ``seen.counting()``."""
        self.groups = [g for g in self.groups if not g.aborted]
        for g in self.groups:
            g.issued.clear()
        self.violations, self.checkers, self.strict = [], list(checkers), strict
        seen = Observed(self)
        self._gates.depth = getattr(self._gates, "depth", 0) + 1
        try:
            with _LandingGate(self):
                yield seen
        finally:
            self._gates.depth -= 1
            self.checkers, self.strict = [], True


class _LandingGate(TorchDispatchMode):
    """Every tensor operation of the thread waits for the collectives whose memory it touches to land."""

    def __init__(self, double: Double) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.double = double
        # gloo's worker threads run the collectives' own copies under the issuing thread's
        # state, this mode included: those are the device's work, never held up here
        self._thread = threading.get_ident()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.double._unlanded and threading.get_ident() == self._thread:
            self.double.land_before([t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
        return func(*args, **kwargs)

    def __enter__(self) -> _LandingGate:
        # the host reads that bypass the dispatcher wait too, as a host sync would on a GPU
        self._saved = [(name, torch.Tensor.__dict__.get(name)) for name in _UNDISPATCHED_READS]
        for name, _ in self._saved:
            setattr(torch.Tensor, name, self._gated(getattr(torch.Tensor, name)))
        # so does a storage resize: on a device, freeing or growing memory is ordered on the
        # compute stream, after its wait on the collective that writes there
        self._resize = resize = torch.UntypedStorage.resize_

        def gated_resize(storage: torch.UntypedStorage, nbytes: int) -> Any:
            start, size = storage.data_ptr(), storage.nbytes()
            if self.double._unlanded and start and size and threading.get_ident() == self._thread:
                self.double.land_spans([(start, start + size)])
            return resize(storage, nbytes)

        torch.UntypedStorage.resize_ = gated_resize  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        for name, func in reversed(self._saved):
            if func is None:
                delattr(torch.Tensor, name)  # inherited from torch._C.TensorBase
            else:
                setattr(torch.Tensor, name, func)

    def _gated(self, func: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.double._unlanded and threading.get_ident() == self._thread:
                self.double.land_before([tensor])
            return func(tensor, *args, **kwargs)

        read.__wrapped__ = func  # type: ignore[attr-defined]  # what a sync counter looks for
        return read


#: host reads of a tensor's data that torch's dispatcher does not see
_UNDISPATCHED_READS = ("tolist", "numpy")


class Observed:
    """What a block run under ``Double.observing`` did."""

    def __init__(self, double: Double) -> None:
        self.double = double
        self.syncs = SyncSites()

    @property
    def violations(self) -> list[str]:
        return self.double.violations

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the host syncs of the block (added up over every use)."""
        with self.syncs:
            yield


DOUBLE = Double()


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SimGroup:
    return SimGroup(store, rank, size, timeout, DOUBLE)


def register() -> None:
    """Register the ``z3sim`` backend with torch (idempotent: pool processes run many tests)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def new_group(ranks: list[int], timeout: timedelta | None = None) -> SimGroup:
    """A ``z3sim`` group over ``ranks`` (global ranks), synchronized among them
    only: a group of its own per test, so that one left broken (aborted, or a
    rank raised while another waited) does not poison the tests after it."""
    register()
    group = dist.new_group(ranks=ranks, timeout=timeout, backend=BACKEND, use_local_synchronization=True)
    assert isinstance(group, SimGroup), type(group)
    return group
