"""Device resolution: accelerator type, backend per device type, bad inputs.

This machine has no accelerator, so the accelerator paths are driven by
faking what torch reports (monkeypatch, undone after each test).
"""

from __future__ import annotations

import pytest
import torch

from z3kit import device as zdevice
from z3kit.device import DeviceInfo, accelerator_type, backend_for, device_count, resolve_device


@pytest.mark.parametrize(
    ("device", "backend"),
    [
        ("cuda", "nccl"),
        ("cuda:3", "nccl"),
        (torch.device("cuda", 1), "nccl"),
        ("npu", "hccl"),  # parsed without torch_npu installed
        ("npu:0", "hccl"),
        ("xpu", "xccl"),
        (torch.device("xpu"), "xccl"),
        ("cpu", "gloo"),
        (torch.device("cpu"), "gloo"),
    ],
)
def test_backend_for_maps_device_types(device: torch.device | str, backend: str) -> None:
    assert backend_for(device) == backend


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "mps", "bogus", ""])
def test_backend_for_rejects_unknown_device_types(device: torch.device | str) -> None:
    with pytest.raises(ValueError, match="no process-group backend is known for device type"):
        backend_for(device)


@pytest.mark.parametrize("device", [None, 0, 1.5, ["cuda"]])
def test_backend_for_rejects_non_devices(device: object) -> None:
    with pytest.raises(TypeError, match="device must be a torch.device or a str"):
        backend_for(device)  # type: ignore[arg-type]


def test_accelerator_type_is_cpu_without_accelerator() -> None:
    if torch.cuda.is_available() or torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    assert accelerator_type() == "cpu"


def test_accelerator_type_follows_torch_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("xpu"))
    assert accelerator_type() == "xpu"


def test_accelerator_type_is_cpu_where_the_build_has_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch >= 2.7's current_accelerator() names the type the build was compiled for, devices or not
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert accelerator_type() == "cpu"


def test_accelerator_type_falls_back_to_cuda_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert accelerator_type() == "cuda"


def test_resolve_device_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zdevice, "accelerator_type", lambda: "cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    info = resolve_device()
    assert info == DeviceInfo(torch.device("cpu"), "gloo")
    assert info.type == "cpu" and not info.is_accelerator
    assert resolve_device(prefer="cpu") == DeviceInfo(torch.device("cpu"), "gloo")


def test_resolve_device_picks_local_rank_of_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zdevice, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = resolve_device()
    assert info.device == torch.device("cuda", 1) and info.backend == "nccl"
    assert info.type == "cuda" and info.is_accelerator
    assert resolve_device(local_rank=0).device == torch.device("cuda", 0)
    assert resolve_device(local_rank=1, prefer="cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="local_rank 2 but only 2 cuda devices are visible"):
        resolve_device(local_rank=2)


def test_resolve_device_refuses_absent_preferred_accelerator() -> None:
    if device_count("cuda") > 0:
        pytest.skip("CUDA is present")
    assert device_count("cuda") == 0 and device_count("npu") == 0 and device_count("cpu") == 1
    with pytest.raises(ValueError, match="no cuda device is available"):
        resolve_device(local_rank=0, prefer="cuda")


@pytest.mark.parametrize(
    ("kwargs", "env", "exc", "match"),
    [
        ({"prefer": "tpu"}, None, ValueError, "prefer must be one of"),
        ({"prefer": "CPU"}, None, ValueError, "prefer must be one of"),
        ({"local_rank": -1}, None, ValueError, "local_rank must be >= 0"),
        ({"local_rank": "0"}, None, TypeError, "local_rank must be an int"),
        ({"local_rank": 1.0}, None, TypeError, "local_rank must be an int"),
        ({}, "zero", ValueError, "LOCAL_RANK must be an integer"),
        ({}, "-2", ValueError, "local_rank must be >= 0"),
    ],
)
def test_resolve_device_bad_inputs(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object], env: str | None, exc: type, match: str
) -> None:
    monkeypatch.setattr(zdevice, "accelerator_type", lambda: "cpu")
    if env is not None:
        monkeypatch.setenv("LOCAL_RANK", env)
    with pytest.raises(exc, match=match):
        resolve_device(**kwargs)  # type: ignore[arg-type]


def test_a_backend_registered_for_one_device_type_communicates_that_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """Third-party backends (a CPU test double of an accelerator backend, say)
    register their device types with torch; one type is unambiguous."""
    import torch.distributed as dist

    monkeypatch.setitem(dist.Backend.backend_capability, "fake-accel", ["cpu"])
    monkeypatch.setitem(dist.Backend.backend_capability, "two-devices", ["cpu", "cuda"])
    assert zdevice.device_type_for_backend("fake-accel") == "cpu"
    assert zdevice.device_type_for_backend("nccl") == "cuda"
    for unknown in ("two-devices", "never-registered"):
        with pytest.raises(ValueError, match="is not supported"):
            zdevice.device_type_for_backend(unknown)
