"""Parameters frozen and unfrozen after initialize (staged fine-tuning).

Note: what follows ``requires_grad``.
    Freezing needs nothing: a frozen parameter gets no gradient on any
    rank, so the optimizer gets None for it and skips it, as it does under
    DDP (``find_unused_parameters=True``) with ``zero_grad()``; its slot in
    the reduction plan is reduced as zeros, and it trains again as soon as
    it is unfrozen.

    Unfreezing a parameter that was frozen at initialize needs what
    initialize gives trainable ones only: a master shard, a place in the
    optimizer, a gradient slot and a grad-ready hook. ``TrainableWatch``
    adds them at the first training forward of an accumulation window after
    the change, before anything is gathered:

    * its master starts from its shard's values (widened to fp32 when the
      compute dtype is narrower; a frozen parameter has no fp32 master);
    * it joins the optimizer's parameter group that the user's factory puts
      it in, asked again with every master, so that an LR scheduler that
      follows that group follows it too (a factory that makes a different
      number of groups gets a new group with the factory's settings);
    * the reduction plan is made again (``GradReducer.replan``).

    Every rank must make the same change: a rank that does posts it on the
    notice board and waits for the others to post the same
    (``RankWatch.left_trace``); a rank that did not change raises when it
    next waits, and so does the one that did. Refused, on every rank, with
    nothing changed: unfreezing in the middle of an accumulation window
    (the window's gradients would be partial), and unfreezing in an
    inference-only engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from z3kit.collectives import ProcessGroup
from z3kit.memory import MemoryLedger
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch
from z3kit_recipes.zero3.training.backward import BackwardPass
from z3kit_recipes.zero3.training.grads import GradReducer
from z3kit_recipes.zero3.training.layout import ShardLayout


class MasterShards(list[nn.Parameter]):
    """What an optimizer factory gets: this rank's fp32 master shards, a list
    as before, that also knows which parameter each shard is of.

    A shard is flat and 1-D whatever its parameter's shape, so rules written
    for the model's parameters (``"bias" in name``, ``p.ndim < 2``) need the
    parameter's name and shape: ``named()`` gives ``(name, shard)`` pairs and
    ``full_shape(shard)`` the parameter's own shape::

        lambda params: torch.optim.AdamW([
            {"params": [p for n, p in params.named() if len(params.full_shape(p)) >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in params.named() if len(params.full_shape(p)) < 2], "weight_decay": 0.0},
        ], lr=1e-3)

    ``group`` is the process group the shards are cut over (rank ``r`` of it
    holds slice ``r``): a matrix optimizer (``z3kit.sharded_muon``) gathers
    over it; ``MasterShards`` is a ``z3kit.matrix_owners.ShardedParams``.
    """

    def __init__(
        self, masters: Sequence[nn.Parameter], names: Sequence[str], shapes: Sequence[torch.Size],
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(masters)
        # side tables by identity: a shard's name and shape are not attributes of the tensor
        self._names = {id(m): n for m, n in zip(masters, names)}
        self._shapes = {id(m): s for m, s in zip(masters, shapes)}
        self._group = group

    @classmethod
    def of(
        cls, layout: ShardLayout, names: Sequence[str], by_pid: Mapping[int, nn.Parameter], group: ProcessGroup | None,
    ) -> MasterShards:
        """The masters of ``by_pid`` (parameter id -> master shard), in parameter order, cut over ``group``."""
        pids = sorted(by_pid)
        return cls([by_pid[p] for p in pids], [names[p] for p in pids], [layout.shards[p].shape for p in pids], group)

    @property
    def group(self) -> ProcessGroup:
        """The process group the shards are cut over."""
        if self._group is None:
            raise RuntimeError("these master shards were made without their process group")
        return self._group

    def name_of(self, shard: torch.Tensor) -> str:
        """The name in the model of the parameter that ``shard`` is a slice of."""
        name = self._names.get(id(shard))
        if name is None:
            raise KeyError("name_of() takes one of the master shards the factory was given")
        return name

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """``(name in the model, master shard)`` for every shard, in order."""
        return [(self._names[id(m)], m) for m in self]

    def full_shape(self, shard: torch.Tensor) -> torch.Size:
        """The shape of the parameter that ``shard`` is a slice of."""
        shape = self._shapes.get(id(shard))
        if shape is None:
            raise KeyError("full_shape() takes one of the master shards the factory was given")
        return shape


#: builds the optimizer on this rank's master shards; a factory written for a plain
#: list of parameters keeps working (``MasterShards`` is one)
OptimizerFactory = Callable[[MasterShards], torch.optim.Optimizer]


class TrainableWatch:
    """Follows ``requires_grad`` on the model's parameters (see the Note)."""

    def __init__(
        self,
        layout: ShardLayout,
        names: Sequence[str],
        *,
        optimizer: torch.optim.Optimizer | None,
        factory: OptimizerFactory | None,
        reducer: GradReducer | None,
        backward: BackwardPass,
        watch: RankWatch,
        memory: MemoryLedger,
        micro_step: Callable[[], int],
        settle: Callable[[], None],
        group: ProcessGroup | None = None,
    ) -> None:
        self.layout, self.names, self.group = layout, names, group
        self.optimizer, self.factory, self.reducer, self.backward = optimizer, factory, reducer, backward
        self.watch, self.memory, self.micro_step = watch, memory, micro_step
        #: waits for an optimizer step still running (``zero3.training.offload``) before the optimizer changes
        self.settle = settle
        self._params = [shard.param for shard in layout.shards]
        self._seen = self._flags()

    def _flags(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self._params)

    def follow(self) -> None:
        """At a training forward: apply unfreezing since the last one (cheap when nothing changed)."""
        flags = self._flags()
        if flags == self._seen:
            return
        planned = self.layout.master_of()
        unfrozen = [pid for pid, on in enumerate(flags) if on and pid not in planned]
        if unfrozen:
            self._unfreeze(unfrozen)
        self._seen = flags

    def _unfreeze(self, pids: list[int]) -> None:
        names = [self.names[pid] for pid in pids]
        shown = f"{names[:4]}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        if self.optimizer is None or self.factory is None or self.reducer is None:
            raise RuntimeError(
                f"parameters {shown} were unfrozen (requires_grad=True), but this engine was initialized without an "
                "optimizer: it trains nothing. Initialize with an optimizer factory to train them"
            )
        if self.reducer.window_open:
            raise RuntimeError(
                f"parameters {shown} were unfrozen in the middle of a gradient-accumulation window; change "
                "requires_grad between optimizer steps (after engine.step() returned True, or after zero_grad())"
            )
        self.settle()
        digest = hashlib.blake2b(repr(names).encode(), digest_size=6).hexdigest()
        self.watch.left_trace((self.micro_step(), -1), f"unfroze {len(pids)} parameter(s) (names hash {digest})")
        masters = self.layout.new_masters(pids)
        everyone = dict(self.layout.master_of())
        everyone.update(zip(pids, masters))
        groups = _groups_for(self.factory, MasterShards.of(self.layout, self.names, everyone, self.group), masters,
                             len(self.optimizer.param_groups))
        # nothing has changed yet: from here on every step is applied
        self.layout.add_trainable(pids, masters)
        _join(self.optimizer, groups)
        self.reducer.replan(self.layout.trainable)
        self.backward.watch_gradients(pids)
        self.layout.count_masters(self.memory)


