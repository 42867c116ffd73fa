"""The command line: options, their checks, and ``main``, which settles the
run (``RunSpec``) before any process starts and hands it to ``launch``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from torch.distributed.checkpoint.api import CheckpointException

from z3kit_recipes.models import GPTConfig
from z3kit_recipes.train.checkpointing import EXPORT_KIND, check_resumable, read_client_state, vocab_digest
from z3kit_recipes.train.config import DEFAULT_MODEL_SIZE, MODEL_SIZES, gpt_config, load_config
from z3kit_recipes.train.corpus import DEFAULT_CORPUS_CHARS, CharVocab, load_corpus
from z3kit_recipes.train.extras import optional_module
from z3kit_recipes.train.launch import run_under_torchrun, spawn_ranks, torchrun_env
from z3kit_recipes.train.outputs import default_out
from z3kit_recipes.train.profile import PROFILE_STEPS
from z3kit_recipes.train.spec import RunSpec
from z3kit_recipes.zero3.weights.commit import MANIFEST

DEFAULT_STEPS: Final = 400
DEFAULT_BATCH_SIZE: Final = 16
DEFAULT_LR: Final = 3e-3
DEFAULT_SAMPLE_CHARS: Final = 300
DEFAULT_PROMPT: Final = "    def __init__(self"
DEFAULT_TEMPERATURE: Final = 0.7
AUTO_CONFIG_SOURCE: Final = "auto (stock config, sizes scaled to the model)"


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
    p.add_argument("--steps", type=_int_at_least(1), default=DEFAULT_STEPS,
                   help=f"optimizer steps (default {DEFAULT_STEPS})")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default=DEFAULT_MODEL_SIZE,
                   help="preset of width/layers/heads/seq-len: "
                   + ", ".join(f"{k} {w}x{l}x{h} seq {t}" for k, (w, l, h, t) in MODEL_SIZES.items())
                   + f" (default {DEFAULT_MODEL_SIZE})")
    p.add_argument("--width", type=_int_at_least(1), help="model width (overrides the preset)")
    p.add_argument("--layers", type=_int_at_least(1), help="transformer blocks (overrides the preset)")
    p.add_argument("--heads", type=_int_at_least(1), help="attention heads (overrides the preset)")
    p.add_argument("--seq-len", type=_int_at_least(1), help="sequence length (overrides the preset)")
    p.add_argument("--batch-size", type=_int_at_least(1), default=DEFAULT_BATCH_SIZE,
                   help=f"sequences per rank and micro-step (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--lr", type=_finite_float(positive=True), default=DEFAULT_LR, help=f"peak AdamW learning rate (default {DEFAULT_LR})")
    p.add_argument("--config", type=Path,
                   help="DeepSpeed JSON (with zero_optimization) or z3kit JSON (Zero3Config fields); "
                   "default: the stock config with sizes scaled to the model")
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
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", type=Path, metavar="PATH",
                       help="continue the run saved at checkpoint PATH (saved at any number of ranks) up to "
                       "--steps in all; the run's options (model, corpus, seed, batch size, lr) must match it")
    start.add_argument("--init-from", type=Path, metavar="PATH",
                       help="start from the weights of PATH, a Hugging Face-layout safetensors folder "
                       "(what --export writes)")
    p.add_argument("--export", type=Path, metavar="PATH",
                   help="at the end, write the trained weights to the folder PATH as a Hugging Face GPT-2 model "
                   "(transformers.AutoModelForCausalLM.from_pretrained(PATH) loads it)")
    return p  # fmt: skip


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    return gpt_config(
        args.model_size, vocab_size, width=args.width, layers=args.layers, heads=args.heads, seq_len=args.seq_len
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the options (exits with status 2 on bad values)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model_config_from_args(args, vocab_size=1)
    except ValueError as exc:
        parser.error(str(exc))
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    if args.prompt == "":
        parser.error("--prompt must not be empty")
    for option, path in (("--resume", args.resume), ("--init-from", args.init_from)):
        if path is not None and not path.is_dir():
            parser.error(f"{option} {path}: no such folder")
    if args.export is not None and args.export.exists() and _manifest_kind(args.export) != EXPORT_KIND:
        parser.error(f"--export {args.export}: exists and is not an earlier --export; refusing to replace it")
    return args


def _manifest_kind(path: Path) -> str | None:
    """The kind of z3kit folder ``path`` is (its manifest's ``kind``), or None."""
    try:
        kind = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 when every rank finished, 2 on bad options or a bad
    config (before any process starts), 1 when a rank failed."""
    args = parse_args(argv)
    try:  # the optional dependencies, before any process starts
        optional_module("tqdm", "the progress bar")
        if args.plot:
            optional_module("matplotlib", "--plot")
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    corpus = load_corpus(args.corpus_chars)
    vocab = CharVocab.from_text(corpus.text)
    model_config = model_config_from_args(args, len(vocab))
    try:
        config = load_config(args.config, model_config, args.dtype)
    except (ValueError, TypeError) as exc:
        print(f"error: --config {args.config}: {exc}", file=sys.stderr)
        return 2
    launched = torchrun_env()
    spec = RunSpec(
        model=model_config,
        config=config,
        config_source=str(args.config) if args.config is not None else AUTO_CONFIG_SOURCE,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        # under torchrun every process runs this: without --out, rank 0 picks the folder for all
        out=None if args.out is None and launched is not None else str(args.out or default_out()),
        plot=args.plot,
        profile=args.profile,
        sample_chars=args.sample_chars,
        prompt=args.prompt,
        temperature=args.temperature,
        corpus_chars=args.corpus_chars,
        corpus_digest=corpus.digest,
        argv=tuple(sys.argv[1:] if argv is None else argv),
        model_size=args.model_size,
        save_every=args.save_every,
        resume=None if args.resume is None else str(args.resume),
        init_from=None if args.init_from is None else str(args.init_from),
        export=None if args.export is None else str(args.export),
    )
    if spec.resume is not None:  # before any process starts: the saved run's options must match
        try:
            check_resumable(spec.resume, read_client_state(spec.resume), spec, vocab_digest(vocab))
        except (ValueError, OSError, CheckpointException) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if launched is not None:
        run_under_torchrun(spec, *launched)
        return 0
    return spawn_ranks(spec, args.nproc)
