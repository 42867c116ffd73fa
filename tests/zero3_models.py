"""Test models and a DDP-vs-zero3 training harness for the zero3 test suites.

Every model here is small (hundreds to a few thousand elements) so that a
case of ten steps runs in well under a second per rank. Sizes are chosen so
that most parameters are *not* divisible by 2 or 4 (7, 13, 5, ...): shards
get padding at every world size the suites use.

The harness, :func:`train_pair`, trains one model two ways on the same
rank-local data, side by side in one process: through ``zero3.initialize``
and through ``torch.nn.parallel.DistributedDataParallel`` on a deep copy
made before ``initialize`` touched the model. It returns plain data (losses,
full parameters, stats) for the test process to compare.

Note: what a parameter without a gradient gets.
    The zero3 runtime hands the optimizer ``None`` for a parameter that got
    no gradient on this rank in the accumulation window (unused on this
    step, a branch not taken), so Adam skips it, as plain PyTorch does
    after ``zero_grad()``; DDP with ``find_unused_parameters=True`` leaves
    the gradient of a parameter unused on every rank untouched (``None``),
    which matches, inside a leaf unit (``leaf_modules``) too: an expert
    that no rank gave tokens is reduced as zeros but gets no gradient, so
    Adam leaves it alone.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

D_IN, D_OUT, HIDDEN, BATCH = 7, 5, 13, 6
VOCAB, SEQ = 61, 8


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


class MLP(nn.Module):
    """7 -> 13 -> 13 -> 5 with Tanh; no size divisible by 2 or 4."""

    def __init__(self, width: int = HIDDEN, depth: int = 2) -> None:
        super().__init__()
        dims = [D_IN] + [width] * depth + [D_OUT]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # no bias: a key bias gets a gradient that is zero up to rounding
        # (softmax ignores a constant shift), which Adam turns into steps of
        # size lr, so the two runs' rounding noise would decide its values
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """A two-block causal transformer whose output projection is the token
    embedding: ``tie="hf"`` ties a real ``lm_head`` child to it
    (``lm_head.weight = tok_emb.weight``), ``tie="functional"`` computes
    ``F.linear(x, self.tok_emb.weight)`` in this (the parent's) forward."""

    def __init__(self, tie: str = "hf", d: int = 18, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        if tie not in ("hf", "functional"):
            raise ValueError(tie)
        self.tie = tie
        self.tok_emb = nn.Embedding(VOCAB, d)
        self.pos_emb = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        if tie == "hf":
            self.lm_head = nn.Linear(d, VOCAB, bias=False)
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.tie == "hf":
            return self.lm_head(x)
        return F.linear(x, self.tok_emb.weight)


class OddModel(nn.Module):
    """Linear(7, 5) and parameters smaller than the world size (3 and 1 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D_IN, 5)
        self.b = nn.Linear(5, 3)
        self.c = nn.Linear(3, D_OUT)
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.temperature


class ReuseModel(nn.Module):
    """One block called three times per forward (layer reuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(3):
            h = self.block(h)
        return self.head(h)


def branch_taken(step: int) -> bool:
    return step % 3 == 2


class BranchModel(nn.Module):
    """Takes the ``alt`` branch on every third step (the same on all ranks):
    the module order changes, so a frozen trace must be invalidated."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.main = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.alt = nn.Sequential(nn.Linear(HIDDEN, 11), nn.Tanh(), nn.Linear(11, HIDDEN))
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.alt(h) if branch_taken(step) else self.main(h)
        return self.head(h)


class EarlyExitModel(nn.Module):
    """A data-dependent early exit: a batch whose mean input is positive
    leaves after two of four blocks, so ranks run different modules, and
    how many steps a module runs on differs too. The head after the exit
    differs from the one at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(4))
        self.exit_head = nn.Linear(HIDDEN, D_OUT)
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1 and float(x.mean()) > 0:
                return self.exit_head(h)
        return self.head(h)


class FrozenModel(nn.Module):
    """The first layer and one bias do not require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.mlp.layers[0].requires_grad_(False)
        self.mlp.layers[1].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x: torch.Tensor, use_gate: bool) -> torch.Tensor:
        h = self.lin(x)
        return h * self.gate if use_gate else h


class UnusedParamModel(nn.Module):
    """``inner.gate`` is used on even steps only (step 0 included)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.inner = Gated()
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(torch.tanh(self.inp(x)), step % 2 == 0)))


