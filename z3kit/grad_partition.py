"""GradPartitionBuffer: this rank's flat gradient partitions for a set of
parameters, accumulated over micro-steps.

One contiguous buffer holds every parameter's partition back to back; each
parameter gets a view. A parameter's first contribution in an accumulation
window is copied in (``copy_``), later ones are added (``add_``): for a
parameter that gets a gradient on every micro-step this is copy on
micro-step 0 and add after it, and a parameter that got none on micro-step
0 does not inherit stale values from the previous window. Accumulation
runs in ``dtype`` (fp32 by default) whatever the gradients' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from z3kit.validate import check_int, check_ints


class GradPartitionBuffer:
    """Flat per-rank gradient partitions, one view per parameter."""

    def __init__(
        self,
        partition_numels: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        partition_numels = check_ints("partition sizes", partition_numels, at_least=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"accumulation dtype must be floating point, got {dtype}")
        # empty, not zeros: a view is written (copy_) before it is first read, and
        # pages never written cost nothing on a CPU
        self.buffer = torch.empty(sum(partition_numels), dtype=dtype, device=device)
        self.views: list[torch.Tensor] = list(self.buffer.split(list(partition_numels))) if partition_numels else []  # Tensor.split is unannotated in torch
        self._has_grad = [False] * len(self.views)

    def __len__(self) -> int:
        return len(self.views)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    def accumulate(self, index: int, partition: torch.Tensor) -> None:
        """Copy (first contribution in the window) or add ``partition`` into view ``index``."""
        if type(index) is not int or not 0 <= index < len(self.views):  # noqa: E721 (a bool is refused too)
            self._check_index(index)
        view = self.views[index]
        # one cheap test for the common case (this runs once per gradient); the messages are _refuse's
        if not (isinstance(partition, torch.Tensor) and partition.is_floating_point()
                and partition.numel() == view.numel() and partition.device == view.device):
            self._refuse(index, partition)
        if self._has_grad[index]:
            view.add_(partition.reshape(-1))
        else:
            view.copy_(partition.reshape(-1))
            self._has_grad[index] = True

    def _refuse(self, index: int, partition: object) -> None:
        if not isinstance(partition, torch.Tensor):
            raise TypeError(f"partition must be a torch.Tensor, got {type(partition).__name__}")
        if not partition.is_floating_point():
            raise TypeError(f"partition {index} must be floating point, got {partition.dtype}")
        view = self.views[index]
        if partition.numel() != view.numel():
            raise ValueError(f"partition {index} has {view.numel()} elements, got {partition.numel()}")
        raise ValueError(f"partition is on {partition.device} but the buffer is on {view.device}")

    def _check_index(self, index: int) -> None:
        # a negative index would silently pick a partition from the end
        check_int("partition index", index)
        if not 0 <= index < len(self.views):
            raise ValueError(f"partition index {index} out of range [0, {len(self.views)})")

    def withdraw(self, index: int) -> torch.Tensor | None:
        """View ``index``'s sum so far (None: nothing accumulated), after which
        the view counts as empty: the next ``accumulate`` copies over it. The
        caller reads the view before that (a runtime that folds it into a
        collective whose result lands back here)."""
        self._check_index(index)
        if not self._has_grad[index]:
            return None
        self._has_grad[index] = False
        return self.views[index]

    def has_grad(self, index: int) -> bool:
        self._check_index(index)
        return self._has_grad[index]

    def optimizer_grads(self) -> list[torch.Tensor | None]:
        """The view of each parameter that received a gradient this window, else None
        (an optimizer then skips it, as it skips a parameter whose grad is None)."""
        return [v if h else None for v, h in zip(self.views, self._has_grad)]

    def squared_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's accumulated partitions (fp32 or wider)."""
        dtype = torch.promote_types(self.buffer.dtype, torch.float32)  # fp64 buffers stay fp64
        if all(self._has_grad):
            return self.buffer.to(dtype).pow(2).sum()
        total = self.buffer.new_zeros((), dtype=dtype)
        for view, has in zip(self.views, self._has_grad):
            if has:  # views without a gradient this window hold stale values
                total += view.to(dtype).pow(2).sum()
        return total

    def scale_(self, factor: float | torch.Tensor) -> None:
        """Multiply every partition by ``factor`` (gradient clipping)."""
        self.buffer.mul_(factor)

    def new_window(self) -> None:
        """Start a new accumulation window (after an optimizer step)."""
        self._has_grad = [False] * len(self.views)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor gradient clipping scales by, ``min(1, max_norm / (norm + 1e-6))``
    as ``torch.nn.utils.clip_grad_norm_`` computes it, kept on the device: the
    factor is applied whatever its value, so the host never reads the norm."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
