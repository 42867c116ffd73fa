"""A DeepSpeed tutorial-shaped training script (GPT-2, a ZeRO-3 JSON with explicit numbers).

Run under DeepSpeed as written, and under z3kit with its import line changed to
``from z3kit_recipes.zero3 import deepspeed`` and nothing else
(``tests/test_zero3_deepspeed_script.py`` runs both at 2 ranks and compares
them). As a script: ``torchrun --nproc-per-node 2 deepspeed_tutorial.py OUT_DIR``.
"""

from __future__ import annotations

import sys
from typing import Any

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel

STEPS, MICRO_BATCH, SEQ, VOCAB = 4, 2, 8, 64
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                                "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 2, "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 500_000,
        "stage3_prefetch_bucket_size": 500_000, "stage3_param_persistence_threshold": 1_000,
        "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": True, "load_from_fp32_weights": True,
    },
    "comms_logger": {"enabled": False},
    "wall_clock_breakdown": False,
}


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


def main(save_dir: str) -> dict[str, Any]:
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=DS_CONFIG)
    losses = []
    for step in range(STEPS):
        ids = batch(step, engine.global_rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(save_dir, tag="final", client_state={"next_step": STEPS})
    path, client_state = engine.load_checkpoint(save_dir, tag="final")
    ids = batch(client_state["next_step"], engine.global_rank)
    resumed_loss = engine(input_ids=ids, labels=ids).loss.item()
    return {
        "losses": losses, "resumed_loss": resumed_loss, "path": path, "client_state": client_state,
        "rank": engine.global_rank, "world": engine.world_size, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "micro_steps": engine.micro_steps,
        "train_batch_size": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
        "accumulation": engine.gradient_accumulation_steps(), "lr": engine.get_lr(),
        "scheduler_lr": scheduler.get_last_lr(), "optimizer_lr": [g["lr"] for g in optimizer.param_groups],
    }


if __name__ == "__main__":
    print(main(sys.argv[1]))
