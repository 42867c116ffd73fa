"""What the engine reports about itself: ``Zero3Stats``, read from the parts.

``engine.stats()`` is a snapshot of typed fields, never a search by name:
the parts' own figures, and the last step's from their clock
(``zero3.runtime.step_stats``).
"""

from __future__ import annotations

import attrs

from z3kit.memory import MemoryKind, MemoryReport, device_peak_bytes, storage_bytes
from z3kit_recipes.zero3.compile.compiled import CompileStats
from z3kit_recipes.zero3.config.budget import MemoryPlan
from z3kit_recipes.zero3.runtime.build import EngineParts


@attrs.frozen
class Zero3Stats:
    """Figures of the last step, as data (``engine.stats()``).

    ``collectives`` counts calls and bytes per kind since the previous
    ``step()`` boundary; memory figures count elements on this rank.
    """

    global_step: int
    micro_step: int
    model_numel: int
    #: elements of parameter shards, fp32 master shards (when separate) and gradient partitions held by this rank
    resident_param_numel: int
    resident_master_numel: int
    resident_grad_numel: int
    #: elements of full parameters gathered right now (persistent ones included)
    live_numel: int
    #: high-water of gathered elements in the last optimizer step (and since), against the limit
    peak_live_numel: int
    max_live_parameters: int
    largest_fetch_numel: int
    #: elements of one gradient bucket and of one prefetch, as used (the knobs,
    #: capped so that transient buffers stay within one rank's partition)
    reduce_bucket_numel: int
    prefetch_bucket_numel: int
    collectives: dict[str, dict[str, int]]
    trace_state: str
    trace_invalidations: int
    last_grad_norm: float | None
    #: wall time from the previous optimizer step to the last one, and the part of it blocked on communication
    step_time_s: float
    comm_wait_s: float
    #: the part of the step spent making sure the ranks agree (``zero3.ranks.agreement``)
    rank_check_s: float

    #: bytes held by kind, now and at their peak since the last training forward after a step
    memory: MemoryReport
    #: the knobs ``memory_budget`` chose, when it is set
    memory_plan: MemoryPlan | None
    #: graphs, recompilations and graph breaks, when part of the model is compiled (``zero3.compile.compiled``)
    compile: CompileStats | None = None
    #: the engine's own host syncs since it was built: reads of a step check or of fetch
    #: comparisons that had to wait for the device (0 on CPU; see ``zero3.training.step_checks``)
    host_waits: int = 0

    @property
    def comm_wait_share(self) -> float:
        return self.comm_wait_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def collectives_per_step(self) -> int:
        return sum(kind["calls"] for kind in self.collectives.values())


def collect_stats(parts: EngineParts) -> Zero3Stats:
    """``engine.stats()``: the parts' figures, read from their fields."""
    layout, coordinator, reducer, limiter = parts.layout, parts.coordinator, parts.reducer, parts.limiter
    last = parts.stats.last
    step = parts.optimizer_step
    return Zero3Stats(
        global_step=parts.step_state.global_step,
        micro_step=parts.step_state.micro_step,
        model_numel=sum(s.numel for s in layout.shards),
        resident_param_numel=storage_bytes(s.shard for s in layout.shards) // layout.flat.element_size(),
        resident_master_numel=0 if layout.masters_are_shards else storage_bytes(layout.masters) // 4,  # fp32
        resident_grad_numel=parts.memory.current(MemoryKind.GRAD_PARTITIONS) // 4,
        live_numel=limiter.live_numel,
        peak_live_numel=parts.stats.peak_live_numel(),
        max_live_parameters=limiter.max_live_parameters,
        largest_fetch_numel=max(
            (sum(coordinator.numels[p] for p in pids) for pids in coordinator.module_params.values()), default=0
        ),
        reduce_bucket_numel=0 if reducer is None else reducer.bucket_capacity,
        prefetch_bucket_numel=limiter.prefetch_bucket_size,
        collectives=last.collectives,
        trace_state=parts.trace.state.value,
        trace_invalidations=parts.trace.invalidations,
        last_grad_norm=None if step is None else step.last_grad_norm,
        step_time_s=last.step_time_s,
        comm_wait_s=last.comm_wait_s,
        rank_check_s=last.rank_check_s,
        memory=parts.memory.report(device_peak_bytes(parts.device)),
        memory_plan=parts.memory_plan,
        compile=parts.forward_context.stats(),
        host_waits=parts.backward.host_waits(),
    )
