"""Hugging Face weights in and out of shards, never whole on a rank.

``load_pretrained`` reads a checkpoint directory (``model.safetensors``, or
``model-0000x-of-0000y.safetensors`` with their index, as
``save_pretrained`` writes them) straight into the shards: each rank reads
only the rows that hold its slice of each tensor, one tensor at a time.
Names are the model's ``state_dict`` names; a tied weight is found under
any of its names and loaded once. Missing, unexpected and mis-shaped
tensors are all reported, by name, before anything changes.

``save_pretrained`` writes the full parameters (and persistent buffers) in
that layout, gathered one parameter at a time and written by rank 0 as they
arrive (see ``safetensors_io``), into files of at most ``max_shard_bytes``,
committed like a checkpoint (``commit``), with a manifest of kind
``hugging-face weights``, which lets a later export replace it (and
nothing else: ``target``): ``transformers``' ``from_pretrained`` loads the
result.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from z3kit.validate import check_int
from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.commit import EXPORT_KIND, commit, staged
from z3kit_recipes.zero3.weights.safetensors_io import (
    Planned,
    StreamingWriter,
    file_names,
    index_of,
    plan_files,
    read_flat_range,
    read_whole,
    write_index,
)
from z3kit_recipes.zero3.weights.target import CHECKPOINT_KIND, manifest_kind
from z3kit_recipes.zero3.weights.together import Together

#: Hugging Face's default largest file
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def names_by_param(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (tied ones have several), by ``id``."""
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that ``state_dict`` holds (persistent ones), by name."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    buffers = dict(module.named_buffers(remove_duplicate=False))
    return {name: buffers[name] for name in module.state_dict(keep_vars=True) if name not in params and name in buffers}


def _listed(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"{kind} ({len(names)}): {shown}"


def load_pretrained(engine: EngineCore, path: str | os.PathLike[str]) -> None:
    """Load a Hugging Face checkpoint into the engine's shards (see the module docstring)."""
    engine.check_idle("load_pretrained")
    if manifest_kind(Path(path)) == CHECKPOINT_KIND:
        raise ValueError(f"{path} is a z3kit training checkpoint (save_checkpoint), not Hugging Face weights: "
                         "load it with engine.load_checkpoint, or convert it with python -m z3kit_recipes.convert")
    stored = index_of(path)
    aliases = names_by_param(engine.module)
    buffers = persistent_buffers(engine.module)
    chosen: list[tuple[int, str]] = []
    missing: list[str] = []
    misshaped: list[str] = []
    known: set[str] = set(buffers)
    for pid, shard in enumerate(engine.shards):
        names = aliases[id(shard.param)]
        known.update(names)
        found = [n for n in names if n in stored]
        if not found:
            missing.append(names[0])
        elif stored[found[0]].shape != tuple(shard.shape):
            misshaped.append(f"{found[0]} {list(stored[found[0]].shape)} (the model's is {list(shard.shape)})")
        else:
            chosen.append((pid, found[0]))
    missing += [n for n in buffers if n not in stored]
    misshaped += [
        f"{n} {list(stored[n].shape)} (the model's is {list(b.shape)})"
        for n, b in buffers.items()
        if n in stored and stored[n].shape != tuple(b.shape)
    ]
    unexpected = sorted(n for n in stored if n not in known)
    problems = [_listed(kind, names) for kind, names in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if names]
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model, nothing was loaded: " + "; ".join(problems))
    for pid, name in chosen:
        start, stop = engine.layout.local_range(pid)
        engine.layout.fill_local(pid, read_flat_range(stored[name], name, start, stop) if stop > start else torch.empty(0))
    with torch.no_grad():
        for name, buffer in buffers.items():
            buffer.copy_(read_whole(stored[name], name))
    engine.shards_changed()


def save_pretrained(
    engine: EngineCore,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> None:
    """Write the full parameters in the Hugging Face layout (collective; see the module docstring).

    Trainable parameters come from the fp32 masters, frozen ones in the
    compute dtype; ``dtype`` converts every floating-point tensor."""
    engine.check_idle("save_pretrained")
    engine.watch.check("save_pretrained")
    check_int("max_shard_bytes", max_shard_bytes, at_least=1)
    group, rank = engine.group, engine.rank
    names = names_by_param(engine.module)
    buffers = persistent_buffers(engine.module)
    sources: dict[str, int | torch.Tensor] = {names[id(s.param)][0]: pid for pid, s in enumerate(engine.shards)}
    sources.update(buffers)
    planned = []
    for name, source in sources.items():
        if isinstance(source, int):
            shard = engine.shards[source]
            own = torch.float32 if source in engine.layout.master_of() else shard.shard.dtype
            planned.append(Planned(name, tuple(shard.shape), _converted(own, dtype)))
        else:
            planned.append(Planned(name, tuple(source.shape), _converted(source.dtype, dtype)))
    files = plan_files(planned, max_shard_bytes)
    together = Together.of(engine)
    with staged(path, EXPORT_KIND, "save_pretrained", together) as staging:
        for file_name, group_of_file in zip(file_names(len(files)), files):
            target = staging.path / file_name
            # rank 0's file work is a step of every rank's (``together``): a disk that fills up on rank 0
            # stops every rank at once, where the others would otherwise wait in the next gather
            writer = together.agreed(f"save_pretrained: creating {target}",
                                     lambda: StreamingWriter(target, group_of_file) if rank == 0 else None)
            for t in group_of_file:
                source = sources[t.name]
                if isinstance(source, int):
                    pid = source
                    full = together.call(lambda: engine.layout.gather_full(pid, group, engine.log)).view(t.shape)
                else:
                    full = source.detach()
                together.agreed(f"save_pretrained: writing {t.name} into {target}",
                                lambda: writer.write(t.name, full.to(t.dtype)) if writer is not None else None)
                del full
            together.agreed(f"save_pretrained: finishing {target}", lambda: writer.close() if writer is not None else None)
        together.agreed("save_pretrained: writing the index and config",
                        lambda: _write_extras(engine, staging.path, files) if rank == 0 else None)
        commit(staging, {"world": engine.world}, together)


def _write_extras(engine: EngineCore, staging: Path, files: list[list[Planned]]) -> None:
    """The index of a model in several files, and the model's config when it has one."""
    if len(files) > 1:
        write_index(staging, files)
    config = getattr(engine.module, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(staging)  # type: ignore[union-attr]


def _converted(own: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and own.is_floating_point else own
