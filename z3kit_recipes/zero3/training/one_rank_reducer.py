"""The gradient path with one rank: straight into the partitions.

With one rank in the shard group and no replicas, a reduction is the
identity followed by the scale. ``OneRankReducer`` therefore puts each
gradient straight into its partition (scaled in the bucket dtype first, as
a bucket's flush would, so the values are the bucketed path's bit for bit):
no bucket, no copy into one, no collective. A gradient that never came
needs no zeros: its partition stays empty, which the optimizer reads as no
gradient, as it would read the zeros. A second arrival (reentrant
checkpointing) is added where the first went, so nothing is late.
Everything else (the window, clipping, the norm, the step checks' flags)
is the ``GradReducer``'s.
"""

from __future__ import annotations

import torch

from z3kit_recipes.zero3.training.grads import GradReducer


class OneRankReducer(GradReducer):
    """A ``GradReducer`` for a shard group of one rank without replicas (see the module docstring)."""

    def add(self, pid: int, grad: torch.Tensor) -> None:
        if grad.dtype != self.bucket_dtype:
            grad = grad.to(self.bucket_dtype)
        self.arrived.add(pid)
        self.handed.add(pid)
        self.window.accumulate(pid, grad if self.scale == 1.0 else grad.mul(self.scale))

    def skip(self, pid: int) -> None:
        self.handed.add(pid)

    def finish(self) -> None:
        """Nothing is in flight and nothing is missing: the partitions hold every gradient that came."""
