"""The per-step clock that fills ``Zero3Stats`` (``zero3.runtime.stats``).

``StepStats`` is told of each optimizer step and each training forward; it
keeps the collectives, the bytes received per link class, wall time,
communication waits and rank checks of the last step, and the high-water of
gathered parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from z3kit.collectives import CollectiveLog
from z3kit.host_work import HostWork
from z3kit.memory import MemoryLedger
from z3kit.prefetch import PrefetchLimiter


@attrs.frozen
class StepFigures:
    """The last optimizer step's figures (``StepStats.last``)."""

    collectives: dict[str, dict[str, int]]
    step_time_s: float
    comm_wait_s: float
    rank_check_s: float
    #: high-water of gathered elements during the step
    peak_live_numel: int
    #: bytes this rank received per link class (``CollectiveLog.link_snapshot``)
    link_bytes: dict[str, int]
    #: the host work of the step (``z3kit.host_work``), and its collectives
    host_work: dict[str, int]


class StepStats:
    """Per-step clocks and counters; ``comm_wait`` and ``rank_check`` read the
    running totals of seconds blocked on communication and on rank checks."""

    def __init__(
        self,
        log: CollectiveLog,
        memory: MemoryLedger,
        limiter: PrefetchLimiter,
        comm_wait: Callable[[], float],
        rank_check: Callable[[], float],
        work: HostWork,
    ) -> None:
        self._log, self._memory, self._limiter = log, memory, limiter
        self._comm_wait, self._rank_check = comm_wait, rank_check
        self._work, self._work_at_step = work, work.snapshot()
        self._at_step = (log.snapshot(), log.link_snapshot(), time.perf_counter(), 0.0, 0.0)
        self._new_memory_window = True
        self.last = StepFigures(
            _diff(log.snapshot(), log.snapshot()), 0.0, 0.0, 0.0, 0, {link: 0 for link in log.link_snapshot()},
            {**HostWork().since(HostWork()), "collectives": 0},
        )

    def training_forward(self) -> None:
        """The first training forward after a step opens a new window of memory peaks."""
        if self._new_memory_window:
            self._new_memory_window = False
            self._memory.reset_peaks()

    def optimizer_step(self) -> None:
        log_before, links_before, clock_before, wait_before, check_before = self._at_step
        log = self._log
        now = (log.snapshot(), log.link_snapshot(), time.perf_counter(), self._comm_wait(), self._rank_check())
        self.last = StepFigures(
            collectives=_diff(now[0], log_before),
            step_time_s=now[2] - clock_before,
            comm_wait_s=now[3] - wait_before,
            rank_check_s=now[4] - check_before,
            peak_live_numel=self._limiter.high_water,
            link_bytes={link: now[1][link] - links_before[link] for link in now[1]},
            host_work={**self._work.since(self._work_at_step),
                       "collectives": sum(kind["calls"] for kind in _diff(now[0], log_before).values())},
        )
        self._at_step, self._work_at_step = now, self._work.snapshot()
        self._limiter.reset_high_water()
        self._new_memory_window = True

    def peak_live_numel(self) -> int:
        """High-water of gathered elements in the last step and since."""
        return max(self.last.peak_live_numel, self._limiter.high_water)


def _diff(now: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {k: {f: now[k][f] - before[k][f] for f in now[k]} for k in now}
