"""TRL's SFTTrainer and DPOTrainer on z3kit, against the same trainers on DDP.

    torchrun --nproc-per-node 2 examples/trl_trainers.py --trainer sft --out runs/sft
    torchrun --nproc-per-node 2 examples/trl_trainers.py --trainer dpo --out runs/dpo
    (add --ddp for TRL's own run on DDP)

A TRL trainer runs on the engine by one class: ``class T(Zero3Trainer,
SFTTrainer)``. TRL's fused loss takes ``lm_head.weight`` into its own
``autograd.Function``; between uses that weight is an honest sharded
parameter, which the function uses as the whole weight. DPO's reference
model is sharded too, by an engine that only runs forwards.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

VOCAB = 64


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words t0 .. t61 (made here: nothing is downloaded)."""
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="</s>")


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1))


def sentences(g: torch.Generator, count: int, words: int) -> list[str]:
    out = []
    for _ in range(count):
        start, step = int(torch.randint(0, VOCAB - 2, (1,), generator=g)), 1 + int(torch.randint(0, 3, (1,), generator=g))
        out.append(" ".join(f"t{(start + step * k) % (VOCAB - 2)}" for k in range(words)))
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["sft", "dpo"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ddp", action="store_true", help="TRL's own trainer on DDP instead of z3kit")
    parser.add_argument("--steps", type=int, default=3)
    return parser.parse_args(argv)


def train(opts: argparse.Namespace) -> None:
    """One run: train, then (rank 0) write the log history and the final weights."""
    g = torch.Generator().manual_seed(0)
    common: dict[str, Any] = dict(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], seed=0, data_seed=0, max_grad_norm=1.0,
        max_length=16)
    kwargs: dict[str, Any]
    if opts.trainer == "sft":
        base: Any = SFTTrainer
        args: Any = SFTConfig(**common)
        kwargs = dict(train_dataset=Dataset.from_dict({"text": sentences(g, 32, 12)}))
    else:
        base, args = DPOTrainer, DPOConfig(**common)
        kwargs = dict(train_dataset=Dataset.from_dict({
            "prompt": sentences(g, 32, 4), "chosen": sentences(g, 32, 4), "rejected": sentences(g, 32, 4)}),
            ref_model=model())
    if opts.ddp:
        trainer = base(model=model(), args=args, processing_class=tokenizer(), **kwargs)
    else:
        from z3kit_recipes import zero3
        from z3kit_recipes.hf import Zero3Trainer

        class Trainer(Zero3Trainer, base):  # type: ignore[misc, valid-type]
            pass

        trainer = Trainer(model=model(), args=args, processing_class=tokenizer(),
                          z3kit_config=zero3.Zero3Config(param_persistence_threshold=0), **kwargs)
    trainer.train()
    weights = trainer.model.state_dict() if opts.ddp else trainer.engine.full_state_dict()
    if dist.get_rank() == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in weights.items()}, os.path.join(opts.out, "weights.pt"))
        with open(os.path.join(opts.out, "history.json"), "w", encoding="utf-8") as f:
            json.dump(trainer.state.log_history, f)
        with open(os.path.join(opts.out, "run.json"), "w", encoding="utf-8") as f:
            json.dump({"reference_sharded": getattr(trainer, "ref_engine", None) is not None}, f)


def main() -> None:
    train(parse())
    # torch 2.13 with gloo can abort in process-group teardown: end without it, after every rank is done
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
