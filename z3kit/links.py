"""Which ranks share a node, and what a collective moves across nodes.

A ``NodeMap`` maps each global rank to its node. ``received_bytes`` says
how many bytes one collective call brings to this rank over intra-node and
over inter-node links; ``Placement`` is what it needs to know of the
process group (the node of each member, and which member this rank is).
``CollectiveLog`` adds these figures up per ``LinkClass`` when it is given
a node map.

Note: the direct-exchange model.
    Each rank is taken to get each peer's contribution from that peer
    itself: in an all-gather it receives every other member's chunk, in a
    reduce-scatter every other member's part of its own output chunk, in
    an all-reduce both (a reduce-scatter then an all-gather of chunks of
    ``t / g`` bytes), in a broadcast the whole tensor from the source. The
    figures depend on who holds the data, not on the algorithm a backend
    picks. They are exact for pairwise exchange. For flat algorithms that
    forward data through intermediate ranks (rings, trees) they are an
    upper bound on the total crossing nodes when ranks are numbered node
    by node, as torchrun does: a ring over g ranks on N nodes moves
    N * (g - 1) chunks across nodes per all-gather, the model counts
    g * (g - g / N), never fewer. (One rank of a ring may receive more over
    its own inter-node link than the model gives it: it relays for the
    others.) Summed over the ranks, the inter-node figures give the total
    that crosses node boundaries under the model, which is what a flat group, a
    hierarchical one (HSDP, MiCS) and a secondary partition (ZeRO++ hpZ)
    can be compared by.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import attrs
import torch.distributed as dist

from z3kit.validate import check_int, int_validator


class LinkClass(enum.Enum):
    """The kind of link bytes travel over between two ranks."""

    # members are singletons: hash by identity, in C (they are dict keys on every recorded collective)
    __hash__ = object.__hash__

    #: between ranks on the same node (NVLink, shared memory, loopback)
    INTRA_NODE = "intra_node"
    #: between ranks on different nodes (the network)
    INTER_NODE = "inter_node"


def _node_indices(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    name = f"{type(instance).__name__}.{attribute.name}"
    if not isinstance(value, tuple):
        raise TypeError(f"{name} must be a tuple of node indices, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must name the node of at least one rank")
    for node in value:
        check_int(f"{name} entries", node, at_least=0)


@attrs.frozen
class NodeMap:
    """The node of every global rank: ``node_of[rank]`` is a node index."""

    node_of: tuple[int, ...] = attrs.field(validator=_node_indices)

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int) -> NodeMap:
        """Ranks ``0 .. ranks_per_node - 1`` on node 0, the next as many on node 1, and so on
        (how torchrun numbers the ranks of nodes launched with the same ``--nproc-per-node``)."""
        check_int("world_size", world_size, at_least=1)
        check_int("ranks_per_node", ranks_per_node, at_least=1)
        if world_size % ranks_per_node:
            raise ValueError(
                f"ranks_per_node ({ranks_per_node}) must divide world_size ({world_size}): "
                "every node holds the same number of ranks"
            )
        return cls(tuple(rank // ranks_per_node for rank in range(world_size)))

    @classmethod
    def single_node(cls, world_size: int) -> NodeMap:
        """Every rank on one node: no byte crosses a node boundary."""
        check_int("world_size", world_size, at_least=1)
        return cls((0,) * world_size)

    @classmethod
    def from_env(cls, world_size: int, env: Mapping[str, str] | None = None) -> NodeMap:
        """What torchrun says: ``LOCAL_WORLD_SIZE`` ranks per node; without it, one node.
        ``env``: where to read it (``os.environ`` when not given)."""
        value = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE")
        if value is None:
            return cls.single_node(world_size)
        try:
            ranks_per_node = int(value)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be a whole number of ranks per node, got {value!r}") from None
        try:
            return cls.uniform(world_size, ranks_per_node)
        except ValueError as e:
            raise ValueError(f"LOCAL_WORLD_SIZE={value!r} does not fit a world of {world_size} ranks: {e}") from None

    def nodes(self) -> int:
        """How many distinct nodes hold ranks."""
        return len(set(self.node_of))


@attrs.frozen
class Placement:
    """One process group as this rank sees it: the node of each member (in group-rank
    order), which member this rank is, and how many of the others share its node."""

    member_nodes: tuple[int, ...] = attrs.field(validator=_node_indices)
    me: int = attrs.field(validator=int_validator(at_least=0))
    #: the other members on this rank's node, and on other nodes (counted once, since every
    #: recorded collective reads them)
    local_peers: int = attrs.field(init=False)
    remote_peers: int = attrs.field(init=False)

    @local_peers.default
    def _count_local_peers(self) -> int:
        if self.me >= len(self.member_nodes):  # checked here: the count below would index past the end
            raise ValueError(f"Placement.me must be < {len(self.member_nodes)} (the group size), got {self.me}")
        return self.member_nodes.count(self.member_nodes[self.me]) - 1

    @remote_peers.default
    def _count_remote_peers(self) -> int:
        return len(self.member_nodes) - 1 - self.local_peers

    @classmethod
    def of(cls, group: dist.ProcessGroup, node_map: NodeMap) -> Placement:
        """This rank's placement in ``group`` (global ranks from torch, nodes from ``node_map``)."""
        ranks = dist.get_process_group_ranks(group)  # global ranks, in group-rank order
        rank = dist.get_rank()
        beyond = [r for r in ranks if r >= len(node_map.node_of)]
        if beyond:
            raise ValueError(f"the node map covers {len(node_map.node_of)} ranks; the group holds rank(s) {beyond}")
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of the group (ranks {ranks})")
        return cls(tuple(node_map.node_of[r] for r in ranks), ranks.index(rank))

    def group_size(self) -> int:
        return len(self.member_nodes)


