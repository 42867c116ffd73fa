"""What ``--mesh RxS`` compares: the mesh, the layouts, one run's spec, and
each layout's resident-memory bound.

``R x S`` ranks stand for R "nodes" of S ranks each (torchrun's
``LOCAL_WORLD_SIZE=S``, ranks numbered node by node): S ranks share fast
links, and the R groups talk over the slow ones.
"""

from __future__ import annotations

import re
from typing import Final, Literal

import attrs

from z3kit.validate import int_validator
from z3kit_recipes.bench.spec import DEFAULT_ZERO_CONFIG, JSON

LayoutName = Literal["flat", "hsdp", "hpz", "fsdp2-hsdp"]
LAYOUTS: Final[tuple[LayoutName, ...]] = ("flat", "hsdp", "hpz", "fsdp2-hsdp")
#: what each layout is (the report's legend)
LAYOUT_DESCRIPTIONS: Final[dict[LayoutName, str]] = {
    "flat": "z3kit zero3, every parameter sharded over all R*S ranks",
    "hsdp": "z3kit zero3, Zero3Config(mics_shard_size=S): sharded within a node, replicated across nodes",
    "hpz": "z3kit zero3, Zero3Config(hpz_partition_size=S): sharded over all ranks, plus a secondary "
           "copy sharded within the node that backward gathers from (ZeRO++ hpZ)",
    "fsdp2-hsdp": "torch fully_shard per block and root on a 2-D (replicate, shard) = (R, S) DeviceMesh",
}
#: which layouts z3kit runs (the rest is torch's)
Z3KIT_LAYOUTS: Final[frozenset[LayoutName]] = frozenset({"flat", "hsdp", "hpz"})

#: bytes a rank holds per element of its shard: the fp32 shard, which is also the
#: optimizer's master (``ShardLayout.masters_are_shards`` in fp32), and Adam's two fp32 moments
FP32_ADAM_BYTES_PER_ELEMENT: Final = 4 + 8
#: bytes per element of the parameters that collectives move (fp32 compute)
PARAM_BYTES: Final = 4

#: the ``zero_optimization`` section of z3kit's layouts unless ``--zero-config`` is given: the
#: bench's, with every parameter released after its forward (``stage3_max_reuse_distance: 0``).
#: At DeepSpeed's default distance (1e9 elements) the bench's models stay gathered from forward
#: to backward, so backward gathers nothing, and hpZ (which changes only where backward
#: gathers from) would have nothing to save; FSDP2 here reshards after forward too.
MESH_ZERO_CONFIG: Final[JSON] = {**DEFAULT_ZERO_CONFIG, "stage3_max_reuse_distance": 0}

_MESH_FORM: Final = re.compile(r"(\d+)x(\d+)")


@attrs.frozen
class MeshShape:
    """R replicas ("nodes") of S ranks each."""

    replicas: int = attrs.field(validator=int_validator(at_least=1))
    shard_size: int = attrs.field(validator=int_validator(at_least=1))

    @property
    def world(self) -> int:
        return self.replicas * self.shard_size

    def __str__(self) -> str:
        return f"{self.replicas}x{self.shard_size}"

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """``"2x4"`` -> 2 nodes of 4 ranks; anything else is refused with what was expected."""
        match = _MESH_FORM.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"--mesh is RxS (nodes x ranks per node, e.g. 2x2), got {text!r}")
        replicas, shard_size = int(match[1]), int(match[2])
        if replicas < 1 or shard_size < 1:
            raise ValueError(f"--mesh needs at least 1 node and 1 rank per node, got {text!r}")
        return cls(replicas, shard_size)


def resident_bound_bytes(layout: LayoutName, total_params: int, mesh: MeshShape) -> float:
    """What one rank holds after an optimizer step in theory (fp32, Adam):
    its shard, which is its master, and Adam's moments, over 1/N of the
    model flat and under hpZ (whose secondary 1/S slices live from a
    window's first forward to its step, which frees them) and 1/S under HSDP."""
    if layout in ("hsdp", "fsdp2-hsdp"):
        return FP32_ADAM_BYTES_PER_ELEMENT * total_params / mesh.shard_size
    return FP32_ADAM_BYTES_PER_ELEMENT * total_params / mesh.world


def hsdp_inter_node_bound_bytes(total_params: int, mesh: MeshShape) -> float:
    """The issue's HSDP target per rank and step: an all-reduce of one 1/S gradient
    partition, at most ``2 * model bytes / S`` (``2 (R - 1) / R`` of it under
    the direct-exchange model)."""
    return 2 * PARAM_BYTES * total_params / mesh.shard_size


@attrs.frozen
class MeshRunSpec:
    """One spawn of ``--mesh``: the layouts run in turn on the same R*S ranks."""

    mesh: MeshShape
    layouts: tuple[LayoutName, ...]
    workload: str
    steps: int = attrs.field(validator=int_validator(at_least=1))
    warmup: int = attrs.field(validator=int_validator(at_least=0))
    threads: int = attrs.field(validator=int_validator(at_least=1))
    #: the ``zero_optimization`` section every z3kit layout starts from
    zero: JSON
    pycache_dir: str
    port: int
    out_path: str
