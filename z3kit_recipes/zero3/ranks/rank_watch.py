"""What an engine does when another rank fails, dies or goes quiet.

A rank whose forward or backward raises posts why on the ranks' notice
board (``z3kit.sideband``) before it re-raises; every other rank finds the
notice within a fraction of a second and raises ``RankFailed`` with it,
and from then on every call of every engine raises the same error instead
of waiting in a collective that can no longer pair. A collective that
fails (a peer's connection closed) or waits longer than
``collective_timeout_s`` makes the rank post that it is waiting, give the
others a moment to answer, and name the ranks that did not: lost, or stuck
elsewhere.

Note: where the watching happens, per backend.
    On gloo, completing a collective blocks the host anyway, so
    ``RankWatch.wait`` blocks in it a slice at a time and reads the board
    between slices (``WatchedWait``). On NCCL and HCCL, completing one only
    makes the stream wait and the host runs ahead: ``wait`` does just that,
    and a watcher thread (``zero3.ranks.watcher``) reads the board and follows
    the collectives in flight, through the device. When a peer failed or
    a collective stalled, it marks the engine broken and aborts the
    engine's groups, so that a host blocked on the device gets an error;
    the engine's next call raises ``RankFailed`` with the reason, before
    NCCL's own watchdog (``collective_timeout_s`` is kept shorter than the
    group's timeout, ``zero3.runtime.build``).

Informational notices (a rank that left the recorded trace of a step) are
not errors on their own: ranks whose programs change in the same way all
post one; they are quoted when something does fail.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from z3kit import process_group
from z3kit.collectives import ProcessGroup
from z3kit.device import event_after
from z3kit.peer_watch import AllOf, Followed, PeerWatcher
from z3kit.sideband import BoardReader, Notice, SideBand, WatchedWait, in_thread
from z3kit_recipes.zero3.ranks.agreement import RanksDisagree
from z3kit_recipes.zero3.ranks.engine_group import spend
from z3kit_recipes.zero3.ranks.notices import (
    ANSWER_S, FAILED, LEFT, NOTE, PATIENCE_S, RECOVER, TRACE_ADVICE, WAITING, departure_place, quoted,
)
from z3kit_recipes.zero3.step.state import StepState

T = TypeVar("T")


class RankFailed(RanksDisagree):
    """A rank failed, skipped its step, died or stopped answering; raised on every rank."""


class RankWatch:
    """The notice board of one engine and the waits that watch it."""

    def __init__(
        self,
        group: ProcessGroup,
        *,
        timeout_s: float,
        step: StepState,
        poll_s: float = 0.05,
        subgroups: tuple[ProcessGroup, ...] = (),
        device: torch.device | None = None,
    ) -> None:
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        #: the rank's device: where the events that the watcher follows are recorded, and its thread's device
        self.device = torch.device("cpu") if device is None else device
        self.group = group
        #: every group the engine's collectives run on (HSDP's shard and replicate groups too): aborted together
        self.groups = (group, *subgroups)
        #: where this rank is; it holds ``broken``, the message every call raises once the ranks no longer run together
        self.step = step
        self.timeout_s = timeout_s
        #: LEFT notices read so far, kept for a rendezvous of this rank's own
        self._left: list[tuple[int, tuple[int, int], str]] = []
        store = process_group.shared_store() if self.world > 1 else None
        self.board: SideBand | None = None
        if store is not None:
            token = [f"{time.time_ns():x}" if self.rank == 0 else ""]
            dist.broadcast_object_list(token, group_src=0, group=group)
            self.board = SideBand(store, f"z3kit/engine/{token[0]}", self.rank, self.world)
        elif self.world > 1:
            warnings.warn(
                "z3kit: no rendezvous store is shared by the ranks (torch.distributed's default store), so a rank "
                "that fails or dies cannot tell the others: they will wait until the process group's own timeout. "
                "Start the job with torch.distributed.init_process_group (torchrun) to get rank failure detection",
                RuntimeWarning, stacklevel=3)  # shown once a process: same text, same place
        self._watched = WatchedWait(self.board, self._on_notices, self._on_timeout, timeout_s=timeout_s, poll_s=poll_s)
        #: completing a collective blocks the host (gloo); else it orders streams (see the Note)
        self.waits_on_host = process_group.waits_on_host(group)
        #: position tags of this rank's own failures (a peer that failed at the same point is in step)
        self.own_failures: set[str] = set()
        #: the watcher thread, on backends whose waits do not block the host (``zero3.ranks.watcher``)
        self.watcher: PeerWatcher | None = None

    @property
    def broken(self) -> str | None:
        """Why the ranks no longer run together (``StepState.broken``); None while they do."""
        return self.step.broken

    @broken.setter
    def broken(self, message: str | None) -> None:
        self.step.broken = message
        if message is not None:
            spend(self.group)  # its collectives may never pair: the next engine gets a new group

    def describe(self) -> str:  # where this rank is, for a message
        return f"at optimizer step {self.step.global_step}, micro-step {self.step.micro_step}"

    # -- the waits ---------------------------------------------------------------------
    def wait(self, done: Callable[[float], bool], wait: Callable[[], Any]) -> Any:
        """Complete one collective (see the module docstring); once the ranks
        no longer run together, raise at once instead of waiting."""
        if self.broken is not None:
            raise RankFailed(self.broken)
        if self.watcher is None:
            return self._completed(done, wait)
        self.check_watcher()
        # followed through the device, never through what the host did (see z3kit.peer_watch's Notes)
        modelled = self._device_completion()
        label = f"the collective waited {self.describe()}"
        if modelled is not None:
            followed = Followed(modelled.query, label, modelled.describe)
        else:  # the work's own is_completed while inside the wait, the event recorded after it from then on
            followed = Followed(lambda: done(0.0), label)
        self.watcher.follow(followed)
        try:
            out = wait()  # orders the stream; returns at once
        except RuntimeError as exc:  # the process group was aborted (by the watcher, or NCCL's watchdog)
            followed.settle(None)
            self.raise_if_broken()
            self._fail_together(f"a collective failed on rank {self.rank} ({exc})")
            raise  # unreachable: _fail_together raises
        if modelled is None:
            followed.settle(event_after(self.device))
        return out

    def _device_completion(self) -> AllOf | None:
        """Where the engine's groups model a device themselves (the CPU double
        of an accelerator backend, ``device_completion()``): the collectives
        issued on them so far, as a probe that holds no tensor; else None."""
        probes = [g.device_completion() for g in self.groups if hasattr(g, "device_completion")]
        return AllOf(probes) if probes else None

    def check_watcher(self) -> None:
        """A dead watcher thread (no failure of another rank would be noticed)
        breaks the engine on every rank, naming what ended it."""
        if self.watcher is None or self.broken is not None:
            return
        try:
            self.watcher.check_alive()
        except RuntimeError as exc:
            self._fail_together(f"rank {self.rank}: {exc}")

    def raise_if_broken(self) -> None:
        """After the host waited on the device: if the watcher found the
        ranks broken meanwhile, what was waited for may be garbage; raise."""
        if self.broken is not None:
            raise RankFailed(self.broken)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, a blocking collective call with no handle to wait on
        (``torch.distributed.checkpoint``, an object collective: saving and
        loading), watched like ``wait``: a peer that dies or fails gives
        ``RankFailed`` on every rank instead of the backend's connection
        error on some and a hang on the rest. Unlike ``wait`` it does not
        refuse once the ranks are broken: callers decide (a save refuses
        through ``check``)."""
        if self.board is None:
            return fn()
        done, wait = in_thread(fn)
        out: T = self._completed(done, wait)
        return out

    def _completed(self, done: Callable[[float], bool], wait: Callable[[], Any]) -> Any:
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
            raise RankFailed(f"{what} refused: {self.broken}. {RECOVER}")

    # -- posting -----------------------------------------------------------------------------
    def failed_here(self, where: str, exc: BaseException, position: tuple[int, int]) -> None:
        """This rank's ``where`` raised ``exc`` after ``position`` (gathers
        issued, modules fetched in the step): tell the others. When every rank
        failed at the same position (bad input on all of them, say) they are
        still in step, and the engine stays usable; otherwise it is broken on
        every rank (see the module docstring)."""
        if isinstance(exc, RanksDisagree):
            return  # already every rank's error
        if self.broken is not None:  # the watcher broke the engine meanwhile (and aborted its groups): that is why
            raise RankFailed(self.broken) from exc
        where_tag = f"[{position[0]}:{position[1]}]"
        self.own_failures.add(where_tag)
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

    def left_trace(self, where: tuple[int, int], what: str) -> None:
        """This rank's forward just left the step's recorded trace at ``where``
        ((micro-step, fetch index)), doing ``what``. Ranks whose program
        changed the same way (a branch taken on every rank) all get here:
        they return and go on together. A rank that did not raises when it
        next waits (see ``_on_notices``), and this one raises with it; a rank
        that left at the same point doing something else raises at once, as
        this one does on reading its notice."""
        if self.board is None:
            return
        self.board.post(f"{LEFT}{where[0]} {where[1]} {what}")
        started = time.monotonic()
        deadline, warned = started + self.timeout_s, False
        while time.monotonic() < deadline:
            for n in self.board.unread():
                self._remember(n)
                if n.message.startswith((FAILED, WAITING)):
                    self.broken = f"rank {self.rank} {departure_place(where)}: {what}; {quoted(n)}"
                    raise RankFailed(self.broken)
            other = next(((r, did) for r, at, did in self._left if at == where and did != what), None)
            if other is not None:
                self.broken = (f"rank {self.rank} {departure_place(where)}: {what}; rank {other[0]} left at the same "
                               f"point, but {other[1]}")
                raise RankFailed(self.broken + (f"; {TRACE_ADVICE}" if where[1] >= 0 else ""))
            alike = {r for r, at, did in self._left if at == where and did == what}
            if len(alike) == self.world - 1:
                self._left = [entry for entry in self._left if entry[1] != where]
                return
            if not warned and PATIENCE_S < self.timeout_s and time.monotonic() - started > PATIENCE_S:
                warned = True  # a rank blocked outside the engine (the user's barrier) cannot answer: say so early
                missing = sorted(set(range(self.world)) - alike - {self.rank})
                warnings.warn(f"z3kit: rank {self.rank} has waited {PATIENCE_S:.0f} s: it {what}; rank(s) {missing} "
                              f"have not done the same. If they never will, this raises after collective_timeout_s "
                              f"({self.timeout_s:.0f} s)", RuntimeWarning, stacklevel=2)
            time.sleep(0.002)
        self._fail_together(f"rank {self.rank} {departure_place(where)}: {what}; the others did not do the same "
                            f"within {self.timeout_s:.0f} s (collective_timeout_s)")

    def _remember(self, notice: Notice) -> None:
        if notice.message.startswith(LEFT):
            micro, index, what = notice.message.removeprefix(LEFT).split(" ", 2)
            self._left.append((notice.rank, (int(micro), int(index)), what))

    def note(self, message: str) -> None:
        """Tell the others something that explains a failure, should one follow."""
        if self.board is not None:
            self.board.post(f"{NOTE}{message} ({self.describe()})")

    # -- reading ------------------------------------------------------------------------------
    def _on_notices(self, notices: list[Notice]) -> None:
        for n in notices:
            self._remember(n)
        here = self.step.rank_position()
        passed = [(r, at, what) for r, at, what in self._left if here > at]
        if passed:  # another rank left the trace at a point this one went through as recorded
            r, at, what = passed[0]
            self.broken = (f"rank {r} {departure_place(at)}: {what}; rank {self.rank} went on without it "
                           f"({self.describe()})")
            if self.board is not None:
                self.board.post(f"{WAITING}{self.broken}")
            raise RankFailed(self.broken + (f"; {TRACE_ADVICE}" if at[1] >= 0 else ""))
        failures = [n for n in notices if n.message.startswith((FAILED, WAITING))]
        if not failures:
            return
        if not any(n.message.startswith(FAILED) for n in failures):
            # only waits reported (a collective failed or timed out somewhere): a
            # rank may be lost, so name the ones that do not answer
            self._fail_together(f"rank {self.rank} stopped: rank {failures[0].rank} reported a collective that "
                                "failed or waited too long", heard=notices)
        notes = [n for n in notices if n.message.startswith(NOTE)]
        self.broken = "; ".join(quoted(n) for n in failures + notes)
        if self.board is not None:  # the failed rank learns at once that this one did not fail with it
            self.board.post(f"{WAITING}stopped on rank {self.rank} ({self.describe()})")
        raise RankFailed(f"{self.broken}; every rank stops this step")

    def _on_timeout(self, seconds: float) -> None:
        self._fail_together(f"rank {self.rank} waited {seconds:.0f} s in a collective (collective_timeout_s)")

    def _fail_together(self, what: str, heard: list[Notice] | None = None) -> None:
        """Post ``what``, give the others ``ANSWER_S`` to post theirs (besides
        the notices ``heard`` already), raise naming the silent ranks."""
        raise RankFailed(self.give_up(what, heard))

    def give_up(self, what: str, heard: list[Notice] | None = None, reader: BoardReader | None = None) -> str:
        """``_fail_together`` up to the raise: the engine is broken, with the
        returned message. ``reader``: the board reader of the calling thread
        (the watcher's own; the main thread's by default): readers are not
        shared between threads."""
        if self.board is None:
            self.broken = what
            return what
        read = self.board.unread if reader is None else reader.unread
        self.board.post(f"{WAITING}{what} ({self.describe()})")
        deadline = time.monotonic() + ANSWER_S
        by_rank: dict[int, list[str]] = {}
        for n in heard or []:
            by_rank.setdefault(n.rank, []).append(n.message)
        while time.monotonic() < deadline:
            for n in read():
                by_rank.setdefault(n.rank, []).append(n.message)
            if len(by_rank) == self.world - 1 and any(
                m.startswith((WAITING, FAILED)) for ms in by_rank.values() for m in ms
            ):
                break
            time.sleep(0.05)
        silent = [r for r in range(self.world) if r != self.rank and r not in by_rank]
        parts = [what]
        parts += [f"rank {r}: {m}" for r, ms in sorted(by_rank.items()) for m in ms]
        if silent:
            parts.append(f"rank(s) {silent} posted nothing within {ANSWER_S:.0f} s: lost (the process died or "
                         "its host is unreachable) or busy outside this engine")
        self.broken = "; ".join(parts)
        return self.broken
