"""The optional dependencies of the ``cli`` extra (tqdm, matplotlib)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Final

CLI_EXTRA_HINT: Final = "install the cli extra: pip install 'z3kit[cli]'"


def optional_module(name: str, what: str) -> ModuleType:
    """Import an optional dependency of the ``cli`` extra, or say how to get it
    (``RuntimeError`` naming ``what`` needs it)."""
    try:
        # through the module attribute, so that tests can hide a package
        return importlib.import_module(name)
    except ImportError:
        raise RuntimeError(f"{what} needs {name.split('.')[0]}, which is not installed; {CLI_EXTRA_HINT}") from None
