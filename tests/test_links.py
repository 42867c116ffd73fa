"""Bytes received per link class (``z3kit.links``): the topology, the
direct-exchange formulas, and what ``CollectiveLog`` and ``engine.stats()``
add up on real gloo groups.

The expected figures are written out by hand from the topology (which rank
sits on which node), not computed with ``received_bytes``: at world 4 with
two ranks per node, ranks 0 and 1 are on node 0, ranks 2 and 3 on node 1.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from tests.dist_pool import PoolSet, WorkerContext
from z3kit.collectives import (
    GLOO_BROADCAST_GATHER_MIN_NUMEL,
    CollectiveKind,
    CollectiveLog,
    all_gather,
    all_reduce,
    broadcast,
    reduce_scatter,
)
from z3kit.links import LinkBytes, LinkClass, NodeMap, Placement, received_bytes

# --------------------------------------------------------------------------- #
# NodeMap and the formulas, without processes
# --------------------------------------------------------------------------- #


def test_node_map_constructors() -> None:
    assert NodeMap.uniform(6, 2).node_of == (0, 0, 1, 1, 2, 2)
    assert NodeMap.uniform(4, 4).nodes() == 1 and NodeMap.uniform(4, 1).nodes() == 4
    assert NodeMap.single_node(3) == NodeMap((0, 0, 0))
    assert NodeMap.from_env(4, {}) == NodeMap.single_node(4)
    assert NodeMap.from_env(4, {"LOCAL_WORLD_SIZE": "2"}) == NodeMap((0, 0, 1, 1))
    assert NodeMap((3, 0, 3)).nodes() == 2  # node indices need not be dense


@pytest.mark.parametrize(
    "make, error, fragment",
    [
        (lambda: NodeMap.uniform(4, 3), ValueError, "ranks_per_node (3) must divide world_size (4)"),
        (lambda: NodeMap.uniform(4, 0), ValueError, "ranks_per_node must be >= 1"),
        (lambda: NodeMap.uniform(0, 1), ValueError, "world_size must be >= 1"),
        (lambda: NodeMap.single_node(True), TypeError, "world_size must be an int"),
        (lambda: NodeMap(()), ValueError, "at least one rank"),
        (lambda: NodeMap([0, 1]), TypeError, "must be a tuple"),
        (lambda: NodeMap((0, -1)), ValueError, "NodeMap.node_of entries must be >= 0"),
        (lambda: NodeMap((0, True)), TypeError, "NodeMap.node_of entries must be an int"),
        (lambda: NodeMap.from_env(4, {"LOCAL_WORLD_SIZE": "two"}), ValueError, "LOCAL_WORLD_SIZE must be a whole"),
        (lambda: NodeMap.from_env(4, {"LOCAL_WORLD_SIZE": "3"}), ValueError, "LOCAL_WORLD_SIZE='3' does not fit"),
        (lambda: Placement((0, 0), 2), ValueError, "Placement.me must be < 2"),
        (lambda: Placement((0, 0), -1), ValueError, "Placement.me must be >= 0"),
    ],
)
def test_node_map_and_placement_refuse_bad_values(make: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_placement_counts_peers_by_node() -> None:
    p = Placement((0, 0, 1, 1, 1), 3)
    assert (p.local_peers, p.remote_peers, p.group_size()) == (2, 2, 5)
    assert (Placement((7,), 0).local_peers, Placement((7,), 0).remote_peers) == (0, 0)


def test_received_bytes_per_kind() -> None:
    # this rank is member 1 of a group of 4 on nodes (0, 0, 1, 1): one local peer, two remote
    p = Placement((0, 0, 1, 1), 1)
    assert received_bytes("all_gather", 10, p) == LinkBytes(10, 20)
    assert received_bytes("reduce_scatter", 40, p) == LinkBytes(10, 20)  # 40 bytes in = 4 chunks of 10
    assert received_bytes("all_reduce", 40, p) == LinkBytes(20, 40)  # 2 * 1 * 40 / 4 and 2 * 2 * 40 / 4
    assert received_bytes("broadcast", 8, p, src=0) == LinkBytes(8, 0)
    assert received_bytes("broadcast", 8, p, src=3) == LinkBytes(0, 8)
    assert received_bytes("broadcast", 8, p, src=1) == LinkBytes(0, 0)  # the source receives nothing
    # an all-reduce's share is rounded to the nearest byte, halves up: 2 * 1 * 11 / 4 = 5.5, 2 * 2 * 11 / 4 = 11
    assert received_bytes("all_reduce", 11, p) == LinkBytes(6, 11)
    assert received_bytes("all_reduce", 5, Placement((0, 0, 1), 0)) == LinkBytes(3, 3)  # 10 / 3 = 3.33
    assert received_bytes("all_gather", 10, Placement((0,), 0)) == LinkBytes(0, 0)
    with pytest.raises(ValueError, match="needs its source's group rank"):
        received_bytes("broadcast", 8, p)
    with pytest.raises(ValueError, match="needs its source's group rank"):
        received_bytes("broadcast", 8, p, src=4)
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        received_bytes("gather", 8, p)


def test_a_log_without_a_node_map_or_group_counts_no_link_bytes() -> None:
    log = CollectiveLog()
    log.record(CollectiveKind.ALL_GATHER, 10)
    assert log.link_snapshot() == {"intra_node": 0, "inter_node": 0}
    log = CollectiveLog(node_map=NodeMap.uniform(4, 2))
    log.record(CollectiveKind.ALL_GATHER, 10)  # no group: no placement to count by
    log.link_bytes[LinkClass.INTER_NODE] = 5
    snap = log.link_snapshot()
    log.reset()
    assert snap == {"intra_node": 0, "inter_node": 5} and log.link_snapshot() == {"intra_node": 0, "inter_node": 0}
    assert log.snapshot()["all_gather"] == {"calls": 0, "bytes": 0}


# --------------------------------------------------------------------------- #
# Collectives at world 4, two ranks per node
# --------------------------------------------------------------------------- #

AG, RS, AR, BC = 5, 7, 12, 6  # elements: gathered per rank, reduce-scatter output, all-reduce, broadcast (fp32)


def _links_worker(ctx: WorkerContext) -> dict[str, Any]:
    import torch.distributed as dist

    rank = ctx.rank
    # every rank makes both of its pairs, in the same order: one within its node, one across nodes
    same_node = dist.new_group(ranks=[rank - rank % 2, rank - rank % 2 + 1], use_local_synchronization=True)
    across = dist.new_group(ranks=[rank % 2, rank % 2 + 2], use_local_synchronization=True)
    out: dict[str, Any] = {}
    for name, group in (("world", ctx.group), ("same_node", same_node), ("across", across)):
        g = dist.get_world_size(group)
        log = CollectiveLog(node_map=NodeMap.uniform(4, 2))
        calls = {
            "all_gather": lambda: all_gather(torch.empty(g * AG), torch.ones(AG), group, log=log),
            "reduce_scatter": lambda: reduce_scatter(torch.empty(RS), torch.ones(g * RS), group, log=log),
            "all_reduce": lambda: all_reduce(torch.ones(AR), group, log=log),
            "broadcast": lambda: broadcast(torch.ones(BC), g - 1, group, log=log),  # from the group's last rank
        }
        received: dict[str, dict[str, int]] = {}
        for kind, call in calls.items():
            before = log.link_snapshot()
            call()
            now = log.link_snapshot()
            received[kind] = {link: now[link] - before[link] for link in now}
        out[name] = {"received": received, "log": log.snapshot()}

    # a gather large enough to run as one broadcast from each rank on gloo counts as the gather would
    n = GLOO_BROADCAST_GATHER_MIN_NUMEL
    log = CollectiveLog(node_map=NodeMap.uniform(4, 2))
    all_gather(torch.empty(4 * n), torch.ones(n), ctx.group, log=log)
    out["large_gather"] = {"received": log.link_snapshot(), "broadcasts": log.calls[CollectiveKind.BROADCAST]}

    too_small = CollectiveLog(node_map=NodeMap.uniform(2, 1))  # covers ranks 0 and 1 only
    try:  # every rank refuses before issuing it: the group holds ranks the node map lacks
        all_reduce(torch.ones(1), ctx.group, log=too_small)
        out["too_small"] = "no error"
    except ValueError as e:
        out["too_small"] = str(e)
    out["too_small_calls"] = too_small.total_calls()  # the refused call is not counted
    return out


def _bytes(intra: int, inter: int) -> dict[str, int]:
    return {"intra_node": intra, "inter_node": inter}


def test_bytes_received_per_link_at_world_4(pools: PoolSet) -> None:
    results = pools.run(4, _links_worker, timeout=90)
    f = 4  # bytes per fp32 element
    for rank, out in enumerate(results):
        node = rank // 2
        # whole world: one peer on this node, two on the other
        world = out["world"]["received"]
        assert world["all_gather"] == _bytes(1 * AG * f, 2 * AG * f), rank
        assert world["reduce_scatter"] == _bytes(1 * RS * f, 2 * RS * f), rank
        assert world["all_reduce"] == _bytes(2 * 1 * AR * f // 4, 2 * 2 * AR * f // 4), rank
        # from rank 3 (node 1): rank 2 gets it over its node, ranks 0 and 1 across nodes, rank 3 gets nothing
        from_rank_3 = {0: _bytes(0, BC * f), 1: _bytes(0, BC * f), 2: _bytes(BC * f, 0), 3: _bytes(0, 0)}
        assert world["broadcast"] == from_rank_3[rank]
        # the kinds' calls and bytes are counted as before
        assert out["world"]["log"] == {
            "all_gather": {"calls": 1, "bytes": AG * f}, "reduce_scatter": {"calls": 1, "bytes": 4 * RS * f},
            "all_reduce": {"calls": 1, "bytes": AR * f}, "broadcast": {"calls": 1, "bytes": BC * f}}  # fmt: skip
        # a pair on one node: nothing crosses nodes; source of the broadcast is the pair's second rank
        same = out["same_node"]["received"]
        assert same["all_gather"] == _bytes(AG * f, 0) and same["reduce_scatter"] == _bytes(RS * f, 0)
        assert same["all_reduce"] == _bytes(AR * f, 0)  # 2 * 1 * t / 2
        assert same["broadcast"] == (_bytes(BC * f, 0) if rank % 2 == 0 else _bytes(0, 0))
        # a pair across nodes (ranks 0 and 2, 1 and 3): everything crosses
        across = out["across"]["received"]
        assert across["all_gather"] == _bytes(0, AG * f) and across["reduce_scatter"] == _bytes(0, RS * f)
        assert across["all_reduce"] == _bytes(0, AR * f)
        assert across["broadcast"] == (_bytes(0, BC * f) if node == 0 else _bytes(0, 0))
        large = GLOO_BROADCAST_GATHER_MIN_NUMEL * f
        assert out["large_gather"] == {"received": _bytes(1 * large, 2 * large), "broadcasts": 4}
        assert out["too_small"].startswith("the node map covers 2 ranks; the group holds rank(s) [2, 3]")
        assert out["too_small_calls"] == 0
    # summed over ranks, what crosses nodes: each of 4 ranks gets 2 remote chunks of a gather or a
    # reduce-scatter, and 2 * 2 / 4 of an all-reduce; a broadcast from node 1 crosses once per rank of node 0
    totals = {kind: sum(out["world"]["received"][kind]["inter_node"] for out in results) for kind in world}
    assert totals == {"all_gather": 8 * AG * f, "reduce_scatter": 8 * RS * f, "all_reduce": 4 * AR * f,
                      "broadcast": 2 * BC * f}  # fmt: skip


# --------------------------------------------------------------------------- #
# engine.stats() at world 4
# --------------------------------------------------------------------------- #


def _engine_worker(ctx: WorkerContext, local_world_size: str) -> dict[str, Any]:
    from z3kit_recipes import zero3
    from z3kit_recipes.models import GPT, GPTConfig

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = local_world_size  # what torchrun sets; read at initialize
    try:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=40, width=16, n_layer=2, n_head=2, seq_len=8)
        config3 = zero3.Zero3Config(param_persistence_threshold=0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            engine = zero3.initialize(GPT(config), torch.optim.AdamW, config3, ctx.group)
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    for _ in range(2):
        engine.backward(engine(torch.randint(0, 40, (2, 8))).float().logsumexp(-1).mean())
        engine.step()
    stats = engine.stats()
    return {"link_bytes": stats.link_bytes, "nodes": stats.nodes, "collectives": stats.collectives, "text": str(stats),
            "warnings": [str(w.message) for w in seen]}


@pytest.mark.parametrize("local_world_size", ["2", "4"])
def test_engine_stats_report_bytes_per_link(pools: PoolSet, local_world_size: str) -> None:
    results = pools.run(4, _engine_worker, local_world_size, timeout=120)
    two_nodes = local_world_size == "2"
    for rank, r in enumerate(results):
        c = {kind: figures["bytes"] for kind, figures in r["collectives"].items()}
        assert c["all_gather"] > 0 and c["reduce_scatter"] + c["all_reduce"] > 0, r["collectives"]
        # the engine's collectives run over the world group; its broadcasts (buffers) are none for this model
        assert r["collectives"]["broadcast"]["calls"] == 0, r["collectives"]
        local, remote = (1, 2) if two_nodes else (3, 0)
        # a gather's chunk and a reduce-scatter's quarter from each peer, 2/4 of an all-reduce from each peer
        ag, rs, ar = c["all_gather"], c["reduce_scatter"], c["all_reduce"]
        expected = {
            "intra_node": local * ag + local * rs // 4 + 2 * local * ar // 4,
            "inter_node": remote * ag + remote * rs // 4 + 2 * remote * ar // 4,
        }
        assert r["link_bytes"] == expected, (rank, r)
        assert r["nodes"] == (2 if two_nodes else 1)
        line = next((text for text in r["text"].splitlines() if "received by link" in text), None)
        if two_nodes:
            assert r["link_bytes"]["inter_node"] > 0
            assert line == (f"  received by link      intra-node {expected['intra_node'] / 1e6:.2f} MB, "
                            f"inter-node {expected['inter_node'] / 1e6:.2f} MB in the last step (2 nodes)")  # fmt: skip
        else:
            assert line is None, r["text"]  # one node: no line for it
    # every rank did the same step, so the same bytes crossed into each
    assert len({tuple(r["link_bytes"].items()) for r in results}) == 1


def test_nodes_of_different_sizes_train_without_traffic_by_link(pools: PoolSet) -> None:
    """LOCAL_WORLD_SIZE that does not divide the world (nodes of 3 and 1 ranks): the run
    goes on, on every rank, with a warning and no figures by link (they are only a report)."""
    for r in pools.run(4, _engine_worker, "3", timeout=120):
        assert r["link_bytes"] == {"intra_node": 0, "inter_node": 0} and r["nodes"] == 1
        assert any("no traffic by link class" in w and "LOCAL_WORLD_SIZE='3'" in w for w in r["warnings"]), r
