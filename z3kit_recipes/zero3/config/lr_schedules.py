"""DeepSpeed's warmup schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``)
as a torch ``LRScheduler``, for a DeepSpeed JSON's ``scheduler`` section.

The values are DeepSpeed's (``deepspeed/runtime/lr_schedules.py``): the
same defaults, the same curves, the same first steps. The engine steps the
scheduler once per optimizer step, after it, as DeepSpeed's engine does.

Note: counting steps.
    DeepSpeed's schedules count ``last_batch_iteration`` from -1: built, they
    set the learning rate of iteration -1 (``warmup_min_lr``; 0 for the
    cosine schedule), which the first optimizer step uses; each scheduler
    step then moves one iteration on. A torch ``LRScheduler`` counts
    ``last_epoch`` from 0 at construction, so iteration ``i`` is
    ``last_epoch - 1`` here: the first optimizer steps see the same
    learning rates as under DeepSpeed (with the log warmup, ``warmup_min_lr``
    twice, as ``log(0 + 1) = 0``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs
import torch
from torch.optim.lr_scheduler import LRScheduler

from z3kit.validate import check_int, check_number

#: the scheduler types of a DeepSpeed JSON that z3kit runs
SCHEDULES: Final = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
#: each type's parameters and DeepSpeed's default for each (None: required, or the optimizer's lr)
_PARAMS: Final[dict[str, dict[str, Any]]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
}
_WARMUP_TYPES: Final = ("log", "linear")


@attrs.frozen(kw_only=True)
class WarmupSchedule:
    """One of DeepSpeed's warmup schedules, as its JSON section gives it (DeepSpeed's defaults filled in)."""

    type: str = attrs.field(validator=attrs.validators.in_(SCHEDULES))
    warmup_num_steps: int = 1000
    warmup_type: str = attrs.field(default="log", validator=attrs.validators.in_(_WARMUP_TYPES))
    warmup_min_lr: float = 0.0
    #: None: the optimizer's lr (``WarmupLR`` only)
    warmup_max_lr: float | None = None
    total_num_steps: int | None = None
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 0.0001

    @classmethod
    def from_json(cls, type_: Any, params: Mapping[str, Any]) -> WarmupSchedule:
        """The ``scheduler`` section's ``type`` and ``params`` (``"auto"`` already
        filled); unknown types and parameters are refused by name."""
        if type_ not in SCHEDULES:
            raise ValueError(f"scheduler.type {type_!r} is not supported; z3kit runs {', '.join(SCHEDULES)}")
        known = _PARAMS[type_]
        unknown = sorted(k for k in params if k not in known)
        if unknown:
            raise ValueError(f"unsupported {type_} parameters: {', '.join(f'scheduler.params.{k}' for k in unknown)}; "
                             f"{type_} takes {', '.join(known)}")
        values = {**known, **params}
        if type_ != "WarmupLR" and values["total_num_steps"] is None:
            raise ValueError(f"{type_} needs scheduler.params.total_num_steps")
        kwargs: dict[str, Any] = {"type": type_}
        for key, value in values.items():
            name = f"scheduler.params.{key}"
            if key in ("warmup_num_steps", "total_num_steps"):
                # JSON writes 1e3 as a float: a whole one is the int it means
                value = int(value) if isinstance(value, float) and value.is_integer() else value
                kwargs[key] = None if value is None else check_int(name, value, at_least=1)
            elif key == "warmup_type":
                if value not in _WARMUP_TYPES:
                    raise ValueError(f"{name} must be one of {', '.join(_WARMUP_TYPES)}, got {value!r}")
                kwargs[key] = value
            else:
                kwargs[key] = None if value is None else float(check_number(name, value, at_least=0.0))
        return cls(**kwargs)

    def lr_at(self, iteration: int, base_lr: float) -> float:
        """The learning rate at DeepSpeed's ``last_batch_iteration`` ``iteration``
        (-1 before the first scheduler step) for a group whose own lr is ``base_lr``."""
        warmup = max(2, self.warmup_num_steps)  # DeepSpeed's floor: log(1) would divide by zero
        if self.type == "WarmupCosineLR":
            return base_lr * self._cosine_ratio(iteration, warmup)
        low = self.warmup_min_lr
        high = base_lr if self.warmup_max_lr is None else self.warmup_max_lr
        if iteration < 0:
            return low
        if iteration < warmup:
            gamma = self._warming(iteration, warmup)
        elif self.type == "WarmupDecayLR":
            assert self.total_num_steps is not None  # from_json requires it
            gamma = max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - warmup))
        else:
            gamma = 1.0
        return low + (high - low) * gamma

    def _warming(self, iteration: int, warmup: int) -> float:
        if self.warmup_type == "log":
            return math.log(iteration + 1) / math.log(warmup)
        return iteration / warmup

    def _cosine_ratio(self, iteration: int, warmup: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < warmup:
            return self.warmup_min_ratio + self._warming(iteration, warmup) * (1.0 - self.warmup_min_ratio)
        assert self.total_num_steps is not None  # from_json requires it
        progress = min(1.0, (iteration - warmup + 1) / max(1, self.total_num_steps - warmup))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def build(self, optimizer: torch.optim.Optimizer) -> DeepSpeedSchedule:
        return DeepSpeedSchedule(optimizer, self)


class DeepSpeedSchedule(LRScheduler):
    """A ``WarmupSchedule`` driving an optimizer (see the Note on counting steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: WarmupSchedule) -> None:
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float | torch.Tensor]:
        out: list[float | torch.Tensor] = []
        for group in self.optimizer.param_groups:
            # a group added after construction (a parameter unfrozen into a new group)
            # keeps the lr it came with as its base, as the first groups keep theirs
            base = group.setdefault("initial_lr", group["lr"])
            out.append(self.schedule.lr_at(self.last_epoch - 1, float(base)))
        return out
