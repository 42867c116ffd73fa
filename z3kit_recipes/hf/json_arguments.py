"""A DeepSpeed JSON's numbers against the ``TrainingArguments`` that fill its ``"auto"``.

Hugging Face's DeepSpeed integration (``HfTrainerDeepSpeedConfig``) fills
each ``"auto"`` of the JSON from a ``TrainingArguments`` field, and refuses
a number written in the JSON that disagrees with the field, listing every
disagreement in one error. ``Zero3Trainer`` does the same, in the names the
user set (``adam_beta2``, ``learning_rate``, ``per_device_train_batch_size``),
at construction, for the optimizer's and the scheduler's keys alike. Two
numbers depend on the number of training steps
(``scheduler.params.total_num_steps``, and ``warmup_num_steps`` when
``warmup_steps`` is a ratio): they are checked at construction when
``max_steps`` gives it, else when ``train()`` builds the schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import TrainingArguments

from z3kit_recipes.zero3.config.auto import AUTO

Path = tuple[str, ...]


def expected(args: TrainingArguments, num_training_steps: int | None) -> dict[Path, tuple[Any, dict[str, Any]]]:
    """JSON key path -> (the value the arguments give it, those arguments by name),
    for every key the Trainer fills; the step-count ones only where ``num_training_steps`` is known."""
    lr = {"learning_rate": args.learning_rate}
    out: dict[Path, tuple[Any, dict[str, Any]]] = {
        ("train_micro_batch_size_per_gpu",): (args.per_device_train_batch_size,
                                              {"per_device_train_batch_size": args.per_device_train_batch_size}),
        ("gradient_accumulation_steps",): (args.gradient_accumulation_steps,
                                           {"gradient_accumulation_steps": args.gradient_accumulation_steps}),
        ("gradient_clipping",): (float(args.max_grad_norm), {"max_grad_norm": args.max_grad_norm}),
        ("bf16", "enabled"): (bool(args.bf16), {"bf16": bool(args.bf16)}),
        ("fp16", "enabled"): (bool(args.fp16), {"fp16": bool(args.fp16)}),
        ("optimizer", "params", "lr"): (args.learning_rate, lr),
        ("optimizer", "params", "betas"): ((args.adam_beta1, args.adam_beta2),
                                           {"adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2}),
        ("optimizer", "params", "eps"): (args.adam_epsilon, {"adam_epsilon": args.adam_epsilon}),
        ("optimizer", "params", "weight_decay"): (args.weight_decay, {"weight_decay": args.weight_decay}),
        ("scheduler", "params", "warmup_max_lr"): (args.learning_rate, lr),
    }
    steps = num_training_steps if num_training_steps is not None else (args.max_steps if args.max_steps > 0 else None)
    # warmup_steps >= 1 is a number of steps, 0 none, between them a ratio of the steps (TrainingArguments.get_warmup_steps)
    if steps is not None or args.warmup_steps >= 1 or args.warmup_steps == 0:
        warmup = args.get_warmup_steps(steps or 0)
        out[("scheduler", "params", "warmup_num_steps")] = (warmup, {"warmup_steps": args.warmup_steps})
    if steps is not None:
        named = ({"max_steps": args.max_steps} if args.max_steps > 0
                 else {"training steps (num_train_epochs x the data)": steps})
        out[("scheduler", "params", "total_num_steps")] = (steps, named)
    return out


def mismatches(ds: Mapping[str, Any], args: TrainingArguments, num_training_steps: int | None = None) -> list[str]:
    """Every number written in ``ds`` that disagrees with the ``TrainingArguments`` that would fill it,
    each naming the arguments that differ ("optimizer.params.betas is [0.9, 0.95] but adam_beta2=0.999")."""
    out = []
    for path, (value, named) in expected(args, num_training_steps).items():
        holder: Any = ds
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, Mapping) else None
        if not isinstance(holder, Mapping) or path[-1] not in holder or holder[path[-1]] == AUTO:
            continue
        written = holder[path[-1]]
        differing = _differing(written, value, named)
        if differing:
            out.append(f"{'.'.join(path)} is {written!r} but {', '.join(f'{k}={v!r}' for k, v in differing.items())}")
    return out


def check_against_arguments(
    ds: Mapping[str, Any], args: TrainingArguments, num_training_steps: int | None = None
) -> None:
    """Raise one error listing every disagreement (``mismatches``), as Hugging Face's integration does."""
    found = mismatches(ds, args, num_training_steps)
    if found:
        raise ValueError(
            f"the DeepSpeed JSON disagrees with TrainingArguments: {'; '.join(found)}. Make each pair agree (change the "
            "TrainingArguments or the JSON), or write \"auto\" in the JSON for Zero3Trainer to fill from TrainingArguments")


def _differing(written: Any, value: Any, named: dict[str, Any]) -> dict[str, Any]:
    """The arguments in ``named`` that disagree with ``written`` (all of them for a single value)."""
    if isinstance(value, tuple):  # betas: name the beta that differs
        if not isinstance(written, (list, tuple)) or len(written) != len(value):
            return named
        try:
            return {k: v for (k, v), w in zip(named.items(), written) if float(w) != float(v)}
        except (TypeError, ValueError):
            return named
    return named if bool(written != value) else {}
