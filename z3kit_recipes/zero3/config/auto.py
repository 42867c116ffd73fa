"""What ``"auto"`` means in a z3kit or DeepSpeed configuration: z3kit picks
the value from the model.

One meaning everywhere (``Zero3Config.from_deepspeed`` and the main job's
``--config``, whether a DeepSpeed or a z3kit JSON): ``"auto"`` stands for a
value derived from the model's hidden size by :func:`auto_sizes`, the way
Hugging Face's DeepSpeed integration fills ``"auto"`` from
``model.config.hidden_size``. Only the five size knobs of :data:`AUTO_SIZED`
have such a value. So:

- ``"auto"`` on a size knob needs the hidden size; without it the config
  is refused, naming the keys (pass the hidden size, or write numbers);
- ``"auto"`` on any other knob of ``Zero3Config`` is refused here: there
  is nothing in the model to derive it from, and a silent default would be
  a second meaning. In a DeepSpeed JSON, the values a training script knows
  (``gradient_accumulation_steps``, ``gradient_clipping``, ``bf16.enabled``,
  the optimizer's and the schedule's) are filled before this, from a
  ``TrainingValues``, as Hugging Face's Trainer fills them
  (``zero3.config.deepspeed_json``); without one they are refused there.

``"auto"`` never means "DeepSpeed's default": a knob left out of the config
keeps the default (DeepSpeed's; ``gradient_clipping`` is DeepSpeed's in a
DeepSpeed JSON and 0.0 in a ``Zero3Config``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from z3kit.validate import check_int

#: the placeholder, as DeepSpeed and Hugging Face configs write it
AUTO: Final = "auto"

#: the ``Zero3Config`` size knobs that ``"auto"`` fills (all of them counts of elements)
AUTO_SIZED: Final = (
    "param_persistence_threshold",
    "prefetch_bucket_size",
    "reduce_bucket_size",
    "max_reuse_distance",
    "max_live_parameters",
)


def block_numel(hidden_size: int) -> int:
    """Elements of one pre-LN transformer block of width ``hidden_size``
    (attention with its output projection, a 4x MLP, two LayerNorms, all
    with biases; ``z3kit_recipes.models.gpt.Block``): ``12 h^2 + 13 h``."""
    h = check_int("hidden_size", hidden_size, at_least=1)
    return 12 * h * h + 13 * h


def auto_sizes(hidden_size: int) -> dict[str, int]:
    """The value of each ``"auto"`` size knob (``Zero3Config`` field names)
    for a model of width ``hidden_size``.

    Parameters under ``10 * hidden_size`` elements (LayerNorms, biases)
    persist, as Hugging Face's integration sets
    ``stage3_param_persistence_threshold``. The rest is in units of one
    transformer block ``B`` (:func:`block_numel`), where Hugging Face uses
    ``hidden_size ** 2``: a prefetch gathers up to ``B``; gradients are
    reduced in buckets of ``B``; a parameter whose next use comes within
    ``B`` fetched elements is kept at module exit; at most ``2.25 B``
    elements are live at once: a block running (one fetch unit, by
    default), the next one prefetched beside it, and a quarter block for
    what stays gathered between them (norms and biases under the
    persistence threshold); with ``2 B`` a block unit's prefetch would fall
    short by those and leave part of the next block to a gather that the
    forward waits for (a running module's own fetch is never refused).
    """
    block = block_numel(hidden_size)
    return {
        "param_persistence_threshold": 10 * hidden_size,
        "prefetch_bucket_size": block,
        "reduce_bucket_size": block,
        "max_reuse_distance": block,
        "max_live_parameters": 2 * block + block // 4,
    }


def resolve_auto(
    knobs: Mapping[str, Any], hidden_size: int | None, *, spelled: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``knobs`` (``Zero3Config`` field name -> value) with each ``"auto"``
    replaced by its :func:`auto_sizes` value for ``hidden_size``.

    Refuses (``ValueError``, every offending key named at once) ``"auto"``
    on a knob outside :data:`AUTO_SIZED`, and ``"auto"`` on a size knob when
    ``hidden_size`` is None. ``spelled`` gives the name each field has in the
    caller's config (DeepSpeed's ``zero_optimization.stage3_...`` keys), for
    the messages.
    """
    spelled = spelled or {}
    autos = [name for name, value in knobs.items() if isinstance(value, str) and value == AUTO]
    if not autos:
        return dict(knobs)
    unsized = [name for name in autos if name not in AUTO_SIZED]
    if unsized:
        raise ValueError(
            f'"auto" for {", ".join(spelled.get(n, n) for n in unsized)}: z3kit fills "auto" only for the size '
            f"knobs it derives from the model ({', '.join(spelled.get(n, n) for n in AUTO_SIZED)}); write a value"
        )
    if hidden_size is None:
        raise ValueError(
            f'"auto" for {", ".join(spelled.get(n, n) for n in autos)}: z3kit derives these from the model; '
            "pass its hidden size (hidden_size=model.config.hidden_size, say) or write numbers"
        )
    sizes = auto_sizes(hidden_size)
    return {name: sizes[name] if name in autos else value for name, value in knobs.items()}
