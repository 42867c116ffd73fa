"""Which gradients share a bucket, and the order buckets are reduced in.

Fixed at initialize and the same on every rank (see the Note on the same
reductions on every rank in ``zero3.training.grads``): parameters in the given order
(the reverse of registration, as gradients usually finish in backward) fill
buckets of ``capacity`` padded elements; a gradient that needs no padding and
would take half a bucket or more, or that does not fit one, is reduced alone
(see the Note on large gradients there).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class ReductionPlan:
    """Buckets of parameter ids, in the order they are reduced; a bucket of
    one marked ``alone`` is reduced on its own (see the Note on large gradients)."""

    buckets: tuple[tuple[int, ...], ...]
    alone: tuple[bool, ...]
    #: the bucket of each parameter id
    bucket_of: dict[int, int]

    @classmethod
    def make(cls, order: Sequence[int], numels: dict[int, int], padded: dict[int, int], capacity: int) -> ReductionPlan:
        buckets: list[tuple[int, ...]] = []
        alone: list[bool] = []
        current: list[int] = []
        size = 0
        for pid in order:
            big = padded[pid] > capacity or (numels[pid] == padded[pid] and 2 * padded[pid] >= capacity)
            if big or (current and size + padded[pid] > capacity):
                if current:
                    buckets.append(tuple(current))
                    alone.append(False)
                current, size = [], 0
            if big:
                buckets.append((pid,))
                alone.append(True)
            else:
                current.append(pid)
                size += padded[pid]
        if current:
            buckets.append(tuple(current))
            alone.append(False)
        bucket_of = {pid: b for b, pids in enumerate(buckets) for pid in pids}
        return cls(tuple(buckets), tuple(alone), bucket_of)
