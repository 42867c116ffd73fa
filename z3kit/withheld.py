"""``Withheld``: a tensor that stands where a value is not, and refuses to be read.

Between uses a sharded parameter holds no values, and its gradient lives as
this rank's 1/N partition of the sum. Code that reads ``param.grad`` or a
state dict's entry there (``torch.nn.utils.clip_grad_norm_``, a logger of
gradient norms, ``torch.save``, safetensors) would find nothing and carry
on with a plausible wrong answer: a norm of 0, an empty file. A ``Withheld``
tensor put in that place makes every such read raise instead, with the
reason it was given, which names what to use.

Note: what it answers.
    It is a real (empty or expanded-from-one-element) tensor of the right
    dtype and device, so torch accepts it as a ``.grad`` of the shape the
    parameter has now. Its ``__torch_function__`` answers only metadata
    that is true of the value it stands for (dtype, device, layout,
    ``requires_grad``, whether it is a leaf); every other function or
    attribute (values, shape, storage, pickling) raises ``ValueWithheld``.
    ``repr`` says what it is without raising, so that printing a model's
    gradients in a debugger still works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

#: what a Withheld tensor answers: metadata true of the value it stands for (see the Note)
_TRUE_METADATA = frozenset({"dtype", "device", "layout", "requires_grad", "is_leaf", "grad_fn", "is_cuda",
                            "is_cpu", "is_sparse", "is_quantized", "is_meta"})


class ValueWithheld(RuntimeError):
    """A ``Withheld`` tensor was read: its message says why and what to use."""


class Withheld(torch.Tensor):
    """A placeholder that refuses every read but metadata (see the module docstring)."""

    reason: str

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, reason: str) -> Withheld:
        # no storage of the value's size: an empty tensor, or one element expanded to the shape
        if 0 in shape:
            base = torch.empty(shape, dtype=dtype, device=device)
        else:
            base = torch.empty((), dtype=dtype, device=device).expand(shape)
        out: Withheld = torch.Tensor._make_subclass(cls, base, False)
        out.reason = reason
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"Withheld({self.reason})"

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Iterable[type], args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = _name_of(func)
        if name in _TRUE_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise ValueWithheld(f"{name}() on a withheld value: {_reason_in(args, kwargs)}")


def withheld_like(tensor: torch.Tensor, reason: str) -> Withheld:
    """A ``Withheld`` of ``tensor``'s current shape, dtype and device."""
    return Withheld(tuple(tensor.shape), tensor.dtype, tensor.device, reason)


def _name_of(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a property of Tensor: name the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name)


def _reason_in(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> str:
    stack: list[Any] = [*args, *(kwargs or {}).values()]
    while stack:
        item = stack.pop(0)
        if isinstance(item, Withheld):
            return item.reason
        if isinstance(item, (list, tuple)):
            stack.extend(item)
    return "this value is withheld"
