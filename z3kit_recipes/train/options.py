"""The command line's options and their checks.

Imports nothing heavy: ``--help`` and a bad option answer at once, before
``main`` imports torch (which takes seconds). The options that a DeepSpeed
JSON can also set (:data:`JSON_SETTABLE`) default to None in the parser, so
that ``parse_args`` knows which ones the user gave (``args.given``) before
it fills in the job's defaults: a value the user did not give yields to the
JSON's (``train.job_values``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from z3kit_recipes.train.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_CORPUS_CHARS,
    DEFAULT_LR,
    DEFAULT_MODEL_SIZE,
    DEFAULT_PROMPT,
    DEFAULT_SAMPLE_CHARS,
    DEFAULT_STEPS,
    DEFAULT_TEMPERATURE,
    MODEL_SIZES,
    PROFILE_STEPS,
)

#: options a DeepSpeed JSON can also set, and the job's default for each (None: the JSON's or the config's)
JSON_SETTABLE: Final[dict[str, float | int | str | None]] = {
    "steps": DEFAULT_STEPS, "batch_size": DEFAULT_BATCH_SIZE, "lr": DEFAULT_LR, "dtype": None,
}  # fmt: skip


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _finite_float(*, positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite float, > 0 (``positive``) or >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if positive else '>='} 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m z3kit_recipes.train",
        description="Train a character-level GPT on the Python standard library's source with z3kit ZeRO-3.",
    )
    p.add_argument("--nproc", type=_int_at_least(1), default=2,
                   help="local CPU processes to spawn (gloo); ignored under torchrun (default 2)")
    p.add_argument("--steps", type=_int_at_least(1),
                   help=f"optimizer steps (default {DEFAULT_STEPS}, or --config's scheduler total_num_steps)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default=DEFAULT_MODEL_SIZE,
                   help="preset of width/layers/heads/seq-len: "
                   + ", ".join(f"{k} {w}x{l}x{h} seq {t}" for k, (w, l, h, t) in MODEL_SIZES.items())
                   + f" (default {DEFAULT_MODEL_SIZE})")
    p.add_argument("--width", type=_int_at_least(1), help="model width (overrides the preset)")
    p.add_argument("--layers", type=_int_at_least(1), help="transformer blocks (overrides the preset)")
    p.add_argument("--heads", type=_int_at_least(1), help="attention heads (overrides the preset)")
    p.add_argument("--seq-len", type=_int_at_least(1), help="sequence length (overrides the preset)")
    p.add_argument("--batch-size", type=_int_at_least(1),
                   help=f"sequences per rank and micro-step (default {DEFAULT_BATCH_SIZE}, or --config's "
                   "train_micro_batch_size_per_gpu)")
    p.add_argument("--lr", type=_finite_float(positive=True),
                   help=f"peak AdamW learning rate (default {DEFAULT_LR}, or --config's optimizer lr)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="adamw (default), or muon: torch.optim.Muon's update (z3kit.sharded_muon) on the blocks' "
                   "matrices at --lr with match_rms_adamw scaling, AdamW on the embeddings, norms and biases "
                   "(not with --config's optimizer section)")
    p.add_argument("--config", type=Path,
                   help="DeepSpeed JSON (with zero_optimization) or z3kit JSON (Zero3Config fields); its \"auto\" "
                   "values are the job's, its numbers replace the job's defaults, and one that contradicts an "
                   "option given is an error; default: the stock config with sizes scaled to the model")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="compute dtype (default: the config's, fp32)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="model and data seed (default 0)")
    p.add_argument("--out", type=Path, help="output folder (default ./runs/<timestamp>)")
    p.add_argument("--plot", action="store_true", help="write loss.png and live_params.png")
    p.add_argument("--profile", action="store_true",
                   help=f"write trace_rank<r>.json: a torch.profiler trace of {PROFILE_STEPS} steps per rank")
    p.add_argument("--sample-chars", type=_int_at_least(0), default=DEFAULT_SAMPLE_CHARS,
                   help=f"characters to sample from the trained model (0: none; default {DEFAULT_SAMPLE_CHARS})")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"start of the sample (default {DEFAULT_PROMPT!r})")
    p.add_argument("--temperature", type=_finite_float(positive=False), default=DEFAULT_TEMPERATURE,
                   help=f"sampling temperature (0: always the likeliest character; default {DEFAULT_TEMPERATURE})")
    p.add_argument("--corpus-chars", type=_int_at_least(1000), default=DEFAULT_CORPUS_CHARS,
                   help=f"characters of standard-library source to train on (default {DEFAULT_CORPUS_CHARS:,})")
    p.add_argument("--save-every", type=_int_at_least(1), metavar="N",
                   help="save a checkpoint (sharded training state) to OUT/checkpoint-<step> every N optimizer "
                   "steps and at the end")
    p.add_argument("--keep-last", type=_int_at_least(1), metavar="N",
                   help="with --save-every, keep only the newest N of the checkpoints this run saves (older ones "
                   "that it saved are deleted as new ones are written)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", type=Path, metavar="PATH",
                       help="continue the run saved at checkpoint PATH (saved at any number of ranks) up to "
                       "--steps in all, or, when PATH is a run folder, from its latest checkpoint-* in it; the "
                       "run's options (model, corpus, seed, batch size, lr) must match it")
    start.add_argument("--init-from", type=Path, metavar="PATH",
                       help="start from the weights of PATH, a Hugging Face-layout safetensors folder "
                       "(what --export writes)")
    p.add_argument("--export", type=Path, metavar="PATH",
                   help="at the end, write the trained weights and the character vocabulary to the folder PATH as "
                   "a Hugging Face GPT-2 model and tokenizer (transformers.pipeline('text-generation', model=PATH) "
                   "loads it)")
    return p  # fmt: skip


def model_dims(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(width, layers, heads, seq_len): the ``--model-size`` preset with the dimensions given overriding it."""
    preset = MODEL_SIZES[args.model_size]
    given = (args.width, args.layers, args.heads, args.seq_len)
    width, layers, heads, seq_len = (g or p for g, p in zip(given, preset))
    return width, layers, heads, seq_len


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the options (exits with status 2 on bad values).

    ``args.given`` names the options of :data:`JSON_SETTABLE` that the user
    gave; the others hold the job's defaults."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = frozenset(name for name in JSON_SETTABLE if getattr(args, name) is not None)
    for name, default in JSON_SETTABLE.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    width, _, heads, _ = model_dims(args)
    if width % heads != 0:  # GPTConfig's rule, checked here without importing the model
        parser.error(f"width ({width}) must be divisible by n_head ({heads})")
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    if args.prompt == "":
        parser.error("--prompt must not be empty")
    if args.keep_last is not None and args.save_every is None:
        parser.error(f"--keep-last {args.keep_last} rotates the checkpoints that --save-every N saves: "
                     "give --save-every too")
    for option, path in (("--resume", args.resume), ("--init-from", args.init_from)):
        if path is not None and not path.is_dir():
            parser.error(f"{option} {path}: no such folder")
    if args.export is not None and args.export.exists():
        # imported only here: reading a manifest's kind brings in the weights package (and torch)
        from z3kit_recipes.zero3.weights.target import EXPORT_KIND, manifest_kind

        if manifest_kind(args.export) != EXPORT_KIND:
            parser.error(f"--export {args.export}: exists and is not an earlier --export; refusing to replace it")
    return args
