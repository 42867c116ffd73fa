"""Muon on flat 1/N shards, step for step ``torch.optim.Muon``'s update, with AdamW for the other groups.

``ShardedMuon`` takes parameter groups of flat, zero-padded shards
(``z3kit.partition``) and, for each, where it comes from: its parameter's
name and logical shape and the process group it is sharded over (a
``ShardedParams``; the stock runtime's optimizer factories get one, its
``MasterShards``). A group with ``use_muon=True`` (the default; DeepSpeed's
spelling) is stepped by Muon, one with ``use_muon=False`` by
``torch.optim.AdamW`` with that group's settings, as ``torch.optim.Muon``
users step embeddings, norms, the head and biases.

Note: equal to ``torch.optim.Muon``, bit for bit.
    torch 2.13's Muon (``torch/optim/_muon.py``) steps each matrix so::

        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if nesterov else buf
        update = newton_schulz(update)              # bf16, the matrix's 2-D shape
        param.mul_(1 - lr * weight_decay)
        param.add_(update, alpha=-adjust_lr(lr, shape))

    Every line but Newton-Schulz is elementwise, and an elementwise op on
    a slice gives the same bits as on the whole tensor, so those run on the
    shards, and the momentum buffers stay sharded (1/N). Newton-Schulz runs
    once per matrix, on its owner (``z3kit.matrix_owners``: balanced by
    ``m * n * min(m, n)``), on the whole matrix in its logical shape, by the
    same op sequence as torch's (``newton_schulz``); its bf16 result goes
    back to the slices' ranks in bf16 (exact). Bytes per step: one fp32
    gather and one bf16 scatter of the Muon matrices (``MuonReport``).

Note: shapes Muon refuses.
    ``torch.optim.Muon`` raises for any parameter that is not 2-D (a conv
    kernel, a bias); so does ``ShardedMuon``, naming the parameter, when a
    Muon group holds one: it is never stepped by AdamW instead. A fused QKV
    projection is one 2-D matrix and is orthogonalized as one, as torch does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from z3kit.matrix_owners import MatrixPlan, ShardedParams, check_matrix_shard, map_on_owners

#: torch.optim.Muon's defaults (torch 2.13), Keller Jordan's Newton-Schulz coefficients
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """torch 2.13's ``_zeropower_via_newtonschulz``, op for op: ``grad``'s orthogonalization, in bf16."""
    a, b, c = coefficients
    ortho = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch 2.13's ``_adjust_lr``: the step size for a matrix of ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


@attrs.frozen
class MuonReport:
    """Which parameter got which optimizer, and what Muon's last step cost on this rank."""

    #: parameter name -> "muon" or "adamw"
    optimizer_of: Mapping[str, str]
    #: Muon parameter name -> the rank that orthogonalizes it
    owner_of: Mapping[str, int]
    #: bytes this rank sent and received in the last step's gather and scatter
    bytes_sent: int = 0
    bytes_received: int = 0
    #: seconds the last step spent on Muon (momentum, gather, Newton-Schulz, scatter, update)
    seconds: float = 0.0
    #: Muon steps run
    steps: int = 0


