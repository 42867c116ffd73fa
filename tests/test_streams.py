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

from z3kit.stream_check import RecordingStreamPair
from z3kit.streams import StreamPair, StreamPairLike, SyncStreamPair, stream_pair_for

PROTOCOL_MEMBERS = ["device", "communicate", "complete", "synchronize"]


def test_sync_stream_pair_runs_inline_and_closes_tickets() -> None:
    pair = SyncStreamPair()
    assert pair.device == torch.device("cpu")
    a, b = torch.ones(2), torch.zeros(2)
    with pair.communicate(reads=[a], writes=[b], label="copy") as ticket:
        b.copy_(a)
    assert ticket.reads == (a,) and ticket.writes == (b,) and not ticket.completed
    with pytest.raises(KeyError, match="boom"), pair.communicate(reads=[], writes=[]):
        raise KeyError("boom")  # errors inside the communication block are not swallowed
    finished: list[str] = []
    pair.complete(ticket, lambda: finished.append("finish"))
    pair.complete(ticket, lambda: finished.append("again"))  # a completed ticket is not finished twice
    assert finished == ["finish"] and ticket.completed and ticket.reads == ticket.writes == ()
    pair.synchronize()


def test_both_pairs_have_the_protocol_interface() -> None:
    for member in PROTOCOL_MEMBERS:
        assert hasattr(StreamPairLike, member)
        for cls in (StreamPair, SyncStreamPair, RecordingStreamPair):
            assert hasattr(cls, member), f"{cls.__name__} lacks {member}"
    for name in PROTOCOL_MEMBERS[1:]:
        expected = list(inspect.signature(getattr(StreamPairLike, name)).parameters)
        for cls in (StreamPair, SyncStreamPair, RecordingStreamPair):
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
    def __init__(self, name: str) -> None:
        self.name = name


class _FakeStream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        self.events = 0

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(f"{self.name}.wait({other.name})")

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(f"{self.name}.wait({event.name})")

    def record_event(self) -> _FakeEvent:
        self.events += 1
        event = _FakeEvent(f"{self.name}.event{self.events}")
        self.log.append(f"{self.name}.record({event.name})")
        return event

    def synchronize(self) -> None:
        self.log.append(f"{self.name}.synchronize")


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


def test_stream_pair_orders_comm_after_compute_and_compute_after_the_event(fake_cuda: _FakeModule) -> None:
    pair = stream_pair_for(torch.device("cuda", 0))
    assert isinstance(pair, StreamPair) and pair.device == torch.device("cuda", 0)
    assert pair.compute.name == "compute" and pair.comm.name == "comm"
    a = torch.ones(2)
    with pair.communicate(reads=[a], writes=[a], label="all_reduce") as ticket:
        assert fake_cuda.current_stream() is pair.comm
        fake_cuda.log.append("collective")
    assert fake_cuda.current_stream() is pair.compute
    assert ticket.reads == (a,) and not ticket.completed  # held until completed
    pair.complete(ticket, lambda: fake_cuda.log.append("wait + follow-ups"))
    assert ticket.completed and ticket.event.name == "comm.event1" and ticket.reads == ()
    pair.complete(ticket, lambda: fake_cuda.log.append("never"))
    assert fake_cuda.log == [
        "comm.wait(compute)", "enter comm", "collective", "exit comm",
        "comm.wait(compute)", "enter comm", "wait + follow-ups", "comm.record(comm.event1)", "exit comm", "compute.wait(comm.event1)",
    ]


def test_stream_pair_keeps_the_ticket_open_when_finish_fails(fake_cuda: _FakeModule) -> None:
    pair = StreamPair(torch.device("cuda", 0))
    a = torch.ones(2)
    ref = weakref.ref(a)
    with pair.communicate(reads=[a], writes=[], label="x") as ticket:
        pass
    del a

    def fail() -> None:
        raise RuntimeError("rank 1 failed")

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        pair.complete(ticket, fail)
    gc.collect()
    assert not ticket.completed and ref() is not None, "a buffer of an unfinished communication was freed"
    assert "compute.wait" not in " ".join(fake_cuda.log)
