"""MemoryLedger: bytes a runtime holds, by kind, now and at their peak.

ZeRO-3 exists to bound what one rank holds, so a runtime built from these
primitives accounts for every buffer it allocates: parameter shards,
gathered full parameters, gradient buckets, gradient partitions, fp32
master shards and optimizer state. The ledger is told of each allocation
and free (it never inspects tensors), keeps the current bytes and the peak
of each kind, and the peak of their sum, between resets. Activations and
the user's own tensors are not the runtime's and are not counted: the
device allocator's peak (``device_peak_bytes``) or the process's resident
set covers them.

Plain counters: no tensors, no process group.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

import attrs
import torch

from z3kit.validate import check_int


class MemoryKind(enum.Enum):
    """What a counted buffer holds."""

    # members are singletons: hash by identity, in C (Enum's own hash is Python code, and
    # these are dict keys on every fetch and release)
    __hash__ = object.__hash__

    #: this rank's flat padded 1/N of every parameter, in the compute dtype
    PARAM_SHARDS = "param_shards"
    #: full parameters gathered for compute, and gathers in flight
    GATHERED_PARAMS = "gathered_params"
    #: flat buckets that gradients are reduced through (only during backward)
    GRAD_BUCKETS = "grad_buckets"
    #: this rank's accumulated gradient partitions (first micro-step to the optimizer step)
    GRAD_PARTITIONS = "grad_partitions"
    #: fp32 master shards, when the compute dtype is not fp32
    FP32_MASTERS = "fp32_masters"
    #: the optimizer's per-parameter state (Adam's moments), over this rank's shards
    OPTIMIZER_STATE = "optimizer_state"
    #: fp32 master shards held in host memory (optimizer offload)
    HOST_FP32_MASTERS = "host_fp32_masters"
    #: the optimizer's state over the host master shards (optimizer offload)
    HOST_OPTIMIZER_STATE = "host_optimizer_state"
    #: host buffers the gradient partitions are copied into for a host optimizer step
    HOST_GRAD_PARTITIONS = "host_grad_partitions"
    #: hpZ: this rank's 1/S slice of each parameter within its node, kept for backward's gathers
    HPZ_SECONDARY = "hpz_secondary"


#: the kinds held in host memory rather than on the device
HOST_KINDS = frozenset({MemoryKind.HOST_FP32_MASTERS, MemoryKind.HOST_OPTIMIZER_STATE, MemoryKind.HOST_GRAD_PARTITIONS})
#: kinds of one runtime feature each (offload, hpZ): reported, as a group, once the feature held bytes
FEATURE_KINDS = (HOST_KINDS, frozenset({MemoryKind.HPZ_SECONDARY}))


def _zeros() -> dict[MemoryKind, int]:
    return {k: 0 for k in MemoryKind}


@attrs.frozen
class MemoryReport:
    """Bytes by kind (keys are ``MemoryKind`` values): now, and the peaks
    since the ledger's last reset. ``peak_total`` is the peak of the sum,
    which is at most the sum of the per-kind peaks."""

    current: Mapping[str, int]
    peak: Mapping[str, int]
    peak_total: int
    #: the device allocator's own peak (``max_memory_allocated``), where the device has one
    device_peak: int | None = None

    @property
    def current_total(self) -> int:
        return sum(self.current.values())


@attrs.define
class MemoryLedger:
    """Current and peak bytes per ``MemoryKind``."""

    _current: dict[MemoryKind, int] = attrs.field(factory=_zeros, init=False)
    _peak: dict[MemoryKind, int] = attrs.field(factory=_zeros, init=False)
    _total: int = attrs.field(default=0, init=False)
    _peak_total: int = attrs.field(default=0, init=False)
    _features_used: set[frozenset[MemoryKind]] = attrs.field(factory=set, init=False)

    def allocate(self, kind: MemoryKind, nbytes: int) -> None:
        """``nbytes`` more of ``kind`` are held."""
        check_int("nbytes", nbytes, at_least=0)
        self._set(kind, self._current[kind] + nbytes)

    def free(self, kind: MemoryKind, nbytes: int) -> None:
        """``nbytes`` of ``kind`` were let go."""
        check_int("nbytes", nbytes, at_least=0)
        if nbytes > self._current[kind]:
            raise ValueError(f"cannot free {nbytes} bytes of {kind.value}: only {self._current[kind]} are held")
        self._set(kind, self._current[kind] - nbytes)

    def set(self, kind: MemoryKind, nbytes: int) -> None:
        """``kind`` now holds exactly ``nbytes`` (for buffers measured rather than tracked)."""
        check_int("nbytes", nbytes, at_least=0)
        self._set(kind, nbytes)

    def _set(self, kind: MemoryKind, nbytes: int) -> None:
        self._total += nbytes - self._current[kind]
        self._current[kind] = nbytes
        self._peak[kind] = max(self._peak[kind], nbytes)
        self._peak_total = max(self._peak_total, self._total)

    def current(self, kind: MemoryKind) -> int:
        return self._current[kind]

    def reset_peaks(self) -> None:
        """Start a new peak window at the current holdings."""
        self._peak = dict(self._current)
        self._peak_total = self._total

    def report(self, device_peak: int | None = None) -> MemoryReport:
        """The figures by kind; a feature's kinds (``FEATURE_KINDS``: the host's of an offloading
        runtime, hpZ's) only once they held bytes."""
        self._features_used.update(f for f in FEATURE_KINDS if any(self._current[k] or self._peak[k] for k in f))
        hidden = set().union(*(f for f in FEATURE_KINDS if f not in self._features_used))
        kinds = [k for k in MemoryKind if k not in hidden]
        return MemoryReport(
            current={k.value: self._current[k] for k in kinds},
            peak={k.value: self._peak[k] for k in kinds},
            peak_total=self._peak_total,
            device_peak=device_peak,
        )


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s own elements (not of a larger storage it may view)."""
    return t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer
    count once, at the buffer's size)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def device_peak_bytes(device: torch.device) -> int | None:
    """The allocator's peak on an accelerator (``max_memory_allocated``), None on CPU."""
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device.type)
    peak = getattr(module, "max_memory_allocated", None)
    return None if peak is None else int(peak(device))
