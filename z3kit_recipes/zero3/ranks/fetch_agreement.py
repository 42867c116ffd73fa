"""Forward fetches that no recorded trace vouches for, agreed by the ranks.

While a trace is recorded (and on every fetch with ``checks_every_fetch``)
each forward fetch is compared across ranks in a small all-gather
(``zero3.ranks.agreement``). A trace departure after the trace is complete goes
to the notice board instead (``RankWatch.left_trace``).

Note: when the comparison is read.
    On gloo, where completing a collective blocks the host anyway, each
    comparison is read at once, before the gather it vouches for is
    issued: a disagreement raises before any gather could mismatch. On an
    accelerator backend, reading each one would be a host sync per fetch;
    they are issued as the forward goes and read together, in one copy to
    the host, at the end of backward (or every ``BATCH`` fetches). A
    disagreement then raises a little later, with the same message; the
    gathers issued meanwhile may have mismatched, which on NCCL can stall
    them, and the watcher turns such a stall into ``RankFailed``
    (``zero3.ranks.rank_watch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from z3kit.collectives import ProcessGroup
from z3kit_recipes.zero3.ranks.agreement import FetchCheck, issue_fetch_check, settle_fetch_checks
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch

#: fetch comparisons in flight at most before they are read (accelerator backends)
BATCH = 256


class FetchAgreement:
    """``RankAgreement`` for one engine: fetch comparisons on the engine's
    group, and trace departures on the notice board."""

    def __init__(self, group: ProcessGroup, device: torch.device, watch: RankWatch, micro_step: Callable[[], int]) -> None:
        self.group, self.device, self.watch, self.micro_step = group, device, watch, micro_step
        self.world = dist.get_world_size(group)
        #: read later, together (see the Note)
        self.batched = not watch.waits_on_host
        self._in_flight: list[FetchCheck] = []
        #: wall time spent agreeing, in all
        self.seconds = 0.0
        #: reads that had to wait for the device (host syncs of the engine's own)
        self.host_waits = 0

    def agree(self, index: int, fetch: tuple[str, int] | None) -> None:
        if self.world == 1:
            return
        started = time.perf_counter()
        self._in_flight.append(issue_fetch_check(self.group, self.device, micro_step=self.micro_step(), index=index,
                                                 fetch=fetch))
        if not self.batched or len(self._in_flight) >= BATCH:
            self.settle()
        self.seconds += time.perf_counter() - started

    def settle(self) -> None:
        """Read the comparisons in flight (every rank at the same point)."""
        checks, self._in_flight = self._in_flight, []
        self.host_waits += settle_fetch_checks(self.group, self.watch.wait, checks)

    def forget(self) -> None:
        """A forward failed: its comparisons are not read (they were issued
        alike where the ranks are still in step, and are moot where not)."""
        self._in_flight = []

    def left_trace(self, index: int, what: str) -> None:
        self.watch.left_trace((self.micro_step(), index), what)
