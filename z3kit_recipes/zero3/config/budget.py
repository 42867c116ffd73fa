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
    it. Persistent parameters (under ``param_persistence_threshold``) stay
    gathered all the time and come off the top. Of the rest, a quarter goes
    to the buckets (split between those that can be in flight or filling at once under
    ``overlap_comm``) and three quarters to gathered parameters: with the
    persistent ones, ``max_live_parameters``. A parameter is kept for reuse only when its
    reuse comes within that same window (``max_reuse_distance``). One
    prefetch may take a quarter of it: a coalesced gather holds its output
    buffer and the parameters it fills at once, twice its size, for a
    moment. A running module's own parameters are gathered whatever the
    budget: when the largest module, or the persistent parameters, need
    more than the budget leaves, the plan says so and they set the floor.
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
    #: parameters that stay gathered all the time (under the persistence threshold)
    persistent_numel: int
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
        if self.persistent_numel:
            text += f"; {self.persistent_numel:,} persistent elements stay gathered"
        if self.bound_bytes > self.budget_bytes:
            text += (
                f"; the largest module needs {self.largest_fetch_numel:,} elements gathered at once, "
                f"so the bound is {self.bound_bytes:,} B"
            )
        return text


#: transient buffers may always be this large: below a million elements the
#: count of collectives matters more than the memory
TRANSIENT_FLOOR_NUMEL = 1 << 20


def transient_cap(total_numel: int, world: int) -> int:
    """Elements one transient buffer may hold (a gradient bucket, a coalesced
    gather's output): two of them together at most one rank's 1/N of a model
    of ``total_numel`` elements, but never under ``TRANSIENT_FLOOR_NUMEL``.

    Note: why transient buffers are capped.
        DeepSpeed's default sizes (a 5e8-element reduce bucket, 5e7-element
        prefetches) exceed many models whole: a rank would then hold a
        model-sized bucket on top of its 1/N partitions at the end of
        backward, and a prefetch of most of the model would exist twice
        (its all-gather output and the parameters it is copied into) in the
        middle of forward. Capped at 1/(2N) of the model, they are still
        millions of elements on any model worth sharding, where one
        collective's fixed cost is lost in its transfer time.
    """
    return max(-(-total_numel // (2 * world)), TRANSIENT_FLOOR_NUMEL)


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
    persistent_numel: int,
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
    spare = max(0, total // element_size - persistent_numel)
    per_bucket = max(world, spare // (4 * buckets))
    live = max(1, spare - per_bucket * buckets)
    bound = persistent_numel + max(live, largest_fetch_numel) + per_bucket * buckets
    return MemoryPlan(
        budget_bytes=total,
        element_size=element_size,
        # the live count includes the persistent parameters; reuse distances do not
        max_live_parameters=persistent_numel + live,
        max_reuse_distance=live,
        prefetch_bucket_size=max(1, live // 4),
        reduce_bucket_size=per_bucket,
        largest_fetch_numel=largest_fetch_numel,
        persistent_numel=persistent_numel,
        bound_bytes=max(total, bound * element_size),
    )
