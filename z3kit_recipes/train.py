"""Train a small character-level GPT with the stock ZeRO-3 recipe.

    python -m z3kit_recipes.train [--nproc 2] [--steps N] [--model-size tiny|small|medium]
        [--width W --layers L --heads H --seq-len T] [--batch-size B] [--lr LR]
        [--config ds_or_z3kit.json] [--dtype fp32|bf16] [--seed S] [--out DIR]
        [--plot] [--profile] [--sample-chars N] [--prompt TEXT] [--temperature T] [--corpus-chars N]

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
scaled to the model, the way Hugging Face's DeepSpeed integration fills
``"auto"`` (see :func:`auto_sizes`): DeepSpeed's absolute defaults (100k
persistence threshold, 1e9 reuse distance) would keep every parameter of a
model this small gathered all the time, and there would be no sharding to
watch. ``--config`` takes either a DeepSpeed JSON (it has a
``zero_optimization`` section; read by ``Zero3Config.from_deepspeed``, with
``"auto"`` size knobs filled the same way) or a z3kit JSON (``Zero3Config``
keyword arguments; ``{}`` is DeepSpeed's defaults).

Rank 0 shows a progress bar (loss, steps/s, tokens/s) and at the end prints
a summary (loss at the start and end, per-rank resident memory against the
whole model, live gathered parameters against ``max_live_parameters``,
collectives per step, the share of step time spent waiting on
communication, trace invalidations) and a text sample from the trained
model. The output folder gets ``summary.json`` (the same figures as data)
and ``loss_history.csv``; ``--plot`` adds ``loss.png`` and
``live_params.png`` (live gathered parameters over one training step,
module by module, with fetches, prefetches and releases marked);
``--profile`` adds ``trace_rank{r}.json`` per rank, a torch.profiler trace
of a few steps that opens in Perfetto or chrome://tracing, with the
engine's labelled ranges (``z3kit.fetch <module>``, ``z3kit.release
<module>``, ``z3kit.prefetch``, ``z3kit.reduce_bucket``).

tqdm and matplotlib come with the ``cli`` extra (``pip install 'z3kit[cli]'``).
"""

from __future__ import annotations

import os
import sys

from z3kit_recipes.launch import PYCACHE_DIR, free_port, use_bytecode_cache

if __name__ in ("__main__", "__mp_main__"):  # run as the command (or a rank it spawned): before torch's import
    use_bytecode_cache()

import argparse  # noqa: E402
import contextlib
import csv
import faulthandler
import hashlib
import importlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from z3kit.device import DeviceInfo, resolve_device
from z3kit_recipes import zero3
from z3kit_recipes.models import GPT, GPTConfig
from z3kit_recipes.zero3.config import Zero3Config
from z3kit_recipes.zero3.params import TimelineEvent

JSON = dict[str, Any]

# torch leaves spawn untyped; bind it once with the type used here.
_spawn: Callable[..., Any] = getattr(mp, "spawn")

#: (width, layers, heads, seq_len) of each ``--model-size``
MODEL_SIZES: Final[dict[str, tuple[int, int, int, int]]] = {
    "tiny": (32, 2, 2, 32),
    "small": (96, 4, 4, 64),
    "medium": (256, 6, 8, 128),
}
DEFAULT_MODEL_SIZE: Final = "small"
DEFAULT_STEPS: Final = 400
DEFAULT_BATCH_SIZE: Final = 16
DEFAULT_LR: Final = 3e-3
DEFAULT_CORPUS_CHARS: Final = 2_000_000
DEFAULT_SAMPLE_CHARS: Final = 300
DEFAULT_PROMPT: Final = "    def __init__(self"
DEFAULT_TEMPERATURE: Final = 0.7
#: steps averaged for the loss at the start and at the end
LOSS_WINDOW: Final = 10
#: steps recorded by --profile
PROFILE_STEPS: Final = 3
CLI_EXTRA_HINT: Final = "install the cli extra: pip install 'z3kit[cli]'"

#: directories of the standard library left out of the corpus: installed
#: packages (they differ between machines) and test suites (odd encodings,
#: generated data)
_SKIPPED_DIRS: Final = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


# --------------------------------------------------------------------------- #
# Corpus and vocabulary
# --------------------------------------------------------------------------- #


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(os.path.dirname(os.__file__))


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root``, sorted by relative path."""
    base = stdlib_root() if root is None else root
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        rel = os.path.relpath(dirpath, base)
        for name in filenames:
            if name.endswith(".py"):
                found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return [base / p for p in sorted(found)]


@attrs.frozen
class Corpus:
    """Training text and where it came from."""

    text: str
    root: str
    files: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load_corpus(max_chars: int = DEFAULT_CORPUS_CHARS, root: Path | None = None) -> Corpus:
    """The first ``max_chars`` characters of the standard library's source.

    Files are read whole in sorted order (``corpus_files``) and joined with a
    blank line; files that are not valid UTF-8 are skipped; the text is
    cut at ``max_chars``. The same Python installation gives the same text
    on every call and every machine.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be > 0, got {max_chars}")
    base = stdlib_root() if root is None else root
    pieces: list[str] = []
    total = used = 0
    for path in corpus_files(base):
        if total >= max_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        pieces.append(text if text.endswith("\n") else text + "\n")
        pieces.append("\n")
        total += len(pieces[-2]) + 1
        used += 1
    if not pieces:
        raise RuntimeError(f"no readable .py files under {base}: there is no corpus to train on")
    return Corpus(text="".join(pieces)[:max_chars], root=str(base), files=used)


