"""Bytes a rank receives per link class, counted from the ``c10d`` operators
any runtime dispatches: FSDP2 as well as z3kit.

``LinkCounter`` is a ``TorchDispatchMode``: every collective that reaches
torch's dispatcher (``c10d._allgather_base_``, ``c10d.allreduce_``, ...) passes
through it with its tensors and its process group (a boxed ``ScriptObject``;
``ProcessGroup.unbox`` gives the group back), on the thread that issued it
and on autograd's. Each call is counted by ``z3kit.links.received_bytes``,
the direct-exchange model that z3kit's own ``CollectiveLog`` applies, so
FSDP2's figures and z3kit's compare on equal terms. Nothing is patched.

Counts are kept per phase (``phase`` is set by the caller: forward,
backward, optimizer step) and per kind, so that a step's gathers can be
told apart from its gradient reductions. A collective issued from a thread
of the runtime's own is not seen; compare ``total`` with the runtime's own
count where there is one.

Note: the private parts.
    ``TorchDispatchMode`` lives in ``torch.utils._python_dispatch`` and the
    operator names and argument positions (``C10D_OPS``) are torch's
    internals; this module is their only reader, for the bench alone (the
    runtime never counts this way), and ``tests/test_bench_mesh.py`` pins
    them: its count must agree with the engine's own ``CollectiveLog``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from z3kit.links import LinkClass, NodeMap, Placement, received_bytes

#: c10d operator -> (kind for ``received_bytes``, index of the argument holding what this rank
#: sends: an all-gather's input chunk, a reduce-scatter's whole input, an all-reduce's or a
#: broadcast's tensors). ``broadcast_``'s source is its argument 2 (a group rank).
C10D_OPS: Final[dict[str, tuple[str, int]]] = {
    "_allgather_base_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    # z3kit's reduce-scatter on gloo (``z3kit.collectives``): one chunk from each peer, as a reduce-scatter
    "alltoall_base_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
}
# torch leaves TorchDispatchMode.__init__ untyped; bind it once with the type used here.
_dispatch_mode_init: Callable[[TorchDispatchMode], None] = TorchDispatchMode.__init__

#: c10d operators that move no tensor data worth counting
IGNORED_OPS: Final = frozenset({"barrier", "monitored_barrier_"})


def tensor_bytes(value: object) -> int:
    """Bytes of the tensors in ``value``: a tensor, or lists of them, nested."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def process_group_of(args: Iterable[object]) -> dist.ProcessGroup | None:
    """The process group among a c10d operator's arguments, unboxed.

    Other script objects (the ``ReduceOp``) come boxed as well; unboxing one
    as a group raises, which is how the group is told from them."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except RuntimeError:
                continue
    return None


class LinkCounter(TorchDispatchMode):
    """Received bytes by phase, kind and link class of the c10d calls dispatched inside it."""

    def __init__(self, node_map: NodeMap) -> None:
        _dispatch_mode_init(self)
        self.node_map = node_map
        #: what the caller is running now; the key the next calls are counted under
        self.phase = "step"
        self.bytes: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {c.value: 0 for c in LinkClass}))
        #: c10d operators seen that ``C10D_OPS`` does not know (their bytes are not counted)
        self.unknown: set[str] = set()
        self._placements: dict[dist.ProcessGroup, Placement] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self._count(func.overloadpacket.__name__, args)
        return out

    def _count(self, op: str, args: tuple[Any, ...]) -> None:
        known = C10D_OPS.get(op)
        group = process_group_of(args)
        if known is None or group is None:
            if op not in IGNORED_OPS:
                self.unknown.add(op)
            return
        kind, data_arg = known
        placement = self._placements.get(group)
        if placement is None:
            placement = self._placements[group] = Placement.of(group, self.node_map)
        src = int(args[2]) if kind == "broadcast" else None
        got = received_bytes(kind, tensor_bytes(args[data_arg]), placement, src)
        counts = self.bytes[self.phase][kind]
        counts[LinkClass.INTRA_NODE.value] += got.intra_node
        counts[LinkClass.INTER_NODE.value] += got.inter_node

    def total(self, link: LinkClass, *, phases: Iterable[str] | None = None,
              kinds: Iterable[str] | None = None) -> int:
        """Bytes over ``link``, summed over ``phases`` and ``kinds`` (all when not given)."""
        wanted_phases = set(self.bytes) if phases is None else set(phases)
        wanted_kinds = None if kinds is None else set(kinds)
        return sum(by_link[link.value]
                   for phase, by_kind in self.bytes.items() if phase in wanted_phases
                   for kind, by_link in by_kind.items() if wanted_kinds is None or kind in wanted_kinds)

    def report(self) -> dict[str, dict[str, dict[str, int]]]:
        """Plain data: {phase: {kind: {link class: bytes}}}."""
        return {phase: {kind: dict(links) for kind, links in by_kind.items()} for phase, by_kind in self.bytes.items()}
