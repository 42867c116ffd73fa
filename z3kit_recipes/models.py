"""Reference models and workloads for benchmarks, training scripts and tests.

Two models:

- :class:`TinyMLP`: ``depth`` blocks of ``Linear(width, width)`` + ``Tanh``
  (each block a :class:`TinyBlock`). Many tiny modules: it stresses per-module
  runtime overhead (hooks, one gather per module), not arithmetic.
- :class:`GPT`: a small pre-LN GPT (:class:`GPTConfig`) with learned position
  embeddings, causal self-attention through ``F.scaled_dot_product_attention``,
  a 4x GELU MLP, a final LayerNorm and an lm head tied to the token embedding.
  The tie comes in two forms that a sharded runtime must both handle:

  * ``tie_mode="hf"`` (default), the way Hugging Face models tie: a real
    ``lm_head = nn.Linear(width, vocab, bias=False)`` child whose ``weight``
    is the *same Parameter object* as ``tok_emb.weight``, so one parameter is
    used by two different modules;
  * ``tie_mode="functional"``: no lm head module; the root's ``forward``
    computes ``F.linear(x, self.tok_emb.weight)``, so a parent uses a
    parameter owned by a child.

A *workload* bundles a model recipe with its data and loss so that every
runtime trains the very same thing: :class:`TinyWorkload`,
:class:`GPTWorkload` and :class:`LlamaWorkload` (a Hugging Face
``LlamaForCausalLM`` built from its config, nothing downloaded; needs
``transformers``, imported only when the model is built). See
:func:`make_workload`. Model weights are seeded (identical on every rank and
every runtime); each batch is seeded by ``(seed, rank, step)``, so ranks see
different data and reruns see the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final, Literal, Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

TieMode = Literal["hf", "functional"]
TIE_MODES: Final[tuple[TieMode, ...]] = ("hf", "functional")

WorkloadName = Literal["tiny", "gpt", "llama"]
WORKLOAD_NAMES: Final[tuple[WorkloadName, ...]] = ("tiny", "gpt", "llama")

_INIT_STD: Final = 0.02


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #


def _positive_int(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    """attrs validator: ``value`` is an ``int`` (not a bool) and ``> 0``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _non_negative_int(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    """attrs validator: ``value`` is an ``int`` (not a bool) and ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _tie_mode(_inst: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in TIE_MODES:
        raise ValueError(f"{attribute.name} must be one of {TIE_MODES}, got {value!r}")


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style init: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of ints (order matters)."""
    seed = 0x5EED
    for p in parts:
        seed = (seed * 1_000_003 + p) % (2**63 - 1)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


# --------------------------------------------------------------------------- #
# Tiny MLP
# --------------------------------------------------------------------------- #


class TinyBlock(nn.Module):
    """``Linear(width, width)`` followed by ``Tanh``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.linear(x))
        return out


class TinyMLP(nn.Module):
    """``depth`` :class:`TinyBlock` s of the same ``width``, in sequence."""

    def __init__(self, depth: int = 96, width: int = 32) -> None:
        super().__init__()
        if depth <= 0:
            raise ValueError(f"depth must be > 0, got {depth}")
        if width <= 0:
            raise ValueError(f"width must be > 0, got {width}")
        self.depth = depth
        self.width = width
        self.blocks = nn.ModuleList(TinyBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# --------------------------------------------------------------------------- #
# GPT
# --------------------------------------------------------------------------- #


@attrs.frozen
class GPTConfig:
    """Shape of a :class:`GPT`. Every field is validated on construction.

    Raises ``ValueError`` (naming the field) for a non-positive size, a
    ``width`` not divisible by ``n_head``, or an unknown ``tie_mode``; and
    ``TypeError`` for a size that is not an ``int``.
    """

    vocab_size: int = attrs.field(default=4096, validator=_positive_int)
    width: int = attrs.field(default=256, validator=_positive_int)
    n_layer: int = attrs.field(default=8, validator=_positive_int)
    n_head: int = attrs.field(default=4, validator=_positive_int)
    #: the longest sequence (number of learned positions).
    seq_len: int = attrs.field(default=64, validator=_positive_int)
    #: how the lm head shares the token embedding (see the module docstring).
    tie_mode: TieMode = attrs.field(default="hf", validator=_tie_mode)

    def __attrs_post_init__(self) -> None:
        if self.width % self.n_head != 0:
            raise ValueError(
                f"width ({self.width}) must be divisible by n_head ({self.n_head})"
            )

    @property
    def head_dim(self) -> int:
        return self.width // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (fused qkv projection, SDPA kernel)."""

    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        if width % n_head != 0:
            raise ValueError(f"width ({width}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        hd = c // self.n_head
        q = q.view(b, t, self.n_head, hd).transpose(1, 2)
        k = k.view(b, t, self.n_head, hd).transpose(1, 2)
        v = v.view(b, t, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.proj(y)
        return out


class MLP(nn.Module):
    """``Linear(w, 4w)`` -> GELU -> ``Linear(4w, w)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.act(self.fc(x)))
        return out


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, n_head)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """A small decoder-only transformer; ``forward(idx)`` returns logits.

    ``idx`` is ``(batch, time)`` token ids with ``time <= config.seq_len``;
    the result is ``(batch, time, vocab_size)`` logits.
    """

    lm_head: nn.Linear | None

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        cfg = self.config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.width)
        if cfg.tie_mode == "hf":
            self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # one Parameter, two modules
        else:
            self.lm_head = None
        self.apply(_init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=_INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(f"sequence of length {t} exceeds seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(x)
        else:
            logits = F.linear(x, self.tok_emb.weight)
        return logits

    def num_parameters(self) -> int:
        """Distinct parameter elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (``(batch, time)``).

        The context is cropped to the last ``seq_len`` tokens at each step.
        ``temperature == 0`` picks the most likely token (greedy); otherwise
        logits are divided by ``temperature`` and, with ``top_k``, restricted
        to the ``top_k`` most likely tokens before sampling. Runs without
        autograd and in eval mode, restoring the previous mode afterwards.
        Returns ``(batch, time + max_new_tokens)`` token ids.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be > 0, got {top_k}")
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    ctx = idx[:, -self.config.seq_len :]
                    logits = self(ctx)[:, -1, :]
                    if temperature == 0:
                        nxt = logits.argmax(dim=-1, keepdim=True)
                    else:
                        logits = logits / temperature
                        if top_k is not None:
                            k = min(top_k, logits.size(-1))
                            kth = torch.topk(logits, k, dim=-1).values[:, -1:]
                            logits = logits.masked_fill(logits < kth, float("-inf"))
                        probs = F.softmax(logits, dim=-1)
                        nxt = torch.multinomial(probs, num_samples=1, generator=generator)
                    idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx


# --------------------------------------------------------------------------- #
# Workloads
# --------------------------------------------------------------------------- #


@runtime_checkable
class Workload(Protocol):
    """A model recipe with its data and loss, identical for every runtime."""

    @property
    def name(self) -> str: ...

    @property
    def batch_size(self) -> int: ...

    def build_model(self) -> nn.Module:
        """A fresh model with seeded weights (the same on every call)."""
        ...

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input, target)`` for ``rank`` at ``step``, seeded by both."""
        ...

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Scalar loss of the model's output (a tensor, or a Hugging Face
        output with ``.logits``) against the target."""
        ...

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated units (one shard group each in FSDP-style runtimes)."""
        ...


def _build_seeded(seed: int, build: Callable[..., nn.Module], *args: object) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build(*args)


def _next_token_batch(
    seed: int, rank: int, step: int, vocab_size: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(batch, seq_len)`` token ids and the same sequences shifted by one."""
    gen = _seeded_generator(seed, rank, step)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


@attrs.frozen
class TinyWorkload:
    """:class:`TinyMLP`, MSE loss against a random target; inputs ``(batch, width)``."""

    depth: int = attrs.field(default=96, validator=_positive_int)
    width: int = attrs.field(default=32, validator=_positive_int)
    batch_size: int = attrs.field(default=8, validator=_positive_int)
    seed: int = attrs.field(default=0, validator=_non_negative_int)

    @property
    def name(self) -> str:
        return "tiny"

    def build_model(self) -> TinyMLP:
        model = _build_seeded(self.seed, TinyMLP, self.depth, self.width)
        assert isinstance(model, TinyMLP)
        return model

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _seeded_generator(self.seed, rank, step)
        x = torch.randn(self.batch_size, self.width, generator=gen)
        y = torch.randn(self.batch_size, self.width, generator=gen)
        return x, y

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, TinyBlock)]


