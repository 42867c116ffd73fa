"""Directories written by every rank that a crash cannot leave half-written.

Note: stage, manifest last, rename.
    Everything is written into a staging directory beside the target
    (``.<name>.partial-<token>``). Once every rank has written its files,
    the ranks hash them (each a share of the files), and rank 0 writes the
    manifest, which names every file with its size and SHA-256, and only
    then renames the staging directory into place (an existing target is
    moved aside first and deleted after). A save killed part-way leaves the
    previous directory as it was and a ``.partial-`` directory without a
    manifest, which nothing loads. Loading checks every file against the
    manifest first and names the first one that does not match.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from z3kit.collectives import ProcessGroup

MANIFEST = "z3kit_manifest.json"
_CHUNK = 1 << 20


def _rank_world(group: ProcessGroup | None) -> tuple[int, int]:
    """(rank, world); a process without a group is rank 0 of 1."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def staging_path(final: Path, group: ProcessGroup | None) -> Path:
    """A fresh staging directory beside ``final``, named by rank 0, created,
    the same on every rank (``group=None``: one process on its own)."""
    rank, _ = _rank_world(group)
    name = [f".{final.name}.partial-{secrets.token_hex(4)}" if rank == 0 else ""]
    if group is not None:
        dist.broadcast_object_list(name, group_src=0, group=group)
    staging = final.parent / name[0]
    if rank == 0:
        staging.mkdir(parents=True)
    if group is not None:
        dist.barrier(group=group)
    return staging


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    block = bytearray(_CHUNK)  # one buffer, reused: hashing adds _CHUNK bytes to the peak
    view = memoryview(block)
    with open(path, "rb") as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _shared(results: dict[str, Any], group: ProcessGroup | None) -> dict[str, Any]:
    if group is None:
        return results
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, results, group=group)
    return {k: v for part in everyone for k, v in part.items()}


def commit(staging: Path, final: Path, metadata: dict[str, Any], group: ProcessGroup | None) -> None:
    """Hash the staged files, write the manifest, rename into place (collective)."""
    if group is not None:
        dist.barrier(group=group)  # every rank's files are complete
    rank, world = _rank_world(group)
    names = _files(staging)
    mine = {n: {"bytes": (staging / n).stat().st_size, "sha256": _sha256(staging / n)} for n in names[rank::world]}
    files = _shared(mine, group)
    if rank == 0:
        manifest = {"format": "z3kit", "files": {n: files[n] for n in names}, **metadata}
        tmp = staging / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, staging / MANIFEST)
        aside = final.parent / f".{final.name}.old-{secrets.token_hex(4)}"
        if final.exists():
            os.replace(final, aside)
        os.replace(staging, final)
        shutil.rmtree(aside, ignore_errors=True)
    if group is not None:
        dist.barrier(group=group)


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a committed directory; a clear error for anything else."""
    if not root.is_dir():
        raise FileNotFoundError(f"no checkpoint at {root}")
    path = root / MANIFEST
    if not path.is_file():
        raise ValueError(
            f"{root} has no {MANIFEST}: it is not a z3kit checkpoint, or its save did not finish "
            "(a save writes the manifest last)"
        )
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def verify(root: Path, manifest: dict[str, Any], group: ProcessGroup | None) -> None:
    """Check every file's size and SHA-256 against the manifest (each rank a
    share, when there is a group); raises the same error everywhere."""
    rank, world = _rank_world(group)
    names = sorted(manifest["files"])
    bad: dict[str, Any] = {}
    for name in names[rank::world]:
        want, path = manifest["files"][name], root / name
        if not path.is_file():
            bad[name] = "missing"
        elif path.stat().st_size != want["bytes"]:
            bad[name] = f"{path.stat().st_size} bytes, the manifest says {want['bytes']}"
        elif _sha256(path) != want["sha256"]:
            bad[name] = "its SHA-256 differs from the manifest's"
    bad = _shared(bad, group)
    if bad:
        first = min(bad)
        raise ValueError(f"checkpoint {root} is corrupt: {first}: {bad[first]}" + (
            f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""))
