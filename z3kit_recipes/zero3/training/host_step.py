"""The offloaded masters' optimizer step, on a host thread behind the next forward.

``HostStep.launch`` starts the step of the host masters and returns: a
thread of its own waits for their gradients to reach the host, then, chunk
by chunk in the order the next forward gathers the parameters, scales the
gradients (the loss scale and the clip the device applied to its
partitions), steps the chunk (``zero3.training.chunked_optimizer``) and
copies the updated masters into their compute-dtype shards, recording an
event after each chunk.

Note: who waits for what.
    The update of a shard is needed only before that shard is read again.
    A gather of parameters (``fence``, called by the ``Gatherer`` before it
    issues one) waits for their chunk: the host until the thread has
    queued the chunk's copies, the compute stream for the copies
    themselves (the gather's stream waits on it). Everything else that
    reads or writes the masters, the shards or the optimizer's state as a
    whole (a checkpoint, ``full_state_dict``, ``stats()``, the next step,
    ``optimizer.state_dict()``) first waits for the whole step
    (``settle``). An exception in the thread is raised there, on this
    rank, where a failed forward is posted to every rank.

Note: the persistent parameters wait on their chunk too.
    ``engine.step()`` frees the gathered copies of every shard it changed
    and gathers the persistent ones again at once; a gather issued there
    would wait for the host to step its chunk, so ``step()`` would wait for
    the host. The parameters a running step writes (``writes``: fixed at
    ``launch``, the same on every rank, never a measure of progress) are
    therefore left to the next forward, which gathers each persistent one
    as it first needs it, behind that gather's fence, like any other
    (``EngineCore.step``); they stay gathered from then on. So the chunks
    follow the trace's order alone, and ``step()`` returns while the first
    chunk is still being stepped. What it costs: that forward gathers even
    when every parameter is persistent (an eval forward there meets the
    other ranks, ``zero3.ranks.uneven``), and a parameter pinned by
    ``gathered_parameters`` across the step is still gathered in ``step()``,
    which then waits for its chunk.

Note: what the main thread never touches while a step runs.
    The thread reads the host gradient buffers, its own copy of the
    hyperparameters and aliases of the masters, and writes the masters'
    storage, their optimizer state and the shards; the main thread writes
    the buffers again only from the next window's landings, after
    ``settle``, and reads the rest only after a fence.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from z3kit.device import use_device
from z3kit_recipes.zero3.training.chunked_optimizer import ChunkedStep

#: chunks a host step is cut into (a gather waits for one chunk, not the step)
CHUNKS = 8


class HostStepFailed(RuntimeError):
    """The optimizer step of the offloaded masters raised on its host thread."""


class _Chunk:
    """A part of the step: its masters, and when their shards are written."""

    def __init__(self, index: int, pids: list[int]) -> None:
        self.index, self.pids = index, pids
        self.queued = threading.Event()
        self.event: Any = None  # the write-back stream's event after the chunk's copies (accelerators)


def cut(order: Sequence[int], numels: dict[int, int], chunks: int = CHUNKS) -> list[list[int]]:
    """``order`` cut into at most ``chunks`` runs of about equal elements (a run
    ends where the running total first reaches its share of the whole)."""
    total = sum(numels[p] for p in order)
    out: list[list[int]] = [[]]
    done = 0
    for pid in order:
        out[-1].append(pid)
        done += numels[pid]
        if done * chunks >= total * len(out) and len(out) < chunks:
            out.append([])
    return [run for run in out if run]


class HostStep:
    """The host masters' steps of one engine (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module: Any = None if device.type == "cpu" else torch.get_device_module(device)
        self._stream: Any = None if self._module is None else self._module.Stream(device=device)
        self._chunk_of: dict[int, _Chunk] = {}
        self._chunks: list[_Chunk] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: called on the main thread once a step is settled (the ledger measures the state it created)
        self.on_settled: Callable[[], None] | None = None
        #: called on the step's thread with a chunk's index before the chunk is stepped: a view of
        #: the thread's progress for a profiler or a test (tests/test_zero3_offload_overlap.py holds
        #: the first chunk there to show that ``engine.step()`` does not wait for it)
        self.on_chunk: Callable[[int], None] | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def writes(self) -> frozenset[int]:
        """The parameters whose shards the running step writes (empty when none
        runs), whether written yet or not: what ``launch`` was given."""
        return frozenset(self._chunk_of)

    def launch(
        self,
        step: ChunkedStep,
        chunks: list[list[int]],
        pairs: dict[int, tuple[nn.Parameter, torch.Tensor, torch.Tensor]],
        *,
        grads_ready: Any,
        factor: float | torch.Tensor | None,
    ) -> None:
        """Step ``pairs`` (pid: master, host gradient, shard) in ``chunks`` on
        the thread. ``grads_ready``: an event after the gradients' copies to
        the host (None on CPU); ``factor``: what the device partitions were
        multiplied by (on the device), applied to the host gradients too."""
        self.settle()
        self._chunks = [_Chunk(i, pids) for i, pids in enumerate(chunks)]
        self._chunk_of = {pid: c for c in self._chunks for pid in c.pids}
        if len(self._chunk_of) != sum(len(c) for c in chunks) or self._chunk_of.keys() != pairs.keys():
            raise ValueError("each parameter of a host step must be in exactly one chunk")  # else stepped twice
        self._thread = threading.Thread(target=self._run, args=(step, pairs, grads_ready, factor),
                                        name="z3kit-host-step", daemon=True)
        self._thread.start()

    def _run(self, step: ChunkedStep, pairs: dict[int, tuple[nn.Parameter, torch.Tensor, torch.Tensor]],
             grads_ready: Any, factor: float | torch.Tensor | None) -> None:
        try:
            use_device(self.device)  # a new thread starts on device 0 (CUDA): the stream and events are this rank's
            if grads_ready is not None:
                grads_ready.synchronize()
            host_factor = factor.to("cpu") if isinstance(factor, torch.Tensor) else factor
            for chunk in self._chunks:
                if self.on_chunk is not None:
                    self.on_chunk(chunk.index)
                for pid in chunk.pids:
                    if host_factor is not None:
                        pairs[pid][1].mul_(host_factor)
                step.step([pairs[pid][:2] for pid in chunk.pids])
                chunk.event = self._write_back([pairs[pid] for pid in chunk.pids])
                chunk.queued.set()
        except BaseException as exc:  # raised on the main thread by fence or settle
            self._error = exc
        finally:
            for chunk in self._chunks:
                chunk.queued.set()

    def _write_back(self, triples: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]) -> Any:
        if self._module is None:
            for master, _, shard in triples:
                shard.copy_(master.detach())
            return None
        with self._module.stream(self._stream):
            for master, _, shard in triples:
                shard.copy_(master.detach(), non_blocking=True)
            return self._stream.record_event()

    def fence(self, pids: Sequence[int]) -> None:
        """Before ``pids`` are gathered: their chunks' shards are written, or the compute stream waits for them."""
        if self._thread is None:
            return
        last = max((c.index for c in (self._chunk_of.get(p) for p in pids) if c is not None), default=None)
        if last is None:
            return
        chunk = self._chunks[last]  # chunks are written in order: the last one needed covers the others
        chunk.queued.wait()
        self._raise(clear=False)  # until the step is settled, every gather of this rank refuses
        if chunk.event is not None:
            self._module.current_stream(self.device).wait_event(chunk.event)

    def settle(self) -> None:
        """Wait for the whole step (see the Note); raises what the step raised."""
        thread = self._thread
        if thread is None:
            return
        thread.join()
        self._thread, self._chunk_of = None, {}
        if self._stream is not None:
            # the masters are written again at the next step (or by a load): the copies out of them must be done
            self._stream.synchronize()
        self._raise(clear=True)
        if self.on_settled is not None:
            self.on_settled()

    def _raise(self, *, clear: bool) -> None:
        if self._error is not None:
            error = self._error
            if clear:
                self._error = None
            raise HostStepFailed(
                f"the optimizer step of the offloaded masters failed on its host thread: {error!r}") from error
