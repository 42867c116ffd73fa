"""Train a small character-level GPT with the stock ZeRO-3 recipe.

    python -m z3kit_recipes.train [--nproc 2] [--steps N] [--model-size tiny|small|medium]
        [--width W --layers L --heads H --seq-len T] [--batch-size B] [--lr LR]
        [--config ds_or_z3kit.json] [--dtype fp32|bf16] [--seed S] [--out DIR]
        [--plot] [--profile] [--sample-chars N] [--prompt TEXT] [--temperature T] [--corpus-chars N]
        [--save-every N [--keep-last N]] [--resume CHECKPOINT_OR_RUN | --init-from WEIGHTS] [--export WEIGHTS]

    torchrun --nproc-per-node 8 -m z3kit_recipes.train [same options]

The corpus is one that every machine has without a download: the Python
standard library's own ``.py`` files (under ``os.path.dirname(os.__file__)``,
read in sorted order up to ``--corpus-chars`` characters, test suites and
installed packages left out). The vocabulary is its set of characters.
Every rank reads the same corpus (checked by digest) and samples its own
batches, seeded by ``(seed, rank, step)``.

Launch: under ``torchrun`` (``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` set)
each process drives the device that ``z3kit.device.resolve_device`` picks
(CUDA GPU with nccl, Ascend NPU with hccl, else CPU with gloo), one process
per device. Otherwise the command spawns ``--nproc`` local CPU processes
that talk over gloo on a free loopback port.

Training goes through ``z3kit_recipes.zero3.initialize`` with the stock
policies and AdamW on the fp32 master shards (linear warm-up, cosine decay
to a tenth of ``--lr``). Without ``--config`` the runtime's size knobs are
scaled to the model (``"auto"``, see :mod:`z3kit_recipes.zero3.config.auto`);
``--config`` takes a DeepSpeed JSON or a z3kit JSON (see
:mod:`z3kit_recipes.train.config`): Hugging Face's documented ZeRO-3 JSON
runs unedited, its ``"auto"`` values filled from the job's options, its
numbers, optimizer and scheduler in place of the job's defaults, and a
number that contradicts an option given refused before anything starts
(:mod:`z3kit_recipes.train.job_values`).

Rank 0 shows a progress bar (loss, steps/s, tokens/s) and at the end prints
a summary: loss at the start and end; per rank, the engine's memory by kind
(parameter shards, gathered parameters, gradient buckets and partitions,
fp32 masters, optimizer state) after the last step and at its peak over
that step, against what one unsharded replica would hold, with the
process's peak resident set (and the device allocator's peak on an
accelerator); the memory plan when ``memory_budget`` is set; live gathered
parameters against ``max_live_parameters``; collectives per step; the share
of step time spent waiting on communication; trace invalidations; and a
text sample from the trained model. The output folder gets
``summary.json`` (the same figures as data) and ``loss_history.csv``;
``--plot`` adds ``loss.png`` and ``live_params.png`` (live gathered
parameters over one training step, module by module, with fetches,
prefetches and releases marked); ``--profile`` adds ``trace_rank{r}.json``
per rank, a torch.profiler trace of a few steps that opens in Perfetto or
chrome://tracing, with the engine's labelled ranges (``z3kit.fetch
<module>``, ``z3kit.release <module>``, ``z3kit.prefetch``,
``z3kit.reduce_bucket``).

Checkpoints (see :mod:`z3kit_recipes.train.checkpointing`): ``--save-every
N`` saves the sharded training state to ``<out>/checkpoint-<step>`` every
N optimizer steps and at the end (``--keep-last N``: only the newest N it
saved stay); ``--resume`` continues such a run (a checkpoint, or a run
folder: its latest; saved
at any number of ranks) up to ``--steps`` in all, refusing, before any
process starts, a run whose options differ from the saved one's, and at
the same world size its losses equal an uninterrupted run's bit for bit;
``--export`` writes the trained weights as a Hugging Face GPT-2 folder that
``AutoModelForCausalLM.from_pretrained`` loads (:mod:`~z3kit_recipes.train.hf_export`),
with the vocabulary as its tokenizer (``pipeline("text-generation")`` loads
the folder and writes text; :mod:`~z3kit_recipes.train.tokenizer`),
and ``--init-from`` starts a new run from such weights.

Ctrl-C (:mod:`~z3kit_recipes.train.interrupt`), on every rank or on one,
stops the ranks together at the end of a step: the command exits with
status 130 after one line naming the last checkpoint and the command that
resumes from it, and a run folder it created and left empty is removed
(:mod:`~z3kit_recipes.train.run_folder`).

tqdm and matplotlib come with the ``cli`` extra (``pip install 'z3kit[cli]'``).

Modules, in the order a run meets them: ``defaults`` (the job's defaults),
``options`` (the options; neither imports anything heavy), ``cli``
(``main``), ``config`` (model sizes, ``Zero3Config``), ``job_values``
(the options and a ``--config`` JSON settled), ``corpus`` (text, vocabulary,
batches), ``spec`` (``RunSpec``, what every rank gets), ``launch`` (spawn or
torchrun, the process group), ``job`` (one rank, corpus to summary),
``loop`` (the training steps), ``checkpointing`` (``--save-every``,
``--resume``, ``--init-from``, ``--export``; ``hf_export``: the GPT-2
layout of the last two), ``profile`` (``--profile``), ``sample`` (text
from the trained model), ``memory`` and ``report`` (the summary as records),
``render`` (as text), ``plots`` (``--plot``), ``outputs`` (the folder,
``loss_history.csv``), ``extras`` (the ``cli`` extra's imports),
``tokenizer`` (the vocabulary as a Hugging Face tokenizer, for ``--export``),
``run_folder`` (its checkpoints: the latest, the rotation), ``interrupt``
(Ctrl-C).

The names below are imported when first used (``__getattr__``): importing
the package, as ``python -m z3kit_recipes.train`` does before it parses
the options, imports nothing heavy.
"""

