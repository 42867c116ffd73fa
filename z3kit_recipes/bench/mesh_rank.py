"""One rank of ``--mesh``: each layout built, trained, measured and counted in turn.

Per layout and rank (memory as in ``z3kit_recipes.bench.measure``: process
resident set above a baseline taken after a barrier and ``gc.collect()``):

- build, then ``warmup + steps`` steps, each timed between barriers;
  z3kit's layouts report each step's received bytes per link class
  (``engine.stats().link_bytes``);
- peak resident set over the build and over training, resident set after
  the last step, and what the runtime itself holds between steps (the
  "ledger": z3kit's ``stats().memory`` less its transient kinds; for FSDP2
  the local shards of its parameters and its optimizer state);
- one more step, not timed, under ``LinkCounter``: received bytes per
  phase (forward, backward, optimizer step), kind and link class, counted
  from the c10d operators. That is FSDP2's traffic figure, and for z3kit a
  cross-check of the engine's and the split by phase (hpZ's check needs
  flat's backward gathers).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist

from z3kit.links import LinkClass, NodeMap
from z3kit_recipes.bench.link_count import LinkCounter
from z3kit_recipes.bench.measure import DEVICE, train_steps, warm_up
from z3kit_recipes.bench.mesh_spec import LayoutName, MeshRunSpec
from z3kit_recipes.bench.rss import MemoryProbe, memory_probe
from z3kit_recipes.bench.runners import RUNTIME_MODULES
from z3kit_recipes.bench.runners.torch_native import FSDP2Runner
from z3kit_recipes.bench.runners.z3kit_zero3 import Z3kitRunner, shared_config
from z3kit_recipes.bench.spec import JSON
from z3kit_recipes.launch import leave_together, use_bytecode_cache
from z3kit_recipes.models import Workload, make_workload

#: z3kit's memory kinds that live only within a step (gathers, buckets, gradient partitions and
#: hpZ's secondary slices up to the optimizer step); every other kind (shards, masters, optimizer
#: state, and whatever persistent kind a layout adds) is resident between steps
TRANSIENT_KINDS: Final = frozenset({"gathered_params", "grad_buckets", "grad_partitions", "host_grad_partitions",
                                    "hpz_secondary"})
GATHER_KINDS: Final = ("all_gather", "broadcast")

MeshRunner = Z3kitRunner | FSDP2Runner


def build_layout(spec: MeshRunSpec, layout: LayoutName, wl: Workload, group: dist.ProcessGroup) -> MeshRunner:
    """The runner of ``layout`` on this rank; z3kit's from the shared ``zero_optimization`` section."""
    shard = spec.mesh.shard_size
    if layout == "fsdp2-hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(DEVICE.type, (spec.mesh.replicas, shard), mesh_dim_names=("replicate", "shard"))
        return FSDP2Runner(wl, group, reshard_after_forward=True, mesh=mesh)
    config = shared_config(spec.zero)
    if layout == "hsdp":
        config = attrs.evolve(config, mics_shard_size=shard)
    elif layout == "hpz":
        config = attrs.evolve(config, hpz_partition_size=shard)
    return Z3kitRunner(wl, group, config)


def unavailable_reason(layout: LayoutName, group: dist.ProcessGroup) -> str:
    """Why ``layout`` cannot run here ("" when it can; the same answer on every rank)."""
    if layout != "fsdp2-hsdp":
        return ""
    probe = torch.ones(1)
    try:  # a local check of gloo's, before any traffic: every rank raises alike, or none does
        dist.all_reduce(probe, op=dist.ReduceOp.AVG, group=group)
    except RuntimeError:
        return (f"FSDP2's HSDP all-reduces with ReduceOp.AVG, which gloo refuses on torch {torch.__version__} "
                "(it takes it on 2.13)")
    return ""


def engine_link_bytes(runner: MeshRunner) -> dict[str, int] | None:
    """The last optimizer step's received bytes per link class, by z3kit's own count."""
    return dict(runner.engine.stats().link_bytes) if isinstance(runner, Z3kitRunner) else None


def ledger_bytes(runner: MeshRunner) -> dict[str, int]:
    """What the runtime holds between steps, by kind (see ``TRANSIENT_KINDS``)."""
    if isinstance(runner, Z3kitRunner):
        return {k: v for k, v in runner.engine.stats().memory.current.items() if k not in TRANSIENT_KINDS and v}
    from torch.distributed.tensor import DTensor

    def local_bytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    state = [v for s in runner.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"param_shards": sum(local_bytes(p) for p in runner.model.parameters()),
            "optimizer_state": sum(local_bytes(v) for v in state)}


def counted_step(runner: MeshRunner, wl: Workload, x: torch.Tensor, y: torch.Tensor, counter: LinkCounter) -> float:
    """One step with ``counter`` told which phase each collective belongs to; the loss."""
    with counter:
        if isinstance(runner, Z3kitRunner):
            counter.phase = "forward"
            loss = wl.loss(runner.engine(x), y)
            counter.phase = "backward"
            runner.engine.backward(loss)
            counter.phase = "step"
            runner.engine.step()
        else:
            runner.opt.zero_grad(set_to_none=True)
            counter.phase = "forward"
            loss = wl.loss(runner.model(x), y)
            counter.phase = "backward"
            torch.autograd.backward([loss])
            counter.phase = "step"
            runner.opt.step()
    return float(loss.item())


