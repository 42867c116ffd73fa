"""The recipes' :class:`GPT` as Hugging Face's GPT-2 (``GPT2LMHeadModel``),
exactly: names, layout and ``config.json``.

Why GPT-2, and why it is exact: both are pre-LN decoders with learned
position embeddings (positions ``0..t-1``), a fused qkv projection split
into q, k, v in that order and then into heads, attention scaled by
``1/sqrt(head_dim)`` under a causal mask, a ``4 * width`` MLP, LayerNorms
with biases (epsilon ``LAYER_NORM_EPS``, GPT-2's ``layer_norm_epsilon``), a
final LayerNorm, biases on every projection, and an lm head without bias
tied to the token embedding. What differs is configured away: GPT-2's
default activation is ``gelu_new`` (the tanh approximation), ours the exact
GELU, so the config says ``"gelu"``; GPT-2 has dropout, ours none, so every
``*_pdrop`` is 0 (exact in training mode too); GPT-2's special tokens
(50256) lie outside a character vocabulary, so they are null. GPT-2's
``Conv1D`` computes ``x @ W + b`` with ``W`` of shape ``(in, out)``, the
transpose of ``nn.Linear``'s weight, so those four weights per block are
stored transposed. Llama (RMSNorm, rotary positions, gated SiLU MLP, no
biases) and OPT (positions offset by 2) are further away.
"""

from __future__ import annotations

from typing import Any, Final

from z3kit_recipes.models.gpt import GELU_APPROXIMATE, LAYER_NORM_EPS, GPTConfig

ARCHITECTURE: Final = "GPT2LMHeadModel"
MODEL_TYPE: Final = "gpt2"

#: our name -> GPT-2's, inside block ``i`` (``blocks.{i}.`` -> ``transformer.h.{i}.``)
_BLOCK_NAMES: Final = {
    "ln1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
    "ln2": "ln_2", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj",
}  # fmt: skip
#: the ``nn.Linear`` layers that are ``Conv1D`` in GPT-2 (their weights stored transposed)
_CONV1D: Final = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")


def gpt2_names(config: GPTConfig) -> dict[str, str]:
    """GPT-2's name of each of :class:`GPT`'s ``state_dict`` names (the tied
    ``lm_head.weight`` included, under ``tie_mode="hf"``)."""
    names = {
        "tok_emb.weight": "transformer.wte.weight",
        "pos_emb.weight": "transformer.wpe.weight",
        "ln_f.weight": "transformer.ln_f.weight",
        "ln_f.bias": "transformer.ln_f.bias",
    }
    for i in range(config.n_layer):
        for ours, theirs in _BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    if config.tie_mode == "hf":
        names["lm_head.weight"] = "lm_head.weight"
    return names


def gpt2_transposed(config: GPTConfig) -> frozenset[str]:
    """Our names of the weights GPT-2 keeps transposed (``Conv1D``)."""
    return frozenset(f"blocks.{i}.{layer}.weight" for i in range(config.n_layer) for layer in _CONV1D)


def gpt2_config(config: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` (less its dtype) under which ``GPT2LMHeadModel`` computes what :class:`GPT` does."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "n_positions": config.seq_len,
        "n_embd": config.width,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": 4 * config.width,
        # transformers' "gelu" is torch's exact GELU; "gelu_new" would be the tanh one
        "activation_function": "gelu" if GELU_APPROXIMATE == "none" else "gelu_pytorch_tanh",
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
    }


def gpt2_generation_config() -> dict[str, Any]:
    """``generation_config.json``: no special tokens (a character vocabulary
    has none), so ``generate`` runs to ``max_new_tokens``, greedy by default."""
    return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "do_sample": False}
