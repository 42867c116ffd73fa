"""Model sizes and the run's ``Zero3Config``.

Without ``--config`` the runtime's size knobs are scaled to the model, the
way Hugging Face's DeepSpeed integration fills ``"auto"`` (see
:func:`auto_sizes`): DeepSpeed's absolute defaults (100k persistence
threshold, 1e9 reuse distance) would keep every parameter of a model this
small gathered all the time, and there would be no sharding to watch.
``--config`` takes either a DeepSpeed JSON (it has a ``zero_optimization``
section; read by ``Zero3Config.from_deepspeed``, with ``"auto"`` size knobs
filled the same way) or a z3kit JSON (``Zero3Config`` keyword arguments;
``{}`` is DeepSpeed's defaults).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from z3kit_recipes.models import GPTConfig
from z3kit_recipes.zero3.config import Zero3Config

#: (width, layers, heads, seq_len) of each ``--model-size``
MODEL_SIZES: Final[dict[str, tuple[int, int, int, int]]] = {
    "tiny": (32, 2, 2, 32),
    "small": (96, 4, 4, 64),
    "medium": (256, 6, 8, 128),
}
DEFAULT_MODEL_SIZE: Final = "small"


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


def block_numel(width: int) -> int:
    """Elements of one transformer block of ``width`` (see ``models.Block``)."""
    return 12 * width * width + 13 * width


def auto_sizes(model_config: GPTConfig) -> dict[str, int]:
    """Size knobs scaled to the model (``Zero3Config`` field names).

    As Hugging Face's DeepSpeed integration fills ``"auto"``: parameters
    under ``10 * width`` elements (LayerNorms, biases) persist. Then, in
    units of one transformer block ``B``: a prefetch gathers up to ``B``;
    gradients are reduced in buckets of ``B``; a parameter whose next use
    comes within ``B`` fetched elements is kept at module exit; and at
    most ``2 B`` elements are live at once (a running module's own fetch
    is never refused).
    """
    block = block_numel(model_config.width)
    return {
        "param_persistence_threshold": 10 * model_config.width,
        "prefetch_bucket_size": block,
        "reduce_bucket_size": block,
        "max_reuse_distance": block,
        "max_live_parameters": 2 * block,
    }


#: DeepSpeed zero_optimization keys that "auto" fills, and the Zero3Config field each sets
_DS_AUTO_KEYS: Final = {
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "reduce_bucket_size": "reduce_bucket_size",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_max_live_parameters": "max_live_parameters",
}


def config_from_dict(raw: Mapping[str, Any], auto: Mapping[str, int] | None = None) -> Zero3Config:
    """A ``Zero3Config`` from a DeepSpeed config (a dict with
    ``zero_optimization``) or from ``Zero3Config`` keyword arguments.

    In a DeepSpeed config, ``"auto"`` size knobs take their value from
    ``auto`` (see :func:`auto_sizes`) when it is given. Unknown keys of
    either kind are refused by name (``ValueError``).
    """
    if not isinstance(raw, Mapping):
        raise TypeError(f"a config is a JSON object, got {type(raw).__name__}")
    if "zero_optimization" in raw:
        section = raw["zero_optimization"]
        if auto is not None and isinstance(section, Mapping):
            filled = {
                key: auto[_DS_AUTO_KEYS[key]] if key in _DS_AUTO_KEYS and value == "auto" else value
                for key, value in section.items()
            }
            raw = {**raw, "zero_optimization": filled}
        return Zero3Config.from_deepspeed(raw)
    known = [f.name for f in attrs.fields(Zero3Config)]
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise ValueError(
            f"unknown z3kit config keys: {', '.join(map(repr, unknown))}; known: {', '.join(known)} "
            "(a DeepSpeed config needs a zero_optimization section)"
        )
    return Zero3Config(**raw)


def load_config(path: str | os.PathLike[str] | None, model_config: GPTConfig, dtype: str | None = None) -> Zero3Config:
    """The run's ``Zero3Config``: from ``path`` (see :func:`config_from_dict`),
    or the stock config with :func:`auto_sizes` when ``path`` is None;
    ``dtype`` (``"fp32"``/``"bf16"``), when given, overrides its compute dtype."""
    auto = auto_sizes(model_config)
    if path is None:
        knobs: dict[str, Any] = dict(auto)
        config = Zero3Config(**knobs)
    else:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        config = config_from_dict(raw, auto)
    if dtype is not None:
        config = attrs.evolve(config, compute_dtype=dtype)
    return config