def measure_layout(spec: MeshRunSpec, layout: LayoutName, rank: int, group: dist.ProcessGroup,
                   probe: MemoryProbe) -> JSON:
    """Build, train, count one layout on this rank; the summary over ranks (on every rank)."""
    wl = make_workload(spec.workload)
    dist.barrier(group=group)
    gc.collect()
    baseline = probe.current()
    probe.reset_peak()
    runner = build_layout(spec, layout, wl, group)
    memory = {"init_peak": probe.peak() - baseline}
    probe.reset_peak()
    links: list[dict[str, int] | None] = []
    times, losses, _, _ = train_steps(runner, wl, rank, group, steps=spec.steps, warmup=spec.warmup,
                                      after_timed_step=lambda: links.append(engine_link_bytes(runner)))
    memory["train_peak"] = probe.peak() - baseline
    gc.collect()
    memory["resident_after_step"] = probe.current() - baseline
    ledger = ledger_bytes(runner)

    counter = LinkCounter(NodeMap.uniform(spec.mesh.world, spec.mesh.shard_size))
    x, y = wl.batch(rank, spec.warmup + spec.steps)
    dist.barrier(group=group)
    losses.append(counted_step(runner, wl, x, y, counter))
    local: JSON = {"times": times, "losses": losses, "links": links, "memory": memory, "ledger": ledger,
                   "counted": counter.report(), "counted_engine": engine_link_bytes(runner),
                   "counted_inter": counter.total(LinkClass.INTER_NODE),
                   "counted_intra": counter.total(LinkClass.INTRA_NODE),
                   "counted_backward_gather_inter": counter.total(LinkClass.INTER_NODE, phases=["backward"],
                                                                  kinds=GATHER_KINDS),
                   "unknown_ops": sorted(counter.unknown)}
    total_params = runner.total_params
    del runner, counter
    gathered: list[Any] = [None] * spec.mesh.world
    dist.all_gather_object(gathered, local, group=group)
    gc.collect()
    return summarize(layout, gathered, total_params)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def summarize(layout: LayoutName, per_rank: list[JSON], total_params: int) -> JSON:
    """One layout's figures over the ranks: step times (slowest rank per step), losses (mean
    over ranks), bytes per step (mean over ranks), memory (max over ranks)."""
    steps = len(per_rank[0]["times"])
    step_times = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    engine_counted = all(link is not None for r in per_rank for link in r["links"])

    def per_step(link: str) -> float:
        if engine_counted:  # the engine's own count over every measured step
            return _mean([float(link_bytes[link]) for r in per_rank for link_bytes in r["links"]])
        return _mean([float(r[f"counted_{'inter' if link == 'inter_node' else 'intra'}"]) for r in per_rank])

    ledger = [sum(r["ledger"].values()) for r in per_rank]
    return {
        "status": "ok",
        "layout": layout,
        "total_params": total_params,
        "median_s": statistics.median(step_times),
        "step_times_s": step_times,
        "losses": [_mean([r["losses"][i] for r in per_rank]) for i in range(len(per_rank[0]["losses"]))],
        "inter_node_bytes_per_step": per_step("inter_node"),
        "intra_node_bytes_per_step": per_step("intra_node"),
        "inter_node_bytes_per_rank": [_mean([float(lb["inter_node"]) for lb in r["links"]]) if engine_counted
                                      else float(r["counted_inter"]) for r in per_rank],
        "link_method": "engine.stats().link_bytes" if engine_counted
                       else "LinkCounter: c10d ops dispatched in one step, direct-exchange model",
        "counted": {
            "inter_node_bytes": _mean([float(r["counted_inter"]) for r in per_rank]),
            "intra_node_bytes": _mean([float(r["counted_intra"]) for r in per_rank]),
            "backward_gather_inter_node_bytes": _mean([float(r["counted_backward_gather_inter"]) for r in per_rank]),
            # the engine's count of the same step, mean over ranks (None for FSDP2)
            "engine_same_step": None if per_rank[0]["counted_engine"] is None else {
                link: _mean([float(r["counted_engine"][link]) for r in per_rank]) for link in per_rank[0]["counted_engine"]},
            "by_phase_rank0": per_rank[0]["counted"],
            "unknown_ops": per_rank[0]["unknown_ops"],
        },
        "memory": {phase: max(r["memory"][phase] for r in per_rank)
                   for phase in ("init_peak", "train_peak", "resident_after_step")},
        "ledger_resident_bytes": max(ledger),
        "ledger_by_kind_rank0": per_rank[0]["ledger"],
    }


def mesh_worker(rank: int, spec: MeshRunSpec) -> None:
    """Entry point of a spawned rank: every layout of ``spec`` in turn; rank 0 writes
    ``{"layouts": {name: summary}}`` to ``spec.out_path``."""
    use_bytecode_cache(spec.pycache_dir)
    shard = spec.mesh.shard_size
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port), RANK=str(rank), WORLD_SIZE=str(spec.mesh.world),
        # "nodes" of S ranks, numbered node by node, as torchrun numbers them
        LOCAL_RANK=str(rank % shard), LOCAL_WORLD_SIZE=str(shard), GROUP_RANK=str(rank // shard),
    )
    # FSDP2 calls the collectives torch 2.13 renamed; not ours to fix.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    torch.set_num_threads(spec.threads)
    warm_up((*RUNTIME_MODULES["z3kit"], *RUNTIME_MODULES["fsdp2"], "torch.distributed.tensor"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        assert group is not None
        probe = memory_probe(DEVICE)
        results = {}
        for layout in spec.layouts:
            why = unavailable_reason(layout, group)
            results[layout] = ({"status": "unavailable", "note": why} if why
                               else measure_layout(spec, layout, rank, group, probe))
        if rank == 0:
            Path(spec.out_path).write_text(json.dumps({"status": "ok", "layouts": results}))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_together()
