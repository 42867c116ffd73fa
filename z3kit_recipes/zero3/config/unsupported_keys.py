"""The refusal of DeepSpeed JSON keys z3kit does not read: one line, each key with the nearest it reads.

A misspelt key (``stage3_prefetch_bucket_sizee``) is answered with the key
meant (``difflib``'s closest match among the keys z3kit reads, dotted as
the JSON nests them), not with the list of every key: that list is
``docs/deepspeed.md``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Final

#: how alike a key and a supported key must be to be suggested (``difflib.SequenceMatcher.ratio``)
_CUTOFF: Final = 0.75


def nearest(key: str, supported: Iterable[str]) -> str | None:
    """The supported key closest to ``key`` (both dotted), or None where none is close."""
    candidates = [s.split(" ", 1)[0] for s in supported]
    found = difflib.get_close_matches(key, candidates, n=1, cutoff=_CUTOFF)
    if not found and "." in key:  # a nested key matched within its own section
        section = key.rsplit(".", 1)[0] + "."
        tails = {c[len(section):]: c for c in candidates if c.startswith(section)}
        found = [tails[t] for t in difflib.get_close_matches(key[len(section):], list(tails), n=1, cutoff=_CUTOFF)]
    return found[0] if found else None


def refusal(unsupported: Iterable[str], supported: Iterable[str]) -> str:
    """One line naming each unsupported key (entries with a reason in parentheses kept as they
    are), a plain name with the nearest supported key."""
    known = list(supported)
    named = []
    for entry in sorted(unsupported):
        near = None if " " in entry else nearest(entry, known)
        named.append(entry if near is None else f"{entry} (did you mean {near}?)")
    return (f"unsupported DeepSpeed config keys: {', '.join(named)}. z3kit does not implement them; remove them "
            "(every key z3kit reads, and what it does: docs/deepspeed.md)")
