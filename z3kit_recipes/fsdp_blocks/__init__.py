"""fsdp_blocks: FSDP2-style sharding by the blocks you name, composed only
from ``z3kit`` primitives (see README, "Write your own runtime").

    engine = fsdp_blocks.initialize(model, lambda ps: torch.optim.AdamW(ps),
                                    blocks=list(model.layers), process_group=group)
    loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()

Modules: ``config`` (``BlocksConfig``), ``plan`` (blocks -> units, checks,
prefetch order), ``unit`` (one unit's shards, gather, reduction),
``engine`` (the hooks, backward's end, the step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from z3kit.streams import StreamPairLike
from z3kit_recipes.fsdp_blocks.config import BlocksConfig
from z3kit_recipes.fsdp_blocks.engine import BlocksEngine, OptimizerFactory
from z3kit_recipes.fsdp_blocks.plan import BlockSpec, make_plan

__all__ = ["BlocksConfig", "BlocksEngine", "initialize"]


def initialize(
    model: nn.Module,
    optimizer: OptimizerFactory,
    *,
    blocks: Sequence[BlockSpec],
    process_group: dist.ProcessGroup,
    config: BlocksConfig | None = None,
    streams: StreamPairLike | None = None,
) -> BlocksEngine:
    """Shard ``model`` by ``blocks`` over ``process_group``; ``optimizer`` gets
    this rank's fp32 shards. Every argument is checked before the model is touched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(optimizer):
        raise TypeError("optimizer must be a callable that builds an optimizer over a list of parameters")
    if process_group is None:
        raise ValueError("process_group is required: fsdp_blocks never falls back to the default group")
    config = BlocksConfig() if config is None else config
    if not isinstance(config, BlocksConfig):
        raise TypeError(f"config must be a BlocksConfig, got {type(config).__name__}")
    plan = make_plan(model, blocks)
    return BlocksEngine(model, plan, optimizer, process_group, config, streams)