import importlib
import sys
from typing import TYPE_CHECKING, Any

from z3kit_recipes.launch import use_bytecode_cache

# ``python -m z3kit_recipes.train`` imports this package (with sys.argv[0]
# "-m" while it locates the command) before it runs ``__main__``: cache
# bytecode before anything brings in torch (see use_bytecode_cache).
# Spawned ranks get the cache through PYTHONPYCACHEPREFIX instead.
if sys.argv[:1] == ["-m"]:
    use_bytecode_cache()

#: each public name and the module that defines it
_HOMES = {
    "DEFAULT_LR": "defaults", "DEFAULT_PROMPT": "defaults", "DEFAULT_STEPS": "defaults",
    "MODEL_SIZES": "defaults", "PROFILE_STEPS": "defaults",
    "build_parser": "options", "parse_args": "options", "main": "cli", "model_config_from_args": "cli",
    "config_from_dict": "config", "gpt_config": "config", "load_config": "config",
    "CharVocab": "corpus", "Corpus": "corpus", "corpus_files": "corpus", "load_corpus": "corpus",
    "sample_batch": "corpus", "stdlib_root": "corpus",
    "lr_at": "loop", "profile_window": "profile", "render_summary": "render", "Summary": "report",
    "RunSpec": "spec",
}  # fmt: skip

if TYPE_CHECKING:
    from z3kit_recipes.train.cli import main, model_config_from_args
    from z3kit_recipes.train.config import config_from_dict, gpt_config, load_config
    from z3kit_recipes.train.corpus import CharVocab, Corpus, corpus_files, load_corpus, sample_batch, stdlib_root
    from z3kit_recipes.train.defaults import DEFAULT_LR, DEFAULT_PROMPT, DEFAULT_STEPS, MODEL_SIZES, PROFILE_STEPS
    from z3kit_recipes.train.loop import lr_at
    from z3kit_recipes.train.options import build_parser, parse_args
    from z3kit_recipes.train.profile import profile_window
    from z3kit_recipes.train.render import render_summary
    from z3kit_recipes.train.report import Summary
    from z3kit_recipes.train.spec import RunSpec


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "DEFAULT_LR",
    "DEFAULT_PROMPT",
    "DEFAULT_STEPS",
    "MODEL_SIZES",
    "PROFILE_STEPS",
    "CharVocab",
    "Corpus",
    "RunSpec",
    "Summary",
    "build_parser",
    "config_from_dict",
    "corpus_files",
    "gpt_config",
    "load_config",
    "load_corpus",
    "lr_at",
    "main",
    "model_config_from_args",
    "parse_args",
    "profile_window",
    "render_summary",
    "sample_batch",
    "stdlib_root",
]