@attrs.frozen
class CharVocab:
    """Characters of a text, sorted by code point; a token is an index into them."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        if not text:
            raise ValueError("cannot build a vocabulary from empty text")
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``; every character must be in the vocabulary."""
        if not text:
            return torch.empty(0, dtype=torch.int64)
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).to(torch.int64)
        table = torch.tensor([ord(c) for c in self.chars], dtype=torch.int64)
        ids = torch.searchsorted(table, codes).clamp_(max=len(self.chars) - 1)
        unknown = table[ids] != codes
        if bool(unknown.any()):
            first = chr(int(codes[unknown][0]))
            raise ValueError(f"character {first!r} is not in the vocabulary")
        return ids

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.chars[i] for i in values)


def _batch_seed(seed: int, rank: int, step: int) -> int:
    mixed = 0x7A3C
    for part in (seed, rank, step):
        mixed = (mixed * 1_000_003 + part) % (2**63 - 1)
    return mixed


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, *, seed: int, rank: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``data``: inputs and next-character
    targets, ``(batch_size, seq_len)`` int64 each, seeded by ``(seed, rank, step)``."""
    if data.numel() < seq_len + 2:
        raise ValueError(f"the corpus ({data.numel()} tokens) is shorter than one sequence ({seq_len + 1})")
    gen = torch.Generator().manual_seed(_batch_seed(seed, rank, step))
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size, 1), generator=gen)
    windows = data[starts + torch.arange(seq_len + 1)].to(torch.int64)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


def block_numel(width: int) -> int:
    """Elements of one transformer block of ``width`` (see ``models.Block``)."""
    return 12 * width * width + 13 * width


def auto_sizes(model_config: GPTConfig) -> dict[str, int]:
    """Size knobs scaled to the model (``Zero3Config`` field names).

    As Hugging Face's DeepSpeed integration fills ``"auto"``: parameters
    under ``10 * width`` elements (LayerNorms, biases) persist. Then, in
    units of one transformer block ``B``: a prefetch gathers up to ``B``;
    gradients are reduced in buckets of ``B``; a parameter whose next use
    comes within ``B`` fetched elements is kept at module exit; and at
    most ``2 B`` elements are live at once (a running module's own fetch
    is never refused).
    """
    block = block_numel(model_config.width)
    return {
        "param_persistence_threshold": 10 * model_config.width,
        "prefetch_bucket_size": block,
        "reduce_bucket_size": block,
        "max_reuse_distance": block,
        "max_live_parameters": 2 * block,
    }


#: DeepSpeed zero_optimization keys that "auto" fills, and the Zero3Config field each sets
_DS_AUTO_KEYS: Final = {
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "reduce_bucket_size": "reduce_bucket_size",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_max_live_parameters": "max_live_parameters",
}


def config_from_dict(raw: Mapping[str, Any], auto: Mapping[str, int] | None = None) -> Zero3Config:
    """A ``Zero3Config`` from a DeepSpeed config (a dict with
    ``zero_optimization``) or from ``Zero3Config`` keyword arguments.

    In a DeepSpeed config, ``"auto"`` size knobs take their value from
    ``auto`` (see :func:`auto_sizes`) when it is given. Unknown keys of
    either kind are refused by name (``ValueError``).
    """
    if not isinstance(raw, Mapping):
        raise TypeError(f"a config is a JSON object, got {type(raw).__name__}")
    if "zero_optimization" in raw:
        section = raw["zero_optimization"]
        if auto is not None and isinstance(section, Mapping):
            filled = {
                key: auto[_DS_AUTO_KEYS[key]] if key in _DS_AUTO_KEYS and value == "auto" else value
                for key, value in section.items()
            }
            raw = {**raw, "zero_optimization": filled}
        return Zero3Config.from_deepspeed(raw)
    known = [f.name for f in attrs.fields(Zero3Config)]
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise ValueError(
            f"unknown z3kit config keys: {', '.join(map(repr, unknown))}; known: {', '.join(known)} "
            "(a DeepSpeed config needs a zero_optimization section)"
        )
    return Zero3Config(**raw)


def load_config(path: str | os.PathLike[str] | None, model_config: GPTConfig, dtype: str | None = None) -> Zero3Config:
    """The run's ``Zero3Config``: from ``path`` (see :func:`config_from_dict`),
    or the stock config with :func:`auto_sizes` when ``path`` is None;
    ``dtype`` (``"fp32"``/``"bf16"``), when given, overrides its compute dtype."""
    auto = auto_sizes(model_config)
    if path is None:
        knobs: dict[str, Any] = dict(auto)
        config = Zero3Config(**knobs)
    else:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        config = config_from_dict(raw, auto)
    if dtype is not None:
        config = attrs.evolve(config, compute_dtype=dtype)
    return config


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def _int_at_least(low: int) -> Callable[[str], int]:
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
    return p


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    width, layers, heads, seq_len = MODEL_SIZES[args.model_size]
    return GPTConfig(
        vocab_size=vocab_size,
        width=args.width or width,
        n_layer=args.layers or layers,
        n_head=args.heads or heads,
        seq_len=args.seq_len or seq_len,
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
    return args


# --------------------------------------------------------------------------- #
# The run, as sent to every rank
# --------------------------------------------------------------------------- #


@attrs.frozen
class RunSpec:
    """Everything a rank needs; plain data, picklable for spawn."""

    model: GPTConfig
    config: Zero3Config
    config_source: str
    steps: int
    batch_size: int
    lr: float
    seed: int
    out: str | None
    plot: bool
    profile: bool
    sample_chars: int
    prompt: str
    temperature: float
    corpus_chars: int
    corpus_digest: str
    #: loopback port of the spawned gloo group (None under torchrun)
    port: int | None = None
    threads: int = 1
    argv: tuple[str, ...] = ()



def _torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) when launched by torchrun, else None."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(k in os.environ for k in keys):
        return None
    try:
        rank, world, local = (int(os.environ[k]) for k in keys)
    except ValueError:
        raise ValueError(f"torchrun environment is malformed: {[os.environ[k] for k in keys]}") from None
    return rank, world, local


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _default_out() -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path("runs") / stamp
    n = 1
    while out.exists():
        n += 1
        out = Path("runs") / f"{stamp}-{n}"
    return out


def _optional(name: str, what: str) -> ModuleType:
    """Import an optional dependency of the ``cli`` extra, or say how to get it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise RuntimeError(f"{what} needs {name.split('.')[0]}, which is not installed; {CLI_EXTRA_HINT}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # the optional dependencies, before any process starts
        _optional("tqdm", "the progress bar")
        if args.plot:
            _optional("matplotlib", "--plot")
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
    launched = _torchrun_env()
    out = None if args.out is None and launched is not None else str(args.out or _default_out())
    spec = RunSpec(
        model=model_config,
        config=config,
        config_source=str(args.config) if args.config is not None else "auto (stock config, sizes scaled to the model)",
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        out=out,
        plot=args.plot,
        profile=args.profile,
        sample_chars=args.sample_chars,
        prompt=args.prompt,
        temperature=args.temperature,
        corpus_chars=args.corpus_chars,
        corpus_digest=corpus.digest,
        argv=tuple(sys.argv[1:] if argv is None else argv),
    )
    if launched is not None:
        rank, world, local_rank = launched
        run_rank(spec, rank, world, resolve_device(local_rank), spawned=False)
        return 0
    spec = attrs.evolve(spec, port=free_port(), threads=max(1, _cpu_count() // args.nproc))
    # the ranks read torch's bytecode from the cache before they run any code of ours
    rank_env = {"OMP_NUM_THREADS": str(spec.threads), "PYTHONPYCACHEPREFIX": sys.pycache_prefix or PYCACHE_DIR}
    try:
        with _environment(rank_env):
            _spawn(_spawned_rank, args=(spec, args.nproc), nprocs=args.nproc, join=True)
    except ProcessRaisedException as exc:
        print(f"error: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    except ProcessExitedException as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Environment variables set for the block (spawned processes inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _spawned_rank(rank: int, spec: RunSpec, world: int) -> None:
    faulthandler.enable()  # a rank that dies on a signal says where
    use_bytecode_cache()
    run_rank(spec, rank, world, resolve_device(prefer="cpu"), spawned=True)


# --------------------------------------------------------------------------- #
# One rank
# --------------------------------------------------------------------------- #


def _init_group(spec: RunSpec, rank: int, world: int, info: DeviceInfo, spawned: bool) -> None:
    if info.is_accelerator:
        torch.get_device_module(info.type).set_device(info.device)
    timeout = timedelta(seconds=600)
    if spawned:
        dist.init_process_group(
            info.backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank, world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(info.backend, timeout=timeout)


def _check_same_corpus(corpus: Corpus, spec: RunSpec, device: torch.device) -> None:
    """Every rank must train on rank 0's corpus (the parent's, when spawned)."""
    mine = torch.tensor(list(bytes.fromhex(corpus.digest)[:8]), dtype=torch.int64, device=device)
    ref = mine.clone()
    dist.broadcast(ref, 0)
    expected = spec.corpus_digest == corpus.digest
    if not (bool(torch.equal(mine, ref)) and expected):
        raise RuntimeError(
            f"rank {dist.get_rank()} read a different corpus from {corpus.root} than rank 0 "
            "(different Python installations?); run every rank with the same Python"
        )


def _lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps (at most 20), then cosine
    decay to a tenth of ``peak``."""
    warmup = min(20, max(1, steps // 20))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@attrs.define
class _Tally:
    """Per-step engine figures, accumulated on each rank."""

    wait_s: float = 0.0
    step_s: float = 0.0
    counted: int = 0
    peak_live: int = 0
    step_times: list[float] = attrs.field(factory=list)


def run_rank(spec: RunSpec, rank: int, world: int, info: DeviceInfo, *, spawned: bool) -> None:
    started = time.perf_counter()
    if spawned:
        torch.set_num_threads(spec.threads)
    _init_group(spec, rank, world, info, spawned)
    try:
        _train(spec, rank, world, info, started)
        # tear down together: a rank that leaves while rank 0 still writes the
        # summary has been seen to abort in gloo's teardown under load
        dist.barrier()
    finally:
        dist.destroy_process_group()


@attrs.define
class _Steps:
    """What the training loop leaves behind on a rank."""

    losses: list[float]
    lrs: list[float]
    tally: _Tally
    train_s: float
    profile_window: tuple[int, int]


def _train_steps(
    engine: zero3.Zero3Engine, data: torch.Tensor, spec: RunSpec, rank: int, world: int, out: Path
) -> _Steps:
    """The training loop: ``spec.steps`` optimizer steps of
    ``gradient_accumulation_steps`` micro-batches each, with the progress
    bar (rank 0), the timeline capture before the last step and ``--profile``."""
    device = engine.device
    gas = spec.config.gradient_accumulation_steps
    tokens_per_step = spec.batch_size * spec.model.seq_len * gas * world
    tqdm_module = _optional("tqdm", "the progress bar")
    bar: Any = tqdm_module.tqdm(
        total=spec.steps, unit="step", disable=rank != 0, dynamic_ncols=True, mininterval=0.5, file=sys.stderr
    )
    # profiled: the forward and backward of steps [profile_at, profile_end) (see _profile_window)
    profile_at, profile_end = _profile_window(spec.steps) if spec.profile else (-1, -1)
    capture_at = spec.steps - 2  # capture_timeline() before this step() records the next step
    profiler: torch.profiler.profile | None = None
    losses: list[float] = []
    lrs: list[float] = []
    tally = _Tally()
    train_start = time.perf_counter()
    ema: float | None = None
    try:
        for step in range(spec.steps):
            t0 = time.perf_counter()
            step_lr = _lr_at(step, spec.steps, spec.lr)
            for group in engine.optimizer.param_groups:
                group["lr"] = step_lr
            total = 0.0
            for micro in range(gas):
                x, y = sample_batch(
                    data, spec.batch_size, spec.model.seq_len, seed=spec.seed, rank=rank, step=step * gas + micro
                )
                logits = engine(x.to(device, non_blocking=True))
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1))
                engine.backward(loss)
                total += float(loss.detach())
            if step == capture_at:
                engine.capture_timeline()
            if step + 1 == profile_at:
                profiler = _start_profiler(device)
            elif profiler is not None and step + 1 == profile_end:
                _stop_profiler(profiler, out / f"trace_rank{rank}.json")
                profiler = None
            engine.step()
            losses.append(total / gas)
            lrs.append(step_lr)
            stats = engine.stats()
            tally.peak_live = max(tally.peak_live, stats.peak_live_numel)
            profiled = profile_at <= step < profile_end
            if step > 0 and not profiled:  # the first step records the trace; profiled steps are slower
                tally.wait_s += stats.comm_wait_s
                tally.step_s += stats.step_time_s
                tally.counted += 1
                tally.step_times.append(time.perf_counter() - t0)  # of the engine's part and ours
            ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
            elapsed = time.perf_counter() - train_start
            bar.set_postfix_str(f"loss {ema:.3f}, {tokens_per_step * (step + 1) / elapsed:,.0f} tok/s", refresh=False)
            bar.update(1)
    finally:
        if profiler is not None:
            profiler.stop()
        bar.close()
    return _Steps(losses, lrs, tally, time.perf_counter() - train_start, (profile_at, profile_end))


def _out_dir(spec: RunSpec, rank: int, device: torch.device) -> Path:
    """The output folder, rank 0's choice on every rank."""
    chosen: list[Any] = [spec.out if spec.out is not None else (str(_default_out()) if rank == 0 else None)]
    if spec.out is None:
        dist.broadcast_object_list(chosen, 0, device=device)
    out = Path(chosen[0])
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return out


def _train(spec: RunSpec, rank: int, world: int, info: DeviceInfo, started: float) -> None:
    device = info.device
    out = _out_dir(spec, rank, device)
    corpus = load_corpus(spec.corpus_chars)
    _check_same_corpus(corpus, spec, device)
    vocab = CharVocab.from_text(corpus.text)
    data = vocab.encode(corpus.text).to(torch.uint8 if len(vocab) <= 256 else torch.int32)
    if len(vocab) != spec.model.vocab_size:
        raise RuntimeError(f"vocabulary has {len(vocab)} characters, the model {spec.model.vocab_size}")

    torch.manual_seed(spec.seed)
    model = GPT(spec.model)
    lr = spec.lr
    engine = zero3.initialize(
        model, lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95)), spec.config
    )
    stats0 = engine.stats()
    gas = spec.config.gradient_accumulation_steps
    tokens_per_step = spec.batch_size * spec.model.seq_len * gas * world

    if rank == 0:
        _print_header(spec, corpus, vocab, stats0.model_numel, world, info, out)

    run = _train_steps(engine, data, spec, rank, world, out)
    losses, lrs, tally, train_s = run.losses, run.lrs, run.tally, run.train_s
    profile_at, profile_end = run.profile_window
    final = engine.stats()

    # every rank's losses and memory, gathered once at the end
    loss_table = _gather_rows(torch.tensor(losses, dtype=torch.float32, device=device), world)
    state_numel, state_bytes = _optimizer_state_size(engine.optimizer)
    grad_itemsize = 4  # gradient partitions accumulate in fp32
    memory_row = torch.tensor(
        [
            final.resident_param_numel,
            final.resident_master_numel,
            final.resident_grad_numel,
            final.resident_param_numel * spec.config.torch_dtype.itemsize
            + final.resident_master_numel * 4
            + final.resident_grad_numel * grad_itemsize,
            state_numel,
            state_bytes,
            tally.peak_live,
        ],
        dtype=torch.int64,  # exact counts
        device=device,
    )
    memory_table = _gather_rows(memory_row, world)
    # what one rank would hold unsharded: the parameters, fp32 masters (when separate) and gradients
    masters = 0 if engine.masters_are_shards else 1
    replica = (
        final.model_numel * (2 + masters),
        final.model_numel * (spec.config.torch_dtype.itemsize + 4 * masters + grad_itemsize),
    )

    # a sample from the trained model: full weights on every rank (collective), generated on rank 0
    sample = ""
    sample_s = 0.0
    if spec.sample_chars > 0:
        t_sample = time.perf_counter()
        state = engine.full_state_dict()
        if rank == 0:
            sample = _generate(spec, vocab, state)
        sample_s = time.perf_counter() - t_sample

    if rank != 0:
        return
    files: list[str] = []
    history_path = out / "loss_history.csv"
    _write_history(history_path, loss_table, lrs)
    files.append(history_path.name)
    timeline = list(engine.timeline)
    if spec.plot:
        files += _plot(out, loss_table, timeline, final.max_live_parameters, final.model_numel)
    profile_info: JSON | None = None
    if spec.profile:
        traces = sorted(out.glob("trace_rank*.json"))
        files += [t.name for t in traces]
        profile_info = {
            "steps": list(range(profile_at, profile_end)),
            "files": [t.name for t in traces],
            "labels_rank0": _trace_labels(out / "trace_rank0.json"),
        }
    summary = _summary(
        spec,
        corpus=corpus,
        vocab_size=len(vocab),
        world=world,
        info=info,
        final=final,
        loss_table=loss_table,
        memory_table=memory_table,
        replica=replica,
        tally=tally,
        train_s=train_s,
        total_s=time.perf_counter() - started,
        tokens_per_step=tokens_per_step,
        sample=sample,
        sample_s=sample_s,
        timeline=timeline,
        profile=profile_info,
        files=files + ["summary.json"],
        out=out,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(render_summary(summary), flush=True)


def _gather_rows(row: torch.Tensor, world: int) -> list[list[float]]:
    """Every rank's ``row`` (same length on all ranks), by rank."""
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    return [[float(v) for v in r.cpu().tolist()] for r in rows]


def _optimizer_state_size(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    numel = nbytes = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                numel += value.numel()
                nbytes += value.numel() * value.element_size()
    return numel, nbytes


def _generate(spec: RunSpec, vocab: CharVocab, state: Mapping[str, torch.Tensor]) -> str:
    """Sample from a plain (unsharded) copy of the trained model.

    Note: why not generate inside ``engine.gathered_parameters()``.
        The engine's module hooks stay attached inside that block: each
        module's forward releases its parameters again on exit, and the next
        call gathers them with a collective. Generating on rank 0 alone
        there deadlocks; generating on every rank works but costs one
        all-gather per module and character. ``full_state_dict()`` (one
        collective on every rank) and a plain copy on rank 0 cost neither.
    """
    model = GPT(spec.model)
    result = model.load_state_dict(state, strict=False)
    loaded = {id(p) for name, p in model.named_parameters() if name in state}
    own = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in result.missing_keys if k not in own or id(own[k]) not in loaded]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"full_state_dict does not fit the model: missing {missing}, unexpected {result.unexpected_keys}")
    prompt = vocab.encode(spec.prompt)[None, :]
    gen = torch.Generator().manual_seed(spec.seed)
    ids = model.generate(prompt, spec.sample_chars, temperature=spec.temperature, generator=gen)
    return vocab.decode(ids[0])


def _profile_window(steps: int) -> tuple[int, int]:
    """Steps ``[first, end)`` whose forward and backward ``--profile`` records:
    ``PROFILE_STEPS`` steps near the end, after the first (which records the
    engine's trace), or none when there are too few steps.

    Note: where the profiler starts and stops.
        The profiler starts and stops between a backward and the optimizer
        step, where the engine has no collective in flight (``step()``
        issues the asynchronous re-gather of persistent parameters, which
        the next forward waits on). A trace therefore runs from the optimizer
        step before ``first`` to the backward of ``end - 1``.
    """
    first = max(1, steps - PROFILE_STEPS - 1)
    end = min(steps, first + PROFILE_STEPS)
    return (first, end) if first < end else (-1, -1)


def _start_profiler(device: torch.device) -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def _stop_profiler(profiler: Any, path: Path) -> None:
    profiler.stop()
    profiler.export_chrome_trace(str(path))


#: label prefixes of the engine's profiler ranges
TRACE_LABELS: Final = ("z3kit.fetch", "z3kit.release", "z3kit.prefetch", "z3kit.reduce_bucket")


def _trace_labels(path: Path) -> dict[str, int]:
    """How many ranges of each engine label a chrome trace holds."""
    if not path.is_file():
        return {}
    events = json.loads(path.read_text(encoding="utf-8")).get("traceEvents", [])
    counts = dict.fromkeys(TRACE_LABELS, 0)
    for event in events:
        name = event.get("name", "") if isinstance(event, dict) else ""
        for label in TRACE_LABELS:
            if isinstance(name, str) and name.startswith(label + " "):
                counts[label] += 1
    return counts


def _write_history(path: Path, loss_table: list[list[float]], lrs: list[float]) -> None:
    world = len(loss_table)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "lr", "loss_mean", *(f"loss_rank{r}" for r in range(world))])
        for step, lr in enumerate(lrs):
            per_rank = [loss_table[r][step] for r in range(world)]
            writer.writerow([step, f"{lr:.6g}", f"{sum(per_rank) / world:.6f}", *(f"{v:.6f}" for v in per_rank)])


# --------------------------------------------------------------------------- #
# Summary
# --------------------------------------------------------------------------- #


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _summary(
    spec: RunSpec,
    *,
    corpus: Corpus,
    vocab_size: int,
    world: int,
    info: DeviceInfo,
    final: zero3.Zero3Stats,
    loss_table: list[list[float]],
    memory_table: list[list[float]],
    replica: tuple[int, int],
    tally: _Tally,
    train_s: float,
    total_s: float,
    tokens_per_step: int,
    sample: str,
    sample_s: float,
    timeline: list[TimelineEvent],
    profile: JSON | None,
    files: list[str],
    out: Path,
) -> JSON:
    steps = len(loss_table[0])
    mean_loss = [_mean([loss_table[r][s] for r in range(world)]) for s in range(steps)]
    window = min(LOSS_WINDOW, steps)
    model_numel = final.model_numel
    per_rank = []
    for r, row in enumerate(memory_table):
        p, m, g, nbytes, s_numel, s_bytes, peak = row
        per_rank.append(
            {
                "rank": r,
                "param_shard_numel": int(p),
                "master_numel": int(m),
                "grad_partition_numel": int(g),
                "resident_numel": int(p + m + g),
                "resident_bytes": int(nbytes),
                "optimizer_state_numel": int(s_numel),
                "optimizer_state_bytes": int(s_bytes),
                "peak_live_numel": int(peak),
            }
        )
    coll = {kind: dict(v) for kind, v in sorted(final.collectives.items()) if v.get("calls", 0) > 0}
    fetches = [e for e in timeline if e.kind == "fetch" and e.numel > 0]
    return {
        "command": "python -m z3kit_recipes.train " + " ".join(spec.argv),
        "out": str(out),
        "world": world,
        "backend": info.backend,
        "device": str(info.device),
        "threads_per_rank": torch.get_num_threads(),
        "corpus": {
            "root": corpus.root,
            "files": corpus.files,
            "chars": len(corpus.text),
            "vocab_size": vocab_size,
            "sha256": corpus.digest,
        },
        "model": {**attrs.asdict(spec.model), "numel": model_numel},
        "config_source": spec.config_source,
        "config": attrs.asdict(spec.config),
        "training": {
            "steps": steps,
            "batch_size_per_rank": spec.batch_size,
            "gradient_accumulation_steps": spec.config.gradient_accumulation_steps,
            "tokens_per_step": tokens_per_step,
            "lr": spec.lr,
            "seed": spec.seed,
            "train_s": train_s,
            "total_s": total_s,
            "steps_per_s": steps / train_s,
            "median_step_s": statistics.median(tally.step_times) if tally.step_times else None,
            "tokens_per_s": steps * tokens_per_step / train_s,
        },
        "loss": {
            "window": window,
            "start": _mean(mean_loss[:window]),
            "end": _mean(mean_loss[-window:]),
            "first": mean_loss[0],
            "last": mean_loss[-1],
        },
        "memory": {
            "model_numel": model_numel,
            "model_bytes_fp32": model_numel * 4,
            "replica_numel": replica[0],
            "replica_bytes": replica[1],
            "per_rank": per_rank,
            "resident_share_of_replica": per_rank[0]["resident_numel"] / replica[0],
        },
        "live": {
            "peak_live_numel": max(r["peak_live_numel"] for r in per_rank),
            "max_live_parameters": final.max_live_parameters,
            "largest_fetch_numel": final.largest_fetch_numel,
            "model_numel": model_numel,
        },
        "collectives_per_step": coll,
        "collective_calls_per_step": sum(v["calls"] for v in coll.values()),
        "collective_bytes_per_step": sum(v.get("bytes", 0) for v in coll.values()),
        "comm_wait": {
            "share": tally.wait_s / tally.step_s if tally.step_s > 0 else 0.0,
            "wait_s": tally.wait_s,
            "step_s": tally.step_s,
            "steps_counted": tally.counted,
            "rank": 0,
        },
        "trace": {"state": final.trace_state, "invalidations": final.trace_invalidations},
        "timeline": {
            "step": steps - 1 if timeline else None,
            "events": len(timeline),
            "demand_gathers": len(fetches),
            "prefetches": sum(1 for e in timeline if e.kind == "prefetch"),
            "releases": sum(1 for e in timeline if e.kind == "release" and e.numel > 0),
            "peak_live_numel": max((e.live_numel for e in timeline), default=0),
        },
        "sample": {
            "prompt": spec.prompt,
            "chars": spec.sample_chars,
            "temperature": spec.temperature,
            "text": sample,
            "seconds": sample_s,
        },
        "profile": profile,
        "files": files,
    }


def _fmt_bytes(n: float) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} kB"
    return f"{int(n)} B"