class CheckpointModel(nn.Module):
    """Two blocks run under ``torch.utils.checkpoint``."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN)) for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(torch.tanh(h))


class SharedCheckpointModel(nn.Module):
    """One block used by two checkpointed segments: under reentrant
    checkpointing each segment's inner backward hands over a gradient of the
    shared block, so its parameters get two in one backward (ALBERT's pattern)."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.shared = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(2):
            h = h + checkpoint(self.shared, h, use_reentrant=self.use_reentrant)
        return self.head(torch.tanh(h))


def hf_llama_shared_layers_checkpointed() -> nn.Module:
    """An HF Llama whose decoder layers are one layer used three times
    (ALBERT's cross-layer sharing), under Hugging Face's reentrant gradient
    checkpointing. (ALBERT itself has no gradient checkpointing in
    transformers 5.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attention_dropout=0.0, tie_word_embeddings=False, attn_implementation="eager", use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    layers = model.model.layers
    for i in range(1, len(layers)):
        layers[i] = layers[0]
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


class Scaler(nn.Module):
    """Returns one of its own parameters alongside its output."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.8, 1.2, HIDDEN))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:
        return x * self.scale, self.scale


class ReturnsParamModel(nn.Module):
    """The parent uses the parameter that ``scaler`` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.scaler = Scaler()
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, scale = self.scaler(torch.tanh(self.inp(x)))
        return self.head(y + scale * scale)


class ParentModel(nn.Module):
    """A root with parameters of its own, used before and after its children."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D_IN, HIDDEN) * 0.3)
        self.b = nn.Parameter(torch.zeros(HIDDEN))
        self.child1 = nn.Linear(HIDDEN, HIDDEN)
        self.child2 = nn.Linear(HIDDEN, D_OUT)
        self.out_scale = nn.Parameter(torch.full((D_OUT,), 1.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w + self.b)
        h = torch.tanh(self.child1(h))
        return self.child2(h) * self.out_scale


N_EXPERTS = 4


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d - 1)
        self.fc2 = nn.Linear(2 * d - 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class MoE(nn.Module):
    """Router + experts, top-1. Which expert a token goes to is given by
    ``route`` (chosen from the data, not the weights, so that both runs of a
    comparison route identically); the router's softmax weight of the chosen
    expert scales its output, so the router is trained."""

    def __init__(self, d: int = HIDDEN, experts: int = N_EXPERTS) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            # route: (tokens,) for top-1, (tokens, k) for top-k
            idx = (route == e).reshape(len(route), -1).any(dim=1).nonzero().flatten()
            if idx.numel() == 0:
                continue  # an expert with no tokens on this rank this step
            y = expert(x.index_select(0, idx)) * gates.index_select(0, idx)[:, e : e + 1]
            out = out.index_add(0, idx, y)
        return x + out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.moe = MoE()
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.moe(torch.tanh(self.inp(x)), route)))


def moe_top2_batch(rank: int, step: int, micro: int, k: int) -> dict[str, Any]:
    """Top-2 routing: each token goes to two experts (the three allowed on
    this rank and step, less one chosen per token); at world 1 an expert gets
    no tokens on every rank each step."""
    g = _gen(7, rank, step, micro, k)
    b = vec_batch(rank, step, micro, k)
    allowed = torch.tensor([(rank + step + micro + i) % N_EXPERTS for i in range(3)])
    pairs = torch.tensor([[0, 1], [1, 2], [0, 2]])[torch.randint(0, 3, (BATCH,), generator=g)]
    b["route"] = allowed[pairs]
    return b


