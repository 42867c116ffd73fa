"""What a worker reports about a call that should be refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def error_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    """``"<ExceptionType>: <message>"`` of a ValueError or TypeError that
    ``fn(*args, **kwargs)`` raises, or ``"no error"`` (picklable, for the pools)."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def raised(fn: Any, *args: Any, **kwargs: Any) -> str:
    """``"<ExceptionType>: <message>"`` of any exception ``fn(*args, **kwargs)`` raises, or ``"ok"``."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(e).__name__}: {e}"
    return "ok"


def unchanged(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> bool:
    """Every tensor of ``before`` is in ``after``, bit for bit: a refused call changed nothing."""
    return all(name in after and torch.equal(t, after[name]) for name, t in before.items())
