"""The adapter over torch's private process-group names (``z3kit.process_group``)
and the watcher thread beside the hot path (``z3kit.peer_watch``), pinned on
real gloo groups: a torch release that changes one of them fails here first."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.dist_pool import fresh_group
from z3kit.host_copy import HostCopy, to_device
from z3kit.peer_watch import Followed, PeerWatcher
from z3kit.sideband import Notice, SideBand


def run_adapter(ctx: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from z3kit import process_group

    group = dist.new_group(ranks=list(range(ctx.world)), timeout=timedelta(seconds=123), use_local_synchronization=True)
    store = process_group.shared_store()
    key = f"adapter-test/{ctx.rank}"
    store.set(key, "here")
    dist.barrier(group=group)
    seen = [store.get(f"adapter-test/{r}").decode() for r in range(ctx.world)]
    return {
        "waits_on_host": process_group.waits_on_host(group),
        "timeout": process_group.timeout_of(group),
        "seen": seen,
    }


@pytest.mark.parametrize("world", [1, 2])
def test_adapter_reads_store_timeout_and_backend(pools: Any, world: int) -> None:
    for out in pools.run(world, run_adapter):
        assert out["waits_on_host"] is True  # gloo blocks the host in wait()
        assert out["timeout"] == timedelta(seconds=123)
        assert out["seen"] == ["here"] * world


def run_abort(ctx: Any) -> bool:
    from z3kit import process_group

    return process_group.abort(fresh_group(ctx))


def test_abort_is_offered_by_this_torch(pools: Any) -> None:
    """``ProcessGroup.abort`` exists and runs (what it does to a peer is the
    backend's: NCCL fails the work in flight; gloo's peers learn only when
    the process exits, which is why gloo keeps the watched waits)."""
    assert pools.run(2, run_abort) == [True, True]


class _Store:
    """An in-memory stand-in for a TCPStore's set/get/add/check (one process)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return bytes(self.data[key])

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.data[key] = int(self.data.get(key, 0)) + n
            return int(self.data[key])

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def test_board_readers_each_see_every_notice() -> None:
    store = _Store()
    rank0, rank1 = SideBand(store, "b", 0, 2), SideBand(store, "b", 1, 2)
    other = rank0.reader()
    rank1.post("one")
    assert rank0.unread() == [Notice(1, "one")]
    rank1.post("two")
    assert other.unread() == [Notice(1, "one"), Notice(1, "two")]
    assert rank0.unread() == [Notice(1, "two")]
    assert other.unread() == [] and rank1.unread() == []  # a rank's own notices are not news to it


def test_watcher_hands_over_notices_and_reports_a_stall() -> None:
    store = _Store()
    board, peer = SideBand(store, "w", 0, 2), SideBand(store, "w", 1, 2)
    heard: list[Notice] = []
    stalls: list[tuple[float, str]] = []
    finished = threading.Event()

    def on_notices(notices: list[Notice]) -> bool:
        heard.extend(notices)
        return False

    def on_stall(seconds: float, what: str) -> bool:
        stalls.append((seconds, what))
        return True

    watcher = PeerWatcher(board.reader(), timeout_s=0.3, on_notices=on_notices, on_stall=on_stall, poll_s=0.02)
    watcher.start()
    watcher.follow(Followed(finished.is_set, "done soon"))
    peer.post("hello")
    finished.set()
    deadline = time.monotonic() + 5
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heard == [Notice(1, "hello")]
    time.sleep(0.1)
    assert watcher.in_flight() == 0 and not stalls  # finished collectives are dropped, not reported
    watcher.follow(Followed(lambda: False, "never finishes"))
    while watcher.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not watcher.running  # on_stall said stop
    assert len(stalls) == 1 and stalls[0][1] == "never finishes" and stalls[0][0] > 0.3
    assert watcher.error is None


def test_host_copy_on_cpu_is_the_tensor_itself() -> None:
    values = to_device([1, 2, 3], torch.int64, torch.device("cpu"))
    copy = HostCopy(values * 2)
    assert copy.ready() and copy.host().tolist() == [2, 4, 6] and not copy.blocked
