"""The stock ZeRO-3 runtime: DeepSpeed ZeRO-3 behaviour from z3kit parts.

    from z3kit_recipes import zero3
    engine = zero3.initialize(model, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                              config=zero3.Zero3Config(), leaf_modules=[SparseMoeBlock])
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
"""

from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.config.deepspeed_json import DeepSpeedNote
from z3kit_recipes.zero3.config.training_values import TrainingValues
from z3kit_recipes.zero3.engine import Zero3Engine
from z3kit_recipes.zero3.initialize import initialize
from z3kit_recipes.zero3.runtime.stats import Zero3Stats
from z3kit_recipes.zero3.training.trainable import MasterShards

__all__ = ["DeepSpeedNote", "MasterShards", "TrainingValues", "Zero3Config", "Zero3Engine", "Zero3Stats", "initialize"]