class LinkBytes(NamedTuple):
    """Bytes this rank receives from peers on its own node and on other nodes."""

    intra_node: int
    inter_node: int


def received_bytes(kind: str, nbytes: int, placement: Placement, src: int | None = None) -> LinkBytes:
    """What one collective brings to this rank, per link class (see the Note on the model).

    ``kind`` is a ``CollectiveKind`` value (``"all_gather"``, ``"reduce_scatter"``,
    ``"all_reduce"``, ``"broadcast"``); ``nbytes`` is what this rank puts in, as
    ``CollectiveLog`` counts it: an all-gather's input chunk, a reduce-scatter's whole
    input (one chunk per member), an all-reduce's or a broadcast's tensor. ``src``: a
    broadcast's source, as a group rank. With ``c`` the bytes of one chunk and
    ``local``/``remote`` the other members on this rank's node/on other nodes:

    - all-gather and reduce-scatter: ``c`` from each peer, ``local * c`` and ``remote * c``;
    - all-reduce of ``t`` bytes: a reduce-scatter then an all-gather of chunks of
      ``t / g``, ``2 * local * t / g`` and ``2 * remote * t / g``, each rounded to the
      nearest byte (halves up), so that a sum over calls is off by under a byte per call;
    - broadcast of ``t`` bytes: ``t`` from the source, over the link to its node; 0 on the source.
    """
    local, remote, g = placement.local_peers, placement.remote_peers, placement.group_size()
    if kind == "all_gather":
        return LinkBytes(local * nbytes, remote * nbytes)
    if kind == "reduce_scatter":
        chunk = nbytes // g  # the input holds one whole chunk per member
        return LinkBytes(local * chunk, remote * chunk)
    if kind == "all_reduce":
        return LinkBytes(_nearest(2 * local * nbytes, g), _nearest(2 * remote * nbytes, g))
    if kind == "broadcast":
        if src is None or not 0 <= src < g:
            raise ValueError(f"a broadcast needs its source's group rank in [0, {g}), got {src}")
        if src == placement.me:
            return LinkBytes(0, 0)
        if placement.member_nodes[src] == placement.member_nodes[placement.me]:
            return LinkBytes(nbytes, 0)
        return LinkBytes(0, nbytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def _nearest(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded to the nearest int, halves up, in integer arithmetic."""
    return (2 * numerator + denominator) // (2 * denominator)
