"""Quick checks of the reference models and workloads (no process group)."""

from __future__ import annotations

import pytest
import torch

from z3kit_recipes.models import (
    GPT,
    Block,
    CausalSelfAttention,
    GPTConfig,
    GPTWorkload,
    TinyBlock,
    TinyMLP,
    TinyWorkload,
    Workload,
    make_workload,
)

SMALL = GPTConfig(vocab_size=64, width=32, n_layer=2, n_head=4, seq_len=16)


def test_tiny_mlp_builds_and_forwards() -> None:
    model = TinyMLP(depth=96, width=32)
    blocks = [m for m in model.modules() if isinstance(m, TinyBlock)]
    assert len(blocks) == 96
    assert sum(p.numel() for p in model.parameters()) == 96 * (32 * 32 + 32)
    x = torch.randn(8, 32)
    out = model(x)
    want = x
    for block in blocks:  # tanh(W x + b), block after block
        want = torch.tanh(want @ block.linear.weight.T + block.linear.bias)
    assert out.shape == (8, 32)
    torch.testing.assert_close(out, want)


def test_tiny_mlp_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="depth"):
        TinyMLP(depth=0)
    with pytest.raises(ValueError, match="width"):
        TinyMLP(width=-1)


def gpt_numel(cfg: GPTConfig) -> int:
    """Parameter elements of a GPT, counted layer by layer from its config."""
    w = cfg.width
    layer_norm = 2 * w
    attention = (w * 3 * w + 3 * w) + (w * w + w)  # qkv, proj
    mlp = (w * 4 * w + 4 * w) + (4 * w * w + w)  # fc, proj
    block = layer_norm + attention + layer_norm + mlp
    # token and position embeddings, blocks, final LayerNorm; the lm head is the token embedding
    return cfg.vocab_size * w + cfg.seq_len * w + cfg.n_layer * block + layer_norm


@pytest.mark.parametrize("cfg", [SMALL, GPTConfig(), GPTConfig(vocab_size=10, width=12, n_layer=3, n_head=3, seq_len=5)])
def test_gpt_parameters_follow_the_config(cfg: GPTConfig) -> None:
    model = GPT(cfg)
    assert model.num_parameters() == gpt_numel(cfg)
    assert len(model.blocks) == cfg.n_layer
    attn = model.blocks[0].attn
    assert isinstance(attn, CausalSelfAttention)
    assert attn.n_head == cfg.n_head and cfg.head_dim * cfg.n_head == cfg.width


def test_default_workload_batches_fit_the_default_model() -> None:
    wl = GPTWorkload()
    model = wl.build_model()
    x, y = wl.batch(rank=0, step=0)
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (*x.shape, model.config.vocab_size)
    assert int(x.max()) < model.config.vocab_size and x.shape[1] <= model.config.seq_len
    assert torch.isfinite(wl.loss(logits, y))


@pytest.mark.parametrize("tie_mode", ["hf", "functional"])
def test_gpt_forward_shape(tie_mode: str) -> None:
    model = GPT(GPTConfig(vocab_size=64, width=32, n_layer=2, n_head=4, seq_len=16, tie_mode=tie_mode))  # type: ignore[arg-type]
    idx = torch.randint(0, 64, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, 64)
    assert len([m for m in model.modules() if isinstance(m, Block)]) == 2


def test_gpt_hf_tie_is_one_parameter_object() -> None:
    model = GPT(SMALL)
    assert model.lm_head is not None
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # counted once
    # A gradient step on the shared weight is seen by both users.
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert model.tok_emb.weight.grad is not None


def test_gpt_functional_tie_has_no_lm_head_and_same_logits() -> None:
    hf = GPT(SMALL)
    fn = GPT(GPTConfig(vocab_size=64, width=32, n_layer=2, n_head=4, seq_len=16, tie_mode="functional"))
    assert fn.lm_head is None
    fn.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("lm_head")})
    idx = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(fn(idx), hf(idx))
    assert hf.num_parameters() == fn.num_parameters()


