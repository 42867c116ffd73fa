"""The run's output folder and the files the job writes there besides the
summary and the pictures."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from z3kit_recipes.train.run_folder import missing_folders


def default_out() -> Path:
    """``./runs/<timestamp>``, with a suffix when that exists already."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path("runs") / stamp
    n = 1
    while out.exists():
        n += 1
        out = Path("runs") / f"{stamp}-{n}"
    return out


def shared_out_dir(out: str | None, rank: int, device: torch.device) -> tuple[Path, list[Path]]:
    """The output folder, the same on every rank (collective): ``out``, or
    rank 0's :func:`default_out` when it is None (torchrun without ``--out``).
    Rank 0 creates it before any rank goes on; with it, the folders rank 0
    created, deepest first (``run_folder.missing_folders``; none on other ranks)."""
    chosen: list[Any] = [out if out is not None else (str(default_out()) if rank == 0 else None)]
    if out is None:
        dist.broadcast_object_list(chosen, 0, device=device)
    path = Path(chosen[0])
    made = missing_folders(path) if rank == 0 else []
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return path, made


def write_history(path: Path, loss_table: Sequence[Sequence[float]], lrs: Sequence[float]) -> None:
    """``loss_history.csv``: per step, the learning rate, the mean loss and each rank's
    (losses written in full, ``repr``: they read back as the very floats the run had)."""
    world = len(loss_table)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "lr", "loss_mean", *(f"loss_rank{r}" for r in range(world))])
        for step, lr in enumerate(lrs):
            per_rank = [loss_table[r][step] for r in range(world)]
            writer.writerow([step, f"{lr:.6g}", repr(sum(per_rank) / world), *(repr(float(v)) for v in per_rank)])
