"""What the engine reports about itself: ``Zero3Stats``, read from the parts.

``engine.stats()`` is a snapshot of typed fields, never a search by name:
the parts' own figures, and the last step's from their clock
(``zero3.runtime.step_stats``).
"""

from __future__ import annotations

import attrs

from z3kit.links import LinkClass
from z3kit.memory import MemoryKind, MemoryReport, device_peak_bytes, storage_bytes
from z3kit.sharded_muon import MuonReport, ShardedMuon
from z3kit.policy_planner import PolicyPlanner, StockPlanner
from z3kit_recipes.zero3.compile.compiled import CompileStats
from z3kit_recipes.zero3.config.budget import MemoryPlan
from z3kit_recipes.zero3.runtime.build import EngineParts


@attrs.frozen
class Zero3Stats:
    """Figures of the last step, as data (``engine.stats()``).

    ``collectives`` counts calls and bytes per kind since the previous
    ``step()`` boundary, ``link_bytes`` the bytes this rank received in
    them per link class (``z3kit.links``); memory figures count elements on
    this rank.
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
    #: fetch comparisons the ranks made since the engine was built: one small all-gather each, in
    #: training forwards no recorded trace vouches for, and per gathering fetch of an eval forward
    #: plus one at its end (``zero3.ranks.fetch_agreement``); not in ``collectives``
    fetch_checks: int = 0
    #: fp16: the current loss scale, and the optimizer steps skipped for an overflow (``zero3.training.loss_scale``;
    #: its one host read per optimizer step counts in ``host_waits`` off the CPU)
    loss_scale: float | None = None
    skipped_steps: int = 0
    #: bytes this rank received since the previous ``step()`` boundary from ranks on its own node
    #: ("intra_node") and on other nodes ("inter_node"), under the direct-exchange model of
    #: ``z3kit.links``; nodes as torchrun's ``LOCAL_WORLD_SIZE`` says (one node without it)
    link_bytes: dict[str, int] = attrs.field(factory=lambda: {link.value: 0 for link in LinkClass})
    nodes: int = 1
    #: hooked modules, each one fetch (the root, the fetch units, leaf units and every other
    #: module with parameters of its own; ``zero3.training.unit_rule``)
    fetch_units: int = 0
    #: the last optimizer step's host work (``z3kit.host_work``): Python hook calls ("hooks"), autograd
    #: Function applications ("functions"), ``__torch_function__`` calls ("torch_functions"), and
    #: "collectives" (calls, as in ``collectives``); counted, so that a test can pin them
    host_work: dict[str, int] = attrs.field(factory=dict)
    #: the planner that schedules prefetches and releases (``zero3.training.step_plans``); its plan's
    #: prefetch gathers per step and its peak of live elements, as planned ("" and 0: no plan yet)
    planner: str = ""
    plan_prefetches: int = 0
    plan_peak_live_numel: int = 0
    #: a ``ShardedMuon`` optimizer's report (``z3kit.sharded_muon``): which parameter got Muon and which
    #: AdamW, each Muon matrix's owner rank, the last step's Muon bytes and seconds (its two all-to-alls
    #: are not in ``collectives``); None with any other optimizer
    muon: MuonReport | None = None
    #: whether the config's scheduling knobs (``max_live_parameters``, ``prefetch_bucket_size``)
    #: apply: the stock planner's, or a release policy and prefetch limiter replayed; not a ``planner=``
    planner_uses_knobs: bool = True
    #: the plan's own limit of live elements (``SchedulePlan.live_limit``), if it has one
    plan_live_limit: int | None = None
    #: the units the plan keeps gathered across steps, their elements, and the all-gathers
    #: per step that keeping them saves (``z3kit.kept_units``)
    plan_kept_units: tuple[str, ...] = ()
    plan_kept_numel: int = 0
    plan_saved_gathers: int = 0

    @property
    def comm_wait_share(self) -> float:
        return self.comm_wait_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def collectives_per_step(self) -> int:
        return sum(kind["calls"] for kind in self.collectives.values())

    def __str__(self) -> str:
        """A short table for ``print(engine.stats())``; ``repr`` keeps every field as it is."""
        return "\n".join(_table(self))


def size(nbytes: int) -> str:
    """Bytes in MB (10**6), or GB from 1 GB on."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**9 else f"{nbytes / 1e6:.2f} MB"


