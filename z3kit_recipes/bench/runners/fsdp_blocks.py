"""z3kit's second runtime (``z3kit_recipes.fsdp_blocks``): sharded by the
workload's blocks, as FSDP2 is here, with the static prefetch plan."""

from __future__ import annotations

import torch
import torch.distributed as dist

from z3kit_recipes import fsdp_blocks
from z3kit_recipes.bench.runners import CompileSpec, OptimizerFn, adam, engine_step
from z3kit_recipes.bench.spec import JSON
from z3kit_recipes.models import Workload


class FsdpBlocksRunner:
    peak_method = "not measured (fsdp_blocks keeps no high-water of gathered elements)"

    def __init__(
        self, wl: Workload, group: dist.ProcessGroup, *, compiled: CompileSpec | None = None,
        optimizer: OptimizerFn = adam,
    ) -> None:
        self.wl = wl
        model = wl.build_model()
        self.total_params = sum(p.numel() for p in model.parameters())
        self.engine = fsdp_blocks.initialize(model, optimizer, blocks=wl.blocks(model), process_group=group)
        #: units the engine hooks: one per block and the root's
        self.units = len(self.engine.units)
        if compiled is not None:  # after sharding, as FSDP2 is compiled after fully_shard
            compiled.apply(wl, model)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.engine.log.reset()  # engine_collectives: the last step's
        return engine_step(self.engine, self.wl, x, y)

    def synchronize(self) -> None:
        self.engine.synchronize()

    def start_probe(self) -> None:
        pass

    def stop_probe(self) -> None:
        pass

    def peak_live_params(self) -> int | None:
        return None

    def engine_report(self) -> JSON | None:
        return None

    def engine_collectives(self) -> dict[str, int] | None:
        return {kind.value: n for kind, n in self.engine.log.calls.items() if n}
