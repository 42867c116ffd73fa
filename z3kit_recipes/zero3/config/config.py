"""Zero3Config: the stock runtime's knobs, with DeepSpeed's names and defaults.

``Zero3Config.from_deepspeed`` reads a DeepSpeed configuration (a dict or
a JSON file) so that a DeepSpeed user brings their config unchanged
(``z3kit_recipes.zero3.config.deepspeed_json``): keys that would change the
result and that z3kit does not implement are refused by name rather than
silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from z3kit.validate import bool_validator, int_validator, is_number, number_validator
from z3kit_recipes.zero3.config.deepspeed_json import read_deepspeed, tell
from z3kit_recipes.zero3.config.json_muon import JsonMuon
from z3kit_recipes.zero3.config.json_optimizer import JsonOptimizer
from z3kit_recipes.zero3.config.loss_scale import LossScaleConfig
from z3kit_recipes.zero3.config.lr_schedules import WarmupSchedule
from z3kit_recipes.zero3.config.monitor import MonitorConfig
from z3kit_recipes.zero3.config.offload import OffloadConfig
from z3kit_recipes.zero3.config.training_values import TrainingValues


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _dtype_name(value: Any) -> str:
    if isinstance(value, torch.dtype):
        for name, dtype in _DTYPES.items():
            if dtype == value:
                return name
    if isinstance(value, str) and value in _DTYPES:
        return value
    raise ValueError(f"Zero3Config.compute_dtype must be one of {sorted(_DTYPES)} (or the torch dtype), got {value!r}")


@attrs.frozen(kw_only=True)
class Zero3Config:
    """Configuration of the stock ZeRO-3 runtime. Sizes count elements.

    The first nine fields carry DeepSpeed's meaning, and its default except
    for ``gradient_clipping``: 0.0 here, which means no clipping, where
    DeepSpeed's default clips the global norm at 1.0 (set 1.0 to clip as it
    does; ``from_deepspeed`` does, for a JSON that leaves it out).
    ``prefetch_bucket_size`` caps one prefetch; ``max_live_parameters``
    caps gathered elements (a running module's own fetch is never refused);
    ``max_reuse_distance`` keeps a parameter gathered at module exit when
    the trace says it is used again within that many elements;
    parameters under ``param_persistence_threshold`` elements are gathered
    once and kept; ``reduce_bucket_size`` is the gradient bucket;
    ``overlap_comm`` runs gathers and reductions asynchronously;
    ``contiguous_gradients`` reduces through the flat bucket (False reduces
    each gradient by its own collective); ``gradient_accumulation_steps``
    micro-steps make one optimizer step; ``gradient_clipping`` is the
    global-norm limit (0 disables).
    """

    prefetch_bucket_size: int = attrs.field(default=50_000_000, validator=int_validator(at_least=0))
    max_live_parameters: int = attrs.field(default=1_000_000_000, validator=int_validator(at_least=0))
    max_reuse_distance: int = attrs.field(default=1_000_000_000, validator=int_validator(at_least=0))
    param_persistence_threshold: int = attrs.field(default=100_000, validator=int_validator(at_least=0))
    reduce_bucket_size: int = attrs.field(default=500_000_000, validator=int_validator(at_least=1))
    overlap_comm: bool = attrs.field(default=True, validator=bool_validator())
    contiguous_gradients: bool = attrs.field(default=True, validator=bool_validator())
    gradient_accumulation_steps: int = attrs.field(default=1, validator=int_validator(at_least=1))
    gradient_clipping: float = attrs.field(default=0.0, validator=number_validator(at_least=0.0))
    #: "fp32", "bf16" or "fp16" (parameters, gathers and reductions in that dtype; fp32 master shards and
    #: gradient partitions); fp16 scales the loss (``loss_scaling``, ``zero3.training.loss_scale``)
    compute_dtype: str = attrs.field(default="fp32", converter=_dtype_name)
    #: fp16 loss scaling, DeepSpeed's ``fp16`` keys (``zero3.config.loss_scale``); only with compute_dtype "fp16"
    loss_scaling: LossScaleConfig = attrs.field(factory=LossScaleConfig)
    #: reduce-scatter the gradient buckets, else all-reduce them and keep this rank's slices (None: on nccl
    #: and hccl yes; on gloo no: its reduce-scatter, an all-to-all there (``z3kit.collectives``), holds a
    #: second buffer of the bucket's size while it runs, and was not steadily faster end to end)
    reduce_scatter: bool | None = attrs.field(default=None)
    #: DeepSpeed's ``stage3_module_granularity_threshold``: above 0, the fetch units are the outermost
    #: modules whose elements per module with parameters are at most this (``zero3.training.unit_rule``)
    #: instead of the blocks of each stack; 0: the blocks (or ``initialize``'s ``fetch_units``)
    module_granularity_threshold: int = attrs.field(default=0, validator=int_validator(at_least=0))
    #: gathers in flight at once (demand fetches included)
    max_inflight_gathers: int = attrs.field(default=2, validator=int_validator(at_least=1))
    #: seconds a collective may wait for the other ranks before the engine gives up and
    #: names the ranks that did not answer; it must be shorter than the process group's own
    #: timeout (after which NCCL's watchdog ends the process with a message of its own).
    #: None: 90% of the process group's timeout (1800 s where torch does not tell it)
    collective_timeout_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(number_validator(above=0.0)))
    #: rank 0's buffers (BatchNorm statistics) are broadcast to every rank before
    #: each training forward, as DDP's ``broadcast_buffers=True`` does
    broadcast_buffers: bool = attrs.field(default=True, validator=bool_validator())
    #: debugging: the ranks agree on every fetch of a training step, forward and backward,
    #: before gathering, so a divergence is named where it starts (one small collective a
    #: fetch); the environment variable ``Z3KIT_CHECK_EVERY_FETCH=1`` turns it on as well
    check_every_fetch: bool = attrs.field(default=False, validator=bool_validator())
    #: rank-divergent graphs (a data-dependent early exit, a per-expert MoE without a leaf
    #: unit): every gather is a round in which the ranks gather the union of what any needs
    #: (``zero3.training.rounds``): such graphs train at DDP parity, at a collective per fetch
    divergent_graphs: bool = attrs.field(default=False, validator=bool_validator())
    #: bytes per rank for gathered parameters and gradient buckets (an int), or a
    #: fraction in (0, 1] of the model's size in the compute dtype (a float); the
    #: runtime derives the four knobs of ``BUDGET_DERIVED`` from it for the model
    #: at hand (see ``z3kit_recipes.zero3.config.budget``). None: use the knobs as given.
    memory_budget: int | float | None = attrs.field(default=None)
    #: the micro batch per rank (DeepSpeed's ``train_micro_batch_size_per_gpu``): a training
    #: forward whose first tensor argument has another batch size (dim 0) is refused. None: any
    micro_batch_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_validator(at_least=1)))
    #: the optimizer a DeepSpeed JSON names (built on the master shards when ``initialize``
    #: gets no factory); None: the factory's, or none
    optimizer: JsonOptimizer | JsonMuon | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of((JsonOptimizer, JsonMuon))))
    #: the learning-rate schedule a DeepSpeed JSON names (``engine.lr_scheduler``, stepped
    #: after each optimizer step)
    lr_scheduler: WarmupSchedule | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(WarmupSchedule)))
    #: the optimizer's fp32 masters and state in host memory, stepped there (``zero3.training.offload``);
    #: DeepSpeed's ``offload_optimizer``. None: on the device
    offload_optimizer: OffloadConfig | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(OffloadConfig)))
    #: HSDP (DeepSpeed's MiCS): parameters sharded within groups of this many ranks and replicated
    #: across the groups (``zero3.ranks.topology``); it must divide the world size. "node": one
    #: node per shard group (torchrun's ``LOCAL_WORLD_SIZE``). None: flat, every rank one shard
    mics_shard_size: int | str | None = attrs.field(default=None)
    #: hpZ (ZeRO++ hierarchical partitioning, DeepSpeed's ``zero_hpz_partition_size``): flat ZeRO-3, plus a
    #: secondary slice of each parameter within groups of this many ranks (one node), so that backward's
    #: gathers stay within them (``zero3.training.secondary``). "node": torchrun's ``LOCAL_WORLD_SIZE``.
    #: None or 1: off
    hpz_partition_size: int | str | None = attrs.field(default=None)
    #: where rank 0 writes the training loss, learning rate (and fp16 loss scale) at each optimizer
    #: step: DeepSpeed's ``tensorboard`` and ``csv_monitor`` sections (``zero3.runtime.monitor``)
    monitors: tuple[MonitorConfig, ...] = attrs.field(
        default=(), converter=tuple, validator=attrs.validators.deep_iterable(attrs.validators.instance_of(MonitorConfig)))
    #: every this many optimizer steps rank 0 logs DeepSpeed's progress line, ``[Rank 0] step=N, skipped=S,
    #: lr=[...], mom=[...]``, at INFO on the ``z3kit`` logger, printed to stdout (``zero3.runtime.progress``);
    #: DeepSpeed's ``steps_per_print``. None: never
    steps_per_print: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_validator(at_least=1)))

    @mics_shard_size.validator
    @hpz_partition_size.validator
    def _check_group_size(self, attribute: attrs.Attribute[int | str | None], value: int | str | None) -> None:
        if value is None or value == "node":
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Zero3Config.{attribute.name} must be a positive int (ranks per group), \"node\" "
                             f"or None (off), got {value!r}")

    @memory_budget.validator
    def _check_memory_budget(self, attribute: attrs.Attribute[int | float | None], value: int | float | None) -> None:
        if value is None:
            return
        if not is_number(value):
            raise TypeError(
                f"Zero3Config.memory_budget must be bytes (an int) or a fraction of the model (a float), "
                f"got {type(value).__name__}"
            )
        if isinstance(value, int) and value < 1:
            raise ValueError(f"Zero3Config.memory_budget in bytes must be >= 1, got {value}")
        if isinstance(value, float) and not 0.0 < value <= 1.0:
            raise ValueError(
                f"Zero3Config.memory_budget as a fraction of the model must be in (0, 1], got {value}; "
                "give bytes as an int"
            )
        changed = [name for name in BUDGET_DERIVED if getattr(self, name) != _DEFAULTS[name]]
        if changed:
            raise ValueError(
                f"Zero3Config.memory_budget derives {', '.join(BUDGET_DERIVED)}; "
                f"do not also set {', '.join(changed)} (drop them, or drop memory_budget)"
            )

    @loss_scaling.validator
    def _check_loss_scaling(self, attribute: attrs.Attribute[LossScaleConfig], value: LossScaleConfig) -> None:
        if not isinstance(value, LossScaleConfig):
            raise TypeError(f"Zero3Config.loss_scaling must be a LossScaleConfig, got {type(value).__name__}")
        if value != LossScaleConfig() and self.compute_dtype != "fp16":
            raise ValueError(f"Zero3Config.loss_scaling applies to fp16 only, and compute_dtype is "
                             f"{self.compute_dtype!r}: set compute_dtype=\"fp16\", or drop loss_scaling")

    @reduce_scatter.validator
    def _check_reduce_scatter(self, attribute: attrs.Attribute[bool | None], value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"Zero3Config.reduce_scatter must be a bool or None, got {type(value).__name__}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.compute_dtype]

    @property
    def checks_every_fetch(self) -> bool:
        """``check_every_fetch``, or the environment's ``Z3KIT_CHECK_EVERY_FETCH``."""
        return self.check_every_fetch or os.environ.get(CHECK_EVERY_FETCH_ENV, "0") not in ("", "0")

    @classmethod
    def from_deepspeed(
        cls,
        config: Mapping[str, Any] | str | os.PathLike[str],
        *,
        hidden_size: int | None = None,
        auto: TrainingValues | None = None,
        world: int | None = None,
    ) -> Zero3Config:
        """Read a DeepSpeed config dict, or the path of its JSON file, as
        ``zero3.config.deepspeed_json`` says: Hugging Face's documented
        ZeRO-3 JSON unedited. ``"auto"`` on a size knob is filled from the
        model's ``hidden_size`` (``zero3.config.auto``), any other from
        ``auto`` (a ``TrainingValues``); ``world`` relates the batch sizes
        as DeepSpeed does (``zero3.initialize`` passes it). Keys that change
        nothing in z3kit are accepted and listed in one warning (on rank 0
        where torch.distributed is up); keys that would change the result
        and that z3kit does not implement are refused by name. A knob the
        config leaves out keeps ``Zero3Config``'s default, except
        ``gradient_clipping``: DeepSpeed's default, 1.0, said in a warning.
        """
        read = read_deepspeed(config, hidden_size=hidden_size, auto=auto, world=world)
        made = cls(**read.knobs)
        tell(read.notes, dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
        return made


#: the environment variable that turns ``check_every_fetch`` on for a run, whatever the code says
CHECK_EVERY_FETCH_ENV = "Z3KIT_CHECK_EVERY_FETCH"
#: the knobs that ``memory_budget`` derives, when it is set
BUDGET_DERIVED = ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance", "reduce_bucket_size")
_DEFAULTS = {f.name: f.default for f in attrs.fields(Zero3Config)}

