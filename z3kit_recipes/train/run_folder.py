"""The run folder's checkpoints: the latest one (``--resume RUN_DIR``), the
rotation of old ones (``--keep-last``), and the folder's removal when a run
stops with nothing in it worth keeping (Ctrl-C).

Pure pathlib: nothing here imports torch, so the command answers before any
process starts. A checkpoint counts when its manifest says it is one (a
save is staged beside its folder and renamed into place, so a folder with
a manifest is complete); deletion touches only what the caller says this
job wrote.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Final

#: the name :func:`checkpoint_path` gives a checkpoint saved after N steps
CHECKPOINT_NAME: Final = re.compile(r"checkpoint-(\d+)")
#: the manifest's kind of a checkpoint (``zero3.weights.target.CHECKPOINT_KIND``, not imported: it brings in torch)
_CHECKPOINT_KIND: Final = "z3kit checkpoint"


def checkpoint_path(out: Path, step: int) -> Path:
    """The checkpoint saved after ``step`` optimizer steps."""
    return out / f"checkpoint-{step:06d}"


def _is_checkpoint(folder: Path) -> bool:
    from z3kit_recipes.zero3.weights.target import manifest_kind  # reads JSON; its package imports torch lazily

    return manifest_kind(folder) == _CHECKPOINT_KIND


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of each complete ``checkpoint-<step>`` in ``run_dir``, oldest first."""
    found = []
    for child in run_dir.iterdir() if run_dir.is_dir() else ():
        match = CHECKPOINT_NAME.fullmatch(child.name)
        if match and child.is_dir() and not child.is_symlink() and _is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def resume_target(path: Path) -> tuple[Path, str | None]:
    """What ``--resume path`` continues: ``path`` itself when it is a
    checkpoint, else, when it is a run folder, its latest complete
    checkpoint, with a line that says which one was taken."""
    if _is_checkpoint(path):
        return path, None
    found = complete_checkpoints(path)
    if not found:
        return path, None  # not a checkpoint, nor a folder of them: read_client_state says what it is
    step, latest = found[-1]
    return latest, (f"--resume {path}: taking its latest checkpoint, {latest.name} (step {step}, "
                    f"the newest of {len(found)})")  # fmt: skip


def rotate(written: Sequence[Path], keep: int, *, delete: bool) -> tuple[list[Path], list[Path]]:
    """``written``: the checkpoints this run saved, oldest first. The oldest
    beyond the newest ``keep`` (>= 1: the newest is never one of them), and
    the rest; those are deleted where ``delete`` (one rank deletes)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest checkpoint is never deleted), got {keep}")
    cut = max(0, len(written) - keep)
    doomed, kept = list(written[:cut]), list(written[cut:])
    for folder in doomed if delete else ():
        shutil.rmtree(folder)
    return doomed, kept


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest
    first: what creating ``path`` would make."""
    made: list[Path] = []
    for folder in (path, *path.parents):
        if folder.exists() or folder == Path(folder.anchor) or str(folder) in ("", "."):
            break
        made.append(folder)
    return made


def remove_if_empty(made: Sequence[Path]) -> list[Path]:
    """Remove the folders of ``made`` (this run created them, deepest
    first) that are empty, and return them: a run that stopped before it
    wrote anything leaves no folder behind. Nothing else is deleted."""
    removed = []
    for folder in made:
        try:
            folder.rmdir()  # only an empty folder: anything in it stays, the folder with it
        except OSError:
            break
        removed.append(folder)
    return removed
