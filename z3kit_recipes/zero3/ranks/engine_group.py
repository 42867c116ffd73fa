"""The group an engine runs its collectives on: its own, over the ranks it was given.

Note: one per group given, made again after a failure.
    After a rank fails, the engine's group holds collectives that will never
    pair; the group the user passed (or the default group) does not, so the
    user's own collectives (a metrics all-reduce in an ``except``) still
    pair. So ``initialize`` runs every engine on a group made over the same
    ranks, with the same backend and timeout. Engines made on one group
    share the one made for it (as they shared the user's group before): a
    process that builds engine after engine (an actor and a reference
    model, a benchmark's cases) would otherwise hold a communicator and its
    threads per engine, since a group cannot be safely destroyed (a later
    group over the same ranks would take its name and meet its stale
    rendezvous keys). Once an engine on it is broken (``RankWatch``
    ``spend``s it), the ranks agree, over the group given, that the next
    engine gets a new one.
"""

from __future__ import annotations

import torch.distributed as dist

from z3kit.collectives import ProcessGroup
from z3kit.process_group import timeout_of

#: the group made for each group given, and those an engine broke on (see the Note)
_made: dict[ProcessGroup, ProcessGroup] = {}
_spent: set[ProcessGroup] = set()


def engine_group(given: ProcessGroup) -> ProcessGroup:
    """The engine's group over ``given``'s ranks (collective: every rank of ``given`` calls it)."""
    made = _made.get(given)
    spent = made is None
    if made is not None and dist.get_world_size(given) > 1:
        # every rank has made engines on ``given`` alike; whether one broke it, they agree here
        everyone: list[object] = [None] * dist.get_world_size(given)
        dist.all_gather_object(everyone, made in _spent, group=given)
        spent = any(bool(s) for s in everyone)
    elif made is not None:
        spent = made in _spent
    if made is None or spent:
        made = dist.new_group(ranks=dist.get_process_group_ranks(given), backend=str(dist.get_backend(given)),
                              timeout=timeout_of(given), use_local_synchronization=True)
        if not isinstance(made, dist.ProcessGroup):  # a member of the ranks always gets the group
            raise RuntimeError(f"torch.distributed.new_group gave {made!r} to a member of its ranks")
        _made[given] = made
    return made


def spend(group: ProcessGroup) -> None:
    """An engine on ``group`` is broken: the next engine over its ranks gets a new group."""
    _spent.add(group)
