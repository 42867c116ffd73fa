"""A DeepSpeed JSON's ``"optimizer": {"type": "Muon", ...}``, built as ``z3kit.sharded_muon.ShardedMuon``.

DeepSpeed's meaning (0.19.8: ``DeepSpeedEngine._muon_param_groups``,
``deepspeed.set_optimizer_flags``, ``MuonWithAuxAdam``):

- which parameters get Muon: those of two or more dimensions whose name
  holds neither ``embed`` nor ``lm_head`` (read on the layer's shape, not
  the shard's); every other trainable parameter gets the auxiliary AdamW.
  The rule reads names only: a GPT-2's token embedding, ``transformer.wte``
  (tied to its head), has neither word and gets Muon, under DeepSpeed too;
  ``stats().muon.optimizer_of`` shows it, and a factory keeps it on AdamW;
- ``lr`` is both halves' learning rate unless ``muon_lr`` / ``adam_lr``
  set one; ``weight_decay`` applies to both; ``momentum`` is Muon's;
  ``betas`` and ``eps`` are AdamW's;
- defaults: Muon lr 0.02, momentum 0.95; AdamW lr 3e-4, betas
  (0.9, 0.95), eps 1e-10; weight decay 0.

Note: the update is ``torch.optim.Muon``'s.
    z3kit's Muon is ``torch.optim.Muon``'s update, bit for bit
    (``z3kit.sharded_muon``): Nesterov momentum, the quintic Newton-Schulz
    iteration in bf16 with torch's coefficients and 5 steps, and the step
    scaled by ``sqrt(max(1, rows / cols))``, which is DeepSpeed's scale too.
    DeepSpeed's default ``ns_method`` ("gram", a Gram-matrix variant) and
    ``per_head_muon`` are other updates and are refused by name, and so is
    ``adam_w_mode: false`` (L2 decay on the auxiliary Adam). DeepSpeed
    reshapes a conv kernel (more than two dimensions) to a matrix; torch's
    Muon refuses it, and so does z3kit, naming it: pass a factory that puts
    it in an AdamW group (``use_muon=False``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

import attrs
import torch
from torch import nn

from z3kit.matrix_owners import ShardedParams
from z3kit.sharded_muon import ShardedMuon
from z3kit.validate import check_bool, check_number
from z3kit_recipes.zero3.config.json_optimizer import JsonOptimizer, check_betas, implementation

_PARAMS: Final = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "betas", "eps", "adam_w_mode", "torch_adam")
_REFUSED: Final = {
    "ns_method": "DeepSpeed's Newton-Schulz variants; z3kit runs torch.optim.Muon's iteration",
    "per_head_muon": "per-head orthogonalization is not torch.optim.Muon's update",
}
#: names DeepSpeed keeps off Muon whatever their shape
NOT_MUON: Final = ("embed", "lm_head")


class NamedShards(ShardedParams, Protocol):
    """What the factory is given (``MasterShards``): the shards, named, with their shapes and group."""

    def named(self) -> list[tuple[str, nn.Parameter]]: ...


def uses_muon(name: str, shape: Sequence[int]) -> bool:
    """DeepSpeed's rule: two or more dimensions, and neither ``embed`` nor ``lm_head`` in the name."""
    return len(shape) >= 2 and not any(word in name.lower() for word in NOT_MUON)


@attrs.frozen(kw_only=True)
class JsonMuon:
    """Muon with an auxiliary AdamW as a DeepSpeed JSON describes it (DeepSpeed's defaults filled in)."""

    muon_lr: float = 0.02
    adam_lr: float = 3e-4
    momentum: float = 0.95
    weight_decay: float = 0.0
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), converter=check_betas)
    eps: float = 1e-10

    @property
    def lr(self) -> float:
        """The Muon half's learning rate (what a job reports as the JSON's ``lr``)."""
        return self.muon_lr

    @classmethod
    def from_json(cls, params: Mapping[str, Any]) -> JsonMuon:
        """The ``optimizer`` section's ``params`` (``"auto"`` already filled)."""
        refused = sorted(k for k in params if k in _REFUSED)
        if refused:
            raise ValueError("; ".join(f"optimizer.params.{k} is not supported: {_REFUSED[k]}" for k in refused))
        unknown = sorted(k for k in params if k not in _PARAMS)
        if unknown:
            raise ValueError(f"unsupported Muon parameters: {', '.join(f'optimizer.params.{k}' for k in unknown)}; "
                             f"supported: {', '.join(_PARAMS)}")
        if not check_bool("optimizer.params.adam_w_mode", params.get("adam_w_mode", True)):
            raise ValueError("optimizer.params.adam_w_mode false (L2 decay on Muon's auxiliary Adam) is not supported: "
                             "z3kit steps the non-Muon parameters with AdamW; remove it")
        check_bool("optimizer.params.torch_adam", params.get("torch_adam", False))
        values = {k: float(check_number(f"optimizer.params.{k}", params[k], at_least=0.0))
                  for k in ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "eps") if k in params}
        kwargs: dict[str, Any] = {k: values[k] for k in ("momentum", "weight_decay", "eps") if k in values}
        for half in ("muon_lr", "adam_lr"):
            if half in values or "lr" in values:
                kwargs[half] = values.get(half, values.get("lr"))
        if "betas" in params:
            kwargs["betas"] = params["betas"]
        return cls(**kwargs)

    def __call__(self, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        """Muon on ``params`` (the engine's master shards, a ``MasterShards``) by DeepSpeed's rule, AdamW on the rest."""
        if not all(hasattr(params, a) for a in ("named", "full_shape", "name_of", "group")):
            raise TypeError("the JSON's Muon is built on the engine's master shards (a MasterShards), which know "
                            f"their names, shapes and process group; got a {type(params).__name__}")
        shards: NamedShards = params  # type: ignore[assignment]
        named = shards.named()
        muon = [p for n, p in named if uses_muon(n, shards.full_shape(p))]
        others = [p for n, p in named if not uses_muon(n, shards.full_shape(p))]
        groups: list[dict[str, Any]] = []
        if muon:
            groups.append({"params": muon, "use_muon": True, "lr": self.muon_lr, "momentum": self.momentum,
                           "weight_decay": self.weight_decay})
        if others:
            groups.append({"params": others, "use_muon": False, "lr": self.adam_lr, "betas": self.betas,
                           "eps": self.eps, "weight_decay": self.weight_decay})
        return ShardedMuon(groups, shards, adamw=implementation(others))


def optimizer_from_json(type_: Any, params: Mapping[str, Any]) -> JsonOptimizer | JsonMuon:
    """The ``optimizer`` section: Muon (``JsonMuon``), or Adam/AdamW (``JsonOptimizer``)."""
    if isinstance(type_, str) and type_.lower() == "muon":
        return JsonMuon.from_json(params)
    return JsonOptimizer.from_json(type_, params)
