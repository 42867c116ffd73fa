"""An engine over 4 pool ranks laid out as torchrun lays out 2 nodes of 2 (hpZ, HSDP "node")."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.dist_pool import WorkerContext, fresh_group
from tests.zero3_models import WORKLOADS


def two_node_engine(ctx: WorkerContext, workload: str, config: dict[str, Any], lr: float) -> Any:
    """``workload``'s model under ``zero3.initialize`` with torchrun's ``LOCAL_WORLD_SIZE=2``
    (read at initialize: traffic by link, "node"), restored afterwards; AdamW at ``lr``."""
    from z3kit_recipes import zero3

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        torch.manual_seed(0)
        return zero3.initialize(WORKLOADS[workload].build(), lambda p: torch.optim.AdamW(p, lr=lr),
                                zero3.Zero3Config(**config), fresh_group(ctx))
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
