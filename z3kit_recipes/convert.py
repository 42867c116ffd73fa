"""Convert a z3kit checkpoint to the Hugging Face layout, offline.

    python -m z3kit_recipes.convert CHECKPOINT OUT [--max-shard-size 5GB] [--dtype fp32|bf16|fp16]

One process, no process group, no accelerator. Each parameter is read
whole from the checkpoint's per-rank files (``torch.distributed.checkpoint``
assembles it from whatever slices the saving ranks wrote, at any world
size), written to the current safetensors file and dropped before the next
one is read, so the peak is one parameter. The files are checked against
the checkpoint's manifest first. When the checkpoint came from a Hugging
Face model, its config (kept in the manifest) is written as
``config.json``, and ``from_pretrained`` loads the result.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from z3kit_recipes.zero3.weights.commit import CHECKPOINT_KIND, EXPORT_KIND, commit, read_manifest, staged, verify
from z3kit_recipes.zero3.weights.pretrained import DEFAULT_MAX_SHARD_BYTES
from z3kit_recipes.zero3.weights.safetensors_io import Planned, StreamingWriter, file_names, plan_files, write_index
from z3kit_recipes.zero3.weights.together import Together

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes of ``5GB``, ``500MB``, ``2GiB`` or a plain number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    size = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if size < 1:
        raise argparse.ArgumentTypeError(f"the size must be at least one byte, got {text!r}")
    return size


def _read(reader_path: str, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    # parameters were saved flattened (one dim-0 shard per rank); buffers whole
    target = torch.empty(numel if key.startswith("params.") else tuple(shape), dtype=dtype)
    with warnings.catch_warnings():  # one process on purpose: DCP's notice that there is no group is noise here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp_load({key: target}, storage_reader=FileSystemReader(reader_path), no_dist=True)
    return target.view(tuple(shape))


def convert(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            dtype: torch.dtype | None = None) -> Path:
    """Write ``checkpoint``'s parameters (and persistent buffers) to ``out`` in
    the Hugging Face layout; returns ``out``."""
    root, final = Path(checkpoint), Path(out)
    manifest = read_manifest(root, CHECKPOINT_KIND)
    verify(root, manifest, Together(None))
    stored = FileSystemReader(str(root)).read_metadata().state_dict_metadata
    entries: list[tuple[str, str, tuple[int, ...], torch.dtype]] = []  # (name, key, shape, saved dtype)
    for p in manifest["params"]:
        entries.append((p["name"], f"params.{p['name']}", tuple(p["shape"]), getattr(torch, p["dtype"])))
    for key, meta in stored.items():
        if key.startswith("buffers."):
            entries.append((key.removeprefix("buffers."), key, tuple(meta.size), meta.properties.dtype))  # type: ignore[union-attr]

    def target_dtype(saved: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and saved.is_floating_point else saved

    planned = [Planned(name, shape, target_dtype(saved)) for name, _, shape, saved in entries]
    files = plan_files(planned, max_shard_bytes)
    by_name = {name: (key, shape, saved) for name, key, shape, saved in entries}
    with staged(final, EXPORT_KIND, "convert", Together(None)) as staging:
        for file_name, group in zip(file_names(len(files)), files):
            writer = StreamingWriter(staging.path / file_name, group)
            for t in group:
                key, shape, saved = by_name[t.name]
                writer.write(t.name, _read(str(root), key, shape, saved).to(t.dtype))
            writer.close()
        if len(files) > 1:
            write_index(staging.path, files)
        hf_config: dict[str, Any] | None = manifest.get("hf_config")
        if hf_config is not None:
            (staging.path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True, default=str))
        commit(staging, {"from": str(root)}, Together(None))
    return final


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m z3kit_recipes.convert",
                                description="z3kit checkpoint -> Hugging Face safetensors layout, on one process.")
    p.add_argument("checkpoint", help="a folder written by engine.save_checkpoint")
    p.add_argument("out", help="the folder to write (new, empty, or an earlier export, which it replaces)")
    p.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                   help="largest safetensors file (default 5GB, Hugging Face's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="convert floating-point tensors (default: as saved; trainable parameters are fp32)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = convert(args.checkpoint, args.out, max_shard_bytes=args.max_shard_size,
                      dtype=None if args.dtype is None else DTYPES[args.dtype])
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
