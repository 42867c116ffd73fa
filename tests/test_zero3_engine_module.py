"""The engine is an ``nn.Module`` that wraps the model, as DeepSpeed's is.

On a Hugging Face GPT-2 at world 2: ``engine.module`` is the model, train
and eval reach it, parameters are the model's (names prefixed ``module.``)
with their full shapes under DeepSpeed's names, ``engine.config`` is the
model's config, and whatever would hand out the empty placeholders as
values (``state_dict``, a cast) refuses, changing nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from z3kit_recipes import zero3


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def _worker(ctx: WorkerContext) -> dict[str, Any]:
    model = _gpt2()
    full = {n: (tuple(p.shape), p.numel()) for n, p in model.named_parameters()}
    engine = zero3.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-3),
                              zero3.Zero3Config(param_persistence_threshold=0), fresh_group(ctx))
    out: dict[str, Any] = {
        "is_module": isinstance(engine, nn.Module),
        "wraps": engine.module is model,
        "eval": (engine.eval() is engine, model.training, engine.training),
        "train": (engine.train() is engine, model.training, engine.training),
        "names": sorted(n for n, _ in engine.named_parameters()) == sorted(f"module.{n}" for n in full),
        "shapes": {n: (tuple(p.ds_shape), p.ds_numel) for n, p in model.named_parameters()} == full,
        "config": type(engine.config).__name__,
        "zero3_config": type(engine.zero3_config).__name__,
        "same_device": engine.to(torch.device("cpu")) is engine and engine.float() is engine,
    }
    refusals = {}
    for what, call in (("state_dict", engine.state_dict), ("load_state_dict", lambda: engine.load_state_dict({})),
                       ("half", engine.half)):
        try:
            call()
            refusals[what] = ""
        except RuntimeError as exc:
            refusals[what] = str(exc)
    out["refusals"] = refusals
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    out["stepped"] = engine.step()
    out["dtype_after"] = {str(v.dtype) for v in engine.full_state_dict().values()}
    return out


def test_the_engine_is_a_module_that_wraps_the_model(pools: PoolSet) -> None:
    for out in pools.run(2, _worker):
        assert out["is_module"] and out["wraps"]
        assert out["eval"] == (True, False, False) and out["train"] == (True, True, True)
        assert out["names"] and out["shapes"]
        assert out["config"] == "GPT2Config" and out["zero3_config"] == "Zero3Config"
        assert out["same_device"]
        assert "engine.full_state_dict()" in out["refusals"]["state_dict"]
        assert "engine.load_pretrained(path)" in out["refusals"]["load_state_dict"]
        assert "compute_dtype" in out["refusals"]["half"]
        assert out["stepped"] is True and out["dtype_after"] == {"torch.float32"}  # the refused cast changed nothing
