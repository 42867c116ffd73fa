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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from z3kit_recipes import zero3

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
    if args.fp16 or args.fp16_full_eval or args.bf16_full_eval:
        problems.append("fp16/fp16_full_eval/bf16_full_eval: the engine has no fp16 loss scaling and its shards keep "
                        "their dtype; use bf16=True (or Zero3Config(compute_dtype='bf16'))")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size re-creates the model on a failure; set the batch size")
    if not getattr(args.accelerator_config, "even_batches", True):
        problems.append("accelerator_config.even_batches=False: every rank must run the same number of eval batches, "
                        "since each forward gathers parameters collectively")
    if problems:
        raise ValueError("Zero3Trainer cannot run with: " + "; ".join(problems))


def engine_config(
    given: zero3.Zero3Config | Mapping[str, Any] | str | os.PathLike[str] | None, args: TrainingArguments,
    model: nn.Module,
) -> zero3.Zero3Config:
    """The engine's configuration: Trainer owns the accumulation window (the engine steps each
    time Trainer's window ends) and clips at ``max_grad_norm``."""
    if given is None:
        config = zero3.Zero3Config()
    elif isinstance(given, zero3.Zero3Config):
        config = given
    else:
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        config = zero3.Zero3Config.from_deepspeed(given, hidden_size=hidden if isinstance(hidden, int) else None)
    if config.gradient_accumulation_steps not in (1, args.gradient_accumulation_steps):
        raise ValueError(
            f"the z3kit config accumulates over {config.gradient_accumulation_steps} micro-steps and TrainingArguments "
            f"over {args.gradient_accumulation_steps}: set gradient_accumulation_steps in TrainingArguments only"
        )
    if config.gradient_clipping not in (0.0, args.max_grad_norm):
        raise ValueError(
            f"the z3kit config clips at {config.gradient_clipping} and TrainingArguments at {args.max_grad_norm}: "
            "set max_grad_norm in TrainingArguments only"
        )
    return attrs.evolve(config, gradient_accumulation_steps=1, gradient_clipping=float(args.max_grad_norm))


def trainer_optimizer_factory(trainer: Trainer, model: nn.Module) -> Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer]:
    """The optimizer Trainer would build, built on the engine's shards: ``args.optim``'s class and
    arguments, weight decay on the parameters Trainer decays, none on the rest."""
    args = trainer.args
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    decay = set(trainer.get_decay_parameter_names(model))
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]  # any module
    bound = [k for k in _MODEL_BOUND_KWARGS if k in kwargs]
    if bound:
        raise ValueError(f"optim={args.optim!r} needs the model itself ({', '.join(bound)}), which the engine keeps "
                         "sharded: choose an optimizer that takes parameter groups (adamw_torch, sgd, adafactor, ...)")

    def build(shards: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        # the shards come in the model's parameter order, trainable ones only: the names above
        if len(shards) != len(names):
            raise RuntimeError(f"the engine handed {len(shards)} shards for {len(names)} trainable parameters")
        groups = [
            {"params": [s for n, s in zip(names, shards) if n in decay], "weight_decay": args.weight_decay},
            {"params": [s for n, s in zip(names, shards) if n not in decay], "weight_decay": 0.0},
        ]
        optimizer: torch.optim.Optimizer = cls([g for g in groups if g["params"]], **kwargs)
        return optimizer

    return build
