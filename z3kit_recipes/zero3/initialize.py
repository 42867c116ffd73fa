"""``zero3.initialize``: every argument checked, then the engine assembled.

Nothing touches the model before every check has passed, on every rank
where a check depends on the others: the ranks agree on the model and the
settings (``zero3.init_agreement``, which also agrees on the seed of a
model built on meta), then on the optimizer factory (``zero3.runtime.build``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from z3kit.collectives import ProcessGroup
from z3kit.device import BACKEND_FOR_DEVICE_TYPE, device_type_for_backend
from z3kit.prefetch import PrefetchLimiter
from z3kit.release import ReleasePolicy
from z3kit.schedule_plan import SchedulePlanner
from z3kit.shard import shard_numel_for
from z3kit.streams import stream_pair_for
from z3kit.trace import TraceRecorder
from z3kit.validate import check_int, is_int
from z3kit_recipes.zero3.config.budget import MemoryPlan, plan_memory, transient_cap
from z3kit_recipes.zero3.config.config import BUDGET_DERIVED, Zero3Config
from z3kit_recipes.zero3.config.deepspeed_json import read_deepspeed, tell
from z3kit_recipes.zero3.config.training_values import TrainingValues
from z3kit_recipes.zero3.deepspeed_call import check_deepspeed_arguments, check_optimizer_argument
from z3kit_recipes.zero3.engine import Zero3Engine
from z3kit_recipes.zero3.init_agreement import agree_at_init, summarize
from z3kit_recipes.zero3.ranks.engine_group import engine_group
from z3kit_recipes.zero3.ranks.topology import (
    check_mesh,
    hpz_size_for,
    shard_size_for,
    topology_for,
)
from z3kit_recipes.zero3.planner_choice import choose_planner
from z3kit_recipes.zero3.runtime.build import MetaInit, StreamPairFactory, assemble
from z3kit_recipes.zero3.runtime.between_uses import adopt_sharded_copies
from z3kit_recipes.zero3.sharded_mark import check_not_sharded, mark_sharded
from z3kit_recipes.zero3.training.hook_plan import LeafSpec, fetch_groups, resolve_leaves
from z3kit_recipes.zero3.training.materialize import InitFn, check_materializable, has_meta_tensors
from z3kit_recipes.zero3.training.reductions import MAX_FLIGHTS
from z3kit_recipes.zero3.training.trainable import OptimizerFactory
from z3kit_recipes.zero3.training.unit_rule import UnitChoice, UnitRule, choose_units


def _resolve_device(model: nn.Module, group: ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group))
    device_type = device_type_for_backend(backend)
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        module = torch.get_device_module(device_type)
        device = torch.device(device_type, module.current_device())
    for name, p in model.named_parameters():
        if p.device.type not in ("cpu", "meta", device_type):
            raise ValueError(
                f"parameter {name!r} is on {p.device}, but the process group's backend {backend!r} "
                f"communicates {device_type} tensors; move the model to {device_type} (or CPU) or use a "
                f"{BACKEND_FOR_DEVICE_TYPE.get(p.device.type, 'matching')} group"
            )
    return device


def initialize(
    model: nn.Module,
    optimizer: OptimizerFactory | None = None,
    config: Zero3Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    process_group: ProcessGroup | None = None,
    leaf_modules: Iterable[LeafSpec] = (),
    *,
    fetch_units: UnitRule = "auto",
    device_mesh: DeviceMesh | None = None,
    auto: TrainingValues | None = None,
    trace: TraceRecorder | None = None,
    planner: SchedulePlanner | None = None,
    release_policy: ReleasePolicy | None = None,
    prefetch_limiter: PrefetchLimiter | None = None,
    param_init_fn: InitFn | None = None,
    init_seed: int | None = None,
    stream_pairs: StreamPairFactory = stream_pair_for,
    **deepspeed_arguments: object,
) -> Zero3Engine:
    """Shard ``model`` over ``process_group`` (default: the world group) and
    return the engine that trains it.

    HSDP (DeepSpeed's MiCS, ``zero3.ranks.topology``): ``device_mesh``, a 2-D
    ``DeviceMesh`` over every rank named ("replicate", "shard"), or the
    config's ``mics_shard_size``, shards the parameters within each shard
    group and replicates them across the groups (not with ``process_group``).

    ``optimizer`` is a factory that receives this rank's fp32 master shards
    (a ``MasterShards``: a list that also names them, ``.named()``), or None
    (the default; ``initialize(model, config=ds_json)``): then the optimizer the DeepSpeed config's ``optimizer`` section names, or,
    without one, an inference-only engine (an RLHF reference model, say): no
    masters, no gradient buffers, every parameter frozen; ``step`` and
    ``backward`` are refused. A factory and an ``optimizer`` section together
    are refused.
    ``config`` is a ``Zero3Config``, or a DeepSpeed config dict or JSON file
    path, read by ``Zero3Config.from_deepspeed``: its ``"auto"`` size knobs
    are filled from ``model.config.hidden_size`` where the model has one,
    every other ``"auto"`` from ``auto`` (a ``TrainingValues``), as Hugging
    Face's Trainer fills them; its ``scheduler`` becomes ``engine.lr_scheduler``.
    ``planner`` (a ``z3kit.schedule_plan.SchedulePlanner``) replaces the
    stock planner, which plans prefetches and releases from the config's
    knobs; ``release_policy`` and ``prefetch_limiter`` replace its parts
    (``zero3.planner_choice``: knobs then not used are named in a warning).
    ``trace`` replaces the trace recorder. Every argument is
    checked before the model is touched: a failed call changes nothing.
    Every rank must pass the same model (names, shapes, dtypes,
    ``requires_grad``) and settings; where they differ, every rank raises
    ``RanksDisagreeAtInit`` naming the differences (``zero3.init_agreement``).

    A model built on the meta device is materialized one module at a time
    (see ``z3kit_recipes.zero3.training.materialize``): by ``param_init_fn(module)``
    when given (a Hugging Face model's ``_init_weights``), else by each
    module's ``reset_parameters()``, from ``init_seed`` (default: rank 0's
    ``torch.initial_seed()``), the same on every rank.

    ``fetch_units`` chooses the modules whose subtree one fetch gathers
    (``zero3.training.unit_rule``): "auto" (the default), the blocks of each
    stack (each decoder layer), or DeepSpeed's granularity rule where the
    config sets ``module_granularity_threshold``; module classes or
    instances name them; ``()`` fetches every module's own parameters.

    ``stream_pairs`` makes the stream pair of the gathers and the one of the
    reductions for a device (default: ``z3kit.streams.stream_pair_for``);
    tests pass ``z3kit.stream_check.RecordingStreamPair``.

    ``deepspeed.initialize``'s own arguments (``model_parameters``,
    ``lr_scheduler``, ``args``, ...) are refused, each naming what z3kit
    takes instead (``zero3.deepspeed_call``); so is an optimizer instance,
    and unpacking the result as DeepSpeed's 4-tuple (``Zero3Engine.__iter__``).
    """
    check_deepspeed_arguments(deepspeed_arguments)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_not_sharded(model)
    check_optimizer_argument(optimizer)
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass process_group or device_mesh, not both: the mesh's groups are the engine's")
    if process_group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first, or pass process_group")
        process_group = dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
    world = dist.get_world_size(process_group)
    if device_mesh is not None:
        device_mesh = check_mesh(device_mesh, world)
    config, notes = _read_config(model, config, auto, world)
    # the size the parameters are sharded to: the world, or an HSDP shard group's
    shard_size = shard_size_for(config.mics_shard_size, device_mesh, process_group)
    hpz_size = hpz_size_for(config.hpz_partition_size, shard_size, process_group, config.divergent_graphs)
    optimizer = _optimizer_factory(optimizer, config)
    if next(model.parameters(), None) is None:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to shard or train")
    if optimizer is not None and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"every parameter of {type(model).__name__} is frozen (requires_grad=False): there is nothing to "
            "optimize; pass optimizer=None for an engine that only runs forwards"
        )
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; ZeRO-3 trains floating-point parameters")
    device = _resolve_device(model, process_group)
    leaves = resolve_leaves(model, leaf_modules)
    if trace is None:
        trace = TraceRecorder()
    elif not isinstance(trace, TraceRecorder):
        raise TypeError(f"trace must be a TraceRecorder (or a subclass), got {type(trace).__name__}")
    units = _choose_units(model, fetch_units, leaves, config, config.max_live_parameters)
    plan = _plan_budget(model, config, leaves, units, shard_size)
    if plan is not None and plan.knobs()["max_live_parameters"] < config.max_live_parameters:
        units = _choose_units(model, fetch_units, leaves, config, plan.knobs()["max_live_parameters"])
        plan = _plan_budget(model, config, leaves, units, shard_size)
    knobs = plan.knobs() if plan is not None else {name: getattr(config, name) for name in BUDGET_DERIVED}
    padded_total = sum(shard_numel_for(p.numel(), shard_size) * shard_size for p in model.parameters())
    policies = choose_planner(
        config, knobs, min(knobs["prefetch_bucket_size"], transient_cap(padded_total, shard_size)), trace,
        planner=planner, release_policy=release_policy, prefetch_limiter=prefetch_limiter)
    meta = has_meta_tensors(model)
    if meta:
        check_materializable(model, param_init_fn)
        if init_seed is not None:
            check_int("init_seed", init_seed)
    # the last check, and the first collective: every rank got the same model and settings
    summary = summarize(
        model, config, world=world, shard_size=shard_size, hpz_size=hpz_size, training=optimizer is not None,
        leaves=leaves, units=units.roots,
        policies=policies, derived_knobs=None if plan is None else knobs,
        # the seed and the init function matter only where tensors are made on every rank
        init_seed=init_seed if meta else None, param_init_fn=param_init_fn if meta else None,
    )
    rank0_seed = agree_at_init(summary, process_group, device)
    tell((*notes, *units.notes()), dist.get_rank(process_group))
    meta_init = MetaInit(param_init_fn, rank0_seed if init_seed is None else init_seed) if meta else MetaInit(None, 0)
    # after the agreement: every rank builds the same mesh, over a group of the engine's own (see zero3.ranks.topology)
    topology = topology_for(engine_group(process_group), device_mesh, shard_size, device.type, hpz_size)
    adopt_sharded_copies(model)  # a copy of a sharded model: its whole values (collective, after the agreement)
    parts = assemble(model, optimizer, config, topology, device, leaves, units, policies, plan, meta_init, stream_pairs)
    engine = Zero3Engine(parts)
    mark_sharded(model)
    return engine


def _read_config(
    model: nn.Module, config: object, auto: TrainingValues | None, world: int
) -> tuple[Zero3Config, tuple[str, ...]]:
    """``config`` as a ``Zero3Config``, and the notes to print about a DeepSpeed JSON."""
    if isinstance(config, (Mapping, str, os.PathLike)):
        # "auto" size knobs come from the model's hidden size, where it says one (a Hugging Face config)
        hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        read = read_deepspeed(config, hidden_size=hidden_size if is_int(hidden_size) else None, auto=auto, world=world)
        return Zero3Config(**read.knobs), read.notes
    if auto is not None:
        raise TypeError("auto= fills the \"auto\" values of a DeepSpeed config; pass the DeepSpeed config (a dict or a "
                        "JSON file path) as config=, or drop auto=")
    if config is None:
        return Zero3Config(), ()
    if not isinstance(config, Zero3Config):
        raise TypeError(
            f"config must be a Zero3Config, or a DeepSpeed config dict or JSON file path, got {type(config).__name__}")
    return config, ()


def _optimizer_factory(factory: OptimizerFactory | None, config: Zero3Config) -> OptimizerFactory | None:
    """The user's factory, or the one the DeepSpeed config names (never both)."""
    if factory is not None and config.optimizer is not None:
        raise ValueError(
            "both an optimizer factory and the DeepSpeed config's optimizer section were given; pass one: "
            "optimizer=None to use the config's, or remove the optimizer section to use the factory")
    if factory is None and config.optimizer is None and config.lr_scheduler is not None:
        raise ValueError(
            "the DeepSpeed config has a scheduler section but no optimizer to schedule: add an optimizer section "
            "or pass an optimizer factory (or remove the scheduler section for an engine that only runs forwards)")
    return factory if factory is not None else config.optimizer


def _choose_units(
    model: nn.Module, rule: UnitRule, leaves: list[nn.Module], config: Zero3Config, max_live: int
) -> UnitChoice:
    return choose_units(model, rule, leaves, granularity_threshold=config.module_granularity_threshold,
                        max_live_parameters=max_live)


def _plan_budget(
    model: nn.Module, config: Zero3Config, leaves: list[nn.Module], units: UnitChoice, world: int
) -> MemoryPlan | None:
    """The knobs ``config.memory_budget`` stands for on this model, if it is set."""
    if config.memory_budget is None:
        return None
    params = [p for _, p in model.named_parameters()]
    groups = fetch_groups(model, params, leaves, units.roots)
    return plan_memory(
        config.memory_budget,
        model_numel=sum(p.numel() for p in params),
        element_size=config.torch_dtype.itemsize,
        largest_fetch_numel=max(sum(params[p].numel() for p in pids) for pids in groups.values()),
        persistent_numel=sum(p.numel() for p in params if p.numel() < config.param_persistence_threshold),
        world=world,
        buckets=MAX_FLIGHTS + 1 if config.overlap_comm else 1,
    )
