"""A memory budget instead of four knobs.

DeepSpeed users bound ZeRO-3's transient memory by guessing four numbers:
``max_live_parameters``, ``max_reuse_distance``, ``prefetch_bucket_size`` and
``reduce_bucket_size``. ``Zero3Config.memory_budget`` states the bound
itself (bytes per rank for gathered parameters and gradient buckets, or a
fraction of the model) and ``plan_memory`` derives the four for the model
at hand.

Note: how the budget is split.
    Gathered parameters live through forward and backward; gradient buckets
    only during backward, at the same time as the parameters gathered for
    it. A quarter of the budget goes to the buckets (split between the two
    that alternate under ``overlap_comm``), three quarters to gathered
    parameters: ``max_live_parameters``. A parameter is kept for reuse only
    when its reuse comes within that same window (``max_reuse_distance``),
    and one prefetch may take half of it, so that the next prefetch can
    start while the module that needed the last one runs. A running
    module's own parameters are gathered whatever the budget: when the
    largest module needs more than three quarters of it, the plan says so,
    and that module sets the floor.
"""

from __future__ import annotations

import attrs

from z3kit.memory import MemoryKind


@attrs.frozen
class MemoryPlan:
    """What ``plan_memory`` chose, in elements of the compute dtype (bytes where named)."""

    budget_bytes: int
    element_size: int
    max_live_parameters: int
    max_reuse_distance: int
    prefetch_bucket_size: int
    reduce_bucket_size: int
    #: the largest single module fetch, gathered whole whatever the budget
    largest_fetch_numel: int
    #: bytes the plan bounds gathered parameters and buckets to: the budget, or
    #: more when the largest module alone needs more
    bound_bytes: int
    #: what the budget covers, for reports
    covers: tuple[str, ...] = (MemoryKind.GATHERED_PARAMS.value, MemoryKind.GRAD_BUCKETS.value)

    def knobs(self) -> dict[str, int]:
        """The four ``Zero3Config`` fields, as chosen."""
        return {
            "max_live_parameters": self.max_live_parameters,
            "max_reuse_distance": self.max_reuse_distance,
            "prefetch_bucket_size": self.prefetch_bucket_size,
            "reduce_bucket_size": self.reduce_bucket_size,
        }

    def describe(self) -> str:
        text = (
            f"memory budget {self.budget_bytes:,} B: max_live_parameters={self.max_live_parameters:,}, "
            f"max_reuse_distance={self.max_reuse_distance:,}, prefetch_bucket_size={self.prefetch_bucket_size:,}, "
            f"reduce_bucket_size={self.reduce_bucket_size:,} elements"
        )
        if self.bound_bytes > self.budget_bytes:
            text += (
                f"; the largest module needs {self.largest_fetch_numel:,} elements gathered at once, "
                f"so the bound is {self.bound_bytes:,} B"
            )
        return text


def budget_bytes(budget: int | float, model_numel: int, element_size: int) -> int:
    """Bytes of a budget given as bytes (int) or as a fraction of the model (float)."""
    if isinstance(budget, float):
        return max(1, int(budget * model_numel * element_size))
    return budget


def plan_memory(
    budget: int | float,
    *,
    model_numel: int,
    element_size: int,
    largest_fetch_numel: int,
    world: int,
    buckets: int,
) -> MemoryPlan:
    """The four knobs for a budget (see the Note on how it is split).

    ``buckets`` is how many gradient buckets can exist at once (2 with
    ``overlap_comm``, else 1); every bucket holds at least ``world``
    elements, as ``FlatBucket`` requires.
    """
    if buckets < 1 or world < 1 or element_size < 1:
        raise ValueError(f"need buckets, world and element_size >= 1, got {buckets}, {world}, {element_size}")
    total = budget_bytes(budget, model_numel, element_size)
    elements = total // element_size
    per_bucket = max(world, elements // (4 * buckets))
    live = max(1, elements - per_bucket * buckets)
    bound = max(live, largest_fetch_numel) + per_bucket * buckets
    return MemoryPlan(
        budget_bytes=total,
        element_size=element_size,
        max_live_parameters=live,
        max_reuse_distance=live,
        prefetch_bucket_size=max(1, live // 2),
        reduce_bucket_size=per_bucket,
        largest_fetch_numel=largest_fetch_numel,
        bound_bytes=max(total, bound * element_size),
    )
