"""What a worker reports about a call that should be refused."""

from __future__ import annotations

from typing import Any


def error_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    """``"<ExceptionType>: <message>"`` of a ValueError or TypeError that
    ``fn(*args, **kwargs)`` raises, or ``"no error"`` (picklable, for the pools)."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
