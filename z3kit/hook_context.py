"""Where a hook runs: inside a backward pass or not, and never inside a compiled graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_graphs(fn: _F) -> _F:
    """``fn`` always runs eagerly: torch.compile never traces it (a graph break where compiled code calls it)."""
    return cast(_F, torch.compiler.disable(fn, recursive=True))


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass in this thread
    (forwards seen then are activation-checkpoint recomputations)."""
    return bool(torch._C._current_graph_task_id() != -1)


__all__ = ["in_backward", "outside_graphs"]
