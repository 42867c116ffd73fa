"""Full parameter values out of an engine, and a rank's values into it.

``full_state_dict`` and ``adopt_full_values`` walk the model one parameter
at a time, so no rank ever holds more than one full parameter beyond what
training holds. ``gathered`` is ``engine.gathered_parameters``: the full
parameters of a module for the time of a block, and one rank's edits of
them written back into every rank's shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn

from z3kit.collectives import broadcast
from z3kit.shard import fill_partition
from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.pretrained import names_by_param, persistent_buffers, state_dict_names


def _now(gather: Callable[[], torch.Tensor]) -> torch.Tensor:
    return gather()


def full_state_dict(
    engine: EngineCore,
    *,
    rank0_only: bool = False,
    dtype: torch.dtype | None = None,
    only: Collection[int] | None = None,
    gather: Callable[[Callable[[], torch.Tensor]], torch.Tensor] = _now,
) -> dict[str, torch.Tensor]:
    """Full parameter values and persistent buffers by name, on CPU
    (collective: every rank calls it), gathered one parameter at a time:
    the names and order of a plain model's ``state_dict()`` (a module or a
    tensor registered under several names is under each of them, one tensor).

    Trainable parameters come from the fp32 master shards (in bf16 runs
    too, so a checkpoint keeps full precision); frozen ones in their
    compute dtype. With ``rank0_only`` the other ranks return ``{}`` and
    hold one parameter at a time. ``dtype`` casts the floating-point ones,
    ``only`` keeps those parameter ids (the same on every rank), and
    ``gather`` runs each gather (``Together.call``, for a watched save).
    """
    engine.check_idle("full_state_dict")
    keep = not rank0_only or engine.rank == 0
    names = names_by_param(engine.module)
    found: dict[str, torch.Tensor] = {}
    for pid, shard in enumerate(engine.shards):
        if only is not None and pid not in only:
            continue
        full = gather(lambda: engine.layout.gather_full(pid, engine.topology.shard_group, engine.log))
        if keep:  # one tensor under each of its names, as state_dict gives it
            cast = dtype if dtype is not None and full.is_floating_point() else full.dtype
            value = full.view(shard.shape).to("cpu", dtype=cast, copy=True)
            found.update(dict.fromkeys(names[id(shard.param)], value))
        del full
    if not keep:
        return {}
    buffers = persistent_buffers(engine.module)
    copies = {id(b): b.detach().to("cpu", copy=True) for b in buffers.values()}
    found.update({name: copies[id(b)] for name, b in buffers.items()})
    return {name: found[name] for name in state_dict_names(engine.module, buffers) if only is None or name in found}


def adopt_full_values(engine: EngineCore, pids: list[int], src: int) -> None:
    """Rank ``src``'s full values of ``pids`` (gathered, maybe changed there)
    into every rank's shards and masters, one parameter at a time (broadcast
    in place). The caller then reports the change (``engine.shards_changed``)."""
    master_of = {} if engine.layout.masters_are_shards else engine.layout.master_of()
    for pid in pids:
        shard = engine.shards[pid]
        full = shard.param.detach().reshape(-1)
        broadcast(full, src, engine.group, log=engine.log)  # every rank's, replicas included
        shard.load_full(full)
        master = master_of.get(pid)
        if master is not None:
            fill_partition(master.data, full, shard.rank, shard.world)


@contextlib.contextmanager
def gathered(
    engine: EngineCore, module: nn.Module | None, modifier_rank: int | None
) -> Iterator[list[nn.Parameter]]:
    """Full parameters of ``module`` (default: the whole model) inside the
    block; with ``modifier_rank``, that rank's changes to them are broadcast
    on exit and written into every rank's shards (and fp32 masters), else
    they are discarded."""
    target = engine.module if module is None else module
    if not any(target is m for m in engine.module.modules()):
        raise ValueError("gathered_parameters needs a submodule of the engine's model")
    if modifier_rank is not None and not 0 <= modifier_rank < engine.world:
        raise ValueError(f"modifier_rank must be in [0, {engine.world}), got {modifier_rank}")
    engine.check_idle("gathered_parameters")
    pids = list(dict.fromkeys(engine.coordinator.index[id(p)] for p in target.parameters()))
    # pinned for the whole block: whatever runs inside it (a forward on one
    # rank only, say) finds them gathered and needs no collective for them
    engine.coordinator.pin(pids)
    adopted = False
    try:
        yield [engine.shards[p].param for p in pids]
        if modifier_rank is not None:
            adopt_full_values(engine, pids, modifier_rank)
            adopted = True
    finally:
        engine.coordinator.unpin(pids)
    if adopted:  # after unpin: what this block gathered is freed, not gathered again
        engine.shards_changed(pids)
