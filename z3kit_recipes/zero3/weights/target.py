"""Where a save may go: it never deletes what it did not write.

A save writes a staging folder beside its target and renames it into place
(``commit``). What is at the target decides whether it may:

- nothing, or an empty folder: written (renaming onto an empty folder
  replaces it atomically and deletes nothing);
- an earlier save of the same kind (its manifest says so, and the folder
  holds only files that the manifest names): replaced, atomically;
- anything else (a folder of other files, a save of another kind, a
  regular file, a symbolic link), and paths whose folder cannot be
  replaced from beside it (``.``, ``..``, ``/``, the working directory or
  one above it): refused before anything is written.
"""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "z3kit_manifest.json"
#: the manifest's ``kind`` of a training checkpoint (``zero3.weights.checkpoint``)
CHECKPOINT_KIND = "z3kit checkpoint"
#: the manifest's ``kind`` of Hugging Face-layout weights (``zero3.weights.pretrained``, ``convert``)
EXPORT_KIND = "hugging-face weights"
#: what writes each kind, for messages
WRITTEN_BY = {CHECKPOINT_KIND: "save_checkpoint", EXPORT_KIND: "save_pretrained (or z3kit_recipes.convert)"}


class SaveRefused(ValueError):
    """What is at a save's target is not the save's to replace."""


class Existing(enum.Enum):
    """What a save finds at its target (when it is not refused)."""

    #: nothing there: the staging folder is renamed to the target
    NOTHING = "nothing"
    #: an empty folder: the staging folder is renamed onto it (rename replaces an empty folder)
    EMPTY_FOLDER = "empty folder"
    #: an earlier save of the same kind: moved aside, the staging folder renamed in, the old one deleted
    EARLIER_SAVE = "earlier save"


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def manifest_kind(root: Path) -> str | None:
    """The ``kind`` in ``root``'s readable z3kit manifest, else None."""
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = manifest.get("kind") if isinstance(manifest, dict) and manifest.get("format") == "z3kit" else None
    return kind if isinstance(kind, str) else None


def check_path(final: Path, what: str) -> None:
    """Refuse a path whose folder cannot be replaced from beside it."""
    name = os.path.basename(os.path.normpath(final))
    if name in ("", ".", "..") or Path.cwd().resolve().is_relative_to(final.resolve()):
        raise SaveRefused(
            f"{what}({str(final)!r}): refused, nothing was written: a save is written beside its folder and "
            "renamed into place, which this path (the working directory, a folder above it, or the root) "
            "does not allow; name a folder below it, such as ./checkpoint"
        )


def inspect(final: Path, kind: str, what: str) -> Existing:
    """What is at ``final``, for a save of ``kind`` (``what``: the call, for
    messages); raises ``SaveRefused`` where the save may not go."""
    refused = f"{what}({str(final)!r}): refused, nothing was written: {final}"
    if final.is_symlink():
        raise SaveRefused(f"{refused} is a symbolic link (to {os.readlink(final)}); save to a path that is not one")
    if not final.exists():
        return Existing.NOTHING
    if not final.is_dir():
        raise SaveRefused(f"{refused} is a file, not a folder; a save is a folder: choose another path, "
                          "or move the file away")
    entries = sorted(p.name for p in final.iterdir())
    if not entries:
        return Existing.EMPTY_FOLDER
    if MANIFEST not in entries:
        raise SaveRefused(f"{refused} is a folder that z3kit did not write (it has no {MANIFEST}; it holds "
                          f"{_shown(entries)}): save to a new or empty folder, or move its contents away")
    manifest = _manifest(final, refused)
    found = manifest.get("kind")
    if found != kind:
        by = WRITTEN_BY.get(found, "something else") if isinstance(found, str) else "something else"
        raise SaveRefused(f"{refused} holds a {found!r} (written by {by}); {what} replaces only an earlier "
                          f"{kind!r}: choose another path")
    listed = set(manifest.get("files", {})) | {MANIFEST}
    extra = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()
                   and str(p.relative_to(final)) not in listed)
    if extra:
        raise SaveRefused(f"{refused} is an earlier save, but it also holds files that the save did not write "
                          f"({_shown(extra)}), which replacing it would delete: move them away, or save elsewhere")
    return Existing.EARLIER_SAVE


def _manifest(final: Path, refused: str) -> dict[str, Any]:
    try:
        manifest = json.loads((final / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SaveRefused(f"{refused} has a {MANIFEST} that cannot be read ({exc}), so it cannot be told apart "
                          "from files of yours: remove the folder yourself if it is an unfinished save") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "z3kit" or not isinstance(manifest.get("files"), dict):
        raise SaveRefused(f"{refused} has a {MANIFEST} that is not a z3kit manifest: save elsewhere")
    return manifest


def leftovers(final: Path) -> list[Path]:
    """Staging (``.partial-``) and set-aside (``.old-``) folders of earlier
    saves of ``final`` that did not finish (a killed process leaves them)."""
    if not final.parent.is_dir():
        return []
    return sorted(p for pattern in (f".{final.name}.partial-*", f".{final.name}.old-*")
                  for p in final.parent.glob(pattern))
