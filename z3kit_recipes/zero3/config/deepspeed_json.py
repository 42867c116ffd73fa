"""A DeepSpeed JSON, read as DeepSpeed reads it: ``Zero3Config`` keyword arguments.

A DeepSpeed user's JSON (Hugging Face's documented ``ds_config_zero3.json``
among them) works unedited:

- ``"auto"`` is filled as Hugging Face's Trainer fills it
  (``integrations/deepspeed.py``): the size knobs from the model's hidden
  size (``zero3.config.auto``), everything else from a ``TrainingValues``
  (:data:`FILLED_BY` says which field fills which key). A JSON number that
  disagrees with a given field is refused, as the Trainer refuses it;
- keys that change nothing in z3kit are accepted and listed in one note
  (``zero3.config.deepspeed_keys`` says why for each; ``offload_param``
  to the CPU: z3kit does not offload parameters, so memory is higher);
- ``tensorboard`` and ``csv_monitor``, enabled, are ``Zero3Config.monitors``;
- ``offload_optimizer`` to the CPU becomes ``Zero3Config.offload_optimizer``
  (``zero3.config.offload``): the optimizer steps on the host;
- ``zero_optimization.mics_shard_size`` is HSDP (``Zero3Config.mics_shard_size``;
  DeepSpeed's default, -1, is off); ``zero_hpz_partition_size`` is hpZ
  (``Zero3Config.hpz_partition_size``; DeepSpeed's default, 1, is off);
- keys that would change the result and that z3kit does not implement are
  refused by name;
- the batch sizes are related as DeepSpeed relates them
  (``train_batch_size = micro * accumulation * world``, the missing one
  derived), and the micro batch is checked against the data;
- ``gradient_clipping`` left out means DeepSpeed's default, 1.0.

The notes are returned, not printed: the caller knows its rank (:func:`tell`).
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any, Final

import attrs

from z3kit.validate import check_int
from z3kit_recipes.zero3.config import deepspeed_keys as keys
from z3kit_recipes.zero3.config.auto import AUTO, resolve_auto
from z3kit_recipes.zero3.config.json_muon import optimizer_from_json
from z3kit_recipes.zero3.config.loss_scale import LossScaleConfig
from z3kit_recipes.zero3.config.lr_schedules import WarmupSchedule
from z3kit_recipes.zero3.config.monitor import MonitorConfig
from z3kit_recipes.zero3.config.offload import OffloadConfig
from z3kit_recipes.zero3.config.training_values import TrainingValues
from z3kit_recipes.zero3.config.unsupported_keys import refusal

#: DeepSpeed's ``GRADIENT_CLIPPING_DEFAULT`` (``deepspeed/runtime/constants.py``)
DEEPSPEED_GRADIENT_CLIPPING: Final = 1.0

#: JSON key path -> the ``TrainingValues`` field that fills its "auto" (Hugging Face's mapping)
FILLED_BY: Final[dict[tuple[str, ...], str]] = {
    ("train_micro_batch_size_per_gpu",): "micro_batch_size",
    ("gradient_accumulation_steps",): "gradient_accumulation_steps",
    ("gradient_clipping",): "max_grad_norm",
    ("bf16", "enabled"): "bf16",
    ("fp16", "enabled"): "fp16",
    ("optimizer", "params", "lr"): "lr",
    ("optimizer", "params", "betas"): "betas",
    ("optimizer", "params", "eps"): "eps",
    ("optimizer", "params", "weight_decay"): "weight_decay",
    ("scheduler", "params", "warmup_max_lr"): "lr",
    ("scheduler", "params", "warmup_num_steps"): "warmup_steps",
    ("scheduler", "params", "total_num_steps"): "total_steps",
}

_TOP_LEVEL: Final = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                     "gradient_clipping": "gradient_clipping", "steps_per_print": "steps_per_print"}
_BATCH: Final = ("train_batch_size", "train_micro_batch_size_per_gpu")
_FP16_KEYS: Final = frozenset({"enabled", "loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis",
                               "consecutive_hysteresis", "min_loss_scale"})
_OFFLOAD_KEYS: Final = frozenset({"device", "pin_memory"})
_ZERO_KEYS: Final = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_scatter": "reduce_scatter",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
}
_INT_FIELDS: Final = frozenset({*(v for k, v in _ZERO_KEYS.items() if k.startswith(("stage3", "reduce_bucket"))),
                                "gradient_accumulation_steps", "mics_shard_size", "hpz_partition_size",
                                "steps_per_print"})
_SECTIONS: Final = frozenset({"bf16", "fp16", "amp", "optimizer", "scheduler", "zero_optimization"})


class DeepSpeedNote(UserWarning):
    """What z3kit says about a DeepSpeed JSON it accepted: keys that change nothing, defaults it applied."""


@attrs.frozen
class DeepSpeedJson:
    """A DeepSpeed JSON read: ``Zero3Config`` keyword arguments and the notes for the user."""

    knobs: dict[str, Any]
    notes: tuple[str, ...]


def load(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A copy of the config dict, or of the JSON file at a path."""
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"a DeepSpeed config is a dict or a JSON file path, got {type(config).__name__}")
    return copy.deepcopy(dict(config))


