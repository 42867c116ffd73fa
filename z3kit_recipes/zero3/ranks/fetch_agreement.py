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
    disagreement then raises a little later; the gathers issued meanwhile
    may have mismatched, so no collective explains it (the message names
    this rank's module and the others' sizes), the engine stops on every
    rank, and the rank that found it posts so on the notice board: a rank
    whose extra gathers wait for partners that never come learns it at
    once (``RankWatch.give_up``), and a stall the board cannot explain is
    the watcher's (``RankFailed``, ``zero3.ranks.rank_watch``). Gathers of
    different sizes may still fail inside the backend first. On gloo the
    engine goes on after a disagreement in an eval forward, since no gather
    was issued with it.

Note: eval and no_grad forwards.
    Their fetches are not traced, and a rank whose eval forward takes
    another path (an early exit on its data) would pair its gathers with
    the others' next ones: silently wrong values where the sizes agree, a
    gloo abort or an NCCL hang where not. So where such a forward may
    gather (``zero3.ranks.uneven`` opens it), each fetch that gathers is
    compared too, numbered within the forward, and at its end the ranks
    agree that it is over (a rank that skipped the last module would
    otherwise leave the others waiting). On gloo each comparison is read
    before its gather; on accelerator backends they are read together in
    the root's post-forward (``zero3.runtime.root_hooks``), before the
    output is handed back: one host read per eval forward, none per fetch.
    Fetches that gather nothing (persistent or pinned parameters) are not
    compared: their ranks issue no collective that could mispair.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from z3kit.collectives import ProcessGroup
from z3kit_recipes.zero3.ranks.agreement import FetchCheck, RanksDisagree, issue_fetch_check, settle_fetch_checks
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
        #: the eval or no_grad forward whose fetches are compared: its next fetch's number; None: none is
        self._untraced: int | None = None
        #: wall time spent agreeing, in all
        self.seconds = 0.0
        #: reads that had to wait for the device (host syncs of the engine's own)
        self.host_waits = 0
        #: comparisons issued since the engine was built (``Zero3Stats.fetch_checks``)
        self.issued = 0

    def agree(self, index: int, fetch: tuple[str, int] | None) -> None:
        self._compare(index, fetch, untraced=False)

    def _compare(self, index: int, fetch: tuple[str, int] | None, *, untraced: bool) -> None:
        if self.world == 1:
            return
        started = time.perf_counter()
        self._in_flight.append(issue_fetch_check(self.group, self.device, micro_step=self.micro_step(), index=index,
                                                 fetch=fetch, untraced=untraced))
        self.issued += 1
        if not self.batched or len(self._in_flight) >= BATCH:
            self.settle()
        self.seconds += time.perf_counter() - started

    # -- eval and no_grad forwards (see the Note) ----------------------------------------------
    def open_untraced(self) -> None:
        """An eval or no_grad forward that may gather starts: its fetches are compared."""
        if self._untraced is None and self.world > 1:
            self._untraced = 0

    def agree_untraced(self, fetch: tuple[str, int]) -> None:
        if self._untraced is not None:
            self._untraced += 1
            self._compare(self._untraced - 1, fetch, untraced=True)

    def close_untraced(self) -> None:
        """The eval forward ends (the root's post-forward): every rank agrees
        that it is over, and every comparison in flight is read."""
        if self._untraced is None:
            return
        index, self._untraced = self._untraced, None
        started = time.perf_counter()
        self._compare(index, None, untraced=True)
        self.settle()
        self.seconds += time.perf_counter() - started

    # -- reading -------------------------------------------------------------------------------
    def settle(self) -> None:
        """Read the comparisons in flight (every rank at the same point)."""
        checks, self._in_flight = self._in_flight, []
        try:
            # read late, the ranks' collectives may no longer pair: no collective to explain (see the Note)
            self.host_waits += settle_fetch_checks(self.group, self.watch.wait, checks, exchange_names=not self.batched)
        except RanksDisagree as exc:
            if not self.batched:
                if not checks[-1].untraced:
                    raise
                raise RanksDisagree(f"{exc}. No gather was issued with the disagreement: the engine goes on, "
                                    "and its next forward runs as usual") from None
            # gathers issued after the first differing fetch may have paired wrongly, and a rank that issued
            # more of them waits for partners that never come: the notice board tells it at once
            raise RanksDisagree(self.watch.give_up(
                f"{exc}. Gathers issued before the comparison was read may have paired wrongly, so the engine "
                "stops on every rank: restart from the last checkpoint")) from None

    def forget(self) -> None:
        """A forward failed: its comparisons are not read (they were issued
        alike where the ranks are still in step, and are moot where not)."""
        self._in_flight = []
        self._untraced = None

    def left_trace(self, index: int, what: str) -> None:
        self.watch.left_trace((self.micro_step(), index), what)
