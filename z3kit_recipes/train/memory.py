"""The summary's memory figures: what each rank held, by kind, against one
unsharded replica.

The engine counts its own buffers (``Zero3Stats.memory``, a
``z3kit.memory.MemoryReport``): parameter shards, gathered parameters,
gradient buckets, gradient partitions, fp32 masters and optimizer state,
in bytes, now and at their peak over the last training step. Activations
are not the engine's: the process's peak resident set (``VmHWM``) and, on
an accelerator, the allocator's peak cover them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs
import torch

from z3kit.memory import MemoryKind, MemoryReport

#: the engine's buffer kinds, in the ledger's order (the rows of the table)
KINDS: Final = tuple(k.value for k in MemoryKind)
#: where Linux reports the process's peak resident set (VmHWM)
PROC_STATUS: Final = Path("/proc/self/status")
#: stands for None in an exchanged row of int64
_ABSENT: Final = -1


def peak_rss_bytes(status: Path = PROC_STATUS) -> int | None:
    """The process's peak resident set since it started (``VmHWM``), None
    where ``/proc`` is not there (not Linux) or does not say."""
    try:
        text = status.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            fields = line.split()
            if len(fields) >= 3 and fields[1].isdigit() and fields[2] == "kB":
                return int(fields[1]) * 1024
    return None


@attrs.frozen
class RankMemory:
    """What one rank held (bytes, keys are ``MemoryKind`` values)."""

    rank: int
    #: the engine's buffers after the last optimizer step
    current: dict[str, int]
    #: their peaks over the last training step (forward, backward, optimizer step)
    peak: dict[str, int]
    #: peak of their sum over that step (at most the sum of the per-kind peaks)
    peak_total: int
    #: the process's peak resident set over the whole run (VmHWM), None where unreadable
    peak_rss: int | None
    #: the device allocator's peak (``max_memory_allocated``), None on CPU; the
    #: engine does not reset it, so like ``peak_rss`` it covers the whole run
    device_peak: int | None
    #: high-water of gathered parameter elements over every step
    peak_live_numel: int
    #: the sum of ``current`` (a field rather than a property, so that summary.json has it)
    current_total: int = attrs.field(
        default=attrs.Factory(lambda self: sum(self.current.values()), takes_self=True)
    )

    @classmethod
    def of(cls, rank: int, report: MemoryReport, *, peak_rss: int | None, peak_live_numel: int) -> RankMemory:
        return cls(
            rank=rank,
            current={k: int(report.current.get(k, 0)) for k in KINDS},
            peak={k: int(report.peak.get(k, 0)) for k in KINDS},
            peak_total=report.peak_total,
            peak_rss=peak_rss,
            device_peak=report.device_peak,
            peak_live_numel=peak_live_numel,
        )

    def to_row(self) -> torch.Tensor:
        """This record as int64 (exact), the same length on every rank, for one all-gather."""
        values = [self.current[k] for k in KINDS] + [self.peak[k] for k in KINDS]
        values += [self.peak_total, _or_absent(self.peak_rss), _or_absent(self.device_peak), self.peak_live_numel]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def from_row(cls, rank: int, row: Sequence[int]) -> RankMemory:
        n = len(KINDS)
        peak_total, peak_rss, device_peak, peak_live = row[2 * n :]
        return cls(
            rank=rank,
            current=dict(zip(KINDS, row[:n])),
            peak=dict(zip(KINDS, row[n : 2 * n])),
            peak_total=peak_total,
            peak_rss=_or_none(peak_rss),
            device_peak=_or_none(device_peak),
            peak_live_numel=peak_live,
        )


def _or_absent(value: int | None) -> int:
    return _ABSENT if value is None else value


def _or_none(value: int) -> int | None:
    return None if value == _ABSENT else value


@attrs.frozen
class Replica:
    """Bytes that one rank would hold for the whole model, unsharded, with
    the same optimizer (the comparison ZeRO-3 is measured against): full
    parameters in the compute dtype, fp32 masters when that is not fp32,
    fp32 gradients and AdamW's two fp32 moments."""

    bytes: dict[str, int]
    total: int

    @classmethod
    def of(cls, model_numel: int, compute_dtype: torch.dtype) -> Replica:
        per_kind = dict.fromkeys(KINDS, 0)
        per_kind[MemoryKind.PARAM_SHARDS.value] = model_numel * compute_dtype.itemsize
        if compute_dtype != torch.float32:
            per_kind[MemoryKind.FP32_MASTERS.value] = model_numel * 4
        per_kind[MemoryKind.GRAD_PARTITIONS.value] = model_numel * 4
        per_kind[MemoryKind.OPTIMIZER_STATE.value] = model_numel * 8
        return cls(per_kind, sum(per_kind.values()))


@attrs.frozen
class MemoryFigures:
    """The summary's memory section (bytes)."""

    model_numel: int
    per_rank: list[RankMemory]
    replica: Replica
    #: ``MemoryPlan.describe()`` when ``memory_budget`` chose the size knobs
    plan: str | None

    def peak_share_of_replica(self, rank: int = 0) -> float:
        """The peak of the engine's buffers on ``rank`` against one replica."""
        return self.per_rank[rank].peak_total / self.replica.total if self.replica.total else float("nan")
