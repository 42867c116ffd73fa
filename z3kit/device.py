"""Device resolution: which accelerator this process drives and which
process-group backend fits it.

Resolution goes through torch's device-agnostic ``torch.accelerator`` API.
Ascend NPUs register themselves with that API only once ``torch_npu`` is
imported, so the NPU probe imports it first when it is installed; it is an
optional dependency and its absence is not an error.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import attrs
import torch

from z3kit.validate import check_int

#: process-group backend for each device type.
BACKEND_FOR_DEVICE_TYPE: dict[str, str] = {
    "cuda": "nccl",
    "npu": "hccl",
    "xpu": "xccl",
    "cpu": "gloo",
}


@attrs.frozen
class DeviceInfo:
    """The device this rank computes on and the backend its collectives use."""

    device: torch.device
    backend: str

    @property
    def type(self) -> str:
        return self.device.type

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"


def device_type_for_backend(backend: str) -> str:
    """The device type a process-group backend communicates (the inverse of
    ``BACKEND_FOR_DEVICE_TYPE``). A third-party backend registered with
    ``torch.distributed.Backend.register_backend(name, ..., devices=[one])``
    communicates that one device type (a test double of an accelerator
    backend, say, that runs on CPU)."""
    for device_type, known in BACKEND_FOR_DEVICE_TYPE.items():
        if known == backend:
            return device_type
    registered = getattr(getattr(torch.distributed, "Backend", None), "backend_capability", {}).get(backend)
    if registered is not None and len(registered) == 1:
        return str(registered[0])
    raise ValueError(
        f"process-group backend {backend!r} is not supported; use one of {sorted(BACKEND_FOR_DEVICE_TYPE.values())}"
    )


def _import_torch_npu() -> bool:
    """Import torch_npu if it is installed; True when it imported."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the "npu" device with torch)

    return True


def accelerator_type() -> str:
    """Type string of the accelerator present ("cuda", "npu", "xpu"), else "cpu"."""
    _import_torch_npu()
    # is_available first: current_accelerator() names the type the build was compiled for, devices
    # or not (cuda from a CUDA build of torch on a machine without a GPU)
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if current is not None and current.type != "cpu":
        return current.type
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def backend_for(device: torch.device | str) -> str:
    """Process-group backend that fits a device (nccl, hccl, xccl or gloo)."""
    if isinstance(device, torch.device):
        device_type = device.type
    elif isinstance(device, str):
        # parse the type ourselves: torch.device("npu") fails until torch_npu is imported,
        # and torch raises RuntimeError for strings it does not know
        device_type = device.split(":", 1)[0].strip()
    else:
        raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__}")
    if device_type not in BACKEND_FOR_DEVICE_TYPE:
        raise ValueError(
            f"no process-group backend is known for device type {device_type!r}; "
            f"known types: {sorted(BACKEND_FOR_DEVICE_TYPE)}"
        )
    return BACKEND_FOR_DEVICE_TYPE[device_type]


def resolve_device(local_rank: int | None = None, prefer: str | None = None) -> DeviceInfo:
    """The device for this process and its backend.

    ``local_rank`` (default: ``$LOCAL_RANK`` or 0) picks one device of several,
    one process per device as under torchrun. ``prefer="cpu"`` forces the CPU
    even where an accelerator exists.
    """
    if prefer is not None and prefer not in BACKEND_FOR_DEVICE_TYPE:
        raise ValueError(f"prefer must be one of {sorted(BACKEND_FOR_DEVICE_TYPE)}, got {prefer!r}")
    if local_rank is None:
        raw = os.environ.get("LOCAL_RANK", "0")
        try:
            local_rank = int(raw)
        except ValueError:
            raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None
    local_rank = check_int("local_rank", local_rank, at_least=0)
    device_type = prefer or accelerator_type()
    if device_type == "cpu":
        return DeviceInfo(torch.device("cpu"), "gloo")
    # count the devices of *this* type: torch.accelerator counts only the current
    # accelerator's, and a preferred type that is absent must not resolve to a device
    count = device_count(device_type)
    if count == 0:
        raise ValueError(f"no {device_type} device is available (prefer={prefer!r})")
    if local_rank >= count:
        raise ValueError(f"local_rank {local_rank} but only {count} {device_type} devices are visible")
    return DeviceInfo(torch.device(device_type, local_rank), backend_for(device_type))


def device_count(device_type: str) -> int:
    """Number of visible devices of ``device_type`` (0 when the type is absent)."""
    if device_type == "cpu":
        return 1
    if device_type == "npu" and not _import_torch_npu():
        return 0
    try:
        module = torch.get_device_module(device_type)
    except (RuntimeError, AttributeError, ValueError):
        return 0
    try:
        return int(module.device_count()) if module.is_available() else 0
    except (RuntimeError, AttributeError, AssertionError):
        return 0


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device. Every thread a
    runtime starts calls this first: on CUDA a new thread starts on device 0,
    so a thread that touches streams, events or communicators without it
    makes a context on (and works against) the first GPU of the node.
    Nothing to do on CPU."""
    if device.type == "cpu":
        return
    module = torch.get_device_module(device)
    module.set_device(device if device.index is not None else module.current_device())


def event_after(device: torch.device) -> Any:
    """An event recorded on ``device``'s current stream (``query()`` never
    blocks and is safe from any thread); None on CPU, which has none."""
    if device.type == "cpu":
        return None
    stream = torch.get_device_module(device).current_stream(device)
    return stream.record_event()
