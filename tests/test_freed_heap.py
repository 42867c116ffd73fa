"""The free heap a step leaves behind goes back to the kernel (issue 41, item 5).

``z3kit.freed_heap`` trims glibc's heaps at an optimizer step's end once the
resident set has grown past a margin; these tests pin the mechanism on the
real allocator (freed blocks under a live one stay resident until a trim)
and that the engine's step is where it happens.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from z3kit.freed_heap import MIN_MARGIN_BYTES, PROCESS_HEAP, FreedHeap, glibc_trim, resident_bytes

pytestmark = pytest.mark.skipif(glibc_trim() is None, reason="malloc_trim is glibc's")

_BLOCK = 4096
_BLOCKS = 16_384  # 64 MiB in blocks far below glibc's mmap threshold: they come from the heap


def _strand_free_heap() -> int:
    """Free 64 MiB of heap blocks under one that stays live (as a step's
    buffers under a block allocated after them), so that free() cannot give
    the heap's top back; returns the live block, for ``_release``."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(_BLOCK) for _ in range(_BLOCKS)]
    for b in blocks:
        ctypes.memset(b, 1, _BLOCK)  # resident
    pin = libc.malloc(_BLOCK)
    for b in blocks:
        libc.free(b)
    return int(pin)


def _release(pin: int) -> None:
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(pin)


def test_freed_heap_under_a_live_block_stays_resident_until_trimmed() -> None:
    trim = glibc_trim()
    assert trim is not None
    before = resident_bytes()
    assert before is not None
    pin = _strand_free_heap()
    try:
        stranded = resident_bytes()
        assert stranded is not None and stranded - before > 48 * 2**20  # free()d, and still resident
        trim()
        after = resident_bytes()
        assert after is not None and stranded - after > 48 * 2**20
    finally:
        _release(pin)


def test_it_trims_once_the_resident_set_grew_past_the_margin() -> None:
    trims: list[int] = []
    trim = glibc_trim()
    assert trim is not None
    readings = iter([400 * 2**20, 402 * 2**20, 403 * 2**20, 400 * 2**20 + MIN_MARGIN_BYTES + 1, 380 * 2**20,
                     383 * 2**20])
    heap = FreedHeap(lambda: (trims.append(1), trim())[1], read_resident=lambda: next(readings))
    # the first step's end is the reference; growth within the margin is the step's working set
    assert [heap.step_ended() for _ in range(3)] == [False, False, False] and heap.reference == 400 * 2**20
    assert heap.step_ended() and heap.trims == 1 == len(trims)
    # after a trim the next step's end (its working set faulted in again) is the new reference
    assert not heap.step_ended() and heap.reference == 380 * 2**20
    assert not heap.step_ended() and heap.trims == 1


def test_where_there_is_no_trim_or_no_procfs_it_does_nothing() -> None:
    assert not FreedHeap(None).step_ended()
    assert not FreedHeap(glibc_trim(), read_resident=lambda: None).step_ended()


def _engine_step_worker(ctx: WorkerContext) -> tuple[int, int, int, int]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), process_group=ctx.group)

    def step() -> None:
        engine.backward(engine(torch.randn(4, 8)).sum())
        engine.step()

    step()
    PROCESS_HEAP.reference = None
    step()  # the reference: this step's end
    trims = PROCESS_HEAP.trims
    pin = _strand_free_heap()  # a step that leaves 64 MiB of free heap resident
    try:
        stranded = resident_bytes()
        step()
        after = resident_bytes()
    finally:
        _release(pin)
    assert stranded is not None and after is not None
    return trims, PROCESS_HEAP.trims, stranded, after


def test_the_engines_step_gives_the_free_heap_back(pools: PoolSet) -> None:
    for trims_before, trims_after, stranded, after in pools.run(2, _engine_step_worker):
        assert trims_after == trims_before + 1
        assert stranded - after > 48 * 2**20
