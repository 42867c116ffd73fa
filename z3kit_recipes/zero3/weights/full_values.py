"""Full parameter values out of an engine, and a rank's values into it.

Both walk the model one parameter at a time, so no rank ever holds more than
one full parameter beyond what training holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from z3kit.collectives import broadcast
from z3kit.shard import fill_partition
from z3kit_recipes.zero3.weights.pretrained import persistent_buffers

if TYPE_CHECKING:
    from z3kit_recipes.zero3.runtime.core import Zero3Engine


def full_state_dict(engine: Zero3Engine, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full parameter values and persistent buffers by name, on CPU
    (collective: every rank calls it), gathered one parameter at a time.

    Trainable parameters come from the fp32 master shards (in bf16 runs
    too, so a checkpoint keeps full precision); frozen ones in their
    compute dtype. With ``rank0_only`` the other ranks return ``{}`` and
    hold one parameter at a time.
    """
    engine.check_idle("full_state_dict")
    keep = not rank0_only or engine.rank == 0
    out: dict[str, torch.Tensor] = {}
    for pid, name in enumerate(engine.param_names):
        full = engine.layout.gather_full(pid, engine.group, engine.log)
        if keep:
            out[name] = full.view(engine.shards[pid].shape).to("cpu", copy=True)
    if keep:
        out.update({name: b.detach().to("cpu", copy=True) for name, b in persistent_buffers(engine.module).items()})
    return out


def adopt_full_values(engine: Zero3Engine, pids: list[int], src: int) -> None:
    """Rank ``src``'s full values of ``pids`` (gathered, maybe changed there)
    into every rank's shards and masters, one parameter at a time (broadcast
    in place: the gathered copies are dropped right after)."""
    master_of = {} if engine.layout.masters_are_shards else engine.layout.master_of()
    for pid in pids:
        shard = engine.shards[pid]
        full = shard.param.detach().reshape(-1)
        broadcast(full, src, engine.group, log=engine.log)
        shard.load_full(full)
        master = master_of.get(pid)
        if master is not None:
            fill_partition(master.data, full, engine.rank, engine.world)
    engine.coordinator.discard(p for p in pids if engine.coordinator.persistent[p])
