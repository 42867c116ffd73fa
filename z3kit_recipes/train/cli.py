"""``main``: the options parsed (``options``, which imports nothing heavy),
then the run settled (``RunSpec``) before any process starts and handed to
``launch``. Everything that brings in torch is imported after parsing, so
``--help`` and a bad option answer at once."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import attrs

from z3kit_recipes.train.defaults import DEFAULT_LR, DEFAULT_PROMPT, DEFAULT_STEPS
from z3kit_recipes.train.extras import optional_module
from z3kit_recipes.train.options import build_parser, model_dims, parse_args

if TYPE_CHECKING:
    import argparse

    from z3kit_recipes.models import GPTConfig

__all__ = ["DEFAULT_LR", "DEFAULT_PROMPT", "DEFAULT_STEPS", "build_parser", "main", "model_config_from_args",
           "parse_args"]

AUTO_CONFIG_SOURCE: Final = "auto (stock config, sizes scaled to the model)"


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    from z3kit_recipes.models import GPTConfig

    width, layers, heads, seq_len = model_dims(args)
    return GPTConfig(vocab_size=vocab_size, width=width, n_layer=layers, n_head=heads, seq_len=seq_len)


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 when every rank finished, 2 on bad options or a bad
    config (before any process starts), 1 when a rank failed, 130 when
    Ctrl-C stopped it (with one line that says where to resume from)."""
    args = parse_args(argv)
    try:
        return _run(args, argv)
    except KeyboardInterrupt:  # before the ranks started: they answer Ctrl-C themselves
        from z3kit_recipes.train.interrupt import INTERRUPTED

        if os.environ.get("RANK", "0") == "0":
            print("interrupted: stopped before training began, nothing to resume", file=sys.stderr)
        return INTERRUPTED


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    try:  # the optional dependencies, before any process starts
        optional_module("tqdm", "the progress bar")
        if args.plot:
            optional_module("matplotlib", "--plot")
        if args.export is not None:
            optional_module("transformers", "--export (it saves the vocabulary as a Hugging Face tokenizer)")
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # after parsing: each of these imports torch
    from torch.distributed.checkpoint.api import CheckpointException

    from z3kit_recipes.train.checkpointing import check_resumable, read_client_state, vocab_digest
    from z3kit_recipes.train.corpus import CharVocab, load_corpus
    from z3kit_recipes.train.job_values import settle
    from z3kit_recipes.train.launch import run_under_torchrun, spawn_ranks, torchrun_env
    from z3kit_recipes.train.outputs import default_out
    from z3kit_recipes.train.run_folder import resume_target
    from z3kit_recipes.train.spec import RunSpec

    corpus = load_corpus(args.corpus_chars)
    vocab = CharVocab.from_text(corpus.text)
    model_config = model_config_from_args(args, len(vocab))
    launched = torchrun_env()
    try:
        values = settle(args, model_config, args.nproc if launched is None else launched[1])
    except (ValueError, TypeError) as exc:
        print(f"error: --config {args.config}: {exc}", file=sys.stderr)
        return 2
    if args.optimizer != "adamw" and values.config.optimizer is not None:
        print(f"error: --optimizer {args.optimizer} and --config {args.config}'s optimizer section both name the "
              "optimizer; drop one", file=sys.stderr)
        return 2
    spec = RunSpec(
        model=model_config,
        config=values.config,
        config_source=str(args.config) if args.config is not None else AUTO_CONFIG_SOURCE,
        steps=values.steps,
        batch_size=values.batch_size,
        lr=values.lr,
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
        keep_last=args.keep_last,
        resume=None if args.resume is None else str(args.resume),
        init_from=None if args.init_from is None else str(args.init_from),
        export=None if args.export is None else str(args.export),
        optimizer=args.optimizer,
    )
    if spec.export is not None:  # made here: a missing transformers stops the run before it starts
        from z3kit_recipes.train.tokenizer import tokenizer_files

        spec = attrs.evolve(spec, export_files=tokenizer_files(vocab, model_config.seq_len))
    if args.resume is not None:  # before any process starts: the saved run's options must match
        resume, took = resume_target(args.resume)  # a run folder: its latest checkpoint
        if took is not None and (launched is None or launched[0] == 0):
            print(took, flush=True)
        spec = attrs.evolve(spec, resume=str(resume))
        try:
            check_resumable(str(resume), read_client_state(str(resume)), spec, vocab_digest(vocab))
        except (ValueError, OSError, CheckpointException) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if launched is not None:
        return run_under_torchrun(spec, *launched)
    return spawn_ranks(spec, args.nproc)
