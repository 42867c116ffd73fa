"""Which ranks share what: flat ZeRO-3, or HSDP (MiCS) over a 2-D mesh.

Flat ZeRO-3 shards every parameter over all N ranks. HSDP (hybrid sharded
data parallel; DeepSpeed calls it MiCS) cuts the N ranks into R replicas of
a shard group of S ranks (N = R x S, a ``DeviceMesh`` of shape (R, S) with
dimension names ("replicate", "shard")): a parameter's shards, gradient
partitions, fp32 masters and optimizer state are 1/S slices, each held by R
ranks, one per replica.

Note: which group carries what.
    ``shard_group`` (S ranks, usually within a node): the gathers of
    forward and backward, the gradient reduce-scatters, and the sum of
    squared gradient norms (clipping, fp16 overflow), since the R replicas
    hold the same partitions after the gradients were all-reduced.
    ``replicate_group`` (R ranks, one per replica, usually across nodes):
    only the all-reduce of each reduced gradient partition. ``world_group``
    (every rank): what must involve every rank: the agreement at initialize
    and at the end of each backward, the notice board and its watch, the
    broadcasts of rank 0's values and buffers, saves and loads. A flat
    layout is HSDP with R = 1: no replicate group, the shard group is the
    world group.

Note: hpZ.
    ZeRO++'s hierarchical partitioning keeps the flat layout (the shard
    group is the world group, no replicas) and adds ``secondary_group``, a
    group of S ranks (one node) within which backward gathers collect the
    secondary slices that each training forward kept
    (``zero3.training.secondary``). It is refused with HSDP (DeepSpeed
    does not combine them either) and with rank-divergent graphs, whose
    ranks may keep different slices.

Note: the engine's own group.
    ``world_group`` is not the group the user passed (or the default
    group) but one made for the engine at initialize over the same ranks
    (``zero3.ranks.engine_group``). After a rank fails, the engine's group holds
    collectives that will never pair; the user's group does not, so the
    user's own collectives (a metrics all-reduce in an ``except``) still
    pair, and a new engine (``zero3.initialize`` again) gets a new group.
    The mesh groups HSDP and hpZ build here are the engine's too; those of
    a ``device_mesh`` the user passes remain the user's.

Note: shard size "node".
    torchrun tells each rank how many ranks its node runs
    (``LOCAL_WORLD_SIZE``); "node" makes that the shard size, so that the
    gathers stay on the node's fast links and only gradient all-reduces of
    a 1/S partition cross nodes.
"""

from __future__ import annotations

import os

import attrs
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from z3kit.collectives import ProcessGroup

#: the dimension names of an HSDP mesh, outer (replicas) first
MESH_DIM_NAMES = ("replicate", "shard")


@attrs.frozen(eq=False)
class Topology:
    """The process groups of one engine (see the Note on which carries what)."""

    world_group: ProcessGroup
    shard_group: ProcessGroup
    #: None: flat ZeRO-3 (one replica)
    replicate_group: ProcessGroup | None
    #: the (replicate, shard) mesh of an HSDP layout; None when flat
    mesh: DeviceMesh | None
    #: hpZ: the node's ranks, among which backward gathers secondary slices; None: off
    secondary_group: ProcessGroup | None = None

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def shard_rank(self) -> int:
        """This rank's shard index: its rank in the shard group."""
        return dist.get_rank(self.shard_group)

    @property
    def subgroups(self) -> tuple[ProcessGroup, ...]:
        """The groups other than the world group that collectives run on (the watcher aborts them too)."""
        found = (self.shard_group, self.replicate_group, self.secondary_group)
        return tuple(g for g in found if g is not None and g is not self.world_group)

    @property
    def replicas(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def shape(self) -> list[int]:
        """[replicas, shard size], as the checkpoint manifest records it."""
        return [self.replicas, self.shard_size]


def flat(group: ProcessGroup) -> Topology:
    """Every parameter sharded over ``group`` (no replicas)."""
    return Topology(group, group, None, None)


def resolve_shard_size(value: int | str | None, world: int, key: str = "mics_shard_size") -> int:
    """The group size that ``Zero3Config.mics_shard_size`` (or ``key``) stands
    for at ``world`` ranks (None: ``world``, flat); it must divide ``world``."""
    if value is None:
        return world
    if value == "node":
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit() or int(local) < 1:
            raise ValueError(
                f"{key}=\"node\" takes the group size from torchrun's LOCAL_WORLD_SIZE, which is "
                f"{'not set' if local is None else repr(local)}: launch with torchrun, or give the size as a number")
        size = int(local)
        what = f"{key}=\"node\" (LOCAL_WORLD_SIZE={size})"
    else:
        assert isinstance(value, int)
        size, what = value, f"{key}={value}"
    if world % size != 0:
        raise ValueError(f"{what} does not divide the world size {world}: the ranks must split into whole shard "
                         "groups; choose a divisor of the world size")
    return size


def check_mesh(mesh: object, world: int) -> DeviceMesh:
    """``mesh`` if it is an HSDP mesh over every rank (see the module docstring), else a clear error."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES:
        raise ValueError(
            f"device_mesh must be 2-D with mesh_dim_names={MESH_DIM_NAMES} (replicas x shard group), got a "
            f"{mesh.ndim}-D mesh named {mesh.mesh_dim_names}; build it with init_device_mesh(device_type, "
            f"(world // shard_size, shard_size), mesh_dim_names={MESH_DIM_NAMES})")
    if mesh.size() != world:
        raise ValueError(f"device_mesh spans {mesh.size()} ranks, the world {world}: the mesh must hold every rank")
    # a shard's index is its rank in the shard group, which torch numbers in increasing global
    # rank, and the checkpoint's DTensors place it by its mesh coordinate: the two must agree
    # (the mesh is the same tensor on every rank, so every rank decides alike)
    rows = mesh.mesh.tolist()
    if any(row != sorted(row) for row in rows):
        raise ValueError(f"device_mesh {rows}: each shard group (row) must list its ranks in increasing order")
    return mesh


def hsdp_mesh(device_type: str, world: int, shard_size: int) -> DeviceMesh:
    """The (replicate, shard) mesh of ``world // shard_size`` replicas (collective: every rank builds it)."""
    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=MESH_DIM_NAMES)