def _groups_for(
    factory: OptimizerFactory, masters: MasterShards, new: Sequence[nn.Parameter], groups_now: int
) -> list[tuple[int | None, dict[str, object], list[nn.Parameter]]]:
    """Where the factory puts each of ``new`` when given every master:
    (index of the optimizer's group, or None for a new one when the factory
    makes another number of groups than the optimizer has; the factory's
    settings for it; the new masters in it)."""
    probe = factory(masters)
    group_of = {id(p): g for g, group in enumerate(probe.param_groups) for p in group["params"]}
    left_out = [i for i, m in enumerate(new) if id(m) not in group_of]
    if left_out:
        raise RuntimeError("the optimizer factory leaves out parameters that were unfrozen; it must take every master it is given")
    out: list[tuple[int | None, dict[str, object], list[nn.Parameter]]] = []
    for g, group in enumerate(probe.param_groups):
        mine = [m for m in new if group_of[id(m)] == g]
        if mine:
            out.append((g if len(probe.param_groups) == groups_now else None,
                        {k: v for k, v in group.items() if k != "params"}, mine))
    return out


def _join(optimizer: torch.optim.Optimizer, groups: list[tuple[int | None, dict[str, object], list[nn.Parameter]]]) -> None:
    """Put the new masters into ``optimizer`` (see ``_groups_for``)."""
    for g, settings, masters in groups:
        if g is not None:
            optimizer.param_groups[g]["params"].extend(masters)
        else:
            optimizer.add_param_group({**settings, "params": masters})
