"""Workloads: a model recipe with its data and loss, so that every runtime
trains the very same thing.

:class:`TinyWorkload` (:class:`~z3kit_recipes.models.tiny.TinyMLP`),
:class:`GPTWorkload` (:class:`~z3kit_recipes.models.gpt.GPT`) and
:class:`LlamaWorkload` (a Hugging Face ``LlamaForCausalLM`` built from its
config, nothing downloaded; needs ``transformers``, imported only when the
model is built); :func:`make_workload` names them. Model weights are seeded
(identical on every rank and every runtime); each batch is seeded by
``(seed, rank, step)``, so ranks see different data and reruns see the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from z3kit.validate import int_validator
from z3kit_recipes.models.gpt import GPT, Block, GPTConfig, TieMode
from z3kit_recipes.models.tiny import TinyBlock, TinyMLP

WorkloadName = Literal["tiny", "gpt", "llama"]
WORKLOAD_NAMES: Final[tuple[WorkloadName, ...]] = ("tiny", "gpt", "llama")


def _seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of ints (order matters)."""
    seed = 0x5EED
    for p in parts:
        seed = (seed * 1_000_003 + p) % (2**63 - 1)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


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

    depth: int = attrs.field(default=96, validator=int_validator(at_least=1))
    width: int = attrs.field(default=32, validator=int_validator(at_least=1))
    batch_size: int = attrs.field(default=8, validator=int_validator(at_least=1))
    seed: int = attrs.field(default=0, validator=int_validator(at_least=0))

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
    batch_size: int = attrs.field(default=4, validator=int_validator(at_least=1))
    seed: int = attrs.field(default=0, validator=int_validator(at_least=0))

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
    """Hugging Face ``LlamaForCausalLM`` (:data:`LLAMA_CONFIG`, or ``config``)
    on random token sequences, next-token cross-entropy on
    ``model(input_ids).logits``.

    Built from its config (nothing is downloaded); ``transformers`` is
    imported by :meth:`build_model` only.
    """

    #: ``transformers.LlamaConfig`` arguments; a smaller shape serves quick checks
    #: (``bench.gpu --dry-run``). Left out of the hash: a dict has none.
    config: Mapping[str, Any] = attrs.field(factory=lambda: dict(LLAMA_CONFIG), hash=False)
    batch_size: int = attrs.field(default=4, validator=int_validator(at_least=1))
    seq_len: int = attrs.field(default=64, validator=int_validator(at_least=1))
    seed: int = attrs.field(default=0, validator=int_validator(at_least=0))

    @property
    def name(self) -> str:
        return "llama"

    @property
    def vocab_size(self) -> int:
        vocab: int = self.config["vocab_size"]
        return vocab

    def build_model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**self.config)
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
