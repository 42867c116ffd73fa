"""Helpers for commands that start local ranks (train, bench).

Imports nothing heavy: the commands call ``use_bytecode_cache`` before they
import torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping

#: default bytecode cache of the commands' processes (see ``use_bytecode_cache``)
PYCACHE_DIR = os.path.join(tempfile.gettempdir(), "z3kit-pycache")


def use_bytecode_cache(pycache_dir: str = PYCACHE_DIR) -> None:
    """Cache bytecode under ``pycache_dir`` from now on in this process.

    Under ``PYTHONDONTWRITEBYTECODE`` (which spawn passes on to the ranks as
    ``-B``), or where the installed packages lack bytecode, every process
    compiles what it imports from source each time: torch itself, and
    torch._dynamo and sympy (DeepSpeed too), which an optimizer's first
    constructor imports; on 2 cores that is 10-20 s per run. A private
    prefix writes nothing next to the sources. Left alone when the user has
    a prefix of their own, or ``pycache_dir`` is empty.
    """
    if pycache_dir and sys.pycache_prefix is None:
        sys.pycache_prefix = pycache_dir
        sys.dont_write_bytecode = False


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (processes started inside
    inherit them), each restored or removed after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def free_port() -> int:
    """A loopback port that was free a moment ago, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def leave_together(status: int = 0) -> None:
    """End a rank that finished its work: meet every other rank, then exit
    with ``status`` without tearing the process group down.

    torch 2.13's gloo aborts in ``destroy_process_group`` about one run in
    ten (with or without z3kit), which would turn a finished run into a
    failed one; once every rank has passed the barrier there is nothing
    left for the teardown to do. Call it only on the success path: a rank
    that failed raises, and the launcher reports that."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
