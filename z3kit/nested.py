"""Tensors inside the nested outputs and inputs of modules: tuples, lists,
dicts (Hugging Face's ``ModelOutput`` among them), dataclasses and
namedtuples."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of tuples, lists, dicts, dataclasses and namedtuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor, containers preserved."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, item) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        # copy, then assign: keeps dict subclasses (e.g. Hugging Face ModelOutput) intact
        mapped = copy.copy(obj)
        for key, value in obj.items():
            mapped[key] = map_tensors(fn, value)
        return mapped
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        rebuilt: Any = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(rebuilt, field.name, map_tensors(fn, getattr(obj, field.name)))
        return rebuilt
    return obj


__all__ = ["iter_tensors", "map_tensors"]
