"""Counting host syncs: the points where the CPU waits for the device.

A training step on an accelerator should never make the host wait for the
device (``.item()``, ``.tolist()``, ``.cpu()``, ``float(t)``, ``if t:``,
``nonzero``): each one drains the queue of kernels the CPU runs ahead with.
``HostSyncCounter`` counts them over a block of code:

- on CUDA (and any accelerator module with ``set_sync_debug_mode``, such as
  torch_npu's), with the device's own sync debug mode, which warns at every
  synchronizing call; the warnings are counted, not shown;
- on CPU, where nothing is asynchronous, by standing in for that mode: a
  ``TorchFunctionMode`` counts the tensor calls that would synchronize on
  an accelerator (``SYNCING_CALLS``).

Only the thread that entered the block is watched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: tensor calls that make the host wait for the device on an accelerator
SYNCING_CALLS: frozenset[Callable[..., Any]] = frozenset({
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.is_nonzero,
    torch.equal,
    torch.Tensor.equal,
})


def _name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))


class _CountingMode(TorchFunctionMode):
    def __init__(self, on_sync: Callable[[str], None]) -> None:
        super().__init__()
        self.on_sync = on_sync

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in SYNCING_CALLS:
            self.on_sync(_name(func))
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter(device) as syncs: ...`` then ``syncs.count``
    (and ``syncs.calls``, what synchronized, in order)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.calls: list[str] = []
        self._mode: _CountingMode | None = None
        self._warnings: Any = None
        self._module: Any = None
        self._previous_mode = 0
        self._caught: list[warnings.WarningMessage] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def _debug_module(self) -> Any:
        if self.device.type == "cpu":
            return None
        module = torch.get_device_module(self.device)
        return module if hasattr(module, "set_sync_debug_mode") else None

    def __enter__(self) -> HostSyncCounter:
        self._module = self._debug_module()
        if self._module is None:
            self._mode = _CountingMode(self.calls.append)
            self._mode.__enter__()  # type: ignore[no-untyped-call]
            return self
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._previous_mode = self._module.get_sync_debug_mode()
        self._module.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._mode = None
            return
        self._module.set_sync_debug_mode(self._previous_mode)
        self.calls += [str(w.message).split("\n", 1)[0] for w in self._caught
                       if "synchroniz" in str(w.message).lower()]
        self._warnings.__exit__(None, None, None)


__all__ = ["HostSyncCounter", "SYNCING_CALLS"]
