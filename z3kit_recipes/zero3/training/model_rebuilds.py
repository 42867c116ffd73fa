"""Hugging Face methods that rebuild a model's parameters, refused by name after initialize.

``resize_token_embeddings`` builds new embedding modules from the old
weights, and ``tie_weights`` points one module's parameter at another's.
After ``initialize`` the old weights are empty placeholders (Hugging Face
fails reading their size, with an error that names nothing of the
engine's), and parameters made or moved then were never sharded. So on
every module of the model that has these methods (a ``PreTrainedModel``,
its base model inside it), the engine puts a guard in front of them: an
attribute of the instance, which Python finds before the class's method,
removed when the engine is freed.

- ``resize_token_embeddings`` is refused before it starts, naming itself
  and saying to call it before initialize.
- ``tie_weights`` runs. Where it leaves every parameter as it was (the
  embeddings tied, or untied, as they were at initialize: the usual call,
  and what Hugging Face's own code calls), that is its result. Where it
  moved a parameter (the config's ``tie_word_embeddings`` changed since)
  or replaced one's values (padding an output bias against a placeholder's
  size), every such parameter is put back and it is refused the same way.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: the method refused outright, and the one checked
_REFUSED = "resize_token_embeddings"
_CHECKED = "tie_weights"


class RebuildRefused(RuntimeError):
    """A Hugging Face method that rebuilds parameters was called after ``zero3.initialize``."""


def _refusal(method: str, what: str) -> RebuildRefused:
    return RebuildRefused(
        f"model.{method}() after zero3.initialize is refused: it {what}, but ZeRO-3 sharded the model's parameters "
        f"at initialize and holds only empty placeholders between uses. Call model.{method}(...) before "
        "zero3.initialize (the engine then shards the result); nothing was changed")


def guard_rebuilds(model: nn.Module) -> Callable[[], None]:
    """Put the guards on every module of ``model`` that has these methods;
    returns what removes them again (see the module docstring)."""
    guarded: list[tuple[weakref.ref[nn.Module], str]] = []  # weakly: the guards themselves hold their module
    for module in model.modules():
        if callable(getattr(type(module), _REFUSED, None)):
            setattr(module, _REFUSED, _refuse_resize)  # not a tensor or module: a plain attribute of the instance
            guarded.append((weakref.ref(module), _REFUSED))
        if callable(getattr(type(module), _CHECKED, None)):
            # bound, so that a copy of the model (deepcopy) gets one bound to itself
            setattr(module, _CHECKED, types.MethodType(_checked_tie, module))
            guarded.append((weakref.ref(module), _CHECKED))

    def remove() -> None:
        for ref, name in guarded:
            module = ref()
            guard = None if module is None else vars(module).get(name)
            if module is not None and getattr(guard, "__func__", guard) in (_refuse_resize, _checked_tie):
                delattr(module, name)

    return remove


def _refuse_resize(*args: Any, **kwargs: Any) -> Any:
    raise _refusal(_REFUSED, "builds new embedding modules from the old weights")


def _checked_tie(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``tie_weights`` on ``module``, checked (see the module docstring)."""
    before = {name: (p, p.data) for name, p in module.named_parameters(remove_duplicate=False)}
    result = getattr(type(module), _CHECKED)(module, *args, **kwargs)
    moved = _restore(module, before)
    if moved:
        raise _refusal(_CHECKED, f"would change {', '.join(moved)}")
    return result


def _restore(module: nn.Module, before: dict[str, tuple[nn.Parameter, torch.Tensor]]) -> list[str]:
    """Put back every parameter of ``before`` that was moved or given other
    values; returns their names."""
    changed = []
    for name, (param, data) in before.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if getattr(owner, attr, None) is not param:
            setattr(owner, attr, param)
            changed.append(name)
        elif param.data.shape != data.shape or param.data.data_ptr() != data.data_ptr():
            param.data = data
            changed.append(name)
    return changed
