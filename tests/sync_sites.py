"""Host syncs on CPU, in backward too, and where each was called from.

``z3kit.host_sync.HostSyncCounter('cpu')`` counts the calls of
``SYNCING_CALLS`` through a ``TorchFunctionMode``, and the autograd engine
does not carry Python torch-function modes into what it runs: tensor hooks,
post-accumulate-grad hooks and queued end-of-backward callbacks (measured
on torch 2.13: the mode stack is empty there). A runtime's reductions and
step checks run exactly there, so ``SyncSites`` counts the same calls by
wrapping them on ``torch.Tensor`` and ``torch`` for the block instead,
in the thread that entered it (backward on CPU runs in that thread).

It also says where each sync came from: the first frame outside torch and
this machinery (an engine's ``.tolist()`` is told from the user model's
``.nonzero()``), and, when torch code made the call, which torch file
(``via torch/optim/adam.py``: Adam reads its step counters, CPU tensors
even on an accelerator).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from z3kit.host_sync import SYNCING_CALLS

_TORCH = str(Path(torch.__file__).parent)
_HERE = str(Path(__file__))
#: the accelerator double's landing gate, which may wrap a syncing call: not a call site
_GATE = str(Path(__file__).with_name("accelerator_double.py"))


def _targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    """(owner, attribute, function) of every call ``HostSyncCounter`` counts."""
    out = []
    for func in SYNCING_CALLS:
        name = func.__name__
        for owner in (torch.Tensor, torch):
            current = getattr(owner, name, None)
            # the accelerator double's landing gate may have wrapped it first (``__wrapped__``): wrap that
            if current is func or getattr(current, "__wrapped__", None) is func:
                out.append((owner, name, current))
    return out


def _site() -> tuple[str, str]:
    """(the first frame outside torch and this file, the torch file that made the call or "")."""
    frame = sys._getframe(2)
    via = ""
    while frame is not None and frame.f_code.co_filename.startswith((_TORCH, _HERE, _GATE)):
        if not via and frame.f_code.co_filename.startswith(_TORCH):
            via = "torch/" + frame.f_code.co_filename[len(_TORCH) + 1:].replace("\\", "/")
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?", via
    path = Path(frame.f_code.co_filename)
    return f"{path.parent.name}/{path.name}:{frame.f_lineno} ({frame.f_code.co_name})", via


class SyncSites:
    """``with syncs: ...`` counts host syncs (the calls of ``SYNCING_CALLS``)
    of the block, adding to ``calls`` and ``sites`` on every use."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        #: where each call came from: "dir/file:line (function)", plus " via torch/..." when torch called it
        self.sites: list[str] = []
        self._thread: int | None = None
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def by_site(self) -> dict[str, int]:
        """``"call at site"`` -> count, in first-seen order."""
        out: dict[str, int] = {}
        for call, site in zip(self.calls, self.sites):
            out[f"{call} at {site}"] = out.get(f"{call} at {site}", 0) + 1
        return out

    def _wrap(self, func: Callable[..., Any]) -> Callable[..., Any]:
        inner = getattr(func, "__wrapped__", func)
        name = getattr(inner, "__qualname__", inner.__name__)

        def counted(*args: Any, **kwargs: Any) -> Any:
            # once per call: a torch-function mode hands the call back through this wrapper
            if threading.get_ident() != self._thread or getattr(self._inside, "busy", False):
                return func(*args, **kwargs)
            site, via = _site()
            self.calls.append(name)
            self.sites.append(f"{site} via {via}" if via else site)
            self._inside.busy = True
            try:
                return func(*args, **kwargs)
            finally:
                self._inside.busy = False

        return counted

    def __enter__(self) -> SyncSites:
        if self._thread is not None:
            raise RuntimeError("SyncSites is already counting")
        self._thread = threading.get_ident()
        for owner, name, func in _targets():
            self._saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, self._wrap(func))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in reversed(self._saved):
            if own is None:
                delattr(owner, name)  # it was inherited (from TensorBase)
            else:
                setattr(owner, name, own)
        self._saved, self._thread = [], None
