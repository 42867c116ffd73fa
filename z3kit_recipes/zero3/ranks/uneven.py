"""Forwards that only some ranks run: met, or refused on every rank in seconds.

Note: why eval forwards meet.
    An eval or ``no_grad`` forward gathers its parameters collectively, as a
    training forward does, and collectives pair by order. A rank that runs
    one alone (rank 0 logging a sample, ranks with different numbers of eval
    batches) would pair its gathers with whatever the others issue next:
    mismatched sizes, a hang, or silently wrong values. So before an eval
    forward that gathers anything, each rank posts on the notice board that
    it runs eval forward #n since its last backward, and waits for every
    other rank to post the same (``RankWatch.left_trace``, at a position
    before that micro-step's training forward). A rank in a training
    forward, or at another point, that reads the notice raises at its next
    wait, and the eval rank raises with it, each naming what the other did:
    within seconds, and without calling a live rank lost. A rank that is
    busy outside the engine (the user's own barrier) is waited for, up to
    ``collective_timeout_s``.

    The meeting is a store round trip per eval forward, no collective and no
    device sync. Forwards that gather nothing (every parameter persistent
    and gathered) need no meeting. ``engine.generate`` runs every rank in
    lockstep on the same inputs, so its forwards skip it (``lockstep``).

    Meeting at the start does not make the forwards alike: a rank whose
    eval forward takes another path (an early exit on its data) would pair
    its gathers with the others' next ones. So each such forward's fetches
    are also compared as they go (``FetchAgreement.open_untraced``, also
    for an eval forward inside a training step, which does not meet), and
    the root's post-forward reads them before the output is handed back
    (``finish``). With ``divergent_graphs`` the fetch rounds keep such
    forwards together instead (``zero3.training.rounds``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from z3kit.hook_context import in_backward, outside_graphs
from z3kit_recipes.zero3.ranks.fetch_agreement import FetchAgreement
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch
from z3kit_recipes.zero3.step.position import EVAL_BASE
from z3kit_recipes.zero3.step.state import StepState

_ADVICE = ("every rank must run the same forwards, since each gathers parameters collectively: for a sample on one "
           "rank call engine.generate(..., rank=0) on every rank; for ranks with different numbers of batches run "
           "the same number on each (pad the last batches), or gather what one rank needs with "
           "engine.gathered_parameters() around its work")


class EvalMeeting:
    """Eval and ``no_grad`` forwards meet on the notice board (see the Note)."""

    def __init__(
        self,
        root: nn.Module,
        watch: RankWatch,
        step: StepState,
        *,
        gathers_needed: Callable[[], bool],
        fetches: FetchAgreement | None,
    ) -> None:
        self.watch, self.gathers_needed = watch, gathers_needed
        #: compares the forward's fetches (None: rank-divergent graphs, whose rounds keep the ranks together)
        self.fetches = fetches
        #: where this rank is: the eval forward under way is written into its position
        self.step = step
        self._counted_at = -1  # the micro-step whose eval forwards ``_count`` counts
        self._count = 0
        self._lockstep = 0

        @outside_graphs
        def before(module: nn.Module, args: Any) -> None:
            self._before_forward(module)

        @outside_graphs
        def after(module: nn.Module, args: Any, output: Any) -> None:
            self.step.position.eval_forward = None

        # prepended: before the root's own fetch, which may gather
        self._handles = [root.register_forward_pre_hook(before, prepend=True), root.register_forward_hook(after)]

    def _before_forward(self, root: nn.Module) -> None:
        self.step.position.eval_forward = None
        if (torch.is_grad_enabled() and root.training) or in_backward():
            return  # a training forward, or a checkpoint recomputation: the step's own checks hold
        if self._lockstep or not self.gathers_needed():
            return
        if not self.step.in_step and self.watch.board is not None:  # inside a step the step's own checks place it
            self._meet()
        if self.fetches is not None:
            self.fetches.open_untraced()

    def finish(self) -> None:
        """The root's post-forward of an eval or no_grad forward: its fetch
        comparisons read, on every rank, before its output is handed back."""
        if self.fetches is not None:
            self.fetches.close_untraced()

    def _meet(self) -> None:
        position = self._next_position()
        self.step.position.eval_forward = position
        self.watch.left_trace((self.step.micro_step, position), f"ran an eval or no_grad forward (#{self._count} "
                                                                f"since its last backward) that the other ranks did not; "
                                                                f"{_ADVICE}")

    def _next_position(self) -> int:
        """The next point of this micro-step where the ranks meet outside the step (eval forwards, collective calls)."""
        micro = self.step.micro_step
        if micro != self._counted_at:
            self._counted_at, self._count = micro, 0
        self._count += 1
        return EVAL_BASE + self._count - 1

    @contextlib.contextmanager
    def collective_call(self, what: str) -> Iterator[None]:
        """``what``, a call outside the step that gathers collectively
        (``model.state_dict()``), meets the other ranks first, as an eval
        forward does: a rank that does something else instead raises, and so
        does this one, naming both, rather than pairing gathers with it."""
        if self.watch.board is None:
            yield
            return
        position = self._next_position()
        self.step.position.eval_forward = position
        try:
            self.watch.left_trace((self.step.micro_step, position),
                                  f"called {what}, which gathers parameters and so is collective: call it on every "
                                  f"rank at the same point")
            yield
        finally:
            self.step.position.eval_forward = None

    @contextlib.contextmanager
    def lockstep(self) -> Iterator[None]:
        """Forwards inside run on every rank alike by construction: no meeting."""
        self._lockstep += 1
        try:
            yield
        finally:
            self._lockstep -= 1
