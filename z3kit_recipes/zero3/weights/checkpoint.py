"""Sharded checkpoints: save, resume exactly, reshard to another world size.

Everything goes through ``torch.distributed.checkpoint`` (DCP): each rank
writes and reads only its own part, collectively, and DCP reshards.

Note: a shard is a dim-0 shard of the flattened parameter.
    A rank's padded slice ``[r * s, (r + 1) * s)`` of a parameter of
    ``numel`` elements (``s = ceil(numel / N)``), cut at ``numel``, is exactly
    the ``Shard(0)`` chunk that a ``DTensor`` of shape ``(numel,)`` over N
    ranks gives rank ``r``. Each parameter (its fp32 master, or its shard when
    it is frozen), each optimizer-state tensor shaped like it, and an open
    window's gradient partitions are saved as such DTensors, over views of
    the engine's own buffers: saving copies nothing, loading writes in place,
    and a checkpoint saved at N ranks loads at M with DCP reading whatever
    slices each rank's new shards need. The padding past ``numel`` is never
    saved and always zero after a load.

Note: HSDP.
    Under HSDP (``zero3.ranks.topology``) the shards are over the shard
    group, and every replica holds the same ones: they are DTensors over the
    (replicate, shard) mesh with placements ``[Replicate(), Shard(0)]``, so
    DCP writes each slice once and reads, at load, whatever slices the new
    layout needs. A checkpoint saved flat loads under HSDP and back, at any
    world size; the manifest records the layout (``mesh``: replicas, shard
    group size) for the reader.

What else is saved: scalar optimizer state (Adam's ``step``), fp16's loss scale, and the
persistent buffers (rank 0's, replicated); the optimizer's hyperparameters
(``param_groups``, without the parameters); the user's ``client_state``;
each rank's random state (restored at the same world size only, whatever the layout); and, in
the manifest (``commit``), the step counters, the config, and the name,
shape and dtype of every parameter, checked before anything is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.commit import CHECKPOINT_KIND, commit, read_manifest, staged, verify
from z3kit_recipes.zero3.weights.flat_shards import flat_dtensor as _sharded
from z3kit_recipes.zero3.weights.flat_shards import flat_mesh as _mesh
from z3kit_recipes.zero3.weights.pretrained import persistent_buffers
from z3kit_recipes.zero3.weights.together import Together

FORMAT_VERSION = 1


@attrs.frozen
class _Entry:
    """One parameter as the checkpoint sees it."""

    pid: int
    name: str
    #: the tensor saved for it: the fp32 master when it has one, else its shard
    tensor: torch.Tensor
    master: torch.nn.Parameter | None


def _entries(engine: EngineCore) -> list[_Entry]:
    masters = engine.layout.master_of()
    out = []
    for pid, shard in enumerate(engine.shards):
        master = masters.get(pid)
        out.append(_Entry(pid, engine.param_names[pid], shard.shard if master is None else master, master))
    return out


def save_checkpoint(engine: EngineCore, path: str | os.PathLike[str], client_state: dict[str, Any] | None) -> None:
    """Write the engine's training state under ``path`` (collective; see the module docstring)."""
    engine.check_idle("save_checkpoint")
    engine.watch.check("save_checkpoint")
    engine.parts.backward.discard_cleared()  # not saved: gradients the user's code set to None
    engine.parts.backward.settle_checks()  # the open window's parameters marked used, as a step would
    if engine.reducer is not None:
        engine.reducer.flush_replicas()  # HSDP: the window's sums over every rank (zero3.training.replicas)
    mesh, layout = _mesh(engine), engine.layout
    state: dict[str, Any] = {}
    params_meta = []
    for e in _entries(engine):
        shard = engine.shards[e.pid]
        start, stop = layout.local_range(e.pid)
        state[f"params.{e.name}"] = _sharded(e.tensor, shard.numel, start, stop, mesh)
        params_meta.append({"name": e.name, "shape": list(shard.shape), "dtype": str(e.tensor.dtype).removeprefix("torch."),
                            "trainable": e.master is not None})
        if e.master is not None:
            for key, value in engine.require_optimizer("save_checkpoint").state.get(e.master, {}).items():
                sharded_like = isinstance(value, torch.Tensor) and value.shape == e.master.shape and value.dim() == 1
                state[f"optim.{e.name}.{key}"] = _sharded(value, shard.numel, start, stop, mesh) if sharded_like else value
    open_window: list[str] = []
    for pid, grad in ({} if engine.reducer is None else engine.reducer.window.grads()).items():
        start, stop = layout.local_range(pid)
        state[f"grads.{engine.param_names[pid]}"] = _sharded(grad, engine.shards[pid].numel, start, stop, mesh)
        open_window.append(engine.param_names[pid])
    for name, buffer in persistent_buffers(engine.module).items():
        state[f"buffers.{name}"] = buffer.detach()
    # one-tuples: DCP saves them whole (pickled), where it would split a dict or list into entries
    groups = [] if engine.optimizer is None else engine.optimizer.param_groups
    state["optim.param_groups"] = ([{k: v for k, v in g.items() if k != "params"} for g in groups],)
    state["client_state"] = (dict(client_state or {}),)
    if engine.lr_scheduler is not None:  # the DeepSpeed JSON's scheduler: where it is in its warmup and decay
        state["lr_scheduler"] = (engine.lr_scheduler.state_dict(),)
    state[f"rng.rank{engine.rank}"] = (_random_state(engine.device),)
    if engine.parts.loss_scaler is not None:  # fp16: the same on every rank
        state["loss_scale"] = (engine.parts.loss_scaler.state_dict(),)
    global_step, micro_step = engine.progress()
    metadata = {
        "version": FORMAT_VERSION,
        "world": engine.world,
        "mesh": engine.topology.shape,  # [replicas, shard group size]; [1, world] when flat
        "global_step": global_step,
        "micro_step": micro_step,
        "open_window": open_window,
        "config": attrs.asdict(engine.zero3_config),
        "params": params_meta,
        "hf_config": _hf_config(engine),
    }
    together = Together.of(engine)
    with staged(path, CHECKPOINT_KIND, "save_checkpoint", together) as staging:
        # one file per tensor: DCP keeps every tensor of a file alive until the file
        # is written (and reads a file whole), so files of one tensor bound the peak
        writer = FileSystemWriter(str(staging.path), single_file_per_rank=False)
        together.call(lambda: dcp_save(state, storage_writer=writer, process_group=engine.group))
        commit(staging, metadata, together)


