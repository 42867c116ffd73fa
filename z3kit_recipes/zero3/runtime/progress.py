"""DeepSpeed's progress line: every ``steps_per_print`` optimizer steps, rank 0 logs
``[Rank 0] step=N, skipped=S, lr=[...], mom=[...]``.

The line is DeepSpeed's (``DeepSpeedEngine._report_progress``, 0.19.8): the
step just taken (counted as ``global_steps``, skipped fp16 steps included),
the steps skipped for an fp16 overflow, and each parameter group's learning
rate (after the scheduler's step: the one the next step uses) and momentum
(``betas`` where the group has them, else ``momentum``). It goes to the
``z3kit.progress`` logger at INFO, which prints it to stdout unless the
application configured that logger itself (silence it with
``logging.getLogger("z3kit.progress").setLevel(logging.WARNING)``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final

import torch

#: the logger of the progress line
LOGGER: Final = logging.getLogger("z3kit.progress")


def group_values(optimizer: torch.optim.Optimizer | None, key: str) -> list[Any]:
    """Each parameter group's ``key`` (0.0 where a group has none), as DeepSpeed's ``_get_optimizer_param``."""
    return [] if optimizer is None else [group.get(key, 0.0) for group in optimizer.param_groups]


def momenta(optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """Each group's ``betas`` (Adam-like) or ``momentum`` (SGD, RMSprop), as DeepSpeed's ``get_mom``."""
    if optimizer is None:
        return []
    return [group["betas"] if "betas" in group else group.get("momentum", 0.0) for group in optimizer.param_groups]


def report_progress(step: int, skipped: int, optimizer: torch.optim.Optimizer | None, rank: int) -> None:
    """Log DeepSpeed's progress line for optimizer step ``step`` (rank 0 calls it)."""
    if not LOGGER.handlers and LOGGER.level == logging.NOTSET:  # nobody configured it: print, as DeepSpeed's does
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        LOGGER.addHandler(handler)
        LOGGER.setLevel(logging.INFO)
        LOGGER.propagate = False
    lr, mom = group_values(optimizer, "lr"), momenta(optimizer)
    LOGGER.info("[Rank %d] step=%d, skipped=%d, lr=%s, mom=%s", rank, step, skipped, lr, mom)
