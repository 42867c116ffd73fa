"""``--export`` and ``--init-from`` in Hugging Face's GPT-2 layout: the job's
GPT is exact as ``GPT2LMHeadModel`` (``models.gpt_hf`` says why), so the
export is a folder ``AutoModelForCausalLM.from_pretrained`` loads:
``config.json``, ``generation_config.json`` and ``model.safetensors`` under
GPT-2's names, the vocabulary's ``tokenizer.json`` and
``tokenizer_config.json`` (``train.tokenizer``: ``AutoTokenizer`` and
``pipeline("text-generation")`` load the folder), beside the z3kit manifest that lets a later ``--export``
replace it. ``--init-from`` reads such a folder back into the shards, and
also an export written before the job used GPT-2's names (the GPT's own).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from z3kit_recipes import zero3
from z3kit_recipes.models import GPTConfig
from z3kit_recipes.models.gpt_hf import MODEL_TYPE, gpt2_config, gpt2_generation_config, gpt2_names, gpt2_transposed
from z3kit_recipes.zero3.weights import pretrained
from z3kit_recipes.zero3.weights.export_layout import ExportLayout
from z3kit_recipes.zero3.weights.hf_config import CONFIG_FILE


def gpt2_layout(model: GPTConfig, files: Iterable[tuple[str, str]] = ()) -> ExportLayout:
    """The GPT of ``model``'s shape, stored as GPT-2, with ``files`` (name, text) beside it."""
    return ExportLayout(gpt2_names(model), gpt2_transposed(model), gpt2_config(model), gpt2_generation_config(),
                        files=files)


def export(engine: zero3.Zero3Engine, path: str, model: GPTConfig, files: Iterable[tuple[str, str]] = ()) -> None:
    """``--export``: the full weights as a GPT-2 folder (collective), with
    ``files`` (the vocabulary's tokenizer, ``train.tokenizer``) beside them."""
    pretrained.save_pretrained(engine, path, layout=gpt2_layout(model, files))


def stored_model_type(path: str) -> str | None:
    """The ``model_type`` in ``path``'s ``config.json``, or None without a readable one."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = config.get("model_type") if isinstance(config, dict) else None
    return kind if isinstance(kind, str) else None


def init_from(engine: zero3.Zero3Engine, path: str, model: GPTConfig) -> None:
    """``--init-from``: the weights of ``path`` into the shards (collective);
    GPT-2's names when its config says gpt2, else the GPT's own."""
    layout = gpt2_layout(model) if stored_model_type(path) == MODEL_TYPE else None
    pretrained.load_pretrained(engine, path, layout=layout)