def read_deepspeed(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    hidden_size: int | None = None,
    auto: TrainingValues | None = None,
    world: int | None = None,
) -> DeepSpeedJson:
    """Read a DeepSpeed config (see the module docstring). ``world``: the
    number of ranks, to relate the batch sizes (None: they are not related)."""
    if hidden_size is not None:
        check_int("hidden_size", hidden_size, at_least=1)
    if auto is not None and not isinstance(auto, TrainingValues):
        raise TypeError(f"auto must be a zero3.TrainingValues, got {type(auto).__name__}")
    ds = load(config)
    _fill_auto(ds, auto or TrainingValues(), world)
    knobs: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # each knob's key in the JSON, for messages about "auto"
    unsupported: list[str] = []
    inert: list[str] = []
    offloaded: list[str] = []
    unwritten: list[str] = []  # monitors enabled that z3kit does not write to

    def take(name: str, key: str, value: Any) -> None:
        # JSON configs often write sizes as 5e8, which json reads as a float
        if isinstance(value, float) and value.is_integer() and name in _INT_FIELDS:
            value = int(value)
        knobs[name], spelled[name] = value, key

    for key, value in ds.items():
        if key in _TOP_LEVEL:
            take(_TOP_LEVEL[key], key, value)
        elif key in _BATCH or key in _SECTIONS:
            continue  # below
        elif key in keys.INERT_TOP_LEVEL:
            inert.append(key)
            if key in ("wandb", "comet", "comms_logger") and isinstance(value, Mapping) and value.get("enabled") is True:
                unwritten.append(key)
        elif key in keys.DOTTED_SECTIONS:
            keys.section_keys(key, value, inert, unsupported)
        elif key in keys.WRITTEN_MONITORS:
            monitor = MonitorConfig.from_json(key, value)
            if monitor is None:
                inert.append(key)
            else:
                knobs.setdefault("monitors", []).append(monitor)
        elif not keys.default_only(key, value, inert, unsupported):
            unsupported.append(key)
    _precision(ds, knobs, inert, unsupported)
    zero = _section(ds, "zero_optimization")
    stage = zero.get("stage", 0)
    if "zero_optimization" in ds and stage != 3:
        raise ValueError(f"z3kit implements ZeRO stage 3; zero_optimization.stage is {stage!r}")
    for zkey, zvalue in zero.items():
        name = f"zero_optimization.{zkey}"
        if zkey == "stage":
            continue
        if zkey in _ZERO_KEYS:
            take(_ZERO_KEYS[zkey], name, zvalue)
        elif zkey in keys.INERT_ZERO:
            inert.append(name)
        elif zkey == "mics_shard_size":  # HSDP: ranks per shard group; DeepSpeed's default, -1, is off
            if zvalue != -1:
                take("mics_shard_size", name, zvalue)
        elif zkey == "zero_hpz_partition_size":  # hpZ; DeepSpeed's default, 1, is off
            take("hpz_partition_size", name, zvalue)
        elif zkey in ("offload_optimizer", "offload_param"):
            _offload(name, zvalue, inert, offloaded, unsupported)
            if zkey == "offload_optimizer" and name in offloaded:  # real offload (zero3.training.offload)
                offloaded.remove(name)
                knobs["offload_optimizer"] = OffloadConfig.from_json(name, zvalue)
        elif not keys.default_only(name, zvalue, inert, unsupported):
            unsupported.append(name)
    if unsupported:
        raise ValueError(refusal(unsupported, supported_keys()))
    for section, build in (("optimizer", optimizer_from_json), ("scheduler", WarmupSchedule.from_json)):
        if section in ds:
            body = _section(ds, section)
            extra = sorted(k for k in body if k not in ("type", "params"))
            if extra:
                raise ValueError(f"unsupported DeepSpeed config keys: {', '.join(f'{section}.{k}' for k in extra)}")
            knobs["optimizer" if section == "optimizer" else "lr_scheduler"] = build(
                body.get("type"), _section(body, "params", f"{section}.params"))
    _batch_sizes(ds, knobs, world)
    notes = []
    if inert or offloaded:
        note = f"z3kit: DeepSpeed config keys accepted that change nothing here: {', '.join(inert + offloaded)}"
        if offloaded:
            note += (f"; {' and '.join(offloaded)} = \"cpu\": z3kit does not offload parameters, they "
                     "stay on the device, so each rank needs more device memory than under DeepSpeed")
        if unwritten:
            note += (f"; {' and '.join(unwritten)} enabled: z3kit writes nothing to it (log from your loop, or "
                     "enable tensorboard or csv_monitor)")
        notes.append(note)
    if "gradient_clipping" not in ds:
        knobs["gradient_clipping"] = DEEPSPEED_GRADIENT_CLIPPING
        notes.append(f"z3kit: gradient_clipping is not in the DeepSpeed config, so DeepSpeed's default applies: the "
                     f"global gradient norm is clipped at {DEEPSPEED_GRADIENT_CLIPPING} (write \"gradient_clipping\": "
                     "0 to turn clipping off)")
    return DeepSpeedJson(resolve_auto(knobs, hidden_size, spelled=spelled), tuple(notes))


