"""Small values between host and device without making the host wait.

A runtime's bookkeeping collectives (a check that the ranks agree, a
count) start from values the host has and end in values the host reads.
Done plainly, each is a host sync: ``torch.tensor(values, device=...)``
copies from pageable memory, and ``.tolist()`` on a device tensor waits for
the whole queue of kernels before it. Here both directions go through
pinned memory with ``non_blocking`` copies:

- ``to_device(values, dtype, device)``: staged in pinned memory, copied
  on the current stream; the host moves on at once. The pinned source is
  kept alive by the caching host allocator until the copy ran.
- ``HostCopy(tensor)``: a device tensor's values copied into pinned memory
  on the current stream, with an event recorded after the copy.
  ``ready()`` polls the event; ``tolist()`` reads the values, waiting on
  the event only if the copy has not run yet (``blocked`` says whether it
  had to: that wait is a host sync, and a caller reads where the device
  is known, or expected, to be past it).

On CPU there is nothing to stage: the values already are on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: ``Tensor.tolist`` as torch defines it, kept at import: a sync counter that wraps the
#: method (``tests/sync_sites.py``) must not count reads of values already on the host,
#: whose only possible wait, on the copy's event, this class counts itself (``blocked``)
_HOST_TOLIST = torch.Tensor.tolist


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, without a host sync."""
    host = torch.tensor(list(values), dtype=dtype, pin_memory=device.type != "cpu")
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


class HostCopy:
    """``tensor``'s values on their way to the host (see the module docstring)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: Any = None
        #: the values had not reached the host when they were read (the read was a host sync)
        self.blocked = False
        if tensor.device.type == "cpu":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        module = torch.get_device_module(tensor.device)
        self._event = module.Event()
        self._event.record(module.current_stream(tensor.device))

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def host(self) -> torch.Tensor:
        """The values, on the host (waits for the copy if it has not run)."""
        if self._event is not None and not self._event.query():
            self.blocked = True
            self._event.synchronize()
        if self._event is None:
            # the values are the tensor itself: read through the dispatcher (an alias), so that a
            # process group that models a device on CPU (the tests' double) orders the read behind
            # its collective, as the event does on a device
            return self._host.detach()
        return self._host

    def tolist(self) -> list[Any]:
        """The values as a (nested) list; a wait, if any, was the event's."""
        host = self.host()
        with torch._C.DisableTorchFunction():  # nor through a torch-function mode (``z3kit.host_sync``)
            out: list[Any] = _HOST_TOLIST(host)
        return out
