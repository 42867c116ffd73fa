"""z3kit's stock ZeRO-3 runtime (``z3kit_recipes.zero3``), with the shared
knobs or with a memory budget that derives them."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from z3kit.sharded_muon import ShardedMuon
from z3kit_recipes.bench.runners import CompileSpec, adam, engine_step
from z3kit_recipes.bench.spec import JSON, LR, MUON_LR
from z3kit_recipes.models import Workload
from z3kit_recipes.zero3 import Zero3Config, Zero3Stats, initialize
from z3kit_recipes.zero3.config.config import BUDGET_DERIVED
from z3kit_recipes.zero3.training.trainable import MasterShards, OptimizerFactory
from z3kit_recipes.zero3.training.unit_rule import UnitRule


def shared_config(zero: JSON) -> Zero3Config:
    """The shared ``zero_optimization`` section, as DeepSpeed gets it, and no
    clipping, as the DeepSpeed runner writes (a JSON without ``gradient_clipping``
    clips at DeepSpeed's default, 1.0)."""
    return Zero3Config.from_deepspeed({"zero_optimization": zero, "gradient_clipping": 0.0})


def budget_config(zero: JSON, budget: int | float) -> Zero3Config:
    """The shared section with ``memory_budget=budget`` in place of the knobs it derives.

    The derived knobs go back to their defaults (the config refuses a budget
    next to a knob set by hand); everything else (persistence threshold,
    overlap, ...) stays as shared.
    """
    defaults: dict[str, Any] = {f.name: f.default for f in attrs.fields(Zero3Config) if f.name in BUDGET_DERIVED}
    return attrs.evolve(shared_config(zero), memory_budget=budget, **defaults)


def hidden_matrix(name: str, shape: torch.Size) -> bool:
    """Muon's usual share of a transformer: its 2-D weights but the embeddings and the head."""
    return len(shape) == 2 and "emb" not in name and "head" not in name


def muon_and_adam(params: MasterShards) -> torch.optim.Optimizer:
    """z3kit-muon's optimizer: Muon on the hidden matrices, the bench's Adam (no weight decay) on the rest."""
    named = params.named()
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if hidden_matrix(n, params.full_shape(p))]},
        {"params": [p for n, p in named if not hidden_matrix(n, params.full_shape(p))], "use_muon": False,
         "lr": LR, "weight_decay": 0.0},
    ]
    return ShardedMuon(groups, params, lr=MUON_LR)


class Z3kitRunner:
    peak_method = "z3kit engine.stats().peak_live_numel"

    def __init__(
        self, wl: Workload, group: dist.ProcessGroup, config: Zero3Config, *, compiled: CompileSpec | None = None,
        optimizer: OptimizerFactory = adam, leaf_blocks: bool = False, fetch_units: UnitRule = "auto",
    ) -> None:
        self.wl = wl
        model = wl.build_model()
        self.total_params = sum(p.numel() for p in model.parameters())
        if compiled is not None:  # before initialize: each compiled block becomes one fetch unit
            compiled.apply(wl, model)
        # leaf_blocks: the workload's blocks as leaf modules (one unit each, one reduction per block)
        leaves = wl.blocks(model) if leaf_blocks else ()
        self.engine = initialize(
            model, optimizer=optimizer, config=config, process_group=group, leaf_modules=leaves, fetch_units=fetch_units
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return engine_step(self.engine, self.wl, x, y)

    def synchronize(self) -> None:
        self.engine.synchronize()

    def start_probe(self) -> None:
        pass  # the engine keeps its own high-water of gathered elements

    def stop_probe(self) -> None:
        pass

    def peak_live_params(self) -> int | None:
        return self.engine.stats().peak_live_numel

    def engine_report(self) -> JSON | None:
        return stats_report(self.engine.stats(), self.engine.zero3_config)

    def engine_collectives(self) -> dict[str, int] | None:
        return {kind: c["calls"] for kind, c in self.engine.stats().collectives.items() if c["calls"]}


def stats_report(stats: Zero3Stats, config: Zero3Config) -> JSON:
    """The figures of ``engine.stats()`` the report keeps, as JSON."""
    memory = stats.memory
    plan = stats.memory_plan
    return {
        "config": attrs.asdict(config),
        "model_numel": stats.model_numel,
        "peak_live_numel": stats.peak_live_numel,
        "max_live_parameters": stats.max_live_parameters,
        "largest_fetch_numel": stats.largest_fetch_numel,
        "collectives": stats.collectives,
        "comm_wait_s": stats.comm_wait_s,
        "rank_check_s": stats.rank_check_s,
        "step_time_s": stats.step_time_s,
        "memory": {
            "current_bytes": dict(memory.current),
            "peak_bytes": dict(memory.peak),
            "current_total_bytes": memory.current_total,
            "peak_total_bytes": memory.peak_total,
            "device_peak_bytes": memory.device_peak,
        },
        "memory_plan": None if plan is None else {
            **attrs.asdict(plan),
            "knobs": plan.knobs(),
            "describe": plan.describe(),
        },
        "compile": None if stats.compile is None else attrs.asdict(stats.compile),
        "muon": None if stats.muon is None else attrs.asdict(stats.muon),
    }
