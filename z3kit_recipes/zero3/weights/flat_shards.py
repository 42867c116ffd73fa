"""A parameter's shard as ``torch.distributed.checkpoint`` sees it: this
rank's slice of the flattened parameter, as a ``DTensor`` of the flat shape
``(numel,)`` (the Note in ``zero3.weights.checkpoint`` says why that is
exactly DTensor's ``Shard(0)`` chunk, and how HSDP's replicas fit), over a
view of the engine's own buffer: saving copies nothing, and loading writes
in place; ``local_slice`` reads an entry back into this rank's slice.
``zero3.weights.checkpoint`` and ``zero3.weights.dcp_state`` save and load
through it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from z3kit.shard import ParamShard
from z3kit_recipes.zero3.runtime.core import EngineCore

#: the mesh the shards are DTensors over, and their placements
FlatMesh = tuple[DeviceMesh, list[Placement]]


def flat_mesh(engine: EngineCore) -> FlatMesh:
    """The mesh of ``engine``'s shards: its shard group (``[Shard(0)]``), or
    under HSDP the (replicate, shard) mesh (``[Replicate(), Shard(0)]``)."""
    topology = engine.topology
    if topology.mesh is None:
        return DeviceMesh.from_group(topology.shard_group, engine.device.type), [Shard(0)]
    return topology.mesh, [Replicate(), Shard(0)]


def flat_dtensor(local_padded: torch.Tensor, numel: int, start: int, stop: int, mesh: FlatMesh) -> DTensor:
    """This rank's slice of a flattened tensor of ``numel`` elements (the
    first ``stop - start`` elements of its padded local buffer) as a DTensor."""
    local = local_padded.detach()[: stop - start]
    return DTensor.from_local(local, mesh[0], mesh[1], run_check=False, shape=torch.Size([numel]), stride=(1,))


def local_slice(key: str, value: Any, shard: ParamShard, span: tuple[int, int], mesh: FlatMesh) -> torch.Tensor:
    """This rank's ``[start, stop)`` of a parameter-sized entry: a flat
    DTensor laid out as this engine's, or a whole tensor (flat or shaped)."""
    start, stop = span
    if isinstance(value, DTensor):
        if tuple(value.shape) != (shard.numel,) or list(value.placements) != mesh[1]:
            raise ValueError(f"{key}: a DTensor of shape {tuple(value.shape)} placed {list(value.placements)}, where "
                             f"this engine's is of shape ({shard.numel},) placed {mesh[1]} (as get_state_dict gives it)")
        local = value.to_local()
    elif isinstance(value, torch.Tensor):
        if value.numel() != shard.numel or (value.dim() != 1 and tuple(value.shape) != tuple(shard.shape)):
            flat = f" (or flat: ({shard.numel},))" if len(shard.shape) != 1 else ""
            raise ValueError(f"{key}: shape {tuple(value.shape)}, where the parameter's is {tuple(shard.shape)}{flat}")
        local = value.detach().reshape(-1)[start:stop]
    else:
        raise ValueError(f"{key}: not a tensor ({type(value).__name__})")
    if local.numel() != stop - start:
        raise ValueError(f"{key}: {local.numel()} elements on this rank, where its shard holds {stop - start}")
    return local
