"""A thread that watches the other ranks while the host runs ahead.

On an accelerator backend (NCCL, HCCL) completing a collective only makes
the compute stream wait (``z3kit.collectives``): the host never blocks in
one, so it cannot notice from there that a peer failed or went quiet. It
would notice only at its next host sync (a ``loss.item()``), blocked for
good. ``PeerWatcher`` does that noticing off the hot path, every
``poll_s``:

- it reads the ranks' notice board (``z3kit.sideband``) with a reader of
  its own and hands what other ranks posted to ``on_notices``;
- it follows the collectives it is given (``follow``), in issue order,
  polling the oldest with its non-blocking ``is_completed``; one that is
  still unfinished ``timeout_s`` after it was followed goes to
  ``on_stall``.

What happens then (posting, naming the silent ranks, aborting the process
group so that a blocked host sync fails instead of hanging) is the
callbacks' business; the thread stops once one of them says so by
returning True. It is a daemon, and never touches a tensor.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from z3kit.sideband import BoardReader, Notice


class PeerWatcher:
    """Board and progress watching in a thread (see the module docstring)."""

    def __init__(
        self,
        reader: BoardReader,
        *,
        timeout_s: float,
        on_notices: Callable[[list[Notice]], bool],
        on_stall: Callable[[float, str], bool],
        poll_s: float = 0.1,
    ) -> None:
        self._reader, self.timeout_s, self.poll_s = reader, timeout_s, poll_s
        self._on_notices, self._on_stall = on_notices, on_stall
        self._followed: collections.deque[tuple[float, Callable[[], bool], str]] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="z3kit-peer-watch", daemon=True)
        #: what ended the thread, if a callback raised (kept for the engine to report)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def follow(self, done: Callable[[], bool], label: str) -> None:
        """Watch a collective: ``done()`` polls it without blocking."""
        # deque appends and poplefts are atomic: no lock between the two threads
        self._followed.append((time.monotonic(), done, label))

    def in_flight(self) -> int:
        """Collectives followed and not yet seen finished."""
        return len(self._followed)

    def _oldest_unfinished(self) -> tuple[float, str] | None:
        while self._followed:
            since, done, label = self._followed[0]
            if not done():
                return since, label
            self._followed.popleft()
        return None

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                # called on every tick, with nothing new too: a callback may be waiting out a grace period
                if self._on_notices(self._reader.unread()):
                    return
                oldest = self._oldest_unfinished()
                if oldest is not None and time.monotonic() - oldest[0] > self.timeout_s:
                    if self._on_stall(time.monotonic() - oldest[0], oldest[1]):
                        return
        except BaseException as exc:  # noqa: BLE001 - a thread has no caller to raise to
            self.error = exc