@attrs.frozen
class GPTWorkload:
    """:class:`GPT` on random token sequences, next-token cross-entropy.

    Inputs are ``(batch, seq_len)`` token ids; targets are the same sequence
    shifted by one.
    """

    config: GPTConfig = attrs.field(factory=GPTConfig)
    batch_size: int = attrs.field(default=4, validator=_positive_int)
    seed: int = attrs.field(default=0, validator=_non_negative_int)

    @property
    def name(self) -> str:
        return "gpt"

    def build_model(self) -> GPT:
        model = _build_seeded(self.seed, GPT, self.config)
        assert isinstance(model, GPT)
        return model

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _next_token_batch(
            self.seed, rank, step, self.config.vocab_size, self.batch_size, self.config.seq_len
        )

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _next_token_loss(output, target)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, Block)]


#: the shape of :class:`LlamaWorkload`'s model, as ``transformers.LlamaConfig``
#: arguments: 75,510,528 parameters (288 MiB in fp32), untied embeddings,
#: grouped-query attention (12 query heads, 4 key/value heads).
LLAMA_CONFIG: Final[dict[str, Any]] = {
    "vocab_size": 16384,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    # training only: no key/value cache to build and drop at every forward
    "use_cache": False,
    # F.scaled_dot_product_attention: runs on CPU under every runtime of the benchmark
    "attn_implementation": "sdpa",
}


