"""``engine.save_checkpoint`` writing the checkpoint at a given folder itself.

``save_checkpoint(save_dir, tag=...)`` is DeepSpeed's call: the checkpoint
goes to ``save_dir/tag`` (``zero3.weights.checkpoint_tags``). The tests of
what a save may replace, and of what a checkpoint folder holds, name the
checkpoint folder itself; this is that call, without DeepSpeed's ``latest``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_at(engine: Any, path: str | Path, **kwargs: Any) -> bool:
    """Save ``engine``'s checkpoint as the folder ``path`` (its parent is the save folder, its name the tag)."""
    folder = Path(path)
    result: bool = engine.save_checkpoint(folder.parent, tag=folder.name, save_latest=False, **kwargs)
    return result


def saver(engine: Any, method: str) -> Any:
    """``engine``'s save call ``method`` ("save_checkpoint" as ``save_at``), or its other methods as they are."""
    if method == "save_checkpoint":
        return lambda path, **kwargs: save_at(engine, path, **kwargs)
    return getattr(engine, method)
