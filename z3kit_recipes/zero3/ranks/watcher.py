"""The engine's watcher thread, on backends whose waits do not block the host.

On NCCL and HCCL, ``RankWatch.wait`` only makes the stream wait (see the
Note in ``zero3.ranks.rank_watch``), so a ``z3kit.peer_watch.PeerWatcher`` thread does
the noticing: ``EngineWatcher`` is what it does with what it sees.

- A peer that posted that it waits, or that it stopped: this rank stops too.
- A peer's failure (``FAILED``): this rank stops too after ``ANSWER_S``,
  unless it failed at the same point itself (then every rank did, and they
  are still in step, as ``RankWatch.failed_here`` decides).
- A collective that has not finished after ``collective_timeout_s``: the
  rank posts it and names the ranks that do not answer (``give_up``).

Stopping marks the engine broken (its next call raises ``RankFailed``)
and aborts the process group, so that a host blocked on the device fails
instead of waiting forever. The thread holds the engine's watch weakly: an
engine that is dropped ends its thread.
"""

from __future__ import annotations

import time
import weakref

from z3kit import process_group
from z3kit.peer_watch import PeerWatcher
from z3kit.sideband import BoardReader, Notice
from z3kit_recipes.zero3.ranks.notices import ANSWER_S, FAILED, WAITING, quoted
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch


class EngineWatcher:
    """What the watcher thread decides for one ``RankWatch`` (see the module docstring)."""

    def __init__(self, watch: RankWatch, reader: BoardReader) -> None:
        self._watch = weakref.ref(watch)
        #: this thread's own reader of the board (the main thread's is never read from here)
        self._reader = reader
        #: FAILED notices of other ranks seen, by position tag: (first seen, notice)
        self._peer_failures: dict[str, tuple[float, Notice]] = {}

    def on_notices(self, notices: list[Notice]) -> bool:
        """Returns True once the engine is broken (or gone): the thread ends."""
        watch = self._watch()
        if watch is None:
            return True
        now = time.monotonic()
        for n in notices:
            if n.message.startswith(WAITING):
                self._break_off(watch, quoted(n))
                return True
            if n.message.startswith(FAILED):
                self._peer_failures.setdefault(n.message.rsplit(" ", 1)[-1], (now, n))
        for tag, (seen, notice) in list(self._peer_failures.items()):
            if tag in watch.own_failures:
                del self._peer_failures[tag]
            elif now - seen > ANSWER_S:
                self._break_off(watch, quoted(notice))
                return True
        return False

    def on_stall(self, seconds: float, what: str) -> bool:
        watch = self._watch()
        if watch is None:
            return True
        heard = [notice for _, notice in self._peer_failures.values()]
        watch.give_up(f"rank {watch.rank}: {what} has not finished after {seconds:.0f} s (collective_timeout_s)",
                      heard, reader=self._reader)
        for group in watch.groups:
            process_group.abort(group)
        return True

    @staticmethod
    def _break_off(watch: RankWatch, reason: str) -> None:
        watch.broken = f"{reason}; every rank stops this step"
        if watch.board is not None:
            watch.board.post(f"{WAITING}stopped on rank {watch.rank} ({watch.describe()})")
        for group in watch.groups:
            process_group.abort(group)


def start_watcher(watch: RankWatch) -> None:
    """Give ``watch`` a watcher thread where its waits do not block the host
    and it has a notice board; elsewhere nothing is started."""
    if watch.board is None or watch.waits_on_host:
        return
    reader = watch.board.reader()
    decide = EngineWatcher(watch, reader)
    watcher = PeerWatcher(reader, timeout_s=watch.timeout_s, on_notices=decide.on_notices,
                          on_stall=decide.on_stall, device=watch.device)
    watcher.start()
    watch.watcher = watcher
