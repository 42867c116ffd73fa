"""A module registered under two names (``model.a = shared; model.b = shared``):
``full_state_dict`` and ``save_pretrained`` keep every name under which a
plain model's ``state_dict()`` lists a tensor, so a strict
``load_state_dict`` into a plain twin works. Tied parameters that Hugging
Face declares tied are written as its own ``save_pretrained`` writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from tests.zero3_models import WORKLOADS
from z3kit_recipes import zero3


class SharedTwice(nn.Module):
    """One block under two names (``a`` and ``b``), with a persistent buffer
    and a non-persistent one (which ``state_dict`` leaves out)."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(6, 6)
        shared.register_buffer("scale", torch.tensor([1.5]))
        shared.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.a = shared
        self.head = nn.Linear(6, 3)
        self.b = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x) * self.a.scale)
        return self.head(torch.tanh(self.b(x)))


def _train(ctx: WorkerContext, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    engine = zero3.initialize(SharedTwice(), lambda p: torch.optim.AdamW(p, lr=1e-2), zero3.Zero3Config(),
                              fresh_group(ctx))
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):
        loss = F.mse_loss(engine(torch.randn(4, 6, generator=g)), torch.randn(4, 3, generator=g))
        engine.backward(loss)
        engine.step()
    return engine


def _full_state_dict(ctx: WorkerContext, root: str) -> dict[str, Any]:
    engine = _train(ctx)
    full = engine.full_state_dict()
    twin = SharedTwice()
    result = twin.load_state_dict(full)  # strict
    loaded = {k: v.clone() for k, v in twin.state_dict().items()}
    engine.save_pretrained(root)
    other = _train(ctx, seed=1)  # other weights, then the saved ones
    other.load_pretrained(root)
    return dict(keys=list(full), plain_keys=list(SharedTwice().state_dict()), missing=result.missing_keys,
                unexpected=result.unexpected_keys, full=full, loaded=loaded, reloaded=other.full_state_dict(),
                one_tensor=full["a.weight"] is full["b.weight"] and full["a.scale"] is full["b.scale"])


def test_a_module_shared_under_two_names_keeps_both_names(pools: PoolSet, tmp_path: Path) -> None:
    from safetensors import safe_open

    root = tmp_path / "saved"
    for out in pools.run(2, _full_state_dict, str(root)):
        assert out["keys"] == out["plain_keys"]  # the names and order of a plain model's state_dict
        assert "a.weight" in out["keys"] and "b.weight" in out["keys"] and "b.scale" in out["keys"]
        assert "a.scratch" not in out["keys"]
        assert out["missing"] == [] and out["unexpected"] == []
        assert out["one_tensor"]
        assert out["loaded"].keys() == out["full"].keys()
        assert all(torch.equal(out["loaded"][k], out["full"][k]) for k in out["full"])
        assert not torch.equal(out["full"]["a.weight"], SharedTwice().a.weight.detach())  # it trained
        assert out["reloaded"].keys() == out["full"].keys()
        assert all(torch.equal(out["reloaded"][k], out["full"][k]) for k in out["full"])
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(out["plain_keys"])


def _gpt2(ctx: WorkerContext, root: str, reference: str) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = zero3.initialize(WORKLOADS["hf_gpt2"].build(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                              zero3.Zero3Config(), fresh_group(ctx))
    full = engine.full_state_dict()
    engine.save_pretrained(root)
    twin = WORKLOADS["hf_gpt2"].build()
    if ctx.rank == 0:
        twin.save_pretrained(reference)  # Hugging Face's own save of the same model
    result = twin.load_state_dict(full)
    return dict(keys=list(full), plain_keys=list(twin.state_dict()), missing=result.missing_keys,
                tied=full["lm_head.weight"] is full["transformer.wte.weight"])


def test_tied_weights_that_hugging_face_declares_are_saved_as_it_saves_them(pools: PoolSet, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from safetensors import safe_open

    root, reference = tmp_path / "ours", tmp_path / "theirs"
    for out in pools.run(2, _gpt2, str(root), str(reference)):
        assert out["keys"] == out["plain_keys"] and out["missing"] == [] and out["tied"]
    with safe_open(str(root / "model.safetensors"), "pt") as ours, \
            safe_open(str(reference / "model.safetensors"), "pt") as theirs:
        assert "lm_head.weight" not in ours.keys()
        assert sorted(ours.keys()) == sorted(theirs.keys())
