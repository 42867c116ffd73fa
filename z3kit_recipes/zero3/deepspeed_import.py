"""A DeepSpeed ZeRO-3 checkpoint into a z3kit engine, at any world size.

``load_deepspeed_checkpoint`` reads what ``deepspeed_engine.save_checkpoint(dir)``
writes at stage 3 and puts the full-precision parameters into the engine's
shards (and fp32 masters), the optimizer's per-element state (Adam's
``exp_avg`` / ``exp_avg_sq``) and scalar state (``step``) into the engine's
optimizer, the persistent buffers into the model, and the step counter into
the engine. Each rank reads only the slices its own shards need, through
memory-mapped files: nothing is ever whole on one rank. DeepSpeed need not
be installed (see the Note on unpickling).

Note: what DeepSpeed writes (0.19, stage 3).
    ``dir/latest`` names a tag folder. In it, for each data-parallel rank
    ``r`` of ``W``:

    - ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``: ``param_shapes``, a
      list with one ordered ``{name: shape}`` per flat group (DeepSpeed's
      sub-groups: a parameter group cut at ``sub_group_size`` elements);
      ``frozen_param_shapes`` and ``frozen_param_fragments`` (rank ``r``'s
      partition of each parameter the optimizer does not own: frozen ones,
      and trainable ones with no elements); ``shared_params`` (tied aliases,
      on rank 0 only); ``module`` (placeholders for the parameters, the real
      persistent buffers) with ``buffer_names``; ``global_steps``,
      ``dp_world_size``, ``mp_world_size``, ``ds_config``, ``ds_version``;
      and whatever ``client_state`` the user passed, at the top level.
    - ``{bf16_}zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (prefix ``bf16_``
      in bf16 runs; none in fp32 and fp16 runs): under
      ``optimizer_state_dict``: ``zero_stage`` (a DeepSpeed enum, 3),
      ``partition_count`` (``W``), ``fp32_flat_groups`` (one fp32 tensor per
      flat group) and ``optimizer_state_dict``, the torch optimizer's own
      state dict over those flat tensors: ``state[k]`` belongs to flat group
      ``k`` (its tensors shaped like the flat group, ``step`` a scalar) and
      ``param_groups`` lists each group's ``k`` with its hyperparameters.

    Flat group ``k`` of rank ``r`` is the concatenation, in
    ``param_shapes[k]`` order, of each parameter's rank-``r`` partition:
    ``S = ceil(numel / W)`` elements, flat elements ``[r * S, (r + 1) * S)``
    of the parameter, cut at ``numel``; the rest of the partition (on the
    last ranks) is padding, and DeepSpeed leaves it uninitialised in the
    parameter values (we have seen 3.6e34 there), zero in the optimizer
    state. A flat group may end with alignment padding past its parameters.

Note: what each rank reads.
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

Note: unpickling without DeepSpeed.
    The optimizer-state files pickle two DeepSpeed objects
    (``deepspeed.runtime.zero.config.ZeroStageEnum`` and a loss scaler from
    ``deepspeed.runtime.fp16.loss_scaler``); client state may hold classes
    of the training script. A class from ``deepspeed``, or one that cannot
    be imported here, is read as an opaque stand-in (``Foreign``) that keeps
    its constructor arguments and state: the zero stage is read from it, the
    rest is not used. DeepSpeed is never imported.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from z3kit.collectives import failed_ranks
from z3kit_recipes.zero3.pretrained import names_by_param, persistent_buffers

if TYPE_CHECKING:
    from z3kit_recipes.zero3.engine import Zero3Engine

#: the optimizer hyperparameters ``load_optimizer_hyperparameters`` copies
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")

#: top-level keys of a model-states file that DeepSpeed itself writes (0.19); the others are client state
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
})


# --------------------------------------------------------------------------- #
# Reading the files
# --------------------------------------------------------------------------- #


class Foreign:
    """A stand-in for a class the checkpoint pickled that is not imported
    here (see the Note on unpickling): its arguments and state, kept."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname} (not imported) args={self.args!r}>"


class _Unpickler(pickle.Unpickler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stand_ins: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module != "deepspeed" and not module.startswith("deepspeed."):
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                pass
        key = (module, name)
        if key not in self._stand_ins:
            self._stand_ins[key] = type(name, (Foreign,), {"qualname": f"{module}.{name}"})
        return self._stand_ins[key]


#: what ``torch.load`` takes as ``pickle_module``: ``pickle`` with the unpickler above
_PICKLE = types.ModuleType("z3kit_deepspeed_pickle")
_PICKLE.__dict__.update({"Unpickler": _Unpickler, "load": pickle.load, "loads": pickle.loads})


def _load(path: Path) -> dict[str, Any]:
    try:
        out = torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_PICKLE)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported by name
        raise ValueError(f"cannot read DeepSpeed checkpoint file {path}: {type(e).__name__}: {e}") from e
    if not isinstance(out, dict):
        raise ValueError(f"{path} holds a {type(out).__name__}, not a DeepSpeed checkpoint dict")
    return out


