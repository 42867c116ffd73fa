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
  an accelerator (``SYNCING_CALLS``), except those made by ``torch.optim``
  itself: its optimizers keep their step counters on the host on an
  accelerator too (unless ``capturable``/``fused``), so reading them
  waits for nothing. The autograd engine runs tensor hooks and
  end-of-backward callbacks without the torch-function modes of the thread
  that called backward, so on CPU what those do is not seen; the tests'
  accelerator double (``tests/sync_sites.py``) sees it.

A wait on an event (``z3kit.host_copy.HostCopy``) is counted by neither
mode; ``HostCopy.blocked`` tells whether one had to wait.

Only the thread that entered the block is watched.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Final

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


_OPTIM_DIR = os.path.dirname(torch.optim.__file__) + os.sep


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _caller() -> str:
    """Where the syncing call was made: ``file:line`` of the first frame
    outside torch's own wrappers and other torch-function modes (torch.optim
    counts as a caller)."""
    frame = sys._getframe(2)  # past this and __torch_function__

    def passing_through(code: Any) -> bool:
        inside_torch = code.co_filename.startswith(_TORCH_DIR) and not code.co_filename.startswith(_OPTIM_DIR)
        return inside_torch or code.co_name == "__torch_function__"

    while frame.f_back is not None and passing_through(frame.f_code):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _CountingMode(TorchFunctionMode):
    def __init__(self, on_sync: Callable[[str], None]) -> None:
        super().__init__()
        self.on_sync = on_sync

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in SYNCING_CALLS:
            where = _caller()
            if not where.startswith(_OPTIM_DIR):  # see the module docstring
                self.on_sync(f"{_name(func)} at {where}")
        return func(*args, **(kwargs or {}))

#: the notice torch gives once, the first time its sync debug mode is set: no sync (seen
#: counted as one on an H200 before this filter)
_DEBUG_MODE_NOTICE: Final = "synchronization debug mode is a prototype feature"


def synchronizing_calls(messages: Iterable[str]) -> list[str]:
    """The first lines of the sync debug mode's warnings that report a
    synchronizing call, in order; other warnings are left out."""
    return [m.split("\n", 1)[0] for m in messages
            if "synchroniz" in m.lower() and not m.lower().startswith(_DEBUG_MODE_NOTICE)]


class HostSyncCounter:
    """``with HostSyncCounter(device) as syncs: ...`` then ``syncs.count``
    (and ``syncs.calls``, what synchronized, in order: on CPU with the
    ``file:line`` that called it)."""

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
        self.calls += synchronizing_calls(str(w.message) for w in self._caught)
        self._warnings.__exit__(None, None, None)


__all__ = ["HostSyncCounter", "SYNCING_CALLS", "synchronizing_calls"]