def load_checkpoint(engine: EngineCore, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore what ``save_checkpoint`` wrote, at this engine's world size
    (collective); returns the saved ``client_state``."""
    engine.check_idle("load_checkpoint")
    # parameters unfrozen since the last forward get their masters now, so that a
    # checkpoint of a later fine-tuning stage loads into a freshly built engine
    engine.parts.trainable_watch.follow()
    root = Path(path)
    manifest = read_manifest(root, CHECKPOINT_KIND)
    _check_format(root, manifest)
    together = Together.of(engine)
    verify(root, manifest, together)
    entries = _entries(engine)
    _check_same_model(manifest, entries, engine)
    if manifest["open_window"] and manifest["config"]["gradient_accumulation_steps"] != engine.zero3_config.gradient_accumulation_steps:
        raise ValueError(
            "the checkpoint was saved in the middle of a gradient-accumulation window of "
            f"{manifest['config']['gradient_accumulation_steps']} micro-steps; this engine accumulates "
            f"{engine.zero3_config.gradient_accumulation_steps}: resume with the same gradient_accumulation_steps"
        )
    stored = FileSystemReader(str(root)).read_metadata().state_dict_metadata
    mesh, layout = _mesh(engine), engine.layout
    state: dict[str, Any] = {}
    optim_targets: dict[str, dict[str, torch.Tensor]] = {}
    for e in entries:
        shard = engine.shards[e.pid]
        start, stop = layout.local_range(e.pid)
        state[f"params.{e.name}"] = _sharded(e.tensor, shard.numel, start, stop, mesh)
        prefix = f"optim.{e.name}."
        held = engine.require_optimizer("load_checkpoint").state.get(e.master, {}) if e.master is not None else {}
        for key in (k for k in stored if k.startswith(prefix)):
            size = getattr(stored[key], "size", None)
            props = getattr(stored[key], "properties", None)
            if size is None or props is None:
                continue
            sharded = list(size) == [shard.numel]
            shape = (shard.shard_numel,) if sharded else tuple(size)
            target = held.get(key[len(prefix):])
            if not (isinstance(target, torch.Tensor) and tuple(target.shape) == shape and target.dtype == props.dtype):
                # nothing to read into in place (a fresh optimizer): new state, padding zero
                where = engine.device if e.master is None else e.master.device  # an offloaded master's state: the host
                target = torch.zeros(shape, dtype=props.dtype, device=where if sharded or shape else "cpu")
            elif sharded:
                target[stop - start :].zero_()
            state[key] = _sharded(target, shard.numel, start, stop, mesh) if sharded else target
            optim_targets.setdefault(e.name, {})[key[len(prefix):]] = target
    grads = {}
    for name in manifest["open_window"]:
        pid = engine.param_names.index(name)
        start, stop = layout.local_range(pid)
        grads[name] = torch.zeros(engine.shards[pid].shard_numel, dtype=torch.float32, device=engine.device)
        state[f"grads.{name}"] = _sharded(grads[name], engine.shards[pid].numel, start, stop, mesh)
    buffers = persistent_buffers(engine.module)
    for name, buffer in buffers.items():
        state[f"buffers.{name}"] = buffer.detach()
    state["optim.param_groups"] = (None,)
    state["client_state"] = (None,)
    if engine.lr_scheduler is not None and "lr_scheduler" in stored:
        state["lr_scheduler"] = (None,)
    scaler = engine.parts.loss_scaler
    if scaler is not None and "loss_scale" in stored:
        state["loss_scale"] = (None,)
    same_world = manifest["world"] == engine.world
    if same_world:
        state[f"rng.rank{engine.rank}"] = (None,)
    together.call(lambda: dcp_load(state, storage_reader=FileSystemReader(str(root)), process_group=engine.group))

    # everything read: put it in place
    for e in entries:
        if e.master is not None:
            shard = engine.shards[e.pid]
            if e.tensor is not shard.shard:  # separate fp32 master: the shard is its rounding, as after a step
                shard.shard.copy_(e.tensor.detach())
            engine.require_optimizer("load_checkpoint").state[e.master] = optim_targets.get(e.name, {})
    for group, saved in zip([] if engine.optimizer is None else engine.optimizer.param_groups,
                            state["optim.param_groups"][0]):
        group.update(saved)
    if engine.reducer is not None:
        engine.reducer.window.restore({engine.param_names.index(name): grad for name, grad in grads.items()})
    if scaler is not None and "loss_scale" in state:
        scaler.load_state_dict(state["loss_scale"][0])
    if same_world:
        _restore_random_state(state[f"rng.rank{engine.rank}"][0], engine.device)
    if engine.lr_scheduler is not None and "lr_scheduler" in state:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"][0])
    engine.restore_progress(manifest["global_step"], manifest["micro_step"], window_open=bool(manifest["open_window"]))
    engine.shards_changed()
    client: dict[str, Any] = state["client_state"][0]
    return client


def _check_format(root: Path, manifest: dict[str, Any]) -> None:
    """A manifest this version reads, with every field it reads (a clear error before anything changes)."""
    wanted = ("world", "global_step", "micro_step", "open_window", "config", "params")
    missing = [k for k in wanted if k not in manifest]
    if manifest.get("version") != FORMAT_VERSION or missing:
        raise ValueError(f"{root}: its manifest is of format version {manifest.get('version')!r}"
                         + (f" and lacks {', '.join(missing)}" if missing else "")
                         + f"; this z3kit reads version {FORMAT_VERSION}")


def _check_same_model(manifest: dict[str, Any], entries: list[_Entry], engine: EngineCore) -> None:
    """Name the first parameter where the checkpoint and the model differ."""
    saved = {p["name"]: p for p in manifest["params"]}
    for e in entries:
        p = saved.get(e.name)
        shape = list(engine.shards[e.pid].shape)
        if p is None:
            raise ValueError(f"the model's parameter {e.name!r} is not in checkpoint {manifest.get('kind')} (shape {shape})")
        if p["shape"] != shape:
            raise ValueError(f"parameter {e.name!r} has shape {p['shape']} in the checkpoint, {shape} in the model")
        if p["trainable"] != (e.master is not None):
            state = "trainable" if p["trainable"] else "frozen"
            fix = ("unfreeze it (requires_grad_(True)) before load_checkpoint" if p["trainable"]
                   else "freeze it (requires_grad_(False)) before zero3.initialize")
            raise ValueError(f"parameter {e.name!r} was {state} when the checkpoint was saved; it is not now: {fix}")
    extra = sorted(set(saved) - {e.name for e in entries})
    if extra:
        raise ValueError(f"checkpoint parameter {extra[0]!r} is not in the model ({len(extra)} such)")


def _random_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        state[device.type] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _restore_random_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type != "cpu" and device.type in state:
        torch.get_device_module(device.type).set_rng_state(state[device.type], device)


def _hf_config(engine: EngineCore) -> dict[str, Any] | None:
    """A Hugging Face model's config, so that an offline export can write config.json."""
    config = getattr(engine.module, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    out: dict[str, Any] = to_dict()
    return out if isinstance(out, dict) else None
