"""``engine.join()``: ranks with different numbers of batches, in the manner
of ``torch.distributed.algorithms.Join``.

Note: rounds and shadows.
    Inside ``with engine.join():`` every forward of the model
    (``engine(x)`` or ``model(x)``: the root's pre-forward hook runs the
    round, see ``zero3.runtime.root_hooks``) starts with a round: one small
    all-gather in which each rank says whether it is still running its own
    batches and, if so, whether this forward is a training one (grad
    enabled, train mode) or an eval one. A rank whose
    loop has ended reaches the end of the block and shadows the others: it
    joins each round as finished and, while any rank is still running,
    repeats its own last forward of the kind the others run (its own last
    batch, inside the block or before it; nothing is changed on it), so
    that it issues the same gathers:

    * an eval forward is repeated under ``no_grad``;
    * a training forward is repeated with a zero loss, then ``backward`` and
      ``step``: the finished rank reduces zero gradients, and takes part in
      every optimizer step, so the shards stay one model.

    The block ends on every rank at the first round in which no rank runs.
    Gradients are averaged over every rank, the finished ones contributing
    zeros, as DDP's ``Join`` does by default (``divide_by_initial_world_size``).

    What has to hold: the repeated forward gathers what the others' does
    (the same modules, in the same order: true of a model without
    data-dependent control flow), one forward per backward, and the ranks
    still running agree on the kind of each forward. A finished rank that
    never ran a forward of the kind needed cannot shadow it; every rank then
    raises, naming it. The rounds are collectives that the host waits for:
    the price of the feature, paid only inside the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from z3kit.collectives import all_gather
from z3kit.nested import iter_tensors
from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.runtime.root_hooks import Arguments

EVAL, TRAIN = 0, 1
_KIND = {EVAL: "an eval (or no_grad) forward", TRAIN: "a training forward"}


@contextlib.contextmanager
def joined(engine: EngineCore) -> Iterator[None]:
    """``engine.join()``: the block's rounds, and its shadowing at the end (see the Note)."""
    forwards = engine.forwards
    if forwards.join is not None:
        raise RuntimeError("engine.join() blocks do not nest")
    join = forwards.join = Join(engine, forwards.last)
    try:
        with engine.parts.meeting.lockstep():  # the rounds keep the ranks' forwards together
            yield
            join.shadow()
    finally:
        forwards.join = None


class JoinRefused(RuntimeError):
    """The ranks cannot go on together inside ``engine.join()``; raised on every rank."""


class Join:
    """The rounds of one ``engine.join()`` block (see the Note)."""

    def __init__(self, engine: EngineCore, last: dict[bool, Arguments]) -> None:
        self.engine = engine
        #: this rank's last forward of each kind (training or not), kept by the engine: what a shadow repeats
        self._last = last
        self._shadowing = False

    def before_forward(self, training: bool) -> None:
        """A forward of this rank's own (not a repeat): a round, running."""
        if not self._shadowing:
            self._round(running=True, kind=TRAIN if training else EVAL)

    def shadow(self) -> None:
        """This rank's loop has ended: repeat the others' forwards until none runs."""
        while True:
            kind = self._round(running=False, kind=EVAL)
            if kind is None:
                return
            self._shadowing = True
            try:
                self._repeat(kind)
            finally:
                self._shadowing = False

    def _round(self, *, running: bool, kind: int) -> int | None:
        """One round (collective): the kind the running ranks run, None when none runs."""
        engine = self.engine
        if engine.world == 1:
            return kind if running else None
        group = engine.parts.backward.agreement.group
        mine = torch.tensor([int(running), kind, int(True in self._last), int(False in self._last)],
                            dtype=torch.int64, device=engine.device)
        everyone = mine.new_empty(engine.world * mine.numel())
        pending = all_gather(everyone, mine, group, async_op=True, log=engine.log)
        engine.watch.wait(pending.is_completed, pending.wait)
        rows = everyone.view(engine.world, -1).tolist()
        kinds = {k for run, k, _, _ in rows if run}
        if not kinds:
            return None
        if len(kinds) > 1:
            doing = "; ".join(f"rank {r} {_KIND[k]}" for r, (run, k, _, _) in enumerate(rows) if run)
            raise JoinRefused(f"inside engine.join() the ranks still running disagree on the kind of forward: {doing}; "
                              "every rank must run the same kind of forward at the same point")
        kind = kinds.pop()
        unable = [r for r, (run, _, has_train, has_eval) in enumerate(rows)
                  if not run and not (has_train if kind == TRAIN else has_eval)]
        if unable:
            raise JoinRefused(
                f"rank(s) {unable} finished their batches inside engine.join() and never ran {_KIND[kind]}, so "
                "they cannot repeat one while the others run it; give every rank at least one batch of each kind "
                "it will have to follow")
        return kind

    def _repeat(self, kind: int) -> None:
        engine = self.engine
        args, kwargs = self._last[kind == TRAIN]
        if kind == EVAL:
            with torch.no_grad():
                engine(*args, **kwargs)
            return
        was_training = engine.module.training
        engine.module.train()
        try:
            with torch.enable_grad():
                out = engine(*args, **kwargs)
        finally:
            engine.module.train(was_training)
        losses = [t.float().sum() * 0.0 for t in iter_tensors(out) if t.requires_grad and t.is_floating_point()]
        if not losses:
            raise JoinRefused("a repeated training forward returned no tensor that requires grad: nothing to "
                              "run a backward from")
        engine.backward(torch.stack(losses).sum())
        engine.step()
