"""Hugging Face's ``resize_token_embeddings`` and ``tie_weights`` after
``zero3.initialize`` (issue 28, item 1): right, or refused by name.

* ``resize_token_embeddings`` failed inside Hugging Face reading the size of
  a placeholder ("not enough values to unpack"); now it is refused by name
  on every rank, saying to call it before initialize, and nothing changed:
  training goes on at parity with a DDP twin that did not resize.
* ``tie_weights`` with the embeddings as they were at initialize (tied or
  untied) changes nothing and trains at parity with a DDP twin that called
  it too; after the config was switched to tied embeddings it would move
  a sharded parameter, and is refused by name with the model untouched.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.dist_pool import WorkerContext, fresh_group
from tests.zero3_models import assert_params_match, hf_batch, rel_norm_error


def _model(arch: str, tied: bool) -> nn.Module:
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=tied, attn_implementation="eager"))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, attention_dropout=0.0, tie_word_embeddings=tied,
        attn_implementation="eager"))


def run_rebuild(ctx: WorkerContext, arch: str, tied: bool, call: str) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = _model(arch, tied)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.group)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    config = zero3.Zero3Config(param_persistence_threshold=0)
    engine = zero3.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), config, fresh_group(ctx))
    params_before = [id(p) for p in model.parameters()]
    out: dict[str, Any] = {"caught": None}
    try:
        if call == "resize":
            model.resize_token_embeddings(136)
        elif call == "tie":
            model.tie_weights()
            ddp.module.tie_weights()  # the twin does the same
        elif call == "tie_switched":
            model.config.tie_word_embeddings = True
            model.tie_weights()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        out["caught"] = f"{type(exc).__name__}: {exc}"
    out["untouched"] = ([id(p) for p in model.parameters()] == params_before
                        and model.get_input_embeddings().weight.ds_shape == (128, 32)
                        and model.config.vocab_size == 128)
    out["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    losses = []
    for step in range(3):
        ids = hf_batch(ctx.rank, step, 0, 0)["ids"]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref = ddp(input_ids=ids, labels=ids).loss
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref.item()))
    out["losses"] = losses
    full = engine.full_state_dict()
    want = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}  # one name per tied parameter
    out["state"], out["ddp"] = {n: full.get(n, torch.empty(0)) for n in want}, want
    return out


def _assert_like_ddp(r: dict[str, Any]) -> None:
    """Losses within 1e-5, parameters within 1e-5 in norm after three AdamW steps at lr 1e-2 (an element of
    a near-zero gradient may differ by a few 1e-5: Adam divides its reduction-order noise by its tiny size)."""
    for got, want in r["losses"]:
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), r["losses"]
    assert rel_norm_error(r["state"], r["ddp"]) < 1e-5
    assert_params_match(r["state"], r["ddp"], atol=5e-5)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("llama", True), ("gpt2", True)])
@pytest.mark.parametrize("call", ["resize", "tie"])
def test_resize_is_refused_and_tie_weights_trains_like_ddp(pools: Any, arch: str, tied: bool, call: str) -> None:
    results = pools.run(2, run_rebuild, arch, tied, call, timeout=180)
    for rank, r in enumerate(results):
        if call == "resize":
            caught = r["caught"]
            assert caught is not None and caught.startswith("RebuildRefused"), (rank, caught)
            assert "resize_token_embeddings" in caught and "before zero3.initialize" in caught, (rank, caught)
        else:
            assert r["caught"] is None, (rank, r["caught"])
        assert r["untouched"] and r["tied"] == tied, (rank, r)
        _assert_like_ddp(r)


def test_tie_weights_that_would_move_a_sharded_parameter_is_refused(pools: Any) -> None:
    for rank, r in enumerate(pools.run(2, run_rebuild, "llama", False, "tie_switched", timeout=180)):
        caught = r["caught"]
        assert caught is not None and caught.startswith("RebuildRefused"), (rank, caught)
        assert "tie_weights" in caught and "lm_head.weight" in caught and "before zero3.initialize" in caught, caught
        assert r["untouched"] and not r["tied"], (rank, r)
        _assert_like_ddp(r)



def run_guards_lifetime(ctx: WorkerContext) -> dict[str, Any]:
    import gc
    import time
    import weakref

    from z3kit_recipes import zero3

    torch.manual_seed(0)
    model = _model("llama", False)
    engine = zero3.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), zero3.Zero3Config(),
                              fresh_group(ctx))
    guarded = [name for name in ("resize_token_embeddings", "tie_weights") if name in vars(model)]
    twin = copy.deepcopy(model)
    own_guard = twin.tie_weights.__self__ is twin
    model_ref, engine_ref = weakref.ref(model), weakref.ref(engine)
    del engine, model, twin
    deadline = time.monotonic() + 5.0
    while (model_ref() is not None or engine_ref() is not None) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return {"guarded": guarded, "own_guard": own_guard, "freed": model_ref() is None and engine_ref() is None}


def test_the_guards_keep_nothing_alive(pools: Any) -> None:
    """Guards on the instances while the engine lives (a deepcopy of the model checks itself); a dropped
    engine and model are freed with them."""
    for r in pools.run(2, run_guards_lifetime):
        assert r == {"guarded": ["resize_token_embeddings", "tie_weights"], "own_guard": True, "freed": True}, r
