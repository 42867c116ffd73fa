"""``engine.generate``: Hugging Face ``generate`` on every rank in lockstep.

A sharded model cannot generate on one rank alone: each forward gathers its
parameters from every rank. So every rank calls ``engine.generate`` and
runs the same ``generate``: with ``rank=r``, on rank r's arguments (the
others may pass anything; they receive r's) and rank r's sampling seed, so
every rank draws the same tokens, stops at the same step and issues the
same gathers; rank r gets the tokens, the others None. That is the way to
log a sample from rank 0 mid-training without ``gathered_parameters`` or a
whole model on one device (``zero3.ranks.uneven`` refuses a forward on one rank).
Each call draws one number from every rank's torch RNG; what generate
draws runs on a forked RNG and leaves the streams as they were.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from z3kit.nested import map_tensors
from z3kit_recipes.zero3.runtime.core import EngineCore


def generate(engine: EngineCore, args: tuple[Any, ...], kwargs: dict[str, Any], rank: int | None) -> Any:
    """See the module docstring (collective)."""
    engine.check_idle("generate")
    engine.watch.check("generate")
    run = getattr(engine.module, "generate", None)
    if not callable(run):
        raise TypeError(f"{type(engine.module).__name__} has no generate(); engine.generate runs a Hugging Face model's")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < engine.world):
        raise ValueError(f"rank must be an int in [0, {engine.world}) or None, got {rank!r}")
    # one draw on every rank, so that their streams stay as far apart as they were
    seed = int(torch.randint(0, 2**62, ()))
    if engine.world > 1:
        # one rank's arguments and seed everywhere (None: rank 0's seed, each rank its own arguments)
        source = 0 if rank is None else rank
        shared: list[Any] = [map_tensors(lambda t: t.cpu(), (args, kwargs)) if rank is not None else None, seed]
        dist.broadcast_object_list(shared, group_src=source, group=engine.group)
        if rank is not None:
            args, kwargs = map_tensors(lambda t: t.to(engine.device), shared[0])
        seed = shared[1]
        if dist.get_process_group_ranks(engine.group) == list(range(dist.get_world_size())):
            kwargs.setdefault("synced_gpus", True)  # transformers' own lockstep, over the default group
    devices = [engine.device] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), engine.parts.meeting.lockstep(), \
            engine.forwards.engine_forwards():
        torch.manual_seed(seed)
        try:
            out = run(*args, **kwargs)
        finally:
            engine.coordinator.release_all()
    return out if rank is None or rank == engine.rank else None