def count(numel: int) -> str:
    """An element count with its unit: 12.35M, 4.1k, 512."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if numel >= scale:
            return f"{numel / scale:.2f}{unit}"
    return str(numel)


def _table(s: Zero3Stats) -> list[str]:
    mem = s.memory
    lines = [
        f"Zero3Stats: step {s.global_step} (micro-step {s.micro_step}), model {count(s.model_numel)} parameters",
        f"  {'memory on this rank':<22}{'now':>11}{'peak':>11}",
        *(f"  {kind:<22}{size(mem.current[kind]):>11}{size(mem.peak.get(kind, 0)):>11}" for kind in mem.current),
        f"  {'total':<22}{size(mem.current_total):>11}{size(mem.peak_total):>11}",
    ]
    if mem.device_peak is not None:
        lines.append(f"  {'device allocator peak':<22}{'':>11}{size(mem.device_peak):>11}")
    lines += [
        f"  resident elements     params {count(s.resident_param_numel)}, fp32 masters {count(s.resident_master_numel)}, "
        f"grads {count(s.resident_grad_numel)}",
        f"  gathered elements     now {count(s.live_numel)}, peak {count(s.peak_live_numel)}{_live_limit(s)} "
        f"(largest fetch {count(s.largest_fetch_numel)}, {s.fetch_units} fetch units)",
        f"  buckets               reduce {count(s.reduce_bucket_numel)}"
        + (f", prefetch {count(s.prefetch_bucket_numel)}" if s.planner_uses_knobs else "") + " elements",
        _planner(s),
        "  collectives           " + (", ".join(
            f"{kind} {c['calls']} call(s), {size(c.get('bytes', 0))}" for kind, c in sorted(s.collectives.items())
            if c["calls"]) or "none")
        + " in the last step",
        f"  step                  {s.step_time_s:.3f} s, comm wait {s.comm_wait_s:.3f} s ({100 * s.comm_wait_share:.1f}%), "
        f"rank checks {1000 * s.rank_check_s:.1f} ms",
        f"  trace                 {s.trace_state}, {s.trace_invalidations} invalidation(s); grad norm "
        + ("-" if s.last_grad_norm is None else f"{s.last_grad_norm:.4g}") + f"; host waits {s.host_waits}",
        "  host work             " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in s.host_work.items())
        + " in the last step",
    ]  # fmt: skip
    if s.nodes > 1:
        lines.append(f"  received by link      intra-node {size(s.link_bytes['intra_node'])}, "
                     f"inter-node {size(s.link_bytes['inter_node'])} in the last step ({s.nodes} nodes)")
    if s.loss_scale is not None:
        lines.append(f"  fp16 loss scale       {s.loss_scale:g}, {s.skipped_steps} step(s) skipped for overflow")
    if s.compile is not None:
        c = s.compile
        lines.append(f"  compile               {len(c.units)} compiled unit(s){', whole model' if c.whole_model else ''}, "
                     f"{c.eager_forwards} eager forward(s); last step {c.last_step.graphs} graph(s), "
                     f"{c.last_step.recompiles} recompile(s), {c.last_step.graph_breaks} graph break(s)")
    if s.memory_plan is not None:
        lines.append(f"  memory plan           {s.memory_plan.describe()}")
    if s.muon is not None:
        m, kinds = s.muon, list(s.muon.optimizer_of.values())
        lines.append(f"  muon                  {kinds.count('muon')} matrices on Muon, {kinds.count('adamw')} on AdamW; "
                     f"last step sent {size(m.bytes_sent)}, received {size(m.bytes_received)}, {1000 * m.seconds:.1f} ms")
    return lines


def _live_limit(s: Zero3Stats) -> str:
    """The limit the live elements are held to: the config's under its knobs, else the plan's, if any."""
    limit = s.max_live_parameters if s.planner_uses_knobs else s.plan_live_limit
    return "" if limit is None else f" of {count(limit)}"


def _planner(s: Zero3Stats) -> str:
    """The planner line: who plans, what its plan prefetches and peaks at, and what it keeps across steps."""
    if not s.planner:
        return "  planner               none yet"
    line = f"  planner               {s.planner}: "
    if not s.plan_peak_live_numel:
        return line + "no plan yet (the first training step records the trace it plans)"
    line += f"{s.plan_prefetches} prefetch gather(s) per step, planned peak {count(s.plan_peak_live_numel)}"
    if s.plan_kept_units:
        line += (f"; keeps {', '.join(s.plan_kept_units)} gathered across steps ({count(s.plan_kept_numel)} "
                 f"elements), {s.plan_saved_gathers} all-gather(s) per step saved")
    return line


def collect_stats(parts: EngineParts) -> Zero3Stats:
    """``engine.stats()``: the parts' figures, read from their fields."""
    layout, coordinator, reducer, limiter = parts.layout, parts.coordinator, parts.reducer, parts.limiter
    last = parts.stats.last
    step, scaler = parts.optimizer_step, parts.loss_scaler
    plans = coordinator.plans
    summary = plans.summary if plans.plan is not None else None
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
        host_waits=parts.backward.host_waits() + (0 if scaler is None or parts.device.type == "cpu" else scaler.host_reads),
        fetch_checks=parts.backward.agreement.issued,
        loss_scale=None if scaler is None else scaler.scale,
        skipped_steps=0 if scaler is None else scaler.skipped,
        link_bytes=last.link_bytes,
        nodes=1 if parts.log.node_map is None else parts.log.node_map.nodes(),
        fetch_units=len(coordinator.module_params),
        host_work=last.host_work,
        planner=plans.planner_name,
        plan_prefetches=0 if summary is None else summary.prefetches,
        plan_peak_live_numel=0 if summary is None else summary.peak_live_numel,
        planner_uses_knobs=isinstance(plans.planner, (StockPlanner, PolicyPlanner)),
        plan_live_limit=None if plans.plan is None else plans.plan.live_limit,
        plan_kept_units=() if summary is None or plans.plan is None else plans.plan.keep_units,
        plan_kept_numel=0 if summary is None else summary.kept_numel,
        plan_saved_gathers=0 if summary is None else summary.saved_gathers,
        muon=parts.optimizer.report if isinstance(parts.optimizer, ShardedMuon) else None,
    )
