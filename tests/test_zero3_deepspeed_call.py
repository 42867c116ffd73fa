"""A DeepSpeed user's first calls (``zero3.deepspeed_call``, ``engine.save_16bit_model``).

* ``zero3.initialize(model, config=ds_json)`` with no optimizer argument
  builds the JSON's optimizer and trains; the older call forms still work.
* ``model_parameters=``, an optimizer instance and unpacking the result as
  DeepSpeed's 4-tuple are each refused, naming what z3kit takes instead,
  before anything changes; initializing the now sharded model again is
  refused, naming the parameter (``zero3.sharded_mark``).
* ``save_16bit_model`` writes the model's ``state_dict`` in the compute
  dtype (bf16 here), tied weights under both names, that loads back into an
  unsharded copy with the engine's values; ``exclude_frozen_parameters``
  leaves the frozen ones out.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from tests.dist_pool import PoolSet, WorkerContext, fresh_group
from z3kit_recipes import zero3
from z3kit_recipes.zero3.deepspeed_call import check_deepspeed_arguments, check_optimizer_argument

DS_JSON = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    "gradient_clipping": 0,
}


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def _refusal(call: Any) -> str:
    try:
        call()
    except TypeError as exc:
        return str(exc)
    return ""


def _worker(ctx: WorkerContext, save_dir: str) -> dict[str, Any]:
    model = _gpt2()
    group = fresh_group(ctx)
    out: dict[str, Any] = {
        "model_parameters": _refusal(lambda: zero3.initialize(
            model, model_parameters=model.parameters(), config=DS_JSON, process_group=group)),
        "instance": _refusal(lambda: zero3.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1), process_group=group)),
        "untouched": all(p.numel() > 0 for p in model.parameters()),
    }
    engine = zero3.initialize(model, config={**DS_JSON, "bf16": {"enabled": True}}, process_group=group)
    out["optimizer"] = type(engine.optimizer).__name__

    def unpack() -> None:
        engine_, optimizer, _, scheduler = engine  # DeepSpeed's 4-tuple

    out["tuple"] = _refusal(unpack)
    try:  # the retry after the tuple's message, in the same process: the model is the engine's now
        zero3.initialize(model, config=DS_JSON, process_group=group)
        out["again"] = ""
    except ValueError as exc:
        out["again"] = str(exc)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    out["stepped"] = engine.step()
    full = engine.full_state_dict()  # fp32 masters
    out["written"] = engine.save_16bit_model(save_dir, "model16.bin")
    # the frozen-parameter variant on an engine with a frozen embedding, the older positional call form
    frozen = _gpt2()
    frozen.transformer.wpe.weight.requires_grad_(False)
    engine2 = zero3.initialize(frozen, lambda p: torch.optim.SGD(p, lr=0.1), zero3.Zero3Config(), group)
    engine2.save_16bit_model(save_dir, "trainable.bin", exclude_frozen_parameters=True)
    out["full"] = full
    return out


def test_deepspeed_call_forms_and_save_16bit_model(pools: PoolSet) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outs = pools.run(2, _worker, tmp)
        for out in outs:
            assert "drop model_parameters" in out["model_parameters"] and "optimizer=lambda params" in out["model_parameters"]
            assert "optimizer=lambda params: torch.optim.AdamW(params, lr=0.0003" in out["instance"]
            assert "weight_decay=0.1" in out["instance"]
            assert out["untouched"]
            assert out["optimizer"] == "AdamW"  # the JSON's, with no optimizer argument
            assert "engine = zero3.initialize(...)" in out["tuple"] and "engine.lr_scheduler" in out["tuple"]
            assert "build the model again before calling initialize again" in out["tuple"]
            assert out["again"].startswith("parameter 'transformer.wte.weight' of GPT2LMHeadModel was sharded by an "
                                           "earlier zero3.initialize"), out["again"]
            assert out["stepped"] is True and out["written"] is True
        saved = torch.load(os.path.join(tmp, "model16.bin"), weights_only=True)
        reference = _gpt2()
        assert set(saved) == set(reference.state_dict())  # every name, tied lm_head.weight and buffers included
        assert saved["lm_head.weight"].data_ptr() == saved["transformer.wte.weight"].data_ptr()
        params = dict(reference.named_parameters(remove_duplicate=False))
        assert {saved[n].dtype for n in params} == {torch.bfloat16}
        full = outs[0]["full"]
        for name, value in full.items():
            expected = value.to(torch.bfloat16) if name in params else value
            assert torch.equal(saved[name], expected), name
        # trained values, not the initial ones: the file is the engine's state after its step
        initial = reference.transformer.h[0].mlp.c_fc.weight.detach().to(torch.bfloat16)
        assert not torch.equal(saved["transformer.h.0.mlp.c_fc.weight"], initial)
        reference.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in saved.items()})
        trainable = torch.load(os.path.join(tmp, "trainable.bin"), weights_only=True)
        assert "transformer.wpe.weight" not in trainable and "transformer.wte.weight" in trainable
        assert {t.dtype for n, t in trainable.items() if n in params} == {torch.float32}  # an fp32 run writes fp32


def test_deepspeed_arguments_are_answered_with_z3kits_spelling() -> None:
    with pytest.raises(TypeError, match=r"lr_scheduler: the scheduler comes from the DeepSpeed config's scheduler"):
        check_deepspeed_arguments({"lr_scheduler": object()})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'not_a_name'"):
        check_deepspeed_arguments({"not_a_name": 1, "lr_scheduler": 1})
    check_deepspeed_arguments({})
    with pytest.raises(TypeError, match=r"torch.optim.SGD\(params, lr=0.5, momentum=0"):
        check_optimizer_argument(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5))
    with pytest.raises(TypeError, match=r"got int"):
        check_optimizer_argument(3)
    check_optimizer_argument(None)
    check_optimizer_argument(lambda params: torch.optim.SGD(params, lr=0.5))


def test_parameter_groups_are_answered_with_a_factory_that_keeps_them() -> None:
    """An optimizer built on groups, or DeepSpeed's model_parameters groups: the suggested factory makes
    each group from the master shards by name, with its own settings, not one group for every parameter."""
    layer = nn.Linear(2, 2)
    grouped = torch.optim.AdamW([{"params": [layer.weight], "weight_decay": 0.1},
                                 {"params": [layer.bias], "weight_decay": 0.0}], lr=3e-4)
    for call in (lambda: check_optimizer_argument(grouped),
                 lambda: check_deepspeed_arguments({"model_parameters": [
                     {"params": [layer.weight], "weight_decay": 0.1}, {"params": [layer.bias], "weight_decay": 0.0}]})):
        with pytest.raises(TypeError) as caught:
            call()
        message = str(caught.value)
        assert "keeps your 2 groups" in message and "params.named()" in message, message
        assert '"weight_decay": 0.1}, {"params": [p for n, p in params.named() if <group 1\'s names>], ' \
               '"weight_decay": 0.0}' in message, message
        assert "torch.optim.AdamW(params, lr" not in message  # no one-group factory