def from_mesh(mesh: DeviceMesh, world: ProcessGroup) -> Topology:
    """The groups of an HSDP mesh over every rank (``world``: the engine's group
    over them); one replica is flat over its shard group."""
    shard = mesh.get_group("shard")
    replicas = mesh.size(0)
    if replicas == 1:
        return Topology(world, shard, None, None)
    return Topology(world, shard, mesh.get_group("replicate"), mesh)


def shard_size_for(mics_shard_size: int | str | None, mesh: DeviceMesh | None, group: ProcessGroup) -> int:
    """The shard group size of an engine over ``group`` or ``mesh`` (checked
    by ``check_mesh``), with ``Zero3Config.mics_shard_size``."""
    world = dist.get_world_size(group)
    if mesh is not None:
        size = mesh.size(1)
        if mics_shard_size is not None and resolve_shard_size(mics_shard_size, world) != size:
            raise ValueError(f"mics_shard_size={mics_shard_size!r} and the device_mesh's shard dimension ({size}) "
                             "disagree: give one of them")
        return size
    size = resolve_shard_size(mics_shard_size, world)
    if size != world and world != dist.get_world_size():
        raise ValueError(
            f"mics_shard_size={mics_shard_size!r} with a process_group of {world} of the {dist.get_world_size()} "
            "ranks: HSDP builds its mesh over every rank; drop process_group, or pass device_mesh= instead")
    return size


def hpz_size_for(hpz_partition_size: int | str | None, shard_size: int, group: ProcessGroup,
                 divergent_graphs: bool) -> int | None:
    """hpZ's secondary group size (None: off), checked against the rest of the layout (see the Note)."""
    world = dist.get_world_size(group)
    size = resolve_shard_size(hpz_partition_size, world, "hpz_partition_size")
    if hpz_partition_size is None or size in (1, world):
        return None  # 1 is DeepSpeed's "off"; the world is flat ZeRO-3 already
    if shard_size != world:
        raise ValueError(f"hpz_partition_size={hpz_partition_size!r} with HSDP (a shard group of {shard_size}): "
                         "hpZ keeps the flat layout and adds a secondary one; choose one of them")
    if world != dist.get_world_size():
        raise ValueError(f"hpz_partition_size={hpz_partition_size!r} with a process_group of {world} of the "
                         f"{dist.get_world_size()} ranks: hpZ builds its node groups over every rank; drop process_group")
    if divergent_graphs:
        raise ValueError("hpz_partition_size with divergent_graphs=True: ranks whose graphs differ would keep "
                         "different secondary slices and split backward's gathers differently; use one of them")
    return size


def topology_for(group: ProcessGroup, mesh: DeviceMesh | None, shard_size: int, device_type: str,
                 hpz_size: int | None = None) -> Topology:
    """The engine's groups (collective where a mesh is built here: every rank calls it)."""
    if mesh is not None:
        return from_mesh(mesh, group)
    world = dist.get_world_size(group)
    if hpz_size is not None:  # the flat layout, and the node groups of an (N/S, S) mesh for the secondary slices
        return Topology(group, group, None, None, hsdp_mesh(device_type, world, hpz_size).get_group("shard"))
    if shard_size == world:
        return flat(group)
    return from_mesh(hsdp_mesh(device_type, world, shard_size), group)
