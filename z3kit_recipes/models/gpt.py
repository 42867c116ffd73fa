"""A small pre-LN GPT (:class:`GPT`, shaped by :class:`GPTConfig`).

Learned position embeddings, causal self-attention through
``F.scaled_dot_product_attention``, a 4x GELU MLP, a final LayerNorm and an
lm head tied to the token embedding. The tie comes in two forms that a
sharded runtime must both handle:

* ``tie_mode="hf"`` (default), the way Hugging Face models tie: a real
  ``lm_head = nn.Linear(width, vocab, bias=False)`` child whose ``weight``
  is the *same Parameter object* as ``tok_emb.weight``, so one parameter is
  used by two different modules;
* ``tie_mode="functional"``: no lm head module; the root's ``forward``
  computes ``F.linear(x, self.tok_emb.weight)``, so a parent uses a
  parameter owned by a child.
"""

from __future__ import annotations

import math
from typing import Final, Literal

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from z3kit.validate import check_int, check_number, int_validator

TieMode = Literal["hf", "functional"]
TIE_MODES: Final[tuple[TieMode, ...]] = ("hf", "functional")

_INIT_STD: Final = 0.02
#: every LayerNorm's epsilon (torch's default), and the MLP's activation: the
#: exact GELU, not GPT-2's tanh approximation (``gpt_hf`` names both to Hugging Face)
LAYER_NORM_EPS: Final = 1e-5
GELU_APPROXIMATE: Final = "none"


def _tie_mode(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in TIE_MODES:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be one of {TIE_MODES}, got {value!r}")


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


@attrs.frozen
class GPTConfig:
    """Shape of a :class:`GPT`. Every field is validated on construction.

    Raises ``ValueError`` (naming the field) for a size below 1, a
    ``width`` not divisible by ``n_head``, or an unknown ``tie_mode``; and
    ``TypeError`` for a size that is not an ``int`` (a bool included).
    """

    vocab_size: int = attrs.field(default=4096, validator=int_validator(at_least=1))
    width: int = attrs.field(default=256, validator=int_validator(at_least=1))
    n_layer: int = attrs.field(default=8, validator=int_validator(at_least=1))
    n_head: int = attrs.field(default=4, validator=int_validator(at_least=1))
    #: the longest sequence (number of learned positions).
    seq_len: int = attrs.field(default=64, validator=int_validator(at_least=1))
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
        self.act = nn.GELU(approximate=GELU_APPROXIMATE)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.act(self.fc(x)))
        return out


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.attn = CausalSelfAttention(width, n_head)
        self.ln2 = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
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
        self.ln_f = nn.LayerNorm(cfg.width, eps=LAYER_NORM_EPS)
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
        check_int("max_new_tokens", max_new_tokens, at_least=0)
        check_number("temperature", temperature, at_least=0.0)
        if top_k is not None:
            check_int("top_k", top_k, at_least=1)
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