def moe_route(rank: int, step: int, micro: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Two experts of four per (rank, step): on every step some experts get
    no tokens on a rank (and at world 1 or 2, on every rank)."""
    allowed = torch.tensor([(rank + step + micro) % N_EXPERTS, (rank + step + micro + 1) % N_EXPERTS])
    return allowed[torch.randint(0, 2, (tokens,), generator=gen)]


class Stack(nn.Module):
    """``n`` Linear(w, w) layers (memory and live-bound tests)."""

    def __init__(self, n: int = 8, w: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(w, w) for _ in range(n))
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        tie_word_embeddings=True, attn_implementation="eager",
    )
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2 embeddings are not tied"
    return model


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attention_dropout=0.0, tie_word_embeddings=False, attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


# --------------------------------------------------------------------------- #
# Workloads: a model, its data and its loss
# --------------------------------------------------------------------------- #


def _gen(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = seed * 1_000_003 + p + 17
    return torch.Generator().manual_seed(seed % (2**62))


@dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]
    #: (rank, step, micro, k) -> batch; k numbers the forwards of one micro-step
    batch: Callable[[int, int, int, int], dict[str, Any]]
    #: (model or engine or DDP, batch, step) -> loss
    loss: Callable[[Any, dict[str, Any], int], torch.Tensor]


def vec_batch(rank: int, step: int, micro: int, k: int) -> dict[str, Any]:
    g = _gen(1, rank, step, micro, k)
    return {"x": torch.randn(BATCH, D_IN, generator=g), "y": torch.randn(BATCH, D_OUT, generator=g)}


def token_batch(rank: int, step: int, micro: int, k: int, vocab: int = VOCAB, seq: int = SEQ) -> dict[str, Any]:
    g = _gen(2, rank, step, micro, k)
    ids = torch.randint(0, vocab, (2, seq + 1), generator=g)
    return {"idx": ids[:, :-1].contiguous(), "tgt": ids[:, 1:].contiguous()}


def hf_batch(rank: int, step: int, micro: int, k: int) -> dict[str, Any]:
    g = _gen(3, rank, step, micro, k)
    return {"ids": torch.randint(0, 128, (2, 16), generator=g)}


def moe_batch(rank: int, step: int, micro: int, k: int) -> dict[str, Any]:
    g = _gen(4, rank, step, micro, k)
    b = vec_batch(rank, step, micro, k)
    b["route"] = moe_route(rank, step, micro, BATCH, g)
    return b


def vec_loss(m: Any, b: dict[str, Any], step: int) -> torch.Tensor:
    return F.mse_loss(m(b["x"]).float(), b["y"])


def ddp_vec_step(ddp: nn.Module, opt: torch.optim.Optimizer, b: dict[str, Any], step: int) -> float:
    """One reference step on a vec batch: loss, backward, optimizer step, zero_grad; returns the loss."""
    loss = vec_loss(ddp, b, step)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def step_loss(m: Any, b: dict[str, Any], step: int) -> torch.Tensor:
    return F.mse_loss(m(b["x"], step=step).float(), b["y"])


def moe_loss(m: Any, b: dict[str, Any], step: int) -> torch.Tensor:
    return F.mse_loss(m(b["x"], route=b["route"]).float(), b["y"])


def token_loss(m: Any, b: dict[str, Any], step: int) -> torch.Tensor:
    logits = m(b["idx"]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["tgt"].reshape(-1))


def hf_loss(m: Any, b: dict[str, Any], step: int) -> torch.Tensor:
    return m(input_ids=b["ids"], labels=b["ids"]).loss.float()


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload(MLP, vec_batch, vec_loss),
    "gpt_hf": Workload(lambda: TinyTransformer("hf"), token_batch, token_loss),
    "gpt_hf_4": Workload(lambda: TinyTransformer("hf", layers=4), token_batch, token_loss),
    "gpt_functional": Workload(lambda: TinyTransformer("functional"), token_batch, token_loss),
    "odd": Workload(OddModel, vec_batch, vec_loss),
    "reuse": Workload(ReuseModel, vec_batch, vec_loss),
    "branch": Workload(BranchModel, vec_batch, step_loss),
    "frozen": Workload(FrozenModel, vec_batch, vec_loss),
    "unused": Workload(UnusedParamModel, vec_batch, step_loss),
    "ckpt_reentrant": Workload(lambda: CheckpointModel(True), vec_batch, vec_loss),
    "ckpt_nonreentrant": Workload(lambda: CheckpointModel(False), vec_batch, vec_loss),
    "shared_ckpt_reentrant": Workload(lambda: SharedCheckpointModel(True), vec_batch, vec_loss),
    "shared_ckpt_nonreentrant": Workload(lambda: SharedCheckpointModel(False), vec_batch, vec_loss),
    "hf_shared_layers_ckpt": Workload(hf_llama_shared_layers_checkpointed, hf_batch, hf_loss),
    "moe_top2": Workload(MoEModel, moe_top2_batch, moe_loss),
    "early_exit": Workload(EarlyExitModel, vec_batch, vec_loss),
    "returns_param": Workload(ReturnsParamModel, vec_batch, vec_loss),
    "parent": Workload(ParentModel, vec_batch, vec_loss),
    "moe": Workload(MoEModel, moe_batch, moe_loss),
    "stack": Workload(Stack, lambda r, s, m, k: {"x": torch.randn(4, 64, generator=_gen(5, r, s, m, k)),
                                                 "y": torch.randn(4, 64, generator=_gen(6, r, s, m, k))},
                      vec_loss),
    "hf_gpt2": Workload(hf_gpt2, hf_batch, hf_loss),
    "hf_llama": Workload(hf_llama, hf_batch, hf_loss),
}

LEAF_CLASSES: dict[str, type[nn.Module]] = {"MoE": MoE}


# --------------------------------------------------------------------------- #
# The harness
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Case:
    """One DDP-vs-zero3 comparison."""

    workload: str
    config: dict[str, Any] = field(default_factory=dict)
    steps: int = 10
    optimizer: str = "adam"
    lr: float = 1e-2
    find_unused: bool = False
    leaf: tuple[str, ...] = ()
    #: forwards per micro-step, their losses summed before one backward
    forwards: int = 1
    #: DDP side: micro-steps per optimizer step (the engine reads its config)
    accumulation: int = 1
    #: DDP side: clip_grad_norm_ limit (0: none; the engine reads its config)
    clip: float = 0.0
    seed: int = 0
    #: DDP side: static_graph=True (what DDP needs for a parameter used by two reentrant checkpoint segments)
    static_graph: bool = False


def make_optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    raise ValueError(kind)


@dataclass
class PairResult:
    engine_losses: list[float]
    ddp_losses: list[float]
    #: what engine.step() returned, per micro-step
    stepped: list[bool]
    engine_params: dict[str, torch.Tensor]
    ddp_params: dict[str, torch.Tensor]
    #: clip: zero3's last_grad_norm and clip_grad_norm_'s total norm, per optimizer step
    engine_norms: list[float | None]
    ddp_norms: list[float]
    stats: Any
    #: engine.gathered_numel() after each optimizer step
    gathered_after_step: list[int]
    persistent_numel: int
    extra: dict[str, Any] = field(default_factory=dict)


class DDPReference:
    """The model trained by DDP, with the same optimizer (see the module Note)."""

    def __init__(self, ctx: Any, model: nn.Module, case: Case) -> None:
        self.model = model
        self.case = case
        self.ddp = nn.parallel.DistributedDataParallel(
            model, process_group=ctx.group, find_unused_parameters=case.find_unused, static_graph=case.static_graph
        )
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = make_optimizer(case.optimizer, trainable, case.lr)

    def micro_step(self, batches: list[dict[str, Any]], step: int, micro: int) -> float:
        wl = WORKLOADS[self.case.workload]
        last = micro == self.case.accumulation - 1
        # static_graph DDP refuses no_sync; reducing every micro-step gives the same sums
        with contextlib.nullcontext() if last or self.case.static_graph else self.ddp.no_sync():
            loss = sum(wl.loss(self.ddp, b, step) for b in batches)
            (loss / self.case.accumulation).backward()
        return float(loss.detach())

    def step(self) -> float:
        norm = 0.0
        if self.case.clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.case.clip))
        self.opt.step()
        self.opt.zero_grad()
        return norm

    def params(self) -> dict[str, torch.Tensor]:
        # every name of a tied or shared parameter, as the plain model's state_dict lists it (and full_state_dict)
        return {n: p.detach().clone() for n, p in self.model.named_parameters(remove_duplicate=False)}


def build_pair(
    ctx: Any, case: Case, *, process_group: Any = None, **init_kwargs: Any
) -> tuple[Any, DDPReference, nn.Module]:
    """The engine (on ``process_group``, default ``ctx.group``) and its DDP
    reference (on ``ctx.group``, a gloo group: the reference stays the same
    whatever backend the engine is tested on)."""
    from z3kit_recipes import zero3

    torch.manual_seed(1000 + case.seed)
    model = WORKLOADS[case.workload].build()
    ref = DDPReference(ctx, copy.deepcopy(model), case)
    engine = zero3.initialize(
        model,
        lambda params: make_optimizer(case.optimizer, params, case.lr),
        zero3.Zero3Config(**case.config),
        ctx.group if process_group is None else process_group,
        leaf_modules=[LEAF_CLASSES[name] for name in case.leaf],
        **init_kwargs,
    )
    return engine, ref, model


def engine_micro_step(engine: Any, case: Case, batches: list[dict[str, Any]], step: int) -> tuple[float, bool]:
    wl = WORKLOADS[case.workload]
    loss = sum(wl.loss(engine, b, step) for b in batches)
    engine.backward(loss)
    return float(loss.detach()), engine.step()


def persistent_numel(engine: Any, ref: DDPReference) -> int:
    """Elements of the parameters the stock rule keeps gathered: those under
    ``param_persistence_threshold`` elements (sizes read off the reference
    copy, whose parameters are full)."""
    threshold = engine.zero3_config.param_persistence_threshold
    return sum(p.numel() for p in ref.model.parameters() if p.numel() < threshold)


def new_result(engine: Any, ref: DDPReference) -> PairResult:
    return PairResult([], [], [], {}, {}, [], [], None, [], persistent_numel(engine, ref))


def train_steps(
    ctx: Any,
    engine: Any,
    ref: DDPReference,
    case: Case,
    steps: range,
    res: PairResult,
    after_step: Callable[[int], None] | None = None,
    grad_norm: Callable[[Any], float | None] = lambda engine: engine.stats().last_grad_norm,
) -> PairResult:
    """Optimizer steps ``steps`` of ``case`` on both runs, recorded in ``res``;
    ``after_step(step)`` runs after each; ``grad_norm(engine)`` is the norm
    the engine clipped by in its last step (another runtime reads it elsewhere)."""
    wl = WORKLOADS[case.workload]
    for step in steps:
        for micro in range(case.accumulation):
            batches = [wl.batch(ctx.rank, step, micro, k) for k in range(case.forwards)]
            z_loss, stepped = engine_micro_step(engine, case, batches, step)
            res.engine_losses.append(z_loss)
            res.stepped.append(stepped)
            res.ddp_losses.append(ref.micro_step(batches, step, micro))
        res.ddp_norms.append(ref.step())
        res.engine_norms.append(grad_norm(engine))
        res.gathered_after_step.append(engine.gathered_numel())
        if after_step is not None:
            after_step(step)
    return res


def finish(engine: Any, ref: DDPReference, res: PairResult) -> PairResult:
    res.stats = engine.stats()
    res.engine_params = engine.full_state_dict()
    res.ddp_params = ref.params()
    return res


def train_pair(ctx: Any, case: Case, **init_kwargs: Any) -> PairResult:
    """Train ``case`` with zero3 and with DDP side by side (see the module docstring)."""
    engine, ref, _ = build_pair(ctx, case, **init_kwargs)
    res = train_steps(ctx, engine, ref, case, range(case.steps), new_result(engine, ref))
    return finish(engine, ref, res)


# --------------------------------------------------------------------------- #
# Comparisons (run in the test process)
# --------------------------------------------------------------------------- #


def assert_params_match(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    assert set(got) == set(want), f"parameter names differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        assert got[name].shape == want[name].shape, f"{name}: shape {got[name].shape} != {want[name].shape}"
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def rel_norm_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float((got[n].float() - want[n].float()).pow(2).sum()) for n in want)
    den = sum(float(want[n].float().pow(2).sum()) for n in want)
    return (num / den) ** 0.5


def assert_pair(results: list[PairResult], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every rank: the same losses as DDP at every micro-step, and full
    parameters equal to DDP's at the end."""
    for rank, r in enumerate(results):
        assert len(r.engine_losses) == len(r.ddp_losses) > 0
        torch.testing.assert_close(
            torch.tensor(r.engine_losses, dtype=torch.float64), torch.tensor(r.ddp_losses, dtype=torch.float64),
            rtol=rtol, atol=atol, msg=lambda m: f"rank {rank} losses: {m}",
        )
        assert_params_match(r.engine_params, r.ddp_params, rtol=rtol, atol=atol)
