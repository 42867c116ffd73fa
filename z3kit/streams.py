"""StreamPair: a device's compute stream and one communication stream.

Note: buffer lifetime across streams.
    A tensor allocated on one stream and used by another may be handed back
    to the caching allocator while the other stream still reads or writes it.
    torch offers two remedies: ``Tensor.record_stream`` (the allocator defers
    reuse until the stream's work at free time is done, but the deferral is
    invisible and can hold memory long past need) or holding a Python
    reference until an event recorded after the last use completes. We hold
    references: the rule is explicit, works the same on every backend that
    has events (CUDA, NPU, XPU), and the held set is pruned each time the
    pair is used, so memory comes back as soon as the work is done.

On CPU there are no asynchronous streams: ``SyncStreamPair`` runs everything
inline and its waits are no-ops; asynchrony there comes from the process
group's work handles, not from streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class StreamPairLike(Protocol):
    """What the runtime needs from a stream pair."""

    @property
    def device(self) -> torch.device: ...

    def on_comm(self) -> contextlib.AbstractContextManager[None]: ...

    def comm_wait_compute(self) -> None: ...

    def compute_wait_comm(self) -> None: ...

    def hold_until_comm_done(self, *tensors: torch.Tensor) -> None: ...

    def synchronize(self) -> None: ...


class StreamPair:
    """Compute + communication stream of one accelerator device.

    ``on_comm()`` runs the enclosed work on the comm stream, after making the
    comm stream wait for the work already queued on the compute stream (so a
    collective never reads a buffer that compute is still writing).
    ``compute_wait_comm()`` makes the compute stream wait for everything
    queued on the comm stream so far. ``hold_until_comm_done`` keeps tensors
    alive until the comm stream has finished with them (see the Note above).
    """

    def __init__(self, device: torch.device | str) -> None:
        device = _as_device(device)
        if device.type == "cpu":
            raise ValueError("StreamPair needs an accelerator device; use SyncStreamPair on CPU")
        self._device = device
        self._module: Any = torch.get_device_module(device)
        if not self._module.is_available():
            raise ValueError(f"StreamPair needs a {device.type} device, but none is available")
        self.compute = self._module.current_stream(device)
        self.comm = self._module.Stream(device=device)
        self._held: list[tuple[Any, tuple[torch.Tensor, ...]]] = []

    @property
    def device(self) -> torch.device:
        return self._device

    @contextlib.contextmanager
    def on_comm(self) -> Iterator[None]:
        self.comm_wait_compute()
        with self._module.stream(self.comm):
            yield

    def comm_wait_compute(self) -> None:
        self.comm.wait_stream(self.compute)

    def compute_wait_comm(self) -> None:
        self.compute.wait_stream(self.comm)

    def hold_until_comm_done(self, *tensors: torch.Tensor) -> None:
        event = self.comm.record_event()
        self._held.append((event, tensors))
        self._prune()

    def _prune(self) -> None:
        self._held = [(e, t) for e, t in self._held if not e.query()]

    def synchronize(self) -> None:
        self.comm.synchronize()
        self._held.clear()


class SyncStreamPair:
    """Synchronous stand-in for CPU: same interface, everything runs inline.

    Held tensors are released at once, since inline work is complete when
    the call that issued it returns.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device("cpu") if device is None else _as_device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    @contextlib.contextmanager
    def on_comm(self) -> Iterator[None]:
        yield

    def comm_wait_compute(self) -> None:
        pass

    def compute_wait_comm(self) -> None:
        pass

    def hold_until_comm_done(self, *tensors: torch.Tensor) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _as_device(device: torch.device | str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        return torch.device(device)
    raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__}")


def stream_pair_for(device: torch.device | str) -> StreamPair | SyncStreamPair:
    """The stream pair that fits ``device``: real streams on accelerators, inline on CPU."""
    device = _as_device(device)
    return SyncStreamPair(device) if device.type == "cpu" else StreamPair(device)
