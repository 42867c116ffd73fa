"""A notice board for the ranks of a process group, outside every collective.

A collective can only tell a rank what the others are doing once they
all join it. When one rank fails, skips its batch or dies, the others are
already waiting in a collective it will never join, and would wait for the
process group's timeout (30 minutes by default) with nothing to say. The
notice board is the rendezvous store that every process of a
``torch.distributed`` job shares (a key-value server on rank 0's host): a
rank that gives up posts why, and a rank whose collective takes unusually
long looks at the board (``WatchedWait``) and raises what it finds, so
every rank stops within a fraction of a second with the same message.

Note: the cost.
    Posting is one store write; looking is one store round trip
    (``add(key, 0)`` returns the count of notices) and is done only by a
    rank already blocked for ``poll_s`` (50 ms): a collective that finishes
    within that never touches the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch


@attrs.frozen
class Notice:
    rank: int
    message: str


class SideBand:
    """Notices under ``prefix`` in ``store`` (one board per engine).

    Several readers may follow one board (the engine's thread, and a
    watcher thread beside it, ``z3kit.peer_watch``): notices are fetched
    once, under a lock, into a history that each reader walks with a
    cursor of its own; ``unread`` is the first reader's."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int) -> None:
        self._store, self._prefix, self.rank, self.world = store, prefix, rank, world
        self._lock = threading.Lock()
        self._posted = 0
        self._seen_total = 0
        self._cursor = [0] * world  # notices of each rank fetched so far
        self._history: list[Notice] = []
        self._main = BoardReader(self)

    def post(self, message: str) -> None:
        """Tell every rank ``message``."""
        with self._lock:
            self._store.set(f"{self._prefix}/{self.rank}/{self._posted}", message)
            self._posted += 1
            self._store.add(f"{self._prefix}/count", 1)

    def count(self) -> int:
        return int(self._store.add(f"{self._prefix}/count", 0))

    def fetched(self, start: int) -> list[Notice]:
        """Every notice of the other ranks from position ``start`` of the
        history on, after fetching what the store has that is new."""
        with self._lock:
            total = self.count()
            if total != self._seen_total:
                self._seen_total = total
                for rank in range(self.world):
                    while rank != self.rank:
                        key = f"{self._prefix}/{rank}/{self._cursor[rank]}"
                        if not self._store.check([key]):
                            break
                        self._history.append(Notice(rank, self._store.get(key).decode()))
                        self._cursor[rank] += 1
            return self._history[start:]

    def unread(self) -> list[Notice]:
        """Notices the other ranks posted since the last call, in the order fetched."""
        return self._main.unread()

    def reader(self) -> BoardReader:
        """A reader of its own, with its own cursor (for another thread)."""
        return BoardReader(self)


class BoardReader:
    """One reader's cursor over a ``SideBand``'s notices."""

    def __init__(self, board: SideBand) -> None:
        self._board = board
        self._position = 0

    def unread(self) -> list[Notice]:
        notices = self._board.fetched(self._position)
        self._position += len(notices)
        return notices


class WatchedWait:
    """Waits on collectives while watching a ``SideBand``.

    ``wait(done, wait)``: ``done(timeout_s)`` blocks up to ``timeout_s``
    for the collective and says whether it finished (``Pending.is_completed``);
    ``wait()`` completes it. Every ``poll_s`` that it is not done, the board
    is read and ``on_notice`` is called with what other ranks posted (it
    raises, typically). Past ``timeout_s``, ``on_timeout`` is called with
    the seconds waited.
    """

    def __init__(
        self,
        board: SideBand | None,
        on_notice: Callable[[list[Notice]], None],
        on_timeout: Callable[[float], None],
        *,
        timeout_s: float,
        poll_s: float = 0.05,
    ) -> None:
        self.board, self.on_notice, self.on_timeout = board, on_notice, on_timeout
        self.timeout_s, self.poll_s = timeout_s, poll_s

    def wait(self, done: Callable[[float], bool], wait: Callable[[], Any]) -> Any:
        if self.board is None:
            return wait()
        start = time.monotonic()
        # blocking in the collective's own wait, a slice at a time, wakes the
        # moment it finishes (polling with sleeps would add their granularity)
        while not done(self.poll_s):
            notices = self.board.unread()
            if notices:
                self.on_notice(notices)
            now = time.monotonic()
            if now - start > self.timeout_s:
                self.on_timeout(now - start)
                start = now  # on_timeout returned: keep waiting, and ask again after another timeout
        return wait()


def in_thread(fn: Callable[[], Any]) -> tuple[Callable[[float], bool], Callable[[], Any]]:
    """``fn``, a blocking call that offers no handle to wait on (an object
    collective, a whole ``torch.distributed.checkpoint`` save), started in a
    thread of its own, as the ``(done, wait)`` pair of ``WatchedWait.wait``:
    so that the caller can read the notice board while it blocks.

    The thread is a daemon: when the wait gives up (another rank failed),
    the call may stay blocked in its collective until the process group's
    own timeout, and must not keep the process from exiting meanwhile."""
    outcome: dict[str, Any] = {}
    # a new thread starts on device 0: an NCCL or HCCL call there would use another rank's device
    device_index = torch.accelerator.current_device_index() if torch.accelerator.is_available() else None

    def run() -> None:
        if device_index is not None:
            torch.accelerator.set_device_index(device_index)
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, raised there
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="z3kit-blocking-call", daemon=True)
    thread.start()

    def done(timeout_s: float) -> bool:
        thread.join(timeout_s)
        return not thread.is_alive()

    def wait() -> Any:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return done, wait
