"""Directories written by every rank that a crash cannot leave half-written.

Note: stage, manifest last, rename.
    Everything is written into a staging directory beside the target
    (``.<name>.partial-<token>``). Once every rank has written its files,
    the ranks hash them (each a share of the files), and rank 0 writes the
    manifest, which names every file with its size and SHA-256, and only
    then renames the staging directory into place (an earlier save at the
    target is moved aside first and deleted after). A save killed part-way
    leaves the previous directory as it was and a ``.partial-`` directory
    without a manifest, which nothing loads. Loading checks every file
    against the manifest first and names the first one that does not match.

Note: what a save may replace, and how its ranks fail.
    Before anything is written, rank 0 looks at the target (``target``) and
    every rank raises the same ``SaveRefused`` where it is not the save's to
    replace; rank 0 looks again just before the rename. Every step ends in
    an exchange of each rank's outcome (``together``), so an error on one
    rank is raised on all of them, and a save that fails on any path removes
    its staging directory on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from z3kit_recipes.zero3.weights.target import (
    CHECKPOINT_KIND,
    EXPORT_KIND,
    MANIFEST,
    WRITTEN_BY,
    Existing,
    check_path,
    inspect,
    leftovers,
)
from z3kit_recipes.zero3.weights.together import Together

__all__ = ["CHECKPOINT_KIND", "EXPORT_KIND", "MANIFEST", "Staging", "commit", "read_manifest", "staged", "verify"]

_CHUNK = 1 << 20


@attrs.frozen
class Staging:
    """A save in progress: its staging directory and where it goes."""

    path: Path
    final: Path
    #: the manifest's ``kind`` of what is being saved
    kind: str
    #: the call that saves, for messages (``save_checkpoint``)
    what: str


def _prepare(final: Path, kind: str, what: str) -> Path:
    """Rank 0's checks of the target, then the staging directory, created."""
    check_path(final, what)
    inspect(final, kind, what)
    stale = leftovers(final)
    if stale:
        # Named, not deleted: a staging folder without a manifest is also what another save of the
        # same target that is still running (a second job, an earlier run not yet stopped) looks like.
        warnings.warn(f"{what}: {final.parent} holds folders of earlier saves of {final.name} that did not finish: "
                      f"{', '.join(p.name for p in stale)}; z3kit leaves them in case a save is still writing one: "
                      "delete them once no save of this folder is running", stacklevel=2)
    staging = final.parent / f".{final.name}.partial-{secrets.token_hex(4)}"
    try:
        staging.mkdir(parents=True)
    except OSError as exc:
        raise OSError(f"{what}({str(final)!r}): cannot create the staging folder {staging} ({exc}): a save is "
                      f"written beside its folder first, so {final.parent} must be a folder this process may "
                      "write in; nothing was written") from None
    return staging


@contextlib.contextmanager
def staged(path: str | os.PathLike[str], kind: str, what: str, together: Together) -> Iterator[Staging]:
    """A fresh staging directory for a save of ``kind`` to ``path``, the same on
    every rank (collective); refused on every rank where the target is not the
    save's to replace (``target``). If the block raises, on any rank, the
    staging directory is removed (every rank tries: whichever is still there)."""
    final = Path(path)
    made: list[Path] = []  # rank 0's staging folder, to remove should the exchange of its name fail

    def prepare() -> Path:
        made.append(_prepare(final, kind, what))
        return made[0]

    try:
        staging = Staging(together.decided(prepare), final, kind, what)
    except BaseException:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging.path, ignore_errors=True)
        raise


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


def _merged(parts: list[Any]) -> dict[str, Any]:
    return {k: v for part in parts for k, v in part.items()}