def _as_int(value: Any) -> int | None:
    if isinstance(value, Foreign) and len(value.args) == 1:
        value = value.args[0]
    return int(value) if isinstance(value, int) else None


@attrs.frozen
class DsParam:
    """Where a parameter's partitions lie in a DeepSpeed checkpoint."""

    name: str
    shape: torch.Size
    #: its flat group, or None for a parameter the optimizer does not own (frozen, or empty)
    group: int | None
    #: where its partition starts in each rank's flat group (0 for a frozen one: its own fragment)
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@attrs.frozen
class DeepSpeedCheckpoint:
    """A stage-3 checkpoint's layout, from rank 0's model-states file
    (``read_deepspeed_checkpoint``); no tensor data is read."""

    folder: Path
    tag: str
    #: DeepSpeed's data-parallel world size, ``W``
    world: int
    #: ``"bf16_"`` or ``""``: the optimizer-state files' prefix
    optim_prefix: str
    params: dict[str, DsParam]
    #: elements of each rank's flat group ``k`` that hold parameters
    group_numels: list[int]
    #: alias -> name of the tied parameter that holds the data
    shared: dict[str, str]
    buffers: dict[str, torch.Tensor]
    global_steps: int
    ds_version: str | None
    #: what ``save_checkpoint(client_state=...)`` added
    client_state: dict[str, Any]

    def model_file(self, rank: int) -> Path:
        return self.folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"

    def optim_file(self, rank: int) -> Path:
        return self.folder / f"{self.optim_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

    def partition(self, p: DsParam) -> int:
        """``S``: elements of each rank's partition of ``p``."""
        return math.ceil(p.numel / self.world)


