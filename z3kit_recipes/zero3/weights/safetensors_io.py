"""The Hugging Face weight layout: safetensors files, one or many with an index.

Reading goes through the ``safetensors`` package, which reads a tensor's
slice without reading the rest: a rank takes only the rows that hold its
flat shard. Writing streams: ``safetensors.torch.save_file`` needs every
tensor of a file in memory at once, which for a model larger than one rank
is exactly what must not happen, so ``StreamingWriter`` writes the format
itself (an 8-byte little-endian header length, a JSON header of names,
dtypes, shapes and byte offsets, then the raw bytes in header order), one
tensor at a time as they are gathered. What it writes is read back by the
``safetensors`` package in the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@attrs.frozen
class StoredTensor:
    """Where a named tensor lives in a checkpoint directory."""

    file: Path
    shape: tuple[int, ...]


def index_of(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """Every tensor of a Hugging Face checkpoint (a directory with
    ``model.safetensors`` or an index and its shards, or one ``.safetensors``
    file), by name, from the files' headers only. Opening a file checks that
    it holds every byte its header promises, so a truncated file is named
    here, before anything is read."""
    root = Path(path)
    if root.is_file():
        files = [root]
    elif (root / INDEX_FILE).is_file():
        files = sorted({root / name for name in _weight_map(root).values()})
    elif (root / SINGLE_FILE).is_file():
        files = [root / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    out: dict[str, StoredTensor] = {}
    for file in files:
        with _opened(file) as f:
            for name in f.keys():
                out[name] = StoredTensor(file, tuple(f.get_slice(name).get_shape()))
    return out


def _weight_map(root: Path) -> dict[str, str]:
    index = root / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError("its weight_map is not a map of tensor names to file names")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: the index of checkpoint {root} cannot be read ({type(exc).__name__}: {exc}); "
                         "it is damaged or incomplete") from None
    return weight_map


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """``safe_open`` of ``file``; its errors (the library's own, which name no
    file) name the file and its folder."""
    from safetensors import safe_open

    try:
        f = safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: any failure to open is this file's
        raise ValueError(f"{file}: cannot be read as safetensors ({type(exc).__name__}: {exc}); checkpoint "
                         f"{file.parent} is damaged or incomplete") from None
    with f:
        yield f


def read_flat_range(stored: StoredTensor, name: str, start: int, stop: int, *, transposed: bool = False) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened tensor, reading only the
    rows (of its first dimension) that hold them. ``transposed``: the file
    holds a 2-D tensor's transpose (GPT-2's ``Conv1D``), and the range is of
    the tensor, so the columns that hold its rows are read."""
    with _opened(stored.file) as f:
        piece = f.get_slice(name)
        if transposed:
            if len(stored.shape) != 2:
                raise ValueError(f"{name} in {stored.file} has shape {list(stored.shape)}: only 2-D tensors are "
                                 "stored transposed")
            row = stored.shape[0]  # a row of the tensor is a column of the file
            first, last = start // row, -(-stop // row)
            out: torch.Tensor = piece[:, first:last].t().reshape(-1)[start - first * row : stop - first * row]
        elif not stored.shape:  # a scalar
            out = f.get_tensor(name).reshape(-1)[start:stop]
        elif len(stored.shape) == 1:
            out = piece[start:stop]
        else:
            row = 1
            for n in stored.shape[1:]:
                row *= n
            first, last = start // row, -(-stop // row)
            out = piece[first:last].reshape(-1)[start - first * row : stop - first * row]
    return out


def read_whole(stored: StoredTensor, name: str) -> torch.Tensor:
    with _opened(stored.file) as f:
        out: torch.Tensor = f.get_tensor(name)
    return out


@attrs.frozen
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * self.dtype.itemsize


def plan_files(tensors: Sequence[Planned], max_file_bytes: int) -> list[list[Planned]]:
    """Tensors split, in order, into files of at most ``max_file_bytes``
    (a tensor larger than that gets a file of its own)."""
    files: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return [f for f in files if f]


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(root: Path, files: list[list[Planned]]) -> None:
    """The index Hugging Face reads for a model in several files."""
    names = file_names(len(files))
    weight_map = {t.name: name for name, group in zip(names, files) for t in group}
    total = sum(t.nbytes for group in files for t in group)
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


class StreamingWriter:
    """Writes one safetensors file whose tensors arrive one at a time, in the
    planned order (see the module docstring)."""

    def __init__(self, path: Path, planned: Sequence[Planned]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in planned:
            header[t.name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._expected: Iterator[Planned] = iter(planned)
        self._file: IO[bytes] = open(path, "wb")
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = next(self._expected, None)
        if want is None or want.name != name or tuple(tensor.shape) != want.shape or tensor.dtype != want.dtype:
            raise ValueError(f"{name} {tuple(tensor.shape)} {tensor.dtype} is not the next planned tensor ({want})")
        # safetensors is little-endian and C-ordered, as torch is on every platform it runs on here
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        data.tofile(self._file)

    def close(self) -> None:
        if next(self._expected, None) is not None:
            self._file.close()
            raise ValueError("the file was closed before every planned tensor was written")
        self._file.close()
