"""StreamPair: a device's compute stream and one communication stream.

A communication that fills or drains buffers runs inside
``pair.communicate(reads=..., writes=...)``, which returns a ``CommTicket``:
the buffers it uses and, once completed, the event recorded after it. The
component that issued it (the parameter coordinator for gathers, the
gradient reducer for reductions) later calls ``pair.complete(ticket,
finish)``: ``finish`` blocks on the collective and runs its follow-ups on
the communication stream, an event is recorded there, and the compute
stream waits on that event. That is the only hand-over from communication
to compute; nothing else orders the two streams.

Note: the two rules.
    1. Compute never reads or writes a buffer a communication writes before
       that communication's ticket is completed (compute waits on its event).
    2. No buffer a communication reads or writes is freed or reused before
       its ticket is completed.
    ``communicate`` makes the communication stream wait for the compute
    stream first, so a collective never reads a buffer that compute is still
    writing. The ticket holds a reference to every buffer until it is
    completed, so dropping one early cannot free it (rule 2), and
    ``complete`` orders everything compute does afterwards behind the event
    (rule 1). ``z3kit.stream_check.RecordingStreamPair`` checks both rules
    on CPU.

Note: where buffers are allocated.
    Buffers that compute touches (gathered parameters, gradient buckets,
    reduction outputs) are allocated on the compute stream, before
    ``communicate`` or, for what a follow-up writes, before ``complete``
    (which makes the communication stream wait for compute first). A block freed on the communication stream could be
    handed to the next communication while compute still reads it;
    allocated on the compute stream, its reuse is ordered behind compute's
    own work. Only staging buffers that compute never sees (a coalesced
    gather's input and output) are allocated inside ``communicate``. This is
    why we hold references instead of calling ``Tensor.record_stream``,
    whose deferred frees are invisible and can hold memory long past need.

On CPU there are no asynchronous streams: ``SyncStreamPair`` runs everything
inline; asynchrony there comes from the process group's work handles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs
import torch


@attrs.define(eq=False)
class CommTicket:
    """One communication: the buffers it reads and writes, held until it is
    completed, and the event recorded after it (None on CPU)."""

    label: str
    reads: tuple[torch.Tensor, ...]
    writes: tuple[torch.Tensor, ...]
    event: Any = None
    completed: bool = False

    def hold(self, *, reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()) -> None:
        """Buffers made inside ``communicate`` (a concatenated input, a
        compacted copy) that the collective uses: held until completion too."""
        self.reads = (*self.reads, *reads)
        self.writes = (*self.writes, *writes)

    def close(self, event: Any = None) -> None:
        """Completed: compute is ordered after the communication; the buffers are the owner's again."""
        self.event, self.completed = event, True
        self.reads = self.writes = ()


class StreamPairLike(Protocol):
    """What the runtime needs from a stream pair."""

    @property
    def device(self) -> torch.device: ...

    def communicate(
        self, *, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], label: str = ""
    ) -> contextlib.AbstractContextManager[CommTicket]: ...

    def complete(self, ticket: CommTicket, finish: Callable[[], object]) -> None: ...

    def synchronize(self) -> None: ...


def _ticket(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], label: str) -> CommTicket:
    return CommTicket(label, tuple(reads), tuple(writes))


#: stream priority of the communication streams: the highest, as FSDP2 gives its own, so
#: that a collective's kernels are scheduled ahead of compute kernels queued beside them
COMM_PRIORITY = -1


class StreamPair:
    """Compute + communication stream of one accelerator device (see the module Notes).

    The compute stream is whatever stream is current when a communication
    is issued or completed, not the one current when the pair was made: a
    user who trains under ``with torch.cuda.stream(s)`` gets ``s`` ordered
    against the collectives."""

    def __init__(self, device: torch.device | str) -> None:
        device = _as_device(device)
        if device.type == "cpu":
            raise ValueError("StreamPair needs an accelerator device; use SyncStreamPair on CPU")
        self._device = device
        self._module: Any = torch.get_device_module(device)
        if not self._module.is_available():
            raise ValueError(f"StreamPair needs a {device.type} device, but none is available")
        try:
            self.comm = self._module.Stream(device=device, priority=COMM_PRIORITY)
        except TypeError:  # a device module whose streams take no priority
            self.comm = self._module.Stream(device=device)

    @property
    def compute(self) -> Any:
        """The stream compute runs on now."""
        return self._module.current_stream(self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @contextlib.contextmanager
    def communicate(
        self, *, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], label: str = ""
    ) -> Iterator[CommTicket]:
        """Run the enclosed collective on the comm stream, after the compute work queued so far."""
        ticket = _ticket(reads, writes, label)
        self.comm.wait_stream(self.compute)
        with self._module.stream(self.comm):
            yield ticket

    def complete(self, ticket: CommTicket, finish: Callable[[], object]) -> None:
        """``finish()`` on the comm stream (waits for the collective, runs its
        follow-ups), then the compute stream waits on the event recorded after it."""
        if ticket.completed:
            return
        compute = self.compute
        # buffers compute allocated for the follow-ups (a gather's copy-out) are written there
        self.comm.wait_stream(compute)
        with self._module.stream(self.comm):
            finish()
            event = self.comm.record_event()
        compute.wait_event(event)
        ticket.close(event)

    def synchronize(self) -> None:
        self.comm.synchronize()


class SyncStreamPair:
    """Synchronous stand-in for CPU: same interface, everything runs inline."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device("cpu") if device is None else _as_device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    @contextlib.contextmanager
    def communicate(
        self, *, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], label: str = ""
    ) -> Iterator[CommTicket]:
        yield _ticket(reads, writes, label)

    def complete(self, ticket: CommTicket, finish: Callable[[], object]) -> None:
        if not ticket.completed:
            finish()
            ticket.close()

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
