"""DeepSpeed's checkpoint layout: tag folders under a save folder, and its ``latest`` file.

``save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True)``
writes the checkpoint (``zero3.weights.checkpoint``, committed safely by
``zero3.weights.commit``) to ``save_dir/tag``, ``tag`` by default
``global_step{N}`` (N: optimizer steps taken), then, with ``save_latest``,
rank 0 writes the tag into ``save_dir/latest``: DeepSpeed's layout, so that a
DeepSpeed script's ``load_checkpoint(save_dir)`` resumes from the last save.
Every rank must pass the same tag (refused on every rank otherwise, before
anything is written: DeepSpeed's ``tag_validation`` at "Fail").

``load_checkpoint(load_dir, tag=None)`` loads ``load_dir/tag``; without a
tag, the tag ``load_dir/latest`` names, or ``load_dir`` itself where it is a
checkpoint (a folder with z3kit's manifest, as older z3kit saves and the
main job's ``checkpoint-N`` folders are). It returns DeepSpeed's
``(path loaded, client_state)``. Where ``load_dir`` is an empty folder
(nothing saved yet), it returns ``(None, None)`` with a warning, as
DeepSpeed does, so that a script's resume-if-present idiom works; a
``load_dir`` that does not exist is refused, naming it (``FileNotFoundError``:
a misspelt path does not start a run afresh, where DeepSpeed's would).

Note: ``latest`` is replaced only when it is one.
    A save never deletes what it did not write: an existing ``latest`` is
    replaced only when it is a regular file holding one tag (what DeepSpeed
    and z3kit write); a folder, a link or any other file of that name is
    refused before anything is written. It is written atomically
    (``os.replace``), after the checkpoint is committed, so that it never
    names a checkpoint that is not complete.
"""

from __future__ import annotations

import os
import secrets
import warnings
from pathlib import Path
from typing import Any, Final

from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights import checkpoint
from z3kit_recipes.zero3.weights.target import MANIFEST, SaveRefused
from z3kit_recipes.zero3.weights.together import Together

#: DeepSpeed's file naming the last tag saved
LATEST: Final = "latest"
#: the most bytes a ``latest`` file that may be replaced holds
_LATEST_BYTES: Final = 1024


def default_tag(engine: EngineCore) -> str:
    """DeepSpeed's default tag: ``global_step{N}``."""
    return f"global_step{engine.global_step}"


def _check_tag(tag: object) -> str:
    """``tag`` as a folder name (DeepSpeed writes ``str(tag)``)."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(f"tag must be a str (or an int), got {type(tag).__name__}")
    name = str(tag)
    if name in ("", ".", "..") or "/" in name or os.sep in name or name == LATEST:
        raise ValueError(f"tag {name!r} must name one folder inside the save folder (not {name!r}, no '/')")
    return name


def _latest_tag(path: Path) -> str | None:
    """The tag a ``latest`` file holds; None where ``path`` is not such a file."""
    if path.is_symlink() or not path.is_file() or path.stat().st_size > _LATEST_BYTES:
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text and "\n" not in text else None


def _check_latest(save_dir: Path) -> None:
    """Rank 0: refuse a ``latest`` that is not one, before anything is written."""
    path = save_dir / LATEST
    if (path.exists() or path.is_symlink()) and _latest_tag(path) is None:
        raise SaveRefused(f"save_checkpoint({str(save_dir)!r}): {path} is not a 'latest' file of a save (a file "
                          "holding one tag), so it is not the save's to replace; refused, nothing was written: "
                          "move it, pass save_latest=False, or save to another folder")


def _write_latest(save_dir: Path, tag: str) -> None:
    _check_latest(save_dir)  # looked at again: it may have changed while the checkpoint was written
    tmp = save_dir / f".{LATEST}.tmp-{secrets.token_hex(4)}"
    tmp.write_text(tag + "\n", encoding="utf-8")
    os.replace(tmp, save_dir / LATEST)


def save_tagged(engine: EngineCore, save_dir: str | os.PathLike[str], tag: object,
                client_state: dict[str, Any] | None, save_latest: bool) -> Path:
    """Save to ``save_dir/tag`` and name it in ``latest`` (collective; see the module docstring)."""
    if not isinstance(save_latest, bool):
        raise TypeError(f"save_latest must be a bool, got {type(save_latest).__name__}")
    if not isinstance(save_dir, (str, os.PathLike)) or not str(save_dir):
        raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
    engine.check_idle("save_checkpoint")  # before any exchange: a broken engine refuses at once
    together = Together.of(engine)
    name = together.agreed("save_checkpoint: checking the tag",
                           lambda: _check_tag(default_tag(engine) if tag is None else tag))
    tags = sorted(set(together.exchange(name)))
    if len(tags) > 1:
        raise ValueError(f"save_checkpoint: the ranks passed different tags ({', '.join(map(repr, tags))}); every "
                         "rank must save under the same tag; nothing was written")
    root = Path(save_dir)
    if save_latest:
        together.decided(lambda: _check_latest(root))
    checkpoint.save_checkpoint(engine, root / name, client_state)
    if save_latest:
        together.decided(lambda: _write_latest(root, name), f"save_checkpoint: writing {root / LATEST}")
    return root / name


def _source(load_dir: Path, tag: object) -> Path | None:
    """The checkpoint folder to load (see the module docstring); None: nothing saved yet."""
    if tag is not None:
        return load_dir / _check_tag(tag)
    if (load_dir / MANIFEST).is_file():
        return load_dir
    latest = load_dir / LATEST
    if latest.exists():
        named = _latest_tag(latest)
        if named is None:
            raise ValueError(f"{latest} does not hold a tag (one line): pass tag= to load_checkpoint")
        return load_dir / _check_tag(named)
    if load_dir.is_dir() and not load_dir.is_symlink() and not any(load_dir.iterdir()):
        return None
    return load_dir  # missing, or a folder of something else: the checkpoint reader says which


def load_tagged(engine: EngineCore, load_dir: str | os.PathLike[str], tag: object) -> tuple[str | None, Any]:
    """Load ``load_dir/tag`` (or what ``latest`` names); DeepSpeed's ``(path, client_state)`` (collective)."""
    engine.check_idle("load_checkpoint")  # before any exchange: a broken engine refuses at once
    together = Together.of(engine)
    source = together.decided(lambda: _source(Path(load_dir), tag))
    if source is None:
        if engine.rank == 0:
            warnings.warn(f"load_checkpoint({str(load_dir)!r}): nothing saved there yet (an empty folder); returning "
                          "(None, None), as DeepSpeed does, and loading nothing",
                          stacklevel=3)
        return None, None
    client = checkpoint.load_checkpoint(engine, source)
    return str(source), client