def render_summary(s: JSON) -> str:
    """The summary as text (what rank 0 prints)."""
    t, lo, mem, live, cw = s["training"], s["loss"], s["memory"], s["live"], s["comm_wait"]
    m = s["model"]
    lines = [
        "",
        f"z3kit zero3: {s['world']} ranks ({s['backend']}, {s['device']}), GPT {m['n_layer']} layers x {m['width']} "
        f"wide ({m['numel']:,} parameters), {t['steps']} steps in {t['train_s']:.1f} s "
        f"({t['steps_per_s']:.2f} steps/s, {t['tokens_per_s']:,.0f} tokens/s); {t['total_s']:.1f} s in all",
        f"loss            {lo['start']:.3f} -> {lo['end']:.3f}  (mean of the first / last {lo['window']} steps, "
        "averaged over ranks)",
        "resident memory per rank (parameter shards + fp32 masters + gradient partitions; AdamW state apart):",
    ]
    for r in mem["per_rank"]:
        lines.append(
            f"  rank {r['rank']:<3}      {r['param_shard_numel']:,} + {r['master_numel']:,} + {r['grad_partition_numel']:,}"
            f" = {r['resident_numel']:,} elements ({_fmt_bytes(r['resident_bytes'])}); "
            f"optimizer state {r['optimizer_state_numel']:,} ({_fmt_bytes(r['optimizer_state_bytes'])})"
        )
    lines.append(
        f"  unsharded     {mem['replica_numel']:,} elements ({_fmt_bytes(mem['replica_bytes'])}) per rank for the "
        f"whole model ({mem['model_numel']:,} parameters); rank 0 holds {mem['resident_share_of_replica']:.1%} of that"
    )
    limit = live["max_live_parameters"]
    lines.append(
        f"live gathered   peak {live['peak_live_numel']:,} elements against max_live_parameters {limit:,} "
        f"(largest single fetch {live['largest_fetch_numel']:,}; whole model {live['model_numel']:,})"
    )
    coll = s["collectives_per_step"]
    parts = [f"{kind} {v['calls']} x ({_fmt_bytes(v.get('bytes', 0))})" for kind, v in coll.items()]
    lines.append(
        f"collectives     {s['collective_calls_per_step']} per step, {_fmt_bytes(s['collective_bytes_per_step'])}: "
        + ", ".join(parts)
    )
    lines.append(
        f"comm wait       {cw['share']:.1%} of step time on rank 0 ({cw['wait_s']:.2f} of {cw['step_s']:.2f} s "
        f"over {cw['steps_counted']} steps)"
    )
    lines.append(f"trace           {s['trace']['state']}, {s['trace']['invalidations']} invalidation(s)")
    if s["profile"] is not None and not s["profile"]["steps"]:
        lines.append("profile         none: too few steps (the first one records the engine's trace)")
    elif s["profile"] is not None:
        labels = ", ".join(f"{k} {v}" for k, v in s["profile"]["labels_rank0"].items())
        steps = s["profile"]["steps"]
        lines.append(f"profile         steps {steps[0]}-{steps[-1]}: {labels} ranges in rank 0's trace")
    if s["sample"]["text"]:
        lines += ["sample:", "-" * 60, s["sample"]["text"], "-" * 60]
    lines.append(f"written to {s['out']}: {', '.join(s['files'])}")
    return "\n".join(lines)


