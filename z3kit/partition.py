"""The padded partition of a flat tensor: which elements each rank keeps.

A tensor of ``numel`` elements is padded with zeros to ``world *
shard_numel`` where ``shard_numel = ceil(numel / world)`` (at least 1), and
rank ``r`` keeps elements ``[r * shard_numel, (r + 1) * shard_numel)``
(``z3kit.shard`` shards parameters so, and re-exports these).
"""

from __future__ import annotations

import math

import torch


def shard_numel_for(numel: int, world: int) -> int:
    """Elements per rank of a parameter of ``numel`` elements (at least 1)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return max(1, math.ceil(numel / world))


def partition_of(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s padded slice of a flat tensor, as a new contiguous tensor."""
    if flat.dim() != 1:
        raise ValueError(f"partition_of needs a flat tensor, got shape {tuple(flat.shape)}")
    out = flat.new_empty(shard_numel_for(flat.numel(), world))
    fill_partition(out, flat, rank, world)
    return out


def fill_partition(out: torch.Tensor, flat: torch.Tensor, rank: int, world: int) -> None:
    """Write rank ``rank``'s padded slice of ``flat`` into ``out`` (converting
    to ``out``'s dtype and device on the way; the padding becomes zeros)."""
    if flat.dim() != 1:
        raise ValueError(f"fill_partition needs a flat tensor, got shape {tuple(flat.shape)}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    size = shard_numel_for(flat.numel(), world)
    if out.numel() != size:
        raise ValueError(f"rank {rank}'s slice of {flat.numel()} elements over {world} ranks has {size}, got {out.numel()}")
    start = rank * size
    stop = min(start + size, flat.numel())
    taken = max(0, stop - start)
    if taken:
        out[:taken].copy_(flat[start:stop])
    if taken < size:
        out[taken:].zero_()
