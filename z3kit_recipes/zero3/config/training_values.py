"""``TrainingValues``: what a training script knows and a DeepSpeed JSON leaves as ``"auto"``.

Hugging Face's documented ZeRO-3 JSON writes ``"auto"`` for every value
its Trainer knows from ``TrainingArguments`` (learning rate, batch sizes,
clipping, precision, warmup); the Trainer fills them in before DeepSpeed
reads the file. ``zero3.initialize(..., config=ds_json, auto=TrainingValues(...))``
does the same from these fields (``zero3.config.deepspeed_json`` says which
key each one fills). A field left None fills nothing: an ``"auto"`` that
needs it is refused, naming the key and the field.
"""

from __future__ import annotations

from typing import Any

import attrs

from z3kit.validate import check_number


def _optional(validator: Any) -> Any:
    return attrs.validators.optional(validator)


def _positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"TrainingValues.{attribute.name} must be an int, got {type(value).__name__}")
    if value < (0 if attribute.name == "warmup_steps" else 1):
        raise ValueError(f"TrainingValues.{attribute.name} must be >= {0 if attribute.name == 'warmup_steps' else 1}, "
                         f"got {value}")


def _number(*, at_least: float | None = None, above: float | None = None) -> Any:
    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_number(f"TrainingValues.{attribute.name}", value, at_least=at_least, above=above)

    return validate


def _flag(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"TrainingValues.{attribute.name} must be a bool, got {type(value).__name__}")


def _betas(value: Any) -> Any:
    # JSON and argparse give lists; a tuple compares equal to what the optimizer keeps
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen(kw_only=True)
class TrainingValues:
    """The values that fill a DeepSpeed JSON's ``"auto"`` (Hugging Face
    ``TrainingArguments`` names in brackets). Every field is optional."""

    #: optimizer ``lr``, scheduler ``warmup_max_lr`` (``learning_rate``)
    lr: float | None = attrs.field(default=None, validator=_optional(_number(above=0.0)))
    #: optimizer ``betas`` (``adam_beta1``, ``adam_beta2``)
    betas: tuple[float, float] | None = attrs.field(default=None, converter=_betas)
    #: optimizer ``eps`` (``adam_epsilon``)
    eps: float | None = attrs.field(default=None, validator=_optional(_number(above=0.0)))
    #: optimizer ``weight_decay`` (``weight_decay``)
    weight_decay: float | None = attrs.field(default=None, validator=_optional(_number(at_least=0.0)))
    #: scheduler ``warmup_num_steps`` (``warmup_steps``)
    warmup_steps: int | None = attrs.field(default=None, validator=_optional(_positive_int))
    #: scheduler ``total_num_steps`` (``max_steps``): optimizer steps of the whole run
    total_steps: int | None = attrs.field(default=None, validator=_optional(_positive_int))
    #: ``train_micro_batch_size_per_gpu`` (``per_device_train_batch_size``)
    micro_batch_size: int | None = attrs.field(default=None, validator=_optional(_positive_int))
    #: ``gradient_accumulation_steps`` (``gradient_accumulation_steps``)
    gradient_accumulation_steps: int | None = attrs.field(default=None, validator=_optional(_positive_int))
    #: ``gradient_clipping`` (``max_grad_norm``; 0 turns clipping off)
    max_grad_norm: float | None = attrs.field(default=None, validator=_optional(_number(at_least=0.0)))
    #: ``bf16.enabled`` (``bf16``)
    bf16: bool | None = attrs.field(default=None, validator=_optional(_flag))
    #: ``fp16.enabled`` (``fp16``); True trains in fp16 with loss scaling
    fp16: bool | None = attrs.field(default=None, validator=_optional(_flag))

    @betas.validator
    def _check_betas(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, tuple) or len(value) != 2:
            raise TypeError(f"TrainingValues.betas must be two numbers (beta1, beta2), got {value!r}")
        for beta in value:
            if not check_number("TrainingValues.betas", beta, at_least=0.0) < 1.0:
                raise ValueError(f"TrainingValues.betas must be in [0, 1), got {value!r}")
