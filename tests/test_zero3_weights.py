"""Weights in and out of shards (gloo, world 1, 2, 4): a model built on the
meta device, Hugging Face checkpoints loaded straight into shards, and the
full model exported in the Hugging Face layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.checkpoint_at import save_at
from tests.errors import error_of, unchanged

transformers = pytest.importorskip("transformers")


def small_llama_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    )


def torch_layers() -> nn.Module:
    """Only torch's own layers, each initialized by its constructor (``reset_parameters``)."""
    return nn.Sequential(nn.Embedding(31, 6), nn.Linear(6, 13), nn.LayerNorm(13), nn.BatchNorm1d(13), nn.Linear(13, 5))


# --------------------------------------------------------------------------- #
# Building on the meta device
# --------------------------------------------------------------------------- #


def run_meta_build(ctx: Any) -> dict[str, Any]:
    from z3kit_recipes import zero3

    torch.manual_seed(11)
    reference = torch_layers()  # unsharded, the same seed
    with torch.device("meta"):
        model = torch_layers()
    engine = zero3.initialize(model, torch.optim.Adam, None, ctx.group, init_seed=11)
    full = engine.full_state_dict()
    return {
        "equal": {n: torch.equal(full[n], p) for n, p in reference.named_parameters()},
        "buffers": {n: torch.equal(b, dict(reference.named_buffers())[n]) for n, b in model.named_buffers()},
        "meta_left": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "shard_bytes": engine.stats().memory.current["param_shards"],
    }


@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_build_equals_an_unsharded_build_with_the_same_seed(pools: Any, world: int) -> None:
    for r in pools.run(world, run_meta_build):
        assert r["equal"] and all(r["equal"].values()), r["equal"]
        assert r["buffers"] and all(r["buffers"].values())  # BatchNorm statistics materialized
        assert r["meta_left"] == []


def run_meta_without_init(ctx: Any) -> str:
    from z3kit_recipes import zero3

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.inner = nn.Linear(3, 3)

    with torch.device("meta"):
        model = Custom()
    try:
        zero3.initialize(model, torch.optim.Adam, None, ctx.group)
    except ValueError as e:
        assert all(p.is_meta for p in model.parameters()), "nothing may change"
        return str(e)
    return "no error"


def test_meta_parameter_nothing_can_initialize_is_named(pools: Any) -> None:
    for message in pools.run(2, run_meta_without_init):
        assert "scale on the meta device" in message and "param_init_fn" in message


# --------------------------------------------------------------------------- #
# Hugging Face checkpoints in, and out
# --------------------------------------------------------------------------- #


def run_hf_roundtrip(ctx: Any, src: str, out: str, max_shard_bytes: int) -> dict[str, Any]:
    from z3kit_recipes import zero3

    config = small_llama_config()
    reference = transformers.LlamaForCausalLM.from_pretrained(src)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    engine = zero3.initialize(model, torch.optim.Adam, {"zero_optimization": {"stage": 3,
                              "stage3_param_persistence_threshold": 0}}, ctx.group,
                              param_init_fn=model._init_weights)
    engine.load_pretrained(src)
    full = engine.full_state_dict()
    loaded_equal = {n: torch.equal(full[n], p.detach()) for n, p in reference.named_parameters()}
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    engine.eval()
    with torch.no_grad():
        logits = engine(ids).logits
    engine.save_pretrained(out, max_shard_bytes=max_shard_bytes)
    save_at(engine, out + "-checkpoint")  # the checkpoint folder itself, which convert reads
    return {"loaded_equal": loaded_equal, "logits": logits, "ref_logits": reference(ids).logits.detach(), "ids": ids}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_hf_checkpoint_loads_into_shards_and_exports_for_transformers(pools: Any, world: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(small_llama_config()).save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()  # sharded, with an index
    out = tmp_path / "out"
    results = pools.run(world, run_hf_roundtrip, str(src), str(out), 30_000)
    for r in results:
        assert r["loaded_equal"] and all(r["loaded_equal"].values()), r["loaded_equal"]
        torch.testing.assert_close(r["logits"], r["ref_logits"], rtol=1e-5, atol=1e-5)
    exported = transformers.LlamaForCausalLM.from_pretrained(out)
    torch.testing.assert_close(exported(results[0]["ids"]).logits, results[0]["logits"], rtol=1e-5, atol=1e-5)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # split at 30 kB
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: written once
    assert not [p.name for p in tmp_path.iterdir() if "partial" in p.name]
    # offline, one process, no group: the checkpoint converts to the same weights
    from safetensors.torch import load_file

    from z3kit_recipes.convert import main as convert_main

    assert convert_main([str(out) + "-checkpoint", str(tmp_path / "converted"), "--max-shard-size", "30kB"]) == 0
    converted = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "converted")
    torch.testing.assert_close(converted(results[0]["ids"]).logits, results[0]["logits"], rtol=1e-5, atol=1e-5)
    tensors = {}
    for f in sorted((tmp_path / "converted").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(str(f)))
    assert tensors.keys() == exported.keys() and all(torch.equal(tensors[k], exported[k]) for k in tensors)


def run_mismatched_load(ctx: Any, src: str) -> dict[str, Any]:
    from z3kit_recipes import zero3

    config = small_llama_config()
    config.intermediate_size = 48  # mis-shaped MLP weights
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.extra = nn.Linear(2, 2, device="meta")  # missing from the checkpoint
    engine = zero3.initialize(model, torch.optim.Adam, None, ctx.group, param_init_fn=model._init_weights)
    before = engine.full_state_dict()
    message = error_of(engine.load_pretrained, src)
    return {"message": message, "unchanged": unchanged(before, engine.full_state_dict())}


def test_mismatched_checkpoint_is_reported_by_name_before_anything_changes(pools: Any, tmp_path: Path) -> None:
    transformers.LlamaForCausalLM(small_llama_config()).save_pretrained(tmp_path)
    for r in pools.run(2, run_mismatched_load, str(tmp_path)):
        assert r["unchanged"]
        msg = r["message"]
        assert msg.startswith("ValueError: ")
        assert "missing (2): extra.weight, extra.bias" in msg
        assert "mis-shaped" in msg and "model.layers.0.mlp.gate_proj.weight [40, 24] (the model's is [48, 24])" in msg


def test_streaming_writer_output_reads_back_with_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from z3kit_recipes.zero3.weights.safetensors_io import Planned, StreamingWriter

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16()}
    writer = StreamingWriter(tmp_path / "x.safetensors", [Planned(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())

