"""``LossScaleConfig``: fp16 loss scaling, with DeepSpeed's names and defaults.

The fields are DeepSpeed's ``fp16`` section (``runtime/config.py``,
``runtime/fp16/loss_scaler.py``): ``loss_scale`` 0 means dynamic scaling,
any other value a static scale; a dynamic scale starts at
``2 ** initial_scale_power``, is halved after ``hysteresis`` overflowing
steps (never below ``min_loss_scale``) and doubled after
``loss_scale_window`` steps without an overflow. They matter only under
``Zero3Config(compute_dtype="fp16")``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from z3kit.validate import int_validator, number_validator

#: DeepSpeed's ``fp16`` keys and the field each one sets
FP16_JSON_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


@attrs.frozen(kw_only=True)
class LossScaleConfig:
    """How the loss is scaled in fp16 runs (see the module docstring)."""

    #: 0: dynamic loss scaling; else the static scale every loss is multiplied by
    loss_scale: float = attrs.field(default=0.0, validator=number_validator(at_least=0.0))
    #: a dynamic scale starts at 2 ** initial_scale_power
    initial_scale_power: int = attrs.field(default=16, validator=int_validator(at_least=0))
    #: optimizer steps without an overflow after which a dynamic scale doubles
    loss_scale_window: int = attrs.field(default=1000, validator=int_validator(at_least=1))
    #: overflowing steps (in a row since the last growth) before a dynamic scale is halved
    hysteresis: int = attrs.field(default=2, validator=int_validator(at_least=1))
    #: the floor of a dynamic scale
    min_loss_scale: float = attrs.field(default=1.0, validator=number_validator(above=0.0))

    def __attrs_post_init__(self) -> None:
        if self.dynamic and 2.0**self.initial_scale_power < self.min_loss_scale:
            raise ValueError(
                f"LossScaleConfig: the initial scale 2 ** {self.initial_scale_power} is below min_loss_scale "
                f"{self.min_loss_scale}; raise initial_scale_power or lower min_loss_scale")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        return 2.0**self.initial_scale_power if self.dynamic else float(self.loss_scale)

    @classmethod
    def from_json(cls, section: Mapping[str, Any]) -> LossScaleConfig:
        """From a DeepSpeed ``fp16`` section (its ``enabled`` key is the caller's)."""
        return cls(**{k: section[k] for k in FP16_JSON_KEYS if k in section})
