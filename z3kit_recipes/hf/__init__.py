"""Hugging Face integration (the ``z3kit[hf]`` extra: transformers and accelerate).

- ``trainer``: ``Zero3Trainer``, ``transformers.Trainer`` on the stock
  ZeRO-3 runtime;
- ``settings``: what it takes from ``TrainingArguments``, and what it refuses;
- ``json_arguments``: a DeepSpeed JSON's numbers against the ``TrainingArguments``
  that fill its ``"auto"``, every disagreement named at once.
"""

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "z3kit_recipes.hf needs transformers and accelerate: pip install 'z3kit[hf]'"
    ) from exc

from z3kit_recipes.hf.trainer import Zero3Trainer

__all__ = ["Zero3Trainer"]
