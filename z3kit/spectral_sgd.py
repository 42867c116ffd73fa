"""Spectral-norm-normalized SGD on flat 1/N shards: a second matrix optimizer from ``z3kit.matrix_owners``.

Each matrix ``W`` with gradient ``G`` steps so (steepest descent under the
spectral norm, with heavy-ball momentum)::

    M = momentum * M + G                      # elementwise: on the shards, M sharded 1/N
    W = W - lr * M / max(||M||_2, eps)        # ||M||_2: the largest singular value, of the whole matrix

The spectral norm needs the whole matrix, so ``M`` goes to its owner
(``map_on_owners``: one all-to-all), which returns ``M / ||M||_2`` in fp32
(the second all-to-all); the subtraction is elementwise again, on the
shards. ``spectral_sgd_reference`` is the same step on whole tensors in one
process, what the sharded step must equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from z3kit.matrix_owners import MatrixPlan, ShardedParams, check_matrix_shard, map_on_owners


def spectral_normalized(matrix: torch.Tensor, eps: float) -> torch.Tensor:
    """``matrix`` divided by its spectral norm (at least ``eps``)."""
    norm: torch.Tensor = torch.linalg.matrix_norm(matrix, ord=2)
    return matrix / norm.clamp(min=eps)


class ShardedSpectralSGD(torch.optim.Optimizer):
    """Spectral-norm-normalized SGD with momentum on flat shards (see the module docstring);
    every parameter must be a matrix's shard (refused by name otherwise)."""

    def __init__(
        self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], shards: ShardedParams, *,
        lr: float = 0.01, momentum: float = 0.9, eps: float = 1e-7,
    ) -> None:
        if not lr >= 0.0 or not 0.0 <= momentum < 1.0 or not eps > 0.0:
            raise ValueError(f"lr must be >= 0, momentum in [0, 1) and eps > 0; got {lr}, {momentum}, {eps}")
        self.shards = shards
        super().__init__(params, {"lr": lr, "momentum": momentum, "eps": eps})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in param_group["params"]:
            check_matrix_shard(self.shards, p, "spectral SGD", "step it with another optimizer")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        with torch.enable_grad():
            loss = None if closure is None else closure()
        entries = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not entries:
            return loss
        bufs = []
        for p, g in entries:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(state["momentum_buffer"].mul_(g["momentum"]).add_(p.grad))
        group = self.shards.group
        plan = MatrixPlan.balanced([self.shards.full_shape(p) for p, _ in entries], dist.get_world_size(group))
        directions = map_on_owners(plan, bufs, group, lambda i, m: spectral_normalized(m, entries[i][1]["eps"]),
                                   torch.float32)
        for (p, g), direction in zip(entries, directions):
            p.add_(direction, alpha=-g["lr"])
        return loss


def spectral_sgd_reference(
    params: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor], *, lr: float, momentum: float, eps: float = 1e-7,
) -> None:
    """The same step on whole matrices in one process (``params`` with ``.grad``; ``bufs`` their momentum)."""
    with torch.no_grad():
        for p, buf in zip(params, bufs):
            assert p.grad is not None
            buf.mul_(momentum).add_(p.grad)
            p.add_(spectral_normalized(buf, eps), alpha=-lr)