def commit(staging: Staging, metadata: dict[str, Any], together: Together) -> None:
    """Hash the staged files, write the manifest, rename into place
    (collective; inside ``staged``)."""
    together.agreed(f"{staging.what}: writing the files", lambda: None)  # every rank's files are complete
    rank, world = together.rank, together.world
    names = _files(staging.path)

    def hash_mine() -> dict[str, Any]:
        return {n: {"bytes": (staging.path / n).stat().st_size, "sha256": _sha256(staging.path / n)}
                for n in names[rank::world]}

    files = _merged(together.exchange(together.agreed(f"{staging.what}: hashing the files", hash_mine)))

    def write_and_rename() -> None:
        manifest = {"format": "z3kit", "kind": staging.kind, "files": {n: files[n] for n in names}, **metadata}
        tmp = staging.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, staging.path / MANIFEST)
        _rename_into_place(staging)

    together.decided(write_and_rename, f"{staging.what}: writing the manifest and renaming {staging.path} to {staging.final}")


def _rename_into_place(staging: Staging) -> None:
    final = staging.final
    # looked at again: the target may have changed while the files were written
    if inspect(final, staging.kind, staging.what) is not Existing.EARLIER_SAVE:
        os.replace(staging.path, final)  # onto nothing, or onto an empty folder: atomic, deletes nothing
        return
    aside = final.parent / f".{final.name}.old-{secrets.token_hex(4)}"
    os.replace(final, aside)
    try:
        os.replace(staging.path, final)
    except BaseException:
        os.replace(aside, final)  # the earlier save back in place
        raise
    shutil.rmtree(aside, ignore_errors=True)
    if aside.exists():
        warnings.warn(f"{staging.what}: saved {final}, but the earlier save moved aside to {aside} could not be "
                      "deleted entirely: delete it yourself", stacklevel=2)


def read_manifest(root: Path, kind: str | None = None) -> dict[str, Any]:
    """The manifest of a committed directory (of ``kind``, when given); a
    clear error naming the file and the folder for anything else."""
    if not root.is_dir():
        raise FileNotFoundError(f"no checkpoint at {root}: " + ("it is a file, not a folder" if root.exists()
                                                                  else "it does not exist (no such folder)"))
    path = root / MANIFEST
    if not path.is_file():
        raise ValueError(
            f"{root} has no {MANIFEST}: it is not a z3kit checkpoint, or its save did not finish "
            "(a save writes the manifest last)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the manifest of {root} is not valid JSON ({exc}): it is damaged or truncated "
                         "(a save writes it whole, then renames it into place)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "z3kit" or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path}: the manifest of {root} is not a z3kit manifest (no format 'z3kit' and files)")
    found = manifest.get("kind")
    if kind is not None and found != kind:
        if found == EXPORT_KIND:
            hint = "it is a Hugging Face export (save_pretrained): load it with engine.load_pretrained"
        else:
            hint = f"it holds {found!r} (written by {WRITTEN_BY.get(str(found), 'something else')})"
        raise ValueError(f"{root} is not a {kind} ({path} says kind {found!r}): {hint}")
    return manifest


def verify(root: Path, manifest: dict[str, Any], together: Together) -> None:
    """Check every file's size and SHA-256 against the manifest (each rank a
    share); raises the same error everywhere."""
    rank, world = together.rank, together.world
    names = sorted(manifest["files"])

    def check_mine() -> dict[str, str]:
        mine = {}
        for name in names[rank::world]:
            want, path = manifest["files"][name], root / name
            if not path.is_file():
                mine[name] = "missing"
            elif path.stat().st_size != want["bytes"]:
                mine[name] = f"{path.stat().st_size} bytes, the manifest says {want['bytes']}"
            elif _sha256(path) != want["sha256"]:
                mine[name] = "its SHA-256 differs from the manifest's"
        return mine

    bad = _merged(together.exchange(together.agreed(f"checking the files of {root}", check_mine)))
    if bad:
        first = min(bad)
        raise ValueError(f"checkpoint {root} is corrupt: {first}: {bad[first]}" + (
            f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""))