class ShardedMuon(torch.optim.Optimizer):
    """Muon on shards, AdamW on the groups with ``use_muon=False`` (see the module docstring).

    ``lr`` ... ``adjust_lr_fn`` are ``torch.optim.Muon``'s, with its defaults;
    ``adamw`` holds the AdamW groups' defaults (``torch.optim.AdamW``'s
    keyword arguments; its own defaults otherwise)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        shards: ShardedParams,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        adamw: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"Muon's {name} must be >= 0, got {value}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        if not 0 < ns_steps < 100 or len(ns_coefficients) != 3:
            raise ValueError(f"ns_steps must be in [1, 100) and ns_coefficients three numbers, got {ns_steps}, "
                             f"{ns_coefficients!r}")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.shards = shards
        self._group = shards.group
        self._world = dist.get_world_size(self._group)
        adam_groups = [g for g in groups if isinstance(g, dict) and g.get("use_muon", True) is False]
        self._adamw_defaults = dict(adamw or {})
        # AdamW fills its defaults into its groups first; Muon's fill the rest (never overriding them)
        self._adamw = torch.optim.AdamW(adam_groups, **self._adamw_defaults) if adam_groups else None
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        use_muon=True)
        super().__init__(groups, defaults)  # type: ignore[arg-type]
        self._last = MuonReport(*self._assignment())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        if param_group.get("use_muon", True) is True:
            for p in param_group["params"]:
                self._check_matrix(p)  # before anything is added: a refused group leaves the optimizer as it was
        elif param_group.get("use_muon") is not False:
            raise TypeError(f"a group's use_muon must be True or False, got {param_group['use_muon']!r}")
        if param_group.get("use_muon", True) is False and hasattr(self, "param_groups") and "betas" not in param_group:
            # an AdamW group added later: AdamW's defaults, as at construction
            probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **self._adamw_defaults)
            for key, value in probe.defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)

    def _check_matrix(self, p: torch.Tensor) -> None:
        check_matrix_shard(self.shards, p, "Muon", "torch.optim.Muon refuses it too; put it in a group with "
                           "use_muon=False to step it with AdamW")

    def _assignment(self, stepped: Sequence[torch.Tensor] | None = None) -> tuple[dict[str, str], dict[str, int]]:
        kinds = {self.shards.name_of(p): "muon" if g["use_muon"] else "adamw"
                 for g in self.param_groups for p in g["params"]}
        matrices = list(stepped) if stepped is not None else [p for g in self._muon_groups() for p in g["params"]]
        plan = MatrixPlan.balanced([self.shards.full_shape(p) for p in matrices], self._world)
        return kinds, {self.shards.name_of(p): o for p, o in zip(matrices, plan.owners)}

    def _muon_groups(self) -> list[dict[str, Any]]:
        return [g for g in self.param_groups if g["use_muon"]]

    @property
    def report(self) -> MuonReport:
        """Which parameter got which optimizer, and the last step's bytes and time."""
        return self._last

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        with torch.enable_grad():
            loss = None if closure is None else closure()
        start = time.perf_counter()
        entries = [(p, g) for g in self._muon_groups() for p in g["params"] if p.grad is not None]
        sent = received = 0
        if entries:
            sent, received = self._muon_step(entries)
        seconds = time.perf_counter() - start
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adam_groups:
            if self._adamw is None:
                self._adamw = torch.optim.AdamW(adam_groups, **self._adamw_defaults)
            # the same groups and state as this optimizer's (a load_state_dict makes new group dicts)
            self._adamw.param_groups, self._adamw.state = adam_groups, self.state
            self._adamw.step()
        kinds, owners = self._assignment([p for p, _ in entries])
        self._last = MuonReport(kinds, owners, sent, received, seconds, self._last.steps + bool(entries))
        return loss

    def _muon_step(self, entries: list[tuple[torch.Tensor, dict[str, Any]]]) -> tuple[int, int]:
        """Muon's update of ``entries`` (the shards with a gradient and their groups); the bytes sent and received."""
        updates = []
        for p, g in entries:
            grad = p.grad
            assert grad is not None
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - g["momentum"])
            updates.append(grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf)
        shapes = [self.shards.full_shape(p) for p, _ in entries]
        plan = MatrixPlan.balanced(shapes, self._world)

        def orthogonalized(i: int, matrix: torch.Tensor) -> torch.Tensor:
            g = entries[i][1]
            return newton_schulz(matrix, tuple(g["ns_coefficients"]), g["ns_steps"], g["eps"])

        slices = map_on_owners(plan, [u.float() for u in updates], self._group, orthogonalized, torch.bfloat16)
        for (p, g), piece, shape in zip(entries, slices, shapes):
            lr = float(g["lr"])
            p.mul_(1 - lr * g["weight_decay"])
            p.add_(piece, alpha=-adjusted_lr(lr, g["adjust_lr_fn"], shape))
        rank = dist.get_rank(self._group)
        gather_sent, gather_received = plan.bytes_per_exchange(rank, 4)
        scatter_received, scatter_sent = plan.bytes_per_exchange(rank, 2)
        return gather_sent + scatter_sent, gather_received + scatter_received
