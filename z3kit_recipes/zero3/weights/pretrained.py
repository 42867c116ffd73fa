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
result. Its ``config.json`` (the model's Hugging Face config, or the
layout's) records the dtype written (``hf_config``).

Both take an ``ExportLayout`` (``export_layout``) for a model that is exact
in a Hugging Face architecture under other names (the recipes' GPT as
GPT-2): the files then hold the layout's names, transposed where it says.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from z3kit.sharded_param import parameter_of
from z3kit.validate import check_int
from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.commit import EXPORT_KIND, commit, staged
from z3kit_recipes.zero3.weights.export_layout import ExportLayout
from z3kit_recipes.zero3.weights.hf_config import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    record_dtype,
    rewrite_dtype,
    saved_dtype,
    write_json,
)
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
    """Every name of each parameter (tied ones have several), by the ``id`` of
    the engine's parameter (``ParamShard.param``), whichever form modules hold now."""
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(parameter_of(p)), []).append(name)
    return out


def state_dict_names(module: nn.Module, buffers: Iterable[str]) -> list[str]:
    """The names ``module.state_dict()`` lists, in its order: each module's
    parameters, then its persistent buffers (``buffers``), then its
    children's, under every path to a module registered under several names
    and every name of a tied tensor."""
    persistent = set(buffers)
    out: list[str] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        out += [dot + n for n, _ in sub.named_parameters(recurse=False, remove_duplicate=False)]
        out += [dot + n for n, _ in sub.named_buffers(recurse=False, remove_duplicate=False) if dot + n in persistent]
    return out


def declared_tied(module: nn.Module) -> list[str]:
    """The patterns of the names a Hugging Face model declares tied
    (``_tied_weights_keys`` of it and its submodules, a dict of target to
    source or a list, prefixed with the submodule's name)."""
    out: list[str] = []
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None) or ()
        out += [f"{prefix}.{key}" if prefix else str(key) for key in declared]
    return out


def names_written(names: Sequence[str], tied: Sequence[str]) -> list[str]:
    """The names of one tensor that ``save_pretrained`` writes: every one,
    less those Hugging Face drops as declared tied (transformers'
    ``save_pretrained``: in sorted order, each name matching a pattern of
    ``tied`` is dropped while another name is left)."""
    dropped: set[str] = set()
    for name in sorted(names):
        if len(dropped) + 1 < len(names) and any(re.search(pattern, name) for pattern in tied):
            dropped.add(name)
    return [n for n in names if n not in dropped]


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that ``state_dict`` holds (persistent ones), by name."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    buffers = dict(module.named_buffers(remove_duplicate=False))
    return {name: buffers[name] for name in module.state_dict(keep_vars=True) if name not in params and name in buffers}


