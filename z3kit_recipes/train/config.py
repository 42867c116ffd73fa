"""Model sizes and the run's ``Zero3Config``.

Without ``--config`` the runtime's size knobs are all ``"auto"``: scaled to
the model by ``z3kit_recipes.zero3.config.auto.auto_sizes``, the way Hugging
Face's DeepSpeed integration fills ``"auto"``. DeepSpeed's absolute
defaults (100k persistence threshold, 1e9 reuse distance) would keep every
parameter of a model this small gathered all the time, and there would be
no sharding to watch. ``--config`` takes either a DeepSpeed JSON (it has a
``zero_optimization`` section; read by ``Zero3Config.from_deepspeed``) or a
z3kit JSON (``Zero3Config`` keyword arguments; ``{}`` is the defaults,
DeepSpeed's but for ``gradient_clipping``). In both, ``"auto"`` on a size
knob takes the model's value, exactly as ``Zero3Config.from_deepspeed(...,
hidden_size=width)`` gives it; :func:`load_config` refuses ``"auto"``
anywhere else. The command reads a DeepSpeed JSON through
``train.job_values`` instead, which fills those from the job's options.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from z3kit_recipes.models import GPTConfig
from z3kit_recipes.train.defaults import MODEL_SIZES
from z3kit_recipes.zero3.config.auto import auto_sizes, resolve_auto
from z3kit_recipes.zero3.config.config import Zero3Config


def gpt_config(
    size: str,
    vocab_size: int,
    *,
    width: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
    seq_len: int | None = None,
) -> GPTConfig:
    """The ``size`` preset of :data:`MODEL_SIZES`, with the dimensions given overriding it."""
    preset = MODEL_SIZES[size]
    return GPTConfig(
        vocab_size=vocab_size,
        width=width or preset[0],
        n_layer=layers or preset[1],
        n_head=heads or preset[2],
        seq_len=seq_len or preset[3],
    )


def config_from_dict(raw: Mapping[str, Any], hidden_size: int | None = None) -> Zero3Config:
    """A ``Zero3Config`` from a DeepSpeed config (a dict with
    ``zero_optimization``) or from ``Zero3Config`` keyword arguments.

    ``"auto"`` on a size knob takes its value for a model of width
    ``hidden_size`` (``z3kit_recipes.zero3.config.auto``); unknown keys of either
    kind are refused by name (``ValueError``).
    """
    if not isinstance(raw, Mapping):
        raise TypeError(f"a config is a JSON object, got {type(raw).__name__}")
    if "zero_optimization" in raw:
        return Zero3Config.from_deepspeed(raw, hidden_size=hidden_size)
    known = [f.name for f in attrs.fields(Zero3Config)]
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise ValueError(
            f"unknown z3kit config keys: {', '.join(map(repr, unknown))}; known: {', '.join(known)} "
            "(a DeepSpeed config needs a zero_optimization section)"
        )
    return Zero3Config(**resolve_auto(raw, hidden_size))


def load_config(path: str | os.PathLike[str] | None, model_config: GPTConfig, dtype: str | None = None) -> Zero3Config:
    """The run's ``Zero3Config``: from ``path`` (see :func:`config_from_dict`),
    or the stock config with every size knob ``"auto"`` (``auto_sizes``) when
    ``path`` is None; ``dtype`` (``"fp32"``/``"bf16"``), when given,
    overrides its compute dtype."""
    if path is None:
        knobs: dict[str, Any] = auto_sizes(model_config.width)  # Any: Zero3Config's fields are not all ints
        config = Zero3Config(**knobs)
    else:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        config = config_from_dict(raw, model_config.width)
    if dtype is not None:
        config = attrs.evolve(config, compute_dtype=dtype)
    return config
