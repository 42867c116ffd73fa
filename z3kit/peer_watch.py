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
  polling the oldest with a non-blocking ``query()`` that asks the device
  (``Followed``); one that is still unfinished ``timeout_s`` after it was
  followed goes to ``on_stall``.

Note: what it may hold, and ask.
    On an accelerator ``Work.wait()`` returns before the collective ran, so
    a flag set when it returns (a ticket closed, a handle waited) says
    nothing about the device. Only the work's own ``is_completed()`` or an
    event recorded on the stream after the wait do (DESIGN.md, "Seeing
    completion from another thread"). The work and the handles that hold it
    keep the collective's buffers alive, so the watcher holds them only
    while the caller is inside the wait (when the caller holds them too)
    and swaps them for the event after it (``Followed.settle``): nothing
    it keeps counts against memory.

Note: aborting from this thread, as torch's own watchdog does.
    ``ProcessGroupNCCL`` runs a watchdog thread beside the main one
    (``ProcessGroupNCCL.hpp``: ``Watchdog::runLoop``) that polls every
    work in flight with ``isCompleted`` and, on a timeout or an error,
    aborts the communicators from that thread (``abortCommsFromMap``, the
    same path as the public ``ProcessGroup.abort()``); each ``NCCLComm``
    is guarded by a mutex, so a collective the main thread launches
    meanwhile is serialized with the abort and fails after it instead of
    racing it. What the callbacks may do from here follows that: read the
    board, post on it, mark the engine broken and call the group's
    ``abort()``; never issue a collective, touch a tensor or free a
    buffer (the main thread owns those, and learns of the abort from the
    error its next wait or host sync raises).

What happens then (posting, naming the silent ranks, aborting the process
group so that a blocked host sync fails instead of hanging) is the
callbacks' business; the thread stops once one of them says so by
returning True. It is a daemon, and never touches a tensor. Its death is
not silent: ``check_alive`` raises with what ended it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from z3kit.device import use_device
from z3kit.sideband import BoardReader, Notice


class Probe(Protocol):
    """What says, without blocking, whether work on the device finished: a device event, say."""

    def query(self) -> bool: ...


class Followed:
    """One collective as the watcher follows it: polled through ``poll``
    (the work's own ``is_completed``, which holds its buffers) while the
    caller waits on it, then, after ``settle``, through a probe that holds
    no tensor (see the Note of the module)."""

    __slots__ = ("_poll", "_label", "_describe")

    def __init__(self, poll: Callable[[], bool], label: str, describe: Callable[[], str] | None = None) -> None:
        self._poll = poll
        self._label = label
        self._describe = describe

    def settle(self, probe: Probe | None) -> None:
        """The caller's wait returned: follow ``probe`` from now on (None: nothing
        left to watch), and let go of what ``poll`` held."""
        self._poll = _finished if probe is None else probe.query  # one store: atomic for the other thread

    def query(self) -> bool:
        return bool(self._poll())

    @property
    def label(self) -> str:
        more = self._describe() if self._describe is not None else ""
        return f"{self._label} ({more})" if more else self._label


def _finished() -> bool:
    return True


class AllOf:
    """Several probes as one: finished when all are, described by the first
    that is not (a probe may say what it follows with ``describe()``)."""

    def __init__(self, probes: list[Any]) -> None:
        self._probes = probes

    def query(self) -> bool:
        return all(p.query() for p in self._probes)

    def describe(self) -> str:
        said = (getattr(p, "describe", lambda: "")() for p in self._probes if not p.query())
        return next((d for d in said if d), "")


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
        device: torch.device | None = None,
    ) -> None:
        self._reader, self.timeout_s, self.poll_s = reader, timeout_s, poll_s
        self._on_notices, self._on_stall = on_notices, on_stall
        #: the rank's device, made current in the thread before it touches an event or a communicator
        self.device = device
        self._followed: collections.deque[tuple[float, Followed]] = collections.deque()
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

    def check_alive(self) -> None:
        """Raise if the thread died (a callback raised, or it never started):
        failure detection would be off without anyone knowing."""
        if self.error is not None:
            raise RuntimeError(f"the z3kit watcher thread died with {type(self.error).__name__}: {self.error}; "
                               "failures of other ranks are no longer detected") from self.error
        if not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("the z3kit watcher thread is not running; failures of other ranks are not detected")

    def follow(self, followed: Followed) -> None:
        """Watch a collective until ``followed.query()`` says it finished."""
        # deque appends and poplefts are atomic: no lock between the two threads
        self._followed.append((time.monotonic(), followed))

    def in_flight(self) -> int:
        """Collectives followed and not yet seen finished."""
        return len(self._followed)

    def _oldest_unfinished(self) -> tuple[float, str] | None:
        while self._followed:
            since, followed = self._followed[0]
            if not followed.query():
                return since, followed.label
            self._followed.popleft()
        return None

    def _run(self) -> None:
        try:
            if self.device is not None:
                use_device(self.device)
            while not self._stop.wait(self.poll_s):
                # called on every tick, with nothing new too: a callback may be waiting out a grace period
                if self._on_notices(self._reader.unread()):
                    return
                oldest = self._oldest_unfinished()
                if oldest is not None and time.monotonic() - oldest[0] > self.timeout_s:
                    if self._on_stall(time.monotonic() - oldest[0], oldest[1]):
                        return
        except BaseException as exc:  # noqa: BLE001 - a thread has no caller to raise to: check_alive reports it
            self.error = exc
