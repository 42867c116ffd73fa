"""The job's training values and a ``--config`` JSON, settled before any process starts.

A DeepSpeed JSON (Hugging Face's documented ZeRO-3 one among them) runs
unedited, as Hugging Face's Trainer runs it:

- ``"auto"`` takes the job's value (``zero3.TrainingValues``): ``--lr``,
  ``--batch-size``, ``--steps``, ``--dtype``, and where the job has no
  option, its own setting: AdamW's betas, eps and weight decay
  (``defaults``), one micro-step per optimizer step, the stock clipping,
  the job's warm-up (``defaults.warmup_steps``);
- a number in the JSON replaces the job's default: its micro batch (or
  ``train_batch_size`` over the ranks) is ``--batch-size``, its
  optimizer's lr is ``--lr``, its scheduler's ``total_num_steps`` is
  ``--steps``, its precision is ``--dtype``;
- a number that contradicts an option the user gave is refused, all such
  in one line (:class:`Contradiction`), before anything starts;
- its ``optimizer`` section builds the optimizer (the job passes none to
  ``zero3.initialize``), its ``scheduler`` section sets the learning rate
  (the job's own schedule then stays off, see ``loop``).

A z3kit JSON (``Zero3Config`` fields) follows the same rule for its
``micro_batch_size`` and ``compute_dtype``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from z3kit_recipes.models import GPTConfig
from z3kit_recipes.train.config import config_from_dict, load_config
from z3kit_recipes.train.defaults import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY, warmup_steps
from z3kit_recipes.zero3.config.auto import AUTO
from z3kit_recipes.zero3.config.config import Zero3Config
from z3kit_recipes.zero3.config.deepspeed_json import FILLED_BY, read_deepspeed
from z3kit_recipes.zero3.config.training_values import TrainingValues

#: the option that sets each ``TrainingValues`` field, where the job has one
_OPTION: Final = {"lr": "--lr", "micro_batch_size": "--batch-size", "total_steps": "--steps", "bf16": "--dtype",
                  "fp16": "--dtype"}


class Contradiction(ValueError):
    """The JSON and an option the user gave say different things (one line, every such pair)."""


@attrs.frozen
class JobValues:
    """What the run trains with, once the options and the JSON agree."""

    steps: int
    batch_size: int
    lr: float
    config: Zero3Config


def settle(args: argparse.Namespace, model: GPTConfig, world: int) -> JobValues:
    """The run's values from the parsed options (``args.given``: those the
    user gave) and ``args.config``; ``world``: the number of ranks.
    ``ValueError`` (a :class:`Contradiction` among them) or ``TypeError`` for a bad JSON."""
    if args.config is None:
        return JobValues(args.steps, args.batch_size, args.lr, load_config(None, model, args.dtype))
    try:
        raw = json.loads(Path(args.config).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{args.config} is not valid JSON: {exc}") from None
    if isinstance(raw, Mapping) and "zero_optimization" in raw:
        return _from_deepspeed(raw, args, model, world)
    config = config_from_dict(raw, model.width)  # refuses what is not a z3kit config
    given = _given(args)
    clashes = [f"{key} is {raw[key]!r} but {_OPTION[field]} is {_shown(args, field)}"
               for key, field in (("micro_batch_size", "micro_batch_size"), ("compute_dtype", "bf16"))
               if key in raw and field in given and raw[key] != _flag_value(args, key)]  # fmt: skip
    _refuse(clashes, "the key from the JSON")
    if "dtype" in args.given:
        config = attrs.evolve(config, compute_dtype=args.dtype)
    return JobValues(args.steps, config.micro_batch_size or args.batch_size, args.lr, config)


def _from_deepspeed(raw: Mapping[str, Any], args: argparse.Namespace, model: GPTConfig, world: int) -> JobValues:
    given = _given(args)
    written = _written(raw)
    clashes = [f"{key} is {value!r} but {_OPTION[field]} is {_shown(args, field)}"
               for field, value_given in given.items() for key, value in written.get(field, [])
               if _differs(value, value_given)]  # fmt: skip
    train = raw.get("train_batch_size")
    accum = raw.get("gradient_accumulation_steps", 1)
    accum = 1 if accum == AUTO else accum
    # train_batch_size as a number (and an accumulation to relate it with): DeepSpeed's micro x accumulation x ranks
    whole: int | None = train if isinstance(train, int) and not isinstance(train, bool) and isinstance(accum, int) \
        else None
    if whole is not None and "micro_batch_size" in given and whole != args.batch_size * accum * world:
        clashes.append(f"train_batch_size is {train!r} but --batch-size {args.batch_size} x "
                       f"gradient_accumulation_steps {accum} x {world} ranks is {args.batch_size * accum * world}")
    _refuse(clashes, 'write "auto" in the JSON')

    def json_or(field: str, value: Any) -> Any:
        """The JSON's first number for ``field`` where the user gave no option for it, else ``value``."""
        return written[field][0][1] if field in written and field not in given else value

    steps = int(json_or("total_steps", args.steps))  # a scheduler's length is the run's
    job: dict[str, Any] = {
        "lr": args.lr, "betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY,
        "micro_batch_size": args.batch_size, "gradient_accumulation_steps": 1,
        "max_grad_norm": Zero3Config().gradient_clipping, "bf16": args.dtype == "bf16", "fp16": False,
        "total_steps": steps, "warmup_steps": warmup_steps(steps),
    }  # fmt: skip
    if whole is not None and "micro_batch_size" not in written and "micro_batch_size" not in given \
            and whole % (accum * world) == 0:
        job["micro_batch_size"] = whole // (accum * world)  # DeepSpeed's derivation, for an "auto" micro batch
    for field, places in written.items():
        if field not in given:
            # a field the JSON writes wherever it has it fills no "auto" (and is checked against
            # nothing: its places may differ, as DeepSpeed allows); one also left "auto" somewhere
            # takes the JSON's first number
            job[field] = None if len(places) == len(_places(raw, field)) else places[0][1]
    read = read_deepspeed(raw, hidden_size=model.width, auto=TrainingValues(**job), world=world)
    for note in read.notes:  # said once, by the command, before any rank starts
        print(note, file=sys.stderr)
    config = Zero3Config(**read.knobs)
    if "dtype" in args.given:  # a JSON that does not say (no bf16 section) takes the option's
        config = attrs.evolve(config, compute_dtype=args.dtype)
    batch_size = config.micro_batch_size or args.batch_size
    lr = config.optimizer.lr if config.optimizer is not None else float(json_or("lr", args.lr))
    return JobValues(steps, batch_size, lr, config)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TrainingValues`` fields that the options the user gave set."""
    given: dict[str, Any] = {}
    if "lr" in args.given:
        given["lr"] = args.lr
    if "batch_size" in args.given:
        given["micro_batch_size"] = args.batch_size
    if "steps" in args.given:
        given["total_steps"] = args.steps
    if "dtype" in args.given:
        given["bf16"], given["fp16"] = args.dtype == "bf16", False
    return given


def _flag_value(args: argparse.Namespace, key: str) -> Any:
    return args.batch_size if key == "micro_batch_size" else args.dtype


def _shown(args: argparse.Namespace, field: str) -> str:
    return str({"lr": args.lr, "micro_batch_size": args.batch_size, "total_steps": args.steps}.get(field, args.dtype))


def _places(raw: Mapping[str, Any], field: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of every place in the JSON that ``field`` fills."""
    found = []
    for path, name in FILLED_BY.items():
        if name != field:
            continue
        holder: Any = raw
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, Mapping) else None
        if isinstance(holder, Mapping) and path[-1] in holder:
            found.append((".".join(path), holder[path[-1]]))
    return found


def _written(raw: Mapping[str, Any]) -> dict[str, list[tuple[str, Any]]]:
    """The places where the JSON writes a value (not ``"auto"``), by the field that would fill them."""
    out: dict[str, list[tuple[str, Any]]] = {}
    for field in dict.fromkeys(FILLED_BY.values()):
        places = [(k, v) for k, v in _places(raw, field) if v != AUTO]
        if places:
            out[field] = places
    return out


def _differs(written: Any, given: Any) -> bool:
    if isinstance(given, bool) or isinstance(written, bool):
        return written is not given
    if isinstance(written, (int, float)) and isinstance(given, (int, float)):
        return float(written) != float(given)
    return bool(written != given)


def _refuse(clashes: list[str], other_fix: str) -> None:
    if clashes:
        raise Contradiction(f"{'; '.join(clashes)}. Drop the option, or {other_fix}")
