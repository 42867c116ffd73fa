"""Parameters a zero3 engine has sharded carry a mark.

Between uses a sharded parameter holds only this rank's shard; its values
live in the engine's shards. A second ``initialize`` of the same model (a
notebook cell run again, a retry after unpacking the result as DeepSpeed's
tuple) would build a second engine over the first one's parameters. The mark lets ``initialize`` refuse it first, naming the parameter
and what to do.
"""

from __future__ import annotations

from torch import nn

from z3kit.sharded_param import parameter_of

#: the attribute set on each sharded parameter (as DeepSpeed sets ``ds_id`` and its kin)
MARK = "z3kit_sharded"


def mark_sharded(model: nn.Module) -> None:
    """Mark each parameter in both its forms: sharded between uses, gathered while a module runs."""
    for p in model.parameters():
        setattr(p, MARK, True)
        setattr(parameter_of(p), MARK, True)


def check_not_sharded(model: nn.Module) -> None:
    """Refuse a model that an earlier ``initialize`` sharded."""
    for name, p in model.named_parameters():
        if getattr(p, MARK, False):
            raise ValueError(
                f"parameter {name!r} of {type(model).__name__} was sharded by an earlier zero3.initialize: its values "
                "live in that engine's shards. Keep training with the engine that call returned (engine = zero3.initialize(...)), or build the "
                "model again (or load its weights into a new one) and initialize that; a copy.deepcopy(model) of it "
                "can be initialized")