def _print_header(
    spec: RunSpec, corpus: Corpus, vocab: CharVocab, model_numel: int, world: int, info: DeviceInfo, out: Path
) -> None:
    m, c = spec.model, spec.config
    print(
        f"corpus: {len(corpus.text):,} characters of {corpus.files} standard-library files under {corpus.root}, "
        f"{len(vocab)} distinct characters\n"
        f"model: GPT {m.n_layer} layers, width {m.width}, {m.n_head} heads, seq {m.seq_len}: {model_numel:,} parameters\n"
        f"run: {world} ranks ({info.backend} on {info.device.type}), {spec.steps} steps of "
        f"{spec.batch_size} x {m.seq_len} tokens per rank, AdamW lr {spec.lr:g}, {c.compute_dtype}\n"
        f"zero3 config ({spec.config_source}): persistence < {c.param_persistence_threshold:,}, "
        f"prefetch {c.prefetch_bucket_size:,}, reduce bucket {c.reduce_bucket_size:,}, "
        f"reuse distance {c.max_reuse_distance:,}, max live {c.max_live_parameters:,}\n"
        f"output: {out}",
        flush=True,
    )


# --------------------------------------------------------------------------- #
# Pictures
# --------------------------------------------------------------------------- #


def _plot(
    out: Path, loss_table: list[list[float]], timeline: list[TimelineEvent], max_live: int, model_numel: int
) -> list[str]:
    matplotlib = _optional("matplotlib", "--plot")
    matplotlib.use("Agg")
    plt = _optional("matplotlib.pyplot", "--plot")
    written = []

    world, steps = len(loss_table), len(loss_table[0])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = list(range(steps))
    for r in range(world):
        ax.plot(xs, loss_table[r], lw=0.6, alpha=0.35, label=f"rank {r}" if world <= 8 else None)
    mean = [_mean([loss_table[r][s] for r in range(world)]) for s in xs]
    k = max(1, min(LOSS_WINDOW, steps // 10))
    smooth = [_mean(mean[max(0, i - k + 1) : i + 1]) for i in xs]
    ax.plot(xs, smooth, lw=2.0, color="black", label=f"mean over ranks, {k}-step average")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    written.append("loss.png")

    if timeline:
        fig, ax = plt.subplots(figsize=(max(10.0, min(30.0, len(timeline) * 0.12)), 5.5))
        idx = list(range(len(timeline)))
        live = [e.live_numel for e in timeline]
        ax.step(idx, live, where="post", color="0.3", lw=1.2, label="live gathered elements")
        styles = {"fetch": ("tab:blue", "o"), "prefetch": ("tab:green", "^"), "release": ("tab:red", "v")}
        for kind, (color, marker) in styles.items():
            pts = [(i, e.live_numel) for i, e in zip(idx, timeline) if e.kind == kind and (e.numel > 0 or kind == "fetch")]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, s=22, zorder=3,
                           label=kind)
        for i, e in zip(idx, timeline):
            if e.kind == "prefetch":
                ax.axvline(i, color="tab:green", alpha=0.25, lw=0.8)
        roots = [i for i, e in zip(idx, timeline) if e.kind == "fetch" and e.module == "<root>"]
        on_top = ax.get_xaxis_transform()  # x in data, y in axes fraction
        if roots:
            ax.text(roots[0], 0.98, "forward", transform=on_top, va="top", fontsize=9, style="italic")
        if len(roots) >= 2:
            ax.axvline(roots[1] - 0.5, color="black", ls=":", lw=1.0)
            ax.text(roots[1], 0.98, "backward", transform=on_top, va="top", fontsize=9, style="italic")
        top = max(live, default=0)
        if 0 < max_live <= 2 * max(top, 1):
            ax.axhline(max_live, color="tab:orange", ls="--", lw=1.0, label=f"max_live_parameters {max_live:,}")
        if model_numel <= 2 * max(top, 1):
            ax.axhline(model_numel, color="tab:purple", ls="-.", lw=1.0, label=f"whole model {model_numel:,}")
        fetch_ticks = [(i, e.module) for i, e in zip(idx, timeline) if e.kind == "fetch"]
        stride = max(1, math.ceil(len(fetch_ticks) / 80))
        ticks = fetch_ticks[::stride]
        ax.set_xticks([t[0] for t in ticks])
        ax.set_xticklabels([t[1] for t in ticks], rotation=90, fontsize=6)
        ax.set_xlabel("event of one training step (ticks: module fetched)")
        ax.set_ylabel("gathered parameter elements")
        ax.set_title("live gathered parameters over one training step (rank 0)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0))
        ax.set_ylim(0, max(top, max_live if 0 < max_live <= 2 * max(top, 1) else 0) * 1.12 + 1)
        fig.tight_layout()
        fig.savefig(out / "live_params.png", dpi=120)
        plt.close(fig)
        written.append("live_params.png")
    return written


if __name__ == "__main__":
    # Run through the importable module so that the spawned ranks unpickle
    # ``z3kit_recipes.train._spawned_rank`` rather than this ``__main__`` copy.
    from z3kit_recipes import train as _train_module

    raise SystemExit(_train_module.main())
