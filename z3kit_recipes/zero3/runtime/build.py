"""The engine's parts, made in data-flow order from checked arguments.

``assemble`` is what ``zero3.initialize`` calls once every argument is
checked: the shard layout and the optimizer on its master shards (a factory
that fails on any rank leaves every model untouched), the values into the
shards, then the gradient path (GradReducer, OptimizerStep), the parameter
path (Gatherer, ParamCoordinator), the backward pass that joins them and
makes the module hooks that drive both, and the statistics. Each part gets
its collaborators when it is made: nothing is wired in afterwards.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from z3kit.collectives import CollectiveLog, ProcessGroup, failed_ranks
from z3kit.flat_bucket import ReduceMode
from z3kit.hooks import ModuleHooks
from z3kit.links import NodeMap
from z3kit.memory import MemoryKind, MemoryLedger, tensor_bytes
from z3kit.prefetch import PrefetchLimiter
from z3kit.schedule_plan import SchedulePlanner
from z3kit.shard import ParamStatus
from z3kit.streams import StreamPairLike
from z3kit.trace import TraceRecorder
from z3kit_recipes.zero3.compile.compiled import ForwardContext
from z3kit_recipes.zero3.config.budget import MemoryPlan
from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.config.timeouts import collective_timeout
from z3kit_recipes.zero3.ranks.agreement import StepRecord
from z3kit_recipes.zero3.ranks.fetch_agreement import FetchAgreement
from z3kit_recipes.zero3.ranks.rank_watch import RankWatch
from z3kit_recipes.zero3.ranks.topology import Topology
from z3kit_recipes.zero3.ranks.uneven import EvalMeeting
from z3kit_recipes.zero3.ranks.watcher import start_watcher
from z3kit_recipes.zero3.runtime.step_stats import StepStats
from z3kit_recipes.zero3.step.state import StepState
from z3kit_recipes.zero3.training.backward import BackwardPass
from z3kit_recipes.zero3.training.gathers import Gatherer
from z3kit_recipes.zero3.training.grads import GradReducer
from z3kit_recipes.zero3.training.hook_plan import fetch_groups
from z3kit_recipes.zero3.training.layout import ShardLayout
from z3kit_recipes.zero3.training.loss_scale import LossScaler
from z3kit_recipes.zero3.training.materialize import InitFn, has_meta_tensors, materialize
from z3kit_recipes.zero3.training.model_watch import ModelWatch, place_buffers
from z3kit_recipes.zero3.training.offload import OffloadedStep
from z3kit_recipes.zero3.training.one_rank_reducer import OneRankReducer
from z3kit_recipes.zero3.training.optim_step import OptimizerStep
from z3kit_recipes.zero3.training.param_use import ParamUseMode
from z3kit_recipes.zero3.training.params import ParamCoordinator
from z3kit_recipes.zero3.training.rounds import FetchRounds
from z3kit_recipes.zero3.training.secondary import SecondaryPartitions
from z3kit_recipes.zero3.training.timeline import Timeline
from z3kit_recipes.zero3.training.trainable import MasterShards, OptimizerFactory, TrainableWatch
from z3kit_recipes.zero3.training.unit_rule import UnitChoice

StreamPairFactory = Callable[[torch.device], StreamPairLike]


@attrs.frozen
class MetaInit:
    """How tensors built on the meta device get their values (see ``zero3.training.materialize``)."""

    init_fn: InitFn | None
    seed: int


@attrs.frozen
class Policies:
    """The trace and the policies the parameter path runs on (stock or the user's)."""

    trace: TraceRecorder
    planner: SchedulePlanner
    #: counts the live elements the runtime gathers (``stats()``' peak and limit)
    limiter: PrefetchLimiter


@attrs.frozen(eq=False)
class EngineParts:
    """Everything a ``Zero3Engine`` is made of, in data-flow order."""

    module: nn.Module
    config: Zero3Config
    #: every rank (``topology.world_group``): agreement, watch, broadcasts of rank 0's values, saves
    group: ProcessGroup
    #: which ranks share the shards and which hold replicas of them (``zero3.ranks.topology``)
    topology: Topology
    device: torch.device
    #: this rank in ``group``, and its size (the data-parallel world)
    rank: int
    world: int
    param_names: list[str]
    log: CollectiveLog
    memory: MemoryLedger
    memory_plan: MemoryPlan | None
    step_state: StepState
    watch: RankWatch
    layout: ShardLayout
    optimizer: torch.optim.Optimizer | None
    #: the DeepSpeed JSON's learning-rate schedule (``Zero3Config.lr_scheduler``), or None
    lr_scheduler: LRScheduler | None
    trace: TraceRecorder
    limiter: PrefetchLimiter
    record: StepRecord
    gather_streams: StreamPairLike
    reduce_streams: StreamPairLike
    timeline: Timeline
    coordinator: ParamCoordinator
    reducer: GradReducer | None
    hooks: ModuleHooks
    forward_context: ForwardContext
    meeting: EvalMeeting
    backward: BackwardPass
    optimizer_step: OptimizerStep | None
    trainable_watch: TrainableWatch
    model_watch: ModelWatch
    stats: StepStats

    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16 runs' loss scale (``zero3.training.loss_scale``), kept by the optimizer step; else None."""
        return None if self.optimizer_step is None else self.optimizer_step.scaler


def assemble(
    module: nn.Module,
    optimizer_factory: OptimizerFactory | None,
    config: Zero3Config,
    topology: Topology,
    device: torch.device,
    leaf_modules: list[nn.Module],
    units: UnitChoice,
    policies: Policies,
    memory_plan: MemoryPlan | None,
    meta_init: MetaInit,
    stream_pairs: StreamPairFactory,
) -> EngineParts:
    group = topology.world_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    named = list(module.named_parameters())  # each parameter once, tied ones included
    params = [p for _, p in named]
    log, memory, state = CollectiveLog(node_map=_node_map()), MemoryLedger(), StepState()
    watch = RankWatch(
        group,
        timeout_s=collective_timeout(config.collective_timeout_s, group),
        # where this rank is, moved by the parts made below; it holds whether the ranks are broken
        step=state,
        subgroups=topology.subgroups,
        device=device,
    )
    start_watcher(watch)

    # the layout is allocated empty and the optimizer built on it; a factory
    # that fails (on any rank) leaves every model untouched
    offload = config.offload_optimizer
    layout = ShardLayout.allocate(
        params, rank=topology.shard_rank, world=topology.shard_size, dtype=config.torch_dtype, device=device,
        trainable=optimizer_factory is not None,
        host_masters=None if offload is None else offload.host_params([p.numel() for p in params]),
        pin=offload is not None and offload.pin_memory and device.type != "cpu",
    )
    names = [name for name, _ in named]
    optimizer = _build_optimizer(optimizer_factory, MasterShards.of(layout, names, layout.master_of(), topology.shard_group), group, device)
    # DeepSpeed's schedules set the optimizer's lr for the first step when they are made
    lr_scheduler = None if optimizer is None or config.lr_scheduler is None else config.lr_scheduler.build(optimizer)

    # the values into the shards, one parameter (or chunk, or module) at a time:
    # rank 0's where the model has them (to every rank: replicas start equal), made on every rank where it was on meta
    real = [pid for pid, p in enumerate(params) if not p.is_meta]
    layout.fill_from_rank0(real, group, log)
    if len(real) < len(params) or has_meta_tensors(module):
        materialize(module, layout, meta_init.init_fn, meta_init.seed, device)
    if optimizer is None:
        for p in params:
            p.requires_grad_(False)  # nothing would consume their gradients
    memory.set(MemoryKind.PARAM_SHARDS, tensor_bytes(layout.flat))
    layout.count_masters(memory)
    place_buffers(module, device, config.torch_dtype)
    for shard in layout.shards:  # full sizes under DeepSpeed's names, which Hugging Face and PEFT read
        setattr(shard.param, "ds_shape", shard.shape)
        setattr(shard.param, "ds_numel", shard.numel)

    # the gradient path first: the parameter path's gathers wait on its host step (offload)
    record, timeline = StepRecord(), Timeline()
    gather_streams, reduce_streams = stream_pairs(device), stream_pairs(device)

    def final_micro_step() -> bool:
        """The backward under way ends the accumulation window (HSDP's replica stage, offload's streaming)."""
        return (state.micro_step + 1) % config.gradient_accumulation_steps == 0

    reducer = _build_reducer(layout, config, topology, device, memory_plan, watch, reduce_streams, log, memory,
                             final_micro_step)
    step_kind: Any = OptimizerStep if offload is None else functools.partial(
        OffloadedStep, layout=layout, overlap=offload.overlap,
        final_landing=final_micro_step,
        # the next forward gathers them, persistent ones too, in the trace's order (host_step's Note)
        gather_order=policies.trace.param_order,
    )
    optimizer_step: OptimizerStep | None = None if optimizer is None or reducer is None else step_kind(
        optimizer, reducer, layout.shards, layout.trainable, layout.masters,
        masters_are_shards=layout.masters_are_shards, clip=config.gradient_clipping, memory=memory,
        scaler=LossScaler(config.loss_scaling) if config.compute_dtype == "fp16" else None,
    )

    # the parameter path
    agreement = FetchAgreement(group, device, watch, lambda: state.micro_step)
    leaf_roots = set(leaf_modules)
    hooked = fetch_groups(module, params, leaf_roots, units.roots)
    gatherer = Gatherer(
        layout.shards, group=topology.shard_group, streams=gather_streams,
        limiter=policies.limiter, log=log, memory=memory, record=record, waiter=watch.wait, overlap=config.overlap_comm,
        # offload: a gather waits for its shards' update from the host
        before_gather=optimizer_step.host_step.fence if isinstance(optimizer_step, OffloadedStep) else None,
        # hpZ: backward gathers within the node
        secondary=None if topology.secondary_group is None else SecondaryPartitions(
            layout.shards, topology.secondary_group, state, memory),
    )
    rounds = FetchRounds(gatherer, agreement.group, device, watch.wait, log) if config.divergent_graphs else None
    coordinator = ParamCoordinator(
        gatherer, hooked, trace=policies.trace, planner=policies.planner, record=record, ranks=agreement,
        timeline=timeline, check_every_fetch=config.checks_every_fetch, rounds=rounds, step=state,
    )
    meeting = EvalMeeting(
        module, watch, state,
        # a gather in flight (persistent ones refreshed after a step) was issued by every rank alike
        gathers_needed=lambda: any(s.status is ParamStatus.NOT_AVAILABLE for s in layout.shards),
        fetches=None if rounds is not None else agreement,
    )

    # the backward pass joins the two paths and makes the module hooks that drive them
    backward = BackwardPass(
        layout.shards, names, layout.trainable, layout.masters, leaf_roots, coordinator=coordinator, reducer=reducer,
        record=record, watch=watch, agreement=agreement, step=state,
        defer_reductions=config.divergent_graphs,
        # an fp16 loss must be scaled (see zero3.training.loss_scale)
        engine_backward_required=optimizer_step is not None and optimizer_step.scaler is not None,
    )
    hooks = backward.hooks
    stats = StepStats(
        log, memory, policies.limiter,
        comm_wait=lambda: gatherer.comm_wait_s + (0.0 if reducer is None else reducer.comm_wait_s),
        rank_check=lambda: backward.check_s + agreement.seconds,
        work=hooks.work,
    )
    return EngineParts(
        module=module, config=config, group=group, topology=topology, device=device, rank=rank, world=world,
        param_names=names,
        log=log, memory=memory, memory_plan=memory_plan, step_state=state, watch=watch, layout=layout,
        optimizer=optimizer, lr_scheduler=lr_scheduler, trace=policies.trace, limiter=policies.limiter, record=record,
        gather_streams=gather_streams, reduce_streams=reduce_streams, timeline=timeline,
        coordinator=coordinator, reducer=reducer, hooks=hooks, meeting=meeting,
        forward_context=ForwardContext(
            ParamUseMode(coordinator, hooks), module, hooks, coordinator, leaf_modules, units.roots, state),
        backward=backward, optimizer_step=optimizer_step, model_watch=ModelWatch(module), stats=stats,
        trainable_watch=TrainableWatch(
            layout, names, optimizer=optimizer, factory=optimizer_factory, reducer=reducer, backward=backward,
            watch=watch, memory=memory, micro_step=lambda: state.micro_step,
            settle=(lambda: None) if optimizer_step is None else optimizer_step.settle, group=topology.shard_group,
        ),
    )


def _node_map() -> NodeMap | None:
    """Which ranks share a node, over global ranks (the default group's), whatever group
    the engine runs on; None (no traffic by link) where torchrun's ``LOCAL_WORLD_SIZE``
    differs between nodes: the figures are only a report, and a launch that ran before
    must not fail, on some ranks only, for them."""
    try:
        return NodeMap.from_env(dist.get_world_size())
    except ValueError as exc:
        warnings.warn(f"z3kit reports no traffic by link class: {exc}", stacklevel=3)
        return None


def _build_optimizer(
    factory: OptimizerFactory | None, masters: MasterShards, group: ProcessGroup, device: torch.device
) -> torch.optim.Optimizer | None:
    optimizer: torch.optim.Optimizer | None = None
    try:
        if factory is not None:
            optimizer = factory(masters)
            _check_optimizer(optimizer, masters)
    except BaseException:
        failed_ranks(False, group, device)
        raise
    failed = failed_ranks(True, group, device)
    if failed:
        raise RuntimeError(f"the optimizer factory failed on rank(s) {failed}; see their error. Nothing was changed here")
    return optimizer


def _check_optimizer(optimizer: Any, masters: list[nn.Parameter]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    ours = {id(m) for m in masters}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in ours:
                raise ValueError(
                    "the optimizer holds a tensor that is not one of the master shards it was given; "
                    "build it from the factory's argument only"
                )


def _build_reducer(
    layout: ShardLayout, config: Zero3Config, topology: Topology, device: torch.device, plan: MemoryPlan | None,
    watch: RankWatch, streams: StreamPairLike, log: CollectiveLog, memory: MemoryLedger,
    final_micro_step: Callable[[], bool],
) -> GradReducer | None:
    if not layout.trainable:
        return None
    reduce_scatter = config.reduce_scatter
    if reduce_scatter is None:  # see Zero3Config.reduce_scatter
        reduce_scatter = dist.get_backend(topology.shard_group) != "gloo"
    # the mean over every rank's micro-batches, as DDP's, replicas included
    world = dist.get_world_size(topology.world_group)
    one_rank = dist.get_world_size(topology.shard_group) == 1 and topology.replicate_group is None
    return (OneRankReducer if one_rank else GradReducer)(
        layout.shards,
        layout.trainable,
        # one communicator for gathers and reductions (see the Note in zero3.training.step_checks)
        group=topology.shard_group,
        replicate=topology.replicate_group,
        final_micro_step=final_micro_step,
        waiter=watch.wait,
        streams=streams,
        log=log,
        memory=memory,
        bucket_size=config.reduce_bucket_size if plan is None else plan.reduce_bucket_size,
        bucket_dtype=config.torch_dtype,  # reduce in the compute dtype, as DeepSpeed does; accumulate in fp32
        mode=ReduceMode.REDUCE_SCATTER if reduce_scatter else ReduceMode.ALL_REDUCE,
        overlap=config.overlap_comm,
        contiguous=config.contiguous_gradients,
        scale=1.0 / (world * config.gradient_accumulation_steps),
    )
