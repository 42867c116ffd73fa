"""How a model's tensors are stored in a Hugging Face folder under another
architecture's names: ``ExportLayout``.

A model of one's own (the recipes' GPT) can be exact in a Hugging Face
architecture without sharing its parameter names or layout: GPT-2 names
every tensor differently and keeps its linear weights transposed (its
``Conv1D`` is ``x @ W`` with ``W`` of shape ``(in, out)``). An
``ExportLayout`` says, for every name of the model, the name stored in the
folder, which 2-D weights are stored transposed, and the ``config.json``
that makes ``AutoModelForCausalLM.from_pretrained`` build that
architecture, and other files of the folder (a tokenizer's), written
beside the weights and committed with them. ``save_pretrained`` and ``load_pretrained``
(``zero3.weights.pretrained``) take one; without it the model's own
``state_dict`` names are stored as they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from z3kit_recipes.zero3.weights.hf_config import CONFIG_FILE, GENERATION_CONFIG_FILE
from z3kit_recipes.zero3.weights.safetensors_io import INDEX_FILE
from z3kit_recipes.zero3.weights.target import MANIFEST


def _frozen_names(value: Mapping[str, str]) -> dict[str, str]:
    return dict(value)


def _name_set(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _config(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


def _files(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    return dict(value)


#: files that the save itself writes: other files may not take their names
RESERVED_FILES = frozenset({CONFIG_FILE, GENERATION_CONFIG_FILE, MANIFEST, INDEX_FILE})


@attrs.frozen
class ExportLayout:
    """Stored names, transposed weights and ``config.json`` of an architecture
    the model is exact in (see the module docstring)."""

    #: the stored name of each of the model's names (tied aliases included)
    names: Mapping[str, str] = attrs.field(converter=_frozen_names)
    #: the model's names of 2-D weights that are stored transposed
    transposed: frozenset[str] = attrs.field(default=frozenset(), converter=_name_set)
    #: ``config.json`` without its dtype, which the save records from what it wrote
    config: Mapping[str, Any] = attrs.field(factory=dict, converter=_config)
    #: ``generation_config.json``, when the architecture needs one
    generation_config: Mapping[str, Any] | None = None
    #: other files of the folder, name -> text (a tokenizer's ``tokenizer.json``, say)
    files: Mapping[str, str] = attrs.field(factory=dict, converter=_files)

    def __attrs_post_init__(self) -> None:
        stored = list(self.names.values())
        clashes = sorted({n for n in stored if stored.count(n) > 1})
        if clashes:
            raise ValueError(f"ExportLayout.names stores several tensors under one name: {', '.join(clashes)}")
        unknown = sorted(self.transposed - set(self.names))
        if unknown:
            raise ValueError(f"ExportLayout.transposed names tensors that names does not: {', '.join(unknown)}")
        bad = sorted(n for n in self.files if n in RESERVED_FILES or n.endswith(".safetensors")
                     or n != os.path.basename(n) or n in ("", ".", ".."))
        if bad:
            raise ValueError(f"ExportLayout.files: not a plain file name of its own: {', '.join(map(repr, bad))} "
                             "(the save writes config.json, the manifest and the .safetensors files itself)")

    def stored(self, name: str) -> str:
        return self.names[name]

    def check_covers(self, names: Iterable[str], what: str) -> None:
        """Refuse (``ValueError`` naming them) the model's names this layout has no stored name for."""
        missing = [n for n in names if n not in self.names]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"{what}: the export layout has no stored name for {len(missing)} of the model's "
                             f"tensors ({shown}); build the layout from this model's names. Nothing was read or written")
