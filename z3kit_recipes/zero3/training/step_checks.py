"""When the end-of-backward step checks are read, and what follows from them.

Every backward ends with a step check (``zero3.ranks.agreement``): the ranks
compare where they are and what they did, and learn, for each trainable
parameter, whether some rank got its gradient (``ARRIVED``), holds a late
one (``LATE``), and whether every rank had it handed over during backward
rather than filled in with zeros at its end (``HANDED``).

Note: no host sync in a step.
    Reading a check is a host sync on an accelerator, so a check is issued
    at the end of its backward, its result copied to the host behind it
    (``z3kit.host_copy``), and read later, where the device is long past
    it:
    - at the end of the next backward (every rank reads the same checks
      there, so a disagreement found then can be explained collectively);
    - at ``step()``, only for what the optimizer needs: which parameters
      got a gradient on some rank. A rank that had every gradient itself
      knows the answer without reading (all of them), and reads nothing.
    A check is read at once, at the end of its own backward, while nothing
    has been read yet (the first backward), in the first backward that
    issues reductions early for newly reliable parameters (see the next
    Note: a gradient that arrives twice becomes late only there), and once
    any rank has held a late gradient: late gradients are reduced right
    after the check that names them. A late gradient that first appears in
    a check read only after the optimizer step it belonged to raises
    ``RanksDisagree``.

Note: reductions issued in the same order on every rank.
    Gathers and reductions share one communicator, and NCCL pairs a
    communicator's collectives by issue order, so a gradient bucket must
    be issued at the same point of the backward on every rank. It is
    issued as soon as it is full only when each of its parameters is
    ``reliable``: handed over during backward on every rank in every
    backward read so far. Any other bucket (and, keeping plan order, every
    bucket after it) is issued at the end of backward, when every rank
    issues the rest in plan order. So the first backward issues all of its
    reductions at the end; later ones overlap them with compute. A
    reliable parameter that some ranks handed over and others did not
    means the orders may have differed: that raises ``RanksDisagree``, and
    the parameter is reliable no more. With ``divergent_graphs`` nothing is
    reliable (every reduction at the end of backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from z3kit_recipes.zero3.ranks.agreement import (
    ARRIVED,
    HANDED,
    LATE,
    CheckOutcome,
    RanksDisagree,
    StepCheck,
    StepRecord,
    start_step_check,
)
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch
from z3kit_recipes.zero3.training.grads import GradReducer


class StepChecks:
    """The step checks of one engine in flight, and what has been learned from them."""

    def __init__(
        self,
        reducer: GradReducer,
        watch: RankWatch,
        device: torch.device,
        names: Sequence[str],
        *,
        global_step: Callable[[], int],
        defer_all: bool,
    ) -> None:
        self.reducer, self.watch, self.device, self.names = reducer, watch, device, names
        self.global_step, self.defer_all = global_step, defer_all
        #: checks in flight, each with the trainable parameters its flags are for
        self._in_flight: list[tuple[StepCheck, tuple[int, ...]]] = []
        #: the accumulation window (``GradWindow.number``) of each check issued, by id
        self._window_of: dict[int, int] = {}
        #: reads that had to wait for the device (host syncs of the engine's own)
        self.host_waits = 0
        #: a late gradient was held by some rank in some backward read so far
        self.late_seen = False
        #: whether nothing has been read yet
        self._learned = False
        #: this rank's flags of the last check in flight, for ``before_step``
        self._last_flags: list[int] = []
        self._marked: set[int] = set()  # ids of checks whose arrivals were marked used at step()
        #: parameters some check has reported on
        self._known: set[int] = set()
        #: the next backward is the first to issue reductions early for newly reliable parameters:
        #: a second gradient may first show up there, so its check is read at once
        self._trial = False
        if watch.world == 1:
            reducer.reliable = None  # one rank: nothing to keep in order

    def end_of_backward(self, trainable: Sequence[int], record: StepRecord, micro_step: int) -> None:
        """Issue this backward's check (after every reduction was issued) and
        read what is due (see the Notes). Collective."""
        flags = self._flags(trainable)
        if self.watch.world == 1:
            self._apply_local(trainable, flags)
            return
        check = start_step_check(self.watch.group, self.device, global_step=self.global_step(),
                                 micro_step=micro_step, record=record, flags=flags)
        check.stage(self.watch.wait)
        self._window_of[id(check)] = self.reducer.window.number
        due, self._in_flight = self._in_flight, [(check, tuple(trainable))]
        self._last_flags = flags
        read = [(c, pids, c.result(self.watch.wait)) for c, pids in due]
        if not self._learned or self._trial or self.late_seen or any(any(o.any_rank(LATE)) for _, _, o in read):
            read.append((check, tuple(trainable), check.result(self.watch.wait)))
            self._in_flight = []
            self._trial = False
        self._apply(read)

    def settle(self) -> None:
        """Read and apply every check in flight now (collective: at a point
        every rank reaches, such as a checkpoint save, which must see the
        window's parameters marked used)."""
        read = [(c, pids, c.result(self.watch.wait)) for c, pids in self._in_flight]
        self._in_flight = []
        self._apply(read)

    def complete(self) -> None:
        """Let the collectives of the checks in flight finish, reading nothing (``engine.synchronize``:
        a gloo work still running when a torch profiler stops can crash the process)."""
        for check, _ in self._in_flight:
            self.watch.wait(check.pending.is_completed, check.pending.wait)

    def before_step(self) -> None:
        """Mark what got a gradient in the window's last backward, reading
        its check only where this rank cannot tell (see the Note)."""
        for check, pids in self._in_flight:
            mine = self._last_flags
            if all(f & ARRIVED for f in mine) and not any(f & LATE for f in mine) and not self.late_seen:
                self.reducer.mark_used(pids)
                self._marked.add(id(check))
                continue
            outcome = check.peek(self.watch.wait)  # only this rank reads here: no collective on this path
            self.host_waits += check.waited
            if any(h != outcome.headers[0] for h in outcome.headers) or any(outcome.any_rank(LATE)):
                message = ("the ranks' last backward before this optimizer step did not match, or held a late "
                           "gradient (a parameter used twice under reentrant checkpointing) for the first time; "
                           "see the error on the other ranks")
                self.watch.broken = message
                raise RanksDisagree(message)
            self.reducer.mark_used(p for p, used in zip(pids, outcome.any_rank(ARRIVED)) if used)
            self._marked.add(id(check))

    def _flags(self, trainable: Sequence[int]) -> list[int]:
        reducer = self.reducer
        arrived, late, handed = reducer.arrived, reducer.late, reducer.handed
        flags = [(ARRIVED if p in arrived else 0) | (LATE if p in late else 0) | (HANDED if p in handed else 0)
                 for p in trainable]
        reducer.new_backward()
        return flags

    def _apply_local(self, trainable: Sequence[int], flags: list[int]) -> None:
        self.reducer.mark_used(p for p, f in zip(trainable, flags) if f & ARRIVED)
        late = [p for p, f in zip(trainable, flags) if f & LATE]
        if late:
            self.reducer.reduce_late(late)

    def _apply(self, read: list[tuple[StepCheck, tuple[int, ...], CheckOutcome]]) -> None:
        """What checks read at the end of a backward mean (the same on every rank)."""
        late: set[int] = set()
        for check, trainable, outcome in read:
            self.host_waits += check.waited
            stepped = self._window_of.pop(id(check)) != self.reducer.window.number
            late_here = {p for p, held in zip(trainable, outcome.any_rank(LATE)) if held}
            if stepped and late_here:
                raise RanksDisagree(
                    f"late gradients of {[self.names[p] for p in sorted(late_here)][:5]} (a parameter used twice in "
                    "one backward, under reentrant checkpointing) appeared for the first time in the last backward "
                    "before an optimizer step, which went ahead without them; restart from the last checkpoint")
            if not stepped and id(check) not in self._marked:
                self.reducer.mark_used(p for p, used in zip(trainable, outcome.any_rank(ARRIVED)) if used)
            self._marked.discard(id(check))
            late |= late_here
            self._learn_order(trainable, outcome)
        self.late_seen = self.late_seen or bool(late)
        if late:
            self.reducer.reduce_late(sorted(late))

    def _learn_order(self, trainable: Sequence[int], outcome: CheckOutcome) -> None:
        """Update which parameters are reliable (see the Note on order): one
        seen for the first time is reliable if every rank handed it over;
        a reliable one stays so while every rank does."""
        self._learned = True
        reliable = self.reducer.reliable
        if reliable is None:
            return
        world, changed = len(outcome.flags), False
        for i, p in enumerate(trainable):
            handed = outcome.ranks_with(i, HANDED)
            if p not in self._known:
                self._known.add(p)
                if len(handed) == world and not self.defer_all:
                    reliable.add(p)
                    changed = self._trial = True
            elif p in reliable and len(handed) < world:
                reliable.discard(p)
                self.reducer.reliability_changed()
                if handed:
                    raise RanksDisagree(
                        f"parameter {self.names[p]!r} got its gradient during backward on rank(s) {handed} only, "
                        "after every earlier backward gave it one on every rank: the ranks may have issued their "
                        "gradient reductions in different orders, so this step's gradients cannot be trusted; "
                        "restart from the last checkpoint. A parameter whose use depends on the rank or the data "
                        "belongs in a leaf module (leaf_modules), or set Zero3Config(divergent_graphs=True)")
        if changed:
            self.reducer.reliability_changed()
