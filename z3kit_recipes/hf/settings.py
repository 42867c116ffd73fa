"""What ``Zero3Trainer`` takes from ``TrainingArguments``, and what it refuses.

The engine's configuration and optimizer come from the Trainer's own
settings, read the way Trainer reads them: the optimizer class and its
arguments from ``args.optim`` (``Trainer.get_optimizer_cls_and_kwargs``),
weight decay on the parameters ``Trainer.get_decay_parameter_names``
names (no decay on biases and norms), clipping at ``max_grad_norm``.
Settings that would bypass the engine or hand it a model it cannot keep
sharded are refused by name before anything is built.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from z3kit_recipes import zero3
from z3kit_recipes.hf.json_arguments import check_against_arguments
from z3kit_recipes.zero3.config import deepspeed_json
from z3kit_recipes.zero3.config.lr_schedules import WarmupSchedule

#: why fp16 is refused, and what to use instead
FP16_REFUSED = (
    "fp16 (TrainingArguments(fp16=True), the DeepSpeed JSON's fp16.enabled, or Zero3Config(compute_dtype='fp16')): "
    "fp16 training needs the loss multiplied by the engine's dynamic loss scale, which engine.backward(loss) does, "
    "and Trainer backs the loss through Accelerate's own path instead; use bf16=True (bf16 needs no loss scale; "
    "with a DeepSpeed JSON write \"bf16\": {\"enabled\": \"auto\"} and \"fp16\": {\"enabled\": false}), or train "
    "fp16 in your own loop: engine = zero3.initialize(model, config=ds_json) with the JSON's fp16 section, then "
    "engine.backward(loss) and engine.step()"
)
#: optimizer arguments that need the model itself (GaLore, LOMO, layer-wise): not buildable on shards
_MODEL_BOUND_KWARGS = ("params", "model", "optimizer_dict")


def refuse_unsupported(args: TrainingArguments, optimizer: Any, scheduler: Any) -> None:
    """Raise naming every setting the engine cannot honour, with what to do instead."""
    problems = []
    if optimizer is not None or scheduler is not None:
        problems.append("optimizers=(...) was given: Zero3Trainer builds the optimizer on the engine's shards from "
                        "TrainingArguments (optim, learning_rate, weight_decay, adam_*); pass none")
    if args.deepspeed or args.fsdp:
        problems.append("TrainingArguments(deepspeed=... or fsdp=...) selects another runtime: remove it and pass a "
                        "DeepSpeed JSON as Zero3Trainer(z3kit_config=...)")
    if args.fp16:
        problems.append(FP16_REFUSED)
    if args.fp16_full_eval or args.bf16_full_eval:
        problems.append("fp16_full_eval/bf16_full_eval: the shards keep the dtype they train in; evaluate in it "
                        "(bf16=True trains and evaluates in bf16)")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size re-creates the model on a failure; set the batch size")
    if not getattr(args.accelerator_config, "even_batches", True):
        problems.append("accelerator_config.even_batches=False: every rank must run the same number of eval batches, "
                        "since each forward gathers parameters collectively")
    if problems:
        raise ValueError("Zero3Trainer cannot run with: " + "; ".join(problems))


def training_values(args: TrainingArguments) -> zero3.TrainingValues:
    """What fills a DeepSpeed JSON's ``"auto"``, from the arguments Trainer fills it from."""
    return zero3.TrainingValues(
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        weight_decay=args.weight_decay, micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=float(args.max_grad_norm),
        bf16=bool(args.bf16), fp16=bool(args.fp16))


@attrs.frozen
class EngineSettings:
    """The engine's configuration, and the DeepSpeed JSON's ``scheduler`` section (built by
    ``Zero3Trainer.create_scheduler`` once Trainer knows the number of steps)."""

    config: zero3.Zero3Config
    json_scheduler: Mapping[str, Any] | None = None


