"""Rank-divergent graphs (``Zero3Config(divergent_graphs=True)``): every
fetch is a round in which the ranks gather the union of what any needs.

Note: why rounds.
    The stock runtime needs every rank to run the same modules in the same
    order: gathers pair by order. A data-dependent early exit, or a
    per-expert ``nn.Module`` MoE whose experts run on some ranks only, breaks
    that, and is refused (``RanksDisagree``) unless the subtree is a leaf
    unit. In this mode every fetch that needs a gather is a round: one small
    all-gather in which each rank says which parameters it needs now (or
    that it has none left to fetch), then one gather of the union, in
    parameter order, the same on every rank. A rank installs what it asked
    for and only contributes its shards to the rest. Rounds pair by order,
    whatever each rank's fetch was, so the ranks' graphs may differ freely;
    at the end of every backward and of every eval forward, a rank keeps
    joining rounds as finished until every rank is (``finish``), so each of
    those ends where every rank is.

    What it costs: a collective that the host waits for before every gather
    (no prefetch: the trace of one rank says nothing of the others'), and
    gradient reductions that are never waited for during backward (a rank
    waiting on a reduction that another rank issues only after a later
    round would never get there). Gradients follow the fixed reduction plan
    with zeros where a rank has none, and the optimizer skips parameters no
    rank used, as DDP does with ``find_unused_parameters=True``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from z3kit.collectives import CollectiveLog, ProcessGroup, all_gather
from z3kit.shard import ParamStatus
from z3kit_recipes.zero3.ranks.agreement import Waiter
from z3kit_recipes.zero3.training.gathers import Gatherer


class FetchRounds:
    """The rounds of one engine (see the Note)."""

    def __init__(self, gatherer: Gatherer, group: ProcessGroup, device: torch.device, waiter: Waiter,
                 log: CollectiveLog) -> None:
        self.gatherer, self.group, self.device, self.waiter, self.log = gatherer, group, device, waiter, log
        self.world = dist.get_world_size(group)
        self._n = len(gatherer.shards)
        #: rounds run, and seconds spent agreeing in them
        self.rounds = 0
        self.seconds = 0.0

    def fetch(self, pids: list[int]) -> None:
        """Make ``pids`` available here: a round when any needs a gather."""
        shards = self.gatherer.shards
        need = [p for p in pids if shards[p].status is ParamStatus.NOT_AVAILABLE]
        self.gatherer.ensure_gathered(p for p in pids if shards[p].status is ParamStatus.INFLIGHT)
        if need:
            self._round(need)

    def finish(self) -> None:
        """This rank has nothing left to fetch: join rounds until every rank is so."""
        while not self._round(None):
            pass

    def _round(self, need: list[int] | None) -> bool:
        """One round (collective): ``need`` (None: finished) gathered; True when every rank is finished."""
        if self.world == 1:
            if need:
                self.gatherer.gather_union(need, set(need))
            return True
        started = time.perf_counter()
        mine = torch.zeros(self._n + 1, dtype=torch.uint8)
        if need is None:
            mine[self._n] = 1
        else:
            mine[need] = 1
        mine = mine.to(self.device)
        everyone = mine.new_empty(self.world * mine.numel())
        pending = all_gather(everyone, mine, self.group, async_op=True, log=self.log)
        self.waiter(pending.is_completed, pending.wait)
        rows = everyone.view(self.world, -1).cpu()
        self.rounds += 1
        self.seconds += time.perf_counter() - started
        union: list[int] = rows[:, : self._n].amax(dim=0).nonzero().flatten().tolist()
        if union:
            self.gatherer.gather_union(union, set(need or ()))
        return bool(rows[:, self._n].amin())
