"""The stock ZeRO-3 runtime: DeepSpeed ZeRO-3 behaviour from z3kit parts.

    from z3kit_recipes import zero3
    engine = zero3.initialize(model, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                              config=zero3.Zero3Config(), leaf_modules=[SparseMoeBlock])
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()

A DeepSpeed script changes its ``import deepspeed`` line to
``from z3kit_recipes.zero3 import deepspeed`` (``zero3.deepspeed``:
DeepSpeed's ``initialize`` and ``init_distributed``), and nothing else.

The errors the engine raises on every rank are importable from here too:
``RanksDisagree`` (the ranks would issue different collectives),
``RankFailed`` (a rank failed, died or stalled; a ``RanksDisagree``),
``RanksDisagreeAtInit`` (``initialize`` got different models or settings;
also a ``ValueError``), ``BackwardTwice`` and ``SaveRefused``.
"""

from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.config.deepspeed_json import DeepSpeedNote
from z3kit_recipes.zero3.config.loss_scale import LossScaleConfig
from z3kit_recipes.zero3.config.monitor import MonitorConfig
from z3kit_recipes.zero3.config.offload import OffloadConfig
from z3kit_recipes.zero3.config.training_values import TrainingValues
from z3kit_recipes.zero3.engine import Zero3Engine
from z3kit_recipes.zero3.init_agreement import RanksDisagreeAtInit
from z3kit_recipes.zero3.initialize import initialize
from z3kit_recipes.zero3.ranks.agreement import RanksDisagree
from z3kit_recipes.zero3.ranks.rank_watch import RankFailed
from z3kit_recipes.zero3.runtime.stats import Zero3Stats
from z3kit_recipes.zero3.training.backward_once import BackwardTwice, EngineBackwardRequired
from z3kit_recipes.zero3.training.loss_scale import LossScaleAtMinimum
from z3kit_recipes.zero3.training.trainable import MasterShards
from z3kit_recipes.zero3.weights.target import SaveRefused

__all__ = [
    "BackwardTwice",
    "DeepSpeedNote",
    "EngineBackwardRequired",
    "LossScaleAtMinimum",
    "LossScaleConfig",
    "MasterShards",
    "MonitorConfig",
    "OffloadConfig",
    "RankFailed",
    "RanksDisagree",
    "RanksDisagreeAtInit",
    "SaveRefused",
    "TrainingValues",
    "Zero3Config",
    "Zero3Engine",
    "Zero3Stats",
    "initialize",
]
