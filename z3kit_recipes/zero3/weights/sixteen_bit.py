"""DeepSpeed's ``engine.save_16bit_model``: the full model, in the compute dtype, in one ``torch.save`` file.

DeepSpeed's ``save_16bit_model(save_dir, save_filename="pytorch_model.bin",
exclude_frozen_parameters=False)`` writes, from rank 0, a ``state_dict`` of
the whole model: every parameter by each of its names (a tied weight under
every name, one tensor), in the parameters' dtype (16-bit in an fp16 or
bf16 run), and the persistent buffers, on CPU, with ``torch.save`` into
``save_dir/save_filename``. A DeepSpeed user's script (and
``model.load_state_dict(torch.load(path))`` after it) works unchanged.

Two differences, both in the user's favour: DeepSpeed writes nothing and
returns False unless ``stage3_gather_16bit_weights_on_model_save`` is true
(consolidating costs it memory); here the parameters are gathered one at a
time, so the file is always written. And the file is written under a
temporary name and renamed, so an interrupted save leaves no half file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.full_values import full_state_dict
from z3kit_recipes.zero3.weights.together import Together

#: DeepSpeed's default file name
DEFAULT_FILENAME = "pytorch_model.bin"


def save_16bit_model(
    engine: EngineCore,
    save_dir: str | os.PathLike[str],
    save_filename: str = DEFAULT_FILENAME,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the model's ``state_dict`` in the compute dtype to ``save_dir/save_filename``
    (collective; rank 0 writes); returns True, as DeepSpeed's does when it wrote."""
    engine.check_idle("save_16bit_model")  # refuses a broken engine too
    if not isinstance(save_filename, str) or not save_filename or os.path.basename(save_filename) != save_filename:
        raise ValueError(f"save_16bit_model: save_filename must be a file name (no folder), got {save_filename!r}")
    path = Path(save_dir) / save_filename
    together = Together.of(engine)
    keep = engine.rank == 0
    # every rank skips the same ones: which parameters train is agreed at initialize;
    # the masters' values in the compute dtype: what the shards hold after each step
    state = full_state_dict(engine, rank0_only=True, dtype=engine.zero3_config.torch_dtype,
                            only=set(engine.trainable) if exclude_frozen_parameters else None, gather=together.call)
    together.agreed(f"save_16bit_model: writing {path}", lambda: _write(state, path) if keep else None)
    return True


def _write(state: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)