def test_gpt_is_causal() -> None:
    model = GPT(SMALL)
    idx = torch.randint(0, 64, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 64
    torch.testing.assert_close(model(idx)[:, :8], model(changed)[:, :8])


def test_gpt_rejects_too_long_sequences() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("top_k", [None, 5])
def test_generate_shape_and_range(top_k: int | None) -> None:
    model = GPT(SMALL)
    model.train()
    idx = torch.randint(0, 64, (2, 4))
    gen = torch.Generator().manual_seed(0)
    out = model.generate(idx, max_new_tokens=20, temperature=0.8, top_k=top_k, generator=gen)
    assert out.shape == (2, 24)  # runs past seq_len: the context is cropped
    assert torch.equal(out[:, :4], idx)
    assert int(out.max()) < 64
    assert model.training  # mode restored
    if top_k is not None:  # each new token is among the top_k of its context's logits
        with torch.no_grad():
            for t in range(4, 24):
                logits = model(out[:, max(0, t - SMALL.seq_len) : t])[:, -1]
                top = torch.topk(logits, top_k, dim=-1).indices
                assert bool((top == out[:, t : t + 1]).any(dim=-1).all()), t


def test_generate_greedy_is_deterministic() -> None:
    model = GPT(SMALL)
    idx = torch.randint(0, 64, (1, 3))
    a = model.generate(idx, max_new_tokens=5, temperature=0.0)
    b = model.generate(idx, max_new_tokens=5, temperature=0.0)
    assert torch.equal(a, b)
    with torch.no_grad():  # greedy: each new token is its context's most likely one
        for t in range(3, 8):
            assert int(a[0, t]) == int(model(a[:, :t])[0, -1].argmax())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"width": -8}, "width"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": 0}, "n_head"),
        ({"seq_len": 0}, "seq_len"),
        ({"width": 30, "n_head": 4}, "n_head"),
        ({"tie_mode": "untied"}, "tie_mode"),
    ],
)
def test_gpt_config_rejects_bad_values(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_gpt_config_rejects_non_int_sizes() -> None:
    with pytest.raises(TypeError, match="width"):
        GPTConfig(width=256.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="n_layer"):
        GPTConfig(n_layer=True)


def test_gpt_config_is_frozen() -> None:
    cfg = GPTConfig()
    with pytest.raises(AttributeError):
        cfg.width = 128  # type: ignore[misc]


@pytest.mark.parametrize("name", ["tiny", "gpt"])
def test_workloads_are_seeded(name: str) -> None:
    wl = make_workload(name)
    assert isinstance(wl, Workload)
    a, b = wl.build_model(), wl.build_model()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    x0, y0 = wl.batch(rank=0, step=3)
    x0b, _ = wl.batch(rank=0, step=3)
    x1, _ = wl.batch(rank=1, step=3)
    x2, _ = wl.batch(rank=0, step=4)
    assert torch.equal(x0, x0b)
    assert not torch.equal(x0, x1) and not torch.equal(x0, x2)
    loss = wl.loss(a(x0), y0)
    assert loss.dim() == 0 and torch.isfinite(loss)
    blocks = wl.blocks(a)
    # every repeated unit, each once: tiny's depth, GPT's layers
    assert len({id(b) for b in blocks}) == len(blocks) == (a.depth if isinstance(a, TinyMLP) else a.config.n_layer)
    assert all(isinstance(b, TinyBlock if name == "tiny" else Block) for b in blocks)


def test_workload_seeding_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    TinyWorkload().build_model()
    assert torch.equal(torch.rand(3), expected)


def test_gpt_workload_targets_are_shifted_inputs() -> None:
    wl = GPTWorkload(config=SMALL, batch_size=3)
    x, y = wl.batch(rank=0, step=0)
    assert x.shape == y.shape == (3, SMALL.seq_len)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_make_workload_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("huge")


def test_llama_workload_builds_the_hf_model_seeded() -> None:
    pytest.importorskip("transformers")
    from z3kit_recipes.models import LLAMA_CONFIG, LlamaWorkload

    wl = make_workload("llama")
    assert isinstance(wl, LlamaWorkload) and isinstance(wl, Workload)
    a, b = wl.build_model(), wl.build_model()
    assert type(a).__name__ == "LlamaForCausalLM"
    # counted from the config: untied embeddings, grouped-query attention, gated MLP, RMSNorms
    c = LLAMA_CONFIG
    h, kv = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = (2 * h * h + 2 * h * kv) + 3 * h * c["intermediate_size"] + 2 * h
    assert sum(p.numel() for p in a.parameters()) == 2 * c["vocab_size"] * h + c["num_hidden_layers"] * layer + h
    assert sum(p.numel() for p in a.parameters()) == 75_510_528  # as LLAMA_CONFIG's comment and the README say
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    del b
    assert wl.blocks(a) == list(a.model.layers) and len(wl.blocks(a)) == c["num_hidden_layers"]
    x, y = wl.batch(rank=0, step=0)
    assert x.shape == y.shape == (wl.batch_size, wl.seq_len)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, wl.batch(rank=1, step=0)[0])
    with torch.no_grad():
        loss = wl.loss(a(x[:1, :8]), y[:1, :8])
    assert loss.dim() == 0 and torch.isfinite(loss)