@attrs.frozen
class LlamaWorkload:
    """Hugging Face ``LlamaForCausalLM`` (:data:`LLAMA_CONFIG`) on random
    token sequences, next-token cross-entropy on ``model(input_ids).logits``.

    Built from its config (nothing is downloaded); ``transformers`` is
    imported by :meth:`build_model` only.
    """

    batch_size: int = attrs.field(default=4, validator=_positive_int)
    seq_len: int = attrs.field(default=64, validator=_positive_int)
    seed: int = attrs.field(default=0, validator=_non_negative_int)

    @property
    def name(self) -> str:
        return "llama"

    @property
    def vocab_size(self) -> int:
        vocab: int = LLAMA_CONFIG["vocab_size"]
        return vocab

    def build_model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**LLAMA_CONFIG)
        return _build_seeded(self.seed, LlamaForCausalLM, config)

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _next_token_batch(self.seed, rank, step, self.vocab_size, self.batch_size, self.seq_len)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = output.logits
        return _next_token_loss(logits, target)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        layers: nn.ModuleList = getattr(model, "model").layers
        return list(layers)


def make_workload(name: str, *, tie_mode: TieMode = "hf", seed: int = 0) -> Workload:
    """The named stock workload: ``"tiny"``, ``"gpt"`` or ``"llama"`` (``tie_mode`` is GPT's)."""
    if name == "tiny":
        return TinyWorkload(seed=seed)
    if name == "gpt":
        return GPTWorkload(config=GPTConfig(tie_mode=tie_mode), seed=seed)
    if name == "llama":
        return LlamaWorkload(seed=seed)
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOAD_NAMES}")
