"""StreamPair and its synchronous CPU stand-in.

There is no accelerator here, so ``StreamPair``'s logic (which stream waits
for which, what is held until which event) is driven through a fake device
module that records what it is asked to do.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from z3kit.streams import StreamPair, StreamPairLike, SyncStreamPair, stream_pair_for

PROTOCOL_MEMBERS = ["device", "on_comm", "comm_wait_compute", "compute_wait_comm", "hold_until_comm_done", "synchronize"]


def test_sync_stream_pair_runs_inline_and_holds_nothing() -> None:
    pair = SyncStreamPair()
    assert pair.device == torch.device("cpu")
    ran = []
    with pair.on_comm():
        ran.append("comm")
    assert ran == ["comm"]
    with pytest.raises(KeyError, match="boom"), pair.on_comm():
        raise KeyError("boom")  # errors inside the comm block are not swallowed
    pair.comm_wait_compute()
    pair.compute_wait_comm()
    t = torch.ones(4)
    ref = weakref.ref(t)
    pair.hold_until_comm_done(t)
    del t
    gc.collect()
    assert ref() is None, "the synchronous pair must not keep held tensors alive"
    pair.synchronize()


def test_both_pairs_have_the_protocol_interface() -> None:
    for member in PROTOCOL_MEMBERS:
        assert hasattr(StreamPairLike, member)
        for cls in (StreamPair, SyncStreamPair):
            assert hasattr(cls, member), f"{cls.__name__} lacks {member}"
    for name in PROTOCOL_MEMBERS[1:]:
        expected = list(inspect.signature(getattr(StreamPairLike, name)).parameters)
        for cls in (StreamPair, SyncStreamPair):
            assert list(inspect.signature(getattr(cls, name)).parameters) == expected, (cls.__name__, name)


def test_stream_pair_refuses_cpu_and_absent_accelerators() -> None:
    with pytest.raises(ValueError, match="StreamPair needs an accelerator device; use SyncStreamPair on CPU"):
        StreamPair(torch.device("cpu"))
    with pytest.raises(ValueError, match="StreamPair needs an accelerator"):
        StreamPair("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a cuda device, but none is available"):
            StreamPair(torch.device("cuda", 0))


def test_stream_pair_for_picks_by_device_type() -> None:
    for device in (torch.device("cpu"), "cpu"):
        pair = stream_pair_for(device)
        assert type(pair) is SyncStreamPair and pair.device == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda device, but none is available"):
            stream_pair_for(torch.device("cuda"))  # an accelerator gets real streams, never the stand-in
    with pytest.raises(TypeError, match="device must be a torch.device or a str"):
        stream_pair_for(0)  # type: ignore[arg-type]


# --- StreamPair over a fake device module ------------------------------------------


class _FakeEvent:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.complete = log, name, False

    def query(self) -> bool:
        return self.complete


class _FakeStream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        self.events: list[_FakeEvent] = []

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(f"{self.name}.wait({other.name})")

    def record_event(self) -> _FakeEvent:
        event = _FakeEvent(self.log, f"{self.name}.event{len(self.events)}")
        self.events.append(event)
        self.log.append(f"{self.name}.record")
        return event

    def synchronize(self) -> None:
        self.log.append(f"{self.name}.synchronize")
        for e in self.events:
            e.complete = True


class _FakeModule:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.current: _FakeStream | None = None
        self._compute = _FakeStream(self.log, "compute")

    def is_available(self) -> bool:
        return True

    def current_stream(self, device: Any = None) -> _FakeStream:
        return self.current or self._compute

    def Stream(self, device: Any = None) -> _FakeStream:  # noqa: N802 - mirrors torch.cuda.Stream
        return _FakeStream(self.log, "comm")

    @contextlib.contextmanager
    def stream(self, s: _FakeStream) -> Iterator[None]:
        before, self.current = self.current, s
        self.log.append(f"enter {s.name}")
        try:
            yield
        finally:
            self.current = before
            self.log.append(f"exit {s.name}")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeModule:
    fake = _FakeModule()
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: fake)
    return fake


def test_stream_pair_orders_comm_after_compute(fake_cuda: _FakeModule) -> None:
    pair = stream_pair_for(torch.device("cuda", 0))
    assert isinstance(pair, StreamPair) and pair.device == torch.device("cuda", 0)
    assert pair.compute.name == "compute" and pair.comm.name == "comm"
    with pair.on_comm():
        assert fake_cuda.current_stream() is pair.comm
        fake_cuda.log.append("collective")
    assert fake_cuda.current_stream() is pair.compute
    pair.compute_wait_comm()
    assert fake_cuda.log == ["comm.wait(compute)", "enter comm", "collective", "exit comm", "compute.wait(comm)"]


def test_stream_pair_holds_tensors_until_comm_event_completes(fake_cuda: _FakeModule) -> None:
    pair = StreamPair(torch.device("cuda", 0))
    a, b = torch.ones(2), torch.ones(3)
    ref_a, ref_b = weakref.ref(a), weakref.ref(b)
    pair.hold_until_comm_done(a)
    del a
    gc.collect()
    assert ref_a() is not None, "a tensor in use by the comm stream was freed early"
    pair.comm.events[0].complete = True
    pair.hold_until_comm_done(b)  # the next use prunes what is done
    del b
    gc.collect()
    assert ref_a() is None and ref_b() is not None
    pair.synchronize()
    gc.collect()
    assert ref_b() is None
    assert "comm.synchronize" in fake_cuda.log
