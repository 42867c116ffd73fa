"""fsdp_blocks on one device against plain training of the same model.

    python examples/fsdp_blocks_one_device.py

On a GPU (nccl) it trains the bench's GPT; elsewhere (gloo, CPU) a tiny
one. 8 Adam steps with clipping at 1.0, the engine beside a deep copy
trained plainly: prints the largest relative loss difference, the largest
parameter difference, and the host syncs of each step
(``z3kit.host_sync``); exits 1 if the two runs differ. The README records
its output on an H200.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from z3kit.host_sync import HostSyncCounter
from z3kit_recipes import fsdp_blocks
from z3kit_recipes.launch import free_port
from z3kit_recipes.models import GPTConfig, GPTWorkload

STEPS = 8
CLIP = 1.0


def adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def main() -> bool:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=60),
                            device_id=device if cuda else None)
    tiny = GPTConfig(vocab_size=128, width=32, n_layer=2, n_head=2, seq_len=16)
    wl = GPTWorkload(config=GPTConfig() if cuda else tiny)
    torch.manual_seed(0)
    model = wl.build_model().to(device)
    ref = copy.deepcopy(model)
    engine = fsdp_blocks.initialize(model, adam, blocks=wl.blocks(model), process_group=dist.group.WORLD,
                                    config=fsdp_blocks.BlocksConfig(gradient_clipping=CLIP))
    ref_opt = adam(list(ref.parameters()))
    worst, syncs = 0.0, []
    for step in range(STEPS):
        x, y = (t.to(device) for t in wl.batch(0, step))
        with HostSyncCounter(device) as counter:
            loss = wl.loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        syncs.append(counter.count)
        ref_loss = wl.loss(ref(x), y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    full = engine.full_state_dict()
    param_diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    print(f"fsdp_blocks on {device}: max loss rel diff {worst:.2e}, max param diff {param_diff:.2e} after "
          f"{STEPS} Adam steps; host syncs per step {syncs}")
    ok = worst < 1e-4 and param_diff < 1e-3
    print("fsdp_blocks against plain training:", "PASS" if ok else "FAIL")
    dist.barrier()
    return ok


if __name__ == "__main__":
    os._exit(0 if main() else 1)  # torch 2.13's gloo can abort in destroy_process_group
