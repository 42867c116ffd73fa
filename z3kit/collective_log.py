"""``CollectiveLog``: what the collectives of ``z3kit.collectives`` moved.

Each call is counted by kind, with the bytes this rank sent; given a
``NodeMap``, the log also adds up what this rank received over intra-node
and inter-node links (``z3kit.links``).
"""

from __future__ import annotations

import enum

import attrs
import torch.distributed as dist

from z3kit.links import LinkClass, NodeMap, Placement, received_bytes

ProcessGroup = dist.ProcessGroup


class CollectiveKind(enum.Enum):
    """The kinds of collective the log counts."""

    # members are singletons: hash by identity, in C (Enum's own hash is Python code, and
    # these are dict keys on every fetch and release)
    __hash__ = object.__hash__

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


@attrs.define
class CollectiveLog:
    """Calls and bytes per collective kind (bytes: the input each rank sends), and,
    with a ``node_map``, the bytes this rank received per link class (``z3kit.links``;
    a call recorded without its group counts no link bytes)."""

    calls: dict[CollectiveKind, int] = attrs.field(factory=lambda: {k: 0 for k in CollectiveKind})
    bytes: dict[CollectiveKind, int] = attrs.field(factory=lambda: {k: 0 for k in CollectiveKind})
    #: every call in issue order, (kind, bytes), once set to a list: a communicator pairs
    #: collectives by issue order, so ranks whose lists differ would mispair (tests compare them)
    order: list[tuple[CollectiveKind, int]] | None = None
    node_map: NodeMap | None = None
    link_bytes: dict[LinkClass, int] = attrs.field(factory=lambda: {c: 0 for c in LinkClass})
    # each group's placement, found once: torch's rank lookup is Python code, and this runs per collective
    _placements: dict[ProcessGroup, Placement] = attrs.field(factory=dict, init=False, repr=False, eq=False)

    def record(self, kind: CollectiveKind, nbytes: int, group: ProcessGroup | None = None, src: int | None = None) -> None:
        """Count one call of ``nbytes`` (what this rank sends) over ``group``; ``src``:
        a broadcast's source, as a group rank."""
        # links first: a group the node map lacks raises before anything is counted
        if self.node_map is not None and group is not None:
            placement = self._placements.get(group)
            if placement is None:
                placement = self._placements[group] = Placement.of(group, self.node_map)
            received = received_bytes(kind.value, nbytes, placement, src)
            self.link_bytes[LinkClass.INTRA_NODE] += received.intra_node
            self.link_bytes[LinkClass.INTER_NODE] += received.inter_node
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        if self.order is not None:
            self.order.append((kind, nbytes))

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Plain-data copy: {kind: {"calls": n, "bytes": b}}."""
        return {k.value: {"calls": self.calls[k], "bytes": self.bytes[k]} for k in CollectiveKind}

    def link_snapshot(self) -> dict[str, int]:
        """Plain-data copy of the bytes received per link class: {"intra_node": b, "inter_node": b}."""
        return {c.value: self.link_bytes[c] for c in LinkClass}

    def reset(self) -> None:
        for k in CollectiveKind:
            self.calls[k] = 0
            self.bytes[k] = 0
        for c in LinkClass:
            self.link_bytes[c] = 0
