"""A stack of tiny blocks: many small modules, to stress per-module runtime overhead.

:class:`TinyMLP` is ``depth`` blocks of ``Linear(width, width)`` + ``Tanh``
(each a :class:`TinyBlock`): one gather per module and hooks on every one,
so a runtime's per-module cost shows, not arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from z3kit.validate import check_int


class TinyBlock(nn.Module):
    """``Linear(width, width)`` followed by ``Tanh``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.linear(x))
        return out


class TinyMLP(nn.Module):
    """``depth`` :class:`TinyBlock` s of the same ``width``, in sequence."""

    def __init__(self, depth: int = 96, width: int = 32) -> None:
        super().__init__()
        self.depth = check_int("depth", depth, at_least=1)
        self.width = check_int("width", width, at_least=1)
        self.blocks = nn.ModuleList(TinyBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

