"""Starting the ranks: spawned local CPU processes over gloo, or the
process ``torchrun`` started; the process group around each rank's job.

Under ``torchrun`` (``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` set) each
process drives the device that ``z3kit.device.resolve_device`` picks (CUDA
GPU with nccl, Ascend NPU with hccl, else CPU with gloo), one process per
device. Otherwise the command spawns local CPU processes that talk over
gloo on a free loopback port.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from z3kit.device import DeviceInfo, resolve_device
from z3kit_recipes.launch import PYCACHE_DIR, environment, free_port, leave_together, use_bytecode_cache
from z3kit_recipes.train.interrupt import INTERRUPTED, StopRequest, interrupted_line, last_checkpoint
from z3kit_recipes.train.job import run_job
from z3kit_recipes.train.run_folder import missing_folders, remove_if_empty
from z3kit_recipes.train.spec import RunSpec

# torch leaves start_processes untyped; bind it once with the type used here.
_start_processes: Callable[..., Any] = getattr(mp, "start_processes")

#: how long a collective waits for the other ranks before it fails
GROUP_TIMEOUT = timedelta(seconds=600)


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) when launched by torchrun, else None."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(k in os.environ for k in keys):
        return None
    try:
        rank, world, local = (int(os.environ[k]) for k in keys)
    except ValueError:
        raise ValueError(f"torchrun environment is malformed: {[os.environ[k] for k in keys]}") from None
    return rank, world, local


def run_under_torchrun(spec: RunSpec, rank: int, world: int, local_rank: int) -> int:
    """This process is one of torchrun's ranks: run the job here; its exit status."""
    return run_rank(spec, rank, world, resolve_device(local_rank), spawned=False)


def spawn_ranks(spec: RunSpec, nproc: int) -> int:
    """Run the job on ``nproc`` spawned local CPU processes; the exit status
    (1 with the failing rank's error on stderr when one fails; after Ctrl-C,
    ``INTERRUPTED`` and one line that says where to resume from, see
    ``interrupt``: a SIGINT that reaches only this process is passed on to the ranks)."""
    spec = attrs.evolve(spec, port=free_port(), threads=max(1, _cpu_count() // nproc))
    assert spec.out is not None  # main picks the folder when it spawns
    made = missing_folders(Path(spec.out))
    # the ranks read torch's bytecode from the cache before they run any code of ours
    rank_env = {"OMP_NUM_THREADS": str(spec.threads), "PYTHONPYCACHEPREFIX": sys.pycache_prefix or PYCACHE_DIR}
    ranks: list[Any] = []
    interrupted = False

    def pass_on(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        interrupted = True
        for process in ranks:
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, pass_on)
    # when one rank ends with a status, torch ends the rest with SIGTERM and logs each: after Ctrl-C
    # they are past their last barrier, and after a failure the error below says what happened
    spawn_log = logging.getLogger(ProcessExitedException.__module__)  # torch.multiprocessing.spawn
    spawn_log.addFilter(_no_termination_notes)
    try:
        with environment(rank_env):
            # spawn pickles the entry point by its module's name: this
            # module, importable in the child, never a __main__
            context = _start_processes(_spawned_rank, args=(spec, nproc), nprocs=nproc, join=False)
            ranks.extend(context.processes)
            while not context.join():
                pass
    except ProcessRaisedException as exc:
        if not interrupted:
            print(f"error: a rank failed:\n{exc}", file=sys.stderr)
            return 1
    except ProcessExitedException as exc:
        if not interrupted and exc.exit_code != INTERRUPTED:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    else:
        return 0  # every rank finished: a Ctrl-C after the last step changed nothing
    finally:
        signal.signal(signal.SIGINT, previous)
        spawn_log.removeFilter(_no_termination_notes)
    removed = remove_if_empty(made)
    line = interrupted_line(last_checkpoint(Path(spec.out), spec.resume), spec.argv,
                            removed=removed[0] if removed else None, torchrun=False)  # fmt: skip
    print(line, file=sys.stderr, flush=True)
    return INTERRUPTED


def _no_termination_notes(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Terminating process")


def _spawned_rank(rank: int, spec: RunSpec, world: int) -> None:
    faulthandler.enable()  # a rank that dies on a signal says where
    use_bytecode_cache()
    run_rank(spec, rank, world, resolve_device(prefer="cpu"), spawned=True)


def run_rank(spec: RunSpec, rank: int, world: int, info: DeviceInfo, *, spawned: bool) -> int:
    """One rank: join the process group, run the job, leave together; the
    exit status (0, or ``INTERRUPTED`` after Ctrl-C)."""
    started = time.perf_counter()
    stop = StopRequest()
    stop.install()  # Ctrl-C stops the ranks together at a step's end (interrupt's Note)
    if spawned:
        torch.set_num_threads(spec.threads)
    _init_group(spec, rank, world, info, spawned)
    try:
        status = run_job(spec, rank, world, info, started, stop, spawned=spawned)
    except KeyboardInterrupt:  # a second Ctrl-C: at once, without a traceback
        if spawned:  # the parent says where to resume
            sys.stderr.flush()
            os._exit(INTERRUPTED)
        stop.uninstall()
        if rank == 0 and stop.run_dir is not None:
            print(interrupted_line(last_checkpoint(stop.run_dir, spec.resume), spec.argv, removed=None, torchrun=True),
                  file=sys.stderr, flush=True)
        return INTERRUPTED  # the group is left as it is: the other ranks may be anywhere
    except BaseException:
        stop.uninstall()
        dist.destroy_process_group()
        raise
    if spawned:
        leave_together(status)  # a spawned rank is ours to end
    # under torchrun this is the caller's process, and main() returns
    dist.barrier()
    dist.destroy_process_group()
    stop.uninstall()
    return status


def _init_group(spec: RunSpec, rank: int, world: int, info: DeviceInfo, spawned: bool) -> None:
    if info.is_accelerator:
        torch.get_device_module(info.type).set_device(info.device)
    if spawned:
        dist.init_process_group(
            info.backend,
            init_method=f"tcp://127.0.0.1:{spec.port}",
            rank=rank,
            world_size=world,
            timeout=GROUP_TIMEOUT,
        )
    else:
        dist.init_process_group(info.backend, timeout=GROUP_TIMEOUT)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