def tell(notes: tuple[str, ...], rank: int) -> None:
    """Print each note once, on rank 0 only (a ``DeepSpeedNote`` warning)."""
    if rank == 0:
        for note in notes:
            warnings.warn(note, DeepSpeedNote, stacklevel=3)


def supported_keys() -> list[str]:
    """Every key of a DeepSpeed JSON that z3kit accepts, for messages."""
    return sorted([*_TOP_LEVEL, *_BATCH, *keys.INERT_TOP_LEVEL, *keys.WRITTEN_MONITORS, "bf16.enabled",
                   *(f"fp16.{k}" for k in sorted(_FP16_KEYS)), "optimizer", "scheduler"]) \
        + sorted(f"zero_optimization.{k}" for k in ("stage", *_ZERO_KEYS, *keys.INERT_ZERO, "offload_optimizer",
                                                    "offload_param", "mics_shard_size", "zero_hpz_partition_size")) \
        + sorted(keys.INERT_IN_SECTIONS) + [f"{k} (at DeepSpeed's default only)" for k in keys.DEFAULT_ONLY]


def _section(ds: Mapping[str, Any], key: str, spelled: str | None = None) -> Mapping[str, Any]:
    value = ds.get(key, {})
    if not isinstance(value, Mapping):
        raise TypeError(f"{spelled or key} must be a dict, got {type(value).__name__}")
    return value


def _fill_auto(ds: dict[str, Any], auto: TrainingValues, world: int | None) -> None:
    """Every "auto" that a ``TrainingValues`` field fills, filled in place; a
    number that disagrees with a given field refused (Hugging Face's check)."""
    missing: list[str] = []
    mismatched: list[str] = []
    for path, field in {**FILLED_BY, ("scheduler", "params", "warmup_min_lr"): ""}.items():
        holder: Any = ds
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, Mapping) else None
        if not isinstance(holder, dict) or path[-1] not in holder:
            continue
        spelled = ".".join(path)
        # Hugging Face: warmup starts from 0; fp16 is on only when asked for (z3kit refuses it on)
        given = 0.0 if not field else getattr(auto, field)
        if field == "fp16" and given is None:
            given = False
        written = holder[path[-1]]
        if written == AUTO:
            if given is None:
                missing.append(f"{spelled} (TrainingValues.{field})")
            else:
                holder[path[-1]] = list(given) if isinstance(given, tuple) else given
        elif field and getattr(auto, field) is not None and _differs(written, getattr(auto, field)):
            mismatched.append(f"{spelled} is {written!r} but TrainingValues.{field} is {getattr(auto, field)!r}")
    if ds.get("train_batch_size") == AUTO:
        micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps", 1)
        if world is None or micro in (None, AUTO) or accum == AUTO:
            missing.append("train_batch_size (TrainingValues.micro_batch_size and gradient_accumulation_steps, "
                           "with the world size: zero3.initialize knows it, from_deepspeed takes world=)")
        else:
            ds["train_batch_size"] = micro * accum * world
    if missing:
        raise ValueError(
            f'"auto" with no value to fill it: {", ".join(missing)}. Pass auto=zero3.TrainingValues(...) with those '
            "fields to zero3.initialize (or to Zero3Config.from_deepspeed), or write the values in the JSON")
    if mismatched:
        raise ValueError(f"the DeepSpeed config and TrainingValues disagree: {'; '.join(mismatched)}. Make them "
                         "agree, or write \"auto\" in the JSON")


