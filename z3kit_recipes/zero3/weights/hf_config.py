"""The ``config.json`` of a Hugging Face export, recording the dtype the
export actually holds.

``from_pretrained`` builds the model in the config's ``dtype`` unless told
otherwise (transformers 5's default is ``dtype="auto"``, which reads it), so
a config that keeps the training model's ``float32`` beside bf16 weights
loads them upcast to fp32. The save therefore writes the dtype of what it
wrote, under ``dtype`` (what transformers 5 reads) and ``torch_dtype`` (what
releases before 4.56 read; transformers 5 takes ``dtype`` when both are
there, without a warning).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from z3kit_recipes.zero3.weights.safetensors_io import Planned

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def saved_dtype(planned: Sequence[Planned]) -> torch.dtype | None:
    """The floating-point dtype of the most elements written, or None when
    nothing written is floating-point. One dtype, except without a ``dtype``
    argument in a bf16 engine with frozen parameters: trainable ones come
    from the fp32 masters, frozen ones in bf16, and the config can name only
    one, so it names the one most of the model is in."""
    counts: dict[torch.dtype, int] = {}
    for t in planned:
        if t.dtype.is_floating_point:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes // t.dtype.itemsize
    return max(counts, key=lambda d: counts[d]) if counts else None


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the config's spelling."""
    return str(dtype).removeprefix("torch.")


def record_dtype(config: Mapping[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """``config`` with the saved dtype under both keys (see the module docstring)."""
    out = dict(config)
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = dtype_name(dtype)
    return out


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def rewrite_dtype(path: Path, dtype: torch.dtype | None) -> None:
    """A ``config.json`` written by ``PretrainedConfig.save_pretrained``, its dtype made the saved one."""
    write_json(path, record_dtype(json.loads(path.read_text(encoding="utf-8")), dtype))