def read_deepspeed_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedCheckpoint:
    """The layout of the ZeRO-3 checkpoint under ``path`` (tag from ``path/latest`` unless given)."""
    root = Path(path)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise ValueError(f"{root} has no 'latest' file naming a checkpoint tag: pass tag= explicitly")
        tag = latest.read_text().strip()
    folder = root / tag
    if not folder.is_dir():
        raise ValueError(f"DeepSpeed checkpoint folder {folder} does not exist")
    names = os.listdir(folder)
    if any(re.fullmatch(r".*_mp_rank_0*[1-9]\d*_.*\.pt", n) for n in names):
        raise ValueError(f"{folder} was saved with model (tensor or pipeline) parallelism; only data parallel is supported")
    optim_names = [n for n in names if re.fullmatch(r"(bf16_)?zero_pp_rank_\d+_mp_rank_00_optim_states\.pt", n)]
    prefixes = sorted({n[: n.index("zero_pp_rank_")] for n in optim_names})
    if not optim_names:
        raise ValueError(f"{folder} holds no ZeRO optimizer-state files (*zero_pp_rank_*_optim_states.pt); "
                         "is it a ZeRO-3 checkpoint saved with its optimizer?")
    if len(prefixes) > 1:
        raise ValueError(f"{folder} holds both bf16_ and plain optimizer-state files: a mix of two runs")
    first = _load(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    shapes = first.get("param_shapes")
    if not isinstance(shapes, list):
        raise ValueError(f"{folder} has no ZeRO param_shapes: not a ZeRO-3 checkpoint saved with its optimizer")
    if first.get("ds_zero_partition_groups") is not None:
        raise ValueError(f"{folder} partitions experts over sub-groups (AutoEP); use DeepSpeed's universal checkpoint")
    world = int(first.get("dp_world_size") or len(optim_names))
    if int(first.get("mp_world_size") or 1) != 1:
        raise ValueError(f"{folder} was saved with model parallelism (mp_world_size {first['mp_world_size']})")
    if len(optim_names) != world:
        raise ValueError(f"{folder} holds {len(optim_names)} optimizer-state files for a data-parallel world of "
                         f"{world}: a checkpoint not saved by every rank, or overwritten by another run")
    params: dict[str, DsParam] = {}
    group_numels = []
    for k, group in enumerate(shapes):
        offset = 0
        for name, shape in group.items():
            p = DsParam(name, torch.Size(shape), k, offset)
            params[name] = p
            offset += math.ceil(p.numel / world)
        group_numels.append(offset)
    for name, shape in (first.get("frozen_param_shapes") or {}).items():
        params[name] = DsParam(name, torch.Size(shape), None, 0)
    module = first.get("module") or {}
    buffers = {n: module[n] for n in first.get("buffer_names") or [] if n in module}
    return DeepSpeedCheckpoint(
        folder=folder, tag=tag, world=world, optim_prefix=prefixes[0], params=params, group_numels=group_numels,
        shared=dict(first.get("shared_params") or {}), buffers=buffers,
        global_steps=int(first.get("global_steps") or 0), ds_version=first.get("ds_version"),
        client_state={k: v for k, v in first.items() if k not in _DEEPSPEED_KEYS},
    )


class _RankFiles:
    """DeepSpeed ranks' files, opened (memory-mapped) on first use and checked."""

    def __init__(self, ckpt: DeepSpeedCheckpoint) -> None:
        self.ckpt = ckpt
        self._optim: dict[int, dict[str, Any]] = {}
        self._frozen: dict[int, dict[str, torch.Tensor]] = {}
        #: the optimizer-state keys of each flat group, as the first file opened has them
        self._state_keys: dict[int, list[str]] | None = None

    def optim(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s ``optimizer_state_dict`` (with ``fp32_flat_groups``), checked."""
        if rank not in self._optim:
            path = self.ckpt.optim_file(rank)
            top = _load(path).get("optimizer_state_dict")
            if not isinstance(top, dict) or "fp32_flat_groups" not in top:
                raise ValueError(f"{path} has no fp32_flat_groups: not a ZeRO-3 optimizer-state file")
            stage, count = _as_int(top.get("zero_stage")), _as_int(top.get("partition_count"))
            if stage != 3:
                raise ValueError(f"{path} was saved at ZeRO stage {stage}; only stage 3 checkpoints are read")
            if count != self.ckpt.world:
                raise ValueError(f"{path} was partitioned over {count} ranks, the model states over {self.ckpt.world}")
            flats, want = top["fp32_flat_groups"], self.ckpt.group_numels
            if len(flats) != len(want) or any(f.numel() < n for f, n in zip(flats, want)):
                raise ValueError(f"{path}: flat groups of {[f.numel() for f in flats]} elements do not hold "
                                 f"the {want} that param_shapes lists")
            inner = top.get("optimizer_state_dict") or {}
            listed = sorted(k for g in inner.get("param_groups", []) for k in g["params"])
            if listed != list(range(len(flats))):
                raise ValueError(f"{path}: the optimizer's param_groups list {listed}, not one entry per flat group")
            keys = {k: sorted(state) for k, state in inner.get("state", {}).items()}
            if self._state_keys is not None and keys != self._state_keys:
                raise ValueError(f"{path}: optimizer state {keys} differs from another rank's {self._state_keys}")
            self._state_keys = keys
            for k, state in inner.get("state", {}).items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() != flats[k].numel():
                        raise ValueError(f"{path}: optimizer state {key!r} of flat group {k} has {value.numel()} "
                                         f"elements, its group {flats[k].numel()}")
            self._optim[rank] = top
        return self._optim[rank]

    def fragment(self, rank: int, name: str) -> torch.Tensor:
        """Rank ``rank``'s partition of frozen parameter ``name``."""
        if rank not in self._frozen:
            self._frozen[rank] = dict(_load(self.ckpt.model_file(rank)).get("frozen_param_fragments") or {})
        fragments = self._frozen[rank]
        if name not in fragments:
            raise ValueError(f"{self.ckpt.model_file(rank)} has no fragment of frozen parameter {name!r}")
        return fragments[name].reshape(-1)


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


def _match(engine: Zero3Engine, ckpt: DeepSpeedCheckpoint) -> list[tuple[int, DsParam]]:
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


def _plan(engine: Zero3Engine, ckpt: DeepSpeedCheckpoint, files: _RankFiles) -> list[_Load]:
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


def _hyperparameters(engine: Zero3Engine, ckpt: DeepSpeedCheckpoint, files: _RankFiles,
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


def _optimizer_state(ld: _Load, ckpt: DeepSpeedCheckpoint, files: _RankFiles, master: torch.Tensor,
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


def _state_source(files: _RankFiles, k: int, key: str) -> Callable[[int], torch.Tensor]:
    return lambda r: files.optim(r)["optimizer_state_dict"]["state"][k][key]


def _values_source(files: _RankFiles, ds: DsParam) -> Callable[[int], torch.Tensor]:
    """Each DeepSpeed rank's flat tensor that holds ``ds``'s partition."""
    k = ds.group
    if k is None:
        return lambda r: files.fragment(r, ds.name)
    return lambda r: files.optim(r)["fp32_flat_groups"][k]


def load_deepspeed_checkpoint(
    engine: Zero3Engine,
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
        files = _RankFiles(ckpt)
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
    gas = engine.config.gradient_accumulation_steps
    engine.restore_progress(ckpt.global_steps, ckpt.global_steps * gas, window_open=False)
    engine.shards_changed()
    return ckpt.client_state