def _differs(written: Any, given: Any) -> bool:
    if isinstance(given, tuple):
        return not isinstance(written, (list, tuple)) or [float(x) for x in written] != list(given)
    return bool(written != given)


def _precision(ds: Mapping[str, Any], knobs: dict[str, Any], inert: list[str], unsupported: list[str]) -> None:
    """bf16 or fp16 on or off (fp16's loss-scaling keys into ``LossScaleConfig``), amp only off."""
    bf16 = _section(ds, "bf16")
    unsupported += [f"bf16.{k}" for k in bf16 if k != "enabled"]
    if bf16.get("enabled", False) is True:
        knobs["compute_dtype"] = "bf16"
    elif bf16.get("enabled", False) is not False:
        raise TypeError(f"bf16.enabled must be true, false or \"auto\", got {bf16.get('enabled')!r}")
    if "fp16" in ds:
        fp16 = _section(ds, "fp16")
        unsupported += [f"fp16.{k}" for k in fp16 if k not in _FP16_KEYS]
        if fp16.get("consecutive_hysteresis", False) is not False:
            unsupported.append("fp16.consecutive_hysteresis (only false)")
        if fp16.get("enabled", False) is True:
            if knobs.get("compute_dtype") == "bf16":
                raise ValueError("bf16.enabled and fp16.enabled are both true: enable one of them")
            knobs["compute_dtype"] = "fp16"
            knobs["loss_scaling"] = LossScaleConfig.from_json(fp16)
        elif fp16.get("enabled", False) is not False:
            raise TypeError(f"fp16.enabled must be true, false or \"auto\", got {fp16.get('enabled')!r}")
        else:
            inert += [f"fp16.{k}" for k in fp16 if k in _FP16_KEYS]
    if "amp" in ds:
        if _section(ds, "amp").get("enabled", False) is not False:
            unsupported.append("amp")
        else:
            inert.append("amp")


def _offload(name: str, value: Any, inert: list[str], offloaded: list[str], unsupported: list[str]) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict like {{\"device\": \"none\"}}, got {type(value).__name__}")
    device = value.get("device", "none")
    if device == "nvme":
        raise ValueError(f"{name}.device is \"nvme\": z3kit does not offload to NVMe; set it to \"none\"")
    if device not in ("none", "cpu"):
        raise ValueError(f"{name}.device must be \"none\" or \"cpu\", got {device!r}")
    allowed = _OFFLOAD_KEYS | ({"ratio"} if name.endswith("offload_optimizer") else set())
    unsupported += [f"{name}.{k}" for k in value if k not in allowed]
    (offloaded if device == "cpu" else inert).append(name)


def _batch_sizes(ds: Mapping[str, Any], knobs: dict[str, Any], world: int | None) -> None:
    """The micro batch the data is checked against, and DeepSpeed's relation
    of the three batch numbers when the world size is known."""
    train, micro = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
    accum = knobs.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro)):
        if value is not None:
            check_int(key, int(value) if isinstance(value, float) and value.is_integer() else value, at_least=1)
    train = None if train is None else int(train)
    micro = None if micro is None else int(micro)
    if world is not None and train is not None:
        # DeepSpeed derives the one it is not given (DeepSpeedConfig._set_batch_related_parameters)
        if micro is None:
            micro = train // world // (accum if isinstance(accum, int) else 1)
        if accum is None:
            accum = knobs["gradient_accumulation_steps"] = train // max(1, micro) // world
        if not isinstance(accum, int) or micro * accum * world != train:
            raise ValueError(
                f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({accum}) x the number of ranks ({world}), as DeepSpeed requires; "
                "fix one of them (or write \"auto\" and pass zero3.TrainingValues)")
    if micro is not None:
        knobs["micro_batch_size"] = micro
