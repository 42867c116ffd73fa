"""Long-lived pools of gloo worker processes for distributed tests.

Spawning a process and importing torch costs seconds, so each world size
gets one pool of ``world`` processes for the whole test session. A test
sends a module-level function and its arguments; every rank runs
``fn(ctx, *args)`` with ``ctx`` naming its rank, the world size and the
process group, and the results come back as a list indexed by rank.

A failure on one rank is raised in the test with every rank's traceback.
When a rank fails while the others block in a collective, or a call
outlives its timeout, the pool is torn down and the next call starts a
fresh one, so one broken test does not poison the rest.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import attrs

from z3kit_recipes.launch import free_port


@attrs.frozen
class WorkerContext:
    """What a test function learns about the rank it runs on."""

    rank: int
    world: int
    group: Any  # torch.distributed.ProcessGroup (the world group, passed explicitly)


def fresh_group(ctx: WorkerContext) -> Any:
    """A process group of its own over the pool's ranks: a test that leaves
    collectives unfinished (a rank raised while another waited) does not
    poison the pool's group for the tests after it."""
    import torch.distributed as dist

    return dist.new_group(ranks=list(range(ctx.world)), use_local_synchronization=True)


#: the result of a rank whose process exited (``DistPool.run(..., lost_ok=True)``)
LOST = "<process exited>"


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds their tracebacks."""


def _worker(rank: int, world: int, port: int, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    ctx = WorkerContext(rank, world, dist.group.WORLD)
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            break
        if message == b"stop":
            os._exit(0)  # skip process-group teardown: the pool is going away as a whole
        try:
            fn, args, kwargs = pickle.loads(message)
            reply: tuple[str, Any] = ("ok", fn(ctx, *args, **kwargs))
            payload = pickle.dumps(reply)
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            payload = pickle.dumps(("err", traceback.format_exc()))
        conn.send_bytes(payload)
    dist.destroy_process_group()


#: imported once by the fork server, so that a new worker starts with them loaded
PRELOAD = ["torch", "torch.distributed", "transformers", "z3kit_recipes.zero3", "tests.zero3_models",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"]


def _process_context() -> Any:
    """Workers fork from one server process that imported torch and the
    project once (it runs no torch op, so no thread pool is forked): a new
    pool, after a test that kills a rank say, then starts in a fraction of
    a second instead of each worker importing everything again. Without a
    fork server (not on Linux), workers are spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class DistPool:
    """``world`` gloo ranks on loopback, reused across calls."""

    def __init__(self, world: int, start_timeout: float = 180.0) -> None:
        self.world = world
        ctx = _process_context()
        port = free_port()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, child), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(start_timeout):
                self.close()
                raise RuntimeError(f"rank {rank} of a {world}-process pool did not start")
            pickle.loads(conn.recv_bytes())
        self.broken = False

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 240.0, lost_ok: bool = False, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; results by rank.
        ``lost_ok``: a rank whose process exits gives the result ``LOST``
        (for tests of a rank that dies; the pool is broken afterwards)."""
        message = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        results: list[Any] = [None] * self.world
        errors: dict[int, str] = {}
        pending = set(range(self.world))
        deadline = time.monotonic() + timeout
        while pending:
            # once a rank failed, the others get a short grace before the pool is abandoned
            limit = min(deadline, (time.monotonic() + 10.0) if errors else deadline)
            ready = [r for r in pending if self._conns[r].poll(0.01)]
            for r in ready:
                try:
                    status, value = pickle.loads(self._conns[r].recv_bytes())
                except EOFError:
                    self.broken = True
                    status, value = ("ok", LOST) if lost_ok else ("err", f"rank {r}'s process exited\n")
                pending.discard(r)
                if status == "ok":
                    results[r] = value
                else:
                    errors[r] = value
            if pending and time.monotonic() > limit:
                self.broken = True
                self.close()
                hung = ", ".join(map(str, sorted(pending)))
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                raise RankFailure(f"ranks {hung} did not finish {fn.__qualname__} in time{detail}")
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailure(f"{fn.__qualname__} failed on ranks {sorted(errors)}:{detail}")
        return results

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(b"stop")
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []


class PoolSet:
    """One pool per world size, created on first use and replaced if broken."""

    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def run(self, world: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        pool = self._pools.get(world)
        if pool is None or pool.broken:
            pool = self._pools[world] = DistPool(world)
        return pool.run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            if not pool.broken:
                pool.close()
        self._pools.clear()
