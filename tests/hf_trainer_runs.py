"""Several runs of ``examples/hf_trainer.py`` in one ``torchrun`` launch.

    torchrun --standalone --nproc-per-node 2 tests/hf_trainer_runs.py RUNS_JSON [EXAMPLE]

``RUNS_JSON`` is a list of steps, each either the example's own command-line
arguments (one run of its ``train``, as its ``main`` runs it) or
``["copy", SRC, DST, IGNORED...]``: rank 0 copies a finished run's folder
(leaving out the names after DST) for a later ``--resume``. Every run builds
its own model, ``TrainingArguments`` and trainer, seeded as the example
seeds them, so a run gives what it gives when launched alone; the launch
is paid once instead of once per run (each costs two processes importing
torch and transformers: most of a run's time here). ``EXAMPLE``: another
example with the same ``parse`` and ``train`` (``examples/trl_trainers.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"


def main() -> None:
    example_path = Path(sys.argv[2]) if len(sys.argv) > 2 else EXAMPLE
    spec = importlib.util.spec_from_file_location("hf_trainer_example", example_path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for step in json.loads(sys.argv[1]):
        if step[0] == "copy":
            if int(os.environ["RANK"]) == 0:
                shutil.copytree(step[1], step[2], ignore=shutil.ignore_patterns(*step[3:]))
            dist.barrier()
        else:
            example.train(example.parse(step))
    # as the example ends: torch 2.13 with gloo can abort in process-group teardown
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
