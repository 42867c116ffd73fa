"""Device resolution: which accelerator this process drives and which
process-group backend fits it.

Resolution goes through torch's device-agnostic ``torch.accelerator`` API
where it exists (torch >= 2.6). Ascend NPUs register themselves with that API
only once ``torch_npu`` is imported, so the NPU probe imports it first when
it is installed; it is an optional dependency and its absence is not an error.
"""

from __future__ import annotations

import importlib.util
import os

import attrs
import torch

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


def _import_torch_npu() -> bool:
    """Import torch_npu if it is installed; True when it imported."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the "npu" device with torch)

    return True


def accelerator_type() -> str:
    """Type string of the accelerator present ("cuda", "npu", "xpu"), else "cpu"."""
    _import_torch_npu()
    current = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if current is not None and current.type != "cpu":
        return current.type
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def backend_for(device: torch.device | str) -> str:
    """Process-group backend that fits a device (nccl, hccl, xccl or gloo)."""
    device_type = torch.device(device).type
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
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    device_type = prefer or accelerator_type()
    if device_type == "cpu":
        return DeviceInfo(torch.device("cpu"), "gloo")
    count = torch.accelerator.device_count() if hasattr(torch, "accelerator") else 1
    if count and local_rank >= count:
        raise ValueError(f"local_rank {local_rank} but only {count} {device_type} devices are visible")
    return DeviceInfo(torch.device(device_type, local_rank), backend_for(device_type))
