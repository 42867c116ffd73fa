"""The optimizer a DeepSpeed JSON's ``optimizer`` section names, built on the master shards.

DeepSpeed's meaning (``DeepSpeedEngine._configure_basic_optimizer``):

- ``"AdamW"`` is AdamW; ``"Adam"`` is AdamW too unless ``"adam_w_mode":
  false`` (its default is true), which gives Adam with L2 weight decay;
  the type is matched without regard to case;
- its fused Adam's defaults: ``lr`` 1e-3, ``betas`` (0.9, 0.999), ``eps``
  1e-8 and ``weight_decay`` 0 (not torch AdamW's 0.01);
- ``weight_decay`` applies to every parameter alike: DeepSpeed builds the
  optimizer on the parameters it is given in one group, and Hugging Face's
  Trainer gives it every trainable parameter when the JSON names the
  optimizer (its no-decay groups apply only to an optimizer it builds
  itself). Users who want no-decay groups pass a factory instead
  (``initialize(optimizer=...)``; its argument has ``.named()``).
- ``torch_adam`` picks torch's implementation over DeepSpeed's fused one:
  the same update, and z3kit always uses torch's. ``max_grad_norm`` is
  refused (DeepSpeed refuses it too: clipping is ``gradient_clipping``).

Note: torch's fused kernel.
    DeepSpeed steps a JSON's Adam with a fused kernel (``FusedAdam`` on the
    device, ``DeepSpeedCPUAdam`` for an offloaded optimizer); torch's default
    Adam loops over the tensors one by one on the CPU, and an offloaded
    step runs there. So the optimizer is built with ``fused=True`` where
    torch has the kernel for every master's device: CPU (since torch 2.4,
    below the floor of 2.7 in ``pyproject.toml``) and CUDA. Elsewhere (an
    Ascend NPU, XPU) torch lists the device as fused-capable by its backend
    name alone, and whether the backend registered the kernel shows only at
    the first step, so ``foreach=True`` is used there: every backend runs
    it. Both are elementwise, so stepping a shard equals stepping the same
    elements of the whole tensor (parity with DDP holds bitwise when DDP's
    twin builds the same flags: ``implementation``); the fused kernel's
    rounding differs from the default loop's (1e-7 on fp32 after a few
    steps).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs
import torch
from torch import nn

from z3kit.validate import check_bool, check_number

#: the optimizer types of a DeepSpeed JSON that z3kit builds
OPTIMIZERS: Final = ("Adam", "AdamW", "Muon")
#: device types whose fused Adam kernel is part of torch itself (see the Note on torch's fused kernel)
FUSED_DEVICES: Final = frozenset({"cpu", "cuda"})
_PARAMS: Final = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam")


def implementation(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """``fused=True`` where every tensor of ``params`` is on a device of
    ``FUSED_DEVICES``, else ``foreach=True`` (see the Note on torch's fused
    kernel): the flags to give ``torch.optim.Adam``/``AdamW`` alongside the
    hyperparameters, for the engine's masters or a DDP twin's parameters."""
    return {"fused": True} if all(p.device.type in FUSED_DEVICES for p in params) else {"foreach": True}


def check_betas(value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"optimizer.params.betas must be two numbers [beta1, beta2], got {value!r}")
    b1, b2 = (float(check_number("optimizer.params.betas", b, at_least=0.0)) for b in value)
    if b1 >= 1.0 or b2 >= 1.0:
        raise ValueError(f"optimizer.params.betas must be in [0, 1), got {value!r}")
    return b1, b2


@attrs.frozen(kw_only=True)
class JsonOptimizer:
    """Adam or AdamW as a DeepSpeed JSON describes it (DeepSpeed's defaults filled in)."""

    #: decoupled weight decay (AdamW) rather than L2 (Adam)
    adamw: bool = True
    lr: float = 1e-3
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), converter=check_betas)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @classmethod
    def from_json(cls, type_: Any, params: Mapping[str, Any]) -> JsonOptimizer:
        """The ``optimizer`` section's ``type`` and ``params`` (``"auto"`` already filled; Muon
        is ``zero3.config.json_muon``'s)."""
        name = type_.lower() if isinstance(type_, str) else type_
        if name not in ("adam", "adamw"):
            raise ValueError(
                f"optimizer.type {type_!r} is not supported; z3kit builds {', '.join(OPTIMIZERS)} from a DeepSpeed "
                "JSON (pass any other optimizer as a factory: initialize(optimizer=lambda params: ...), and drop "
                "the optimizer section)")
        unknown = sorted(k for k in params if k not in _PARAMS)
        if unknown:
            hint = " (write gradient_clipping at the top level)" if "max_grad_norm" in unknown else ""
            raise ValueError(f"unsupported optimizer parameters: {', '.join(f'optimizer.params.{k}' for k in unknown)}"
                             f"{hint}; supported: {', '.join(_PARAMS)}")
        adam_w_mode = check_bool("optimizer.params.adam_w_mode", params.get("adam_w_mode", True))
        check_bool("optimizer.params.torch_adam", params.get("torch_adam", False))
        kwargs: dict[str, Any] = {"adamw": name == "adamw" or adam_w_mode}
        for key, above in (("lr", 0.0), ("eps", 0.0), ("weight_decay", None)):
            if key in params:
                kwargs[key] = float(check_number(f"optimizer.params.{key}", params[key], at_least=0.0, above=above))
        if "betas" in params:
            kwargs["betas"] = params["betas"]
        return cls(**kwargs)

    def __call__(self, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer on ``params`` (the engine's master shards), all in one group."""
        kind = torch.optim.AdamW if self.adamw else torch.optim.Adam
        masters = list(params)
        return kind(masters, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                    **implementation(masters))
