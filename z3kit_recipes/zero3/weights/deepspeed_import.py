"""A DeepSpeed ZeRO-3 checkpoint into a z3kit engine, at any world size.

``load_deepspeed_checkpoint`` reads what ``deepspeed_engine.save_checkpoint(dir)``
writes at stage 3 and puts the full-precision parameters into the engine's
shards (and fp32 masters), the optimizer's per-element state (Adam's
``exp_avg`` / ``exp_avg_sq``) and scalar state (``step``) into the engine's
optimizer, the persistent buffers into the model, and the step counter into
the engine. Each rank reads only the slices its own shards need, through
memory-mapped files: nothing is ever whole on one rank. DeepSpeed need not
be installed. What the files hold, and how they are read without DeepSpeed,
is ``z3kit_recipes.zero3.weights.deepspeed_files`` (whose names this module
re-exports).

Note: what each rank reads.
    (``W`` is DeepSpeed's world size and ``S`` its partition of a parameter,
    as in ``deepspeed_files``' Note on what DeepSpeed writes.)
    z3kit rank ``q`` of ``M`` holds flat elements ``[q * s, (q + 1) * s)``
    of each parameter, ``s = max(1, ceil(numel / M))``. Those elements lie in
    DeepSpeed ranks ``q * s // S`` to ``((q + 1) * s - 1) // S``: a rank
    opens only those ranks' files (at ``M == W``, its own), each through
    ``torch.load(mmap=True)``, so that only the pages of its slices are
    read, and copies its slice piece by piece into the shard, the master and
    zero-padded optimizer-state tensors. Rank 0's model-states file gives
    every rank the parameter list, the buffers and the step counter.

Note: nothing changes on a failure.
    Every rank first matches the checkpoint to the model (missing,
    unexpected and mis-shaped parameters and buffers, and any parameter
    that is trainable on one side and frozen on the other, all named), opens
    the files its slices need and checks their layout; the ranks then agree
    (one small collective) that all of them succeeded before any rank
    writes. A mismatch raises the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from z3kit.collectives import failed_ranks
from z3kit_recipes.zero3.runtime.core import EngineCore
from z3kit_recipes.zero3.weights.deepspeed_files import (
    DeepSpeedCheckpoint,
    DsParam,
    Foreign,
    RankFiles,
    read_deepspeed_checkpoint,
)
from z3kit_recipes.zero3.weights.pretrained import names_by_param, persistent_buffers

__all__ = [
    "HYPERPARAMETERS",
    "DeepSpeedCheckpoint",
    "DsParam",
    "Foreign",
    "RankFiles",
    "load_deepspeed_checkpoint",
    "read_deepspeed_checkpoint",
]

#: the optimizer hyperparameters ``load_optimizer_hyperparameters`` copies
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


# --------------------------------------------------------------------------- #
# Planning: match, open, check
# --------------------------------------------------------------------------- #


@attrs.frozen
class _Load:
    """One engine parameter and where it comes from."""

    pid: int
    ds: DsParam
    #: per DeepSpeed rank, the piece ``[lo, hi)`` of the parameter's flat elements it supplies
    pieces: list[tuple[int, int, int]]
    #: the DeepSpeed rank whose scalar optimizer state (``step``) this parameter takes
    scalar_rank: int


def _listed(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"{kind} ({len(names)}): {shown}"


def _match(engine: EngineCore, ckpt: DeepSpeedCheckpoint) -> list[tuple[int, DsParam]]:
    """Each engine parameter's DeepSpeed entry; every difference, by name, in one ValueError."""
    aliases = names_by_param(engine.module)
    trainable = set(engine.trainable)
    chosen: list[tuple[int, DsParam]] = []
    missing: list[str] = []
    misshaped: list[str] = []
    trainability: list[str] = []
    used: set[str] = set()
    for pid, shard in enumerate(engine.shards):
        names = aliases[id(shard.param)]
        found = [ckpt.params[n] for n in names if n in ckpt.params]
        if not found:
            missing.append(names[0])
            continue
        p = found[0]
        used.add(p.name)
        if p.shape != shard.shape:
            misshaped.append(f"{p.name} {list(p.shape)} (the model's is {list(shard.shape)})")
        elif shard.numel > 0 and (p.group is not None) != (pid in trainable):
            side = "trainable in the checkpoint, frozen" if p.group is not None else "frozen in the checkpoint, trainable"
            trainability.append(f"{p.name} ({side} in the model)")
        else:
            chosen.append((pid, p))
    buffers = persistent_buffers(engine.module)
    missing += [n for n in buffers if n not in ckpt.buffers]
    misshaped += [f"{n} {list(ckpt.buffers[n].shape)} (the model's is {list(b.shape)})"
                  for n, b in buffers.items() if n in ckpt.buffers and ckpt.buffers[n].shape != b.shape]
    unexpected = sorted(n for n in ckpt.params if n not in used) + sorted(n for n in ckpt.buffers if n not in buffers)
    problems = [_listed(kind, names) for kind, names in (
        ("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped),
        ("trainable on one side only", trainability)) if names]
    if problems:
        raise ValueError(f"DeepSpeed checkpoint {ckpt.folder} does not match the model, nothing was loaded: "
                         + "; ".join(problems))
    return chosen


def _plan(engine: EngineCore, ckpt: DeepSpeedCheckpoint, files: RankFiles) -> list[_Load]:
    """What this rank reads for each parameter; opens and checks those files."""
    loads = []
    for pid, p in _match(engine, ckpt):
        start, stop = engine.layout.local_range(pid)
        size = max(1, ckpt.partition(p))
        pieces = [(r, max(start, r * size), min(stop, (r + 1) * size))
                  for r in range(start // size, (stop - 1) // size + 1)] if stop > start else []
        load = _Load(pid, p, pieces, min(start // size, ckpt.world - 1))
        for r in {r for r, _, _ in pieces} | ({load.scalar_rank} if p.group is not None else set()):
            if p.group is None:
                if files.fragment(r, p.name).numel() < min(size, p.numel - r * size):
                    raise ValueError(f"{ckpt.model_file(r)}: the fragment of frozen parameter {p.name!r} has "
                                     f"{files.fragment(r, p.name).numel()} elements, not {size}")
            else:
                files.optim(r)
        loads.append(load)
    return loads


def _hyperparameters(engine: EngineCore, ckpt: DeepSpeedCheckpoint, files: RankFiles,
                     loads: list[_Load]) -> list[dict[str, Any]]:
    """For each of the engine optimizer's param groups, DeepSpeed's
    hyperparameters of its parameters (they must agree within the group)."""
    group_of_flat: dict[int, int] = {}
    source: dict[int, _Load] = {ld.pid: ld for ld in loads if ld.ds.group is not None}
    master_pid = {id(m): pid for pid, m in engine.layout.master_of().items()}
    out = []
    for group in [] if engine.optimizer is None else engine.optimizer.param_groups:
        found: dict[str, dict[str, Any]] = {}
        for master in group["params"]:
            ld = source.get(master_pid.get(id(master), -1))
            if ld is None or ld.ds.group is None:
                continue
            inner = files.optim(ld.scalar_rank)["optimizer_state_dict"]
            if not group_of_flat:
                group_of_flat = {k: g for g, pg in enumerate(inner["param_groups"]) for k in pg["params"]}
            ds_group = inner["param_groups"][group_of_flat[ld.ds.group]]
            found[ld.ds.name] = {k: ds_group[k] for k in HYPERPARAMETERS if k in ds_group and k in group}
        values = list(found.values())
        if any(v != values[0] for v in values[1:]):
            differ = [n for n, v in found.items() if v != values[0]]
            raise ValueError(f"load_optimizer_hyperparameters: one param group of the engine's optimizer holds "
                             f"parameters from DeepSpeed groups with other hyperparameters ({differ[:4]} differ "
                             f"from {next(iter(found))}); group them as DeepSpeed did, or keep the engine's")
        out.append(values[0] if values else {})
    return out


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def _slice(flat_of_rank: Callable[[int], torch.Tensor], ld: _Load, ckpt: DeepSpeedCheckpoint) -> torch.Tensor:
    """This rank's slice of ``ld``'s parameter, piece by piece from each
    DeepSpeed rank's flat tensor ``flat_of_rank(r)`` (a flat group, the
    same-shaped optimizer state, or a frozen parameter's fragment)."""
    size = max(1, ckpt.partition(ld.ds))
    parts = []
    for r, lo, hi in ld.pieces:
        base = ld.ds.offset - r * size
        parts.append(flat_of_rank(r)[base + lo : base + hi])
    return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.empty(0)


def _step_like_torch(value: torch.Tensor, group: Mapping[str, Any], master: torch.Tensor) -> torch.Tensor:
    """A scalar ``step`` as torch's optimizers keep it: float32 on the
    parameter's device when fused or capturable, else a CPU scalar of the
    default scalar dtype; always its own tensor (they count it in place)."""
    if group.get("capturable") or group.get("fused"):
        return value.detach().to(device=master.device, dtype=torch.float32, copy=True)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return value.detach().to(device="cpu", dtype=dtype, copy=True)


def _optimizer_state(ld: _Load, ckpt: DeepSpeedCheckpoint, files: RankFiles, master: torch.Tensor,
                     group: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer state of ``master`` from its flat group's: per-element
    tensors sliced and zero-padded, ``step`` and other scalars copied."""
    k = ld.ds.group
    if k is None:
        return {}
    scalar_state = files.optim(ld.scalar_rank)["optimizer_state_dict"]["state"].get(k, {})
    out: dict[str, Any] = {}
    for key, value in scalar_state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            padded = torch.zeros(master.numel(), dtype=master.dtype, device=master.device)
            local = _slice(_state_source(files, k, key), ld, ckpt)
            padded[: local.numel()].copy_(local)
            out[key] = padded
        elif isinstance(value, torch.Tensor) and key == "step":
            out[key] = _step_like_torch(value, group, master)
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to(device=master.device, dtype=master.dtype if value.is_floating_point()
                                         else value.dtype, copy=True)
        else:
            out[key] = value
    return out


def _state_source(files: RankFiles, k: int, key: str) -> Callable[[int], torch.Tensor]:
    return lambda r: files.optim(r)["optimizer_state_dict"]["state"][k][key]


def _values_source(files: RankFiles, ds: DsParam) -> Callable[[int], torch.Tensor]:
    """Each DeepSpeed rank's flat tensor that holds ``ds``'s partition."""
    k = ds.group
    if k is None:
        return lambda r: files.fragment(r, ds.name)
    return lambda r: files.optim(r)["fp32_flat_groups"][k]


def load_deepspeed_checkpoint(
    engine: EngineCore,
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    load_optimizer_hyperparameters: bool = False,
) -> dict[str, Any]:
    """Load the DeepSpeed ZeRO-3 checkpoint under ``path`` into ``engine``
    (collective; see the module docstring); returns the checkpoint's client state."""
    engine.check_idle("load_deepspeed_checkpoint")
    error: BaseException | None = None
    try:
        ckpt = read_deepspeed_checkpoint(path, tag)
        files = RankFiles(ckpt)
        loads = _plan(engine, ckpt, files)
        hyper = _hyperparameters(engine, ckpt, files, loads) if load_optimizer_hyperparameters else []
    except Exception as e:  # noqa: BLE001 - the ranks agree first; then each raises
        error = e
    failed = failed_ranks(error is None, engine.group, engine.device)
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"reading DeepSpeed checkpoint {path} failed on rank(s) {failed}; see their error. "
                         "Nothing was loaded")

    # everything matched and every file this rank needs is open: write
    masters = engine.layout.master_of()
    groups = [] if engine.optimizer is None else engine.optimizer.param_groups
    group_of = {id(p): g for g in groups for p in g["params"]}
    with torch.no_grad():
        for ld in loads:
            engine.layout.fill_local(ld.pid, _slice(_values_source(files, ld.ds), ld, ckpt))
            master = masters.get(ld.pid)
            if master is None or id(master) not in group_of:
                continue
            state = _optimizer_state(ld, ckpt, files, master.detach(), group_of[id(master)])
            optimizer = engine.require_optimizer("load_deepspeed_checkpoint")
            if state:
                optimizer.state[master] = state
            else:  # saved before DeepSpeed's first step, or an empty parameter
                optimizer.state.pop(master, None)
        for name, buffer in persistent_buffers(engine.module).items():
            buffer.copy_(ckpt.buffers[name])
    for group, values in zip(groups, hyper):
        group.update(values)
    if engine.reducer is not None:  # gradients accumulated before the load belong to other weights
        engine.reducer.end_window()
    gas = engine.zero3_config.gradient_accumulation_steps
    engine.restore_progress(ckpt.global_steps, ckpt.global_steps * gas, window_open=False)
    engine.shards_changed()
    return ckpt.client_state
