"""Reference models and workloads for benchmarks, training scripts and tests.

- :mod:`~z3kit_recipes.models.tiny`: :class:`TinyMLP`, ``depth`` blocks of
  ``Linear(width, width)`` + ``Tanh``; many tiny modules, to stress
  per-module runtime overhead (hooks, one gather per module).
- :mod:`~z3kit_recipes.models.gpt`: :class:`GPT`, a small pre-LN GPT
  (:class:`GPTConfig`) whose lm head is tied to the token embedding, either
  as one Parameter shared by two modules (``tie_mode="hf"``) or used by the
  root functionally (``tie_mode="functional"``).
- :mod:`~z3kit_recipes.models.workloads`: a model recipe with its data and
  loss, identical for every runtime (:class:`TinyWorkload`,
  :class:`GPTWorkload`, :class:`LlamaWorkload`; :func:`make_workload`).

Everything is importable from ``z3kit_recipes.models`` itself.
"""

from z3kit_recipes.models.gpt import GPT, MLP, TIE_MODES, Block, CausalSelfAttention, GPTConfig, TieMode
from z3kit_recipes.models.tiny import TinyBlock, TinyMLP
from z3kit_recipes.models.workloads import (
    LLAMA_CONFIG,
    WORKLOAD_NAMES,
    GPTWorkload,
    LlamaWorkload,
    TinyWorkload,
    Workload,
    WorkloadName,
    make_workload,
)

__all__ = [
    "GPT",
    "LLAMA_CONFIG",
    "MLP",
    "TIE_MODES",
    "WORKLOAD_NAMES",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTWorkload",
    "LlamaWorkload",
    "TieMode",
    "TinyBlock",
    "TinyMLP",
    "TinyWorkload",
    "Workload",
    "WorkloadName",
    "make_workload",
]