def engine_settings(
    given: zero3.Zero3Config | Mapping[str, Any] | str | os.PathLike[str] | None, args: TrainingArguments,
    model: nn.Module,
) -> EngineSettings:
    """The engine's configuration. Trainer owns the accumulation window (the engine steps each
    time Trainer's window ends, so it accumulates over one micro-step) and the batches; a
    ``Zero3Config`` clips at ``max_grad_norm``, a DeepSpeed JSON as DeepSpeed would."""
    if given is None or isinstance(given, zero3.Zero3Config):
        config = zero3.Zero3Config() if given is None else given
        if config.gradient_accumulation_steps not in (1, args.gradient_accumulation_steps):
            raise ValueError(
                f"the z3kit config accumulates over {config.gradient_accumulation_steps} micro-steps and "
                f"TrainingArguments over {args.gradient_accumulation_steps}: set it in TrainingArguments only")
        if config.compute_dtype == "fp16":
            raise ValueError(f"Zero3Trainer cannot run with: {FP16_REFUSED}")
        if config.gradient_clipping not in (0.0, args.max_grad_norm):
            raise ValueError(
                f"the z3kit config clips at {config.gradient_clipping} and TrainingArguments at {args.max_grad_norm}: "
                "set max_grad_norm in TrainingArguments only")
        return EngineSettings(attrs.evolve(config, gradient_accumulation_steps=1,
                                           gradient_clipping=float(args.max_grad_norm)))
    ds = deepspeed_json.load(given)
    fp16 = ds.get("fp16")
    if isinstance(fp16, Mapping) and fp16.get("enabled") is True:
        raise ValueError(f"Zero3Trainer cannot run with: {FP16_REFUSED}")
    # every number that disagrees with the arguments, the scheduler's too, in the arguments' names, at once
    check_against_arguments(ds, args)
    scheduler = ds.pop("scheduler", None)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    # "auto" filled (and numbers checked) against the arguments, batch sizes related over the ranks
    read = deepspeed_json.read_deepspeed(ds, hidden_size=hidden if isinstance(hidden, int) else None,
                                         auto=training_values(args), world=args.world_size)
    deepspeed_json.tell(read.notes, args.process_index)
    config = zero3.Zero3Config(**read.knobs)
    return EngineSettings(attrs.evolve(config, gradient_accumulation_steps=1, micro_batch_size=None), scheduler)


def json_schedule(section: Mapping[str, Any], args: TrainingArguments, num_training_steps: int) -> WarmupSchedule:
    """The JSON's ``scheduler`` section with its ``"auto"`` filled as Trainer fills it for DeepSpeed."""
    check_against_arguments({"scheduler": section}, args, num_training_steps)  # the step counts, now known
    values = zero3.TrainingValues(lr=args.learning_rate, warmup_steps=args.get_warmup_steps(num_training_steps),
                                  total_steps=num_training_steps)
    read = deepspeed_json.read_deepspeed({"scheduler": section, "gradient_clipping": 0.0}, auto=values)
    schedule: WarmupSchedule = read.knobs["lr_scheduler"]
    return schedule


def trainer_optimizer_factory(trainer: Trainer, model: nn.Module) -> Callable[[zero3.MasterShards], torch.optim.Optimizer]:
    """The optimizer Trainer would build, built on the engine's shards: ``args.optim``'s class and
    arguments, weight decay on the parameters Trainer decays, none on the rest (by name, so
    parameters unfrozen later, offered to the factory again, are grouped the same way)."""
    args = trainer.args
    decay = set(trainer.get_decay_parameter_names(model))
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]  # any module
    bound = [k for k in _MODEL_BOUND_KWARGS if k in kwargs]
    if bound:
        raise ValueError(f"optim={args.optim!r} needs the model itself ({', '.join(bound)}), which the engine keeps "
                         "sharded: choose an optimizer that takes parameter groups (adamw_torch, sgd, adafactor, ...)")

    def build(shards: zero3.MasterShards) -> torch.optim.Optimizer:
        named = shards.named()
        groups = [
            {"params": [s for n, s in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [s for n, s in named if n not in decay], "weight_decay": 0.0},
        ]
        optimizer: torch.optim.Optimizer = cls([g for g in groups if g["params"]], **kwargs)
        return optimizer

    return build
