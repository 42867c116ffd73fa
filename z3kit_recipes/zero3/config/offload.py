"""OffloadConfig: the optimizer's fp32 masters and state in host memory.

DeepSpeed's ``zero_optimization.offload_optimizer`` with ``device: "cpu"``
(``DeepSpeedZeroOffloadOptimizerConfig``: ``device``, ``pin_memory``,
``ratio``) maps onto it. ``ratio`` is the fraction of the model's elements
whose masters and optimizer state live on the host: parameters are taken
in model order until that fraction is reached (1.0: all of them), so the
choice is the same on every rank and does not change when a parameter is
frozen or unfrozen later (``host_params``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from z3kit.validate import bool_validator, is_number


def _check_device(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value == "nvme":
        raise ValueError('OffloadConfig.device "nvme": z3kit does not offload to NVMe; use "cpu"')
    if value != "cpu":
        raise ValueError(f'OffloadConfig.device must be "cpu", got {value!r}')


def _check_ratio(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    if not is_number(value):
        raise TypeError(f"OffloadConfig.ratio must be a number in (0, 1], got {type(value).__name__}")
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"OffloadConfig.ratio is the fraction of the optimizer state offloaded and must be in (0, 1], got {value}; "
            "for no offload leave Zero3Config.offload_optimizer at None"
        )


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """Where the optimizer's fp32 masters and state live (see the module docstring).

    ``pin_memory``: the host tensors are page-locked where there is an
    accelerator, so that copies to and from it run asynchronously
    (True by default, as in DeepSpeed). ``ratio``: the fraction of the parameters'
    elements offloaded. ``overlap``: the host step runs behind the next
    forward, each gather waiting only for its own parameters' update
    (``zero3.training.offload``); False steps them inside ``engine.step()``.
    """

    device: str = attrs.field(default="cpu", validator=_check_device)
    pin_memory: bool = attrs.field(default=True, validator=bool_validator())
    ratio: float = attrs.field(default=1.0, validator=_check_ratio)
    overlap: bool = attrs.field(default=True, validator=bool_validator())

    def host_params(self, numels: Sequence[int]) -> frozenset[int]:
        """Ids of the parameters (of ``numels`` elements each, in model order)
        whose masters and optimizer state live on the host."""
        target, taken, out = self.ratio * sum(numels), 0, set()
        for pid, numel in enumerate(numels):
            if taken >= target:
                break
            out.add(pid)
            taken += numel
        return frozenset(out)

    @classmethod
    def from_json(cls, name: str, value: Any) -> OffloadConfig:
        """DeepSpeed's ``offload_optimizer`` section (``name``, for messages) with ``device: "cpu"``."""
        try:
            return cls(device=value.get("device", "cpu"), pin_memory=value.get("pin_memory", True),
                       ratio=value.get("ratio", 1.0))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