def _listed(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"{kind} ({len(names)}): {shown}"


def load_pretrained(engine: EngineCore, path: str | os.PathLike[str], *, layout: ExportLayout | None = None) -> None:
    """Load a Hugging Face checkpoint into the engine's shards (see the module docstring)."""
    engine.check_idle("load_pretrained")
    if not Path(path).exists():
        raise FileNotFoundError(f"load_pretrained: {path} does not exist (no such folder or file); pass the folder "
                                "that save_pretrained or from_pretrained's save wrote")
    if manifest_kind(Path(path)) == CHECKPOINT_KIND:
        raise ValueError(f"{path} is a z3kit training checkpoint (save_checkpoint), not Hugging Face weights: "
                         "load it with engine.load_checkpoint, or convert it with python -m z3kit_recipes.convert")
    stored = index_of(path)
    aliases = names_by_param(engine.module)
    buffers = persistent_buffers(engine.module)
    if layout is not None:
        layout.check_covers([*(n for names in aliases.values() for n in names), *buffers], f"load_pretrained({path})")
    as_stored = (lambda n: n) if layout is None else layout.stored
    chosen: list[tuple[int, str]] = []
    missing: list[str] = []
    misshaped: list[str] = []
    known: set[str] = {as_stored(n) for n in buffers}
    for pid, shard in enumerate(engine.shards):
        names = aliases[id(shard.param)]
        known.update(as_stored(n) for n in names)
        found = [n for n in names if as_stored(n) in stored]
        if not found:
            missing.append(as_stored(names[0]))
            continue
        key, want = as_stored(found[0]), _stored_shape(tuple(shard.shape), layout, found[0])
        if stored[key].shape != want:
            misshaped.append(f"{key} {list(stored[key].shape)} (the model's is {list(want)})")
        else:
            chosen.append((pid, found[0]))
    missing += [as_stored(n) for n in buffers if as_stored(n) not in stored]
    misshaped += [
        f"{as_stored(n)} {list(stored[as_stored(n)].shape)} (the model's is {list(b.shape)})"
        for n, b in buffers.items()
        if as_stored(n) in stored and stored[as_stored(n)].shape != _stored_shape(tuple(b.shape), layout, n)
    ]
    unexpected = sorted(n for n in stored if n not in known)
    problems = [_listed(kind, names) for kind, names in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if names]
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model, nothing was loaded: " + "; ".join(problems))
    flipped = frozenset() if layout is None else layout.transposed
    for pid, name in chosen:
        start, stop = engine.layout.local_range(pid)
        key = as_stored(name)
        engine.layout.fill_local(
            pid, read_flat_range(stored[key], key, start, stop, transposed=name in flipped) if stop > start else torch.empty(0)
        )
    with torch.no_grad():
        for name, buffer in buffers.items():
            whole = read_whole(stored[as_stored(name)], as_stored(name))
            buffer.copy_(whole.t() if name in flipped else whole)
    engine.shards_changed()


def _stored_shape(shape: tuple[int, ...], layout: ExportLayout | None, name: str) -> tuple[int, ...]:
    """The shape a tensor of the model's ``shape`` has in the files."""
    return shape[::-1] if layout is not None and name in layout.transposed else shape


def save_pretrained(
    engine: EngineCore,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    layout: ExportLayout | None = None,
) -> None:
    """Write the full parameters in the Hugging Face layout (collective; see the module docstring).

    Trainable parameters come from the fp32 masters, frozen ones in the
    compute dtype; ``dtype`` converts every floating-point tensor.
    ``layout``: the names, transposes and config of another architecture."""
    engine.check_idle("save_pretrained")
    engine.watch.check("save_pretrained")
    check_int("max_shard_bytes", max_shard_bytes, at_least=1)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"save_pretrained: dtype must be a floating-point torch.dtype (torch.bfloat16), got {dtype!r}")
    group, rank = engine.topology.shard_group, engine.rank  # the gathers are the shard group's
    names = names_by_param(engine.module)
    buffers = persistent_buffers(engine.module)
    # every name a plain model's state_dict lists, less those Hugging Face drops as declared tied; with a
    # layout, the other architecture's names: one per parameter (it knows its own tied names)
    tied = declared_tied(engine.module)
    sources: dict[str, int | torch.Tensor] = {
        name: pid for pid, s in enumerate(engine.shards)
        for name in (names_written(names[id(s.param)], tied) if layout is None else names[id(s.param)][:1])
    }
    sources.update(buffers)
    if layout is None:  # in the order of the model's state_dict
        sources = {name: sources[name] for name in state_dict_names(engine.module, buffers) if name in sources}
    if layout is not None:
        layout.check_covers(sources, f"save_pretrained({path})")
    planned = []
    model_name: dict[str, str] = {}  # stored name -> the model's
    for name, source in sources.items():
        key = name if layout is None else layout.stored(name)
        model_name[key] = name
        if isinstance(source, int):
            shard = engine.shards[source]
            own = torch.float32 if source in engine.layout.master_of() else shard.shard.dtype
            planned.append(Planned(key, _stored_shape(tuple(shard.shape), layout, name), _converted(own, dtype)))
        else:
            planned.append(Planned(key, _stored_shape(tuple(source.shape), layout, name), _converted(source.dtype, dtype)))
    flipped = frozenset() if layout is None else layout.transposed
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
                own_name = model_name[t.name]
                source = sources[own_name]
                if isinstance(source, int):
                    pid = source
                    full = together.call(lambda: engine.layout.gather_full(pid, group, engine.log)).view(
                        _stored_shape(t.shape, layout, own_name))  # the model's shape (a transpose's is symmetric)
                else:
                    full = source.detach()
                if own_name in flipped:
                    full = full.t()
                together.agreed(f"save_pretrained: writing {t.name} into {target}",
                                lambda: writer.write(t.name, full.to(t.dtype)) if writer is not None else None)
                del full
            together.agreed(f"save_pretrained: finishing {target}", lambda: writer.close() if writer is not None else None)
        together.agreed("save_pretrained: writing the index and config",
                        lambda: _write_extras(engine, staging.path, files, layout) if rank == 0 else None)
        commit(staging, {"world": engine.world}, together)


def _write_extras(engine: EngineCore, staging: Path, files: list[list[Planned]], layout: ExportLayout | None) -> None:
    """The index of a model in several files, and the config (the layout's,
    or the model's when it has a Hugging Face one), with the dtype written;
    the layout's other files."""
    if len(files) > 1:
        write_index(staging, files)
    dtype = saved_dtype([t for group in files for t in group])
    if layout is not None:
        for name, text in layout.files.items():
            (staging / name).write_text(text, encoding="utf-8")
        write_json(staging / CONFIG_FILE, record_dtype(layout.config, dtype))
        if layout.generation_config is not None:
            write_json(staging / GENERATION_CONFIG_FILE, layout.generation_config)
        return
    config = getattr(engine.module, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(staging)  # type: ignore[union-attr]
        rewrite_dtype(staging / CONFIG_FILE, dtype)


def _converted(own: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and own.is_floating_point else own
