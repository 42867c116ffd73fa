"""What an engine does when another rank fails, dies or goes quiet.

``RankWatch`` completes every collective of the engine through a watched
wait (``z3kit.sideband``): while a collective is unfinished, the ranks'
notice board is read now and then. A rank whose forward or backward raises
posts why before it re-raises; every other rank finds the notice within a
fraction of a second and raises ``RankFailed`` with it, and from then on
every call of every engine raises the same error instead of waiting in a
collective that can no longer pair. A collective that fails (a peer's
connection closed) or waits longer than ``collective_timeout_s`` makes the
rank post that it is waiting, give the others a moment to answer, and name
the ranks that did not: lost, or stuck elsewhere.

Informational notices (a rank that left the recorded trace of a step) are
not errors on their own: ranks whose programs change in the same way all
post one; they are quoted when something does fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from z3kit.collectives import ProcessGroup
from z3kit.sideband import Notice, SideBand, WatchedWait, default_store
from z3kit_recipes.zero3.agreement import RanksDisagree

FAILED = "failed: "
NOTE = "note: "
WAITING = "waiting: "
#: how long a rank that found trouble gives the others to post their side
ANSWER_S = 3.0


class RankFailed(RanksDisagree):
    """A rank failed, skipped its step, died or stopped answering; raised on every rank."""


class RankWatch:
    """The notice board of one engine and the waits that watch it."""

    def __init__(
        self, group: ProcessGroup, *, timeout_s: float, describe: Callable[[], str], poll_s: float = 0.05
    ) -> None:
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.describe = describe
        #: the message every call raises once the ranks no longer run together
        self.broken: str | None = None
        store = default_store() if self.world > 1 else None
        self.board: SideBand | None = None
        if store is not None:
            token = [f"{time.time_ns():x}" if self.rank == 0 else ""]
            dist.broadcast_object_list(token, group_src=0, group=group)
            self.board = SideBand(store, f"z3kit/engine/{token[0]}", self.rank, self.world)
        self._watched = WatchedWait(self.board, self._on_notices, self._on_timeout, timeout_s=timeout_s, poll_s=poll_s)

    # -- the waits ---------------------------------------------------------------------
    def wait(self, done: Callable[[], bool], wait: Callable[[], Any]) -> Any:
        """Complete one collective (see the module docstring)."""
        try:
            return self._watched.wait(done, wait)
        except RanksDisagree:
            raise
        except RuntimeError as exc:  # the collective itself failed: a peer is gone, or the ranks' calls did not match
            self._fail_together(f"a collective failed on rank {self.rank} ({exc})")
            raise  # unreachable: _fail_together raises

    def check(self, what: str) -> None:
        """Refuse ``what`` once the ranks no longer run together."""
        if self.broken is not None:
            raise RankFailed(f"{what} refused: {self.broken}. Restart from the last checkpoint (engine.load_checkpoint)")

    # -- posting -----------------------------------------------------------------------------
    def failed_here(self, where: str, exc: BaseException, position: tuple[int, int]) -> None:
        """This rank's ``where`` raised ``exc`` after ``position`` (gathers
        issued, modules fetched in the step): tell the others. When every rank
        failed at the same position (bad input on all of them, say) they are
        still in step, and the engine stays usable; otherwise it is broken on
        every rank (see the module docstring)."""
        if isinstance(exc, RanksDisagree):
            return  # already every rank's error
        where_tag = f"[{position[0]}:{position[1]}]"
        message = f"{FAILED}{where} raised {type(exc).__name__}: {exc} ({self.describe()}) {where_tag}"
        self.broken = f"rank {self.rank} {message.removeprefix(FAILED)}"
        if self.board is None:
            self.broken = None if self.world == 1 else self.broken
            return
        self.board.post(message)
        same = 0
        deadline = time.monotonic() + ANSWER_S
        while time.monotonic() < deadline and same < self.world - 1:
            for n in self.board.unread():
                if n.message.startswith(FAILED) and n.message.endswith(where_tag):
                    same += 1
                elif n.message.startswith((FAILED, WAITING)):
                    return  # another rank did something else: broken everywhere
            time.sleep(0.01)
        if same == self.world - 1:
            self.broken = None  # every rank failed at the same point: still in step

    def note(self, message: str) -> None:
        """Tell the others something that explains a failure, should one follow."""
        if self.board is not None:
            self.board.post(f"{NOTE}{message} ({self.describe()})")

    # -- reading ------------------------------------------------------------------------------
    def _on_notices(self, notices: list[Notice]) -> None:
        failures = [n for n in notices if n.message.startswith((FAILED, WAITING))]
        if failures:
            notes = [n for n in notices if n.message.startswith(NOTE)]
            self.broken = "; ".join(f"rank {n.rank} {n.message.split(': ', 1)[1]}" for n in failures + notes)
            if self.board is not None:  # the failed rank learns at once that this one did not fail with it
                self.board.post(f"{WAITING}stopped on rank {self.rank} ({self.describe()})")
            raise RankFailed(f"{self.broken}; every rank stops this step")

    def _on_timeout(self, seconds: float) -> None:
        self._fail_together(f"rank {self.rank} waited {seconds:.0f} s in a collective (collective_timeout_s)")

    def _fail_together(self, what: str) -> None:
        """Post ``what``, give the others ``ANSWER_S`` to post theirs, raise naming the silent ranks."""
        if self.board is None:
            self.broken = what
            raise RankFailed(what)
        self.board.post(f"{WAITING}{what} ({self.describe()})")
        deadline = time.monotonic() + ANSWER_S
        heard: dict[int, list[str]] = {}
        while time.monotonic() < deadline:
            for n in self.board.unread():
                heard.setdefault(n.rank, []).append(n.message)
            if len(heard) == self.world - 1 and any(m.startswith((WAITING, FAILED)) for ms in heard.values() for m in ms):
                break
            time.sleep(0.05)
        silent = [r for r in range(self.world) if r != self.rank and r not in heard]
        parts = [what]
        parts += [f"rank {r}: {m}" for r, ms in sorted(heard.items()) for m in ms]
        if silent:
            parts.append(f"rank(s) {silent} posted nothing within {ANSWER_S:.0f} s: lost (the process died or "
                         "its host is unreachable) or busy outside this engine")
        self.broken = "; ".join(parts)
        raise RankFailed(self.broken)
