"""What a DeepSpeed ZeRO-3 checkpoint holds and where, read without DeepSpeed.

``read_deepspeed_checkpoint`` reads the layout of what
``deepspeed_engine.save_checkpoint(dir)`` writes at stage 3 (parameter
names, shapes and offsets; buffers; the step counter; client state) from
rank 0's model-states file; ``RankFiles`` opens the other ranks' files on
demand, memory-mapped, and checks each against that layout. No tensor data
is read until a caller slices it. Loading into an engine is
``z3kit_recipes.zero3.weights.deepspeed_import``.

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
from pathlib import Path
from typing import Any

import attrs
import torch

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
    if not root.is_dir():  # before looking for 'latest' in it, which would blame the file
        raise FileNotFoundError(f"DeepSpeed checkpoint {root} does not exist" if not root.exists() else
                                f"DeepSpeed checkpoint {root} is a file: pass the folder save_checkpoint wrote")
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


class RankFiles:
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

