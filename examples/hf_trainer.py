"""A Hugging Face Trainer script on z3kit: the one-line switch, and its DDP twin.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out /tmp/run            # z3kit
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out /tmp/ddp --ddp      # Trainer + DDP
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out /tmp/run --resume   # resume

A small Llama (tied embeddings) learns a synthetic next-token task for a few
optimizer steps with gradient accumulation, clipping, weight decay, a linear
schedule with warmup, evaluation and checkpoints; rank 0 writes Trainer's
log history to ``OUT/history.json`` and the script ends with
``trainer.save_model()`` on every rank, as Trainer scripts do. The only
z3kit line is the trainer's class (``Zero3Trainer``) and its
``z3kit_config``. ``tests/test_hf_trainer.py`` runs it against the DDP twin.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, LENGTH = 96, 16


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Deterministic token sequences with a learnable rule (each token is the previous plus a step)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.offset + i)
        start, step = torch.randint(0, VOCAB, (1,), generator=g), 1 + torch.randint(0, 3, (1,), generator=g)
        ids = (start + step * torch.arange(LENGTH)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ddp", action="store_true", help="plain Trainer (DDP) instead of z3kit")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint under --out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None, help="a DeepSpeed JSON: z3kit's config; with --ddp, its optimizer "
                        "(AdamW, decay on every parameter) and DeepSpeed's own WarmupLR, as DeepSpeed would run it")
    return parser.parse_args(argv)


def train(opts: argparse.Namespace) -> None:
    """One run: train, save the model, and (rank 0) write the log history."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LENGTH, tie_word_embeddings=True))
    args = TrainingArguments(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3,
        save_strategy="steps", save_steps=2, use_cpu=True, report_to=[], seed=0, data_seed=0)
    data = dict(train_dataset=Sequences(64), eval_dataset=Sequences(7, offset=1000))
    if opts.ddp:
        optimizers: Any = (None, None)
        if opts.json:  # what DeepSpeed builds from the JSON's sections, with Trainer's "auto" values
            from deepspeed.runtime.lr_schedules import WarmupLR

            from z3kit_recipes.zero3.config.json_optimizer import implementation

            # fused where torch has the kernel, as z3kit builds the JSON's AdamW (and DeepSpeed fuses its own)
            adamw = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_epsilon, weight_decay=args.weight_decay,
                                      **implementation(model.parameters()))
            optimizers = (adamw, WarmupLR(adamw, warmup_min_lr=0, warmup_max_lr=args.learning_rate,
                                          warmup_num_steps=args.get_warmup_steps(opts.steps)))
        trainer: Trainer = Trainer(model=model, args=args, optimizers=optimizers, **data)
    else:
        from z3kit_recipes import zero3
        from z3kit_recipes.hf import Zero3Trainer

        config = opts.json or zero3.Zero3Config(param_persistence_threshold=0)
        trainer = Zero3Trainer(model=model, args=args, z3kit_config=config, **data)
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    trainer.save_model()
    if args.process_index == 0:
        with open(os.path.join(opts.out, "history.json"), "w", encoding="utf-8") as f:
            json.dump(trainer.state.log_history, f)


def main() -> None:
    train(parse())
    # torch 2.13 with gloo can abort in process-group teardown: end without it, after every rank is done
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
