"""A CPU process group with NCCL's waiting semantics: accelerator-only faults, caught on CPU.

gloo and NCCL differ exactly where a runtime waits (DESIGN.md, "Waiting on
a collective: gloo is not NCCL"): gloo's ``Work.wait()`` blocks the host,
NCCL's only orders the current stream; NCCL's ``Work.wait(timeout)`` blocks
the host and aborts the communicator on timeout. A runtime tested on gloo
alone can poll, block and time out in its hot path without any test
noticing. The ``z3sim`` backend registered here moves data through a real
gloo group, but its work handles (``tests.sim_group``) wait like NCCL's:

- ``wait()``: on CPU compute *is* the stream, so the data is completed here,
  interruptibly: once the group is aborted it raises ``RuntimeError``, as an
  aborted communicator does, instead of hanging;
- ``wait(timeout)``: a violation (it blocks the host on an accelerator);
- ``is_completed()``: never blocks, and sees a collective done only once it
  finished ``DEVICE_LAG_S`` ago or was waited for: the device runs behind the
  host, so polling right after issue tells nothing (and what a runtime does
  does not depend on how fast the peers were).

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
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tests.sim_group import BACKEND, DEVICE_LAG_S, SimGroup, SimWork
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
        try:
            yield seen
        finally:
            self.checkers, self.strict = [], True


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
