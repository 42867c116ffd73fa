"""The training text, its character vocabulary, and the batches drawn from it.

The corpus is one that every machine has without a download: the Python
standard library's own ``.py`` files, read in sorted order. Every rank
reads the same text (the job checks the digest) and samples its own
batches, seeded by ``(seed, rank, step)``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs
import torch

from z3kit_recipes.train.defaults import DEFAULT_CORPUS_CHARS

#: directories of the standard library left out of the corpus: installed
#: packages (they differ between machines) and test suites (odd encodings,
#: generated data)
SKIPPED_DIRS: Final = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(os.path.dirname(os.__file__))


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root``, sorted by relative path."""
    base = stdlib_root() if root is None else root
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        rel = os.path.relpath(dirpath, base)
        for name in filenames:
            if name.endswith(".py"):
                found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return [base / p for p in sorted(found)]


@attrs.frozen
class Corpus:
    """Training text and where it came from."""

    text: str
    root: str
    files: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load_corpus(max_chars: int = DEFAULT_CORPUS_CHARS, root: Path | None = None) -> Corpus:
    """The first ``max_chars`` characters of the standard library's source.

    Files are read whole in sorted order (``corpus_files``) and joined with a
    blank line; files that are not valid UTF-8 are skipped; the text is
    cut at ``max_chars``. The same Python installation gives the same text
    on every call and every machine.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be > 0, got {max_chars}")
    base = stdlib_root() if root is None else root
    pieces: list[str] = []
    total = used = 0
    for path in corpus_files(base):
        if total >= max_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        pieces.append(text if text.endswith("\n") else text + "\n")
        pieces.append("\n")
        total += len(pieces[-2]) + 1
        used += 1
    if not pieces:
        raise RuntimeError(f"no readable .py files under {base}: there is no corpus to train on")
    return Corpus(text="".join(pieces)[:max_chars], root=str(base), files=used)


@attrs.frozen
class CharVocab:
    """Characters of a text, sorted by code point; a token is an index into them."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        if not text:
            raise ValueError("cannot build a vocabulary from empty text")
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``; every character must be in the vocabulary."""
        if not text:
            return torch.empty(0, dtype=torch.int64)
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).to(torch.int64)
        table = torch.tensor([ord(c) for c in self.chars], dtype=torch.int64)
        ids = torch.searchsorted(table, codes).clamp_(max=len(self.chars) - 1)
        unknown = table[ids] != codes
        if bool(unknown.any()):
            first = chr(int(codes[unknown][0]))
            raise ValueError(f"character {first!r} is not in the vocabulary")
        return ids

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.chars[i] for i in values)

    def tokens(self, text: str) -> torch.Tensor:
        """``text`` encoded in the narrowest dtype that holds the vocabulary
        (the whole corpus stays resident on every rank)."""
        return self.encode(text).to(torch.uint8 if len(self) <= 256 else torch.int32)


def _batch_seed(seed: int, rank: int, step: int) -> int:
    mixed = 0x7A3C
    for part in (seed, rank, step):
        mixed = (mixed * 1_000_003 + part) % (2**63 - 1)
    return mixed


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, *, seed: int, rank: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``data``: inputs and next-character
    targets, ``(batch_size, seq_len)`` int64 each, seeded by ``(seed, rank, step)``."""
    if data.numel() < seq_len + 2:
        raise ValueError(f"the corpus ({data.numel()} tokens) is shorter than one sequence ({seq_len + 1})")
    gen = torch.Generator().manual_seed(_batch_seed(seed, rank, step))
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size, 1), generator=gen)
    windows = data[starts + torch.arange(seq_len + 1)].to(torch.int64)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
